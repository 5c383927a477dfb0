// The token embedding's backward of kernels.cu (embedding_kernels.cuh: embedding_bwd_pieces,
// embedding_bwd_merge) under emu.h (run.sh), against an f64 sum of each id's gradient rows.
// The tables are built as crates/model/src/ops/embedding.rs's Groups::of builds them (ids
// sorted stably, runs cut into pieces of 32 tokens, EMB_MERGE | slot for rows of several).
#include "emu.h"
#include "driver.h"
#include "kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

template <typename T>
int run(int n, int vocab, int h, int hot, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-2.f, 2.f);
  std::uniform_int_distribution<int> V(0, vocab - 1);
  // Every other token is the hot id: a run of n/2 tokens, several pieces.
  std::vector<unsigned> ids(n);
  for (int i = 0; i < n; i++) ids[i] = i % 2 ? (unsigned)hot : (unsigned)V(rng);
  std::vector<T> dy((size_t)n * h);
  for (auto& e : dy) e = cvt<T>(U(rng));
  std::vector<unsigned> order(n), bounds{0}, dest, merge_rows, merge_bounds{0};
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](unsigned a, unsigned b) { return ids[a] < ids[b]; });
  unsigned slots = 0;
  for (int start = 0; start < n;) {
    int end = start;
    while (end < n && ids[order[end]] == ids[order[start]]) end++;
    const int pieces = (end - start + 31) / 32;
    for (int p = 0; p < pieces; p++) {
      bounds.push_back((unsigned)std::min(start + (p + 1) * 32, end));
      dest.push_back(pieces == 1 ? ids[order[start]] : (EMB_MERGE | (slots + p)));
    }
    if (pieces > 1) {
      slots += pieces;
      merge_rows.push_back(ids[order[start]]);
      merge_bounds.push_back(slots);
    }
    start = end;
  }
  // ∂W starts at zero (the launcher's alloc_zeros); scratch is never read before written.
  std::vector<T> dw((size_t)vocab * h, cvt<T>(0.f));
  std::vector<float> scratch((size_t)std::max(1u, slots) * h, NAN);
  const unsigned cols = (h + 255) / 256;
  emu_launch(Dim3{(unsigned)dest.size(), cols, 1}, Dim3{256, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4)
      embedding_bwd_pieces_f32(dy.data(), order.data(), bounds.data(), dest.data(), dw.data(), scratch.data(), h);
    else
      embedding_bwd_pieces_bf16(dy.data(), order.data(), bounds.data(), dest.data(), dw.data(), scratch.data(), h);
  });
  if (!merge_rows.empty())
    emu_launch(Dim3{(unsigned)merge_rows.size(), cols, 1}, Dim3{256, 1, 1}, 0, [&] {
      if constexpr (sizeof(T) == 4)
        embedding_bwd_merge_f32(scratch.data(), merge_rows.data(), merge_bounds.data(), dw.data(), h);
      else
        embedding_bwd_merge_bf16(scratch.data(), merge_rows.data(), merge_bounds.data(), dw.data(), h);
    });
  const bool f32 = sizeof(T) == 4;
  double worst = 0;
  for (int v = 0; v < vocab; v++)
    for (int c = 0; c < h; c++) {
      double want = 0, scale = 0;
      for (int t = 0; t < n; t++)
        if ((int)ids[t] == v) {
          want += back(dy[(size_t)t * h + c]);
          scale += std::abs(back(dy[(size_t)t * h + c]));
        }
      // f32 sums of up to n terms; bf16 also rounds the result to 8 bits.
      const double err = std::abs(back(dw[(size_t)v * h + c]) - want);
      worst = worst_of(worst, err / std::max(1.0, f32 ? scale : std::abs(want)));
    }
  const double tol = f32 ? 1e-6 : 8e-3;
  const bool ok = worst <= tol;
  std::printf("%s n %d vocab %d h %d (pieces %zu, merged rows %zu): worst %.2e %s\n", f32 ? "f32 " : "bf16", n, vocab,
              h, dest.size(), merge_rows.size(), worst, ok ? "ok" : "BAD");
  return ok ? 0 : 1;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(150, 20, 37, 3, 1);    // hot id: 75 tokens, three pieces
  bad += run<bf16>(150, 20, 37, 19, 2);
  bad += run<float>(10, 50, 300, 0, 3);    // two column blocks; no merge
  if (!quick) bad += run<bf16>(400, 97, 600, 42, 4);  // 200 hot tokens: seven pieces
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
