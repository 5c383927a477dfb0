//! The CPU thread count is fixed once (in `RAYON_NUM_THREADS`) so candle does not re-derive
//! it from /proc/cpuinfo on every matmul; a user's own value is kept. One test function: the
//! environment is process-wide, and this file is its own test process.

use candle_core::Device;
use composer_model::threads::{configure_cpu_threads, THREADS_ENV};
use composer_model::{ModelConfig, Transformer};

#[test]
fn thread_count_is_fixed_once_and_a_users_value_is_kept() {
    // Unset: building a model (the library path) fixes candle's default in the environment.
    std::env::remove_var(THREADS_ENV);
    let candle_default = candle_core::utils::get_num_threads();
    Transformer::random_init(&ModelConfig::tiny_qwen2(64), 0, &Device::Cpu).expect("model");
    assert_eq!(
        std::env::var(THREADS_ENV).ok(),
        Some(candle_default.to_string()),
        "building a model must fix the thread count"
    );
    assert_eq!(candle_core::utils::get_num_threads(), candle_default);

    // A user's value wins.
    std::env::set_var(THREADS_ENV, "3");
    assert_eq!(configure_cpu_threads(), 3);
    assert_eq!(std::env::var(THREADS_ENV).unwrap(), "3");
    assert_eq!(candle_core::utils::get_num_threads(), 3);

    // Values candle would ignore (0, not a number) are replaced by its default.
    for bad in ["0", "many", ""] {
        std::env::set_var(THREADS_ENV, bad);
        assert_eq!(configure_cpu_threads(), candle_default, "value {bad:?}");
        assert_eq!(
            std::env::var(THREADS_ENV).unwrap(),
            candle_default.to_string()
        );
    }
}
