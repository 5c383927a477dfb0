//! What a resumed run must find unchanged: its recipe, and the data files the recipe names.
//! A run picks its prompts by (seed, step, index); resuming on an edited dataset would silently
//! train on other prompts than the ones its first steps were drawn from, so both are refused
//! before any model is loaded.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::recipe::{self, Recipe};

/// With `--resume`, a recipe argument must be the run's own recipe (byte-equal, or equal once
/// parsed): refuses otherwise, naming both files.
pub fn same_recipe(given: &Path, stored_text: &str, stored: &Path) -> Result<()> {
    let text = std::fs::read_to_string(given)
        .with_context(|| format!("reading recipe {}", given.display()))?;
    if text == stored_text {
        return Ok(());
    }
    let same = match (
        recipe::parse_recipe(&text, given),
        recipe::parse_recipe(stored_text, stored),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if !same {
        bail!(
            "recipe {} differs from the resumed run's recipe {}; a resumed run continues with its \
             own recipe: drop the recipe argument, or start a new run with it",
            given.display(),
            stored.display()
        );
    }
    Ok(())
}

/// The recipe's data files (`[data] dataset`, `[data] eval_dataset`, `[warmup] dataset`), by
/// recipe key, each with the sha256 of its bytes.
pub fn data_digests(recipe: &Recipe) -> Result<BTreeMap<String, String>> {
    let files = [
        ("[data] dataset", recipe.data.dataset.as_deref()),
        ("[data] eval_dataset", recipe.data.eval_dataset.as_deref()),
        (
            "[warmup] dataset",
            recipe.warmup.as_ref().and_then(|w| w.dataset.as_deref()),
        ),
    ];
    let mut out = BTreeMap::new();
    for (key, path) in files {
        if let Some(p) = path {
            let digest = crate::data::file_sha256(p).with_context(|| format!("key `{key}`"))?;
            out.insert(key.to_string(), digest);
        }
    }
    Ok(out)
}

/// On resume, each data file the checkpoint recorded must have the same bytes now. A
/// checkpoint written before digests were recorded (`stored` empty) is not checked.
pub fn same_data(
    stored: &BTreeMap<String, String>,
    now: &BTreeMap<String, String>,
    checkpoint: &Path,
) -> Result<()> {
    for (key, was) in stored {
        match now.get(key) {
            Some(is) if is == was => {}
            Some(is) => bail!(
                "key `{key}`: the file changed since the run started ({was} then, {is} now; \
                 recorded in {}); a resumed run must train on the data it started with: restore \
                 the file, or start a new run",
                checkpoint.display()
            ),
            None => bail!(
                "key `{key}`: the run started with this data file (recorded in {}) and the recipe \
                 no longer names it",
                checkpoint.display()
            ),
        }
    }
    Ok(())
}
