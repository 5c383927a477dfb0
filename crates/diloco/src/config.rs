//! The `[diloco]` recipe section.

use std::time::Duration;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// How pseudo-gradients are encoded in the store. Global weights are always f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// 4 bytes per element, lossless.
    #[default]
    F32,
    /// 2 bytes per element: bfloat16 (round to nearest even), relative error ≤ 2⁻⁸.
    Bf16,
    /// 1 byte per element plus one f32 per tensor: symmetric per-tensor absmax quantisation,
    /// `q = round(x / s)`, `s = max|x| / 127`; absolute error ≤ s / 2.
    Int8,
}

impl Compression {
    /// Bytes per element of a pseudo-gradient (ignoring the per-tensor scale and header).
    pub fn bytes_per_element(self) -> usize {
        match self {
            Compression::F32 => 4,
            Compression::Bf16 => 2,
            Compression::Int8 => 1,
        }
    }

    /// Short lowercase name, as written in recipes and object metadata.
    pub fn name(self) -> &'static str {
        match self {
            Compression::F32 => "f32",
            Compression::Bf16 => "bf16",
            Compression::Int8 => "int8",
        }
    }
}

/// DiLoCo settings (the recipe's `[diloco]` section). Times are in seconds so TOML stays plain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DilocoConfig {
    /// H: inner optimizer steps between two syncs of the same fragment.
    pub inner_steps: usize,
    /// Outer SGD learning rate (DiLoCo paper: 0.7).
    #[serde(default = "default_outer_lr")]
    pub outer_lr: f64,
    /// Outer SGD momentum μ (DiLoCo paper: 0.9).
    #[serde(default = "default_outer_momentum")]
    pub outer_momentum: f64,
    /// Nesterov momentum in the outer step (torch.optim.SGD `nesterov=True`).
    #[serde(default = "default_true")]
    pub nesterov: bool,
    /// Replicas expected per round: a round closes as soon as this many have published.
    pub num_replicas: usize,
    /// After `quorum_timeout_s` a round closes with whoever published, if at least this many.
    #[serde(default = "default_one")]
    pub min_replicas: usize,
    /// How long a replica waits for the expected replicas before closing with fewer.
    #[serde(default = "default_quorum_timeout_s")]
    pub quorum_timeout_s: f64,
    /// F: fragments the model is split into (1 = plain DiLoCo). Fragment `r % F` syncs in round r.
    #[serde(default = "default_one")]
    pub num_fragments: usize,
    /// τ: inner steps between publishing a fragment's pseudo-gradient and applying its round.
    #[serde(default)]
    pub fragment_sync_delay: usize,
    /// α: after a fragment's outer step, weights = (1-α)·global + α·local (torchft's lerp).
    #[serde(default)]
    pub fragment_update_alpha: f64,
    /// Pseudo-gradient encoding.
    #[serde(default)]
    pub compression: Compression,
    /// Seconds a store operation that fails transiently (store unreachable, 5xx, timeout)
    /// keeps being retried before the replica gives up. Long enough to ride out a store
    /// restart or a short network outage: when it runs out every replica exits.
    #[serde(default = "default_store_retry_budget_s")]
    pub store_retry_budget_s: f64,
    /// Optional cap on the attempts after the first one, on top of the time budget
    /// (unset: only `store_retry_budget_s` bounds the retries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_retries: Option<usize>,
    /// First back-off between attempts (doubles each time, at most
    /// [`MAX_STORE_BACKOFF_S`]).
    #[serde(default = "default_store_backoff_s")]
    pub store_backoff_s: f64,
    /// How often a waiting replica polls the store.
    #[serde(default = "default_poll_interval_s")]
    pub poll_interval_s: f64,
    /// Store URL (`file:///dir`, `s3://bucket/prefix`, …; see [`crate::open_store`]);
    /// `--diloco-store` overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}

fn default_outer_lr() -> f64 {
    0.7
}
fn default_outer_momentum() -> f64 {
    0.9
}
fn default_true() -> bool {
    true
}
fn default_one() -> usize {
    1
}
fn default_quorum_timeout_s() -> f64 {
    60.0
}
fn default_store_retry_budget_s() -> f64 {
    90.0
}

/// Largest accepted value of any `*_s` duration key (one year): anything longer is a typo,
/// and values near 1e19 s do not fit a `Duration` or an `Instant`.
pub const MAX_DURATION_S: f64 = 365.0 * 24.0 * 3600.0;

/// Longest wait between two attempts of a store operation: the back-off doubles up to this,
/// so a store that comes back is noticed within this many seconds.
pub const MAX_STORE_BACKOFF_S: f64 = 10.0;
fn default_store_backoff_s() -> f64 {
    0.2
}
fn default_poll_interval_s() -> f64 {
    0.1
}

impl DilocoConfig {
    /// A config with the paper's defaults for `num_replicas` replicas and H inner steps.
    pub fn new(inner_steps: usize, num_replicas: usize) -> Self {
        Self {
            inner_steps,
            outer_lr: default_outer_lr(),
            outer_momentum: default_outer_momentum(),
            nesterov: true,
            num_replicas,
            min_replicas: 1,
            quorum_timeout_s: default_quorum_timeout_s(),
            num_fragments: 1,
            fragment_sync_delay: 0,
            fragment_update_alpha: 0.0,
            compression: Compression::F32,
            store_retry_budget_s: default_store_retry_budget_s(),
            store_retries: None,
            store_backoff_s: default_store_backoff_s(),
            poll_interval_s: default_poll_interval_s(),
            store: None,
        }
    }

    /// Inner steps between two consecutive rounds (any fragment): H / F.
    pub fn round_period(&self) -> usize {
        self.inner_steps / self.num_fragments.max(1)
    }

    /// Checks the field ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if self.inner_steps == 0 {
            bail!("diloco.inner_steps must be ≥ 1");
        }
        if self.num_fragments == 0 {
            bail!("diloco.num_fragments must be ≥ 1");
        }
        if !self.inner_steps.is_multiple_of(self.num_fragments) {
            bail!(
                "diloco.inner_steps ({}) must be a multiple of diloco.num_fragments ({})",
                self.inner_steps,
                self.num_fragments
            );
        }
        if self.fragment_sync_delay >= self.round_period() {
            bail!(
                "diloco.fragment_sync_delay ({}) must be < inner_steps / num_fragments ({})",
                self.fragment_sync_delay,
                self.round_period()
            );
        }
        if !(0.0..=1.0).contains(&self.fragment_update_alpha) {
            bail!("diloco.fragment_update_alpha must be in [0, 1]");
        }
        if self.num_replicas == 0 {
            bail!("diloco.num_replicas must be ≥ 1");
        }
        if self.min_replicas == 0 || self.min_replicas > self.num_replicas {
            bail!("diloco.min_replicas must be in 1..=num_replicas");
        }
        if !(self.outer_lr.is_finite() && self.outer_lr > 0.0) {
            bail!("diloco.outer_lr must be > 0");
        }
        if !(0.0..1.0).contains(&self.outer_momentum) {
            bail!("diloco.outer_momentum must be in [0, 1)");
        }
        for (name, v) in [
            ("quorum_timeout_s", self.quorum_timeout_s),
            ("store_retry_budget_s", self.store_retry_budget_s),
            ("store_backoff_s", self.store_backoff_s),
            ("poll_interval_s", self.poll_interval_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("diloco.{name} must be a finite number ≥ 0");
            }
            // Larger values would panic mid-round (Duration / Instant overflow).
            if v > MAX_DURATION_S {
                bail!("diloco.{name} = {v} is too large: at most {MAX_DURATION_S} s (one year)");
            }
        }
        Ok(())
    }

    /// `store_retry_budget_s` as a Duration.
    pub fn store_retry_budget(&self) -> Duration {
        Duration::from_secs_f64(self.store_retry_budget_s)
    }

    /// `quorum_timeout_s` as a Duration.
    pub fn quorum_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.quorum_timeout_s)
    }
}
