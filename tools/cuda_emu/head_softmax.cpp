// The LM head's softmax kernels of kernels.cu (head_row_stats, head_logits_grad) under emu.h
// (run.sh) against an f64 reference, as crates/model/tests/ops_head.rs checks them on a device.
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>



template <typename T>
int run(int rows, int v, int w, double t, bool spike, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-6.f, 6.f);
  std::vector<T> z(rows * v);
  for (auto& e : z) e = cvt<T>(U(rng));
  if (spike) z[v / 3] = cvt<T>(900.f);
  std::vector<uint32_t> ids(rows * w);
  for (int r = 0; r < rows; r++)
    for (int k = 0; k < w; k++) ids[r * w + k] = (k == w - 1 && w >= 2) ? ids[r * w] : rng() % v;
  std::vector<float> grad(rows * (w + 1));
  for (auto& e : grad) e = U(rng) / 6.f;
  const float inv_t = (float)(1.0 / t);
  std::vector<float> stats(rows * 2);
  std::vector<T> dz(rows * v);
  const Dim3 grid{(unsigned)rows, 1, 1}, block{row_threads(v), 1, 1};
  emu_launch(grid, block, 0, [&] {
    if constexpr (sizeof(T) == 4) head_row_stats_f32(z.data(), stats.data(), rows, v, inv_t);
    else head_row_stats_bf16(z.data(), stats.data(), rows, v, inv_t);
  });
  emu_launch(grid, block, 0, [&] {
    if constexpr (sizeof(T) == 4)
      head_logits_grad_f32(z.data(), stats.data(), ids.data(), grad.data(), dz.data(), rows, v, w, inv_t);
    else head_logits_grad_bf16(z.data(), stats.data(), ids.data(), grad.data(), dz.data(), rows, v, w, inv_t);
  });
  double worst_stat = 0, num = 0, den = 0, worst_abs = 0;
  for (int r = 0; r < rows; r++) {
    std::vector<double> x(v);
    double m = -INFINITY;
    for (int j = 0; j < v; j++) { x[j] = back(z[r * v + j]) / t; m = std::max(m, x[j]); }
    double s = 0, sx = 0;
    for (int j = 0; j < v; j++) { double e = std::exp(x[j] - m); s += e; sx += e * x[j]; }
    const double lse = m + std::log(s), h = lse - sx / s;
    worst_stat = worst_of({worst_stat, std::abs(stats[2 * r] - lse), std::abs(stats[2 * r + 1] - h)});
    double gs = 0;
    for (int k = 0; k < w; k++) gs += grad[r * (w + 1) + k];
    const double ge = grad[r * (w + 1) + w];
    std::vector<double> want(v);
    for (int j = 0; j < v; j++) {
      const double lp = x[j] - lse;
      want[j] = -std::exp(lp) * (gs + ge * (lp + h));
    }
    for (int k = 0; k < w; k++) want[ids[r * w + k]] += grad[r * (w + 1) + k];
    for (int j = 0; j < v; j++) {
      const double d = back(dz[r * v + j]) - want[j] / t;
      num += d * d; den += want[j] / t * want[j] / t;
      worst_abs = worst_of(worst_abs, std::abs(d));
    }
  }
  const double rel = std::sqrt(num / std::max(den, 1e-300));
  // f32: the sums over a row in f32 against f64; bf16: ∂z rounded to 8 bits of mantissa.
  const bool f32 = sizeof(T) == 4;
  const bool ok = worst_stat <= 1e-4 && (f32 ? worst_abs <= 1e-5 : rel <= 8e-3);
  std::printf("%s rows %d V %d W %d T %.1f%s: stats %.2e, dz rel %.2e abs %.2e %s\n", f32 ? "f32 " : "bf16", rows, v,
              w, t, spike ? " spike" : "", worst_stat, rel, worst_abs, ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// Arguments: --quick skips the full-vocabulary (151,936 ids) cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(5, 1000, 3, 1.0, false, 1);
  bad += run<bf16>(5, 1000, 3, 1.0, false, 2);
  bad += run<float>(3, 3001, 1, 0.7, false, 3);
  bad += run<float>(4, 100, 0, 1.3, false, 4);  // fewer logits than threads, no ids
  bad += run<bf16>(2, 2048, 9, 1.0, true, 5);   // a dominant logit, a repeated id
  bad += run<bf16>(3, 1003, 2, 1.0, false, 8);  // rows past a 16-byte boundary, a vector's tail
  if (!quick) {
    bad += run<float>(2, 151936, 5, 1.0, false, 6);
    bad += run<bf16>(2, 151936, 5, 0.8, false, 7);
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
