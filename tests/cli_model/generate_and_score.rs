//! `generate` and `score`: greedy continuations and log-probs against the fixtures' references,
//! seeded and restricted sampling, the chat template, bad inputs.

use super::*;

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
