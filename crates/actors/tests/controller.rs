//! The controller with toy actors (the weights are a number): ordering, the staleness bound
//! with forced-stale items, sync mode, clean shutdown on an actor's error and on cancel.

use std::sync::Arc;
use std::time::Duration;

use composer_actors::{
    ActorKind, Controller, ControllerConfig, ControllerError, GenerateContext, Generator, Hooks,
    Mode, PolicyVersion, Rewarder, RunEnd, ScoreContext, StepRecord, TrainContext, Trainer,
    Versioned,
};

/// A rollout: the version that sampled it (possibly forced older, to simulate a rollout that
/// spanned many updates).
#[derive(Debug, Clone)]
struct Item {
    batch: u64,
    version: PolicyVersion,
}

impl Versioned for Item {
    fn oldest_policy_version(&self) -> PolicyVersion {
        self.version
    }
}

/// Two items per batch; every 3rd batch's second item claims version 0.
struct Gen {
    force_stale: bool,
    delay: Duration,
}

impl Generator<u64> for Gen {
    type Item = Item;
    fn generate(&mut self, ctx: &GenerateContext<'_, u64>) -> anyhow::Result<Vec<Item>> {
        std::thread::sleep(self.delay);
        let v = ctx.weights.policy_version;
        // The weights themselves are the version number they were published as.
        assert_eq!(*ctx.weights.weights, v);
        let stale = self.force_stale && ctx.batch_index % 3 == 2;
        Ok(vec![
            Item {
                batch: ctx.batch_index,
                version: v,
            },
            Item {
                batch: ctx.batch_index,
                version: if stale { 0 } else { v },
            },
        ])
    }
}

struct Rew {
    fail_at_batch: Option<u64>,
}

impl Rewarder<Item> for Rew {
    type Scored = Item;
    fn score(&mut self, items: Vec<Item>, ctx: &ScoreContext<'_>) -> anyhow::Result<Vec<Item>> {
        if self.fail_at_batch == Some(ctx.batch_index) {
            anyhow::bail!("verifier exploded");
        }
        Ok(items)
    }
}

struct Train {
    version: PolicyVersion,
    delay: Duration,
    bound: u64,
}

impl Trainer<u64> for Train {
    type Scored = Item;
    type Report = Vec<Item>;
    fn train(&mut self, batch: Vec<Item>, ctx: &TrainContext) -> anyhow::Result<Vec<Item>> {
        std::thread::sleep(self.delay);
        assert_eq!(ctx.policy_version, self.version);
        for (item, lag) in batch.iter().zip(&ctx.staleness) {
            assert!(item.version <= ctx.policy_version, "item from the future");
            assert_eq!(*lag, ctx.policy_version - item.version);
            assert!(*lag <= self.bound, "stale item consumed: {item:?}");
        }
        Ok(batch)
    }
    fn publish(&mut self, policy_version: PolicyVersion) -> anyhow::Result<Arc<u64>> {
        self.version = policy_version;
        Ok(Arc::new(policy_version))
    }
}

/// (step, published version, lags, dropped, items trained on).
type Rec = (u64, PolicyVersion, Vec<u64>, u64, Vec<Item>);

#[derive(Default)]
struct Log {
    records: Vec<Rec>,
    end: Option<RunEnd>,
}

impl Hooks<Train, Vec<Item>> for Log {
    fn on_step(&mut self, _: &mut Train, r: &StepRecord<Vec<Item>>) -> anyhow::Result<()> {
        self.records.push((
            r.step,
            r.policy_version,
            r.staleness.values.clone(),
            r.staleness.dropped,
            r.report.clone(),
        ));
        Ok(())
    }
    fn on_shutdown(&mut self, _: &mut Train, end: &RunEnd) -> anyhow::Result<()> {
        self.end = Some(end.clone());
        Ok(())
    }
}

fn run(
    mode: Mode,
    steps: u64,
    gen: &mut Gen,
    rew: &mut Rew,
    train_delay: Duration,
) -> (
    Result<composer_actors::ControllerSummary, ControllerError>,
    Log,
) {
    let mut controller = Controller::new(ControllerConfig::new(mode, steps), 0, Arc::new(0u64));
    let mut trainer = Train {
        version: 0,
        delay: train_delay,
        bound: mode.max_staleness(),
    };
    let mut log = Log::default();
    let result = controller.run(gen, rew, &mut trainer, &mut log);
    (result, log)
}

#[test]
fn async_drops_and_counts_stale_items_and_keeps_order() {
    for k in [0u64, 1, 2] {
        let mode = Mode::Async {
            max_staleness: k,
            queue_capacity: 2,
        };
        let mut gen = Gen {
            force_stale: true,
            delay: Duration::from_millis(1),
        };
        let mut rew = Rew {
            fail_at_batch: None,
        };
        let (result, log) = run(mode, 12, &mut gen, &mut rew, Duration::from_millis(3));
        let summary = result.unwrap();
        assert_eq!(summary.steps, 12);
        assert_eq!(log.end, Some(RunEnd::Completed));
        assert_eq!(log.records.len(), 12);
        let mut last_batch = None;
        let mut dropped = 0;
        for (i, (step, version, lags, step_dropped, items)) in log.records.iter().enumerate() {
            assert_eq!(*step, i as u64);
            assert_eq!(*version, i as u64 + 1, "one version per step, in order");
            assert!(lags.iter().all(|l| *l <= k), "k = {k}: {lags:?}");
            // Generation order is kept: batch indices never go back.
            for item in items {
                assert!(last_batch.is_none_or(|b| item.batch >= b));
                last_batch = Some(item.batch);
            }
            dropped += step_dropped;
        }
        assert_eq!(summary.dropped, dropped);
        // From batch 2 on every 3rd batch's forced item (version 0) lags by >= 2 by the time
        // it is consumed... unless the trainer is still at version <= k: only then kept.
        if k == 0 {
            assert!(
                summary.dropped >= 3,
                "k = 0 must drop the forced-stale items"
            );
        }
    }
}

#[test]
fn sync_mode_is_on_policy() {
    let mut gen = Gen {
        force_stale: false,
        delay: Duration::ZERO,
    };
    let mut rew = Rew {
        fail_at_batch: None,
    };
    let (result, log) = run(Mode::Sync, 5, &mut gen, &mut rew, Duration::ZERO);
    let summary = result.unwrap();
    assert_eq!((summary.steps, summary.dropped), (5, 0));
    for (i, (_, _, lags, _, items)) in log.records.iter().enumerate() {
        assert!(lags.iter().all(|l| *l == 0));
        assert!(items.iter().all(|it| it.batch == i as u64));
    }
}

#[test]
fn rewarder_error_stops_every_actor_with_a_clear_error() {
    for mode in [
        Mode::Sync,
        Mode::Async {
            max_staleness: 1,
            queue_capacity: 1,
        },
    ] {
        let mut gen = Gen {
            force_stale: false,
            delay: Duration::from_millis(1),
        };
        let mut rew = Rew {
            fail_at_batch: Some(3),
        };
        let (result, log) = run(mode, 50, &mut gen, &mut rew, Duration::from_millis(1));
        match result {
            Err(ControllerError::Actor { actor, index, .. }) => {
                assert_eq!(actor, ActorKind::Rewarder);
                assert_eq!(index, 3);
            }
            other => panic!("{mode:?}: expected a rewarder error, got {other:?}"),
        }
        let msg = format!(
            "{}",
            run(mode, 50, &mut gen, &mut rew, Duration::ZERO)
                .0
                .unwrap_err()
        );
        assert!(
            msg.contains("rewarder") && msg.contains("verifier exploded"),
            "{msg}"
        );
        assert!(log.records.len() <= 3, "nothing trained past the failure");
        assert!(
            matches!(log.end, Some(RunEnd::Failed { .. })),
            "{:?}",
            log.end
        );
    }
}

#[test]
fn cancel_stops_a_blocked_run() {
    let mode = Mode::Async {
        max_staleness: 1,
        queue_capacity: 1,
    };
    let mut controller = Controller::new(ControllerConfig::new(mode, 1_000_000), 0, Arc::new(0));
    let cancel = controller.cancel_token();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        cancel.cancel();
    });
    let mut gen = Gen {
        force_stale: false,
        delay: Duration::from_millis(5),
    };
    let mut trainer = Train {
        version: 0,
        delay: Duration::from_millis(5),
        bound: 1,
    };
    let mut log = Log::default();
    let result = controller.run(
        &mut gen,
        &mut Rew {
            fail_at_batch: None,
        },
        &mut trainer,
        &mut log,
    );
    stopper.join().unwrap();
    assert!(
        matches!(result, Err(ControllerError::Cancelled { .. })),
        "{result:?}"
    );
    assert_eq!(log.end, Some(RunEnd::Cancelled));
}
