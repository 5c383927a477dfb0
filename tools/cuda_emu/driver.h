// What every driver of the emulated kernels shares: converting test values to the kernels'
// element types and back, and the launch shapes of crates/model/src/ops/cuda.rs.
#pragma once
#include "emu.h"
#include <algorithm>
#include <cmath>
#include <initializer_list>

template <typename T> T cvt(float x);
template <> inline float cvt<float>(float x) { return x; }
template <> inline __nv_bfloat16 cvt<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
inline double back(float x) { return x; }
inline double back(__nv_bfloat16 x) { return __bfloat162float(x); }

// Threads per block as crates/model/src/ops/cuda.rs's row_threads launches them.
inline unsigned row_threads(int d) {
  return d <= 256 ? std::max(32, (d + 31) / 32 * 32) : d <= 4096 ? 256 : 512;
}

// The larger of two errors, NaN-sticky: a NaN error (a NaN output — an unwritten shared-memory
// slot reads as NaN — or a failed check) stays the worst, so `worst <= tol` fails. std::max
// drops a NaN second argument, and `if (!(e <= worst)) worst = e` loses a NaN at the next
// finite error.
inline double worst_of(double a, double b) {
  return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b);
}
inline double worst_of(std::initializer_list<double> xs) {
  double w = -INFINITY;
  for (double x : xs) w = worst_of(w, x);
  return w;
}
