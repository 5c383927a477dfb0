// The varlen (flash) attention kernels of crates/model/src/ops/attention_kernels.cu under emu.h (run.sh):
// forward, delta, ∂Q and ∂K/∂V launched as attention_cuda.rs launches them (same tile table),
// compared with a naive f64 attention (explicit softmax and gradients) on the same rounded
// inputs. Arguments: case indices to run (default all), or --quick for the cases marked quick
// (every d class in f32, one-token segments, d 64 and 256 in bf16).
#include "emu.h"
#include "driver.h"
#include "attention_kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>

struct Tiles { int dmax, f_rpw, f_bk, q_rpw, q_bk, kv_rpw, kv_bq; };
const Tiles TILES[3] = {{64, 8, 32, 8, 32, 8, 32}, {128, 6, 32, 3, 32, 3, 32}, {256, 3, 16, 1, 16, 1, 16}};


template <typename T>
struct Kernels {
  void (*fwd)(const T*, const T*, const T*, const int*, int, T*, float*, int, int, int, int, float, int);
  void (*dq)(const T*, const T*, const T*, const T*, const float*, const float*, const int*, int, T*, int, int, int, int, float, int);
  void (*dkv)(const T*, const T*, const T*, const T*, const float*, const float*, const int*, int, T*, T*, int, int, int, int, float, int);
  void (*delta)(const T*, const T*, float*, int, int);
};
Kernels<float> kf(int cls) {
  switch (cls) {
    case 0: return {varlen_attn_fwd_d64_f32, varlen_attn_bwd_dq_d64_f32, varlen_attn_bwd_dkv_d64_f32, varlen_attn_delta_f32};
    case 1: return {varlen_attn_fwd_d128_f32, varlen_attn_bwd_dq_d128_f32, varlen_attn_bwd_dkv_d128_f32, varlen_attn_delta_f32};
    default: return {varlen_attn_fwd_d256_f32, varlen_attn_bwd_dq_d256_f32, varlen_attn_bwd_dkv_d256_f32, varlen_attn_delta_f32};
  }
}
Kernels<bf16> kb(int cls) {
  switch (cls) {
    case 0: return {varlen_attn_fwd_d64_bf16, varlen_attn_bwd_dq_d64_bf16, varlen_attn_bwd_dkv_d64_bf16, varlen_attn_delta_bf16};
    case 1: return {varlen_attn_fwd_d128_bf16, varlen_attn_bwd_dq_d128_bf16, varlen_attn_bwd_dkv_d128_bf16, varlen_attn_delta_bf16};
    default: return {varlen_attn_fwd_d256_bf16, varlen_attn_bwd_dq_d256_bf16, varlen_attn_bwd_dkv_d256_bf16, varlen_attn_delta_bf16};
  }
}
template <typename T> Kernels<T> kern(int cls);
template <> Kernels<float> kern<float>(int c) { return kf(c); }
template <> Kernels<bf16> kern<bf16>(int c) { return kb(c); }

// Naive f64 reference from the (rounded) inputs.
void reference(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
               const std::vector<double>& dO, const std::vector<int>& cu, int n, int hq, int hkv, int d, double scale,
               std::vector<double>& o, std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv) {
  o.assign((size_t)n * hq * d, 0); dq.assign(o.size(), 0); dk.assign((size_t)n * hkv * d, 0); dv.assign(dk.size(), 0);
  int rep = hq / hkv;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    int a = cu[s], b = cu[s + 1];
    for (int h = 0; h < hq; ++h) {
      int g = h / rep;
      for (int i = a; i < b; ++i) {
        std::vector<double> p(i - a + 1), dp(i - a + 1);
        double mx = -1e300;
        for (int j = a; j <= i; ++j) {
          double sc = 0; for (int c = 0; c < d; ++c) sc += q[((size_t)i * hq + h) * d + c] * k[((size_t)j * hkv + g) * d + c];
          p[j - a] = sc * scale; mx = max(mx, p[j - a]);
        }
        double z = 0; for (auto& x : p) { x = exp(x - mx); z += x; }
        for (auto& x : p) x /= z;
        for (int j = a; j <= i; ++j) for (int c = 0; c < d; ++c) o[((size_t)i * hq + h) * d + c] += p[j - a] * v[((size_t)j * hkv + g) * d + c];
        double sum = 0;
        for (int j = a; j <= i; ++j) {
          double x = 0; for (int c = 0; c < d; ++c) x += dO[((size_t)i * hq + h) * d + c] * v[((size_t)j * hkv + g) * d + c];
          dp[j - a] = x; sum += p[j - a] * x;
        }
        for (int j = a; j <= i; ++j) {
          double ds = p[j - a] * (dp[j - a] - sum);
          for (int c = 0; c < d; ++c) {
            dv[((size_t)j * hkv + g) * d + c] += p[j - a] * dO[((size_t)i * hq + h) * d + c];
            dq[((size_t)i * hq + h) * d + c] += ds * scale * k[((size_t)j * hkv + g) * d + c];
            dk[((size_t)j * hkv + g) * d + c] += ds * scale * q[((size_t)i * hq + h) * d + c];
          }
        }
      }
    }
  }
}

// ‖a − b‖ / ‖b‖ (NaN counts as a huge error); for an all-zero b (e.g. ∂q when every segment
// has one token) the largest absolute difference instead.
double relerr(const std::vector<float>& a, const std::vector<double>& b, double* maxabs) {
  double num = 0, den = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double e = a[i] - b[i]; if (std::isnan(a[i])) e = 1e300;
    num += e * e; den += b[i] * b[i]; m = max(m, fabs(e));
  }
  *maxabs = m;
  return den < 1e-20 ? m : sqrt(num / den);
}

// The tensor-core forward (bf16, d 64 or 128), launched as attention_cuda.rs launches it.
void tc_forward(int d, const bf16* q, const bf16* k, const bf16* v, const int* cu, int ncu, bf16* o, float* lse, int n,
                int hq, int hkv, float sf) {
  auto f = d == 64 ? varlen_attn_fwd_tc_d64_bf16 : varlen_attn_fwd_tc_d128_bf16;
  const int rows = 64;
  // Two stages of 64-key K/V tiles (opted in past 48 KiB at head_dim 128, as the launcher does).
  emu_launch(Dim3{(unsigned)((n + rows - 1) / rows), (unsigned)hq, 1}, Dim3{128, 1, 1}, 2 * 2 * 2 * 64 * (size_t)(d + 8),
             [&] { f(q, k, v, cu, ncu, o, lse, n, hq, hkv, d, sf, rows); }, 99 * 1024);
}
template <typename T>
void tc_forward_of(int, const T*, const T*, const T*, const int*, int, T*, float*, int, int, int, float) {
  std::abort();  // f32 has no tensor-core kernels
}
template <>
void tc_forward_of<bf16>(int d, const bf16* q, const bf16* k, const bf16* v, const int* cu, int ncu, bf16* o, float* lse,
                         int n, int hq, int hkv, float sf) {
  tc_forward(d, q, k, v, cu, ncu, o, lse, n, hq, hkv, sf);
}
// The tensor-core ∂Q and ∂K/∂V, launched as attention_cuda.rs launches them.
template <typename T>
void tc_backward_of(int, const T*, const T*, const T*, const T*, const float*, const float*, const int*, int, T*, T*, T*,
                    int, int, int, float) {
  std::abort();
}
template <>
void tc_backward_of<bf16>(int d, const bf16* q, const bf16* k, const bf16* v, const bf16* dO, const float* lse,
                          const float* delta, const int* cu, int ncu, bf16* dq, bf16* dk, bf16* dv, int n, int hq, int hkv,
                          float sf) {
  auto fq = d == 64 ? varlen_attn_bwd_dq_tc_d64_bf16 : varlen_attn_bwd_dq_tc_d128_bf16;
  auto fkv = d == 64 ? varlen_attn_bwd_dkv_tc_d64_bf16 : varlen_attn_bwd_dkv_tc_d128_bf16;
  const unsigned blocks = (unsigned)((n + 63) / 64);
  emu_launch(Dim3{blocks, (unsigned)hq, 1}, Dim3{128, 1, 1}, 2 * 2 * 2 * 32 * (size_t)(d + 8),  // two stages
             [&] { fq(q, k, v, dO, lse, delta, cu, ncu, dq, n, hq, hkv, d, sf, 64); });
  // ∂K/∂V: 64 keys and two stages of 48 queries with their lse and delta (opted in past 48 KiB
  // at head_dim 128, as the launcher does; 99 KiB is the least any sm_80+ card allows).
  emu_launch(Dim3{blocks, (unsigned)hkv, 1}, Dim3{128, 1, 1}, 2 * 2 * 64 * (size_t)(d + 8) + 2 * (2 * 2 * 48 * (size_t)(d + 8) + 2 * 4 * 48),
             [&] { fkv(q, k, v, dO, lse, delta, cu, ncu, dk, dv, n, hq, hkv, d, sf, 64); }, 99 * 1024);
}

// `tc`: the tensor-core kernels (varlen_attn_*_tc) where the scalar ones run otherwise (the
// delta kernel is shared).
// `misalign`: q, k, v and ∂O start one element past a 16-byte boundary (a view at an odd
// offset: the tile loads take their element-wise path).
template <typename T>
bool run_case(std::vector<int> cu, int hq, int hkv, int d, unsigned seed, double tol, bool tc, bool misalign) {
  int n = cu.back();
  std::mt19937 rng(seed); std::uniform_real_distribution<float> U(-1.f, 1.f);
  auto mk = [&](size_t m, float sc) { std::vector<T> x(m); for (auto& e : x) e = cvt<T>(U(rng) * sc); return x; };
  auto q = mk((size_t)n * hq * d, 1.5f), k = mk((size_t)n * hkv * d, 1.5f), v = mk((size_t)n * hkv * d, 1.f), dO = mk((size_t)n * hq * d, 1.f);
  // The inputs the kernels read: the same values, copied one element further when misaligned.
  const size_t shift = misalign ? 1 : 0;
  auto placed = [&](const std::vector<T>& x) {
    std::vector<T> y(x.size() + 8);
    std::copy(x.begin(), x.end(), y.begin() + shift);
    return y;
  };
  auto qb = placed(q), kb_ = placed(k), vb = placed(v), gb = placed(dO);
  const T *pq = qb.data() + shift, *pk = kb_.data() + shift, *pv = vb.data() + shift, *pg = gb.data() + shift;
  auto dbl = [](const std::vector<T>& x) { std::vector<double> y(x.size()); for (size_t i = 0; i < x.size(); ++i) y[i] = back(x[i]); return y; };
  double scale = 1.0 / sqrt((double)d);
  std::vector<double> ro, rdq, rdk, rdv;
  reference(dbl(q), dbl(k), dbl(v), dbl(dO), cu, n, hq, hkv, d, scale, ro, rdq, rdk, rdv);
  int cls = d <= 64 ? 0 : d <= 128 ? 1 : 2;
  const Tiles& t = TILES[cls];
  auto K = kern<T>(cls);
  std::vector<T> o((size_t)n * hq * d, cvt<T>(NAN)), dq(o.size(), cvt<T>(NAN)), dk((size_t)n * hkv * d, cvt<T>(NAN)), dv(dk.size(), cvt<T>(NAN));
  std::vector<float> lse((size_t)n * hq, NAN), delta((size_t)n * hq, NAN);
  float sf = (float)scale; int ncu = cu.size();
  int rows = 4 * t.f_rpw;
  if (tc) {
    tc_forward_of<T>(d, pq, pk, pv, cu.data(), ncu, o.data(), lse.data(), n, hq, hkv, sf);
  } else {
    emu_launch(Dim3{(unsigned)((n + rows - 1) / rows), (unsigned)hq, 1}, Dim3{128, 1, 1}, 4 * ((size_t)rows * d + d * (t.f_bk + 1) + t.f_bk * d),
               [&] { K.fwd(pq, pk, pv, cu.data(), ncu, o.data(), lse.data(), n, hq, hkv, d, sf, rows); });
  }
  // The backward's dO·O uses the kernel's own (rounded) output, as the op does.
  emu_launch(Dim3{(unsigned)((n * hq + 3) / 4), 1, 1}, Dim3{128, 1, 1}, 0, [&] { K.delta(pg, o.data(), delta.data(), n * hq, d); });
  if (tc) {
    tc_backward_of<T>(d, pq, pk, pv, pg, lse.data(), delta.data(), cu.data(), ncu, dq.data(), dk.data(), dv.data(), n, hq, hkv, sf);
  } else {
    rows = 4 * t.q_rpw;
    emu_launch(Dim3{(unsigned)((n + rows - 1) / rows), (unsigned)hq, 1}, Dim3{128, 1, 1}, 4 * ((size_t)2 * rows * d + 2 * d * (t.q_bk + 1)),
           [&] { K.dq(pq, pk, pv, pg, lse.data(), delta.data(), cu.data(), ncu, dq.data(), n, hq, hkv, d, sf, rows); });
    rows = 4 * t.kv_rpw;
    emu_launch(Dim3{(unsigned)((n + rows - 1) / rows), (unsigned)hkv, 1}, Dim3{128, 1, 1}, 4 * ((size_t)2 * rows * d + 2 * d * (t.kv_bq + 1) + 2 * t.kv_bq),
           [&] { K.dkv(pq, pk, pv, pg, lse.data(), delta.data(), cu.data(), ncu, dk.data(), dv.data(), n, hq, hkv, d, sf, rows); });
  }
  auto fl = [](const std::vector<T>& x) { std::vector<float> y(x.size()); for (size_t i = 0; i < x.size(); ++i) y[i] = back(x[i]); return y; };
  bool ok = true;
  const char* names[4] = {"out", "dq", "dk", "dv"};
  std::vector<float> got[4] = {fl(o), fl(dq), fl(dk), fl(dv)};
  std::vector<double>* want[4] = {&ro, &rdq, &rdk, &rdv};
  printf("%s%s%s n=%d hq=%d hkv=%d d=%d:", sizeof(T) == 4 ? "f32 " : "bf16", tc ? " tc" : "", misalign ? " misaligned" : "", n, hq, hkv, d);
  for (int i = 0; i < 4; ++i) {
    double m; double e = relerr(got[i], *want[i], &m);
    printf(" %s rel %.1e max %.1e;", names[i], e, m);
    if (!(e <= tol)) ok = false;
  }
  // The log-sum-exp against f64 (the backward recomputes P from it).
  double lse_err = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int i = cu[s]; i < cu[s + 1]; ++i)
      for (int h = 0; h < hq; ++h) {
        const int g = h / (hq / hkv);
        std::vector<double> sc;
        double mx = -1e300;
        for (int j = cu[s]; j <= i; ++j) {
          double x = 0;
          for (int c = 0; c < d; ++c) x += back(q[((size_t)i * hq + h) * d + c]) * back(k[((size_t)j * hkv + g) * d + c]);
          sc.push_back(x * scale);
          mx = max(mx, x * scale);
        }
        double z = 0;
        for (double x : sc) z += exp(x - mx);
        const double e = fabs(lse[(size_t)i * hq + h] - (mx + log(z)));
        lse_err = std::isnan(e) ? 1e300 : max(lse_err, e);
      }
  printf(" lse max %.1e;", lse_err);
  if (!(lse_err <= 1e-3)) ok = false;
  printf(" %s\n", ok ? "ok" : "FAIL");
  return ok;
}

struct Case { bool bf16; std::vector<int> cu; int hq, hkv, d; unsigned seed; double tol; bool quick; bool tc = false; bool misalign = false; };

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // a line per case as it finishes
  const std::vector<int> multi = {0, 5, 5, 6, 75, 76, 207};
  const std::vector<int> ones = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const std::vector<Case> cases = {
      {false, {0, 150}, 4, 2, 16, 1, 2e-5, true},
      {false, multi, 6, 2, 8, 2, 2e-5, false},
      {false, multi, 4, 1, 12, 3, 2e-5, false},
      {false, multi, 3, 3, 7, 4, 2e-5, false},
      {false, ones, 2, 1, 64, 5, 2e-5, true},
      {false, multi, 4, 2, 64, 6, 2e-5, false},
      {false, multi, 2, 2, 128, 7, 2e-5, true},
      {false, {0, 3, 40, 41, 100}, 4, 2, 100, 8, 2e-5, false},
      {false, {0, 1, 37, 60}, 2, 1, 256, 9, 2e-5, true},
      {false, {0, 30, 31, 47}, 2, 2, 200, 10, 2e-5, false},
      {true, multi, 4, 2, 64, 11, 1e-2, true},
      {true, multi, 2, 1, 128, 12, 1e-2, false},
      {true, {0, 1, 37, 60}, 2, 1, 256, 13, 1e-2, true},
      // The tensor-core forward: rows of a warp and of a block across segments, segments over
      // several 64-key tiles, a last block past n, one-token segments, GQA 1-4.
      {true, multi, 4, 2, 64, 14, 1e-2, true, true},
      {true, multi, 2, 1, 128, 15, 1e-2, true, true},
      {true, ones, 4, 1, 64, 16, 1e-2, false, true},
      {true, {0, 150}, 3, 3, 128, 17, 1e-2, false, true},
      {true, {0, 17, 200, 201, 290}, 4, 4, 64, 18, 1e-2, false, true},
      // Inputs at an odd element offset: the tile loads' element-wise path.
      {true, multi, 4, 2, 64, 19, 1e-2, true, true, true},
      {true, {0, 70, 150}, 2, 1, 128, 20, 1e-2, false, true, true},
  };
  std::vector<size_t> pick;
  for (int a = 1; a < argc; a++) {
    if (std::strcmp(argv[a], "--quick") == 0) {
      for (size_t i = 0; i < cases.size(); i++) if (cases[i].quick) pick.push_back(i);
      continue;
    }
    const size_t i = std::strtoul(argv[a], nullptr, 10);
    if (i >= cases.size()) { std::fprintf(stderr, "no case %s (0..%zu)\n", argv[a], cases.size() - 1); return 2; }
    pick.push_back(i);
  }
  if (argc == 1) for (size_t i = 0; i < cases.size(); i++) pick.push_back(i);
  bool ok = true;
  for (size_t i : pick) {
    const Case& c = cases[i];
    ok &= c.bf16 ? run_case<bf16>(c.cu, c.hq, c.hkv, c.d, c.seed, c.tol, c.tc, c.misalign)
                 : run_case<float>(c.cu, c.hq, c.hkv, c.d, c.seed, c.tol, c.tc, c.misalign);
  }
  printf(ok ? "ALL OK\n" : "FAIL\n");
  return ok ? 0 : 1;
}
