//! `[model] use_peft = true` on the built-in model: only LoRA adapters train; checkpoints hold
//! PEFT's adapter files and the adapters' optimizer state only; a resumed run (with a warm-up,
//! so the reference holds a non-zero adapter) ends with the uninterrupted run's bytes; the
//! `--merge` export equals the adapted model; the async generator samples adapted snapshots;
//! bad `lora_*` keys and models LoRA cannot apply to are refused at parse time.
//! (The HF-checkpoint run is in lora_hf.rs.)

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use composer_model::lora::{export_adapter, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use composer_model::Transformer;
use composer_train::recipe::{parse_recipe, EMBEDDED_DEFAULT_RECIPE, EXAMPLE_RECIPE};
use composer_train::{run_train, TrainOptions};

mod common;
use common::tiny_model_and_task;

const LORA: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 4
max_completion_length = 3

[train]
steps = 4
prompts_per_step = 4
seed = 3
eval_every = 2
checkpoint_every = 2

[loss]
beta = 0.04

[warmup]
steps = 3
batch_size = 4
lr = 0.05

[optimizer]
lr = 0.01
"#
);

/// The tiny recipe with LoRA keys added to `[model]` (before `[model.builtin_tiny]`).
fn lora_recipe(keys: &str) -> String {
    format!("[model]\n{keys}\n{LORA}")
}

fn opts(recipe: &Path, run_dir: &Path, steps: Option<usize>) -> TrainOptions {
    TrainOptions {
        recipe_path: Some(recipe.to_path_buf()),
        quiet: true,
        run_dir_override: Some(run_dir.to_path_buf()),
        max_steps_override: steps,
        ..Default::default()
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn lora_run_stores_only_the_adapter_resumes_and_exports_merged_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    std::fs::write(
        &recipe,
        lora_recipe(
            "use_peft = true\nlora_r = 4\nlora_alpha = 8.0\nlora_dropout = 0.1\nlora_target_modules = \"all-linear\"",
        ),
    )
    .unwrap();

    // A 4-step run, and a 2-step run resumed to 4: the same metrics (dropout included).
    let a = tmp.path().join("a");
    assert_eq!(
        run_train(&opts(&recipe, &a, None)).unwrap().steps_completed,
        4
    );
    let b = tmp.path().join("b");
    run_train(&opts(&recipe, &b, Some(2))).unwrap();
    let resumed = run_train(&TrainOptions {
        resume: Some(b.clone()),
        quiet: true,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(resumed.steps_completed, 4);
    let metrics = |d: &Path| -> Vec<serde_json::Value> {
        composer_telemetry::read_metrics(&d.join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .map(|mut r| {
                r.as_object_mut()
                    .unwrap()
                    .retain(|k, _| k.starts_with("loss") || k.starts_with("reward") || k == "kl");
                r
            })
            .collect()
    };
    assert_eq!(metrics(&a), metrics(&b), "resumed LoRA run differs");
    // Bit-exact: the adapter, its optimizer state and the reference (a dropout-free copy of
    // the adapter at RL start) are the uninterrupted run's bytes.
    for f in [
        ADAPTER_WEIGHTS_FILE,
        "optimizer.safetensors",
        "reference.safetensors",
    ] {
        let read = |d: &Path| std::fs::read(d.join("checkpoint").join(f)).unwrap();
        assert!(read(&a) == read(&b), "{f} differs after resume");
    }

    // The checkpoint: PEFT's adapter files, no full weights; optimizer state for adapters only.
    let ck = a.join("checkpoint");
    assert!(ck.join(ADAPTER_CONFIG_FILE).is_file());
    assert!(
        !ck.join("model.safetensors").exists(),
        "a LoRA checkpoint stores only the adapter"
    );
    let adapter =
        candle_core::safetensors::load(ck.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu).unwrap();
    assert_eq!(adapter.len(), 2 * 7, "A and B of 7 projections in 1 layer");
    for name in adapter.keys() {
        assert!(
            name.starts_with("base_model.model.model.layers.0.") && name.contains(".lora_"),
            "{name}"
        );
    }
    let trained_b = adapter
        .iter()
        .filter(|(k, _)| k.contains("lora_B"))
        .all(|(_, t)| flat(t).iter().any(|x| *x != 0.0));
    assert!(trained_b, "every lora_B moved off zero");
    let opt =
        candle_core::safetensors::load(ck.join("optimizer.safetensors"), &Device::Cpu).unwrap();
    assert!(!opt.is_empty());
    for name in opt.keys() {
        assert!(
            name.contains(".lora_"),
            "optimizer state for a non-adapter tensor: {name}"
        );
    }
    let conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join(ADAPTER_CONFIG_FILE)).unwrap())
            .unwrap();
    let base_dir = Path::new(conf["base_model_name_or_path"].as_str().unwrap()).to_path_buf();
    assert_eq!(base_dir, std::path::absolute(a.join("base_model")).unwrap());

    // The frozen base: what a fresh run of the same seed starts from, untouched by training.
    let c = tmp.path().join("c");
    std::fs::write(&recipe, lora_recipe("use_peft = true\nlora_r = 4\nlora_alpha = 8.0\nlora_dropout = 0.1\nlora_target_modules = \"all-linear\"").replace("steps = 4", "steps = 1")).unwrap();
    run_train(&opts(&recipe, &c, None)).unwrap();
    let base_a =
        candle_core::safetensors::load(base_dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let base_c =
        candle_core::safetensors::load(c.join("base_model/model.safetensors"), &Device::Cpu)
            .unwrap();
    for (k, t) in &base_a {
        assert_eq!(flat(t), flat(&base_c[k]), "base weight {k}");
    }

    // `composer-rl export --merge`: full weights whose logits are the adapted model's.
    let merged_dir = tmp.path().join("merged");
    export_adapter(&ck, &merged_dir, true).unwrap();
    assert!(merged_dir.join("tokenizer.json").is_file());
    let merged = Transformer::load(&merged_dir, &Device::Cpu, DType::F32).unwrap();
    let mut adapted = Transformer::load(&base_dir, &Device::Cpu, DType::F32).unwrap();
    adapted.load_lora(&ck).unwrap();
    let ids = Tensor::new(&[[1u32, 2, 3, 4, 5]], &Device::Cpu).unwrap();
    let (x, y) = (
        flat(&merged.forward(&ids, None).unwrap().flatten_all().unwrap()),
        flat(&adapted.forward(&ids, None).unwrap().flatten_all().unwrap()),
    );
    let d = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-4, "merged vs adapted: {d}");
    // Without --merge: the PEFT adapter directory.
    let adapter_out = tmp.path().join("adapter");
    export_adapter(&ck, &adapter_out, false).unwrap();
    assert!(adapter_out.join(ADAPTER_WEIGHTS_FILE).is_file());
    // A full checkpoint is no LoRA checkpoint.
    let e = format!(
        "{:#}",
        export_adapter(&merged_dir, &tmp.path().join("x"), true).unwrap_err()
    );
    assert!(e.contains(ADAPTER_CONFIG_FILE), "{e}");
}

#[test]
fn bad_lora_keys_are_refused_naming_the_key() {
    let refuse = |keys: &str| -> String {
        let text = format!("[model]\n{keys}\n{EMBEDDED_DEFAULT_RECIPE}");
        match parse_recipe(&text, Path::new("recipes/bad.toml")) {
            Ok(_) => panic!("accepted: {keys}"),
            Err(e) => e.to_string(),
        }
    };
    for (keys, key) in [
        ("use_peft = true\nlora_r = 0", "lora_r"),
        ("use_peft = true\nlora_alpha = -2.0", "lora_alpha"),
        ("use_peft = true\nlora_dropout = 1.5", "lora_dropout"),
        ("use_peft = true\nlora_r = -1", "lora_r"),
        ("use_peft = true\nlora_alpha = 0.0", "lora_alpha"),
        ("use_peft = true\nlora_alpha = nan", "lora_alpha"),
        ("use_peft = true\nlora_dropout = 1.0", "lora_dropout"),
        ("use_peft = true\nlora_dropout = -0.1", "lora_dropout"),
        (
            "use_peft = true\nlora_target_modules = [\"qkv\"]",
            "lora_target_modules",
        ),
        (
            "use_peft = true\nlora_target_modules = [\"lm_head\"]",
            "lora_target_modules",
        ),
        (
            "use_peft = true\nlora_target_modules = []",
            "lora_target_modules",
        ),
        (
            "use_peft = true\nlora_target_modules = [\"all-linear\", \"q_proj\"]",
            "lora_target_modules",
        ),
        // A single string other than "all-linear" is PEFT's regex form.
        (
            "use_peft = true\nlora_target_modules = \"q_proj\"",
            "lora_target_modules",
        ),
    ] {
        let e = refuse(keys);
        assert!(
            e.contains("recipes/bad.toml") && e.contains(key),
            "{keys}: {e}"
        );
    }
    // TRL refuses sync_ref_model with PEFT.
    let text = format!("[model]\nuse_peft = true\n{EMBEDDED_DEFAULT_RECIPE}").replacen(
        "[loss]\n",
        "[loss]\nsync_ref_model = true\n",
        1,
    );
    let e = format!(
        "{:#}",
        parse_recipe(&text, Path::new("recipes/bad.toml")).unwrap_err()
    );
    assert!(
        e.contains("recipes/bad.toml") && e.contains("sync_ref_model") && e.contains("use_peft"),
        "{e}"
    );
    // The same keys with use_peft off are the plain trainer's recipe.
    let text = text.replacen("use_peft = true", "use_peft = false", 1);
    parse_recipe(&text, Path::new("recipes/ok.toml")).unwrap();
    // The example recipe's documented LoRA keys, uncommented, are a valid recipe.
    let mut example = EXAMPLE_RECIPE.replacen("# use_peft = false", "use_peft = true", 1);
    for key in [
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
    ] {
        example = example.replacen(&format!("# {key} = "), &format!("{key} = "), 1);
    }
    let r = parse_recipe(&example, Path::new("example.toml")).unwrap();
    let cfg = r.model.lora_config().unwrap().expect("use_peft = true");
    assert_eq!((cfg.r, cfg.alpha, cfg.dropout), (16, 32.0, 0.05));
    assert_eq!(cfg.target_modules, ["q_proj", "v_proj"]);
    // A misspelt key is refused by the schema.
    let e = refuse("lora_rank = 8");
    assert!(e.contains("lora_rank"), "{e}");
}

/// A recipe with `[model] path = dir` and `use_peft = true`.
fn hf_lora_recipe(dir: &Path) -> String {
    format!("[model]\npath = {dir:?}\nuse_peft = true\n\n[data]\ntask = \"arithmetic\"\n")
}

#[test]
fn lora_on_a_model_it_cannot_apply_to_is_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let origin = Path::new("recipes/bad.toml");
    // A family composer-model does not adapt (only its config.json is read).
    let gpt2 = tmp.path().join("gpt2");
    std::fs::create_dir_all(&gpt2).unwrap();
    std::fs::write(
        gpt2.join("config.json"),
        r#"{"model_type": "gpt2", "vocab_size": 10, "n_embd": 8}"#,
    )
    .unwrap();
    let e = format!(
        "{:#}",
        parse_recipe(&hf_lora_recipe(&gpt2), origin).unwrap_err()
    );
    assert!(
        e.contains("recipes/bad.toml") && e.contains("use_peft") && e.contains("gpt2"),
        "{e}"
    );
    // A missing directory.
    let e = format!(
        "{:#}",
        parse_recipe(&hf_lora_recipe(&tmp.path().join("nope")), origin).unwrap_err()
    );
    assert!(e.contains("use_peft") && e.contains("nope"), "{e}");
    // A PEFT adapter directory (e.g. a LoRA run's checkpoint) is no model to adapt.
    let adapter = tmp.path().join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    std::fs::copy(
        common::hf_fixture("qwen2-tiny").join("config.json"),
        adapter.join("config.json"),
    )
    .unwrap();
    std::fs::write(adapter.join(ADAPTER_CONFIG_FILE), "{}").unwrap();
    let e = format!(
        "{:#}",
        parse_recipe(&hf_lora_recipe(&adapter), origin).unwrap_err()
    );
    assert!(
        e.contains("[model] path") && e.contains(ADAPTER_CONFIG_FILE) && e.contains("--merge"),
        "{e}"
    );
    // The real fixture is accepted.
    parse_recipe(&hf_lora_recipe(&common::hf_fixture("qwen2-tiny")), origin).unwrap();
}

/// Metric values that depend neither on timing nor on the layout's bookkeeping (as
/// tests/async_mode.rs compares the layouts).
fn stable_metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    common::train_metrics(run_dir)
        .into_iter()
        .map(|mut l| {
            l.as_object_mut().unwrap().retain(|k, _| {
                !["time/", "staleness/", "actors/", "idle/"]
                    .iter()
                    .any(|p| k.starts_with(p))
                    && k != "tokens_per_s"
                    && k != "env/latency_s"
            });
            l
        })
        .collect()
}

#[test]
fn lora_async_generator_samples_the_adapted_snapshot() {
    // With max_staleness = 0 the async layout is the sync run: its generator samples the
    // published snapshots, so equal runs mean the snapshots carry the trained adapter.
    let tmp = tempfile::tempdir().unwrap();
    let keys = "use_peft = true\nlora_r = 4\nlora_alpha = 8.0\nlora_dropout = 0.1";
    let sync = tmp.path().join("sync.toml");
    std::fs::write(&sync, lora_recipe(keys)).unwrap();
    let asynch = tmp.path().join("async.toml");
    std::fs::write(
        &asynch,
        lora_recipe(keys).replacen(
            "checkpoint_every = 2\n",
            "checkpoint_every = 2\nmode = \"async\"\nmax_staleness = 0\n",
            1,
        ),
    )
    .unwrap();
    let (s, a) = (tmp.path().join("s"), tmp.path().join("a"));
    assert_eq!(
        run_train(&opts(&sync, &s, None)).unwrap().steps_completed,
        4
    );
    assert_eq!(
        run_train(&opts(&asynch, &a, None)).unwrap().steps_completed,
        4
    );
    let ms = stable_metrics(&s);
    assert!(
        ms.iter().any(|l| l["loss/rlvr"].as_f64() != Some(0.0)),
        "the adapters never trained: {ms:?}"
    );
    assert_eq!(ms, stable_metrics(&a), "async (max_staleness 0) vs sync");
    let read = |d: &Path| std::fs::read(d.join("checkpoint").join(ADAPTER_WEIGHTS_FILE)).unwrap();
    assert!(read(&s) == read(&a), "adapters differ");
}
