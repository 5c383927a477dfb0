//! `[model] use_peft = true` on a transformers-written HF checkpoint (qwen2-tiny): during the
//! run the base weights stay byte-identical to the fixture's file and only the adapters move;
//! rollouts sample the adapted model (equal to the base model's while `lora_B` is zero,
//! different once it is not); the checkpoint is a PEFT adapter (PEFT's names, no full
//! weights, optimizer state for the adapter only) that composer-model's PEFT loader turns
//! into a model with the trainer's logits; the `--merge` export has the same logits; a run
//! stopped at step 2 and resumed ends with the same bytes as the uninterrupted one.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use composer_model::lora::{export_adapter, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use composer_model::Transformer;
use composer_telemetry::TrainProgress;
use composer_train::model::PolicyModel;
use composer_train::rollout::sample_rollouts;
use composer_train::session::Session;
use composer_train::{run_train, run_train_with, StepExtras, StepHook, TrainOptions};

mod common;
use common::{hf_fixture, train_metrics};

/// The adapted projections of the recipe below, in each of the fixture's 2 layers.
const TARGETS: [&str; 3] = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"];

fn write_recipe(dir: &Path) -> PathBuf {
    let model = hf_fixture("qwen2-tiny");
    let data = dir.join("rows.jsonl");
    let mut rows = String::new();
    for q in [
        "What is 2+2?",
        "What is 3+4?",
        "Name a prime.",
        "Reverse 'abc'.",
    ] {
        let row = serde_json::json!({"messages": [{"role": "user", "content": q}], "answer": "x"});
        rows.push_str(&format!("{row}\n"));
    }
    std::fs::write(&data, rows).unwrap();
    let recipe = dir.join("recipe.toml");
    // The random fixture emits "A" in about half of its short chat completions: a regex
    // verifier on it gives groups with reward variance, so the adapters get gradients.
    std::fs::write(
        &recipe,
        format!(
            r#"
[model]
path = {model:?}
use_peft = true
lora_r = 4
lora_alpha = 16.0
lora_dropout = 0.1
lora_target_modules = ["q_proj", "v_proj", "down_proj"]

[data]
dataset = {data:?}
eval_dataset = {data:?}
verifiers = [{{ kind = "regex", weight = 1.0, pattern = "A" }}]

[rollout]
num_generations = 4
max_completion_length = 6
temperature = 1.0

[loss]
beta = 0.04
ref_model_path = {model:?}

[optimizer]
lr = 0.02

[train]
steps = 4
prompts_per_step = 2
seed = 5
eval_every = 0
checkpoint_every = 2
"#
        ),
    )
    .unwrap();
    recipe
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

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// Every adapter tensor name PEFT gives the recipe's targets on the 2-layer fixture.
fn peft_names() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for layer in 0..2 {
        for t in TARGETS {
            for which in ["lora_A", "lora_B"] {
                out.insert(format!(
                    "base_model.model.model.layers.{layer}.{t}.{which}.weight"
                ));
            }
        }
    }
    out
}

/// Token ids the logits are compared on.
fn probe_ids() -> Tensor {
    Tensor::new(&[[5u32, 17, 42, 99, 3, 250, 7]], &Device::Cpu).unwrap()
}

fn logits(t: &Transformer) -> Vec<f32> {
    flat(&t.forward(&probe_ids(), None).unwrap())
}

/// Watches the run from inside the step loop.
struct Probe {
    /// The fixture's weights, as the trainer must keep them.
    base_file: HashMap<String, Tensor>,
    /// The fixture without adapters: what rollouts would be without LoRA.
    base_policy: PolicyModel,
    /// Steps after which rollouts of the policy differed from the base model's.
    differing_steps: Vec<usize>,
    /// The policy's logits after the last step.
    final_logits: Option<Vec<f32>>,
}

impl Probe {
    fn base_unchanged(&self, s: &Session) {
        let named = s.model.transformer.named_tensors();
        assert_eq!(named.len(), self.base_file.len());
        for (name, t) in named {
            let want = &self.base_file[&name];
            assert!(
                flat(&t) == flat(want),
                "base weight {name} differs from the fixture's file"
            );
        }
    }

    /// Sampler log-probs of the step's rollouts under `model` (the trainer's own sampler).
    fn rollout_logprobs(s: &Session, model: &PolicyModel, step: usize) -> Vec<f32> {
        let b = sample_rollouts(
            model,
            0,
            &s.recipe,
            &s.train_rows,
            &s.tok,
            &s.stop_ids,
            step,
            0,
        )
        .unwrap();
        b.samples
            .iter()
            .flat_map(|r| r.sampler_logprobs.clone())
            .collect()
    }
}

impl StepHook for Probe {
    fn before_loop(&mut self, s: &mut Session, _p: &TrainProgress) -> Result<()> {
        assert!(s.model.lora().is_some());
        self.base_unchanged(s);
        // The only variables are the adapters, by PEFT's names.
        let vars: BTreeSet<String> = s.model.weights()?.into_iter().map(|(n, _)| n).collect();
        assert_eq!(vars, peft_names());
        // lora_B = 0: the adapted model samples exactly as the base model — bitwise: both
        // decode with the same stacked q/k/v and gate/up products, and the adapters' packed
        // delta (x·Aᵀ·(s·B)ᵀ, block-diagonal B) is exactly zero.
        assert_eq!(
            Self::rollout_logprobs(s, &s.model, 1),
            Self::rollout_logprobs(s, &self.base_policy, 1)
        );
        Ok(())
    }

    fn after_step(&mut self, s: &mut Session, step: usize) -> Result<StepExtras> {
        self.base_unchanged(s);
        let b_nonzero = s
            .model
            .weights()?
            .iter()
            .any(|(n, t)| n.contains("lora_B") && flat(t).iter().any(|x| *x != 0.0));
        if b_nonzero {
            let ours = Self::rollout_logprobs(s, &s.model, step + 1);
            let base = Self::rollout_logprobs(s, &self.base_policy, step + 1);
            if ours != base {
                self.differing_steps.push(step);
            }
        }
        self.final_logits = Some(logits(&s.model.transformer));
        Ok(StepExtras::default())
    }
}

#[test]
fn lora_on_an_hf_checkpoint_trains_only_the_adapter_and_checkpoints_it_in_peft_format() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = write_recipe(tmp.path());
    let fixture = hf_fixture("qwen2-tiny");
    let base_file =
        candle_core::safetensors::load(fixture.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut probe = Probe {
        base_file,
        base_policy: PolicyModel::load_hf(&fixture, &Device::Cpu).unwrap(),
        differing_steps: Vec::new(),
        final_logits: None,
    };
    let a = tmp.path().join("a");
    let out = run_train_with(&opts(&recipe, &a, None), &mut probe).unwrap();
    assert_eq!(out.steps_completed, 4);
    assert_eq!(train_metrics(&a).len(), 4);
    // Rollouts use the adapted model: once lora_B moved, the same draws give other log-probs.
    assert!(
        !probe.differing_steps.is_empty(),
        "rollouts never differed from the base model's"
    );

    // The checkpoint: PEFT's adapter files and nothing of the full weights.
    let ck = a.join("checkpoint");
    let conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join(ADAPTER_CONFIG_FILE)).unwrap())
            .unwrap();
    assert_eq!(conf["peft_type"], "LORA");
    assert_eq!(conf["task_type"], "CAUSAL_LM");
    assert_eq!(conf["r"], 4);
    assert_eq!(conf["lora_alpha"], 16.0);
    assert_eq!(conf["lora_dropout"], 0.1);
    let targets: BTreeSet<&str> = conf["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(targets, BTreeSet::from(["q_proj", "v_proj", "down_proj"]));
    assert_eq!(
        PathBuf::from(conf["base_model_name_or_path"].as_str().unwrap()),
        std::path::absolute(&fixture).unwrap()
    );
    let adapter =
        candle_core::safetensors::load(ck.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu).unwrap();
    assert_eq!(
        adapter.keys().cloned().collect::<BTreeSet<_>>(),
        peft_names()
    );
    let safetensors: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    // The `ref_model_path` reference is reloaded from there on resume, not copied.
    assert_eq!(
        safetensors
            .iter()
            .map(|s| s.as_str())
            .collect::<BTreeSet<_>>(),
        BTreeSet::from([ADAPTER_WEIGHTS_FILE, "optimizer.safetensors"]),
    );
    let opt =
        candle_core::safetensors::load(ck.join("optimizer.safetensors"), &Device::Cpu).unwrap();
    let want: BTreeSet<String> = peft_names()
        .iter()
        .flat_map(|n| [format!("m.{n}"), format!("v.{n}")])
        .collect();
    assert_eq!(opt.keys().cloned().collect::<BTreeSet<_>>(), want);
    for f in [
        "tokenizer.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        assert!(ck.join(f).is_file(), "{f} copied from the base model");
    }

    // composer-model's PEFT loader on the saved adapter: the trainer's logits.
    let ours = probe.final_logits.clone().unwrap();
    let mut loaded = Transformer::load(&fixture, &Device::Cpu, DType::F32).unwrap();
    loaded.load_lora(&ck).unwrap();
    let d = max_abs_diff(&logits(&loaded), &ours);
    assert!(d <= 1e-6, "PEFT-loaded adapter vs the trainer's model: {d}");
    // ... which differ from the base model's.
    let base = Transformer::load(&fixture, &Device::Cpu, DType::F32).unwrap();
    assert!(max_abs_diff(&logits(&base), &ours) > 1e-4);
    // `export --merge`: full HF weights with the same logits; the tokenizer side copied.
    let merged_dir = tmp.path().join("merged");
    export_adapter(&ck, &merged_dir, true).unwrap();
    let merged = Transformer::load(&merged_dir, &Device::Cpu, DType::F32).unwrap();
    let d = max_abs_diff(&logits(&merged), &ours);
    assert!(d < 1e-4, "merged export vs the trainer's model: {d}");
    assert!(merged_dir.join("tokenizer.json").is_file());

    // Stopped after step 2 and resumed: the same adapter, optimizer state and metrics.
    let b = tmp.path().join("b");
    assert_eq!(
        run_train(&opts(&recipe, &b, Some(2)))
            .unwrap()
            .steps_completed,
        2
    );
    let resumed = run_train(&TrainOptions {
        resume: Some(b.clone()),
        quiet: true,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(resumed.steps_completed, 4);
    for f in [
        ADAPTER_WEIGHTS_FILE,
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        let read = |d: &Path| std::fs::read(d.join("checkpoint").join(f)).unwrap();
        assert!(read(&a) == read(&b), "{f} differs after resume");
    }
    let stable = |d: &Path| -> Vec<serde_json::Value> {
        train_metrics(d)
            .into_iter()
            .map(|mut l| {
                l.as_object_mut()
                    .unwrap()
                    .retain(|k, _| !k.ends_with("_s") && !k.contains("time") && k != "ts");
                l
            })
            .collect()
    };
    assert_eq!(stable(&a), stable(&b), "resumed run's metrics differ");
}
