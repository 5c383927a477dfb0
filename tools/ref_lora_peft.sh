#!/usr/bin/env bash
# Regenerate crates/model/tests/fixtures/lora-qwen2/: composer-model writes a LoRA adapter
# (seeded, non-zero A and B) for the qwen2-tiny fixture, then upstream PEFT loads it and
# records reference logits (tools/ref_lora_peft.py).
#
#   bash tools/ref_lora_peft.sh
#
# VENV (default /work/.venv-upstream) needs torch, transformers and peft.
set -euo pipefail
VENV=${VENV:-/work/.venv-upstream}
cd "$(dirname "$0")/.."
SHARED=${COMPOSER_SHARED:-$(pwd)/../shared}
BASE="$SHARED/fixtures/hf-tiny/qwen2-tiny"
OUT=crates/model/tests/fixtures/lora-qwen2
"$VENV/bin/python" -c "import peft" 2>/dev/null || "$VENV/bin/pip" install -q peft
cargo run -q -p composer-model --example write_lora_fixture -- "$BASE" "$OUT"
"$VENV/bin/python" tools/ref_lora_peft.py "$BASE" "$OUT"
