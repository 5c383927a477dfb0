// The decode's fused residual add + RMSNorm of kernels.cu (add_rms_norm_fwd) under emu.h
// (run.sh) against an f64 reference, as crates/model/tests/ops.rs checks it on a device.
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>



template <typename T>
int run(int rows, int d, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-3.f, 3.f);
  std::vector<T> x(rows * d), delta(rows * d), w(d), out(2 * rows * d);
  for (auto& e : x) e = cvt<T>(U(rng));
  for (auto& e : delta) e = cvt<T>(U(rng));
  for (auto& e : w) e = cvt<T>(1.f + U(rng) / 6.f);
  const float eps = 1e-6f;
  emu_launch(Dim3{(unsigned)rows, 1, 1}, Dim3{row_threads(d), 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4) add_rms_norm_fwd_f32(x.data(), delta.data(), w.data(), out.data(), rows, d, eps);
    else add_rms_norm_fwd_bf16(x.data(), delta.data(), w.data(), out.data(), rows, d, eps);
  });
  // f32: exact sums, the norm within f32 rounding; bf16: each result rounded to 8 bits.
  const bool f32 = sizeof(T) == 4;
  const double tol = f32 ? 2e-5 : 1.6e-2;
  double worst = 0;
  for (int r = 0; r < rows; r++) {
    double ss = 0;
    std::vector<double> s(d);
    for (int i = 0; i < d; i++) {
      s[i] = back(x[r * d + i]) + back(delta[r * d + i]);
      ss += s[i] * s[i];
    }
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int i = 0; i < d; i++) {
      const double got_s = back(out[r * d + i]), got_y = back(out[rows * d + r * d + i]);
      const double want_y = s[i] * inv * back(w[i]);
      worst = worst_of({worst, std::abs(got_s - s[i]) / std::max(1.0, std::abs(s[i])),
                        std::abs(got_y - want_y) / std::max(1.0, std::abs(want_y))});
    }
  }
  const bool ok = worst <= tol;
  std::printf("%s rows %d d %d: worst rel %.2e %s\n", f32 ? "f32 " : "bf16", rows, d, worst, ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(4, 37, 1);   // fewer columns than a warp's multiple
  bad += run<bf16>(3, 64, 2);
  bad += run<float>(2, 896, 3);  // Qwen2.5-0.5B's hidden size
  if (!quick) {
    bad += run<bf16>(5, 3584, 4);  // Qwen2.5-7B's
    bad += run<float>(2, 5000, 5); // 512 threads per row
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
