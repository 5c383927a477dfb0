//! composer-plan — `composer-rl plan`: estimate a workload's four walls (τ_R rollout, τ_V reward/env,
//! τ_T train, τ_S weight sync) before any run, or read them from a run, and say which layout
//! fits: colocated synchronous, disaggregated (one-step overlap), or bounded-async.
//!
//! The formulas (also in `crates/plan/PLAN.md`), with N = parameters, S = samples per
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

//!
//! Layout: [`hardware`] (datasheets, architectures) → [`shape`] (the workload) → [`estimate`]
//! (walls, layouts, recommendation) → [`from_run`] (measured walls via composer-telemetry's
//! public reader) → [`display`] / [`cli`]. Plan depends on telemetry, never the reverse.

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]
#![deny(missing_docs)]

pub mod cli;
pub mod display;
pub mod estimate;
pub mod from_run;
pub mod hardware;
pub mod shape;
#[cfg(test)]
mod tests;

pub use cli::{plan_cli, PlanOptions};
pub use estimate::{plan_from_shape, Layout, LayoutEstimate, MemoryCheck, Plan, Walls};
pub use from_run::{plan_from_run, plan_from_run_with};
pub use hardware::{GpuKind, GpuSpec, ModelArch};
pub use shape::WorkloadShape;

/// Trainer bytes per parameter: bf16 weights (2) + f32 master weights (4) + f32 Adam moments
/// (8) + bf16 gradients (2).
pub const TRAINER_BYTES_PER_PARAM: f64 = 16.0;
/// Weight bytes per parameter in bf16 (generator weights, weight sync).
pub const WEIGHT_BYTES_PER_PARAM: f64 = 2.0;
/// Fraction of GPU memory usable (the rest: CUDA context, fragmentation, activations slack).
pub const USABLE_MEMORY_FRACTION: f64 = 0.9;
/// A more complex layout must be at least this much faster to be recommended.
pub(crate) const LAYOUT_MARGIN: f64 = 1.15;
