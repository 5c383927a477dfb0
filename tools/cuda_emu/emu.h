// Runs CUDA kernels on the CPU (see run.sh): a std::thread per CUDA thread of a block, the
// blocks one at a time, __syncthreads and warp shuffles through barriers; static __shared__
// arrays become function statics (one block runs at a time), the dynamic shared memory a
// buffer of the launch's size.
#pragma once
#include <barrier>
#include <memory>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>
#include <algorithm>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __launch_bounds__(x)
using std::min; using std::max;
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;
float* emu_dynamic_smem = nullptr;
struct Warp { std::barrier<>* bar; float buf[32]; };
thread_local Warp* emu_warp;
std::barrier<>* emu_block_bar;
inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int lane = threadIdx.x & 31;
  emu_warp->buf[lane] = v;
  emu_warp->bar->arrive_and_wait();
  const float r = emu_warp->buf[lane ^ o];
  emu_warp->bar->arrive_and_wait();
  return r;
}
// Launches `f` on `grid` blocks of `block` threads: block.x persistent threads run the blocks
// one after another (a block starts when every thread has finished the previous one).
template <class F>
void emu_launch(Dim3 grid, Dim3 block, size_t shared_bytes, F f) {
  gridDim = grid; blockDim = block;
  const unsigned nw = (block.x + 31) / 32;
  std::vector<std::unique_ptr<std::barrier<>>> bars;
  std::vector<Warp> warps(nw);
  for (unsigned w = 0; w < nw; w++) {
    bars.push_back(std::make_unique<std::barrier<>>(std::min(32u, block.x - 32 * w)));
    warps[w].bar = bars.back().get();
  }
  std::barrier<> bbar(block.x), step(block.x);
  emu_block_bar = &bbar;
  // A fresh buffer of exactly the launch's size per block (ASan sees overruns; not zeroed,
  // as on a GPU).
  std::unique_ptr<float[]> smem;
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < block.x; t++)
    ts.emplace_back([&, t] {
      threadIdx = Dim3{t, 0, 0};
      emu_warp = &warps[t / 32];
      for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
          for (unsigned bx = 0; bx < grid.x; bx++) {
            if (t == 0) {
              smem.reset(shared_bytes ? new float[shared_bytes / 4] : nullptr);
              emu_dynamic_smem = smem.get();
            }
            step.arrive_and_wait();  // the block's shared memory is ready
            blockIdx = Dim3{bx, by, bz};
            f();
            step.arrive_and_wait();  // every thread is done with the block
          }
    });
  for (auto& t : ts) t.join();
}
