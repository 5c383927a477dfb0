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
"""

import argparse
import hashlib
import importlib.metadata as md
import inspect
import json
import math
import platform
import sys
import textwrap
import types
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

torch.set_default_dtype(torch.float64)

PRIME_RL_REPO = "PrimeIntellect-ai/prime-rl"
PRIME_RL_COMMIT = "e48a53853ef82dc4549645685cd0065b875f05fa"
PRIME_RL_PATH = "src/prime_rl/trainer/rl/loss.py"
PRIME_RL_SHA256 = "102b14539a2aa7e4b807967f9c9caeaaa974373391a21602ce45b24414fb7863"

OUT = Path(__file__).resolve().parent.parent / "crates/loss/tests/fixtures/upstream"
SEED = 20260601


def r6(x):
    """Round-trip floats exactly (json keeps 17 significant digits)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().tolist()
    if isinstance(x, np.ndarray):
        x = x.tolist()
    return x


# --------------------------------------------------------------------------------------------
# Random batches
# --------------------------------------------------------------------------------------------


class Gen:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def mask(self, b, t, holes=True, empty_rows=True, truncate=True):
        m = np.zeros((b, t))
        for i in range(b):
            r = self.rng.random()
            if empty_rows and r < 0.12:
                continue  # empty row
            n = t if (truncate and r > 0.8) else int(self.rng.integers(1, t + 1))
            m[i, :n] = 1.0
            if holes and self.rng.random() < 0.4 and n > 2:
                k = int(self.rng.integers(1, n))
                m[i, k] = 0.0  # a hole (tool output)
        return m

    def logprobs(self, b, t, scale=1.0):
        return -np.abs(self.rng.normal(0.0, scale, (b, t))) - 0.01

    def near(self, base, spread, extreme=False):
        d = self.rng.normal(0.0, spread, base.shape)
        if extreme:
            sel = self.rng.random(base.shape) < 0.15
            d = np.where(sel, self.rng.choice([-1.0, 1.0], base.shape) * self.rng.uniform(1.5, 4.0, base.shape), d)
        return np.minimum(base + d, -1e-3)

    def advantages(self, b, t=None, per_token=False):
        a = self.rng.normal(0.0, 1.0, b)
        a[self.rng.random(b) < 0.15] = 0.0
        if per_token:
            return a[:, None] + self.rng.normal(0.0, 0.5, (b, t))
        return a

    def entropies(self, b, t):
        # f32-representable: TRL takes the entropy quantile in float32.
        return np.abs(self.rng.normal(1.0, 0.6, (b, t))).astype(np.float32).astype(np.float64)


def batch(g, b, t, *, extreme=False, per_token_adv=False, sampler=True, ref=True, ent=True, old=True):
    lp = g.logprobs(b, t)
    x = {
        "trainer_logprobs": lp,
        "old_logprobs": g.near(lp, 0.15, extreme) if old else None,
        "advantages": g.advantages(b, t, per_token_adv),
        "loss_mask": g.mask(b, t),
    }
    base = x["old_logprobs"] if old else lp
    x["sampler_logprobs"] = g.near(base, 0.1, extreme) if sampler else None
    x["ref_logprobs"] = g.near(lp, 0.3, extreme) if ref else None
    x["entropies"] = g.entropies(b, t) if ent else None
    x["truncated"] = [bool(v) for v in (x["loss_mask"][:, -1] > 0)]
    return x


def jsonable_inputs(x):
    return {k: (r6(v) if v is not None else None) for k, v in x.items()}


# --------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------

from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402


class _Acc:
    num_processes = 1
    process_index = 0
    sync_gradients = True
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _trl_block(method, start, end):
    """The exact source lines of `method` from the line containing `start` up to (excluding)
    the line containing `end`, dedented: released TRL code run with `exec`."""
    src = inspect.getsource(method).splitlines()
    i = next(k for k, l in enumerate(src) if l.strip().startswith(start))
    j = next(k for k in range(i + 1, len(src)) if end in src[k])
    return textwrap.dedent("\n".join(src[i:j]))


TRL_IS_BLOCK = _trl_block(
    GRPOTrainer._generate_and_score_completions,
    "mask = completion_mask if tool_mask is None else completion_mask * tool_mask",
    "# Compute the per-token log probabilities for the reference model",
)
TRL_ADV_BLOCK = _trl_block(
    GRPOTrainer._generate_and_score_completions,
    'if self.multi_objective_aggregation == "sum_then_normalize":',
    "# Slice to keep only the local part of the data",
)
TRL_TRUNC_LINE = "completion_mask = completion_mask * (~is_truncated).unsqueeze(1).int()"
assert TRL_TRUNC_LINE in inspect.getsource(GRPOTrainer._generate_and_score_completions)


def trl_is_ratio(old, sampler, mask, mode, cmin, cmax):
    self = SimpleNamespace(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=cmin,
        vllm_importance_sampling_clip_max=cmax,
    )
    env = {
        "self": self,
        "completion_mask": mask,
        "tool_mask": None,
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampler,
        "torch": torch,
        "math": math,
    }
    exec(TRL_IS_BLOCK, env)
    return env["vllm_importance_sampling_ratio"]


def trl_advantages(rewards_per_func, weights, num_generations, scale_rewards, agg):
    rpf = torch.tensor(rewards_per_func)
    self = SimpleNamespace(
        multi_objective_aggregation=agg,
        reward_weights=torch.tensor(weights),
        scale_rewards=scale_rewards,
        reward_funcs=[None] * rpf.shape[1],
    )
    env = {
        "self": self,
        "rewards_per_func": rpf,
        "num_generations": num_generations,
        "unscorable_mask": torch.isnan(rpf).all(dim=1),
        "device": torch.device("cpu"),
        "torch": torch,
        "nanstd": nanstd,
    }
    exec(TRL_ADV_BLOCK, env)
    return env["advantages"]


TRL_DEFAULTS = dict(
    loss_type="dapo",
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    importance_sampling_level="token",
    beta=0.0,
    use_bias_correction_kl=False,
    entropy_coef=0.0,
    top_entropy_quantile=1.0,
    mask_truncated_completions=False,
    max_completion_length=512,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    vllm_importance_sampling_correction=False,
    vllm_importance_sampling_mode="sequence_mask",
    vllm_importance_sampling_clip_min=None,
    vllm_importance_sampling_clip_max=3.0,
    off_policy_mask_threshold=None,
)


def trl_loss(mb, cfg, g_steps, num_items):
    """Run TRL's GRPOTrainer._compute_loss on one micro-batch; returns (loss, grad)."""
    c = dict(TRL_DEFAULTS, **cfg)
    t = GRPOTrainer.__new__(GRPOTrainer)
    eps_high = c["epsilon_high"] if c["epsilon_high"] is not None else c["epsilon"]
    t.args = SimpleNamespace(
        use_bias_correction_kl=c["use_bias_correction_kl"],
        delta=c["delta"],
        sapo_temperature_pos=c["sapo_temperature_pos"],
        sapo_temperature_neg=c["sapo_temperature_neg"],
        vespo_k_pos=c["vespo_k_pos"],
        vespo_lambda_pos=c["vespo_lambda_pos"],
        vespo_k_neg=c["vespo_k_neg"],
        vespo_lambda_neg=c["vespo_lambda_neg"],
        steps_per_generation=g_steps,
    )
    for k, v in dict(
        loss_type=c["loss_type"],
        epsilon_low=c["epsilon"],
        epsilon_high=eps_high,
        importance_sampling_level=c["importance_sampling_level"],
        beta=c["beta"],
        top_entropy_quantile=c["top_entropy_quantile"],
        off_policy_mask_threshold=c["off_policy_mask_threshold"],
        max_completion_length=c["max_completion_length"],
        use_vllm=c["vllm_importance_sampling_correction"],
        vllm_importance_sampling_correction=c["vllm_importance_sampling_correction"],
        model=SimpleNamespace(training=True),
        accelerator=_Acc(),
        current_gradient_accumulation_steps=g_steps,
        _entropy_bonus_enabled=c["entropy_coef"] != 0.0,
        use_adaptive_entropy=False,
        entropy_coef=c["entropy_coef"],
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    ).items():
        setattr(t, k, v)

    lp = torch.tensor(mb["trainer_logprobs"], requires_grad=True)
    ent = torch.tensor(mb["entropies"]) if mb["entropies"] is not None else torch.zeros_like(lp)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (lp, ent, None)
    mask = torch.tensor(mb["loss_mask"])
    if c["mask_truncated_completions"]:
        is_truncated = torch.tensor(mb["truncated"])
        completion_mask = mask
        env = {"completion_mask": completion_mask, "is_truncated": is_truncated}
        exec(TRL_TRUNC_LINE, env)
        mask = env["completion_mask"].to(torch.float64)
    b, tt = lp.shape
    inputs = {
        "prompt_ids": torch.zeros((b, 1), dtype=torch.long),
        "prompt_mask": torch.ones((b, 1), dtype=torch.long),
        "completion_ids": torch.zeros((b, tt), dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.tensor(mb["advantages"]),
        "num_items_in_batch": torch.tensor(float(num_items)),
    }
    if mb.get("old_logprobs") is not None:
        inputs["old_per_token_logps"] = torch.tensor(mb["old_logprobs"])
    if c["beta"] != 0.0:
        inputs["ref_per_token_logps"] = torch.tensor(mb["ref_logprobs"])
    if mb.get("sampler_logprobs") is not None:
        inputs["sampling_per_token_logps"] = torch.tensor(mb["sampler_logprobs"])
    if c["vllm_importance_sampling_correction"]:
        inputs["importance_sampling_ratio"] = trl_is_ratio(
            inputs["old_per_token_logps"],
            inputs["sampling_per_token_logps"],
            mask,
            c["vllm_importance_sampling_mode"],
            c["vllm_importance_sampling_clip_min"],
            c["vllm_importance_sampling_clip_max"],
        )
    loss = t._compute_loss(None, inputs)
    loss.backward()
    return loss.item(), lp.grad


def trl_to_composer(cfg):
    """TRL GRPOConfig keys -> composer RlvrConfig JSON (TRL's own names where composer has them)."""
    out = {}
    for k, v in cfg.items():
        out[k] = v
    out.setdefault("sampler_importance_sampling_correction", cfg.get("vllm_importance_sampling_correction", False))
    out.pop("vllm_importance_sampling_correction", None)
    return out


def eff_mask(mb, mask_trunc):
    m = np.array(mb["loss_mask"])
    if mask_trunc:
        m = m * (~np.array(mb["truncated"]))[:, None]
    return m


def scale_of(mbs, mask_trunc):
    toks, seqs = 0.0, 0.0
    for mb in mbs:
        m = eff_mask(mb, mask_trunc)
        toks += m.sum()
        seqs += float((m.sum(1) > 0).sum())
    return {"global_active_tokens": toks, "global_sequences": seqs, "num_micro_batches": float(len(mbs))}


def trl_cases(g):
    cases = []
    types_ = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
    variants = [
        ("plain", {}),
        ("clip_higher", {"epsilon_high": 0.28}),
        ("delta", {"delta": 1.5}),
        ("seq_level", {"importance_sampling_level": "sequence"}),
        ("kl", {"beta": 0.04}),
        ("kl_bias_corr", {"beta": 0.1, "use_bias_correction_kl": True}),
        ("entropy", {"entropy_coef": 0.01}),
        ("entropy_topq", {"entropy_coef": 0.02, "top_entropy_quantile": 0.5}),
        ("top_quantile", {"top_entropy_quantile": 0.3}),
        ("mask_trunc", {"mask_truncated_completions": True}),
        ("is_seq_mask", {"vllm_importance_sampling_correction": True}),
        ("is_seq_trunc", {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_clip_min": 0.5}),
        ("is_tok_mask", {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 2.0}),
        ("is_tok_trunc", {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate"}),
        ("off_policy_mask", {"off_policy_mask_threshold": 0.05}),
        ("per_token_adv", {}),
        ("extreme", {}),
    ]
    for lt in types_:
        for vname, v in variants:
            cfg = {"loss_type": lt, **v}
            if lt == "cispo":
                cfg.setdefault("epsilon_high", 5.0)
            if lt == "vespo" and cfg.get("vllm_importance_sampling_mode", "sequence_mask").startswith("sequence") and cfg.get("vllm_importance_sampling_correction"):
                continue  # TRL's VESPO needs token-level IS ratios
            for accum in (1, 3) if vname in ("plain", "entropy", "kl", "per_token_adv") else (1,):
                b, t = int(g.rng.integers(3, 6)), int(g.rng.integers(4, 8))
                mbs = [
                    batch(g, b, t, extreme=(vname == "extreme") or g.rng.random() < 0.2, per_token_adv=(vname == "per_token_adv"))
                    for _ in range(accum)
                ]
                sc = scale_of(mbs, cfg.get("mask_truncated_completions", False))
                fam = family_of_trl(lt, vname)
                for k, mb in enumerate(mbs):
                    loss, grad = trl_loss(mb, cfg, accum, sc["global_active_tokens"])
                    cases.append({
                        "family": fam,
                        "name": f"trl/{lt}/{vname}/accum{accum}/mb{k}",
                        "reference": "trl==1.16.0 GRPOTrainer._compute_loss",
                        "kind": "rlvr",
                        "config": trl_to_composer(cfg),
                        "scale": sc,
                        "inputs": jsonable_inputs(mb),
                        "expected": {"loss": loss, "grad_trainer_logprobs": r6(grad)},
                    })
    return cases


def family_of_trl(lt, vname):
    if vname.startswith("entropy"):
        return f"trl/entropy/{lt}"
    if vname == "off_policy_mask":
        return "trl/off_policy_mask"
    if vname == "per_token_adv":
        return "trl/per_token_advantages"
    if vname.startswith("is_"):
        return "trl/sampler_is"
    return f"trl/{lt}"


def trl_adv_cases(g):
    cases = []
    for scale in ("group", "batch", "none"):
        for agg in ("sum_then_normalize", "normalize_then_sum"):
            for n in (1, 2, 4):
                for _ in range(3):
                    groups = int(g.rng.integers(1, 4))
                    k = 1 if agg == "sum_then_normalize" and g.rng.random() < 0.5 else 2
                    rpf = g.rng.choice([0.0, 0.5, 1.0], (groups * n, k)) + g.rng.normal(0, 0.3, (groups * n, k)) * (g.rng.random() < 0.5)
                    w = list(g.rng.uniform(0.5, 1.5, k))
                    if agg == "normalize_then_sum" and groups * n < 2:
                        continue
                    adv = trl_advantages(rpf, w, n, scale, agg)
                    cases.append({
                        "family": "trl/advantages",
                        "name": f"trl/adv/{scale}/{agg}/n{n}",
                        "reference": "trl==1.16.0 GRPOTrainer._generate_and_score_completions (advantage block)",
                        "kind": "advantages",
                        "config": {"estimator": "grpo", "scale_rewards": scale, "reward_weights": w, "multi_objective_aggregation": agg},
                        "inputs": {"rewards_per_func": r6(rpf), "lengths": [1] * (groups * n), "group_size": n},
                        "expected": {"advantages": r6(adv)},
                    })
    return cases


# --------------------------------------------------------------------------------------------
# verl
# --------------------------------------------------------------------------------------------

import verl.trainer.ppo.core_algos as ca  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402


def verl_actor_config(mode, batch_info, **kw):
    pl = PolicyLossConfig(**{k: v for k, v in kw.items() if k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "loss_mode")})
    a = {k: v for k, v in kw.items() if k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")}
    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, loss_agg_mode=mode, policy_loss=pl, **a)
    object.__setattr__(cfg, "global_batch_info", batch_info)
    return cfg


def verl_cases(g):
    cases = []
    modes = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    losses = ["vanilla", "gspo", "sapo", "cispo", "gpg", "clip_cov", "kl_cov", "geo_mean"]
    for name in losses:
        for mode in modes:
            for variant in ("plain", "extreme", "accum", "per_token_adv", "kl"):
                if variant == "per_token_adv" and name == "geo_mean":
                    pass
                accum = 3 if variant == "accum" else 1
                b, t = int(g.rng.integers(3, 6)), int(g.rng.integers(4, 8))
                mbs = [batch(g, b, t, extreme=variant == "extreme", per_token_adv=variant == "per_token_adv", sampler=False, ent=False) for _ in range(accum)]
                sc = scale_of(mbs, False)
                info = {"dp_size": 1, "batch_num_tokens": sc["global_active_tokens"], "global_batch_size": sc["global_sequences"]}
                kw = {"clip_ratio": 0.2, "clip_ratio_high": 0.28 if g.rng.random() < 0.5 else None, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05}
                if name == "clip_cov":
                    kw.update(clip_cov_ratio=1.0, clip_cov_lb=-0.5 if g.rng.random() < 0.5 else 1.0, clip_cov_ub=5.0)
                if name == "kl_cov":
                    kw.update(kl_cov_ratio=float(g.rng.choice([0.0002, 0.2, 0.5])), ppo_kl_coef=1.0)
                kl_type = str(g.rng.choice(["kl", "k1", "mse", "k2", "low_var_kl", "k3", "abs", "k3+"])) if variant == "kl" else None
                kl_coef = 0.05
                acfg = verl_actor_config(mode, info, **kw)
                fn = ca.get_policy_loss_fn(name)
                for k, mb in enumerate(mbs):
                    lp = torch.tensor(mb["trainer_logprobs"], requires_grad=True)
                    mask = torch.tensor(mb["loss_mask"])
                    adv = torch.tensor(mb["advantages"])
                    adv2 = adv if adv.dim() == 2 else adv.unsqueeze(-1).expand_as(lp)
                    pg_loss, _ = fn(old_log_prob=torch.tensor(mb["old_logprobs"]), log_prob=lp, advantages=adv2, response_mask=mask, loss_agg_mode=mode, config=acfg)
                    loss = pg_loss
                    if kl_type is not None:
                        kld = ca.kl_penalty(lp, torch.tensor(mb["ref_logprobs"]), kl_type)
                        loss = loss + kl_coef * ca.agg_loss(kld, mask, mode, **info)
                    loss.backward()
                    cfg = verl_to_composer(name, mode, kw, kl_type, kl_coef)
                    fam = f"verl/kl_penalty" if kl_type is not None else f"verl/{name}"
                    cases.append({
                        "family": fam,
                        "name": f"verl/{name}/{mode}/{variant}{'/' + kl_type if kl_type else ''}/mb{k}",
                        "reference": f"verl==0.9.1 core_algos.get_policy_loss_fn('{name}')" + (f" + kl_penalty('{kl_type}') + agg_loss" if kl_type else ""),
                        "kind": "rlvr",
                        "config": cfg,
                        "scale": sc,
                        "inputs": jsonable_inputs(mb),
                        "expected": {"loss": loss.item(), "grad_trainer_logprobs": r6(lp.grad)},
                    })
    return cases


def verl_to_composer(name, mode, kw, kl_type, kl_coef):
    """verl ActorConfig -> composer RlvrConfig JSON with verl's values for every option."""
    c = {
        "loss_agg_mode": mode,
        "epsilon": kw["clip_ratio"],
        "epsilon_high": kw["clip_ratio_high"],
        "sampler_importance_sampling_correction": False,
    }
    c["loss_type"] = {"vanilla": "grpo", "gspo": "grpo"}.get(name, name)
    if name in ("vanilla", "sapo", "cispo"):
        c["log_ratio_clamp"] = 20.0
    if name == "vanilla":
        c.update(dual_clip=True, clip_ratio_c=kw["clip_ratio_c"])
    if name == "cispo":
        c["cispo_clip_mode"] = "two_sided"
    if name == "gspo":
        c.update(importance_sampling_level="sequence", sequence_log_ratio_max=10.0, sequence_ratio_gradient="token")
    if name == "sapo":
        c.update(sapo_temperature_pos=kw["tau_pos"], sapo_temperature_neg=kw["tau_neg"], policy_loss_agg_mode="seq-mean-token-mean")
    if name == "clip_cov":
        c.update(clip_cov_ratio=kw["clip_cov_ratio"], clip_cov_lb=kw["clip_cov_lb"], clip_cov_ub=kw["clip_cov_ub"])
    if name == "kl_cov":
        c.update(kl_cov_ratio=kw["kl_cov_ratio"], ppo_kl_coef=kw["ppo_kl_coef"])
    if kl_type is not None:
        c["beta"] = kl_coef
        c["kl_estimator"] = kl_type
        if kl_type in ("low_var_kl", "k3", "k3+"):
            c["kl_clamp"] = 10.0
    return c


def verl_agg_cases(g):
    cases = []
    for mode in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        for _ in range(4):
            b, t = int(g.rng.integers(2, 6)), int(g.rng.integers(3, 8))
            x = torch.tensor(g.rng.normal(0, 1, (b, t)), requires_grad=True)
            m = torch.tensor(g.mask(b, t))
            toks = float(m.sum()) + float(g.integers(0, 10)) if False else float(m.sum()) + float(g.rng.integers(0, 10))
            seqs = float((m.sum(1) > 0).sum()) + float(g.rng.integers(0, 3))
            lsf = float(g.rng.choice([0, 16])) or None
            loss = ca.agg_loss(x, m, mode, dp_size=1, batch_num_tokens=toks, global_batch_size=seqs, loss_scale_factor=lsf)
            loss.backward()
            cases.append({
                "family": "verl/agg_loss",
                "name": f"verl/agg_loss/{mode}",
                "reference": "verl==0.9.1 core_algos.agg_loss",
                "kind": "agg",
                "config": {"loss_agg_mode": mode, "loss_scale_factor": lsf},
                "scale": {"global_active_tokens": toks, "global_sequences": seqs, "num_micro_batches": 1.0},
                "inputs": {"per_token": r6(x), "loss_mask": r6(m)},
                "expected": {"loss": loss.item(), "grad_per_token": r6(x.grad)},
            })
    return cases


def verl_adv_cases(g):
    cases = []
    for est in ["grpo", "grpo_nostd", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk", "grpo_passk_nostd", "remax"]:
        for n in (1, 2, 4):
            if est.startswith("grpo_passk") and n < 2:
                continue
            for _ in range(4):
                groups = int(g.rng.integers(1, 4))
                bsz, t = groups * n, 6
                lengths = [int(v) for v in g.rng.integers(1, t + 1, bsz)]
                mask = torch.zeros((bsz, t))
                for i, l in enumerate(lengths):
                    mask[i, :l] = 1.0
                rewards = torch.tensor(g.rng.choice([0.0, 0.5, 1.0], bsz) + g.rng.normal(0, 0.2, bsz) * (g.rng.random() < 0.5))
                tlr = torch.zeros((bsz, t))
                tlr[torch.arange(bsz), torch.tensor(lengths) - 1] = rewards
                index = np.array([i // n for i in range(bsz)])
                norm = not est.endswith("_nostd")
                base = est.replace("_nostd", "")
                algo = SimpleNamespace(get=lambda k, d=None, _n=norm: {"norm_adv_by_std_in_grpo": _n}.get(k, d), gamma=1.0)
                inputs = {"rewards": r6(rewards), "lengths": lengths, "group_size": n}
                if base == "remax":
                    baselines = torch.tensor(g.rng.choice([0.0, 1.0], bsz))
                    adv, _ = ca.compute_remax_outcome_advantage(tlr, baselines, mask)
                    inputs["reward_baselines"] = r6(baselines)
                elif base == "grpo":
                    adv, _ = ca.compute_grpo_outcome_advantage(tlr, mask, index, norm_adv_by_std_in_grpo=norm)
                elif base == "grpo_passk":
                    adv, _ = ca.compute_grpo_passk_outcome_advantage(tlr, mask, index, config=algo)
                elif base == "reinforce_plus_plus":
                    adv, _ = ca.compute_reinforce_plus_plus_outcome_advantage(tlr, mask, config=algo)
                else:
                    fn = ca.get_adv_estimator_fn(base)
                    adv, _ = fn(token_level_rewards=tlr, response_mask=mask, index=index, config=algo)
                cases.append({
                    "family": f"verl/adv/{base}",
                    "name": f"verl/adv/{est}/n{n}",
                    "reference": f"verl==0.9.1 core_algos advantage estimator '{base}'",
                    "kind": "verl_advantages",
                    "config": {"estimator": base, "norm_adv_by_std_in_grpo": norm},
                    "inputs": inputs,
                    "expected": {"token_advantages": r6(adv)},
                })
    return cases


# --------------------------------------------------------------------------------------------
# PRIME-RL
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# TRL DPO (replay channel's DPO term) and TRL SDPO (hint channel; replay channel's teacher KL)
# --------------------------------------------------------------------------------------------
# Each file below has its own seed, so it can be regenerated alone (--only) without changing the
# files above (which share one generator stream).

SEED_DPO = SEED + 1
SEED_SDPO = SEED + 2

from trl import DPOTrainer  # noqa: E402


def _fake_trainer_metrics():
    return {"train": defaultdict(list), "eval": defaultdict(list)}


def trl_dpo_loss(lp, mask, ref_c, ref_r, loss_type, beta):
    """Run TRL 1.16.0 `DPOTrainer._compute_loss` on a [chosen; rejected] batch of per-token
    log-probs `lp` [2P, T] (completion tokens where `mask` is 1). The model forward is replaced by
    one that returns `lp` as the fused head's per-token log-probs (0 where the label is -100, as
    the head does); the reference sums come precomputed (`precompute_ref_logps`)."""
    two_p, t = lp.shape
    self = DPOTrainer.__new__(DPOTrainer)
    for k, v in dict(
        model=SimpleNamespace(training=True),
        accelerator=_Acc(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics=_fake_trainer_metrics(),
        _total_train_tokens=0,
        _tp_size=1,
    ).items():
        setattr(self, k, v)
    # The collator's layout: one prompt token, then the completion; completion_mask marks the
    # completion, and the model's outputs are aligned to input_ids[:, 1:].
    completion_mask = torch.cat([torch.zeros((two_p, 1)), mask], dim=1).long()

    def model(**kw):
        z = torch.zeros((two_p, t))
        return SimpleNamespace(log_probs=lp * mask, entropy=z, mean_logits=z, is_top1=z.bool())

    inputs = {
        "input_ids": torch.zeros((two_p, t + 1), dtype=torch.long),
        "attention_mask": torch.ones((two_p, t + 1), dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_c,
        "ref_rejected_logps": ref_r,
    }
    loss = DPOTrainer._compute_loss(self, model, inputs, False)
    m = {k: v[-1] for k, v in self._metrics["train"].items() if k.startswith("rewards/")}
    return loss, m


def trl_dpo_cases():
    g = Gen(SEED_DPO)
    cases = []
    for loss_type in ("sigmoid", "hinge", "ipo"):
        for variant in ("plain", "extreme", "beta", "empty_rows"):
            for _ in range(4):
                p, t = int(g.rng.integers(1, 5)), int(g.rng.integers(2, 8))
                beta = float(g.rng.choice([0.05, 0.5, 2.0])) if variant == "beta" else 0.1
                scale = 6.0 if variant == "extreme" else 1.0
                lp_np = g.logprobs(2 * p, t, scale)
                mask_np = g.mask(2 * p, t, holes=True, empty_rows=variant == "empty_rows")
                ref_np = (lp_np * mask_np).sum(1) + g.rng.normal(0.0, 2.0 * scale, 2 * p)
                lp = torch.tensor(lp_np, requires_grad=True)
                mask = torch.tensor(mask_np)
                ref = torch.tensor(ref_np)
                loss, metrics = trl_dpo_loss(lp, mask, ref[:p], ref[p:], loss_type, beta)
                loss.backward()
                cases.append({
                    "family": f"trl/dpo/{loss_type}",
                    "name": f"trl/dpo/{loss_type}/{variant}",
                    "reference": "trl==1.16.0 DPOTrainer._compute_loss",
                    "kind": "dpo",
                    "config": {"loss_type": loss_type, "beta": beta},
                    "inputs": {
                        "per_token_logprobs": r6(lp),
                        "loss_mask": r6(mask),
                        "ref_chosen_logps": r6(ref[:p]),
                        "ref_rejected_logps": r6(ref[p:]),
                    },
                    "expected": {
                        "loss": loss.item(),
                        "grad_per_token_logprobs": r6(lp.grad),
                        "metrics": metrics,
                    },
                })
    return cases


from trl.experimental.sdpo.sdpo_trainer import DistillationLogits, SDPOTrainer  # noqa: E402


def _fake_sdpo(args, accum):
    self = SDPOTrainer.__new__(SDPOTrainer)
    for k, v in dict(
        args=SimpleNamespace(distillation_weight=1.0, **args),
        model=SimpleNamespace(training=True),
        accelerator=_Acc(),
        use_teacher_server=False,
        current_gradient_accumulation_steps=accum,
        teacher_model=None,
        _metrics=_fake_trainer_metrics(),
        state=SimpleNamespace(global_step=0),
        _last_loaded_step=0,
    ).items():
        setattr(self, k, v)
    self._log_self_distillation_metric = lambda mode, value: None
    return self


# Composer's hint divergence for TRL's `distillation_alpha` (0 forward KL, 1 reverse KL, else JSD).
def _divergence_of(alpha):
    return "forward_kl" if alpha == 0.0 else "reverse_kl" if alpha == 1.0 else "jsd"


def trl_sdpo_cases():
    """The hint channel against TRL 1.16.0 `SDPOTrainer.compute_loss` (local teacher: the hinted
    forward of the same model; `_compute_teacher_student_logits` replaced by one returning the
    fixture's logits) and the replay channel's teacher KL against `compute_loss` with
    `use_teacher_server=True` (`_compute_server_distillation_loss`: the teacher's recorded top-K
    ids and log-probs; the server call replaced by one returning the fixture's), alpha = 0."""
    g = Gen(SEED_SDPO)
    cases = []
    V = 9
    modes = [
        ("topk_tail", {"distillation_mode": "topk_logits", "distillation_topk": 4, "distillation_add_tail": True}),
        ("topk_renorm", {"distillation_mode": "topk_logits", "distillation_topk": 4, "distillation_add_tail": False}),
        ("full", {"distillation_mode": "full_logits", "distillation_topk": None, "distillation_add_tail": False}),
        ("sampled_token", {"distillation_mode": "sampled_token", "distillation_topk": None, "distillation_add_tail": False}),
    ]
    for mname, margs in modes:
        alphas = (1.0,) if mname == "sampled_token" else (0.0, 0.5, 0.3, 1.0)
        for alpha in alphas:
            for variant in ("plain", "is_clip_1_2", "no_is", "no_old", "accum", "no_hint"):
                is_clip = {"is_clip_1_2": 1.2, "no_is": None}.get(variant, 2.0)
                accum = 2 if variant == "accum" else 1
                b, t = int(g.rng.integers(2, 5)), int(g.rng.integers(2, 6))
                s_logits = torch.tensor(g.rng.normal(0.0, 2.0, (b, t, V)), requires_grad=True)
                t_logits = torch.tensor(g.rng.normal(0.0, 2.0, (b, t, V)))
                ids = torch.tensor(g.rng.integers(0, V, (b, t)))
                cmask = torch.tensor(g.mask(b, t))
                sd_mask = torch.tensor((g.rng.random(b) < 0.7).astype(float))
                if variant == "no_hint":
                    sd_mask = torch.zeros(b)
                s_tok = torch.log_softmax(s_logits.detach(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
                old = None if variant == "no_old" else s_tok + torch.tensor(g.rng.normal(0.0, 0.6, (b, t)))
                args = dict(margs, distillation_alpha=alpha, distillation_is_clip=is_clip)
                self = _fake_sdpo(args, accum)
                dl = DistillationLogits(
                    completion_ids=ids,
                    completion_mask=cmask,
                    loss_mask=cmask * sd_mask.unsqueeze(1),
                    student_logits=s_logits,
                    teacher_logits=t_logits,
                )
                self._compute_teacher_student_logits = lambda model, teacher, inputs, _dl=dl: _dl
                self._compute_self_distillation_loss = types.MethodType(SDPOTrainer._compute_self_distillation_loss, self)
                inputs = {"self_distillation_mask": sd_mask}
                if old is not None:
                    inputs["old_per_token_logps"] = old
                loss = SDPOTrainer.compute_loss(self, self.model, inputs)
                loss.backward()
                k = margs["distillation_topk"]
                topk_ids = torch.topk(s_logits.detach(), k, dim=-1).indices if k else None
                cfg = {
                    "divergence": "sampled_token" if mname == "sampled_token" else _divergence_of(alpha),
                    "alpha": alpha if 0.0 < alpha < 1.0 else 0.5,
                    "support": {"topk_tail": "topk_tail", "topk_renorm": "topk_renormalized"}.get(mname, "full"),
                    "is_clip": is_clip,
                    "loss_agg_mode": "seq-mean-token-mean",
                }
                cases.append({
                    "family": f"trl/sdpo/{mname}",
                    "name": f"trl/sdpo/{mname}/alpha{alpha}/{variant}",
                    "reference": "trl==1.16.0 trl.experimental.sdpo SDPOTrainer.compute_loss (_compute_self_distillation_loss)",
                    "kind": "hint",
                    "trl_args": args,
                    "config": cfg,
                    "accumulation_steps": accum,
                    "inputs": {
                        "student_logits": r6(s_logits),
                        "teacher_logits": r6(t_logits),
                        "completion_ids": r6(ids),
                        "student_topk_ids": r6(topk_ids) if topk_ids is not None else None,
                        "loss_mask": r6(cmask),
                        "has_hint": [bool(v) for v in sd_mask.tolist()],
                        "old_logprobs": r6(old) if old is not None else None,
                    },
                    "expected": {"loss": loss.item(), "grad_student_logits": r6(s_logits.grad)},
                })
    # Teacher KL of the replay channel: forward KL (alpha = 0) on the teacher's recorded top-K.
    for support, add_tail in (("topk_tail", True), ("topk_renormalized", False)):
        for variant in ("plain", "accum", "empty_rows"):
            for _ in range(3):
                accum = 2 if variant == "accum" else 1
                b, t, kk = int(g.rng.integers(2, 5)), int(g.rng.integers(2, 6)), 3
                s_logits = torch.tensor(g.rng.normal(0.0, 2.0, (b, t, V)), requires_grad=True)
                t_lp_full = torch.log_softmax(torch.tensor(g.rng.normal(0.0, 2.0, (b, t, V))), -1)
                t_topk = torch.topk(t_lp_full, kk, dim=-1)
                ids = torch.tensor(g.rng.integers(0, V, (b, t)))
                cmask = torch.tensor(g.mask(b, t, empty_rows=variant == "empty_rows"))
                args = dict(
                    distillation_mode="topk_logits",
                    distillation_topk=kk,
                    distillation_add_tail=add_tail,
                    distillation_alpha=0.0,
                    distillation_is_clip=2.0,
                )
                self = _fake_sdpo(args, accum)
                self.use_teacher_server = True
                self._forward_logits = lambda model, input_ids, attention_mask, logits_to_keep, _s=s_logits: _s
                teacher = {
                    "actual_logprobs": t_lp_full.gather(-1, ids.unsqueeze(-1)).squeeze(-1),
                    "topk_logprobs": t_topk.values,
                    "topk_token_ids": t_topk.indices,
                }
                self._get_teacher_token_logprobs_from_server = lambda inputs, n, _t=teacher: _t
                inputs = {
                    "prompt_ids": torch.zeros((b, 1), dtype=torch.long),
                    "prompt_mask": torch.ones((b, 1), dtype=torch.long),
                    "completion_ids": ids,
                    "completion_mask": cmask,
                }
                loss = SDPOTrainer.compute_loss(self, self.model, inputs)
                loss.backward()
                cases.append({
                    "family": f"trl/sdpo_teacher_topk/{support}",
                    "name": f"trl/sdpo_teacher_topk/{support}/{variant}",
                    "reference": "trl==1.16.0 trl.experimental.sdpo SDPOTrainer.compute_loss (_compute_server_distillation_loss, topk_logits, alpha 0)",
                    "kind": "teacher_kl",
                    "trl_args": args,
                    "config": {"support": support, "kl_loss_agg_mode": "seq-mean-token-mean"},
                    "accumulation_steps": accum,
                    "inputs": {
                        "student_logits": r6(s_logits),
                        "teacher_topk_ids": r6(t_topk.indices),
                        "teacher_topk_logprobs": r6(t_topk.values),
                        "loss_mask": r6(cmask),
                    },
                    "expected": {"loss": loss.item(), "grad_student_logits": r6(s_logits.grad)},
                })
    return cases


NO_COUNTERPART = {
    "trl_dpo.json": "composer's DPO loss types sigmoid/hinge/ipo are TRL's; the other TRL loss types, "
    "f-divergences, ld_alpha and WPO weighting have no composer counterpart. Sequence log-probs are "
    "sums over the completion tokens (TRL's fused head gives 0 at label -100).",
    "trl_sdpo.json": "TRL SDPO has no per-teacher weights (composer's replay teacher_weights): the "
    "teacher-KL cases use weight 1; the weighted form keeps its numpy reference in "
    "tests/fixtures/hint.json (tools/ref_losses.py). TRL SDPO aggregates seq-mean-token-mean over "
    "the micro-batch (composer default); the verl-fork SDPO's token-mean stays a recipe option "
    "checked against tools/ref_losses.py.",
}

INDEPENDENT = {"trl_dpo.json": trl_dpo_cases, "trl_sdpo.json": trl_sdpo_cases}
INDEPENDENT_SEED = {"trl_dpo.json": SEED_DPO, "trl_sdpo.json": SEED_SDPO}


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
