//! One engine: HF checkpoints train through composer-model's decoder and KV-cached sampler
//! with their own chat template and EOS ids; checkpoints keep the loaded tokenizer side
//! byte-identical; the reference policy, DAPO dynamic sampling and the per-step sample
//! records.

use std::path::{Path, PathBuf};

use composer_train::trainer::open_session;
use composer_train::{run_train, TrainOptions};
use serde_json::Value;

#[path = "../common/mod.rs"]
mod common;
use common::hf_fixture as fixture;
use common::{tiny_model_and_task, train_metrics};

mod record_traces;
mod reference_and_sampling;
mod rollout_signals;

fn reference(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

fn opts(recipe: &Path, run_dir: &Path) -> TrainOptions {
    TrainOptions {
        recipe_path: Some(recipe.to_path_buf()),
        quiet: true,
        run_dir_override: Some(run_dir.to_path_buf()),
        ..Default::default()
    }
}

/// A one-step recipe on an HF checkpoint with a `messages` dataset.
fn hf_recipe(dir: &Path, model: &Path) -> PathBuf {
    let ex = &reference("qwen2-tiny")["chat_template_example"];
    let row = serde_json::json!({"messages": ex["messages"], "answer": "4"});
    let data = dir.join("data.jsonl");
    std::fs::write(&data, format!("{row}\n{row}\n")).unwrap();
    let recipe = dir.join("recipe.toml");
    std::fs::write(
        &recipe,
        format!(
            r#"
[model]
path = {model:?}

[data]
dataset = {data:?}
eval_dataset = {data:?}

[rollout]
num_generations = 2
max_completion_length = 4

[train]
steps = 1
prompts_per_step = 1
eval_every = 0
checkpoint_every = 1
"#
        ),
    )
    .unwrap();
    recipe
}

#[test]
fn messages_rows_use_the_checkpoints_chat_template() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    let recipe = hf_recipe(tmp.path(), &model);
    let s = open_session(&opts(&recipe, &tmp.path().join("run"))).unwrap();
    let rendered = reference("qwen2-tiny")["chat_template_example"]["rendered"]
        .as_str()
        .unwrap()
        .to_string();
    let tok = composer_model::Tokenizer::from_dir(&model).unwrap();
    let want = tok.encode(&rendered).unwrap();
    assert_eq!(s.train_rows[0].prompt, rendered);
    assert_eq!(s.encode(&s.train_rows[0].prompt).unwrap(), want);
    // The chat markers are single special tokens, not characters.
    assert!(want.len() < rendered.len() / 2, "{want:?}");
}

#[test]
fn every_eos_id_of_generation_config_stops_a_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for e in std::fs::read_dir(fixture("qwen2-tiny")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
    }
    let gen = model.join("generation_config.json");
    let mut g: Value = serde_json::from_str(&std::fs::read_to_string(&gen).unwrap()).unwrap();
    g["eos_token_id"] = serde_json::json!([2, 7]);
    std::fs::write(&gen, g.to_string()).unwrap();
    let recipe = hf_recipe(tmp.path(), &model);
    let s = open_session(&opts(&recipe, &tmp.path().join("run"))).unwrap();
    assert!(
        s.stop_ids.contains(&2) && s.stop_ids.contains(&7),
        "{:?}",
        s.stop_ids
    );
}

#[test]
fn hf_checkpoint_keeps_the_loaded_files_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    let recipe = hf_recipe(tmp.path(), &model);
    let run = tmp.path().join("run");
    let out = run_train(&opts(&recipe, &run)).unwrap();
    assert_eq!(out.steps_completed, 1);
    let ck = run.join("checkpoint");
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        assert_eq!(
            std::fs::read(model.join(name)).unwrap(),
            std::fs::read(ck.join(name)).unwrap(),
            "{name} differs from the loaded checkpoint's"
        );
    }
    assert!(!ck.join("reference.safetensors").exists());
    // config.json: only the dtype may change.
    let mut src: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let dst: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    src["dtype"] = serde_json::json!("float32");
    assert_eq!(src, dst);
    // The saved checkpoint loads back through composer-model.
    composer_model::Policy::load(&ck, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    // The step's samples were recorded for audit.
    let samples = std::fs::read_to_string(run.join("samples/step_000001.jsonl")).unwrap();
    let lines: Vec<Value> = samples
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert_eq!(
            l["completion_ids"].as_array().unwrap().len(),
            l["sampler_logprobs"].as_array().unwrap().len()
        );
        assert_eq!(l["policy_version"], 0);
        assert!(l["reward"].is_number());
    }
}

/// The tiny model with all three channels on, plus `extra_loss` keys of `[loss]` and a
/// `[train]` section.
fn small_recipe(dir: &Path, extra_loss: &str, train: &str) -> PathBuf {
    // All three channels on (as `all_channels_rollout!`), plus `extra_loss` keys of `[loss]`.
    let text = format!(
        r#"{}
[rollout]
num_generations = 4
max_completion_length = 3

[loss]
hint_weight = 1.0
replay_weight = 1.0
{extra_loss}
[loss.hint.template]
reprompt = "{{solution}}{{prompt}}"
solution = "[{{successful_previous_attempt}}]"
feedback = ""

{train}
[warmup]
steps = 20
batch_size = 16
hint_fraction = 0.3

[replay]
traces = ["builtin:scripted"]
"#,
        tiny_model_and_task!(),
    );
    let p = dir.join("recipe.toml");
    std::fs::write(&p, text).unwrap();
    p
}
