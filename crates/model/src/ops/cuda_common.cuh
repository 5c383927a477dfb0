// What every CUDA source of composer-model shares (kernels.cu, attention_kernels.cu,
// decode_kernels.cu): the bf16 type, f32 <-> element conversions, and warp reductions.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }

#define FULL_MASK 0xffffffffu

// Bytes of dynamic shared memory the block was launched with (kernels check their layout
// against it, or lay out their last region from it).
#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}
#else
__device__ unsigned dynamic_smem_bytes();
#endif

#ifdef __CUDA_ARCH__
// A load that bypasses L1 (another block wrote the value; L1 is not coherent across SMs).
__device__ __forceinline__ float4 ld_cg_f4(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ float ld_cg_f1(const float* p) { return __ldcg(p); }
#else
__device__ float4 ld_cg_f4(const float* p);
__device__ float ld_cg_f1(const float* p);
#endif

// Butterfly reductions over a warp: every lane gets the same value (a + b == b + a in floating
// point, so the result does not depend on the lane).
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// ---- Tensor cores: mma.sync m16n8k16, bf16 inputs, f32 accumulation (sm_80+) ----
// The operand layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"),
// with gid = lane / 4 and tig = lane % 4: A (16×16, row-major) register 0 holds row gid, columns
// 2·tig and 2·tig + 1 (the lower column in the low half); register 1 row gid + 8; registers 2
// and 3 the same rows at columns + 8. B (16×8) register 0 holds rows (k) 2·tig, 2·tig + 1 of
// column gid, register 1 rows + 8. C/D (16×8, f32): c[0], c[1] row gid, columns 2·tig, 2·tig + 1;
// c[2], c[3] row gid + 8. tools/cuda_emu/emu.h implements the same contract on CPU threads.

// Two bf16 as one operand register, `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(bf16 lo, bf16 hi) {
  return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return pack_bf16x2(__float2bfloat16(lo), __float2bfloat16(hi));
}

// Whether all of `ptrs` start 16-byte aligned (a 16-byte vector load or cp.async may read them).
template <int K>
__device__ __forceinline__ bool aligned16(const void* const (&ptrs)[K]) {
  uintptr_t bits = 0;
#pragma unroll
  for (int i = 0; i < K; i++) bits |= reinterpret_cast<uintptr_t>(ptrs[i]);
  return (bits & 15) == 0;
}

// 16 bytes of T as f32 and back: 4 floats or 8 bf16 (widened exactly, narrowed to nearest
// even). The address must be 16-byte aligned.
template <typename T> struct Vec16;
template <> struct Vec16<float> {
  static constexpr int N = 4;
  __device__ static void load(const float* p, float (&x)[4]) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  }
  __device__ static void store(float* p, const float (&x)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  }
};
template <> struct Vec16<bf16> {
  static constexpr int N = 8;
  __device__ static void load(const bf16* p, float (&x)[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      x[2 * i] = __uint_as_float(w[i] << 16);  // the lower address is the low half
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static void store(bf16* p, const float (&x)[8]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]),
                                              pack_bf16x2(x[4], x[5]), pack_bf16x2(x[6], x[7]));
  }
};

#ifdef __CUDA_ARCH__
// Two adjacent bf16 at a 4-byte aligned address as one operand register.
__device__ __forceinline__ uint32_t ld_bf16x2(const bf16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
// c += A·B over one warp (every lane calls it, with its fragments).
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  // Not volatile: the instruction has no effect beyond its outputs, so the compiler may
  // schedule it freely.
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// ldmatrix.x4 (sm_75+): four 8×8 bf16 matrices from shared memory in one warp-wide load.
// Lane l gives the address of row l % 8 of matrix l / 8 (16 contiguous bytes, 16-byte
// aligned); r[i] receives matrix i's fragment: lane t holds row t / 4, columns 2·(t % 4) and
// + 1 (the lower column in the low half) — the A fragment's and, for a matrix stored
// [n][k], the B fragment's register layout above. `_t` loads each matrix transposed: lane t
// holds rows 2·(t % 4) and + 1 of column t / 4 (the B fragment of a matrix stored [k][n]).
// Volatile: they read shared memory, so they must stay between the __syncthreads around it.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
// cp.async (sm_80+): 16 bytes from global to shared memory without passing through
// registers, completing in the background; `src_bytes` = 0 writes 16 zero bytes instead (src is
// not read). Completion is tracked in commit groups: cp_async_wait<N>() returns once at most N
// of this thread's groups are pending (a __syncthreads after it makes every thread's copies
// visible to the block).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#else
__device__ void cp_async_16(void* dst, const void* src, int src_bytes);
__device__ void cp_async_commit();
template <int N> __device__ void cp_async_wait();
__device__ uint32_t ld_bf16x2(const bf16* p);
__device__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
__device__ void ldsm_x4(uint32_t (&r)[4], const bf16* p);
__device__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p);
#endif

// ---- Tensor-core operands from shared-memory tiles of rows padded to D + 8 bf16 (the
// attention kernels' K/V/q tiles and the paged decode's key and value tiles) ----

// B operands of S = x·Tᵀ from a row-major tile T [·][D + 8] in shared memory (K, or q/∂O in
// ∂K/∂V): for the 16 rows t0 .. t0 + 15 of T (two n = 8 tiles) and dims k0 .. k0 + 15, b[0..1]
// for rows t0.. and b[2..3] for rows t0 + 8.. (one ldmatrix.x4; the B(k = dim, n = row)
// fragment of a matrix stored [n][k] is ldmatrix's plain layout).
template <int D>
__device__ __forceinline__ void ld_b_rows(uint32_t (&b)[4], const bf16* t, int t0, int k0,
                                          int lane) {
  const int mi = lane >> 3, rr = lane & 7;
  ldsm_x4(b, t + (t0 + (mi >> 1) * 8 + rr) * (D + 8) + k0 + (mi & 1) * 8);
}

// B operands of acc += a·T for a row-major tile T [k][D + 8] (V, or K in ∂Q, or q/∂O in
// ∂K/∂V), k rows k0 .. k0 + 15 and the 16 columns c0 .. c0 + 15: b[0..1] for columns c0..,
// b[2..3] for c0 + 8.. (one transposed ldmatrix.x4).
template <int D>
__device__ __forceinline__ void ld_b_cols(uint32_t (&b)[4], const bf16* t, int k0, int c0,
                                          int lane) {
  const int mi = lane >> 3, rr = lane & 7;
  ldsm_x4_t(b, t + (k0 + (mi & 1) * 8 + rr) * (D + 8) + c0 + (mi >> 1) * 8);
}

// One tile of BK keys for a warp's 16 query rows (the var-len attention's tokens, or the paged
// decode's query heads): S = q·Kᵀ (qf: the rows' A fragments), scores in base 2 (scale2 =
// scale·log2 e), the online softmax update of this lane's two rows' m, l and o, then o += P·V
// with P rounded to bf16 (ks, vs: the tile's keys and values in shared memory, rows of D + 8).
// Key j (0 .. BK − 1) of row r (0: gid, 1: gid + 8) counts when `all` or keep(r, j); else its
// score is −∞. A row with no key yet keeps p = 0.
template <int D, int BK, class Keep>
__device__ __forceinline__ void flash_tile(const bf16* ks, const bf16* vs,
                                           const uint32_t (&qf)[D / 16][4], float (&o)[D / 8][4],
                                           float (&m)[2], float (&l)[2], float scale2, int lane,
                                           int tig, bool all, Keep keep) {
  float s[BK / 8][4];
#pragma unroll
  for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int nt = 0; nt < BK / 8; nt += 2) {
      // B(k = dim, n = key) = K[key][dim]: keys nt·8 .. nt·8 + 15, dims kk·16 ...
      uint32_t b[4];
      ld_b_rows<D>(b, ks, nt * 8, kk * 16, lane);
      mma_bf16_16816(s[nt], qf[kk], b[0], b[1]);
      mma_bf16_16816(s[nt + 1], qf[kk], b[2], b[3]);
    }
  float mx[2] = {-INFINITY, -INFINITY};
  if (all) {
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] *= scale2;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
      }
  } else {
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, j = nt * 8 + 2 * tig + (e & 1);
        s[nt][e] = keep(r, j) ? s[nt][e] * scale2 : -INFINITY;
        mx[r] = fmaxf(mx[r], s[nt][e]);
      }
  }
  float m_use[2], corr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
    const float m_new = fmaxf(m[r], mx[r]);
    // A row with no valid key yet keeps p = 0 (exp(−∞ − 0)) instead of exp(−∞ + ∞).
    m_use[r] = m_new == -INFINITY ? 0.f : m_new;
    corr[r] = exp2f(m[r] - m_use[r]);  // 0 while m[r] is −∞
    m[r] = m_new;
  }
  float rs[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = exp2f(s[nt][e] - m_use[e >> 1]);
      rs[e >> 1] += s[nt][e];
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rs[r] += __shfl_xor_sync(FULL_MASK, rs[r], 1);
    rs[r] += __shfl_xor_sync(FULL_MASK, rs[r], 2);
    l[r] = l[r] * corr[r] + rs[r];
  }
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    o[dt][0] *= corr[0];
    o[dt][1] *= corr[0];
    o[dt][2] *= corr[1];
    o[dt][3] *= corr[1];
  }
#pragma unroll
  for (int kt = 0; kt < BK / 16; ++kt) {
    // P's 16 keys kt·16.. as an A operand: score tiles 2·kt (keys + 2·tig) and 2·kt + 1 (+ 8).
    const uint32_t pa[4] = {pack_bf16x2(s[2 * kt][0], s[2 * kt][1]),
                            pack_bf16x2(s[2 * kt][2], s[2 * kt][3]),
                            pack_bf16x2(s[2 * kt + 1][0], s[2 * kt + 1][1]),
                            pack_bf16x2(s[2 * kt + 1][2], s[2 * kt + 1][3])};
#pragma unroll
    for (int dt = 0; dt < D / 8; dt += 2) {
      // B(k = key, n = dim) = V[key][dim]: keys kt·16 .., dims dt·8 .. dt·8 + 15.
      uint32_t b[4];
      ld_b_cols<D>(b, vs, kt * 16, dt * 8, lane);
      mma_bf16_16816(o[dt], pa, b[0], b[1]);
      mma_bf16_16816(o[dt + 1], pa, b[2], b[3]);
    }
  }
}
