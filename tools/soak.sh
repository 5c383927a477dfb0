#!/usr/bin/env bash
# Soak test of issue 19 (not part of `cargo test`): long runs of the real `composer-rl` binary
# with random faults, then a tally of faults injected, survived and data lost. RELIABILITY.md
# records its results.
#
#   tools/soak.sh [STEPS]            (default 1000)
#
# Phase 1 (exactness): a sync run of the tiny built-in model on 1-digit arithmetic, hit by
#   `kill -9` and SIGTERM at random moments and resumed each time, against the same run
#   uninterrupted. Data lost = train steps missing or repeated in metrics.jsonl, plus 1 if the
#   final weights, optimizer state or trainer state differ from the uninterrupted run's.
# Phase 2 (env server): the same model against a real OpenEnv echo server (port $PORT), whose
#   server is killed (-9) and restarted at random moments while the trainer is also killed
#   and resumed. Data lost = train steps missing or repeated; env failures are counted.
#
# Environment: SEED (default 1), BIN (default target/release/composer-rl, else target/debug),
# PORT (default 8801), OPENENV_DIR (the echo server's venv, default ./.openenv-venv; phase 2
# is skipped with a note when ../shared/openenv/start-server.sh is missing), SOAK_DIR (work
# folder, default a new temporary one), PHASES (default "1 2").
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STEPS=${1:-1000}
SEED=${SEED:-1}
PORT=${PORT:-8801}
PHASES=${PHASES:-"1 2"}
SHARED=${COMPOSER_SHARED:-$ROOT/../shared}
OPENENV_DIR=${OPENENV_DIR:-$ROOT/.openenv-venv}
BIN=${BIN:-}
if [[ -z "$BIN" ]]; then
  if [[ -x target/release/composer-rl ]]; then BIN=target/release/composer-rl; else BIN=target/debug/composer-rl; fi
fi
SOAK_DIR=${SOAK_DIR:-$(mktemp -d /tmp/composer-soak.XXXXXX)}
mkdir -p "$SOAK_DIR"
RANDOM=$SEED
log() { echo "[soak] $*" >&2; }

recipe() { # $1 = steps, $2 = extra sections
  cat <<EOF
[model.builtin_tiny]
hidden_size = 32
layers = 1
heads = 2
kv_heads = 1
intermediate_size = 64

[data]
task = "arithmetic"
eval_size = 8

[data.arithmetic]
digits = 1

[rollout]
num_generations = 4
max_completion_length = 3

[loss]
replay_weight = 1.0

[replay]
traces = ["builtin:scripted"]

[warmup]
steps = 10
batch_size = 8

[train]
steps = $1
prompts_per_step = 2
seed = $SEED
eval_every = 50
checkpoint_every = 10
$2
EOF
}

# Train-step numbers of a run's metrics: prints "missing repeated".
step_tally() {
  python3 - "$1" "$2" <<'EOF'
import json, sys, collections
steps = [json.loads(l)["step"] for l in open(sys.argv[1] + "/metrics.jsonl")
         if l.strip() and json.loads(l).get("kind") == "train"]
c = collections.Counter(steps)
want = range(1, int(sys.argv[2]) + 1)
print(sum(1 for s in want if s not in c), sum(n - 1 for n in c.values() if n > 1))
EOF
}

# Runs the trainer in $1 (recipe $2) until it finishes: after a random delay, a random fault:
# kill -9 or SIGTERM of the trainer (then --resume), or, when $3 = env, kill -9 and restart of
# the env server (the trainer runs on). Counts into KILLS, TERMS, ENV_RESTARTS, ATTEMPTS.
KILLS=0 TERMS=0 ENV_RESTARTS=0 ATTEMPTS=0
faulty_run() {
  local run=$1 recipe=$2 with_env=${3:-}
  local first=1
  while :; do
    ATTEMPTS=$((ATTEMPTS + 1))
    if ((first)); then
      "$BIN" train "$recipe" --quiet --run-dir "$run" >>"$SOAK_DIR/train.log" 2>&1 &
      first=0
    else
      "$BIN" train --quiet --resume "$run" >>"$SOAK_DIR/train.log" 2>&1 &
    fi
    local pid=$!
    while :; do
      local delay=$((2 + RANDOM % 12)) t=0
      while ((t < delay * 10)) && kill -0 "$pid" 2>/dev/null; do sleep 0.1; t=$((t + 1)); done
      kill -0 "$pid" 2>/dev/null || break
      local fault=$((RANDOM % 3))
      if [[ -n "$with_env" && $fault -eq 2 ]]; then
        ENV_RESTARTS=$((ENV_RESTARTS + 1))
        kill -9 "$(cat "$OPENENV_DIR/server.pid")" 2>/dev/null || true
        sleep $((1 + RANDOM % 3))
        PORT=$PORT "$SHARED/openenv/start-server.sh" start "$OPENENV_DIR" >/dev/null
        continue
      fi
      if ((fault == 0)); then
        KILLS=$((KILLS + 1)); kill -9 "$pid" 2>/dev/null || true
      else
        TERMS=$((TERMS + 1)); kill -TERM "$pid" 2>/dev/null || true
      fi
      break
    done
    local rc=0
    wait "$pid" || rc=$?
    if ((rc == 0)); then break; fi
    if ((rc != 137 && rc != 143)); then
      log "attempt $ATTEMPTS ended with status $rc (see $SOAK_DIR/train.log)"
      tail -5 "$SOAK_DIR/train.log" >&2
    fi
    # Killed before the first checkpoint: start over.
    if ! ls "$run"/checkpoint*/trainer_state.json >/dev/null 2>&1; then first=1; rm -rf "$run"; fi
  done
}

same_file() { cmp -s "$1" "$2"; }

for phase in $PHASES; do
  KILLS=0 TERMS=0 ENV_RESTARTS=0 ATTEMPTS=0
  t0=$(date +%s)
  if [[ $phase == 1 ]]; then
    recipe "$STEPS" "" >"$SOAK_DIR/sync.toml"
    log "phase 1: $STEPS sync steps, uninterrupted reference run"
    "$BIN" train "$SOAK_DIR/sync.toml" --quiet --run-dir "$SOAK_DIR/reference" >>"$SOAK_DIR/train.log" 2>&1
    log "phase 1: the same run with random kill -9 / SIGTERM"
    faulty_run "$SOAK_DIR/faulty" "$SOAK_DIR/sync.toml"
    read -r missing repeated < <(step_tally "$SOAK_DIR/faulty" "$STEPS")
    diverged=0
    for f in model.safetensors optimizer.safetensors trainer_state.json; do
      same_file "$SOAK_DIR/faulty/checkpoint/$f" "$SOAK_DIR/reference/checkpoint/$f" || { diverged=1; log "differs: $f"; }
    done
    lost=$((missing + repeated + diverged))
    echo "RESULT phase=1 steps=$STEPS seed=$SEED kill9=$KILLS sigterm=$TERMS env_restarts=0 attempts=$ATTEMPTS survived=$((KILLS + TERMS)) missing_steps=$missing repeated_steps=$repeated final_state_differs=$diverged data_lost=$lost wall_s=$(($(date +%s) - t0)) bin=$BIN"
  elif [[ $phase == 2 ]]; then
    if [[ ! -x "$SHARED/openenv/start-server.sh" ]]; then log "phase 2 skipped: no $SHARED/openenv/start-server.sh"; continue; fi
    PORT=$PORT "$SHARED/openenv/start-server.sh" start "$OPENENV_DIR" >/dev/null
    trap '"$SHARED/openenv/start-server.sh" stop "$OPENENV_DIR" >/dev/null 2>&1 || true' EXIT
    env_steps=$((STEPS / 4 > 0 ? STEPS / 4 : 1))
    cat >"$SOAK_DIR/env.toml" <<EOF
[model.builtin_tiny]
hidden_size = 16
layers = 1
heads = 2
kv_heads = 1
intermediate_size = 32

[data]
task = "arithmetic"
eval_size = 4

[rollout]
num_generations = 2
max_completion_length = 4

[train]
steps = $env_steps
prompts_per_step = 2
seed = $SEED
eval_every = 0
checkpoint_every = 10

[env]
kind = "openenv"
url = "http://127.0.0.1:$PORT"
max_turns = 1
max_concurrent = 2
call_timeout_s = 10.0
connect_timeout_s = 2.0
server_down_budget_s = 120.0
EOF
    log "phase 2: $env_steps env steps with random env server kills, kill -9 / SIGTERM"
    faulty_run "$SOAK_DIR/env-run" "$SOAK_DIR/env.toml" env
    read -r missing repeated < <(step_tally "$SOAK_DIR/env-run" "$env_steps")
    failures=$(python3 -c "import json,sys; t=[json.loads(l) for l in open(sys.argv[1]) if '\"train\"' in l]; print(sum(v for v in t[-1].get('env/failures',{}).values() if isinstance(v,int)))" "$SOAK_DIR/env-run/metrics.jsonl")
    lost=$((missing + repeated))
    echo "RESULT phase=2 steps=$env_steps seed=$SEED kill9=$KILLS sigterm=$TERMS env_restarts=$ENV_RESTARTS attempts=$ATTEMPTS survived=$((KILLS + TERMS + ENV_RESTARTS)) missing_steps=$missing repeated_steps=$repeated env_failures_counted=$failures data_lost=$lost wall_s=$(($(date +%s) - t0)) bin=$BIN"
    "$SHARED/openenv/start-server.sh" stop "$OPENENV_DIR" >/dev/null 2>&1 || true
  fi
done
log "work folder: $SOAK_DIR"
