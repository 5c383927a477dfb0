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
    /// The flags of every ancestor (parent, grandparent, ...): a child of a child must still
    /// see the root's Ctrl-C, so the whole chain is kept, not just the nearest flag.
    ancestors: Vec<Arc<AtomicBool>>,
}

impl CancelToken {
    /// A fresh, unset token.
    pub fn new() -> Self {
        Self::default()
    }

    /// A token that reads as cancelled when it or `self` is cancelled (including through
    /// `self`'s own ancestors); cancelling the child does not cancel `self`.
    pub fn child(&self) -> Self {
        let mut ancestors = self.ancestors.clone();
        ancestors.push(Arc::clone(&self.flag));
        Self {
            flag: Arc::new(AtomicBool::new(false)),
            ancestors,
        }
    }

    /// Sets the flag (idempotent; safe from a signal-handler thread).
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }

    /// Whether this token or any of its ancestors was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::SeqCst) || self.ancestors.iter().any(|p| p.load(Ordering::SeqCst))
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

    #[test]
    fn grandchild_sees_the_root() {
        let root = CancelToken::new();
        let grandchild = root.child().child();
        assert!(!grandchild.is_cancelled());
        root.cancel();
        assert!(
            grandchild.is_cancelled(),
            "a child of a child lost the root"
        );
    }
}
