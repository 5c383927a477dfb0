// Deterministic mode's batch-invariant decode kernels (launched by rows_invariant_cuda.rs;
// CPU twins: ops/linear_rows.rs and ops/attend_one.rs). Every output of a row is computed from
// that row's inputs alone, in one order fixed by the shapes of the row (k, head_dim, keys) — not
// by how many rows the launch has or where the row sits — so a row's bits are the same whether
// the sampler decodes it among 64 others or the trainer rescores it among 3. cuBLAS promises no
// such thing (it picks its algorithm, tiles and split-k by the whole shape). Included by
// decode_kernels.cu; tools/cuda_emu/rows_invariant.cpp runs both on the CPU.

// Warps per block of rows_linear (one weight row each).
#define RI_WARPS 8
// Rows of x one warp accumulates at once (registers: one f32 sum per row per lane).
#define RI_ROWS 16

// Piece `c0` of a row — columns c0 .. c0 + VEC − 1, those below k (`left` = k − c0) — as f32:
// one 16-byte load when `vec` (the caller checked alignment and k % VEC == 0), else element by
// element (columns past k read as 0 and are not summed by the caller).
template <typename T>
__device__ __forceinline__ void ri_piece(const T* p, int left, bool vec,
                                         float (&x)[Vec16<T>::N]) {
  if (vec) {
    Vec16<T>::load(p, x);
  } else {
#pragma unroll
    for (int e = 0; e < Vec16<T>::N; e++) x[e] = e < left ? to_f(p[e]) : 0.f;
  }
}

// y [m, n] = x [m, k] · w [n, k]ᵀ. A warp owns weight row `o`; lane l sums the pieces l, l + 32,
// … of VEC = 16 / sizeof(T) consecutive columns (piece p: columns p·VEC .., those below k), each
// piece's columns in order, by fmaf in f32, for RI_ROWS rows of x at a time, then the warp's
// butterfly sum (the same value in every lane). Pieces load as 16 bytes where x and w start
// 16-byte aligned and k is a multiple of VEC, element by element otherwise: the same products
// summed in the same order either way. So a row's sum depends on its own x row, w and k only —
// not on the rows beside it, nor on where x lies (the trainer's x is not the sampler's buffer).
// (Until 2026-11-28 each lane read one column at a time: a load per multiply-add.)
template <typename T>
__device__ void rows_linear(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                            int m, int n, int k) {
  constexpr int VEC = Vec16<T>::N;
  const int lane = threadIdx.x & 31;
  const int o = blockIdx.x * RI_WARPS + (threadIdx.x >> 5);
  if (o >= n) return;  // the whole warp: o is the warp's
  const T* wr = w + (size_t)o * k;
  const bool vec = k % VEC == 0 && aligned16<2>({x, w});
  const int pieces = (k + VEC - 1) / VEC;
  for (int r0 = 0; r0 < m; r0 += RI_ROWS) {
    float acc[RI_ROWS];
#pragma unroll
    for (int r = 0; r < RI_ROWS; r++) acc[r] = 0.f;
    for (int p = lane; p < pieces; p += 32) {
      const int c0 = p * VEC, left = k - c0;
      float wv[VEC];
      ri_piece(wr + c0, left, vec, wv);
#pragma unroll
      for (int r = 0; r < RI_ROWS; r++) {
        if (r0 + r < m) {
          float xv[VEC];
          ri_piece(x + (size_t)(r0 + r) * k + c0, left, vec, xv);
#pragma unroll
          for (int e = 0; e < VEC; e++)
            if (e < left) acc[r] = fmaf(xv[e], wv[e], acc[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RI_ROWS; r++) {
      const float s = warp_sum(acc[r]);
      if (lane == 0 && r0 + r < m) y[(size_t)(r0 + r) * n + o] = from_f<T>(s);
    }
  }
}

// Warps per block of attend_one (keys dealt round robin).
#define RA_WARPS 8
// Largest head_dim: a lane holds RA_MAX_D / 32 query and accumulator values.
#define RA_MAX_D 256

// out [rows, t_q, hq, d] = softmax(q·Kᵀ·scale)·V for the t_q queries of each row, causally: query
// i of a row (at position past + i) attends to the row's first past + i + 1 keys (GQA: head h
// reads KV head h / (hq / hkv)); element (row, kv head, key j, e) of k and v lies at
// row·s_row + head·s_head + j·s_key + e (the dense KV cache read in place). One block per
// (query, head): warp w takes keys w, w + RA_WARPS, … in order with an online softmax in f32
// (scores by lanes over head_dim, butterfly-summed), and warp 0 merges the warps in warp order —
// so a query's bits depend on its own q, keys and values only, not on t_q, past or the rows.
template <typename T>
__device__ void attend_one(const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, T* __restrict__ out, int hq, int hkv, int d,
                           int t_q, int past, long long s_row, long long s_head,
                           long long s_key, float scale) {
  constexpr int PER = RA_MAX_D / 32;
  __shared__ float red_m[RA_WARPS], red_l[RA_WARPS];
  __shared__ float red_o[RA_WARPS][RA_MAX_D];
  const int bh = blockIdx.x;  // (row · t_q + query) · hq + head
  const int query = bh / hq, head = bh % hq;
  const int row = query / t_q, len = past + query % t_q + 1;
  const int kvh = head / (hq / hkv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float qv[PER], acc[PER];
#pragma unroll
  for (int i = 0; i < PER; i++) {
    const int e = lane + 32 * i;
    qv[i] = e < d ? to_f(q[(size_t)bh * d + e]) : 0.f;
    acc[i] = 0.f;
  }
  const T* kb = k + row * s_row + kvh * s_head;
  const T* vb = v + row * s_row + kvh * s_head;
  float m = -INFINITY, l = 0.f;
  for (int j = warp; j < len; j += RA_WARPS) {
    const T* kr = kb + j * s_key;
    const T* vr = vb + j * s_key;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
      const int e = lane + 32 * i;
      if (e < d) s += qv[i] * to_f(kr[e]);
    }
    s = warp_sum(s) * scale;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new);  // 0 at the first key (m = −∞)
    const float p = expf(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < PER; i++) {
      const int e = lane + 32 * i;
      if (e < d) acc[i] = acc[i] * corr + p * to_f(vr[e]);
    }
    m = m_new;
  }
  if (lane == 0) {
    red_m[warp] = m;
    red_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < PER; i++) {
    const int e = lane + 32 * i;
    if (e < d) red_o[warp][e] = acc[i];
  }
  __syncthreads();
  if (warp != 0) return;
  float top = -INFINITY;
  for (int w = 0; w < RA_WARPS; w++) top = fmaxf(top, red_m[w]);
  float sum = 0.f, o[PER];
#pragma unroll
  for (int i = 0; i < PER; i++) o[i] = 0.f;
  for (int w = 0; w < RA_WARPS; w++) {
    if (red_l[w] == 0.f) continue;  // a warp that had no key (len < RA_WARPS)
    const float c = expf(red_m[w] - top);
    sum += red_l[w] * c;
#pragma unroll
    for (int i = 0; i < PER; i++) {
      const int e = lane + 32 * i;
      if (e < d) o[i] += red_o[w][e] * c;
    }
  }
#pragma unroll
  for (int i = 0; i < PER; i++) {
    const int e = lane + 32 * i;
    if (e < d) out[(size_t)bh * d + e] = from_f<T>(o[i] / sum);
  }
}

#define RI_INSTANTIATE(T, SFX)                                                                  \
  extern "C" __global__ void __launch_bounds__(32 * RI_WARPS)                                   \
      rows_linear_##SFX(const T* x, const T* w, T* y, int m, int n, int k) {                    \
    rows_linear<T>(x, w, y, m, n, k);                                                           \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(32 * RA_WARPS) attend_one_##SFX(                 \
      const T* q, const T* k, const T* v, T* out, int hq, int hkv, int d, int t_q, int past,     \
      long long s_row, long long s_head, long long s_key, float scale) {                        \
    attend_one<T>(q, k, v, out, hq, hkv, d, t_q, past, s_row, s_head, s_key, scale);            \
  }
RI_INSTANTIATE(float, f32)
RI_INSTANTIATE(bf16, bf16)
