//! KV rows of finished samples kept for their continuations: a multi-turn episode's next
//! turn starts with the previous turn's context and completion, so only the new tokens (the
//! environment's observation) need a prefill.
//!
//! The engine stores each finished sample's row under the tokens it fed (prompt and
//! completion but the last token, which was sampled and never fed) and, when a later prompt
//! starts with stored tokens, takes that row out and prefills only the rest. An entry is used
//! once (the next turn extends it); the oldest entries go first when the store would hold
//! more than its token bound (memory: tokens × layers × 2 × kv_heads × head_dim elements).
//!
//! Stored K/V belong to the weights that computed them: a store must not outlive a weight
//! update (the trainer keeps one per rollout step's turn sampler).

use crate::kv_cache::KvCache;
use std::collections::VecDeque;

/// Stored KV rows keyed by the tokens they hold, at most `max_tokens` tokens in all.
#[derive(Debug)]
pub struct PrefixStore {
    entries: VecDeque<(Vec<u32>, KvCache)>,
    tokens: usize,
    max_tokens: usize,
}

impl PrefixStore {
    /// An empty store holding at most `max_tokens` tokens' K/V (0 keeps nothing).
    pub fn new(max_tokens: usize) -> Self {
        PrefixStore {
            entries: VecDeque::new(),
            tokens: 0,
            max_tokens,
        }
    }

    /// Tokens whose K/V are stored.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Number of rows stored.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Stores `cache` (one row holding exactly `tokens`), dropping the oldest rows while the
    /// store would exceed its token bound (a row larger than the bound is not stored).
    pub(crate) fn insert(&mut self, tokens: Vec<u32>, cache: KvCache) {
        if tokens.is_empty() || tokens.len() > self.max_tokens {
            return;
        }
        while self.tokens + tokens.len() > self.max_tokens {
            match self.entries.pop_front() {
                Some((old, _)) => self.tokens -= old.len(),
                None => break,
            }
        }
        self.tokens += tokens.len();
        self.entries.push_back((tokens, cache));
    }

    /// Takes out the stored row with the longest token list that is a proper prefix of
    /// `prompt` (at least one prompt token is left to feed), with its length.
    pub(crate) fn take_longest_prefix(&mut self, prompt: &[u32]) -> Option<(usize, KvCache)> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, (t, _))| t.len() < prompt.len() && prompt.starts_with(t))
            .max_by_key(|(_, (t, _))| t.len())
            .map(|(i, _)| i)?;
        let (tokens, cache) = self.entries.remove(best)?;
        self.tokens -= tokens.len();
        Some((tokens.len(), cache))
    }
}
