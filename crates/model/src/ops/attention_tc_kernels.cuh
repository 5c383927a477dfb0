// The tensor-core versions of the causal var-len GQA flash attention (bf16, head_dim 64 and
// 128): the contract, tiling split and summation order of the scalar kernels in
// attention_kernels.cu, which includes this file at its end (one PTX module; seg_of,
// ATT_WARPS and cuda_common.cuh come from there). tools/cuda_emu runs it on CPU threads.
#pragma once

// ---- Shared by the tensor-core kernels (bf16, head_dim D = 64 or 128) ----

// Rows r0 .. r0 + ROWS − 1 of head `head` of a and b ([·, heads, D]) into the shared tiles
// a_s, b_s ([ROWS][D + 8]); rows from r_end on are zero. 16 bytes (8 bf16) a load when both
// tensors start 16-byte aligned (every row and column offset is then a multiple of 8
// elements: D is); a view at an odd offset takes the element-wise path.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile_pair(bf16* a_s, bf16* b_s, const bf16* a, const bf16* b,
                                               int r0, int r_end, int head, int heads) {
  static_assert(D % 8 == 0, "rows are copied 8 bf16 at a time");
  if (aligned16<2>({a, b})) {
    constexpr int VR = D / 8;  // 16-byte vectors a row
    for (int e = threadIdx.x; e < ROWS * VR; e += blockDim.x) {
      const int rr = e / VR, c = (e % VR) * 8, r = r0 + rr;
      uint4 av = make_uint4(0u, 0u, 0u, 0u), bv = av;
      if (r < r_end) {
        const size_t o = ((size_t)r * heads + head) * D + c;
        av = *reinterpret_cast<const uint4*>(a + o);
        bv = *reinterpret_cast<const uint4*>(b + o);
      }
      *reinterpret_cast<uint4*>(a_s + rr * (D + 8) + c) = av;
      *reinterpret_cast<uint4*>(b_s + rr * (D + 8) + c) = bv;
    }
    return;
  }
  const bf16 zero = __float2bfloat16(0.f);
  for (int e = threadIdx.x; e < ROWS * D; e += blockDim.x) {
    const int rr = e / D, c = e % D, r = r0 + rr;
    bf16 av = zero, bv = zero;
    if (r < r_end) {
      const size_t o = ((size_t)r * heads + head) * D + c;
      av = a[o];
      bv = b[o];
    }
    a_s[rr * (D + 8) + c] = av;
    b_s[rr * (D + 8) + c] = bv;
  }
}

// load_tile_pair's copy as cp.async, issued and not waited for (the caller commits and waits):
// a and b must start 16-byte aligned; rows from r_end on are zero-filled.
template <int D, int ROWS>
__device__ __forceinline__ void issue_tile_pair(bf16* a_s, bf16* b_s, const bf16* a, const bf16* b,
                                                int r0, int r_end, int head, int heads) {
  constexpr int VR = D / 8;  // 16-byte vectors a row
  for (int e = threadIdx.x; e < ROWS * VR; e += blockDim.x) {
    const int rr = e / VR, c = (e % VR) * 8, r = r0 + rr;
    const bool in = r < r_end;
    const size_t o = in ? ((size_t)r * heads + head) * D + c : 0;
    cp_async_16(a_s + rr * (D + 8) + c, a + o, in ? 16 : 0);
    cp_async_16(b_s + rr * (D + 8) + c, b + o, in ? 16 : 0);
  }
}

// Runs body(t, stage) for steps t = 0 .. steps − 1 with step t's data in shared-memory stage
// t % 2, copied one step ahead by fetch(t, stage): with `async`, fetch issues cp.async copies
// and commits them (every thread commits, copies or not), and step t is waited for before its
// body; otherwise fetch copies synchronously. A barrier before each body makes the step's data
// visible to the block, one after it frees the stage for step t + 2. Called by every thread.
template <class Fetch, class Body>
__device__ __forceinline__ void two_stage(int steps, bool async, Fetch fetch, Body body) {
  fetch(0, 0);
  for (int t = 0; t < steps; ++t) {
    if (t + 1 < steps) fetch(t + 1, (t + 1) & 1);  // into the stage every thread finished with
    if (async) {
      if (t + 1 < steps)
        cp_async_wait<1>();  // this thread's copies of step t have landed
      else
        cp_async_wait<0>();
    }
    __syncthreads();  // … and every thread's
    body(t, t & 1);
    __syncthreads();  // stage t % 2 is consumed before step t + 2 is fetched into it
  }
}

// A tile pair (rows r0.. of head `head`) into a_s, b_s: by cp.async, committed, when `async`
// (a and b 16-byte aligned), else synchronously (load_tile_pair).
template <int D, int ROWS>
__device__ __forceinline__ void fetch_tile_pair(bool async, bf16* a_s, bf16* b_s, const bf16* a,
                                                const bf16* b, int r0, int r_end, int head,
                                                int heads) {
  if (async) {
    issue_tile_pair<D, ROWS>(a_s, b_s, a, b, r0, r_end, head, heads);
    cp_async_commit();
  } else {
    load_tile_pair<D, ROWS>(a_s, b_s, a, b, r0, r_end, head, heads);
  }
}

// The key tiles t = 0 .. tiles − 1 (keys k_begin + t·BK .., rows from r_end on zero) of K and V
// head g through two shared-memory stages (`stages`: 2 × ([BK][D + 8] keys, [BK][D + 8] values)):
// body(t, ks, vs) runs on tile t while tile t + 1 is copied (two_stage).
template <int D, int BK, class Body>
__device__ __forceinline__ void pipelined_kv_tiles(bf16* stages, const bf16* k, const bf16* v,
                                                   int k_begin, int r_end, int g, int hkv,
                                                   int tiles, Body body) {
  constexpr int TILE = BK * (D + 8);
  const bool async = aligned16<2>({k, v});
  two_stage(
      tiles, async,
      [&](int t, int stage) {
        bf16* kst = stages + stage * 2 * TILE;
        fetch_tile_pair<D, BK>(async, kst, kst + TILE, k, v, k_begin + t * BK, r_end, g, hkv);
      },
      [&](int t, int stage) {
        const bf16* ks = stages + stage * 2 * TILE;
        body(t, ks, ks + TILE);
      });
}

// A warp's 16 query rows w0 .. w0 + 15 of a block and this lane's two of them, w0 + gid (r = 0)
// and w0 + gid + 8 (r = 1), with their segments' starts. A row past n gets the segment start
// INT_MAX: no key is valid for it.
struct WarpRows {
  int w0, w_last, w_kbegin, w_klast;
  int row[2], row_s[2];

  __device__ WarpRows(const int* cu, int n_cu, int w0_, int gid, int n) : w0(w0_) {
    w_last = min(w0 + 15, n - 1);
    w_kbegin = w0 < n ? cu[seg_of(cu, n_cu, w0)] : n;
    w_klast = w0 < n ? cu[seg_of(cu, n_cu, w_last)] : n;  // the last row's segment start
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row[r] = w0 + gid + 8 * r;
      row_s[r] = row[r] < n ? cu[seg_of(cu, n_cu, row[r])] : 0x7fffffff;
    }
  }

  // Warp-uniform: whether the keys j0 .. j0 + bk − 1 hold none valid for any of the rows.
  __device__ bool skips(int j0, int bk, int n) const {
    return w0 >= n || j0 > w_last || j0 + bk <= w_kbegin;
  }

  // Warp-uniform: whether every row attends every key j0 .. j0 + bk − 1 (no mask needed: the
  // keys lie in the last row's segment, which starts at or after every other row's, and end
  // at or before the first row).
  __device__ bool covers(int j0, int bk) const { return j0 >= w_klast && j0 + bk - 1 <= w0; }

  // Whether row r attends key j.
  __device__ bool attends(int r, int j) const { return j >= row_s[r] && j <= row[r]; }
};

// log2(e): the kernels exponentiate with exp2f, the softmax scale (and lse) taken to base 2.
#define ATT_LOG2E 1.4426950408889634f
#define ATT_LN2 0.6931471805599453f

// The A fragments of this lane's two rows of x [n, heads, D] (head h) over all of D, zero
// for a row past n.
template <int D>
__device__ __forceinline__ void load_row_frags(uint32_t (&f)[D / 16][4], const bf16* x,
                                               const WarpRows& w, int h, int heads, int n,
                                               int tig) {
  const bf16 zero = __float2bfloat16(0.f);
  auto at = [&](int r, int c) {
    return w.row[r] < n ? x[((size_t)w.row[r] * heads + h) * D + c] : zero;
  };
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + 2 * tig;
    f[kk][0] = pack_bf16x2(at(0, c), at(0, c + 1));
    f[kk][1] = pack_bf16x2(at(1, c), at(1, c + 1));
    f[kk][2] = pack_bf16x2(at(0, c + 8), at(0, c + 9));
    f[kk][3] = pack_bf16x2(at(1, c + 8), at(1, c + 9));
  }
}

// One key tile of the forward for a warp (flash_tile, cuda_common.cuh), keys j0 .. j0 + BK − 1
// masked unless the tile lies inside every row's range.
template <int D, int BK>
__device__ __forceinline__ void attend_tile(const bf16* ks, const bf16* vs,
                                            const uint32_t (&qf)[D / 16][4], float (&o)[D / 8][4],
                                            float (&m)[2], float (&l)[2], const WarpRows& w,
                                            int j0, float scale2, int lane, int tig) {
  flash_tile<D, BK>(ks, vs, qf, o, m, l, scale2, lane, tig, w.covers(j0, BK),
                    [&](int r, int j) { return w.attends(r, j0 + j); });
}

// The forward's result for a warp's rows: out = o / l, lse = (m + log2 l)·ln 2 (m in base 2).
template <int D>
__device__ __forceinline__ void write_rows(bf16* out, float* lse, const float (&o)[D / 8][4],
                                           const float (&m)[2], const float (&l)[2],
                                           const WarpRows& w, int h, int hq, int n, int tig) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (w.row[r] >= n) continue;
    const size_t base = ((size_t)w.row[r] * hq + h) * D;
    const float inv = 1.f / l[r];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int c = dt * 8 + 2 * tig;
      out[base + c] = __float2bfloat16(o[dt][2 * r] * inv);
      out[base + c + 1] = __float2bfloat16(o[dt][2 * r + 1] * inv);
    }
    // m is in base 2: lse = (m + log2 l)·ln 2.
    if (tig == 0) lse[(size_t)w.row[r] * hq + h] = (m[r] + log2f(l[r])) * ATT_LN2;
  }
}

// ---- The forward on tensor cores (bf16, head_dim D = 64 or 128) ----
// The same contract as varlen_attn_fwd (output and lse, same scale convention), with the two
// products on mma.sync m16n8k16 (cuda_common.cuh), flash-attention-2 style: a warp owns 16
// query rows whose q fragments stay in registers; S = q·Kᵀ for a tile of BK = 64 keys lands in
// accumulator fragments, the online softmax runs on them in registers (a row's 64 scores are
// spread over the 4 lanes of a group: two shuffles per reduction), and P — rounded to bf16, as
// flash attention does — is reused as the A operand of P·V without leaving registers (the
// accumulator layout of two adjacent 8-key tiles is the A layout of one 16-key step). K and V
// tiles go through shared memory as bf16, rows padded by 8 elements so that a fragment's 32
// lanes read 32 distinct banks, in two stages: the next tile's copy (cp.async, when K and V
// start 16-byte aligned) runs while this one is computed. l sums the f32 probabilities. Rows
// of other segments and keys past a row are masked to −∞; a tile holding no key of any of the
// warp's rows is skipped.
template <int D>
__device__ void varlen_attn_fwd_tc(const bf16* q, const bf16* k, const bf16* v, const int* cu,
                                   int n_cu, bf16* out, float* lse, int n, int hq, int hkv, int d,
                                   float scale, int block_rows) {
  constexpr int BQ = 16 * ATT_WARPS, BK = 64, KS = D + 8;
  if (block_rows != BQ || d != D || blockDim.x != 32 * ATT_WARPS ||
      dynamic_smem_bytes() < 2u * 2 * 2 * BK * KS)
    __trap();
  extern __shared__ float smem[];
  bf16* stages = reinterpret_cast<bf16*>(smem);  // 2 × ([BK][KS] keys, [BK][KS] values)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int h = blockIdx.y, g = h / (hq / hkv);
  const int i0 = blockIdx.x * BQ;
  if (i0 >= n) return;
  const int i_last = min(i0 + BQ, n) - 1;
  const int k_begin = cu[seg_of(cu, n_cu, i0)];
  const WarpRows w(cu, n_cu, i0 + warp * 16, gid, n);
  const float scale2 = scale * ATT_LOG2E;
  uint32_t qf[D / 16][4];
  load_row_frags<D>(qf, q, w, h, hq, n, tig);
  float o[D / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
  const int tiles = (i_last - k_begin) / BK + 1;
  pipelined_kv_tiles<D, BK>(stages, k, v, k_begin, i_last + 1, g, hkv, tiles,
                            [&](int t, const bf16* ks, const bf16* vs) {
                              const int j0 = k_begin + t * BK;
                              if (!w.skips(j0, BK, n))
                                attend_tile<D, BK>(ks, vs, qf, o, m, l, w, j0, scale2, lane, tig);
                            });
  write_rows<D>(out, lse, o, m, l, w, h, hq, n, tig);
}

// ---- The backward on tensor cores (bf16, head_dim D = 64 or 128) ----
// The scalar backward's split (∂Q per query tile, ∂K/∂V per key tile, each output owned by one
// lane: no atomics, a fixed summation order), with every product on mma.sync. P and dS are
// recomputed in f32 from the accumulators and rounded to bf16 only as the A operand of the next
// product (as flash attention's backward does).

// A operand fragment of a row-major bf16 tile in shared memory: rows r0 + gid (+ 8), columns
// c0 + 2·tig (+ 1, + 8, + 9), `stride` elements per row.
// One ldmatrix.x4: matrix i is rows r0 + 8·(i % 2), columns c0 + 8·(i / 2) (the A fragment's
// register order).
__device__ __forceinline__ void ld_a_frag(uint32_t (&a)[4], const bf16* t, int stride, int r0,
                                          int c0, int lane) {
  const int mi = lane >> 3, rr = lane & 7;
  ldsm_x4(a, t + (r0 + (mi & 1) * 8 + rr) * stride + c0 + (mi >> 1) * 8);
}

// Two accumulator tiles (16×8 each, columns c and c + 8) as one A operand of 16 rows × 16.
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                         const float (&hi)[4]) {
  a[0] = pack_bf16x2(lo[0], lo[1]);
  a[1] = pack_bf16x2(lo[2], lo[3]);
  a[2] = pack_bf16x2(hi[0], hi[1]);
  a[3] = pack_bf16x2(hi[2], hi[3]);
}

// acc[dt] += a · T[k0 .. k0 + 15, dt·8 ..] for a row-major bf16 tile T [k][D + 8] in shared
// memory (B operand with k = T's rows, loaded transposed).
template <int D>
__device__ __forceinline__ void mma_rows(float (&acc)[D / 8][4], const uint32_t (&a)[4],
                                         const bf16* t, int k0, int lane) {
#pragma unroll
  for (int dt = 0; dt < D / 8; dt += 2) {
    uint32_t b[4];
    ld_b_cols<D>(b, t, k0, dt * 8, lane);
    mma_bf16_16816(acc[dt], a, b[0], b[1]);
    mma_bf16_16816(acc[dt + 1], a, b[2], b[3]);
  }
}

// ∂Q: block = 64 query rows (16 per warp) of head blockIdx.y; keys in tiles of 32 from the first
// row's segment start. Per tile S = q·Kᵀ and dP = ∂O·Vᵀ (q and ∂O fragments in registers),
// dS = P ∘ (dP − delta) with P = exp(S·scale − lse), then ∂Q += dS·K; ∂Q·scale at the end.
template <int D>
__device__ void varlen_attn_bwd_dq_tc(const bf16* q, const bf16* k, const bf16* v,
                                      const bf16* dout, const float* lse, const float* delta,
                                      const int* cu, int n_cu, bf16* dq, int n, int hq, int hkv,
                                      int d, float scale, int block_rows) {
  constexpr int BQ = 16 * ATT_WARPS, BK = 32, KS = D + 8;
  if (block_rows != BQ || d != D || blockDim.x != 32 * ATT_WARPS ||
      dynamic_smem_bytes() < 2u * 2 * 2 * BK * KS)
    __trap();
  extern __shared__ float smem[];
  bf16* stages = reinterpret_cast<bf16*>(smem);  // 2 × ([BK][KS] keys, [BK][KS] values)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int h = blockIdx.y, g = h / (hq / hkv);
  const int i0 = blockIdx.x * BQ;
  if (i0 >= n) return;
  const int i_last = min(i0 + BQ, n) - 1;
  const int k_begin = cu[seg_of(cu, n_cu, i0)];
  const WarpRows w(cu, n_cu, i0 + warp * 16, gid, n);
  const float scale2 = scale * ATT_LOG2E;
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool in = w.row[r] < n;
    row_lse[r] = in ? lse[(size_t)w.row[r] * hq + h] * ATT_LOG2E : 0.f;  // base 2
    row_delta[r] = in ? delta[(size_t)w.row[r] * hq + h] : 0.f;
  }
  uint32_t qf[D / 16][4], gf[D / 16][4];
  load_row_frags<D>(qf, q, w, h, hq, n, tig);
  load_row_frags<D>(gf, dout, w, h, hq, n, tig);
  float acc[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;
  const int tiles = (i_last - k_begin) / BK + 1;
  pipelined_kv_tiles<D, BK>(stages, k, v, k_begin, i_last + 1, g, hkv, tiles,
                            [&](int t, const bf16* ks, const bf16* vs) {
    const int j0 = k_begin + t * BK;
    if (w.skips(j0, BK, n)) return;
    float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int nt = 0; nt < BK / 8; nt += 2) {
        uint32_t kb[4], vb[4];
        ld_b_rows<D>(kb, ks, nt * 8, kk * 16, lane);
        ld_b_rows<D>(vb, vs, nt * 8, kk * 16, lane);
        mma_bf16_16816(s[nt], qf[kk], kb[0], kb[1]);
        mma_bf16_16816(s[nt + 1], qf[kk], kb[2], kb[3]);
        mma_bf16_16816(dp[nt], gf[kk], vb[0], vb[1]);
        mma_bf16_16816(dp[nt + 1], gf[kk], vb[2], vb[3]);
      }
    // P = 2^(S·scale·log2 e − lse·log2 e), masked unless the tile is inside every row's range.
    const bool full = w.covers(j0, BK);
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, j = j0 + nt * 8 + 2 * tig + (e & 1);
        const float p =
            full || w.attends(r, j) ? exp2f(fmaf(s[nt][e], scale2, -row_lse[r])) : 0.f;
        s[nt][e] = p * (dp[nt][e] - row_delta[r]);  // dS
      }
#pragma unroll
    for (int kt = 0; kt < BK / 16; ++kt) {
      uint32_t a[4];
      acc_to_a(a, s[2 * kt], s[2 * kt + 1]);
      mma_rows<D>(acc, a, ks, kt * 16, lane);
    }
  });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (w.row[r] >= n) continue;
    const size_t base = ((size_t)w.row[r] * hq + h) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int c = dt * 8 + 2 * tig;
      dq[base + c] = __float2bfloat16(acc[dt][2 * r] * scale);
      dq[base + c + 1] = __float2bfloat16(acc[dt][2 * r + 1] * scale);
    }
  }
}

// ∂K, ∂V: block = 64 key rows (16 per warp) of key/value head blockIdx.y, in shared memory
// with steps of 48 queries (q, ∂O, their lse and delta; two stages, the next step's copied by
// cp.async while this one is computed), for every query head of the group in turn, queries
// from the block's first key to the end of its last key's segment. A warp walks the step's
// queries 16 at a time, skipping those none of its keys meets: Sᵀ = K·qᵀ and dPᵀ = V·∂Oᵀ
// (16 keys × 16 queries), Pᵀ = exp(Sᵀ·scale − lse), dSᵀ = Pᵀ ∘ (dPᵀ − delta); ∂V += Pᵀ·∂O and
// ∂K += dSᵀ·q, ∂K·scale at the end. (At head_dim 128 that is 87 KB of shared memory, which the
// launcher opts in to; 48 queries a step keep it under the 99 KiB every sm_80+ card allows.)
template <int D>
__device__ void varlen_attn_bwd_dkv_tc(const bf16* q, const bf16* k, const bf16* v,
                                       const bf16* dout, const float* lse, const float* delta,
                                       const int* cu, int n_cu, bf16* dk, bf16* dv, int n, int hq,
                                       int hkv, int d, float scale, int block_rows) {
  constexpr int BKV = 16 * ATT_WARPS, BQ = 48, KS = D + 8;
  // A stage: q and ∂O tiles [BQ][KS] each, then lse and delta [BQ] (f32).
  constexpr int STAGE = 2 * BQ * KS * 2 + 2 * BQ * 4;  // bytes (a multiple of 16)
  static_assert(STAGE % 16 == 0, "cp.async needs 16-byte aligned stages");
  if (block_rows != BKV || d != D || blockDim.x != 32 * ATT_WARPS ||
      dynamic_smem_bytes() < 2u * 2 * BKV * KS + 2 * STAGE)
    __trap();
  extern __shared__ float smem[];
  bf16* kts = reinterpret_cast<bf16*>(smem);  // [BKV][KS]
  bf16* vts = kts + BKV * KS;                  // [BKV][KS]
  char* stages = reinterpret_cast<char*>(vts + BKV * KS);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int g = blockIdx.y, rep = hq / hkv;
  const float scale2 = scale * ATT_LOG2E;
  const int j0 = blockIdx.x * BKV;
  if (j0 >= n) return;
  const int j_last = min(j0 + BKV, n) - 1;
  const int q_end = cu[seg_of(cu, n_cu, j_last) + 1];  // queries j0 .. q_end − 1
  load_tile_pair<D, BKV>(kts, vts, k, v, j0, n, g, hkv);  // visible after two_stage's barrier
  // This lane's two keys (rows gid, gid + 8 of the warp's 16) and their segments' ends: query
  // i attends key j iff j <= i < end(j). A key past n gets end −1 (no query).
  const int wk0 = j0 + warp * 16, wk_last = min(wk0 + 15, n - 1);
  const int w_qend = wk0 < n ? cu[seg_of(cu, n_cu, wk_last) + 1] : 0;
  int key[2], key_e[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    key[r] = wk0 + gid + 8 * r;
    key_e[r] = key[r] < n ? cu[seg_of(cu, n_cu, key[r]) + 1] : -1;
  }
  float acc_k[D / 8][4], acc_v[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_k[dt][e] = acc_v[dt][e] = 0.f;
  // Steps: for each query head h of the group, the queries j0 .. q_end − 1 in tiles of BQ.
  const int per_head = (q_end - j0 + BQ - 1) / BQ;
  const bool async = aligned16<2>({q, dout});
  auto stage_of = [&](int stage, bf16*& qs, bf16*& gs, float*& lse_s, float*& delta_s) {
    char* base = stages + stage * STAGE;
    qs = reinterpret_cast<bf16*>(base);
    gs = qs + BQ * KS;
    lse_s = reinterpret_cast<float*>(gs + BQ * KS);
    delta_s = lse_s + BQ;
  };
  two_stage(
      rep * per_head, async,
      [&](int t, int stage) {
        const int h = g * rep + t / per_head, i0 = j0 + (t % per_head) * BQ;
        bf16 *qs, *gs;
        float *lse_s, *delta_s;
        stage_of(stage, qs, gs, lse_s, delta_s);
        fetch_tile_pair<D, BQ>(async, qs, gs, q, dout, i0, q_end, h, hq);
        for (int x = threadIdx.x; x < BQ; x += blockDim.x) {
          const int i = i0 + x;
          lse_s[x] = i < q_end ? lse[(size_t)i * hq + h] * ATT_LOG2E : 0.f;  // base 2
          delta_s[x] = i < q_end ? delta[(size_t)i * hq + h] : 0.f;
        }
      },
      [&](int t, int stage) {
        const int i0 = j0 + (t % per_head) * BQ;
        bf16 *qs, *gs;
        float *lse_s, *delta_s;
        stage_of(stage, qs, gs, lse_s, delta_s);
        for (int sub = 0; sub < BQ; sub += 16) {
          const int i1 = i0 + sub;  // this sub-step's queries i1 .. i1 + 15
          if (wk0 >= n || i1 >= q_end || i1 + 16 <= wk0 || i1 >= w_qend) continue;  // warp-uniform
          float st[2][4], dpt[2][4];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t ka[4], va[4], qb[4], gb[4];
            ld_a_frag(ka, kts, KS, warp * 16, kk * 16, lane);
            ld_a_frag(va, vts, KS, warp * 16, kk * 16, lane);
            ld_b_rows<D>(qb, qs, sub, kk * 16, lane);
            ld_b_rows<D>(gb, gs, sub, kk * 16, lane);
            mma_bf16_16816(st[0], ka, qb[0], qb[1]);
            mma_bf16_16816(st[1], ka, qb[2], qb[3]);
            mma_bf16_16816(dpt[0], va, gb[0], gb[1]);
            mma_bf16_16816(dpt[1], va, gb[2], gb[3]);
          }
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int r = e >> 1, ii = sub + nt * 8 + 2 * tig + (e & 1), i = i0 + ii;
              const bool valid = i >= key[r] && i < key_e[r];
              const float p = valid ? exp2f(fmaf(st[nt][e], scale2, -lse_s[ii])) : 0.f;
              st[nt][e] = p;
              dpt[nt][e] = p * (dpt[nt][e] - delta_s[ii]);  // dSᵀ
            }
          uint32_t pa[4], da[4];
          acc_to_a(pa, st[0], st[1]);
          acc_to_a(da, dpt[0], dpt[1]);
          mma_rows<D>(acc_v, pa, gs, sub, lane);
          mma_rows<D>(acc_k, da, qs, sub, lane);
        }
      });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= n) continue;
    const size_t base = ((size_t)key[r] * hkv + g) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int c = dt * 8 + 2 * tig;
      dk[base + c] = __float2bfloat16(acc_k[dt][2 * r] * scale);
      dk[base + c + 1] = __float2bfloat16(acc_k[dt][2 * r + 1] * scale);
      dv[base + c] = __float2bfloat16(acc_v[dt][2 * r]);
      dv[base + c + 1] = __float2bfloat16(acc_v[dt][2 * r + 1]);
    }
  }
}

// The tensor-core forward, bf16 only, for the head dims it is instantiated for (attention_cuda.rs
// launches it for those, the scalar kernels otherwise). The forward is bounded to 3 blocks an
// SM at head_dim 128 (168 registers, ptxas spills 24 bytes; unbounded it took 173, two
// blocks) and 4 at 64.
#define ATT_INSTANTIATE_TC(D)                                                                    \
  extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS, D == 128 ? 3 : 4)                  \
      varlen_attn_fwd_tc_d##D##_bf16(                                                            \
      const bf16* q, const bf16* k, const bf16* v, const int* cu, int n_cu, bf16* out,            \
      float* lse, int n, int hq, int hkv, int d, float scale, int block_rows) {                   \
    varlen_attn_fwd_tc<D>(q, k, v, cu, n_cu, out, lse, n, hq, hkv, d, scale, block_rows);         \
  }                                                                                               \
  extern "C" __global__ void varlen_attn_bwd_dq_tc_d##D##_bf16(                                  \
      const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,            \
      const float* delta, const int* cu, int n_cu, bf16* dq, int n, int hq, int hkv, int d,       \
      float scale, int block_rows) {                                                              \
    varlen_attn_bwd_dq_tc<D>(q, k, v, dout, lse, delta, cu, n_cu, dq, n, hq, hkv, d, scale,       \
                             block_rows);                                                         \
  }                                                                                               \
  extern "C" __global__ void varlen_attn_bwd_dkv_tc_d##D##_bf16(                                 \
      const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,            \
      const float* delta, const int* cu, int n_cu, bf16* dk, bf16* dv, int n, int hq, int hkv,    \
      int d, float scale, int block_rows) {                                                       \
    varlen_attn_bwd_dkv_tc<D>(q, k, v, dout, lse, delta, cu, n_cu, dk, dv, n, hq, hkv, d, scale,  \
                              block_rows);                                                        \
  }
ATT_INSTANTIATE_TC(64)
ATT_INSTANTIATE_TC(128)
