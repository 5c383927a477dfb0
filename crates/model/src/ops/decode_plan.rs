//! How the CUDA paged decode kernel (`decode_kernels.cu`) runs one step: keys per chunk,
//! chunks per row and the block's shared memory ([`decode_plan`]). A host-side computation,
//! tested on the CPU; `tools/cuda_emu/paged_decode.cpp` holds the same formula.

use std::sync::OnceLock;

/// Keys one block of the CUDA kernel scores at most (a row's keys split into chunks of this
/// many or fewer, merged by the last of its blocks to finish when a row has more than one).
pub(crate) const DECODE_CHUNK: usize = 256;

/// The smaller chunks the CUDA kernel may use: to fit shared memory, or to give a step with
/// few rows enough blocks.
const DECODE_CHUNKS: [usize; 4] = [DECODE_CHUNK, 128, 64, 32];

/// Blocks a step's grid should have for the GPU's SMs to be busy (about two per SM of an
/// H100/H200): below it, keys are split into smaller chunks. `COMPOSER_DECODE_BLOCKS=<n>`
/// replaces it (a benchmark diagnostic, see [`decode_target_blocks`]).
const DECODE_TARGET_BLOCKS: usize = 256;

/// [`DECODE_TARGET_BLOCKS`], or `COMPOSER_DECODE_BLOCKS` when set to a positive integer: on an
/// H200 a block of 128 keys took 46.6 µs per layer at batch 64 (BENCHMARKS.md, 2026-11-27),
/// latency-bound on its serial key loop (since vectorised: many keys in flight per warp), so
/// `tools/gpu_check.sh` times the decode with finer chunks beside the default before the
/// default moves.
fn decode_target_blocks() -> usize {
    static TARGET: OnceLock<usize> = OnceLock::new();
    *TARGET.get_or_init(|| {
        std::env::var("COMPOSER_DECODE_BLOCKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or(DECODE_TARGET_BLOCKS)
    })
}

/// Threads per block of the CUDA kernel (8 warps).
pub(crate) const DECODE_THREADS: usize = 256;

/// Shared memory a CUDA block may use without opting in (48 KiB).
const DECODE_SHARED_LIMIT: usize = 48 * 1024;

/// Query heads a CUDA thread accumulates at once (`DK_HEADS_PER_PASS` in the kernel).
const DECODE_HEADS_PER_PASS: usize = 8;

/// Largest head_dim of the CUDA kernel (`DK_MAX_D`).
const DECODE_MAX_HEAD_DIM: usize = 256;

/// How the CUDA kernel runs one step: keys per chunk, chunks of the longest row, and the
/// block's shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct DecodePlan {
    pub(super) block_size: usize,
    pub(super) chunk: usize,
    pub(super) splits: usize,
    pub(super) shared_bytes: usize,
}

/// The CUDA kernel's plan for `groups` (rows × KV heads) of `n_rep` query heads of
/// `head_dim`, the longest row attending to `longest` keys: the largest chunk that fits
/// shared memory and still gives [`decode_target_blocks`] blocks, else the smallest that
/// fits. `None` when the kernel cannot serve the shape (head_dim over 256, a group too large
/// for shared memory even at 32 keys per chunk, or over 65,535 chunks).
pub(super) fn decode_plan(
    groups: usize,
    n_rep: usize,
    head_dim: usize,
    block_size: usize,
    longest: usize,
) -> Option<DecodePlan> {
    if head_dim == 0 || head_dim > DECODE_MAX_HEAD_DIM || n_rep == 0 {
        return None;
    }
    // 4-byte words: the group's queries, its scores, max and sum per head, a reduction
    // region, and the chunk's KV slots last (see decode_kernels.cu). The reduction holds the
    // value sums of the thread groups beyond the first (the scalar passes), and where that
    // fits, those of the 7 warps beyond the first, two query heads at a time (one at head_dim
    // 256), which the vectorised passes need.
    let thread_groups = DECODE_THREADS / head_dim;
    let scalar_reduction = DECODE_HEADS_PER_PASS * head_dim * (thread_groups - 1);
    let warp_heads = if head_dim <= 128 { 2 } else { 1 };
    let vec_reduction = scalar_reduction.max((DECODE_THREADS / 32 - 1) * warp_heads * head_dim);
    let bytes = |chunk: usize, reduction: usize| {
        4 * (n_rep * head_dim + n_rep * chunk + 2 * n_rep + reduction + chunk)
    };
    let (chunk, reduction) =
        [vec_reduction, scalar_reduction]
            .into_iter()
            .find_map(|reduction| {
                let fitting = || {
                    DECODE_CHUNKS
                        .into_iter()
                        .filter(move |&c| bytes(c, reduction) <= DECODE_SHARED_LIMIT)
                };
                let chunk = fitting()
                    .find(|&c| groups * longest.div_ceil(c) >= decode_target_blocks())
                    .or_else(|| fitting().next_back())?;
                Some((chunk, reduction))
            })?;
    let splits = longest.div_ceil(chunk).max(1);
    // The chunks are the grid's second axis (at most 65,535 blocks).
    (splits <= 65_535).then_some(DecodePlan {
        block_size,
        chunk,
        splits,
        shared_bytes: bytes(chunk, reduction),
    })
}

/// Threads of a block of the tensor-core kernel (4 warps: `DT_WARPS` in decode_tc_kernels.cuh).
#[cfg(feature = "cuda")]
pub(crate) const DECODE_TC_THREADS: usize = 32 * 4;

/// The tensor-core paged decode kernel (`paged_decode_tc_d{64,128}_bf16`): whether it serves
/// a step (bf16, head_dim 64 or 128, at most 16 query heads per KV head — the rows of its
/// products — unless `COMPOSER_DECODE_TC=0`, the scalar and vectorised kernel instead: a
/// diagnostic and the GPU check's baseline), and if so its dynamic shared memory: a round of
/// 4 warps' key tiles (32 keys each at head_dim 64, 16 at 128), keys and values in rows of
/// head_dim + 8 bf16, then the round's u32 slots. It runs the same chunks as [`decode_plan`].
#[cfg(feature = "cuda")]
pub(super) fn decode_tc_shared_bytes(bf16: bool, n_rep: usize, head_dim: usize) -> Option<usize> {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("COMPOSER_DECODE_TC").is_ok_and(|v| v == "0"));
    tc_shared_bytes(bf16 && !off, n_rep, head_dim)
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn tc_shared_bytes(bf16: bool, n_rep: usize, head_dim: usize) -> Option<usize> {
    let tile = match head_dim {
        64 => 32,
        128 => 16,
        _ => return None,
    };
    let round = 4 * tile;
    (bf16 && (1..=16).contains(&n_rep)).then_some(2 * round * (head_dim + 8) * 2 + 4 * round)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CUDA kernel's chunking: full chunks when the step has blocks enough, finer ones
    /// for few rows, shorter ones when a large group would overflow shared memory, and no
    /// plan past the kernel's limits.
    #[test]
    fn decode_plans_fit_shared_memory_and_fill_the_grid() {
        // 128 rows × 2 KV heads of ≤ 256 keys: 256 blocks at full chunks, one per row.
        let p = decode_plan(256, 7, 64, 16, 256).unwrap();
        assert_eq!((p.chunk, p.splits), (256, 1));
        // One row: the finest chunk (4,096 keys → 128 chunks per KV head).
        let p = decode_plan(2, 7, 64, 16, 4096).unwrap();
        assert_eq!((p.chunk, p.splits), (32, 128));
        // 64 rows × 2 of 200 keys: 128 chunks is the largest giving 256 blocks.
        assert_eq!(decode_plan(128, 7, 64, 16, 200).unwrap().chunk, 128);
        // 32 query heads of dim 256 per KV head: 128-key chunks would need 57,088 bytes (the
        // vectorised value pass's reduction of 7 warps × 256 included).
        let p = decode_plan(4096, 32, 256, 16, 1000).unwrap();
        assert_eq!((p.chunk, p.shared_bytes), (64, 48_640));
        for (n_rep, d) in [(1, 1), (7, 64), (7, 128), (16, 256), (40, 256), (8, 80)] {
            for groups in [1, 300] {
                let p = decode_plan(groups, n_rep, d, 16, 777).unwrap();
                assert!(
                    p.shared_bytes <= DECODE_SHARED_LIMIT,
                    "{n_rep} x {d}: {p:?}"
                );
                assert_eq!(p.splits, 777usize.div_ceil(p.chunk));
            }
        }
        // head_dim over 256, a group no chunk fits, more chunks than the grid's second axis.
        assert_eq!(decode_plan(1, 1, 320, 16, 10), None);
        assert_eq!(decode_plan(1, 64, 256, 16, 10), None);
        assert_eq!(decode_plan(1, 1, 64, 16, 256 * 65_536), None);
    }

    /// The tensor-core kernel: bf16 at head_dim 64 or 128 with at most 16 query heads a KV
    /// head, in the 48 KiB a block may use without opting in (its combine reuses the key and
    /// value rows for 4 warps' 16 × head_dim f32 sums, so those must fit too).
    #[test]
    fn tensor_core_decode_fits_shared_memory() {
        for (d, n_rep) in [(64, 7), (128, 16), (64, 1)] {
            let bytes = tc_shared_bytes(true, n_rep, d).unwrap();
            assert!(bytes <= DECODE_SHARED_LIMIT, "{d}: {bytes}");
            let tile = if d == 64 { 32 } else { 16 };
            assert!(4 * 16 * d * 4 + 2 * 4 * 16 * 4 <= 2 * 4 * tile * (d + 8) * 2);
        }
        assert_eq!(tc_shared_bytes(true, 7, 64), Some(37_376));
        assert_eq!(tc_shared_bytes(false, 7, 64), None);
        assert_eq!(tc_shared_bytes(true, 17, 128), None);
        assert_eq!(tc_shared_bytes(true, 7, 80), None);
        assert_eq!(tc_shared_bytes(true, 0, 64), None);
    }
}
