//! Environment variables that make a test run misbehave on purpose (NaN loss, a real
//! SIGINT/SIGTERM, a failing verifier) at chosen steps, so the recovery paths are tested
//! end to end through the real binary.

/// Test hook: comma-separated RL steps whose loss is replaced by NaN.
pub const NAN_HOOK_ENV: &str = "COMPOSER_TRAIN_INJECT_NAN_STEPS";

/// Test hook: comma-separated RL steps at whose end the process raises a real SIGINT
/// (exercises the Ctrl-C path: checkpoint, clean shutdown of every actor).
pub const SIGINT_HOOK_ENV: &str = "COMPOSER_TRAIN_SIGINT_AT_STEPS";

/// Test hook: like [`SIGINT_HOOK_ENV`], with a real SIGTERM.
pub const SIGTERM_HOOK_ENV: &str = "COMPOSER_TRAIN_SIGTERM_AT_STEPS";

/// Test hook: the supervised warm-up step (0-based) at whose start the process raises SIGINT.
pub const WARMUP_SIGINT_HOOK_ENV: &str = "COMPOSER_TRAIN_SIGINT_AT_WARMUP_STEP";

/// Test hook (async mode): the rewarder fails on this scored batch (1-based), to exercise
/// shutdown on an actor's error.
pub const REWARD_ERROR_HOOK_ENV: &str = "COMPOSER_TRAIN_INJECT_REWARD_ERROR_AT_BATCH";

/// The comma-separated step numbers in env var `var` (none when unset).
pub(crate) fn hook_steps(var: &str) -> Vec<usize> {
    std::env::var(var)
        .unwrap_or_default()
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect()
}
