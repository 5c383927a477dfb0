"""The references of tools/ref_losses.py in numpy: SDPO's self-distillation loss (the
hint channel), TRL's DPO loss (the replay channel), and the advantage estimators of TRL and
verl with DAPO's dynamic-sampling filter."""
import numpy as np


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
