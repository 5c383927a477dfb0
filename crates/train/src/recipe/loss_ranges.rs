//! The loss options of a parsed recipe, checked at parse time by composer-loss's own `validate`
//! (the configs the step builds, against the recipe's verifier count): the loss functions
//! would otherwise check them only at the first step's loss, after the whole warm-up, and under
//! composer-loss's field names (the replay's DPO β as `beta`, which is the recipe's KL
//! coefficient). Each error names the file and the recipe's `[section] key`.

use std::path::Path;

use anyhow::{bail, Result};
use composer_loss::{DpoConfig, LossError, LossType, ReplayConfig, SamplerIsMode};

use super::sections::Recipe;

/// composer-loss's replay-config keys → the recipe's.
const REPLAY_KEYS: [(&str, &str); 3] = [
    ("dpo.beta", "[loss.replay] dpo_beta"),
    ("dpo_coef", "[loss.replay] dpo_weight"),
    ("kl_coef", "[loss.replay] kl_weight"),
];

/// Checks `[loss]`, `[loss.hint]` and `[loss.replay]` with composer-loss's validators;
/// `origin` is the recipe file named in the error.
pub(super) fn validate_loss(r: &Recipe, origin: &Path) -> Result<()> {
    let file = origin.display();
    // A LossError::Config under its recipe key: `section` for keys that map one to one,
    // `renames` for those the recipe spells differently.
    let named = |section: &str, renames: &[(&str, &str)], e: LossError| -> anyhow::Error {
        match e {
            LossError::Config { key, message } => {
                let key = renames.iter().find(|(k, _)| *k == key).map_or_else(
                    || format!("[{section}] {key}"),
                    |(_, full)| full.to_string(),
                );
                anyhow::anyhow!("recipe {file}: key `{key}`: {message}")
            }
            e => anyhow::anyhow!("recipe {file}: [{section}]: {e}"),
        }
    };
    let l = &r.loss;
    l.rlvr.validate().map_err(|e| named("loss", &[], e))?;
    // With `[env]` the env's reward is the one reward function; else one per verifier.
    let reward_funcs = r.env.is_none().then_some(r.data.verifiers.len());
    if let (Some(w), Some(k)) = (&l.advantage.reward_weights, reward_funcs) {
        if w.len() != k {
            bail!(
                "recipe {file}: key `[loss] reward_weights` = {w:?}: {} weights for {k} reward \
                 functions; allowed: one weight per `[[data.verifiers]]` entry",
                w.len()
            );
        }
    }
    // The count was checked above, with the recipe's own message.
    l.advantage
        .validate(None)
        .map_err(|e| named("loss", &[], e))?;
    l.hint
        .config
        .validate()
        .map_err(|e| named("loss.hint", &[], e))?;
    let rc = &l.replay;
    let replay = ReplayConfig {
        dpo: DpoConfig {
            beta: rc.dpo_beta,
            loss_type: rc.dpo_loss_type,
        },
        dpo_coef: rc.dpo_weight,
        kl_coef: rc.kl_weight,
        kl_loss_agg_mode: rc.kl_loss_agg_mode,
        ..Default::default()
    };
    replay
        .validate()
        .map_err(|e| named("loss.replay", &REPLAY_KEYS, e))?;

    let rl = &l.rlvr;
    let seq_mode = matches!(
        rl.sampler_importance_sampling_mode,
        SamplerIsMode::SequenceMask | SamplerIsMode::SequenceTruncate
    );
    if rl.loss_type == LossType::Vespo && rl.sampler_importance_sampling_correction && seq_mode {
        bail!(
            "recipe {file}: key `[loss] loss_type` = \"vespo\" needs `[loss] \
             sampler_importance_sampling_mode` = \"token_truncate\" or \"token_mask\" (as TRL; \
             the default is \"sequence_mask\"), or `sampler_importance_sampling_correction = \
             false`"
        );
    }
    Ok(())
}
