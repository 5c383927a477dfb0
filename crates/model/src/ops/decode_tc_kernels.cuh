// The paged decode attention on tensor cores (bf16, head_dim D = 64 or 128, up to 16 query
// heads per KV head): the contract of paged_decode in decode_kernels.cu, which includes this
// file (one PTX module), and the same partials, merged by merge_chunks_if_last. The group's query
// heads are the 16 rows of an mma.sync m16n8k16 A operand (rows past n_rep zero), so the
// scores of a tile of keys for every head of the group are a few products, and P·V
// accumulates in registers — no per-key shuffles and no cross-thread sums of values, which
// the scalar and vectorised passes spend most of their time on (paged_decode_bf16 took 21 µs a
// layer at batch 64 on an H200, 2026-11-27, for ~5 MB of keys and values). tools/cuda_emu runs
// it on CPU threads (paged_decode driver). A warp's tile is cuda_common.cuh's flash_tile, as in
// the var-len attention's forward.
#pragma once

// Warps of a block; each owns a tile of DT_BK(D) keys of a round.
#define DT_WARPS 4
// Keys a warp's tile holds: 32 at head_dim 64, 16 at 128 (a round's keys and values, DT_WARPS
// tiles of both, fit in 48 KiB of shared memory with their rows padded to D + 8).
#define DT_BK(D) ((D) == 64 ? 32 : 16)

// Block (row · hkv + g, split) serves KV head g's n_rep ≤ 16 query heads over keys
// [split·chunk, (split+1)·chunk) of its row, in rounds of DT_WARPS·BK keys: the round's KV
// slots looked up once, its key and value rows copied into shared memory together (cp.async
// when both pools start 16-byte aligned, zero rows past the chunk), warp w scoring and summing
// tile w. The warps' (m, l, o) then meet in shared memory in warp order, and the result or
// the chunk's partials (max in natural-log units, as merge_chunks_if_last reads them) are
// written as paged_decode writes them. blockDim.x = 32·DT_WARPS; dynamic shared memory:
// 2·DT_WARPS·BK rows of D + 8 bf16 (keys, values), then DT_WARPS·BK u32 slots
// (decode_cuda.rs computes the same).
template <int D>
__device__ void paged_decode_tc(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                const bf16* __restrict__ v, const uint32_t* __restrict__ tables,
                                const uint32_t* __restrict__ lens, bf16* __restrict__ out,
                                float* __restrict__ part_o, float* __restrict__ part_m,
                                float* __restrict__ part_l, unsigned* __restrict__ counters,
                                int hq, int hkv, int d, int block_size, int max_blocks, int chunk,
                                int splits, float scale) {
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

  const DecodeChunk c(lens, tables, hkv, chunk, max_blocks);
  if (c.len > splits * chunk) __trap();  // the plan is shorter than the row: keys would be lost
  if (c.n == 0) return;
  const int row = c.row, g = c.g, split = c.split, n = c.n;
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
    for (int jj = tid; jj < rn; jj += blockDim.x) slot_s[jj] = c.slot(r0 + jj, block_size);
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
      // The tile's keys past `valid` are zero rows in shared memory, masked here.
      flash_tile<D, BK>(keys_s + warp * BK * KS, vals_s + warp * BK * KS, qf, o, m, l, scale2,
                        lane, tig, valid == BK, [&](int, int j) { return j < valid; });
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
  if (splits > 1)
    merge_chunks_if_last<bf16>(c, part_o, part_m, part_l, counters, out, smem, hq, hkv, D,
                               chunk, splits);
}
