#!/usr/bin/env python3
"""Reference values for composer-loss's hint, DPO and advantage fixtures, formula by formula, in
numpy (float64).

Run by hand (not by CI):  pip install numpy && python3 tools/ref_losses.py
Writes crates/loss/tests/fixtures/{hint,dpo,advantages}.json, read by
crates/loss/tests/reference_parity.rs. The formulas are in tools/reflosses/other.py; this file
builds the cases. The RLVR losses are not here: they are checked against the upstream code
itself (tools/ref_upstream.py -> crates/loss/tests/fixtures/upstream/), as are TRL's DPO and
SDPO and TRL's and verl's advantages; these numpy cases stay as a second, independent check.

Each function in reflosses/other.py re-derives one reference implementation's formula (read,
not copied):
  * TRL main @ f2cd57710 (1.10.0.dev0, 2026-07): _generate_and_score_completions (advantages
      with std + 1e-4, nanstd unbiased), trl/trainer/dpo_trainer.py DPOTrainer._compute_loss
      (sigmoid, hinge, ipo).
  * verl @ b178a3cd5 (0.8.0.dev, 2026-01): verl/trainer/ppo/core_algos.py
      compute_rloo_outcome_advantage, compute_opo_outcome_advantage,
      compute_reinforce_plus_plus_outcome_advantage (+ _baseline), verl_F.masked_whiten.
  * verl recipe/dapo/dapo_ray_trainer.py RayDAPOTrainer.fit, `filter_groups` (dynamic sampling:
      keep a group iff np.std(rewards) > 0 or it has one sample).
  * SDPO: compute_self_distillation_loss (verl core_algos.py of the SDPO code; top-K + tail,
      renormalised top-K, alpha 0 = forward KL, 1 = reverse KL, else generalised JSD via lerp,
      sampled-token form, is_clip, token-mean).

Coverage (checked by reference_parity.rs `fixtures_cover_every_variant`): every advantage
estimator and multi-reward aggregation, the DAPO filter, every hint divergence x support, IS cap
on/off, DPO sigmoid/ipo/hinge, and the teacher KL with per-teacher weights (tail and
renormalised).

Gradients in the fixtures are central finite differences (h = 1e-6) of these reference
functions with respect to the trainable input only; stop-gradients are honoured by passing
a frozen copy (`*_sg`) of the trainable input that the perturbation does not touch.
"""
import json
import os

import numpy as np

from reflosses.other import (VERL_DAPO, kl_div, sdpo_add_tail, sdpo_loss, sdpo_renorm, trl_advantages,
                             trl_dpo, verl_dapo_filter, verl_opo, verl_rfpp, verl_rfpp_baseline, verl_rloo)

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "loss", "tests", "fixtures")
VERL = "verl@b178a3cd5 (0.8.0.dev) verl/trainer/ppo/core_algos.py"
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


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261122)

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
    print(f"wrote {len(hint_cases)} hint, {len(dpo_cases)} dpo, {len(adv_cases)} advantage cases")


if __name__ == "__main__":
    main()
