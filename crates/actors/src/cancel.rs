//! Cooperative cancellation shared by the controller, the actors and a Ctrl-C handler.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A clonable cancellation flag. The trainer binary installs a Ctrl-C handler that calls
/// [`CancelToken::cancel`] on the token it passes to the controller; the controller gives the
/// actors a child token that is also set when the run stops for any other reason (an actor
/// failed, or the last step is done), so a long rollout can check it and return early.
#[derive(Debug, Clone, Default)]
pub struct CancelToken {
    flag: Arc<AtomicBool>,
    parent: Option<Arc<AtomicBool>>,
}

impl CancelToken {
    /// A fresh, unset token.
    pub fn new() -> Self {
        Self::default()
    }

    /// A token that reads as cancelled when it or `self` is cancelled; cancelling the child
    /// does not cancel `self`.
    pub fn child(&self) -> Self {
        Self {
            flag: Arc::new(AtomicBool::new(false)),
            parent: Some(Arc::clone(&self.flag)),
        }
    }

    /// Sets the flag (idempotent; safe from a signal-handler thread).
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }

    /// Whether this token or its parent was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
            || self
                .parent
                .as_ref()
                .is_some_and(|p| p.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_sees_parent_but_not_the_reverse() {
        let parent = CancelToken::new();
        let child = parent.child();
        child.cancel();
        assert!(child.is_cancelled());
        assert!(!parent.is_cancelled());
        let child2 = parent.child();
        parent.cancel();
        assert!(child2.is_cancelled());
        assert!(parent.clone().is_cancelled());
    }
}
