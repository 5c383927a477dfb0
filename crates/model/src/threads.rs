//! The CPU thread count of candle's matmuls, fixed once at start-up.
//!
//! candle-core 0.11.1 asks `candle_core::utils::get_num_threads()` on every CPU matmul. That
//! reads `RAYON_NUM_THREADS` and, when it is unset (or not a positive integer), recomputes the
//! default: on Linux `num_cpus::get_physical()`, which opens and parses `/proc/cpuinfo` (and
//! the cgroup files) each time. A decode step does a few dozen matmuls, so an 8 × 200-token
//! `generate` opened `/proc/cpuinfo` about 7,400 times (see BENCHMARKS.md, "CPU thread
//! count"). [`configure_cpu_threads`] computes candle's own default once and stores it in
//! `RAYON_NUM_THREADS`, so every later lookup is an environment read with the same answer;
//! a value the user set is kept.

use std::sync::Once;

/// The variable candle (and rayon's global pool) read for the thread count.
pub const THREADS_ENV: &str = "RAYON_NUM_THREADS";

/// `RAYON_NUM_THREADS` parsed as candle parses it: a positive integer, else None.
fn user_threads() -> Option<usize> {
    std::env::var(THREADS_ENV)
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

/// Fixes the CPU thread count for the process and returns it: a valid `RAYON_NUM_THREADS`
/// set by the user is kept; otherwise candle's default (computed once, here) is written to
/// `RAYON_NUM_THREADS`. Idempotent and cheap after the first call.
///
/// Call it first thing in `main`, before other threads start (it sets an environment
/// variable); the library also calls it once when a model is built, for library users.
pub fn configure_cpu_threads() -> usize {
    if let Some(n) = user_threads() {
        return n;
    }
    // candle's own rule (CPU mask, preferred cores, physical cores) — one /proc read.
    std::env::remove_var(THREADS_ENV);
    let n = candle_core::utils::get_num_threads().max(1);
    std::env::set_var(THREADS_ENV, n.to_string());
    n
}

/// [`configure_cpu_threads`] at most once per process (what model constructors call).
pub(crate) fn ensure_cpu_threads_configured() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        configure_cpu_threads();
    });
}
