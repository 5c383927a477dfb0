//! `plan --from-run`: the plan read off a run's measured walls (through telemetry's public
//! metrics reader and run summary), instead of estimated from a shape.

use std::path::Path;

use anyhow::{bail, Result};

use composer_telemetry::read_metrics_checked;
use composer_telemetry::summary::{fmt_secs, RunSummary};

use crate::estimate::*;

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
    // Checked: a negative or absurd wall is refused naming its line, not planned from.
    let records = read_metrics_checked(&path)?;
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
