//! `composer-rl export` of the real binary on a LoRA run's checkpoint (`use_peft = true`, the
//! built-in model trained by `composer-rl train`): `--merge` writes full HF weights whose
//! logits equal the base model with the adapter loaded by composer-model's PEFT loader;
//! without `--merge` the PEFT adapter files come out byte-identical; `generate` on the adapter
//! directory points at the export; a full checkpoint is refused naming the missing
//! adapter_config.json.

use std::path::Path;
use std::process::{Command, Output};

use candle_core::{DType, Device, Tensor};
use composer_model::lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use composer_model::Transformer;

const RECIPE: &str = r#"
[model]
use_peft = true
lora_r = 4
lora_alpha = 8.0
lora_dropout = 0.0
lora_target_modules = "all-linear"

[model.builtin_tiny]
hidden_size = 16
layers = 1
heads = 2
kv_heads = 1
intermediate_size = 32

[data]
task = "arithmetic"
eval_size = 10

[data.arithmetic]
digits = 1

[rollout]
num_generations = 4
max_completion_length = 3

[warmup]
steps = 3
batch_size = 4
lr = 0.05

[train]
steps = 2
prompts_per_step = 4
seed = 3
eval_every = 0
checkpoint_every = 2
"#;

fn composer_rl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(args)
        .output()
        .expect("running composer-rl")
}

fn ok(args: &[&str]) {
    let out = composer_rl(args);
    assert!(
        out.status.success(),
        "composer-rl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn logits(t: &Transformer) -> Vec<f32> {
    let ids = Tensor::new(&[[1u32, 4, 2, 7, 3, 5]], &Device::Cpu).unwrap();
    t.forward(&ids, None)
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
        .fold(0f32, f32::max)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn export_merges_a_lora_checkpoint_into_full_weights_with_the_adapted_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    std::fs::write(&recipe, RECIPE).unwrap();
    let run = tmp.path().join("run");
    ok(&["train", s(&recipe), "--run-dir", s(&run), "--quiet"]);
    let ck = run.join("checkpoint");

    // The adapted model, as PEFT would build it: the base its adapter_config.json names,
    // plus the adapter.
    let conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join(ADAPTER_CONFIG_FILE)).unwrap())
            .unwrap();
    let base_dir = Path::new(conf["base_model_name_or_path"].as_str().unwrap()).to_path_buf();
    let base = Transformer::load(&base_dir, &Device::Cpu, DType::F32).unwrap();
    let mut adapted = base.clone();
    adapted.load_lora(&ck).unwrap();
    let adapted_logits = logits(&adapted);
    assert!(
        max_abs_diff(&adapted_logits, &logits(&base)) > 1e-4,
        "the adapter never moved: the merge check would be vacuous"
    );

    let merged = tmp.path().join("merged");
    ok(&["export", s(&ck), "--out", s(&merged), "--merge"]);
    assert!(merged.join("config.json").is_file());
    assert!(!merged.join(ADAPTER_CONFIG_FILE).exists());
    assert!(merged.join("tokenizer.json").is_file());
    let full = Transformer::load(&merged, &Device::Cpu, DType::F32).unwrap();
    assert!(full.lora.is_none());
    let d = max_abs_diff(&logits(&full), &adapted_logits);
    assert!(d < 1e-4, "merged vs adapted logits: {d}");

    // Without --merge: PEFT's two files, byte-identical.
    let adapter = tmp.path().join("adapter");
    ok(&["export", s(&ck), "--out", s(&adapter)]);
    for f in [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE] {
        assert_eq!(
            std::fs::read(adapter.join(f)).unwrap(),
            std::fs::read(ck.join(f)).unwrap(),
            "{f}"
        );
    }
    assert!(!adapter.join("model.safetensors").exists());

    // `generate` on the adapter directory points at the export.
    let out = composer_rl(&["generate", "--model", s(&ck), "--prompt", "1+1="]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(ADAPTER_CONFIG_FILE) && err.contains("--merge"),
        "{err}"
    );

    // A full checkpoint has no adapter to export.
    let out = composer_rl(&["export", s(&merged), "--out", s(&tmp.path().join("x"))]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(ADAPTER_CONFIG_FILE) && err.contains(s(&merged)),
        "{err}"
    );
}
