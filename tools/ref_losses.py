#!/usr/bin/env python3
"""Reference values for composer-loss, formula by formula, in numpy (float64).

Run by hand (not by CI):  pip install numpy && python3 tools/ref_losses.py
Writes crates/loss/tests/fixtures/*.json, read by crates/loss/tests/reference_parity.rs.

Each function below re-derives one reference implementation's formula (read, not copied):
  * TRL main @ f2cd57710 (1.10.0.dev0, 2026-07): trl/trainer/grpo_trainer.py
      GRPOTrainer._compute_loss, get_high_entropy_mask, get_gamma_weights (VESPO),
      _generate_and_score_completions (vLLM IS ratio; advantages with std + 1e-4, nanstd
      unbiased), trl/trainer/dpo_trainer.py DPOTrainer._compute_loss (sigmoid, hinge, ipo).
  * verl @ b178a3cd5 (0.8.0.dev, 2026-01): verl/trainer/ppo/core_algos.py
      compute_policy_loss_vanilla (dual clip c), agg_loss, kl_penalty_forward (k1, k2/mse,
      k3/low_var_kl), compute_rloo_outcome_advantage, compute_opo_outcome_advantage,
      compute_reinforce_plus_plus_outcome_advantage (+ _baseline), verl_F.masked_whiten.
  * verl recipe/dapo/dapo_ray_trainer.py RayDAPOTrainer.fit, `filter_groups` (dynamic sampling:
      keep a group iff np.std(rewards) > 0 or it has one sample).
  * PRIME-RL @ 559b44772 (2026-08): src/prime_rl/trainer/rl/loss.py default_loss_fn
      (DPPO mask + KL, adv_tau, kl_tau), compute_loss (sum / rl_scale).
  * SDPO: compute_self_distillation_loss (verl core_algos.py of the SDPO code; top-K + tail,
      renormalised top-K, alpha 0 = forward KL, 1 = reverse KL, else generalised JSD via lerp,
      sampled-token form, is_clip, token-mean).

Coverage (checked by reference_parity.rs `fixtures_cover_every_variant`): every loss_type, clip
variant (epsilon/epsilon_high, delta, verl dual clip where it bites), GSPO, DPPO+KL, KL k1/k2/k3,
entropy bonus, top_entropy_quantile, mask_truncated_completions, all four sampler IS modes with
C_min/C_max, gradient-accumulation scales (`*_ga4`), every advantage estimator and multi-reward
aggregation, the DAPO filter, every hint divergence x support, IS cap on/off, DPO sigmoid/ipo/
hinge, and the teacher KL with per-teacher weights (tail and renormalised).

Gradients in the fixtures are central finite differences (h = 1e-6) of these reference
functions with respect to the trainable input only; stop-gradients are honoured by passing
a frozen copy (`*_sg`) of the trainable input that the perturbation does not touch.
"""
import json
import math
import os

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "loss", "tests", "fixtures")
TRL = "TRL main@f2cd57710 (1.10.0.dev0) trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss"
VERL = "verl@b178a3cd5 (0.8.0.dev) verl/trainer/ppo/core_algos.py"
PRIME = "PRIME-RL@559b44772 src/prime_rl/trainer/rl/loss.py default_loss_fn + compute_loss"
SDPO = "SDPO compute_self_distillation_loss (verl core_algos.py fork)"
TRL_DPO = "TRL main@f2cd57710 trl/trainer/dpo_trainer.py DPOTrainer._compute_loss"


def fd_grad(f, x, h=1e-6):
    """Central finite differences of scalar f at array x."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp = x.copy(); xp[i] += h
        xm = x.copy(); xm[i] -= h
        g[i] = (f(xp) - f(xm)) / (2 * h)
    return g


# ----------------------------------------------------------------------------- TRL GRPO
TRL_DEFAULTS = dict(
    loss_type="dapo", epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
    beta=0.0, use_bias_correction_kl=False, entropy_coef=0.0, top_entropy_quantile=1.0,
    mask_truncated_completions=False, max_completion_length=512, sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
    vespo_lambda_neg=2.0, sampler_importance_sampling_correction=True,
    sampler_importance_sampling_mode="sequence_mask", sampler_importance_sampling_clip_min=None,
    sampler_importance_sampling_clip_max=3.0,
)


def trl_is_ratio(old, samp, mask, c):
    """_generate_and_score_completions: vLLM importance-sampling ratio (a constant)."""
    mode = c["sampler_importance_sampling_mode"]
    diff = (old - samp) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    r = np.exp(diff)
    lo = c["sampler_importance_sampling_clip_min"]
    hi = c["sampler_importance_sampling_clip_max"]
    if mode.endswith("truncate"):
        r = np.clip(r, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    else:
        lo = -np.inf if lo is None else lo
        hi = np.inf if hi is None else hi
        r = np.where((r < lo) | (r > hi), 0.0, r)
    return r


def trl_entropy_mask(ent, mask, threshold):
    active = ent[mask.astype(bool)]
    if active.size == 0:
        return np.zeros_like(ent, dtype=bool)
    thr = np.quantile(active, threshold)  # linear interpolation, like torch.quantile
    return ((ent * mask) >= thr) & mask.astype(bool)


def trl_grpo(inp, cfg, scale, lp, lp_sg):
    """GRPOTrainer._compute_loss with one process; `scale` = (global tokens, GA steps).

    Returns (loss, metrics)."""
    c = dict(TRL_DEFAULTS, **cfg)
    mask = np.array(inp["loss_mask"], dtype=float)
    if c["mask_truncated_completions"] and inp.get("truncated") is not None:
        mask = mask * (1 - np.array(inp["truncated"], dtype=float))[:, None]
    adv = np.array(inp["advantages"])[:, None]
    old = np.array(inp["old_logprobs"])
    eps_low = c["epsilon"]
    eps_high = c["epsilon_high"] if c["epsilon_high"] is not None else c["epsilon"]
    is_ratio = None
    if c["sampler_importance_sampling_correction"] and inp.get("sampler_logprobs") is not None:
        is_ratio = trl_is_ratio(old, np.array(inp["sampler_logprobs"]), mask, c)
    ent = np.array(inp["entropies"]) if inp.get("entropies") is not None else None
    entropy_mask = None
    if c["top_entropy_quantile"] < 1.0:
        entropy_mask = trl_entropy_mask(ent, mask, 1 - c["top_entropy_quantile"])

    log_ratio = lp - old
    if c["importance_sampling_level"] == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
    coef_1 = np.exp(liw)
    coef_1_sg = np.exp(lp_sg - old) if c["importance_sampling_level"] == "token" else \
        np.exp(((lp_sg - old) * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]

    if c["beta"] != 0.0:
        ref = np.array(inp["ref_logprobs"])
        per_token_kl = np.exp(ref - lp) - (ref - lp) - 1
        if c["use_bias_correction_kl"]:
            per_token_kl = per_token_kl * coef_1

    lt = c["loss_type"]
    phi_seq = None
    if lt == "cispo":
        clamped = np.minimum(coef_1_sg, eps_high)  # detached
        ptl = -clamped * adv * lp
    elif lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
        c1 = coef_1
        if c["delta"] is not None:
            c1 = np.minimum(c1, c["delta"])
        ptl = -np.minimum(c1 * adv, coef_2 * adv)
    elif lt == "sapo":
        tau = np.where(adv > 0, c["sapo_temperature_pos"], c["sapo_temperature_neg"])
        ptl = -(1 / (1 + np.exp(-tau * (coef_1 - 1)))) * 4 / tau * adv
    elif lt == "vespo":
        lower = math.log(1e-8)
        lr = np.clip(lp_sg - old, -20, 20)
        s = np.sum(lr * mask, -1, keepdims=True)
        if is_ratio is not None:
            with np.errstate(divide="ignore"):
                s = s + np.sum(np.clip(np.log(is_ratio), lower, 20.0), -1, keepdims=True)
        lw = np.clip(s, lower, 20.0)
        w = np.exp(lw)
        nn = adv >= 0
        k = np.where(nn, c["vespo_k_pos"], c["vespo_k_neg"])
        lam = np.maximum(np.where(nn, c["vespo_lambda_pos"], c["vespo_lambda_neg"]), 1e-4)
        phi_seq = np.nan_to_num(np.exp(lam + k * lw - lam * w), nan=0.0, posinf=0.0, neginf=0.0)
        ptl = -phi_seq * adv * lp
    else:
        raise ValueError(lt)
    ptl = np.broadcast_to(ptl, lp.shape) if ptl.shape != lp.shape else ptl
    if entropy_mask is not None:
        ptl = ptl * entropy_mask
    if is_ratio is not None and lt != "vespo":
        ptl = ptl * is_ratio
    if c["beta"] != 0.0:
        ptl = ptl + c["beta"] * per_token_kl

    ga = scale["num_micro_batches"]
    B = lp.shape[0]
    if lt in ("grpo", "sapo"):
        loss = ((ptl * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean() / ga
    elif lt == "bnpo":
        loss = (ptl * mask).sum() / max(mask.sum(), 1.0) / ga
    elif lt == "dr_grpo":
        loss = (ptl * mask).sum() / (B * c["max_completion_length"]) / ga
    elif lt in ("cispo", "dapo", "vespo"):
        normalizer = max(scale["global_active_tokens"], 1.0)
        loss = (ptl * mask).sum() / normalizer
    elif lt == "luspo":
        # TRL: (per_token_loss * mask.sum(1, keepdim=True)).mean() with per_token_loss (B, 1) at
        # sequence level, i.e. (1/B) Σ_i ℓ_i |o_i| = (1/B) Σ_i Σ_t m ℓ_i.
        loss = (ptl * mask).sum() / B / ga
    policy_loss = loss
    if c["entropy_coef"] != 0.0:
        eff = mask if entropy_mask is None else mask * entropy_mask
        if lt in ("cispo", "dapo", "vespo"):
            el = (ent * eff).sum() / max(scale["global_active_tokens"], 1.0)
        else:
            el = (ent * eff).sum() / max(eff.sum(), 1.0) / ga
        loss = loss - c["entropy_coef"] * el

    def gmm(x):
        if x.shape[1] == 1:
            return float(x.sum() / x.shape[0])
        return float((x * mask).sum() / max(mask.sum(), 1.0))

    m = {"loss": float(loss), "policy_loss": float(policy_loss), "active_tokens": float(mask.sum()),
         "mean_ratio": gmm(coef_1)}
    if c["beta"] != 0.0:
        m["kl"] = gmm(per_token_kl)
    if ent is not None:
        m["entropy"] = gmm(ent)
    if lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((coef_1 < 1 - eps_low) & (adv < 0)).astype(float)
        high = ((coef_1 > 1 + eps_high) & (adv > 0)).astype(float)
        m["clip_ratio_low"] = gmm(low)
        m["clip_ratio_high"] = gmm(high)
        m["clip_ratio_region"] = gmm(np.maximum(low, high))
    elif lt == "cispo":
        m["cispo_clip_ratio"] = gmm(((coef_1 > eps_high) & (adv > 0)).astype(float))
    elif lt == "vespo":
        m["vespo_phi_mean"] = gmm(phi_seq)
    if is_ratio is not None:
        if is_ratio.shape[1] == 1:
            sel = is_ratio[:, 0]
        else:
            sel = is_ratio[mask.astype(bool)]
        m["is_weight_mean"] = float(sel.mean())
        m["is_weight_min"] = float(sel.min())
        m["is_weight_max"] = float(sel.max())
    return float(loss), m


# ----------------------------------------------------------------------------- verl
def verl_kl(lp, ref, kind):
    if kind in ("kl", "k1"):
        return lp - ref
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref) ** 2
    if kind in ("low_var_kl", "k3"):
        kl = np.clip(ref - lp, -20, 20)
        return np.clip(np.exp(kl) - kl - 1, -10, 10)
    raise ValueError(kind)


def verl_agg(mat, mask, mode, scale_factor=None):
    if mode == "token-mean":
        return (mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        seq = (mat * mask).sum(-1)
        sm = (mask.sum(-1) > 0).astype(float)
        return (seq * sm).sum() / sm.sum()
    if mode == "seq-mean-token-mean":
        n = mask.sum(-1)
        seq = (mat * mask).sum(-1) / (n + 1e-8)
        sm = (n > 0).astype(float)
        return (seq * sm).sum() / sm.sum()
    if mode == "seq-mean-token-sum-norm":
        f = mask.shape[-1] if scale_factor is None else scale_factor
        return (mat * mask).sum(-1).sum() / f
    raise ValueError(mode)


def verl_policy_loss(inp, cfg, lp):
    """compute_policy_loss_vanilla (dual clip) + kl_coef * agg_loss(kl_penalty(...))."""
    old = np.array(inp["old_logprobs"])
    mask = np.array(inp["loss_mask"], dtype=float)
    adv = np.array(inp["advantages"])[:, None]
    lo, hi, cc = cfg["epsilon"], cfg.get("epsilon_high", cfg["epsilon"]), cfg["clip_ratio_c"]
    ratio = np.exp(np.clip(lp - old, -20, 20))
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - lo, 1 + hi)
    c1 = np.maximum(l1, l2)
    l3 = -adv * cc
    c2 = np.minimum(l3, c1)
    pg = np.where(adv < 0, c2, c1)
    mode = cfg["loss_agg_mode"]
    loss = verl_agg(pg, mask, mode)
    if cfg.get("beta", 0.0) != 0.0:
        kld = verl_kl(lp, np.array(inp["ref_logprobs"]), cfg["kl_estimator"])
        loss = loss + cfg["beta"] * verl_agg(kld, mask, mode)
    return float(loss), {"loss": float(loss)}


# ----------------------------------------------------------------------------- PRIME-RL
def prime_dppo(inp, cfg, scale, lp):
    """default_loss_fn per sample, summed, divided by rl_scale (the global token count)."""
    inf = np.array(inp["sampler_logprobs"])
    mask = np.array(inp["loss_mask"]).astype(bool)
    advs = np.array(inp["advantages"])
    lo, hi = cfg.get("dppo_mask_low", 0.2), cfg.get("dppo_mask_high", 0.2)
    adv_tau, kl_tau = cfg.get("adv_tau", 1.0), cfg.get("kl_tau", 1e-3)
    total = 0.0
    acc = {k: [0.0, 0.0] for k in ("is_masked", "is_masked_low", "is_masked_high", "mkl")}
    for i in range(lp.shape[0]):
        t, q, lm = lp[i], inf[i], mask[i]
        a = np.full_like(t, advs[i])
        lir = t - q
        ir = np.exp(lir)
        mkl = ir - lir - 1
        pd = np.exp(t) - np.exp(q)
        inv_hi = pd > hi
        inv_lo = pd < -lo
        pos, neg = a > 0, a < 0
        inv = np.where(pos, inv_hi, inv_lo)
        keep = lm & ~inv
        pg = keep * (adv_tau * a) * ir
        kl = lm * lir ** 2
        total += (-pg + kl_tau * kl).sum()
        for k, v in (("is_masked", inv), ("is_masked_low", neg & inv_lo), ("is_masked_high", pos & inv_hi),
                     ("mkl", mkl)):
            acc[k][0] += float((v * lm).sum())
            acc[k][1] += float(lm.sum())
    loss = total / scale["global_active_tokens"]
    m = {"loss": float(loss), "policy_loss": float(loss),
         "dppo_masked_fraction": acc["is_masked"][0] / max(acc["is_masked"][1], 1),
         "dppo_masked_low": acc["is_masked_low"][0] / max(acc["is_masked_low"][1], 1),
         "dppo_masked_high": acc["is_masked_high"][0] / max(acc["is_masked_high"][1], 1),
         "mismatch_kl": acc["mkl"][0] / max(acc["mkl"][1], 1)}
    return float(loss), m


# ----------------------------------------------------------------------------- SDPO
def sdpo_add_tail(lp):
    mx = lp.max(-1, keepdims=True)
    log_s = np.log(np.exp(lp - mx).sum(-1, keepdims=True)) + mx
    log_s = np.minimum(log_s, -1e-7)
    return np.concatenate([lp, np.log(-np.expm1(log_s))], -1)


def sdpo_renorm(lp):
    mx = lp.max(-1, keepdims=True)
    return lp - (np.log(np.exp(lp - mx).sum(-1, keepdims=True)) + mx)


def kl_div(inp, tgt):
    """torch F.kl_div(input, target, reduction='none', log_target=True)."""
    return np.exp(tgt) * (tgt - inp)


def sdpo_loss(inp, cfg, s_topk, s_tok, s_tok_sg):
    """compute_self_distillation_loss. alpha: 0 forward KL, 1 reverse KL, else JSD."""
    mask = np.array(inp["loss_mask"], dtype=float) * np.array(inp["has_hint"], dtype=float)[:, None]
    alpha = cfg["sdpo_alpha"]
    if cfg["full_logit"]:
        t_topk = np.array(inp["teacher_topk_logprobs"])
        if cfg["support"] == "topk_tail":
            s, t = sdpo_add_tail(s_topk), sdpo_add_tail(t_topk)
        elif cfg["support"] == "topk_renormalized":
            s, t = sdpo_renorm(s_topk), sdpo_renorm(t_topk)
        else:
            s, t = s_topk, t_topk
        if alpha == 0.0:
            kl = kl_div(s, t)
        elif alpha == 1.0:
            kl = kl_div(t, s)
        else:
            mix = np.log(np.exp(s + np.log(1 - alpha)) + np.exp(t + np.log(alpha)))
            kt = kl_div(mix, t)
            ks = kl_div(mix, s)
            kl = ks + alpha * (kt - ks)  # torch.lerp
        ptl = kl.sum(-1)
    else:
        tt = np.array(inp["teacher_token_logprobs"])
        ptl = (s_tok_sg - tt) * s_tok
    if cfg.get("is_clip") is not None:
        old = np.array(inp["old_logprobs"])
        r = np.minimum(np.exp(np.clip(s_tok_sg - old, -20, 20)), cfg["is_clip"])
        ptl = ptl * r
    return float((ptl * mask).sum() / max(mask.sum(), 1.0))


# ----------------------------------------------------------------------------- TRL DPO
def logsigmoid(x):
    return -np.logaddexp(0, -x)


def trl_dpo(inp, cfg, pc, pr):
    beta = cfg["beta"]
    hc = pc - np.array(inp["ref_chosen_logps"])
    hr = pr - np.array(inp["ref_rejected_logps"])
    d = hc - hr
    lt = cfg["loss_type"]
    if lt == "sigmoid":
        per = -logsigmoid(beta * d)
    elif lt == "hinge":
        per = np.maximum(0, 1 - beta * d)
    elif lt == "ipo":
        lc = np.maximum(np.array(inp["chosen_lengths"], dtype=float), 1)
        lr = np.maximum(np.array(inp["rejected_lengths"], dtype=float), 1)
        per = (hc / lc - hr / lr - 1 / (2 * beta)) ** 2
    loss = per.mean()
    m = {"loss": float(loss), "chosen_reward": float((beta * hc).mean()),
         "rejected_reward": float((beta * hr).mean()),
         "reward_accuracy": float((beta * hc > beta * hr).mean()),
         "reward_margin": float((beta * d).mean())}
    return float(loss), m


# ----------------------------------------------------------------------------- advantages
def nanstd(x, axis=None):
    return np.std(x, axis=axis, ddof=1)


def trl_advantages(rpf, weights, G, scale_rewards, agg):
    rpf = np.array(rpf, dtype=float)
    w = np.array(weights, dtype=float)
    if agg == "sum_then_normalize":
        r = (rpf * w[None]).sum(1)
        g = r.reshape(-1, G)
        mean = np.repeat(g.mean(1), G)
        if scale_rewards in ("group", "none"):
            std = np.repeat(nanstd(g, 1), G)
        else:
            std = np.full_like(r, nanstd(r))
        a = r - mean
        if scale_rewards != "none":
            a = a / (std + 1e-4)
        return a
    grouped = rpf.reshape(-1, G, rpf.shape[1])
    mk = grouped.mean(1, keepdims=True)
    sk = nanstd(grouped, 1)[:, None, :]
    rk = ((grouped - mk) / (sk + 1e-4)).reshape(-1, rpf.shape[1])
    r = (rk * w[None]).sum(1)
    return (r - r.mean()) / (nanstd(r) + 1e-4)


def verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8)
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) / np.sqrt(var + 1e-8)


def token_rewards(rewards, lengths):
    T = max(lengths)
    tr = np.zeros((len(rewards), T))
    mask = np.zeros((len(rewards), T))
    for i, (r, l) in enumerate(zip(rewards, lengths)):
        tr[i, l - 1] = r
        mask[i, :l] = 1
    return tr, mask


def verl_rloo(rewards, G):
    s = np.array(rewards, dtype=float).reshape(-1, G)
    n = G
    return (s * n / (n - 1) - s.mean(1, keepdims=True) * n / (n - 1)).reshape(-1)


def verl_opo(rewards, lengths, G):
    s = np.array(rewards, dtype=float).reshape(-1, G)
    l = np.array(lengths, dtype=float).reshape(-1, G)
    bsl = (l * s).sum(1, keepdims=True) / l.sum(1, keepdims=True)
    return (s - bsl).reshape(-1)


def verl_rfpp(rewards, lengths, gamma=1.0):
    tr, mask = token_rewards(rewards, lengths)
    ret = np.zeros_like(tr)
    run = np.zeros(tr.shape[0])
    for t in reversed(range(tr.shape[1])):
        run = tr[:, t] + gamma * run
        ret[:, t] = run
        run = run * mask[:, t]
    adv = verl_masked_whiten(ret, mask) * mask
    return [float(adv[i, 0]) for i in range(len(rewards))]


def verl_rfpp_baseline(rewards, lengths, G):
    s = np.array(rewards, dtype=float).reshape(-1, G)
    s = (s - s.mean(1, keepdims=True)).reshape(-1)
    _, mask = token_rewards(rewards, lengths)
    vals = s[:, None] * mask
    adv = verl_masked_whiten(vals, mask) * mask
    return [float(adv[i, 0]) for i in range(len(rewards))]


VERL_DAPO = ("verl@b178a3cd5 recipe/dapo/dapo_ray_trainer.py RayDAPOTrainer.fit (filter_groups: keep a prompt "
             "iff np.std(metric_vals) > 0 or len(metric_vals) == 1)")


def verl_dapo_filter(rewards, G):
    """DAPO dynamic sampling: keep groups with non-zero reward std (or a single sample)."""
    groups = np.array(rewards, dtype=float).reshape(-1, G)
    kept = [g for g in range(groups.shape[0]) if np.std(groups[g]) > 0 or G == 1]
    keep = [bool(i // G in kept) for i in range(len(rewards))]
    return kept, keep, 1.0 - len(kept) / groups.shape[0]


# ----------------------------------------------------------------------------- inputs
def rlvr_inputs(rng, B=4, T=5, lens=(5, 3, 4, 2), old_noise=0.25, samp_noise=0.25, with_sampler=True):
    p = rng.uniform(0.05, 0.95, size=(B, T))
    lp = np.log(p)
    old = lp + rng.normal(0, old_noise, size=(B, T))
    old = np.minimum(old, -1e-3)
    mask = np.zeros((B, T))
    for i, l in enumerate(lens):
        mask[i, :l] = 1
    inp = {
        "trainer_logprobs": lp.tolist(),
        "old_logprobs": old.tolist(),
        "advantages": [1.0, -0.7, 0.4, -1.3][:B] if B <= 4 else rng.normal(size=B).tolist(),
        "loss_mask": mask.tolist(),
        "truncated": [False, True, False, False][:B],
        "entropies": rng.uniform(0.1, 2.0, size=(B, T)).tolist(),
        "ref_logprobs": (lp + rng.normal(0, 0.2, size=(B, T))).tolist(),
    }
    if with_sampler:
        inp["sampler_logprobs"] = np.minimum(old + rng.normal(0, samp_noise, size=(B, T)), -1e-3).tolist()
    return inp


def local_scale(inp, mask_trunc=False):
    mask = np.array(inp["loss_mask"])
    if mask_trunc:
        mask = mask * (1 - np.array(inp["truncated"], dtype=float))[:, None]
    return {"global_active_tokens": float(mask.sum()), "global_sequences": float((mask.sum(-1) > 0).sum()),
            "num_micro_batches": 1.0}


def rlvr_case(name, reference, inp, cfg, scale, fn):
    lp = np.array(inp["trainer_logprobs"])
    loss, metrics = fn(lp, lp)
    grad = fd_grad(lambda x: fn(x, lp)[0], lp)
    return {"name": name, "reference": reference, "kind": "rlvr", "config": cfg, "scale": scale,
            "inputs": inp, "expected": {"loss": loss, "metrics": metrics, "grad_trainer_logprobs": grad.tolist()}}


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261122)
    cases = []

    def trl(name, cfg, inp=None, note=None, scale=None):
        inp = inp or rlvr_inputs(rng)
        sc = scale or local_scale(inp, cfg.get("mask_truncated_completions", False))
        c = rlvr_case(name, TRL, inp, cfg, sc, lambda x, xs: trl_grpo(inp, cfg, sc, x, xs))
        if note:
            c["note"] = note
        cases.append(c)

    nos = dict(sampler_importance_sampling_correction=False)
    trl("trl_grpo_token", dict(loss_type="grpo", **nos))
    trl("trl_bnpo_k3", dict(loss_type="bnpo", beta=0.04, **nos))
    trl("trl_dr_grpo", dict(loss_type="dr_grpo", max_completion_length=8, **nos))
    trl("trl_dapo_clip_higher_seq_mask", dict(loss_type="dapo", epsilon_high=0.28))
    trl("trl_dapo_token_truncate", dict(loss_type="dapo", sampler_importance_sampling_mode="token_truncate",
                                        sampler_importance_sampling_clip_min=0.8,
                                        sampler_importance_sampling_clip_max=1.2))
    trl("trl_dapo_token_mask", dict(loss_type="dapo", sampler_importance_sampling_mode="token_mask",
                                    sampler_importance_sampling_clip_min=0.8,
                                    sampler_importance_sampling_clip_max=1.2))
    trl("trl_dapo_sequence_truncate", dict(loss_type="dapo", sampler_importance_sampling_mode="sequence_truncate",
                                           sampler_importance_sampling_clip_max=1.1))
    trl("trl_grpo_sequence_gspo", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4,
                                       epsilon_high=4e-4, **nos))
    trl("trl_grpo_delta", dict(loss_type="grpo", delta=1.1, **nos), inp=rlvr_inputs(rng, old_noise=0.4))
    trl("trl_cispo", dict(loss_type="cispo", epsilon_high=1.1, **nos), inp=rlvr_inputs(rng, old_noise=0.4))
    trl("trl_sapo", dict(loss_type="sapo", **nos), inp=rlvr_inputs(rng, old_noise=0.4))
    trl("trl_luspo", dict(loss_type="luspo", importance_sampling_level="sequence", **nos))
    trl("trl_vespo_token_truncate", dict(loss_type="vespo", sampler_importance_sampling_mode="token_truncate",
                                         sampler_importance_sampling_clip_max=1.5),
        inp=rlvr_inputs(rng, old_noise=0.08, samp_noise=0.08))
    trl("trl_dapo_top_entropy_bonus", dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01, **nos))
    trl("trl_grpo_entropy_bonus", dict(loss_type="grpo", entropy_coef=0.05, **nos))
    trl("trl_dapo_mask_truncated", dict(loss_type="dapo", mask_truncated_completions=True))
    trl("trl_bnpo_bias_corrected_kl", dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=True, **nos))
    # TRL's default correction (sequence_mask) with both bounds active: some sequences masked.
    trl("trl_dapo_sequence_mask_cmin_cmax", dict(loss_type="dapo", sampler_importance_sampling_clip_min=0.7,
                                                 sampler_importance_sampling_clip_max=1.3),
        inp=rlvr_inputs(rng, samp_noise=0.3))
    trl("trl_gspo_sequence_mask_is", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4,
                                          epsilon_high=4e-4))
    trl("trl_dapo_k3_entropy_bonus", dict(loss_type="dapo", beta=0.04, entropy_coef=0.02, **nos))
    # Gradient accumulation: the scale spans 4 micro-batches of which this is one.
    ga = {"global_active_tokens": 51.0, "global_sequences": 16.0, "num_micro_batches": 4.0}
    trl("trl_dapo_ga4_global_tokens", dict(loss_type="dapo", entropy_coef=0.01), scale=ga)
    trl("trl_grpo_ga4", dict(loss_type="grpo", **nos), scale=ga)
    trl("trl_bnpo_ga4", dict(loss_type="bnpo", **nos), scale=ga)
    trl("trl_dr_grpo_ga4", dict(loss_type="dr_grpo", max_completion_length=16, **nos), scale=ga)
    trl("trl_cispo_ga4", dict(loss_type="cispo", epsilon_high=1.05, **nos), scale=ga,
        inp=rlvr_inputs(rng, old_noise=0.4))
    trl("trl_sapo_ga4_asym", dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, **nos),
        scale=ga, inp=rlvr_inputs(rng, old_noise=0.4))
    trl("trl_luspo_ga4", dict(loss_type="luspo", importance_sampling_level="sequence", **nos), scale=ga)
    trl("trl_vespo_token_mask_ga4", dict(loss_type="vespo", sampler_importance_sampling_mode="token_mask",
                                         sampler_importance_sampling_clip_min=0.9,
                                         sampler_importance_sampling_clip_max=1.1), scale=ga,
        inp=rlvr_inputs(rng, old_noise=0.08, samp_noise=0.08))

    # verl: vanilla PPO with dual clip, all aggregation modes, k1/k2/k3.
    for mode, kl in (("token-mean", "k1"), ("seq-mean-token-sum", "k2"), ("seq-mean-token-mean", "k3"),
                     ("seq-mean-token-sum-norm", None)):
        inp = rlvr_inputs(rng, old_noise=0.6, with_sampler=False)
        inp["advantages"] = [1.0, -0.7, 0.4, -1.3]
        vcfg = dict(epsilon=0.2, epsilon_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode,
                    beta=0.05 if kl else 0.0, kl_estimator=kl or "k3")
        rcfg = dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, dual_clip=True, clip_ratio_c=3.0,
                    loss_agg_mode=mode, beta=vcfg["beta"], kl_estimator=vcfg["kl_estimator"], **nos)
        sc = local_scale(inp)
        c = rlvr_case(f"verl_vanilla_{mode}_{kl}", VERL + " compute_policy_loss_vanilla + agg_loss + kl_penalty",
                      inp, rcfg, sc, lambda x, xs, inp=inp, vcfg=vcfg: verl_policy_loss(inp, vcfg, x))
        cases.append(c)

    # verl dual clip where it bites: negative-advantage tokens with ratio > c = 3.
    inp = rlvr_inputs(rng, old_noise=0.1, with_sampler=False)
    old = np.array(inp["old_logprobs"])
    old[1, 0] -= 1.6; old[3, 1] -= 2.0; old[1, 2] -= 0.9  # ratios ~5, ~7.4 and ~2.5 (below c)
    inp["old_logprobs"] = old.tolist()
    for mode in ("token-mean", "seq-mean-token-mean"):
        vcfg = dict(epsilon=0.2, epsilon_high=0.2, clip_ratio_c=3.0, loss_agg_mode=mode, beta=0.0,
                    kl_estimator="k3")
        rcfg = dict(loss_type="dapo", epsilon=0.2, dual_clip=True, clip_ratio_c=3.0, loss_agg_mode=mode, **nos)
        cases.append(rlvr_case(f"verl_dual_clip_triggered_{mode}",
                               VERL + " compute_policy_loss_vanilla (dual clip c = 3) + agg_loss", inp, rcfg,
                               local_scale(inp), lambda x, xs, inp=inp, vcfg=vcfg: verl_policy_loss(inp, vcfg, x)))

    # PRIME-RL DPPO + KL.
    for name, pcfg, noise in (("prime_dppo_default", {}, 0.3),
                              ("prime_dppo_tight", dict(dppo_mask_low=0.05, dppo_mask_high=0.05, adv_tau=0.5,
                                                        kl_tau=0.1), 0.3)):
        inp = rlvr_inputs(rng, samp_noise=noise)
        sc = local_scale(inp)
        rcfg = dict(loss_type="dppo", **pcfg)
        cases.append(rlvr_case(name, PRIME, inp, rcfg, sc, lambda x, xs, inp=inp, pcfg=pcfg, sc=sc:
                               prime_dppo(inp, pcfg, sc, x)))

    # rlvr.json is retired: the RLVR losses are checked against the upstream code itself
    # (tools/ref_upstream.py -> tests/fixtures/upstream/); `cases` above is no longer written.

    # ------------------------------------------------------------------ hint (SDPO)
    hint_cases = []
    B, T, V, K = 3, 4, 10, 4
    for name, div, alpha_sdpo, support, full_logit, is_clip in (
        ("sdpo_jsd_topk_tail", "jsd", 0.5, "topk_tail", True, 2.0),
        ("sdpo_jsd03_topk_tail", "jsd", 0.3, "topk_tail", True, 2.0),
        ("sdpo_forward_kl_topk_tail", "forward_kl", 0.0, "topk_tail", True, 2.0),
        ("sdpo_reverse_kl_topk_tail", "reverse_kl", 1.0, "topk_tail", True, None),
        ("sdpo_jsd_topk_renorm", "jsd", 0.5, "topk_renormalized", True, 2.0),
        ("sdpo_reverse_kl_full_vocab", "reverse_kl", 1.0, "full", True, 1.5),
        ("sdpo_sampled_token", "sampled_token", 1.0, "topk_tail", False, 2.0),
        ("sdpo_sampled_token_no_is", "sampled_token", 1.0, "topk_tail", False, None),
        ("sdpo_forward_kl_topk_renorm", "forward_kl", 0.0, "topk_renormalized", True, 2.0),
        ("sdpo_reverse_kl_topk_renorm", "reverse_kl", 1.0, "topk_renormalized", True, 2.0),
        ("sdpo_jsd07_full_vocab", "jsd", 0.7, "full", True, 2.0),
        ("sdpo_jsd_topk_tail_is_cap_1_2", "jsd", 0.5, "topk_tail", True, 1.2),
    ):
        ls = rng.normal(0, 1.5, size=(B, T, V))
        lt = ls + rng.normal(0, 1.0, size=(B, T, V))
        ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
        lt = lt - np.log(np.exp(lt).sum(-1, keepdims=True))
        if support == "full":
            s_k, t_k = ls, lt
            ids = np.tile(np.arange(V), (B, T, 1))
        else:
            ids = np.argsort(-ls, -1)[..., :K]
            s_k = np.take_along_axis(ls, ids, -1)
            t_k = np.take_along_axis(lt, ids, -1)
        sampled = rng.integers(0, V, size=(B, T))
        s_tok = np.take_along_axis(ls, sampled[..., None], -1)[..., 0]
        t_tok = np.take_along_axis(lt, sampled[..., None], -1)[..., 0]
        old = s_tok + rng.normal(0, 0.8, size=(B, T))
        mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=float)
        inp = {"trainer_logprobs": s_tok.tolist(), "old_logprobs": old.tolist(), "loss_mask": mask.tolist(),
               "advantages": [0.0] * B, "has_hint": [True, False, True],
               "student_topk_logprobs": s_k.tolist(), "teacher_topk_logprobs": t_k.tolist(),
               "topk_ids": ids.tolist(), "teacher_token_logprobs": t_tok.tolist()}
        scfg = {"sdpo_alpha": alpha_sdpo, "support": support, "full_logit": full_logit, "is_clip": is_clip}
        loss = sdpo_loss(inp, scfg, s_k, s_tok, s_tok)
        g_topk = fd_grad(lambda x: sdpo_loss(inp, scfg, x, s_tok, s_tok), s_k) if full_logit else np.zeros_like(s_k)
        g_tok = fd_grad(lambda x: sdpo_loss(inp, scfg, s_k, x, s_tok), s_tok)
        rcfg = {"divergence": div, "alpha": alpha_sdpo if div == "jsd" else 0.5, "support": support,
                "is_clip": is_clip}
        hint_cases.append({"name": name, "reference": SDPO, "kind": "hint", "config": rcfg, "sdpo_config": scfg,
                           "inputs": inp, "expected": {"loss": loss, "grad_student_topk_logprobs": g_topk.tolist(),
                                                       "grad_trainer_logprobs": g_tok.tolist()}})
    # Teacher-KL replay = SDPO's alpha = 0 (forward KL) on the teachers' top-K, weighted per teacher.
    ls = rng.normal(0, 1.5, size=(B, T, V)); ls -= np.log(np.exp(ls).sum(-1, keepdims=True))
    lt = rng.normal(0, 1.5, size=(B, T, V)); lt -= np.log(np.exp(lt).sum(-1, keepdims=True))
    ids = np.argsort(-lt, -1)[..., :K]
    s_k = np.take_along_axis(ls, ids, -1); t_k = np.take_along_axis(lt, ids, -1)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=float)
    teachers = ["alpha", "beta", "alpha"]
    weights = {"alpha": 1.0, "beta": 0.5}
    w = np.array([weights[t] for t in teachers])

    for support, prep in (("topk_tail", sdpo_add_tail), ("topk_renormalized", sdpo_renorm)):
        def teacher_kl(x, prep=prep):
            kl = kl_div(prep(x), prep(t_k)).sum(-1)
            return float((kl * mask * w[:, None]).sum() / mask.sum())
        hint_cases.append({"name": f"replay_teacher_forward_kl_{support}", "kind": "teacher_kl",
                           "reference": SDPO + f" with alpha = 0 (forward KL), support {support}; "
                                               "per-teacher weights ours (weighted token sum / active tokens)",
                           "config": {"teacher_weights": weights, "support": support},
                           "inputs": {"student_topk_logprobs": s_k.tolist(), "teacher_topk_logprobs": t_k.tolist(),
                                      "loss_mask": mask.tolist(), "teachers": teachers},
                           "expected": {"loss": teacher_kl(s_k),
                                        "grad_student_topk_logprobs": fd_grad(teacher_kl, s_k).tolist()}})
    with open(os.path.join(OUT, "hint.json"), "w") as f:
        json.dump({"generator": "tools/ref_losses.py", "cases": hint_cases}, f, indent=1)

    # ------------------------------------------------------------------ DPO
    dpo_cases = []
    P = 4
    for lt_ in ("sigmoid", "hinge", "ipo"):
        pc = rng.normal(-20, 5, size=P); pr = rng.normal(-22, 5, size=P)
        inp = {"policy_chosen_logps": pc.tolist(), "policy_rejected_logps": pr.tolist(),
               "ref_chosen_logps": (pc + rng.normal(0, 2, size=P)).tolist(),
               "ref_rejected_logps": (pr + rng.normal(0, 2, size=P)).tolist(),
               "chosen_lengths": [12, 7, 20, 3], "rejected_lengths": [9, 15, 4, 11]}
        cfg = {"loss_type": lt_, "beta": 0.1 if lt_ != "hinge" else 0.3}
        loss, m = trl_dpo(inp, cfg, pc, pr)
        gc = fd_grad(lambda x: trl_dpo(inp, cfg, x, pr)[0], pc)
        gr = fd_grad(lambda x: trl_dpo(inp, cfg, pc, x)[0], pr)
        dpo_cases.append({"name": f"trl_dpo_{lt_}", "reference": TRL_DPO, "kind": "dpo", "config": cfg, "inputs": inp,
                          "expected": {"loss": loss, "metrics": m, "grad_policy_chosen_logps": gc.tolist(),
                                       "grad_policy_rejected_logps": gr.tolist()}})
    with open(os.path.join(OUT, "dpo.json"), "w") as f:
        json.dump({"generator": "tools/ref_losses.py", "cases": dpo_cases}, f, indent=1)

    # ------------------------------------------------------------------ advantages
    adv_cases = []
    G = 4
    rewards = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 1.0, 0.2, 0.9, 0.4, 0.4]
    lengths = [5, 9, 3, 7, 2, 8, 6, 4, 10, 1, 5, 5]
    for sr in ("group", "batch", "none"):
        adv_cases.append({"name": f"trl_grpo_{sr}", "reference": "TRL main@f2cd57710 grpo_trainer.py "
                          "_generate_and_score_completions (sum_then_normalize)",
                          "config": {"estimator": "grpo", "scale_rewards": sr},
                          "rewards_per_func": [[r] for r in rewards], "lengths": lengths, "group_size": G,
                          "expected": trl_advantages([[r] for r in rewards], [1.0], G, sr, "sum_then_normalize").tolist()})
    rpf = [[r, float(l % 3), 0.1 * l] for r, l in zip(rewards, lengths)]
    for agg in ("sum_then_normalize", "normalize_then_sum"):
        adv_cases.append({"name": f"trl_multi_{agg}", "reference": "TRL main@f2cd57710 grpo_trainer.py "
                          "multi_objective_aggregation", "config": {"estimator": "grpo", "scale_rewards": "group",
                          "reward_weights": [1.0, 0.5, -0.2], "multi_objective_aggregation": agg},
                          "rewards_per_func": rpf, "lengths": lengths, "group_size": G,
                          "expected": trl_advantages(rpf, [1.0, 0.5, -0.2], G, "group", agg).tolist()})
    for est, fn in (("rloo", lambda: verl_rloo(rewards, G)), ("opo", lambda: verl_opo(rewards, lengths, G)),
                    ("reinforce_plus_plus", lambda: verl_rfpp(rewards, lengths)),
                    ("reinforce_plus_plus_baseline", lambda: verl_rfpp_baseline(rewards, lengths, G))):
        adv_cases.append({"name": f"verl_{est}", "reference": VERL + f" compute_{est}_outcome_advantage",
                          "config": {"estimator": est}, "rewards_per_func": [[r] for r in rewards],
                          "lengths": lengths, "group_size": G, "expected": [float(x) for x in fn()]})
    ds_cases = []
    for name, rw, G_ in (("verl_dapo_filter_g4", rewards, 4),
                         ("verl_dapo_filter_all_equal", [1.0, 1.0, 0.0, 0.0, 0.5, 0.5], 2),
                         ("verl_dapo_filter_g3_mixed", [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.3, 0.3, 0.3], 3),
                         ("verl_dapo_filter_g1_kept", [0.0, 1.0, 1.0], 1)):
        kept, keep, frac = verl_dapo_filter(rw, G_)
        ds_cases.append({"name": name, "reference": VERL_DAPO, "rewards": rw, "group_size": G_,
                         "expected": {"kept_groups": kept, "keep": keep, "fraction_dropped": frac}})
    with open(os.path.join(OUT, "advantages.json"), "w") as f:
        json.dump({"generator": "tools/ref_losses.py", "cases": adv_cases, "dynamic_sampling_cases": ds_cases},
                  f, indent=1)
    print(f"wrote {len(cases)} rlvr, {len(hint_cases)} hint, {len(dpo_cases)} dpo, {len(adv_cases)} advantage cases")


if __name__ == "__main__":
    main()
