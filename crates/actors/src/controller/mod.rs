//! The controller: runs the actors in sync or bounded-async mode and records every step.
//!
//! `shared` holds the state the actor threads share and the step-input bookkeeping;
//! `async_mode` the bounded-async run (the generator and rewarder threads).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::actor::{
    ActorKind, GenerateContext, Generator, Rewarder, ScoreContext, TrainContext, Trainer,
};
use crate::cancel::CancelToken;
use crate::record::{ControllerSummary, IdleTimes, RunEnd, StalenessStats, StepRecord, StepWalls};
use crate::version::PolicyVersion;
use crate::weights::PublishedWeights;
use shared::{check_not_future, guarded, Envelope, StepInput};

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

    /// Trains on `input`, publishes, records and calls the step hook; `stop` is the token the
    /// trainer sees in [`TrainContext::cancel`].
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
        stop: &CancelToken,
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
            // The run's stop token (async: also set when another actor fails), so a long step
            // polling it ends early instead of finishing for a run that already failed.
            cancel: stop.clone(),
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
                // `max_empty_batches` empty batches are tolerated: the run fails on the next one
                // (with 0 the first empty batch fails it, but a non-empty one still trains).
                if input.empty_batches > self.config.max_empty_batches {
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
            self.finish_step(
                trainer,
                hooks,
                step,
                input,
                None,
                step_started,
                summary,
                &self.cancel,
            )?;
        }
        Ok(())
    }
}

mod async_mode;
mod shared;
