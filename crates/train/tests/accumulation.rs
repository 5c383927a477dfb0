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
TOKEN_BUDGET

[warmup]
steps = 2
batch_size = 16
"#
);

fn train_lines(dir: &Path, loss: &str, ga: usize) -> Vec<Value> {
    train_lines_budget(dir, loss, ga, None)
}

/// As [`train_lines`] with `[train] max_tokens_per_microbatch` set to `budget`.
fn train_lines_budget(dir: &Path, loss: &str, ga: usize, budget: Option<usize>) -> Vec<Value> {
    let tag = budget.map_or(String::new(), |b| format!("-t{b}"));
    let recipe = dir.join(format!("{loss}-{ga}{tag}.toml"));
    let budget_line = budget.map_or(String::new(), |b| {
        format!("max_tokens_per_microbatch = {b}")
    });
    std::fs::write(
        &recipe,
        RECIPE
            .replace("LOSS", loss)
            .replace("GA", &ga.to_string())
            .replace("TOKEN_BUDGET", &budget_line),
    )
    .unwrap();
    let run_dir = dir.join(format!("{loss}-{ga}{tag}"));
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

#[test]
fn dapo_with_a_token_budget_equals_one_batch() {
    // A 24-token budget splits the step's 16 rows into many small micro-batches, not aligned
    // with the prompt groups.
    let tmp = tempfile::tempdir().unwrap();
    let one = train_lines(tmp.path(), "dapo", 1);
    let budget = train_lines_budget(tmp.path(), "dapo", 1, Some(24));
    assert_eq!(one.len(), 3);
    for (a, b) in one.iter().zip(&budget) {
        for key in ["grad_norm", "loss/rlvr", "reward/mean"] {
            let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!(
                close(x, y),
                "step {}: {key} {x} (1 batch) vs {y} (token budget 24)",
                a["step"]
            );
        }
    }
    // The bnpo counterpart differs, so the budget really split the batch.
    let one = train_lines(tmp.path(), "bnpo", 1);
    let split = train_lines_budget(tmp.path(), "bnpo", 1, Some(24));
    assert!(
        one.iter().zip(&split).any(|(a, b)| !close(
            a["grad_norm"].as_f64().unwrap(),
            b["grad_norm"].as_f64().unwrap()
        )),
        "bnpo gave identical gradients with and without the token budget"
    );
}

#[test]
fn token_budget_splits_in_order_and_counts_padding() {
    use composer_train::update::split_by_tokens;
    let lens = [3usize, 3, 5, 2, 9, 1];
    let len = |i: usize| lens[i];
    let all: Vec<usize> = (0..lens.len()).collect();
    // 2 rows × 5 = 10 fits; adding a row to a micro-batch whose longest row is 5 (3 × 5 = 15)
    // would not.
    assert_eq!(
        split_by_tokens(&all, &len, 10, true),
        vec![vec![0, 1], vec![2, 3], vec![4], vec![5]]
    );
    assert_eq!(split_by_tokens(&all, &len, 1000, true), vec![all.clone()]);
    // A row longer than the budget trains alone; nothing is dropped.
    assert_eq!(split_by_tokens(&[4], &len, 3, true), vec![vec![4]]);
    // padding_free counts real tokens: rows 0-2 hold 3 + 3 + 5 = 11 (padded: 3 × 5 = 15).
    assert_eq!(
        split_by_tokens(&all, &len, 11, false),
        vec![vec![0, 1, 2], vec![3, 4], vec![5]]
    );
    assert_eq!(
        split_by_tokens(&all, &len, 11, true),
        vec![vec![0, 1], vec![2, 3], vec![4], vec![5]]
    );
    assert_eq!(split_by_tokens(&[4], &len, 3, false), vec![vec![4]]);
}
