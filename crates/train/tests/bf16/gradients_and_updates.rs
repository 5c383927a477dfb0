//! Through the bf16 forward: every master's f32 gradient, an update close to the f32 one, the
//! compute copy cast again after every optimizer step.

use super::runs_and_resume::{all_channels_with_reference, opts, write};
use super::*;

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
