//! Teacher traces for the replay channel: one JSONL row per trace with the completion's token
//! ids and, per token, the teacher's top-K token ids and log-probs.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// One recorded teacher trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeacherTrace {
    /// Which teacher wrote it.
    pub teacher: String,
    /// Prompt text (the key that pairs a trace with rollouts of the same prompt).
    pub prompt: String,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Completion token ids.
    pub completion_ids: Vec<u32>,
    /// Per completion token, the teacher's top-K token ids.
    pub topk_ids: Vec<Vec<u32>>,
    /// Per completion token, the teacher's top-K log-probs (same order).
    pub topk_logprobs: Vec<Vec<f32>>,
    /// The trace's verified reward (passing traces are the DPO "chosen").
    pub reward: f64,
}

/// Read a trace file; errors name file and line.
pub fn read_traces(path: &Path, vocab_size: usize) -> Result<Vec<TeacherTrace>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading traces {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let t: TeacherTrace = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not a valid trace", path.display(), i + 1))?;
        let n = t.completion_ids.len();
        if t.topk_ids.len() != n || t.topk_logprobs.len() != n {
            bail!("{} line {}: topk_ids/topk_logprobs must have one entry per completion token ({n})", path.display(), i + 1);
        }
        let bad = t.prompt_ids.iter().chain(&t.completion_ids).chain(t.topk_ids.iter().flatten()).any(|&id| id as usize >= vocab_size);
        if bad {
            bail!("{} line {}: token id outside the vocabulary ({vocab_size})", path.display(), i + 1);
        }
        out.push(t);
    }
    Ok(out)
}
