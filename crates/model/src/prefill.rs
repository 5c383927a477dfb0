//! Prompt prefill for the rollout engine: left-padded batches fed in chunks, and prompts
//! continued from a [`PrefixStore`] row (only their new tokens are fed).

use crate::kv_cache::KvCache;
use crate::prefix_store::PrefixStore;
use crate::transformer::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;

/// What prefill forwards did, for the caller's statistics (the engine's `EngineStats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PrefillCounts {
    /// Real prompt tokens fed (padding not counted).
    pub(crate) tokens: usize,
    /// Forwards run (one per chunk).
    pub(crate) forwards: usize,
}

/// Prefilled prompts: their K/V (in a shared left-padded batch, or a cache of their own when
/// continued from a store row) and next-token logits.
pub(crate) struct Prefilled {
    /// The prompts not continued from the store, left-padded in prompt order.
    batch: Option<KvCache>,
    /// Per prompt: its own cache when continued, else None (its row of `batch`).
    continued: Vec<Option<KvCache>>,
    /// Per prompt: its row in its cache.
    rows: Vec<usize>,
    /// Next-token logits `[prompts, V]`.
    pub(crate) logits: Tensor,
}

impl Prefilled {
    /// The caches and, per cache, its prompts as (prompt index, row there): the batch of
    /// plain prompts first (if any), then each continued prompt's own cache.
    pub(crate) fn groups(&self) -> Vec<(&KvCache, Vec<(usize, usize)>)> {
        let mut groups = Vec::new();
        if let Some(batch) = &self.batch {
            let plain = (0..self.rows.len()).filter(|&i| self.continued[i].is_none());
            groups.push((batch, plain.map(|i| (i, self.rows[i])).collect()));
        }
        for (i, c) in self.continued.iter().enumerate() {
            if let Some(c) = c {
                groups.push((c, vec![(i, self.rows[i])]));
            }
        }
        groups
    }
}

/// Prefills `prompts` (K/V and next-token logits of each). A prompt that starts with a row of
/// `store` feeds only the tokens after it onto that row; the others are left-padded into one
/// batch. Prompts are fed `chunk` tokens per forward (0 = all at once); `counts` gains the
/// tokens and forwards fed.
pub(crate) fn prefill(
    model: &Transformer,
    prompts: &[&[u32]],
    chunk: usize,
    mut store: Option<&mut PrefixStore>,
    counts: &mut PrefillCounts,
) -> Result<Prefilled> {
    let mut continued: Vec<Option<KvCache>> = Vec::with_capacity(prompts.len());
    let mut own_logits: Vec<Option<Tensor>> = Vec::with_capacity(prompts.len());
    for p in prompts {
        let hit = store.as_deref_mut().and_then(|s| s.take_longest_prefix(p));
        let (cache, logits) = match hit {
            Some((stored, mut cache)) => {
                cache.reserve(p.len());
                let input = Tensor::new(&p[stored..], model.device())?.unsqueeze(0)?;
                let last = feed(model, &mut cache, &input, chunk, counts)?;
                counts.tokens += p.len() - stored;
                (Some(cache), Some(model.logits(&last)?.squeeze(1)?))
            }
            None => (None, None),
        };
        continued.push(cache);
        own_logits.push(logits);
    }
    let plain: Vec<&[u32]> = prompts
        .iter()
        .zip(&continued)
        .filter(|(_, c)| c.is_none())
        .map(|(p, _)| *p)
        .collect();
    let (batch, batch_logits) = if plain.is_empty() {
        (None, None)
    } else {
        let (cache, logits) = prefill_batch(model, &plain, chunk, counts)?;
        (Some(cache), Some(logits))
    };
    let mut rows = Vec::with_capacity(prompts.len());
    let mut logits = Vec::with_capacity(prompts.len());
    let mut next_plain = 0;
    for own in own_logits {
        match own {
            Some(lg) => {
                rows.push(0);
                logits.push(lg);
            }
            None => {
                let lg = batch_logits.as_ref().expect("plain prompts were batched");
                rows.push(next_plain);
                logits.push(lg.narrow(0, next_plain, 1)?);
                next_plain += 1;
            }
        }
    }
    // One prompt, or all plain: the batch's logits as they are.
    let logits = match batch_logits {
        Some(lg) if next_plain == prompts.len() => lg,
        _ => Tensor::cat(&logits, 0)?,
    };
    Ok(Prefilled {
        batch,
        continued,
        rows,
        logits,
    })
}

/// Prefills `prompts` left-padded into one batch; returns their cache and next-token logits.
fn prefill_batch(
    model: &Transformer,
    prompts: &[&[u32]],
    chunk: usize,
    counts: &mut PrefillCounts,
) -> Result<(KvCache, Tensor)> {
    let max_len = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(prompts.len() * max_len);
    let mut pads = Vec::with_capacity(prompts.len());
    for p in prompts {
        pads.push(max_len - p.len());
        ids.extend(std::iter::repeat_n(0u32, max_len - p.len()));
        ids.extend_from_slice(p);
    }
    let input = Tensor::from_vec(ids, (prompts.len(), max_len), model.device())?;
    let mut cache = KvCache::new(model.cfg.num_hidden_layers, pads);
    cache.reserve(max_len);
    let last = feed(model, &mut cache, &input, chunk, counts)?;
    counts.tokens += prompts.iter().map(|p| p.len()).sum::<usize>();
    Ok((cache, model.logits(&last)?.squeeze(1)?))
}

/// Feeds `input` (`[rows, T]`, T > 0) through `cache`, `chunk` columns per forward (0 = all
/// at once); returns the last position's hidden states `[rows, 1, hidden]`.
fn feed(
    model: &Transformer,
    cache: &mut KvCache,
    input: &Tensor,
    chunk: usize,
    counts: &mut PrefillCounts,
) -> Result<Tensor> {
    let len = input.dim(1)?;
    let step = if chunk == 0 { len } else { chunk };
    let mut start = 0;
    let mut last = None;
    while start < len {
        let t = step.min(len - start);
        let hidden = model.forward_hidden(&input.narrow(1, start, t)?, None, Some(cache), false)?;
        last = Some(hidden.narrow(1, t - 1, 1)?);
        counts.forwards += 1;
        start += t;
    }
    match last {
        Some(h) => Ok(h),
        None => bail!("nothing to prefill"),
    }
}
