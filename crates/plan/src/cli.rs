//! [`PlanOptions`] and [`plan_cli`]: the `composer-rl plan` subcommand, free of clap.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::estimate::*;
use crate::from_run::plan_from_run_with;
use crate::hardware::{GpuKind, ModelArch};
use crate::shape::WorkloadShape;

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
