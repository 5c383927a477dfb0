//! composer-train: the recipe, data and rewards, the built-in tiny model (a composer-model
//! `Transformer`) and arithmetic task, the step loop (rollouts through composer-model's
//! KV-cached `generate`, the loss through composer-loss), checkpoints and resume.
//!
//! Entry points: [`run_train`] (what `composer-rl train` calls), [`EXAMPLE_RECIPE`],
//! [`embedded_default_recipe`], [`bench_channels`].

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

pub mod async_mode;
pub mod async_resume;
pub mod batch;
pub mod bench;
pub mod bench_grpo;
pub mod checkpoint;
pub mod data;
pub mod env_batch;
pub mod env_rollout;
pub mod mixed_precision;
pub mod model;
pub mod optim;
pub mod options;
pub mod prompts;
pub mod recipe;
pub mod record_episodes;
pub mod record_traces;
pub mod replay;
pub mod resume_check;
pub mod rewards;
pub mod rollout;
pub mod run_dir;
pub mod sampling;
pub mod seed;
pub mod session;
pub mod signals;
pub mod step_end;
pub mod step_hook;
pub mod step_loss;
pub mod task;
pub mod test_hooks;
pub mod tokenizer;
pub mod tool_calls;
pub mod tool_env;
pub mod trainer;
pub mod update;
pub mod verifiers;

pub use bench::{bench_async, bench_channels, AsyncBenchOptions, BenchOptions};
pub use recipe::{
    embedded_default_recipe, load_recipe, parse_recipe, Recipe, EMBEDDED_DEFAULT_RECIPE,
    EXAMPLE_RECIPE,
};
pub use signals::Interrupt;
pub use trainer::{
    run_train, run_train_with, NoHook, RunOutcome, StepExtras, StepHook, TrainOptions,
};
