//! The training progress display: an indicatif bar with ETA on a terminal, plain `tracing`
//! lines (with ETA) when quiet or when stderr is not a terminal (CI logs, `nohup`).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// What the progress display shows after a step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepSnapshot {
    /// The step just finished (1-based; `total_steps` is the last).
    pub step: u64,
    /// Mean reward of the step.
    pub reward_mean: f64,
    /// Latest eval accuracy, if an eval ran (it is remembered for later steps).
    pub eval_accuracy: Option<f64>,
    /// Generated tokens per second.
    pub tokens_per_s: f64,
    /// Free text appended to the line, e.g. `"diloco r3 4/4 12.1MB"`.
    pub extra: Option<String>,
}

/// Progress of a training run: a bar with ETA, or plain log lines.
pub struct TrainProgress {
    bar: Option<ProgressBar>,
    total_steps: u64,
    start: Instant,
    start_step: u64,
    last_eval: Option<f64>,
}

impl TrainProgress {
    /// A progress display for `total_steps` steps; `quiet` (or a non-terminal stderr) logs
    /// one plain line per step through `tracing` instead of drawing a bar.
    pub fn new(total_steps: u64, quiet: bool) -> Self {
        let use_bar = !quiet && std::io::stderr().is_terminal();
        let bar = use_bar.then(|| {
            let bar =
                ProgressBar::with_draw_target(Some(total_steps), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{spinner} step {pos}/{len} [{elapsed_precise}<{eta_precise}] {wide_bar} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(250));
            bar
        });
        Self {
            bar,
            total_steps,
            start: Instant::now(),
            start_step: 0,
            last_eval: None,
        }
    }

    /// Starts counting from `step` (a resumed run), so the ETA uses only this session's pace.
    pub fn resume_from(&mut self, step: u64) {
        self.start_step = step;
        self.start = Instant::now();
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.reset_eta();
        }
    }

    /// The one-line message for a snapshot (also used in quiet mode).
    fn message(&mut self, s: &StepSnapshot) -> String {
        if s.eval_accuracy.is_some() {
            self.last_eval = s.eval_accuracy;
        }
        let mut msg = format!(
            "reward {:.3} · {} tok/s",
            s.reward_mean,
            crate::summary::fmt_num(s.tokens_per_s)
        );
        if let Some(acc) = self.last_eval {
            msg.push_str(&format!(" · eval {acc:.3}"));
        }
        if let Some(extra) = &s.extra {
            msg.push_str(" · ");
            msg.push_str(extra);
        }
        msg
    }

    /// Estimated seconds left from this session's mean step time, if any step is done.
    pub fn eta_s(&self, step: u64) -> Option<f64> {
        let done = step.checked_sub(self.start_step).filter(|d| *d > 0)?;
        let per_step = self.start.elapsed().as_secs_f64() / done as f64;
        Some(per_step * self.total_steps.saturating_sub(step) as f64)
    }

    /// Shows the state after a step.
    pub fn update(&mut self, s: &StepSnapshot) {
        let msg = self.message(s);
        match &self.bar {
            Some(bar) => {
                bar.set_position(s.step);
                bar.set_message(msg);
            }
            None => {
                let eta = self
                    .eta_s(s.step)
                    .map_or("-".to_string(), crate::summary::fmt_secs);
                tracing::info!("step {}/{} · {msg} · eta {eta}", s.step, self.total_steps);
            }
        }
    }

    /// Prints a line above the bar (or logs it in quiet mode).
    pub fn println(&self, msg: impl AsRef<str>) {
        match &self.bar {
            Some(bar) => bar.println(msg.as_ref()),
            None => tracing::info!("{}", msg.as_ref()),
        }
    }

    /// Ends the display and prints `summary` (e.g. the [`crate::RunSummary`] table).
    pub fn finish(&self, summary: impl AsRef<str>) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
            eprintln!("{}", summary.as_ref());
        } else {
            tracing::info!("{}", summary.as_ref());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_progress_remembers_eval_and_estimates_eta() {
        let mut p = TrainProgress::new(10, true);
        p.resume_from(4);
        assert_eq!(p.eta_s(4), None);
        let snap = StepSnapshot {
            step: 5,
            reward_mean: 0.25,
            eval_accuracy: Some(0.5),
            tokens_per_s: 1234.0,
            extra: Some("diloco r1".into()),
        };
        let msg = p.message(&snap);
        assert!(
            msg.contains("eval 0.500") && msg.contains("diloco r1"),
            "{msg}"
        );
        let msg = p.message(&StepSnapshot {
            step: 6,
            ..Default::default()
        });
        assert!(msg.contains("eval 0.500"), "{msg}");
        assert!(p.eta_s(6).unwrap() >= 0.0);
        p.update(&snap);
        p.println("hello");
        p.finish("done");
    }
}
