//! The input of the padding-free training forward (TRL's `padding_free`,
//! [`Transformer::forward_hidden_packed`](super::Transformer::forward_hidden_packed)): the
//! sequences of a batch packed without padding into one row of `N` tokens, with per-token
//! positions and the segment offsets `cu_seqlens`, so projections, MLPs and attention run on
//! real tokens only. Attention never crosses a segment boundary
//! ([`crate::ops::causal_attention_varlen`]).

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
