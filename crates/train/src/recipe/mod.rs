//! The training recipe: one TOML file with sections `[model]`, `[data]`, `[rollout]`, `[loss]`,
//! `[optimizer]`, `[train]`, `[warmup]`, `[replay]`, `[output]`, `[env]`.
//!
//! Unknown keys are rejected (`deny_unknown_fields` everywhere); the error names the file, the
//! key path (`[section] key`) and the closest valid key (Jaro-Winkler via `strsim`).
//!
//! Layout: `sections` holds [`Recipe`] and the section types, `env` and `loss` the two larger
//! sections, `defaults` the serde defaults they share, `parse` reads the TOML, `ranges` and
//! `rules` check value ranges and cross-key rules, `loss_ranges` the loss options (with
//! composer-loss's validators).

mod defaults;
mod env;
mod keys;
mod loss;
mod loss_ranges;
mod parse;
mod ranges;
mod rules;
mod sections;

pub use env::EnvSection;
pub use loss::{HintSection, LossSection, ReferenceConfig, ReplayLossConfig};
pub use parse::{
    embedded_default_recipe, load_recipe, parse_recipe, validate_diloco_steps,
    EMBEDDED_DEFAULT_RECIPE, EXAMPLE_RECIPE,
};
pub use ranges::validate_ranges;
pub use sections::{
    ArithmeticConfig, DataSection, LoraTargets, ModelSection, OptimizerSection, OutputSection,
    Recipe, ReplaySection, RolloutSection, TrainMode, TrainSection, VerifierSpec, WarmupSection,
};
