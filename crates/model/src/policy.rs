//! `Policy`: model + tokenizer + chat template + generation defaults, loaded from and saved
//! to one Hugging Face model directory; and the `generate` CLI entry point.

use crate::config::ModelConfig;
use crate::device::device_from_str;
use crate::rollout::{generate, FinishReason, GenerationRequest, SamplingParams};
use crate::tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use crate::transformer::Transformer;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarMap;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Everything needed to turn text into completions.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The transformer.
    pub model: Transformer,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Chat template, if the checkpoint has one.
    pub chat_template: Option<ChatTemplate>,
    /// Default sampling knobs (stop ids = config/generation_config EOS ∪ tokenizer EOS).
    pub sampling: SamplingParams,
}

/// Checks the tokenizer cannot emit ids the model has no embedding for. A tokenizer
/// smaller than `vocab_size` is normal (Qwen pads the embedding to a multiple of 128).
fn check_vocab(tokenizer: &Tokenizer, cfg: &ModelConfig, dir: &Path) -> Result<()> {
    let Some(max_id) = tokenizer.max_token_id() else {
        bail!(
            "{}: the tokenizer has no tokens",
            dir.join("tokenizer.json").display()
        );
    };
    if max_id as usize >= cfg.vocab_size {
        bail!(
            "tokenizer/vocab size mismatch: {} has {} tokens (ids up to {max_id}) but {} `vocab_size` is {}; \
             ids >= vocab_size have no embedding row",
            dir.join("tokenizer.json").display(),
            tokenizer.vocab_size(),
            dir.join("config.json").display(),
            cfg.vocab_size
        );
    }
    Ok(())
}

impl Policy {
    /// Assembles a policy; stop ids default to the model's EOS plus the tokenizer's.
    pub fn new(
        model: Transformer,
        tokenizer: Tokenizer,
        chat_template: Option<ChatTemplate>,
    ) -> Result<Self> {
        check_vocab(&tokenizer, &model.cfg, Path::new("<in-memory model>"))?;
        let mut stops = model.cfg.eos_token_ids.clone();
        if let Some(e) = tokenizer.eos_token_id() {
            if !stops.contains(&e) {
                stops.push(e);
            }
        }
        Ok(Policy {
            model,
            tokenizer,
            chat_template,
            sampling: SamplingParams {
                stop_token_ids: Some(stops),
                ..SamplingParams::default()
            },
        })
    }

    /// Loads a Hugging Face model directory for inference. The config and tokenizer are
    /// checked against each other before the (possibly large) weights are read.
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let (tokenizer, chat_template) = Self::load_text_side(dir)?;
        let model = Transformer::load(dir, device, dtype)?;
        Self::new(model, tokenizer, chat_template)
    }

    /// Loads a model directory with trainable f32 variables (returns their `VarMap`).
    pub fn load_trainable(dir: &Path, device: &Device) -> Result<(Self, VarMap)> {
        let (tokenizer, chat_template) = Self::load_text_side(dir)?;
        let (model, varmap) = Transformer::load_trainable(dir, device, DType::F32)?;
        Ok((Self::new(model, tokenizer, chat_template)?, varmap))
    }

    /// Tokenizer and chat template of `dir`, after checking the tokenizer against
    /// `config.json`'s `vocab_size`.
    fn load_text_side(dir: &Path) -> Result<(Tokenizer, Option<ChatTemplate>)> {
        let cfg = ModelConfig::from_dir(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        check_vocab(&tokenizer, &cfg, dir)?;
        let chat_template = ChatTemplate::from_dir(dir, Some(&tokenizer))?;
        Ok((tokenizer, chat_template))
    }

    /// Writes model, generation config, tokenizer and chat template into `dir`.
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        self.model.save_pretrained(dir)?;
        self.tokenizer.save(dir)?;
        if let Some(t) = &self.chat_template {
            t.save(dir)?;
        }
        Ok(())
    }

    /// Prompt token ids: the raw text, or with `chat` the chat template rendered for one
    /// user message with the generation prompt.
    pub fn encode_prompt(&self, text: &str, chat: bool) -> Result<Vec<u32>> {
        if chat {
            let t = self
                .chat_template
                .as_ref()
                .context("--chat needs a chat template (chat_template.jinja or tokenizer_config.json `chat_template`)")?;
            let rendered = t.render(&[ChatMessage::new("user", text)], true)?;
            self.tokenizer.encode(&rendered)
        } else {
            self.tokenizer.encode(text)
        }
    }
}

/// Options of `composer-rl generate`.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Hugging Face model directory.
    pub model_dir: PathBuf,
    /// Prompt text.
    pub prompt: String,
    /// Render the prompt through the chat template as one user message.
    pub chat: bool,
    /// Completion length cap.
    pub max_new_tokens: usize,
    /// Temperature (0 = greedy).
    pub temperature: f64,
    /// Nucleus mass (1 = off).
    pub top_p: f64,
    /// Top-k (0 = off).
    pub top_k: usize,
    /// Min-p (0 = off).
    pub min_p: f64,
    /// RNG seed.
    pub seed: u64,
    /// Number of completions.
    pub num_samples: usize,
    /// Device string (`cpu`, `cuda:0`).
    pub device: String,
    /// Batch-invariant decoding ([`crate::generate_deterministic`]): log-probs equal
    /// `score --deterministic`'s bitwise.
    pub deterministic: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            model_dir: PathBuf::new(),
            prompt: String::new(),
            chat: false,
            max_new_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
            num_samples: 1,
            device: "cpu".into(),
            deterministic: false,
        }
    }
}

/// Activation dtype of the CLI entry points: bf16 on a GPU, f32 on the CPU.
pub(crate) fn dtype_for(device: &Device) -> DType {
    if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

/// `composer-rl generate`: `{"samples":[{"completion_ids","completion_text","logprobs",
/// "finish_reason"}]}`.
pub fn generate_cli(opts: &GenerateOptions) -> Result<Value> {
    let device = device_from_str(&opts.device)?;
    let knobs = SamplingParams {
        temperature: opts.temperature,
        top_p: opts.top_p,
        top_k: opts.top_k,
        min_p: opts.min_p,
        ..SamplingParams::default()
    };
    crate::sampling::check_params(&knobs)?;
    let policy = Policy::load(&opts.model_dir, &device, dtype_for(&device))?;
    let prompt_ids = policy.encode_prompt(&opts.prompt, opts.chat)?;
    if prompt_ids.is_empty() {
        bail!("the prompt tokenizes to no tokens");
    }
    let params = SamplingParams {
        max_new_tokens: opts.max_new_tokens,
        stop_token_ids: policy.sampling.stop_token_ids.clone(),
        deterministic: opts.deterministic,
        ..knobs
    };
    let req = GenerationRequest {
        prompt_ids,
        num_samples: opts.num_samples,
        seed: opts.seed,
    };
    let out = generate(&policy.model, &[req], &params)?;
    let mut samples = Vec::new();
    for s in out.into_iter().flatten() {
        if let Some(i) = s.sampler_logprobs.iter().position(|lp| !lp.is_finite()) {
            anyhow::bail!(
                "{}: the model's log-prob of sampled token {i} is {} (non-finite logits: NaN or                  inf weights, or a config value such as rms_norm_eps that makes them)",
                opts.model_dir.display(),
                s.sampler_logprobs[i]
            );
        }
        samples.push(json!({
            "completion_ids": s.completion_ids,
            // As transformers' decode(ids, skip_special_tokens=True): no `<|im_end|>` etc.
            "completion_text": policy.tokenizer.decode_skip_special(&s.completion_ids)?,
            "logprobs": s.sampler_logprobs,
            "finish_reason": match s.finish_reason { FinishReason::Stop => "stop", FinishReason::Length => "length" },
        }));
    }
    Ok(json!({ "samples": samples }))
}
