//! `composer-rl record-traces`: sample a teacher checkpoint on a prompt dataset and write its
//! completions in the trace store's format (prompt/completion ids, the teacher's top-K ids
//! and log-probs at every completion position, reward, passed), for the replay channel.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use composer_loss::{Trace, TraceStore, TraceWriter};
use composer_model::{GenerationRequest, Policy, SamplingParams};

use crate::data::{self, Message};
use crate::prompts::render_messages;
use crate::recipe::VerifierSpec;
use crate::verifiers::RewardFn;

/// What to record.
#[derive(Debug, Clone)]
pub struct RecordTracesOptions {
    /// The teacher: an HF checkpoint directory.
    pub model_dir: PathBuf,
    /// JSONL prompts (`prompt` or `messages`, and `answer`), as `[data] dataset`.
    pub data: PathBuf,
    /// Trace file to write (JSONL; truncated unless `append`).
    pub out: PathBuf,
    /// Append to `out` (a store of several teachers) instead of truncating it. The store's
    /// traces must have been recorded with the same tokenizer and top-K; refused otherwise.
    pub append: bool,
    /// The teacher's name in the traces (default: the checkpoint directory's name).
    pub teacher: Option<String>,
    /// Completions per prompt.
    pub num_samples: usize,
    /// Top-K recorded per position.
    pub top_k: usize,
    /// Completion length cap.
    pub max_new_tokens: usize,
    /// Sampling temperature (0 = greedy). Recorded log-probs are at temperature 1.
    pub temperature: f64,
    /// RNG seed (prompt i samples from seed + i).
    pub seed: u64,
    /// Verifier kind scoring the completions against the rows' answers.
    pub verifier: String,
    /// The `regex` verifier's pattern (`{answer}` is replaced by the escaped answer).
    pub verifier_pattern: Option<String>,
    /// Device string.
    pub device: String,
}

/// What was recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordSummary {
    /// Traces written.
    pub traces: usize,
    /// Of which passed the verifier.
    pub passed: usize,
    /// Prompts with no passing trace.
    pub prompts_without_pass: usize,
}

/// Most completions per prompt (as `generate`'s `--num-samples`).
const MAX_NUM_SAMPLES: usize = 1024;

/// The flags' values, checked before anything is loaded or written.
fn check_options(o: &RecordTracesOptions) -> Result<()> {
    if !(1..=MAX_NUM_SAMPLES).contains(&o.num_samples) {
        bail!(
            "--num-samples must be in 1..={MAX_NUM_SAMPLES}, got {}",
            o.num_samples
        );
    }
    if o.top_k == 0 {
        bail!("--top-k must be at least 1 (the teacher's top-K ids recorded per position)");
    }
    if o.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    if !(o.temperature.is_finite() && o.temperature >= 0.0) {
        bail!(
            "--temperature must be finite and >= 0, got {}",
            o.temperature
        );
    }
    if matches!(&o.teacher, Some(t) if t.trim().is_empty()) {
        bail!("--teacher: empty name");
    }
    Ok(())
}

/// Samples the teacher and writes the trace file. Every flag and every prompt row is checked
/// before the first trace is written, and the traces go to a temporary sibling renamed over
/// `out` at the end (after a copy of `out` when appending): a bad flag or row, or a failure
/// halfway, leaves `out` as it was.
pub fn record_traces(o: &RecordTracesOptions) -> Result<RecordSummary> {
    check_options(o)?;
    let reward = RewardFn::from_specs(&[VerifierSpec {
        kind: o.verifier.clone(),
        weight: 1.0,
        pattern: o.verifier_pattern.clone(),
    }])
    .context("--verifier")?;
    let device = composer_model::device_from_str(&o.device)?;
    let policy = Policy::load(&o.model_dir, &device, DType::F32)?;
    let vocab = policy.model.cfg.vocab_size;
    if o.top_k > vocab {
        bail!(
            "--top-k {} is more than the teacher's {vocab} tokens",
            o.top_k
        );
    }
    let rows = data::load_prompts(&o.data, &|m: &[Message]| {
        render_messages(policy.chat_template.as_ref(), m)
    })?;
    let mut prompts = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let prompt_ids = policy.tokenizer.encode(&row.prompt)?;
        if prompt_ids.is_empty() {
            bail!(
                "{} row {}: the prompt tokenizes to nothing",
                o.data.display(),
                i + 1
            );
        }
        prompts.push(prompt_ids);
    }
    let max = reward.max_reward();
    let teacher = o
        .teacher
        .clone()
        .unwrap_or_else(|| teacher_name(&o.model_dir));
    let fingerprint = tokenizer_fingerprint(&o.model_dir)?;
    if o.append {
        check_appendable(&o.out, &fingerprint, o.top_k, &o.model_dir)?;
    }
    let params = SamplingParams {
        temperature: o.temperature,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens: o.max_new_tokens,
        stop_token_ids: policy.sampling.stop_token_ids.clone(),
        ..Default::default()
    };
    let tmp = composer_fsutil::temp_path(&o.out);
    if o.append && o.out.exists() {
        std::fs::copy(&o.out, &tmp)
            .with_context(|| format!("copying {} to {}", o.out.display(), tmp.display()))?;
    } else {
        let _ = std::fs::remove_file(&tmp);
    }
    let recorded = (|| {
        let mut writer = TraceWriter::append(&tmp).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut summary = RecordSummary {
            traces: 0,
            passed: 0,
            prompts_without_pass: 0,
        };
        for (i, (row, prompt_ids)) in rows.iter().zip(&prompts).enumerate() {
            let req = GenerationRequest {
                prompt_ids: prompt_ids.clone(),
                num_samples: o.num_samples,
                seed: o.seed.wrapping_add(i as u64),
            };
            let samples = composer_model::generate(&policy.model, &[req], &params)?;
            let mut any_pass = false;
            for smp in samples.into_iter().flatten() {
                let (topk_ids, topk_logprobs) =
                    teacher_topk(&policy, prompt_ids, &smp.completion_ids, o.top_k)?;
                let text = policy.tokenizer.decode_skip_special(&smp.completion_ids)?;
                let (r, _) = reward.score(&text, &row.answer);
                let passed = r >= max - 1e-9;
                any_pass |= passed;
                writer
                    .write(&Trace {
                        teacher: teacher.clone(),
                        prompt_ids: prompt_ids.clone(),
                        completion_ids: smp.completion_ids,
                        topk_ids,
                        topk_logprobs,
                        reward: r,
                        passed,
                        loss_mask: None,
                        tokenizer: Some(fingerprint.clone()),
                    })
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                summary.traces += 1;
                summary.passed += passed as usize;
            }
            summary.prompts_without_pass += (!any_pass) as usize;
        }
        writer.flush().map_err(|e| anyhow::anyhow!("{e}"))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", tmp.display()))?;
        std::fs::rename(&tmp, &o.out)
            .with_context(|| format!("renaming {} to {}", tmp.display(), o.out.display()))?;
        composer_fsutil::sync_parent(&o.out)?;
        Ok(summary)
    })();
    if recorded.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    recorded
}

/// The teacher's top-K ids and log-probs (temperature 1) at every completion position.
#[allow(clippy::type_complexity)]
fn teacher_topk(
    policy: &Policy,
    prompt: &[u32],
    completion: &[u32],
    k: usize,
) -> Result<(Vec<Vec<u32>>, Vec<Vec<f32>>)> {
    if completion.is_empty() {
        return Ok((vec![], vec![]));
    }
    let seq: Vec<u32> = prompt
        .iter()
        .chain(completion)
        .copied()
        .take(prompt.len() + completion.len() - 1)
        .collect();
    let n = seq.len();
    let ids = Tensor::from_vec(seq, (1, n), policy.model.device())?;
    // The fused head at the completion positions: no [len, vocab] logits beyond one chunk.
    let hidden = policy
        .model
        .forward_hidden(&ids, None, None, false)?
        .narrow(1, prompt.len() - 1, completion.len())?
        .squeeze(0)?;
    let none = Tensor::zeros((completion.len(), 0), DType::U32, ids.device())?;
    let out = policy.model.head_logprobs(
        &hidden,
        &none,
        &composer_model::HeadOptions {
            top_k: k,
            ..Default::default()
        },
    )?;
    let top_ids = out.topk_ids.context("top-K ids of the teacher")?;
    let top_lp = out
        .topk_logprobs
        .context("top-K log-probs of the teacher")?;
    Ok((
        top_ids.to_vec2::<u32>()?,
        top_lp.to_dtype(DType::F32)?.to_vec2::<f32>()?,
    ))
}

fn teacher_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().to_string())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "teacher".into())
}

/// sha256 (hex) of the checkpoint's tokenizer.json: the identity of the token ids in its traces.
fn tokenizer_fingerprint(model_dir: &Path) -> Result<String> {
    crate::data::file_sha256(&model_dir.join("tokenizer.json"))
}

/// With `--append`: the existing store at `out` (if any) must load as a trace store, and every
/// trace in it must carry this teacher's tokenizer fingerprint and top-K width; the error
/// names the store's line at fault.
fn check_appendable(out: &Path, fingerprint: &str, top_k: usize, model_dir: &Path) -> Result<()> {
    if !out.exists() {
        return Ok(());
    }
    let store = TraceStore::load(out)
        .map_err(|e| anyhow::anyhow!("--append: {} is not a trace store: {e}", out.display()))?;
    for (i, t) in store.traces.iter().enumerate() {
        let line = i + 1;
        match &t.tokenizer {
            None => bail!(
                "--append: {} trace #{line} (teacher {:?}) carries no tokenizer fingerprint, so it cannot be shown to match {}'s tokenizer; record into a new store",
                out.display(),
                t.teacher,
                model_dir.display()
            ),
            Some(f) if f != fingerprint => bail!(
                "--append: {} trace #{line} (teacher {:?}) was recorded with tokenizer {f}, but {} has tokenizer {fingerprint}: one store holds one tokenizer's ids",
                out.display(),
                t.teacher,
                model_dir.display()
            ),
            Some(_) => {}
        }
        if t.k() != 0 && t.k() != top_k {
            bail!(
                "--append: {} trace #{line} (teacher {:?}) has top-K {}, this recording --top-k {top_k}: one store holds one K",
                out.display(),
                t.teacher,
                t.k()
            );
        }
    }
    Ok(())
}
