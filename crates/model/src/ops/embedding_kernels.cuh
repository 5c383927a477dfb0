// The token embedding's backward (crates/model/src/ops/embedding.rs), included by kernels.cu:
// ∂W's rows summed over their tokens without atomics. The host sorted the token positions by
// id (`order`, ties in token order) and cut each id's run into pieces of at most 32 tokens;
// block (p, ·) sums ∂y over piece p's tokens in order, in f32, one thread a column, and writes
// the id's row of ∂W when the piece is the row's only one, else its scratch slot
// (dest = EMB_MERGE | slot); the merge kernel then adds a row's slots in order. ∂W is zeroed
// by the caller (rows without tokens stay zero).
#define EMB_MERGE 0x80000000u

template <typename T>
__device__ void embedding_bwd_pieces(const T* dy, const unsigned* order, const unsigned* bounds,
                                     const unsigned* dest, T* dw, float* scratch, int h) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= h) return;
  const unsigned p = blockIdx.x;
  float acc = 0.f;
#pragma unroll 4
  for (unsigned i = bounds[p]; i < bounds[p + 1]; i++) acc += to_f(dy[(size_t)order[i] * h + c]);
  const unsigned to = dest[p];
  if (to & EMB_MERGE)
    scratch[(size_t)(to & ~EMB_MERGE) * h + c] = acc;
  else
    dw[(size_t)to * h + c] = from_f<T>(acc);
}

template <typename T>
__device__ void embedding_bwd_merge(const float* scratch, const unsigned* rows,
                                    const unsigned* bounds, T* dw, int h) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= h) return;
  const unsigned m = blockIdx.x;
  float acc = 0.f;
  for (unsigned s = bounds[m]; s < bounds[m + 1]; s++) acc += scratch[(size_t)s * h + c];
  dw[(size_t)rows[m] * h + c] = from_f<T>(acc);
}

#define EMBEDDING_KERNELS(T, SFX)                                                               \
  extern "C" __global__ void embedding_bwd_pieces_##SFX(                                        \
      const T* dy, const unsigned* order, const unsigned* bounds, const unsigned* dest, T* dw,  \
      float* scratch, int h) {                                                                  \
    embedding_bwd_pieces<T>(dy, order, bounds, dest, dw, scratch, h);                           \
  }                                                                                             \
  extern "C" __global__ void embedding_bwd_merge_##SFX(const float* scratch,                    \
                                                       const unsigned* rows,                    \
                                                       const unsigned* bounds, T* dw, int h) {  \
    embedding_bwd_merge<T>(scratch, rows, bounds, dw, h);                                       \
  }
EMBEDDING_KERNELS(float, f32)
EMBEDDING_KERNELS(bf16, bf16)
