#!/usr/bin/env bash
# Runs on a lent GPU machine (the `device` tool), from the repository root, with `.device/`
# carried. Build `.device/` here first with tools/gpu_prepare.sh (CUDA binaries + fixtures).
# Does everything in one call: CUDA parity and token-faithfulness tests, the model benchmark
# in bf16 next to PyTorch eager on the same card; prints a
# table last. Full logs go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
# .device/bins.tar.xz holds composer-rl and the CUDA test binaries (see gpu_prepare.sh).
D=/tmp/composer-device
mkdir -p "$D"
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' .device/bins.tar.xz "$D"
# candle's CUDA build links cudart/cuBLAS/cuRAND/NVRTC dynamically: take PyTorch's copies.
NV=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")' 2>/dev/null)
for lib in "$NV"/*/lib /usr/local/cuda/lib64 /usr/local/nvidia/lib64; do
  [ -d "$lib" ] && LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

export COMPOSER_SHARED=$PWD/.device/shared COMPOSER_TEST_DEVICE=cuda
status=()
[ -n "${SKIP_TESTS:-}" ] || for t in "$D"/tests/*; do
  name=$(basename "$t")
  if timeout 300 "$t" --test-threads 1 >"$OUT/test-$name.log" 2>&1; then
    status+=("test $name: PASS ($(grep -o '[0-9]* passed' "$OUT/test-$name.log" | tail -1))")
  else
    status+=("test $name: FAIL (see test-$name.log)")
    tail -30 "$OUT/test-$name.log"
  fi
done

BIN=$D/composer-rl
# One process per batch size, so that running out of memory at one size loses only that row.
# Training at sequence length 256 (batch 64 x 512 with the 152k vocabulary runs out of memory
# in both frameworks on 80 GB).
# bf16 numerics: the fixtures scored on the GPU in bf16 (score's default there) against
# transformers' f32 reference log-probs.
python3 - "$D/composer-rl" .device/shared/fixtures/hf-tiny <<'PY' | tee "$OUT/bf16.txt"
import json, subprocess, sys
bin_, root = sys.argv[1], sys.argv[2]
for name in ["llama-tiny", "qwen2-tiny", "qwen3-tiny"]:
    ref = json.load(open(f"{root}/{name}/reference.json"))
    worst, n = 0.0, 0
    for case in ref["cases"]:
        out = subprocess.run([bin_, "score", "--model", f"{root}/{name}", "--text", case["text"],
                              "--device", "cuda", "--json"], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name}: score failed: {out.stderr.strip()[-300:]}"); break
        got = json.loads(out.stdout)["next_token_logprobs"]
        want = case["next_token_logprobs"]
        worst = max([worst] + [abs(a - b) for a, b in zip(got, want)]); n += len(want)
    print(f"bf16 on CUDA vs transformers f32: {name}: max |d logprob| = {worst:.4f} over {n} tokens")
PY
for b in ${BATCHES:-1 16 64}; do
  timeout 200 "$BIN" bench model --shape qwen2.5-0.5b --device cuda --dtype bf16 --json \
    --batch "$b" --train-seq-len 256 >"$OUT/bench-candle-$b.json" 2>"$OUT/bench-candle-$b.err" \
    || { echo "candle bench batch $b failed: $(grep -m1 -o 'error.*' "$OUT/bench-candle-$b.err"); decode only:"
         timeout 120 "$BIN" bench model --shape qwen2.5-0.5b --device cuda --dtype bf16 --json \
           --batch "$b" --skip-train >"$OUT/bench-candle-$b.json" 2>>"$OUT/bench-candle-$b.err"; }
  timeout 150 python3 tools/bench_torch.py --device cuda --dtype bf16 --json \
    --batch "$b" --train-seq-len 256 >"$OUT/bench-torch-$b.json" 2>"$OUT/bench-torch-$b.err" \
    || { echo "torch bench batch $b failed: $(tail -1 "$OUT/bench-torch-$b.err"); decode only:"
         timeout 120 python3 tools/bench_torch.py --device cuda --dtype bf16 --json \
           --batch "$b" --skip-train >"$OUT/bench-torch-$b.json" 2>>"$OUT/bench-torch-$b.err"; }
done

echo
echo "=== summary ==="
cat "$OUT/gpu.txt"
printf '%s\n' "${status[@]}"
python3 - "$OUT" <<'EOF'
import json, sys, os
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception as e:
        print(f"{n}: unreadable ({e})"); return None
import glob
def rows(prefix):
    out = {}
    for f in sorted(glob.glob(os.path.join(out_dir, prefix + "-*.json"))):
        try:
            r = json.load(open(f))
        except Exception:
            continue
        for row in r["rows"]:
            out[row["batch"]] = row
        rows.meta = r
    return out
out_dir = out
cr = rows("bench-candle"); cmeta = getattr(rows, "meta", None)
tr_ = rows("bench-torch"); t = getattr(rows, "meta", None)
if t:
    print(f"Qwen2.5-0.5B shape, bf16, train seq 256, decode 128+64: composer-rl (candle) vs {t['framework']}")
    print(f"{'batch':>5} | {'train tok/s candle':>18} {'torch':>10} {'ratio':>6} | {'decode tok/s candle':>19} {'torch':>10} {'ratio':>6}")
    for batch in sorted(set(cr) | set(tr_)):
        rc = cr.get(batch, {"batch": batch, "decode_tokens_per_s": None})
        rt = tr_.get(batch, {"batch": batch, "decode_tokens_per_s": None})
        tc, tt = rc.get("train_tokens_per_s"), rt.get("train_tokens_per_s")
        tr = f"{tc:18.0f} {tt:10.0f} {tc/tt:6.2f}" if tc and tt else f"{'-':>18} {'-':>10} {'-':>6}"
        dc, dt = rc["decode_tokens_per_s"], rt["decode_tokens_per_s"]
        f = lambda x: f"{x:.0f}" if x else "OOM/fail"
        ratio = f"{dc/dt:6.2f}" if dc and dt else "-"
        tr = f"{f(tc):>18} {f(tt):>10} " + (f"{tc/tt:6.2f}" if tc and tt else "     -")
        print(f"{batch:>5} | {tr} | {f(dc):>19} {f(dt):>10} {ratio:>6}")
EOF
