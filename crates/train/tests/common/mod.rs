//! Shared by the trainer's integration tests.
#![allow(dead_code, unused_macros)]

/// The smallest useful policy (a 1-layer built-in model) and the 1-digit arithmetic task, as
/// recipe text; each test appends its own `[rollout]`, `[loss]`, `[train]`... sections with
/// `concat!(tiny_model_and_task!(), r#"..."#)`.
macro_rules! tiny_model_and_task {
    () => {
        r#"
[model.builtin_tiny]
hidden_size = 16
layers = 1
heads = 2
kv_heads = 1
intermediate_size = 32

[data]
task = "arithmetic"
eval_size = 10

[data.arithmetic]
digits = 1
"#
    };
}
pub(crate) use tiny_model_and_task;
