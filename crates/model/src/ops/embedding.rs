//! The token embedding's row lookup with a backward that is parallel and deterministic.
//!
//! candle's `index_select` backward is an `index_add` into a zero `[vocab, hidden]` tensor,
//! and its CUDA kernel gives each of the `hidden` columns one thread that walks all N tokens
//! in turn (Qwen2.5-0.5B at 16×512 tokens: 896 threads, 4.3 ms of the step on an H200). Here
//! the training forward, whose ids the host has just uploaded, also groups them on the host
//! ([`Groups`]: a stable sort): the backward sums each vocabulary row's gradient over its
//! tokens in token order — pieces of at most [`PIECE_TOKENS`] tokens side by side, a row's
//! pieces then added in order — with no atomics, so a step's gradient is the same bits every
//! run. CUDA sums in f32 (`embedding_kernels.cuh`); the CPU twin runs the same pieces in f64.

use anyhow::{bail, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Storage, Tensor, WithDType};

/// The most tokens one piece of the backward sums (a frequent id is cut into several pieces,
/// so its row does not serialise the backward).
const PIECE_TOKENS: usize = 32;

/// Marks a piece whose row has other pieces: its sum goes to scratch slot `dest & !MERGE`.
const MERGE: u32 = 1 << 31;

/// `weight` `[vocab, hidden]` at `ids` (u32, any shape, taken flat) → `[N, hidden]`. When
/// `train` and the weight is in a graph, one node whose backward is the grouped sum above (the
/// ids are read back to the host once here, and checked against the vocabulary); otherwise
/// candle's `index_select`, which reads nothing back (the rollout's prefill).
pub fn embedding(weight: &Tensor, ids: &Tensor, train: bool) -> Result<Tensor> {
    let ids = ids.flatten_all()?;
    if !grouped_backward(weight, train) {
        return Ok(weight.index_select(&ids, 0)?);
    }
    let host: Vec<u32> = ids
        .to_dtype(DType::U32)
        .and_then(|t| t.to_vec1())
        .context("embedding: the token ids must be u32")?;
    with_groups(weight, ids, &host)
}

/// [`embedding`] of ids the caller holds on the host (uploaded here; nothing read back).
pub fn embedding_of_ids(weight: &Tensor, ids: &[u32], train: bool) -> Result<Tensor> {
    let ids_t = Tensor::new(ids, weight.device())?;
    if !grouped_backward(weight, train) {
        return Ok(weight.index_select(&ids_t, 0)?);
    }
    with_groups(weight, ids_t, ids)
}

/// Whether the lookup takes the grouped backward: training, the weight in a graph, and a
/// backward for its device and dtype (the CPU: any float; CUDA: f32, bf16).
fn grouped_backward(weight: &Tensor, train: bool) -> bool {
    train
        && weight.track_op()
        && match weight.device() {
            candle_core::Device::Cpu => weight.dtype().is_float(),
            candle_core::Device::Cuda(_) => super::kernels_apply(weight),
            _ => false,
        }
}

/// The op over `ids` (on the weight's device) with its host copy `host`.
fn with_groups(weight: &Tensor, ids: Tensor, host: &[u32]) -> Result<Tensor> {
    let (vocab, _) = weight
        .dims2()
        .context("embedding: the weight must be [vocab, hidden]")?;
    let groups = Groups::of(host, vocab)?;
    Ok(weight
        .contiguous()?
        .apply_op1(EmbeddingOp { ids, groups })?)
}

/// The backward's work list, built on the host from the forward's ids.
#[derive(Debug, PartialEq, Eq)]
struct Groups {
    /// Token positions sorted by id, ties in token order.
    order: Vec<u32>,
    /// `P + 1` offsets into `order`: piece `p` is `order[piece_bounds[p]..piece_bounds[p+1]]`,
    /// at most [`PIECE_TOKENS`] tokens of one id.
    piece_bounds: Vec<u32>,
    /// Piece `p`'s destination: its id's row of `∂W` when it is that row's only piece, else
    /// `MERGE | slot` (its partial sum's scratch slot).
    piece_dest: Vec<u32>,
    /// The ids with several pieces, in id order.
    merge_rows: Vec<u32>,
    /// `M + 1` offsets into the scratch slots: row `merge_rows[m]` adds slots
    /// `merge_bounds[m]..merge_bounds[m+1]` (its pieces, in token order).
    merge_bounds: Vec<u32>,
}

impl Groups {
    /// The work list of `ids`, each checked against `vocab` (an error names the first id
    /// outside it and its position).
    fn of(ids: &[u32], vocab: usize) -> Result<Groups> {
        // Rows and scratch slots (at most one a token) share a u32 with the MERGE bit.
        if vocab >= MERGE as usize || ids.len() >= MERGE as usize {
            bail!(
                "embedding: {} ids into a vocabulary of {vocab} rows exceed the backward's u32 tables",
                ids.len()
            );
        }
        if let Some((pos, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            bail!("embedding: token id {id} at position {pos} is outside the vocabulary of {vocab} rows");
        }
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&i| ids[i as usize]); // stable: ties keep token order
        let mut g = Groups {
            order,
            piece_bounds: vec![0],
            piece_dest: Vec::new(),
            merge_rows: Vec::new(),
            merge_bounds: vec![0],
        };
        let mut slots = 0u32;
        let mut start = 0;
        while start < g.order.len() {
            let id = ids[g.order[start] as usize];
            let end = start
                + g.order[start..]
                    .iter()
                    .take_while(|&&i| ids[i as usize] == id)
                    .count();
            let pieces = (end - start).div_ceil(PIECE_TOKENS);
            for p in 0..pieces {
                g.piece_bounds
                    .push((start + ((p + 1) * PIECE_TOKENS).min(end - start)) as u32);
                g.piece_dest.push(if pieces == 1 {
                    id
                } else {
                    MERGE | (slots + p as u32)
                });
            }
            if pieces > 1 {
                slots += pieces as u32;
                g.merge_rows.push(id);
                g.merge_bounds.push(slots);
            }
            start = end;
        }
        Ok(g)
    }

    /// How many pieces write a scratch slot.
    fn slots(&self) -> usize {
        *self.merge_bounds.last().unwrap_or(&0) as usize
    }
}

struct EmbeddingOp {
    /// `[N]` u32 on the weight's device.
    ids: Tensor,
    groups: Groups,
}

impl EmbeddingOp {
    /// The forward on any backend: the weight's rows at the ids.
    fn rows<S: BackendStorage>(
        &self,
        w: &S,
        lw: &Layout,
        ids: impl Fn(&Storage) -> Option<&S>,
    ) -> candle_core::Result<(S, Shape)> {
        let (ids_storage, ids_layout) = self.ids.storage_and_layout();
        let Some(ids_storage) = ids(&ids_storage) else {
            candle_core::bail!("embedding: the ids are not on the weight's device")
        };
        let out = w.index_select(ids_storage, lw, ids_layout, 0)?;
        let hidden = lw.dims()[1];
        Ok((out, Shape::from((ids_layout.shape().elem_count(), hidden))))
    }
}

impl CustomOp1 for EmbeddingOp {
    fn name(&self) -> &'static str {
        "embedding-grouped-backward"
    }

    fn cpu_fwd(&self, w: &CpuStorage, lw: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.rows(w, lw, |s| match s {
            Storage::Cpu(s) => Some(s),
            _ => None,
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.rows(w, lw, |s| match s {
            Storage::Cuda(s) => Some(s),
            _ => None,
        })
    }

    fn bwd(&self, w: &Tensor, _rows: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (vocab, hidden) = w.dims2()?;
        #[cfg(feature = "cuda")]
        if w.device().is_cuda() {
            return Ok(Some(cuda::backward(dy, &self.groups, vocab, hidden)?));
        }
        let dy = dy.contiguous()?.flatten_all()?;
        // Summed in f64 and rounded once to the dtype.
        let (g, dev) = (&self.groups, w.device());
        let dw = match dy.dtype() {
            DType::F64 => cpu_grad::<f64>(&dy, g, vocab, hidden, dev)?,
            DType::F32 => cpu_grad::<f32>(&dy, g, vocab, hidden, dev)?,
            DType::BF16 => cpu_grad::<half::bf16>(&dy, g, vocab, hidden, dev)?,
            DType::F16 => cpu_grad::<half::f16>(&dy, g, vocab, hidden, dev)?,
            other => candle_core::bail!("embedding backward: unsupported dtype {other:?}"),
        };
        Ok(Some(dw))
    }
}

/// [`backward_cpu`] of the flat gradient `dy` as a `[vocab, hidden]` tensor of its dtype.
fn cpu_grad<T: WithDType>(
    dy: &Tensor,
    g: &Groups,
    vocab: usize,
    hidden: usize,
    dev: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let dw = backward_cpu(&dy.to_vec1::<T>()?, g, vocab, hidden);
    Tensor::from_vec(dw, (vocab, hidden), dev)
}

/// `∂W` `[vocab, hidden]` on the CPU: the pieces' sums in f64, a row's pieces added in order.
fn backward_cpu<T: WithDType>(dy: &[T], g: &Groups, vocab: usize, hidden: usize) -> Vec<T> {
    let mut dw = vec![T::zero(); vocab * hidden];
    let mut scratch = vec![0f64; g.slots() * hidden];
    let mut acc = vec![0f64; hidden];
    for (p, &dest) in g.piece_dest.iter().enumerate() {
        acc.fill(0.0);
        for &tok in &g.order[g.piece_bounds[p] as usize..g.piece_bounds[p + 1] as usize] {
            let row = &dy[tok as usize * hidden..(tok as usize + 1) * hidden];
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += v.to_f64();
            }
        }
        if dest & MERGE != 0 {
            let slot = (dest & !MERGE) as usize;
            scratch[slot * hidden..(slot + 1) * hidden].copy_from_slice(&acc);
        } else {
            let out = &mut dw[dest as usize * hidden..(dest as usize + 1) * hidden];
            for (o, &a) in out.iter_mut().zip(&acc) {
                *o = T::from_f64(a);
            }
        }
    }
    for (m, &row) in g.merge_rows.iter().enumerate() {
        acc.fill(0.0);
        for slot in g.merge_bounds[m] as usize..g.merge_bounds[m + 1] as usize {
            for (a, &v) in acc
                .iter_mut()
                .zip(&scratch[slot * hidden..(slot + 1) * hidden])
            {
                *a += v;
            }
        }
        let out = &mut dw[row as usize * hidden..(row as usize + 1) * hidden];
        for (o, &a) in out.iter_mut().zip(&acc) {
            *o = T::from_f64(a);
        }
    }
    dw
}

/// The CUDA backward: `embedding_bwd_pieces` then, for rows with several pieces,
/// `embedding_bwd_merge` (`embedding_kernels.cuh`).
#[cfg(feature = "cuda")]
mod cuda {
    use super::Groups;
    use crate::ops::cuda::{alloc, kernel_name, typed, view, MODULE, PTX};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::op::BackpropOp;
    use candle_core::{DType, Result, Storage, Tensor};
    use half::bf16;

    /// Threads of a block; one a column.
    const THREADS: usize = 256;

    /// `∂W` `[vocab, hidden]` from `dy` `[N, hidden]` and the forward's groups.
    pub(super) fn backward(dy: &Tensor, g: &Groups, vocab: usize, hidden: usize) -> Result<Tensor> {
        let dy = dy.contiguous()?;
        let dtype = dy.dtype();
        let (storage, layout) = dy.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            candle_core::bail!("embedding backward: the gradient is not on the GPU")
        };
        let dev = s.device().clone();
        // The tables in one upload, in this order.
        let parts: [&[u32]; 5] = [
            &g.order,
            &g.piece_bounds,
            &g.piece_dest,
            &g.merge_rows,
            &g.merge_bounds,
        ];
        let table = dev.clone_htod(&parts.concat())?;
        let mut at = 0;
        let views: Vec<_> = parts
            .iter()
            .map(|p| {
                let v = table.slice(at..at + p.len());
                at += p.len();
                v
            })
            .collect();
        let h = hidden as i32;
        let cols = hidden.div_ceil(THREADS) as u32;
        typed!(dtype, "embedding backward", |T| {
            let dyv = view::<T>(s, layout, "embedding backward")?;
            let dw = dev.alloc_zeros::<T>(vocab * hidden)?;
            let scratch = alloc::<f32>(&dev, g.slots() * hidden)?;
            let pieces = g.piece_dest.len();
            if pieces > 0 {
                let name = kernel_name("embedding_bwd_pieces", dtype)?;
                let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
                let mut b = f.builder();
                b.arg(&dyv).arg(&views[0]).arg(&views[1]).arg(&views[2]);
                b.arg(&dw).arg(&scratch).arg(&h);
                let cfg = LaunchConfig {
                    grid_dim: (pieces as u32, cols, 1),
                    block_dim: (THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: (dy, order, piece_bounds, piece_dest, dw, scratch, hidden) as the
                // kernel takes them; every id and slot in the tables is inside dw / scratch.
                unsafe { b.launch(cfg) }.w()?;
            }
            let merges = g.merge_rows.len();
            if merges > 0 {
                let name = kernel_name("embedding_bwd_merge", dtype)?;
                let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
                let mut b = f.builder();
                b.arg(&scratch)
                    .arg(&views[3])
                    .arg(&views[4])
                    .arg(&dw)
                    .arg(&h);
                let cfg = LaunchConfig {
                    grid_dim: (merges as u32, cols, 1),
                    block_dim: (THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: (scratch, merge_rows, merge_bounds, dw, hidden) as the kernel takes
                // them.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok(Tensor::from_storage(
                Storage::Cuda(T::wrap_cuda_slice(dw, dev)),
                (vocab, hidden),
                BackpropOp::none(),
                false,
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frequent_id_is_cut_into_pieces_merged_in_token_order() {
        // id 2 at 70 positions (pieces of 32, 32, 6), id 0 once, id 1 never.
        let mut ids = vec![2u32; 70];
        ids[5] = 0;
        ids.push(2);
        let g = Groups::of(&ids, 3).unwrap();
        let twos: Vec<u32> = (0..71).filter(|&i| i != 5).collect();
        assert_eq!(g.order[0], 5);
        assert_eq!(&g.order[1..], twos.as_slice());
        assert_eq!(g.piece_bounds, vec![0, 1, 33, 65, 71]);
        assert_eq!(g.piece_dest, vec![0, MERGE, MERGE | 1, MERGE | 2]);
        assert_eq!(g.merge_rows, vec![2]);
        assert_eq!(g.merge_bounds, vec![0, 3]);
        // The CPU backward over those tables: each id's row is the sum of its tokens' rows.
        let hidden = 2;
        let dy: Vec<f64> = (0..ids.len() * hidden).map(|i| i as f64).collect();
        let dw = backward_cpu(&dy, &g, 3, hidden);
        for (row, want) in (0..3).map(|r| {
            let toks = ids.iter().enumerate().filter(|(_, &id)| id == r as u32);
            let sums = toks.fold([0.0; 2], |a, (t, _)| {
                [a[0] + dy[2 * t], a[1] + dy[2 * t + 1]]
            });
            (r, sums)
        }) {
            assert_eq!(&dw[row * hidden..(row + 1) * hidden], &want[..]);
        }
    }

    #[test]
    fn an_id_outside_the_vocabulary_is_named() {
        let e = Groups::of(&[1, 4, 9], 5).unwrap_err().to_string();
        assert!(e.contains("token id 9 at position 2"), "{e}");
        assert!(e.contains("5 rows"), "{e}");
        assert!(Groups::of(&[], 5).unwrap().piece_dest.is_empty());
    }
}
