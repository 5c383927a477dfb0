// CUDA kernels of the causal var-len GQA flash attention (ops/attention.rs), forward and
// backward, f32 and bf16 with f32 accumulation. CPU twin: attention_cpu.rs (tests/ops_attention.rs
// compares both with the composition; tools/cuda_emu runs this file on CPU threads). Built to its
// own PTX by crates/model/build.rs (`--features cuda`); launched by attention_cuda.rs.
#include "cuda_common.cuh"

// ---- Causal variable-length grouped-query attention, flash style (ops/attention.rs) ----
// q [n, hq, d], k/v [n, hkv, d] packed tokens; cu [n_cu] int32 segment offsets (0, …, n):
// query i of segment [s, e) attends keys s..=i; query head h uses key/value head
// h / (hq / hkv). lse and delta are [n, hq] f32. No [n, n] buffer exists: every kernel walks
// tiles of keys (or queries) through shared memory, and each output element is owned by one
// lane that sums in a fixed order (deterministic, no atomics). Four warps per block; a warp
// owns RPW rows (query rows, or key rows in the ∂K/∂V kernel), keeping their accumulators in
// registers, lane t holding columns t, t + 32, … (DC = ⌈d/32⌉ of them). Shared tiles are f32;
// a transposed tile is stored [d][tile + 1], so that both a lane per row (fixed column) and a
// lane per column (fixed row) read distinct banks. The tile sizes are fixed per d class (d ≤
// 64, 128, 256) so that every kernel's shared memory stays within 48 KiB; the launchers in
// attention_cuda.rs hold the same table and pass the block's row count and the shared memory
// size, both checked here (a mismatch traps: a launch error, not a silent overflow).
// bf16 at head_dim 64 and 128 (Qwen's) runs the tensor-core versions, attention_tc_kernels.cuh
// included at the end (varlen_attn_*_tc: the same contract and split, every product on
// mma.sync).
#define ATT_WARPS 4

// Every kernel checks its shared-memory layout against dynamic_smem_bytes() (cuda_common.cuh):
// the launchers size it from their own copy of the tile table.

// The segment of token i: the largest s with cu[s] <= i (so cu[s] <= i < cu[s + 1], empty
// segments skipped), for 0 <= i < cu[n_cu - 1].
__device__ __forceinline__ int seg_of(const int* cu, int n_cu, int i) {
  int lo = 0, hi = n_cu - 1;  // cu[lo] <= i < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (cu[mid] <= i) lo = mid; else hi = mid;
  }
  return lo;
}

// acc[r][c] += Σ_{jj < jn} w_r(jj)·src[jj·j_stride + c·c_stride] for the columns c = lane + 32t
// a lane owns, where w_r(jj) is lane jj's w[r] (a warp-wide weight row: the forward's P·V over
// a row-major V tile, ∂Q's dS·K over a transposed K tile).
template <int RPW, int DC>
__device__ __forceinline__ void accumulate_shuffled(const float* src, int j_stride, int c_stride,
                                                    const float (&w)[RPW], int jn, int d,
                                                    int lane, float (&acc)[RPW][DC]) {
  for (int jj = 0; jj < jn; ++jj) {
    float sv[DC];
#pragma unroll
    for (int t = 0; t < DC; ++t) {
      const int c = lane + 32 * t;
      sv[t] = c < d ? src[jj * j_stride + c * c_stride] : 0.f;
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const float wj = __shfl_sync(FULL_MASK, w[r], jj);
#pragma unroll
      for (int t = 0; t < DC; ++t) acc[r][t] += wj * sv[t];
    }
  }
}

// Forward: block = BQ = 4·RPW query rows of head blockIdx.y; keys in tiles of BK from the
// first row's segment start to the last row. Lane = key for the scores (q broadcast from
// qs, k from the transposed kt), lane = column for the output (p shuffled, v from vs).
// Online softmax per row: running max m, normaliser l; out = acc / l, lse = m + ln l.
template <typename T, int DC, int RPW, int BK>
__device__ void varlen_attn_fwd(const T* q, const T* k, const T* v, const int* cu, int n_cu,
                                T* out, float* lse, int n, int hq, int hkv, int d, float scale,
                                int block_rows) {
  constexpr int BQ = ATT_WARPS * RPW;
  if (block_rows != BQ || d > 32 * DC || blockDim.x != 32 * ATT_WARPS ||
      dynamic_smem_bytes() < 4u * (BQ * d + d * (BK + 1) + BK * d))
    __trap();
  extern __shared__ float smem[];
  float* qs = smem;               // [BQ][d], q · scale
  float* kt = qs + BQ * d;        // [d][BK + 1]
  float* vs = kt + d * (BK + 1);  // [BK][d]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.y, g = h / (hq / hkv);
  const int i0 = blockIdx.x * BQ;
  if (i0 >= n) return;
  const int i_last = min(i0 + BQ, n) - 1;
  const int k_begin = cu[seg_of(cu, n_cu, i0)];
  for (int e = threadIdx.x; e < BQ * d; e += blockDim.x) {
    const int i = i0 + e / d;
    qs[e] = i < n ? to_f(q[((size_t)i * hq + h) * d + e % d]) * scale : 0.f;
  }
  int row[RPW], row_s[RPW];
  float m[RPW], l[RPW], acc[RPW][DC];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    row[r] = i0 + warp * RPW + r;
    row_s[r] = row[r] < n ? cu[seg_of(cu, n_cu, row[r])] : 0;
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int t = 0; t < DC; ++t) acc[r][t] = 0.f;
  }
  const int kl = lane < BK ? lane : 0;  // lanes past the tile read a valid slot, unused
  for (int j0 = k_begin; j0 <= i_last; j0 += BK) {
    __syncthreads();  // the previous tile is consumed (and qs is written, the first time)
    for (int e = threadIdx.x; e < BK * d; e += blockDim.x) {
      const int jj = e / d, c = e % d, j = j0 + jj;
      float kv = 0.f, vv = 0.f;
      if (j <= i_last) {
        const size_t at = ((size_t)j * hkv + g) * d + c;
        kv = to_f(k[at]);
        vv = to_f(v[at]);
      }
      kt[c * (BK + 1) + jj] = kv;
      vs[jj * d + c] = vv;
    }
    __syncthreads();
    float s[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) s[r] = 0.f;
    if ((d & 3) == 0) {  // rows of qs are 16-byte aligned: broadcast float4 reads
      for (int c = 0; c < d; c += 4) {
        float kv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) kv[u] = kt[(c + u) * (BK + 1) + kl];
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const float4 qv = *reinterpret_cast<const float4*>(qs + (warp * RPW + r) * d + c);
          s[r] += qv.x * kv[0] + qv.y * kv[1] + qv.z * kv[2] + qv.w * kv[3];
        }
      }
    } else {
      for (int c = 0; c < d; ++c) {
        const float kv = kt[c * (BK + 1) + kl];
#pragma unroll
        for (int r = 0; r < RPW; ++r) s[r] += qs[(warp * RPW + r) * d + c] * kv;
      }
    }
    const int j = j0 + lane;
    float p[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      p[r] = 0.f;
      // Warp-uniform: whether the tile holds any key of this row (then m_new is finite).
      if (row[r] >= n || j0 > row[r] || j0 + BK <= row_s[r]) continue;
      const bool valid = lane < BK && j >= row_s[r] && j <= row[r];
      const float sv = valid ? s[r] : -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(sv));
      const float corr = expf(m[r] - m_new);  // 0 while m[r] is still −∞
      p[r] = valid ? expf(sv - m_new) : 0.f;
      l[r] = l[r] * corr + warp_sum(p[r]);
      m[r] = m_new;
#pragma unroll
      for (int t = 0; t < DC; ++t) acc[r][t] *= corr;
    }
    accumulate_shuffled<RPW, DC>(vs, d, 1, p, min(BK, i_last + 1 - j0), d, lane, acc);
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    if (row[r] >= n) continue;
    const size_t base = ((size_t)row[r] * hq + h) * d;
    const float inv = 1.f / l[r];
#pragma unroll
    for (int t = 0; t < DC; ++t) {
      const int c = lane + 32 * t;
      if (c < d) out[base + c] = from_f<T>(acc[r][t] * inv);
    }
    if (lane == 0) lse[(size_t)row[r] * hq + h] = m[r] + logf(l[r]);
  }
}

// delta[i, h] = Σ_c ∂O·O over the row; one warp per row.
template <typename T>
__device__ void varlen_attn_delta(const T* dout, const T* o, float* delta, int rows, int d) {
  const int row = blockIdx.x * ATT_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;
  const size_t base = (size_t)row * d;
  float a = 0.f;
  for (int c = lane; c < d; c += 32) a += to_f(dout[base + c]) * to_f(o[base + c]);
  a = warp_sum(a);
  if (lane == 0) delta[row] = a;
}

// The backward's two score products for the RPW rows `row0..` a warp owns: s[r] = a_r·A[:, col]
// and dp[r] = b_r·B[:, col], with `rows_a`/`rows_b` row-major [·, d] in shared memory and
// `cols_a`/`cols_b` transposed tiles (column c at c·stride). ∂Q's kernel passes (Q, dO) rows
// against (K, V) tiles, ∂K/∂V's (K, V) rows against (Q, dO) tiles: the same products, summed
// in the same order, so both kernels recompute bit-identical scores.
template <int RPW>
__device__ __forceinline__ void paired_dots(const float* rows_a, const float* rows_b,
                                            const float* cols_a, const float* cols_b, int stride,
                                            int col, int row0, int d, float* s, float* dp) {
#pragma unroll
  for (int r = 0; r < RPW; ++r) s[r] = dp[r] = 0.f;
  if ((d & 3) == 0) {  // rows are 16-byte aligned: broadcast float4 reads
    for (int c = 0; c < d; c += 4) {
      float av[4], bv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        av[u] = cols_a[(c + u) * stride + col];
        bv[u] = cols_b[(c + u) * stride + col];
      }
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float4 ar = *reinterpret_cast<const float4*>(rows_a + (row0 + r) * d + c);
        const float4 br = *reinterpret_cast<const float4*>(rows_b + (row0 + r) * d + c);
        s[r] += ar.x * av[0] + ar.y * av[1] + ar.z * av[2] + ar.w * av[3];
        dp[r] += br.x * bv[0] + br.y * bv[1] + br.z * bv[2] + br.w * bv[3];
      }
    }
  } else {
    for (int c = 0; c < d; ++c) {
      const float av = cols_a[c * stride + col], bv = cols_b[c * stride + col];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        s[r] += rows_a[(row0 + r) * d + c] * av;
        dp[r] += rows_b[(row0 + r) * d + c] * bv;
      }
    }
  }
}

// ∂Q: block = BQ = 4·RPW query rows of head blockIdx.y, key tiles as in the forward. Lane =
// key: p = exp(q·k·scale − lse), ∂S = p·(∂O·v − delta); lane = column: ∂Q += ∂S·k·scale.
template <typename T, int DC, int RPW, int BK>
__device__ void varlen_attn_bwd_dq(const T* q, const T* k, const T* v, const T* dout,
                                   const float* lse, const float* delta, const int* cu, int n_cu,
                                   T* dq, int n, int hq, int hkv, int d, float scale,
                                   int block_rows) {
  constexpr int BQ = ATT_WARPS * RPW;
  if (block_rows != BQ || d > 32 * DC || blockDim.x != 32 * ATT_WARPS ||
      dynamic_smem_bytes() < 4u * (2 * BQ * d + 2 * d * (BK + 1)))
    __trap();
  extern __shared__ float smem[];
  float* qs = smem;               // [BQ][d], q · scale
  float* dos = qs + BQ * d;       // [BQ][d]
  float* kt = dos + BQ * d;       // [d][BK + 1]
  float* vt = kt + d * (BK + 1);  // [d][BK + 1]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.y, g = h / (hq / hkv);
  const int i0 = blockIdx.x * BQ;
  if (i0 >= n) return;
  const int i_last = min(i0 + BQ, n) - 1;
  const int k_begin = cu[seg_of(cu, n_cu, i0)];
  for (int e = threadIdx.x; e < BQ * d; e += blockDim.x) {
    const int i = i0 + e / d;
    const size_t at = ((size_t)i * hq + h) * d + e % d;
    qs[e] = i < n ? to_f(q[at]) * scale : 0.f;
    dos[e] = i < n ? to_f(dout[at]) : 0.f;
  }
  int row[RPW], row_s[RPW];
  float row_lse[RPW], row_delta[RPW], acc[RPW][DC];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    row[r] = i0 + warp * RPW + r;
    const bool in = row[r] < n;
    row_s[r] = in ? cu[seg_of(cu, n_cu, row[r])] : 0;
    row_lse[r] = in ? lse[(size_t)row[r] * hq + h] : 0.f;
    row_delta[r] = in ? delta[(size_t)row[r] * hq + h] : 0.f;
#pragma unroll
    for (int t = 0; t < DC; ++t) acc[r][t] = 0.f;
  }
  const int kl = lane < BK ? lane : 0;
  for (int j0 = k_begin; j0 <= i_last; j0 += BK) {
    __syncthreads();
    for (int e = threadIdx.x; e < BK * d; e += blockDim.x) {
      const int jj = e / d, c = e % d, j = j0 + jj;
      float kv = 0.f, vv = 0.f;
      if (j <= i_last) {
        const size_t at = ((size_t)j * hkv + g) * d + c;
        kv = to_f(k[at]);
        vv = to_f(v[at]);
      }
      kt[c * (BK + 1) + jj] = kv;
      vt[c * (BK + 1) + jj] = vv;
    }
    __syncthreads();
    float s[RPW], dp[RPW];
    paired_dots<RPW>(qs, dos, kt, vt, BK + 1, kl, warp * RPW, d, s, dp);
    const int j = j0 + lane;
    float ds[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const bool valid = row[r] < n && lane < BK && j >= row_s[r] && j <= row[r];
      const float p = valid ? expf(s[r] - row_lse[r]) : 0.f;
      ds[r] = p * (dp[r] - row_delta[r]);
    }
    accumulate_shuffled<RPW, DC>(kt, 1, BK + 1, ds, min(BK, i_last + 1 - j0), d, lane, acc);
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    if (row[r] >= n) continue;
    const size_t base = ((size_t)row[r] * hq + h) * d;
#pragma unroll
    for (int t = 0; t < DC; ++t) {
      const int c = lane + 32 * t;
      if (c < d) dq[base + c] = from_f<T>(acc[r][t] * scale);
    }
  }
}

// ∂K, ∂V: block = BKV = 4·RPW key rows of key/value head blockIdx.y; for each query head of
// the group, query tiles of BQ from the block's first key to the end of its last key's
// segment. Lane = query: p = exp(q·k·scale − lse), ∂S = p·(∂O·v − delta); lane = column:
// ∂V += p·∂O, ∂K += ∂S·q·scale. Heads, then query tiles, in order: a fixed summation order.
template <typename T, int DC, int RPW, int BQ>
__device__ void varlen_attn_bwd_dkv(const T* q, const T* k, const T* v, const T* dout,
                                    const float* lse, const float* delta, const int* cu,
                                    int n_cu, T* dk, T* dv, int n, int hq, int hkv, int d,
                                    float scale, int block_rows) {
  constexpr int BKV = ATT_WARPS * RPW;
  if (block_rows != BKV || d > 32 * DC || blockDim.x != 32 * ATT_WARPS ||
      dynamic_smem_bytes() < 4u * (2 * BKV * d + 2 * d * (BQ + 1) + 2 * BQ))
    __trap();
  extern __shared__ float smem[];
  float* ks = smem;                // [BKV][d]
  float* vs = ks + BKV * d;        // [BKV][d]
  float* qt = vs + BKV * d;        // [d][BQ + 1], q · scale
  float* dot = qt + d * (BQ + 1);  // [d][BQ + 1]
  float* lse_s = dot + d * (BQ + 1);
  float* delta_s = lse_s + BQ;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = blockIdx.y, n_rep = hq / hkv;
  const int j0 = blockIdx.x * BKV;
  if (j0 >= n) return;
  const int j_last = min(j0 + BKV, n) - 1;
  const int q_end = cu[seg_of(cu, n_cu, j_last) + 1];
  for (int e = threadIdx.x; e < BKV * d; e += blockDim.x) {
    const int j = j0 + e / d;
    const size_t at = ((size_t)j * hkv + g) * d + e % d;
    ks[e] = j < n ? to_f(k[at]) : 0.f;
    vs[e] = j < n ? to_f(v[at]) : 0.f;
  }
  int key[RPW], key_e[RPW];
  float ak[RPW][DC], av[RPW][DC];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    key[r] = j0 + warp * RPW + r;
    key_e[r] = key[r] < n ? cu[seg_of(cu, n_cu, key[r]) + 1] : 0;
#pragma unroll
    for (int t = 0; t < DC; ++t) ak[r][t] = av[r][t] = 0.f;
  }
  const int ql = lane < BQ ? lane : 0;
  for (int hr = 0; hr < n_rep; ++hr) {
    const int h = g * n_rep + hr;
    for (int i0 = j0; i0 < q_end; i0 += BQ) {
      __syncthreads();  // the previous tile is consumed (and ks/vs are written)
      for (int e = threadIdx.x; e < BQ * d; e += blockDim.x) {
        const int ii = e / d, c = e % d, i = i0 + ii;
        float qv = 0.f, ov = 0.f;
        if (i < q_end) {
          const size_t at = ((size_t)i * hq + h) * d + c;
          qv = to_f(q[at]) * scale;
          ov = to_f(dout[at]);
        }
        qt[c * (BQ + 1) + ii] = qv;
        dot[c * (BQ + 1) + ii] = ov;
      }
      for (int ii = threadIdx.x; ii < BQ; ii += blockDim.x) {
        const int i = i0 + ii;
        lse_s[ii] = i < q_end ? lse[(size_t)i * hq + h] : 0.f;
        delta_s[ii] = i < q_end ? delta[(size_t)i * hq + h] : 0.f;
      }
      __syncthreads();
      float s[RPW], dp[RPW];
      paired_dots<RPW>(ks, vs, qt, dot, BQ + 1, ql, warp * RPW, d, s, dp);
      const int i = i0 + lane;
      float p[RPW], ds[RPW];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const bool valid = key[r] < n && lane < BQ && i >= key[r] && i < key_e[r];
        p[r] = valid ? expf(s[r] - lse_s[ql]) : 0.f;
        ds[r] = p[r] * (dp[r] - delta_s[ql]);
      }
      const int in_ = min(BQ, q_end - i0);
      for (int ii = 0; ii < in_; ++ii) {
        float qv[DC], ov[DC];
#pragma unroll
        for (int t = 0; t < DC; ++t) {
          const int c = lane + 32 * t;
          qv[t] = c < d ? qt[c * (BQ + 1) + ii] : 0.f;
          ov[t] = c < d ? dot[c * (BQ + 1) + ii] : 0.f;
        }
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const float pj = __shfl_sync(FULL_MASK, p[r], ii);
          const float dsj = __shfl_sync(FULL_MASK, ds[r], ii);
#pragma unroll
          for (int t = 0; t < DC; ++t) {
            av[r][t] += pj * ov[t];
            ak[r][t] += dsj * qv[t];
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    if (key[r] >= n) continue;
    const size_t base = ((size_t)key[r] * hkv + g) * d;
#pragma unroll
    for (int t = 0; t < DC; ++t) {
      const int c = lane + 32 * t;
      if (c < d) {
        dk[base + c] = from_f<T>(ak[r][t]);
        dv[base + c] = from_f<T>(av[r][t]);
      }
    }
  }
}

// Tile table (d class: DC, forward RPW/BK, ∂Q RPW/BK, ∂K∂V RPW/BQ); attention_cuda.rs has
// the same numbers for the grid and the shared memory size.
#define ATT_INSTANTIATE_D(T, SFX, DMAX, DC, F_RPW, F_BK, Q_RPW, Q_BK, KV_RPW, KV_BQ)             \
  extern "C" __global__ void varlen_attn_fwd_d##DMAX##_##SFX(                                    \
      const T* q, const T* k, const T* v, const int* cu, int n_cu, T* out, float* lse, int n,     \
      int hq, int hkv, int d, float scale, int block_rows) {                                      \
    varlen_attn_fwd<T, DC, F_RPW, F_BK>(q, k, v, cu, n_cu, out, lse, n, hq, hkv, d, scale,        \
                                        block_rows);                                              \
  }                                                                                               \
  extern "C" __global__ void varlen_attn_bwd_dq_d##DMAX##_##SFX(                                 \
      const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,    \
      const int* cu, int n_cu, T* dq, int n, int hq, int hkv, int d, float scale,                 \
      int block_rows) {                                                                           \
    varlen_attn_bwd_dq<T, DC, Q_RPW, Q_BK>(q, k, v, dout, lse, delta, cu, n_cu, dq, n, hq, hkv,   \
                                           d, scale, block_rows);                                 \
  }                                                                                               \
  extern "C" __global__ void varlen_attn_bwd_dkv_d##DMAX##_##SFX(                                \
      const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,    \
      const int* cu, int n_cu, T* dk, T* dv, int n, int hq, int hkv, int d, float scale,          \
      int block_rows) {                                                                           \
    varlen_attn_bwd_dkv<T, DC, KV_RPW, KV_BQ>(q, k, v, dout, lse, delta, cu, n_cu, dk, dv, n, hq, \
                                              hkv, d, scale, block_rows);                         \
  }

#define ATT_INSTANTIATE(T, SFX)                                                                   \
  ATT_INSTANTIATE_D(T, SFX, 64, 2, 8, 32, 8, 32, 8, 32)                                           \
  ATT_INSTANTIATE_D(T, SFX, 128, 4, 6, 32, 3, 32, 3, 32)                                          \
  ATT_INSTANTIATE_D(T, SFX, 256, 8, 3, 16, 1, 16, 1, 16)                                          \
  extern "C" __global__ void varlen_attn_delta_##SFX(const T* dout, const T* o, float* delta,    \
                                                     int rows, int d) {                           \
    varlen_attn_delta<T>(dout, o, delta, rows, d);                                                \
  }

ATT_INSTANTIATE(float, f32)
ATT_INSTANTIATE(bf16, bf16)

// The tensor-core kernels (bf16, head_dim 64 and 128).
#include "attention_tc_kernels.cuh"
