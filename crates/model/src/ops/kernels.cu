// CUDA kernels of the training ops (crates/model/src/ops): RMSNorm, RoPE, SwiGLU and the
// masked softmax of attention, forward and backward, for f32 and bf16 tensors. Every kernel
// reads and writes the tensor's dtype and computes in f32. Their CPU twins are the `cpu_fwd`
// of the same candle custom ops (tested in CI); tools/gpu_check.sh runs the CUDA tests.
// Built to PTX by crates/model/build.rs (`--features cuda`).
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) total = v;
  }
  __syncthreads();
  const float r = total;
  __syncthreads();
  return r;
}

__device__ float block_max(float v) {
  __shared__ float part[32];
  __shared__ float total;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? part[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) total = v;
  }
  __syncthreads();
  const float r = total;
  __syncthreads();
  return r;
}

// ---- RMSNorm: y = T(x·r)·w with r = 1/√(mean(x²) + ε), one block per row ----
template <typename T>
__device__ void rms_norm_fwd(const T* x, const T* w, T* y, int rows, int d, float eps) {
  const int row = blockIdx.x;
  if (row >= rows) return;
  const T* xr = x + (size_t)row * d;
  T* yr = y + (size_t)row * d;
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = to_f(xr[i]);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss) / d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    // Rounded to T before the weight, as the composed op (and transformers) does.
    const float n = to_f(from_f<T>(to_f(xr[i]) * r));
    yr[i] = from_f<T>(n * to_f(w[i]));
  }
}

// dx = r·g − x·r³·(Σ g·x)/D with g = dy·w; one block per row.
template <typename T>
__device__ void rms_norm_bwd_dx(const T* x, const T* w, const T* dy, T* dx, int rows, int d,
                                float eps) {
  const int row = blockIdx.x;
  if (row >= rows) return;
  const T* xr = x + (size_t)row * d;
  const T* gr = dy + (size_t)row * d;
  float ss = 0.f, gx = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = to_f(xr[i]);
    ss += v * v;
    gx += to_f(gr[i]) * to_f(w[i]) * v;
  }
  const float r = rsqrtf(block_sum(ss) / d + eps);
  const float c = r * r * r * block_sum(gx) / d;
  T* out = dx + (size_t)row * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    out[i] = from_f<T>(r * to_f(gr[i]) * to_f(w[i]) - to_f(xr[i]) * c);
}

// dw += Σ_rows dy·x·r into f32 `dw` (zeroed by the caller): each block strides over rows,
// accumulating per column in shared memory (d floats), then adds its partial sums.
template <typename T>
__device__ void rms_norm_bwd_dw(const T* x, const T* dy, float* dw, int rows, int d, float eps) {
  extern __shared__ float acc[];
  for (int i = threadIdx.x; i < d; i += blockDim.x) acc[i] = 0.f;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + (size_t)row * d;
    const T* gr = dy + (size_t)row * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      const float v = to_f(xr[i]);
      ss += v * v;
    }
    const float r = rsqrtf(block_sum(ss) / d + eps);
    // Each thread owns the same columns in every row: no race on acc.
    for (int i = threadIdx.x; i < d; i += blockDim.x) acc[i] += to_f(gr[i]) * to_f(xr[i]) * r;
  }
  for (int i = threadIdx.x; i < d; i += blockDim.x) atomicAdd(&dw[i], acc[i]);
}

template <typename T>
__device__ void cast_from_f32(const float* src, T* dst, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = from_f<T>(src[i]);
}

// ---- RoPE (rotate-half) of x [N, H, D] with cos/sin [N, D/2]; sign = −1 rotates back ----
template <typename T>
__device__ void rope(const T* x, const T* cos, const T* sin, T* y, int n, int h, int d,
                     float sign) {
  const int half = d / 2;
  const size_t total = (size_t)n * h * half;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (size_t)gridDim.x * blockDim.x) {
    const int i = (int)(e % half);
    const size_t tok_head = e / half;
    const size_t tok = tok_head / h;
    const size_t base = tok_head * d;
    const float c = to_f(cos[tok * half + i]);
    const float s = sign * to_f(sin[tok * half + i]);
    const float x1 = to_f(x[base + i]), x2 = to_f(x[base + i + half]);
    y[base + i] = from_f<T>(x1 * c - x2 * s);
    y[base + i + half] = from_f<T>(x2 * c + x1 * s);
  }
}

// ---- SwiGLU: y = silu(g)·u; backward writes [∂g | ∂u] into one buffer of 2n ----
template <typename T>
__device__ void swiglu_fwd(const T* g, const T* u, T* y, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float gv = to_f(g[i]);
    const float s = 1.f / (1.f + __expf(-gv));
    y[i] = from_f<T>(gv * s * to_f(u[i]));
  }
}

template <typename T>
__device__ void swiglu_bwd(const T* g, const T* u, const T* dy, T* out, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float gv = to_f(g[i]), uv = to_f(u[i]), d = to_f(dy[i]);
    const float s = 1.f / (1.f + __expf(-gv));
    out[i] = from_f<T>(d * uv * s * (1.f + gv * (1.f - s)));
    out[n + i] = from_f<T>(d * gv * s);
  }
}

// ---- Softmax over the last axis of scores [rows, tk] plus an additive f32 mask ----
// Row r is query i = r % t of batch b = r / rows_per_batch; the mask is [mask_batches, t, tk]
// (mask_batches 1: shared by every batch), or absent (mask == nullptr).
template <typename T>
__device__ void masked_softmax_fwd(const T* s, const float* mask, T* p, int rows, int tk, int t,
                                   int rows_per_batch, int mask_batches) {
  const int row = blockIdx.x;
  if (row >= rows) return;
  const T* sr = s + (size_t)row * tk;
  T* pr = p + (size_t)row * tk;
  const float* mr = nullptr;
  if (mask) {
    const int b = mask_batches > 1 ? row / rows_per_batch : 0;
    mr = mask + ((size_t)b * t + row % t) * tk;
  }
  float m = -INFINITY;
  for (int j = threadIdx.x; j < tk; j += blockDim.x)
    m = fmaxf(m, to_f(sr[j]) + (mr ? mr[j] : 0.f));
  m = block_max(m);
  float z = 0.f;
  for (int j = threadIdx.x; j < tk; j += blockDim.x)
    z += __expf(to_f(sr[j]) + (mr ? mr[j] : 0.f) - m);
  const float inv = 1.f / block_sum(z);
  for (int j = threadIdx.x; j < tk; j += blockDim.x)
    pr[j] = from_f<T>(__expf(to_f(sr[j]) + (mr ? mr[j] : 0.f) - m) * inv);
}

// ∂s = p·(∂p − Σ_j ∂p_j·p_j), one block per row.
template <typename T>
__device__ void masked_softmax_bwd(const T* p, const T* dp, T* ds, int rows, int tk) {
  const int row = blockIdx.x;
  if (row >= rows) return;
  const T* pr = p + (size_t)row * tk;
  const T* gr = dp + (size_t)row * tk;
  float dot = 0.f;
  for (int j = threadIdx.x; j < tk; j += blockDim.x) dot += to_f(pr[j]) * to_f(gr[j]);
  dot = block_sum(dot);
  T* out = ds + (size_t)row * tk;
  for (int j = threadIdx.x; j < tk; j += blockDim.x)
    out[j] = from_f<T>(to_f(pr[j]) * (to_f(gr[j]) - dot));
}

#define INSTANTIATE(T, SFX)                                                                     \
  extern "C" __global__ void rms_norm_fwd_##SFX(const T* x, const T* w, T* y, int rows, int d,  \
                                                float eps) {                                    \
    rms_norm_fwd<T>(x, w, y, rows, d, eps);                                                     \
  }                                                                                             \
  extern "C" __global__ void rms_norm_bwd_dx_##SFX(const T* x, const T* w, const T* dy, T* dx,  \
                                                   int rows, int d, float eps) {                \
    rms_norm_bwd_dx<T>(x, w, dy, dx, rows, d, eps);                                             \
  }                                                                                             \
  extern "C" __global__ void rms_norm_bwd_dw_##SFX(const T* x, const T* dy, float* dw,         \
                                                   int rows, int d, float eps) {                \
    rms_norm_bwd_dw<T>(x, dy, dw, rows, d, eps);                                                \
  }                                                                                             \
  extern "C" __global__ void cast_from_f32_##SFX(const float* src, T* dst, int n) {            \
    cast_from_f32<T>(src, dst, n);                                                              \
  }                                                                                             \
  extern "C" __global__ void rope_##SFX(const T* x, const T* c, const T* s, T* y, int n, int h, \
                                        int d, float sign) {                                    \
    rope<T>(x, c, s, y, n, h, d, sign);                                                         \
  }                                                                                             \
  extern "C" __global__ void swiglu_fwd_##SFX(const T* g, const T* u, T* y, size_t n) {        \
    swiglu_fwd<T>(g, u, y, n);                                                                  \
  }                                                                                             \
  extern "C" __global__ void swiglu_bwd_##SFX(const T* g, const T* u, const T* dy, T* out,     \
                                              size_t n) {                                       \
    swiglu_bwd<T>(g, u, dy, out, n);                                                            \
  }                                                                                             \
  extern "C" __global__ void masked_softmax_fwd_##SFX(const T* s, const float* mask, T* p,     \
                                                      int rows, int tk, int t,                  \
                                                      int rows_per_batch, int mask_batches) {   \
    masked_softmax_fwd<T>(s, mask, p, rows, tk, t, rows_per_batch, mask_batches);               \
  }                                                                                             \
  extern "C" __global__ void masked_softmax_bwd_##SFX(const T* p, const T* dp, T* ds, int rows, \
                                                      int tk) {                                 \
    masked_softmax_bwd<T>(p, dp, ds, rows, tk);                                                 \
  }

INSTANTIATE(float, f32)
INSTANTIATE(bf16, bf16)

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
#define ATT_WARPS 4
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// Butterfly sum: every lane gets the same value (a + b == b + a in floating point).
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

// Bytes of dynamic shared memory the block was launched with (the kernels check that their
// layout fits: the launchers size it from their own copy of the tile table).
#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}
#else
__device__ unsigned dynamic_smem_bytes();
#endif

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
    const int jn = min(BK, i_last + 1 - j0);
    for (int jj = 0; jj < jn; ++jj) {
      float vv[DC];
#pragma unroll
      for (int t = 0; t < DC; ++t) {
        const int c = lane + 32 * t;
        vv[t] = c < d ? vs[jj * d + c] : 0.f;
      }
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float pj = __shfl_sync(FULL_MASK, p[r], jj);
#pragma unroll
        for (int t = 0; t < DC; ++t) acc[r][t] += pj * vv[t];
      }
    }
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
#pragma unroll
    for (int r = 0; r < RPW; ++r) s[r] = dp[r] = 0.f;
    if ((d & 3) == 0) {  // rows of qs and dos are 16-byte aligned: broadcast float4 reads
      for (int c = 0; c < d; c += 4) {
        float kv[4], vv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          kv[u] = kt[(c + u) * (BK + 1) + kl];
          vv[u] = vt[(c + u) * (BK + 1) + kl];
        }
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const float4 qv = *reinterpret_cast<const float4*>(qs + (warp * RPW + r) * d + c);
          const float4 ov = *reinterpret_cast<const float4*>(dos + (warp * RPW + r) * d + c);
          s[r] += qv.x * kv[0] + qv.y * kv[1] + qv.z * kv[2] + qv.w * kv[3];
          dp[r] += ov.x * vv[0] + ov.y * vv[1] + ov.z * vv[2] + ov.w * vv[3];
        }
      }
    } else {
      for (int c = 0; c < d; ++c) {
        const float kv = kt[c * (BK + 1) + kl], vv = vt[c * (BK + 1) + kl];
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          s[r] += qs[(warp * RPW + r) * d + c] * kv;
          dp[r] += dos[(warp * RPW + r) * d + c] * vv;
        }
      }
    }
    const int j = j0 + lane;
    float ds[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const bool valid = row[r] < n && lane < BK && j >= row_s[r] && j <= row[r];
      const float p = valid ? expf(s[r] - row_lse[r]) : 0.f;
      ds[r] = p * (dp[r] - row_delta[r]);
    }
    const int jn = min(BK, i_last + 1 - j0);
    for (int jj = 0; jj < jn; ++jj) {
      float kv[DC];
#pragma unroll
      for (int t = 0; t < DC; ++t) {
        const int c = lane + 32 * t;
        kv[t] = c < d ? kt[c * (BK + 1) + jj] : 0.f;
      }
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float dsj = __shfl_sync(FULL_MASK, ds[r], jj);
#pragma unroll
        for (int t = 0; t < DC; ++t) acc[r][t] += dsj * kv[t];
      }
    }
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
#pragma unroll
      for (int r = 0; r < RPW; ++r) s[r] = dp[r] = 0.f;
      if ((d & 3) == 0) {  // rows of ks and vs are 16-byte aligned: broadcast float4 reads
        for (int c = 0; c < d; c += 4) {
          float qv[4], ov[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            qv[u] = qt[(c + u) * (BQ + 1) + ql];
            ov[u] = dot[(c + u) * (BQ + 1) + ql];
          }
#pragma unroll
          for (int r = 0; r < RPW; ++r) {
            const float4 kv = *reinterpret_cast<const float4*>(ks + (warp * RPW + r) * d + c);
            const float4 vv = *reinterpret_cast<const float4*>(vs + (warp * RPW + r) * d + c);
            s[r] += qv[0] * kv.x + qv[1] * kv.y + qv[2] * kv.z + qv[3] * kv.w;
            dp[r] += ov[0] * vv.x + ov[1] * vv.y + ov[2] * vv.z + ov[3] * vv.w;
          }
        }
      } else {
        for (int c = 0; c < d; ++c) {
          const float qv = qt[c * (BQ + 1) + ql], ov = dot[c * (BQ + 1) + ql];
#pragma unroll
          for (int r = 0; r < RPW; ++r) {
            s[r] += qv * ks[(warp * RPW + r) * d + c];
            dp[r] += ov * vs[(warp * RPW + r) * d + c];
          }
        }
      }
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
