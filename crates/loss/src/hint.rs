//! The hint self-distillation channel (SDPO / OPSD): the same model, given a hint in its
//! prompt, scores the student's own completion tokens, and the student is pulled toward it.
//!
//! Per token (student S, teacher T, both over the same support — the student's top-K ids
//! plus a tail bucket log(1 − Σ_K p), the renormalised top-K, or a full small vocabulary):
//!
//! | `divergence` | per-token loss |
//! |---|---|
//! | `forward_kl` | KL(T‖S) = Σ p_T (log p_T − log p_S) |
//! | `reverse_kl` | KL(S‖T) = Σ p_S (log p_S − log p_T) |
//! | `jsd` (α) | (1−α)·KL(S‖M) + α·KL(T‖M), M = (1−α)S + αT (SDPO's generalised JSD) |
//! | `sampled_token` | sg(log π_S(y) − log π_T(y)) · log π_S(y) (reverse-KL score-function form) |
//!
//! Each per-token loss is multiplied by the IS weight sg(min(exp(log π_S(y) − log π_old(y)),
//! `is_clip`)) (SDPO default cap 2.0) and averaged over the active tokens of the samples that
//! received a hint (`has_hint`), by `loss_agg_mode` (per-row token mean averaged over the
//! micro-batch, TRL's default; or one token mean). Teacher log-probs never receive gradients.
//! Reference: TRL 1.16 `SDPOTrainer._compute_self_distillation_loss` (upstream-parity fixtures in
//! `tests/fixtures/upstream/trl_sdpo.json`); the verl-fork SDPO `compute_self_distillation_loss`
//! is the `token-mean` option.
use crate::divergence::{add_tail, renorm};
pub use crate::divergence::{divergence_per_token, DistillationAgg, HintDivergence, HintSupport};
pub use crate::inputs::HintInputs;
use crate::inputs::LossInputs;
use crate::util::{gate, masked_sum, row_column, value};
use crate::{LossError, Result};
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

/// Knobs of the hint channel. Defaults follow SDPO's `self_distillation` config (TRL 1.16's
/// `SDPOConfig` defaults differ: `distillation_alpha = 1.0` i.e. reverse KL, `distillation_mode =
/// sampled_token`, no tail bucket; its aggregation is the default here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HintConfig {
    /// Divergence. Default `jsd`.
    pub divergence: HintDivergence,
    /// JSD mixing weight α ∈ (0, 1). SDPO default 0.5.
    pub alpha: f64,
    /// Support. Default `topk_tail`.
    pub support: HintSupport,
    /// IS-weight cap (SDPO `is_clip`); `None` disables the weight. Default 2.0.
    pub is_clip: Option<f64>,
    /// Aggregation over the micro-batch: `seq-mean-token-mean` (TRL 1.16 SDPO, default) or
    /// `token-mean` (verl-fork SDPO).
    pub loss_agg_mode: DistillationAgg,
}

impl Default for HintConfig {
    fn default() -> Self {
        Self {
            divergence: HintDivergence::Jsd,
            alpha: 0.5,
            support: HintSupport::TopkTail,
            is_clip: Some(2.0),
            loss_agg_mode: DistillationAgg::default(),
        }
    }
}

impl HintConfig {
    /// Check ranges (NaN fails every check); errors name the key. `alpha` is used by the JSD
    /// divergence only, where it must lie in (0, 1); set for another divergence it must still
    /// be a number in [0, 1]. `is_clip`, when set, must be finite and > 0 (a negative cap would
    /// flip the sign of every weight).
    pub fn validate(&self) -> Result<()> {
        let a = self.alpha;
        if self.divergence == HintDivergence::Jsd && !(a > 0.0 && a < 1.0) {
            return Err(LossError::Config {
                key: "alpha",
                message: format!("JSD mixing must be in (0, 1), got {a}"),
            });
        }
        if !(0.0..=1.0).contains(&a) {
            return Err(LossError::Config {
                key: "alpha",
                message: format!("must be in [0, 1], got {a}"),
            });
        }
        if let Some(c) = self.is_clip {
            if !(c > 0.0 && c.is_finite()) {
                return Err(LossError::Config {
                    key: "is_clip",
                    message: format!("must be finite and > 0 (the IS weight's cap), got {c}"),
                });
            }
        }
        Ok(())
    }
}

/// Metrics of the hint channel.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct HintMetrics {
    /// The loss value.
    pub loss: f64,
    /// Samples that received a hint.
    pub hinted_samples: f64,
    /// Active tokens of those samples (the denominator).
    pub hinted_tokens: f64,
    /// Mean per-token divergence before the IS weight.
    pub divergence_mean: f64,
    /// Mean IS weight (after the cap) over the hinted tokens.
    pub is_weight_mean: f64,
    /// Fraction of hinted tokens whose IS weight hit the cap.
    pub is_capped_fraction: f64,
}

/// The hint self-distillation loss of one micro-batch: `(scalar, metrics)`, the
/// `cfg.loss_agg_mode` aggregate of `h_i m_it · sg(min(π_S/π_old, cap)) · D_it` with D the
/// per-token divergence of `cfg.divergence` and h_i = `has_hint[i]`: `seq-mean-token-mean`
/// Σ_i (Σ_t h_i m_it ℓ_it / max(1, Σ_t h_i m_it)) / B (TRL 1.16 SDPO), `token-mean`
/// Σ_it h_i m_it ℓ_it / Σ_it h_i m_it (verl-fork SDPO).
///
/// Reads `inputs.hint` (required), `inputs.trainer_logprobs` (student log-prob of the sampled
/// token, for `sampled_token` and the IS weight), `inputs.old_logprobs` (IS weight; `None` →
/// weight 1) and `inputs.loss_mask`, over the local micro-batch; with no hinted token the loss
/// is an exact zero that still depends on the graph.
pub fn hint_loss(inputs: &LossInputs, cfg: &HintConfig) -> Result<(Tensor, HintMetrics)> {
    let (b, t) = inputs.validate()?;
    let hint = inputs.hint.as_ref().ok_or_else(|| LossError::Missing {
        field: "hint",
        reason: "the hint channel is enabled".into(),
    })?;
    if hint.has_hint.len() != b {
        return Err(LossError::Input {
            field: "hint.has_hint",
            message: format!("has {} flags for a batch of {b}", hint.has_hint.len()),
        });
    }
    cfg.validate()?;
    let lp = &inputs.trainer_logprobs;
    let keep: Vec<f64> = hint
        .has_hint
        .iter()
        .map(|&h| if h { 1.0 } else { 0.0 })
        .collect();
    let keep = row_column(&keep, lp)?;
    let m = inputs
        .loss_mask
        .detach()
        .to_dtype(lp.dtype())?
        .broadcast_mul(&keep)?;
    let agg_t = cfg.loss_agg_mode.weights(&m)?;
    let n_tok = value(&m.sum_all()?)?;

    let per_token = match cfg.divergence {
        HintDivergence::SampledToken => {
            let tt = hint
                .teacher_token_logprobs
                .as_ref()
                .ok_or_else(|| LossError::Missing {
                    field: "hint.teacher_token_logprobs",
                    reason: "divergence = sampled_token".into(),
                })?;
            crate::util::check_shape(tt, "hint.teacher_token_logprobs", &[b, t])?;
            let tt = tt.detach().to_dtype(lp.dtype())?;
            ((lp - tt)?.detach() * lp)?
        }
        d => {
            let s = hint
                .student_topk_logprobs
                .as_ref()
                .ok_or_else(|| LossError::Missing {
                    field: "hint.student_topk_logprobs",
                    reason: "distribution divergences need the student's top-K log-probs".into(),
                })?;
            let te = hint
                .teacher_topk_logprobs
                .as_ref()
                .ok_or_else(|| LossError::Missing {
                    field: "hint.teacher_topk_logprobs",
                    reason:
                        "distribution divergences need the teacher's log-probs at the top-K ids"
                            .into(),
                })?;
            let dims = s.dims();
            if dims.len() != 3 || dims[0] != b || dims[1] != t {
                return Err(LossError::Shape {
                    tensor: "hint.student_topk_logprobs",
                    expected: format!("[{b}, {t}, K]"),
                    got: dims.to_vec(),
                });
            }
            crate::util::check_shape(te, "hint.teacher_topk_logprobs", dims)?;
            let te = te.detach().to_dtype(s.dtype())?;
            let (s2, t2) = match cfg.support {
                HintSupport::TopkTail => (add_tail(s)?, add_tail(&te)?),
                HintSupport::TopkRenormalized => (renorm(s)?, renorm(&te)?),
                HintSupport::Full => (s.clone(), te),
            };
            divergence_per_token(&s2, &t2, d, cfg.alpha)?.to_dtype(lp.dtype())?
        }
    };
    let div_mean = value(&masked_sum(&per_token.detach(), &m)?)? / n_tok.max(1.0);

    let (per_token, is_mean, capped) = match cfg.is_clip {
        Some(cap) => {
            let lpd = lp.detach();
            let old = match &inputs.old_logprobs {
                Some(o) => o.detach().to_dtype(lp.dtype())?,
                None => lpd.clone(),
            };
            let r = (lpd - old)?.clamp(-20.0, 20.0)?.exp()?;
            let w = r.minimum(cap)?;
            let capped = value(&masked_sum(&gate(&r.gt(cap)?, &r)?, &m)?)?;
            let sum_w = value(&masked_sum(&w, &m)?)?;
            (
                (per_token * w)?,
                sum_w / n_tok.max(1.0),
                capped / n_tok.max(1.0),
            )
        }
        None => (per_token, 1.0, 0.0),
    };
    let loss = (per_token * &agg_t)?.sum_all()?;
    let metrics = HintMetrics {
        loss: value(&loss)?,
        hinted_samples: hint.has_hint.iter().filter(|h| **h).count() as f64,
        hinted_tokens: n_tok,
        divergence_mean: div_mean,
        is_weight_mean: is_mean,
        is_capped_fraction: capped,
    };
    Ok((loss, metrics))
}

/// One rollout of a group, as the hint builder needs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutForHint {
    /// The prompt text as the student saw it.
    pub prompt_text: String,
    /// The completion text.
    pub completion_text: String,
    /// Its reward.
    pub reward: f64,
    /// Whether it passed the verifier.
    pub passed: bool,
    /// Environment feedback (e.g. a failing test's output), if any.
    pub feedback: Option<String>,
}

/// The default teacher-prompt template, SDPO style. Placeholders: `{prompt}` (the original
/// prompt text), `{solution}` (the solution section, empty without a peer), `{feedback}` (the
/// feedback section, empty when a peer solution is used or there is no feedback).
pub const DEFAULT_HINT_TEMPLATE: &str =
    "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n";
/// SDPO's solution section; placeholder `{successful_previous_attempt}`.
pub const DEFAULT_SOLUTION_TEMPLATE: &str =
    "\nCorrect solution:\n\n{successful_previous_attempt}\n\n";
/// SDPO's feedback section; placeholder `{feedback_raw}`.
pub const DEFAULT_FEEDBACK_TEMPLATE: &str =
    "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n";

/// The three templates of a teacher prompt (SDPO's `reprompt_template`, `solution_template`,
/// `feedback_template`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HintTemplate {
    /// Outer template: `{prompt}`, `{solution}`, `{feedback}`.
    pub reprompt: String,
    /// Solution section: `{successful_previous_attempt}`.
    pub solution: String,
    /// Feedback section: `{feedback_raw}`.
    pub feedback: String,
}

impl Default for HintTemplate {
    fn default() -> Self {
        Self {
            reprompt: DEFAULT_HINT_TEMPLATE.into(),
            solution: DEFAULT_SOLUTION_TEMPLATE.into(),
            feedback: DEFAULT_FEEDBACK_TEMPLATE.into(),
        }
    }
}

/// Single-pass placeholder substitution: every `{key}` of `template` is replaced by its
/// value; text coming from values is never scanned again, so a prompt, solution or feedback
/// that itself contains `{prompt}` or `{feedback}` (code often does) stays literal.
/// Unknown `{...}` sequences are kept as they are.
fn fill_template(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    'scan: while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open..];
        for (key, value) in values {
            let ph_len = key.len() + 2;
            if after.len() >= ph_len
                && after.as_bytes()[ph_len - 1] == b'}'
                && &after[1..ph_len - 1] == *key
            {
                out.push_str(value);
                rest = &after[ph_len..];
                continue 'scan;
            }
        }
        out.push('{');
        rest = &after[1..];
    }
    out.push_str(rest);
    out
}

/// Teacher prompts for one group of rollouts of the same prompt (SDPO's reprompting).
///
/// For rollout i: if some *other* rollout j ≠ i passed, the hint is the first such peer's
/// completion (solution section; the sample's own completion is never used); else, if i has
/// non-blank environment feedback, that feedback (feedback section); else `None`: the sample
/// gets no teacher prompt and is excluded from the hint channel (`HintInputs::has_hint`
/// false, so its tokens are masked out of the hint loss).
///
/// `teacher_prompt_i = reprompt[{prompt} ← prompt_i, {solution} ← solution section or "",
/// {feedback} ← feedback section or ""]`, with the default SDPO-style
/// [`DEFAULT_HINT_TEMPLATE`]. Substitution is single-pass, so braces inside the prompt,
/// solution or feedback texts are kept literally.
pub fn build_hint_prompts(
    group: &[RolloutForHint],
    template: &HintTemplate,
) -> Vec<Option<String>> {
    group
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let peer = group
                .iter()
                .enumerate()
                .find(|(j, p)| *j != i && p.passed)
                .map(|(_, p)| p);
            let (solution, feedback) = match (peer, &r.feedback) {
                (Some(p), _) => (
                    fill_template(
                        &template.solution,
                        &[("successful_previous_attempt", &p.completion_text)],
                    ),
                    String::new(),
                ),
                (None, Some(f)) if !f.trim().is_empty() => (
                    String::new(),
                    fill_template(&template.feedback, &[("feedback_raw", f)]),
                ),
                _ => return None,
            };
            Some(fill_template(
                &template.reprompt,
                &[
                    ("prompt", &r.prompt_text),
                    ("solution", &solution),
                    ("feedback", &feedback),
                ],
            ))
        })
        .collect()
}

/// EMA teacher update θ_T ← (1−τ)·θ_T + τ·θ_S, in place on the teacher's variables
/// (τ ∈ [0, 1]; τ = 1 copies the student, τ = 0 keeps the teacher). Every count, shape and
/// τ is checked before any variable is written, so an error leaves the teacher untouched.
pub fn ema_update(teacher: &[Var], student: &[Tensor], tau: f64) -> Result<()> {
    let current: Vec<Tensor> = teacher.iter().map(|v| v.as_tensor().clone()).collect();
    let new = ema_tensors(&current, student, tau)?;
    for (tv, n) in teacher.iter().zip(&new) {
        tv.set(n)?;
    }
    Ok(())
}

/// Pure form of [`ema_update`]: returns the new teacher tensors (1−τ)·θ_T + τ·θ_S
/// (detached), τ ∈ [0, 1]; τ = 1 copies the student, τ = 0 keeps the teacher.
pub fn ema_tensors(teacher: &[Tensor], student: &[Tensor], tau: f64) -> Result<Vec<Tensor>> {
    if !(0.0..=1.0).contains(&tau) {
        return Err(LossError::Config {
            key: "tau",
            message: format!("must be in [0, 1], got {tau}"),
        });
    }
    if teacher.len() != student.len() {
        return Err(LossError::Input {
            field: "student",
            message: format!(
                "{} teacher vs {} student tensors",
                teacher.len(),
                student.len()
            ),
        });
    }
    teacher
        .iter()
        .zip(student)
        .enumerate()
        .map(|(i, (t, s))| {
            if t.dims() != s.dims() {
                return Err(LossError::Shape {
                    tensor: "student",
                    expected: format!("{:?} (teacher tensor {i})", t.dims()),
                    got: s.dims().to_vec(),
                });
            }
            Ok(((t.detach() * (1.0 - tau))? + (s.detach().to_dtype(t.dtype())? * tau)?)?)
        })
        .collect()
}
