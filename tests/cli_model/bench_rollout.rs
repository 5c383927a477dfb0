//! `bench rollout`: every token decoded, deterministic mode equal to the scorer, the GRPO-shaped
//! workload's schedules, bad flags.

use super::*;

/// `bench rollout` (composer-rl's side; the transformers side needs torch) on each fixture:
/// every sample decodes to `--new-tokens`, and deterministic mode's sampler log-probs equal
/// its scorer's bitwise. Bad flags are refused naming them, before the model loads.
#[test]
fn bench_rollout_decodes_every_token_and_deterministic_mode_matches_the_scorer() {
    for name in FIXTURES {
        let model = fixture(name);
        let v = run_json(&[
            "bench",
            "rollout",
            "--model",
            model.to_str().unwrap(),
            "--batch",
            "3",
            "--new-tokens",
            "6",
            "--repeats",
            "1",
            "--skip-reference",
            "--json",
        ]);
        let ours = &v["composer_rl"];
        assert!(ours["tokens_per_s"].as_f64().unwrap() > 0.0, "{name}: {v}");
        let det = ours["deterministic_runs_tokens_per_s"].as_array().unwrap();
        assert_eq!(det.len(), 1, "{name}: {v}");
        assert!(
            ours["deterministic_tokens_per_s"].as_f64().unwrap() > 0.0,
            "{name}: {v}"
        );
        assert_eq!(ours["deterministic_tokens"], 12, "{name}: {v}");
        assert_eq!(ours["deterministic_max_abs_diff"], 0.0, "{name}: {v}");
        assert!(v["transformers"].is_null(), "{v}");
    }
    let model = fixture("qwen2-tiny");
    // Random weights of a named shape in bf16 (what the GPU run measures, on the CPU's
    // kernels): still bitwise, and the report says what it ran.
    let shaped = [
        "bench",
        "rollout",
        "--shape",
        "small",
        "--model",
        model.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--batch",
        "2",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
        "--json",
    ];
    let v = run_json(&[&shaped[..], &["--skip-reference"]].concat());
    let ours = &v["composer_rl"];
    assert_eq!(ours["dtype"], "bf16", "{v}");
    assert_eq!(ours["deterministic_tokens"], 8, "{v}");
    assert_eq!(ours["deterministic_max_abs_diff"], 0.0, "{v}");
    // transformers' side cannot run the random shape: refused before anything loads.
    let out = composer_rl(&shaped);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--skip-reference") && err.contains("--shape small"),
        "{err}"
    );
    let out = composer_rl(&[
        "bench",
        "rollout",
        "--shape",
        "small",
        "--model",
        "/nonexistent-model",
        "--skip-reference",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("tokenizer.json") && err.contains("--model"),
        "{err}"
    );
    let out = composer_rl(&[
        "bench",
        "rollout",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "0",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--batch"), "{err}");
    let out = composer_rl(&["bench", "rollout", "--model", "/nonexistent-model"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--model /nonexistent-model"),
        "{err}"
    );
    let out = composer_rl(&[
        "bench",
        "rollout",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "1",
        "--new-tokens",
        "2",
        "--repeats",
        "1",
        "--python",
        "/nonexistent-python",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("/nonexistent-python") && err.contains("--python"),
        "{err}"
    );
}

/// `bench rollout --workload grpo` on a fixture: four schedules of the same requests, each
/// sampling every sample, prefilling each prompt once for its group (prefix sharing); bad
/// workload flags
/// are refused naming them before any decoding.
#[test]
fn bench_rollout_grpo_workload_runs_every_schedule_and_refuses_bad_flags() {
    let model = fixture("qwen2-tiny");
    let model = model.to_str().unwrap();
    // The base flags, each overridden by the same flag in `extra`.
    fn grpo_args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let base = [
            ("--workload", "grpo"),
            ("--model", model),
            ("--prompts", "3"),
            ("--group", "2"),
            ("--new-tokens", "12"),
            ("--prompt-len", "4..20"),
            ("--max-running", "2"),
            ("--mean-completion", "8"),
            ("--repeats", "1"),
        ];
        let mut args = vec!["bench", "rollout"];
        for (flag, value) in base {
            if !extra.contains(&flag) {
                args.extend([flag, value]);
            }
        }
        args.extend_from_slice(extra);
        args
    }
    let v = run_json(&grpo_args(model, &["--json"]));
    let arms = v["arms"].as_array().unwrap();
    assert_eq!(arms.len(), 4, "{v}");
    // Prompts of 4, 12 and 20 tokens, each prefilled once for its 2 samples.
    assert_eq!(v["prefill_tokens_unshared"], 72, "{v}");
    for arm in arms {
        assert_eq!(arm["prefill_tokens"], 36, "{arm}");
        let tokens = arm["tokens"].as_u64().unwrap();
        assert!((6..=72).contains(&tokens), "{arm}");
        assert!(arm["tokens_per_s"].as_f64().unwrap() > 0.0, "{arm}");
        assert!(
            arm["peak_kv_slots"].as_u64().unwrap()
                <= arm["peak_kv_slots_unshared"].as_u64().unwrap(),
            "{arm}"
        );
    }
    // All six at once: one batch, one decode step per token of the longest completion after
    // its first; the static arm runs its three batches one after another.
    assert!(arms[3]["decode_forwards"].as_u64().unwrap() < 12, "{v}");
    assert!(arms[0]["decode_forwards"].as_u64().unwrap() < 3 * 12, "{v}");
    for (extra, want) in [
        (vec!["--max-running", "3"], "--max-running 3"),
        (vec!["--prompt-len", "250"], "max_position_embeddings"),
        (vec!["--prompt-len", "9..x"], "--prompt-len"),
        (vec!["--mean-completion", "1"], "--mean-completion 1"),
        (vec!["--workload", "nope"], "--workload \"nope\""),
    ] {
        let out = composer_rl(&grpo_args(model, &extra));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{extra:?}: {err}"
        );
    }
}
