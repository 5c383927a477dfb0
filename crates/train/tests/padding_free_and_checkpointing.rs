//! `[train] padding_free` (TRL's key): teacher-forcing forwards pack a micro-batch's rows
//! without padding. The trainer's per-token quantities ([`token_stats`]: log-probs, entropy,
//! log-probs at given ids, top-K) and every parameter's gradient equal the padded path's, on
//! the built-in tiny model and an HF fixture; a whole run with all three loss channels
//! (hint's top-K, replay's DPO and teacher KL, μ = 2 old log-probs, a reference model) logs
//! the same metrics with and without it, and with `[train] gradient_checkpointing` (each
//! layer's activations recomputed in the backward). Bad values of both keys are refused
//! naming the key.

use std::path::Path;

use candle_core::{Device, Tensor};
use composer_train::batch::{token_batch, token_stats, TokenStats};
use composer_train::model::{PolicyModel, TinyConfig};
use serde_json::Value;

mod common;
use common::{tiny_model_and_task, train_metrics, train_quietly};

/// (prompt, completion) pairs of different lengths: the padded batch has padding in every
/// row but the longest.
const PAIRS: [(&[u32], &[u32]); 4] = [
    (&[3, 9, 4], &[7, 2, 8, 1]),
    (&[5], &[6, 2]),
    (&[1, 2, 3, 4, 5], &[9]),
    (&[8, 8], &[3, 4, 5, 6, 7, 2]),
];

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(candle_core::DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Token stats (at temperature 0.8, log-probs at two extra ids per slot, top-3) and every
/// trainable variable's gradient of a loss using all of them.
fn stats_and_grads(model: &PolicyModel) -> (TokenStats, Vec<(String, Vec<f64>)>) {
    let dev = Device::Cpu;
    let tb = token_batch(&PAIRS, 0, &dev).unwrap();
    let (b, l) = tb.input.dims2().unwrap();
    let extra: Vec<u32> = (0..b * l * 2).map(|i| (i % 7) as u32 + 1).collect();
    let extra = Tensor::from_vec(extra, (b, l, 2), &dev).unwrap();
    let st = token_stats(model, &tb, 0.8, Some(&extra), 3).unwrap();
    let loss = ((&st.logprobs * &tb.mask).unwrap().sum_all().unwrap()
        + (&st.entropy * 0.3).unwrap().sum_all().unwrap()
        + (st.at_ids.as_ref().unwrap() * -0.2)
            .unwrap()
            .sum_all()
            .unwrap()
        + (st.topk_logprobs.as_ref().unwrap() * 0.1)
            .unwrap()
            .sum_all()
            .unwrap())
    .unwrap();
    let grads = loss.backward().unwrap();
    let grads = model
        .weights()
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            let g = grads
                .get(&t)
                .unwrap_or_else(|| panic!("{name} got no gradient"));
            (name, flat(g))
        })
        .collect();
    (st, grads)
}

fn assert_packed_equals_padded(what: &str, model: &mut PolicyModel) {
    model.padding_free = false;
    let (a, ga) = stats_and_grads(model);
    model.padding_free = true;
    let (b, gb) = stats_and_grads(model);
    let tol = 2e-5;
    for (name, x, y) in [
        ("logprobs", &a.logprobs, &b.logprobs),
        ("entropy", &a.entropy, &b.entropy),
        (
            "at_ids",
            a.at_ids.as_ref().unwrap(),
            b.at_ids.as_ref().unwrap(),
        ),
        (
            "topk_logprobs",
            a.topk_logprobs.as_ref().unwrap(),
            b.topk_logprobs.as_ref().unwrap(),
        ),
    ] {
        assert_eq!(x.dims(), y.dims(), "{what}: {name} shapes");
        let d = max_abs_diff(&flat(x), &flat(y));
        assert!(d <= tol, "{what}: {name} differ by {d:e}");
    }
    assert_eq!(
        flat(a.topk_ids.as_ref().unwrap()),
        flat(b.topk_ids.as_ref().unwrap()),
        "{what}: top-K ids"
    );
    assert!(!ga.is_empty());
    for ((name, x), (_, y)) in ga.iter().zip(&gb) {
        let scale = x.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let d = max_abs_diff(x, y) / scale;
        assert!(d <= tol, "{what}: gradient of {name} differs by {d:e}");
    }
}

#[test]
fn packed_token_stats_and_gradients_equal_the_padded_ones() {
    let tiny = TinyConfig {
        hidden_size: 16,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 24,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        init_std: 0.3,
        max_position_embeddings: 64,
        tie_word_embeddings: true,
    };
    let cfg = tiny.model_config(12, 0).unwrap();
    let mut model = PolicyModel::random_init(&cfg, 3, &Device::Cpu).unwrap();
    assert_packed_equals_padded("built-in tiny", &mut model);

    let mut model = PolicyModel::load_hf(&common::hf_fixture("qwen3-tiny"), &Device::Cpu).unwrap();
    assert_packed_equals_padded("qwen3-tiny", &mut model);
}

const RECIPE: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 4
max_completion_length = 3

[loss]
hint_weight = 1.0
replay_weight = 1.0
beta = 0.05

[loss.hint.template]
reprompt = "{solution}{prompt}"
solution = "[{successful_previous_attempt}]"
feedback = ""

[train]
steps = 3
prompts_per_step = 4
seed = 11
eval_every = 0
checkpoint_every = 0
num_iterations = 2
KEYS

[warmup]
steps = 3
batch_size = 8
hint_fraction = 0.3

[replay]
traces = ["builtin:scripted"]
"#
);

/// The metrics of a run of [`RECIPE`] with the `[train]` lines `keys`.
fn run(dir: &Path, name: &str, keys: &str) -> Vec<Value> {
    let recipe = dir.join(format!("{name}.toml"));
    std::fs::write(&recipe, RECIPE.replace("KEYS", keys)).unwrap();
    let run_dir = dir.join(name);
    train_quietly(&recipe, &run_dir).unwrap();
    train_metrics(&run_dir)
}

#[test]
fn padding_free_and_checkpointed_runs_log_the_padded_runs_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let padded = run(tmp.path(), "padded", "");
    assert_eq!(padded.len(), 3);
    for (name, keys) in [
        ("padding_free", "padding_free = true"),
        ("gradient_checkpointing", "gradient_checkpointing = true"),
        ("both", "padding_free = true\ngradient_checkpointing = true"),
    ] {
        let other = run(tmp.path(), name, keys);
        assert_eq!(other.len(), 3, "{name}");
        assert_same_metrics(&padded, &other, name);
    }
}

fn assert_same_metrics(padded: &[Value], other: &[Value], what: &str) {
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * a.abs().max(b.abs()).max(1e-3);
    let mut checked = 0;
    for (a, b) in padded.iter().zip(other) {
        for key in [
            "grad_norm",
            "loss/rlvr",
            "loss/hint",
            "loss/replay",
            "kl",
            "entropy",
            "reward/mean",
        ] {
            let (Some(x), Some(y)) = (a[key].as_f64(), b[key].as_f64()) else {
                panic!("step {}: metric {key} missing: {a} / {b}", a["step"]);
            };
            assert!(
                close(x, y),
                "step {}: {key} {x} (padded) vs {y} ({what})",
                a["step"]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 21, "{what}");
}

fn refusal(text: &str) -> String {
    match composer_train::recipe::parse_recipe(text, Path::new("bad.toml")) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => format!("{e:#}"),
    }
}

/// The tiny recipe on `[model] device`, with `[train]` line `line`.
fn on_device(device: &str, line: &str) -> String {
    let model = format!("[model]\ndevice = \"{device}\"\n\n[model.builtin_tiny]");
    format!(
        "{}\n[train]\n{line}\n",
        tiny_model_and_task!().replace("[model.builtin_tiny]", &model)
    )
}

#[test]
fn bad_values_are_refused_naming_the_key() {
    for key in ["padding_free", "gradient_checkpointing"] {
        let err = refusal(&on_device("cpu", &format!("{key} = \"yes\"")));
        assert!(err.contains(key), "{err}");
    }
    let ok = |text: &str| composer_train::recipe::parse_recipe(text, Path::new("ok.toml")).unwrap();
    ok(&on_device("cpu", "gradient_checkpointing = true"));
    // The checkpointed layer's op has a CUDA forward too (tools/gpu_check.sh runs it there).
    ok(&on_device("cuda:0", "gradient_checkpointing = true"));
    // padding_free runs on every device (on CUDA the varlen attention kernel; elsewhere off the
    // CPU, packed attention segment by segment).
    ok(&on_device("cuda:0", "padding_free = true"));
}
