// The rollout sampler's draw of the next token on the device: inverse CDF over the logits of
// each row with temperature, top-k, top-p and min-p (crates/model/src/sampling.rs; CPU twin: its
// blocked inverse CDF; tests/sampling_device.rs compares them). Included by decode_kernels.cu (one
// PTX module), which instantiates the kernels; launched by decode_cuda.rs;
// tools/cuda_emu/sample_inverse_cdf.cpp runs them on the CPU.
#pragma once
#include "cuda_common.cuh"

// ---- Inverse-CDF sampling of one token per row of logits [rows, V] ----
// As the CPU sampler: x = logits·inv_t in f32, logp = x − lse (lse = m + ln Σ e^{x − m}, m the
// row max), p = e^{logp}. The filters keep the tokens with x ≥ cut (see `filter_cut`); the
// token is the first kept id, in id order, whose cumulative p (f64) exceeds u·Σp_kept with
// p > 0 (u = uniforms[row]); a target past the end (rounding) takes the last kept id with
// p > 0. Writes the token and its (unfiltered) logp. Two ways:
// - no top-k or top-p (min-p or nothing: the cut needs only the row max), three launches over
//   parts of SP_PART ids of every row, a block per (part, row): sample_parts (each part's max
//   and Σ e^{x − max}), sample_part_mass (lse from the parts, each part's kept mass), then
//   sample_pick, a block per row: the part where the cumulative mass crosses u·Σ, and the
//   token within it by `draw_in_range`. One block per row reading all of V = 151,936 logits
//   took 123 µs for 64 rows on an H200 (2026-11-27, 1,024 threads): a row's passes are
//   latency-bound within one SM; parts spread them over the card.
// - top-k or top-p: one block per row (sample_inverse_cdf), the cuts by bisection (32 passes
//   over the row each), then `draw_in_range` over the whole row. blockDim.x = DS_THREADS.
#ifndef DS_THREADS  // tools/cuda_emu builds it smaller too: the scan must not depend on it
#define DS_THREADS 1024
#endif
// Threads of the three part kernels' blocks (decode_cuda.rs launches 256; tools/cuda_emu may
// build it smaller: the kernels do not depend on it).
#ifndef SP_THREADS
#define SP_THREADS 256
#endif

// A float's position in the total order of floats, as an unsigned key (larger float, larger key).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Block-wide sums of floats or doubles (every thread gets the result); `part` holds a slot per
// warp.
template <typename A>
__device__ A ds_block_sum(A v, A* part) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  A total = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += part[w];
  __syncthreads();  // `part` is reused by the next call
  return total;
}

// The smallest x the filters keep, as transformers' warpers apply them (temperature, top-k,
// top-p over the top-k set, min-p), each keeping ties at its boundary: the largest of the
// k-th largest x; the largest t with Σ_{x ≥ t, x ≥ cut_k} e^{x−m} ≥ top_p · Σ_{x ≥ cut_k} e^{x−m};
// m + ln(min_p). The first two are found exactly by bisection over the 32 bits of the floats'
// order keys (32 passes over the row each). −∞ keeps everything.
template <typename T>
__device__ float filter_cut(const T* x, int v, float inv_t, float m, int top_k, float top_p,
                            float min_p, double* part) {
  const int tid = threadIdx.x;
  float cut_k = -INFINITY;
  if (top_k > 0 && top_k < v) {
    uint32_t key = 0;
    for (int bit = 31; bit >= 0; bit--) {
      const uint32_t cand = key | (1u << bit);
      double count = 0.0;
      for (int i = tid; i < v; i += blockDim.x) count += order_key(to_f(x[i]) * inv_t) >= cand;
      if (ds_block_sum(count, part) >= (double)top_k) key = cand;
    }
    cut_k = key_value(key);
  }
  float cut = cut_k;
  if (top_p < 1.f) {
    double mass_k = 0.0;
    for (int i = tid; i < v; i += blockDim.x) {
      const float xi = to_f(x[i]) * inv_t;
      if (xi >= cut_k) mass_k += (double)expf(xi - m);
    }
    const double target = (double)top_p * ds_block_sum(mass_k, part);
    uint32_t key = 0;
    for (int bit = 31; bit >= 0; bit--) {
      const uint32_t cand = key | (1u << bit);
      double mass = 0.0;
      for (int i = tid; i < v; i += blockDim.x) {
        const float xi = to_f(x[i]) * inv_t;
        if (xi >= cut_k && order_key(xi) >= cand) mass += (double)expf(xi - m);
      }
      if (ds_block_sum(mass, part) >= target) key = cand;
    }
    cut = fmaxf(cut, key_value(key));
  }
  if (min_p > 0.f) cut = fmaxf(cut, m + logf(min_p));
  return cut;
}

// Block-wide max of floats (every thread gets the result); `part` holds a slot per warp.
__device__ float ds_block_max(float v, float* part) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float r = -INFINITY;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) r = fmaxf(r, part[w]);
  __syncthreads();  // `part` is reused by the next call
  return r;
}

// The token at `target` in the kept mass of x[lo, hi) (x the row's logits; p = e^{x·inv_t −
// lse}, kept when x·inv_t ≥ cut; f64 sums), `base` the kept mass before lo. Thread t owns the
// ids of segment t (contiguous, ⌈(hi − lo) / blockDim⌉ each): segment sums, a block-wide scan
// of them, then the owning thread walks its segment to the first kept id with p > 0 whose
// cumulative mass exceeds the target; a target past the range (rounding) takes its last kept
// id with p > 0. Writes the token and its unfiltered log-prob x·inv_t − lse.
template <typename T>
__device__ void draw_in_range(const T* x, int lo_range, int hi_range, float inv_t, float cut,
                              float lse, double base, double target, uint32_t* token,
                              float* logprob) {
  __shared__ double dr_part[32];
  __shared__ double dr_warp_base[32];
  __shared__ int dr_found, dr_last_with_mass;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = blockDim.x >> 5;
  const int per = (hi_range - lo_range + blockDim.x - 1) / blockDim.x;
  const int lo = min(hi_range, lo_range + tid * per), hi = min(hi_range, lo + per);
  double s = 0.0;
  for (int i = lo; i < hi; i++) {
    const float xi = to_f(x[i]) * inv_t;
    if (xi >= cut) s += (double)expf(xi - lse);
  }
  // The mass before and after segment t: inclusive scans of the segment sums within each warp,
  // then over the warps' totals, exclusive prefixes taken by shuffles (not subtraction) so a
  // segment's `after` is its successor's `before` exactly.
  double incl = s;
  for (int o = 1; o < 32; o <<= 1) {
    const double up = __shfl_up_sync(FULL_MASK, incl, o);
    if (lane >= o) incl += up;
  }
  double excl = __shfl_up_sync(FULL_MASK, incl, 1);
  if (lane == 0) excl = 0.0;
  if (lane == 31) dr_part[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    double w_incl = lane < nwarps ? dr_part[lane] : 0.0;
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(FULL_MASK, w_incl, o);
      if (lane >= o) w_incl += up;
    }
    double w_excl = __shfl_up_sync(FULL_MASK, w_incl, 1);
    if (lane == 0) w_excl = 0.0;
    dr_warp_base[lane] = base + w_excl;
    if (lane == 0) {
      dr_found = 0x7fffffff;
      dr_last_with_mass = 0;
    }
  }
  __syncthreads();
  const double before = dr_warp_base[warp] + excl, after = dr_warp_base[warp] + incl;
  // The target's segment is the first whose mass ends past it, else (rounding) the last one
  // with mass.
  if (after > before) {
    atomicMax(&dr_last_with_mass, tid);
    if (after > target) atomicMin(&dr_found, tid);
  }
  __syncthreads();
  if (tid == (dr_found != 0x7fffffff ? dr_found : dr_last_with_mass)) {
    double acc = before;
    int pick = -1, last = lo;
    for (int i = lo; i < hi; i++) {
      const float xi = to_f(x[i]) * inv_t;
      const float p = xi >= cut ? expf(xi - lse) : 0.f;
      if (p > 0.f) last = i;
      acc += (double)p;
      if (acc > target && p > 0.f) {
        pick = i;
        break;
      }
    }
    if (pick < 0) pick = last;
    *token = (uint32_t)pick;
    *logprob = to_f(x[pick]) * inv_t - lse;
  }
  __syncthreads();  // the shared state is reused by the next call
}

// Top-k or top-p: one block of DS_THREADS per row.
template <typename T>
__device__ void sample_inverse_cdf(const T* __restrict__ logits,
                                   const double* __restrict__ uniforms, float inv_t,
                                   uint32_t* __restrict__ tokens, float* __restrict__ logprobs,
                                   int v, int top_k, float top_p, float min_p) {
  __shared__ float part[DS_THREADS / 32];
  __shared__ double dpart[DS_THREADS / 32];
  const int row = blockIdx.x, tid = threadIdx.x;
  const T* x = logits + (size_t)row * v;

  float m = -INFINITY;
  for (int i = tid; i < v; i += blockDim.x) m = fmaxf(m, to_f(x[i]) * inv_t);
  m = ds_block_max(m, part);
  float z = 0.f;
  for (int i = tid; i < v; i += blockDim.x) z += expf(to_f(x[i]) * inv_t - m);
  const float lse = logf(ds_block_sum(z, part)) + m;
  const float cut = filter_cut(x, v, inv_t, m, top_k, top_p, min_p, dpart);
  double kept = 0.0;
  for (int i = tid; i < v; i += blockDim.x) {
    const float xi = to_f(x[i]) * inv_t;
    if (xi >= cut) kept += (double)expf(xi - lse);
  }
  const double target = uniforms[row] * ds_block_sum(kept, dpart);
  draw_in_range(x, 0, v, inv_t, cut, lse, 0.0, target, tokens + row, logprobs + row);
}

// The row's lse from its parts' maxima and exp-sums (in part order: every block of the row
// gets the same bits), and the smallest x·inv_t its min-p filter keeps (−∞ without one).
__device__ float parts_lse(const float* part_m, const float* part_s, int parts, float min_p,
                           float* cut) {
  float m = -INFINITY;
  for (int p = 0; p < parts; p++) m = fmaxf(m, part_m[p]);
  float z = 0.f;
  for (int p = 0; p < parts; p++)
    if (part_s[p] > 0.f) z += part_s[p] * expf(part_m[p] - m);
  *cut = min_p > 0.f ? m + logf(min_p) : -INFINITY;
  return logf(z) + m;
}

// Part p (blockIdx.x) of row blockIdx.y: its max x·inv_t and Σ e^{x·inv_t − max} into
// part_m / part_s [rows, parts]. blockDim.x = SP_THREADS.
template <typename T>
__device__ void sample_parts(const T* __restrict__ logits, float inv_t, float* __restrict__ part_m,
                             float* __restrict__ part_s, int v, int part_len, int parts) {
  __shared__ float red[32];
  const int p = blockIdx.x, row = blockIdx.y;
  const int lo = p * part_len, hi = min(v, lo + part_len);
  const T* x = logits + (size_t)row * v;
  float m = -INFINITY;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) m = fmaxf(m, to_f(x[i]) * inv_t);
  m = ds_block_max(m, red);
  float z = 0.f;
  if (m > -INFINITY)
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) z += expf(to_f(x[i]) * inv_t - m);
  z = ds_block_sum(z, red);
  if (threadIdx.x == 0) {
    part_m[(size_t)row * parts + p] = m;
    part_s[(size_t)row * parts + p] = z;
  }
}

// Part p (blockIdx.x) of row blockIdx.y: its kept mass Σ e^{x·inv_t − lse} (f64, x·inv_t ≥
// the min-p cut m + ln min_p, or all) into part_mass [rows, parts]. blockDim.x = SP_THREADS.
template <typename T>
__device__ void sample_part_mass(const T* __restrict__ logits, float inv_t,
                                 const float* __restrict__ part_m,
                                 const float* __restrict__ part_s,
                                 double* __restrict__ part_mass, int v, int part_len, int parts,
                                 float min_p) {
  __shared__ double red[32];
  const int p = blockIdx.x, row = blockIdx.y;
  const int lo = p * part_len, hi = min(v, lo + part_len);
  const T* x = logits + (size_t)row * v;
  float cut;
  const float lse =
      parts_lse(part_m + (size_t)row * parts, part_s + (size_t)row * parts, parts, min_p, &cut);
  double mass = 0.0;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float xi = to_f(x[i]) * inv_t;
    if (xi >= cut) mass += (double)expf(xi - lse);
  }
  mass = ds_block_sum(mass, red);
  if (threadIdx.x == 0) part_mass[(size_t)row * parts + p] = mass;
}

// Row blockIdx.x: the first part whose cumulative kept mass exceeds u·Σ (else, rounding, the
// last with mass), then the token within it. blockDim.x = SP_THREADS.
template <typename T>
__device__ void sample_pick(const T* __restrict__ logits, const double* __restrict__ uniforms,
                            float inv_t, const float* __restrict__ part_m,
                            const float* __restrict__ part_s,
                            const double* __restrict__ part_mass, uint32_t* __restrict__ tokens,
                            float* __restrict__ logprobs, int v, int part_len, int parts,
                            float min_p) {
  __shared__ int chosen;
  __shared__ double chosen_base, chosen_target;
  const int row = blockIdx.x;
  const T* x = logits + (size_t)row * v;
  const double* mass = part_mass + (size_t)row * parts;
  float cut;
  const float lse =
      parts_lse(part_m + (size_t)row * parts, part_s + (size_t)row * parts, parts, min_p, &cut);
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int p = 0; p < parts; p++) total += mass[p];
    const double target = uniforms[row] * total;
    // The first part with mass whose cumulative mass ends past the target, else (rounding)
    // the last with mass; `base` the mass before it.
    double before = 0.0, base = 0.0;
    int pick = 0;
    for (int p = 0; p < parts; p++) {
      if (mass[p] > 0.0) {
        pick = p;
        base = before;
        if (before + mass[p] > target) break;
      }
      before += mass[p];
    }
    chosen = pick;
    chosen_base = base;
    chosen_target = target;
  }
  __syncthreads();
  const int lo = chosen * part_len, hi = min(v, lo + part_len);
  draw_in_range(x, lo, hi, inv_t, cut, lse, chosen_base, chosen_target, tokens + row,
                logprobs + row);
}
