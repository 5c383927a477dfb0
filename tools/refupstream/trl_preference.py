"""TRL 1.16.0's DPO loss (the replay channel's DPO term) and SDPO (the hint channel; the replay
channel's teacher KL), each file with its own seed so it can be regenerated alone (--only)."""
import types
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl import DPOTrainer

from refupstream.batches import SEED, Gen, SingleProcess, r6

# Each file here has its own seed, so it can be regenerated alone (--only) without changing the
# files of the shared generator stream.
SEED_DPO = SEED + 1
SEED_SDPO = SEED + 2


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
        accelerator=SingleProcess(),
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
        accelerator=SingleProcess(),
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
