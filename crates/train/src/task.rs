//! The built-in arithmetic task: procedural problems `"37+58="` → `"95"`, a held-out eval set
//! disjoint from the training prompts, and a scripted teacher that solves the task and writes
//! traces in the trace-store format (per-token top-K log-probs).

use std::path::Path;

use anyhow::{Context, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::data::PromptRow;
use crate::recipe::ArithmeticConfig;
use crate::replay::TeacherTrace;

/// All problems of the task, split into (train, eval) with `eval_size` held out (seeded shuffle).
pub fn arithmetic_split(
    cfg: &ArithmeticConfig,
    eval_size: usize,
    seed: u64,
) -> (Vec<PromptRow>, Vec<PromptRow>) {
    let lo = 10u64.pow(cfg.digits - 1);
    let lo = if cfg.digits == 1 { 0 } else { lo };
    let hi = cfg
        .operand_max
        .map(|m| m + 1)
        .unwrap_or(10u64.pow(cfg.digits))
        .max(lo + 1);
    let mut all = Vec::new();
    for op in &cfg.ops {
        for a in lo..hi {
            for b in lo..hi {
                let ans: i64 = match op.as_str() {
                    "-" => a as i64 - b as i64,
                    "*" => (a * b) as i64,
                    _ => (a + b) as i64,
                };
                all.push(PromptRow {
                    prompt: format!("{a}{op}{b}="),
                    answer: ans.to_string(),
                });
            }
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0E7A_15E7);
    all.shuffle(&mut rng);
    let eval_size = eval_size.min(all.len() / 2);
    let train = all.split_off(eval_size);
    (train, all)
}

/// Probability the scripted teacher puts on the correct next token.
pub const TEACHER_CONFIDENCE: f64 = 0.9;

/// The scripted teacher's trace for one row: the answer's tokens + EOS, each with a top-K
/// distribution putting log(0.9) on the right token and spreading the rest over K-1 other
/// tokens and the tail.
pub fn scripted_trace(
    row: &PromptRow,
    prompt_ids: Vec<u32>,
    completion_ids: Vec<u32>,
    vocab_ids: &[u32],
    top_k: usize,
) -> TeacherTrace {
    let others = top_k.saturating_sub(1).max(1);
    // The remaining 0.1 is split: 90% over the K-1 listed alternatives, 10% to the tail.
    let alt_p = (1.0 - TEACHER_CONFIDENCE) * 0.9 / others as f64;
    let mut topk_ids = Vec::new();
    let mut topk_logprobs = Vec::new();
    for &tok in &completion_ids {
        let mut ids = vec![tok];
        let mut lps = vec![TEACHER_CONFIDENCE.ln() as f32];
        for &alt in vocab_ids.iter().filter(|&&v| v != tok).take(others) {
            ids.push(alt);
            lps.push(alt_p.ln() as f32);
        }
        topk_ids.push(ids);
        topk_logprobs.push(lps);
    }
    let _ = row;
    TeacherTrace {
        teacher: "scripted-arithmetic".into(),
        prompt_ids,
        completion_ids,
        topk_ids,
        topk_logprobs,
        reward: 1.0,
        passed: true,
        loss_mask: None,
        tokenizer: None,
    }
}

/// Write traces in the trace store's format, atomically and durably (`composer_fsutil`).
pub fn write_traces(path: &Path, traces: &[TeacherTrace]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // Same lines as `composer_loss::TraceWriter` (validated, one JSON object per line),
    // written through the workspace's crash-safe writer.
    composer_fsutil::write_atomic_with(path, |w| {
        use std::io::Write as _;
        for t in traces {
            t.validate().map_err(|m| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("invalid trace: {m}"),
                )
            })?;
            serde_json::to_writer(&mut *w, t).map_err(std::io::Error::other)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    })?;
    Ok(())
}
