//! The training ops of `composer_model::ops` (custom CPU kernels with a backward) against
//! their differentiable candle compositions: forward values and gradients in f64 with tight
//! tolerances, the f32 kernels against the f64 composition, and bad inputs.
//!
//! The model's training forward with the kernels equals it with the compositions (f64,
//! left-padded batch, every parameter's gradient).
//!
//! Gradients are those of the scalar `Σ out·R` for a fixed random `R`, so every output element
//! feeds the check with its own weight.
//!
//! With `COMPOSER_TEST_DEVICE=cuda` (a `--features cuda` build on a GPU, tools/gpu_check.sh)
//! the kernels run on the GPU in f32 and bf16 against the f64 composition on the CPU: the
//! CUDA kernels against their CPU twins' reference. The varlen attention's checks are in
//! `ops_attention.rs`.

#[path = "../common/mod.rs"]
mod common;

mod decode;
mod linear_and_model;
mod norms;
mod rope_softmax_swiglu;
