//! The controller: runs the actors in sync or bounded-async mode and records every step.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::actor::{
    ActorKind, GenerateContext, Generator, Rewarder, ScoreContext, TrainContext, Trainer,
};
use crate::cancel::CancelToken;
use crate::queue::{BoundedQueue, PopError, PushError};
use crate::record::{ControllerSummary, IdleTimes, RunEnd, StalenessStats, StepRecord, StepWalls};
use crate::version::{PolicyVersion, Versioned};
use crate::weights::PublishedWeights;

/// How the actors are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Generate, score, train, publish — one after the other, on the calling thread, in a
    /// fixed order (same seed, same run).
    Sync,
    /// Generator and rewarder on their own threads feeding bounded queues; the trainer (on the
    /// calling thread) consumes. The generator starts batch `i` only once the published
    /// version is at least `first version + i - max_staleness` (as PRIME-RL's async level),
    /// and any item whose lag exceeds `max_staleness` when scored or consumed is dropped and
    /// counted, never used.
    Async {
        /// Largest accepted lag k = trainer version − item's oldest version.
        max_staleness: u64,
        /// Capacity (in batches) of each queue: generator→rewarder and rewarder→trainer.
        queue_capacity: usize,
    },
}

impl Mode {
    /// The bound in force: `max_staleness`, or 0 in sync mode.
    pub fn max_staleness(&self) -> u64 {
        match self {
            Mode::Sync => 0,
            Mode::Async { max_staleness, .. } => *max_staleness,
        }
    }
}

/// Controller settings.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Sync or bounded-async.
    pub mode: Mode,
    /// Trainer steps to run.
    pub steps: u64,
    /// Longest single wait on a queue or on the weight slot before re-checking for
    /// cancellation: bounds how long shutdown takes beyond an in-flight actor call.
    pub poll_interval: Duration,
    /// Consecutive batches with nothing usable (empty after scoring and dropping) tolerated
    /// for one step before the run fails with [`ControllerError::NoData`].
    pub max_empty_batches: u32,
}

impl ControllerConfig {
    /// `steps` steps in `mode`, polling every 20 ms, tolerating 16 empty batches in a row.
    pub fn new(mode: Mode, steps: u64) -> Self {
        Self {
            mode,
            steps,
            poll_interval: Duration::from_millis(20),
            max_empty_batches: 16,
        }
    }
}

/// Why a run stopped early.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// An actor or hook returned an error (or panicked); every other actor was stopped and
    /// joined before this was returned.
    #[error("{actor} failed at {} {index}: {source:#}", actor.unit())]
    Actor {
        /// Which one.
        actor: ActorKind,
        /// Generator/rewarder: the batch index; trainer/hooks: the step index.
        index: u64,
        /// The actor's error.
        source: anyhow::Error,
    },
    /// The cancel token was set (Ctrl-C); actors were stopped and joined.
    #[error("run cancelled after {steps_done} completed steps")]
    Cancelled {
        /// Steps trained and published before the stop.
        steps_done: u64,
    },
    /// Too many consecutive batches had nothing left to train on.
    #[error(
        "step {step}: {batches} consecutive batches had no usable item ({dropped} dropped as \
         staler than {bound} versions, the rest removed by the rewarder); check max_staleness \
         and the rewarder's filtering"
    )]
    NoData {
        /// Step index.
        step: u64,
        /// Batches pulled for the step.
        batches: u32,
        /// Items dropped as stale among them.
        dropped: u64,
        /// The staleness bound.
        bound: u64,
    },
}

impl ControllerError {
    fn as_run_end(&self) -> RunEnd {
        match self {
            ControllerError::Cancelled { .. } => RunEnd::Cancelled,
            ControllerError::Actor { actor, .. } => RunEnd::Failed {
                actor: *actor,
                message: self.to_string(),
            },
            ControllerError::NoData { .. } => RunEnd::Failed {
                actor: ActorKind::Rewarder,
                message: self.to_string(),
            },
        }
    }
}

/// Callbacks on the trainer's thread: per-step metrics/checkpoints, and a final one.
pub trait Hooks<T, R> {
    /// After step `record.step` was trained and published: write metrics, checkpoint. An
    /// error stops the run like an actor error.
    fn on_step(&mut self, trainer: &mut T, record: &StepRecord<R>) -> anyhow::Result<()>;

    /// Once, after every actor thread has joined, however the run ended: keep or write the
    /// last checkpoint, flush files. Its own error is returned only if the run had otherwise
    /// succeeded (else it is logged and the original error returned).
    fn on_shutdown(&mut self, trainer: &mut T, end: &RunEnd) -> anyhow::Result<()> {
        let _ = (trainer, end);
        Ok(())
    }
}

/// Hooks that do nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHooks;

impl<T, R> Hooks<T, R> for NoHooks {
    fn on_step(&mut self, _: &mut T, _: &StepRecord<R>) -> anyhow::Result<()> {
        Ok(())
    }
}

/// Runs generator, rewarder and trainer around one weight slot.
pub struct Controller<W> {
    config: ControllerConfig,
    weights: Arc<PublishedWeights<W>>,
    cancel: CancelToken,
}

/// A generated batch on its way to the trainer.
struct Envelope<T> {
    batch_index: u64,
    items: Vec<T>,
    rollout_s: f64,
    reward_s: f64,
    /// Dropped as stale before scoring.
    dropped: u64,
}

/// The first failure of a run (later ones are consequences of the stop).
struct Failure {
    actor: ActorKind,
    index: u64,
    error: anyhow::Error,
}

/// Shared state of one async run.
struct Shared<'a, W> {
    slot: &'a PublishedWeights<W>,
    stop: CancelToken,
    failure: Mutex<Option<Failure>>,
    idle_generator_ns: AtomicU64,
    idle_rewarder_ns: AtomicU64,
}

impl<W> Shared<'_, W> {
    fn fail(&self, actor: ActorKind, index: u64, error: anyhow::Error) {
        let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            tracing::error!(actor = actor.name(), index, "actor failed: {error:#}");
            *slot = Some(Failure {
                actor,
                index,
                error,
            });
        }
        drop(slot);
        self.stop.cancel();
    }
}

fn add_idle(counter: &AtomicU64, since: Instant) {
    counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

fn take_idle_s(counter: &AtomicU64) -> f64 {
    counter.swap(0, Ordering::Relaxed) as f64 * 1e-9
}

/// Runs an actor call, turning a panic into an error so one actor's panic stops the run
/// cleanly instead of leaving the others waiting.
fn guarded<T>(call: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(result) => result,
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".to_string());
            Err(anyhow::anyhow!("panicked: {message}"))
        }
    }
}

/// Rejects items claiming a version no one has published yet.
fn check_not_future<T: Versioned>(items: &[T], published: PolicyVersion) -> anyhow::Result<()> {
    if let Some(v) = items
        .iter()
        .map(Versioned::oldest_policy_version)
        .find(|&v| v > published)
    {
        anyhow::bail!(
            "a trajectory reports policy version {v}, newer than the newest published version \
             {published}: record the version of the weights given in GenerateContext"
        );
    }
    Ok(())
}

/// Keeps the items within `bound` of `trainer_version`; returns them, their lags, and the
/// dropped count. Order is preserved.
fn drop_stale<T: Versioned>(
    items: Vec<T>,
    trainer_version: PolicyVersion,
    bound: u64,
) -> (Vec<T>, Vec<u64>, u64) {
    let mut kept = Vec::with_capacity(items.len());
    let mut lags = Vec::with_capacity(items.len());
    let mut dropped = 0;
    for item in items {
        let lag = trainer_version.saturating_sub(item.oldest_policy_version());
        if lag > bound {
            dropped += 1;
        } else {
            kept.push(item);
            lags.push(lag);
        }
    }
    (kept, lags, dropped)
}

/// A step's input, assembled from one or more envelopes.
struct StepInput<T> {
    items: Vec<T>,
    lags: Vec<u64>,
    batch_indices: Vec<u64>,
    rollout_s: f64,
    reward_s: f64,
    dropped: u64,
    empty_batches: u32,
}

impl<T: Versioned> StepInput<T> {
    fn new() -> Self {
        Self {
            items: Vec::new(),
            lags: Vec::new(),
            batch_indices: Vec::new(),
            rollout_s: 0.0,
            reward_s: 0.0,
            dropped: 0,
            empty_batches: 0,
        }
    }

    /// Adds an envelope's fresh items; returns whether the step now has something to train on.
    fn absorb(
        &mut self,
        envelope: Envelope<T>,
        trainer_version: PolicyVersion,
        bound: u64,
    ) -> bool {
        let (items, lags, dropped) = drop_stale(envelope.items, trainer_version, bound);
        self.batch_indices.push(envelope.batch_index);
        self.rollout_s += envelope.rollout_s;
        self.reward_s += envelope.reward_s;
        self.dropped += envelope.dropped + dropped;
        if items.is_empty() {
            self.empty_batches += 1;
            false
        } else {
            self.items = items;
            self.lags = lags;
            true
        }
    }
}

impl<W: Send + Sync> Controller<W> {
    /// A controller whose generator starts from `weights` as `policy_version` (0 for a fresh
    /// run, the checkpoint's version when resuming).
    pub fn new(config: ControllerConfig, policy_version: PolicyVersion, weights: Arc<W>) -> Self {
        Self {
            config,
            weights: Arc::new(PublishedWeights::new(policy_version, weights)),
            cancel: CancelToken::new(),
        }
    }

    /// Uses `cancel` (e.g. set by the binary's Ctrl-C handler) to stop the run.
    pub fn with_cancel(mut self, cancel: CancelToken) -> Self {
        self.cancel = cancel;
        self
    }

    /// The token that stops the run when cancelled.
    pub fn cancel_token(&self) -> CancelToken {
        self.cancel.clone()
    }

    /// The weight slot (e.g. for an evaluator reading the newest weights).
    pub fn weights(&self) -> &Arc<PublishedWeights<W>> {
        &self.weights
    }

    /// The settings.
    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// Runs `config.steps` steps. Returns after every actor thread has joined and
    /// `hooks.on_shutdown` has run, with an error naming the failed actor, or
    /// [`ControllerError::Cancelled`]. Calling it again continues from the last published
    /// version.
    pub fn run<G, R, T, H>(
        &mut self,
        generator: &mut G,
        rewarder: &mut R,
        trainer: &mut T,
        hooks: &mut H,
    ) -> Result<ControllerSummary, ControllerError>
    where
        G: Generator<W>,
        R: Rewarder<G::Item>,
        T: Trainer<W, Scored = R::Scored>,
        H: Hooks<T, T::Report>,
    {
        let started = Instant::now();
        let mut summary = ControllerSummary {
            steps: 0,
            policy_version: self.weights.policy_version(),
            consumed: 0,
            dropped: 0,
            wall_s: 0.0,
        };
        let result = match self.config.mode {
            Mode::Sync => self.run_sync(generator, rewarder, trainer, hooks, &mut summary),
            Mode::Async {
                max_staleness,
                queue_capacity,
            } => self.run_async(
                generator,
                rewarder,
                trainer,
                hooks,
                max_staleness,
                queue_capacity,
                &mut summary,
            ),
        };
        let end = match &result {
            Ok(()) => RunEnd::Completed,
            Err(e) => e.as_run_end(),
        };
        let shutdown = guarded(|| hooks.on_shutdown(trainer, &end));
        summary.wall_s = started.elapsed().as_secs_f64();
        match (result, shutdown) {
            (Ok(()), Ok(())) => Ok(summary),
            (Ok(()), Err(source)) => Err(ControllerError::Actor {
                actor: ActorKind::Hooks,
                index: summary.steps,
                source: source.context("shutdown hook"),
            }),
            (Err(e), Ok(())) => Err(e),
            (Err(e), Err(hook_error)) => {
                tracing::error!("shutdown hook failed after the run failed: {hook_error:#}");
                Err(e)
            }
        }
    }

    /// Trains on `input`, publishes, records and calls the step hook.
    #[allow(clippy::too_many_arguments)]
    fn finish_step<T, H>(
        &self,
        trainer: &mut T,
        hooks: &mut H,
        step: u64,
        input: StepInput<T::Scored>,
        idle: Option<(f64, f64, f64)>,
        step_started: Instant,
        summary: &mut ControllerSummary,
    ) -> Result<(), ControllerError>
    where
        T: Trainer<W>,
        H: Hooks<T, T::Report>,
    {
        let version = summary.policy_version;
        let consumed = input.items.len();
        let ctx = TrainContext {
            step,
            policy_version: version,
            staleness: input.lags.clone(),
            batch_indices: input.batch_indices.clone(),
            cancel: self.cancel.clone(),
        };
        let trainer_error = |source| ControllerError::Actor {
            actor: ActorKind::Trainer,
            index: step,
            source,
        };
        let t_train = Instant::now();
        let report = guarded(|| trainer.train(input.items, &ctx)).map_err(trainer_error)?;
        let train_s = t_train.elapsed().as_secs_f64();
        let new_version = version + 1;
        let t_sync = Instant::now();
        let weights = guarded(|| trainer.publish(new_version))
            .map_err(|e| trainer_error(e.context(format!("publishing version {new_version}"))))?;
        self.weights.publish(new_version, weights);
        let sync_s = t_sync.elapsed().as_secs_f64();

        summary.policy_version = new_version;
        summary.steps += 1;
        summary.consumed += consumed as u64;
        summary.dropped += input.dropped;
        let record = StepRecord {
            step,
            policy_version: new_version,
            batch_indices: input.batch_indices,
            consumed,
            walls: StepWalls {
                rollout_s: input.rollout_s,
                reward_s: input.reward_s,
                train_s,
                sync_s,
                step_s: step_started.elapsed().as_secs_f64(),
            },
            idle: idle.map(|(generator_s, rewarder_s, trainer_s)| IdleTimes {
                generator_s,
                rewarder_s,
                trainer_s,
            }),
            staleness: StalenessStats {
                values: input.lags,
                dropped: input.dropped,
                bound: self.config.mode.max_staleness(),
            },
            report,
        };
        guarded(|| hooks.on_step(trainer, &record)).map_err(|source| ControllerError::Actor {
            actor: ActorKind::Hooks,
            index: step,
            source,
        })
    }

    fn run_sync<G, R, T, H>(
        &self,
        generator: &mut G,
        rewarder: &mut R,
        trainer: &mut T,
        hooks: &mut H,
        summary: &mut ControllerSummary,
    ) -> Result<(), ControllerError>
    where
        G: Generator<W>,
        R: Rewarder<G::Item>,
        T: Trainer<W, Scored = R::Scored>,
        H: Hooks<T, T::Report>,
    {
        let mut batch_index = 0u64;
        let cancelled = |summary: &ControllerSummary| ControllerError::Cancelled {
            steps_done: summary.steps,
        };
        for step in 0..self.config.steps {
            let step_started = Instant::now();
            let mut input = StepInput::new();
            loop {
                if self.cancel.is_cancelled() {
                    return Err(cancelled(summary));
                }
                if input.empty_batches >= self.config.max_empty_batches {
                    return Err(ControllerError::NoData {
                        step,
                        batches: input.empty_batches,
                        dropped: input.dropped,
                        bound: 0,
                    });
                }
                let index = batch_index;
                batch_index += 1;
                let actor_error = |actor, source| ControllerError::Actor {
                    actor,
                    index,
                    source,
                };
                let ctx = GenerateContext {
                    batch_index: index,
                    weights: self.weights.latest(),
                    slot: &self.weights,
                    cancel: &self.cancel,
                };
                let t = Instant::now();
                let items = guarded(|| {
                    let items = generator.generate(&ctx)?;
                    check_not_future(&items, ctx.weights.policy_version)?;
                    Ok(items)
                })
                .map_err(|e| actor_error(ActorKind::Generator, e))?;
                let rollout_s = t.elapsed().as_secs_f64();
                if self.cancel.is_cancelled() {
                    return Err(cancelled(summary));
                }
                let t = Instant::now();
                let score_ctx = ScoreContext {
                    batch_index: index,
                    cancel: &self.cancel,
                };
                let scored = guarded(|| rewarder.score(items, &score_ctx))
                    .map_err(|e| actor_error(ActorKind::Rewarder, e))?;
                let reward_s = t.elapsed().as_secs_f64();
                let envelope = Envelope {
                    batch_index: index,
                    items: scored,
                    rollout_s,
                    reward_s,
                    dropped: 0,
                };
                if input.absorb(envelope, summary.policy_version, 0) {
                    break;
                }
            }
            if self.cancel.is_cancelled() {
                return Err(cancelled(summary));
            }
            self.finish_step(trainer, hooks, step, input, None, step_started, summary)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run_async<G, R, T, H>(
        &self,
        generator: &mut G,
        rewarder: &mut R,
        trainer: &mut T,
        hooks: &mut H,
        bound: u64,
        queue_capacity: usize,
        summary: &mut ControllerSummary,
    ) -> Result<(), ControllerError>
    where
        G: Generator<W>,
        R: Rewarder<G::Item>,
        T: Trainer<W, Scored = R::Scored>,
        H: Hooks<T, T::Report>,
    {
        let poll = self.config.poll_interval;
        let first_version = summary.policy_version;
        let shared = Shared {
            slot: &self.weights,
            stop: self.cancel.child(),
            failure: Mutex::new(None),
            idle_generator_ns: AtomicU64::new(0),
            idle_rewarder_ns: AtomicU64::new(0),
        };
        let generated: BoundedQueue<Envelope<G::Item>> = BoundedQueue::new(queue_capacity);
        let scored: BoundedQueue<Envelope<R::Scored>> = BoundedQueue::new(queue_capacity);

        let trainer_result = std::thread::scope(|scope| {
            let generator_thread = std::thread::Builder::new()
                .name("composer-generator".into())
                .spawn_scoped(scope, || {
                    generator_loop(generator, &shared, &generated, first_version, bound, poll);
                    generated.close();
                });
            let rewarder_thread = std::thread::Builder::new()
                .name("composer-rewarder".into())
                .spawn_scoped(scope, || {
                    rewarder_loop(rewarder, &shared, &generated, &scored, bound, poll);
                    scored.close();
                    // Unblock a generator waiting for room.
                    generated.close();
                });
            if let Err(e) = generator_thread.and(rewarder_thread) {
                shared.fail(
                    ActorKind::Generator,
                    0,
                    anyhow::Error::new(e).context("spawning an actor thread"),
                );
            }
            let mut result = self.trainer_loop(trainer, hooks, &shared, &scored, bound, summary);
            // Record the trainer's (or hook's) failure in the same first-wins slot, so the
            // root cause is reported even when another actor failed just after.
            if let Err(ControllerError::Actor {
                actor,
                index,
                source,
            }) = result
            {
                shared.fail(actor, index, source);
                result = Err(ControllerError::Cancelled {
                    steps_done: summary.steps,
                });
            }
            // Stop and unblock everyone; the scope then joins both threads.
            shared.stop.cancel();
            generated.close();
            scored.close();
            result
        });

        let failure = shared
            .failure
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        match (trainer_result, failure) {
            (_, Some(f)) => Err(ControllerError::Actor {
                actor: f.actor,
                index: f.index,
                source: f.error,
            }),
            (result, None) => result,
        }
    }

    fn trainer_loop<T, H>(
        &self,
        trainer: &mut T,
        hooks: &mut H,
        shared: &Shared<'_, W>,
        scored: &BoundedQueue<Envelope<T::Scored>>,
        bound: u64,
        summary: &mut ControllerSummary,
    ) -> Result<(), ControllerError>
    where
        T: Trainer<W>,
        T::Scored: Versioned,
        H: Hooks<T, T::Report>,
    {
        let poll = self.config.poll_interval;
        let mut step_started = Instant::now();
        for step in 0..self.config.steps {
            let mut input = StepInput::new();
            let mut idle_trainer_s = 0.0;
            loop {
                if shared.stop.is_cancelled() {
                    return Err(ControllerError::Cancelled {
                        steps_done: summary.steps,
                    });
                }
                if input.empty_batches >= self.config.max_empty_batches {
                    return Err(ControllerError::NoData {
                        step,
                        batches: input.empty_batches,
                        dropped: input.dropped,
                        bound,
                    });
                }
                let waited = Instant::now();
                let popped = scored.pop(poll);
                idle_trainer_s += waited.elapsed().as_secs_f64();
                match popped {
                    Ok(envelope) => {
                        if input.absorb(envelope, summary.policy_version, bound) {
                            break;
                        }
                    }
                    Err(PopError::Timeout) => {}
                    // The rewarder stopped: its (or the generator's) failure is recorded.
                    Err(PopError::Closed) => {
                        return Err(ControllerError::Cancelled {
                            steps_done: summary.steps,
                        })
                    }
                }
            }
            let idle = (
                take_idle_s(&shared.idle_generator_ns),
                take_idle_s(&shared.idle_rewarder_ns),
                idle_trainer_s,
            );
            self.finish_step(
                trainer,
                hooks,
                step,
                input,
                Some(idle),
                step_started,
                summary,
            )?;
            step_started = Instant::now();
        }
        Ok(())
    }
}

/// Generator thread: waits until batch `i` is within the bound, generates, ships.
fn generator_loop<W, G: Generator<W>>(
    generator: &mut G,
    shared: &Shared<'_, W>,
    out: &BoundedQueue<Envelope<G::Item>>,
    first_version: PolicyVersion,
    bound: u64,
    poll: Duration,
) {
    for batch_index in 0u64.. {
        // Batch i is consumed at step >= i, when the trainer holds version >= first + i:
        // starting it with version >= first + i - k keeps its lag <= k.
        let needed = (first_version + batch_index).saturating_sub(bound);
        let waited = Instant::now();
        let weights = loop {
            if shared.stop.is_cancelled() {
                add_idle(&shared.idle_generator_ns, waited);
                return;
            }
            if let Some(w) = shared.slot.wait_for(needed, poll) {
                break w;
            }
        };
        add_idle(&shared.idle_generator_ns, waited);
        let ctx = GenerateContext {
            batch_index,
            weights,
            slot: shared.slot,
            cancel: &shared.stop,
        };
        let started = Instant::now();
        let result = guarded(|| {
            let items = generator.generate(&ctx)?;
            check_not_future(&items, shared.slot.policy_version())?;
            Ok(items)
        });
        let rollout_s = started.elapsed().as_secs_f64();
        if shared.stop.is_cancelled() {
            return; // whatever it produced or failed with is a consequence of the stop
        }
        let items = match result {
            Ok(items) => items,
            Err(e) => return shared.fail(ActorKind::Generator, batch_index, e),
        };
        let mut envelope = Envelope {
            batch_index,
            items,
            rollout_s,
            reward_s: 0.0,
            dropped: 0,
        };
        let waited = Instant::now();
        loop {
            match out.push(envelope, poll) {
                Ok(()) => break,
                Err(PushError::Timeout(back)) if !shared.stop.is_cancelled() => envelope = back,
                Err(_) => {
                    add_idle(&shared.idle_generator_ns, waited);
                    return;
                }
            }
        }
        add_idle(&shared.idle_generator_ns, waited);
    }
}

/// Rewarder thread: drops what is already too stale, scores the rest, ships.
fn rewarder_loop<W, I: Versioned, R: Rewarder<I>>(
    rewarder: &mut R,
    shared: &Shared<'_, W>,
    input: &BoundedQueue<Envelope<I>>,
    out: &BoundedQueue<Envelope<R::Scored>>,
    bound: u64,
    poll: Duration,
) {
    loop {
        let waited = Instant::now();
        let popped = input.pop(poll);
        add_idle(&shared.idle_rewarder_ns, waited);
        let envelope = match popped {
            Ok(envelope) => envelope,
            Err(PopError::Timeout) if !shared.stop.is_cancelled() => continue,
            Err(_) => return,
        };
        if shared.stop.is_cancelled() {
            return;
        }
        // Lags only grow from here, so scoring an item already past the bound is wasted work.
        let (fresh, _, dropped) = drop_stale(envelope.items, shared.slot.policy_version(), bound);
        let ctx = ScoreContext {
            batch_index: envelope.batch_index,
            cancel: &shared.stop,
        };
        let started = Instant::now();
        let result = if fresh.is_empty() {
            Ok(Vec::new())
        } else {
            guarded(|| rewarder.score(fresh, &ctx))
        };
        let reward_s = started.elapsed().as_secs_f64();
        if shared.stop.is_cancelled() {
            return;
        }
        let items = match result {
            Ok(items) => items,
            Err(e) => return shared.fail(ActorKind::Rewarder, envelope.batch_index, e),
        };
        let mut scored = Envelope {
            batch_index: envelope.batch_index,
            items,
            rollout_s: envelope.rollout_s,
            reward_s,
            dropped: envelope.dropped + dropped,
        };
        let waited = Instant::now();
        loop {
            match out.push(scored, poll) {
                Ok(()) => break,
                Err(PushError::Timeout(back)) if !shared.stop.is_cancelled() => scored = back,
                Err(_) => {
                    add_idle(&shared.idle_rewarder_ns, waited);
                    return;
                }
            }
        }
        add_idle(&shared.idle_rewarder_ns, waited);
    }
}
