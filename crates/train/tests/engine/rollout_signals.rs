//! Per-step rollout signals: the sampler-trainer mismatch (zero in deterministic mode), the
//! scheduler's limits, the per-step sample records, and the library's advantage estimators.

use super::*;

#[test]
fn every_step_logs_the_sampler_trainer_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = hf_recipe(tmp.path(), &fixture("qwen2-tiny"));
    let run = tmp.path().join("run");
    run_train(&opts(&recipe, &run)).unwrap();
    let lines = train_metrics(&run);
    assert!(!lines.is_empty());
    for l in &lines {
        let max_abs = l["mismatch/max_abs"].as_f64().expect("mismatch/max_abs");
        let kl = l["mismatch/kl"].as_f64().expect("mismatch/kl");
        // f32 KV-cached sampler vs the trainer's full forward: equal up to rounding.
        assert!((0.0..1e-3).contains(&max_abs), "{l}");
        assert!((0.0..1e-6).contains(&kl), "{l}");
    }
}

#[test]
fn deterministic_mode_makes_the_mismatch_exactly_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = hf_recipe(tmp.path(), &fixture("qwen2-tiny"));
    let text = std::fs::read_to_string(&recipe).unwrap();
    let text = text.replace(
        "[rollout]\n",
        "[rollout]\ndeterministic = true\ntemperature = 0.9\n",
    );
    std::fs::write(&recipe, text).unwrap();
    let run = tmp.path().join("run");
    run_train(&opts(&recipe, &run)).unwrap();
    let lines = train_metrics(&run);
    assert!(!lines.is_empty());
    for l in &lines {
        assert_eq!(l["mismatch/max_abs"].as_f64(), Some(0.0), "{l}");
        assert_eq!(l["mismatch/kl"].as_f64(), Some(0.0), "{l}");
    }
}

#[test]
fn rollout_scheduler_limits_change_when_samples_run_not_what_they_sample() {
    let run_with = |extra: &str| -> Result<Vec<Value>, String> {
        let tmp = tempfile::tempdir().unwrap();
        let recipe = hf_recipe(tmp.path(), &fixture("qwen2-tiny"));
        let text = std::fs::read_to_string(&recipe).unwrap();
        let text = text
            .replace("num_generations = 2", "num_generations = 5")
            .replace("max_completion_length = 4", "max_completion_length = 6")
            .replace("[rollout]\n", &format!("[rollout]\n{extra}"));
        std::fs::write(&recipe, text).unwrap();
        let run = tmp.path().join("run");
        run_train(&opts(&recipe, &run)).map_err(|e| format!("{e:#}"))?;
        Ok(train_metrics(&run))
    };
    let all_at_once = run_with("").unwrap();
    let limited = run_with(
        "max_running_sequences = 2\nkv_token_budget = 4000\nprefill_chunk = 3\nkv_block_size = 5\n",
    )
    .unwrap();
    assert_eq!(all_at_once.len(), limited.len());
    for (a, b) in all_at_once.iter().zip(&limited) {
        assert_eq!(
            a["completions/lengths"], b["completions/lengths"],
            "{a}\n{b}"
        );
        assert_eq!(a["reward/mean"], b["reward/mean"], "{a}\n{b}");
    }
    // The fixed-shape decode steps (`cuda_graphs`; no capture on the CPU) sample the same.
    let fixed = run_with("cuda_graphs = true\nmax_running_sequences = 3\n").unwrap();
    for (a, b) in all_at_once.iter().zip(&fixed) {
        assert_eq!(
            a["completions/lengths"], b["completions/lengths"],
            "{a}\n{b}"
        );
        assert_eq!(a["reward/mean"], b["reward/mean"], "{a}\n{b}");
    }
    // A budget that cannot hold one sample is refused naming the key.
    let err = run_with("kv_token_budget = 5\n").unwrap_err();
    assert!(err.contains("kv_token_budget"), "{err}");
    // So is a block size of 0.
    let err = run_with("kv_block_size = 0\n").unwrap_err();
    assert!(err.contains("[rollout] kv_block_size"), "{err}");
}

/// The lines of `RUN_DIR/samples/step_NNNNNN.jsonl`.
fn recorded_samples(run: &Path, step: usize) -> Vec<Value> {
    std::fs::read_to_string(run.join(format!("samples/step_{step:06}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

/// Trains `estimator` for 2 steps (`temperature` for the sampled rollouts) and checks the
/// losses are finite; returns the run dir.
fn two_steps(dir: &Path, estimator: &str, temperature: f64) -> PathBuf {
    let recipe = small_recipe(
        dir,
        &format!("estimator = \"{estimator}\"\n"),
        "[train]\nsteps = 2\nprompts_per_step = 4\nseed = 5\neval_every = 0\ncheckpoint_every = 0\n",
    );
    // A second verifier (the completion starts with a character of the answer) gives the
    // barely warmed-up model rewards that differ between prompts.
    let text = std::fs::read_to_string(&recipe)
        .unwrap()
        .replace(
            "max_completion_length = 3",
            &format!("max_completion_length = 3\ntemperature = {temperature}"),
        )
        .replace(
            "task = \"arithmetic\"",
            "task = \"arithmetic\"\nverifiers = [{ kind = \"numeric\" }, { kind = \"regex\", pattern = \"^[{answer}]\" }]",
        );
    std::fs::write(&recipe, text).unwrap();
    let run = dir.join(format!("run-{estimator}-{temperature}"));
    assert_eq!(run_train(&opts(&recipe, &run)).unwrap().steps_completed, 2);
    let lines = train_metrics(&run);
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert!(f(l, "loss/rlvr").is_finite(), "{l}");
        assert!(l.get("skipped").is_none(), "{l}");
    }
    run
}

#[test]
fn grpo_passk_trains_with_the_library_advantages() {
    let tmp = tempfile::tempdir().unwrap();
    let run = two_steps(tmp.path(), "grpo_passk", 1.0);
    let mut nonzero = 0;
    for step in 1..=2 {
        let s = recorded_samples(&run, step);
        let rewards: Vec<f64> = s.iter().map(|x| f(x, "reward")).collect();
        let recorded: Vec<f64> = s.iter().map(|x| f(x, "advantage")).collect();
        // The recipe's defaults: group std scaling, std ε 1e-4 (TRL's).
        let want = composer_loss::grpo_passk_advantages(&rewards, 4, true, 1e-4).unwrap();
        for (a, b) in recorded.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-9,
                "step {step}: {recorded:?} vs {want:?}"
            );
        }
        nonzero += recorded.iter().filter(|a| **a != 0.0).count();
    }
    assert!(
        nonzero > 0,
        "every advantage was 0: the test proves nothing"
    );
}

#[test]
fn remax_baseline_is_the_reward_of_the_greedy_completion() {
    let tmp = tempfile::tempdir().unwrap();
    // Sampled rollouts: advantage = reward − the baseline of the sample's prompt, the same
    // baseline for a prompt's whole group, and its mean is the logged metric.
    let run = two_steps(tmp.path(), "remax", 1.0);
    let lines = train_metrics(&run);
    for step in 1..=2 {
        let s = recorded_samples(&run, step);
        for x in &s {
            let want = f(x, "reward") - f(x, "remax_baseline");
            assert!((f(x, "advantage") - want).abs() <= 1e-9, "{x}");
        }
        for g in s.chunks(4) {
            assert!(g
                .iter()
                .all(|x| x["remax_baseline"] == g[0]["remax_baseline"]));
        }
        let mean = s.iter().map(|x| f(x, "remax_baseline")).sum::<f64>() / s.len() as f64;
        let logged = f(&lines[step - 1], "remax/baseline_reward");
        assert!((mean - logged).abs() <= 1e-9, "{mean} vs {logged}");
    }
    // Greedy rollouts (temperature 0): every sample is its prompt's greedy completion, so the
    // baseline is its own reward, prompt by prompt — with rewards that differ between prompts.
    let run = two_steps(tmp.path(), "remax", 0.0);
    let all: Vec<Value> = (1..=2).flat_map(|k| recorded_samples(&run, k)).collect();
    for x in &all {
        assert_eq!(f(x, "remax_baseline"), f(x, "reward"), "{x}");
        assert_eq!(f(x, "advantage"), 0.0, "{x}");
    }
    let rewards: Vec<f64> = all.iter().map(|x| f(x, "reward")).collect();
    assert!(
        rewards.iter().any(|r| *r > 0.0) && rewards.contains(&0.0),
        "rewards {rewards:?} do not tell prompts apart: the test proves nothing"
    );
}
