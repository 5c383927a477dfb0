// CUDA kernels of the rollout engine's decode step: attention of one query token per row over
// a paged KV cache (crates/model/src/ops/paged_attention.rs), read in place through the rows'
// block tables, for f32 and bf16 tensors with f32 accumulation (CPU twin: the same custom op's
// `cpu_fwd`, PagedDecode; tests/paged_kv.rs compares both with a dense reference on
// $COMPOSER_TEST_DEVICE) and the KV-cache write; with, included below, the sampler's
// inverse-CDF draw of the next token (sample_kernels.cuh), the tensor-core paged decode
// (decode_tc_kernels.cuh), the skinny products (decode_gemm_kernels.cuh) and deterministic mode's
// batch-invariant kernels (rows_invariant_kernels.cuh); the kernels are instantiated here.
// Built to its own PTX by crates/model/build.rs (`--features cuda`); launched by decode_cuda.rs.
#include "cuda_common.cuh"

// Query heads whose value sums one thread keeps in registers at once (more heads per group
// take several passes over the chunk's values).
#define DK_HEADS_PER_PASS 8
// Largest head_dim: a warp holds one key row in DK_MAX_D / 32 registers per lane.
#define DK_MAX_D 256

// One key's scores against every query head of the group (q_s [n_rep, d]), in passes of
// DK_HEADS_PER_PASS heads: this lane holds the key's values x[i] at columns col0 + i·col_step
// (those below d count), the `width` lanes sharing the key (a power of two, aligned) sum their
// partial dot products by shuffles, and the lane with `writes` stores score·scale into
// sc[head·chunk + jj]. Every lane of the warp calls it.
template <int N>
__device__ __forceinline__ void score_key(const float* q_s, const float (&x)[N], int col0,
                                          int col_step, int d, int n_rep, int width, bool writes,
                                          float* sc, int chunk, int jj, float scale) {
  for (int r0 = 0; r0 < n_rep; r0 += DK_HEADS_PER_PASS) {
    float s[DK_HEADS_PER_PASS];
#pragma unroll
    for (int h = 0; h < DK_HEADS_PER_PASS; h++) {
      s[h] = 0.f;
      if (r0 + h < n_rep) {
        const float* qr = q_s + (r0 + h) * d;
#pragma unroll
        for (int i = 0; i < N; i++) {
          const int e = col0 + i * col_step;
          if (e < d) s[h] += qr[e] * x[i];
        }
      }
    }
    for (int o = width / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int h = 0; h < DK_HEADS_PER_PASS; h++) s[h] += __shfl_xor_sync(FULL_MASK, s[h], o);
    }
    if (writes) {
#pragma unroll
      for (int h = 0; h < DK_HEADS_PER_PASS; h++)
        if (r0 + h < n_rep) sc[(r0 + h) * chunk + jj] = s[h] * scale;
    }
  }
}

// The vectorised value pass of paged_decode (see there): thread t reads columns cv·VEC.. (cv =
// t mod L) of the keys of key group t / L (256 / L groups, keys strided by that), summing the
// probability-weighted values of up to DK_HEADS_PER_PASS query heads in registers; the groups
// of a warp meet by shuffles, the warps through `red` (`red_words` long: as many heads at a time
// as fit, at least one); warp 0's first L lanes write the result.
template <typename T>
__device__ void vec_values(const T* __restrict__ v, const uint32_t* slot_s, const float* sc,
                           const float* m_s, const float* l_s, float* red, int red_words,
                           T* __restrict__ out,
                           float* __restrict__ part_o, float* __restrict__ part_m,
                           float* __restrict__ part_l, int n, int chunk, int n_rep, int g, int hkv,
                           int hq, int d, int row, int split, int splits, int L) {
  constexpr int VEC = Vec16<T>::N;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int groups = blockDim.x / L, kg = tid / L, cv = tid % L;
  const int rh = min(DK_HEADS_PER_PASS, red_words / ((nwarps - 1) * d));  // heads a round
  for (int r0 = 0; r0 < n_rep; r0 += DK_HEADS_PER_PASS) {
    float acc[DK_HEADS_PER_PASS][VEC];
#pragma unroll
    for (int h = 0; h < DK_HEADS_PER_PASS; h++)
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[h][e] = 0.f;
#pragma unroll 2
    for (int jj = kg; jj < n; jj += groups) {
      float x[VEC];
      Vec16<T>::load(v + ((size_t)slot_s[jj] * hkv + g) * d + cv * VEC, x);
#pragma unroll
      for (int h = 0; h < DK_HEADS_PER_PASS; h++) {
        if (r0 + h < n_rep) {
          const float p = sc[(r0 + h) * chunk + jj];
#pragma unroll
          for (int e = 0; e < VEC; e++) acc[h][e] += p * x[e];
        }
      }
    }
    // The warp's key groups (lanes cv, cv + L, …) into its first L lanes.
    for (int o = L; o < 32; o <<= 1) {
#pragma unroll
      for (int h = 0; h < DK_HEADS_PER_PASS; h++)
#pragma unroll
        for (int e = 0; e < VEC; e++) acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], o);
    }
    // The warps into warp 0, heads h0 .. h0 + rh − 1 a round (block-uniform bounds; the
    // register array is indexed by unrolled constants only).
    for (int h0 = 0; h0 < DK_HEADS_PER_PASS && r0 + h0 < n_rep; h0 += rh) {
      if (warp > 0 && lane < L) {
#pragma unroll
        for (int h = 0; h < DK_HEADS_PER_PASS; h++)
          if (h >= h0 && h < h0 + rh) {
#pragma unroll
            for (int e = 0; e < VEC; e++)
              red[((warp - 1) * rh + h - h0) * d + cv * VEC + e] = acc[h][e];
          }
      }
      __syncthreads();
      if (warp == 0 && lane < L) {
        for (int w = 1; w < nwarps; w++) {
#pragma unroll
          for (int h = 0; h < DK_HEADS_PER_PASS; h++)
            if (h >= h0 && h < h0 + rh) {
#pragma unroll
              for (int e = 0; e < VEC; e++)
                acc[h][e] += red[((w - 1) * rh + h - h0) * d + cv * VEC + e];
            }
        }
      }
      __syncthreads();  // `red` is reused by the next heads
    }
    if (warp == 0 && lane < L) {
#pragma unroll
      for (int i = 0; i < DK_HEADS_PER_PASS; i++) {
        const int r = r0 + i;
        if (r >= n_rep) break;
        const size_t h = (size_t)row * hq + (size_t)g * n_rep + r;
#pragma unroll
        for (int e = 0; e < VEC; e++) {
          const int col = cv * VEC + e;
          if (splits == 1) {
            out[h * d + col] = from_f<T>(acc[i][e] / l_s[r]);
          } else {
            part_o[(h * splits + split) * d + col] = acc[i][e];
          }
        }
        if (splits > 1 && cv == 0) {
          part_m[h * splits + split] = m_s[r];
          part_l[h * splits + split] = l_s[r];
        }
      }
    }
  }
}

// What block (row · hkv + g, split) of a paged decode kernel serves: KV head g of `row`, keys
// [start, start + n) of the row's len (n = 0: the row has fewer chunks than the grid; the
// merge reads only its own), and where key j of the row lies in the pools.
struct DecodeChunk {
  int row, g, split, len, start, n;
  const uint32_t* table;  // the row's block table

  __device__ DecodeChunk(const uint32_t* lens, const uint32_t* tables, int hkv, int chunk,
                         int max_blocks) {
    row = blockIdx.x / hkv;
    g = blockIdx.x % hkv;
    split = blockIdx.y;
    len = (int)lens[row];
    start = split * chunk;
    n = start < len ? min(chunk, len - start) : 0;
    table = tables + (size_t)row * max_blocks;
  }

  // The slot of the chunk's key jj (the row's key start + jj).
  __device__ uint32_t slot(int jj, int block_size) const {
    const int j = start + jj;
    return table[j / block_size] * (uint32_t)block_size + (uint32_t)(j % block_size);
  }
};

// ---- The chunks of a paged decode merged (splits > 1) by the last block of the group ----
// Every block of (row, KV head g) with keys, once its partials are written, counts itself in
// counters[row · hkv + g]; the last of the row's ⌈len / chunk⌉ to arrive merges them for the
// group's query heads — out[row, h] = Σ_s e^{m_s − M}·o_s / Σ_s e^{m_s − M}·l_s, M the largest
// chunk max — and wraps the counter back to zero for the next launch (no launch zeroes them: a
// CUDA graph replays the kernel alone). Each head's M and denominator are found once, by a warp
// (lanes over the chunks, butterfly-reduced), then every output sums its chunks in chunk order:
// the order is fixed by the row's length and the block size, not by which block came last.
// Until 2026-11-28 a second kernel did this merge: one launch more per layer and step. `scratch`
// is the block's shared memory (1 + 2·n_rep words), no longer read by the caller. Every thread
// of the block calls it.
template <typename T>
__device__ void merge_chunks_if_last(const DecodeChunk& c, const float* part_o,
                                     const float* part_m, const float* part_l,
                                     unsigned* counters, T* out, float* scratch, int hq, int hkv,
                                     int d, int chunk, int splits) {
  const int used = (c.len + chunk - 1) / chunk;
  int* flag = reinterpret_cast<int*>(scratch);
  float* stats = scratch + 1;  // [n_rep][max, denominator]
  __threadfence();  // this block's partials are visible device-wide before the counter says so
  __syncthreads();  // and every thread is done with shared memory (scratch reuses it)
  if (threadIdx.x == 0)
    *flag = atomicInc(counters + (size_t)c.row * hkv + c.g, (unsigned)used - 1) ==
            (unsigned)used - 1;
  __syncthreads();
  if (!*flag) return;
  __threadfence();  // every other chunk's partials are visible to this block
  const int n_rep = hq / hkv, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t h0 = (size_t)c.row * hq + (size_t)c.g * n_rep;
  for (int r = warp; r < n_rep; r += blockDim.x >> 5) {
    const float* m = part_m + (h0 + r) * splits;
    const float* l = part_l + (h0 + r) * splits;
    float top = -INFINITY;
    for (int s = lane; s < used; s += 32) top = fmaxf(top, ld_cg_f1(m + s));
    top = warp_max(top);
    float den = 0.f;
    for (int s = lane; s < used; s += 32) den += expf(ld_cg_f1(m + s) - top) * ld_cg_f1(l + s);
    den = warp_sum(den);
    if (lane == 0) {
      stats[2 * r] = top;
      stats[2 * r + 1] = den;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_rep * d; i += blockDim.x) {
    const int r = i / d, col = i % d;
    const size_t h = h0 + r;
    const float* m = part_m + h * splits;
    const float* o = part_o + h * splits * d + col;
    const float top = stats[2 * r];
    float num = 0.f;
#pragma unroll 4
    for (int s = 0; s < used; s++) num += expf(ld_cg_f1(m + s) - top) * ld_cg_f1(o + (size_t)s * d);
    out[h * d + col] = from_f<T>(num / stats[2 * r + 1]);
  }
}

// The scalar value pass of paged_decode (see there): `groups` = 256 / d groups of d threads,
// each thread one column, group p taking keys p, p + groups, …; the groups' sums are added
// through `red`; group 0 writes the result.
template <typename T>
__device__ void scalar_values(const T* __restrict__ v, const uint32_t* slot_s, const float* sc,
                              const float* m_s, const float* l_s, float* red,
                              T* __restrict__ out, float* __restrict__ part_o,
                              float* __restrict__ part_m, float* __restrict__ part_l, int n,
                              int chunk, int n_rep, int g, int hkv, int hq, int d, int row,
                              int split, int splits) {
  const int tid = threadIdx.x;
  const int groups = blockDim.x / d;
  const int col = tid % d, grp = tid / d;
  const bool active = grp < groups;
  for (int r0 = 0; r0 < n_rep; r0 += DK_HEADS_PER_PASS) {
    float acc[DK_HEADS_PER_PASS];
#pragma unroll
    for (int i = 0; i < DK_HEADS_PER_PASS; i++) acc[i] = 0.f;
    if (active) {
      // Unrolled by two: two keys' value loads in flight per thread (more spills registers).
#pragma unroll 2
      for (int jj = grp; jj < n; jj += groups) {
        const float x = to_f(v[((size_t)slot_s[jj] * hkv + g) * d + col]);
#pragma unroll
        for (int i = 0; i < DK_HEADS_PER_PASS; i++)
          if (r0 + i < n_rep) acc[i] += sc[(r0 + i) * chunk + jj] * x;
      }
    }
    if (groups > 1) {
      if (active && grp > 0) {
#pragma unroll
        for (int i = 0; i < DK_HEADS_PER_PASS; i++)
          red[((grp - 1) * DK_HEADS_PER_PASS + i) * d + col] = acc[i];
      }
      __syncthreads();
      if (grp == 0) {
        for (int p = 1; p < groups; p++) {
#pragma unroll
          for (int i = 0; i < DK_HEADS_PER_PASS; i++)
            acc[i] += red[((p - 1) * DK_HEADS_PER_PASS + i) * d + col];
        }
      }
      __syncthreads();  // `red` is reused by the next pass
    }
    if (grp == 0) {
#pragma unroll
      for (int i = 0; i < DK_HEADS_PER_PASS; i++) {
        const int r = r0 + i;
        if (r >= n_rep) break;
        const size_t h = (size_t)row * hq + (size_t)g * n_rep + r;
        if (splits == 1) {
          out[h * d + col] = from_f<T>(acc[i] / l_s[r]);
        } else {
          part_o[(h * splits + split) * d + col] = acc[i];
          if (col == 0) {
            part_m[h * splits + split] = m_s[r];
            part_l[h * splits + split] = l_s[r];
          }
        }
      }
    }
  }
}

// ---- Paged decode attention, one block per (row, kv head, chunk of keys) ----
// q [rows, hq, d]; k, v [slots, hkv, d]; tables [rows, max_blocks] (row b's token j lies in
// slot tables[b][j / block_size] * block_size + j % block_size); lens [rows] (>= 1). The
// block serves the group's n_rep = hq / hkv query heads over keys [split·chunk, (split+1)·chunk)
// of its row: scores q·k·scale into shared memory, the chunk's softmax (max, exp, sum), then
// the probability-weighted sum of the values.
//   splits == 1: out [rows, hq, d] gets the normalised result.
//   splits > 1: the chunk's unnormalised sums go to part_o [rows, hq, splits, d] with its max
//   and exp-sum in part_m / part_l [rows, hq, splits]; the group's last block to finish merges
//   them into out (merge_chunks_if_last; counters u32 [rows · hkv], zero before the launch and
//   left zero after it).
// blockDim.x = 256 (8 warps); head_dim d <= DK_MAX_D. Dynamic shared memory (4-byte words):
// q [n_rep·d] | scores [n_rep·chunk] | max, sum [2·n_rep] | reduction [what is left, at least
// 8·d·(256/d − 1)] | the chunk's KV slots [chunk] (u32), the last `chunk` words.
// Two ways through the key and value passes, the same maths in another summation order:
// vectorised — each key or value row read 16 bytes a lane by L = d / Vec16<T>::N lanes, so a
// warp has 32 / L keys (and the block 256 / L) in flight at once — when L is a power of two up
// to 32, both pools start 16-byte aligned and the reduction region holds 7·d words (the plan
// gives it 7·d·(d ≤ 128 ? 2 : 1) where that fits); else a warp per key and a thread per column. (On
// an H200 the second, one key after another per warp, took 46.6 µs per layer at batch 64:
// latency-bound.)
template <typename T>
__device__ void paged_decode(const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, const uint32_t* __restrict__ tables,
                             const uint32_t* __restrict__ lens, T* __restrict__ out,
                             float* __restrict__ part_o, float* __restrict__ part_m,
                             float* __restrict__ part_l, unsigned* __restrict__ counters,
                             int hq, int hkv, int d, int block_size, int max_blocks, int chunk,
                             int splits, float scale) {
  extern __shared__ float smem[];
  const DecodeChunk c(lens, tables, hkv, chunk, max_blocks);
  if (c.len > splits * chunk) __trap();  // the plan is shorter than the row: keys would be lost
  if (c.n == 0) return;
  const int row = c.row, g = c.g, split = c.split, n = c.n;
  const int n_rep = hq / hkv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;

  float* q_s = smem;                  // [n_rep, d]
  float* sc = q_s + n_rep * d;        // [n_rep, chunk]
  float* m_s = sc + n_rep * chunk;    // [n_rep]
  float* l_s = m_s + n_rep;           // [n_rep]
  float* red = l_s + n_rep;  // [(groups − 1), DK_HEADS_PER_PASS, d] or [7, heads, d]
  uint32_t* slot_s = reinterpret_cast<uint32_t*>(smem + dynamic_smem_bytes() / 4 - chunk);
  const int red_words = (int)(reinterpret_cast<float*>(slot_s) - red);
  if (red_words < DK_HEADS_PER_PASS * d * ((int)blockDim.x / d - 1)) __trap();  // plan mismatch

  const T* qg = q + ((size_t)row * hq + (size_t)g * n_rep) * d;
  for (int i = tid; i < n_rep * d; i += blockDim.x) q_s[i] = to_f(qg[i]);
  // The chunk's slots, looked up once by all threads together: the key and value passes then
  // load each row without first waiting on its block table entry (on an H200 the two
  // dependent loads per key made the kernel latency-bound: 46.6 µs per layer at batch 64).
  for (int jj = tid; jj < n; jj += blockDim.x) slot_s[jj] = c.slot(jj, block_size);
  __syncthreads();

  constexpr int VEC = Vec16<T>::N;
  const int vec_lanes = d % VEC == 0 ? d / VEC : 0;  // L
  const bool vec = vec_lanes > 0 && vec_lanes <= 32 && (vec_lanes & (vec_lanes - 1)) == 0 &&
                   aligned16<2>({k, v}) &&
                   red_words >= (nwarps - 1) * d;
  if (vec) {
    // Scores: lane `cv` of each L-lane group reads columns cv·VEC.. of the group's key; the
    // group's partial dot products meet by shuffles within the group.
    const int L = vec_lanes, keys_per_warp = 32 / L, sub = lane / L, cv = lane % L;
#pragma unroll 2
    for (int base = warp * keys_per_warp; base < n; base += nwarps * keys_per_warp) {
      const int jj = base + sub;
      float kx[VEC];
      if (jj < n) {
        Vec16<T>::load(k + ((size_t)slot_s[jj] * hkv + g) * d + cv * VEC, kx);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; e++) kx[e] = 0.f;
      }
      score_key(q_s, kx, cv * VEC, 1, d, n_rep, L, cv == 0 && jj < n, sc, chunk, jj, scale);
    }
  } else {
    // Scores: a warp per key, the key row read once (DK_MAX_D / 32 values per lane) for every
    // query head of the group; the partial dot products of up to DK_HEADS_PER_PASS heads are
    // reduced across the warp together (independent shuffles overlap).
    for (int jj = warp; jj < n; jj += nwarps) {
      const T* kr = k + ((size_t)slot_s[jj] * hkv + g) * d;
      float kreg[DK_MAX_D / 32];
#pragma unroll
      for (int i = 0; i < DK_MAX_D / 32; i++) {
        const int e = lane + 32 * i;
        kreg[i] = e < d ? to_f(kr[e]) : 0.f;
      }
      score_key(q_s, kreg, lane, 32, d, n_rep, 32, lane == 0, sc, chunk, jj, scale);
    }
  }
  __syncthreads();

  // The chunk's softmax numerators, a warp per query head.
  for (int r = warp; r < n_rep; r += nwarps) {
    float* sr = sc + r * chunk;
    float m = -INFINITY;
    for (int jj = lane; jj < n; jj += 32) m = fmaxf(m, sr[jj]);
    m = warp_max(m);
    float z = 0.f;
    for (int jj = lane; jj < n; jj += 32) {
      const float e = expf(sr[jj] - m);
      sr[jj] = e;
      z += e;
    }
    z = warp_sum(z);
    if (lane == 0) {
      m_s[r] = m;
      l_s[r] = z;
    }
  }
  __syncthreads();

  if (vec) {
    vec_values<T>(v, slot_s, sc, m_s, l_s, red, red_words, out, part_o, part_m, part_l, n, chunk,
                  n_rep, g, hkv, hq, d, row, split, splits, vec_lanes);
  } else {
    scalar_values<T>(v, slot_s, sc, m_s, l_s, red, out, part_o, part_m, part_l, n, chunk, n_rep,
                     g, hkv, hq, d, row, split, splits);
  }
  if (splits > 1)
    merge_chunks_if_last<T>(c, part_o, part_m, part_l, counters, out, smem, hq, hkv, d, chunk,
                            splits);
}

#include "sample_kernels.cuh"

// ---- The decode step's new keys and values into their cache slots, in place, both in one
// launch: pool [2, slot_count, width] (the keys' pool, then the values'), kv [2, rows, width]
// (the step's keys, then its values), slots [rows] (the caller checked each < slot_count). ----
template <typename T>
__device__ void kv_write(T* pool, const T* kv, const uint32_t* slots, int rows, int slot_count,
                         int width) {
  const size_t per_part = (size_t)rows * width;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < 2 * per_part;
       e += (size_t)gridDim.x * blockDim.x) {
    const size_t part = e / per_part, r = (e % per_part) / width, j = e % width;
    pool[(part * slot_count + slots[r]) * (size_t)width + j] = kv[e];
  }
}

#define DK_INSTANTIATE(T, SFX)                                                                 \
  extern "C" __global__ void __launch_bounds__(256) paged_decode_##SFX(                        \
      const T* q, const T* k, const T* v, const uint32_t* tables, const uint32_t* lens, T* out, \
      float* part_o, float* part_m, float* part_l, unsigned* counters, int hq, int hkv, int d, \
      int block_size, int max_blocks, int chunk, int splits, float scale) {                    \
    paged_decode<T>(q, k, v, tables, lens, out, part_o, part_m, part_l, counters, hq, hkv, d,  \
                    block_size, max_blocks, chunk, splits, scale);                             \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(DS_THREADS) sample_inverse_cdf_##SFX(          \
      const T* logits, const double* uniforms, float inv_t, uint32_t* tokens, float* logprobs, \
      int v, int top_k, float top_p, float min_p) {                                            \
    sample_inverse_cdf<T>(logits, uniforms, inv_t, tokens, logprobs, v, top_k, top_p, min_p);  \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(SP_THREADS) sample_parts_##SFX(                 \
      const T* logits, float inv_t, float* part_m, float* part_s, int v, int part_len,         \
      int parts) {                                                                             \
    sample_parts<T>(logits, inv_t, part_m, part_s, v, part_len, parts);                        \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(SP_THREADS) sample_part_mass_##SFX(             \
      const T* logits, float inv_t, const float* part_m, const float* part_s,                  \
      double* part_mass, int v, int part_len, int parts, float min_p) {                        \
    sample_part_mass<T>(logits, inv_t, part_m, part_s, part_mass, v, part_len, parts, min_p);  \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(SP_THREADS) sample_pick_##SFX(                  \
      const T* logits, const double* uniforms, float inv_t, const float* part_m,               \
      const float* part_s, const double* part_mass, uint32_t* tokens, float* logprobs, int v,  \
      int part_len, int parts, float min_p) {                                                  \
    sample_pick<T>(logits, uniforms, inv_t, part_m, part_s, part_mass, tokens, logprobs, v,    \
                   part_len, parts, min_p);                                                    \
  }                                                                                            \
  extern "C" __global__ void kv_write_##SFX(T* pool, const T* kv, const uint32_t* slots,       \
                                            int rows, int slot_count, int width) {             \
    kv_write<T>(pool, kv, slots, rows, slot_count, width);                                     \
  }

DK_INSTANTIATE(float, f32)
DK_INSTANTIATE(bf16, bf16)

#include "decode_tc_kernels.cuh"

#define DT_INSTANTIATE(D)                                                                      \
  extern "C" __global__ void __launch_bounds__(32 * DT_WARPS) paged_decode_tc_d##D##_bf16(     \
      const bf16* q, const bf16* k, const bf16* v, const uint32_t* tables,                     \
      const uint32_t* lens, bf16* out, float* part_o, float* part_m, float* part_l,            \
      unsigned* counters, int hq, int hkv, int d, int block_size, int max_blocks, int chunk,   \
      int splits, float scale) {                                                               \
    paged_decode_tc<D>(q, k, v, tables, lens, out, part_o, part_m, part_l, counters, hq, hkv,  \
                       d, block_size, max_blocks, chunk, splits, scale);                       \
  }
DT_INSTANTIATE(64)
DT_INSTANTIATE(128)

#include "decode_gemm_kernels.cuh"

// skinny_gemm_{plain,swiglu,qkv}_m{MT}_bf16: MT m16 tiles (m ≤ 16·MT rows).
#define SG_ARGS                                                                               \
  const bf16 *x, const bf16 *w, float *part, unsigned *counters, int m, int n, int k,         \
      int k_split, int splits, const bf16 *norm_w, float eps
#define SG_PASS x, w, part, counters, m, n, k, k_split, splits, norm_w, eps
#define SG_INSTANTIATE(MT)                                                                     \
  extern "C" __global__ void __launch_bounds__(32 * SG_WARPS)                                  \
      skinny_gemm_plain_m##MT##_bf16(SG_ARGS, bf16* y, const bf16* residual) {                 \
    skinny_gemm<MT>(SG_PASS, SgPlain{y, residual});                                            \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(32 * SG_WARPS)                                  \
      skinny_gemm_swiglu_m##MT##_bf16(SG_ARGS, bf16* y) {                                      \
    skinny_gemm<MT>(SG_PASS, SgSwiglu{y});                                                     \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(32 * SG_WARPS) skinny_gemm_qkv_m##MT##_bf16(    \
      SG_ARGS, const bf16* bias, const bf16* cos, const bf16* sin, bf16* q, bf16* pool,        \
      const uint32_t* slots, int nh, int nkv, int d, int slot_count) {                         \
    skinny_gemm<MT>(SG_PASS, SgQkv{bias, cos, sin, q, pool, slots, nh, nkv, d, slot_count});   \
  }
SG_INSTANTIATE(1)
SG_INSTANTIATE(2)
SG_INSTANTIATE(3)
SG_INSTANTIATE(4)

#include "rows_invariant_kernels.cuh"
