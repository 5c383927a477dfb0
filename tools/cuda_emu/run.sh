#!/usr/bin/env bash
# Runs the rollout engine's decode kernels (crates/model/src/ops/decode_kernels.cu) on the CPU,
# for checking them where no GPU is at hand: emu.h runs each CUDA thread of a block as a
# std::thread, __syncthreads and warp shuffles through barriers, the blocks one at a time; the
# kernel source is used as is (only its dynamic shared memory declaration becomes a pointer to
# a buffer of exactly the launch's size). Built with AddressSanitizer + UBSan (out-of-bounds
# reads/writes of global or shared memory abort), or ThreadSanitizer with TSAN=1 (a missing
# __syncthreads shows as a data race). Each driver compares with an f64 reference:
# paged_decode.cpp the paged decode attention on the shapes of tests/paged_kv.rs (arguments
# pick its cases by index; all of them take ~15 min on 2 cores), sample_inverse_cdf.cpp the
# sampler. Needs g++ >= 11 (C++20 <barrier>). Not a GPU test: tools/gpu_check.sh runs the
# real kernels.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed 's/extern __shared__ float smem\[\];/float* smem = emu_dynamic_smem;/' \
  "$here/../../crates/model/src/ops/decode_kernels.cu" >"$work/decode_kernels_emu.cu"
grep -q 'emu_dynamic_smem' "$work/decode_kernels_emu.cu" || { echo "the dynamic shared memory declaration moved" >&2; exit 1; }
if [ "${TSAN:-0}" = 1 ]; then san=thread; else san=address,undefined; fi
for driver in paged_decode sample_inverse_cdf; do
  g++ -std=c++20 -O1 -g -fsanitize=$san -I"$here/inc" -I"$work" -I"$here" \
    "$here/$driver.cpp" -o "$work/$driver" -lpthread
  echo "== $driver ($san)"
  if [ "$driver" = paged_decode ]; then "$work/$driver" "$@"; else "$work/$driver"; fi
done
