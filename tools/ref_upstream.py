"""Reference fixtures for composer-loss, produced by RUNNING the upstream implementations.

Every expected value in crates/loss/tests/fixtures/upstream/*.json comes from calling the released
upstream code on random batches in float64 (loss and d loss / d trainer log-probs by torch
autograd):

* TRL 1.16.0 (PyPI): ``GRPOTrainer._compute_loss`` on a trainer object built without ``__init__``
  (the attributes the method reads are set by hand; the model forward
  ``_get_per_token_logps_and_entropies`` is replaced by one that returns the fixture's log-probs
  and entropies). The advantage block and the vLLM importance-sampling block live inline in
  ``GRPOTrainer._generate_and_score_completions``: their exact source lines are cut out of the
  installed method with ``inspect.getsource`` (between marker lines, see ``_trl_block``) and
  executed, so they too are the released code, not a re-derivation.
* verl 0.9.1 (PyPI, installed ``--no-deps``): ``verl.trainer.ppo.core_algos``:
  ``get_policy_loss_fn`` (vanilla, gspo, sapo, cispo, gpg, clip_cov, kl_cov, geo_mean),
  ``kl_penalty``, ``agg_loss``, and the advantage estimators (grpo, rloo, opo,
  reinforce_plus_plus(_baseline), grpo_passk, remax). verl's actor adds the KL term as
  ``pg_loss + kl_coef * agg_loss(kl_penalty(...), mask, loss_agg_mode)``; the ``verl/kl_penalty``
  cases compose exactly that from the two upstream functions.
* PRIME-RL ``src/prime_rl/trainer/rl/loss.py`` at ``PRIME_RL_COMMIT``: ``compute_loss`` with
  ``setup_rl_loss_fn(DefaultLossConfig)`` on packed sequences. The file is not on a package
  registry and this generator cannot reach GitHub, so it takes the path of the fetched file
  (``--prime-rl-loss``) and refuses to run unless its sha256 equals ``PRIME_RL_SHA256``. Its two
  ``prime_rl`` imports (the pydantic config classes and ``import_object``) are replaced by small
  stand-ins with the same fields and defaults.

No upstream code is committed. Run (creates/updates the venv outside the repository):

    bash tools/ref_upstream.sh /path/to/loss.py

or, with the venv in place: ``$VENV/bin/python tools/ref_upstream.py --prime-rl-loss PATH``.

The calls into each upstream are in ``tools/refupstream/`` (``trl_rlvr``, ``verl``, ``prime_rl``,
``trl_preference``; the shared random batches in ``batches``); this file writes the fixtures.
"""

import argparse
import importlib.metadata as md
import json
import platform
import sys
from collections import defaultdict
from pathlib import Path

import torch

# Before the upstream packages are imported (by the modules below), as it always was.
torch.set_default_dtype(torch.float64)

from refupstream.batches import SEED, Gen  # noqa: E402
from refupstream.prime_rl import (PRIME_RL_COMMIT, PRIME_RL_PATH, PRIME_RL_REPO,  # noqa: E402
                                  PRIME_RL_SHA256, load_prime_rl, prime_cases)
from refupstream.trl_preference import INDEPENDENT, INDEPENDENT_SEED, NO_COUNTERPART  # noqa: E402
from refupstream.trl_rlvr import trl_adv_cases, trl_cases  # noqa: E402
from refupstream.verl import verl_adv_cases, verl_agg_cases, verl_cases  # noqa: E402


OUT = Path(__file__).resolve().parent.parent / "crates/loss/tests/fixtures/upstream"


# --------------------------------------------------------------------------------------------


def header(extra):
    v = {p: md.version(p) for p in ("trl", "torch", "transformers", "verl", "numpy")}
    return {
        "generator": "tools/ref_upstream.py",
        "python": platform.python_version(),
        "packages": v,
        "seed": SEED,
        "dtype": "float64",
        **extra,
    }


def write(name, cases, extra=None):
    OUT.mkdir(parents=True, exist_ok=True)
    p = OUT / name
    p.write_text(json.dumps({"header": header(extra or {}), "cases": cases}, separators=(",", ":")) + "\n")
    fams = defaultdict(int)
    for c in cases:
        fams[c["family"]] += 1
    print(f"{p.name}: {len(cases)} cases, {p.stat().st_size // 1024} KiB, families {dict(fams)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prime-rl-loss", help=f"{PRIME_RL_PATH} of {PRIME_RL_REPO}@{PRIME_RL_COMMIT}")
    ap.add_argument("--only", help=f"comma-separated subset of {sorted(INDEPENDENT)} (files with their own seed)")
    args = ap.parse_args()
    if args.only:
        for name in args.only.split(","):
            if name not in INDEPENDENT:
                sys.exit(f"--only: {name!r} is not one of {sorted(INDEPENDENT)}")
            write(name, INDEPENDENT[name](), {"seed": INDEPENDENT_SEED[name], "no_upstream_counterpart": NO_COUNTERPART[name]})
        return
    if not args.prime_rl_loss:
        sys.exit("--prime-rl-loss PATH is required unless --only is given")
    g = Gen(SEED)
    write("trl_rlvr.json", trl_cases(g))
    write("trl_advantages.json", trl_adv_cases(g))
    write("verl_policy.json", verl_cases(g))
    write("verl_agg.json", verl_agg_cases(g))
    write("verl_advantages.json", verl_adv_cases(g))
    mod, dcfg = load_prime_rl(args.prime_rl_loss)
    prime = {"prime_rl": {"repo": PRIME_RL_REPO, "commit": PRIME_RL_COMMIT, "path": PRIME_RL_PATH, "sha256": PRIME_RL_SHA256}}
    write("prime_rl.json", prime_cases(g, mod, dcfg), prime)
    for name, fn in INDEPENDENT.items():
        write(name, fn(), {"seed": INDEPENDENT_SEED[name], "no_upstream_counterpart": NO_COUNTERPART[name]})


if __name__ == "__main__":
    main()
