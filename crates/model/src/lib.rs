//! composer-model: the policy model of composer-rl.
//!
//! - [`config`]: `ModelConfig` from/to Hugging Face `config.json` (Llama, Qwen2, Qwen3).
//! - [`transformer`]: the decoder (fused inference path + differentiable training path,
//!   caller-owned [`KvCache`]), load/save of HF checkpoints, `VarMap` master weights.
//! - [`chunked_logprobs`]: the LM head fused with log-softmax, gathers, entropy and top-K,
//!   chunked over tokens forward and backward (the training path: no `[N, vocab]` logits).
//! - [`ops`]: training ops with a backward (RMSNorm, RoPE, SwiGLU, causal GQA attention over
//!   variable-length packed rows), custom CPU kernels with candle compositions elsewhere.
//! - [`kv_cache`]: the KV cache, grown in blocks and written in place.
//! - [`lora`]: LoRA adapters on a model (PEFT semantics and `adapter_model.safetensors`
//!   format): add, attach, save, load, merge, export.
//! - [`lora_adapter`]: the LoRA config and one projection's adapter (what the layers hold).
//! - [`checkpoint`]: safetensors single-file and sharded I/O.
//! - [`tokenizer`]: `tokenizer.json` wrapper and the Jinja chat template.
//! - [`logprobs`]: per-token log-probs, entropy and top-K from logits (f32, differentiable).
//! - [`rollout`]: batched KV-cached sampling returning token ids + sampler log-probs.
//! - [`sampling`]: the request/sample types and the token sampler (engine and deterministic).
//! - [`engine`]: the rollout scheduler: continuous batching over a paged KV cache (block
//!   tables; a prompt's blocks shared by its samples), shared prompt prefill, KV budget.
//! - [`prefix_store`]: finished samples' KV rows kept so a continuation prefills only new tokens.
//! - [`score`]: teacher-forced scoring.
//! - [`deterministic`]: batch-invariant sampling and scoring (log-probs equal bitwise).
//! - [`score_cli`]: `composer-rl score` on text, exact ids or a JSON Lines batch.
//! - [`policy`]: model + tokenizer + chat template bundle and the CLI entry points.
//! - [`threads`]: the CPU thread count of candle's matmuls, fixed once at start-up.
//! - [`bench`]: training and decoding throughput benchmark.
//! - [`bench_rollout`]: decode throughput on an HF checkpoint (vs transformers' `generate`).

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

pub mod bench;
pub mod bench_rollout;
pub mod bench_rollout_grpo;
pub mod checkpoint;
pub mod chunked_logprobs;
pub mod config;
mod decode_graph;
pub mod deterministic;
pub mod device;
pub mod engine;
pub mod kv_cache;
pub mod logprobs;
pub mod lora;
pub mod lora_adapter;
pub mod ops;
mod paged_kv;
pub mod policy;
mod prefill;
pub mod prefix_store;
pub mod rollout;
pub mod sampling;
pub mod score;
pub mod score_cli;
pub mod threads;
pub mod tokenizer;
pub mod transformer;

pub use chunked_logprobs::{head_logprobs, head_logprobs_with, HeadLogprobs, HeadOptions};
pub use config::{ModelConfig, ModelType};
pub use decode_graph::GraphStats;
pub use deterministic::{generate_deterministic, score_deterministic};
pub use device::device_from_str;
pub use engine::{generate_with_stats, generate_with_store, EngineConfig, EngineStats};
pub use logprobs::{log_softmax, logsumexp, token_entropy, token_logprobs, topk_logprobs};
pub use lora::LoraConfig;
pub use policy::{generate_cli, GenerateOptions, Policy};
pub use prefix_store::PrefixStore;
pub use rollout::{generate, FinishReason, GenerationRequest, Sample, SamplingParams};
pub use score::{score, score_with_temperature};
pub use score_cli::{score_cli, ScoreInput, ScoreOptions};
pub use threads::configure_cpu_threads;
pub use tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
pub use transformer::{KvCache, PackedBatch, Transformer};
