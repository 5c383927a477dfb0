//! A bounded FIFO queue whose every wait has a timeout, so no actor can block forever on a
//! peer that has stopped (std's `sync_channel` has no send timeout).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Why a push did not happen; the item comes back.
#[derive(Debug)]
pub(crate) enum PushError<T> {
    /// The queue stayed full for the whole timeout.
    Timeout(T),
    /// The queue was closed.
    Closed(T),
}

/// Why a pop returned nothing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PopError {
    /// The queue stayed empty for the whole timeout.
    Timeout,
    /// The queue is closed and drained.
    Closed,
}

struct State<T> {
    items: VecDeque<T>,
    closed: bool,
}

/// Bounded multi-producer multi-consumer FIFO.
pub(crate) struct BoundedQueue<T> {
    capacity: usize,
    state: Mutex<State<T>>,
    not_empty: Condvar,
    not_full: Condvar,
}

impl<T> BoundedQueue<T> {
    /// A queue holding at most `capacity` items (at least 1).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            state: Mutex::new(State {
                items: VecDeque::new(),
                closed: false,
            }),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends `item`, waiting up to `timeout` for room.
    pub(crate) fn push(&self, item: T, timeout: Duration) -> Result<(), PushError<T>> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        loop {
            if state.closed {
                return Err(PushError::Closed(item));
            }
            if state.items.len() < self.capacity {
                state.items.push_back(item);
                drop(state);
                self.not_empty.notify_one();
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(PushError::Timeout(item));
            }
            state = self
                .not_full
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Takes the oldest item, waiting up to `timeout` for one.
    pub(crate) fn pop(&self, timeout: Duration) -> Result<T, PopError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(item) = state.items.pop_front() {
                drop(state);
                self.not_full.notify_one();
                return Ok(item);
            }
            if state.closed {
                return Err(PopError::Closed);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(PopError::Timeout);
            }
            state = self
                .not_empty
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Closes the queue: pushes fail, pops drain what is left then fail; wakes all waiters.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.not_empty.notify_all();
        self.not_full.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_millis(2);

    #[test]
    fn fifo_bounded_and_closable() {
        let q = BoundedQueue::new(2);
        q.push(1, SHORT).unwrap();
        q.push(2, SHORT).unwrap();
        assert!(matches!(q.push(3, SHORT), Err(PushError::Timeout(3))));
        assert_eq!(q.pop(SHORT), Ok(1));
        q.push(3, SHORT).unwrap();
        q.close();
        assert!(matches!(q.push(4, SHORT), Err(PushError::Closed(4))));
        assert_eq!(q.pop(SHORT), Ok(2));
        assert_eq!(q.pop(SHORT), Ok(3));
        assert_eq!(q.pop(SHORT), Err(PopError::Closed));
        let empty: BoundedQueue<u8> = BoundedQueue::new(0);
        assert_eq!(empty.pop(SHORT), Err(PopError::Timeout));
    }
}
