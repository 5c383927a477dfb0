// The decode step's projections for a few rows: y = x·Wᵀ with x [m ≤ 64, k] and the weight
// W [n, k] row-major (a Linear's), bf16 in and out, f32 accumulation on tensor cores
// (mma.sync m16n8k16). At batch 64 cuBLAS took ~24 µs a layer on an H200 (2026-11-27 profile)
// for ~30 MB of Qwen2.5-0.5B weights (~6 µs of HBM bytes): its tiles are made for large m, so
// the small projections run on a few SMs. Here a block owns SG_NT weight rows (output columns)
// and every row of x, and the product's k is split over gridDim.y blocks when the weight rows
// alone give too few blocks (decode_gemm.rs plans it); the last block of a tile to finish sums the tile's partials in split order (so the result does not depend on which
// block finishes first) and runs the epilogue:
//   SgPlain    y [m, n] = x·Wᵀ rounded to bf16 (what the cuBLAS product gives, up to the
//              order of the f32 sums);
//   SgSwiglu   W = [gate | up] stacked (n = 2·inter): y [m, inter] = silu(g)·u with g and u
//              the products rounded to bf16 first, as swiglu_packed_fwd reads them — the
//              packed gate/up product never goes to memory;
//   SgQkv      W = [q | k | v] stacked: qkv_bias_rope's arithmetic (product rounded, bias
//              added and rounded, q and k rotated) with q written to [m, nh, d] and k, v
//              straight into their cache slots as kv_write writes them — the packed product,
//              the rotated keys and values never go to memory, and two launches fewer.
// With norm_w given, x's rows go through the RMSNorm that precedes the projection on the way
// in: each stage's x rows are scaled by norm_w (per k) in shared memory as they land, their
// sums of squares kept (over all of k: split partials summed like the product's), and the
// product's rows scaled by 1/rms = rsqrt(Σx²/k + eps) before the epilogue — the decode layer's
// add_rms_norm launches fold into the products that read the norms (the rounding differs from
// rms_norm's: x·norm_w is rounded to bf16 instead of x/rms, then x/rms·norm_w). SgPlain's
// residual adds the residual stream to the rounded product (add_rms_norm's add).
// decode_kernels.cu includes this file (one PTX module); tools/cuda_emu runs it on CPU
// threads (decode_gemm driver).
#pragma once

// Weight rows (output columns) per block; 32 per warp.
#define SG_NT 128
// k per pipeline stage, and stages in flight (cp.async): three keep a block at ≤ 81 KiB of
// shared memory at 64 rows, inside the 99 KiB every sm_80+ card allows a block.
#define SG_KC 64
#define SG_STAGES 3
#define SG_WARPS 4
// Shared-memory rows of a stage: SG_KC bf16 and 8 of padding (ldmatrix rows in distinct banks).
#define SG_PITCH (SG_KC + 8)
// Columns of the f32 result tile in shared memory (padded).
#define SG_TILE_PITCH (SG_NT + 4)

// The epilogues: each gives the weight row of a block's local row r (0 .. SG_NT − 1) and
// writes the block's result from the f32 tile t [MR][SG_TILE_PITCH] in shared memory (rows
// past m are not read).
struct SgPlain {
  bf16* y;               // [m, n]
  const bf16* residual;  // [m, n] added to the rounded product, or null
  __device__ int weight_row(int tile, int r, int) const { return tile * SG_NT + r; }
  __device__ void store(const float* t, int tile, int m, int n) const {
    for (int i = threadIdx.x; i < m * SG_NT; i += blockDim.x) {
      const int r = i / SG_NT, c = i % SG_NT, col = tile * SG_NT + c;
      if (col >= n) continue;
      const size_t at = (size_t)r * n + col;
      float v = t[r * SG_TILE_PITCH + c];
      if (residual) v = __bfloat162float(__float2bfloat16(v)) + __bfloat162float(residual[at]);
      y[at] = __float2bfloat16(v);
    }
  }
};

// The first half of a block's rows are gate rows, the second half the same outputs' up rows.
struct SgSwiglu {
  bf16* y;  // [m, n / 2]
  __device__ int weight_row(int tile, int r, int n) const {
    constexpr int H = SG_NT / 2;
    return r < H ? tile * H + r : n / 2 + tile * H + (r - H);
  }
  __device__ void store(const float* t, int tile, int m, int n) const {
    constexpr int H = SG_NT / 2;
    const int inter = n / 2;
    for (int i = threadIdx.x; i < m * H; i += blockDim.x) {
      const int r = i / H, c = i % H;
      const float g = __bfloat162float(__float2bfloat16(t[r * SG_TILE_PITCH + c]));
      const float u = __bfloat162float(__float2bfloat16(t[r * SG_TILE_PITCH + H + c]));
      const float s = 1.f / (1.f + expf(-g));
      y[(size_t)r * inter + tile * H + c] = __float2bfloat16(g * s * u);
    }
  }
};

// n = (nh + 2·nkv)·d with d dividing SG_NT, so a block holds whole heads. Row r's key and
// value go to slot slots[r] of pool [2, slot_count, nkv·d] (keys, then values).
struct SgQkv {
  const bf16* bias;  // [n] or null
  const bf16* cos;   // [m, d / 2]
  const bf16* sin;
  bf16* q;  // [m, nh, d]
  bf16* pool;
  const uint32_t* slots;  // [m], each < slot_count
  int nh, nkv, d, slot_count;
  __device__ int weight_row(int tile, int r, int) const { return tile * SG_NT + r; }
  __device__ void store(const float* t, int tile, int m, int n) const {
    const int half = d / 2, pairs = SG_NT / 2;
    for (int i = threadIdx.x; i < m * pairs; i += blockDim.x) {
      const int r = i / pairs, p = i % pairs;
      const int lh = p / half, j = p % half, c0 = lh * d + j;
      const int col = tile * SG_NT + c0;
      if (col >= n) continue;
      const int head = col / d;
      float x1 = __bfloat162float(__float2bfloat16(t[r * SG_TILE_PITCH + c0]));
      float x2 = __bfloat162float(__float2bfloat16(t[r * SG_TILE_PITCH + c0 + half]));
      if (bias) {
        x1 = __bfloat162float(__float2bfloat16(x1 + __bfloat162float(bias[col])));
        x2 = __bfloat162float(__float2bfloat16(x2 + __bfloat162float(bias[col + half])));
      }
      bf16* dst;
      if (head < nh + nkv) {
        const float c = __bfloat162float(cos[(size_t)r * half + j]);
        const float s = __bfloat162float(sin[(size_t)r * half + j]);
        const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
        x1 = y1, x2 = y2;
        dst = head < nh ? q + ((size_t)r * nh + head) * d
                        : pool + (size_t)slots[r] * nkv * d + (size_t)(head - nh) * d;
      } else {
        dst = pool + ((size_t)slot_count + slots[r]) * nkv * d + (size_t)(head - nh - nkv) * d;
      }
      dst[j] = __float2bfloat16(x1);
      dst[j + half] = __float2bfloat16(x2);
    }
  }
};

// Block (tile, split): weight rows of `tile` (Epi::weight_row) times x's m rows over k in
// [split·k_split, min(k, (split + 1)·k_split)). MT = ⌈m / 16⌉ m16 tiles. part: f32
// [tiles, splits, MT·16, SG_NT] then [tiles, splits, MT·16] (the rows' sums of squares, read
// with norm_w) (null when splits = 1); norm_w: [k] or null; counters: u32 [tiles], zero before
// the launch and left zero after it (the last block of a tile wraps its counter back to zero).
// Requirements (decode_gemm.rs checks them): k % 8 == 0, x, w and norm_w 16-byte aligned,
// k_split % SG_KC == 0; SgSwiglu: n % SG_NT == 0; SgQkv: d even, dividing SG_NT. blockDim.x = 32·SG_WARPS; dynamic shared
// memory: SG_STAGES·(SG_NT + MT·16)·SG_PITCH bf16 (≥ the f32 tile MT·16 × SG_TILE_PITCH).
template <int MT, class Epi>
__device__ void skinny_gemm(const bf16* __restrict__ x, const bf16* __restrict__ w,
                            float* __restrict__ part, unsigned* __restrict__ counters, int m,
                            int n, int k, int k_split, int splits,
                            const bf16* __restrict__ norm_w, float eps, const Epi& epi) {
  constexpr int MR = MT * 16;
  constexpr int STAGE = (SG_NT + MR) * SG_PITCH;  // bf16 per stage: weight rows, then x rows
  constexpr unsigned SMEM = SG_STAGES * STAGE * 2;
  static_assert(MR * SG_TILE_PITCH * 4 <= SMEM, "the result tile reuses the stages");
  if (blockDim.x != 32 * SG_WARPS || dynamic_smem_bytes() < SMEM || m > MR || k % 8 != 0 ||
      k_split % SG_KC != 0 || gridDim.y != (unsigned)splits || (splits > 1 && part == nullptr))
    __trap();  // launch and kernel disagree
  extern __shared__ float smem[];
  bf16* stages = reinterpret_cast<bf16*>(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int k_begin = split * k_split, k_end = min(k, k_begin + k_split);
  const int chunks = k_end > k_begin ? (k_end - k_begin + SG_KC - 1) / SG_KC : 0;

  // Copies chunk c's weight and x rows into stage s (16-byte pieces; rows past n or m and k
  // past k_end as zeros).
  auto load = [&](int c, int s) {
    bf16* ws = stages + s * STAGE;
    bf16* xs = ws + SG_NT * SG_PITCH;
    const int k0 = k_begin + c * SG_KC;
    constexpr int PIECES = SG_KC / 8;
    for (int p = tid; p < (SG_NT + MR) * PIECES; p += 32 * SG_WARPS) {
      const int r = p / PIECES, kk = k0 + (p % PIECES) * 8;
      const bf16* src;
      bool ok;
      bf16* dst;
      if (r < SG_NT) {
        const int wr = epi.weight_row(tile, r, n);
        ok = wr < n && kk < k_end;
        src = w + (size_t)(ok ? wr : 0) * k + (ok ? kk : 0);
        dst = ws + r * SG_PITCH + (p % PIECES) * 8;
      } else {
        const int xr = r - SG_NT;
        ok = xr < m && kk < k_end;
        src = x + (size_t)(ok ? xr : 0) * k + (ok ? kk : 0);
        dst = xs + xr * SG_PITCH + (p % PIECES) * 8;
      }
      cp_async_16(dst, src, ok ? 16 : 0);
    }
  };

  // Warp `warp` owns the block's columns warp·32 .. warp·32 + 31: four n8 tiles.
  float acc[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

#pragma unroll
  for (int s = 0; s < SG_STAGES - 1; ++s) {
    if (s < chunks) load(s, s);
    cp_async_commit();  // an empty group keeps the count: wait<STAGES − 2> below stays right
  }
  // With norm_w: thread tid scales the 16-byte piece tid % 8 (8 of a stage's 64 k) of rows
  // tid / 8 + 16·i by norm_w and sums the squares of what it read, row by row.
  float sumsq[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) sumsq[i] = 0.f;
  for (int c = 0; c < chunks; ++c) {
    cp_async_wait<SG_STAGES - 2>();
    __syncthreads();  // chunk c is in; every warp is done with the stage chunk c − 1 used
    if (c + SG_STAGES - 1 < chunks) load(c + SG_STAGES - 1, (c + SG_STAGES - 1) % SG_STAGES);
    cp_async_commit();
    const bf16* ws = stages + (c % SG_STAGES) * STAGE;
    const bf16* xs = ws + SG_NT * SG_PITCH;
    if (norm_w) {
      bf16* xst = stages + (c % SG_STAGES) * STAGE + SG_NT * SG_PITCH;
      const int piece = tid & 7, kk = k_begin + c * SG_KC + piece * 8;
      // The piece's 8 weights (k_end is a multiple of 8: a piece lies wholly inside or past it).
      float g[8];
      if (kk < k_end) {
        Vec16<bf16>::load(norm_w + kk, g);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) g[j] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int r = (tid >> 3) + 16 * i;
        if (r >= m) continue;
        bf16* at = xst + r * SG_PITCH + piece * 8;
        float e[8];
        Vec16<bf16>::load(at, e);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          sumsq[i] += e[j] * e[j];  // zero past k_end (the copy filled zeros)
          e[j] *= g[j];
        }
        Vec16<bf16>::store(at, e);  // x·norm_w rounded to bf16
      }
      __syncthreads();  // the scaled rows are in before any warp reads them
    }
#pragma unroll
    for (int kk = 0; kk < SG_KC / 16; ++kk) {
      // B(k, n = weight row): rows warp·32 + 0..15 and 16..31 of the stage.
      uint32_t b[2][4];
      ld_b_rows<SG_KC>(b[0], ws, warp * 32, kk * 16, lane);
      ld_b_rows<SG_KC>(b[1], ws, warp * 32 + 16, kk * 16, lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // A rows mt·16 .. + 15: lanes 0-15 address rows 0-15 at k, lanes 16-31 at k + 8
        // (ldmatrix matrices 0-3 = the A fragment's registers 0-3).
        uint32_t a[4];
        ldsm_x4(a, xs + (mt * 16 + (lane & 15)) * SG_PITCH + kk * 16 + (lane >> 4) * 8);
        mma_bf16_16816(acc[mt][0], a, b[0][0], b[0][1]);
        mma_bf16_16816(acc[mt][1], a, b[0][2], b[0][3]);
        mma_bf16_16816(acc[mt][2], a, b[1][0], b[1][1]);
        mma_bf16_16816(acc[mt][3], a, b[1][2], b[1][3]);
      }
    }
  }
  cp_async_wait<0>();
  // Row r's sum of squares over this block's k.
  __shared__ float row_sumsq[MR];
  if (norm_w) {  // the same for every thread of the block
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      float v = sumsq[i];  // a row's 8 pieces are neighbouring lanes
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      if ((tid & 7) == 0) row_sumsq[(tid >> 3) + 16 * i] = v;
    }
  }
  __syncthreads();  // the stages are free: the block's f32 tile [MR][SG_TILE_PITCH] goes there
  float* t = smem;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = mt * 16 + gid + (e >> 1) * 8, col = warp * 32 + nt * 8 + 2 * tig + (e & 1);
        t[r * SG_TILE_PITCH + col] = acc[mt][nt][e];
      }
  __syncthreads();

  if (splits > 1) {
    // This split's partial out; the tile's last block to arrive sums them all in split order.
    float* mine = part + ((size_t)tile * splits + split) * MR * SG_NT;
    for (int i = tid; i < m * (SG_NT / 4); i += 32 * SG_WARPS) {  // rows past m are not read
      const int r = i / (SG_NT / 4), c4 = (i % (SG_NT / 4)) * 4;
      *reinterpret_cast<float4*>(mine + r * SG_NT + c4) =
          *reinterpret_cast<const float4*>(t + r * SG_TILE_PITCH + c4);
    }
    // The sums of squares after every tile's partials: [tiles, splits, MR].
    float* sumsq_part = part + (size_t)gridDim.x * splits * MR * SG_NT;
    if (norm_w && tid < m) sumsq_part[((size_t)tile * splits + split) * MR + tid] = row_sumsq[tid];
    __threadfence();  // the partial is visible device-wide before the counter says so
    __syncthreads();
    __shared__ int last;
    // The last arrival finds splits − 1 and wraps the counter to zero for the next launch.
    if (tid == 0) last = atomicInc(counters + tile, (unsigned)splits - 1) == (unsigned)splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // every other split's partial is visible to this block
    const float* all = part + (size_t)tile * splits * MR * SG_NT;
    for (int i = tid; i < m * (SG_NT / 4); i += 32 * SG_WARPS) {
      const int r = i / (SG_NT / 4), c4 = (i % (SG_NT / 4)) * 4;
      float4 s = ld_cg_f4(all + r * SG_NT + c4);
      for (int sp = 1; sp < splits; ++sp) {
        const float4 v = ld_cg_f4(all + (size_t)sp * MR * SG_NT + r * SG_NT + c4);
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
      }
      *reinterpret_cast<float4*>(t + r * SG_TILE_PITCH + c4) = s;
    }
    if (norm_w && tid < m) {
      const float* ss = sumsq_part + (size_t)tile * splits * MR + tid;
      float s = ld_cg_f1(ss);
      for (int sp = 1; sp < splits; ++sp) s += ld_cg_f1(ss + (size_t)sp * MR);
      row_sumsq[tid] = s;
    }
    __syncthreads();
  }

  if (norm_w) {
    // Row r times 1/rms: the product of x/rms (times norm_w), as the norm then the projection.
    if (tid < m) row_sumsq[tid] = rsqrtf(row_sumsq[tid] / (float)k + eps);
    __syncthreads();
    for (int i = tid; i < m * SG_NT; i += 32 * SG_WARPS) {
      const int r = i / SG_NT, c = i % SG_NT;
      t[r * SG_TILE_PITCH + c] *= row_sumsq[r];
    }
    __syncthreads();
  }
  epi.store(t, tile, m, n);
}
