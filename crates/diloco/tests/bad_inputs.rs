//! Bad inputs that must fail with a clear error before any work: non-finite values given to
//! the codec, durations too large to represent, and a replica state that does not belong to
//! the store it is resumed against.

use std::sync::Arc;

use composer_diloco::codec::{decode, encode, FlatTensor};
use composer_diloco::toy;
use composer_diloco::{open_store, Compression, DilocoConfig, DilocoReplica};
use object_store::path::Path;
use object_store::ObjectStore;

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

/// A diverged replica's NaN/Inf must never reach the store: int8 used to turn NaN into 0 and
/// an Inf into a scale that zeroes the whole tensor, so the corrupt pseudo-gradient decoded
/// as a valid, silently wrong one and was averaged in.
#[test]
fn non_finite_values_are_refused_by_every_codec() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for compression in [Compression::F32, Compression::Bf16, Compression::Int8] {
            let tensors = vec![FlatTensor {
                name: "l1.weight".into(),
                shape: vec![3],
                data: vec![0.5, bad, -0.25],
            }];
            match encode(&tensors, compression, Default::default()) {
                Ok(bytes) => panic!(
                    "{compression:?} encoded {bad} (decodes as {:?})",
                    decode(&bytes).map(|d| d.tensors[0].data.clone())
                ),
                Err(e) => {
                    let msg = format!("{e:#}");
                    assert!(
                        msg.contains("l1.weight") && msg.contains("index 1"),
                        "{compression:?}: {msg}"
                    );
                }
            }
        }
    }
}

/// Durations are validated before use: one too large for a `Duration`/`Instant` used to pass
/// `validate` and then panic in the middle of a round.
#[test]
fn absurdly_large_durations_are_named_by_validate() {
    for field in [
        "quorum_timeout_s",
        "store_retry_budget_s",
        "store_backoff_s",
        "poll_interval_s",
    ] {
        for huge in [1e12, 1e19, 1e300] {
            let mut c = config(2, 1);
            match field {
                "quorum_timeout_s" => c.quorum_timeout_s = huge,
                "store_retry_budget_s" => c.store_retry_budget_s = huge,
                "store_backoff_s" => c.store_backoff_s = huge,
                _ => c.poll_interval_s = huge,
            }
            let e = c
                .validate()
                .expect_err(&format!("{field} = {huge} accepted"));
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
    }
}

/// The panic the validation prevents: joining and running a round with a huge quorum timeout.
#[tokio::test]
async fn join_with_a_huge_quorum_timeout_is_an_error_not_a_panic() {
    let (store, prefix) = memory().await;
    let params = toy::init_params(1).unwrap();
    let mut c = config(1, 1);
    c.quorum_timeout_s = 1e19;
    match DilocoReplica::join(store, prefix, "0", c, &params).await {
        Err(e) => assert!(format!("{e:#}").contains("quorum_timeout_s"), "{e:#}"),
        Ok(mut r) => {
            let round = r.after_inner_step(&params).await.map(|_| ());
            panic!("joined with quorum_timeout_s = 1e19; the round gave {round:?}");
        }
    }
}

/// A replica state saved at round 4 of one run, resumed against a store whose newest round
/// is 1 (another run's prefix, or a store restored from an old backup): the replica would
/// publish round 4 while its peers are at round 2, and each side would time out and train
/// alone. It must be refused, naming the file and both rounds.
#[tokio::test]
async fn state_ahead_of_the_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("diloco-state.safetensors");
    {
        let (store, prefix) = memory().await;
        let params = toy::init_params(4).unwrap();
        let mut r = DilocoReplica::join(store, prefix, "0", config(1, 1), &params)
            .await
            .unwrap();
        for _ in 0..4 {
            r.after_inner_step(&params).await.unwrap().unwrap();
        }
        assert_eq!(r.round(), 4);
        r.save_state(&state).unwrap();
    }
    let (store, prefix) = memory().await;
    let params = toy::init_params(4).unwrap();
    let mut other = DilocoReplica::join(store.clone(), prefix.clone(), "1", config(1, 1), &params)
        .await
        .unwrap();
    for _ in 0..2 {
        other.after_inner_step(&params).await.unwrap().unwrap();
    }
    let mut resumed = DilocoReplica::join(store, prefix, "0", config(1, 1), &params)
        .await
        .unwrap();
    assert_eq!(resumed.round(), 2, "joined at the store's position");
    let e = resumed
        .load_state(&state, &params)
        .await
        .expect_err("resumed at round 4 against a store at round 2");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("diloco-state.safetensors") && msg.contains("round 4"),
        "{msg}"
    );
    // Nothing was adopted from the rejected file.
    assert_eq!(resumed.round(), 2);
}
