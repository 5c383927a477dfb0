//! f64 finite-difference gradient checks for every loss of the crate.
//!
//! For each loss, candle's backward w.r.t. the trainable inputs (trainer log-probs; student
//! top-K log-probs; DPO policy sums; entropies for the entropy bonus) is compared with central
//! differences (h = 1e-5) of the same Rust function, to 1e-6 (relative above magnitude 1).
//!
//! Stop-gradients are checked two ways:
//! * inputs the references detach (old, sampler, reference and teacher log-probs) are passed
//!   as `Var`s and must receive no gradient (absent or all zero);
//! * terms that the references detach although they are computed from the trainer's own
//!   log-probs (CISPO's capped ratio sg(min(r, ε_high)), VESPO's sequence weight sg(φ),
//!   the hint channel's IS weight sg(min(π/π_old, cap)) and sampled-token coefficient
//!   sg(log π_S − log π_T)) are held fixed in the finite differences by shifting their
//!   partner inputs (old / sampler / teacher token log-probs) by the same perturbation, so
//!   log π − log π_old is unchanged and only the differentiated factor moves. The backward
//!   must match that, and (where it matters) differ from the naive derivative.
mod common;
use candle_core::{backprop::GradStore, Device, Tensor, Var};
use common::flat;
use composer_loss::*;
use std::collections::BTreeMap;

const B: usize = 4;
const T: usize = 5;
const H: f64 = 1e-5;
const TOL: f64 = 1e-6;

/// SplitMix64: deterministic inputs without a dev-dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    fn normal(&mut self) -> f64 {
        let u1 = self.uniform(1e-12, 1.0);
        let u2 = self.uniform(0.0, 1.0);
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

fn tensor(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
}

fn var(v: &[f64], shape: &[usize]) -> Var {
    Var::from_tensor(&tensor(v, shape)).unwrap()
}

fn grad_or_zero(grads: &GradStore, v: &Var, n: usize) -> Vec<f64> {
    grads.get(v.as_tensor()).map(flat).unwrap_or(vec![0.0; n])
}

/// The detached input must receive no gradient.
fn assert_no_grad(grads: &GradStore, v: &Var, what: &str) {
    if let Some(g) = grads.get(v.as_tensor()) {
        assert!(
            flat(g).iter().all(|x| *x == 0.0),
            "{what}: a detached input received a gradient"
        );
    }
}

/// Central differences of `f` at `x0`.
fn fd_grad(x0: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    (0..x0.len())
        .map(|i| {
            let mut xp = x0.to_vec();
            let mut xm = x0.to_vec();
            xp[i] += H;
            xm[i] -= H;
            (f(&xp) - f(&xm)) / (2.0 * H)
        })
        .collect()
}

/// Central differences of `f` at `x0`, compared with `analytic`.
fn fd_check(what: &str, x0: &[f64], analytic: &[f64], f: impl Fn(&[f64]) -> f64) {
    assert_eq!(x0.len(), analytic.len(), "{what}: gradient length");
    for (i, fd) in fd_grad(x0, f).into_iter().enumerate() {
        let a = analytic[i];
        assert!(
            (fd - a).abs() <= TOL * a.abs().max(1.0),
            "{what}[{i}]: backward {a}, finite difference {fd}"
        );
    }
}

fn shifted(base: &[f64], x: &[f64], x0: &[f64]) -> Vec<f64> {
    base.iter()
        .zip(x.iter().zip(x0))
        .map(|(b, (x, x0))| b + (x - x0))
        .collect()
}

// ------------------------------------------------------------------------------ RLVR

#[derive(Clone)]
struct RlvrData {
    lp: Vec<f64>,
    old: Vec<f64>,
    sampler: Vec<f64>,
    reference: Vec<f64>,
    entropies: Vec<f64>,
    advantages: Vec<f64>,
    mask: Vec<f64>,
    truncated: Vec<bool>,
}

fn rlvr_data(seed: u64, old_noise: f64, sampler_noise: f64) -> RlvrData {
    let mut rng = Rng(seed);
    let n = B * T;
    let lp: Vec<f64> = (0..n).map(|_| rng.uniform(0.05, 0.95).ln()).collect();
    let old: Vec<f64> = lp
        .iter()
        .map(|x| (x + old_noise * rng.normal()).min(-1e-3))
        .collect();
    let sampler: Vec<f64> = old
        .iter()
        .map(|x| (x + sampler_noise * rng.normal()).min(-1e-3))
        .collect();
    let reference: Vec<f64> = lp.iter().map(|x| x + 0.2 * rng.normal()).collect();
    let entropies: Vec<f64> = (0..n).map(|_| rng.uniform(0.1, 2.0)).collect();
    let lens = [5, 3, 4, 2];
    let mask: Vec<f64> = (0..n)
        .map(|k| if k % T < lens[k / T] { 1.0 } else { 0.0 })
        .collect();
    RlvrData {
        lp,
        old,
        sampler,
        reference,
        entropies,
        advantages: vec![1.0, -0.7, 0.4, -1.3],
        mask,
        truncated: vec![false, true, false, false],
    }
}

fn rlvr_inputs_from(
    d: &RlvrData,
    lp: Tensor,
    old: Tensor,
    s: Tensor,
    r: Tensor,
    e: Tensor,
) -> LossInputs {
    let mut x = LossInputs::new(lp, tensor(&d.advantages, &[B]), tensor(&d.mask, &[B, T]));
    x.old_logprobs = Some(old);
    x.sampler_logprobs = Some(s);
    x.ref_logprobs = Some(r);
    x.entropies = Some(e);
    x.truncated = Some(d.truncated.clone());
    x
}

fn rlvr_plain(d: &RlvrData) -> LossInputs {
    let s = [B, T];
    rlvr_inputs_from(
        d,
        tensor(&d.lp, &s),
        tensor(&d.old, &s),
        tensor(&d.sampler, &s),
        tensor(&d.reference, &s),
        tensor(&d.entropies, &s),
    )
}

fn rlvr_value(d: &RlvrData, cfg: &RlvrConfig, scale: &LossScale) -> f64 {
    let (l, _) = rlvr_loss(&rlvr_plain(d), cfg, scale).unwrap();
    flat(&l)[0]
}

/// Returns the backward gradient w.r.t. the trainer log-probs (after checking it).
fn check_rlvr(name: &str, d: &RlvrData, cfg: &RlvrConfig, co_shift: bool) -> Vec<f64> {
    let s = [B, T];
    let scale = LossScale::local(&rlvr_plain(d), cfg.mask_truncated_completions).unwrap();
    let (lp, old, samp, refp, ent) = (
        var(&d.lp, &s),
        var(&d.old, &s),
        var(&d.sampler, &s),
        var(&d.reference, &s),
        var(&d.entropies, &s),
    );
    let inputs = rlvr_inputs_from(
        d,
        lp.as_tensor().clone(),
        old.as_tensor().clone(),
        samp.as_tensor().clone(),
        refp.as_tensor().clone(),
        ent.as_tensor().clone(),
    );
    let (loss, _) = rlvr_loss(&inputs, cfg, &scale).unwrap_or_else(|e| panic!("{name}: {e}"));
    let grads = loss.backward().unwrap();
    assert_no_grad(&grads, &old, &format!("{name}: old_logprobs"));
    assert_no_grad(&grads, &samp, &format!("{name}: sampler_logprobs"));
    assert_no_grad(&grads, &refp, &format!("{name}: ref_logprobs"));
    let g_lp = grad_or_zero(&grads, &lp, B * T);
    fd_check(
        &format!("{name}: d/d trainer_logprobs"),
        &d.lp,
        &g_lp,
        |x| {
            let mut d2 = d.clone();
            d2.lp = x.to_vec();
            if co_shift {
                d2.old = shifted(&d.old, x, &d.lp);
                d2.sampler = shifted(&d.sampler, x, &d.lp);
            }
            rlvr_value(&d2, cfg, &scale)
        },
    );
    let g_ent = grad_or_zero(&grads, &ent, B * T);
    if cfg.entropy_coef != 0.0 {
        fd_check(
            &format!("{name}: d/d entropies"),
            &d.entropies,
            &g_ent,
            |x| {
                let mut d2 = d.clone();
                d2.entropies = x.to_vec();
                rlvr_value(&d2, cfg, &scale)
            },
        );
    } else {
        assert!(
            g_ent.iter().all(|x| *x == 0.0),
            "{name}: entropies got a gradient without an entropy bonus"
        );
    }
    assert!(
        g_lp.iter().any(|x| *x != 0.0),
        "{name}: the loss has no gradient at all (degenerate case)"
    );
    g_lp
}

fn cfg(f: impl FnOnce(&mut RlvrConfig)) -> RlvrConfig {
    let mut c = RlvrConfig {
        sampler_importance_sampling_correction: false,
        ..Default::default()
    };
    f(&mut c);
    c
}

#[test]
fn rlvr_loss_types_and_clipping() {
    let d = rlvr_data(1, 0.3, 0.25);
    let cases: Vec<(&str, RlvrConfig)> = vec![
        ("grpo", cfg(|c| c.loss_type = LossType::Grpo)),
        (
            "grpo clip-higher",
            cfg(|c| {
                c.loss_type = LossType::Grpo;
                c.epsilon_high = Some(0.28);
            }),
        ),
        ("bnpo", cfg(|c| c.loss_type = LossType::Bnpo)),
        (
            "dr_grpo",
            cfg(|c| {
                c.loss_type = LossType::DrGrpo;
                c.max_completion_length = 8;
            }),
        ),
        ("dapo", cfg(|c| c.loss_type = LossType::Dapo)),
        (
            "delta",
            cfg(|c| {
                c.loss_type = LossType::Grpo;
                c.delta = Some(1.1);
            }),
        ),
        (
            "gspo sequence",
            cfg(|c| {
                c.loss_type = LossType::Grpo;
                c.importance_sampling_level = ImportanceSamplingLevel::Sequence;
                c.epsilon = 0.05;
            }),
        ),
        ("sapo", cfg(|c| c.loss_type = LossType::Sapo)),
        (
            "sapo asymmetric",
            cfg(|c| {
                c.loss_type = LossType::Sapo;
                c.sapo_temperature_pos = 0.5;
                c.sapo_temperature_neg = 2.0;
            }),
        ),
        (
            "luspo",
            cfg(|c| {
                c.loss_type = LossType::Luspo;
                c.importance_sampling_level = ImportanceSamplingLevel::Sequence;
            }),
        ),
        ("dppo default", cfg(|c| c.loss_type = LossType::Dppo)),
        (
            "dppo tight",
            cfg(|c| {
                c.loss_type = LossType::Dppo;
                c.dppo_mask_low = 0.05;
                c.dppo_mask_high = 0.05;
                c.adv_tau = 0.5;
                c.kl_tau = 0.1;
            }),
        ),
        (
            "mask_truncated_completions",
            cfg(|c| {
                c.loss_type = LossType::Dapo;
                c.mask_truncated_completions = true;
            }),
        ),
    ];
    for (name, c) in &cases {
        check_rlvr(name, &d, c, false);
    }
}

#[test]
fn rlvr_dual_clip_bounds_negative_advantage_tokens() {
    let mut d = rlvr_data(2, 0.1, 0.25);
    // Ratios ≈ 5 and ≈ 7 on negative-advantage rows 1 and 3: beyond c = 3.
    d.old[T] -= 1.6;
    d.old[3 * T + 1] -= 2.0;
    let c = cfg(|c| {
        c.loss_type = LossType::Dapo;
        c.dual_clip = true;
        c.clip_ratio_c = 3.0;
    });
    let g = check_rlvr("dual clip", &d, &c, false);
    // The dual-clipped tokens carry the constant −A·c: no gradient.
    assert_eq!(g[T], 0.0);
    assert_eq!(g[3 * T + 1], 0.0);
    // Without dual clip they would be unclipped (A < 0, r > 1 + ε takes the r·A branch).
    let plain = check_rlvr(
        "no dual clip",
        &d,
        &cfg(|c| c.loss_type = LossType::Dapo),
        false,
    );
    assert!(plain[T] != 0.0 && plain[3 * T + 1] != 0.0);
}

#[test]
fn rlvr_detached_coefficients_cispo_vespo() {
    let d = rlvr_data(3, 0.4, 0.08);
    let cispo = cfg(|c| {
        c.loss_type = LossType::Cispo;
        c.epsilon_high = Some(1.1);
    });
    let g = check_rlvr("cispo", &d, &cispo, true);
    // sg(min(r, ε_high))·A·∇log π: the gradient is exactly −min(r, ε_high)·A·m / N.
    let n: f64 = d.mask.iter().sum();
    for (k, gk) in g.iter().enumerate() {
        let r = (d.lp[k] - d.old[k]).exp().min(1.1);
        let want = -r * d.advantages[k / T] * d.mask[k] / n;
        assert!((gk - want).abs() < 1e-12, "cispo[{k}]: {gk} vs {want}");
    }
    let vespo = RlvrConfig {
        loss_type: LossType::Vespo,
        sampler_importance_sampling_mode: SamplerIsMode::TokenTruncate,
        sampler_importance_sampling_clip_max: Some(1.5),
        ..Default::default()
    };
    let d4 = rlvr_data(4, 0.08, 0.08);
    check_rlvr("vespo", &d4, &vespo, true);

    // The detach matters: the naive derivative (ratio differentiated too) is different.
    let scale = LossScale::local(&rlvr_plain(&d), false).unwrap();
    let naive = fd_grad(&d.lp, |x| {
        rlvr_value(
            &RlvrData {
                lp: x.to_vec(),
                ..d.clone()
            },
            &cispo,
            &scale,
        )
    });
    let gap = naive
        .iter()
        .zip(&g)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        gap > 1e-3,
        "cispo: detached and naive gradients agree ({gap})"
    );
}

#[test]
fn rlvr_sampler_importance_correction_modes() {
    let d = rlvr_data(5, 0.3, 0.3);
    for (mode, lo, hi) in [
        (SamplerIsMode::TokenTruncate, Some(0.8), Some(1.2)),
        (SamplerIsMode::TokenMask, Some(0.8), Some(1.2)),
        (SamplerIsMode::SequenceTruncate, None, Some(1.1)),
        (SamplerIsMode::SequenceMask, Some(0.7), Some(1.3)),
    ] {
        let c = RlvrConfig {
            loss_type: LossType::Dapo,
            sampler_importance_sampling_mode: mode,
            sampler_importance_sampling_clip_min: lo,
            sampler_importance_sampling_clip_max: hi,
            ..Default::default()
        };
        check_rlvr(&format!("sampler IS {mode:?}"), &d, &c, false);
    }
}

#[test]
fn rlvr_kl_estimators_and_entropy() {
    let d = rlvr_data(6, 0.3, 0.25);
    for est in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
        let c = cfg(|c| {
            c.loss_type = LossType::Dapo;
            c.beta = 0.1;
            c.kl_estimator = est;
        });
        check_rlvr(&format!("kl {est:?}"), &d, &c, false);
    }
    let c = cfg(|c| {
        c.loss_type = LossType::Bnpo;
        c.beta = 0.1;
        c.use_bias_correction_kl = true;
    });
    check_rlvr("bias-corrected kl", &d, &c, false);
    for lt in [LossType::Dapo, LossType::Grpo] {
        let c = cfg(|c| {
            c.loss_type = lt;
            c.entropy_coef = 0.05;
        });
        check_rlvr(&format!("entropy bonus {lt:?}"), &d, &c, false);
        let c = cfg(|c| {
            c.loss_type = lt;
            c.entropy_coef = 0.05;
            c.top_entropy_quantile = 0.5;
        });
        check_rlvr(&format!("top-entropy + bonus {lt:?}"), &d, &c, false);
    }
}

#[test]
fn rlvr_verl_aggregation_modes() {
    let d = rlvr_data(7, 0.3, 0.25);
    for mode in [
        LossAggMode::TokenMean,
        LossAggMode::SeqMeanTokenSum,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ] {
        let c = cfg(|c| {
            c.loss_agg_mode = Some(mode);
            c.beta = 0.05;
            c.kl_estimator = KlEstimator::K2;
            c.entropy_coef = 0.01;
        });
        check_rlvr(&format!("agg {mode:?}"), &d, &c, false);
    }
}

// ------------------------------------------------------------------------------ hint

const K: usize = 3;
const V: usize = 8;

#[derive(Clone)]
struct HintData {
    lp: Vec<f64>,
    old: Vec<f64>,
    student: Vec<f64>,
    teacher: Vec<f64>,
    teacher_token: Vec<f64>,
    mask: Vec<f64>,
    has_hint: Vec<bool>,
    k: usize,
}

fn log_softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let ls = x.iter().map(|v| (v - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|v| v - ls).collect()
}

/// Student/teacher log-probs at the student's top-K ids (or the full vocabulary).
fn hint_data(seed: u64, full: bool) -> HintData {
    let mut rng = Rng(seed);
    let k = if full { V } else { K };
    let (mut student, mut teacher, mut lp, mut tt) = (vec![], vec![], vec![], vec![]);
    for _ in 0..B * T {
        let s_logits: Vec<f64> = (0..V).map(|_| 1.5 * rng.normal()).collect();
        let t_logits: Vec<f64> = s_logits.iter().map(|x| x + rng.normal()).collect();
        let (ls, lt) = (log_softmax(&s_logits), log_softmax(&t_logits));
        let mut ids: Vec<usize> = (0..V).collect();
        if !full {
            ids.sort_by(|a, b| ls[*b].total_cmp(&ls[*a]));
            ids.truncate(K);
        }
        student.extend(ids.iter().map(|&i| ls[i]));
        teacher.extend(ids.iter().map(|&i| lt[i]));
        let y = (rng.next_u64() % V as u64) as usize;
        lp.push(ls[y]);
        tt.push(lt[y]);
    }
    let old = lp.iter().map(|x| x + 0.8 * rng.normal()).collect();
    let base = rlvr_data(seed, 0.1, 0.1);
    HintData {
        lp,
        old,
        student,
        teacher,
        teacher_token: tt,
        mask: base.mask,
        has_hint: vec![true, false, true, true],
        k,
    }
}

fn hint_inputs_from(
    d: &HintData,
    lp: Tensor,
    old: Tensor,
    s: Tensor,
    t: Tensor,
    tt: Tensor,
) -> LossInputs {
    let mut x = LossInputs::new(lp, tensor(&[0.0; B], &[B]), tensor(&d.mask, &[B, T]));
    x.old_logprobs = Some(old);
    x.hint = Some(HintInputs {
        student_topk_logprobs: Some(s),
        teacher_topk_logprobs: Some(t),
        topk_ids: None,
        teacher_token_logprobs: Some(tt),
        has_hint: d.has_hint.clone(),
    });
    x
}

fn hint_value(d: &HintData, cfg: &HintConfig) -> f64 {
    let (s2, s3) = ([B, T], [B, T, d.k]);
    let x = hint_inputs_from(
        d,
        tensor(&d.lp, &s2),
        tensor(&d.old, &s2),
        tensor(&d.student, &s3),
        tensor(&d.teacher, &s3),
        tensor(&d.teacher_token, &s2),
    );
    flat(&hint_loss(&x, cfg).unwrap().0)[0]
}

/// Returns (grad trainer log-probs, grad student top-K).
fn check_hint(name: &str, d: &HintData, cfg: &HintConfig) -> (Vec<f64>, Vec<f64>) {
    let (s2, s3) = ([B, T], [B, T, d.k]);
    let (lp, old, st, te, tt) = (
        var(&d.lp, &s2),
        var(&d.old, &s2),
        var(&d.student, &s3),
        var(&d.teacher, &s3),
        var(&d.teacher_token, &s2),
    );
    let x = hint_inputs_from(
        d,
        lp.as_tensor().clone(),
        old.as_tensor().clone(),
        st.as_tensor().clone(),
        te.as_tensor().clone(),
        tt.as_tensor().clone(),
    );
    let (loss, _) = hint_loss(&x, cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
    let grads = loss.backward().unwrap();
    assert_no_grad(&grads, &old, &format!("{name}: old_logprobs"));
    assert_no_grad(&grads, &te, &format!("{name}: teacher_topk_logprobs"));
    assert_no_grad(&grads, &tt, &format!("{name}: teacher_token_logprobs"));
    let g_lp = grad_or_zero(&grads, &lp, B * T);
    let g_st = grad_or_zero(&grads, &st, B * T * d.k);
    // Trainer log-probs: the IS weight and the sampled-token coefficient are detached; shift
    // old and teacher-token log-probs along to hold them fixed.
    fd_check(
        &format!("{name}: d/d trainer_logprobs"),
        &d.lp,
        &g_lp,
        |x| {
            let mut d2 = d.clone();
            d2.lp = x.to_vec();
            d2.old = shifted(&d.old, x, &d.lp);
            d2.teacher_token = shifted(&d.teacher_token, x, &d.lp);
            hint_value(&d2, cfg)
        },
    );
    fd_check(
        &format!("{name}: d/d student_topk"),
        &d.student,
        &g_st,
        |x| {
            let mut d2 = d.clone();
            d2.student = x.to_vec();
            hint_value(&d2, cfg)
        },
    );
    // Samples without a hint get no gradient at all.
    for (i, h) in d.has_hint.iter().enumerate() {
        if !h {
            assert!(g_lp[i * T..(i + 1) * T].iter().all(|x| *x == 0.0), "{name}");
            let kk = T * d.k;
            assert!(
                g_st[i * kk..(i + 1) * kk].iter().all(|x| *x == 0.0),
                "{name}"
            );
        }
    }
    (g_lp, g_st)
}

#[test]
fn hint_divergences() {
    for (support, full) in [
        (HintSupport::TopkTail, false),
        (HintSupport::TopkRenormalized, false),
        (HintSupport::Full, true),
    ] {
        let d = hint_data(10 + full as u64, full);
        for (divergence, alpha) in [
            (HintDivergence::ForwardKl, 0.5),
            (HintDivergence::ReverseKl, 0.5),
            (HintDivergence::Jsd, 0.5),
            (HintDivergence::Jsd, 0.3),
        ] {
            for is_clip in [Some(2.0), Some(1.2), None] {
                let cfg = HintConfig {
                    divergence,
                    alpha,
                    support,
                    is_clip,
                    // Both aggregations, on alternating caps.
                    loss_agg_mode: if is_clip == Some(1.2) {
                        DistillationAgg::TokenMean
                    } else {
                        DistillationAgg::SeqMeanTokenMean
                    },
                };
                let name = format!("hint {divergence:?} α={alpha} {support:?} cap={is_clip:?}");
                let (g_lp, g_st) = check_hint(&name, &d, &cfg);
                // The trainer's sampled-token log-prob enters only through the detached IS
                // weight: no gradient; all of it goes to the top-K rows.
                assert!(g_lp.iter().all(|x| *x == 0.0), "{name}");
                assert!(g_st.iter().any(|x| *x != 0.0), "{name}");
            }
        }
    }
}

#[test]
fn hint_sampled_token_form() {
    let d = hint_data(20, false);
    for is_clip in [Some(2.0), None] {
        let cfg = HintConfig {
            divergence: HintDivergence::SampledToken,
            is_clip,
            // The closed form below is the token mean over every hinted token.
            loss_agg_mode: composer_loss::DistillationAgg::TokenMean,
            ..Default::default()
        };
        let (g_lp, g_st) = check_hint(&format!("sampled token cap={is_clip:?}"), &d, &cfg);
        assert!(g_st.iter().all(|x| *x == 0.0));
        // The naive derivative of the same value (coefficient differentiated too) differs.
        let naive = fd_grad(&d.lp, |x| {
            hint_value(
                &HintData {
                    lp: x.to_vec(),
                    ..d.clone()
                },
                &cfg,
            )
        });
        let gap = naive
            .iter()
            .zip(&g_lp)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(gap > 1e-3, "sampled token: detach has no effect ({gap})");
        // ∇ = sg(log π_S − log π_T)·w·m / N exactly.
        let m: Vec<f64> = (0..B * T)
            .map(|k| d.mask[k] * f64::from(u8::from(d.has_hint[k / T])))
            .collect();
        let n: f64 = m.iter().sum();
        for (k, gk) in g_lp.iter().enumerate() {
            let w = is_clip.map_or(1.0, |c| (d.lp[k] - d.old[k]).exp().min(c));
            let want = (d.lp[k] - d.teacher_token[k]) * w * m[k] / n;
            assert!((gk - want).abs() < 1e-12, "[{k}] {gk} vs {want}");
        }
    }
}

// ------------------------------------------------------------------------------ replay

#[derive(Clone)]
struct DpoData {
    pc: Vec<f64>,
    pr: Vec<f64>,
    rc: Vec<f64>,
    rr: Vec<f64>,
}

fn dpo_data(seed: u64) -> DpoData {
    let mut rng = Rng(seed);
    let p = 6;
    let pc: Vec<f64> = (0..p).map(|_| -20.0 + 5.0 * rng.normal()).collect();
    let pr: Vec<f64> = (0..p).map(|_| -22.0 + 5.0 * rng.normal()).collect();
    let rc = pc.iter().map(|x| x + 2.0 * rng.normal()).collect();
    let rr = pr.iter().map(|x| x + 2.0 * rng.normal()).collect();
    DpoData { pc, pr, rc, rr }
}

fn dpo_inputs_from(d: &DpoData, pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor) -> DpoInputs {
    DpoInputs {
        policy_chosen_logps: pc,
        policy_rejected_logps: pr,
        ref_chosen_logps: rc,
        ref_rejected_logps: rr,
        chosen_lengths: vec![12, 7, 20, 3, 9, 1][..d.pc.len()].to_vec(),
        rejected_lengths: vec![9, 15, 4, 11, 2, 6][..d.pc.len()].to_vec(),
    }
}

fn dpo_plain(d: &DpoData) -> DpoInputs {
    let p = [d.pc.len()];
    dpo_inputs_from(
        d,
        tensor(&d.pc, &p),
        tensor(&d.pr, &p),
        tensor(&d.rc, &p),
        tensor(&d.rr, &p),
    )
}

#[test]
fn dpo_family() {
    let d = dpo_data(30);
    let p = [d.pc.len()];
    for (loss_type, beta) in [
        (DpoLossType::Sigmoid, 0.1),
        (DpoLossType::Sigmoid, 2.0),
        (DpoLossType::Ipo, 0.1),
        (DpoLossType::Hinge, 0.3),
    ] {
        let cfg = DpoConfig { loss_type, beta };
        let name = format!("dpo {loss_type:?} β={beta}");
        let (pc, pr, rc, rr) = (
            var(&d.pc, &p),
            var(&d.pr, &p),
            var(&d.rc, &p),
            var(&d.rr, &p),
        );
        let x = dpo_inputs_from(
            &d,
            pc.as_tensor().clone(),
            pr.as_tensor().clone(),
            rc.as_tensor().clone(),
            rr.as_tensor().clone(),
        );
        let grads = dpo_loss(&x, &cfg).unwrap().0.backward().unwrap();
        assert_no_grad(&grads, &rc, &format!("{name}: ref_chosen"));
        assert_no_grad(&grads, &rr, &format!("{name}: ref_rejected"));
        let value = |d2: &DpoData| flat(&dpo_loss(&dpo_plain(d2), &cfg).unwrap().0)[0];
        let gc = grad_or_zero(&grads, &pc, p[0]);
        let gr = grad_or_zero(&grads, &pr, p[0]);
        fd_check(&format!("{name}: chosen"), &d.pc, &gc, |x| {
            value(&DpoData {
                pc: x.to_vec(),
                ..d.clone()
            })
        });
        fd_check(&format!("{name}: rejected"), &d.pr, &gr, |x| {
            value(&DpoData {
                pr: x.to_vec(),
                ..d.clone()
            })
        });
        assert!(gc.iter().any(|x| *x != 0.0), "{name}");
    }
}

#[derive(Clone)]
struct TeacherKlData {
    student: Vec<f64>,
    teacher: Vec<f64>,
    mask: Vec<f64>,
    teachers: Vec<String>,
}

/// Student log-probs at the teacher's recorded top-K ids.
fn teacher_kl_data(seed: u64) -> TeacherKlData {
    let mut rng = Rng(seed);
    let (mut student, mut teacher) = (vec![], vec![]);
    for _ in 0..B * T {
        let ls = log_softmax(&(0..V).map(|_| 1.5 * rng.normal()).collect::<Vec<_>>());
        let lt = log_softmax(&(0..V).map(|_| 1.5 * rng.normal()).collect::<Vec<_>>());
        let mut ids: Vec<usize> = (0..V).collect();
        ids.sort_by(|a, b| lt[*b].total_cmp(&lt[*a]));
        student.extend(ids[..K].iter().map(|&i| ls[i]));
        teacher.extend(ids[..K].iter().map(|&i| lt[i]));
    }
    TeacherKlData {
        student,
        teacher,
        mask: rlvr_data(seed, 0.1, 0.1).mask,
        teachers: ["alpha", "beta", "alpha", "gamma"]
            .map(String::from)
            .to_vec(),
    }
}

fn teacher_kl_from(d: &TeacherKlData, s: Tensor, t: Tensor) -> TeacherKlInputs {
    TeacherKlInputs {
        student_topk_logprobs: s,
        teacher_topk_logprobs: t,
        loss_mask: tensor(&d.mask, &[B, T]),
        teachers: d.teachers.clone(),
    }
}

#[test]
fn replay_teacher_kl_and_channel() {
    let d = teacher_kl_data(40);
    let s3 = [B, T, K];
    let weights: BTreeMap<String, f64> = [("alpha".to_string(), 1.0), ("beta".to_string(), 0.5)]
        .into_iter()
        .collect();
    for (support, agg) in [
        (HintSupport::TopkTail, DistillationAgg::SeqMeanTokenMean),
        (
            HintSupport::TopkRenormalized,
            DistillationAgg::SeqMeanTokenMean,
        ),
        (HintSupport::TopkTail, DistillationAgg::TokenMean),
    ] {
        let name = format!("teacher kl {support:?} {agg:?}");
        let (st, te) = (var(&d.student, &s3), var(&d.teacher, &s3));
        let x = teacher_kl_from(&d, st.as_tensor().clone(), te.as_tensor().clone());
        let grads = teacher_kl_loss(&x, support, &weights, agg)
            .unwrap()
            .0
            .backward()
            .unwrap();
        assert_no_grad(&grads, &te, &format!("{name}: teacher"));
        let g = grad_or_zero(&grads, &st, B * T * K);
        fd_check(&name, &d.student, &g, |xs| {
            let x = teacher_kl_from(&d, tensor(xs, &s3), tensor(&d.teacher, &s3));
            flat(&teacher_kl_loss(&x, support, &weights, agg).unwrap().0)[0]
        });
    }

    // The whole channel: dpo_coef·L_dpo + kl_coef·L_kl.
    let dd = dpo_data(41);
    let p = [dd.pc.len()];
    let cfg = ReplayConfig {
        dpo_coef: 0.7,
        kl_coef: 0.3,
        teacher_weights: weights.clone(),
        ..Default::default()
    };
    let (pc, pr, st) = (var(&dd.pc, &p), var(&dd.pr, &p), var(&d.student, &s3));
    let build = |pc: Tensor, pr: Tensor, st: Tensor| ReplayInputs {
        dpo: Some(dpo_inputs_from(
            &dd,
            pc,
            pr,
            tensor(&dd.rc, &p),
            tensor(&dd.rr, &p),
        )),
        teacher_kl: Some(teacher_kl_from(&d, st, tensor(&d.teacher, &s3))),
    };
    let x = build(
        pc.as_tensor().clone(),
        pr.as_tensor().clone(),
        st.as_tensor().clone(),
    );
    let grads = replay_loss(&x, &cfg).unwrap().0.backward().unwrap();
    let value = |pcv: &[f64], prv: &[f64], stv: &[f64]| {
        let x = build(tensor(pcv, &p), tensor(prv, &p), tensor(stv, &s3));
        flat(&replay_loss(&x, &cfg).unwrap().0)[0]
    };
    fd_check(
        "replay chosen",
        &dd.pc,
        &grad_or_zero(&grads, &pc, p[0]),
        |x| value(x, &dd.pr, &d.student),
    );
    fd_check(
        "replay rejected",
        &dd.pr,
        &grad_or_zero(&grads, &pr, p[0]),
        |x| value(&dd.pc, x, &d.student),
    );
    fd_check(
        "replay student",
        &d.student,
        &grad_or_zero(&grads, &st, B * T * K),
        |x| value(&dd.pc, &dd.pr, x),
    );
}

// ------------------------------------------------------------------------------ composer

#[test]
fn composer_sum_gradient() {
    let rd = rlvr_data(50, 0.3, 0.25);
    let hd = hint_data(51, false);
    let td = teacher_kl_data(52);
    let dd = dpo_data(53);
    let (s2, s3, p) = ([B, T], [B, T, K], [dd.pc.len()]);
    let scale = LossScale::local(&rlvr_plain(&rd), false).unwrap();

    // Everything the composer reads, from flat values; trainables as one tuple.
    struct Trainables<'a> {
        lp: &'a [f64],
        hint_student: &'a [f64],
        chosen: &'a [f64],
        replay_student: &'a [f64],
    }
    let build = |tr: [Tensor; 4]| -> LossInputs {
        let [lp, hs, pc, rs] = tr;
        let mut x = rlvr_inputs_from(
            &rd,
            lp,
            tensor(&rd.old, &s2),
            tensor(&rd.sampler, &s2),
            tensor(&rd.reference, &s2),
            tensor(&rd.entropies, &s2),
        );
        x.hint = Some(HintInputs {
            student_topk_logprobs: Some(hs),
            teacher_topk_logprobs: Some(tensor(&hd.teacher, &s3)),
            topk_ids: None,
            teacher_token_logprobs: None,
            has_hint: hd.has_hint.clone(),
        });
        x.replay = Some(ReplayInputs {
            dpo: Some(dpo_inputs_from(
                &dd,
                pc,
                tensor(&dd.pr, &p),
                tensor(&dd.rc, &p),
                tensor(&dd.rr, &p),
            )),
            teacher_kl: Some(teacher_kl_from(&td, rs, tensor(&td.teacher, &s3))),
        });
        x
    };
    let mut cfg = ComposerConfig {
        use_rlvr: true,
        use_hint: true,
        use_replay: true,
        hint_coef: 0.6,
        replay_coef: 0.25,
        ..Default::default()
    };
    cfg.rlvr.beta = 0.05;
    cfg.rlvr.entropy_coef = 0.01;
    // The hint IS weight detaches a function of the trainer log-probs that the RLVR ratio
    // differentiates; without it one finite difference checks the whole sum.
    cfg.hint.is_clip = None;
    let value = |t: &Trainables| -> f64 {
        let x = build([
            tensor(t.lp, &s2),
            tensor(t.hint_student, &s3),
            tensor(t.chosen, &p),
            tensor(t.replay_student, &s3),
        ]);
        flat(&composer_loss(&x, &cfg, &scale).unwrap().0)[0]
    };
    let vars = [
        var(&rd.lp, &s2),
        var(&hd.student, &s3),
        var(&dd.pc, &p),
        var(&td.student, &s3),
    ];
    let x = build(vars.clone().map(|v| v.as_tensor().clone()));
    let (loss, metrics) = composer_loss(&x, &cfg, &scale).unwrap();
    assert!(metrics.rlvr.is_some() && metrics.hint.is_some() && metrics.replay.is_some());
    let grads = loss.backward().unwrap();
    let g: Vec<Vec<f64>> = vars
        .iter()
        .map(|v| grad_or_zero(&grads, v, v.elem_count()))
        .collect();
    let base = Trainables {
        lp: &rd.lp,
        hint_student: &hd.student,
        chosen: &dd.pc,
        replay_student: &td.student,
    };
    fd_check("composer lp", &rd.lp, &g[0], |x| {
        value(&Trainables { lp: x, ..base })
    });
    fd_check("composer hint student", &hd.student, &g[1], |x| {
        value(&Trainables {
            hint_student: x,
            ..base
        })
    });
    fd_check("composer chosen", &dd.pc, &g[2], |x| {
        value(&Trainables { chosen: x, ..base })
    });
    fd_check("composer replay student", &td.student, &g[3], |x| {
        value(&Trainables {
            replay_student: x,
            ..base
        })
    });

    // With the hint IS weight on, the composer's gradient is still the weighted sum of the
    // channels' gradients (each checked against finite differences above).
    cfg.hint.is_clip = Some(2.0);
    let x = build(vars.clone().map(|v| v.as_tensor().clone()));
    let total = composer_loss(&x, &cfg, &scale)
        .unwrap()
        .0
        .backward()
        .unwrap();
    let r = rlvr_loss(&x, &cfg.rlvr, &scale).unwrap().0;
    let h = (hint_loss(&x, &cfg.hint).unwrap().0 * cfg.hint_coef).unwrap();
    let rp = (replay_loss(x.replay.as_ref().unwrap(), &cfg.replay)
        .unwrap()
        .0
        * cfg.replay_coef)
        .unwrap();
    let sum = ((r + h).unwrap() + rp).unwrap().backward().unwrap();
    for v in &vars {
        let a = grad_or_zero(&total, v, v.elem_count());
        let b = grad_or_zero(&sum, v, v.elem_count());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-12);
        }
    }
}
