//! Bad input: broken or mismatched checkpoints, configs and tokenizers, and sequences past
//! the positions, each a clear error naming the file, key or tensor.

use super::*;

fn load_error(dir: &Path) -> String {
    match Transformer::load(dir, &Device::Cpu, DType::F32) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => {
            let msg = format!("{e:#}");
            eprintln!("error (as expected): {msg}");
            msg
        }
    }
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    let missing = load_error(Path::new("/nonexistent/model"));
    assert!(missing.contains("/nonexistent/model"), "{missing}");

    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen2-tiny").join(f), dir.path().join(f)).unwrap();
    }
    let config = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        config.replace("\"qwen2\"", "\"gpt2\""),
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model_type") && err.contains("gpt2"), "{err}");

    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("config.json"), "{err}");

    let mut value: serde_json::Value = serde_json::from_str(&config).unwrap();
    value.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(dir.path().join("config.json"), value.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("hidden_size"), "{err}");

    let mut value: serde_json::Value = serde_json::from_str(&config).unwrap();
    value["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    std::fs::write(dir.path().join("config.json"), value.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("yarn") || err.contains("rope"), "{err}");

    let mut value: serde_json::Value = serde_json::from_str(&config).unwrap();
    value["hidden_size"] = serde_json::json!(128);
    std::fs::write(dir.path().join("config.json"), value.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("embed_tokens") || err.contains("shape"),
        "{err}"
    );
}

#[test]
fn prompt_longer_than_the_positions_is_an_error() {
    let model = Transformer::load(&fixture("qwen3-tiny"), &Device::Cpu, DType::F32).unwrap();
    let req = GenerationRequest {
        prompt_ids: vec![5; 300],
        num_samples: 1,
        seed: 0,
    };
    let Err(err) = generate(&model, &[req], &params(1.0, 4)) else {
        panic!("must fail")
    };
    assert!(format!("{err:#}").contains("256"), "{err:#}");
}

#[test]
fn unsupported_tensor_dtype_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("qwen2-tiny").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let data: Vec<u8> = (0..8 * 4i64).flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![8, 4], &data).unwrap();
    safetensors::serialize_to_file(
        [("model.embed_tokens.weight", view)],
        None,
        &dir.path().join("model.safetensors"),
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.embed_tokens.weight") && err.contains("I64"),
        "{err}"
    );
}

#[test]
fn bf16_checkpoints_load_and_stay_close_to_f32() {
    let model = Transformer::load(&fixture("qwen3-tiny"), &Device::Cpu, DType::F32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model
        .to_dtype(DType::BF16)
        .unwrap()
        .save_pretrained(dir.path())
        .unwrap();
    let reloaded = Transformer::load(dir.path(), &Device::Cpu, DType::F32).unwrap();
    let ids = Tensor::new(&[PROMPT], &Device::Cpu).unwrap();
    let a: Vec<f32> = model
        .forward(&ids, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let b: Vec<f32> = reloaded
        .forward(&ids, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    // bf16 keeps 8 mantissa bits: weights round by ≤ 2^-9 relative, logits by a few 1e-2 here.
    assert!(worst < 0.1, "bf16 round trip moved a logit by {worst}");
}

fn policy_load_error(dir: &Path) -> String {
    match composer_model::Policy::load(dir, &Device::Cpu, DType::F32) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => {
            let msg = format!("{e:#}");
            eprintln!("error (as expected): {msg}");
            msg
        }
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(&path, value.to_string()).unwrap();
}

#[test]
fn tokenizer_larger_than_the_vocabulary_is_an_error_naming_both_files() {
    // tokenizer.json has 384 tokens; a config claiming 300 rows would let the tokenizer
    // produce ids with no embedding row.
    let dir = common::copy_fixture("qwen2-tiny");
    edit_config(dir.path(), |v| v["vocab_size"] = serde_json::json!(300));
    let err = policy_load_error(dir.path());
    for needle in ["tokenizer.json", "config.json", "vocab_size", "384", "300"] {
        assert!(err.contains(needle), "missing `{needle}` in: {err}");
    }
}

#[test]
fn tokenizer_smaller_than_the_vocabulary_is_allowed() {
    // Qwen checkpoints pad the embedding beyond the tokenizer (151936 rows, 151665 tokens).
    let mut cfg = composer_model::ModelConfig::tiny_qwen2(512);
    cfg.num_hidden_layers = 1;
    let (model, _) = Transformer::random_init(&cfg, 3, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path()).unwrap();
    std::fs::copy(
        fixture("qwen2-tiny").join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let policy = composer_model::Policy::load(dir.path(), &Device::Cpu, DType::F32).unwrap();
    assert_eq!(policy.tokenizer.vocab_size(), 384);
    assert_eq!(policy.model.cfg.vocab_size, 512);
}

#[test]
fn missing_tensor_is_an_error_naming_it() {
    let model = Transformer::load(&fixture("llama-tiny"), &Device::Cpu, DType::F32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path()).unwrap();
    let kept: Vec<(String, Tensor)> = model
        .named_tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.mlp.up_proj.weight")
        .collect();
    composer_model::checkpoint::save_dir(dir.path(), &kept, 1).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn unreadable_missing_or_corrupt_files_are_errors_naming_the_file() {
    // config.json that cannot be read (a directory: root can read any file, so permission
    // bits would not make it unreadable in CI).
    let dir = common::copy_fixture("qwen2-tiny");
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    std::fs::create_dir(dir.path().join("config.json")).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("config.json"), "{err}");

    // No weights at all.
    let dir = common::copy_fixture("qwen2-tiny");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.safetensors") && err.contains(&dir.path().display().to_string()),
        "{err}"
    );

    // Truncated safetensors.
    let dir = common::copy_fixture("qwen2-tiny");
    std::fs::write(dir.path().join("model.safetensors"), b"\x10\x00\x00").unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors"), "{err}");

    // A sharded index naming a shard that is not there.
    let dir = common::copy_fixture("qwen2-tiny");
    let model = Transformer::load(dir.path(), &Device::Cpu, DType::F32).unwrap();
    model.save_pretrained_sharded(dir.path(), 2).unwrap();
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");

    // Malformed generation_config.json.
    let dir = common::copy_fixture("qwen2-tiny");
    std::fs::write(
        dir.path().join("generation_config.json"),
        "{\"eos_token_id\": ",
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("generation_config.json"), "{err}");

    // Missing and malformed tokenizer.json (the policy needs it; the bare model does not).
    let dir = common::copy_fixture("qwen2-tiny");
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = policy_load_error(dir.path());
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3").unwrap();
    let err = policy_load_error(dir.path());
    assert!(err.contains("tokenizer.json"), "{err}");

    // Malformed tokenizer_config.json.
    let dir = common::copy_fixture("qwen2-tiny");
    std::fs::write(dir.path().join("tokenizer_config.json"), "[1,").unwrap();
    let err = policy_load_error(dir.path());
    assert!(err.contains("tokenizer_config.json"), "{err}");
}

#[test]
fn bad_config_values_name_the_key() {
    let dir = common::copy_fixture("qwen3-tiny");
    edit_config(dir.path(), |v| v["hidden_size"] = serde_json::json!("64"));
    let err = load_error(dir.path());
    assert!(
        err.contains("hidden_size") && err.contains("config.json"),
        "{err}"
    );

    // transformers 5.x layout: the scaling type sits in `rope_parameters`.
    let dir = common::copy_fixture("qwen3-tiny");
    edit_config(
        dir.path(),
        |v| {
            v["rope_parameters"] =
                serde_json::json!({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0})
        },
    );
    let err = load_error(dir.path());
    assert!(
        err.contains("rope_parameters.rope_type") && err.contains("llama3"),
        "{err}"
    );

    let dir = common::copy_fixture("qwen3-tiny");
    edit_config(dir.path(), |v| {
        v.as_object_mut().unwrap().remove("rope_parameters");
    });
    let err = load_error(dir.path());
    assert!(err.contains("rope_theta"), "{err}");

    let dir = common::copy_fixture("qwen3-tiny");
    edit_config(dir.path(), |v| {
        v.as_object_mut().unwrap().remove("model_type");
    });
    let err = load_error(dir.path());
    assert!(err.contains("model_type"), "{err}");
}

#[test]
fn sequences_longer_than_the_positions_are_errors_everywhere() {
    let model = Transformer::load(&fixture("qwen3-tiny"), &Device::Cpu, DType::F32).unwrap();
    let err = composer_model::score(&model, &[vec![5; 257]]).unwrap_err();
    assert!(
        format!("{err:#}").contains("max_position_embeddings"),
        "{err:#}"
    );
    let ids = Tensor::new(&[[5u32; 257]], &Device::Cpu).unwrap();
    let err = model.forward_train(&ids, None).unwrap_err();
    assert!(
        format!("{err:#}").contains("max_position_embeddings"),
        "{err:#}"
    );
    // A prompt that fits but leaves no room for max_new_tokens stops at the limit instead.
    let req = GenerationRequest {
        prompt_ids: vec![5; 250],
        num_samples: 1,
        seed: 0,
    };
    let out = generate(&model, &[req], &params(1.0, 20)).unwrap();
    assert!(out[0][0].completion_ids.len() <= 6, "{:?}", out[0][0]);
    assert!(
        matches!(
            out[0][0].finish_reason,
            composer_model::FinishReason::Length
        ),
        "{:?}",
        out[0][0]
    );
}

/// A config.json with fewer layers than its checkpoint holds is refused naming the first layer
/// it would drop, rather than loading a truncated model.
#[test]
fn a_config_with_fewer_layers_than_the_checkpoint_is_refused() {
    let tmp = fixture_copy("qwen2-tiny");
    let cfg_path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let layers = cfg["num_hidden_layers"].as_u64().unwrap();
    cfg["num_hidden_layers"] = (layers - 1).into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = match Transformer::load(tmp.path(), &Device::Cpu, DType::F32) {
        Ok(_) => panic!("a truncated model loaded"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains(&format!("layer {}", layers - 1)) && e.contains("num_hidden_layers"),
        "{e}"
    );
}
