//! Reading recipe TOML: unknown keys, their line and the closest valid key.

use std::path::Path;

use anyhow::{Context, Result};
use serde::Deserialize;

use super::keys::{section_at, suggestion};
use super::loss::parse_loss;
use super::ranges::validate_ranges;
use super::rules::validate;
use super::sections::{
    DataSection, ModelSection, OptimizerSection, OutputSection, Recipe, ReplaySection,
    RolloutSection, TrainSection, WarmupSection,
};
use super::EnvSection;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRecipe {
    /// The policy.
    model: ModelSection,
    /// Prompts and rewards.
    data: DataSection,
    /// Sampling.
    #[serde(default)]
    rollout: RolloutSection,
    #[serde(default)]
    loss: Option<toml::Table>,
    /// AdamW and the learning-rate schedule.
    #[serde(default)]
    optimizer: OptimizerSection,
    /// Step counts, batch shape, seed, intervals.
    #[serde(default)]
    train: TrainSection,
    /// Supervised warm-up before RL (optional).
    #[serde(default)]
    warmup: Option<WarmupSection>,
    /// Teacher traces for the replay channel (optional).
    #[serde(default)]
    replay: Option<ReplaySection>,
    /// Where the run writes.
    #[serde(default)]
    output: OutputSection,
    /// Environment rollouts (optional).
    #[serde(default)]
    env: Option<EnvSection>,
    /// `[diloco]`: parsed by composer-diloco (`train --diloco-replica-id`); ignored here.
    #[serde(default)]
    #[allow(dead_code)]
    diloco: Option<toml::Table>,
}

/// A complete, commented example recipe (shown by `composer-rl train --help`).
pub const EXAMPLE_RECIPE: &str = include_str!("../example_recipe.toml");

/// The recipe `composer-rl train` runs with no arguments: the built-in arithmetic task, a tiny
/// model from scratch, a short warm-up, then RL with all three channels on.
pub const EMBEDDED_DEFAULT_RECIPE: &str = include_str!("../default_recipe.toml");

/// The embedded default recipe, parsed.
pub fn embedded_default_recipe() -> Recipe {
    parse_recipe(
        EMBEDDED_DEFAULT_RECIPE,
        Path::new("<embedded default recipe>"),
    )
    .expect("the embedded default recipe parses (tested)")
}

/// Read and validate a recipe file.
pub fn load_recipe(path: &Path) -> Result<Recipe> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading recipe {}", path.display()))?;
    parse_recipe(&text, path)
}

/// Parse and validate recipe text; `origin` names the file in errors.
pub fn parse_recipe(text: &str, origin: &Path) -> Result<Recipe> {
    let raw: RawRecipe = toml::from_str(text).map_err(|e| {
        let msg = e.message().to_string();
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
        let section = line.map(|l| section_at(text, l)).unwrap_or_default();
        // The key is what precedes `=` on the error's line (the span may cover the value).
        let key = e
            .span()
            .map(|s| {
                let start = s.start.min(text.len());
                let line_start = text[..start].rfind('\n').map(|i| i + 1).unwrap_or(0);
                let line_end = text[start..]
                    .find('\n')
                    .map(|i| start + i)
                    .unwrap_or(text.len());
                let line = &text[line_start..line_end];
                match line.split_once('=') {
                    Some((k, _)) if !line.trim_start().starts_with('[') => k.trim().to_string(),
                    _ => text[start..s.end.min(text.len())].trim().to_string(),
                }
            })
            .unwrap_or_default();
        let key_path = if section.is_empty() {
            key.clone()
        } else {
            format!("[{section}] {key}")
        };
        let hint = suggestion(&msg)
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        let at = line.map(|l| format!(" line {l}")).unwrap_or_default();
        anyhow::anyhow!(
            "recipe {}{at}, key `{key_path}`: {msg}{hint}",
            origin.display()
        )
    })?;
    if let Some(d) = &raw.diloco {
        validate_diloco_steps(d, raw.train.steps, origin)?;
    }
    let loss = parse_loss(raw.loss.unwrap_or_default(), text)
        .map_err(|e| anyhow::anyhow!("recipe {}{e}", origin.display()))?;
    let recipe = Recipe {
        model: raw.model,
        data: raw.data,
        rollout: raw.rollout,
        loss,
        optimizer: raw.optimizer,
        train: raw.train,
        warmup: raw.warmup,
        replay: raw.replay,
        output: raw.output,
        env: raw.env,
    };
    // Ranges first: their errors carry the file, key and allowed range themselves.
    validate_ranges(&recipe, origin)?;
    validate(&recipe).with_context(|| format!("recipe {}", origin.display()))?;
    Ok(recipe)
}

/// `[diloco] inner_steps` against `[train] steps`: a replica syncs every `inner_steps` steps,
/// so fewer steps than that run no round at all (and exit 0), and a remainder trains steps no
/// round ever averages. The rest of `[diloco]` is composer-diloco's to check. Public for the
/// replica path, which strips `[diloco]` before [`parse_recipe`] sees the recipe.
pub fn validate_diloco_steps(diloco: &toml::Table, steps: usize, origin: &Path) -> Result<()> {
    let Some(inner) = diloco.get("inner_steps").and_then(toml::Value::as_integer) else {
        return Ok(());
    };
    let Ok(inner) = usize::try_from(inner) else {
        return Ok(()); // negative: composer-diloco refuses it naming the key
    };
    if inner >= 1 && (steps < inner || !steps.is_multiple_of(inner)) {
        anyhow::bail!(
            "recipe {}: key `[train] steps` = {steps} with `[diloco] inner_steps` = {inner} \
             would run {} full DiLoCo round(s){}; allowed: steps a positive multiple of \
             inner_steps (e.g. {})",
            origin.display(),
            steps / inner,
            if steps < inner {
                String::new()
            } else {
                format!(" and {} steps no round averages", steps % inner)
            },
            (steps / inner).max(1) * inner
        );
    }
    Ok(())
}
