//! Serde defaults shared by the section types.

use std::path::PathBuf;

pub(super) fn one() -> f64 {
    1.0
}
pub(super) fn one_usize() -> usize {
    1
}
pub(super) fn d_eval_size() -> usize {
    200
}
pub(super) fn d_digits() -> u32 {
    2
}
pub(super) fn d_ops() -> Vec<String> {
    vec!["+".into()]
}
pub(super) fn d_num_generations() -> usize {
    8
}
pub(super) fn d_kv_block_size() -> usize {
    composer_model::sampling::DEFAULT_KV_BLOCK_SIZE
}
pub(super) fn d_max_completion_length() -> usize {
    8
}
pub(super) fn d_hint_top_k() -> usize {
    8
}
pub(super) fn d_dpo_beta() -> f64 {
    0.1
}
pub(super) fn d_lr() -> f64 {
    1e-3
}
pub(super) fn d_betas() -> [f64; 2] {
    [0.9, 0.999]
}
pub(super) fn d_eps() -> f64 {
    1e-8
}
pub(super) fn d_schedule() -> String {
    "constant".into()
}
pub(super) fn d_steps() -> usize {
    100
}
pub(super) fn d_prompts() -> usize {
    16
}
pub(super) fn d_eval_every() -> usize {
    10
}
pub(super) fn d_ckpt_every() -> usize {
    50
}
pub(super) fn d_max_nonfinite() -> usize {
    3
}
pub(super) fn d_warm_steps() -> usize {
    200
}
pub(super) fn d_warm_batch() -> usize {
    64
}
pub(super) fn d_warm_lr() -> f64 {
    3e-3
}
pub(super) fn d_run_dir() -> PathBuf {
    PathBuf::from("runs/default")
}
