//! `composer-rl score --ids` and `--batch`: exact ids score as transformers does, a sampler's
//! completions score to its own log-probs on the very ids it sampled, and bad ids / files fail
//! naming the culprit.

use super::{f64s, fixture, reference, run_err, run_json};

#[test]
fn score_ids_matches_transformers_and_the_text_path() {
    for name in ["llama-tiny", "qwen2-tiny", "qwen3-tiny"] {
        let dir = fixture(name);
        let dir = dir.to_str().unwrap();
        let reference = reference(name);
        let case = &reference["cases"][0];
        let ids: Vec<String> = case["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.to_string())
            .collect();
        let by_ids = run_json(&["score", "--model", dir, "--ids", &ids.join(","), "--json"]);
        let by_text = run_json(&[
            "score",
            "--model",
            dir,
            "--text",
            case["text"].as_str().unwrap(),
            "--json",
        ]);
        assert_eq!(by_ids, by_text, "{name}: --ids and --text on the same ids");
        let ours = f64s(&by_ids["next_token_logprobs"]);
        let theirs = f64s(&case["next_token_logprobs"]);
        assert_eq!(ours.len(), theirs.len());
        for (t, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!((a - b).abs() <= 1e-4, "{name} position {t}: {a} vs {b}");
        }
    }
}

/// `generate`'s samples scored by `score --batch` on their own ids: equal to rounding, and
/// with `--deterministic` on both sides bit for bit (the scorer batching all rows together,
/// the sampler its three samples).
#[test]
fn batch_scores_a_samplers_own_ids_to_its_logprobs() {
    for deterministic in [false, true] {
        scores_a_samplers_own_ids(deterministic);
    }
}

fn scores_a_samplers_own_ids(deterministic: bool) {
    let det: &[&str] = if deterministic {
        &["--deterministic"]
    } else {
        &[]
    };
    let dir = fixture("qwen2-tiny");
    let dir = dir.to_str().unwrap();
    let prompt = "def add(a, b):";
    let prompt_ids =
        run_json(&["score", "--model", dir, "--text", prompt, "--json"])["input_ids"].clone();
    let generated = run_json(
        &[
            &[
                "generate",
                "--model",
                dir,
                "--prompt",
                prompt,
                "--num-samples",
                "3",
                "--seed",
                "5",
                "--temperature",
                "0.7",
                "--max-new-tokens",
                "24",
                "--json",
            ],
            det,
        ]
        .concat(),
    );
    let samples = generated["samples"].as_array().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let batch = tmp.path().join("rows.jsonl");
    let lines: Vec<String> = samples
        .iter()
        .map(|s| {
            serde_json::json!({"prompt_ids": prompt_ids, "completion_ids": s["completion_ids"]})
                .to_string()
        })
        .collect();
    // A blank line between rows is allowed.
    std::fs::write(&batch, lines.join("\n\n") + "\n").unwrap();
    let scored = run_json(
        &[
            &[
                "score",
                "--model",
                dir,
                "--batch",
                batch.to_str().unwrap(),
                "--temperature",
                "0.7",
            ],
            det,
        ]
        .concat(),
    );
    let rows = scored["rows"].as_array().unwrap();
    assert_eq!(rows.len(), samples.len());
    let n_prompt = prompt_ids.as_array().unwrap().len() as u64;
    for (i, (row, s)) in rows.iter().zip(samples).enumerate() {
        assert_eq!(row["prompt_len"].as_u64(), Some(n_prompt));
        let scorer = f64s(&row["completion_logprobs"]);
        let sampler = f64s(&s["logprobs"]);
        assert_eq!(scorer.len(), sampler.len(), "sample {i}");
        assert!(!scorer.is_empty());
        for (t, (a, b)) in scorer.iter().zip(&sampler).enumerate() {
            // f32, KV-cached decode vs one forward: equal to rounding; bitwise in
            // deterministic mode.
            let tol = if deterministic { 0.0 } else { 1e-4 };
            assert!(
                (a - b).abs() <= tol,
                "deterministic {deterministic}, sample {i} token {t}: scorer {a} vs sampler {b}"
            );
        }
    }
}

#[test]
fn bad_ids_and_batch_files_fail_naming_the_culprit() {
    let dir = fixture("qwen2-tiny");
    let dir = dir.to_str().unwrap();
    // vocab_size of the fixtures is 384.
    let e = run_err(&["score", "--model", dir, "--ids", "1,2,384"]);
    assert!(
        e.contains("--ids") && e.contains("384") && e.contains("position 2") && e.contains("vocab"),
        "{e}"
    );
    let e = run_err(&["score", "--model", dir, "--ids", ""]);
    assert!(e.contains("--ids is empty"), "{e}");
    let e = run_err(&["score", "--model", dir, "--ids", "1,two"]);
    assert!(e.contains("`two`"), "{e}");
    // Exactly one input.
    let e = run_err(&["score", "--model", dir, "--ids", "1,2", "--text", "hi"]);
    assert!(e.contains("cannot be used with"), "{e}");

    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &str); 5] = [
        (
            "{\"prompt_ids\":[1,2],\"completion_ids\":[3]}\nnot json\n",
            "line 2: not JSON",
        ),
        ("{\"prompt_ids\":[1]}\n", "line 1: missing `completion_ids`"),
        (
            "{\"prompt_ids\":[],\"completion_ids\":[3]}\n",
            "line 1: `prompt_ids` is empty",
        ),
        (
            "{\"prompt_ids\":[1,-4],\"completion_ids\":[]}\n",
            "`prompt_ids`[1] = -4",
        ),
        ("\n\n", "has no rows"),
    ];
    for (i, (body, want)) in cases.iter().enumerate() {
        let f = tmp.path().join(format!("bad{i}.jsonl"));
        std::fs::write(&f, body).unwrap();
        let e = run_err(&["score", "--model", dir, "--batch", f.to_str().unwrap()]);
        assert!(
            e.contains(want) && e.contains(&format!("bad{i}.jsonl")),
            "case {i}: {e}"
        );
    }
    let f = tmp.path().join("vocab.jsonl");
    // The bad row on line 3 (after a blank line): named by its line, as parse errors are.
    std::fs::write(&f, "{\"prompt_ids\":[1],\"completion_ids\":[2]}\n\n{\"prompt_ids\":[1],\"completion_ids\":[999]}\n").unwrap();
    let e = run_err(&["score", "--model", dir, "--batch", f.to_str().unwrap()]);
    assert!(
        e.contains("line 3") && e.contains("999") && e.contains("vocab"),
        "{e}"
    );
    let e = run_err(&[
        "score",
        "--model",
        dir,
        "--batch",
        "/nonexistent/rows.jsonl",
    ]);
    assert!(e.contains("/nonexistent/rows.jsonl"), "{e}");
}

/// A temperature the scored distribution cannot have (0, inf, NaN, 1e-40: logits / t
/// overflows to null log-probs) is refused naming the flag.
#[test]
fn score_refuses_temperatures_outside_its_range() {
    let dir = fixture("qwen2-tiny");
    let dir = dir.to_str().unwrap();
    for t in ["0", "inf", "nan", "1e-40", "1e9"] {
        let e = run_err(&["score", "--model", dir, "--text", "hi", "--temperature", t]);
        assert!(e.contains("--temperature"), "{t}: {e}");
    }
}
