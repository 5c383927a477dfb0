//! `[train] bf16` (TRL's key): the forward and backward of every training pass run on a bf16
//! copy of the f32 master weights; gradients come back to f32, AdamW and its moments stay f32,
//! checkpoints store the f32 masters, and rollouts sample with the bf16 copy. Checks: every
//! trainable parameter (full model, HF fixture, LoRA adapters) gets a nonzero f32 gradient
//! through the bf16 forward; the trainer's bf16 update on a batch is close to its f32 update
//! on the same batch (and not equal to it: the bf16 path ran); the bf16 copy is cast again
//! after every optimizer step and is what async generators get; bf16 runs (every loss
//! channel with an EMA reference; LoRA; async; packed and checkpointed; an HF checkpoint with
//! a `ref_model_path` reference) keep f32 masters in their checkpoints and resume exactly;
//! `fp16 = true` and a non-boolean `bf16` are refused naming the key.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use composer_train::batch::{token_batch, token_stats};
use composer_train::model::{PolicyModel, TinyConfig};
use composer_train::trainer::{
    open_session, reward_batch, rollout_batch, step_advantages, train_on_batch,
};
use composer_train::{run_train, TrainOptions};
use serde_json::Value;

mod common;
use common::{all_channels_rollout, hf_fixture, tiny_model_and_task, train_metrics};

/// (prompt, completion) pairs of different lengths.
const PAIRS: [(&[u32], &[u32]); 3] = [
    (&[3, 9, 4], &[7, 2, 8, 1]),
    (&[5], &[6, 2]),
    (&[1, 2, 3, 4, 5], &[9]),
];

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn l2(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

fn tiny() -> PolicyModel {
    let cfg = TinyConfig {
        hidden_size: 16,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 24,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        init_std: 0.02,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
    }
    .model_config(12, 0)
    .unwrap();
    PolicyModel::random_init(&cfg, 3, &Device::Cpu).unwrap()
}

/// The f32 gradient, by master name, of a loss using the target log-probs, the entropy and
/// the top-3 log-probs (every head output the loss channels read).
fn master_grads(model: &PolicyModel) -> HashMap<String, Tensor> {
    let tb = token_batch(&PAIRS, 0, &Device::Cpu).unwrap();
    let st = token_stats(model, &tb, 0.8, None, 3).unwrap();
    assert_eq!(st.logprobs.dtype(), DType::F32, "log-probs are f32");
    let loss = ((&st.logprobs * &tb.mask).unwrap().sum_all().unwrap()
        + (&st.entropy * 0.3).unwrap().sum_all().unwrap()
        + (st.topk_logprobs.as_ref().unwrap() * 0.1)
            .unwrap()
            .sum_all()
            .unwrap())
    .unwrap();
    model.master_grads(&loss.backward().unwrap()).unwrap()
}

/// Every master is f32 and gets a finite, nonzero f32 gradient (the names in `zero_ok` may be
/// exactly zero: LoRA's A while B is still 0).
fn assert_every_master_gets_a_gradient(
    what: &str,
    model: &PolicyModel,
    zero_ok: &dyn Fn(&str) -> bool,
) {
    assert_eq!(model.compute_dtype(), DType::BF16, "{what}");
    let grads = master_grads(model);
    let weights = model.weights().unwrap();
    assert!(!weights.is_empty());
    for (name, w) in &weights {
        assert_eq!(w.dtype(), DType::F32, "{what}: master {name}");
        let g = grads
            .get(name)
            .unwrap_or_else(|| panic!("{what}: {name} got no gradient"));
        assert_eq!(g.dtype(), DType::F32, "{what}: gradient of {name}");
        assert_eq!(g.dims(), w.dims(), "{what}: gradient of {name}");
        let g = flat(g);
        assert!(g.iter().all(|v| v.is_finite()), "{what}: {name}");
        assert!(
            zero_ok(name) || l2(&g) > 0.0,
            "{what}: {name} got a zero gradient"
        );
    }
}

#[test]
fn every_trainable_parameter_gets_an_f32_gradient_through_the_bf16_forward() {
    // Built-in model: its bf16 gradients are close to the f32 model's.
    let f32_model = tiny();
    let want = master_grads(&f32_model);
    let mut model = tiny();
    model.set_compute_dtype(DType::BF16, 0).unwrap();
    assert_every_master_gets_a_gradient("tiny", &model, &|_| false);
    let got = master_grads(&model);
    let (mut diff, mut norm) = (0f64, 0f64);
    for (name, g) in &want {
        let (a, b) = (flat(g), flat(&got[name]));
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum::<f64>();
        // bf16 keeps 8 mantissa bits: each tensor's gradient within a few per cent.
        assert!(
            d.sqrt() <= 5e-2 * l2(&a),
            "{name}: bf16 gradient off by {:e}",
            d.sqrt() / l2(&a)
        );
        diff += d;
        norm += l2(&a).powi(2);
    }
    let rel = (diff / norm).sqrt();
    assert!(
        rel > 0.0 && rel < 2e-2,
        "bf16 vs f32 gradients: relative L2 {rel:e}"
    );

    // An HF checkpoint (Qwen3: q/k norms too).
    let mut hf = PolicyModel::load_hf(&hf_fixture("qwen3-tiny"), &Device::Cpu).unwrap();
    hf.set_compute_dtype(DType::BF16, 0).unwrap();
    assert_every_master_gets_a_gradient("qwen3-tiny", &hf, &|_| false);

    // LoRA: the adapters are the masters (f32), the frozen base is bf16.
    let tmp = tempfile::tempdir().unwrap();
    let mut lora = tiny();
    let targets = ["q_proj".to_string(), "down_proj".to_string()];
    let cfg = composer_model::LoraConfig::new(4, 8.0, 0.0, Some(&targets)).unwrap();
    lora.enable_lora(&cfg, 5, None, tmp.path()).unwrap();
    lora.set_compute_dtype(DType::BF16, 5).unwrap();
    assert_eq!(lora.transformer.model.embed_tokens.dtype(), DType::BF16);
    // B starts at 0, so A's gradient is 0 until B moves: B's must not be.
    assert_every_master_gets_a_gradient("lora", &lora, &|n| n.contains("lora_A"));
    // Loaded weights reach the bf16 copy: with B ≠ 0 every adapter gets a gradient.
    let moved: HashMap<String, Tensor> = lora
        .weights()
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let t = if n.contains("lora_B") {
                (t.ones_like().unwrap() * 0.01).unwrap()
            } else {
                t.copy().unwrap()
            };
            (n, t)
        })
        .collect();
    lora.set_weights(&moved, Path::new("moved")).unwrap();
    assert_every_master_gets_a_gradient("lora with B = 0.01", &lora, &|_| false);
}

/// The all-channels `[rollout]` / `[loss]` sections with a reference policy (`beta > 0`)
/// that an EMA of the policy updates every 2 steps.
fn all_channels_with_reference() -> String {
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

fn opts(recipe: &Path, run_dir: &Path) -> TrainOptions {
    TrainOptions {
        recipe_path: Some(recipe.to_path_buf()),
        quiet: true,
        run_dir_override: Some(run_dir.to_path_buf()),
        ..Default::default()
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
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
fn bf16_update_is_close_to_the_f32_update_on_the_same_batch() {
    // ε = 1 and no clipping: AdamW's first step is lr·g/(|g| + 1) ≈ lr·g, so the update is
    // proportional to the gradient and comparing updates compares the gradients that reached
    // the masters.
    let recipe = |bf16: bool| {
        format!(
            "{}{}\n[optimizer]\nlr = 0.01\neps = 1.0\nmax_grad_norm = 0.0\n\n[train]\nsteps = 1\nprompts_per_step = 4\nseed = 2\ngradient_accumulation_steps = 2\nbf16 = {bf16}\n\n[replay]\ntraces = [\"builtin:scripted\"]\n",
            tiny_model_and_task!(),
            all_channels_with_reference(),
        )
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut sessions = Vec::new();
    for bf16 in [false, true] {
        let name = format!("bf16-{bf16}");
        let r = write(tmp.path(), &format!("{name}.toml"), &recipe(bf16));
        sessions.push(open_session(&opts(&r, &tmp.path().join(name))).unwrap());
    }
    let (s32, s16) = sessions.split_at_mut(1);
    let (s32, s16) = (&mut s32[0], &mut s16[0]);
    assert_eq!(s16.model.compute_dtype(), DType::BF16);
    // One batch (sampled by the f32 policy) for both.
    let batch = rollout_batch(s32, 1).unwrap();
    let rewards = reward_batch(s32, &batch);
    // The untrained policy passes nothing (every advantage 0): fixed advantages of both signs
    // give the policy-gradient channel a signal; replay's DPO pairs the scripted teacher's
    // traces with the failing rollouts against the reference.
    assert_eq!(
        step_advantages(s32, &batch, &rewards).unwrap().len(),
        batch.samples.len()
    );
    let adv: Vec<f64> = (0..batch.samples.len())
        .map(|i| if i % 3 == 0 { 1.0 } else { -0.5 })
        .collect();
    let before: Vec<(String, Vec<f64>)> = s32
        .model
        .weights()
        .unwrap()
        .iter()
        .map(|(n, t)| (n.clone(), flat(t)))
        .collect();
    assert_eq!(
        before,
        s16.model
            .weights()
            .unwrap()
            .iter()
            .map(|(n, t)| (n.clone(), flat(t)))
            .collect::<Vec<_>>()
    );
    let mut deltas = Vec::new();
    for s in [&mut *s32, &mut *s16] {
        let stats = train_on_batch(s, 1, &batch, &rewards, &adv, false).unwrap();
        assert_eq!(stats.updates, 1);
        assert!(!stats.non_finite);
        let after = s.model.weights().unwrap();
        let d: Vec<Vec<f64>> = after
            .iter()
            .zip(&before)
            .map(|((n, t), (n0, w0))| {
                assert_eq!(n, n0);
                assert_eq!(t.dtype(), DType::F32, "master {n}");
                flat(t).iter().zip(w0).map(|(x, y)| x - y).collect()
            })
            .collect();
        deltas.push(d);
    }
    let (mut diff, mut norm) = (0f64, 0f64);
    for ((name, _), (d32, d16)) in before.iter().zip(deltas[0].iter().zip(&deltas[1])) {
        assert!(
            l2(d16) > 0.0,
            "{name}: the bf16 step did not move its master"
        );
        diff += d32
            .iter()
            .zip(d16)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f64>();
        norm += l2(d32).powi(2);
    }
    let rel = (diff / norm).sqrt();
    assert!(
        rel > 0.0,
        "the bf16 update equals the f32 one: bf16 did not run"
    );
    assert!(rel < 2e-2, "bf16 vs f32 update: relative L2 {rel:e}");
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

/// The bf16 weights the policy computes with: each master's name with its compute tensor.
fn compute_weights(model: &PolicyModel) -> HashMap<String, Vec<f64>> {
    model
        .transformer
        .named_tensors()
        .into_iter()
        .map(|(n, t)| {
            assert_eq!(t.dtype(), DType::BF16, "{n}");
            (n, flat(&t))
        })
        .collect()
}

/// Every master cast to bf16 equals the weight the forward reads: the copy is cast again
/// after the warm-up's and the RL step's optimizer steps, and what an async generator gets
/// (`sampling_copy`) holds exactly those values.
fn assert_compute_is_the_cast_masters(what: &str, model: &PolicyModel) {
    let compute = compute_weights(model);
    for (name, master) in model.weights().unwrap() {
        assert_eq!(master.dtype(), DType::F32, "{what}: {name}");
        let cast = flat(&master.to_dtype(DType::BF16).unwrap());
        assert_eq!(compute[&name], cast, "{what}: {name} is stale");
    }
    let copy = model.sampling_copy().unwrap();
    assert_eq!(compute_weights(&copy), compute, "{what}: sampling copy");
}

#[test]
fn the_compute_copy_follows_every_optimizer_step() {
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        "{}{}\n[train]\nsteps = 1\nprompts_per_step = 2\nbf16 = true\n\n[warmup]\nsteps = 2\nbatch_size = 4\n",
        tiny_model_and_task!(),
        all_channels_rollout!(),
    );
    let r = write(tmp.path(), "r.toml", &text);
    let mut s = open_session(&opts(&r, &tmp.path().join("run"))).unwrap();
    let masters = |s: &composer_train::session::Session| -> Vec<Vec<f64>> {
        s.model
            .weights()
            .unwrap()
            .iter()
            .map(|(_, t)| flat(t))
            .collect()
    };
    let initial = masters(&s);
    assert_compute_is_the_cast_masters("initial", &s.model);
    let w = s.recipe.warmup.clone().unwrap();
    composer_train::trainer::warmup(&mut s, &w).unwrap();
    assert!(
        masters(&s) != initial,
        "the warm-up did not move the masters"
    );
    assert_compute_is_the_cast_masters("after the warm-up", &s.model);
    let batch = rollout_batch(&s, 1).unwrap();
    let rewards = reward_batch(&s, &batch);
    let adv: Vec<f64> = (0..batch.samples.len())
        .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let stats = train_on_batch(&mut s, 1, &batch, &rewards, &adv, false).unwrap();
    assert_eq!(stats.updates, 1);
    assert_compute_is_the_cast_masters("after an RL step", &s.model);

    // The non-finite guard: a NaN loss (the test hook) skips the step; neither the masters
    // nor the copy move.
    let before = masters(&s);
    let stats = train_on_batch(&mut s, 2, &batch, &rewards, &adv, true).unwrap();
    assert!(stats.non_finite && stats.updates == 0, "{stats:?}");
    assert!(masters(&s) == before, "a non-finite step moved the masters");
    assert_compute_is_the_cast_masters("after a skipped step", &s.model);
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
