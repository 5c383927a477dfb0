//! The trace store: recorded trajectories of N frozen teachers, for the replay channel.
//!
//! # On-disk format: JSONL
//!
//! One trace per line, a JSON object with exactly these keys:
//!
//! ```json
//! {"teacher": "qwen2.5-coder-7b", "prompt_ids": [1, 2, 3], "completion_ids": [4, 5],
//!  "topk_ids": [[4, 9], [5, 7]], "topk_logprobs": [[-0.1, -2.5], [-0.05, -3.2]],
//!  "reward": 1.0, "passed": true}
//! ```
//!
//! * `topk_ids[t]` / `topk_logprobs[t]`: the teacher's K most likely next tokens at completion
//!   position t and their log-probs (natural log, ≤ 0, Σ exp ≤ 1); every row has the same K.
//!   The tail mass 1 − Σ exp is implied, never stored.
//! * Blank lines are skipped; unknown keys are errors (a typo must not silently drop data).
//!
//! Why JSONL rather than safetensors: traces are ragged (every prompt and completion has its
//! own length), are appended one at a time by teacher scripts in any language, and are read
//! once per run and held in memory; JSONL is appendable, greppable, diffable and streams
//! line by line, and an error can name the exact line. Top-K (K ≈ 20) per token is small, so
//! the text overhead is affordable; no full-vocabulary rows are ever stored.
use crate::{LossError, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

/// One recorded teacher trajectory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trace {
    /// Name of the teacher that produced it.
    pub teacher: String,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Completion token ids.
    pub completion_ids: Vec<u32>,
    /// `[T][K]` top-K token ids per completion position.
    pub topk_ids: Vec<Vec<u32>>,
    /// `[T][K]` their log-probs.
    pub topk_logprobs: Vec<Vec<f32>>,
    /// The reward it received.
    pub reward: f64,
    /// Whether it passed the verifier.
    pub passed: bool,
    /// Per completion position: 1 = the teacher's token (trained on), 0 = an environment
    /// token (a tool result between the turns of a multi-turn episode: never trained on).
    /// Absent: every position is the teacher's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_mask: Option<Vec<u8>>,
    /// Fingerprint of the tokenizer the ids belong to (`record-traces` writes the sha256 of
    /// the teacher's tokenizer.json), so traces of another tokenizer are not appended to the
    /// same store. Absent: unknown (scripted traces, older stores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
}

impl Trace {
    /// K of this trace (0 for an empty completion).
    pub fn k(&self) -> usize {
        self.topk_ids.first().map_or(0, |r| r.len())
    }

    /// Check internal consistency; the message names the field.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.teacher.is_empty() {
            return Err("`teacher` is empty".into());
        }
        let t = self.completion_ids.len();
        if t == 0 {
            return Err("`completion_ids` is empty".into());
        }
        if self.topk_ids.len() != t || self.topk_logprobs.len() != t {
            return Err(format!(
                "`topk_ids` has {} rows and `topk_logprobs` {} rows, `completion_ids` has {t} tokens",
                self.topk_ids.len(),
                self.topk_logprobs.len()
            ));
        }
        let k = self.k();
        if k == 0 {
            return Err("`topk_ids` rows are empty (K = 0)".into());
        }
        for (pos, (ids, lps)) in self.topk_ids.iter().zip(&self.topk_logprobs).enumerate() {
            if ids.len() != k || lps.len() != k {
                return Err(format!("position {pos}: `topk_ids` has {} entries, `topk_logprobs` {}, expected K = {k}", ids.len(), lps.len()));
            }
            if let Some(x) = lps.iter().find(|x| !x.is_finite() || **x > 1e-6) {
                return Err(format!(
                    "position {pos}: `topk_logprobs` value {x} is not a finite log-probability ≤ 0"
                ));
            }
            let mass: f64 = lps.iter().map(|x| (*x as f64).exp()).sum();
            if mass > 1.0 + 1e-3 {
                return Err(format!(
                    "position {pos}: `topk_logprobs` sum to probability {mass} > 1"
                ));
            }
        }
        if let Some(mask) = &self.loss_mask {
            if mask.len() != t {
                return Err(format!(
                    "`loss_mask` has {} entries, `completion_ids` has {t} tokens",
                    mask.len()
                ));
            }
            if let Some(pos) = mask.iter().position(|&m| m > 1) {
                return Err(format!("position {pos}: `loss_mask` values must be 0 or 1"));
            }
            if !mask.contains(&1) {
                return Err("`loss_mask` masks every position".into());
            }
        }
        if !self.reward.is_finite() {
            return Err(format!("`reward` {} is not finite", self.reward));
        }
        Ok(())
    }

    /// The recorded log-prob of each sampled completion token, when it is among that
    /// position's top-K (else `None`): the "recorded" reference for DPO.
    pub fn recorded_token_logprobs(&self) -> Option<Vec<f32>> {
        self.completion_ids
            .iter()
            .zip(self.topk_ids.iter().zip(&self.topk_logprobs))
            .map(|(id, (ids, lps))| ids.iter().position(|x| x == id).map(|k| lps[k]))
            .collect()
    }
}

/// All traces of one JSONL file, in file order.
#[derive(Debug, Clone, Default)]
pub struct TraceStore {
    /// Where they were loaded from.
    pub path: PathBuf,
    /// The traces.
    pub traces: Vec<Trace>,
}

impl TraceStore {
    /// Load and validate a JSONL trace file. Errors name the file and the 1-based line.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::load_checked(path.as_ref(), None)
    }

    /// [`TraceStore::load`], also refusing a token id (prompt, completion or top-K) that is
    /// not below `vocab_size`: the error names the file and line, before any training.
    pub fn load_within_vocab(path: impl AsRef<Path>, vocab_size: usize) -> Result<Self> {
        Self::load_checked(path.as_ref(), Some(vocab_size))
    }

    fn load_checked(path: &Path, vocab_size: Option<usize>) -> Result<Self> {
        let name = path.display().to_string();
        let file = File::open(path).map_err(|source| LossError::Io {
            path: name.clone(),
            source,
        })?;
        let mut traces = Vec::new();
        for (i, line) in BufReader::new(file).lines().enumerate() {
            let line = line.map_err(|e| LossError::TraceFile {
                path: name.clone(),
                line: i + 1,
                message: e.to_string(),
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let trace: Trace = serde_json::from_str(&line).map_err(|e| LossError::TraceFile {
                path: name.clone(),
                line: i + 1,
                message: e.to_string(),
            })?;
            trace.validate().map_err(|message| LossError::TraceFile {
                path: name.clone(),
                line: i + 1,
                message,
            })?;
            if let Some(vocab) = vocab_size {
                let outside = (trace.prompt_ids.iter())
                    .chain(&trace.completion_ids)
                    .chain(trace.topk_ids.iter().flatten())
                    .find(|&&id| id as usize >= vocab);
                if let Some(id) = outside {
                    return Err(LossError::TraceFile {
                        path: name.clone(),
                        line: i + 1,
                        message: format!(
                            "token id {id} is outside the model's vocabulary of {vocab}"
                        ),
                    });
                }
            }
            traces.push(trace);
        }
        Ok(Self {
            path: path.to_path_buf(),
            traces,
        })
    }

    /// Number of traces.
    pub fn len(&self) -> usize {
        self.traces.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.traces.is_empty()
    }

    /// The distinct teacher names, sorted.
    pub fn teachers(&self) -> Vec<String> {
        self.traces
            .iter()
            .map(|t| t.teacher.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// Traces recorded for exactly this prompt.
    pub fn for_prompt<'a>(&'a self, prompt_ids: &'a [u32]) -> impl Iterator<Item = &'a Trace> + 'a {
        self.traces
            .iter()
            .filter(move |t| t.prompt_ids == prompt_ids)
    }

    /// Passing traces recorded for this prompt (DPO "chosen" candidates).
    pub fn passing_for_prompt<'a>(
        &'a self,
        prompt_ids: &'a [u32],
    ) -> impl Iterator<Item = &'a Trace> + 'a {
        self.for_prompt(prompt_ids).filter(|t| t.passed)
    }
}

/// Appends traces to a JSONL file (what a scripted teacher uses to record).
#[derive(Debug)]
pub struct TraceWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TraceWriter {
    /// Create (truncate) a trace file.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let f = File::create(&path).map_err(|source| LossError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Ok(Self {
            path,
            out: BufWriter::new(f),
        })
    }

    /// Open a trace file for appending (created if absent).
    pub fn append(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| LossError::Io {
                path: path.display().to_string(),
                source,
            })?;
        Ok(Self {
            path,
            out: BufWriter::new(f),
        })
    }

    /// Validate and write one trace as one line.
    pub fn write(&mut self, trace: &Trace) -> Result<()> {
        let name = self.path.display().to_string();
        trace.validate().map_err(|message| LossError::TraceFile {
            path: name.clone(),
            line: 0,
            message,
        })?;
        let line = serde_json::to_string(trace).map_err(|e| LossError::TraceFile {
            path: name.clone(),
            line: 0,
            message: e.to_string(),
        })?;
        writeln!(self.out, "{line}").map_err(|source| LossError::Io { path: name, source })
    }

    /// Flush to the OS (call before others read the file).
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|source| LossError::Io {
            path: self.path.display().to_string(),
            source,
        })
    }
}

/// Padded top-K tensors of a batch of traces, for the teacher-KL replay loss.
#[derive(Debug, Clone)]
pub struct TopkBatch {
    /// `[B, T, K]` u32 top-K ids (0 on padding) — gather the student's log-probs here.
    pub topk_ids: Tensor,
    /// `[B, T, K]` recorded teacher log-probs (0 on padding).
    pub teacher_topk_logprobs: Tensor,
    /// `[B, T]` 0/1 mask of the teacher's completion positions (not padding, not masked
    /// environment tokens).
    pub loss_mask: Tensor,
    /// Teacher name per trace.
    pub teachers: Vec<String>,
}

/// Collate traces (same K) into right-padded tensors.
pub fn collate_topk(traces: &[&Trace], device: &Device, dtype: DType) -> Result<TopkBatch> {
    let b = traces.len();
    let k = traces.first().map_or(0, |t| t.k());
    if let Some(bad) = traces.iter().position(|t| t.k() != k) {
        return Err(LossError::Input {
            field: "traces",
            message: format!(
                "trace {bad} has K = {}, trace 0 has K = {k}",
                traces[bad].k()
            ),
        });
    }
    let t = traces
        .iter()
        .map(|x| x.completion_ids.len())
        .max()
        .unwrap_or(0);
    let mut ids = vec![0u32; b * t * k];
    let mut lps = vec![0f32; b * t * k];
    let mut mask = vec![0f32; b * t];
    for (i, tr) in traces.iter().enumerate() {
        for (j, (ri, rl)) in tr.topk_ids.iter().zip(&tr.topk_logprobs).enumerate() {
            let o = (i * t + j) * k;
            ids[o..o + k].copy_from_slice(ri);
            lps[o..o + k].copy_from_slice(rl);
            mask[i * t + j] = match &tr.loss_mask {
                Some(m) => f32::from(m[j]),
                None => 1.0,
            };
        }
    }
    Ok(TopkBatch {
        topk_ids: Tensor::from_vec(ids, (b, t, k), device)?,
        teacher_topk_logprobs: Tensor::from_vec(lps, (b, t, k), device)?.to_dtype(dtype)?,
        loss_mask: Tensor::from_vec(mask, (b, t), device)?.to_dtype(dtype)?,
        teachers: traces.iter().map(|x| x.teacher.clone()).collect(),
    })
}
