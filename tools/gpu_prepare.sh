#!/usr/bin/env bash
# Builds what tools/gpu_check.sh needs into .device/ (git-ignored; carried by the device tool):
# the CUDA release binary, the CUDA test binaries of composer-model, and the hf-tiny fixtures.
# Needs the toolkit from ../shared/cuda/setup-toolkit.sh in .cuda-toolkit/.
set -euo pipefail
cd "$(dirname "$0")/.."
source .cuda-toolkit/env.sh
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-cuda}
cargo build --release --features cuda
rm -rf .device && mkdir -p .device/tests .device/shared/fixtures
cp "$CARGO_TARGET_DIR/release/composer-rl" .device/
cargo test --release -p composer-model --features cuda --no-run --message-format json 2>/dev/null \
  | python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])' | while read -r exe; do cp "$exe" .device/tests/; done
cp -r ../shared/fixtures/hf-tiny .device/shared/fixtures/
du -sh .device
