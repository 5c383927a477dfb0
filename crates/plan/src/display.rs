//! The human-readable rendering of a [`Plan`] printed by `composer-rl plan`.

use std::fmt;

use composer_telemetry::summary::{fmt_num, fmt_secs};

use crate::estimate::*;

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
