//! composer-model: the policy model of composer-rl.
//!
//! - [`config`]: `ModelConfig` from/to Hugging Face `config.json` (Llama, Qwen2, Qwen3).
//! - [`transformer`]: the decoder (fused inference path + differentiable training path,
//!   caller-owned [`KvCache`]), load/save of HF checkpoints, `VarMap` master weights.
//! - [`lora`]: LoRA adapters (PEFT semantics and `adapter_model.safetensors` format), merge.
//! - [`checkpoint`]: safetensors single-file and sharded I/O.
//! - [`tokenizer`]: `tokenizer.json` wrapper and the Jinja chat template.
//! - [`logprobs`]: per-token log-probs, entropy and top-K from logits (f32, differentiable).
//! - [`rollout`]: batched KV-cached sampling returning token ids + sampler log-probs.
//! - [`score`]: teacher-forced scoring.
//! - [`policy`]: model + tokenizer + chat template bundle and the CLI entry points.
//! - [`bench`]: training and decoding throughput benchmark.

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod logprobs;
pub mod lora;
pub mod policy;
pub mod rollout;
pub mod score;
pub mod tokenizer;
pub mod transformer;

pub use config::{ModelConfig, ModelType};
pub use device::device_from_str;
pub use logprobs::{log_softmax, logsumexp, token_entropy, token_logprobs, topk_logprobs};
pub use lora::LoraConfig;
pub use policy::{generate_cli, score_cli, GenerateOptions, Policy};
pub use rollout::{generate, FinishReason, GenerationRequest, Sample, SamplingParams};
pub use score::{score, score_with_temperature};
pub use tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
pub use transformer::{KvCache, Transformer};
