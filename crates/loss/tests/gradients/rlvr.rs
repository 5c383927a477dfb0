//! The RLVR policy-gradient loss: loss types, clipping, detached coefficients, importance
//! corrections, KL estimators, aggregation modes.

use super::*;

#[derive(Clone)]
pub(crate) struct RlvrData {
    pub(crate) lp: Vec<f64>,
    pub(crate) old: Vec<f64>,
    pub(crate) sampler: Vec<f64>,
    pub(crate) reference: Vec<f64>,
    pub(crate) entropies: Vec<f64>,
    pub(crate) advantages: Vec<f64>,
    pub(crate) mask: Vec<f64>,
    pub(crate) truncated: Vec<bool>,
}

pub(crate) fn rlvr_data(seed: u64, old_noise: f64, sampler_noise: f64) -> RlvrData {
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

pub(crate) fn rlvr_inputs_from(
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

pub(crate) fn rlvr_plain(d: &RlvrData) -> LossInputs {
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

pub(crate) fn rlvr_value(d: &RlvrData, cfg: &RlvrConfig, scale: &LossScale) -> f64 {
    let (l, _) = rlvr_loss(&rlvr_plain(d), cfg, scale).unwrap();
    flat(&l)[0]
}

/// Returns the backward gradient w.r.t. the trainer log-probs (after checking it).
pub(crate) fn check_rlvr(name: &str, d: &RlvrData, cfg: &RlvrConfig, co_shift: bool) -> Vec<f64> {
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

pub(crate) fn cfg(f: impl FnOnce(&mut RlvrConfig)) -> RlvrConfig {
    let mut c = RlvrConfig {
        sampler_importance_sampling_correction: false,
        ..Default::default()
    };
    f(&mut c);
    c
}

#[test]
pub(crate) fn rlvr_loss_types_and_clipping() {
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
pub(crate) fn rlvr_dual_clip_bounds_negative_advantage_tokens() {
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
pub(crate) fn rlvr_detached_coefficients_cispo_vespo() {
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
pub(crate) fn rlvr_sampler_importance_correction_modes() {
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
pub(crate) fn rlvr_kl_estimators_and_entropy() {
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
pub(crate) fn rlvr_verl_aggregation_modes() {
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
