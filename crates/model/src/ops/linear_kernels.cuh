// The projections' bias (crates/model/src/ops/linear.rs), included by kernels.cu: y[r, c] +=
// b[c] in place on the fresh product y [rows, n], each sum rounded to T as candle's add of the
// two T values is. 16 bytes a thread where y and b start 16-byte aligned and n is a multiple
// of the vector; one element a thread otherwise. Grid-stride.
template <typename T>
__device__ void bias_add_rows(T* y, const T* b, unsigned long long rows, int n) {
  constexpr int V = Vec16<T>::N;
  const size_t total = (size_t)rows * n;
  const size_t start = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const void* const ptrs[2] = {y, b};
  if (n % V == 0 && aligned16(ptrs)) {
    for (size_t v = start; v < total / V; v += stride) {
      const size_t e = v * V;
      float yv[V], bv[V];
      Vec16<T>::load(y + e, yv);
      Vec16<T>::load(b + e % n, bv);
#pragma unroll
      for (int j = 0; j < V; j++) yv[j] += bv[j];
      Vec16<T>::store(y + e, yv);
    }
  } else {
    for (size_t e = start; e < total; e += stride) y[e] = from_f<T>(to_f(y[e]) + to_f(b[e % n]));
  }
}

#define LINEAR_KERNELS(T, SFX)                                                                \
  extern "C" __global__ void bias_add_rows_##SFX(T* y, const T* b, unsigned long long rows,  \
                                                 int n) {                                     \
    bias_add_rows<T>(y, b, rows, n);                                                          \
  }
LINEAR_KERNELS(float, f32)
LINEAR_KERNELS(bf16, bf16)
