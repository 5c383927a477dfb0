//! The weight slot between trainer and generator.
//!
//! Publishing swaps an `Arc<W>` under a mutex and wakes waiters: colocated publishing copies
//! nothing beyond what the trainer chose to snapshot into `W` (it may be the trainer's own
//! frozen tensors, a cheap clone of reference-counted buffers, or a path to a checkpoint on
//! disk for a generator in another process).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::version::PolicyVersion;

/// A snapshot of published weights with the policy version they represent.
#[derive(Debug)]
pub struct Published<W> {
    /// Version of these weights.
    pub policy_version: PolicyVersion,
    /// The weights, shared (never copied by the controller).
    pub weights: Arc<W>,
}

impl<W> Clone for Published<W> {
    fn clone(&self) -> Self {
        Self {
            policy_version: self.policy_version,
            weights: Arc::clone(&self.weights),
        }
    }
}

/// A watch-like slot holding the newest published weights.
#[derive(Debug)]
pub struct PublishedWeights<W> {
    latest: Mutex<Published<W>>,
    changed: Condvar,
}

impl<W> PublishedWeights<W> {
    /// A slot holding `weights` as `policy_version` (the initial or resumed policy).
    pub fn new(policy_version: PolicyVersion, weights: Arc<W>) -> Self {
        Self {
            latest: Mutex::new(Published {
                policy_version,
                weights,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Published<W>> {
        // A panic while holding this lock can only happen inside this module's trivial
        // critical sections; the data (an Arc and a number) is always consistent.
        self.latest.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the weights by `weights` as `policy_version` and wakes every waiter.
    pub fn publish(&self, policy_version: PolicyVersion, weights: Arc<W>) {
        let old = {
            let mut latest = self.lock();
            std::mem::replace(
                &mut *latest,
                Published {
                    policy_version,
                    weights,
                },
            )
        };
        // Drop the previous snapshot outside the lock: freeing large weights can take time.
        drop(old);
        self.changed.notify_all();
    }

    /// The newest published weights.
    pub fn latest(&self) -> Published<W> {
        self.lock().clone()
    }

    /// The newest published version.
    pub fn policy_version(&self) -> PolicyVersion {
        self.lock().policy_version
    }

    /// The newest weights if their version is newer than `than`.
    pub fn newer_than(&self, than: PolicyVersion) -> Option<Published<W>> {
        let latest = self.lock();
        (latest.policy_version > than).then(|| latest.clone())
    }

    /// Waits up to `timeout` for a version `>= at_least`; returns the newest weights if reached.
    pub fn wait_for(&self, at_least: PolicyVersion, timeout: Duration) -> Option<Published<W>> {
        let deadline = Instant::now() + timeout;
        let mut latest = self.lock();
        loop {
            if latest.policy_version >= at_least {
                return Some(latest.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            latest = self
                .changed
                .wait_timeout(latest, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_shares_instead_of_copying() {
        let slot = PublishedWeights::new(0, Arc::new(vec![1.0f32; 4]));
        let w = Arc::new(vec![2.0f32; 4]);
        slot.publish(1, Arc::clone(&w));
        let got = slot.latest();
        assert_eq!(got.policy_version, 1);
        assert!(
            Arc::ptr_eq(&got.weights, &w),
            "the slot must hand out the same allocation"
        );
        assert!(slot.newer_than(1).is_none());
        assert_eq!(slot.newer_than(0).map(|p| p.policy_version), Some(1));
    }

    #[test]
    fn wait_for_wakes_on_publish() {
        let slot = Arc::new(PublishedWeights::new(0, Arc::new(0u32)));
        let s2 = Arc::clone(&slot);
        let t = std::thread::spawn(move || s2.wait_for(2, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(5));
        slot.publish(1, Arc::new(1));
        slot.publish(2, Arc::new(2));
        let got = t.join().unwrap().expect("woken");
        assert_eq!(got.policy_version, 2);
        assert!(slot.wait_for(3, Duration::from_millis(1)).is_none());
    }
}
