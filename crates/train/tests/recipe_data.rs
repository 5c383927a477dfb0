//! Recipe parsing, unknown-key suggestions, error messages naming key and file; dataset errors
//! naming the line; verifiers.

use std::path::Path;

use composer_train::data::{load_prompts, load_sft, render_chatml};
use composer_train::recipe::{parse_recipe, EMBEDDED_DEFAULT_RECIPE, EXAMPLE_RECIPE};
use composer_train::verifiers::{extract_number, RewardFn, Verifier};

/// The default recipe with the first line starting with `prefix` replaced by `line`.
fn with_line(prefix: &str, line: &str) -> String {
    let mut done = false;
    EMBEDDED_DEFAULT_RECIPE
        .lines()
        .map(|l| {
            if !done && l.starts_with(prefix) {
                done = true;
                line.to_string()
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn example_and_default_recipes_parse() {
    let r = parse_recipe(EXAMPLE_RECIPE, Path::new("example.toml")).unwrap();
    assert!(r.model.builtin_tiny.is_some());
    let d = composer_train::embedded_default_recipe();
    assert!(
        d.loss.hint_weight > 0.0 && d.loss.replay_weight > 0.0,
        "all three channels on"
    );
    assert!(d.warmup.is_some() && d.replay.is_some());
    parse_recipe(EMBEDDED_DEFAULT_RECIPE, Path::new("d.toml")).unwrap();
}

#[test]
fn unknown_key_is_rejected_with_suggestion_and_file() {
    let text = with_line("prompts_per_step", "prompts_per_stp = 16");
    let e = format!(
        "{:#}",
        parse_recipe(&text, Path::new("my-recipe.toml")).unwrap_err()
    );
    assert!(e.contains("my-recipe.toml"), "{e}");
    assert!(e.contains("[train] prompts_per_stp"), "{e}");
    assert!(e.contains("did you mean `prompts_per_step`"), "{e}");
}

#[test]
fn unknown_loss_key_names_section_line_and_suggestion() {
    let text = with_line("epsilon_high", "epsilon_hgh = 0.28");
    let e = format!(
        "{:#}",
        parse_recipe(&text, Path::new("r.toml")).unwrap_err()
    );
    assert!(
        e.contains("r.toml") && e.contains("[loss] epsilon_hgh"),
        "{e}"
    );
    assert!(e.contains("did you mean `epsilon_high`"), "{e}");
    assert!(e.contains("line "), "{e}");
    let text = with_line("top_k", "top_kk = 8");
    let e = format!(
        "{:#}",
        parse_recipe(&text, Path::new("r.toml")).unwrap_err()
    );
    assert!(
        e.contains("[loss.hint] top_kk") && e.contains("`top_k`"),
        "{e}"
    );
}

#[test]
fn bad_values_name_the_key() {
    let text = with_line("loss_type", "loss_type = \"ppo2\"");
    let e = format!(
        "{:#}",
        parse_recipe(&text, Path::new("r.toml")).unwrap_err()
    );
    assert!(e.contains("loss_type") && e.contains("r.toml"), "{e}");
    let text = with_line("lr = 5", "lr = \"fast\"");
    let e = format!(
        "{:#}",
        parse_recipe(&text, Path::new("r.toml")).unwrap_err()
    );
    assert!(e.contains("[optimizer] lr") && e.contains("r.toml"), "{e}");
    let text = with_line("task", "task = \"chess\"");
    let e = format!(
        "{:#}",
        parse_recipe(&text, Path::new("r.toml")).unwrap_err()
    );
    assert!(e.contains("[data] task") && e.contains("chess"), "{e}");
}

#[test]
fn dataset_errors_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.jsonl");
    std::fs::write(
        &p,
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"2+2=\"}\n",
    )
    .unwrap();
    let e = format!("{:#}", load_prompts(&p, &render_chatml).unwrap_err());
    assert!(e.contains("d.jsonl line 2") && e.contains("answer"), "{e}");
    std::fs::write(&p, "{\"prompt\": \"1+1=\", \"answer\": 2}\nnot json\n").unwrap();
    let e = format!("{:#}", load_prompts(&p, &render_chatml).unwrap_err());
    assert!(e.contains("d.jsonl line 2"), "{e}");
    std::fs::write(
        &p,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"answer\": 3}\n",
    )
    .unwrap();
    let rows = load_prompts(&p, &render_chatml).unwrap();
    assert_eq!(
        rows[0].prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(rows[0].answer, "3");
    std::fs::write(
        &p,
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"}\n",
    )
    .unwrap();
    let e = format!("{:#}", load_sft(&p, &render_chatml).unwrap_err());
    assert!(
        e.contains("d.jsonl line 2") && e.contains("completion"),
        "{e}"
    );
}

#[test]
fn verifiers_score_as_documented() {
    assert_eq!(Verifier::Exact.score(" 95 ", "95"), 1.0);
    assert_eq!(Verifier::Exact.score("95.", "95"), 0.0);
    assert_eq!(
        Verifier::Numeric.score("so the answer is 1,234", "1234"),
        1.0
    );
    assert_eq!(Verifier::Numeric.score("\\boxed{42} not 7", "42"), 1.0);
    assert_eq!(Verifier::Numeric.score("41 then 42", "42"), 1.0);
    assert_eq!(Verifier::Numeric.score("no number", "42"), 0.0);
    assert_eq!(extract_number("x = -3.5"), Some(-3.5));
    assert_eq!(
        Verifier::Regex("^A: {answer}$".into()).score("A: 1+1", "1+1"),
        1.0
    );
    let specs = vec![
        composer_train::recipe::VerifierSpec {
            kind: "numeric".into(),
            weight: 1.0,
            pattern: None,
        },
        composer_train::recipe::VerifierSpec {
            kind: "regex".into(),
            weight: 0.5,
            pattern: Some("^\\d+$".into()),
        },
    ];
    let f = RewardFn::from_specs(&specs).unwrap();
    assert_eq!(f.score("12", "12"), (1.5, vec![1.0, 1.0]));
    assert_eq!(f.score("x 12", "12"), (1.0, vec![1.0, 0.0]));
    assert_eq!(f.max_reward(), 1.5);
}

#[test]
fn an_unknown_device_is_an_error_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("r.toml");
    let text = composer_train::recipe::EMBEDDED_DEFAULT_RECIPE.replace(
        "[model.builtin_tiny]",
        "[model]\ndevice = \"tpu\"\n\n[model.builtin_tiny]",
    );
    std::fs::write(&recipe, text).unwrap();
    let Err(err) = composer_train::run_train(&composer_train::TrainOptions {
        recipe_path: Some(recipe),
        quiet: true,
        run_dir_override: Some(dir.path().join("run")),
        ..Default::default()
    }) else {
        panic!("a bad device must fail");
    };
    let msg = format!("{err:#}");
    assert!(
        msg.contains("[model] device") && msg.contains("tpu"),
        "{msg}"
    );
}
