//! Hint construction (`build_hint_prompts`, SDPO-style reprompting) and the EMA teacher.
use candle_core::{DType, Device, Tensor, Var};
use composer_loss::hint::{DEFAULT_FEEDBACK_TEMPLATE, DEFAULT_SOLUTION_TEMPLATE};
use composer_loss::*;

fn rollout(prompt: &str, completion: &str, passed: bool, feedback: Option<&str>) -> RolloutForHint {
    RolloutForHint {
        prompt_text: prompt.into(),
        completion_text: completion.into(),
        reward: if passed { 1.0 } else { 0.0 },
        passed,
        feedback: feedback.map(String::from),
    }
}

const TAIL: &str = "\n\nCorrectly solve the original question.\n";

fn with_solution(prompt: &str, solution: &str) -> String {
    format!("{prompt}\nCorrect solution:\n\n{solution}\n\n{TAIL}")
}

fn with_feedback(prompt: &str, feedback: &str) -> String {
    format!(
        "{prompt}\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback}\n\n{TAIL}"
    )
}

#[test]
fn default_template_is_exactly_sdpo_style() {
    assert_eq!(
        DEFAULT_HINT_TEMPLATE,
        "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
    );
    let t = HintTemplate::default();
    assert_eq!(t.reprompt, DEFAULT_HINT_TEMPLATE);
    assert_eq!(t.solution, DEFAULT_SOLUTION_TEMPLATE);
    assert_eq!(t.feedback, DEFAULT_FEEDBACK_TEMPLATE);
}

#[test]
fn hint_is_a_successful_peer_never_the_samples_own() {
    let p = "Write f(x).";
    let group = [
        rollout(p, "wrong A", false, None),
        rollout(p, "right B", true, None),
        rollout(p, "wrong C", false, Some("AssertionError: f(2) != 4")),
        rollout(p, "right D", true, None),
    ];
    let got = build_hint_prompts(&group, &HintTemplate::default());
    assert_eq!(got.len(), 4);
    // A and C: the first passing peer (B); C's own feedback is not used when a peer solved it.
    assert_eq!(
        got[0].as_deref(),
        Some(with_solution(p, "right B").as_str())
    );
    assert_eq!(
        got[2].as_deref(),
        Some(with_solution(p, "right B").as_str())
    );
    // B passed itself: its hint is the OTHER passer D, never its own completion.
    assert_eq!(
        got[1].as_deref(),
        Some(with_solution(p, "right D").as_str())
    );
    assert_eq!(
        got[3].as_deref(),
        Some(with_solution(p, "right B").as_str())
    );
}

#[test]
fn lone_passer_gets_feedback_or_no_hint() {
    let p = "Sort a list.";
    // The only passer has no peer solution and no feedback: no hint (excluded).
    let group = [
        rollout(p, "right", true, None),
        rollout(p, "wrong", false, None),
    ];
    let got = build_hint_prompts(&group, &HintTemplate::default());
    assert_eq!(got[0], None);
    assert_eq!(got[1].as_deref(), Some(with_solution(p, "right").as_str()));
    // With feedback of its own, the lone passer gets the feedback section, not its solution.
    let group = [
        rollout(p, "right", true, Some("2 tests passed, style warning")),
        rollout(p, "wrong", false, None),
    ];
    let got = build_hint_prompts(&group, &HintTemplate::default());
    let own = got[0].as_deref().unwrap();
    assert_eq!(own, with_feedback(p, "2 tests passed, style warning"));
    assert!(!own.contains("right"));
}

#[test]
fn without_a_passing_peer_feedback_else_excluded() {
    let p = "Parse JSON.";
    let group = [
        rollout(p, "a", false, Some("Traceback: KeyError 'x'")),
        rollout(p, "b", false, None),
        rollout(p, "c", false, Some("   \n")),
    ];
    let got = build_hint_prompts(&group, &HintTemplate::default());
    assert_eq!(
        got[0].as_deref(),
        Some(with_feedback(p, "Traceback: KeyError 'x'").as_str())
    );
    assert_eq!(got[1], None, "no peer, no feedback: no hint");
    assert_eq!(got[2], None, "blank feedback counts as none");
    assert_eq!(
        build_hint_prompts(&[], &HintTemplate::default()),
        Vec::<Option<String>>::new()
    );
}

#[test]
fn template_is_configurable() {
    let t = HintTemplate {
        reprompt: "<hint>{solution}{feedback}</hint>\n{prompt}".into(),
        solution: "[solved: {successful_previous_attempt}]".into(),
        feedback: "[feedback: {feedback_raw}]".into(),
    };
    let group = [
        rollout("Q1", "x = 1", true, None),
        rollout("Q1", "x = 2", false, Some("wrong value")),
    ];
    let got = build_hint_prompts(&group, &t);
    // Sample 0 (lone passer, no feedback): excluded; sample 1: the peer's solution.
    assert_eq!(got[0], None);
    assert_eq!(got[1].as_deref(), Some("<hint>[solved: x = 1]</hint>\nQ1"));
    let group = [rollout("Q2", "y", false, Some("timeout"))];
    assert_eq!(
        build_hint_prompts(&group, &t)[0].as_deref(),
        Some("<hint>[feedback: timeout]</hint>\nQ2")
    );
}

#[test]
fn braces_in_texts_are_literal() {
    // Code is full of braces: placeholders inside the prompt, the peer's solution or the
    // feedback must never be expanded (single-pass substitution).
    let p = "Print '{solution}' and '{feedback}'.";
    let sol = "print('{prompt}'); d = {'a': 1}; f'{feedback}'";
    let group = [rollout(p, sol, true, None), rollout(p, "no", false, None)];
    let got = build_hint_prompts(&group, &HintTemplate::default());
    assert_eq!(got[1].as_deref(), Some(with_solution(p, sol).as_str()));
    let fb = "expected {prompt} got {successful_previous_attempt}";
    let group = [rollout(p, "no", false, Some(fb))];
    let got = build_hint_prompts(&group, &HintTemplate::default());
    assert_eq!(got[0].as_deref(), Some(with_feedback(p, fb).as_str()));
}

#[test]
fn excluded_samples_have_no_hint_loss() {
    // Prompts → `has_hint`; the excluded sample contributes nothing, the mean runs over the
    // hinted samples' tokens only.
    let group = [
        rollout("Q", "ok", true, None),
        rollout("Q", "bad", false, None),
        rollout("Q", "bad2", false, Some("err")),
    ];
    let prompts = build_hint_prompts(&group, &HintTemplate::default());
    let has_hint: Vec<bool> = prompts.iter().map(Option::is_some).collect();
    assert_eq!(has_hint, [false, true, true]);
    let dev = Device::Cpu;
    let lp = Var::from_tensor(
        &Tensor::new(&[[-0.5f64, -1.0], [-0.2, -0.7], [-1.5, -0.1]], &dev).unwrap(),
    )
    .unwrap();
    let tt = Tensor::new(&[[-0.9f64, -0.3], [-0.4, -1.1], [-0.6, -0.8]], &dev).unwrap();
    let mut x = LossInputs::new(
        lp.as_tensor().clone(),
        Tensor::zeros(3, DType::F64, &dev).unwrap(),
        Tensor::ones((3, 2), DType::F64, &dev).unwrap(),
    );
    x.hint = Some(HintInputs {
        student_topk_logprobs: None,
        teacher_topk_logprobs: None,
        topk_ids: None,
        teacher_token_logprobs: Some(tt),
        has_hint,
    });
    let cfg = HintConfig {
        divergence: HintDivergence::SampledToken,
        is_clip: None,
        loss_agg_mode: DistillationAgg::TokenMean,
        ..Default::default()
    };
    let (loss, m) = hint_loss(&x, &cfg).unwrap();
    assert_eq!(m.hinted_samples, 2.0);
    assert_eq!(m.hinted_tokens, 4.0);
    // (Σ over rows 1, 2 of (lp − tt)·lp) / 4
    let want = ((-0.2f64 + 0.4) * -0.2
        + (-0.7f64 + 1.1) * -0.7
        + (-1.5f64 + 0.6) * -1.5
        + (-0.1f64 + 0.8) * -0.1)
        / 4.0;
    let got = loss.to_scalar::<f64>().unwrap();
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    let g = loss.backward().unwrap();
    let g = g.get(lp.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
    assert_eq!(g[0], [0.0, 0.0], "the excluded sample gets no gradient");
}

// ------------------------------------------------------------------------------ EMA

fn t(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap()
}

const TEACHER: [f64; 5] = [0.5, -1.25, 3.0, 1e-3, -7.5];
const STUDENT: [f64; 5] = [0.1, 2.0, -3.0, 4.5, 0.25];

#[test]
fn ema_tensors_is_the_convex_combination() {
    for tau in [0.0, 0.01, 0.25, 0.5, 0.999, 1.0] {
        let out = ema_tensors(&[t(&TEACHER)], &[t(&STUDENT)], tau).unwrap();
        let got = out[0].to_vec1::<f64>().unwrap();
        for i in 0..5 {
            let want = (1.0 - tau) * TEACHER[i] + tau * STUDENT[i];
            assert_eq!(got[i], want, "τ = {tau}, element {i}");
        }
    }
    // τ = 1 copies the student, τ = 0 keeps the teacher, bit for bit.
    let one = ema_tensors(&[t(&TEACHER)], &[t(&STUDENT)], 1.0).unwrap();
    assert_eq!(one[0].to_vec1::<f64>().unwrap(), STUDENT);
    let zero = ema_tensors(&[t(&TEACHER)], &[t(&STUDENT)], 0.0).unwrap();
    assert_eq!(zero[0].to_vec1::<f64>().unwrap(), TEACHER);
    // f32 teacher, f64 student: computed in the teacher's dtype.
    let t32 = t(&TEACHER).to_dtype(DType::F32).unwrap();
    let out = ema_tensors(&[t32], &[t(&STUDENT)], 0.3).unwrap();
    assert_eq!(out[0].dtype(), DType::F32);
    for (i, g) in out[0].to_vec1::<f32>().unwrap().iter().enumerate() {
        let want = 0.7 * TEACHER[i] + 0.3 * STUDENT[i];
        assert!((*g as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
    }
}

#[test]
fn ema_update_in_place_matches_ema_tensors() {
    let teacher = [
        Var::from_tensor(&t(&TEACHER)).unwrap(),
        Var::new(&[[1.0f64, 2.0]], &Device::Cpu).unwrap(),
    ];
    let student = [
        t(&STUDENT),
        Tensor::new(&[[3.0f64, -2.0]], &Device::Cpu).unwrap(),
    ];
    ema_update(&teacher, &student, 0.1).unwrap();
    let got = teacher[0].as_tensor().to_vec1::<f64>().unwrap();
    for i in 0..5 {
        assert_eq!(got[i], 0.9 * TEACHER[i] + 0.1 * STUDENT[i]);
    }
    assert_eq!(
        teacher[1].as_tensor().to_vec2::<f64>().unwrap(),
        [[0.9 * 1.0 + 0.1 * 3.0, 0.9 * 2.0 + 0.1 * -2.0]]
    );
    ema_update(&teacher, &student, 1.0).unwrap();
    assert_eq!(teacher[0].as_tensor().to_vec1::<f64>().unwrap(), STUDENT);
    let before = teacher[1].as_tensor().to_vec2::<f64>().unwrap();
    ema_update(&teacher, &student, 0.0).unwrap();
    assert_eq!(teacher[1].as_tensor().to_vec2::<f64>().unwrap(), before);
}

#[test]
fn ema_bad_inputs_are_errors_that_leave_the_teacher_untouched() {
    let teacher = [
        Var::from_tensor(&t(&TEACHER)).unwrap(),
        Var::from_tensor(&t(&[1.0, 2.0])).unwrap(),
    ];
    // Second tensor has the wrong shape: nothing may be written, not even the first.
    let err = ema_update(&teacher, &[t(&STUDENT), t(&[1.0, 2.0, 3.0])], 0.5).unwrap_err();
    assert!(err.to_string().contains("teacher tensor 1"), "{err}");
    assert_eq!(teacher[0].as_tensor().to_vec1::<f64>().unwrap(), TEACHER);
    let err = ema_update(&teacher, &[t(&STUDENT)], 0.5).unwrap_err();
    assert!(err.to_string().contains("student"), "{err}");
    for tau in [-0.1, 1.5, f64::NAN] {
        let err = ema_tensors(&[t(&TEACHER)], &[t(&STUDENT)], tau).unwrap_err();
        assert!(err.to_string().contains("tau"), "{err}");
        assert!(ema_update(&teacher[..1], &[t(&STUDENT)], tau).is_err());
    }
    assert_eq!(teacher[0].as_tensor().to_vec1::<f64>().unwrap(), TEACHER);
}
