//! `[loss]` and its sub-tables `[loss.hint]`, `[loss.replay]`.

use std::path::PathBuf;

use composer_loss::hint::HintTemplate;
use composer_loss::{AdvantageConfig, DistillationAgg, DpoLossType, HintConfig, RlvrConfig};
use serde::{Deserialize, Serialize};

use super::defaults::{d_dpo_beta, d_hint_top_k, one};
use super::keys::{field_names, split_table, typed};

/// `[loss]`: L = L_rlvr + hint_weight · L_hint + replay_weight · L_replay.
///
/// Keys directly under `[loss]` are those of composer-loss's [`RlvrConfig`] (TRL names:
/// `loss_type`, `epsilon`, `epsilon_high`, `delta`, `beta`, `mask_truncated_completions`,
/// `importance_sampling_level`, ...) and [`AdvantageConfig`] (`estimator`, `scale_rewards`,
/// `dynamic_sampling`, ...), plus the channel weights.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossSection {
    /// The policy-gradient surrogate's options.
    pub rlvr: RlvrConfig,
    /// The advantage estimator's options.
    pub advantage: AdvantageConfig,
    /// α: weight of the hint self-distillation channel (0 = off).
    pub hint_weight: f64,
    /// β: weight of the trace replay channel (0 = off).
    pub replay_weight: f64,
    /// `[loss.hint]`.
    pub hint: HintSection,
    /// `[loss.replay]`.
    pub replay: ReplayLossConfig,
    /// The frozen reference policy (KL term of RLVR with `beta > 0`, DPO of the replay
    /// channel): `ref_model_path`, `sync_ref_model`, `ref_model_mixup_alpha`,
    /// `ref_model_sync_steps` (TRL names).
    pub reference: ReferenceConfig,
    /// With `dynamic_sampling = true`: most extra sampling rounds per step to replace
    /// zero-variance groups (`max_dynamic_sampling_rounds`).
    pub max_dynamic_sampling_rounds: usize,
}

/// The reference policy π_ref, TRL's `GRPOConfig` / `DPOConfig` keys.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceConfig {
    /// An HF checkpoint directory to use as the reference; None = the policy's weights when
    /// RL starts (after the warm-up).
    pub ref_model_path: Option<PathBuf>,
    /// Every `ref_model_sync_steps` RL steps, π_ref ← α·π + (1 − α)·π_ref.
    pub sync_ref_model: bool,
    /// α of the sync (TRL default 0.6).
    pub ref_model_mixup_alpha: f64,
    /// Steps between syncs (TRL default 512).
    pub ref_model_sync_steps: usize,
}

impl Default for ReferenceConfig {
    fn default() -> Self {
        Self {
            ref_model_path: None,
            sync_ref_model: false,
            ref_model_mixup_alpha: d_mixup_alpha(),
            ref_model_sync_steps: d_ref_sync_steps(),
        }
    }
}

pub(super) fn d_mixup_alpha() -> f64 {
    0.6
}
pub(super) fn d_ref_sync_steps() -> usize {
    512
}
pub(super) fn d_dynamic_rounds() -> usize {
    4
}

/// `[loss.hint]`: composer-loss's [`HintConfig`] keys (`divergence`, `alpha`, `support`,
/// `is_clip`) plus how the teacher prompt is built.
#[derive(Debug, Clone, PartialEq)]
pub struct HintSection {
    /// Divergence options.
    pub config: HintConfig,
    /// Student top-K tokens per position (+ one tail bucket).
    pub top_k: usize,
    /// Apply only to failing completions (passing ones already agree with their peers).
    pub only_failed: bool,
    /// `[loss.hint.template]`: `reprompt` (`{prompt}`, `{solution}`, `{feedback}`),
    /// `solution` (`{successful_previous_attempt}`), `feedback` (`{feedback_raw}`).
    pub template: HintTemplate,
}

impl Default for HintSection {
    fn default() -> Self {
        Self {
            config: HintConfig::default(),
            top_k: 8,
            only_failed: false,
            template: HintTemplate::default(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HintOwn {
    #[serde(default = "d_hint_top_k")]
    top_k: usize,
    #[serde(default)]
    only_failed: bool,
    #[serde(default)]
    template: HintTemplate,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LossOwn {
    #[serde(default)]
    hint_weight: f64,
    #[serde(default)]
    replay_weight: f64,
    #[serde(default)]
    hint: Option<toml::Table>,
    #[serde(default)]
    replay: ReplayLossConfig,
    #[serde(default)]
    ref_model_path: Option<PathBuf>,
    #[serde(default)]
    sync_ref_model: bool,
    #[serde(default = "d_mixup_alpha")]
    ref_model_mixup_alpha: f64,
    #[serde(default = "d_ref_sync_steps")]
    ref_model_sync_steps: usize,
    #[serde(default = "d_dynamic_rounds")]
    max_dynamic_sampling_rounds: usize,
}

/// `[loss.replay]`: DPO pairs (chosen = passing teacher trace, rejected = failing rollout of the
/// same prompt) and token-level forward KL to the teachers' recorded top-K distributions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayLossConfig {
    /// Weight of the DPO term.
    #[serde(default = "one")]
    pub dpo_weight: f64,
    /// DPO β (TRL DPOTrainer `beta`).
    #[serde(default = "d_dpo_beta")]
    pub dpo_beta: f64,
    /// Weight of the token-KL term.
    #[serde(default = "one")]
    pub kl_weight: f64,
    /// DPO variant (TRL DPOTrainer `loss_type`): `sigmoid` (default), `hinge`, `ipo`.
    #[serde(default)]
    pub dpo_loss_type: DpoLossType,
    /// Aggregation of the token-KL term: `seq-mean-token-mean` (TRL 1.16 SDPO, default) or
    /// `token-mean`.
    #[serde(default)]
    pub kl_loss_agg_mode: DistillationAgg,
}

impl Default for ReplayLossConfig {
    fn default() -> Self {
        Self {
            dpo_weight: 1.0,
            dpo_beta: d_dpo_beta(),
            kl_weight: 1.0,
            dpo_loss_type: DpoLossType::default(),
            kl_loss_agg_mode: DistillationAgg::default(),
        }
    }
}

/// `[loss]` split between composer-loss's configs and this crate's own keys; errors are
/// `", line N, key ..."` suffixes for the caller to prefix with the file.
pub(super) fn parse_loss(
    table: toml::Table,
    text: &str,
) -> std::result::Result<LossSection, String> {
    let sets = [
        field_names::<RlvrConfig>(),
        field_names::<AdvantageConfig>(),
        field_names::<LossOwn>(),
    ];
    let mut parts = split_table(table, "loss", &sets, text)?.into_iter();
    let rlvr: RlvrConfig = typed(parts.next().unwrap_or_default(), "loss", text)?;
    let advantage: AdvantageConfig = typed(parts.next().unwrap_or_default(), "loss", text)?;
    let own: LossOwn = typed(parts.next().unwrap_or_default(), "loss", text)?;
    let hint_sets = [field_names::<HintConfig>(), field_names::<HintOwn>()];
    let mut hp =
        split_table(own.hint.unwrap_or_default(), "loss.hint", &hint_sets, text)?.into_iter();
    let config: HintConfig = typed(hp.next().unwrap_or_default(), "loss.hint", text)?;
    let hown: HintOwn = typed(hp.next().unwrap_or_default(), "loss.hint", text)?;
    Ok(LossSection {
        rlvr,
        advantage,
        hint_weight: own.hint_weight,
        replay_weight: own.replay_weight,
        hint: HintSection {
            config,
            top_k: hown.top_k,
            only_failed: hown.only_failed,
            template: hown.template,
        },
        replay: own.replay,
        reference: ReferenceConfig {
            ref_model_path: own.ref_model_path,
            sync_ref_model: own.sync_ref_model,
            ref_model_mixup_alpha: own.ref_model_mixup_alpha,
            ref_model_sync_steps: own.ref_model_sync_steps,
        },
        max_dynamic_sampling_rounds: own.max_dynamic_sampling_rounds,
    })
}
