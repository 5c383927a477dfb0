// RoPE of kernels.cu (`rope`) in its three layouts — token-major, [B,T,H,D] -> [B,H,T,D] and
// back (the backward, rotating by the opposite angle) — under emu.h (run.sh) against an f64
// reference, as crates/model/tests/ops.rs checks the op on a device.
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

// heads_major: 0 token-major in and out, 2 the output [B,H,T,D], 1 the input [B,H,T,D].
template <typename T>
int run(int b, int t, int h, int d, int heads_major, float sign, unsigned blocks, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-2.f, 2.f);
  const int n = b * t, half = d / 2;
  std::vector<T> x((size_t)n * h * d), y(x.size()), cos(n * half), sin(n * half);
  for (auto& e : x) e = cvt<T>(U(rng));
  for (int i = 0; i < n * half; i++) {
    const float a = U(rng) * 3.f;
    cos[i] = cvt<T>(std::cos(a));
    sin[i] = cvt<T>(std::sin(a));
  }
  const int t_len = heads_major ? t : 0;
  emu_launch(Dim3{blocks, 1, 1}, Dim3{64, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4) rope_f32(x.data(), cos.data(), sin.data(), y.data(), n, h, d, sign, t_len, heads_major);
    else rope_bf16(x.data(), cos.data(), sin.data(), y.data(), n, h, d, sign, t_len, heads_major);
  });
  auto tokens = [&](int tok, int head) { return ((size_t)tok * h + head) * d; };
  auto heads = [&](int tok, int head) { return (((size_t)(tok / t) * h + head) * t + tok % t) * d; };
  double worst = 0;
  for (int tok = 0; tok < n; tok++)
    for (int head = 0; head < h; head++) {
      const size_t xb = heads_major == 1 ? heads(tok, head) : tokens(tok, head);
      const size_t yb = heads_major == 2 ? heads(tok, head) : tokens(tok, head);
      for (int i = 0; i < half; i++) {
        const double c = back(cos[tok * half + i]), s = sign * back(sin[tok * half + i]);
        const double x1 = back(x[xb + i]), x2 = back(x[xb + i + half]);
        const double w1 = x1 * c - x2 * s, w2 = x2 * c + x1 * s;
        worst = worst_of({worst, std::abs(back(y[yb + i]) - w1), std::abs(back(y[yb + i + half]) - w2)});
      }
    }
  const bool f32 = sizeof(T) == 4;
  const bool ok = worst <= (f32 ? 1e-5 : 5e-2);
  std::printf("%s B %d T %d H %d D %d heads_major %d sign %+.0f: worst %.2e %s\n", f32 ? "f32 " : "bf16", b, t, h, d,
              heads_major, sign, worst, ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  for (int hm = 0; hm <= 2; hm++) {
    bad += run<float>(2, 5, 3, 8, hm, 1.f, 3, 1 + hm);
    bad += run<bf16>(3, 4, 2, 6, hm, -1.f, 2, 4 + hm);
  }
  if (!quick) {
    bad += run<float>(4, 37, 14, 64, 2, 1.f, 64, 7);
    bad += run<bf16>(2, 64, 4, 128, 1, -1.f, 40, 8);
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
