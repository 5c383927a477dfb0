#!/usr/bin/env bash
# Builds and runs the CPU emulation of the CUDA kernels (see README.md): each driver includes
# emu.h and the real kernel source, and compares the kernels with an f64 reference.
#   tools/cuda_emu/run.sh [--quick]                      every driver
#   tools/cuda_emu/run.sh [--quick] DRIVER [ARGS...]     one driver; ARGS go to it (case indices)
# DRIVER: varlen_attention (attention_kernels.cu), paged_decode, decode_gemm, rows_invariant, sample_inverse_cdf, kv_write (decode_kernels.cu),
# head_softmax, add_rms_norm, qkv_bias_rope, rope, swiglu_packed, adamw, embedding, rms_norm_bwd, bias_add (kernels.cu).
# --quick: each driver's quick subset of its cases (the default runs all of them).
# SANITIZE=address (default: ASan + UBSan, out-of-bounds global/shared memory and undefined
# behaviour abort), thread (TSan: a missing __syncthreads shows as a data race) or none
# (plain -O2, fastest). Exits non-zero when a build fails or a driver reports FAIL.
# EMU_DEFINES="-DDS_THREADS=64 -DSP_THREADS=32": extra compiler flags (the sampler's block sizes
# are macros; 1,024 or 256 host threads per block make its driver slow, and its kernels must
# work at any size).
# Needs g++ >= 11 (C++20 <barrier>, std::atomic_ref).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ops="$here/../../crates/model/src/ops"
quick=()
if [ "${1:-}" = --quick ]; then quick=(--quick); shift; fi
all=(varlen_attention paged_decode decode_gemm rows_invariant sample_inverse_cdf kv_write head_softmax add_rms_norm qkv_bias_rope rope swiglu_packed adamw embedding rms_norm_bwd bias_add)
if [ $# -gt 0 ]; then drivers=("$1"); shift; else drivers=("${all[@]}"); fi
case "${SANITIZE:-address}" in
  address) flags=(-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all) ;;
  thread) flags=(-O1 -g -fsanitize=thread) ;;
  none) flags=(-O2) ;;
  *) echo "SANITIZE=${SANITIZE} is not one of address, thread, none" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The kernel sources as they are, but for the dynamic shared memory declarations: a pointer to
# the launch's buffer (emu.h) instead of `extern __shared__`, which a host compiler cannot give.
# attention_tc_kernels.cuh, which attention_kernels.cu includes, is rewritten under its own name
# in the work directory (searched before the sources' directory).
for src in attention_kernels.cu decode_kernels.cu kernels.cu attention_tc_kernels.cuh decode_tc_kernels.cuh decode_gemm_kernels.cuh rows_invariant_kernels.cuh sample_kernels.cuh head_kernels.cuh embedding_kernels.cuh linear_kernels.cuh; do
  case "$src" in *.cu) out="${src%.cu}_emu.cu" ;; *) out="$src" ;; esac
  sed -E 's/extern __shared__ float ([A-Za-z_][A-Za-z0-9_]*)\[\];/float* \1 = emu_dynamic_smem;/' \
    "$ops/$src" >"$work/$out"
  if grep -n 'extern __shared__' "$work/$out" >&2; then
    echo "$src: a dynamic shared memory declaration run.sh does not rewrite" >&2
    exit 1
  fi
done
failed=()
for driver in "${drivers[@]}"; do
  if [ ! -f "$here/$driver.cpp" ]; then echo "no driver $driver (one of: ${all[*]})" >&2; exit 2; fi
  g++ -std=c++20 "${flags[@]}" ${EMU_DEFINES:-} -I"$here/inc" -I"$here" -I"$work" -I"$ops" "$here/$driver.cpp" -o "$work/$driver" -pthread
  echo "== $driver (SANITIZE=${SANITIZE:-address}${quick:+, quick})"
  "$work/$driver" "${quick[@]}" "$@" || failed+=("$driver")
done
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}" >&2; exit 1; fi
