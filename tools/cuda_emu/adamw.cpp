// AdamW's two in-place passes of kernels.cu (adamw_moments_f32, adamw_params_f32) under emu.h,
// launched as crates/model/src/ops/cuda.rs launches them (256 threads, a grid-stride loop),
// for several steps against the same update in f64 (both lerp branches; sizes past one block,
// not a multiple of it). Arguments: case indices (default all), or --quick.
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>

static Dim3 grid_for(size_t n) { return Dim3{(unsigned)std::clamp<size_t>((n + 255) / 256, 1, 8192), 1, 1}; }

bool run_case(size_t n, double b1, double b2, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  std::vector<float> p(n), mv(2 * n, 0.f);
  for (auto& x : p) x = U(rng);
  std::vector<double> pd(p.begin(), p.end()), md(n, 0), vd(n, 0);
  const double eps = 1e-6, wd = 0.05;
  const double lrs[4] = {1e-3, 1e-2, 3e-2, 1e-4};
  for (int t = 1; t <= 4; ++t) {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = U(rng) * std::pow(10.f, (float)(i % 5) - 3.f);
    const double lr = lrs[t - 1];
    const float w = (float)(1 - b1), fb2 = (float)b2, omb2 = (float)(1 - b2);
    emu_launch(grid_for(n), Dim3{256, 1, 1}, 0, [&] { adamw_moments_f32(mv.data(), g.data(), n, w, fb2, omb2); });
    const float decay = (float)(1 - lr * wd), neg_step = (float)(-lr / (1 - std::pow(b1, t)));
    const float bc2 = (float)std::sqrt(1 - std::pow(b2, t)), feps = (float)eps;
    emu_launch(grid_for(n), Dim3{256, 1, 1}, 0, [&] { adamw_params_f32(p.data(), mv.data(), n, decay, neg_step, bc2, feps); });
    for (size_t i = 0; i < n; ++i) {
      md[i] = b1 * md[i] + (1 - b1) * g[i];
      vd[i] = b2 * vd[i] + (1 - b2) * (double)g[i] * g[i];
      pd[i] *= 1 - lr * wd;
      pd[i] -= lr * (md[i] / (1 - std::pow(b1, t))) / (std::sqrt(vd[i] / (1 - std::pow(b2, t))) + eps);
    }
  }
  bool ok = true;
  const char* names[3] = {"p", "m", "v"};
  for (int q = 0; q < 3; ++q) {
    const float* got = q == 0 ? p.data() : q == 1 ? mv.data() : mv.data() + n;
    const std::vector<double>& want = q == 0 ? pd : q == 1 ? md : vd;
    double mx = 0, worst = 0;
    for (double x : want) mx = max(mx, fabs(x));
    for (size_t i = 0; i < n; ++i) {
      const double e = fabs(got[i] - want[i]) / max(fabs(want[i]), 1e-2 * mx);
      worst = std::isnan(got[i]) ? 1e300 : max(worst, e);
    }
    printf(" %s rel %.1e;", names[q], worst);
    if (!(worst <= 1e-5)) ok = false;
  }
  printf(" n=%zu beta1=%.1f %s\n", n, b1, ok ? "ok" : "FAIL");
  return ok;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  struct Case { size_t n; double b1, b2; bool quick; };
  const Case cases[] = {{1, 0.9, 0.999, true}, {1000, 0.9, 0.999, true}, {1000, 0.3, 0.95, true}, {70000, 0.9, 0.999, false}};
  const size_t count = sizeof(cases) / sizeof(cases[0]);
  std::vector<size_t> pick;
  for (int a = 1; a < argc; a++) {
    if (std::strcmp(argv[a], "--quick") == 0) {
      for (size_t i = 0; i < count; i++) if (cases[i].quick) pick.push_back(i);
      continue;
    }
    const size_t i = std::strtoul(argv[a], nullptr, 10);
    if (i >= count) { std::fprintf(stderr, "no case %s (0..%zu)\n", argv[a], count - 1); return 2; }
    pick.push_back(i);
  }
  if (argc == 1) for (size_t i = 0; i < count; i++) pick.push_back(i);
  bool ok = true;
  for (size_t i : pick) ok &= run_case(cases[i].n, cases[i].b1, cases[i].b2, 100 + (unsigned)i);
  printf(ok ? "ALL OK\n" : "FAIL\n");
  return ok ? 0 : 1;
}
