// The decode's fused attention inputs of kernels.cu (qkv_bias_rope: biases, then RoPE on q and
// k) under emu.h (run.sh) against an f64 reference, as crates/model/tests/ops.rs checks it.
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

template <typename T>
int run(int rows, int nh, int nkv, int d, bool bias, unsigned blocks, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-2.f, 2.f);
  const int half = d / 2;
  auto mk = [&](size_t n) { std::vector<T> x(n); for (auto& e : x) e = cvt<T>(U(rng)); return x; };
  const int width = (nh + 2 * nkv) * d;
  // Packed projection rows [q | k | v] and the bias stacked the same way.
  auto qkv = mk((size_t)rows * width);
  auto bqkv = mk(width);
  std::vector<T> cos(rows * half), sin(rows * half);
  for (int i = 0; i < rows * half; i++) {
    const float a = U(rng) * 3.f;
    cos[i] = cvt<T>(std::cos(a));
    sin[i] = cvt<T>(std::sin(a));
  }
  std::vector<T> out((size_t)rows * width);
  // Fewer blocks than pairs: the grid-stride loop crosses the q/k/v boundaries.
  emu_launch(Dim3{blocks, 1, 1}, Dim3{64, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4)
      qkv_bias_rope_f32(qkv.data(), bqkv.data(), bias, cos.data(), sin.data(), out.data(), rows, nh, nkv, d);
    else
      qkv_bias_rope_bf16(qkv.data(), bqkv.data(), bias, cos.data(), sin.data(), out.data(), rows, nh, nkv, d);
  });
  double worst = 0;
  size_t off = 0;
  for (int part = 0; part < 3; part++) {
    const int heads = part == 0 ? nh : nkv;
    const int col = part == 0 ? 0 : part == 1 ? nh * d : (nh + nkv) * d;
    for (int t = 0; t < rows; t++)
      for (int h = 0; h < heads; h++)
        for (int i = 0; i < half; i++) {
          const size_t base = ((size_t)t * heads + h) * d;
          const size_t src = (size_t)t * width + col + h * d;
          double x1 = back(qkv[src + i]), x2 = back(qkv[src + i + half]);
          if (bias) { x1 += back(bqkv[col + h * d + i]); x2 += back(bqkv[col + h * d + i + half]); }
          double y1 = x1, y2 = x2;
          if (part < 2) {
            const double c = back(cos[t * half + i]), s = back(sin[t * half + i]);
            y1 = x1 * c - x2 * s;
            y2 = x2 * c + x1 * s;
          }
          worst = worst_of({worst, std::abs(back(out[off + base + i]) - y1) / std::max(1.0, std::abs(y1)),
                            std::abs(back(out[off + base + i + half]) - y2) / std::max(1.0, std::abs(y2))});
        }
    off += (size_t)rows * heads * d;
  }
  // f32: rounding of the bias sum and the rotation; bf16: the sum and the result each rounded.
  const bool f32 = sizeof(T) == 4;
  const bool ok = worst <= (f32 ? 1e-6 : 2.5e-2);
  std::printf("%s rows %d heads %d/%d d %d%s blocks %u: worst rel %.2e %s\n", f32 ? "f32 " : "bf16", rows, nh, nkv,
              d, bias ? " bias" : "", blocks, worst, ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(3, 4, 2, 10, true, 2, 1);
  bad += run<float>(2, 2, 2, 8, false, 1, 2);
  bad += run<bf16>(4, 4, 1, 16, true, 3, 3);
  if (!quick) {
    bad += run<float>(8, 14, 2, 64, true, 16, 4);   // Qwen2.5-0.5B's heads
    bad += run<bf16>(5, 28, 4, 128, true, 40, 5);   // Qwen2.5-7B's
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
