// The RMSNorm backward of kernels.cu (rms_norm_bwd: ∂x and per-block ∂w sums in one pass, a
// warp a row; rms_norm_bwd_dw_sum: the blocks' sums in block order) under emu.h (run.sh),
// launched as crates/model/src/ops/cuda.rs's rms_norm_bwd launches them, against an f64
// reference; `misaligned` starts every buffer one element past 16 bytes (the scalar path).
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

template <typename T>
int run(int rows, int d, bool misaligned, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-2.f, 2.f);
  const int off = misaligned ? 1 : 0;
  std::vector<T> xb(rows * d + off), gb(rows * d + off), wb(d + off), dxb(rows * d + off), dwb(d + off);
  T *x = xb.data() + off, *g = gb.data() + off, *w = wb.data() + off, *dx = dxb.data() + off, *dw = dwb.data() + off;
  for (int i = 0; i < rows * d; i++) x[i] = cvt<T>(U(rng)), g[i] = cvt<T>(U(rng));
  for (int i = 0; i < d; i++) w[i] = cvt<T>(1.f + U(rng) / 4.f);
  const float eps = 1e-6f;
  // The launcher's shape.
  const int max_d = 12 * 1024;
  const int warps = std::clamp(max_d / d, 1, 8);
  long blocks = ((long)rows * d + 4096L * warps - 1) / (4096L * warps);
  blocks = std::min(std::clamp(blocks, 1L, 1024L), std::max(1L, (long)(rows + warps - 1) / warps));
  std::vector<float> partial(blocks * d, NAN);
  emu_launch(Dim3{(unsigned)blocks, 1, 1}, Dim3{32u * warps, 1, 1}, (size_t)warps * d * 4, [&] {
    if constexpr (sizeof(T) == 4) rms_norm_bwd_f32(x, w, g, dx, partial.data(), rows, d, eps);
    else rms_norm_bwd_bf16(x, w, g, dx, partial.data(), rows, d, eps);
  });
  emu_launch(Dim3{(unsigned)((d + 31) / 32), 1, 1}, Dim3{256, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4) rms_norm_bwd_dw_sum_f32(partial.data(), dw, (int)blocks, d);
    else rms_norm_bwd_dw_sum_bf16(partial.data(), dw, (int)blocks, d);
  });
  const bool f32 = sizeof(T) == 4;
  double worst_dx = 0, worst_dw = 0;
  std::vector<double> want_dw(d, 0.0), scale_dw(d, 0.0);
  for (int r = 0; r < rows; r++) {
    double ss = 0, gx = 0;
    for (int i = 0; i < d; i++) {
      const double xv = back(x[r * d + i]), gv = back(g[r * d + i]);
      ss += xv * xv;
      gx += gv * back(w[i]) * xv;
    }
    const double rr = 1.0 / std::sqrt(ss / d + eps), c = rr * rr * rr * gx / d;
    for (int i = 0; i < d; i++) {
      const double xv = back(x[r * d + i]), gv = back(g[r * d + i]);
      const double want = rr * gv * back(w[i]) - xv * c;
      worst_dx = worst_of(worst_dx, std::abs(back(dx[r * d + i]) - want) / std::max(1.0, std::abs(want)));
      want_dw[i] += gv * xv * rr;
      scale_dw[i] += std::abs(gv * xv * rr);
    }
  }
  for (int i = 0; i < d; i++)
    worst_dw = worst_of(worst_dw, std::abs(back(dw[i]) - want_dw[i]) / std::max(1.0, f32 ? scale_dw[i] : std::abs(want_dw[i])));
  const double tol = f32 ? 1e-5 : 1e-2;
  const bool ok = worst_dx <= tol && worst_dw <= tol;
  std::printf("%s rows %d d %d%s (%ld blocks of %d warps): worst dx %.2e dw %.2e %s\n", f32 ? "f32 " : "bf16", rows, d,
              misaligned ? " misaligned" : "", blocks, warps, worst_dx, worst_dw, ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(20, 37, false, 1);   // odd width: the scalar path
  bad += run<bf16>(40, 64, false, 2);    // 8 lanes of 16 bytes a row
  bad += run<bf16>(9, 64, true, 3);      // misaligned: the scalar path
  bad += run<float>(6, 896, false, 4);   // Qwen2.5-0.5B's hidden size, 16-byte chunks
  if (!quick) {
    bad += run<bf16>(700, 128, false, 5);  // Qwen3's q/k norms: 24 warps, ~29 rows each
    bad += run<bf16>(5, 3584, false, 6);   // Qwen2.5-7B's: three warps a block
    bad += run<float>(3, 12288, true, 7);  // the widest row the launcher takes, one warp
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
