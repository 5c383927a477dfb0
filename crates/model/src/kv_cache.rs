//! The key/value cache of a batch of sequences, grown in blocks and written in place.
//!
//! Each layer keeps one `[B, kv_heads, capacity, head_dim]` buffer for keys and one for
//! values. A forward writes its new keys/values into the free slots (`slice_set`) and attends
//! over a view of the filled part, so a decode step copies only its own token's K/V instead
//! of the whole cache (`Tensor::cat` per step, per layer, before). When a buffer is full it
//! grows to the next multiple of [`KV_BLOCK`] slots (or to the reservation, see
//! [`KvCache::reserve`]), one copy per block. The attention reads the same numbers in the same
//! order as with a contiguous cache, so outputs are bitwise the same.

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

    /// A deep copy of rows `idx` from slot `trim` on, keeping the free capacity.
    fn select(&self, idx: &Tensor, trim: usize) -> Result<LayerKv> {
        let Some((k, v)) = &self.buffers else {
            return Ok(LayerKv::empty());
        };
        let cap = self.capacity() - trim;
        let sel = |t: &Tensor| -> Result<Tensor> {
            // Rows first: candle's index_select needs a contiguous source, which the slot
            // narrowing would not be when `trim` > 0 (and a buffer stacked or overwritten
            // in place may not be either: `contiguous` is free when it already is).
            let t = t.contiguous()?.index_select(idx, 0)?.narrow(2, trim, cap)?;
            Ok(t.contiguous()?)
        };
        Ok(LayerKv {
            buffers: Some((sel(k)?, sel(v)?)),
            len: self.len - trim,
        })
    }
}

/// Key/value cache for a batch of sequences, owned by the caller (one per rollout batch).
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
    /// A cache holding only `rows` (in that order; repeats allowed), e.g. to expand a
    /// prompt's cache to n samples or to drop finished samples. Padding columns common to
    /// all kept rows are trimmed; the free capacity is kept.
    pub fn select_rows(&self, rows: &[usize]) -> Result<KvCache> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= self.batch_size()) {
            bail!(
                "row {bad} is outside a KV cache of {} rows",
                self.batch_size()
            );
        }
        let left_pad: Vec<usize> = rows.iter().map(|&r| self.left_pad[r]).collect();
        let trim = left_pad.iter().copied().min().unwrap_or(0);
        let device = self
            .layers
            .iter()
            .find_map(|l| l.buffers.as_ref().map(|(k, _)| k.device().clone()));
        let layers = match device {
            Some(dev) => {
                let idx = Tensor::new(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), &dev)?;
                self.layers
                    .iter()
                    .map(|l| l.select(&idx, trim))
                    .collect::<Result<Vec<_>>>()?
            }
            None => self.layers.iter().map(|_| LayerKv::empty()).collect(),
        };
        Ok(KvCache {
            layers,
            left_pad: left_pad.iter().map(|p| p - trim).collect(),
            len: self.len - trim,
            reserved: self.reserved.saturating_sub(trim),
        })
    }
}

impl KvCache {
    /// The rows of `parts` stacked into one cache (part 0's rows first), left-aligned: every
    /// row keeps its own tokens, and shorter parts get extra left padding so all end at the
    /// same slot. Padding columns common to a part's rows are dropped first. The buffers get
    /// `capacity` slots per row (at least the longest part; more is free room to decode into
    /// without regrowing). This is how a continuous batch admits newly prefilled rows.
    pub fn concat_rows(parts: &[&KvCache], capacity: usize) -> Result<KvCache> {
        let Some(first) = parts.first() else {
            bail!("concat_rows needs at least one cache");
        };
        let num_layers = first.layers.len();
        if let Some(p) = parts.iter().find(|p| p.layers.len() != num_layers) {
            bail!(
                "cannot stack KV caches of {} and {num_layers} layers",
                p.layers.len()
            );
        }
        // Per part: leading padding common to its rows, and the slots kept after dropping it.
        let trims: Vec<usize> = parts
            .iter()
            .map(|p| p.left_pad.iter().copied().min().unwrap_or(0))
            .collect();
        let lens: Vec<usize> = parts.iter().zip(&trims).map(|(p, t)| p.len - t).collect();
        let len = lens.iter().copied().max().unwrap_or(0);
        if capacity < len {
            bail!("capacity {capacity} is below the longest stacked row ({len} slots)");
        }
        let mut layers = Vec::with_capacity(num_layers);
        for i in 0..num_layers {
            let mut ks = Vec::with_capacity(parts.len());
            let mut vs = Vec::with_capacity(parts.len());
            for ((p, &trim), &plen) in parts.iter().zip(&trims).zip(&lens) {
                if p.batch_size() == 0 {
                    continue;
                }
                let Some((k, v)) = &p.layers[i].buffers else {
                    bail!("cannot stack a KV cache that holds no tokens");
                };
                let place = |t: &Tensor| -> Result<Tensor> {
                    let (b, h, _, d) = t.dims4()?;
                    let mut pieces = Vec::with_capacity(3);
                    if len > plen {
                        pieces.push(Tensor::zeros((b, h, len - plen, d), t.dtype(), t.device())?);
                    }
                    pieces.push(t.narrow(2, trim, plen)?);
                    if capacity > len {
                        pieces.push(Tensor::zeros(
                            (b, h, capacity - len, d),
                            t.dtype(),
                            t.device(),
                        )?);
                    }
                    Ok(Tensor::cat(&pieces, 2)?)
                };
                ks.push(place(k)?);
                vs.push(place(v)?);
            }
            layers.push(LayerKv {
                buffers: Some((Tensor::cat(&ks, 0)?, Tensor::cat(&vs, 0)?)),
                len,
            });
        }
        let left_pad = parts
            .iter()
            .zip(&trims)
            .zip(&lens)
            .flat_map(|((p, &trim), &plen)| p.left_pad.iter().map(move |&x| x - trim + len - plen))
            .collect();
        Ok(KvCache {
            layers,
            left_pad,
            len,
            reserved: capacity,
        })
    }
}

impl KvCache {
    /// Overwrites row `row` in place with row `src_row` of `src`: that row's stored tokens go
    /// right-aligned to this cache's current length and the slots before them become padding.
    /// Only the copied tokens are written (a continuous batch reuses a finished sample's row
    /// this way instead of rebuilding the whole cache).
    pub fn overwrite_row(&mut self, row: usize, src: &KvCache, src_row: usize) -> Result<()> {
        if row >= self.batch_size() || src_row >= src.batch_size() {
            bail!(
                "row {row} (of {}) or source row {src_row} (of {}) is out of range",
                self.batch_size(),
                src.batch_size()
            );
        }
        if src.layers.len() != self.layers.len() {
            bail!(
                "cannot copy a row of a {}-layer KV cache into a {}-layer one",
                src.layers.len(),
                self.layers.len()
            );
        }
        let n = src.seq_len(src_row);
        if n > self.len {
            bail!(
                "a row of {n} tokens does not fit before slot {} of this cache",
                self.len
            );
        }
        let from = src.left_pad[src_row];
        for (dst, s) in self.layers.iter().zip(&src.layers) {
            let (Some((dk, dv)), Some((sk, sv))) = (&dst.buffers, &s.buffers) else {
                bail!("cannot copy rows of a KV cache that holds no tokens");
            };
            for (d, s) in [(dk, sk), (dv, sv)] {
                let piece = s.narrow(0, src_row, 1)?.narrow(2, from, n)?.contiguous()?;
                // A one-row view of a contiguous buffer is contiguous: written in place.
                d.narrow(0, row, 1)?.slice_set(&piece, 2, self.len - n)?;
            }
        }
        self.left_pad[row] = self.len - n;
        Ok(())
    }
}

impl KvCache {
    /// A one-row copy of row `row` holding only its stored tokens (no padding, no free room):
    /// what is kept of a finished sample for its continuation.
    pub fn row(&self, row: usize) -> Result<KvCache> {
        if row >= self.batch_size() {
            bail!(
                "row {row} is outside a KV cache of {} rows",
                self.batch_size()
            );
        }
        let (from, n) = (self.left_pad[row], self.seq_len(row));
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let Some((k, v)) = &l.buffers else {
                    return Ok(LayerKv::empty());
                };
                let cut = |t: &Tensor| -> Result<Tensor> {
                    Ok(t.narrow(0, row, 1)?.narrow(2, from, n)?.contiguous()?)
                };
                Ok(LayerKv {
                    buffers: Some((cut(k)?, cut(v)?)),
                    len: n,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layers,
            left_pad: vec![0],
            len: n,
            reserved: 0,
        })
    }
}
