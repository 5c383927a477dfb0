// The CPU runtime of the CUDA emulation (tools/cuda_emu, see README.md): every driver includes
// it before the kernel source. A block's CUDA threads are std::threads; the blocks of a launch
// run one at a time (the same threads walk them in order, or in reverse with emu_reverse_blocks);
// __syncthreads is a block barrier, warp shuffles exchange through a per-warp buffer between two
// warp barriers, cp.async copies wait in commit groups until cp_async_wait. Static __shared__
// arrays become function statics (shared by the block's threads: one block runs at a time);
// dynamic shared memory (`extern __shared__ float x[];`, rewritten by run.sh into a pointer to
// emu_dynamic_smem) is a fresh 16-byte-aligned buffer of exactly the launch's size per block,
// filled with NaN so that a read of a slot the block never wrote shows in the results and an
// overrun trips AddressSanitizer. bf16 comes from the shim inc/cuda_bf16.h.
#pragma once
#include <cuda_bf16.h>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __launch_bounds__(...)
using std::max;
using std::min;

struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 blockDim, gridDim;
inline float* emu_dynamic_smem = nullptr;
inline unsigned emu_dynamic_smem_size = 0;

// What the PTX register %dynamic_smem_size holds: the launch's dynamic shared memory bytes
// (attention_kernels.cu declares it for host compilers and reads the register on the device).
inline unsigned dynamic_smem_bytes() { return emu_dynamic_smem_size; }

[[noreturn]] inline void __trap() {
  std::fprintf(stderr, "__trap() in block (%u,%u,%u) thread %u\n", blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
  std::abort();
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __expf(float x) { return std::exp(x); }
inline float atomicAdd(float* a, float v) { return std::atomic_ref<float>(*a).fetch_add(v); }

struct EmuWarp {
  std::barrier<>* bar;
  alignas(8) unsigned char buf[32][8];  // one slot per lane, values of up to 8 bytes
  uint32_t mma[32][6];                  // one lane's A and B registers of an mma
};
inline thread_local EmuWarp* emu_warp;
inline std::barrier<>* emu_block_bar;
inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
// __syncwarp: a barrier over the warp's lanes (their shared-memory writes are then visible).
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp->bar->arrive_and_wait(); }

// Every lane of the warp publishes `v`, then reads lane `src`'s (a lane outside a partial
// warp reads a stale slot: undefined on a GPU too).
template <class T>
T emu_shuffle(T v, int src) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8);
  const int lane = threadIdx.x & 31;
  std::memcpy(emu_warp->buf[lane], &v, sizeof(T));
  emu_warp->bar->arrive_and_wait();
  T r;
  std::memcpy(&r, emu_warp->buf[src & 31], sizeof(T));
  emu_warp->bar->arrive_and_wait();  // nobody overwrites a slot before every lane read it
  return r;
}
template <class T> T __shfl_xor_sync(unsigned, T v, int lane_mask) { return emu_shuffle(v, (threadIdx.x & 31) ^ lane_mask); }
template <class T> T __shfl_sync(unsigned, T v, int src_lane) { return emu_shuffle(v, src_lane); }
// A lane below `delta` gets its own value back, as on a GPU.
template <class T> T __shfl_up_sync(unsigned, T v, unsigned delta) {
  const int lane = threadIdx.x & 31;
  return emu_shuffle(v, lane >= (int)delta ? lane - (int)delta : lane);
}
inline unsigned atomicAdd(unsigned* a, unsigned v) { return std::atomic_ref<unsigned>(*a).fetch_add(v); }
// ((old >= limit) ? 0 : old + 1), returning old.
inline unsigned atomicInc(unsigned* a, unsigned limit) {
  std::atomic_ref<unsigned> r(*a);
  unsigned old = r.load();
  while (!r.compare_exchange_weak(old, old >= limit ? 0 : old + 1)) {}
  return old;
}
// __threadfence: a sequentially consistent fence (the blocks of a launch run one after another
// here, so it orders nothing the driver could see; TSan sees the fence).
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// decode_gemm_kernels.cuh's L1-bypassing load: a plain 16-byte load (checked aligned).
inline float4 ld_cg_f4(const float* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    std::fprintf(stderr, "ld_cg_f4: %p is not 16-byte aligned\n", (const void*)p);
    std::abort();
  }
  float4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline float ld_cg_f1(const float* p) { return *p; }
inline int atomicMin(int* a, int v) {
  std::atomic_ref<int> r(*a);
  int old = r.load();
  while (v < old && !r.compare_exchange_weak(old, v)) {}
  return old;
}
inline int atomicMax(int* a, int v) {
  std::atomic_ref<int> r(*a);
  int old = r.load();
  while (v > old && !r.compare_exchange_weak(old, v)) {}
  return old;
}

// Two adjacent bf16 as one 32-bit register (the lower address in the low half).
inline uint32_t ld_bf16x2(const __nv_bfloat16* p) {
  return (uint32_t)p[0].x | ((uint32_t)p[1].x << 16);
}

// mma.sync.m16n8k16 (bf16 in, f32 accumulate) across the warp, with the fragment layouts of
// the PTX ISA that crates/model/src/ops/cuda_common.cuh describes: every lane publishes its A
// and B registers, then computes its own four outputs from the whole 16×16 A and 16×8 B (in f32,
// k in order: the hardware's internal order and precision are not modelled).
inline void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int lane = threadIdx.x & 31;
  uint32_t* mine = emu_warp->mma[lane];
  for (int r = 0; r < 4; r++) mine[r] = a[r];
  mine[4] = b0;
  mine[5] = b1;
  emu_warp->bar->arrive_and_wait();
  auto half = [](uint32_t reg, int hi) { return __bfloat162float(__nv_bfloat16{(uint16_t)(hi ? reg >> 16 : reg & 0xffff)}); };
  // A(row, k): lane (row % 8)·4 + (k % 8)/2, register (row ≥ 8) + 2·(k ≥ 8), half k % 2.
  auto A = [&](int row, int k) { return half(emu_warp->mma[(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k & 1); };
  // B(k, col): lane col·4 + (k % 8)/2, register 4 + (k ≥ 8), half k % 2.
  auto B = [&](int k, int col) { return half(emu_warp->mma[col * 4 + (k % 8) / 2][4 + (k >= 8)], k & 1); };
  const int gid = lane >> 2, tig = lane & 3;
  float out[4];
  for (int e = 0; e < 4; e++) {
    const int row = gid + 8 * (e >> 1), col = 2 * tig + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; k++) acc += A(row, k) * B(k, col);
    out[e] = acc;
  }
  emu_warp->bar->arrive_and_wait();  // nobody overwrites a register before every lane read it
  for (int e = 0; e < 4; e++) c[e] = out[e];
}

// ldmatrix.x4 (cuda_common.cuh's ldsm_x4 / ldsm_x4_t) across the warp, from the PTX ISA's
// description: lane l publishes the address of row l % 8 of matrix l / 8 (which must be 16-byte
// aligned); lane t receives, in register i, elements (t / 4, 2·(t % 4)) and (t / 4, 2·(t % 4) + 1)
// of matrix i — or, transposed, (2·(t % 4), t / 4) and (2·(t % 4) + 1, t / 4).
inline void emu_ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* p, bool trans) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    std::fprintf(stderr, "ldmatrix: lane %u's row address %p is not 16-byte aligned\n", threadIdx.x & 31, (const void*)p);
    std::abort();
  }
  const int lane = threadIdx.x & 31;
  std::memcpy(emu_warp->buf[lane], &p, sizeof(p));
  emu_warp->bar->arrive_and_wait();
  auto row = [&](int i, int rr) {
    const __nv_bfloat16* q;
    std::memcpy(&q, emu_warp->buf[8 * i + rr], sizeof(q));
    return q;
  };
  const int gid = lane >> 2, tig = lane & 3;
  for (int i = 0; i < 4; i++) {
    const uint16_t lo = trans ? row(i, 2 * tig)[gid].x : row(i, gid)[2 * tig].x;
    const uint16_t hi = trans ? row(i, 2 * tig + 1)[gid].x : row(i, gid)[2 * tig + 1].x;
    r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
  }
  emu_warp->bar->arrive_and_wait();  // nobody overwrites an address before every lane read it
}
// cp.async (cuda_common.cuh's cp_async_16 / commit / wait): each thread's copies are queued in
// commit groups and done by cp_async_wait<N> (every group but the newest N, oldest first) or at
// the end of the block — so a kernel that reads a stage before waiting for its group reads
// what was there before (NaN in a block's fresh shared memory), and one that overwrites a
// stage other threads still read shows as a race under TSan. Both addresses must be 16-byte
// aligned.
struct EmuCopy {
  void* dst;
  const void* src;
  int bytes;
};
inline thread_local std::vector<std::vector<EmuCopy>> emu_cp_groups;  // committed, oldest first
inline thread_local std::vector<EmuCopy> emu_cp_open;                 // not yet committed
inline void emu_cp_do(const EmuCopy& c) {
  if (c.bytes == 16) std::memcpy(c.dst, c.src, 16);
  else std::memset(c.dst, 0, 16);
}
inline void cp_async_16(void* dst, const void* src, int src_bytes) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 != 0) {
    std::fprintf(stderr, "cp.async: %p <- %p is not 16-byte aligned\n", dst, src);
    std::abort();
  }
  if (src_bytes != 16 && src_bytes != 0) {
    std::fprintf(stderr, "cp.async: src_bytes %d (the kernels use 0 or 16)\n", src_bytes);
    std::abort();
  }
  emu_cp_open.push_back(EmuCopy{dst, src, src_bytes});
}
inline void cp_async_commit() {
  emu_cp_groups.push_back(std::move(emu_cp_open));
  emu_cp_open.clear();
}
template <int N> void cp_async_wait() {
  while (emu_cp_groups.size() > (size_t)N) {
    for (const EmuCopy& c : emu_cp_groups.front()) emu_cp_do(c);
    emu_cp_groups.erase(emu_cp_groups.begin());
  }
}
// What a block left in flight lands before the next block starts (the hardware finishes it).
inline void emu_cp_drain() {
  cp_async_commit();
  cp_async_wait<0>();
}
inline void ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* p) { emu_ldsm_x4(r, p, false); }
inline void ldsm_x4_t(uint32_t (&r)[4], const __nv_bfloat16* p) { emu_ldsm_x4(r, p, true); }

// Launches `f` (a call of the kernel) on `grid` blocks of `block.x` threads with
// `shared_bytes` of dynamic shared memory. Aborts on what a GPU launch would refuse here
// (more than 1024 threads, more than `smem_limit` bytes of dynamic shared memory: 48 KiB unless
// the launcher opts the kernel in to more, as attention_cuda.rs does for ∂K/∂V) and on 2-D/3-D
// blocks (not emulated).
// When set, emu_launch walks a launch's blocks last to first (a kernel whose blocks meet
// through atomics then sees them arrive in the other order).
inline bool emu_reverse_blocks = false;

template <class F>
void emu_launch(Dim3 grid, Dim3 block, size_t shared_bytes, F f, size_t smem_limit = 48 * 1024) {
  if (block.x == 0 || block.x > 1024 || block.y != 1 || block.z != 1 || grid.x == 0 || grid.y == 0 || grid.z == 0) {
    std::fprintf(stderr, "emu_launch: unsupported shape grid (%u,%u,%u) block (%u,%u,%u)\n", grid.x, grid.y, grid.z,
                 block.x, block.y, block.z);
    std::abort();
  }
  if (shared_bytes > smem_limit) {
    std::fprintf(stderr, "emu_launch: %zu bytes of dynamic shared memory > %zu\n", shared_bytes, smem_limit);
    std::abort();
  }
  gridDim = grid;
  blockDim = block;
  emu_dynamic_smem_size = (unsigned)shared_bytes;
  const unsigned n_warps = (block.x + 31) / 32;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
  std::vector<EmuWarp> warps(n_warps);
  for (unsigned w = 0; w < n_warps; w++) {
    warp_bars.push_back(std::make_unique<std::barrier<>>(std::min(32u, block.x - 32 * w)));
    warps[w].bar = warp_bars.back().get();
  }
  std::barrier<> block_bar(block.x), step(block.x);
  emu_block_bar = &block_bar;
  struct FreeAligned {
    void operator()(float* p) const { ::operator delete(p, std::align_val_t(16)); }
  };
  std::unique_ptr<float, FreeAligned> smem;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < block.x; t++)
    threads.emplace_back([&, t] {
      threadIdx = Dim3{t, 0, 0};
      emu_warp = &warps[t / 32];
      for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
          for (unsigned bx = 0; bx < grid.x; bx++) {
            if (t == 0) {
              smem.reset(shared_bytes ? static_cast<float*>(::operator new(shared_bytes, std::align_val_t(16))) : nullptr);
              for (size_t i = 0; i < shared_bytes / 4; i++) smem.get()[i] = NAN;
              emu_dynamic_smem = smem.get();
            }
            step.arrive_and_wait();  // the block's shared memory is ready
            blockIdx = emu_reverse_blocks ? Dim3{grid.x - 1 - bx, grid.y - 1 - by, grid.z - 1 - bz} : Dim3{bx, by, bz};
            f();
            emu_cp_drain();
            step.arrive_and_wait();  // every thread is done with the block
          }
    });
  for (auto& t : threads) t.join();
}
