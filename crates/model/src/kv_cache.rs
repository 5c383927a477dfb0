//! The key/value cache of a batch of sequences, grown in blocks and written in place.
//!
//! Each layer keeps one `[B, kv_heads, capacity, head_dim]` buffer for keys and one for
//! values. A forward writes its new keys/values into the free slots (`slice_set`) and attends
//! over a view of the filled part, so a decode step copies only its own token's K/V instead
//! of the whole cache (`Tensor::cat` per step, per layer, before). When a buffer is full it
//! grows to the next multiple of [`KV_BLOCK`] slots (or to the reservation, see
//! [`KvCache::reserve`]), one copy per block. The attention reads the same numbers in the same
//! order as with a contiguous cache, so outputs are bitwise the same.
//!
//! This cache serves [`Transformer::forward`](crate::Transformer::forward) callers: prefill,
//! scoring, deterministic decoding, the [`PrefixStore`](crate::PrefixStore). The rollout
//! engine's running batch lives in a paged block pool instead (`crate::paged_kv`); prompts are
//! prefilled here and their tokens written into blocks.

use anyhow::{bail, Result};
use candle_core::Tensor;

/// Slots added per growth of a layer's buffer.
pub const KV_BLOCK: usize = 64;

/// One layer's keys and values: buffers `[B, kv_heads, capacity, head_dim]`, the first `len`
/// slots filled.
#[derive(Debug)]
pub(crate) struct LayerKv {
    buffers: Option<(Tensor, Tensor)>,
    len: usize,
}

impl LayerKv {
    fn empty() -> Self {
        LayerKv {
            buffers: None,
            len: 0,
        }
    }

    fn capacity(&self) -> usize {
        self.buffers
            .as_ref()
            .map_or(0, |(k, _)| k.dims().get(2).copied().unwrap_or(0))
    }

    /// Appends `k`, `v` (`[B, kv_heads, T, head_dim]`) and returns the keys and values of
    /// every filled slot (views of the buffers, `[B, kv_heads, len + T, head_dim]`).
    /// `reserved` is the capacity to grow to at once when it is larger than the next block.
    pub(crate) fn append(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        reserved: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (b, h, t, d) = k.dims4()?;
        let needed = self.len + t;
        if needed > self.capacity() {
            let new_cap = (needed.div_ceil(KV_BLOCK) * KV_BLOCK).max(reserved);
            let grow = |old: Option<&Tensor>, like: &Tensor| -> Result<Tensor> {
                let old_cap = old.map_or(0, |o| o.dims()[2]);
                let fresh =
                    Tensor::zeros((b, h, new_cap - old_cap, d), like.dtype(), like.device())?;
                Ok(match old {
                    // The free tail of the old buffer is copied too: one contiguous `cat`.
                    Some(o) => Tensor::cat(&[o, &fresh], 2)?,
                    None => fresh,
                })
            };
            let old = self.buffers.take();
            self.buffers = Some((
                grow(old.as_ref().map(|(k, _)| k), k)?,
                grow(old.as_ref().map(|(_, v)| v), v)?,
            ));
        }
        let (kb, vb) = self.buffers.as_ref().expect("allocated above");
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = needed;
        Ok((kb.narrow(2, 0, needed)?, vb.narrow(2, 0, needed)?))
    }
}

/// Key/value cache for a batch of sequences, owned by the caller (a prefill batch, a scored
/// or deterministically decoded sequence, a stored prefix).
///
/// Sequences are left-padded: row `b` has `left_pad[b]` padding slots before its first
/// token; padding keys are masked out and positions start at 0 at the first real token.
/// Cloning copies the buffers (they are written in place, so clones must not share them).
#[derive(Debug)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerKv>,
    pub(crate) left_pad: Vec<usize>,
    pub(crate) len: usize,
    reserved: usize,
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        let layers = self
            .layers
            .iter()
            .map(|l| LayerKv {
                buffers: l.buffers.as_ref().map(|(k, v)| {
                    (
                        k.copy().expect("copying a KV buffer"),
                        v.copy().expect("copying a KV buffer"),
                    )
                }),
                len: l.len,
            })
            .collect();
        KvCache {
            layers,
            left_pad: self.left_pad.clone(),
            len: self.len,
            reserved: self.reserved,
        }
    }
}

impl KvCache {
    /// An empty cache for `batch` rows with the given left padding per row (the padding
    /// of the first chunk fed to it).
    pub fn new(num_layers: usize, left_pad: Vec<usize>) -> Self {
        KvCache {
            layers: (0..num_layers).map(|_| LayerKv::empty()).collect(),
            left_pad,
            len: 0,
            reserved: 0,
        }
    }
    /// Reserves `slots` slots per row (padding included): the first allocation takes them
    /// all, so a generation of known length never regrows. Memory: `slots` × rows × layers ×
    /// 2 × kv_heads × head_dim elements.
    pub fn reserve(&mut self, slots: usize) {
        self.reserved = slots;
    }
    /// Slots allocated per row (the largest over layers; 0 before the first forward).
    pub fn capacity(&self) -> usize {
        self.layers.iter().map(LayerKv::capacity).max().unwrap_or(0)
    }
    /// Slots stored per row (padding included).
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when nothing has been fed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Number of rows.
    pub fn batch_size(&self) -> usize {
        self.left_pad.len()
    }
    /// Left padding per row.
    pub fn left_pad(&self) -> &[usize] {
        &self.left_pad
    }
    /// Number of real (non-padding) tokens stored for row `b`.
    pub fn seq_len(&self, b: usize) -> usize {
        self.len - self.left_pad[b]
    }
    /// The layer slot a forward appends to.
    pub(crate) fn layer_mut(&mut self, i: usize) -> (&mut LayerKv, usize) {
        (&mut self.layers[i], self.reserved)
    }
}

impl KvCache {
    /// Indices of `rows`' stored tokens (padding left out), row after row, into a layer's
    /// token-major view of `B · len` slots ([`Self::tokens_at`]).
    pub(crate) fn token_index(&self, rows: &[usize]) -> Result<Vec<u32>> {
        let mut index = Vec::new();
        for &row in rows {
            if row >= self.batch_size() {
                bail!(
                    "row {row} is outside a KV cache of {} rows",
                    self.batch_size()
                );
            }
            let first = row * self.len + self.left_pad[row];
            index.extend((first..(row + 1) * self.len).map(|i| i as u32));
        }
        Ok(index)
    }

    /// The keys and values of the tokens at `index` ([`Self::token_index`]'s, u32 on the
    /// cache's device) in layer `layer`, token-major `[2, tokens, kv_heads, head_dim]` (keys,
    /// then values): what the rollout engine writes into its block pool after a prefill. One
    /// token-major copy of the layer's filled slots and one gather, whatever the rows.
    pub(crate) fn tokens_at(&self, layer: usize, index: &Tensor) -> Result<Tensor> {
        let (k, v) = self.buffers(layer)?;
        let (b, h, _, d) = k.dims4()?;
        let major =
            |t: &Tensor| -> Result<Tensor> { Ok(t.narrow(2, 0, self.len)?.transpose(1, 2)?) };
        let kv = Tensor::stack(&[major(k)?, major(v)?], 0)?.reshape((2, b * self.len, h * d))?;
        Ok(kv
            .index_select(index, 1)?
            .reshape((2, index.dim(0)?, h, d))?)
    }

    /// [`Self::tokens_at`] of `rows`' tokens (the tests' view of a row).
    #[cfg(test)]
    pub(crate) fn rows_tokens(&self, layer: usize, rows: &[usize]) -> Result<Tensor> {
        let index = Tensor::new(self.token_index(rows)?, self.buffers(layer)?.0.device())?;
        self.tokens_at(layer, &index)
    }

    /// Layer `layer`'s key and value buffers.
    fn buffers(&self, layer: usize) -> Result<&(Tensor, Tensor)> {
        match self.layers.get(layer).and_then(|l| l.buffers.as_ref()) {
            Some(kv) => Ok(kv),
            None => bail!("layer {layer} of the KV cache holds no tokens"),
        }
    }

    /// A one-row cache holding exactly the tokens of `layers` (per layer, keys and values
    /// `[tokens, kv_heads, head_dim]`, all layers the same length): a rollout sample's KV
    /// gathered from the engine's blocks for its continuation.
    pub(crate) fn from_tokens(layers: Vec<(Tensor, Tensor)>) -> Result<KvCache> {
        let len = match layers.first() {
            Some((k, _)) => k.dim(0)?,
            None => 0,
        };
        let layers = layers
            .into_iter()
            .map(|(k, v)| {
                if k.dim(0)? != len || v.dim(0)? != len {
                    bail!("every layer of a KV row must hold {len} tokens");
                }
                let row = |t: Tensor| -> Result<Tensor> {
                    Ok(t.transpose(0, 1)?.unsqueeze(0)?.contiguous()?)
                };
                Ok(LayerKv {
                    buffers: Some((row(k)?, row(v)?)),
                    len,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layers,
            left_pad: vec![0],
            len,
            reserved: 0,
        })
    }
}
