//! bf16 runs: f32 masters in their checkpoints, exact resumes (all channels, LoRA, async,
//! packing), bad keys refused, an HF checkpoint, deterministic rollouts.

use super::*;

/// The all-channels `[rollout]` / `[loss]` sections with a reference policy (`beta > 0`)
/// that an EMA of the policy updates every 2 steps.
pub(crate) fn all_channels_with_reference() -> String {
    all_channels_rollout!().replace(
        "replay_weight = 1.0\n",
        "replay_weight = 1.0\nbeta = 0.05\nsync_ref_model = true\nref_model_sync_steps = 2\n\
         ref_model_mixup_alpha = 0.5\n",
    )
}

/// The tiny model with every loss channel and a reference policy.
fn all_channels(extra_train: &str) -> String {
    let train = format!(
        r#"
[train]
steps = 4
prompts_per_step = 4
seed = 11
eval_every = 2
checkpoint_every = 2
num_iterations = 2
mini_batches = 2
gradient_accumulation_steps = 2
{extra_train}

[warmup]
steps = 6
batch_size = 8
hint_fraction = 0.3

[replay]
traces = ["builtin:scripted"]
"#
    );
    format!(
        "{}{}{train}",
        tiny_model_and_task!(),
        all_channels_with_reference()
    )
}

pub(crate) fn opts(recipe: &Path, run_dir: &Path) -> TrainOptions {
    TrainOptions {
        recipe_path: Some(recipe.to_path_buf()),
        quiet: true,
        run_dir_override: Some(run_dir.to_path_buf()),
        ..Default::default()
    }
}

pub(crate) fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Metric lines without wall-clock fields (nor the async actors' timing-dependent counts).
fn stable_metrics(run_dir: &Path) -> Vec<Value> {
    composer_telemetry::read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|mut l| {
            l.as_object_mut().unwrap().retain(|k, _| {
                !k.starts_with("time/")
                    && !k.starts_with("actors/")
                    && !k.starts_with("idle/")
                    && k != "tokens_per_s"
                    && k != "env/latency_s"
            });
            l
        })
        .collect()
}

/// The checkpoint's weights, optimizer state and reference policy are all f32.
fn assert_masters_are_f32(ck: &Path) {
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "reference.safetensors",
    ] {
        for (name, dt) in safetensors_dtypes(&ck.join(f)) {
            assert_eq!(dt, DType::F32, "{f}: {name}");
        }
    }
}

fn safetensors_dtypes(path: &Path) -> Vec<(String, DType)> {
    let t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    assert!(!t.is_empty(), "{}", path.display());
    t.into_iter().map(|(k, v)| (k, v.dtype())).collect()
}

#[test]
fn bf16_run_keeps_f32_masters_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = write(tmp.path(), "bf16.toml", &all_channels("bf16 = true"));
    let a = tmp.path().join("a");
    assert_eq!(run_train(&opts(&recipe, &a)).unwrap().steps_completed, 4);
    let lines = train_metrics(&a);
    assert_eq!(lines.len(), 4);
    for l in &lines {
        for k in ["loss/rlvr", "loss/hint", "loss/replay", "kl", "grad_norm"] {
            let v = l[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{k} missing in {l}"));
            assert!(v.is_finite(), "{k} = {v}");
        }
        assert!(l["grad_norm"].as_f64().unwrap() > 0.0, "{l}");
    }
    // Masters, moments and the reference policy are stored in f32.
    let ck = a.join("checkpoint");
    assert_masters_are_f32(&ck);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["dtype"], "float32");

    // The bf16 path really ran: the f32 run of the same recipe logs other values.
    let f32_recipe = write(tmp.path(), "f32.toml", &all_channels(""));
    let f = tmp.path().join("f32");
    run_train(&opts(&f32_recipe, &f)).unwrap();
    assert_ne!(
        train_metrics(&f)[0]["loss/rlvr"],
        lines[0]["loss/rlvr"],
        "bf16 and f32 runs logged the same loss"
    );

    // 2 steps, then resume to 4: the same metrics, bit for bit.
    let b = tmp.path().join("b");
    let mut o = opts(&recipe, &b);
    o.max_steps_override = Some(2);
    assert_eq!(run_train(&o).unwrap().steps_completed, 2);
    let resumed = run_train(&TrainOptions {
        resume: Some(b.clone()),
        quiet: true,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(resumed.steps_completed, 4);
    assert_eq!(stable_metrics(&a), stable_metrics(&b));
}

/// A bf16 run of `text` for 4 steps, and one of 2 steps resumed to 4, log the same metrics;
/// returns the uninterrupted run's directory.
fn assert_resume_is_exact(dir: &Path, name: &str, text: &str) -> PathBuf {
    let recipe = write(dir, &format!("{name}.toml"), text);
    let a = dir.join(format!("{name}-a"));
    assert_eq!(
        run_train(&opts(&recipe, &a)).unwrap().steps_completed,
        4,
        "{name}"
    );
    let b = dir.join(format!("{name}-b"));
    let mut o = opts(&recipe, &b);
    o.max_steps_override = Some(2);
    assert_eq!(run_train(&o).unwrap().steps_completed, 2, "{name}");
    let resumed = run_train(&TrainOptions {
        resume: Some(b.clone()),
        quiet: true,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(resumed.steps_completed, 4, "{name}");
    let (la, lb) = (stable_metrics(&a), stable_metrics(&b));
    assert_eq!(la.len(), lb.len(), "{name}: metric lines");
    for (x, y) in la.iter().zip(&lb) {
        let (x, y) = (x.as_object().unwrap(), y.as_object().unwrap());
        for k in x.keys().chain(y.keys()) {
            assert_eq!(x.get(k), y.get(k), "{name}: {k} differs after resume");
        }
    }
    let norms: Vec<f64> = train_metrics(&a)
        .iter()
        .map(|l| l["grad_norm"].as_f64().unwrap())
        .collect();
    assert!(norms.iter().all(|g| g.is_finite()), "{name}: {norms:?}");
    assert!(
        norms.iter().any(|g| *g > 0.0),
        "{name}: no gradient {norms:?}"
    );
    a
}

#[test]
fn bf16_with_lora_async_and_packing_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    // LoRA with dropout: the adapters are the f32 masters, the frozen base computes in bf16.
    let lora = format!(
        "[model]\nuse_peft = true\nlora_r = 4\nlora_alpha = 8.0\nlora_dropout = 0.1\n\
         lora_target_modules = \"all-linear\"\n{}",
        all_channels("bf16 = true").replace("sync_ref_model = true\n", "")
    );
    let a = assert_resume_is_exact(tmp.path(), "lora", &lora);
    for (name, dt) in safetensors_dtypes(&a.join("checkpoint").join("adapter_model.safetensors")) {
        assert_eq!(dt, DType::F32, "adapter {name}");
    }
    for (name, dt) in safetensors_dtypes(&a.join("checkpoint").join("optimizer.safetensors")) {
        assert!(name.contains("lora_"), "{name}: only the adapters train");
        assert_eq!(dt, DType::F32, "optimizer {name}");
    }
    // The async layout: the generator samples published bf16 copies.
    assert_resume_is_exact(
        tmp.path(),
        "async",
        &all_channels("bf16 = true\nmode = \"async\"\nmax_staleness = 1"),
    );
    // Packed rows and recomputed layers on the bf16 copy.
    assert_resume_is_exact(
        tmp.path(),
        "packed",
        &all_channels("bf16 = true\npadding_free = true\ngradient_checkpointing = true"),
    );
}

#[test]
fn fp16_and_bad_bf16_values_are_refused_naming_the_key() {
    let refusal = |line: &str| {
        let text = format!("{}\n[train]\n{line}\n", tiny_model_and_task!());
        match composer_train::recipe::parse_recipe(&text, Path::new("bad.toml")) {
            Ok(_) => panic!("accepted: {line}"),
            Err(e) => format!("{e:#}"),
        }
    };
    let err = refusal("fp16 = true");
    assert!(
        err.contains("bad.toml")
            && err.contains("`[train] fp16` = true")
            && err.contains("bf16 = true"),
        "{err}"
    );
    let err = refusal("bf16 = \"yes\"");
    assert!(err.contains("bf16"), "{err}");
    for ok in ["fp16 = false", "bf16 = true", "bf16 = false"] {
        let text = format!("{}\n[train]\n{ok}\n", tiny_model_and_task!());
        composer_train::recipe::parse_recipe(&text, Path::new("ok.toml")).unwrap();
    }
}

#[test]
fn hf_checkpoint_trains_in_bf16_and_checkpoints_f32_masters() {
    let tmp = tempfile::tempdir().unwrap();
    let model = hf_fixture("qwen2-tiny");
    let data = tmp.path().join("data.jsonl");
    let rows: String = (1..=4)
        .map(|i| {
            format!(
                "{{\"prompt\": \"{i} + {i} =\", \"answer\": \"{}\"}}\n",
                2 * i
            )
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let text = format!(
        "[model]\npath = {model:?}\n\n[data]\ndataset = {data:?}\neval_dataset = {data:?}\n\n\
         verifiers = [{{ kind = \"regex\", pattern = \"[aeiou]\" }}]\n\n\
         [rollout]\nnum_generations = 4\nmax_completion_length = 4\n\n[loss]\nbeta = 0.05\nref_model_path = {model:?}\n\n\
         [train]\nsteps = 4\nprompts_per_step = 2\neval_every = 2\ncheckpoint_every = 2\n\
         bf16 = true\n"
    );
    let a = assert_resume_is_exact(tmp.path(), "hf", &text);
    // The reference (`ref_model_path`, the same checkpoint) computes in bf16 too: at step 1
    // it equals the policy bit for bit (an f32 reference would not).
    let kl = train_metrics(&a)[0]["kl"].as_f64().unwrap();
    assert_eq!(kl, 0.0, "step-1 KL to a bf16 copy of the same weights");
    let ck = a.join("checkpoint");
    assert_masters_are_f32(&ck);
    // The checkpoint loads as an HF model again, in the loaded checkpoint's dtype (f32).
    let loaded = composer_model::Transformer::load(&ck, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(
        loaded.cfg,
        PolicyModel::load_hf(&model, &Device::Cpu)
            .unwrap()
            .config()
            .clone()
    );
}

#[test]
fn deterministic_bf16_rollouts_score_bit_for_bit_as_the_trainer() {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        "{}{}\n[train]\nsteps = 2\nprompts_per_step = 2\neval_every = 0\nbf16 = true\n",
        tiny_model_and_task!(),
        all_channels_rollout!().replace(
            "[rollout]\n",
            "[rollout]\ndeterministic = true\ntemperature = 0.9\n"
        ),
    );
    let r = write(tmp.path(), "det.toml", &text);
    let run = tmp.path().join("run");
    run_train(&opts(&r, &run)).unwrap();
    let lines = train_metrics(&run);
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert_eq!(l["mismatch/max_abs"].as_f64(), Some(0.0), "{l}");
        assert_eq!(l["mismatch/kl"].as_f64(), Some(0.0), "{l}");
    }
}
