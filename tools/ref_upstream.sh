#!/usr/bin/env bash
# Regenerate crates/loss/tests/fixtures/upstream/*.json by running the upstream code itself
# (TRL 1.16.0, verl 0.9.1, PRIME-RL loss.py at a pinned commit). See tools/ref_upstream.py.
#
#   bash tools/ref_upstream.sh /path/to/prime-rl/src/prime_rl/trainer/rl/loss.py
#
# The venv lives outside the repository (VENV, default /work/.venv-upstream). PRIME-RL's
# loss.py is not on a package registry: fetch the repository at the pinned commit
# (PRIME_RL_COMMIT in tools/ref_upstream.py) and pass the file's path; its sha256 is checked.
set -euo pipefail
VENV=${VENV:-/work/.venv-upstream}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q torch "trl==1.16.0" numpy jaxtyping beartype
# verl: --no-deps, then only what `verl.trainer.ppo.core_algos` needs to import.
"$VENV/bin/pip" install -q --no-deps "verl==0.9.1"
"$VENV/bin/pip" install -q omegaconf "tensordict==0.10.0" codetiming ray
cd "$(dirname "$0")/.."
"$VENV/bin/python" tools/ref_upstream.py --prime-rl-loss "$1"
