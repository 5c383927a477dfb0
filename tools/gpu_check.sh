#!/usr/bin/env bash
# Runs on a lent GPU machine (the `device` tool), from the repository root, with `.device/`
# carried. Build `.device/` here first with tools/gpu_prepare.sh (CUDA binaries + fixtures).
# Does everything in one call: CUDA parity and token-faithfulness tests, the model benchmark
# in bf16 next to PyTorch eager on the same card; prints a
# table last. Full logs go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
D=.device
# candle's CUDA build links cudart/cuBLAS/cuRAND/NVRTC dynamically: take PyTorch's copies.
NV=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")' 2>/dev/null)
for lib in "$NV"/*/lib /usr/local/cuda/lib64; do
  [ -d "$lib" ] && LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

export COMPOSER_SHARED=$PWD/$D/shared COMPOSER_TEST_DEVICE=cuda
status=()
for t in "$D"/tests/*; do
  name=$(basename "$t")
  if timeout 300 "$t" --test-threads 1 >"$OUT/test-$name.log" 2>&1; then
    status+=("test $name: PASS ($(grep -o '[0-9]* passed' "$OUT/test-$name.log" | tail -1))")
  else
    status+=("test $name: FAIL (see test-$name.log)")
    tail -30 "$OUT/test-$name.log"
  fi
done

BIN=$D/composer-rl
timeout 400 "$BIN" bench model --shape qwen2.5-0.5b --device cuda --dtype bf16 --json \
  >"$OUT/bench-candle.json" 2>"$OUT/bench-candle.err" || { echo "candle bench failed"; tail -20 "$OUT/bench-candle.err"; }
timeout 400 python3 tools/bench_torch.py --device cuda --dtype bf16 --json \
  >"$OUT/bench-torch.json" 2>"$OUT/bench-torch.err" || { echo "torch bench failed"; tail -20 "$OUT/bench-torch.err"; }

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
c, t = load("bench-candle.json"), load("bench-torch.json")
if c and t:
    print(f"Qwen2.5-0.5B shape, bf16: composer-rl (candle) vs {t['framework']}")
    print(f"{'batch':>5} | {'train tok/s candle':>18} {'torch':>10} {'ratio':>6} | {'decode tok/s candle':>19} {'torch':>10} {'ratio':>6}")
    for rc, rt in zip(c["rows"], t["rows"]):
        tc, tt = rc.get("train_tokens_per_s"), rt.get("train_tokens_per_s")
        tr = f"{tc:18.0f} {tt:10.0f} {tc/tt:6.2f}" if tc and tt else f"{'-':>18} {'-':>10} {'-':>6}"
        dc, dt = rc["decode_tokens_per_s"], rt["decode_tokens_per_s"]
        print(f"{rc['batch']:>5} | {tr} | {dc:19.0f} {dt:10.0f} {dc/dt:6.2f}")
EOF
