//! `messages` rows on a checkpoint whose chat template is not ChatML: a copy of the qwen2-tiny
//! fixture given Qwen2.5's template (which, unlike ChatML, inserts a default system prompt).
//! The prompt ids the trainer uses equal transformers' `apply_chat_template(messages,
//! add_generation_prompt=True)` ids (fixture from tools/ref_chat_template_ids.py).

use std::path::Path;

use composer_train::trainer::open_session;
use composer_train::TrainOptions;
use serde_json::Value;

mod common;
use common::hf_fixture;

#[test]
fn messages_prompt_ids_equal_transformers_on_a_qwen25_template() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(manifest.join("tests/fixtures/qwen2_5_prompt_ids.json")).unwrap(),
    )
    .unwrap();
    let cases = reference["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);

    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for e in std::fs::read_dir(hf_fixture("qwen2-tiny")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
    }
    std::fs::copy(
        manifest.join("../model/tests/fixtures/qwen2_5_tools.jinja"),
        model.join("chat_template.jinja"),
    )
    .unwrap();

    let data = tmp.path().join("data.jsonl");
    let rows: String = cases
        .iter()
        .map(|c| {
            format!(
                "{}\n",
                serde_json::json!({"messages": c["messages"], "answer": "4"})
            )
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let recipe = tmp.path().join("recipe.toml");
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
"#
        ),
    )
    .unwrap();
    let s = open_session(&TrainOptions {
        recipe_path: Some(recipe),
        quiet: true,
        run_dir_override: Some(tmp.path().join("run")),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(s.train_rows.len(), cases.len());
    for (row, case) in s.train_rows.iter().zip(cases) {
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(
            s.encode(&row.prompt).unwrap(),
            want,
            "case {}",
            case["name"]
        );
    }
    // Not ChatML: the template's default system prompt is in the rendered prompt.
    assert!(
        s.train_rows[0].prompt.contains("You are Qwen"),
        "{}",
        s.train_rows[0].prompt
    );
}
