//! The rollout engine's paged KV cache: one block pool per layer and a block table per
//! sequence.
//!
//! Each layer keeps a key pool and a value pool `[slots, kv_heads, head_dim]` (the two halves
//! of one tensor), `block_size` slots per block. A sequence is a [`BlockTable`]: its blocks in
//! order and its length; token `j` lies in slot `blocks[j / block_size] * block_size + j %
//! block_size`. Blocks are reference-counted, so the samples of one request point at the same
//! prompt blocks (the prompt is prefilled once and written once). A sequence appending into a block others still
//! read copies that block first (copy on write: only a prompt's partly filled last block is
//! ever shared and appended to); a block is free again when no table holds it. Freed blocks
//! are reused before the pool grows; the pool grows (one copy of each layer's pool) only when
//! every block is held.
//!
//! Decode attention reads the blocks in place ([`crate::ops::paged_decode_attention`]); a
//! forward writes its new keys/values into their slots with one write per layer
//! ([`crate::ops::write_kv_slots`]).

use crate::kv_cache::KvCache;
use crate::ops::{KvSlots, PagedLayout};
use crate::transformer::Transformer;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// Blocks the pool grows by at least, so small pools do not regrow every step.
const MIN_GROWTH_BLOCKS: usize = 16;

/// One layer's key and value pools as one tensor `[2, slots, kv_heads, head_dim]` (the keys'
/// pool, then the values'), so a step's keys and values are written in one launch.
#[derive(Debug)]
pub(crate) struct PoolLayer {
    kv: Tensor,
}

impl PoolLayer {
    /// The key pool `[slots, kv_heads, head_dim]` (a view: it shares the pool's storage).
    pub(crate) fn keys(&self) -> Result<Tensor> {
        Ok(self.kv.get(0)?)
    }

    /// The value pool `[slots, kv_heads, head_dim]` (a view).
    pub(crate) fn values(&self) -> Result<Tensor> {
        Ok(self.kv.get(1)?)
    }

    /// Writes `kv` (`[2, rows, kv_heads, head_dim]`: the keys, then the values) into the
    /// slots of `slots`, in place.
    pub(crate) fn write(&self, slots: &KvSlots, kv: &Tensor) -> Result<()> {
        crate::ops::write_kv_slots(&self.kv, kv, slots)
    }

    /// Both pools as one tensor `[2, slots, kv_heads, head_dim]`, for an op that writes the
    /// step's keys and values itself ([`crate::ops::decode_qkv_into_cache`]).
    pub(crate) fn pools(&self) -> &Tensor {
        &self.kv
    }
}

/// A sequence's blocks (in token order) and its length in tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BlockTable {
    pub(crate) blocks: Vec<u32>,
    pub(crate) len: usize,
}

/// What one decode step writes and reads: each row's new slot ([`KvSlots`]) and the
/// rows' block tables with their lengths after the step's token.
pub(crate) struct PagedStep {
    pub(crate) slots: KvSlots,
    pub(crate) layout: PagedLayout,
}

/// The block pools of every layer and the blocks' reference counts.
#[derive(Debug)]
pub(crate) struct BlockPool {
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    /// Empty until the first block is taken.
    layers: Vec<PoolLayer>,
    num_layers: usize,
    refs: Vec<u32>,
    free: Vec<u32>,
    /// Most blocks ever held at once (0 = no bound).
    max_blocks: usize,
    held: usize,
    /// Blocks copied on write.
    pub(crate) copies: usize,
    /// Times the pool grew (each growth makes new pool tensors).
    generation: u64,
}

impl BlockPool {
    /// An empty pool for `model`'s layers, `block_size` slots per block, at most `max_blocks`
    /// blocks held (0 = no bound).
    pub(crate) fn new(model: &Transformer, block_size: usize, max_blocks: usize) -> Result<Self> {
        if block_size == 0 {
            bail!("kv_block_size must be >= 1, got 0");
        }
        Ok(BlockPool {
            block_size,
            kv_heads: model.cfg.num_key_value_heads,
            head_dim: model.cfg.head_dim,
            dtype: model.dtype(),
            device: model.device().clone(),
            layers: Vec::new(),
            num_layers: model.cfg.num_hidden_layers,
            refs: Vec::new(),
            free: Vec::new(),
            max_blocks,
            held: 0,
            copies: 0,
            generation: 0,
        })
    }

    /// Blocks held by at least one table.
    pub(crate) fn held_blocks(&self) -> usize {
        self.held
    }

    /// Blocks allocated (the pool's memory: blocks × block_size × layers × 2 × kv_heads ×
    /// head_dim elements).
    pub(crate) fn capacity_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Layer `i`'s pools (after the first block was taken).
    pub(crate) fn layer(&self, i: usize) -> &PoolLayer {
        &self.layers[i]
    }

    /// Takes a free block (reference count 1), growing the pool when none is free.
    fn alloc(&mut self) -> Result<u32> {
        if self.max_blocks > 0 && self.held >= self.max_blocks {
            bail!(
                "internal: the KV block pool is full ({} blocks) although admission reserved room",
                self.max_blocks
            );
        }
        if self.free.is_empty() {
            self.grow()?;
        }
        let b = self.free.pop().expect("grow adds free blocks");
        self.refs[b as usize] = 1;
        self.held += 1;
        Ok(b)
    }

    fn grow(&mut self) -> Result<()> {
        let old = self.refs.len();
        let mut new = (2 * old).max(old + MIN_GROWTH_BLOCKS);
        if self.max_blocks > 0 {
            new = new.min(self.max_blocks).max(old + 1);
        }
        let extra = (new - old) * self.block_size;
        let zeros = Tensor::zeros(
            (2, extra, self.kv_heads, self.head_dim),
            self.dtype,
            &self.device,
        )?;
        if self.layers.is_empty() {
            for _ in 0..self.num_layers {
                self.layers.push(PoolLayer { kv: zeros.copy()? });
            }
        } else {
            for l in &mut self.layers {
                l.kv = Tensor::cat(&[&l.kv, &zeros], 1)?;
            }
        }
        self.refs.resize(new, 0);
        self.generation += 1;
        // Lowest ids on top of the free stack.
        self.free.extend((old as u32..new as u32).rev());
        Ok(())
    }

    /// Times the pool grew: the pool tensors of two equal generations are the same tensors
    /// (what a captured decode step reads).
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Takes a block for good, outside the tables and the budget's count (the padded rows of
    /// a fixed-shape decode step write and read it; `crate::decode_graph`).
    pub(crate) fn scratch_block(&mut self) -> Result<u32> {
        if self.free.is_empty() {
            self.grow()?;
        }
        let b = self.free.pop().expect("grow adds free blocks");
        self.refs[b as usize] = 1;
        Ok(b)
    }

    /// Another holder of `table`'s blocks (a sample starting from a shared prompt).
    pub(crate) fn share(&mut self, table: &BlockTable) -> BlockTable {
        for &b in &table.blocks {
            self.refs[b as usize] += 1;
        }
        table.clone()
    }

    /// Drops `table`'s hold on its blocks; blocks nobody holds are free again.
    pub(crate) fn release(&mut self, table: BlockTable) {
        for b in table.blocks {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r == 0 {
                self.held -= 1;
                self.free.push(b);
            }
        }
    }

    /// Writes rows `rows` of a prefilled cache into fresh blocks, all of them at once (per
    /// layer one token-major copy and one gather, [`KvCache::tokens_at`], then one slot
    /// write); returns their tables, in `rows`' order. On an error no block stays held.
    pub(crate) fn write_prompts(
        &mut self,
        cache: &KvCache,
        rows: &[usize],
    ) -> Result<Vec<BlockTable>> {
        let index = cache.token_index(rows)?;
        let mut tables = Vec::with_capacity(rows.len());
        let written = self
            .fill_tables(cache, rows, &mut tables)
            .and_then(|slots| self.write_slots(cache, index, slots));
        if let Err(e) = written {
            for t in tables {
                self.release(t);
            }
            return Err(e);
        }
        Ok(tables)
    }

    /// Fresh blocks for each of `rows`' tokens, pushed onto `tables` as they are taken (so a
    /// caller can release them if this fails part way); returns the tokens' slots, row after
    /// row.
    fn fill_tables(
        &mut self,
        cache: &KvCache,
        rows: &[usize],
        tables: &mut Vec<BlockTable>,
    ) -> Result<Vec<u32>> {
        let mut slots = Vec::new();
        for &row in rows {
            let n = cache.seq_len(row);
            tables.push(BlockTable {
                blocks: Vec::with_capacity(n.div_ceil(self.block_size)),
                len: n,
            });
            for _ in 0..n.div_ceil(self.block_size) {
                let b = self.alloc()?;
                tables.last_mut().expect("pushed above").blocks.push(b);
            }
            let table = tables.last().expect("pushed above");
            slots.extend((0..n).map(|j| self.slot(table, j) as u32));
        }
        Ok(slots)
    }

    /// Every layer's tokens of `cache` at `index` ([`KvCache::token_index`]) into `slots`.
    fn write_slots(&self, cache: &KvCache, index: Vec<u32>, slots: Vec<u32>) -> Result<()> {
        if index.is_empty() {
            return Ok(());
        }
        let index = Tensor::new(index, &self.device)?;
        let slots = KvSlots::new(slots, &self.device)?;
        for (i, layer) in self.layers.iter().enumerate() {
            layer.write(&slots, &cache.tokens_at(i, &index)?)?;
        }
        Ok(())
    }

    /// The slot of token `j` of `table`.
    fn slot(&self, table: &BlockTable, j: usize) -> usize {
        table.blocks[j / self.block_size] as usize * self.block_size + j % self.block_size
    }

    /// Makes room for `table`'s next token and returns its slot: a new block at a block
    /// boundary, or a private copy of the last block when other tables still hold it.
    fn prepare_append(&mut self, table: &mut BlockTable) -> Result<usize> {
        let (at, offset) = (table.len / self.block_size, table.len % self.block_size);
        if offset == 0 {
            let b = self.alloc()?;
            table.blocks.push(b);
        } else if self.refs[table.blocks[at] as usize] > 1 {
            let (src, dst) = (table.blocks[at], self.alloc()?);
            let (from, to) = (
                src as usize * self.block_size,
                dst as usize * self.block_size,
            );
            for l in &self.layers {
                for pool in [l.keys()?, l.values()?] {
                    // `copy`: slice_set cannot read and write the same storage. The pool is a
                    // view of the layer's tensor: slice_set writes through it.
                    pool.slice_set(&pool.narrow(0, from, offset)?.copy()?, 0, to)?;
                }
            }
            self.refs[src as usize] -= 1;
            table.blocks[at] = dst;
            self.copies += 1;
        }
        Ok(self.slot(table, table.len))
    }

    /// Takes the blocks one new token of each of `tables` goes to; returns their slots.
    pub(crate) fn prepare_appends(&mut self, tables: &mut [BlockTable]) -> Result<Vec<u32>> {
        let mut slots = Vec::with_capacity(tables.len());
        for t in tables.iter_mut() {
            slots.push(self.prepare_append(t)? as u32);
        }
        Ok(slots)
    }

    /// Prepares one decode step of `tables` (one new token each): takes the blocks the
    /// tokens go to, and returns where they are written and what each row then attends to.
    /// The tables' lengths are not advanced (the caller does after the forward).
    pub(crate) fn prepare_step(&mut self, tables: &mut [BlockTable]) -> Result<PagedStep> {
        let slots = self.prepare_appends(tables)?;
        let layout = PagedLayout::new(
            self.block_size,
            tables.iter().map(|t| t.blocks.clone()).collect(),
            tables.iter().map(|t| t.len + 1).collect(),
        )?;
        Ok(PagedStep {
            slots: KvSlots::new(slots, &self.device)?,
            layout,
        })
    }

    /// A one-row [`KvCache`] holding `table`'s tokens (a finished sample kept for its
    /// continuation).
    pub(crate) fn gather(&self, table: &BlockTable) -> Result<KvCache> {
        let slots: Vec<u32> = (0..table.len).map(|j| self.slot(table, j) as u32).collect();
        let index = Tensor::new(slots, &self.device)?;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok((
                    l.keys()?.index_select(&index, 0)?,
                    l.values()?.index_select(&index, 0)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        KvCache::from_tokens(layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    /// Two tables share a prompt's blocks; appending to the shared, partly filled last block
    /// copies it for the first writer, and each table then reads the prompt's K/V followed by
    /// its own token's, whatever the other wrote.
    #[test]
    fn copy_on_write_leaves_the_other_tables_kv_untouched() -> Result<()> {
        let dev = Device::Cpu;
        let (model, _) = Transformer::random_init(&ModelConfig::tiny_qwen2(32), 3, &dev)?;
        let layers = model.cfg.num_hidden_layers;
        let (hkv, d) = (model.cfg.num_key_value_heads, model.cfg.head_dim);
        let mut cache = KvCache::new(layers, vec![0]);
        let ids = Tensor::new(&[[1u32, 2, 3, 4, 5, 6]], &dev)?;
        model.forward(&ids, Some(&mut cache))?;
        // Blocks of 4: one full prompt block and 2 tokens in a second.
        let mut pool = BlockPool::new(&model, 4, 0)?;
        let prompt = pool.write_prompts(&cache, &[0])?.remove(0);
        let mut tables = vec![pool.share(&prompt), pool.share(&prompt)];
        pool.release(prompt);
        assert_eq!(pool.held_blocks(), 2);
        let step = pool.prepare_step(&mut tables)?;
        assert_eq!((pool.copies, pool.held_blocks()), (1, 3));
        assert_eq!(tables[0].blocks[0], tables[1].blocks[0]);
        assert_ne!(tables[0].blocks[1], tables[1].blocks[1]);
        // Row t writes keys and values all equal to t + 1.
        let own = Tensor::new(&[1f32, 2.], &dev)?
            .reshape((2, 1, 1))?
            .broadcast_as((2, hkv, d))?
            .contiguous()?;
        for i in 0..layers {
            pool.layer(i)
                .write(&step.slots, &Tensor::stack(&[&own, &own], 0)?)?;
        }
        tables.iter_mut().for_each(|t| t.len += 1);
        let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
        for (t, table) in tables.iter().enumerate() {
            let row = pool.gather(table)?;
            for layer in 0..layers {
                let got = row.rows_tokens(layer, &[0])?;
                let prompt_kv = cache.rows_tokens(layer, &[0])?;
                for part in 0..2 {
                    let (g, p) = (got.get(part)?, prompt_kv.get(part)?);
                    assert_eq!(flat(&g.narrow(0, 0, 6)?)?, flat(&p)?, "table {t}");
                    let last = flat(&g.narrow(0, 6, 1)?)?;
                    assert!(last.iter().all(|&x| x == (t + 1) as f32), "table {t}");
                }
            }
        }
        // Releasing both frees every block.
        for t in tables {
            pool.release(t);
        }
        assert_eq!(pool.held_blocks(), 0);
        Ok(())
    }
}
