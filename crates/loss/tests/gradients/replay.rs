//! The replay channel: the DPO family and the teacher KL.

use super::hint::*;
use super::rlvr::*;
use super::*;

#[derive(Clone)]
pub(crate) struct DpoData {
    pub(crate) pc: Vec<f64>,
    pub(crate) pr: Vec<f64>,
    pub(crate) rc: Vec<f64>,
    pub(crate) rr: Vec<f64>,
}

pub(crate) fn dpo_data(seed: u64) -> DpoData {
    let mut rng = Rng(seed);
    let p = 6;
    let pc: Vec<f64> = (0..p).map(|_| -20.0 + 5.0 * rng.normal()).collect();
    let pr: Vec<f64> = (0..p).map(|_| -22.0 + 5.0 * rng.normal()).collect();
    let rc = pc.iter().map(|x| x + 2.0 * rng.normal()).collect();
    let rr = pr.iter().map(|x| x + 2.0 * rng.normal()).collect();
    DpoData { pc, pr, rc, rr }
}

pub(crate) fn dpo_inputs_from(
    d: &DpoData,
    pc: Tensor,
    pr: Tensor,
    rc: Tensor,
    rr: Tensor,
) -> DpoInputs {
    DpoInputs {
        policy_chosen_logps: pc,
        policy_rejected_logps: pr,
        ref_chosen_logps: rc,
        ref_rejected_logps: rr,
        chosen_lengths: vec![12, 7, 20, 3, 9, 1][..d.pc.len()].to_vec(),
        rejected_lengths: vec![9, 15, 4, 11, 2, 6][..d.pc.len()].to_vec(),
    }
}

pub(crate) fn dpo_plain(d: &DpoData) -> DpoInputs {
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
pub(crate) fn dpo_family() {
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
pub(crate) struct TeacherKlData {
    pub(crate) student: Vec<f64>,
    pub(crate) teacher: Vec<f64>,
    pub(crate) mask: Vec<f64>,
    pub(crate) teachers: Vec<String>,
}

/// Student log-probs at the teacher's recorded top-K ids.
pub(crate) fn teacher_kl_data(seed: u64) -> TeacherKlData {
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

pub(crate) fn teacher_kl_from(d: &TeacherKlData, s: Tensor, t: Tensor) -> TeacherKlInputs {
    TeacherKlInputs {
        student_topk_logprobs: s,
        teacher_topk_logprobs: t,
        loss_mask: tensor(&d.mask, &[B, T]),
        teachers: d.teachers.clone(),
    }
}

#[test]
pub(crate) fn replay_teacher_kl_and_channel() {
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
