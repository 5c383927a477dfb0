// The sampling kernel of decode_kernels.cu under emu.h (run.sh) against an f64 inverse CDF,
// with no filter, top-k, top-p, min-p and all three, as crates/model/tests/paged_kv.rs checks
// it on a device.
#include "emu.h"
#include "driver.h"
#include "decode_kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>

struct Filter { int top_k; double top_p, min_p; };

// The filters' kept set in f64 from their definitions (top-k keeping ties, top-p over the
// top-k set keeping ties, min-p against the max); `fragile`: how close a value or a mass is
// to deciding otherwise.
static std::vector<bool> kept_set(const std::vector<double>& lp, Filter f, double& fragile) {
  std::vector<double> desc;
  double max = -INFINITY;
  for (double l : lp) if (std::isfinite(l)) { desc.push_back(l); max = std::max(max, l); }
  std::sort(desc.begin(), desc.end(), std::greater<double>());
  fragile = INFINITY;
  auto near = [&](double cut) { for (double l : lp) if (std::isfinite(l) && l != cut) fragile = std::min(fragile, std::abs(l - cut)); };
  double cut = -INFINITY, cut_k = -INFINITY;
  if (f.top_k > 0 && f.top_k < (int)desc.size()) { cut_k = desc[f.top_k - 1]; near(cut_k); cut = cut_k; }
  if (f.top_p < 1.0) {
    double total = 0; for (double l : desc) if (l >= cut_k) total += std::exp(l);
    double target = f.top_p * total, acc = 0, cut_p = max;
    for (double l : desc) {
      if (l < cut_k) break;
      double before = acc; acc += std::exp(l);
      if (acc >= target) { cut_p = l; fragile = std::min(fragile, std::min(acc - target, target - before) * 1e2); break; }
    }
    near(cut_p); cut = std::max(cut, cut_p);
  }
  if (f.min_p > 0) { double c = max + std::log(f.min_p); near(c); cut = std::max(cut, c); }
  std::vector<bool> keep(lp.size());
  for (size_t i = 0; i < lp.size(); i++) keep[i] = lp[i] >= cut;
  return keep;
}

// f64 reference: first kept id with cumulative p > u·Σp_kept (p > 0), margin to the nearest
// boundary (the filters' included).
static void reference(const std::vector<double>& x, double t, double u, Filter f, int& pick, double& lp, double& margin,
                      std::vector<bool>& keep) {
  double m = -INFINITY; for (double v : x) m = std::max(m, v / t);
  double z = 0; for (double v : x) z += std::exp(v / t - m);
  double lse = std::log(z) + m;
  std::vector<double> lps(x.size());
  for (size_t i = 0; i < x.size(); i++) lps[i] = x[i] / t - lse;
  double fragile;
  keep = kept_set(lps, f, fragile);
  std::vector<double> p(x.size()); double total = 0;
  for (size_t i = 0; i < x.size(); i++) { p[i] = keep[i] ? std::exp(lps[i]) : 0.0; total += p[i]; }
  double target = u * total, acc = 0; pick = -1; margin = INFINITY; int last = 0;
  for (size_t i = 0; i < x.size(); i++) {
    acc += p[i];
    if (p[i] > 0) { last = i; margin = std::min(margin, std::abs(acc - target)); if (pick < 0 && acc > target) pick = i; }
  }
  if (pick < 0) pick = last;
  lp = x[pick] / t - lse;
  margin = std::min(margin, fragile);
}


// part_len: ids per part of the part kernels (decode_cuda.rs's SAMPLE_PART is 4,096; smaller
// ones give the small vocabularies several parts, an uneven last one included).
template <typename T>
int run(int rows, int v, unsigned seed, int part_len = 4096) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-6.f, 6.f);
  std::uniform_real_distribution<double> Uu(0.0, 1.0);
  std::vector<T> x(rows * v);
  for (auto& e : x) e = cvt<T>(U(rng));
  for (int i = 0; i < v; i++) if (rows > 1 && i % 7 != 3) x[v + i] = cvt<T>(-INFINITY);
  // Row 2: only ids [v/2, v/2 + 20) possible — whole parts masked, the first and the (uneven)
  // last included, when parts are short.
  for (int i = 0; i < v; i++) if (rows > 3 && (i < v / 2 || i >= v / 2 + 20)) x[2 * v + i] = cvt<T>(-INFINITY);
  std::vector<double> u(rows);
  for (auto& e : u) e = Uu(rng);
  u[0] = 0.0; u[rows - 1] = 1.0 - 1e-12;
  int bad = 0, compared = 0;
  const Filter filters[] = {{0, 1.0, 0.0}, {20, 1.0, 0.0}, {0, 0.9, 0.0}, {0, 1.0, 0.05}, {50, 0.8, 0.02}};
  for (double t : {1.0, 0.7})
  for (Filter f : filters) {
    std::vector<uint32_t> tokens(rows);
    std::vector<float> lps(rows);
    float inv_t = (float)(1.0 / t);
    const int top_k = f.top_k >= v ? 0 : f.top_k;
    if (top_k == 0 && f.top_p >= 1.0) {
      // decode_cuda.rs's three part kernels, parts of `part_len` ids.
      const int parts = (v + part_len - 1) / part_len;
      std::vector<float> pm(rows * parts, NAN), ps(rows * parts, NAN);
      std::vector<double> mass(rows * parts, NAN);
      const float min_p = (float)f.min_p;
      emu_launch(Dim3{(unsigned)parts, (unsigned)rows, 1}, Dim3{SP_THREADS, 1, 1}, 0, [&] {
        if constexpr (sizeof(T) == 4) sample_parts_f32(x.data(), inv_t, pm.data(), ps.data(), v, part_len, parts);
        else sample_parts_bf16(x.data(), inv_t, pm.data(), ps.data(), v, part_len, parts);
      });
      emu_launch(Dim3{(unsigned)parts, (unsigned)rows, 1}, Dim3{SP_THREADS, 1, 1}, 0, [&] {
        if constexpr (sizeof(T) == 4) sample_part_mass_f32(x.data(), inv_t, pm.data(), ps.data(), mass.data(), v, part_len, parts, min_p);
        else sample_part_mass_bf16(x.data(), inv_t, pm.data(), ps.data(), mass.data(), v, part_len, parts, min_p);
      });
      emu_launch(Dim3{(unsigned)rows, 1, 1}, Dim3{SP_THREADS, 1, 1}, 0, [&] {
        if constexpr (sizeof(T) == 4)
          sample_pick_f32(x.data(), u.data(), inv_t, pm.data(), ps.data(), mass.data(), tokens.data(), lps.data(), v, part_len, parts, min_p);
        else
          sample_pick_bf16(x.data(), u.data(), inv_t, pm.data(), ps.data(), mass.data(), tokens.data(), lps.data(), v, part_len, parts, min_p);
      });
    } else {
      emu_launch(Dim3{(unsigned)rows, 1, 1}, Dim3{DS_THREADS, 1, 1}, 0, [&] {
        if constexpr (sizeof(T) == 4)
          sample_inverse_cdf_f32(x.data(), u.data(), inv_t, tokens.data(), lps.data(), v, top_k, (float)f.top_p, (float)f.min_p);
        else
          sample_inverse_cdf_bf16(x.data(), u.data(), inv_t, tokens.data(), lps.data(), v, top_k, (float)f.top_p, (float)f.min_p);
      });
    }
    for (int r = 0; r < rows; r++) {
      std::vector<double> xr(v);
      for (int i = 0; i < v; i++) xr[i] = back(x[r * v + i]);
      int pick; double lp, margin;
      std::vector<bool> keep;
      reference(xr, t, u[r], f, pick, lp, margin, keep);
      double tok_lp = xr[tokens[r]] / t; 
      double m = -INFINITY; for (double e : xr) m = std::max(m, e / t);
      double z = 0; for (double e : xr) z += std::exp(e / t - m);
      tok_lp -= std::log(z) + m;
      bool ok_tok = margin <= 1e-6 || ((int)tokens[r] == pick && keep[tokens[r]]);
      if (margin > 1e-6) compared++;
      bool ok_lp = std::abs(lps[r] - tok_lp) <= 1e-4 && std::isfinite(tok_lp);
      if (!ok_tok || !ok_lp) { bad++; std::printf("  BAD row %d T %.1f filter (%d, %.2f, %.2f): got %u (%f) want %d (%f) margin %g\n", r, t, f.top_k, f.top_p, f.min_p, tokens[r], lps[r], pick, lp, margin); }
    }
  }
  std::printf("sampler %s rows %d V %d parts of %d: %d bad, %d compared\n", sizeof(T) == 4 ? "f32" : "bf16", rows, v, part_len, bad, compared);
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
  bad += run<float>(9, 1000, 7, 37);
  bad += run<bf16>(48, 384, 8, 64);
  if (!quick) {
    bad += run<float>(3, 151936, 4);
    bad += run<bf16>(3, 151936, 5);
  }
  bad += run<float>(2, 100, 6);  // fewer ids than threads: empty segments
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
