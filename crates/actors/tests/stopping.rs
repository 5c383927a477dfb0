//! Review findings on stopping a run: a Ctrl-C token handed in as a child of the binary's own
//! token, the trainer's view of a failed peer, and `max_empty_batches = 0`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use composer_actors::{
    ActorKind, CancelToken, Controller, ControllerConfig, ControllerError, GenerateContext,
    Generator, Mode, NoHooks, PolicyVersion, Rewarder, ScoreContext, TrainContext, Trainer,
    Versioned,
};

struct Item(PolicyVersion);

impl Versioned for Item {
    fn oldest_policy_version(&self) -> PolicyVersion {
        self.0
    }
}

/// One on-policy item per batch.
struct Gen;

impl Generator<u64> for Gen {
    type Item = Item;
    fn generate(&mut self, ctx: &GenerateContext<'_, u64>) -> anyhow::Result<Vec<Item>> {
        std::thread::sleep(Duration::from_millis(1));
        Ok(vec![Item(ctx.weights.policy_version)])
    }
}

/// Scores everything, failing at `fail_at` if set.
struct Rew {
    fail_at: Option<u64>,
}

impl Rewarder<Item> for Rew {
    type Scored = Item;
    fn score(&mut self, items: Vec<Item>, ctx: &ScoreContext<'_>) -> anyhow::Result<Vec<Item>> {
        if self.fail_at == Some(ctx.batch_index) {
            anyhow::bail!("verifier exploded");
        }
        Ok(items)
    }
}

/// Sleeps `delay` per step, or, with `wait_for_stop`, polls `ctx.cancel` for up to 10 s (a
/// long step that ends early when the run stops); records whether it saw the stop.
struct Train {
    delay: Duration,
    wait_for_stop: bool,
    saw_stop: bool,
}

impl Trainer<u64> for Train {
    type Scored = Item;
    type Report = ();
    fn train(&mut self, _: Vec<Item>, ctx: &TrainContext) -> anyhow::Result<()> {
        if self.wait_for_stop {
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                if ctx.cancel.is_cancelled() {
                    self.saw_stop = true;
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        } else {
            std::thread::sleep(self.delay);
        }
        Ok(())
    }
    fn publish(&mut self, v: PolicyVersion) -> anyhow::Result<Arc<u64>> {
        Ok(Arc::new(v))
    }
}

fn async_mode() -> Mode {
    Mode::Async {
        max_staleness: 1,
        queue_capacity: 1,
    }
}

fn trainer(delay_ms: u64) -> Train {
    Train {
        delay: Duration::from_millis(delay_ms),
        wait_for_stop: false,
        saw_stop: false,
    }
}

/// A binary that hands the controller a child of its Ctrl-C token (e.g. one per phase) must
/// still stop the run with the root token: the controller's own stop token is a grandchild.
#[test]
fn cancelling_the_root_of_a_child_token_stops_an_async_run() {
    let root = CancelToken::new();
    let mut controller =
        Controller::new(ControllerConfig::new(async_mode(), 2_000), 0, Arc::new(0))
            .with_cancel(root.child());
    let stopper = {
        let root = root.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            root.cancel();
        })
    };
    let started = Instant::now();
    let result = controller.run(
        &mut Gen,
        &mut Rew { fail_at: None },
        &mut trainer(2),
        &mut NoHooks,
    );
    stopper.join().unwrap();
    assert!(
        matches!(result, Err(ControllerError::Cancelled { .. })),
        "root cancelled after 100 ms, yet the run ended with {result:?} after {:?}",
        started.elapsed()
    );
}

/// `TrainContext::cancel` is "set when the run is stopping": in async mode a rewarder that
/// fails while the trainer is inside a long step must be visible to that step.
#[test]
fn a_long_train_step_sees_a_failed_rewarder() {
    let mut controller = Controller::new(ControllerConfig::new(async_mode(), 5), 0, Arc::new(0u64));
    let mut train = Train {
        delay: Duration::ZERO,
        wait_for_stop: true,
        saw_stop: false,
    };
    let started = Instant::now();
    let result = controller.run(
        &mut Gen,
        &mut Rew { fail_at: Some(1) },
        &mut train,
        &mut NoHooks,
    );
    match result {
        Err(ControllerError::Actor { actor, index, .. }) => {
            assert_eq!((actor, index), (ActorKind::Rewarder, 1));
        }
        other => panic!("expected the rewarder's error, got {other:?}"),
    }
    assert!(
        train.saw_stop,
        "the trainer's step never saw the stop (ran {:?})",
        started.elapsed()
    );
}

/// `max_empty_batches = 0` tolerates no empty batch; it must still train on non-empty ones
/// rather than fail before pulling the first batch.
#[test]
fn zero_tolerated_empty_batches_still_trains() {
    for mode in [Mode::Sync, async_mode()] {
        let mut config = ControllerConfig::new(mode, 3);
        config.max_empty_batches = 0;
        let mut controller = Controller::new(config, 0, Arc::new(0u64));
        let result = controller.run(
            &mut Gen,
            &mut Rew { fail_at: None },
            &mut trainer(0),
            &mut NoHooks,
        );
        assert_eq!(result.map(|s| s.steps).ok(), Some(3), "{mode:?}");
    }
}
