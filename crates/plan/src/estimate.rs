//! The estimate from a shape: the four walls per layout, the memory check, and the
//! recommendation (formulas in the crate docs and `crates/plan/PLAN.md`).

use std::fmt;

use anyhow::Result;
use serde::Serialize;

use composer_telemetry::summary::fmt_num;

use crate::shape::WorkloadShape;
use crate::{LAYOUT_MARGIN, TRAINER_BYTES_PER_PARAM, USABLE_MEMORY_FRACTION};

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
pub(crate) fn rollout_seconds(
    shape: &WorkloadShape,
    g: usize,
    async_batching: bool,
) -> (f64, bool, usize) {
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

pub(crate) fn reward_seconds(shape: &WorkloadShape, async_batching: bool) -> f64 {
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

pub(crate) fn train_seconds(shape: &WorkloadShape, g: usize) -> f64 {
    let spec = shape.gpu.spec();
    6.0 * shape.params * trained_tokens(shape) / (g as f64 * spec.bf16_flops * shape.mfu)
}

pub(crate) fn trained_tokens(shape: &WorkloadShape) -> f64 {
    shape.samples_per_step as f64 * (shape.prompt_tokens + shape.mean_output_tokens)
}

pub(crate) fn sync_seconds(shape: &WorkloadShape) -> f64 {
    shape.weight_bytes() * shape.weight_copies as f64 / shape.sync_link()
}

pub(crate) fn trainer_fits(shape: &WorkloadShape, g: usize, extra_per_gpu: f64) -> bool {
    TRAINER_BYTES_PER_PARAM * shape.params / g as f64 + extra_per_gpu
        <= USABLE_MEMORY_FRACTION * shape.gpu.spec().memory_bytes
}

/// Staleness to configure for bounded-async: enough versions in flight to absorb a straggler
/// that runs p95/mean times longer than a typical sample, at least 2, at most the tolerance.
pub(crate) fn async_staleness(shape: &WorkloadShape) -> u32 {
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
pub(crate) fn recommend(layouts: &[LayoutEstimate], tolerance: u32) -> (Layout, String) {
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

pub(crate) fn knob_for(binding: &str, shape: &WorkloadShape) -> String {
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

pub(crate) fn fmt_bytes(b: f64) -> String {
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
