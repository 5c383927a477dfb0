#!/usr/bin/env bash
# Builds and runs the CPU emulation of the varlen attention CUDA kernels (attention_emu.cpp,
# with shim/cuda_bf16.h standing in for the toolkit header): a check of the kernels' indexing,
# tiling and maths without a GPU. Needs g++ with C++20. Takes minutes (one std::thread per
# CUDA thread). Exits non-zero when any case exceeds its tolerance.
set -euo pipefail
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/composer-attention-emu
g++ -std=c++20 -O1 -pthread -Ishim -x c++ attention_emu.cpp -o "$out"
exec "$out"
