//! The paged decode attention (the test device's kernel and the gathering composition) against
//! a dense reference.

use super::*;

/// Dense attention of one query per row over its `len` keys, in f64 by hand: row `b` reads
/// token `j` from `slot(b, j)` of `[slots, hkv, d]` pools.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (hq, hkv, d): (usize, usize, usize),
    lens: &[usize],
    slot: &dyn Fn(usize, usize) -> usize,
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; lens.len() * hq * d];
    for (b, &len) in lens.iter().enumerate() {
        for h in 0..hq {
            let g = h / (hq / hkv);
            let qh = &q[(b * hq + h) * d..][..d];
            let kv = |pool: &[f64], j: usize| pool[(slot(b, j) * hkv + g) * d..][..d].to_vec();
            let scores: Vec<f64> = (0..len)
                .map(|j| qh.iter().zip(kv(k, j)).map(|(a, b)| a * b).sum::<f64>() * scale)
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (j, w) in e.iter().enumerate() {
                for (o, x) in out[(b * hq + h) * d..][..d].iter_mut().zip(kv(v, j)) {
                    *o += w / sum * x;
                }
            }
        }
    }
    out
}

/// Values of `x` after a round trip through `dtype` (what a tensor of that dtype holds).
fn rounded(x: &[f64], dtype: DType) -> Vec<f64> {
    Tensor::new(x, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .unwrap()
}

/// The paged decode attention (the kernel of the test device: CPU f32/f64, CUDA f32/bf16)
/// and the gathering composition against [`reference`] on the dtype-rounded inputs, for
/// `(heads, kv_heads, head_dim, block_size)` and row lengths `lens`, the rows' blocks
/// scattered over the pool in no order (row 0's table one block longer than it needs).
fn check_paged_attention((hq, hkv, d, bs): (usize, usize, usize, usize), lens: &[usize]) {
    let dev = common::test_device();
    let lens = lens.to_vec();
    let num_blocks = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 4;
    let mut free: Vec<u32> = (0..num_blocks as u32).rev().collect();
    free.rotate_left(7);
    let tables: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(b, &l)| {
            let n = l.div_ceil(bs) + usize::from(b == 0);
            (0..n).map(|_| free.pop().unwrap()).collect()
        })
        .collect();
    let slot = |b: usize, j: usize| tables[b][j / bs] as usize * bs + j % bs;
    let slots = num_blocks * bs;
    let (qv, kv, vv) = (
        values(lens.len() * hq * d, 1),
        values(slots * hkv * d, 2),
        values(slots * hkv * d, 3),
    );
    let scale = 1.0 / (d as f64).sqrt();
    // (dtype, kernel tolerance, composition tolerance): outputs are averages of values in
    // [-1, 1); the CUDA composition rounds its bf16 scores and probabilities, the kernel only
    // its output.
    let cases = if dev.is_cpu() {
        vec![(DType::F32, 2e-6, 2e-6), (DType::F64, 1e-12, 1e-12)]
    } else {
        vec![(DType::F32, 1e-4, 1e-4), (DType::BF16, 1e-2, 4e-2)]
    };
    for (dtype, tol_kernel, tol_composed) in cases {
        let (qr, kr, vr) = (
            rounded(&qv, dtype),
            rounded(&kv, dtype),
            rounded(&vv, dtype),
        );
        let want = reference(&qr, &kr, &vr, (hq, hkv, d), &lens, &slot, scale);
        let t = |x: &[f64], shape: (usize, usize, usize)| {
            Tensor::from_vec(x.to_vec(), shape, &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| t.to_device(&dev))
                .unwrap()
        };
        let q = t(&qr, (lens.len(), hq, d));
        let (k, v) = (t(&kr, (slots, hkv, d)), t(&vr, (slots, hkv, d)));
        let layout = PagedLayout::new(bs, tables.clone(), lens.clone()).unwrap();
        let kernel = paged_decode_attention(&q, &k, &v, &layout, scale).unwrap();
        let composed = paged_decode_attention_composed(&q, &k, &v, &layout, scale).unwrap();
        for (what, got, tol) in [
            ("kernel", kernel, tol_kernel),
            ("composed", composed, tol_composed),
        ] {
            assert_eq!(got.dims(), &[lens.len(), hq, d]);
            assert_eq!(got.dtype(), dtype);
            let got = got
                .to_dtype(DType::F64)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f64>())
                .unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= tol,
                    "{what} {dtype:?} on {dev:?}, ({hq}, {hkv}, {d}, block {bs}) {lens:?} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn paged_decode_attention_equals_dense_attention() {
    // GQA (6 query heads over 2 KV heads), rows of different lengths, none a multiple of the
    // block size but one; then a step large enough for the CPU kernel's threads (16 query
    // heads over 4, 4,100 keys) and for several key chunks of the CUDA kernel.
    check_paged_attention((6, 2, 16, 4), &[1, 5, 8, 11, 13]);
    check_paged_attention((16, 4, 64, 16), &[1700, 1, 1333, 1066]);
    // GQA ratios 1, 2 and 7 at head_dim 64 and 128; blocks of 1, 5, 16 and 32 slots; rows of
    // one token, rows ending exactly on a block boundary, and on or just past a chunk boundary.
    check_paged_attention((4, 4, 64, 1), &[1, 7, 256, 300]);
    check_paged_attention((8, 4, 128, 16), &[1, 16, 48, 513, 200]);
    check_paged_attention((14, 2, 128, 5), &[1, 10, 255, 257, 40]);
    check_paged_attention((7, 1, 64, 32), &[64, 1, 31, 600]);
    // Groups of 16 and 32 query heads at head_dim 256 (the CUDA kernel's largest: several
    // passes over the values, shorter key chunks to fit shared memory), an odd head_dim (80),
    // and one past the CUDA kernel (320: the composition serves it).
    check_paged_attention((16, 1, 256, 16), &[300, 3]);
    check_paged_attention((32, 1, 256, 8), &[200, 1]);
    check_paged_attention((4, 2, 80, 16), &[33, 290]);
    check_paged_attention((2, 1, 320, 4), &[5, 9]);
    // A step with enough rows for the CUDA kernel's full chunks (256 keys, one per row): 128
    // rows of 1 to 256 keys.
    let many: Vec<usize> = (0..128).map(|i| 1 + (i * 37) % 256).collect();
    check_paged_attention((4, 2, 64, 16), &many);
    let dev = Device::Cpu;
    let (hq, hkv, d, bs, scale) = (6, 2, 16, 4, 0.25);
    // A table too short for its row, or a row reading past the pool, is an error.
    let e = PagedLayout::new(bs, vec![vec![0]], vec![5]).unwrap_err();
    assert!(e.to_string().contains("row 0 attends to 5 tokens"), "{e}");
    let q = Tensor::zeros((1, hq, d), DType::F32, &dev).unwrap();
    let pool = Tensor::zeros((8, hkv, d), DType::F32, &dev).unwrap();
    let layout = PagedLayout::new(bs, vec![vec![5]], vec![2]).unwrap();
    let e = paged_decode_attention(&q, &pool, &pool, &layout, scale).unwrap_err();
    assert!(
        e.to_string().contains("reads slot 21 of a pool of 8"),
        "{e}"
    );
}
