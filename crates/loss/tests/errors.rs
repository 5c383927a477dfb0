//! Bad inputs and configurations are errors that name the field, key or tensor at fault.
use candle_core::{DType, Device, Tensor};
use composer_loss::*;

fn inputs(b: usize, t: usize) -> LossInputs {
    let dev = Device::Cpu;
    LossInputs::new(
        Tensor::full(-0.5f64, (b, t), &dev).unwrap(),
        Tensor::ones(b, DType::F64, &dev).unwrap(),
        Tensor::ones((b, t), DType::F64, &dev).unwrap(),
    )
}

fn err_of<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.unwrap_err().to_string()
}

fn contains(err: String, what: &str) {
    assert!(err.contains(what), "wanted {what:?} in: {err}");
}

#[test]
fn rlvr_bad_inputs() {
    let local = |x: &LossInputs| LossScale::local(x, false).unwrap();
    let x = inputs(2, 3);
    let s = local(&x);
    let kl = RlvrConfig {
        beta: 0.1,
        ..Default::default()
    };
    contains(err_of(rlvr_loss(&x, &kl, &s)), "ref_logprobs");
    let ent = RlvrConfig {
        entropy_coef: 0.1,
        ..Default::default()
    };
    contains(err_of(rlvr_loss(&x, &ent, &s)), "entropies");
    let q = RlvrConfig {
        top_entropy_quantile: 0.2,
        ..Default::default()
    };
    contains(err_of(rlvr_loss(&x, &q, &s)), "entropies");
    for (cfg, key) in [
        (
            RlvrConfig {
                epsilon: -0.1,
                ..Default::default()
            },
            "epsilon",
        ),
        (
            RlvrConfig {
                top_entropy_quantile: 1.5,
                ..Default::default()
            },
            "top_entropy_quantile",
        ),
        (
            RlvrConfig {
                dual_clip: true,
                clip_ratio_c: 0.9,
                ..Default::default()
            },
            "clip_ratio_c",
        ),
        (
            RlvrConfig {
                loss_type: LossType::DrGrpo,
                max_completion_length: 0,
                ..Default::default()
            },
            "max_completion_length",
        ),
        (
            RlvrConfig {
                sapo_temperature_neg: 0.0,
                ..Default::default()
            },
            "sapo_temperature",
        ),
    ] {
        contains(err_of(rlvr_loss(&x, &cfg, &s)), key);
    }
    // VESPO needs a token-level sampler correction (as TRL).
    let mut xs = inputs(2, 3);
    xs.sampler_logprobs = Some(Tensor::full(-0.4f64, (2, 3), &Device::Cpu).unwrap());
    let v = RlvrConfig {
        loss_type: LossType::Vespo,
        ..Default::default()
    };
    contains(
        err_of(rlvr_loss(&xs, &v, &s)),
        "sampler_importance_sampling_mode",
    );
    // Shapes and flags.
    let mut bad = inputs(2, 3);
    bad.old_logprobs = Some(Tensor::zeros((2, 4), DType::F64, &Device::Cpu).unwrap());
    contains(err_of(bad.validate()), "old_logprobs");
    let mut bad = inputs(2, 3);
    bad.advantages = Tensor::zeros(3, DType::F64, &Device::Cpu).unwrap();
    contains(err_of(bad.validate()), "advantages");
    let mut bad = inputs(2, 3);
    bad.truncated = Some(vec![true]);
    contains(err_of(bad.validate()), "truncated");
    let mut bad = inputs(2, 3);
    bad.trainer_logprobs = Tensor::zeros(6, DType::F64, &Device::Cpu).unwrap();
    contains(err_of(bad.validate()), "trainer_logprobs");
    let mut bad = inputs(2, 3);
    bad.trainer_logprobs = Tensor::zeros((2, 3), DType::U32, &Device::Cpu).unwrap();
    contains(err_of(bad.validate()), "trainer_logprobs");
}

#[test]
fn hint_and_composer_bad_inputs() {
    let x = inputs(2, 3);
    contains(err_of(hint_loss(&x, &HintConfig::default())), "hint");
    let mut h = inputs(2, 3);
    h.hint = Some(HintInputs {
        student_topk_logprobs: None,
        teacher_topk_logprobs: None,
        topk_ids: None,
        teacher_token_logprobs: None,
        has_hint: vec![true, true],
    });
    contains(
        err_of(hint_loss(&h, &HintConfig::default())),
        "hint.student_topk_logprobs",
    );
    let st = HintConfig {
        divergence: HintDivergence::SampledToken,
        ..Default::default()
    };
    contains(err_of(hint_loss(&h, &st)), "hint.teacher_token_logprobs");
    let jsd = HintConfig {
        alpha: 1.0,
        ..Default::default()
    };
    contains(err_of(hint_loss(&h, &jsd)), "alpha");
    if let Some(hi) = h.hint.as_mut() {
        hi.has_hint = vec![true];
    }
    contains(err_of(hint_loss(&h, &st)), "hint.has_hint");

    let s = LossScale::local(&x, false).unwrap();
    let off = ComposerConfig {
        use_rlvr: false,
        ..Default::default()
    };
    contains(err_of(composer_loss(&x, &off, &s)), "use_rlvr");
    let replay = ComposerConfig {
        use_replay: true,
        ..Default::default()
    };
    contains(err_of(composer_loss(&x, &replay, &s)), "replay");
    let hint = ComposerConfig {
        use_hint: true,
        ..Default::default()
    };
    contains(err_of(composer_loss(&x, &hint, &s)), "hint");
    contains(
        err_of(replay_loss(
            &ReplayInputs::default(),
            &ReplayConfig::default(),
        )),
        "replay",
    );
}

#[test]
fn replay_and_advantage_bad_inputs() {
    let dev = Device::Cpu;
    let p = |n: usize| Tensor::full(-10.0f64, n, &dev).unwrap();
    let d = DpoInputs {
        policy_chosen_logps: p(2),
        policy_rejected_logps: p(3),
        ref_chosen_logps: p(2),
        ref_rejected_logps: p(2),
        chosen_lengths: vec![1, 1],
        rejected_lengths: vec![1, 1],
    };
    contains(
        err_of(dpo_loss(&d, &DpoConfig::default())),
        "policy_rejected_logps",
    );
    let d = DpoInputs {
        policy_rejected_logps: p(2),
        rejected_lengths: vec![1],
        ..d
    };
    let zero = DpoConfig {
        beta: 0.0,
        ..Default::default()
    };
    contains(err_of(dpo_loss(&d, &zero)), "beta");
    let ipo = DpoConfig {
        loss_type: DpoLossType::Ipo,
        ..Default::default()
    };
    contains(err_of(dpo_loss(&d, &ipo)), "rejected_lengths");
    let k = TeacherKlInputs {
        student_topk_logprobs: Tensor::full(-2.0f64, (2, 3, 2), &dev).unwrap(),
        teacher_topk_logprobs: Tensor::full(-2.0f64, (2, 3, 2), &dev).unwrap(),
        loss_mask: Tensor::ones((2, 3), DType::F64, &dev).unwrap(),
        teachers: vec!["a".into()],
    };
    contains(
        err_of(teacher_kl_loss(
            &k,
            HintSupport::TopkTail,
            &Default::default(),
            DistillationAgg::default(),
        )),
        "teachers",
    );

    contains(
        err_of(group_advantages(&[1.0, 0.0, 1.0], 2, StdScaling::Group)),
        "rewards",
    );
    contains(
        err_of(group_advantages(&[1.0, f64::NAN], 2, StdScaling::Group)),
        "rewards",
    );
    contains(err_of(opo_advantages(&[1.0, 0.0], &[3], 2)), "lengths");
    contains(
        err_of(reinforce_plus_plus_advantages(&[1.0], &[1])),
        "lengths",
    );
    let cfg = AdvantageConfig {
        reward_weights: Some(vec![1.0, 2.0]),
        ..Default::default()
    };
    contains(
        err_of(compute_advantages(
            &cfg,
            &[vec![1.0], vec![0.0]],
            &[1, 1],
            2,
        )),
        "reward_weights",
    );
    contains(
        err_of(compute_advantages(
            &AdvantageConfig::default(),
            &[vec![1.0], vec![0.0, 1.0]],
            &[1, 1],
            2,
        )),
        "rewards_per_func",
    );
    contains(err_of(filter_zero_variance_groups(&[1.0; 3], 0)), "rewards");
}

#[test]
fn configs_reject_unknown_keys() {
    let e = serde_json::from_str::<RlvrConfig>(r#"{"loss_typ": "dapo"}"#).unwrap_err();
    assert!(e.to_string().contains("loss_typ"), "{e}");
    let e = serde_json::from_str::<ComposerConfig>(r#"{"rlvr": {"epsilonn": 0.1}}"#).unwrap_err();
    assert!(e.to_string().contains("epsilonn"), "{e}");
    let c: RlvrConfig = serde_json::from_str(
        r#"{"loss_type": "dppo_kl", "vllm_importance_sampling_mode": "token_mask",
            "kl_estimator": "low_var_kl"}"#,
    )
    .unwrap();
    assert_eq!(c.loss_type, LossType::Dppo);
    assert_eq!(c.sampler_importance_sampling_mode, SamplerIsMode::TokenMask);
    assert_eq!(c.kl_estimator, KlEstimator::K3);
}

/// Every config float is checked by `validate` before the first loss, NaN included (a `<= 0`
/// test lets NaN through), and the error names the key.
#[test]
fn configs_validate_ranges_and_nan() {
    let key_of = |r: Result<()>| r.unwrap_err().to_string();
    for (cfg, key) in [
        (
            RlvrConfig {
                beta: f64::NAN,
                ..Default::default()
            },
            "beta",
        ),
        (
            RlvrConfig {
                entropy_coef: f64::NAN,
                ..Default::default()
            },
            "entropy_coef",
        ),
        (
            RlvrConfig {
                epsilon: f64::INFINITY,
                ..Default::default()
            },
            "epsilon",
        ),
        (
            RlvrConfig {
                delta: Some(0.5),
                ..Default::default()
            },
            "delta",
        ),
        (
            RlvrConfig {
                kl_clamp: Some(-1.0),
                ..Default::default()
            },
            "kl_clamp",
        ),
        (
            RlvrConfig {
                clip_cov_ratio: f64::NAN,
                ..Default::default()
            },
            "clip_cov_ratio",
        ),
        (
            RlvrConfig {
                clip_cov_lb: 6.0,
                ..Default::default()
            },
            "clip_cov_lb",
        ),
        (
            RlvrConfig {
                loss_scale_factor: Some(f64::NAN),
                ..Default::default()
            },
            "loss_scale_factor",
        ),
    ] {
        contains(key_of(cfg.validate()), key);
    }
    RlvrConfig::default().validate().unwrap();

    for (cfg, key) in [
        (
            HintConfig {
                alpha: 5.0,
                ..Default::default()
            },
            "alpha",
        ),
        (
            HintConfig {
                divergence: HintDivergence::ReverseKl,
                alpha: f64::NAN,
                ..Default::default()
            },
            "alpha",
        ),
        (
            HintConfig {
                is_clip: Some(-1.0),
                ..Default::default()
            },
            "is_clip",
        ),
    ] {
        contains(key_of(cfg.validate()), key);
    }
    HintConfig::default().validate().unwrap();

    let nan_beta = DpoConfig {
        beta: f64::NAN,
        ..Default::default()
    };
    contains(key_of(nan_beta.validate()), "beta");
    for (cfg, key) in [
        (
            ReplayConfig {
                dpo: nan_beta.clone(),
                ..Default::default()
            },
            "dpo.beta",
        ),
        (
            ReplayConfig {
                kl_coef: -1.0,
                ..Default::default()
            },
            "kl_coef",
        ),
        (
            ReplayConfig {
                teacher_weights: [("t".to_string(), f64::NAN)].into(),
                ..Default::default()
            },
            "teacher_weights",
        ),
    ] {
        contains(key_of(cfg.validate()), key);
    }
    ReplayConfig::default().validate().unwrap();

    let adv = |std_epsilon: f64, w: Option<Vec<f64>>| AdvantageConfig {
        std_epsilon,
        reward_weights: w,
        ..Default::default()
    };
    contains(key_of(adv(-1.0, None).validate(None)), "std_epsilon");
    contains(key_of(adv(f64::NAN, None).validate(None)), "std_epsilon");
    contains(
        key_of(adv(1e-4, Some(vec![f64::NAN])).validate(None)),
        "reward_weights",
    );
    contains(
        key_of(adv(1e-4, Some(vec![1.0, 2.0])).validate(Some(1))),
        "reward_weights",
    );
    adv(1e-4, Some(vec![1.0, 2.0])).validate(Some(2)).unwrap();

    for (cfg, key) in [
        (
            ComposerConfig {
                hint_coef: f64::NAN,
                ..Default::default()
            },
            "hint_coef",
        ),
        (
            ComposerConfig {
                replay_coef: -1.0,
                ..Default::default()
            },
            "replay_coef",
        ),
        (
            ComposerConfig {
                hint: HintConfig {
                    is_clip: Some(f64::NAN),
                    ..Default::default()
                },
                ..Default::default()
            },
            "hint.is_clip",
        ),
        (
            ComposerConfig {
                replay: ReplayConfig {
                    dpo: nan_beta.clone(),
                    ..Default::default()
                },
                ..Default::default()
            },
            "replay.dpo.beta",
        ),
    ] {
        contains(key_of(cfg.validate()), key);
    }
    ComposerConfig::default().validate().unwrap();
}
