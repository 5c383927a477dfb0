// The sampling kernel of decode_kernels.cu under emu.h (run.sh) against an f64 inverse CDF,
// as crates/model/tests/paged_kv.rs checks it on a device.
#include "emu.h"
#include "decode_kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>

// f64 reference: first id with cumulative p > u·Σp (p > 0), margin to the nearest boundary.
static void reference(const std::vector<double>& x, double t, double u, int& pick, double& lp, double& margin) {
  double m = -INFINITY; for (double v : x) m = std::max(m, v / t);
  double z = 0; for (double v : x) z += std::exp(v / t - m);
  double lse = std::log(z) + m;
  std::vector<double> p(x.size()); double total = 0;
  for (size_t i = 0; i < x.size(); i++) { p[i] = std::exp(x[i] / t - lse); total += p[i]; }
  double target = u * total, acc = 0; pick = -1; margin = INFINITY; int last = 0;
  for (size_t i = 0; i < x.size(); i++) {
    acc += p[i];
    if (p[i] > 0) { last = i; margin = std::min(margin, std::abs(acc - target)); if (pick < 0 && acc > target) pick = i; }
  }
  if (pick < 0) pick = last;
  lp = x[pick] / t - lse;
}

template <typename T> T cvt(float x);
template <> float cvt<float>(float x) { return x; }
template <> bf16 cvt<bf16>(float x) { return __float2bfloat16(x); }
double back(float x) { return x; }
double back(bf16 x) { return __bfloat162float(x); }

template <typename T>
int run(int rows, int v, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-6.f, 6.f);
  std::uniform_real_distribution<double> Uu(0.0, 1.0);
  std::vector<T> x(rows * v);
  for (auto& e : x) e = cvt<T>(U(rng));
  for (int i = 0; i < v; i++) if (rows > 1 && i % 7 != 3) x[v + i] = cvt<T>(-INFINITY);
  std::vector<double> u(rows);
  for (auto& e : u) e = Uu(rng);
  u[0] = 0.0; u[rows - 1] = 1.0 - 1e-12;
  int bad = 0, compared = 0;
  for (double t : {1.0, 0.7}) {
    std::vector<uint32_t> tokens(rows);
    std::vector<float> lps(rows);
    float inv_t = (float)(1.0 / t);
    emu_launch(Dim3{(unsigned)rows, 1, 1}, Dim3{256, 1, 1}, 0, [&] {
      if constexpr (sizeof(T) == 4) sample_inverse_cdf_f32(x.data(), u.data(), inv_t, tokens.data(), lps.data(), v);
      else sample_inverse_cdf_bf16(x.data(), u.data(), inv_t, tokens.data(), lps.data(), v);
    });
    for (int r = 0; r < rows; r++) {
      std::vector<double> xr(v);
      for (int i = 0; i < v; i++) xr[i] = back(x[r * v + i]);
      int pick; double lp, margin;
      reference(xr, t, u[r], pick, lp, margin);
      double tok_lp = xr[tokens[r]] / t; 
      double m = -INFINITY; for (double e : xr) m = std::max(m, e / t);
      double z = 0; for (double e : xr) z += std::exp(e / t - m);
      tok_lp -= std::log(z) + m;
      bool ok_tok = margin <= 1e-6 || (int)tokens[r] == pick;
      if (margin > 1e-6) compared++;
      bool ok_lp = std::abs(lps[r] - tok_lp) <= 1e-4 && std::isfinite(tok_lp);
      if (!ok_tok || !ok_lp) { bad++; std::printf("  BAD row %d T %.1f: got %u (%f) want %d (%f) margin %g\n", r, t, tokens[r], lps[r], pick, lp, margin); }
    }
  }
  std::printf("sampler %s rows %d V %d: %d bad, %d compared\n", sizeof(T) == 4 ? "f32" : "bf16", rows, v, bad, compared);
  return bad;
}

// Arguments: --quick skips the two full-vocabulary (151,936 ids) cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(48, 384, 1);
  bad += run<bf16>(48, 384, 2);
  bad += run<float>(9, 1000, 3);
  if (!quick) {
    bad += run<float>(3, 151936, 4);
    bad += run<bf16>(3, 151936, 5);
  }
  bad += run<float>(2, 100, 6);  // fewer ids than threads: empty segments
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
