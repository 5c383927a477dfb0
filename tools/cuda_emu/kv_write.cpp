// The decode step's KV-cache write of decode_kernels.cu (kv_write: a step's keys and values
// into their slots of the layer's [2, slots, width] pool) under emu.h (run.sh), against the
// expected pool, as crates/model/tests/ops.rs checks it.
#include "emu.h"
#include "driver.h"
#include "decode_kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

template <typename T>
int run(int slot_count, int width, std::vector<uint32_t> slots, unsigned blocks, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-2.f, 2.f);
  const int rows = (int)slots.size();
  std::vector<T> pool((size_t)2 * slot_count * width), kv((size_t)2 * rows * width);
  for (auto& e : pool) e = cvt<T>(U(rng));
  for (auto& e : kv) e = cvt<T>(U(rng));
  std::vector<T> want = pool;
  for (int part = 0; part < 2; part++)
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < width; j++)
        want[((size_t)part * slot_count + slots[r]) * width + j] = kv[((size_t)part * rows + r) * width + j];
  // Fewer blocks than elements: the grid-stride loop crosses rows and the two halves.
  emu_launch(Dim3{blocks, 1, 1}, Dim3{64, 1, 1}, 0, [&] {
    if constexpr (sizeof(T) == 4)
      kv_write_f32(pool.data(), kv.data(), slots.data(), rows, slot_count, width);
    else
      kv_write_bf16(pool.data(), kv.data(), slots.data(), rows, slot_count, width);
  });
  size_t bad = 0;
  for (size_t i = 0; i < pool.size(); i++) bad += back(pool[i]) != back(want[i]);
  std::printf("%s slots %d width %d rows %d blocks %u: %zu wrong %s\n", sizeof(T) == 4 ? "f32 " : "bf16", slot_count,
              width, rows, blocks, bad, bad ? "BAD" : "ok");
  return bad != 0;
}

// Arguments: --quick keeps the small cases.
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (argc > 2 || (argc == 2 && !quick)) { std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]); return 2; }
  int bad = 0;
  bad += run<float>(6, 6, {4, 1, 5}, 1, 1);
  bad += run<bf16>(8, 10, {0, 7}, 2, 2);
  if (!quick) {
    std::vector<uint32_t> many(64);
    for (int r = 0; r < 64; r++) many[r] = (uint32_t)(r * 37 % 1024);
    bad += run<float>(1024, 128, many, 16, 3);  // Qwen2.5-0.5B: 2 kv heads × 64, 64 rows
    bad += run<bf16>(1024, 512, many, 40, 4);   // Qwen2.5-7B: 4 kv heads × 128
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
