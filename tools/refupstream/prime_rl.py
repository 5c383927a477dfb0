"""PRIME-RL's loss.py at a pinned commit, loaded from a fetched file whose sha256 is checked,
with stand-ins for its two prime_rl imports (tools/ref_upstream.py's prime_rl.json)."""
import hashlib
import sys
import types
from pathlib import Path

import torch

from refupstream.batches import batch, jsonable_inputs, r6, scale_of

PRIME_RL_REPO = "PrimeIntellect-ai/prime-rl"
PRIME_RL_COMMIT = "e48a53853ef82dc4549645685cd0065b875f05fa"
PRIME_RL_PATH = "src/prime_rl/trainer/rl/loss.py"
PRIME_RL_SHA256 = "102b14539a2aa7e4b807967f9c9caeaaa974373391a21602ce45b24414fb7863"


def load_prime_rl(path):
    data = Path(path).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    if sha != PRIME_RL_SHA256:
        sys.exit(f"{path}: sha256 {sha} != pinned {PRIME_RL_SHA256} ({PRIME_RL_REPO}@{PRIME_RL_COMMIT}:{PRIME_RL_PATH})")

    class _Base:
        def __init__(self, **kw):
            for k, v in type(self).__dict__.items():
                if not k.startswith("_"):
                    setattr(self, k, v)
            for k, v in kw.items():
                setattr(self, k, v)

    class DefaultLossConfig(_Base):  # prime_rl.configs.trainer.DefaultLossConfig field defaults
        type = "default"
        dppo_mask_low = 0.2
        dppo_mask_high = 0.2
        adv_tau = 1.0
        kl_tau = 1e-3

    class IPOLossConfig(_Base):
        type = "ipo"
        ipo_threshold = 0.1
        adv_tau = 1.0
        kl_tau = 1e-3

    class CustomLossConfig(_Base):
        type = "custom"

    stubs = {
        "prime_rl": types.ModuleType("prime_rl"),
        "prime_rl.configs": types.ModuleType("prime_rl.configs"),
        "prime_rl.configs.trainer": types.ModuleType("prime_rl.configs.trainer"),
        "prime_rl.utils": types.ModuleType("prime_rl.utils"),
        "prime_rl.utils.utils": types.ModuleType("prime_rl.utils.utils"),
    }
    t = stubs["prime_rl.configs.trainer"]
    t.DefaultLossConfig, t.IPOLossConfig, t.CustomLossConfig = DefaultLossConfig, IPOLossConfig, CustomLossConfig
    t.LossConfig = DefaultLossConfig
    stubs["prime_rl.utils.utils"].import_object = lambda p: None
    sys.modules.update(stubs)
    mod = types.ModuleType("prime_rl_loss")
    exec(compile(data, str(path), "exec"), mod.__dict__)
    return mod, DefaultLossConfig


def prime_cases(g, mod, DefaultLossConfig):
    cases = []
    for variant in ("plain", "extreme", "accum", "per_token_adv", "params", "no_sampler"):
        for _ in range(4):
            accum = 3 if variant == "accum" else 1
            b, t = int(g.rng.integers(2, 6)), int(g.rng.integers(3, 8))
            mbs = [batch(g, b, t, extreme=variant == "extreme", per_token_adv=variant == "per_token_adv", ent=False, ref=False, sampler=variant != "no_sampler") for _ in range(accum)]
            params = {"dppo_mask_low": 0.1, "dppo_mask_high": 0.3, "adv_tau": 0.7, "kl_tau": 0.01} if variant == "params" else {}
            lcfg = DefaultLossConfig(**params)
            sc = scale_of(mbs, False)
            for k, mb in enumerate(mbs):
                lp = torch.tensor(mb["trainer_logprobs"], requires_grad=True)
                inf = mb["sampler_logprobs"] if mb["sampler_logprobs"] is not None else mb["old_logprobs"]
                inf = torch.tensor(inf)
                mask = torch.tensor(mb["loss_mask"]) > 0
                adv = torch.tensor(mb["advantages"])
                adv2 = adv if adv.dim() == 2 else adv.unsqueeze(-1).expand_as(lp)
                # PRIME-RL packs sequences; each row's tokens (padding included, masked out) is one sequence.
                loss, _ = mod.compute_loss(
                    trainer_logprobs=list(lp.unbind(0)),
                    inference_logprobs=list(inf.unbind(0)),
                    ref_logprobs=None,
                    advantages=list(adv2.unbind(0)),
                    loss_mask=list(mask.unbind(0)),
                    rl_weights=None,
                    ce_weights=None,
                    ref_kl_weights=None,
                    rl_loss_fn=mod.setup_rl_loss_fn(lcfg),
                    rl_scale=max(int(sc["global_active_tokens"]), 1),
                    ce_scale=1,
                    ref_kl_scale=1,
                )
                loss.backward()
                cfg = {"loss_type": "dppo", "sampler_importance_sampling_correction": False, **params}
                cases.append({
                    "family": "prime_rl/dppo",
                    "name": f"prime_rl/dppo/{variant}/mb{k}",
                    "reference": f"{PRIME_RL_REPO}@{PRIME_RL_COMMIT} {PRIME_RL_PATH} compute_loss + default_loss_fn",
                    "kind": "rlvr",
                    "config": cfg,
                    "scale": sc,
                    "inputs": jsonable_inputs(mb),
                    "expected": {"loss": loss.item(), "grad_trainer_logprobs": r6(lp.grad)},
                })
    return cases
