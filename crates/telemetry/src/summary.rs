//! The walls summary of a run: where each step's time went (τ_R rollout, τ_V reward,
//! τ_T train, τ_S sync), which wall binds, goodput, the straggler tax, env latency, staleness.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;
use serde_json::Value;

use crate::metrics::{is_eval, is_train, keys, num, nums};

/// Percentile `p` (0..=100) of `values` with linear interpolation between closest ranks
/// (numpy's default `method="linear"`): rank = p/100 · (n − 1), value = x[⌊rank⌋] +
/// (rank − ⌊rank⌋)·(x[⌊rank⌋+1] − x[⌊rank⌋]) over the sorted values. `None` when empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    Some(sorted[lo] + frac * (sorted[hi] - sorted[lo]))
}

/// One wall's time over the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WallStat {
    /// `rollout`, `reward`, `train` or `sync`.
    pub name: String,
    /// Sum over steps (seconds).
    pub total_s: f64,
    /// Mean per step over the steps that report it (seconds).
    pub mean_s: f64,
    /// Mean wall time / mean step time (in async mode walls overlap, so shares can sum > 1).
    pub share: f64,
}

/// Summary of a run's metrics (see the module docs). Every field tolerates missing keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunSummary {
    /// Number of training-step lines.
    pub steps: usize,
    /// Last training step number seen.
    pub last_step: Option<u64>,
    /// Sum of per-step wall-clock time: `time/step_s`, or the sum of the four walls where
    /// a line has no `time/step_s`.
    pub total_step_s: f64,
    /// Mean step time (seconds).
    pub mean_step_s: f64,
    /// rollout, reward, train, sync (only walls that appear in the metrics).
    pub walls: Vec<WallStat>,
    /// The wall with the largest total, if any wall was measured.
    pub binding_wall: Option<String>,
    /// The binding wall's mean / mean step time.
    pub binding_share: Option<f64>,
    /// Tokens trained over the steps in the file: the growth of the cumulative
    /// `trained_tokens` counter (see [`trained_tokens_total`]), not a sum of its values.
    pub trained_tokens: f64,
    /// Goodput: trained tokens / total step seconds.
    pub goodput_tokens_per_s: Option<f64>,
    /// Mean of `tokens_per_s` (generation throughput).
    pub mean_tokens_per_s: Option<f64>,
    /// Completion length p50 (tokens), from per-sample `completions/lengths` when logged,
    /// otherwise from per-step `completions/mean_length` (see `length_source`).
    pub completion_p50: Option<f64>,
    /// Completion length p95 (tokens).
    pub completion_p95: Option<f64>,
    /// Straggler tax: p95 / p50 completion length (the batch waits for its longest sample).
    pub straggler_tax: Option<f64>,
    /// `"per-sample"` or `"per-step means"`.
    pub length_source: Option<String>,
    /// Env latency p50 (seconds), over every logged `env/latency_s` value.
    pub env_latency_p50: Option<f64>,
    /// Env latency p95 (seconds).
    pub env_latency_p95: Option<f64>,
    /// Count of consumed trajectories per policy-version lag (from `staleness/values`).
    pub staleness_histogram: BTreeMap<u64, u64>,
    /// Largest lag seen (`staleness/max` or the values).
    pub staleness_max: Option<f64>,
    /// Total trajectories dropped as too stale.
    pub staleness_dropped: f64,
    /// Total seconds the generator idled (async mode).
    pub idle_generator_s: Option<f64>,
    /// Total seconds the trainer idled (async mode).
    pub idle_trainer_s: Option<f64>,
    /// Total seconds the rewarder idled (async mode).
    pub idle_rewarder_s: Option<f64>,
    /// Reward mean of the first training step.
    pub reward_first: Option<f64>,
    /// Reward mean of the last training step.
    pub reward_last: Option<f64>,
    /// Last eval accuracy.
    pub eval_last: Option<f64>,
    /// Best eval accuracy.
    pub eval_best: Option<f64>,
    /// Last DiLoCo round seen.
    pub diloco_rounds: Option<f64>,
    /// Total DiLoCo bytes exchanged.
    pub diloco_bytes: Option<f64>,
    /// Total seconds in DiLoCo outer syncs.
    pub outer_sync_s: Option<f64>,
}

/// The four walls: display name and metric key.
pub const WALLS: [(&str, &str); 4] = [
    ("rollout", keys::TIME_ROLLOUT),
    ("reward", keys::TIME_REWARD),
    ("train", keys::TIME_TRAIN),
    ("sync", keys::TIME_SYNC),
];

/// Total tokens trained over `train` lines (in file order) from the cumulative
/// `trained_tokens` counter: the sum of its increments from line to line, counting from 0
/// before the first line. Summing the counter itself over steps inflates the total by about
/// steps/2 (the bug this replaces). A drop in the counter means it restarted (a fresh run
/// appended to the same file), so the new value counts whole rather than as a negative step.
/// Lines without the key are skipped.
pub fn trained_tokens_total(train: &[&Value]) -> f64 {
    let mut total = 0.0;
    let mut prev = 0.0;
    for value in train.iter().filter_map(|r| num(r, keys::TRAINED_TOKENS)) {
        total += if value >= prev { value - prev } else { value };
        prev = value;
    }
    total
}

fn sum_opt(records: &[&Value], key: &str) -> Option<f64> {
    let vals: Vec<f64> = records.iter().filter_map(|r| num(r, key)).collect();
    (!vals.is_empty()).then(|| vals.iter().sum())
}

impl RunSummary {
    /// Summarises metric records (train and eval lines, any order of keys, missing keys fine).
    pub fn from_metrics(records: &[Value]) -> RunSummary {
        let train: Vec<&Value> = records.iter().filter(|r| is_train(r)).collect();
        let evals: Vec<f64> = records
            .iter()
            .filter(|r| is_eval(r))
            .filter_map(|r| num(r, keys::EVAL_ACCURACY))
            .collect();
        let mut s = RunSummary {
            steps: train.len(),
            last_step: train
                .iter()
                .filter_map(|r| r.get(keys::STEP).and_then(Value::as_u64))
                .max(),
            ..Default::default()
        };

        // Step time: time/step_s, else the sum of whatever walls the line has.
        let step_times: Vec<f64> = train
            .iter()
            .map(|r| {
                num(r, keys::TIME_STEP)
                    .unwrap_or_else(|| WALLS.iter().filter_map(|(_, k)| num(r, k)).sum())
            })
            .collect();
        s.total_step_s = step_times.iter().sum();
        s.mean_step_s = if train.is_empty() {
            0.0
        } else {
            s.total_step_s / train.len() as f64
        };

        for (name, key) in WALLS {
            let vals: Vec<f64> = train.iter().filter_map(|r| num(r, key)).collect();
            if vals.is_empty() {
                continue;
            }
            let total: f64 = vals.iter().sum();
            let mean = total / vals.len() as f64;
            let share = if s.mean_step_s > 0.0 {
                mean / s.mean_step_s
            } else {
                0.0
            };
            s.walls.push(WallStat {
                name: name.to_string(),
                total_s: total,
                mean_s: mean,
                share,
            });
        }
        if let Some(b) = s
            .walls
            .iter()
            .max_by(|a, b| a.total_s.total_cmp(&b.total_s))
        {
            s.binding_wall = Some(b.name.clone());
            s.binding_share = Some(b.share);
        }

        s.trained_tokens = trained_tokens_total(&train);
        if s.trained_tokens > 0.0 && s.total_step_s > 0.0 {
            s.goodput_tokens_per_s = Some(s.trained_tokens / s.total_step_s);
        }
        let tps: Vec<f64> = train
            .iter()
            .filter_map(|r| num(r, keys::TOKENS_PER_S))
            .collect();
        if !tps.is_empty() {
            s.mean_tokens_per_s = Some(tps.iter().sum::<f64>() / tps.len() as f64);
        }

        let lengths: Vec<f64> = train
            .iter()
            .flat_map(|r| nums(r, keys::COMPLETION_LENGTHS))
            .collect();
        let (lengths, source) = if !lengths.is_empty() {
            (lengths, "per-sample")
        } else {
            let means: Vec<f64> = train
                .iter()
                .filter_map(|r| num(r, keys::COMPLETION_MEAN_LENGTH))
                .collect();
            (means, "per-step means")
        };
        if !lengths.is_empty() {
            s.completion_p50 = percentile(&lengths, 50.0);
            s.completion_p95 = percentile(&lengths, 95.0);
            s.length_source = Some(source.to_string());
            if let (Some(p50), Some(p95)) = (s.completion_p50, s.completion_p95) {
                if p50 > 0.0 {
                    s.straggler_tax = Some(p95 / p50);
                }
            }
        }

        let latencies: Vec<f64> = train
            .iter()
            .flat_map(|r| nums(r, keys::ENV_LATENCY))
            .collect();
        s.env_latency_p50 = percentile(&latencies, 50.0);
        s.env_latency_p95 = percentile(&latencies, 95.0);

        let mut max_lag: Option<f64> = None;
        for r in &train {
            for lag in nums(r, keys::STALENESS_VALUES) {
                if lag >= 0.0 {
                    *s.staleness_histogram.entry(lag.round() as u64).or_default() += 1;
                    max_lag = Some(max_lag.map_or(lag, |m: f64| m.max(lag)));
                }
            }
            if let Some(m) = num(r, keys::STALENESS_MAX) {
                max_lag = Some(max_lag.map_or(m, |x: f64| x.max(m)));
            }
        }
        s.staleness_max = max_lag;
        s.staleness_dropped = train
            .iter()
            .filter_map(|r| num(r, keys::STALENESS_DROPPED))
            .sum();

        s.idle_generator_s = sum_opt(&train, keys::IDLE_GENERATOR);
        s.idle_trainer_s = sum_opt(&train, keys::IDLE_TRAINER);
        s.idle_rewarder_s = sum_opt(&train, keys::IDLE_REWARDER);

        s.reward_first = train.iter().find_map(|r| num(r, keys::REWARD_MEAN));
        s.reward_last = train.iter().rev().find_map(|r| num(r, keys::REWARD_MEAN));
        s.eval_last = evals.last().copied();
        s.eval_best = evals.iter().copied().reduce(f64::max);

        s.diloco_rounds = train
            .iter()
            .filter_map(|r| num(r, keys::DILOCO_ROUND))
            .reduce(f64::max);
        s.diloco_bytes = sum_opt(&train, keys::DILOCO_BYTES);
        s.outer_sync_s = sum_opt(&train, keys::TIME_OUTER_SYNC);
        s
    }

    /// The measured wall `name` (`rollout`, `reward`, `train`, `sync`), if logged.
    pub fn wall(&self, name: &str) -> Option<&WallStat> {
        self.walls.iter().find(|w| w.name == name)
    }

    /// Rows `(label, value)` of the summary, shared by the terminal table and the HTML report.
    pub fn rows(&self) -> Vec<(String, String)> {
        let mut rows = vec![
            (
                "steps".to_string(),
                match self.last_step {
                    Some(last) => format!("{} (last step {last})", self.steps),
                    None => self.steps.to_string(),
                },
            ),
            (
                "step time".to_string(),
                format!(
                    "{} total, {} mean",
                    fmt_secs(self.total_step_s),
                    fmt_secs(self.mean_step_s)
                ),
            ),
        ];
        if let (Some(b), Some(share)) = (&self.binding_wall, self.binding_share) {
            rows.push((
                "binding wall".to_string(),
                format!("{b} ({:.0}% of the step)", share * 100.0),
            ));
        }
        if let Some(g) = self.goodput_tokens_per_s {
            rows.push((
                "goodput".to_string(),
                format!(
                    "{} trained tok/s ({} tokens / {})",
                    fmt_num(g),
                    fmt_num(self.trained_tokens),
                    fmt_secs(self.total_step_s)
                ),
            ));
        }
        if let Some(t) = self.mean_tokens_per_s {
            rows.push((
                "generation".to_string(),
                format!("{} tok/s mean", fmt_num(t)),
            ));
        }
        if let (Some(p50), Some(p95)) = (self.completion_p50, self.completion_p95) {
            rows.push((
                "completion length".to_string(),
                format!(
                    "p50 {} p95 {} tokens, straggler tax ×{:.2} ({})",
                    fmt_num(p50),
                    fmt_num(p95),
                    self.straggler_tax.unwrap_or(f64::NAN),
                    self.length_source.as_deref().unwrap_or("")
                ),
            ));
        }
        if let (Some(p50), Some(p95)) = (self.env_latency_p50, self.env_latency_p95) {
            rows.push((
                "env latency".to_string(),
                format!("p50 {} p95 {}", fmt_secs(p50), fmt_secs(p95)),
            ));
        }
        if self.staleness_max.is_some() || !self.staleness_histogram.is_empty() {
            let hist: Vec<String> = self
                .staleness_histogram
                .iter()
                .map(|(lag, n)| format!("{lag}:{n}"))
                .collect();
            rows.push((
                "staleness".to_string(),
                format!(
                    "max {} · lag:count {} · dropped {}",
                    self.staleness_max.map_or("-".into(), fmt_num),
                    if hist.is_empty() {
                        "-".to_string()
                    } else {
                        hist.join(" ")
                    },
                    fmt_num(self.staleness_dropped)
                ),
            ));
        }
        let idle: Vec<String> = [
            ("generator", self.idle_generator_s),
            ("trainer", self.idle_trainer_s),
            ("rewarder", self.idle_rewarder_s),
        ]
        .iter()
        .filter_map(|(n, v)| v.map(|v| format!("{n} {}", fmt_secs(v))))
        .collect();
        if !idle.is_empty() {
            rows.push(("idle".to_string(), idle.join(", ")));
        }
        if let (Some(a), Some(b)) = (self.reward_first, self.reward_last) {
            rows.push(("reward mean".to_string(), format!("{a:.4} → {b:.4}")));
        }
        if let (Some(last), Some(best)) = (self.eval_last, self.eval_best) {
            rows.push((
                "eval accuracy".to_string(),
                format!("last {last:.4}, best {best:.4}"),
            ));
        }
        if let Some(r) = self.diloco_rounds {
            rows.push((
                "diloco".to_string(),
                format!(
                    "{} rounds, {} bytes, outer sync {}",
                    fmt_num(r),
                    fmt_num(self.diloco_bytes.unwrap_or(0.0)),
                    fmt_secs(self.outer_sync_s.unwrap_or(0.0))
                ),
            ));
        }
        rows
    }
}

/// Seconds with a unit that reads well (ms / s / min / h).
pub fn fmt_secs(s: f64) -> String {
    if !s.is_finite() {
        "-".to_string()
    } else if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 120.0 {
        format!("{s:.2} s")
    } else if s < 7200.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.2} h", s / 3600.0)
    }
}

/// A number with a k/M/G suffix when large.
pub fn fmt_num(x: f64) -> String {
    let a = x.abs();
    if !x.is_finite() {
        "-".to_string()
    } else if a >= 1e12 {
        format!("{:.2}T", x / 1e12)
    } else if a >= 1e9 {
        format!("{:.2}G", x / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", x / 1e3)
    } else if x.fract() == 0.0 || a >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

impl fmt::Display for RunSummary {
    /// A compact terminal table: the walls (total, mean, share, binding marker) then one row
    /// per other figure.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.walls.is_empty() {
            writeln!(
                f,
                "{:<10} {:>12} {:>12} {:>7}",
                "wall", "total", "mean/step", "share"
            )?;
            for w in &self.walls {
                let marker = if self.binding_wall.as_deref() == Some(w.name.as_str()) {
                    "  ← binding"
                } else {
                    ""
                };
                writeln!(
                    f,
                    "{:<10} {:>12} {:>12} {:>6.1}%{marker}",
                    w.name,
                    fmt_secs(w.total_s),
                    fmt_secs(w.mean_s),
                    w.share * 100.0
                )?;
            }
        }
        for (label, value) in self.rows() {
            writeln!(f, "{label:<18} {value}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn percentile_matches_numpy_linear() {
        // numpy.percentile([1,2,3,4,10], 50) = 3.0; 95 → rank 0.95·4 = 3.8 → 4 + 0.8·(10−4) = 8.8
        let v = [10.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&v, 50.0), Some(3.0));
        assert!((percentile(&v, 95.0).unwrap() - 8.8).abs() < 1e-12);
        // Even count: [1,2,3,4] p50 → rank 1.5 → 2.5
        assert_eq!(percentile(&[4.0, 3.0, 2.0, 1.0], 50.0), Some(2.5));
        assert_eq!(percentile(&[7.0], 95.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    fn synthetic() -> Vec<Value> {
        vec![
            json!({"kind":"train","step":1,"reward/mean":0.1,
                   "time/rollout_s":6.0,"time/reward_s":1.0,"time/train_s":2.0,"time/sync_s":1.0,
                   "time/step_s":10.0,"trained_tokens":1000,
                   "completions/lengths":[100,200,300,400,1000],
                   "env/latency_s":[0.5,1.5],
                   "staleness/values":[0,1,1],"staleness/max":1,"staleness/dropped":2,
                   "idle/trainer_s":3.0}),
            json!({"kind":"train","step":2,"reward/mean":0.3,
                   "time/rollout_s":4.0,"time/reward_s":1.0,"time/train_s":4.0,"time/sync_s":1.0,
                   "time/step_s":10.0,"trained_tokens":4000,
                   "completions/lengths":[500],
                   "env/latency_s":[2.5,3.5],
                   "staleness/values":[2],"staleness/max":2,
                   "idle/trainer_s":1.0}),
            json!({"kind":"eval","step":2,"eval/accuracy":0.4}),
            json!({"kind":"train","step":3}),
        ]
    }

    #[test]
    fn summary_math() {
        let s = RunSummary::from_metrics(&synthetic());
        assert_eq!(s.steps, 3);
        assert_eq!(s.last_step, Some(3));
        // Step 3 has no timing at all: it contributes 0 s (sum of no walls).
        assert_eq!(s.total_step_s, 20.0);
        let rollout = s.wall("rollout").unwrap();
        // rollout 6 + 4 = 10 s over 2 steps that report it → mean 5; mean step = 20/3 s.
        assert_eq!(rollout.total_s, 10.0);
        assert_eq!(rollout.mean_s, 5.0);
        assert!((rollout.share - 5.0 / (20.0 / 3.0)).abs() < 1e-12);
        // train 2 + 4 = 6 < rollout 10 → rollout binds.
        assert_eq!(s.binding_wall.as_deref(), Some("rollout"));
        // trained_tokens is cumulative (1000 then 4000): 4000 tokens / 20 s = 200 tok/s.
        assert_eq!(s.goodput_tokens_per_s, Some(200.0));
        // lengths sorted [100,200,300,400,500,1000]: p50 rank 2.5 → 350;
        // p95 rank 4.75 → 500 + 0.75·500 = 875; tax 875/350 = 2.5.
        assert_eq!(s.completion_p50, Some(350.0));
        assert_eq!(s.completion_p95, Some(875.0));
        assert!((s.straggler_tax.unwrap() - 2.5).abs() < 1e-12);
        assert_eq!(s.length_source.as_deref(), Some("per-sample"));
        // latencies [0.5,1.5,2.5,3.5]: p50 rank 1.5 → 2.0; p95 rank 2.85 → 2.5+0.85 = 3.35.
        assert_eq!(s.env_latency_p50, Some(2.0));
        assert!((s.env_latency_p95.unwrap() - 3.35).abs() < 1e-12);
        assert_eq!(
            s.staleness_histogram,
            BTreeMap::from([(0, 1), (1, 2), (2, 1)])
        );
        assert_eq!(s.staleness_max, Some(2.0));
        assert_eq!(s.staleness_dropped, 2.0);
        assert_eq!(s.idle_trainer_s, Some(4.0));
        assert_eq!(s.idle_generator_s, None);
        assert_eq!(s.reward_first, Some(0.1));
        assert_eq!(s.reward_last, Some(0.3));
        assert_eq!(s.eval_best, Some(0.4));
        let text = s.to_string();
        assert!(text.contains("← binding"), "{text}");
        assert!(text.contains("straggler tax ×2.50"), "{text}");
    }

    #[test]
    fn summary_of_nothing_is_empty_not_a_panic() {
        let s = RunSummary::from_metrics(&[]);
        assert_eq!(s.steps, 0);
        assert!(s.binding_wall.is_none());
        let _ = s.to_string();
        // Falls back to per-step means for lengths.
        let s = RunSummary::from_metrics(&[
            json!({"step":1,"completions/mean_length":10.0}),
            json!({"step":2,"completions/mean_length":30.0}),
        ]);
        assert_eq!(s.completion_p50, Some(20.0));
        assert_eq!(s.length_source.as_deref(), Some("per-step means"));
    }
}
