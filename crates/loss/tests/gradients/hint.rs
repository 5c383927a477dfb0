//! The hint self-distillation channel: divergences and the sampled-token form.

use super::rlvr::*;
use super::*;

pub(crate) const K: usize = 3;
pub(crate) const V: usize = 8;

#[derive(Clone)]
pub(crate) struct HintData {
    pub(crate) lp: Vec<f64>,
    pub(crate) old: Vec<f64>,
    pub(crate) student: Vec<f64>,
    pub(crate) teacher: Vec<f64>,
    pub(crate) teacher_token: Vec<f64>,
    pub(crate) mask: Vec<f64>,
    pub(crate) has_hint: Vec<bool>,
    pub(crate) k: usize,
}

pub(crate) fn log_softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let ls = x.iter().map(|v| (v - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|v| v - ls).collect()
}

/// Student/teacher log-probs at the student's top-K ids (or the full vocabulary).
pub(crate) fn hint_data(seed: u64, full: bool) -> HintData {
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

pub(crate) fn hint_inputs_from(
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

pub(crate) fn hint_value(d: &HintData, cfg: &HintConfig) -> f64 {
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
pub(crate) fn check_hint(name: &str, d: &HintData, cfg: &HintConfig) -> (Vec<f64>, Vec<f64>) {
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
pub(crate) fn hint_divergences() {
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
pub(crate) fn hint_sampled_token_form() {
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
