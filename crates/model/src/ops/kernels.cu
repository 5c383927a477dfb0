// CUDA kernels of the training ops (crates/model/src/ops): RMSNorm, RoPE, SwiGLU and the
// masked softmax of attention, forward and backward, the LM head's softmax algebra
// (head_kernels.cuh), and the token embedding's backward (embedding_kernels.cuh), for f32 and
// bf16 tensors. Every kernel
// reads and writes the tensor's dtype and computes in f32. Their CPU twins are the `cpu_fwd`
// of the same candle custom ops (tested in CI); tools/gpu_check.sh runs the CUDA tests.
// Built to PTX by crates/model/build.rs (`--features cuda`).
#include "cuda_common.cuh"

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

// The decode's residual add fused with the norm after it: s = T(x + δ) into out[0, rows·d),
// RMSNorm(s)·w into out[rows·d, 2·rows·d); one block per row. Each thread reads back only the
// sums it wrote itself.
template <typename T>
__device__ void add_rms_norm_fwd(const T* x, const T* delta, const T* w, T* out, int rows, int d,
                                 float eps) {
  const int row = blockIdx.x;
  if (row >= rows) return;
  const size_t off = (size_t)row * d;
  T* sr = out + off;
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const T s = from_f<T>(to_f(x[off + i]) + to_f(delta[off + i]));
    sr[i] = s;
    const float v = to_f(s);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss) / d + eps);
  T* yr = out + (size_t)rows * d + off;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float n = to_f(from_f<T>(to_f(sr[i]) * r));
    yr[i] = from_f<T>(n * to_f(w[i]));
  }
}

// ---- RMSNorm backward: ∂x = r·g − x·r³·(Σ g·x)/D with g = ∂y·w, and ∂w = Σ_rows ∂y·x·r, in one
// pass over x and ∂y. A warp a row (rows w, w + W, … for the grid's W warps); each warp adds its
// rows' ∂y·x·r into its own f32 column sums in shared memory ([warps of the block][d], the
// columns of a 16-byte chunk d / V apart); the
// block adds its warps' sums in warp order into partial[blockIdx.x], and rms_norm_bwd_dw_sum
// adds the blocks' in block order: no atomics, the same ∂w every run. ----

// V consecutive elements of a row as f32: 16 bytes (V = Vec16<T>::N) or one element (V = 1).
template <typename T, int V>
__device__ __forceinline__ void load_chunk(const T* p, float (&v)[V]) {
  if constexpr (V == 1)
    v[0] = to_f(*p);
  else
    Vec16<T>::load(p, v);
}
template <typename T, int V>
__device__ __forceinline__ void store_chunk(T* p, const float (&v)[V]) {
  if constexpr (V == 1)
    *p = from_f<T>(v[0]);
  else
    Vec16<T>::store(p, v);
}

template <typename T, int V>
__device__ void rms_norm_bwd_rows(const T* x, const T* w, const T* dy, T* dx, float* mine,
                                  int rows, int d, float eps) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < rows; row += gridDim.x * warps) {
    const size_t off = (size_t)row * d;
    float ss = 0.f, gx = 0.f;
    for (int i = lane * V; i < d; i += 32 * V) {
      float xv[V], gv[V], wv[V];
      load_chunk<T, V>(x + off + i, xv);
      load_chunk<T, V>(dy + off + i, gv);
      load_chunk<T, V>(w + i, wv);
#pragma unroll
      for (int j = 0; j < V; j++) {
        ss += xv[j] * xv[j];
        gx += gv[j] * wv[j] * xv[j];
      }
    }
    const float r = rsqrtf(warp_sum(ss) / d + eps);
    const float c = r * r * r * warp_sum(gx) / d;
    // The row again (from L1: the warp just read it).
    for (int i = lane * V; i < d; i += 32 * V) {
      float xv[V], gv[V], wv[V], out[V];
      load_chunk<T, V>(x + off + i, xv);
      load_chunk<T, V>(dy + off + i, gv);
      load_chunk<T, V>(w + i, wv);
#pragma unroll
      for (int j = 0; j < V; j++) {
        out[j] = r * gv[j] * wv[j] - xv[j] * c;
        // Column i + j at (j, i / V) of a [V][d / V] layout: consecutive lanes hit
        // consecutive words (the plain layout would put them V words apart: bank conflicts).
        mine[j * (d / V) + i / V] += gv[j] * xv[j] * r;
      }
      store_chunk<T, V>(dx + off + i, out);
    }
  }
}

// Shared memory: blockDim.x / 32 · d floats. partial: [gridDim.x, d] f32.
template <typename T>
__device__ void rms_norm_bwd(const T* x, const T* w, const T* dy, T* dx, float* partial, int rows,
                             int d, float eps) {
  extern __shared__ float acc[];
  const int warps = blockDim.x >> 5;
  float* mine = acc + (size_t)(threadIdx.x >> 5) * d;
  for (int i = threadIdx.x & 31; i < d; i += 32) mine[i] = 0.f;
  __syncwarp();  // a lane accumulates into columns another lane zeroed
  constexpr int V = Vec16<T>::N;
  const void* const ptrs[4] = {x, w, dy, dx};
  const bool vec = d % V == 0 && aligned16(ptrs);
  if (vec)
    rms_norm_bwd_rows<T, V>(x, w, dy, dx, mine, rows, d, eps);
  else
    rms_norm_bwd_rows<T, 1>(x, w, dy, dx, mine, rows, d, eps);
  __syncthreads();
  const int v = vec ? V : 1;  // the sums' layout: column i at (i % v)·(d / v) + i / v
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const int at = (i % v) * (d / v) + i / v;
    float s = 0.f;
    for (int k = 0; k < warps; k++) s += acc[(size_t)k * d + at];
    partial[(size_t)blockIdx.x * d + i] = s;
  }
}

// ∂w[c] = Σ_b partial[b, c] in a fixed order, cast to T: block (c / 32) of 32·L threads, lane
// k of column c sums blocks k, k + L, … in order, then the L sums are added in lane order.
template <typename T>
__device__ void rms_norm_bwd_dw_sum(const float* partial, T* dw, int blocks, int d) {
  __shared__ float part[32][33];
  const int lanes = blockDim.x >> 5, k = threadIdx.x >> 5, col_in = threadIdx.x & 31;
  const int col = blockIdx.x * 32 + col_in;
  float s = 0.f;
  if (col < d)
    for (int b = k; b < blocks; b += lanes) s += partial[(size_t)b * d + col];
  part[k][col_in] = s;
  __syncthreads();
  if (k == 0 && col < d) {
    float t = 0.f;
    for (int j = 0; j < lanes; j++) t += part[j][col_in];
    dw[col] = from_f<T>(t);
  }
}

// ---- RoPE (rotate-half) of N tokens × H heads with cos/sin [N, D/2]; sign = −1 rotates back.
// Token-major [N, H, D] unless `t_len` > 0: then the side named by `heads_major` (1: x, 2: y)
// is [N / t_len, H, t_len, D] (the attention's layout), so the transpose costs no extra pass. ----
template <typename T>
__device__ void rope(const T* x, const T* cos, const T* sin, T* y, int n, int h, int d,
                     float sign, int t_len, int heads_major) {
  const int half = d / 2;
  const size_t total = (size_t)n * h * half;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (size_t)gridDim.x * blockDim.x) {
    const int i = (int)(e % half);
    const size_t tok_head = e / half;
    const size_t tok = tok_head / h;
    const size_t tokens_base = tok_head * d;
    const size_t heads_base =
        t_len > 0 ? (((tok / t_len) * h + tok_head % h) * t_len + tok % t_len) * d : tokens_base;
    const size_t xb = heads_major == 1 ? heads_base : tokens_base;
    const size_t yb = heads_major == 2 ? heads_base : tokens_base;
    const float c = to_f(cos[tok * half + i]);
    const float s = sign * to_f(sin[tok * half + i]);
    const float x1 = to_f(x[xb + i]), x2 = to_f(x[xb + i + half]);
    y[yb + i] = from_f<T>(x1 * c - x2 * s);
    y[yb + i + half] = from_f<T>(x2 * c + x1 * s);
  }
}

// ---- The decode's attention inputs: biases added (rounded to T, as the unfused add), q and k
// rotated as `rope` does; out = [q rows·nh·d | k rows·nkv·d | v rows·nkv·d] from the packed
// projection rows qkv [rows, (nh + 2·nkv)·d] (q's columns, k's, v's) and the bias stacked the
// same way. One thread per (token, head, rotation pair) over the three parts. ----
template <typename T>
__device__ void qkv_bias_rope(const T* qkv, const T* bias, int has_bias, const T* cos,
                              const T* sin, T* out, int rows, int nh, int nkv, int d) {
  const int half = d / 2;
  const size_t width = (size_t)(nh + 2 * nkv) * d;
  const size_t nq = (size_t)rows * nh * half, nk = (size_t)rows * nkv * half;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < nq + 2 * nk;
       e += (size_t)gridDim.x * blockDim.x) {
    // The part (q, k or v) this pair belongs to: its column offset in a packed row, its block
    // of the output, its head count.
    size_t col = 0;
    T* dst = out;
    int heads = nh;
    size_t p = e;
    bool rotate = true;
    if (e >= nq + nk) {
      col = (size_t)(nh + nkv) * d, dst = out + 2 * (nq + nk), heads = nkv, p = e - nq - nk;
      rotate = false;
    } else if (e >= nq) {
      col = (size_t)nh * d, dst = out + 2 * nq, heads = nkv, p = e - nq;
    }
    const int i = (int)(p % half);
    const size_t tok_head = p / half;
    const size_t tok = tok_head / heads;
    const size_t hb = col + (tok_head % heads) * d;
    const size_t src = tok * width + hb;
    const size_t base = tok_head * d;
    float x1 = to_f(qkv[src + i]), x2 = to_f(qkv[src + i + half]);
    if (has_bias) {
      x1 = to_f(from_f<T>(x1 + to_f(bias[hb + i])));
      x2 = to_f(from_f<T>(x2 + to_f(bias[hb + i + half])));
    }
    if (rotate) {
      const float c = to_f(cos[tok * half + i]), s = to_f(sin[tok * half + i]);
      dst[base + i] = from_f<T>(x1 * c - x2 * s);
      dst[base + i + half] = from_f<T>(x2 * c + x1 * s);
    } else {
      dst[base + i] = from_f<T>(x1);
      dst[base + i + half] = from_f<T>(x2);
    }
  }
}

// ---- SwiGLU: y = silu(g)·u; backward writes [∂g | ∂u] into one buffer of 2n ----
// Both walk the elements 16 bytes a thread when every buffer they touch starts 16-byte aligned
// (the elements past the last whole vector, and misaligned views, one by one).

__device__ __forceinline__ float swiglu_of(float g, float u) {
  const float s = 1.f / (1.f + expf(-g));
  return g * s * u;
}

template <typename T>
__device__ void swiglu_fwd(const T* g, const T* u, T* y, size_t n) {
  constexpr int VEC = Vec16<T>::N;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t scalar_from = 0;
  if (aligned16<3>({g, u, y})) {
    const size_t vecs = n / VEC;
    for (size_t i = first; i < vecs; i += stride) {
      float gv[VEC], uv[VEC];
      Vec16<T>::load(g + i * VEC, gv);
      Vec16<T>::load(u + i * VEC, uv);
#pragma unroll
      for (int e = 0; e < VEC; e++) gv[e] = swiglu_of(gv[e], uv[e]);
      Vec16<T>::store(y + i * VEC, gv);
    }
    scalar_from = vecs * VEC;
  }
  for (size_t i = scalar_from + first; i < n; i += stride)
    y[i] = from_f<T>(swiglu_of(to_f(g[i]), to_f(u[i])));
}

// The decode's SwiGLU from packed rows [gate | up] of 2·inter (one product with the stacked
// weights): y [n = rows·inter].
template <typename T>
__device__ void swiglu_packed_fwd(const T* gu, T* y, size_t n, size_t inter) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t g = (i / inter) * 2 * inter + i % inter;
    const float gv = to_f(gu[g]);
    const float s = 1.f / (1.f + expf(-gv));
    y[i] = from_f<T>(gv * s * to_f(gu[g + inter]));
  }
}

// (∂g, ∂u) of one element.
__device__ __forceinline__ void swiglu_grads(float g, float u, float d, float& dg, float& du) {
  const float s = 1.f / (1.f + expf(-g));
  dg = d * u * s * (1.f + g * (1.f - s));
  du = d * g * s;
}

template <typename T>
__device__ void swiglu_bwd(const T* g, const T* u, const T* dy, T* out, size_t n) {
  constexpr int VEC = Vec16<T>::N;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t scalar_from = 0;
  if (aligned16<5>({g, u, dy, out, out + n})) {
    const size_t vecs = n / VEC;
    for (size_t i = first; i < vecs; i += stride) {
      float gv[VEC], uv[VEC], dv[VEC], dg[VEC], du[VEC];
      Vec16<T>::load(g + i * VEC, gv);
      Vec16<T>::load(u + i * VEC, uv);
      Vec16<T>::load(dy + i * VEC, dv);
#pragma unroll
      for (int e = 0; e < VEC; e++) swiglu_grads(gv[e], uv[e], dv[e], dg[e], du[e]);
      Vec16<T>::store(out + i * VEC, dg);
      Vec16<T>::store(out + n + i * VEC, du);
    }
    scalar_from = vecs * VEC;
  }
  for (size_t i = scalar_from + first; i < n; i += stride) {
    float dg, du;
    swiglu_grads(to_f(g[i]), to_f(u[i]), to_f(dy[i]), dg, du);
    out[i] = from_f<T>(dg);
    out[n + i] = from_f<T>(du);
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
    z += expf(to_f(sr[j]) + (mr ? mr[j] : 0.f) - m);
  const float inv = 1.f / block_sum(z);
  for (int j = threadIdx.x; j < tk; j += blockDim.x)
    pr[j] = from_f<T>(expf(to_f(sr[j]) + (mr ? mr[j] : 0.f) - m) * inv);
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

#include "head_kernels.cuh"

// ---- acc += x, acc f32 and x in T (ops/add_into.rs; CPU twin AddInto::cpu_fwd) ----
template <typename T>
__device__ void add_into_f32(float* __restrict__ acc, const T* __restrict__ x, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x)
    acc[i] += to_f(x[i]);
}

#define INSTANTIATE(T, SFX)                                                                     \
  extern "C" __global__ void rms_norm_fwd_##SFX(const T* x, const T* w, T* y, int rows, int d,  \
                                                float eps) {                                    \
    rms_norm_fwd<T>(x, w, y, rows, d, eps);                                                     \
  }                                                                                             \
  extern "C" __global__ void add_rms_norm_fwd_##SFX(const T* x, const T* delta, const T* w,     \
                                                    T* out, int rows, int d, float eps) {       \
    add_rms_norm_fwd<T>(x, delta, w, out, rows, d, eps);                                        \
  }                                                                                             \
  extern "C" __global__ void rms_norm_bwd_##SFX(const T* x, const T* w, const T* dy, T* dx,     \
                                                float* partial, int rows, int d, float eps) {    \
    rms_norm_bwd<T>(x, w, dy, dx, partial, rows, d, eps);                                        \
  }                                                                                             \
  extern "C" __global__ void rms_norm_bwd_dw_sum_##SFX(const float* partial, T* dw, int blocks, \
                                                       int d) {                                 \
    rms_norm_bwd_dw_sum<T>(partial, dw, blocks, d);                                             \
  }                                                                                             \
  extern "C" __global__ void add_into_f32_##SFX(float* acc, const T* x, unsigned long long n) { \
    add_into_f32<T>(acc, x, n);                                                                 \
  }                                                                                             \
  extern "C" __global__ void rope_##SFX(const T* x, const T* c, const T* s, T* y, int n, int h, \
                                        int d, float sign, int t_len, int heads_major) {        \
    rope<T>(x, c, s, y, n, h, d, sign, t_len, heads_major);                                     \
  }                                                                                             \
  extern "C" __global__ void qkv_bias_rope_##SFX(const T* qkv, const T* bias, int has_bias,   \
                                                 const T* c, const T* s, T* out, int rows,      \
                                                 int nh, int nkv, int d) {                      \
    qkv_bias_rope<T>(qkv, bias, has_bias, c, s, out, rows, nh, nkv, d);                         \
  }                                                                                             \
  extern "C" __global__ void swiglu_fwd_##SFX(const T* g, const T* u, T* y, size_t n) {        \
    swiglu_fwd<T>(g, u, y, n);                                                                  \
  }                                                                                             \
  extern "C" __global__ void swiglu_packed_fwd_##SFX(const T* gu, T* y, size_t n,             \
                                                     size_t inter) {                            \
    swiglu_packed_fwd<T>(gu, y, n, inter);                                                      \
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
  }                                                                                             \
  extern "C" __global__ void head_row_stats_##SFX(const T* z, float* stats, int rows, int v,    \
                                                  float inv_t) {                                \
    head_row_stats<T>(z, stats, rows, v, inv_t);                                                \
  }                                                                                             \
  extern "C" __global__ void head_logits_grad_##SFX(const T* z, const float* stats,             \
                                                    const uint32_t* ids, const float* grad,     \
                                                    T* dz, int rows, int v, int w,              \
                                                    float inv_t) {                              \
    head_logits_grad<T>(z, stats, ids, grad, dz, rows, v, w, inv_t);                            \
  }

INSTANTIATE(float, f32)
INSTANTIATE(bf16, bf16)

// ---- AdamW's two in-place passes (ops/adamw.rs; CPU twins moments_pass / param_pass) ----
// torch.optim.AdamW's arithmetic in its order, f32 (the master weights, moments and gradients).
// mv = [m…, v…] of a parameter's n elements: m ← lerp(m, g, w), v ← v·β2 + ((1 − β2)·g)·g.
extern "C" __global__ void adamw_moments_f32(float* mv, const float* g, unsigned long long n,
                                             float w, float b2, float omb2) {
  const bool small = w < 0.5f;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    const float gi = g[i], m = mv[i];
    mv[i] = small ? m + w * (gi - m) : gi - (gi - m) * (1.f - w);
    mv[n + i] = mv[n + i] * b2 + omb2 * gi * gi;
  }
}

// θ ← θ·decay, then θ + (−step size)·(m / (√v / √(1 − β2^t) + ε)).
extern "C" __global__ void adamw_params_f32(float* p, const float* mv, unsigned long long n,
                                            float decay, float neg_step, float bc2_sqrt,
                                            float eps) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    const float decayed = p[i] * decay;
    p[i] = decayed + neg_step * (mv[i] / (sqrtf(mv[n + i]) / bc2_sqrt + eps));
  }
}

// The token embedding's backward.
#include "embedding_kernels.cuh"

// The projections' bias, added in place.
#include "linear_kernels.cuh"
