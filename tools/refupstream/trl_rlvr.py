"""TRL 1.16.0's GRPO loss, importance-sampling correction and advantages, run on random batches
(tools/ref_upstream.py's trl_rlvr.json and trl_advantages.json)."""
import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from refupstream.batches import SingleProcess, batch, jsonable_inputs, r6, scale_of


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
        accelerator=SingleProcess(),
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
