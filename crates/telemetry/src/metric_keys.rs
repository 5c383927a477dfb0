//! The typed schema of `metrics.jsonl`: every key any crate writes, with its unit, the kind of
//! line it appears on, and what it means.
//!
//! One source of truth: the `&str` constants of [`crate::metrics::keys`] are generated from this
//! table (so readers and writers cannot drift apart), and `docs/METRICS.md` is rendered from it
//! by [`markdown`]; a test fails when the committed file is out of date (regenerate with
//! `UPDATE_METRICS_MD=1 cargo test -p composer-telemetry metrics_md`).

use std::fmt::Write as _;

/// The unit of a metric's value(s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// A label or identifier (string or integer used as a name).
    Label,
    /// An optimizer step or policy version number.
    Step,
    /// A count of items (samples, pairs, episodes, ...).
    Count,
    /// A fraction in [0, 1].
    Ratio,
    /// Seconds of wall-clock time.
    Seconds,
    /// Tokens.
    Tokens,
    /// Tokens per second.
    TokensPerSecond,
    /// Bytes.
    Bytes,
    /// Nats (natural-log information units: losses, KL, entropy).
    Nats,
    /// A reward value, in the task's own scale.
    Reward,
    /// A dimensionless number (norms, learning rates).
    Scalar,
    /// A boolean flag.
    Flag,
}

impl Unit {
    /// The short name used in docs/METRICS.md.
    pub const fn as_str(self) -> &'static str {
        match self {
            Unit::Label => "label",
            Unit::Step => "step",
            Unit::Count => "count",
            Unit::Ratio => "ratio",
            Unit::Seconds => "s",
            Unit::Tokens => "tokens",
            Unit::TokensPerSecond => "tokens/s",
            Unit::Bytes => "bytes",
            Unit::Nats => "nats",
            Unit::Reward => "reward",
            Unit::Scalar => "scalar",
            Unit::Flag => "bool",
        }
    }
}

/// Whether a key holds one value or an array of per-item values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One number (or string / bool) per line.
    Scalar,
    /// An array of per-item numbers (one per sample, call, trajectory, ...).
    Array,
}

/// The kind of line (`"kind"`) a key appears on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// Every line.
    Any,
    /// Per-step training lines (`kind = "train"`).
    Train,
    /// Evaluation lines (`kind = "eval"`).
    Eval,
    /// DiLoCo outer-round lines (`kind = "diloco"`).
    Diloco,
}

impl Record {
    /// The `kind` value, or `any`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Record::Any => "any",
            Record::Train => "train",
            Record::Eval => "eval",
            Record::Diloco => "diloco",
        }
    }
}

/// One key of `metrics.jsonl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricKey {
    /// The JSON key.
    pub name: &'static str,
    /// Unit of the value(s).
    pub unit: Unit,
    /// Scalar or per-item array.
    pub shape: Shape,
    /// The line kind it appears on.
    pub record: Record,
    /// One line: what it measures.
    pub description: &'static str,
}

/// `kind` of a per-step training line.
pub const KIND_TRAIN: &str = "train";
/// `kind` of an evaluation line.
pub const KIND_EVAL: &str = "eval";
/// `kind` of a DiLoCo outer-round line.
pub const KIND_DILOCO: &str = "diloco";

/// Defines each key as a typed [`MetricKey`] constant, the [`ALL`] table in file order, and the
/// plain `&str` constants of [`names`] (what writers pass to `json!` / `insert`).
macro_rules! schema {
    ($( $id:ident = $name:literal, $unit:ident, $shape:ident, $rec:ident, $desc:literal; )*) => {
        $(
            #[doc = concat!("`", $name, "`: ", $desc)]
            pub const $id: MetricKey = MetricKey {
                name: $name,
                unit: Unit::$unit,
                shape: Shape::$shape,
                record: Record::$rec,
                description: $desc,
            };
        )*
        /// Every key of the schema, in documentation order.
        pub const ALL: &[MetricKey] = &[$($id),*];
        /// The key strings alone, under the same names (re-exported as
        /// `composer_telemetry::keys`).
        pub mod names {
            $(
                #[doc = concat!("`", $name, "`: ", $desc)]
                pub const $id: &str = $name;
            )*
        }
    };
}

schema! {
    KIND = "kind", Label, Scalar, Any, "line kind: `train`, `eval` or `diloco`";
    STEP = "step", Step, Scalar, Any, "optimizer step the line belongs to (0 = before training)";
    POLICY_VERSION = "policy_version", Step, Scalar, Any, "version of the policy published at the end of the step (evals: the one evaluated)";
    SAMPLES = "samples", Count, Scalar, Any, "completions generated so far in the run (running total)";
    REWARD_MEAN = "reward/mean", Reward, Scalar, Train, "mean sequence reward of the step's batch";
    REWARD_STD = "reward/std", Reward, Scalar, Train, "standard deviation of the step's rewards";
    COMPLETION_MEAN_LENGTH = "completions/mean_length", Tokens, Scalar, Train, "mean completion length";
    COMPLETION_CLIPPED_RATIO = "completions/clipped_ratio", Ratio, Scalar, Train, "fraction of completions cut at the token limit";
    COMPLETION_LENGTHS = "completions/lengths", Tokens, Array, Train, "per-sample completion lengths";
    LOSS_RLVR = "loss/rlvr", Nats, Scalar, Train, "RLVR (policy-gradient) channel loss";
    LOSS_HINT = "loss/hint", Nats, Scalar, Train, "hint self-distillation channel loss";
    LOSS_REPLAY = "loss/replay", Nats, Scalar, Train, "trace-replay channel loss (DPO + teacher KL)";
    LOSS_REPLAY_DPO = "loss/replay_dpo", Nats, Scalar, Train, "DPO part of the replay loss";
    LOSS_REPLAY_KL = "loss/replay_kl", Nats, Scalar, Train, "teacher forward-KL part of the replay loss";
    KL = "kl", Nats, Scalar, Train, "KL to the reference policy (β ≠ 0), else 0";
    MISMATCH_MAX_ABS = "mismatch/max_abs", Nats, Scalar, Train, "largest abs(log π_old − log μ) over the trained tokens: the trainer's recomputed vs the sampler's log-probs (0 = bitwise equal)";
    MISMATCH_KL = "mismatch/kl", Nats, Scalar, Train, "mean of r − log r − 1, r = π_old/μ, over the trained tokens (k3 estimate of KL(sampler ‖ trainer))";
    ENTROPY = "entropy", Nats, Scalar, Train, "mean token entropy of the trainer's distribution";
    CLIP_RATIO_LOW = "clip_ratio/low", Ratio, Scalar, Train, "fraction of tokens clipped at 1 − ε_low";
    CLIP_RATIO_HIGH = "clip_ratio/high", Ratio, Scalar, Train, "fraction of tokens clipped at 1 + ε_high";
    GRAD_NORM = "grad_norm", Scalar, Scalar, Train, "gradient norm before clipping";
    LR = "lr", Scalar, Scalar, Train, "learning rate used for the step";
    HINT_SAMPLES = "hint/samples", Count, Scalar, Train, "samples that received a hint this step";
    REPLAY_DPO_PAIRS = "replay/dpo_pairs", Count, Scalar, Train, "DPO preference pairs trained on this step";
    REPLAY_ROWS_WITHOUT_TRACE = "replay/rows_without_trace", Count, Scalar, Train, "training prompts no passing teacher trace covers (the replay channel skips them; 0 without traces)";
    TIME_ROLLOUT = "time/rollout_s", Seconds, Scalar, Train, "τ_R: generating rollouts";
    TIME_REWARD = "time/reward_s", Seconds, Scalar, Train, "τ_V: environments, verifiers and reward";
    TIME_TRAIN = "time/train_s", Seconds, Scalar, Train, "τ_T: trainer forward, backward and optimizer";
    TIME_SYNC = "time/sync_s", Seconds, Scalar, Train, "τ_S: publishing weights to the generator";
    TIME_STEP = "time/step_s", Seconds, Scalar, Train, "wall-clock time of the whole step";
    TOKENS_PER_S = "tokens_per_s", TokensPerSecond, Scalar, Train, "generated tokens per second of rollout";
    TRAINED_TOKENS = "trained_tokens", Tokens, Scalar, Train, "tokens trained on so far: a running total restored on resume, never to be summed over steps";
    SKIPPED_STEPS = "skipped_steps", Count, Scalar, Train, "steps skipped so far for a non-finite loss or gradient (running total)";
    SKIPPED = "skipped", Flag, Scalar, Train, "present and true when this step's update was skipped (non-finite)";
    ENV_LATENCY = "env/latency_s", Seconds, Array, Train, "per-call environment / verifier latencies";
    ENV_STEP_P50 = "env/step_p50_s", Seconds, Scalar, Train, "median env step-call latency so far (env rollouts)";
    ENV_STEP_P95 = "env/step_p95_s", Seconds, Scalar, Train, "p95 env step-call latency so far (env rollouts)";
    ENV_RESET_P50 = "env/reset_p50_s", Seconds, Scalar, Train, "median env reset-call latency so far (env rollouts)";
    ENV_RESET_P95 = "env/reset_p95_s", Seconds, Scalar, Train, "p95 env reset-call latency so far (env rollouts)";
    ENV_EPISODES_OK = "env/episodes_ok", Count, Scalar, Train, "episodes finished without an env failure so far";
    ENV_EPISODES_FAILED = "env/episodes_failed", Count, Scalar, Train, "episodes that failed (env error or timeout) so far";
    ENV_FAILURES = "env/failures", Count, Scalar, Train, "env failures so far, by cause (an object of counts)";
    ENV_TURNS = "env/turns", Count, Array, Train, "per tool episode of the step, its model turns";
    ENV_TOOL_CALLS = "env/tool_calls", Count, Scalar, Train, "tool calls the step's episodes sent, by tool (an object of counts)";
    ENV_MALFORMED_CALLS = "env/malformed_calls", Count, Array, Train, "per tool episode, its malformed tool calls (bad JSON, unknown tool, bad arguments)";
    ENV_TURNS_WITHOUT_CALL = "env/turns_without_call", Count, Array, Train, "per tool episode, its model turns that held no tool call";
    ENV_TESTS_PASSED = "env/tests_passed", Count, Array, Train, "per graded tool episode, hidden tests passed";
    ENV_TESTS_TOTAL = "env/tests_total", Count, Array, Train, "per graded tool episode, hidden tests run";
    ENV_SANDBOX_S = "env/sandbox_s", Seconds, Array, Train, "per tool episode, wall time of its tool calls (the sandbox), grading included";
    ENV_VERIFIER_S = "env/verifier_s", Seconds, Array, Train, "per graded tool episode, wall time of the grading call (submit): the verifier wall";
    STALENESS_MEAN = "staleness/mean", Step, Scalar, Train, "mean policy-version lag of the consumed trajectories";
    STALENESS_MAX = "staleness/max", Step, Scalar, Train, "max policy-version lag of the consumed trajectories";
    STALENESS_DROPPED = "staleness/dropped", Count, Scalar, Train, "trajectories dropped this step for exceeding the staleness bound";
    STALENESS_VALUES = "staleness/values", Step, Array, Train, "per consumed trajectory, its policy-version lag (async mode)";
    STALENESS_BOUND = "staleness/bound", Step, Scalar, Train, "the staleness bound k in force (0 in sync mode)";
    IDLE_GENERATOR = "idle/generator_s", Seconds, Scalar, Train, "seconds the generator waited (async mode)";
    IDLE_REWARDER = "idle/rewarder_s", Seconds, Scalar, Train, "seconds the rewarder waited (async mode)";
    IDLE_TRAINER = "idle/trainer_s", Seconds, Scalar, Train, "seconds the trainer waited for a scored batch (async mode)";
    DYNAMIC_SAMPLING_DROPPED_GROUPS = "dynamic_sampling/dropped_groups", Count, Scalar, Train, "groups dropped this step by dynamic sampling (all rewards equal)";
    DYNAMIC_SAMPLING_ROUNDS = "dynamic_sampling/rounds", Count, Scalar, Train, "generation rounds dynamic sampling needed to fill the step's batch";
    REMAX_BASELINE_REWARD = "remax/baseline_reward", Reward, Scalar, Train, "mean over the step's samples of the reward of their prompt's greedy completion (ReMax's baseline)";
    ACTORS_CONSUMED = "actors/consumed", Count, Scalar, Train, "items trained on this step (async mode)";
    EVAL_ACCURACY = "eval/accuracy", Ratio, Scalar, Eval, "held-out accuracy";
    WARMUP_LOSS = "warmup/loss", Nats, Scalar, Eval, "loss of the supervised warm-up (the step-0 eval line)";
    DILOCO_REPLICA = "diloco/replica", Label, Scalar, Train, "id of the DiLoCo replica that wrote the line";
    DILOCO_ROUND = "diloco/round", Step, Scalar, Diloco, "DiLoCo outer round";
    DILOCO_FRAGMENT = "diloco/fragment", Label, Scalar, Diloco, "parameter fragment updated in the round (streaming DiLoCo)";
    DILOCO_REPLICAS = "diloco/replicas", Count, Scalar, Diloco, "replicas in the round's quorum";
    DILOCO_BYTES = "diloco/bytes", Bytes, Scalar, Diloco, "bytes exchanged in the round (up + down)";
    DILOCO_BYTES_UP = "diloco/bytes_up", Bytes, Scalar, Diloco, "bytes uploaded in the round";
    DILOCO_BYTES_DOWN = "diloco/bytes_down", Bytes, Scalar, Diloco, "bytes downloaded in the round";
    DILOCO_REJECTED = "diloco/rejected", Count, Scalar, Diloco, "delta objects rejected as corrupt or foreign";
    TIME_OUTER_SYNC = "time/outer_sync_s", Seconds, Scalar, Diloco, "seconds in the DiLoCo outer synchronisation";
}

/// Looks a key up by its JSON name.
pub fn lookup(name: &str) -> Option<&'static MetricKey> {
    ALL.iter().find(|k| k.name == name)
}

/// Renders the schema as the Markdown of `docs/METRICS.md`.
pub fn markdown() -> String {
    let mut s = String::new();
    s.push_str("# metrics.jsonl keys\n\n");
    s.push_str(
        "Generated from `crates/telemetry/src/metric_keys.rs` — do not edit by hand; run\n\
         `UPDATE_METRICS_MD=1 cargo test -p composer-telemetry metrics_md` after changing the schema.\n\n",
    );
    s.push_str(
        "Each line of `RUN_DIR/metrics.jsonl` is one JSON object; `kind` says which keys it may \
         hold. Array keys hold one value per item (sample, call, trajectory).\n\n",
    );
    s.push_str("| key | unit | shape | line | meaning |\n|---|---|---|---|---|\n");
    for k in ALL {
        let shape = match k.shape {
            Shape::Scalar => "scalar",
            Shape::Array => "array",
        };
        let _ = writeln!(
            s,
            "| `{}` | {} | {} | {} | {} |",
            k.name,
            k.unit.as_str(),
            shape,
            k.record.as_str(),
            k.description
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique() {
        let mut names: Vec<_> = ALL.iter().map(|k| k.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a key is listed twice");
        assert_eq!(lookup("time/step_s"), Some(&TIME_STEP));
    }

    /// docs/METRICS.md must be what [`markdown`] renders; `UPDATE_METRICS_MD=1` rewrites it.
    #[test]
    fn metrics_md_is_up_to_date() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/METRICS.md");
        let want = markdown();
        if std::env::var_os("UPDATE_METRICS_MD").is_some() {
            composer_fsutil::write_atomic(&path, want.as_bytes()).unwrap();
        }
        let got = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            got == want,
            "{} is out of date: run `UPDATE_METRICS_MD=1 cargo test -p composer-telemetry metrics_md`",
            path.display()
        );
    }
}
