#!/usr/bin/env bash
# Training-rollout time per token against completion length on an HF checkpoint: one `train`
# run per length (8 prompts x 8 samples, 2 steps), reading `time/rollout_s` and the completion
# lengths from each run's metrics.jsonl. With a KV cache the per-token time stays flat; a
# sampler that recomputes the sequence per token grows linearly with the length.
#   tools/bench_rollout_scaling.sh [MODEL_DIR] [LENGTHS]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${1:-$ROOT/../shared/fixtures/hf-tiny/qwen2-tiny}
LENGTHS=${2:-"16 64 128"}
BIN=${BIN:-$ROOT/target/release/composer-rl}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 - "$WORK/rows.jsonl" <<'PY'
import json, sys
qs = ["What is 2+2?", "What is 3+4?", "Name a prime.", "Reverse 'abc'.", "Sort [3,1,2].",
      "Say hi.", "Add 5 and 7.", "What is 9*9?"]
with open(sys.argv[1], "w") as f:
    for q in qs:
        f.write(json.dumps({"messages": [{"role": "user", "content": q}], "answer": "x"}) + "\n")
PY
printf "%-8s %-12s %-14s %-14s\n" length tokens rollout_s ms_per_token
for L in $LENGTHS; do
  cat > "$WORK/r$L.toml" <<TOML
[model]
path = "$MODEL"
[data]
dataset = "$WORK/rows.jsonl"
eval_dataset = "$WORK/rows.jsonl"
verifiers = [{ kind = "regex", weight = 1.0, pattern = "A" }]
[rollout]
num_generations = 8
max_completion_length = $L
[train]
steps = 2
prompts_per_step = 8
eval_every = 0
checkpoint_every = 0
TOML
  "$BIN" train "$WORK/r$L.toml" --quiet --run-dir "$WORK/run$L" >/dev/null 2>&1
  python3 - "$WORK/run$L/metrics.jsonl" "$L" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"time/rollout_s"' in l]
tok = sum(sum(r["completions/lengths"]) for r in rows)
t = sum(r["time/rollout_s"] for r in rows)
print(f"{sys.argv[2]:<8} {tok:<12} {t:<14.3f} {1000*t/tok:<14.3f}")
PY
done
