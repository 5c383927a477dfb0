//! `bench grpo`: whole GRPO steps of the real trainer, bad flags.

use super::*;

/// `bench grpo` (composer-rl's side; TRL's needs torch and trl): whole GRPO steps of the real
/// trainer on a fixture and on random weights of a named shape written as a checkpoint with
/// the fixture's tokenizer; bad flags are refused naming them before any run.
#[test]
fn bench_grpo_runs_the_trainer_on_a_checkpoint_and_on_a_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    let model = model.to_str().unwrap();
    for (shape, out) in [(None, "fixture"), (Some("small"), "shape")] {
        let out_dir = tmp.path().join(out);
        let mut args = vec![
            "bench",
            "grpo",
            "--model",
            model,
            "--prompts",
            "2",
            "--group",
            "2",
            "--new-tokens",
            "4",
            "--steps",
            "2",
            "--out-dir",
            out_dir.to_str().unwrap(),
            "--skip-reference",
            "--json",
        ];
        if let Some(shape) = shape {
            args.extend(["--shape", shape]);
        }
        let v = run_json(&args);
        let ours = &v["composer_rl"];
        let steps = ours["steps"]["step_s"].as_array().unwrap();
        assert_eq!(steps.len(), 2, "{v}");
        assert!(steps.iter().all(|s| s.as_f64().unwrap() > 0.0), "{v}");
        let len = ours["steps"]["mean_completion_length"].as_f64().unwrap();
        assert!(len > 0.0 && len <= 4.0, "{v}");
        assert!(ours["walls_s"][2].as_f64().unwrap() > 0.0, "{v}");
        assert!(v["trl"].is_null(), "{v}");
        // Both sides read the same 4 prompts (2 per step x 2 steps).
        let prompts = std::fs::read_to_string(out_dir.join("prompts.jsonl")).unwrap();
        assert_eq!(prompts.lines().count(), 4);
        if shape.is_some() {
            let dir = out_dir.join("model");
            assert_eq!(ours["model_dir"].as_str(), dir.to_str(), "{v}");
            let cfg: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                    .unwrap();
            assert_eq!(cfg["hidden_size"], 128, "{cfg}");
            assert!(dir.join("tokenizer.json").is_file());
        }
    }
    for (args, want) in [
        (vec!["--group", "1"], "--group"),
        (
            vec!["--model", "/nonexistent-model"],
            "--model /nonexistent-model",
        ),
        (vec!["--shape", "qwen9"], "--shape \"qwen9\""),
    ] {
        let mut all = vec!["bench", "grpo", "--skip-reference"];
        all.extend(args.iter().copied());
        let out = composer_rl(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{args:?}: {err}"
        );
    }
}
