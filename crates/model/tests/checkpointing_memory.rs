//! Gradient checkpointing lowers a training step's peak heap: a test binary of its own, with
//! a counting global allocator and a single test, so the counted bytes are this step's.
//! (A memory bound, not a timing: the numbers with their command are in BENCHMARKS.md.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::Device;
use composer_model::bench::{bench_input, train_step};
use composer_model::{ModelConfig, Transformer};

/// The system allocator, counting live bytes and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are updated.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Peak heap (bytes) above the live heap at the start of one training step.
fn step_peak(model: &Transformer, input: &candle_core::Tensor) -> usize {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    train_step(model, input).unwrap();
    PEAK.load(Ordering::Relaxed) - base
}

#[test]
fn checkpointing_at_least_halves_the_step_peak_heap() {
    let mut cfg = ModelConfig::tiny_qwen2(256);
    cfg.hidden_size = 64;
    cfg.intermediate_size = 256;
    cfg.num_hidden_layers = 6;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = 2;
    cfg.head_dim = 16;
    cfg.max_position_embeddings = 256;
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
