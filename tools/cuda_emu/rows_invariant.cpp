// Deterministic mode's batch-invariant kernels of rows_invariant_kernels.cuh (rows_linear,
// attend_one; included by decode_kernels.cu) under emu.h (run.sh): each against an f64
// reference of the same inputs, and each row's bits the same whether the launch has every row,
// the rows reversed, or that row alone, and each query's the same as decoding it alone — the
// property deterministic mode needs.
#include "emu.h"
#include "driver.h"
#include "decode_kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

template <typename T> const char* tname() { return sizeof(T) == 4 ? "f32 " : "bf16"; }

template <typename T> std::vector<uint32_t> bits_of(const std::vector<T>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); i++) {
    uint32_t u = 0;
    std::memcpy(&u, &v[i], sizeof(T));
    b[i] = u;
  }
  return b;
}

// y = x·wᵀ of m rows through the kernel; with `shift`, x copied one element past a 16-byte
// boundary first (the kernel's element-wise loads instead of 16-byte ones).
template <typename T>
std::vector<T> linear(const std::vector<T>& x, const std::vector<T>& w, int m, int n, int k,
                      bool shift = false) {
  std::vector<T> y((size_t)m * n, cvt<T>(NAN));
  std::vector<T> moved(x.size() + 1);
  std::copy(x.begin(), x.end(), moved.begin() + 1);
  const T* xp = shift ? moved.data() + 1 : x.data();
  emu_launch(Dim3{(unsigned)((n + RI_WARPS - 1) / RI_WARPS), 1, 1}, Dim3{32 * RI_WARPS, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4)
      rows_linear_f32(xp, w.data(), y.data(), m, n, k);
    else
      rows_linear_bf16(xp, w.data(), y.data(), m, n, k);
  });
  return y;
}

template <typename T> int run_linear(int m, int n, int k, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  std::vector<T> x((size_t)m * k), w((size_t)n * k);
  for (auto& e : x) e = cvt<T>(U(rng));
  for (auto& e : w) e = cvt<T>(U(rng));
  const auto y = linear(x, w, m, n, k);
  double worst = 0;
  for (int r = 0; r < m; r++)
    for (int o = 0; o < n; o++) {
      double want = 0, mag = 0;
      for (int c = 0; c < k; c++) {
        const double p = back(x[(size_t)r * k + c]) * back(w[(size_t)o * k + c]);
        want += p;
        mag += std::fabs(p);
      }
      worst = worst_of(worst, std::fabs(back(y[(size_t)r * n + o]) - want) / std::max(mag, 1e-30));
    }
  // Reversed rows, and each of rows 0 and m − 1 alone: the same bits per row.
  std::vector<T> xr(x.size());
  for (int r = 0; r < m; r++) std::copy_n(&x[(size_t)r * k], k, &xr[(size_t)(m - 1 - r) * k]);
  const auto yr = bits_of(linear(xr, w, m, n, k));
  const auto yb = bits_of(y);
  size_t moved = 0;
  for (int r = 0; r < m; r++)
    for (int o = 0; o < n; o++) moved += yb[(size_t)r * n + o] != yr[(size_t)(m - 1 - r) * n + o];
  for (int r : {0, m - 1}) {
    std::vector<T> one(&x[(size_t)r * k], &x[(size_t)r * k] + k);
    const auto y1 = bits_of(linear(one, w, 1, n, k));
    for (int o = 0; o < n; o++) moved += y1[o] != yb[(size_t)r * n + o];
  }
  // x one element off a 16-byte boundary (element-wise loads where k allowed 16-byte ones).
  const auto ys = bits_of(linear(x, w, m, n, k, true));
  for (size_t i = 0; i < ys.size(); i++) moved += ys[i] != yb[i];
  const double tol = sizeof(T) == 4 ? 1e-6 : 8e-3;  // bf16: the output's rounding
  const bool bad = !(worst <= tol) || moved != 0;
  std::printf("rows_linear %s m %2d n %3d k %3d: worst rel %.2e, %zu bits moved with the batch %s\n", tname<T>(), m,
              n, k, worst, moved, bad ? "BAD" : "ok");
  return bad;
}

// The cache: rows × hkv × cap × d, the first len keys of each row valid; t_q queries a row, the
// last t_q of those positions (query i attends to the first len − t_q + i + 1 keys).
template <typename T>
std::vector<T> attend(const std::vector<T>& q, const std::vector<T>& kc, const std::vector<T>& vc, int rows, int t_q,
                      int hq, int hkv, int d, int len, int cap) {
  std::vector<T> out((size_t)rows * t_q * hq * d, cvt<T>(NAN));
  const long long s_key = d, s_head = (long long)cap * d, s_row = (long long)hkv * cap * d;
  const float scale = 1.f / std::sqrt((float)d);
  const int past = len - t_q;
  emu_launch(Dim3{(unsigned)(rows * t_q * hq), 1, 1}, Dim3{32 * RA_WARPS, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4)
      attend_one_f32(q.data(), kc.data(), vc.data(), out.data(), hq, hkv, d, t_q, past, s_row, s_head, s_key, scale);
    else
      attend_one_bf16(q.data(), kc.data(), vc.data(), out.data(), hq, hkv, d, t_q, past, s_row, s_head, s_key, scale);
  });
  return out;
}

template <typename T> int run_attend(int rows, int t_q, int hq, int hkv, int d, int len, unsigned seed) {
  const int cap = len + 3;  // slots past the keys: NaN, never read
  const int past = len - t_q;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-2.f, 2.f);
  std::vector<T> q((size_t)rows * t_q * hq * d), kc((size_t)rows * hkv * cap * d, cvt<T>(NAN)), vc(kc.size(), cvt<T>(NAN));
  for (auto& e : q) e = cvt<T>(U(rng));
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < hkv; h++)
      for (int j = 0; j < len; j++)
        for (int e = 0; e < d; e++) {
          const size_t at = (((size_t)r * hkv + h) * cap + j) * d + e;
          kc[at] = cvt<T>(U(rng));
          vc[at] = cvt<T>(U(rng));
        }
  const auto out = attend(q, kc, vc, rows, t_q, hq, hkv, d, len, cap);
  double worst = 0;
  bool finite = true;
  for (int r = 0; r < rows; r++)
    for (int i = 0; i < t_q; i++)
      for (int h = 0; h < hq; h++) {
        const int g = h / (hq / hkv), keys = past + i + 1;
        const size_t qi = (((size_t)r * t_q + i) * hq + h) * d;
        std::vector<double> s(keys);
        double top = -INFINITY, sum = 0;
        for (int j = 0; j < keys; j++) {
          double dot = 0;
          for (int e = 0; e < d; e++) dot += back(q[qi + e]) * back(kc[(((size_t)r * hkv + g) * cap + j) * d + e]);
          s[j] = dot / std::sqrt((double)d);
          top = std::max(top, s[j]);
        }
        for (int j = 0; j < keys; j++) sum += (s[j] = std::exp(s[j] - top));
        for (int e = 0; e < d; e++) {
          double want = 0;
          for (int j = 0; j < keys; j++) want += s[j] / sum * back(vc[(((size_t)r * hkv + g) * cap + j) * d + e]);
          const double got = back(out[qi + e]);
          finite = finite && std::isfinite(got);
          worst = worst_of(worst, std::fabs(got - want));
        }
      }
  // Rows reversed (queries and caches), and the last row's queries each alone (one query over
  // its own prefix of the keys): the same bits.
  std::vector<T> qr(q.size()), kr(kc.size()), vr(vc.size());
  const size_t qrow = (size_t)t_q * hq * d, crow = (size_t)hkv * cap * d, qone = (size_t)hq * d;
  for (int r = 0; r < rows; r++) {
    std::copy_n(&q[r * qrow], qrow, &qr[(rows - 1 - r) * qrow]);
    std::copy_n(&kc[r * crow], crow, &kr[(rows - 1 - r) * crow]);
    std::copy_n(&vc[r * crow], crow, &vr[(rows - 1 - r) * crow]);
  }
  const auto ob = bits_of(out);
  const auto orv = bits_of(attend(qr, kr, vr, rows, t_q, hq, hkv, d, len, cap));
  size_t moved = 0;
  for (int r = 0; r < rows; r++)
    for (size_t i = 0; i < qrow; i++) moved += ob[r * qrow + i] != orv[(rows - 1 - r) * qrow + i];
  const int last = rows - 1;
  const std::vector<T> k1(&kc[last * crow], &kc[last * crow] + crow), v1(&vc[last * crow], &vc[last * crow] + crow);
  for (int i = 0; i < t_q; i++) {
    const size_t at = last * qrow + i * qone;
    std::vector<T> q1(&q[at], &q[at] + qone);
    const auto o1 = bits_of(attend(q1, k1, v1, 1, 1, hq, hkv, d, past + i + 1, cap));
    for (size_t e = 0; e < qone; e++) moved += o1[e] != ob[at + e];
  }
  const double tol = sizeof(T) == 4 ? 1e-5 : 2e-2;
  const bool bad = !finite || !(worst <= tol) || moved != 0;
  std::printf("attend_one  %s rows %d queries %d hq %2d hkv %d d %3d keys %3d: max err %.2e, %zu bits moved with the batch %s\n",
              tname<T>(), rows, t_q, hq, hkv, d, len, worst, moved, bad ? "BAD" : "ok");
  return bad;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  // One row; rows past a group of RI_ROWS; k below, at and past a warp's 32 columns; n past a
  // block's RI_WARPS weight rows.
  bad += run_linear<float>(1, 5, 16, 1);
  bad += run_linear<bf16>(3, 24, 37, 2);
  bad += run_attend<float>(3, 1, 4, 2, 16, 5, 3);
  bad += run_attend<float>(2, 4, 2, 1, 16, 6, 12);  // a prefill chunk: 4 queries after 2 keys
  bad += run_attend<bf16>(2, 1, 2, 2, 64, 1, 4);
  if (!quick) {
    bad += run_linear<float>(17, 24, 96, 5);
    bad += run_linear<bf16>(40, 130, 200, 6);
    bad += run_linear<bf16>(64, 9, 896, 7);  // Qwen2.5-0.5B's hidden size, 64 rows
    bad += run_attend<float>(3, 1, 14, 2, 64, 37, 8);  // Qwen2.5-0.5B's heads
    bad += run_attend<bf16>(2, 1, 4, 1, 80, 20, 9);    // head_dim not a multiple of 32
    bad += run_attend<bf16>(2, 9, 8, 4, 128, 9, 10);  // a whole prompt at once
    bad += run_attend<float>(1, 1, 2, 2, 256, 12, 11);
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
