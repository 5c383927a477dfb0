//! The three channels' sum: one backward through every channel's trainables.

use super::hint::*;
use super::replay::*;
use super::rlvr::*;
use super::*;

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
