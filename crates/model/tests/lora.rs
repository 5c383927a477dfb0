//! LoRA adapters: parity with upstream PEFT (our saved adapter loaded by
//! `peft.PeftModel.from_pretrained`, reference logits in `fixtures/lora-qwen2/reference.json`
//! from tools/ref_lora_peft.sh), the merged export, the save → load round trip, gradients and
//! training that moves only the adapter, and bad input.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use common::{as_f32s, as_u32s, fixture};
use composer_model::lora::{export_adapter, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use composer_model::{
    generate_deterministic, generate_with_stats, token_logprobs, GenerationRequest, LoraConfig,
    SamplingParams, Transformer,
};
use rand::{Rng, SeedableRng};

fn lora_fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/lora-qwen2"
    ))
}

fn reference() -> serde_json::Value {
    let p = lora_fixture().join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("reference.json")).expect("json")
}

fn ids_of(r: &serde_json::Value, device: &Device) -> Tensor {
    let rows: Vec<Vec<u32>> = r["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(as_u32s)
        .collect();
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), device).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn all_linear(r: usize, dropout: f64) -> LoraConfig {
    LoraConfig::new(
        r,
        2.0 * r as f64,
        dropout,
        Some(&["all-linear".to_string()]),
    )
    .unwrap()
}

/// Sets every `lora_B` variable to seeded uniform values in ±`scale` (B starts at zero).
fn randomize_b(varmap: &VarMap, seed: u64, scale: f64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().filter(|k| k.contains("lora_B")).collect();
    names.sort();
    for n in names {
        let v = &data[n];
        let vals: Vec<f32> = (0..v.elem_count())
            .map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * scale) as f32)
            .collect();
        let t = Tensor::from_vec(vals, v.shape(), v.device())
            .unwrap()
            .to_dtype(v.dtype())
            .unwrap();
        v.set(&t).unwrap();
    }
}

#[test]
fn peft_loads_our_adapter_with_equal_logits() {
    let r = reference();
    assert!(
        r["peft_version"].is_string(),
        "reference names its peft version"
    );
    let device = Device::Cpu;
    let mut model = Transformer::load(&fixture("qwen2-tiny"), &device, DType::F32).unwrap();
    let ids = ids_of(&r, &device);
    let base = flat(&model.forward(&ids, None).unwrap());
    let (cfg, _) = model.load_lora(&lora_fixture()).unwrap();
    assert_eq!(
        cfg.target_modules.len(),
        7,
        "the fixture adapts every projection"
    );
    let ours = flat(&model.forward(&ids, None).unwrap());
    let want = as_f32s(&r["adapted_logits"]);
    // The adapter matters: PEFT's adapted logits are far from the base ones.
    let moved = max_abs_diff(&want, &as_f32s(&r["base_logits"]));
    assert!(moved > 1e-2, "adapter barely changes the logits ({moved})");
    assert!(max_abs_diff(&base, &as_f32s(&r["base_logits"])) < 1e-4);
    let d = max_abs_diff(&ours, &want);
    assert!(
        d < 1e-4,
        "max |ours - peft| = {d} (adapter moves logits by {moved})"
    );
    // The differentiable training path computes the same adapted logits without dropout.
    let mut eval_model = Transformer::load(&fixture("qwen2-tiny"), &device, DType::F32).unwrap();
    let no_dropout = LoraConfig {
        dropout: 0.0,
        ..cfg
    };
    let (_, vm) = eval_model.load_lora(&lora_fixture()).unwrap();
    eval_model.attach_lora(&no_dropout, &vm, 0).unwrap();
    let train_path = flat(&eval_model.forward_train(&ids, None).unwrap());
    let d = max_abs_diff(&train_path, &want);
    assert!(d < 1e-4, "training path: max |ours - peft| = {d}");
}

#[test]
fn merged_export_matches_peft_merge_and_unload() {
    let r = reference();
    let device = Device::Cpu;
    let mut model = Transformer::load(&fixture("qwen2-tiny"), &device, DType::F32).unwrap();
    model.load_lora(&lora_fixture()).unwrap();
    let merged = model.merge_lora().unwrap();
    assert!(merged.lora.is_none());
    let out = tempfile::tempdir().unwrap();
    merged.save_pretrained(out.path()).unwrap();
    let reloaded = Transformer::load(out.path(), &device, DType::F32).unwrap();
    let ids = ids_of(&r, &device);
    let ours = flat(&reloaded.forward(&ids, None).unwrap());
    let d = max_abs_diff(&ours, &as_f32s(&r["merged_logits"]));
    assert!(d < 1e-4, "merged: max |ours - peft merge_and_unload| = {d}");
    // A model with adapters refuses to save only its base weights.
    let e = format!("{:#}", model.save_pretrained(out.path()).unwrap_err());
    assert!(e.contains("LoRA") && e.contains("merge"), "{e}");
}

#[test]
fn saved_adapter_round_trips_to_identical_logits() {
    let device = Device::Cpu;
    let mut model = Transformer::load(&fixture("llama-tiny"), &device, DType::F32).unwrap();
    let cfg = LoraConfig::new(3, 6.0, 0.0, Some(&["q_proj".into(), "down_proj".into()])).unwrap();
    let vm = model.add_lora(&cfg, 7).unwrap();
    randomize_b(&vm, 8, 0.1);
    let dir = tempfile::tempdir().unwrap();
    model.save_lora(dir.path(), "llama-tiny").unwrap();

    // PEFT's file layout and names.
    let conf: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(ADAPTER_CONFIG_FILE)).unwrap(),
    )
    .unwrap();
    assert_eq!(conf["peft_type"], "LORA");
    assert_eq!(conf["r"], 3);
    assert_eq!(conf["lora_alpha"], 6.0);
    assert_eq!(
        conf["target_modules"],
        serde_json::json!(["q_proj", "down_proj"])
    );
    let saved =
        candle_core::safetensors::load(dir.path().join(ADAPTER_WEIGHTS_FILE), &device).unwrap();
    let layers = model.cfg.num_hidden_layers;
    assert_eq!(saved.len(), layers * 2 * 2);
    let a = &saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
    assert_eq!(a.dims(), &[3, model.cfg.hidden_size]);
    let b = &saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"];
    assert_eq!(b.dims(), &[model.cfg.hidden_size, 3]);

    let mut again = Transformer::load(&fixture("llama-tiny"), &device, DType::F32).unwrap();
    let (cfg2, _) = again.load_lora(dir.path()).unwrap();
    assert_eq!(cfg2, cfg);
    let ids = Tensor::new(&[[5u32, 17, 99, 3, 250, 42]], &device).unwrap();
    let before = flat(&model.forward(&ids, None).unwrap());
    let after = flat(&again.forward(&ids, None).unwrap());
    assert_eq!(before, after, "save → load must give bit-identical logits");
    let base = Transformer::load(&fixture("llama-tiny"), &device, DType::F32).unwrap();
    assert!(max_abs_diff(&before, &flat(&base.forward(&ids, None).unwrap())) > 1e-3);
}

/// Mean next-token NLL of `seq` through the training forward.
fn nll(model: &Transformer, seq: &[u32]) -> Tensor {
    let ids = Tensor::new(seq, model.device())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let n = seq.len() - 1;
    let logits = model
        .forward_train(&ids.narrow(1, 0, n).unwrap(), None)
        .unwrap();
    token_logprobs(&logits, &ids.narrow(1, 1, n).unwrap())
        .unwrap()
        .mean_all()
        .unwrap()
        .neg()
        .unwrap()
}

const SEQ: [u32; 8] = [5, 17, 99, 3, 250, 42, 7, 300];

#[test]
fn every_adapter_tensor_gets_a_gradient_and_the_base_none() {
    let (mut model, base_vars) =
        Transformer::load_trainable(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    let vm = model.add_lora(&all_linear(4, 0.0), 3).unwrap();
    // Fresh adapter (B = 0): B gets gradient; A's is s·Bᵀ(...) = 0, as in PEFT.
    let grads = nll(&model, &SEQ).backward().unwrap();
    for (k, v) in vm.data().lock().unwrap().iter() {
        if k.contains("lora_B") {
            let g = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {k}"));
            assert!(flat(g).iter().any(|x| *x != 0.0), "zero gradient for {k}");
        }
    }
    randomize_b(&vm, 4, 0.05);
    let grads = nll(&model, &SEQ).backward().unwrap();
    let data = vm.data().lock().unwrap();
    assert_eq!(data.len(), 2 * 7 * model.cfg.num_hidden_layers);
    for (k, v) in data.iter() {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {k}"));
        let norm: f32 = flat(g).iter().map(|x| x * x).sum();
        assert!(
            norm > 0.0 && norm.is_finite(),
            "zero/non-finite gradient for {k}"
        );
    }
    for (k, v) in base_vars.data().lock().unwrap().iter() {
        assert!(
            grads.get(v.as_tensor()).is_none(),
            "frozen base weight {k} got a gradient"
        );
    }
}

#[test]
fn adapter_gradients_match_central_differences() {
    let mut model = Transformer::load(&fixture("qwen3-tiny"), &Device::Cpu, DType::F64).unwrap();
    let cfg = LoraConfig::new(2, 5.0, 0.0, Some(&["k_proj".into(), "up_proj".into()])).unwrap();
    let vm = model.add_lora(&cfg, 11).unwrap();
    randomize_b(&vm, 12, 0.05);
    let grads = nll(&model, &SEQ).backward().unwrap();
    let get = |n: &str| -> Var { vm.data().lock().unwrap()[n].clone() };
    let eps = 1e-6;
    for (name, idx) in [
        (
            "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight",
            37,
        ),
        (
            "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight",
            21,
        ),
    ] {
        let v = get(name);
        let analytic: Vec<f64> = grads
            .get(v.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut w: Vec<f64> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let w0 = w[idx];
        let mut at = |x: f64| {
            w[idx] = x;
            v.set(&Tensor::from_vec(w.clone(), v.shape(), v.device()).unwrap())
                .unwrap();
            nll(&model, &SEQ).to_scalar::<f64>().unwrap()
        };
        let numeric = (at(w0 + eps) - at(w0 - eps)) / (2.0 * eps);
        at(w0);
        let scale = analytic[idx].abs().max(numeric.abs());
        assert!(scale > 1e-7, "{name}: gradient too small to check");
        let rel = (analytic[idx] - numeric).abs() / scale;
        assert!(
            rel < 1e-6,
            "{name}[{idx}]: {} vs {numeric} (rel {rel:e})",
            analytic[idx]
        );
    }
}

#[test]
fn lora_training_changes_only_adapter_weights_and_lowers_the_loss() {
    let (mut model, _) =
        Transformer::load_trainable(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    let base_before: Vec<(String, Vec<f32>)> = model
        .named_tensors()
        .iter()
        .map(|(n, t)| (n.clone(), flat(t)))
        .collect();
    let vm = model.add_lora(&all_linear(4, 0.05), 5).unwrap();
    let adapter_before: Vec<(String, Vec<f32>)> = model
        .lora_tensors()
        .iter()
        .map(|(n, t)| (n.clone(), flat(t)))
        .collect();
    // The optimizer holds only the adapter variables.
    let mut opt = candle_nn::AdamW::new(
        vm.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        },
    )
    .unwrap();
    let first = nll(&model, &SEQ).to_scalar::<f32>().unwrap();
    for step in 0..15 {
        model.reseed_lora_dropout(step).unwrap();
        opt.backward_step(&nll(&model, &SEQ)).unwrap();
    }
    model.reseed_lora_dropout(100).unwrap();
    let last = nll(&model, &SEQ).to_scalar::<f32>().unwrap();
    assert!(
        last < 0.7 * first,
        "loss {first} → {last}: LoRA did not learn"
    );
    for ((n, before), (_, t)) in base_before.iter().zip(model.named_tensors()) {
        assert_eq!(before, &flat(&t), "base weight {n} changed");
    }
    for ((n, before), (_, t)) in adapter_before.iter().zip(model.lora_tensors()) {
        assert_ne!(before, &flat(&t), "adapter tensor {n} did not train");
    }
    // The rollout path (detached, fused kernels) sees the trained adapter.
    let ids = Tensor::new(&[[5u32, 17, 99]], &Device::Cpu).unwrap();
    let merged = model.merge_lora().unwrap();
    let d = max_abs_diff(
        &flat(&model.detached().forward(&ids, None).unwrap()),
        &flat(&merged.forward(&ids, None).unwrap()),
    );
    assert!(d < 1e-4, "adapted inference vs merged weights: {d}");
}

#[test]
fn dropout_is_reproducible_from_its_seed_and_off_at_inference() {
    let mut model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    let vm = model.add_lora(&all_linear(4, 0.3), 1).unwrap();
    randomize_b(&vm, 2, 0.1);
    let ids = Tensor::new(&[[5u32, 17, 99, 3]], &Device::Cpu).unwrap();
    model.reseed_lora_dropout(9).unwrap();
    let a = flat(&model.forward_train(&ids, None).unwrap());
    model.reseed_lora_dropout(9).unwrap();
    let b = flat(&model.forward_train(&ids, None).unwrap());
    let c = flat(&model.forward_train(&ids, None).unwrap());
    assert_eq!(a, b, "same seed, same dropout masks");
    assert_ne!(b, c, "the stream moves on between forwards");
    let i1 = flat(&model.forward(&ids, None).unwrap());
    let i2 = flat(&model.forward(&ids, None).unwrap());
    assert_eq!(i1, i2, "no dropout at inference");
}

#[test]
fn bad_lora_settings_are_errors_naming_the_key() {
    let err = |r: usize, alpha: f64, p: f64, t: Option<&[String]>| {
        format!("{:#}", LoraConfig::new(r, alpha, p, t).unwrap_err())
    };
    assert!(err(0, 8.0, 0.0, None).contains("lora_r"));
    assert!(err(4, -1.0, 0.0, None).contains("lora_alpha"));
    assert!(err(4, f64::NAN, 0.0, None).contains("lora_alpha"));
    assert!(err(4, 8.0, 1.0, None).contains("lora_dropout"));
    let e = err(4, 8.0, 0.0, Some(&["qproj".into()]));
    assert!(
        e.contains("lora_target_modules") && e.contains("qproj"),
        "{e}"
    );
    let e = err(4, 8.0, 0.0, Some(&["all-linear".into(), "q_proj".into()]));
    assert!(e.contains("all-linear"), "{e}");
    assert!(err(4, 8.0, 0.0, Some(&[])).contains("lora_target_modules"));
    let d = LoraConfig::new(8, 16.0, 0.05, None).unwrap();
    assert_eq!(
        d.target_modules,
        vec!["q_proj", "v_proj"],
        "PEFT's default targets"
    );
    assert_eq!(d.scaling(), 2.0);
}

fn copy_adapter(to: &Path) {
    for f in [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE] {
        std::fs::copy(lora_fixture().join(f), to.join(f)).unwrap();
    }
}

#[test]
fn bad_adapter_files_are_errors_naming_the_file_and_key() {
    let dev = Device::Cpu;
    let base = || Transformer::load(&fixture("qwen2-tiny"), &dev, DType::F32).unwrap();
    // DoRA is not plain LoRA.
    let dir = tempfile::tempdir().unwrap();
    copy_adapter(dir.path());
    let cp = dir.path().join(ADAPTER_CONFIG_FILE);
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cp).unwrap()).unwrap();
    c["use_dora"] = serde_json::json!(true);
    std::fs::write(&cp, c.to_string()).unwrap();
    let e = format!(
        "{:#}",
        base().load_lora(dir.path()).err().expect("an error")
    );
    assert!(
        e.contains("use_dora") && e.contains(ADAPTER_CONFIG_FILE),
        "{e}"
    );
    // A rank that does not match the tensors.
    c["use_dora"] = serde_json::json!(false);
    c["r"] = serde_json::json!(5);
    std::fs::write(&cp, c.to_string()).unwrap();
    let e = format!(
        "{:#}",
        base().load_lora(dir.path()).err().expect("an error")
    );
    assert!(e.contains("lora_A.weight") && e.contains("shape"), "{e}");
    // Fewer targets than the file has tensors for.
    c["r"] = serde_json::json!(4);
    c["target_modules"] = serde_json::json!(["q_proj"]);
    std::fs::write(&cp, c.to_string()).unwrap();
    let e = format!(
        "{:#}",
        base().load_lora(dir.path()).err().expect("an error")
    );
    assert!(e.contains("outside target_modules"), "{e}");
    // No adapter at all.
    let empty = tempfile::tempdir().unwrap();
    let e = format!(
        "{:#}",
        base().load_lora(empty.path()).err().expect("an error")
    );
    assert!(e.contains(ADAPTER_CONFIG_FILE), "{e}");
}

#[test]
fn export_writes_the_adapter_or_merged_weights_with_the_tokenizer() {
    let dev = Device::Cpu;
    let base_dir = fixture("qwen2-tiny");
    let mut model = Transformer::load(&base_dir, &dev, DType::F32).unwrap();
    let vm = model.add_lora(&all_linear(2, 0.0), 21).unwrap();
    randomize_b(&vm, 22, 0.1);
    let ck = tempfile::tempdir().unwrap();
    model
        .save_lora(ck.path(), &base_dir.to_string_lossy())
        .unwrap();
    std::fs::copy(
        base_dir.join("tokenizer.json"),
        ck.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(ck.path().join("optimizer.safetensors"), b"not exported").unwrap();

    let merged = tempfile::tempdir().unwrap();
    export_adapter(ck.path(), merged.path(), true).unwrap();
    assert!(merged.path().join("tokenizer.json").is_file());
    assert!(!merged.path().join("optimizer.safetensors").exists());
    let m = Transformer::load(merged.path(), &dev, DType::F32).unwrap();
    let ids = Tensor::new(&[[1u32, 2, 3, 4, 5]], &dev).unwrap();
    let d = max_abs_diff(
        &flat(&m.forward(&ids, None).unwrap()),
        &flat(&model.forward(&ids, None).unwrap()),
    );
    assert!(d < 1e-4, "merged export vs adapted model: {d}");

    let adapter = tempfile::tempdir().unwrap();
    export_adapter(ck.path(), adapter.path(), false).unwrap();
    for f in [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, "tokenizer.json"] {
        assert!(adapter.path().join(f).is_file(), "{f}");
    }
    // A full checkpoint is not a LoRA checkpoint.
    let e = format!(
        "{:#}",
        export_adapter(merged.path(), adapter.path(), true).unwrap_err()
    );
    assert!(e.contains(ADAPTER_CONFIG_FILE), "{e}");
}

#[test]
fn adapted_rollouts_sample_what_the_separate_projections_sample() {
    // Adapters on q and v but not k (a block of zero rows in the stacked q/k/v delta), on gate
    // but not up, and on down, with non-zero B: the engine's decode adds each stack's adapters
    // as one packed delta; the deterministic sampler runs every projection and adapter apart.
    let dev = Device::Cpu;
    let (mut model, _) =
        Transformer::load_trainable(&fixture("qwen2-tiny"), &dev, DType::F32).unwrap();
    let targets = ["q_proj", "v_proj", "gate_proj", "down_proj"].map(String::from);
    let cfg = LoraConfig::new(4, 8.0, 0.0, Some(&targets)).unwrap();
    let vm = model.add_lora(&cfg, 13).unwrap();
    randomize_b(&vm, 5, 0.05);
    let reqs = vec![
        GenerationRequest {
            prompt_ids: vec![380, 361, 10, 67, 14, 265, 8, 90, 3],
            num_samples: 3,
            seed: 11,
        },
        GenerationRequest {
            prompt_ids: vec![5, 17],
            num_samples: 2,
            seed: 4,
        },
    ];
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 12,
        stop_token_ids: Some(vec![]),
        ..Default::default()
    };
    let apart = generate_deterministic(&model, &reqs, &params).unwrap();
    let (stacked, _) = generate_with_stats(&model, &reqs, &params).unwrap();
    let base = Transformer::load(&fixture("qwen2-tiny"), &dev, DType::F32).unwrap();
    let (unadapted, _) = generate_with_stats(&base, &reqs, &params).unwrap();
    let mut moved = 0f32;
    for ((a, s), u) in apart
        .iter()
        .flatten()
        .zip(stacked.iter().flatten())
        .zip(unadapted.iter().flatten())
    {
        assert_eq!(a.completion_ids, s.completion_ids);
        let pairs = a.sampler_logprobs.iter().zip(&s.sampler_logprobs);
        for (x, y) in pairs {
            assert!((x - y).abs() <= 1e-5, "separate {x} vs stacked {y}");
        }
        if a.completion_ids == u.completion_ids {
            let pairs = a.sampler_logprobs.iter().zip(&u.sampler_logprobs);
            moved = pairs.fold(moved, |m, (x, y)| m.max((x - y).abs()));
        } else {
            moved = f32::INFINITY;
        }
    }
    // The adapters change what is sampled: the comparison above is not of two base models.
    assert!(
        moved > 1e-3,
        "the adapters moved the log-probs by only {moved}"
    );
}
