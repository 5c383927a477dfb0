// The SwiGLU kernels of kernels.cu under emu.h (run.sh) against an f64 reference, as
// crates/model/tests/ops.rs checks them: the decode's from packed rows [gate | up]
// (swiglu_packed_fwd), and the training op's forward and backward (swiglu_fwd, swiglu_bwd) on
// aligned buffers (16 bytes a thread) and on views one element off (element by element).
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
      worst = worst_of(worst, std::abs(back(y[(size_t)r * inter + j]) - want) / std::max(1.0, std::abs(want)));
    }
  const bool f32 = sizeof(T) == 4;
  const bool ok = worst <= (f32 ? 1e-6 : 1e-2);
  std::printf("%s rows %d inter %d blocks %u: worst rel %.2e %s\n", f32 ? "f32 " : "bf16", rows, inter, blocks, worst,
              ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// swiglu_fwd and swiglu_bwd over n elements, the inputs and outputs `offset` elements into
// their allocations (1: every buffer misaligned).
template <typename T>
int run_op(size_t n, unsigned blocks, size_t offset, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-4.f, 4.f);
  std::vector<T> g(n + offset + 8), u(n + offset + 8), dy(n + offset + 8), y(n + offset + 8), out(2 * n + offset + 8);
  for (auto* v : {&g, &u, &dy})
    for (auto& e : *v) e = cvt<T>(U(rng));
  T *pg = g.data() + offset, *pu = u.data() + offset, *pd = dy.data() + offset, *py = y.data() + offset,
    *po = out.data() + offset;
  emu_launch(Dim3{blocks, 1, 1}, Dim3{64, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4) {
      swiglu_fwd_f32(pg, pu, py, n);
      swiglu_bwd_f32(pg, pu, pd, po, n);
    } else {
      swiglu_fwd_bf16(pg, pu, py, n);
      swiglu_bwd_bf16(pg, pu, pd, po, n);
    }
  });
  double worst = 0;
  auto rel = [](double got, double want) { return std::abs(got - want) / std::max(1.0, std::abs(want)); };
  for (size_t i = 0; i < n; i++) {
    const double gv = back(pg[i]), uv = back(pu[i]), d = back(pd[i]), s = 1.0 / (1.0 + std::exp(-gv));
    worst = worst_of({worst, rel(back(py[i]), gv * s * uv), rel(back(po[i]), d * uv * s * (1 + gv * (1 - s))),
                      rel(back(po[n + i]), d * gv * s)});
  }
  const bool f32 = sizeof(T) == 4;
  const bool ok = worst <= (f32 ? 1e-6 : 1e-2);
  std::printf("%s swiglu fwd+bwd n %zu blocks %u offset %zu: worst rel %.2e %s\n", f32 ? "f32 " : "bf16", n, blocks,
              offset, worst, ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(3, 13, 1, 1);
  bad += run<bf16>(4, 7, 2, 2);
  bad += run_op<bf16>(1003, 3, 0, 5);  // vectors, then a 3-element tail
  bad += run_op<bf16>(1003, 3, 1, 6);  // misaligned: element by element
  bad += run_op<bf16>(1024, 3, 0, 9);   // ∂u's half aligned too: the backward's vectors
  bad += run_op<float>(999, 2, 0, 7);
  bad += run_op<float>(1000, 2, 0, 10);
  bad += run_op<float>(64, 1, 1, 8);
  if (!quick) {
    bad += run<float>(16, 4864, 64, 3);  // Qwen2.5-0.5B's intermediate size
    bad += run<bf16>(5, 18944, 40, 4);   // Qwen2.5-7B's
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
