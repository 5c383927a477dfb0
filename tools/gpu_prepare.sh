#!/usr/bin/env bash
# Builds what tools/gpu_check.sh needs into .device/ (git-ignored; carried by the device tool):
# the CUDA release binary, the CUDA test binaries of composer-model (parity, training_and_rollout,
# ops, ops_attention, ops_step, paged_kv, decode_graphs), the CUPTI kernel profiler, and the hf-tiny fixtures.
# Needs the toolkit from ../shared/cuda/setup-toolkit.sh in .cuda-toolkit/.
set -euo pipefail
cd "$(dirname "$0")/.."
source .cuda-toolkit/env.sh
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-cuda}
cargo build --release --features cuda
rm -rf .device /tmp/devpack && mkdir -p .device/shared/fixtures /tmp/devpack/tests
# Stripped and xz-packed: the device tool carries at most 64 MiB, and the CUDA binaries embed
# their PTX (~45-80 MB each stripped).
strip -o /tmp/devpack/composer-rl "$CARGO_TARGET_DIR/release/composer-rl"
cargo test --release -p composer-model --features cuda --no-run 2>&1 \
  | grep -oE '\(/[^)]*/deps/(parity|training_and_rollout|ops|ops_attention|ops_step|paged_kv|decode_graphs)-[0-9a-f]+\)' | tr -d '()' \
  | while read -r exe; do strip -o "/tmp/devpack/tests/$(basename "$exe" | cut -d- -f1)" "$exe"; done
# The CUPTI kernel profiler (tools/cupti_profile, gpu_check.sh section `profile`), built
# against CUPTI 13.0 and carried with that libcupti so records and headers agree.
CUPTI=/tmp/cupti-wheel
if [ ! -f "$CUPTI/nvidia/cu13/lib/libcupti.so.13" ]; then
  rm -rf "$CUPTI" && mkdir -p "$CUPTI"
  pip download -q --no-deps -d "$CUPTI" nvidia-cuda-cupti==13.0.85
  python3 -m zipfile -e "$CUPTI"/nvidia_cuda_cupti-*.whl "$CUPTI"
fi
bash tools/cupti_profile/selftest.sh "$CUPTI/nvidia/cu13/include" "$CUDA_HOME/include"
mkdir -p /tmp/devpack/cupti
g++ -O2 -std=c++17 -Wall -Wextra -Werror -shared -fPIC -I"$CUPTI/nvidia/cu13/include" \
  -I"$CUDA_HOME/include" tools/cupti_profile/kernel_profile.cc -o /tmp/devpack/cupti/libkernel_profile.so \
  -L"$CUPTI/nvidia/cu13/lib" -l:libcupti.so.13 -static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL
cp "$CUPTI/nvidia/cu13/lib/libcupti.so.13" /tmp/devpack/cupti/
# One xz stream with a dictionary larger than the tar: the binaries share most of their bytes
# (candle, the PTX modules), which a small dictionary cannot see across files (~59 MB at
# `xz -6`, ~17 MB like this; about 6 minutes on one core).
tar -C /tmp/devpack -cf - . | xz --lzma2=preset=6,dict=512MiB -T1 > .device/bins.tar.xz
cp -r ../shared/fixtures/hf-tiny .device/shared/fixtures/
# TRL's side of `bench grpo` (gpu_check.sh section `rollout`): the device has no network.
pip download -q --no-deps -d .device/wheels trl==1.16.0 accelerate datasets dill multiprocess xxhash
du -sh .device
# The device tool carries at most 64 MiB with the working tree: say so here, not after a
# failed (and charged) device call.
kib=$(du -sk .device | cut -f1)
if [ "$kib" -gt $((60 * 1024)) ]; then
  echo "gpu_prepare: .device is ${kib} KiB, too close to the device tool's 64 MiB carry limit;" \
    "drop a test binary from the grep above" >&2
  exit 1
fi
