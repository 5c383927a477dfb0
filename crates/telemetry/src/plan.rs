//! `composer-rl plan`: estimate a workload's four walls (τ_R rollout, τ_V reward/env,
//! τ_T train, τ_S weight sync) before any run, or read them from a run, and say which layout
//! fits: colocated synchronous, disaggregated (one-step overlap), or bounded-async.
//!
//! The formulas (also in `crates/telemetry/PLAN.md`), with N = parameters, S = samples per
//! step, P = prompt tokens, L̄ / L95 = mean / p95 output tokens, G = GPUs:
//!
//! - **Generator (τ_R)**: decode is memory-bound. A generator replica of `tp` GPUs (the
//!   smallest power of two whose share of the bf16 weights, 2N/tp, fits in half a GPU's
//!   memory) holds `b` sequences; every decode step reads all weights once plus the KV cache
//!   of every live sequence:
//!   `t_step = max((2N + b·kv·(P + L̄/2)) / (tp·HBM), 2N·b / (tp·FLOPs·MFU))`,
//!   with `kv = 2·layers·kv_heads·head_dim·2` bytes per token. A synchronous batch waits for
//!   its straggler, so `τ_R = waves · (L95 · t_step + 2N·b·P / (tp·FLOPs·MFU))` where
//!   `waves = ⌈S/replicas / b⌉` and `b` is capped by the KV memory left after the weights
//!   (`(0.9·tp·mem − 2N) / (kv·(P + L95))`). Asynchronous (continuous) batching refills
//!   finished slots, so its rollout uses L̄ in place of L95.
//! - **Env (τ_V)**: `τ_V = calls_per_sample · ⌈S / concurrency⌉ · env_p95` (each wave waits for
//!   its slowest call); async uses the mean latency.
//! - **Trainer (τ_T)**: `τ_T = 6·N·S·(P + L̄) / (G_T · FLOPs · MFU)` (forward 2N + backward 4N
//!   FLOPs per token; MFU 0.4 by default).
//! - **Sync (τ_S)**: `τ_S = 2N · copies / link` (bf16 weights, `copies` generator replicas fed
//!   sequentially, NVLink within a node of ≤ 8 GPUs, the network beyond).
//! - **Memory**: trainer state ≈ 16 bytes/param (bf16 weights 2 + f32 master 4 + f32 Adam m, v
//!   8 + bf16 grads 2), sharded over the trainer GPUs (FSDP/ZeRO-3); fits when
//!   `16N/G_T (+ 2N/tp generator weights when colocated) ≤ 0.9 · mem`. Activations are not
//!   modelled.
//! - **Layouts**: colocated sync `step = τ_R + τ_V + τ_T + τ_S` on all G GPUs; disaggregated
//!   (G_R + G_T = G, staleness 1) `step = max(τ_R(G_R) + τ_V, τ_T(G_T) + τ_S)`; bounded-async
//!   (staleness k ≥ 2) `step = max(τ_R^mean(G_R), τ_V^mean, τ_T(G_T) + τ_S)`; the split G_R:G_T
//!   minimises the step. The recommended layout is the fastest allowed by the staleness
//!   tolerance, but a more complex layout must win by ≥ 15% over a simpler one.

use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::metrics::read_metrics;
use crate::summary::{fmt_num, fmt_secs, RunSummary};

/// Trainer bytes per parameter: bf16 weights (2) + f32 master weights (4) + f32 Adam moments
/// (8) + bf16 gradients (2).
pub const TRAINER_BYTES_PER_PARAM: f64 = 16.0;
/// Weight bytes per parameter in bf16 (generator weights, weight sync).
pub const WEIGHT_BYTES_PER_PARAM: f64 = 2.0;
/// Fraction of GPU memory usable (the rest: CUDA context, fragmentation, activations slack).
pub const USABLE_MEMORY_FRACTION: f64 = 0.9;
/// A more complex layout must be at least this much faster to be recommended.
const LAYOUT_MARGIN: f64 = 1.15;

/// Accelerator kind with the datasheet numbers the estimator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuKind {
    /// NVIDIA H100 SXM5 80 GB.
    H100,
    /// NVIDIA H200 SXM 141 GB.
    H200,
    /// NVIDIA A100 SXM4 80 GB.
    A100,
    /// NVIDIA L40S 48 GB (PCIe, no NVLink).
    L40s,
    /// A CPU server (rough numbers; for smoke runs).
    Cpu,
}

/// Hardware numbers of one device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuSpec {
    /// Memory bandwidth (bytes/s).
    pub hbm_bytes_per_s: f64,
    /// Dense bf16 peak (FLOP/s), without sparsity.
    pub bf16_flops: f64,
    /// Device memory (bytes).
    pub memory_bytes: f64,
    /// Intra-node link bandwidth per direction (bytes/s): NVLink, or PCIe where there is none.
    pub link_bytes_per_s: f64,
    /// Inter-node network bandwidth per device (bytes/s).
    pub network_bytes_per_s: f64,
}

impl GpuKind {
    /// Datasheet numbers. Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: 3.35 TB/s
    /// HBM3, 989 TFLOP/s dense BF16 (1979 with sparsity), 80 GB, NVLink 900 GB/s
    /// bidirectional → 450 GB/s per direction); NVIDIA H200 datasheet (4.8 TB/s HBM3e, 141 GB,
    /// same compute and NVLink as H100); NVIDIA A100 datasheet (SXM4 80 GB: 2.039 TB/s, 312
    /// TFLOP/s BF16, NVLink 600 GB/s → 300 per direction); NVIDIA L40S datasheet (864 GB/s
    /// GDDR6, 362 TFLOP/s dense BF16, 48 GB, PCIe Gen4 x16 64 GB/s → 32 per direction).
    /// Network: 400 Gb/s (50 GB/s) NDR InfiniBand per H100/H200, 200 Gb/s (25 GB/s) HDR per
    /// A100/L40S. CPU: an assumed 16-core AVX-512 server socket (≈100 GB/s sustained DRAM,
    /// ≈2 TFLOP/s, 128 GB, 10 GB/s memcpy, 10 GbE) — order-of-magnitude only.
    pub fn spec(self) -> GpuSpec {
        match self {
            GpuKind::H100 => GpuSpec {
                hbm_bytes_per_s: 3.35e12,
                bf16_flops: 989e12,
                memory_bytes: 80e9,
                link_bytes_per_s: 450e9,
                network_bytes_per_s: 50e9,
            },
            GpuKind::H200 => GpuSpec {
                hbm_bytes_per_s: 4.8e12,
                bf16_flops: 989e12,
                memory_bytes: 141e9,
                link_bytes_per_s: 450e9,
                network_bytes_per_s: 50e9,
            },
            GpuKind::A100 => GpuSpec {
                hbm_bytes_per_s: 2.039e12,
                bf16_flops: 312e12,
                memory_bytes: 80e9,
                link_bytes_per_s: 300e9,
                network_bytes_per_s: 25e9,
            },
            GpuKind::L40s => GpuSpec {
                hbm_bytes_per_s: 864e9,
                bf16_flops: 362e12,
                memory_bytes: 48e9,
                link_bytes_per_s: 32e9,
                network_bytes_per_s: 25e9,
            },
            GpuKind::Cpu => GpuSpec {
                hbm_bytes_per_s: 100e9,
                bf16_flops: 2e12,
                memory_bytes: 128e9,
                link_bytes_per_s: 10e9,
                network_bytes_per_s: 1.25e9,
            },
        }
    }

    /// Parses `h100`, `h200`, `a100`, `l40s`, `cpu` (case-insensitive).
    pub fn parse(name: &str) -> Result<GpuKind> {
        Ok(match name.trim().to_ascii_lowercase().as_str() {
            "h100" => GpuKind::H100,
            "h200" => GpuKind::H200,
            "a100" => GpuKind::A100,
            "l40s" => GpuKind::L40s,
            "cpu" => GpuKind::Cpu,
            other => bail!("unknown --gpu {other:?}: expected one of h100, h200, a100, l40s, cpu"),
        })
    }

    /// Lower-case name, as parsed.
    pub fn name(self) -> &'static str {
        match self {
            GpuKind::H100 => "h100",
            GpuKind::H200 => "h200",
            GpuKind::A100 => "a100",
            GpuKind::L40s => "l40s",
            GpuKind::Cpu => "cpu",
        }
    }
}

/// The shape of the transformer, for KV-cache bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelArch {
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Key/value heads (GQA).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

/// Qwen2.5 family configs (config.json of Qwen/Qwen2.5-{0.5,1.5,3,7,14,32,72}B): parameter
/// count, layers, hidden, kv heads, head dim.
const QWEN25_ARCHS: [(f64, usize, usize, usize, usize); 7] = [
    (0.49e9, 24, 896, 2, 64),
    (1.54e9, 28, 1536, 2, 128),
    (3.09e9, 36, 2048, 2, 128),
    (7.62e9, 28, 3584, 4, 128),
    (14.7e9, 48, 5120, 8, 128),
    (32.8e9, 64, 5120, 8, 128),
    (72.7e9, 80, 8192, 8, 128),
];

impl ModelArch {
    /// The Qwen2.5 config whose parameter count is nearest to `params` (in log scale).
    pub fn for_params(params: f64) -> ModelArch {
        let target = params.max(1.0).ln();
        let best = QWEN25_ARCHS
            .iter()
            .min_by(|a, b| {
                (a.0.ln() - target)
                    .abs()
                    .total_cmp(&(b.0.ln() - target).abs())
            })
            .copied()
            .unwrap_or(QWEN25_ARCHS[3]);
        ModelArch {
            layers: best.1,
            hidden: best.2,
            kv_heads: best.3,
            head_dim: best.4,
        }
    }

    /// KV-cache bytes per token in bf16: K and V (2) · layers · kv_heads · head_dim · 2 bytes.
    pub fn kv_bytes_per_token(&self) -> f64 {
        (2 * self.layers * self.kv_heads * self.head_dim * 2) as f64
    }
}

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
        Ok(())
    }

    fn arch(&self) -> ModelArch {
        self.arch
            .unwrap_or_else(|| ModelArch::for_params(self.params))
    }

    fn weight_bytes(&self) -> f64 {
        WEIGHT_BYTES_PER_PARAM * self.params
    }

    /// Link used for weight sync: NVLink/PCIe within one node (≤ 8 GPUs), the network beyond.
    fn sync_link(&self) -> f64 {
        let spec = self.gpu.spec();
        if self.gpus <= 8 {
            spec.link_bytes_per_s
        } else {
            spec.network_bytes_per_s
        }
    }
}

/// The four walls of one step (seconds).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Walls {
    /// τ_R rollout generation.
    pub rollout_s: f64,
    /// τ_V env / verifier / reward.
    pub reward_s: f64,
    /// τ_T trainer.
    pub train_s: f64,
    /// τ_S weight sync.
    pub sync_s: f64,
}

impl Walls {
    /// `(name, seconds)` of each wall.
    pub fn named(&self) -> [(&'static str, f64); 4] {
        [
            ("rollout", self.rollout_s),
            ("reward", self.reward_s),
            ("train", self.train_s),
            ("sync", self.sync_s),
        ]
    }

    /// Sum of the walls (the synchronous step).
    pub fn sum(&self) -> f64 {
        self.rollout_s + self.reward_s + self.train_s + self.sync_s
    }

    /// The largest wall and its share of `step_s`.
    pub fn binding(&self, step_s: f64) -> (&'static str, f64) {
        let (name, s) = self
            .named()
            .into_iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or(("rollout", 0.0));
        (name, if step_s > 0.0 { s / step_s } else { 0.0 })
    }
}

/// A layout of generator and trainer on the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "layout", rename_all = "kebab-case")]
pub enum Layout {
    /// Generator and trainer share every GPU and take turns; on-policy.
    ColocatedSync,
    /// Separate generator and trainer GPUs; the generator makes batch n+1 while the trainer
    /// trains on batch n (staleness 1).
    Disaggregated,
    /// Separate pools, continuous batching, trajectories up to `max_staleness` versions old.
    BoundedAsync {
        /// The staleness bound to configure.
        max_staleness: u32,
    },
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::ColocatedSync => write!(f, "colocated-sync"),
            Layout::Disaggregated => write!(f, "disaggregated"),
            Layout::BoundedAsync { max_staleness } => {
                write!(f, "bounded-async (max_staleness {max_staleness})")
            }
        }
    }
}

/// One candidate layout's estimate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayoutEstimate {
    /// The layout.
    pub layout: Layout,
    /// GPUs generating.
    pub generator_gpus: usize,
    /// GPUs training.
    pub trainer_gpus: usize,
    /// Walls in this layout.
    pub walls: Walls,
    /// Seconds per step.
    pub step_s: f64,
    /// Whether the memory check passes.
    pub fits_memory: bool,
    /// Allowed by the staleness tolerance.
    pub allowed: bool,
}

/// Trainer memory check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryCheck {
    /// Trainer state, 16 bytes/param.
    pub trainer_state_bytes: f64,
    /// Per GPU when sharded over all GPUs, plus the generator's weight shard (colocated).
    pub per_gpu_bytes: f64,
    /// Device memory.
    pub gpu_memory_bytes: f64,
    /// `per_gpu_bytes ≤ 0.9 · gpu_memory_bytes`.
    pub fits: bool,
    /// Fewest GPUs of this kind holding the trainer state.
    pub min_gpus: usize,
    /// KV-cache bytes per token.
    pub kv_bytes_per_token: f64,
    /// Generator tensor-parallel degree.
    pub generator_tp: usize,
}

/// The estimate: walls, binding wall, layouts, recommendation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// `"estimate"` or `"measured"`.
    pub source: String,
    /// One-line description of the input (workload or run directory).
    pub input: String,
    /// Walls of the synchronous colocated step (measured ones for a run).
    pub walls: Walls,
    /// Synchronous step seconds.
    pub step_s: f64,
    /// The largest wall.
    pub binding_wall: String,
    /// Its share of the step.
    pub binding_share: f64,
    /// Trained tokens per step.
    pub trained_tokens_per_step: f64,
    /// Memory check (estimates only).
    pub memory: Option<MemoryCheck>,
    /// Candidate layouts.
    pub layouts: Vec<LayoutEstimate>,
    /// The recommended layout.
    pub recommended: Layout,
    /// Why.
    pub recommendation: String,
    /// Which knob to turn first.
    pub first_knob: String,
    /// Assumptions and caveats.
    pub assumptions: Vec<String>,
}

/// Generator estimate on `g` GPUs; `async_batching` uses the mean length (continuous batching)
/// instead of the p95 (a batch waiting for its straggler). Returns (seconds, fits, tp).
fn rollout_seconds(shape: &WorkloadShape, g: usize, async_batching: bool) -> (f64, bool, usize) {
    let spec = shape.gpu.spec();
    let w = shape.weight_bytes();
    let kv = shape.arch().kv_bytes_per_token();
    // Smallest power-of-two tensor-parallel degree whose weight shard fits in half a GPU.
    let mut tp = 1usize;
    while w / tp as f64 > 0.5 * spec.memory_bytes && tp < g {
        tp *= 2;
    }
    let tp = tp.min(g);
    let fits = w / (tp as f64) <= 0.5 * spec.memory_bytes;
    let tpf = tp as f64;
    let replicas = (g / tp).max(1);
    let per_replica = (shape.samples_per_step as f64 / replicas as f64).ceil();
    let kv_free = (USABLE_MEMORY_FRACTION * tpf * spec.memory_bytes - w).max(0.0);
    let seq_bytes = kv * (shape.prompt_tokens + shape.p95_output_tokens);
    let slots = (kv_free / seq_bytes).floor().max(1.0);
    let waves = (per_replica / slots).ceil().max(1.0);
    let b = (per_replica / waves).ceil();
    let achievable = tpf * spec.bf16_flops * shape.mfu;
    let t_mem = (w + b * kv * (shape.prompt_tokens + shape.mean_output_tokens / 2.0))
        / (tpf * spec.hbm_bytes_per_s);
    let t_compute = 2.0 * shape.params * b / achievable;
    let t_step = t_mem.max(t_compute);
    let steps = if async_batching {
        shape.mean_output_tokens
    } else {
        shape.p95_output_tokens
    };
    let prefill = 2.0 * shape.params * b * shape.prompt_tokens / achievable;
    (waves * (steps * t_step + prefill), fits, tp)
}

fn reward_seconds(shape: &WorkloadShape, async_batching: bool) -> f64 {
    let concurrency = shape
        .env_concurrency
        .unwrap_or(shape.samples_per_step)
        .max(1);
    let waves = (shape.samples_per_step as f64 / concurrency as f64).ceil();
    let latency = if async_batching {
        shape.env_latency_mean_s
    } else {
        shape.env_latency_p95_s
    };
    shape.env_calls_per_sample * waves * latency
}

fn train_seconds(shape: &WorkloadShape, g: usize) -> f64 {
    let spec = shape.gpu.spec();
    6.0 * shape.params * trained_tokens(shape) / (g as f64 * spec.bf16_flops * shape.mfu)
}

fn trained_tokens(shape: &WorkloadShape) -> f64 {
    shape.samples_per_step as f64 * (shape.prompt_tokens + shape.mean_output_tokens)
}

fn sync_seconds(shape: &WorkloadShape) -> f64 {
    shape.weight_bytes() * shape.weight_copies as f64 / shape.sync_link()
}

fn trainer_fits(shape: &WorkloadShape, g: usize, extra_per_gpu: f64) -> bool {
    TRAINER_BYTES_PER_PARAM * shape.params / g as f64 + extra_per_gpu
        <= USABLE_MEMORY_FRACTION * shape.gpu.spec().memory_bytes
}

/// Staleness to configure for bounded-async: enough versions in flight to absorb a straggler
/// that runs p95/mean times longer than a typical sample, at least 2, at most the tolerance.
fn async_staleness(shape: &WorkloadShape) -> u32 {
    let tail = (shape.p95_output_tokens / shape.mean_output_tokens)
        .max(shape.env_latency_p95_s / shape.env_latency_mean_s.max(1e-9))
        .ceil();
    (tail.max(2.0) as u32).min(shape.staleness_tolerance)
}

/// Estimates the walls of `shape` and recommends a layout (formulas in the module docs).
pub fn plan_from_shape(shape: &WorkloadShape) -> Result<Plan> {
    shape.validate()?;
    let spec = shape.gpu.spec();
    let g = shape.gpus;
    let (rollout, gen_fits, tp) = rollout_seconds(shape, g, false);
    let walls = Walls {
        rollout_s: rollout,
        reward_s: reward_seconds(shape, false),
        train_s: train_seconds(shape, g),
        sync_s: sync_seconds(shape),
    };
    let step_s = walls.sum();
    let (binding, share) = walls.binding(step_s);
    let arch = shape.arch();
    let colocated_extra = shape.weight_bytes() / tp as f64;
    let memory = MemoryCheck {
        trainer_state_bytes: TRAINER_BYTES_PER_PARAM * shape.params,
        per_gpu_bytes: TRAINER_BYTES_PER_PARAM * shape.params / g as f64 + colocated_extra,
        gpu_memory_bytes: spec.memory_bytes,
        fits: trainer_fits(shape, g, colocated_extra) && gen_fits,
        min_gpus: (TRAINER_BYTES_PER_PARAM * shape.params
            / (USABLE_MEMORY_FRACTION * spec.memory_bytes))
            .ceil() as usize,
        kv_bytes_per_token: arch.kv_bytes_per_token(),
        generator_tp: tp,
    };

    let mut layouts = vec![LayoutEstimate {
        layout: Layout::ColocatedSync,
        generator_gpus: g,
        trainer_gpus: g,
        walls,
        step_s,
        fits_memory: memory.fits,
        allowed: true,
    }];
    // Split the GPUs between generator and trainer to minimise the step.
    let best_split = |async_batching: bool| -> Option<LayoutEstimate> {
        (1..g)
            .map(|g_t| {
                let g_r = g - g_t;
                let (r, fits_r, _) = rollout_seconds(shape, g_r, async_batching);
                let w = Walls {
                    rollout_s: r,
                    reward_s: reward_seconds(shape, async_batching),
                    train_s: train_seconds(shape, g_t),
                    sync_s: sync_seconds(shape),
                };
                let step = if async_batching {
                    w.rollout_s.max(w.reward_s).max(w.train_s + w.sync_s)
                } else {
                    (w.rollout_s + w.reward_s).max(w.train_s + w.sync_s)
                };
                let fits = fits_r && trainer_fits(shape, g_t, 0.0);
                (fits, step, g_r, g_t, w)
            })
            // Prefer splits that fit, then the fastest.
            .min_by(|a, b| b.0.cmp(&a.0).then(a.1.total_cmp(&b.1)))
            .map(|(fits, step, g_r, g_t, w)| LayoutEstimate {
                layout: if async_batching {
                    Layout::BoundedAsync {
                        max_staleness: async_staleness(shape).max(2),
                    }
                } else {
                    Layout::Disaggregated
                },
                generator_gpus: g_r,
                trainer_gpus: g_t,
                walls: w,
                step_s: step,
                fits_memory: fits,
                allowed: if async_batching {
                    shape.staleness_tolerance >= 2
                } else {
                    shape.staleness_tolerance >= 1
                },
            })
    };
    layouts.extend(best_split(false));
    layouts.extend(best_split(true));

    let mut assumptions = vec![
        format!(
            "{} GPU numbers: {:.2} TB/s memory, {:.0} TFLOP/s dense bf16, {:.0} GB, sync link {:.0} GB/s",
            shape.gpu.name(),
            spec.hbm_bytes_per_s / 1e12,
            spec.bf16_flops / 1e12,
            spec.memory_bytes / 1e9,
            shape.sync_link() / 1e9
        ),
        format!(
            "MFU {:.0}% for training and prefill; decode is memory-bound (weights + KV cache read per token)",
            shape.mfu * 100.0
        ),
        format!(
            "KV cache {} per token (layers {}, kv heads {}, head dim {}{})",
            fmt_bytes(arch.kv_bytes_per_token()),
            arch.layers,
            arch.kv_heads,
            arch.head_dim,
            if shape.arch.is_none() {
                ", nearest Qwen2.5 config"
            } else {
                ""
            }
        ),
        "trainer state 16 bytes/param sharded over the trainer GPUs; activations not modelled"
            .to_string(),
    ];
    if shape.env_latency_p95_s == shape.env_latency_mean_s && shape.env_latency_mean_s > 0.0 {
        assumptions.push("env latency p95 = mean (no tail given: --env-latency-p95)".to_string());
    }

    let (recommended, recommendation) = recommend(&layouts, shape.staleness_tolerance);
    let first_knob = if !memory.fits && !layouts.iter().any(|l| l.fits_memory) {
        format!(
            "memory first: the trainer state ({}) needs at least {} {} GPUs; add GPUs, or shard/offload the optimizer state",
            fmt_bytes(memory.trainer_state_bytes),
            memory.min_gpus,
            shape.gpu.name()
        )
    } else {
        knob_for(binding, shape)
    };
    let input = format!(
        "{} params on {}× {}, {} samples/step, output mean {} / p95 {} tokens, prompt {}, env {} s (p95 {} s) × {} call(s), staleness tolerance {}",
        fmt_num(shape.params),
        shape.gpus,
        shape.gpu.name(),
        shape.samples_per_step,
        fmt_num(shape.mean_output_tokens),
        fmt_num(shape.p95_output_tokens),
        fmt_num(shape.prompt_tokens),
        shape.env_latency_mean_s,
        shape.env_latency_p95_s,
        shape.env_calls_per_sample,
        shape.staleness_tolerance
    );
    Ok(Plan {
        source: "estimate".into(),
        input,
        walls,
        step_s,
        binding_wall: binding.to_string(),
        binding_share: share,
        trained_tokens_per_step: trained_tokens(shape),
        memory: Some(memory),
        layouts,
        recommended,
        recommendation,
        first_knob,
        assumptions,
    })
}

/// Picks the fastest allowed layout that fits, requiring a [`LAYOUT_MARGIN`] win over each
/// simpler one (colocated < disaggregated < bounded-async in complexity).
fn recommend(layouts: &[LayoutEstimate], tolerance: u32) -> (Layout, String) {
    let mut best = &layouts[0];
    for candidate in &layouts[1..] {
        if !candidate.allowed {
            continue;
        }
        let better_fit = candidate.fits_memory && !best.fits_memory;
        let faster = candidate.fits_memory == best.fits_memory
            && candidate.step_s * LAYOUT_MARGIN < best.step_s;
        if better_fit || faster {
            best = candidate;
        }
    }
    let base = &layouts[0];
    let why = match best.layout {
        Layout::ColocatedSync => {
            let blocked = layouts[1..]
                .iter()
                .any(|l| !l.allowed && l.step_s * LAYOUT_MARGIN < base.step_s);
            if blocked {
                format!(
                    "colocated synchronous; an async layout would be faster but the staleness tolerance is {tolerance} (allow ≥ 1 for disaggregated, ≥ 2 for bounded-async)"
                )
            } else {
                "colocated synchronous: the walls are balanced enough that splitting GPUs does not pay (< 15% faster); simplest and on-policy".to_string()
            }
        }
        Layout::Disaggregated => format!(
            "disaggregated: {} GPUs generate while {} train the previous batch (staleness 1), {:.2}× faster than colocated",
            best.generator_gpus,
            best.trainer_gpus,
            base.step_s / best.step_s
        ),
        Layout::BoundedAsync { max_staleness } => format!(
            "bounded-async with max_staleness = {max_staleness}: {} GPUs generate with continuous batching (stragglers stop holding the batch), {} train, {:.2}× faster than colocated",
            best.generator_gpus,
            best.trainer_gpus,
            base.step_s / best.step_s
        ),
    };
    (best.layout, why)
}

fn knob_for(binding: &str, shape: &WorkloadShape) -> String {
    let tax = shape.p95_output_tokens / shape.mean_output_tokens;
    match binding {
        "rollout" => format!(
            "rollout binds: the batch waits for its p95 sample (straggler tax ×{tax:.1}); cap max_new_tokens near the p95, then go bounded-async (staleness ≥ 2) or move GPUs to the generator"
        ),
        "reward" => format!(
            "reward binds: raise env concurrency (now {}), cut env/verifier latency (timeouts, cached test setup), or overlap it with training (disaggregated/async)",
            shape.env_concurrency.unwrap_or(shape.samples_per_step)
        ),
        "train" => "train binds: raise the micro-batch to lift MFU (sequence packing), train on fewer tokens per step, or move GPUs from the generator to the trainer".to_string(),
        _ => "weight sync binds: sync less often (staleness ≥ 1), colocate, use a faster link, or send bf16 deltas".to_string(),
    }
}

fn fmt_bytes(b: f64) -> String {
    if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} KB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

/// Plans from a finished (or running) run's measured walls in `RUN_DIR/metrics.jsonl`:
/// the measured colocated step, and what overlapping would give on the same GPUs if they were
/// split in proportion (an upper bound on the gain): disaggregated `max(R/f + V, T/(1−f) + S)`
/// minimised over the generator fraction f, bounded-async the same with R shrunk by the
/// measured straggler tax (p95/p50 length) and V by env p50/p95.
pub fn plan_from_run(run_dir: &Path) -> Result<Plan> {
    plan_from_run_with(run_dir, None)
}

/// [`plan_from_run`] with an explicit staleness tolerance (default: the run's measured max lag).
pub fn plan_from_run_with(run_dir: &Path, staleness_tolerance: Option<u32>) -> Result<Plan> {
    let path = run_dir.join("metrics.jsonl");
    let records = read_metrics(&path)?;
    let s = RunSummary::from_metrics(&records);
    if s.walls.is_empty() {
        bail!(
            "{} has no time/rollout_s, time/reward_s, time/train_s or time/sync_s: nothing to plan from",
            path.display()
        );
    }
    let mean = |name: &str| s.wall(name).map_or(0.0, |w| w.mean_s);
    let walls = Walls {
        rollout_s: mean("rollout"),
        reward_s: mean("reward"),
        train_s: mean("train"),
        sync_s: mean("sync"),
    };
    let step_s = if s.mean_step_s > 0.0 {
        s.mean_step_s
    } else {
        walls.sum()
    };
    let (binding, share) = walls.binding(step_s);
    let was_async = !s.staleness_histogram.is_empty() || s.staleness_max.is_some();
    let tolerance = staleness_tolerance
        .or_else(|| s.staleness_max.map(|m| m as u32))
        .unwrap_or(0);
    let tax = s.straggler_tax.unwrap_or(1.0).max(1.0);
    let env_tail = match (s.env_latency_p50, s.env_latency_p95) {
        (Some(p50), Some(p95)) if p50 > 0.0 => (p95 / p50).max(1.0),
        _ => 1.0,
    };
    let split = |r: f64, v: f64, async_mode: bool| -> (f64, f64) {
        (1..20)
            .map(|i| {
                let f = i as f64 / 20.0;
                let step = if async_mode {
                    (r / f).max(v).max(walls.train_s / (1.0 - f) + walls.sync_s)
                } else {
                    (r / f + v).max(walls.train_s / (1.0 - f) + walls.sync_s)
                };
                (step, f)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap_or((step_s, 0.5))
    };
    let (disagg_step, f_d) = split(walls.rollout_s, walls.reward_s, false);
    let (async_step, f_a) = split(walls.rollout_s / tax, walls.reward_s / env_tail, true);
    let pct = |f: f64| (f * 100.0).round() as usize;
    let layouts = vec![
        LayoutEstimate {
            layout: Layout::ColocatedSync,
            generator_gpus: 100,
            trainer_gpus: 100,
            walls,
            step_s: walls.sum(),
            fits_memory: true,
            allowed: true,
        },
        LayoutEstimate {
            layout: Layout::Disaggregated,
            generator_gpus: pct(f_d),
            trainer_gpus: 100 - pct(f_d),
            walls,
            step_s: disagg_step,
            fits_memory: true,
            allowed: tolerance >= 1,
        },
        LayoutEstimate {
            layout: Layout::BoundedAsync {
                max_staleness: (tax.max(env_tail).ceil().max(2.0) as u32).min(tolerance.max(2)),
            },
            generator_gpus: pct(f_a),
            trainer_gpus: 100 - pct(f_a),
            walls: Walls {
                rollout_s: walls.rollout_s / tax,
                reward_s: walls.reward_s / env_tail,
                ..walls
            },
            step_s: async_step,
            fits_memory: true,
            allowed: tolerance >= 2,
        },
    ];
    let (recommended, recommendation) = recommend(&layouts, tolerance);
    let mut first_knob = match binding {
        "rollout" => format!(
            "rollout binds: the batch waits for its p95 sample (measured straggler tax ×{tax:.2}); cap max_new_tokens near the p95, then overlap (bounded-async) or add generator GPUs"
        ),
        "reward" => "reward binds: raise env concurrency, cut env/verifier latency, or overlap it with training".to_string(),
        "train" => "train binds: raise the micro-batch to lift MFU, pack sequences, or give the trainer more GPUs".to_string(),
        _ => "weight sync binds: sync less often (staleness ≥ 1), colocate, or use a faster link".to_string(),
    };
    if was_async {
        if let (Some(idle_t), Some(idle_g)) = (s.idle_trainer_s, s.idle_generator_s) {
            first_knob = if idle_t > idle_g {
                format!("async run: the trainer idled {} vs the generator {}: the generator side binds; add generator GPUs or raise max_staleness", fmt_secs(idle_t), fmt_secs(idle_g))
            } else {
                format!("async run: the generator idled {} vs the trainer {}: the trainer binds; move GPUs to the trainer or lower max_staleness", fmt_secs(idle_g), fmt_secs(idle_t))
            };
        }
    }
    let trained_per_step = if s.steps > 0 {
        s.trained_tokens / s.steps as f64
    } else {
        0.0
    };
    Ok(Plan {
        source: "measured".into(),
        input: format!(
            "{} ({} steps, mean step {}{})",
            run_dir.display(),
            s.steps,
            fmt_secs(step_s),
            if was_async { ", async run" } else { "" }
        ),
        walls,
        step_s,
        binding_wall: binding.to_string(),
        binding_share: share,
        trained_tokens_per_step: trained_per_step,
        memory: None,
        layouts,
        recommended,
        recommendation,
        first_knob,
        assumptions: vec![
            "layout rows re-use the measured walls; GPU columns are the % of the run's GPUs given to each side".to_string(),
            "overlap estimates assume the walls scale inversely with GPUs (an upper bound on the gain)".to_string(),
        ],
    })
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "composer-rl plan ({}): {}", self.source, self.input)?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<24} {:>12} {:>7}",
            "wall (synchronous step)", "seconds", "share"
        )?;
        for (name, s) in self.walls.named() {
            let symbol = match name {
                "rollout" => "τ_R",
                "reward" => "τ_V",
                "train" => "τ_T",
                _ => "τ_S",
            };
            let marker = if name == self.binding_wall {
                "  ← binding"
            } else {
                ""
            };
            let share = if self.step_s > 0.0 {
                s / self.step_s
            } else {
                0.0
            };
            writeln!(
                f,
                "  {symbol} {name:<18} {:>12} {:>6.1}%{marker}",
                fmt_secs(s),
                share * 100.0
            )?;
        }
        writeln!(f, "  {:<22} {:>12}", "step", fmt_secs(self.step_s))?;
        if self.step_s > 0.0 && self.trained_tokens_per_step > 0.0 {
            writeln!(
                f,
                "  {:<22} {:>12}",
                "goodput (tok/s)",
                fmt_num(self.trained_tokens_per_step / self.step_s)
            )?;
        }
        if let Some(m) = &self.memory {
            writeln!(f)?;
            writeln!(
                f,
                "memory: trainer state {} → {} per GPU (+ generator weights, tp {}) of {}: {}; minimum {} GPUs; KV cache {} per token",
                fmt_bytes(m.trainer_state_bytes),
                fmt_bytes(m.per_gpu_bytes),
                m.generator_tp,
                fmt_bytes(m.gpu_memory_bytes),
                if m.fits { "fits" } else { "DOES NOT FIT" },
                m.min_gpus,
                fmt_bytes(m.kv_bytes_per_token)
            )?;
        }
        writeln!(f)?;
        let unit = if self.source == "measured" { "% " } else { "" };
        writeln!(
            f,
            "{:<34} {:>9} {:>9} {:>12} {:>8}",
            "layout", "gen GPUs", "trn GPUs", "step", "speed-up"
        )?;
        let base = self.layouts.first().map_or(self.step_s, |l| l.step_s);
        for l in &self.layouts {
            let mut flags = String::new();
            if !l.allowed {
                flags.push_str("  (needs more staleness)");
            }
            if !l.fits_memory {
                flags.push_str("  (does not fit)");
            }
            let speedup = if l.step_s > 0.0 { base / l.step_s } else { 0.0 };
            writeln!(
                f,
                "{:<34} {:>8}{unit} {:>8}{unit} {:>12} {:>7.2}×{flags}",
                l.layout.to_string(),
                l.generator_gpus,
                l.trainer_gpus,
                fmt_secs(l.step_s),
                speedup
            )?;
        }
        writeln!(f)?;
        writeln!(f, "recommended: {}", self.recommended)?;
        writeln!(f, "  why: {}", self.recommendation)?;
        writeln!(f, "  first knob: {}", self.first_knob)?;
        writeln!(f, "assumptions:")?;
        for a in &self.assumptions {
            writeln!(f, "  - {a}")?;
        }
        Ok(())
    }
}

/// Options of `composer-rl plan`, free of clap so the CLI maps its flags one to one.
/// Either `from_run` or `params` (+ output lengths) must be given.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// `--from-run RUN_DIR`: plan from measured walls.
    pub from_run: Option<PathBuf>,
    /// `--params` (e.g. 7e9).
    pub params: Option<f64>,
    /// `--mean-output` tokens.
    pub mean_output: Option<f64>,
    /// `--p95-output` tokens (default: the mean).
    pub p95_output: Option<f64>,
    /// `--prompt-tokens` (default 512).
    pub prompt_tokens: Option<f64>,
    /// `--samples-per-step` (default 256).
    pub samples_per_step: Option<usize>,
    /// `--env-latency` seconds, mean (default 1.0).
    pub env_latency: Option<f64>,
    /// `--env-latency-p95` seconds (default: the mean).
    pub env_latency_p95: Option<f64>,
    /// `--env-concurrency` (default: all samples at once).
    pub env_concurrency: Option<usize>,
    /// `--env-calls` per sample (default 1).
    pub env_calls: Option<f64>,
    /// `--staleness` tolerance (default 0).
    pub staleness: Option<u32>,
    /// `--gpus` (default 8).
    pub gpus: Option<usize>,
    /// `--gpu` h100/h200/a100/l40s/cpu (default h100).
    pub gpu: Option<String>,
    /// `--layers` (with `--kv-heads`, `--head-dim`; default from params).
    pub layers: Option<usize>,
    /// `--hidden`.
    pub hidden: Option<usize>,
    /// `--kv-heads`.
    pub kv_heads: Option<usize>,
    /// `--head-dim`.
    pub head_dim: Option<usize>,
    /// `--mfu` (default 0.4).
    pub mfu: Option<f64>,
    /// `--weight-copies` (default 1).
    pub weight_copies: Option<usize>,
    /// `--json`: print the plan as JSON.
    pub json: bool,
}

impl PlanOptions {
    /// The workload these options describe (errors name the missing/bad flag).
    pub fn to_shape(&self) -> Result<WorkloadShape> {
        let d = WorkloadShape::default();
        let params = self
            .params
            .context("plan: --params is required (or use --from-run RUN_DIR)")?;
        let mean_output = self
            .mean_output
            .context("plan: --mean-output is required (mean completion tokens)")?;
        let env_mean = self.env_latency.unwrap_or(d.env_latency_mean_s);
        let base = ModelArch::for_params(params);
        let arch = if self.layers.is_some()
            || self.kv_heads.is_some()
            || self.head_dim.is_some()
            || self.hidden.is_some()
        {
            Some(ModelArch {
                layers: self.layers.unwrap_or(base.layers),
                hidden: self.hidden.unwrap_or(base.hidden),
                kv_heads: self.kv_heads.unwrap_or(base.kv_heads),
                head_dim: self.head_dim.unwrap_or(base.head_dim),
            })
        } else {
            None
        };
        let shape = WorkloadShape {
            params,
            mean_output_tokens: mean_output,
            p95_output_tokens: self.p95_output.unwrap_or(mean_output),
            prompt_tokens: self.prompt_tokens.unwrap_or(d.prompt_tokens),
            samples_per_step: self.samples_per_step.unwrap_or(d.samples_per_step),
            env_latency_mean_s: env_mean,
            env_latency_p95_s: self.env_latency_p95.unwrap_or(env_mean),
            env_concurrency: self.env_concurrency,
            env_calls_per_sample: self.env_calls.unwrap_or(1.0),
            staleness_tolerance: self.staleness.unwrap_or(0),
            gpus: self.gpus.unwrap_or(d.gpus),
            gpu: match &self.gpu {
                Some(name) => GpuKind::parse(name)?,
                None => d.gpu,
            },
            arch,
            mfu: self.mfu.unwrap_or(d.mfu),
            weight_copies: self.weight_copies.unwrap_or(1),
        };
        shape.validate()?;
        Ok(shape)
    }
}

/// `composer-rl plan ...`: the text (or JSON with `json`) to print.
pub fn plan_cli(opts: &PlanOptions) -> Result<String> {
    let plan = match &opts.from_run {
        Some(dir) => plan_from_run_with(dir, opts.staleness)?,
        None => plan_from_shape(&opts.to_shape()?)?,
    };
    if opts.json {
        serde_json::to_string_pretty(&plan).context("serialising the plan as JSON")
    } else {
        Ok(plan.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-12)
    }

    /// The hand-computed example of PLAN.md.
    fn example() -> WorkloadShape {
        WorkloadShape {
            params: 1e9,
            mean_output_tokens: 512.0,
            p95_output_tokens: 1024.0,
            prompt_tokens: 256.0,
            samples_per_step: 64,
            env_latency_mean_s: 0.5,
            env_latency_p95_s: 1.0,
            env_concurrency: Some(16),
            env_calls_per_sample: 1.0,
            staleness_tolerance: 0,
            gpus: 1,
            gpu: GpuKind::H100,
            arch: Some(ModelArch {
                layers: 16,
                hidden: 2048,
                kv_heads: 8,
                head_dim: 64,
            }),
            mfu: 0.4,
            weight_copies: 1,
        }
    }

    #[test]
    fn hand_computed_example() {
        // kv = 2·16·8·64·2 = 32768 B/token. Weights W = 2·1e9 = 2e9 B (fits half of 80 GB: tp 1).
        // KV room 0.9·80e9 − 2e9 = 70e9 B; one full sequence (256 + 1024)·32768 = 41.94 MB →
        // 1668 slots ≥ 64 samples: one wave, b = 64.
        // Decode step: bytes = 2e9 + 64·32768·(256 + 512/2) = 3,073,741,824 → /3.35e12 =
        // 9.17535e-4 s; compute 2·1e9·64 / (989e12·0.4) = 3.2356e-4 s → memory-bound.
        // Decode 1024 · 9.17535e-4 = 0.939556 s; prefill 2·1e9·64·256 / 3.956e14 = 0.082831 s.
        // τ_R = 1.022387 s.
        // τ_V = 1 call · ⌈64/16⌉ waves · 1.0 s p95 = 4.0 s.
        // τ_T = 6·1e9·64·(256 + 512) / (1·989e12·0.4) = 2.94912e14 / 3.956e14 = 0.745480 s.
        // τ_S = 2e9 / 450e9 = 0.004444 s.
        // step = 5.772311 s; binding: reward, 4.0 / 5.772311 = 69.3%.
        let plan = plan_from_shape(&example()).unwrap();
        assert!(
            close(plan.walls.rollout_s, 1.022387, 1e-5),
            "{}",
            plan.walls.rollout_s
        );
        assert!(close(plan.walls.reward_s, 4.0, 1e-12));
        assert!(
            close(plan.walls.train_s, 0.745480, 1e-5),
            "{}",
            plan.walls.train_s
        );
        assert!(close(plan.walls.sync_s, 0.0044444, 1e-4));
        assert!(close(plan.step_s, 5.772311, 1e-5), "{}", plan.step_s);
        assert_eq!(plan.binding_wall, "reward");
        assert!(close(plan.binding_share, 4.0 / 5.772311, 1e-5));
        let m = plan.memory.as_ref().unwrap();
        // Trainer state 16e9 B + generator weights 2e9 B = 18e9 ≤ 72e9: fits; min GPUs ⌈16e9/72e9⌉ = 1.
        assert!(m.fits);
        assert_eq!(m.min_gpus, 1);
        assert_eq!(m.kv_bytes_per_token, 32768.0);
        // One GPU: no split possible, colocated it is.
        assert_eq!(plan.layouts.len(), 1);
        assert_eq!(plan.recommended, Layout::ColocatedSync);
        assert!(
            plan.first_knob.contains("env concurrency (now 16)"),
            "{}",
            plan.first_knob
        );
        let text = plan.to_string();
        assert!(
            text.contains("← binding") && text.contains("recommended: colocated-sync"),
            "{text}"
        );
    }

    #[test]
    fn long_tail_rollout_with_staleness_goes_async() {
        // The CLI example: 7B, mean 2000 / p95 8000 tokens, 8 H100, staleness 2.
        let opts = PlanOptions {
            params: Some(7e9),
            mean_output: Some(2000.0),
            p95_output: Some(8000.0),
            env_latency: Some(2.0),
            gpus: Some(8),
            gpu: Some("h100".into()),
            staleness: Some(2),
            ..Default::default()
        };
        let plan = plan_from_shape(&opts.to_shape().unwrap()).unwrap();
        assert_eq!(plan.binding_wall, "rollout");
        assert_eq!(plan.layouts.len(), 3);
        // Async decodes for the mean (2000) instead of the p95 (8000) and overlaps training.
        let async_l = &plan.layouts[2];
        assert!(async_l.step_s < plan.layouts[1].step_s);
        assert_eq!(plan.recommended, Layout::BoundedAsync { max_staleness: 2 });
        // Same workload, on-policy only: colocated, with the reason naming the tolerance.
        let on_policy = plan_from_shape(
            &PlanOptions {
                staleness: Some(0),
                ..opts.clone()
            }
            .to_shape()
            .unwrap(),
        )
        .unwrap();
        assert_eq!(on_policy.recommended, Layout::ColocatedSync);
        assert!(on_policy
            .recommendation
            .contains("staleness tolerance is 0"));
        let json: serde_json::Value =
            serde_json::from_str(&plan_cli(&PlanOptions { json: true, ..opts }).unwrap()).unwrap();
        assert_eq!(json["recommended"]["layout"], "bounded-async");
        assert_eq!(json["recommended"]["max_staleness"], 2);
    }

    #[test]
    fn memory_check_and_arch_defaults() {
        // 70B on 1 L40S: 16·70e9 = 1.12e12 B; min GPUs ⌈1.12e12 / (0.9·48e9)⌉ = ⌈25.93⌉ = 26.
        let shape = WorkloadShape {
            params: 70e9,
            gpus: 1,
            gpu: GpuKind::L40s,
            ..Default::default()
        };
        let plan = plan_from_shape(&shape).unwrap();
        let m = plan.memory.unwrap();
        assert!(!m.fits);
        assert_eq!(m.min_gpus, 26);
        assert!(plan.first_knob.starts_with("memory first"));
        // 7e9 maps to Qwen2.5-7B: 2·28·4·128·2 = 57344 B/token.
        assert_eq!(ModelArch::for_params(7e9).kv_bytes_per_token(), 57344.0);
        assert_eq!(ModelArch::for_params(5e8).layers, 24);
    }

    #[test]
    fn bad_options_name_the_flag() {
        let err = plan_cli(&PlanOptions::default()).unwrap_err().to_string();
        assert!(err.contains("--params"), "{err}");
        let err = PlanOptions {
            params: Some(1e9),
            mean_output: Some(100.0),
            p95_output: Some(50.0),
            ..Default::default()
        }
        .to_shape()
        .unwrap_err()
        .to_string();
        assert!(err.contains("--p95-output"), "{err}");
        let err = PlanOptions {
            params: Some(1e9),
            mean_output: Some(100.0),
            gpu: Some("tpu".into()),
            ..Default::default()
        }
        .to_shape()
        .unwrap_err()
        .to_string();
        assert!(err.contains("--gpu"), "{err}");
        let err = PlanOptions {
            params: Some(-1.0),
            mean_output: Some(100.0),
            ..Default::default()
        }
        .to_shape()
        .unwrap_err()
        .to_string();
        assert!(err.contains("--params"), "{err}");
    }

    #[test]
    fn plan_from_measured_run() {
        let dir = tempfile::tempdir().unwrap();
        crate::report::tests::synthetic_run(dir.path());
        let plan = plan_from_run_with(dir.path(), Some(2)).unwrap();
        assert_eq!(plan.source, "measured");
        // Synthetic walls: rollout 6, reward 1.5, train 2, sync 0.5 of a 10 s step.
        assert_eq!(plan.binding_wall, "rollout");
        assert!(close(plan.binding_share, 0.6, 1e-12));
        assert!(close(plan.trained_tokens_per_step, 4000.0, 1e-12));
        assert!(plan.layouts[1].step_s < plan.layouts[0].step_s);
        let text = plan_cli(&PlanOptions {
            from_run: Some(dir.path().to_path_buf()),
            ..Default::default()
        })
        .unwrap();
        assert!(text.contains("measured"), "{text}");
        let err = plan_from_run(&dir.path().join("nope")).unwrap_err();
        assert!(format!("{err:#}").contains("metrics.jsonl"));
    }
}
