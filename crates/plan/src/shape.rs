//! [`WorkloadShape`]: the per-step description of a workload that the estimator plans for.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::hardware::{GpuKind, ModelArch};
use crate::WEIGHT_BYTES_PER_PARAM;

/// What a workload looks like (all per training step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadShape {
    /// Model parameters N.
    pub params: f64,
    /// Mean completion length L̄ (tokens).
    pub mean_output_tokens: f64,
    /// p95 completion length L95 (tokens).
    pub p95_output_tokens: f64,
    /// Prompt length P (tokens).
    pub prompt_tokens: f64,
    /// Completions per step S (prompts × group size).
    pub samples_per_step: usize,
    /// Mean env/verifier latency per call (seconds).
    pub env_latency_mean_s: f64,
    /// p95 env/verifier latency per call (seconds).
    pub env_latency_p95_s: f64,
    /// Env calls in flight at once (`None`: all samples at once).
    pub env_concurrency: Option<usize>,
    /// Sequential env calls per sample (turns).
    pub env_calls_per_sample: f64,
    /// Largest policy-version lag the algorithm tolerates (0: on-policy only).
    pub staleness_tolerance: u32,
    /// GPUs G.
    pub gpus: usize,
    /// GPU kind.
    pub gpu: GpuKind,
    /// Transformer shape; `None`: the nearest Qwen2.5 config ([`ModelArch::for_params`]).
    pub arch: Option<ModelArch>,
    /// Model FLOP utilisation assumed for the trainer and prefill (0.4 by default).
    pub mfu: f64,
    /// Generator replicas the weights are sent to one after the other (1: broadcast tree).
    pub weight_copies: usize,
}

impl Default for WorkloadShape {
    /// A 7B model, 256 samples of mean 2000 / p95 8000 tokens after 512-token prompts, 1 s
    /// env calls, on-policy, 8 H100s.
    fn default() -> Self {
        WorkloadShape {
            params: 7e9,
            mean_output_tokens: 2000.0,
            p95_output_tokens: 8000.0,
            prompt_tokens: 512.0,
            samples_per_step: 256,
            env_latency_mean_s: 1.0,
            env_latency_p95_s: 1.0,
            env_concurrency: None,
            env_calls_per_sample: 1.0,
            staleness_tolerance: 0,
            gpus: 8,
            gpu: GpuKind::H100,
            arch: None,
            mfu: 0.4,
            weight_copies: 1,
        }
    }
}

/// Largest `--params` accepted (10¹⁵, ~500× today's largest models).
pub const MAX_PARAMS: f64 = 1e15;
/// Largest token count accepted for `--mean-output`, `--p95-output`, `--prompt-tokens`.
pub const MAX_TOKENS: f64 = 1e9;
/// Largest env latency accepted (seconds, ~31.7 years).
pub const MAX_SECONDS: f64 = 1e9;
/// Largest GPU, sample, copy, call or architecture count accepted.
pub const MAX_COUNT: usize = 1_000_000;
/// Smallest `--mfu` accepted: below it every wall is astronomically long.
pub const MIN_MFU: f64 = 1e-3;

impl WorkloadShape {
    /// Checks every field; the error names the option at fault.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("--params", self.params),
            ("--mean-output", self.mean_output_tokens),
            ("--p95-output", self.p95_output_tokens),
            ("--mfu", self.mfu),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                bail!("{name} must be a positive number, got {v}");
            }
        }
        let non_negative = [
            ("--prompt-tokens", self.prompt_tokens),
            ("--env-latency", self.env_latency_mean_s),
            ("--env-latency-p95", self.env_latency_p95_s),
            ("--env-calls", self.env_calls_per_sample),
        ];
        for (name, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{name} must be a non-negative number, got {v}");
            }
        }
        if self.p95_output_tokens < self.mean_output_tokens {
            bail!(
                "--p95-output ({}) is below --mean-output ({}): the p95 of a length distribution is at least its typical value",
                self.p95_output_tokens,
                self.mean_output_tokens
            );
        }
        if self.env_latency_p95_s < self.env_latency_mean_s {
            bail!(
                "--env-latency-p95 ({}) is below --env-latency ({})",
                self.env_latency_p95_s,
                self.env_latency_mean_s
            );
        }
        if self.mfu > 1.0 {
            bail!("--mfu must be at most 1, got {}", self.mfu);
        }
        if self.samples_per_step == 0 {
            bail!("--samples-per-step must be at least 1");
        }
        if self.gpus == 0 {
            bail!("--gpus must be at least 1");
        }
        if self.env_concurrency == Some(0) {
            bail!("--env-concurrency must be at least 1");
        }
        if self.weight_copies == 0 {
            bail!("--weight-copies must be at least 1");
        }
        if let Some(a) = &self.arch {
            if a.layers == 0 || a.kv_heads == 0 || a.head_dim == 0 {
                bail!("--layers, --kv-heads and --head-dim must be at least 1");
            }
        }
        self.check_upper_bounds()
    }

    /// Refuses values far beyond any real workload, naming the flag: the GPU split search is
    /// linear in `--gpus` (so 2⁶⁴ GPUs never finished), and huge sizes overflow the walls to
    /// infinity (NaN shares in the plan).
    fn check_upper_bounds(&self) -> Result<()> {
        let (layers, hidden, kv_heads, head_dim) = self.arch.map_or((0, 0, 0, 0), |a| {
            (a.layers, a.hidden, a.kv_heads, a.head_dim)
        });
        let floats = [
            ("--params", self.params, MAX_PARAMS),
            ("--mean-output", self.mean_output_tokens, MAX_TOKENS),
            ("--p95-output", self.p95_output_tokens, MAX_TOKENS),
            ("--prompt-tokens", self.prompt_tokens, MAX_TOKENS),
            ("--env-latency", self.env_latency_mean_s, MAX_SECONDS),
            ("--env-latency-p95", self.env_latency_p95_s, MAX_SECONDS),
            ("--env-calls", self.env_calls_per_sample, MAX_COUNT as f64),
        ];
        for (name, v, max) in floats {
            if v > max {
                bail!("{name} = {v:e} is beyond any real workload (at most {max:e})");
            }
        }
        let counts = [
            ("--gpus", self.gpus),
            ("--samples-per-step", self.samples_per_step),
            ("--env-concurrency", self.env_concurrency.unwrap_or(0)),
            ("--weight-copies", self.weight_copies),
            ("--layers", layers),
            ("--hidden", hidden),
            ("--kv-heads", kv_heads),
            ("--head-dim", head_dim),
        ];
        for (name, v) in counts {
            if v > MAX_COUNT {
                bail!("{name} = {v} is beyond any real workload (at most {MAX_COUNT})");
            }
        }
        if self.mfu < MIN_MFU {
            bail!("--mfu = {:e} is below {MIN_MFU} (0.1%)", self.mfu);
        }
        Ok(())
    }

    pub(crate) fn arch(&self) -> ModelArch {
        self.arch
            .unwrap_or_else(|| ModelArch::for_params(self.params))
    }

    pub(crate) fn weight_bytes(&self) -> f64 {
        WEIGHT_BYTES_PER_PARAM * self.params
    }

    /// Link used for weight sync: NVLink/PCIe within one node (≤ 8 GPUs), the network beyond.
    pub(crate) fn sync_link(&self) -> f64 {
        let spec = self.gpu.spec();
        if self.gpus <= 8 {
            spec.link_bytes_per_s
        } else {
            spec.network_bytes_per_s
        }
    }
}
