//! Gradient accumulation in the trainer: with `loss_type = "dapo"` every micro-batch is
//! normalised by the whole optimizer step's active-token count, so splitting the step into
//! micro-batches changes nothing (the loss library proves the identity on tensors; this checks
//! that the trainer feeds it the step's count).

use std::path::Path;

use serde_json::Value;

mod common;
use common::{tiny_model_and_task, train_metrics, train_quietly};

const RECIPE: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 4
max_completion_length = 6

[loss]
loss_type = "LOSS"
hint_weight = 0.0
replay_weight = 0.0

[train]
steps = 3
prompts_per_step = 4
seed = 5
eval_every = 0
checkpoint_every = 0
gradient_accumulation_steps = GA

[warmup]
steps = 2
batch_size = 16
"#
);

fn train_lines(dir: &Path, loss: &str, ga: usize) -> Vec<Value> {
    let recipe = dir.join(format!("{loss}-{ga}.toml"));
    std::fs::write(
        &recipe,
        RECIPE.replace("LOSS", loss).replace("GA", &ga.to_string()),
    )
    .unwrap();
    let run_dir = dir.join(format!("{loss}-{ga}"));
    train_quietly(&recipe, &run_dir).unwrap();
    train_metrics(&run_dir)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-4 * a.abs().max(b.abs()).max(1e-3)
}

#[test]
fn dapo_with_four_micro_batches_equals_one_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let one = train_lines(tmp.path(), "dapo", 1);
    let four = train_lines(tmp.path(), "dapo", 4);
    assert_eq!(one.len(), 3);
    for (a, b) in one.iter().zip(&four) {
        for key in ["grad_norm", "loss/rlvr", "reward/mean"] {
            let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!(
                close(x, y),
                "step {}: {key} {x} (1 batch) vs {y} (4 micro)",
                a["step"]
            );
        }
    }
}

#[test]
fn per_micro_batch_normalisation_differs_for_bnpo() {
    // bnpo divides each micro-batch by its own token count (TRL), so 4 micro-batches are not
    // one batch: this guards the test above against passing vacuously.
    let tmp = tempfile::tempdir().unwrap();
    let one = train_lines(tmp.path(), "bnpo", 1);
    let four = train_lines(tmp.path(), "bnpo", 4);
    let differs = one.iter().zip(&four).any(|(a, b)| {
        !close(
            a["grad_norm"].as_f64().unwrap(),
            b["grad_norm"].as_f64().unwrap(),
        )
    });
    assert!(
        differs,
        "bnpo gave identical gradients with 1 and 4 micro-batches"
    );
}
