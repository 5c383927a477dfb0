// The paged decode attention on tensor cores (bf16, head_dim D = 64 or 128, up to 16 query
// heads per KV head): the contract of paged_decode in decode_kernels.cu, which includes this
// file (one PTX module), and the same partials for paged_decode_combine. The group's query
// heads are the 16 rows of an mma.sync m16n8k16 A operand (rows past n_rep zero), so the
// scores of a tile of keys for every head of the group are a few products, and P·V
// accumulates in registers — no per-key shuffles and no cross-thread sums of values, which
// the scalar and vectorised passes spend most of their time on (paged_decode_bf16 took 21 µs a
// layer at batch 64 on an H200, 2026-11-27, for ~5 MB of keys and values). tools/cuda_emu runs
// it on CPU threads (paged_decode driver).
#pragma once

// Warps of a block; each owns a tile of DT_BK(D) keys of a round.
#define DT_WARPS 4
// Keys a warp's tile holds: 32 at head_dim 64, 16 at 128 (a round's keys and values, DT_WARPS
// tiles of both, fit in 48 KiB of shared memory with their rows padded to D + 8).
#define DT_BK(D) ((D) == 64 ? 32 : 16)

// One tile of `valid` keys (the rest zero in shared memory and masked) for a warp: S = q·Kᵀ in
// base 2 (scale2 = scale·log2 e), the online softmax update of m, l and o, o += P·V with P
// rounded to bf16 (as the var-len tensor-core kernels do).
template <int D, int BK>
__device__ __forceinline__ void decode_tile_tc(const bf16* ks, const bf16* vs,
                                               const uint32_t (&qf)[D / 16][4],
                                               float (&o)[D / 8][4], float (&m)[2], float (&l)[2],
                                               int valid, float scale2, int lane, int tig) {
  float s[BK / 8][4];
#pragma unroll
  for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int nt = 0; nt < BK / 8; nt += 2) {
      uint32_t b[4];
      ld_b_rows<D>(b, ks, nt * 8, kk * 16, lane);
      mma_bf16_16816(s[nt], qf[kk], b[0], b[1]);
      mma_bf16_16816(s[nt + 1], qf[kk], b[2], b[3]);
    }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = nt * 8 + 2 * tig + (e & 1);
      s[nt][e] = j < valid ? s[nt][e] * scale2 : -INFINITY;
      mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
  float m_use[2], corr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
    const float m_new = fmaxf(m[r], mx[r]);  // finite: the tile has a valid key
    m_use[r] = m_new;
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
      uint32_t b[4];
      ld_b_cols<D>(b, vs, kt * 16, dt * 8, lane);
      mma_bf16_16816(o[dt], pa, b[0], b[1]);
      mma_bf16_16816(o[dt + 1], pa, b[2], b[3]);
    }
  }
}

// Block (row · hkv + g, split) serves KV head g's n_rep ≤ 16 query heads over keys
// [split·chunk, (split+1)·chunk) of its row, in rounds of DT_WARPS·BK keys: the round's KV
// slots looked up once, its key and value rows copied into shared memory together (cp.async
// when both pools start 16-byte aligned, zero rows past the chunk), warp w scoring and summing
// tile w. The warps' (m, l, o) then meet in shared memory in warp order, and the result or
// the chunk's partials (max in natural-log units, as paged_decode_combine reads them) are
// written as paged_decode writes them. blockDim.x = 32·DT_WARPS; dynamic shared memory:
// 2·DT_WARPS·BK rows of D + 8 bf16 (keys, values), then DT_WARPS·BK u32 slots
// (decode_cuda.rs computes the same).
template <int D>
__device__ void paged_decode_tc(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                const bf16* __restrict__ v, const uint32_t* __restrict__ tables,
                                const uint32_t* __restrict__ lens, bf16* __restrict__ out,
                                float* __restrict__ part_o, float* __restrict__ part_m,
                                float* __restrict__ part_l, int hq, int hkv, int d, int block_size,
                                int max_blocks, int chunk, int splits, float scale) {
  constexpr int BK = DT_BK(D), ROUND = DT_WARPS * BK, KS = D + 8;
  constexpr unsigned KV_BYTES = 2u * ROUND * KS * 2;
  const int n_rep = hq / hkv;
  if (d != D || n_rep > 16 || blockDim.x != 32 * DT_WARPS ||
      dynamic_smem_bytes() < KV_BYTES + 4u * ROUND)
    __trap();  // launch and kernel disagree
  extern __shared__ float smem[];
  bf16* keys_s = reinterpret_cast<bf16*>(smem);  // [ROUND][KS]
  bf16* vals_s = keys_s + ROUND * KS;            // [ROUND][KS]
  uint32_t* slot_s = reinterpret_cast<uint32_t*>(smem + KV_BYTES / 4);  // [ROUND]

  const int row = blockIdx.x / hkv, g = blockIdx.x % hkv, split = blockIdx.y;
  const int len = (int)lens[row];
  const int start = split * chunk;
  if (start >= len) return;  // this row has fewer chunks; the combine reads only its own
  const int n = min(chunk, len - start);
  const uint32_t* table = tables + (size_t)row * max_blocks;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;

  // The group's queries as A fragments: rows gid and gid + 8 (heads past n_rep zero).
  const bf16* qg = q + ((size_t)row * hq + (size_t)g * n_rep) * D;
  const bf16 zero = __float2bfloat16(0.f);
  auto qat = [&](int r, int c) { return r < n_rep ? qg[(size_t)r * D + c] : zero; };
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + 2 * tig;
    qf[kk][0] = pack_bf16x2(qat(gid, c), qat(gid, c + 1));
    qf[kk][1] = pack_bf16x2(qat(gid + 8, c), qat(gid + 8, c + 1));
    qf[kk][2] = pack_bf16x2(qat(gid, c + 8), qat(gid, c + 9));
    qf[kk][3] = pack_bf16x2(qat(gid + 8, c + 8), qat(gid + 8, c + 9));
  }
  float o[D / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
  const float scale2 = scale * 1.4426950408889634f;  // log2(e): scores in base 2
  const bool async = aligned16<2>({k, v});

  for (int r0 = 0; r0 < n; r0 += ROUND) {
    const int rn = min(ROUND, n - r0);
    for (int jj = tid; jj < rn; jj += blockDim.x) {
      const int j = start + r0 + jj;
      slot_s[jj] = table[j / block_size] * (uint32_t)block_size + (uint32_t)(j % block_size);
    }
    __syncthreads();
    constexpr int VR = D / 8;  // 16-byte pieces a row
    for (int e = tid; e < ROUND * VR; e += blockDim.x) {
      const int jj = e / VR, c = (e % VR) * 8;
      const bool in = jj < rn;
      const size_t at = in ? ((size_t)slot_s[jj] * hkv + g) * D + c : 0;
      bf16* kd = keys_s + jj * KS + c;
      bf16* vd = vals_s + jj * KS + c;
      if (async) {
        cp_async_16(kd, k + at, in ? 16 : 0);
        cp_async_16(vd, v + at, in ? 16 : 0);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          kd[i] = in ? k[at + i] : zero;
          vd[i] = in ? v[at + i] : zero;
        }
      }
    }
    if (async) {
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();
    const int valid = min(BK, rn - warp * BK);  // warp-uniform; ≤ 0: no key in this tile
    if (valid > 0)
      decode_tile_tc<D, BK>(keys_s + warp * BK * KS, vals_s + warp * BK * KS, qf, o, m, l, valid,
                            scale2, lane, tig);
    __syncthreads();  // the round's tiles and slots are consumed before the next is copied
  }

  // The warps' states into shared memory (over the key and value tiles, now free): o [warp][16][D]
  // unnormalised, m (base 2) and l [warp][16].
  float* o_s = smem;
  float* m_s = o_s + DT_WARPS * 16 * D;
  float* l_s = m_s + DT_WARPS * 16;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int hr = gid + 8 * r;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int c = dt * 8 + 2 * tig;
      o_s[(warp * 16 + hr) * D + c] = o[dt][2 * r];
      o_s[(warp * 16 + hr) * D + c + 1] = o[dt][2 * r + 1];
    }
    if (tig == 0) {
      m_s[warp * 16 + hr] = m[r];
      l_s[warp * 16 + hr] = l[r];
    }
  }
  __syncthreads();
  for (int e = tid; e < n_rep * D; e += blockDim.x) {
    const int r = e / D, c = e % D;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < DT_WARPS; ++w) top = fmaxf(top, m_s[w * 16 + r]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < DT_WARPS; ++w) {
      const float mw = m_s[w * 16 + r];
      if (mw == -INFINITY) continue;  // a warp without keys
      const float f = exp2f(mw - top);
      den += f * l_s[w * 16 + r];
      num += f * o_s[(w * 16 + r) * D + c];
    }
    const size_t h = (size_t)row * hq + (size_t)g * n_rep + r;
    if (splits == 1) {
      out[h * D + c] = __float2bfloat16(num / den);
    } else {
      part_o[(h * splits + split) * D + c] = num;
      if (c == 0) {
        part_m[h * splits + split] = top * 0.6931471805599453f;  // base 2 → natural log
        part_l[h * splits + split] = den;
      }
    }
  }
}
