//! Padding-free training forward (TRL's `padding_free`): the sequences of a batch packed
//! without padding into one row of `N` tokens, with per-token positions and the segment
//! offsets `cu_seqlens`, so projections, MLPs and attention run on real tokens only.
//! Attention never crosses a segment boundary ([`crate::ops::causal_attention_varlen`]).

use super::layers::{Ctx, OpPath};
use super::Transformer;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;

/// Sequences packed into one row: token ids, each token's position in its own sequence and
/// the cumulative segment offsets `[0, n₁, n₁+n₂, …, N]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    /// `N` token ids, the sequences one after the other.
    pub ids: Vec<u32>,
    /// `N` positions (RoPE angles): restart at 0 at every sequence.
    pub positions: Vec<u32>,
    /// Segment offsets; segment `s` is tokens `cu_seqlens[s]..cu_seqlens[s + 1]`.
    pub cu_seqlens: Vec<usize>,
}

impl PackedBatch {
    /// Packs `sequences` one after the other, positions restarting at 0 for each.
    pub fn from_sequences<S: AsRef<[u32]>>(sequences: &[S]) -> Self {
        let mut out = PackedBatch {
            ids: Vec::new(),
            positions: Vec::new(),
            cu_seqlens: vec![0],
        };
        for s in sequences {
            let s = s.as_ref();
            out.ids.extend_from_slice(s);
            out.positions.extend(0..s.len() as u32);
            out.cu_seqlens.push(out.ids.len());
        }
        out
    }

    /// Number of packed tokens `N`.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no token is packed.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

impl Transformer {
    /// Differentiable final hidden states `[N, hidden]` (after `model.norm`) of a packed
    /// batch: the same values as [`Transformer::forward_hidden`] on the padded batch, at the
    /// real tokens. On the CPU in f32/f64 the custom kernels run; elsewhere (or with
    /// `training_kernels` off) the differentiable compositions, attention segment by segment.
    pub fn forward_hidden_packed(&self, batch: &PackedBatch) -> Result<Tensor> {
        let n = batch.len();
        if n == 0 {
            bail!("packed batch has no tokens");
        }
        if batch.positions.len() != n {
            bail!(
                "packed batch has {n} ids but {} positions",
                batch.positions.len()
            );
        }
        crate::ops::check_cu_seqlens(&batch.cu_seqlens, n).context("packed batch")?;
        let max_pos = self.cfg.max_position_embeddings;
        if let Some(p) = batch.positions.iter().find(|&&p| p as usize >= max_pos) {
            bail!("packed batch: position {p} exceeds max_position_embeddings = {max_pos}");
        }
        let path = if self.training_kernels {
            OpPath::Kernels
        } else {
            OpPath::Differentiable
        };
        let pos = Tensor::new(batch.positions.as_slice(), &self.device)?;
        let half = self.cfg.head_dim / 2;
        let table = |t: &Tensor| -> Result<Tensor> {
            Ok(t.index_select(&pos, 0)?
                .reshape((1, n, half))?
                .to_dtype(self.dtype)?)
        };
        let ctx = Ctx {
            cos: table(&self.rope.cos)?,
            sin: table(&self.rope.sin)?,
            mask: None,
            cu_seqlens: batch.cu_seqlens.clone(),
            path,
            train: true,
        };
        let ids = Tensor::new(batch.ids.as_slice(), &self.device)?;
        let x =
            self.model
                .embed_tokens
                .index_select(&ids, 0)?
                .reshape((1, n, self.cfg.hidden_size))?;
        let x = self.decoder_stack(x, &ctx, None)?;
        Ok(self.model.norm.forward(&x, path)?.squeeze(0)?)
    }
}
