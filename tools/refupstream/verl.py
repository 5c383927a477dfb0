"""verl 0.9.1's policy losses, KL penalties, aggregation and advantage estimators from
`verl.trainer.ppo.core_algos` (tools/ref_upstream.py's verl_*.json)."""
from types import SimpleNamespace

import numpy as np
import torch
import verl.trainer.ppo.core_algos as ca
from verl.workers.config import ActorConfig, PolicyLossConfig

from refupstream.batches import batch, jsonable_inputs, r6, scale_of


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
