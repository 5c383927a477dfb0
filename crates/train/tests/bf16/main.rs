//! `[train] bf16` (TRL's key): the forward and backward of every training pass run on a bf16
//! copy of the f32 master weights; gradients come back to f32, AdamW and its moments stay f32,
//! checkpoints store the f32 masters, and rollouts sample with the bf16 copy. Checks: every
//! trainable parameter (full model, HF fixture, LoRA adapters) gets a nonzero f32 gradient
//! through the bf16 forward; the trainer's bf16 update on a batch is close to its f32 update
//! on the same batch (and not equal to it: the bf16 path ran); the bf16 copy is cast again
//! after every optimizer step and is what async generators get; bf16 runs (every loss
//! channel with an EMA reference; LoRA; async; packed and checkpointed; an HF checkpoint with
//! a `ref_model_path` reference) keep f32 masters in their checkpoints and resume exactly;
//! `fp16 = true` and a non-boolean `bf16` are refused naming the key.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use composer_train::batch::{token_batch, token_stats};
use composer_train::model::{PolicyModel, TinyConfig};
use composer_train::trainer::{
    open_session, reward_batch, rollout_batch, step_advantages, train_on_batch,
};
use composer_train::{run_train, TrainOptions};
use serde_json::Value;

#[path = "../common/mod.rs"]
mod common;
use common::{all_channels_rollout, hf_fixture, tiny_model_and_task, train_metrics};

mod gradients_and_updates;
mod runs_and_resume;

/// (prompt, completion) pairs of different lengths.
const PAIRS: [(&[u32], &[u32]); 3] = [
    (&[3, 9, 4], &[7, 2, 8, 1]),
    (&[5], &[6, 2]),
    (&[1, 2, 3, 4, 5], &[9]),
];

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn l2(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

fn tiny() -> PolicyModel {
    let cfg = TinyConfig {
        hidden_size: 16,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 24,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        init_std: 0.02,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
    }
    .model_config(12, 0)
    .unwrap();
    PolicyModel::random_init(&cfg, 3, &Device::Cpu).unwrap()
}

/// The f32 gradient, by master name, of a loss using the target log-probs, the entropy and
/// the top-3 log-probs (every head output the loss channels read).
fn master_grads(model: &PolicyModel) -> HashMap<String, Tensor> {
    let tb = token_batch(&PAIRS, 0, &Device::Cpu).unwrap();
    let st = token_stats(model, &tb, 0.8, None, 3).unwrap();
    assert_eq!(st.logprobs.dtype(), DType::F32, "log-probs are f32");
    let loss = ((&st.logprobs * &tb.mask).unwrap().sum_all().unwrap()
        + (&st.entropy * 0.3).unwrap().sum_all().unwrap()
        + (st.topk_logprobs.as_ref().unwrap() * 0.1)
            .unwrap()
            .sum_all()
            .unwrap())
    .unwrap();
    model.master_grads(&loss.backward().unwrap()).unwrap()
}

/// Every master is f32 and gets a finite, nonzero f32 gradient (the names in `zero_ok` may be
/// exactly zero: LoRA's A while B is still 0).
fn assert_every_master_gets_a_gradient(
    what: &str,
    model: &PolicyModel,
    zero_ok: &dyn Fn(&str) -> bool,
) {
    assert_eq!(model.compute_dtype(), DType::BF16, "{what}");
    let grads = master_grads(model);
    let weights = model.weights().unwrap();
    assert!(!weights.is_empty());
    for (name, w) in &weights {
        assert_eq!(w.dtype(), DType::F32, "{what}: master {name}");
        let g = grads
            .get(name)
            .unwrap_or_else(|| panic!("{what}: {name} got no gradient"));
        assert_eq!(g.dtype(), DType::F32, "{what}: gradient of {name}");
        assert_eq!(g.dims(), w.dims(), "{what}: gradient of {name}");
        let g = flat(g);
        assert!(g.iter().all(|v| v.is_finite()), "{what}: {name}");
        assert!(
            zero_ok(name) || l2(&g) > 0.0,
            "{what}: {name} got a zero gradient"
        );
    }
}
