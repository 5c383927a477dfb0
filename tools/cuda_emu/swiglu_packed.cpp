// The decode's SwiGLU from packed rows [gate | up] (swiglu_packed_fwd of kernels.cu) under
// emu.h (run.sh) against an f64 reference, as crates/model/tests/ops.rs checks it.
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

template <typename T>
int run(int rows, int inter, unsigned blocks, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-4.f, 4.f);
  std::vector<T> gu((size_t)rows * 2 * inter);
  for (auto& e : gu) e = cvt<T>(U(rng));
  const size_t n = (size_t)rows * inter;
  std::vector<T> y(n);
  // Fewer blocks than elements: the grid-stride loop crosses rows.
  emu_launch(Dim3{blocks, 1, 1}, Dim3{64, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4)
      swiglu_packed_fwd_f32(gu.data(), y.data(), n, (size_t)inter);
    else
      swiglu_packed_fwd_bf16(gu.data(), y.data(), n, (size_t)inter);
  });
  double worst = 0;
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < inter; j++) {
      const double g = back(gu[(size_t)r * 2 * inter + j]), u = back(gu[(size_t)r * 2 * inter + inter + j]);
      const double want = g / (1.0 + std::exp(-g)) * u;
      worst = std::max(worst, std::abs(back(y[(size_t)r * inter + j]) - want) / std::max(1.0, std::abs(want)));
    }
  const bool f32 = sizeof(T) == 4;
  const bool ok = worst <= (f32 ? 1e-6 : 1e-2);
  std::printf("%s rows %d inter %d blocks %u: worst rel %.2e %s\n", f32 ? "f32 " : "bf16", rows, inter, blocks, worst,
              ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(3, 13, 1, 1);
  bad += run<bf16>(4, 7, 2, 2);
  if (!quick) {
    bad += run<float>(16, 4864, 64, 3);  // Qwen2.5-0.5B's intermediate size
    bad += run<bf16>(5, 18944, 40, 4);   // Qwen2.5-7B's
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
