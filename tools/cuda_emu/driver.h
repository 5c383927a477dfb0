// What every driver of the emulated kernels shares: converting test values to the kernels'
// element types and back, and the launch shapes of crates/model/src/ops/cuda.rs.
#pragma once
#include "emu.h"
#include <algorithm>

template <typename T> T cvt(float x);
template <> inline float cvt<float>(float x) { return x; }
template <> inline __nv_bfloat16 cvt<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
inline double back(float x) { return x; }
inline double back(__nv_bfloat16 x) { return __bfloat162float(x); }

// Threads per block as crates/model/src/ops/cuda.rs's row_threads launches them.
inline unsigned row_threads(int d) {
  return d <= 256 ? std::max(32, (d + 31) / 32 * 32) : d <= 4096 ? 256 : 512;
}
