// The projections' bias add of kernels.cu (linear_kernels.cuh: bias_add_rows, in place on the
// product) under emu.h (run.sh), launched as crates/model/src/ops/linear.rs launches it,
// against the element-wise sum rounded to the dtype — exactly: 16-byte vectors (widths a
// multiple of the vector), a width that is not, and buffers one element past 16 bytes.
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

template <typename T>
int run(int rows, int n, bool misaligned, unsigned blocks, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-3.f, 3.f);
  const int off = misaligned ? 1 : 0;
  std::vector<T> yb((size_t)rows * n + off), bb(n + off);
  T *y = yb.data() + off, *b = bb.data() + off;
  for (size_t i = 0; i < (size_t)rows * n; i++) y[i] = cvt<T>(U(rng));
  for (int i = 0; i < n; i++) b[i] = cvt<T>(U(rng));
  std::vector<T> want(y, y + (size_t)rows * n);
  for (size_t i = 0; i < want.size(); i++) want[i] = cvt<T>((float)back(want[i]) + (float)back(b[i % n]));
  emu_launch(Dim3{blocks, 1, 1}, Dim3{256, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4) bias_add_rows_f32(y, b, (unsigned long long)rows, n);
    else bias_add_rows_bf16(y, b, (unsigned long long)rows, n);
  });
  size_t wrong = 0;
  for (size_t i = 0; i < want.size(); i++) wrong += std::memcmp(&y[i], &want[i], sizeof(T)) != 0;
  std::printf("%s rows %d n %d%s, %u blocks: %zu wrong %s\n", sizeof(T) == 4 ? "f32 " : "bf16", rows, n,
              misaligned ? " misaligned" : "", blocks, wrong, wrong ? "BAD" : "ok");
  return wrong != 0;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<bf16>(7, 128, false, 1, 1);   // Qwen2's k/v bias width, 16-byte vectors, grid-stride
  bad += run<float>(5, 12, false, 2, 2);   // f32 vectors of 4
  bad += run<bf16>(6, 5, false, 1, 3);     // not a multiple of the vector: element-wise
  bad += run<bf16>(4, 64, true, 1, 4);     // misaligned: element-wise
  if (!quick) bad += run<bf16>(33, 896, false, 3, 5);  // Qwen2.5-0.5B's q bias
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
