//! The `generate` and `score` subcommands of the real `composer-rl` binary on the
//! transformers-written tiny checkpoints: greedy continuations and next-token log-probs
//! against each fixture's reference.json (computed by transformers 5.23, f32, CPU), seeded
//! sampling reproducibility, the chat template, the JSON shapes, and a missing model dir; and
//! `bench model` / `bench rollout`.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

const FIXTURES: [&str; 3] = ["llama-tiny", "qwen2-tiny", "qwen3-tiny"];

/// The shared fixtures root: `$COMPOSER_SHARED`, else `<workspace>/../shared`.
fn shared_dir() -> PathBuf {
    match std::env::var("COMPOSER_SHARED") {
        Ok(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared")),
    }
}

fn fixture(name: &str) -> PathBuf {
    shared_dir().join("fixtures/hf-tiny").join(name)
}

fn reference(name: &str) -> Value {
    let p = fixture(name).join("reference.json");
    let text =
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    serde_json::from_str(&text).expect("reference.json parses")
}

fn composer_rl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(args)
        .output()
        .expect("running composer-rl")
}

/// Runs the binary, expects success, parses stdout as one JSON value.
fn run_json(args: &[&str]) -> Value {
    let out = composer_rl(args);
    assert!(
        out.status.success(),
        "composer-rl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout of {args:?} is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("integer") as u32)
        .collect()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

/// The `{"samples":[{completion_ids, completion_text, logprobs, finish_reason}]}` shape.
fn samples(out: &Value) -> &Vec<Value> {
    let obj = out.as_object().expect("object");
    assert_eq!(obj.keys().collect::<Vec<_>>(), ["samples"], "{out}");
    let samples = out["samples"].as_array().expect("samples array");
    for s in samples {
        let mut keys: Vec<&String> = s.as_object().expect("sample object").keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "completion_ids",
                "completion_text",
                "finish_reason",
                "logprobs"
            ],
            "{s}"
        );
        assert_eq!(
            s["completion_ids"].as_array().unwrap().len(),
            s["logprobs"].as_array().unwrap().len()
        );
        assert!(matches!(
            s["finish_reason"].as_str(),
            Some("stop") | Some("length")
        ));
    }
    samples
}

#[test]
fn greedy_generate_matches_the_transformers_continuations() {
    for name in FIXTURES {
        let dir = fixture(name);
        let tokenizer = composer_model::Tokenizer::from_dir(&dir).unwrap();
        for (ci, case) in reference(name)["cases"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let out = run_json(&[
                "generate",
                "--model",
                dir.to_str().unwrap(),
                "--prompt",
                case["text"].as_str().unwrap(),
                "--temperature",
                "0",
                "--max-new-tokens",
                "16",
                "--json",
            ]);
            let samples = samples(&out);
            assert_eq!(samples.len(), 1);
            let s = &samples[0];
            // reference greedy_16 ran without stop tokens; the CLI stops at EOS (id 2 in
            // these fixtures), so compare up to and including the first stop.
            let reference = u32s(&case["greedy_16"]);
            let expected: Vec<u32> = match reference.iter().position(|&t| t == 2) {
                Some(i) => reference[..=i].to_vec(),
                None => reference,
            };
            let ids = u32s(&s["completion_ids"]);
            assert_eq!(ids, expected, "{name} case {ci}: greedy continuation");
            let want_reason = if ids.len() < 16 { "stop" } else { "length" };
            assert_eq!(s["finish_reason"], want_reason, "{name} case {ci}");
            assert_eq!(
                s["completion_text"].as_str().unwrap(),
                tokenizer.decode_skip_special(&ids).unwrap(),
                "{name} case {ci}: completion_text"
            );
        }
    }
}

#[test]
fn score_matches_the_transformers_logprobs() {
    for name in FIXTURES {
        let dir = fixture(name);
        for (ci, case) in reference(name)["cases"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let out = run_json(&[
                "score",
                "--model",
                dir.to_str().unwrap(),
                "--text",
                case["text"].as_str().unwrap(),
                "--json",
            ]);
            let mut keys: Vec<&String> = out.as_object().unwrap().keys().collect();
            keys.sort();
            assert_eq!(keys, ["input_ids", "next_token_logprobs"], "{out}");
            assert_eq!(
                u32s(&out["input_ids"]),
                u32s(&case["input_ids"]),
                "{name} case {ci}: input ids (no special tokens added)"
            );
            let ours = f64s(&out["next_token_logprobs"]);
            let theirs = f64s(&case["next_token_logprobs"]);
            assert_eq!(ours.len(), theirs.len(), "{name} case {ci}");
            for (t, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4,
                    "{name} case {ci} position {t}: {a} vs transformers {b}"
                );
            }
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_specials_are_not_in_the_text() {
    let dir = fixture("qwen2-tiny");
    let args = [
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "def add(a, b):",
        "--num-samples",
        "3",
        "--seed",
        "7",
        // A flat distribution so that EOS (`<|im_end|>`, id 2) gets sampled within 64
        // tokens: its text must not appear in completion_text.
        "--temperature",
        "5",
        "--max-new-tokens",
        "64",
        "--json",
    ];
    let first = composer_rl(&args);
    let second = composer_rl(&args);
    assert!(first.status.success());
    assert_eq!(first.stdout, second.stdout, "same seed, different output");
    let out: Value = serde_json::from_slice(&first.stdout).unwrap();
    let samples = samples(&out);
    assert_eq!(samples.len(), 3);
    let tokenizer = composer_model::Tokenizer::from_dir(&dir).unwrap();
    let mut stops = 0;
    for s in samples {
        let ids = u32s(&s["completion_ids"]);
        if s["finish_reason"] == "stop" {
            stops += 1;
            assert_eq!(ids.last(), Some(&2), "{s}");
            let text = s["completion_text"].as_str().unwrap();
            assert!(!text.contains("<|im_end|>"), "special token in text: {s}");
        }
        assert_eq!(
            s["completion_text"].as_str().unwrap(),
            tokenizer.decode_skip_special(&ids).unwrap()
        );
        for lp in f64s(&s["logprobs"]) {
            assert!(lp <= 0.0 && lp.is_finite(), "{s}");
        }
    }
    assert!(stops > 0, "no sample stopped at EOS: {out}");
    let other_seed = composer_rl(&[&args[..8], &["8"][..], &args[9..]].concat());
    assert!(other_seed.status.success());
    assert_ne!(first.stdout, other_seed.stdout, "the seed changes nothing");
}

/// Min-p and top-k restrict what is drawn: with `--min-p 0.5` at temperature 5 every drawn
/// token is within ln 2 of its step's most likely one, which the teacher-forced scorer confirms;
/// an out-of-range `--min-p` is refused by name before the model is read.
#[test]
fn min_p_and_top_k_restrict_the_draw_and_bad_min_p_is_refused() {
    let dir = fixture("qwen2-tiny");
    let out = run_json(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "def add(a, b):",
        "--num-samples",
        "2",
        "--temperature",
        "5",
        "--min-p",
        "0.5",
        "--top-k",
        "3",
        "--max-new-tokens",
        "24",
        "--json",
    ]);
    let policy =
        composer_model::Policy::load(&dir, &candle_core::Device::Cpu, candle_core::DType::F32)
            .unwrap();
    let prompt = policy.encode_prompt("def add(a, b):", false).unwrap();
    for s in samples(&out) {
        let ids = u32s(&s["completion_ids"]);
        let mut seq = prompt.clone();
        for &tok in &ids {
            let input = candle_core::Tensor::new(&seq[..], &candle_core::Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let logits: Vec<f32> = policy
                .model
                .forward(&input, None)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .get(seq.len() - 1)
                .unwrap()
                .to_vec1()
                .unwrap();
            let best = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let rank = logits.iter().filter(|&&l| l > logits[tok as usize]).count();
            // p / p_max = exp((l − l_max) / T) ≥ 0.5, and among the 3 most likely.
            assert!(
                ((logits[tok as usize] - best) / 5.0) as f64 >= 0.5f64.ln() - 1e-4 && rank < 3,
                "token {tok} (logit {}, best {best}, rank {rank}) outside min-p 0.5 / top-k 3: {s}",
                logits[tok as usize]
            );
            seq.push(tok);
        }
    }
    let bad = composer_rl(&[
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt",
        "x",
        "--min-p",
        "1.5",
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("min_p must be in [0, 1], got 1.5"), "{err}");
}

#[test]
fn chat_renders_the_fixture_template() {
    let name = "qwen3-tiny";
    let dir = fixture(name);
    let example = &reference(name)["chat_template_example"];
    let question = example["messages"][0]["content"].as_str().unwrap();
    let rendered = example["rendered"].as_str().unwrap();
    let greedy = |prompt: &str, chat: bool| {
        let mut args = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-new-tokens",
            "8",
            "--json",
        ];
        if chat {
            args.push("--chat");
        }
        run_json(&args)
    };
    // `--chat` with the question = the transformers-rendered prompt given verbatim.
    assert_eq!(greedy(question, true), greedy(rendered, false));
    assert_ne!(greedy(question, true), greedy(question, false));
}

#[test]
fn missing_model_dir_fails_naming_the_path() {
    let missing = "/nonexistent/composer-model-dir";
    for args in [
        vec!["generate", "--model", missing, "--prompt", "hi", "--json"],
        vec!["score", "--model", missing, "--text", "hi", "--json"],
    ] {
        let out = composer_rl(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(missing), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
    }
}

#[test]
fn prompts_longer_than_the_positions_fail_naming_the_limit() {
    // ~1000 tokens of varied text against max_position_embeddings = 256.
    let long: String = (0..300).map(|i| format!("x{i} ")).collect();
    let dir = fixture("llama-tiny");
    for args in [
        vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            &long,
        ],
        vec!["score", "--model", dir.to_str().unwrap(), "--text", &long],
    ] {
        let out = composer_rl(&args);
        assert!(!out.status.success(), "{} succeeded", args[0]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("max_position_embeddings") && stderr.contains("256"),
            "{}: {stderr}",
            args[0]
        );
    }
}

/// `bench model --padding-free`: the training step runs on the batch's rows packed as segments
/// of one row, and the report says so.
#[test]
fn bench_model_runs_padding_free() {
    let args = [
        "bench",
        "model",
        "--shape",
        "small",
        "--batch",
        "2",
        "--train-seq-len",
        "16",
        "--skip-decode",
        "--json",
    ];
    let padded = run_json(&args);
    assert_eq!(padded["padding_free"], false);
    let out = run_json(&[&args[..], &["--padding-free"]].concat());
    assert_eq!(out["padding_free"], true);
    let row = &out["rows"][0];
    assert!(row["train_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(row["train_phase_s"].as_array().unwrap().len(), 3);
}

/// `bench model` on the CPU-sized shape with LoRA and gradient checkpointing: the JSON report
/// counts only the adapters as trainable and times every phase; bad flags name themselves
/// before any model is built.
#[test]
fn bench_model_runs_lora_with_checkpointing_and_refuses_bad_flags() {
    let out = run_json(&[
        "bench",
        "model",
        "--shape",
        "small",
        "--batch",
        "2",
        "--train-seq-len",
        "16",
        "--skip-decode",
        "--lora",
        "4",
        "--gradient-checkpointing",
        "--json",
    ]);
    let total = out["num_parameters"].as_u64().unwrap();
    let trainable = out["num_trainable_parameters"].as_u64().unwrap();
    assert!(
        trainable > 0 && trainable < total / 10,
        "{trainable} of {total}"
    );
    let row = &out["rows"][0];
    assert!(row["train_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(row["decode_tokens_per_s"].is_null());
    let phases = row["train_phase_s"].as_array().unwrap();
    assert_eq!(phases.len(), 3);
    assert!(phases.iter().all(|p| p.as_f64().unwrap() >= 0.0));
    for (args, want) in [
        (
            vec!["bench", "model", "--shape", "qwen9"],
            "--shape \"qwen9\"",
        ),
        (
            vec![
                "bench",
                "model",
                "--shape",
                "small",
                "--train-seq-len",
                "100000",
            ],
            "--train-seq-len 100000",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--dtype", "f8"],
            "--dtype",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--prompt-len", "0"],
            "--prompt-len 0",
        ),
        (
            vec![
                "bench",
                "model",
                "--shape",
                "qwen2.5-0.5b",
                "--prompt-len",
                "40000",
            ],
            "--prompt-len 40000",
        ),
        (
            vec![
                "bench",
                "model",
                "--shape",
                "small",
                "--prompt-len",
                "18446744073709551615",
            ],
            "--prompt-len 18446744073709551615",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--torch-compile"],
            "--torch",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--peak-tflops", "0"],
            "--peak-tflops",
        ),
        (
            vec![
                "bench", "model", "--shape", "small", "--device", "tpu", "--torch",
            ],
            "unknown device `tpu`",
        ),
    ] {
        let out = composer_rl(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}

/// `bench model --torch` with a Python that cannot run PyTorch's side: our side still runs and
/// the reference's row says why it failed, naming the interpreter (the reference itself needs
/// torch, which CI does not install; BENCHMARKS.md has a run with it).
#[test]
fn bench_model_keeps_its_own_numbers_when_the_torch_side_fails() {
    let out = composer_rl(&[
        "bench",
        "model",
        "--shape",
        "small",
        "--batch",
        "1",
        "--train-seq-len",
        "64",
        "--skip-decode",
        "--torch",
        "--python",
        "/nonexistent/python3",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(out.stdout.trim_ascii()).expect("one JSON document");
    let ours = &report["composer_rl"]["rows"][0];
    assert!(
        ours["train_tokens_per_s"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    let torch = report["torch"].as_array().unwrap();
    assert_eq!(torch.len(), 1, "{report}");
    let error = torch[0]["error"].as_str().unwrap();
    assert!(error.contains("/nonexistent/python3"), "{error}");
    // Training FLOPs per token of the small shape: 6·N plus causal attention 6·L·H·d·T.
    let n = report["composer_rl"]["num_parameters"].as_f64().unwrap();
    let flops = report["train_flops_per_token"].as_f64().unwrap();
    assert_eq!(flops, 6.0 * n + 6.0 * (4 * 4 * 32 * 64) as f64, "{report}");
}

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
