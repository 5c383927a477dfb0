// The decode step's skinny product of decode_gemm_kernels.cuh (skinny_gemm_{plain,swiglu,qkv}_m*,
// included by decode_kernels.cu) under emu.h (run.sh) against f64 products of the same bf16
// inputs: rows 1-64 (every m16 tile count), weight rows past a tile's end, k not a multiple of
// a stage (and smaller than one), split k with its partials summed by the last block — run
// twice on the same counters, which must come back zero, the second time with the blocks in
// reverse order (the tile's last arrival then its first split) — the SwiGLU epilogue on the stacked
// [gate | up] weight, and the q/k/v epilogue (bias, RoPE, q out, keys and values into their
// cache slots, every other slot untouched) at head_dim 32, 64 and 128; with the input norm
// (norm_w: the rows' RMSNorm folded in, its sums of squares split like the product) and the
// residual add after a plain product, against the f64 norm then product (then add).
// Arguments: case indices (default all), or --quick.
#include "emu.h"
#include "driver.h"
#include "decode_kernels_emu.cu"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

struct Case {
  bool swiglu;
  int m, n, k, k_split;  // k_split: k per block (a multiple of SG_KC); splits = ⌈k / k_split⌉
  bool quick;
  bool norm = false, residual = false;  // the input norm; the residual add (plain only)
};

#define SG_PARAMS const bf16*, const bf16*, float*, unsigned*, int, int, int, int, int, const bf16*, float
using Plain = void (*)(SG_PARAMS, bf16*, const bf16*);
using Kernel = void (*)(SG_PARAMS, bf16*);
using QkvKernel = void (*)(SG_PARAMS, const bf16*, const bf16*, const bf16*, bf16*, bf16*, const uint32_t*, int,
                           int, int, int);

const Plain plain_kernels[4] = {skinny_gemm_plain_m1_bf16, skinny_gemm_plain_m2_bf16, skinny_gemm_plain_m3_bf16,
                                skinny_gemm_plain_m4_bf16};
const Kernel swiglu_kernels[4] = {skinny_gemm_swiglu_m1_bf16, skinny_gemm_swiglu_m2_bf16,
                                  skinny_gemm_swiglu_m3_bf16, skinny_gemm_swiglu_m4_bf16};

const QkvKernel qkv_kernels[4] = {skinny_gemm_qkv_m1_bf16, skinny_gemm_qkv_m2_bf16, skinny_gemm_qkv_m3_bf16,
                                  skinny_gemm_qkv_m4_bf16};

struct Rng {
  std::mt19937_64 g;
  std::uniform_real_distribution<float> u{-1.f, 1.f};
  explicit Rng(unsigned seed) : g(seed) {}
  // n bf16 values in [-scale, scale) (and 8 spare: the kernel copies 16 bytes at a time).
  std::vector<bf16> bf(size_t n, float scale = 1.f) {
    std::vector<bf16> v(n + 8);
    for (auto& e : v) e = __float2bfloat16(scale * u(g));
    return v;
  }
};

double rel(double got, double want) {
  return std::isfinite(got) ? std::abs(got - want) / std::max(1.0, std::abs(want)) : INFINITY;
}
double f(bf16 v) { return __bfloat162float(v); }
double round_bf16(double v) { return __bfloat162float(__float2bfloat16((float)v)); }
// The spacing of bf16 values at v (8 significant bits).
double bf16_ulp(double v) { return v == 0 ? 0x1p-133 : std::ldexp(1.0, std::ilogb(v) - 7); }

const float kEps = 1e-6f;

// Row dot products in f64 from the bf16 inputs; with norm_w, of x's row through the RMSNorm
// as the kernel rounds it: x·norm_w rounded to bf16, the sum over k divided by the rms of x
// (rms_norm rounds x / rms instead — a difference of the same size as its own rounding, which
// the Rust tests bound against the norm and product as separate ops; here the reference
// follows the kernel so that a wrong scale or a skipped stage stands out at 2⁻⁸).
double dot(const std::vector<bf16>& x, const std::vector<bf16>& w, int k, int r, int wr,
           const std::vector<bf16>* norm_w = nullptr) {
  double s = 0, ss = 0;
  for (int i = 0; i < k; i++) {
    const double xv = f(x[(size_t)r * k + i]);
    s += (norm_w ? round_bf16(xv * f((*norm_w)[i])) : xv) * f(w[(size_t)wr * k + i]);
    ss += xv * xv;
  }
  return norm_w ? s / std::sqrt(ss / k + kEps) : s;
}

struct Launch {
  int mt, tiles, splits;
  size_t smem;
  std::vector<float> part;
  std::vector<unsigned> counters;
  Launch(int m, int n_tiles, int k, int k_split)
      : mt((m + 15) / 16), tiles(n_tiles), splits((k + k_split - 1) / k_split),
        smem((size_t)SG_STAGES * (SG_NT + mt * 16) * SG_PITCH * 2),
        part(splits > 1 ? (size_t)n_tiles * splits * mt * 16 * (SG_NT + 1) : 0, NAN), counters(n_tiles, 0) {}
  float* part_ptr() { return part.empty() ? nullptr : part.data(); }
  bool zeroed() const {
    return std::all_of(counters.begin(), counters.end(), [](unsigned v) { return v == 0; });
  }
  // `reverse`: the blocks last to first, so a tile's last arriving block is its first split.
  template <class F> void run(F body, bool reverse) {
    emu_reverse_blocks = reverse;
    emu_launch(Dim3{(unsigned)tiles, (unsigned)splits, 1}, Dim3{32 * SG_WARPS, 1, 1}, smem, body, smem);
    emu_reverse_blocks = false;
  }
};

int run(const Case& c, unsigned seed) {
  Rng rng(seed);
  std::vector<bf16> x = rng.bf((size_t)c.m * c.k), w = rng.bf((size_t)c.n * c.k);
  // A norm weight around 1 (and a residual the product's size); x far from unit rms.
  std::vector<bf16> norm_w = rng.bf(c.k, 0.5f), res = rng.bf((size_t)c.m * c.n, 8.f);
  for (auto& e : norm_w) e = __float2bfloat16(1.f + f(e));
  if (c.norm)
    for (auto& e : x) e = __float2bfloat16(3.f * f(e));
  const std::vector<bf16>* nw = c.norm ? &norm_w : nullptr;
  const int tiles = c.swiglu ? c.n / SG_NT : (c.n + SG_NT - 1) / SG_NT;
  const int out_cols = c.swiglu ? c.n / 2 : c.n;
  std::vector<bf16> y((size_t)c.m * out_cols);
  Launch l(c.m, tiles, c.k, c.k_split);
  int bad = 0;
  // The second launch reuses the counters the first left, and runs the blocks in reverse order.
  for (int launch = 0; launch < 2; launch++) {
    std::fill(y.begin(), y.end(), __float2bfloat16(NAN));
    l.run([&] {
      const bf16* nwp = c.norm ? norm_w.data() : nullptr;
      if (c.swiglu)
        swiglu_kernels[l.mt - 1](x.data(), w.data(), l.part_ptr(), l.counters.data(), c.m, c.n, c.k, c.k_split,
                                 l.splits, nwp, kEps, y.data());
      else
        plain_kernels[l.mt - 1](x.data(), w.data(), l.part_ptr(), l.counters.data(), c.m, c.n, c.k, c.k_split,
                                l.splits, nwp, kEps, y.data(), c.residual ? res.data() : nullptr);
    }, launch == 1);
    double worst = 0;
    for (int r = 0; r < c.m; r++)
      for (int j = 0; j < out_cols; j++) {
        double want;
        if (c.swiglu) {
          // g and u are rounded to bf16 before silu(g)·u; the kernel's f32 sums and the f64
          // ones can round to neighbouring values, which silu magnifies where g is negative
          // (a step of g = −4.5 moves silu(g) by 2.4%): the nearest of silu(g')·u' over g', u'
          // the rounded value and its two neighbours.
          const double g0 = round_bf16(dot(x, w, c.k, r, j, nw)), u0 = round_bf16(dot(x, w, c.k, r, c.n / 2 + j, nw));
          const double got = f(y[(size_t)r * out_cols + j]);
          double best = INFINITY;
          for (int dg = -1; dg <= 1; dg++)
            for (int du = -1; du <= 1; du++) {
              const double g = g0 + dg * bf16_ulp(g0), u = u0 + du * bf16_ulp(u0);
              const double cand = g / (1 + std::exp(-g)) * u;
              if (rel(got, cand) < best) best = rel(got, cand), want = cand;
            }
        } else {
          want = dot(x, w, c.k, r, j, nw);
          if (c.residual) want = round_bf16(want) + f(res[(size_t)r * c.n + j]);
        }
        worst = worst_of(worst, rel(f(y[(size_t)r * out_cols + j]), want));
      }
    // bf16 outputs: 2⁻⁸ of rounding (a dropped stage or split is off by far more).
    const bool ok = worst <= 1e-2 && l.zeroed();
    std::printf("%s%s%s m %d n %d k %d k_split %d (tiles %d, splits %d) launch %d: worst rel %.2e%s %s\n",
                c.swiglu ? "swiglu" : "plain ", c.norm ? " +norm" : "", c.residual ? " +residual" : "", c.m, c.n,
                c.k, c.k_split, tiles, l.splits, launch, worst,
                l.zeroed() ? "" : ", counters not reset", ok ? "ok" : "BAD");
    bad += !ok;
  }
  return bad;
}

struct QkvCase {
  int m, nh, nkv, d, k, k_split, slot_count;
  bool bias, quick;
  bool norm = false;
};

// q = rope(round(round(x·Wq) + bq)), k likewise into pool[0][slot], v = round(round(x·Wv) + bv)
// into pool[1][slot], as qkv_bias_rope and kv_write compute them.
int run_qkv(const QkvCase& c, unsigned seed) {
  Rng rng(seed);
  const int n = (c.nh + 2 * c.nkv) * c.d, half = c.d / 2, width = c.nkv * c.d;
  std::vector<bf16> x = rng.bf((size_t)c.m * c.k), w = rng.bf((size_t)n * c.k, 0.2f);
  std::vector<bf16> bias = rng.bf(n), cos = rng.bf((size_t)c.m * half), sin = rng.bf((size_t)c.m * half);
  std::vector<bf16> norm_w = rng.bf(c.k, 0.5f);
  for (auto& e : norm_w) e = __float2bfloat16(1.f + f(e));
  const std::vector<bf16>* nw = c.norm ? &norm_w : nullptr;
  // Distinct slots, scattered over the pool.
  std::vector<uint32_t> all(c.slot_count);
  for (int i = 0; i < c.slot_count; i++) all[i] = i;
  std::shuffle(all.begin(), all.end(), rng.g);
  std::vector<uint32_t> slots(all.begin(), all.begin() + c.m);
  const bf16 sentinel = __float2bfloat16(5.f);
  std::vector<bf16> q((size_t)c.m * c.nh * c.d), pool(2 * (size_t)c.slot_count * width + 8);
  Launch l(c.m, (n + SG_NT - 1) / SG_NT, c.k, c.k_split);
  int bad = 0;
  for (int launch = 0; launch < 2; launch++) {
    std::fill(q.begin(), q.end(), __float2bfloat16(NAN));
    std::fill(pool.begin(), pool.end(), sentinel);
    l.run([&] {
      qkv_kernels[l.mt - 1](x.data(), w.data(), l.part_ptr(), l.counters.data(), c.m, n, c.k, c.k_split, l.splits,
                            c.norm ? norm_w.data() : nullptr, kEps, c.bias ? bias.data() : nullptr, cos.data(), sin.data(), q.data(), pool.data(),
                            slots.data(), c.nh, c.nkv, c.d, c.slot_count);
    }, launch == 1);
    double worst = 0;
    std::vector<bool> written(c.slot_count, false);
    for (int r = 0; r < c.m; r++) {
      written[slots[r]] = true;
      for (int head = 0; head < c.nh + 2 * c.nkv; head++)
        for (int j = 0; j < half; j++) {
          const int col = head * c.d + j;
          double x1 = round_bf16(dot(x, w, c.k, r, col, nw)), x2 = round_bf16(dot(x, w, c.k, r, col + half, nw));
          if (c.bias) x1 = round_bf16(x1 + f(bias[col])), x2 = round_bf16(x2 + f(bias[col + half]));
          const bf16* got;
          if (head < c.nh + c.nkv) {
            const double cs = f(cos[(size_t)r * half + j]), sn = f(sin[(size_t)r * half + j]);
            const double y1 = x1 * cs - x2 * sn, y2 = x2 * cs + x1 * sn;
            x1 = y1, x2 = y2;
            got = head < c.nh ? &q[((size_t)r * c.nh + head) * c.d]
                              : &pool[(size_t)slots[r] * width + (size_t)(head - c.nh) * c.d];
          } else {
            got = &pool[((size_t)c.slot_count + slots[r]) * width + (size_t)(head - c.nh - c.nkv) * c.d];
          }
          worst = worst_of({worst, rel(f(got[j]), x1), rel(f(got[j + half]), x2)});
        }
    }
    int touched = 0;  // slots no row owns must keep their values
    for (int part = 0; part < 2; part++)
      for (int s = 0; s < c.slot_count; s++)
        if (!written[s])
          for (int e = 0; e < width; e++)
            touched += f(pool[((size_t)part * c.slot_count + s) * width + e]) != 5.0;
    const bool ok = worst <= 2e-2 && touched == 0 && l.zeroed();
    std::printf("qkv%s m %d heads %d/%d d %d k %d k_split %d bias %d (tiles %d, splits %d) launch %d: worst rel "
                "%.2e, %d foreign pool values%s %s\n",
                c.norm ? " +norm" : "   ", c.m, c.nh, c.nkv, c.d, c.k, c.k_split, c.bias, l.tiles, l.splits, launch, worst, touched,
                l.zeroed() ? "" : ", counters not reset", ok ? "ok" : "BAD");
    bad += !ok;
  }
  return bad;
}

int main(int argc, char** argv) {
  const std::vector<Case> cases = {
      {false, 5, 200, 136, 192, true},     // 0: one split; a tile past n; k ends mid-stage
      {false, 37, 256, 392, 128, true},    // 1: four splits, the last 8 wide; 3 m tiles
      {false, 64, 130, 8, 64, true},       // 2: k smaller than a stage; 4 m tiles
      {true, 16, 256, 200, 64, true},      // 3: SwiGLU, four splits
      {true, 17, 128, 72, 128, true},      // 4: SwiGLU, one split, 2 m tiles
      {false, 1, 128, 64, 64, true},       // 5: one row, one stage
      {false, 64, 1152, 896, 128, false},  // 6: Qwen2.5-0.5B's q/k/v, as decode_gemm.rs plans it
      {false, 64, 896, 4864, 256, false},  // 7: its down projection
      {true, 64, 9728, 896, 448, false},   // 8: its gate/up
      {false, 48, 384, 1024, 192, false},  // 9: k_split three stages
      {false, 37, 256, 392, 128, true, true, true},    // 10: norm + residual, four splits
      {true, 17, 256, 200, 64, true, true},            // 11: SwiGLU + norm, four splits
      {false, 5, 200, 136, 192, true, true},           // 12: norm, one split, k ends mid-stage
      {false, 64, 896, 896, 128, false, false, true},  // 13: 0.5B's o + residual
      {true, 64, 9728, 896, 448, false, true},         // 14: 0.5B's gate/up + norm
      {false, 64, 896, 4864, 256, false, false, true}, // 15: 0.5B's down + residual
      {false, 64, 4864, 896, 896, false, true},        // 16: an LM head's: final norm, one split
  };
  const std::vector<QkvCase> qkv_cases = {
      {5, 3, 1, 64, 136, 64, 40, true, true},       // 17: 320 columns: a half tile; three splits
      {17, 4, 2, 32, 72, 128, 30, false, true},     // 18: four heads a tile; no bias; one split
      {3, 2, 1, 128, 200, 128, 8, true, true},      // 19: one head a tile; two splits
      {64, 14, 2, 64, 896, 128, 300, true, false},  // 20: Qwen2.5-0.5B, batch 64
      {5, 3, 1, 64, 136, 64, 40, true, true, true},  // 21: norm, three splits
      {64, 14, 2, 64, 896, 128, 300, true, false, true},  // 22: 0.5B at batch 64 + norm
  };
  std::vector<size_t> pick;
  const size_t total = cases.size() + qkv_cases.size();
  for (int a = 1; a < argc; a++) {
    if (std::strcmp(argv[a], "--quick") == 0) {
      for (size_t i = 0; i < total; i++)
        if (i < cases.size() ? cases[i].quick : qkv_cases[i - cases.size()].quick) pick.push_back(i);
    } else {
      pick.push_back(std::strtoul(argv[a], nullptr, 10));
    }
  }
  if (pick.empty())
    for (size_t i = 0; i < total; i++) pick.push_back(i);
  int bad = 0;
  for (size_t i : pick) {
    if (i >= total) { std::fprintf(stderr, "no case %zu\n", i); return 2; }
    std::printf("case %zu: ", i);
    bad += i < cases.size() ? run(cases[i], 100 + (unsigned)i) : run_qkv(qkv_cases[i - cases.size()], 100 + (unsigned)i);
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
