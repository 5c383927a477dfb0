// The LM head's softmax algebra on the device (ops/head_softmax.rs: the chunked log-probs'
// row statistics and ∂logits; CPU twins: the same custom ops' `cpu_fwd`). Included by kernels.cu
// (one PTX module), which instantiates the kernels; tools/cuda_emu/head_softmax.cpp runs them on
// the CPU.
#pragma once
#include "cuda_common.cuh"

// ---- The LM head's softmax algebra (ops/head_softmax.rs), one block per row of z [rows, v] ----
// A row is read 16 bytes a thread at a time when it starts 16-byte aligned (the ids past the
// last whole vector one by one), element by element otherwise.

// Running (max m, Σe^(x−m), Σe^(x−m)·x) over some of a row's x, rescaled as m grows.
struct SoftStats {
  float m, s, sx;
};

// Adds n values (one 16-byte vector's, or one) to `a`: one rescale for all of them.
template <int N>
__device__ __forceinline__ void soft_add(SoftStats& a, const float (&x)[N]) {
  float mx = x[0];
#pragma unroll
  for (int e = 1; e < N; e++) mx = fmaxf(mx, x[e]);
  if (mx > a.m) {
    const float c = expf(a.m - mx);  // 0 while a is empty (m = −∞)
    a.s *= c;
    a.sx *= c;
    a.m = mx;
  }
#pragma unroll
  for (int e = 0; e < N; e++) {
    const float ex = expf(x[e] - a.m);
    a.s += ex;
    a.sx += ex * x[e];
  }
}

__device__ __forceinline__ SoftStats soft_merge(const SoftStats& a, const SoftStats& b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return a;  // both empty
  const float ca = expf(a.m - m), cb = expf(b.m - m);
  return {m, a.s * ca + b.s * cb, a.sx * ca + b.sx * cb};
}

// The block's SoftStats, merged across warps by butterflies (every thread gets the same:
// merge is commutative in floating point) and through shared memory.
__device__ SoftStats block_soft_stats(SoftStats a) {
  __shared__ float part[3][32];
  for (int o = 16; o > 0; o >>= 1) {
    const SoftStats b = {__shfl_xor_sync(FULL_MASK, a.m, o), __shfl_xor_sync(FULL_MASK, a.s, o),
                         __shfl_xor_sync(FULL_MASK, a.sx, o)};
    a = soft_merge(a, b);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) {
    part[0][warp] = a.m;
    part[1][warp] = a.s;
    part[2][warp] = a.sx;
  }
  __syncthreads();
  SoftStats t = {-INFINITY, 0.f, 0.f};
  for (int w = 0; w < warps; w++) t = soft_merge(t, SoftStats{part[0][w], part[1][w], part[2][w]});
  __syncthreads();  // `part` is reused by the next call
  return t;
}

// stats[row] = (lse, entropy) of softmax(x), x = z·inv_t, in one pass over the row.
template <typename T>
__device__ void head_row_stats(const T* z, float* stats, int rows, int v, float inv_t) {
  constexpr int VEC = Vec16<T>::N;
  const int row = blockIdx.x;
  if (row >= rows) return;
  const T* zr = z + (size_t)row * v;
  SoftStats a = {-INFINITY, 0.f, 0.f};
  int scalar_from = 0;
  if (aligned16<1>({zr})) {
    const int vecs = v / VEC;
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
      float x[VEC];
      Vec16<T>::load(zr + (size_t)i * VEC, x);
#pragma unroll
      for (int e = 0; e < VEC; e++) x[e] *= inv_t;
      soft_add(a, x);
    }
    scalar_from = vecs * VEC;
  }
  for (int j = scalar_from + threadIdx.x; j < v; j += blockDim.x) {
    const float x[1] = {to_f(zr[j]) * inv_t};
    soft_add(a, x);
  }
  a = block_soft_stats(a);
  if (threadIdx.x == 0) {
    const float lse = a.m + logf(a.s);
    stats[2 * row] = lse;
    stats[2 * row + 1] = lse - a.sx / a.s;
  }
}

// dz = (Σₖ Gₖ(δ_{idₖ} − p) − E·p·(log p + H))·inv_t in T, grad[row] = (G₀..G_{w−1}, E); ids are
// in range (checked by the caller). Vectorised as head_row_stats. The δ terms are added to
// the f32 value before rounding: thread 0 writes each distinct id of the row once, after the
// block wrote the rest.
template <typename T>
__device__ void head_logits_grad(const T* z, const float* stats, const uint32_t* ids,
                                 const float* grad, T* dz, int rows, int v, int w, float inv_t) {
  const int row = blockIdx.x;
  if (row >= rows) return;
  const T* zr = z + (size_t)row * v;
  T* out = dz + (size_t)row * v;
  const float lse = stats[2 * row], entropy = stats[2 * row + 1];
  const float* g = grad + (size_t)row * (w + 1);
  const uint32_t* id = ids + (size_t)row * w;
  float g_sum = 0.f;
  for (int k = 0; k < w; ++k) g_sum += g[k];
  const float g_ent = g[w];
  auto dz_of = [&](float zj) {
    const float logp = zj * inv_t - lse;
    return -expf(logp) * (g_sum + g_ent * (logp + entropy)) * inv_t;
  };
  constexpr int VEC = Vec16<T>::N;
  int scalar_from = 0;
  if (aligned16<2>({zr, out})) {
    const int vecs = v / VEC;
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
      float x[VEC];
      Vec16<T>::load(zr + (size_t)i * VEC, x);
#pragma unroll
      for (int e = 0; e < VEC; e++) x[e] = dz_of(x[e]);
      Vec16<T>::store(out + (size_t)i * VEC, x);
    }
    scalar_from = vecs * VEC;
  }
  for (int j = scalar_from + threadIdx.x; j < v; j += blockDim.x)
    out[j] = from_f<T>(dz_of(to_f(zr[j])));
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 0; k < w; ++k) {
      bool seen = false;
      for (int e = 0; e < k; ++e) seen |= id[e] == id[k];
      if (seen) continue;
      float gk = 0.f;
      for (int e = k; e < w; ++e) gk += id[e] == id[k] ? g[e] : 0.f;
      const float logp = to_f(zr[id[k]]) * inv_t - lse;
      const float base = -expf(logp) * (g_sum + g_ent * (logp + entropy));
      out[id[k]] = from_f<T>((base + gk) * inv_t);
    }
  }
}
