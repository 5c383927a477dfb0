//! Bounded-async mode: generator and rewarder threads run ahead of the trainer by at most
//! the staleness bound, feeding it through bounded queues.
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::actor::{ActorKind, GenerateContext, Generator, Rewarder, ScoreContext, Trainer};
use crate::queue::{BoundedQueue, PopError, PushError};
use crate::record::ControllerSummary;
use crate::version::{PolicyVersion, Versioned};

use super::shared::{
    add_idle, check_not_future, drop_stale, guarded, take_idle_s, Envelope, Shared, StepInput,
};
use super::{Controller, ControllerError, Hooks};

impl<W: Send + Sync> Controller<W> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_async<G, R, T, H>(
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

    pub(super) fn trainer_loop<T, H>(
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
                // Tolerates `max_empty_batches` empty batches (see `run_sync`).
                if input.empty_batches > self.config.max_empty_batches {
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
                &shared.stop,
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
