//! `composer-rl score`: teacher-forced log-probs of a text, of exact token ids, or of a batch
//! of `{prompt_ids, completion_ids}` rows (so a sampler's log-probs can be checked on the very
//! ids it sampled: re-tokenising sampled text does not give them back).
//!
//! Every input is checked against the checkpoint's `config.json` (vocabulary, positions)
//! before the weights are read; errors name the flag, file, line and token at fault.

use crate::config::ModelConfig;
use crate::deterministic::score_deterministic;
use crate::device::device_from_str;
use crate::policy::{dtype_for, Policy};
use crate::score::score_with_temperature;
use crate::transformer::Transformer;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// What to score.
#[derive(Debug, Clone)]
pub enum ScoreInput {
    /// Text, tokenized without special tokens.
    Text(String),
    /// Token ids as written on the command line (`--ids "1,2,3"`, commas or spaces).
    Ids(String),
    /// A JSON Lines file, one `{"prompt_ids": [...], "completion_ids": [...]}` per line.
    Batch(PathBuf),
}

/// Options of `composer-rl score`.
#[derive(Debug, Clone)]
pub struct ScoreOptions {
    /// Hugging Face model directory.
    pub model_dir: PathBuf,
    /// The sequences.
    pub input: ScoreInput,
    /// Score under `log softmax(logits / temperature)` (the sampler's distribution).
    pub temperature: f64,
    /// Device string (`cpu`, `cuda:0`).
    pub device: String,
    /// Batch-invariant scoring ([`score_deterministic`]): equal bitwise to the log-probs of
    /// `generate --deterministic`.
    pub deterministic: bool,
}

/// One batch row: prompt and completion ids.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreRow {
    /// Prompt token ids (non-empty).
    pub prompt_ids: Vec<u32>,
    /// Completion token ids (may be empty).
    pub completion_ids: Vec<u32>,
    /// Its 1-based line in the file (blank lines counted), for errors.
    pub line: usize,
}

/// Parses `--ids`: non-negative integers separated by commas and/or whitespace.
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    let ids = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, s)| {
            s.parse::<u32>()
                .with_context(|| format!("--ids: entry {i} `{s}` is not a token id"))
        })
        .collect::<Result<Vec<u32>>>()?;
    if ids.is_empty() {
        bail!("--ids is empty: give at least one token id (e.g. --ids 1,2,3)");
    }
    Ok(ids)
}

/// Parses a `--batch` JSON Lines file (blank lines skipped).
pub fn parse_batch(path: &Path) -> Result<Vec<ScoreRow>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --batch file {}", path.display()))?;
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), n + 1);
        let v: Value = serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
        let field = |key: &str| -> Result<Vec<u32>> {
            let arr = v
                .get(key)
                .with_context(|| format!("{}: missing `{key}`", at()))?
                .as_array()
                .with_context(|| format!("{}: `{key}` is not an array", at()))?;
            arr.iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .with_context(|| format!("{}: `{key}`[{i}] = {x} is not a token id", at()))
                })
                .collect()
        };
        let row = ScoreRow {
            prompt_ids: field("prompt_ids")?,
            completion_ids: field("completion_ids")?,
            line: n + 1,
        };
        if row.prompt_ids.is_empty() {
            bail!("{}: `prompt_ids` is empty", at());
        }
        rows.push(row);
    }
    if rows.is_empty() {
        bail!("--batch file {} has no rows", path.display());
    }
    Ok(rows)
}

/// Checks one sequence against the vocabulary and the position limit; `what` names it.
fn check_ids(ids: &[u32], cfg: &ModelConfig, what: &str) -> Result<()> {
    if let Some((i, &bad)) = ids
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= cfg.vocab_size)
    {
        bail!(
            "{what}: token id {bad} at position {i} is outside the vocabulary (vocab_size = {})",
            cfg.vocab_size
        );
    }
    if ids.len() > cfg.max_position_embeddings {
        bail!(
            "{what}: {} tokens is more than max_position_embeddings ({})",
            ids.len(),
            cfg.max_position_embeddings
        );
    }
    Ok(())
}

/// Scores with the batched or the deterministic scorer, as `opts` asks.
fn score_seqs(
    model: &Transformer,
    seqs: &[Vec<u32>],
    opts: &ScoreOptions,
) -> Result<Vec<Vec<f32>>> {
    if opts.deterministic {
        score_deterministic(model, seqs, opts.temperature)
    } else {
        score_with_temperature(model, seqs, opts.temperature)
    }
}

/// Runs `composer-rl score`. Text and `--ids` give `{"input_ids", "next_token_logprobs"}`
/// (entry t = `log p(ids[t+1] | ids[..=t])`); `--batch` gives `{"rows": [{"prompt_len",
/// "completion_logprobs"}]}` with entry t = `log p(completion[t] | prompt, completion[..t])`,
/// comparable one to one with a sampler's log-probs.
pub fn score_cli(opts: &ScoreOptions) -> Result<Value> {
    if !(opts.temperature.is_finite() && (1e-4..=1e4).contains(&opts.temperature)) {
        bail!(
            "--temperature must be in [0.0001, 10000] (the scored distribution is log softmax(logits / t)), got {}",
            opts.temperature
        );
    }
    let device = device_from_str(&opts.device)?;
    let dtype = dtype_for(&device);
    match &opts.input {
        ScoreInput::Text(text) => {
            let policy = Policy::load(&opts.model_dir, &device, dtype)?;
            let ids = policy.tokenizer.encode(text)?;
            let lp = score_seqs(&policy.model, std::slice::from_ref(&ids), opts)?;
            Ok(
                json!({ "input_ids": ids, "next_token_logprobs": lp.into_iter().next().unwrap_or_default() }),
            )
        }
        ScoreInput::Ids(raw) => {
            let ids = parse_ids(raw)?;
            let cfg = ModelConfig::from_dir(&opts.model_dir)?;
            check_ids(&ids, &cfg, "--ids")?;
            let model = Transformer::load(&opts.model_dir, &device, dtype)?;
            let lp = score_seqs(&model, std::slice::from_ref(&ids), opts)?;
            Ok(
                json!({ "input_ids": ids, "next_token_logprobs": lp.into_iter().next().unwrap_or_default() }),
            )
        }
        ScoreInput::Batch(path) => {
            let rows = parse_batch(path)?;
            let cfg = ModelConfig::from_dir(&opts.model_dir)?;
            let seqs: Vec<Vec<u32>> = rows
                .iter()
                .map(|r| [r.prompt_ids.as_slice(), r.completion_ids.as_slice()].concat())
                .collect();
            for (r, s) in rows.iter().zip(&seqs) {
                check_ids(s, &cfg, &format!("{} line {}", path.display(), r.line))?;
            }
            let model = Transformer::load(&opts.model_dir, &device, dtype)?;
            let lps = score_seqs(&model, &seqs, opts)?;
            let out: Vec<Value> = rows
                .iter()
                .zip(lps)
                .map(|(r, lp)| {
                    let p = r.prompt_ids.len();
                    json!({ "prompt_len": p, "completion_logprobs": lp[p - 1..].to_vec() })
                })
                .collect();
            Ok(json!({ "rows": out }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_with_commas_or_spaces_and_reject_junk() {
        assert_eq!(parse_ids("1,2, 3 4").unwrap(), vec![1, 2, 3, 4]);
        let e = parse_ids("1,x").unwrap_err().to_string();
        assert!(e.contains("entry 1") && e.contains("`x`"), "{e}");
        assert!(parse_ids(" , ").unwrap_err().to_string().contains("empty"));
        assert!(parse_ids("-1").is_err());
    }
}
