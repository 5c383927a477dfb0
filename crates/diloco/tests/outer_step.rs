//! Outer optimizer semantics, compression, streaming schedule and corrupt-object handling,
//! with replicas in one process over an in-memory or folder store.

use std::sync::Arc;

use candle_core::{Device, Var};
use composer_diloco::codec::{decode, encode, FlatTensor};
use composer_diloco::toy::{self, Dataset, Rng};
use composer_diloco::{open_store, outer, Compression, DilocoConfig, DilocoReplica, Phase};
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};

fn vals(vars: &[(String, Var)], name: &str) -> Vec<f32> {
    let v = &vars.iter().find(|(n, _)| n == name).unwrap().1;
    v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()
}

fn all_vals(vars: &[(String, Var)]) -> Vec<Vec<f32>> {
    let mut names: Vec<&String> = vars.iter().map(|(n, _)| n).collect();
    names.sort();
    names.iter().map(|n| vals(vars, n)).collect()
}

fn config(h: usize, replicas: usize) -> DilocoConfig {
    let mut c = DilocoConfig::new(h, replicas);
    c.quorum_timeout_s = 5.0;
    c.poll_interval_s = 0.005;
    c.store_retries = Some(1);
    c.store_backoff_s = 0.01;
    c
}

async fn memory() -> (Arc<dyn ObjectStore>, Path) {
    open_store("memory://").await.unwrap()
}

/// Issue 7 §1: one replica, outer lr 1, momentum 0 → θ_global − 1·(θ_global − θ_local) = θ_local,
/// bit for bit. This run has weights that cross zero (e.g. θ_global 0.0448 → θ_local −0.00582),
/// where an f32 Δ would round and break exactness; the f32 codec publishes θ_local and the
/// outer step forms Δ and θ_global − Δ in f64, so the round trip is exact.
#[tokio::test]
async fn one_replica_lr1_no_momentum_reproduces_local_weights_exactly() {
    let (store, prefix) = memory().await;
    let params = toy::init_params(3).unwrap();
    let data = Dataset::new(3, 256, 16).unwrap();
    let mut c = config(4, 1);
    c.outer_lr = 1.0;
    c.outer_momentum = 0.0;
    c.nesterov = false;
    let mut r = DilocoReplica::join(store, prefix, "0", c, &params)
        .await
        .unwrap();
    for round in 0..3 {
        let mut report = None;
        let mut before = Vec::new();
        for step in 0..4 {
            let (x, y) = data.batch(round * 4 + step, 0, 1, 8).unwrap();
            toy::sgd_step(&params, &x, &y, 0.1).unwrap();
            before = all_vals(&params);
            report = r.after_inner_step(&params).await.unwrap();
        }
        let report = report.expect("round applied at step H");
        assert_eq!(report.round, round as u64);
        assert_eq!(report.replicas_in_quorum, 1);
        assert_eq!(
            all_vals(&params),
            before,
            "round {round}: outer step must give back θ_local"
        );
    }
}

/// torch.optim.SGD(nesterov=True, dampening=0): buf = μ·buf + g; g' = g + μ·buf; p −= lr·g'.
/// Hand-computed with lr 0.5, μ 0.9, θ₀ = 1, g₁ = 0.2, g₂ = −0.1:
///   step 1: buf = 0.2,  g' = 0.2 + 0.18 = 0.38,     θ = 1 − 0.19 = 0.81
///   step 2: buf = 0.08, g' = −0.1 + 0.072 = −0.028, θ = 0.81 + 0.014 = 0.824
/// Without Nesterov (p −= lr·buf): θ = 0.9, then 0.86.
#[test]
fn nesterov_sgd_matches_hand_computed_torch_formula() {
    for (nesterov, expected) in [(true, [0.81f32, 0.824]), (false, [0.9, 0.86])] {
        let mut p = vec![1.0f32];
        let mut buf = vec![0.0f32];
        for (g, want) in [0.2f64, -0.1].iter().zip(expected) {
            outer::sgd_step(&mut p, &mut buf, &[*g], 0.5, 0.9, nesterov);
            assert!(
                (p[0] - want).abs() < 1e-6,
                "nesterov={nesterov}: {} vs {want}",
                p[0]
            );
        }
    }
}

/// The same Nesterov example through a replica: the published pseudo-gradient is
/// Δ = θ_global − θ_local, so a local move from 1.0 to 0.8 is g = +0.2.
#[tokio::test]
async fn replica_outer_step_uses_global_minus_local_and_nesterov_momentum() {
    let (store, prefix) = memory().await;
    let w = Var::from_vec(vec![1.0f32], 1, &Device::Cpu).unwrap();
    let vars = vec![("w".to_string(), w.clone())];
    let mut c = config(1, 1);
    c.outer_lr = 0.5;
    c.outer_momentum = 0.9;
    let mut r = DilocoReplica::join(store, prefix, "0", c, &vars)
        .await
        .unwrap();
    w.set(&w.as_tensor().affine(1.0, -0.2).unwrap()).unwrap(); // local 0.8
    r.after_inner_step(&vars).await.unwrap().unwrap();
    assert!((vals(&vars, "w")[0] - 0.81).abs() < 1e-6);
    assert!((r.momentum("w").unwrap()[0] - 0.2).abs() < 1e-6);
    w.set(&w.as_tensor().affine(1.0, 0.1).unwrap()).unwrap(); // local 0.91 → g = −0.1
    r.after_inner_step(&vars).await.unwrap().unwrap();
    assert!((vals(&vars, "w")[0] - 0.824).abs() < 1e-6);
}

/// Three replicas in one process, lr 1 and no momentum: the new global is the mean of the local
/// weights; a garbage object under a delta key is rejected by name and never averaged.
#[tokio::test]
async fn three_replicas_average_and_garbage_delta_is_rejected() {
    let (store, prefix) = memory().await;
    let garbage = prefix
        .child("round-000000")
        .child("frag-0")
        .child("delta")
        .child("replica-9.safetensors");
    store
        .put(
            &garbage,
            PutPayload::from_static(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"),
        )
        .await
        .unwrap();
    let mut c = config(1, 3);
    c.outer_lr = 1.0;
    c.outer_momentum = 0.0;
    let shared: Vec<Vec<(String, Var)>> = (0..3)
        .map(|_| {
            vec![(
                "w".to_string(),
                Var::from_vec(vec![1.0f32, -2.0], 2, &Device::Cpu).unwrap(),
            )]
        })
        .collect();
    let mut replicas = Vec::new();
    for (i, vars) in shared.iter().enumerate() {
        replicas.push(
            DilocoReplica::join(
                store.clone(),
                prefix.clone(),
                &i.to_string(),
                c.clone(),
                vars,
            )
            .await
            .unwrap(),
        );
    }
    for (i, vars) in shared.iter().enumerate() {
        vars[0]
            .1
            .set(&vars[0].1.as_tensor().affine(1.0, i as f64).unwrap())
            .unwrap();
    }
    let futs = replicas.iter_mut().zip(&shared).map(|(r, v)| r.apply(v));
    let reports = futures::future::join_all(futs).await;
    for (report, vars) in reports.into_iter().zip(&shared) {
        let report = report.unwrap();
        assert_eq!(report.members, vec!["0", "1", "2"]);
        assert_eq!(
            report.rejected_keys,
            vec![garbage.to_string()],
            "garbage named and skipped"
        );
        let w = vals(vars, "w");
        assert!(
            (w[0] - 2.0).abs() < 1e-6 && (w[1] + 1.0).abs() < 1e-6,
            "mean of locals: {w:?}"
        );
    }
}

fn random_tensors(seed: u64) -> Vec<FlatTensor> {
    let mut rng = Rng::new(seed);
    vec![
        FlatTensor {
            name: "a".into(),
            shape: vec![64, 32],
            data: rng.normals(2048, 0.01),
        },
        FlatTensor {
            name: "b".into(),
            shape: vec![7],
            data: rng.normals(7, 3.0),
        },
        FlatTensor {
            name: "z".into(),
            shape: vec![3],
            data: vec![0.0; 3],
        },
    ]
}

/// Round trips: f32 exact; bf16 |e| ≤ 2⁻⁸·|x| (round-to-nearest with 8 mantissa bits);
/// int8 absmax |e| ≤ scale/2 with scale = max|x|/127. Bytes of the data section are exactly
/// numel × bytes-per-element (+ one f32 scale per tensor for int8).
#[test]
fn compression_round_trip_error_bounds_and_bytes() {
    let ts = random_tensors(5);
    let numel: usize = ts.iter().map(|t| t.data.len()).sum();
    for comp in [Compression::F32, Compression::Bf16, Compression::Int8] {
        let bytes = encode(&ts, comp, Default::default()).unwrap();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let data_bytes = bytes.len() - 8 - header;
        let expected = numel * comp.bytes_per_element()
            + if comp == Compression::Int8 {
                4 * ts.len()
            } else {
                0
            };
        assert_eq!(data_bytes, expected, "{comp:?}");
        println!(
            "{comp:?}: {} bytes for {numel} elements ({} header)",
            bytes.len(),
            header + 8
        );
        let back = decode(&bytes).unwrap();
        for (a, b) in ts.iter().zip(&back.tensors) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.shape, b.shape);
            let absmax = a.data.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (x, y) in a.data.iter().zip(&b.data) {
                let err = (x - y).abs();
                let bound = match comp {
                    Compression::F32 => 0.0,
                    Compression::Bf16 => x.abs() * 2f32.powi(-8),
                    Compression::Int8 => absmax / 127.0 / 2.0 * (1.0 + 1e-5),
                };
                assert!(err <= bound, "{comp:?} {}: {x} → {y}", a.name);
            }
        }
    }
}

#[test]
fn corrupt_and_truncated_objects_are_rejected() {
    let bytes = encode(&random_tensors(6), Compression::F32, Default::default()).unwrap();
    assert!(decode(b"garbage").is_err());
    let truncated = decode(&bytes[..bytes.len() - 5]).unwrap_err();
    assert!(
        format!("{truncated:#}").contains("safetensors"),
        "{truncated:#}"
    );
    let mut flipped = bytes.clone();
    let n = flipped.len();
    flipped[n - 3] ^= 0x55;
    let e = decode(&flipped).unwrap_err();
    assert!(format!("{e:#}").contains("checksum mismatch"), "{e:#}");
}

/// Streaming (F = 2, H = 4, τ = 1): fragment r % 2 is published at step 1 of each 2-step
/// period and applied at step 2; with α = 0.5, lr 1, μ 0 the applied fragment becomes
/// 0.5·θ_local(at publish) + 0.5·θ_local(at apply) and the other fragment keeps training.
#[tokio::test]
async fn streaming_fragments_stagger_and_alpha_mixes() {
    let (store, prefix) = memory().await;
    let params = toy::init_params(4).unwrap();
    let data = Dataset::new(4, 256, 16).unwrap();
    let mut c = config(4, 1);
    c.num_fragments = 2;
    c.fragment_sync_delay = 1;
    c.fragment_update_alpha = 0.5;
    c.outer_lr = 1.0;
    c.outer_momentum = 0.0;
    let mut r = DilocoReplica::join(store, prefix, "0", c, &params)
        .await
        .unwrap();
    assert_eq!(
        r.fragments(),
        &[
            vec!["l1.bias".to_string(), "l1.weight".into()],
            vec!["l2.bias".into(), "l2.weight".into()]
        ]
    );
    assert_eq!(r.phase_after(1), Phase::Publish(0));
    assert_eq!(r.phase_after(2), Phase::Apply(0));
    let mut step = 0;
    for round in 0..4u64 {
        let frag = (round % 2) as usize;
        let names = r.fragments()[frag].clone();
        let other = r.fragments()[1 - frag].clone();
        let (x, y) = data.batch(step, 0, 1, 8).unwrap();
        step += 1;
        toy::sgd_step(&params, &x, &y, 0.1).unwrap();
        assert_eq!(r.phase_after(r.local_step() + 1), Phase::Publish(frag));
        assert!(r.after_inner_step(&params).await.unwrap().is_none());
        let at_publish: Vec<Vec<f32>> = names.iter().map(|n| vals(&params, n)).collect();
        let (x, y) = data.batch(step, 0, 1, 8).unwrap();
        step += 1;
        toy::sgd_step(&params, &x, &y, 0.1).unwrap();
        let at_apply: Vec<Vec<f32>> = names.iter().map(|n| vals(&params, n)).collect();
        let other_before: Vec<Vec<f32>> = other.iter().map(|n| vals(&params, n)).collect();
        let report = r.after_inner_step(&params).await.unwrap().expect("applied");
        assert_eq!((report.round, report.fragment), (round, frag));
        for (i, n) in names.iter().enumerate() {
            for ((p, a), now) in at_publish[i].iter().zip(&at_apply[i]).zip(vals(&params, n)) {
                let want = 0.5 * p + 0.5 * a;
                assert!(
                    (now - want).abs() < 1e-6,
                    "round {round} {n}: {now} vs {want}"
                );
            }
        }
        let other_after: Vec<Vec<f32>> = other.iter().map(|n| vals(&params, n)).collect();
        assert_eq!(
            other_before, other_after,
            "round {round}: other fragment untouched"
        );
    }
}

/// A replica's outer state survives save_state / load_state.
#[tokio::test]
async fn outer_state_checkpoint_round_trips() {
    let (store, prefix) = memory().await;
    let params = toy::init_params(8).unwrap();
    let mut r = DilocoReplica::join(store.clone(), prefix.clone(), "0", config(1, 1), &params)
        .await
        .unwrap();
    params[0]
        .1
        .set(&params[0].1.as_tensor().affine(0.9, 0.0).unwrap())
        .unwrap();
    r.after_inner_step(&params).await.unwrap().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("diloco.safetensors");
    r.save_state(&path).unwrap();
    let (store2, prefix2) = memory().await; // fresh store: state comes from the file only
    let fresh = toy::init_params(8).unwrap();
    let mut r2 = DilocoReplica::join(store2, prefix2, "0", config(1, 1), &fresh)
        .await
        .unwrap();
    r2.load_state(&path, &fresh).await.unwrap();
    assert_eq!(r2.round(), 1);
    assert_eq!(r2.momentum("l1.weight"), r.momentum("l1.weight"));
    assert_eq!(r2.global("l1.weight"), r.global("l1.weight"));
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, b"nope").unwrap();
    let e = r2.load_state(&bad, &fresh).await.unwrap_err();
    assert!(format!("{e:#}").contains("bad.safetensors"), "{e:#}");
}

#[test]
fn config_parses_from_toml_and_rejects_unknown_fields() {
    let c: DilocoConfig = toml::from_str(
        "inner_steps = 10\nnum_replicas = 3\nmin_replicas = 2\nnum_fragments = 2\nfragment_sync_delay = 1\ncompression = \"int8\"",
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.compression, Compression::Int8);
    assert_eq!(c.outer_lr, 0.7);
    let e = toml::from_str::<DilocoConfig>("inner_steps = 10\nnum_replicas = 3\nouter_lrr = 1")
        .unwrap_err();
    assert!(e.to_string().contains("outer_lrr"), "{e}");
    let mut bad = c.clone();
    bad.fragment_sync_delay = 5;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("fragment_sync_delay"));
}

/// Issue 19: the store retry budget is a `[diloco]` key (default 90 s), validated by name.
#[test]
fn store_retry_budget_is_a_diloco_key() {
    let c: DilocoConfig = toml::from_str("inner_steps = 2\nnum_replicas = 1").unwrap();
    assert_eq!(c.store_retry_budget_s, 90.0);
    assert_eq!(c.store_retries, None);
    let c: DilocoConfig =
        toml::from_str("inner_steps = 2\nnum_replicas = 1\nstore_retry_budget_s = 5").unwrap();
    assert_eq!(c.store_retry_budget(), std::time::Duration::from_secs(5));
    let mut bad = c.clone();
    bad.store_retry_budget_s = -1.0;
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("store_retry_budget_s"), "{e}");
}

#[tokio::test]
async fn unsupported_store_urls_name_the_missing_feature() {
    let e = open_store("gs://bucket/run").await.err().unwrap();
    assert!(format!("{e:#}").contains("`gcp`"), "{e:#}");
    let e = open_store("az://container/run").await.err().unwrap();
    assert!(format!("{e:#}").contains("`azure`"), "{e:#}");
}

/// The store unavailable for a while (the prefix path is blocked by a file, which is removed
/// after 300 ms): the replica retries with back-off and then succeeds.
#[tokio::test]
async fn folder_store_unavailable_for_a_while_is_retried() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open_store(dir.path().to_str().unwrap()).await.unwrap();
    let blocker = dir.path().join("run");
    std::fs::write(&blocker, b"not a folder").unwrap();
    let b2 = blocker.clone();
    let unblock = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        std::fs::remove_file(b2).unwrap();
    });
    let mut c = config(1, 1);
    c.store_retries = Some(6);
    c.store_backoff_s = 0.05; // 0.05 + 0.1 + 0.2 + 0.4 … covers 300 ms
    let params = toy::init_params(1).unwrap();
    let r = DilocoReplica::join(store.clone(), Path::from("run"), "0", c.clone(), &params).await;
    unblock.join().unwrap();
    assert!(r.is_ok(), "{:#}", r.err().unwrap());
    // Permanently blocked: bounded retries, then an error naming the key.
    std::fs::write(dir.path().join("run2"), b"x").unwrap();
    c.store_retries = Some(2);
    let e = DilocoReplica::join(store, Path::from("run2"), "0", c, &params)
        .await
        .err()
        .unwrap();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("run2/init.safetensors") && msg.contains("after 3 attempts"),
        "{msg}"
    );
}

/// A replica's recipe whose `[train] steps` is not a multiple of `[diloco] inner_steps` (a
/// replica that would run no round, exit 0) is refused naming both keys.
#[test]
fn replica_recipe_steps_must_be_a_multiple_of_inner_steps() {
    let text = "[train]\nsteps = 2\n\n[diloco]\ninner_steps = 3\nnum_replicas = 1\n";
    let e = format!(
        "{:#}",
        composer_diloco::split_recipe(text, std::path::Path::new("r.toml")).unwrap_err()
    );
    assert!(e.contains("inner_steps") && e.contains("steps"), "{e}");
    let ok = "[train]\nsteps = 6\n\n[diloco]\ninner_steps = 3\nnum_replicas = 1\n";
    assert!(composer_diloco::split_recipe(ok, std::path::Path::new("r.toml")).is_ok());
}
