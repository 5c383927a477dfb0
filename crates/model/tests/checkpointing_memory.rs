//! Gradient checkpointing lowers a training step's peak heap: a test binary of its own, with
//! a counting global allocator and a single test, so the counted bytes are this step's.
//! (A memory bound, not a timing: the numbers with their command are in BENCHMARKS.md.)

use candle_core::Device;
use composer_model::bench::alloc_counter::{peak_during, CountingAllocator};
use composer_model::bench::{bench_input, train_step};
use composer_model::{ModelConfig, Transformer};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Peak heap (bytes) above the live heap at the start of one training step.
fn step_peak(model: &Transformer, input: &candle_core::Tensor) -> usize {
    let ((), peak) = peak_during(|| train_step(model, input).unwrap());
    peak
}

#[test]
fn checkpointing_at_least_halves_the_step_peak_heap() {
    // `tiny_qwen2`'s hidden 64 and 4 query / 2 key-value heads × 16, deeper and wider.
    let cfg = ModelConfig {
        intermediate_size: 256,
        num_hidden_layers: 6,
        ..ModelConfig::tiny_qwen2(256)
    };
    let (mut model, _vars) = Transformer::random_init(&cfg, 0, &Device::Cpu).unwrap();
    let input = bench_input(4, 256, 256, &Device::Cpu).unwrap();
    let plain = step_peak(&model, &input);
    model.gradient_checkpointing = true;
    let checkpointed = step_peak(&model, &input);
    eprintln!("peak heap: {plain} B plain, {checkpointed} B checkpointed");
    assert!(
        checkpointed * 2 <= plain,
        "checkpointing: peak heap {checkpointed} B vs {plain} B without"
    );
}
