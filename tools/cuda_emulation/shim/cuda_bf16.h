#pragma once
// Emulation shim of the CUDA toolkit header for tools/cuda_emulation (host code only).
#include <cstdint>
#include <cstring>
struct alignas(16) float4 { float x, y, z, w; };
struct __nv_bfloat16 { uint16_t x; };
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.x << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  uint32_t lsb = (u >> 16) & 1; u += 0x7fff + lsb;  // round to nearest even (finite inputs)
  __nv_bfloat16 b; b.x = (uint16_t)(u >> 16); return b;
}
