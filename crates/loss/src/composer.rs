//! The composer loss `L = L_rlvr + α·L_hint + β·L_replay`, each channel switchable and logged
//! separately.
use crate::hint::{hint_loss, HintConfig, HintMetrics};
use crate::inputs::{LossInputs, LossScale};
use crate::replay::{replay_loss, ReplayConfig, ReplayMetrics};
use crate::rlvr::{rlvr_loss, RlvrConfig, RlvrMetrics};
use crate::{LossError, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// Channel switches, weights and per-channel configs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ComposerConfig {
    /// Use the RLVR channel. Default true.
    pub use_rlvr: bool,
    /// Use the hint self-distillation channel. Default false.
    pub use_hint: bool,
    /// Use the trace-replay channel. Default false.
    pub use_replay: bool,
    /// α, the hint weight. Default 1.0.
    #[serde(alias = "alpha")]
    pub hint_coef: f64,
    /// β, the replay weight (not the KL β of the RLVR channel). Default 1.0.
    #[serde(alias = "beta")]
    pub replay_coef: f64,
    /// RLVR settings.
    pub rlvr: RlvrConfig,
    /// Hint settings.
    pub hint: HintConfig,
    /// Replay settings.
    pub replay: ReplayConfig,
}

impl Default for ComposerConfig {
    fn default() -> Self {
        Self {
            use_rlvr: true,
            use_hint: false,
            use_replay: false,
            hint_coef: 1.0,
            replay_coef: 1.0,
            rlvr: RlvrConfig::default(),
            hint: HintConfig::default(),
            replay: ReplayConfig::default(),
        }
    }
}

impl ComposerConfig {
    /// Check every knob before the first loss (NaN fails every check): the channel weights
    /// finite and >= 0, then each channel's config. Errors name the key (`hint.alpha`,
    /// `replay.dpo.beta`, ...; RLVR keys unprefixed, as they sit at the top of `[loss]`).
    pub fn validate(&self) -> Result<()> {
        for (key, w) in [
            ("hint_coef", self.hint_coef),
            ("replay_coef", self.replay_coef),
        ] {
            if !(w >= 0.0 && w.is_finite()) {
                return Err(LossError::Config {
                    key,
                    message: format!("must be finite and >= 0, got {w}"),
                });
            }
        }
        self.rlvr.validate()?;
        let prefix = |keys: &[(&'static str, &'static str)], e: LossError| match e {
            LossError::Config { key, message } => LossError::Config {
                key: keys
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map_or(key, |(_, full)| *full),
                message,
            },
            e => e,
        };
        self.hint
            .validate()
            .map_err(|e| prefix(&[("alpha", "hint.alpha"), ("is_clip", "hint.is_clip")], e))?;
        self.replay.validate().map_err(|e| {
            prefix(
                &[
                    ("dpo.beta", "replay.dpo.beta"),
                    ("dpo_coef", "replay.dpo_coef"),
                    ("kl_coef", "replay.kl_coef"),
                    ("teacher_weights", "replay.teacher_weights"),
                ],
                e,
            )
        })?;
        Ok(())
    }
}

/// Metrics of the composed loss, one block per enabled channel.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ComposerMetrics {
    /// The total loss.
    pub loss: f64,
    /// RLVR channel (unweighted), when enabled.
    pub rlvr: Option<RlvrMetrics>,
    /// Hint channel (unweighted), when enabled.
    pub hint: Option<HintMetrics>,
    /// Replay channel (unweighted), when enabled.
    pub replay: Option<ReplayMetrics>,
}

/// `L = [use_rlvr]·L_rlvr + [use_hint]·α·L_hint + [use_replay]·β·L_replay`.
///
/// The hint channel reads `inputs.hint` and the replay channel `inputs.replay`; an enabled
/// channel whose inputs are absent is an error (a silent zero would hide a wiring bug).
pub fn composer_loss(
    inputs: &LossInputs,
    cfg: &ComposerConfig,
    scale: &LossScale,
) -> Result<(Tensor, ComposerMetrics)> {
    if !(cfg.use_rlvr || cfg.use_hint || cfg.use_replay) {
        return Err(LossError::Config {
            key: "use_rlvr/use_hint/use_replay",
            message: "all channels are off".into(),
        });
    }
    cfg.validate()?;
    let mut total: Option<Tensor> = None;
    let mut metrics = ComposerMetrics::default();
    let mut add = |t: Tensor| -> Result<()> {
        total = Some(match total.take() {
            Some(acc) => (acc + t.to_dtype(inputs.trainer_logprobs.dtype())?)?,
            None => t,
        });
        Ok(())
    };
    if cfg.use_rlvr {
        let (l, m) = rlvr_loss(inputs, &cfg.rlvr, scale)?;
        add(l)?;
        metrics.rlvr = Some(m);
    }
    if cfg.use_hint {
        let (l, m) = hint_loss(inputs, &cfg.hint)?;
        add((l * cfg.hint_coef)?)?;
        metrics.hint = Some(m);
    }
    if cfg.use_replay {
        let r = inputs.replay.as_ref().ok_or_else(|| LossError::Missing {
            field: "replay",
            reason: "use_replay is on".into(),
        })?;
        let (l, m) = replay_loss(r, &cfg.replay)?;
        add((l * cfg.replay_coef)?)?;
        metrics.replay = Some(m);
    }
    let total = total.expect("at least one channel is on (checked above)");
    metrics.loss = total.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok((total, metrics))
}
