//! The device helpers checked on tensors against plain host computations.
use super::*;
use candle_core::{Device, Var};

/// A deterministic pseudo-random sequence in [0, 1) (no rand dependency).
pub(crate) fn lcg(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 11) as f64 / (1u64 << 53) as f64
        })
        .collect()
}

#[test]
fn clamp_const_keeps_the_value_inside_and_the_bound_outside_with_torch_gradients() {
    let x = Var::from_vec(
        vec![
            -3.0f64,
            -1.0,
            0.5,
            2.0,
            5.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ],
        7,
        &Device::Cpu,
    )
    .unwrap();
    let y = clamp_const(x.as_tensor(), -1.0, 2.0).unwrap();
    assert_eq!(
        y.to_vec1::<f64>().unwrap(),
        vec![-1.0, -1.0, 0.5, 2.0, 2.0, 2.0, -1.0]
    );
    let g = y.sum_all().unwrap().backward().unwrap();
    let g = g.get(x.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(g, vec![0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
}

#[test]
fn inclusive_cumsum_equals_the_host_prefix_sums() {
    for n in [0usize, 1, 2, 3, 37, 64, 129] {
        let v: Vec<f32> = lcg(n as u64, n)
            .iter()
            .map(|x| if *x > 0.4 { 1.0 } else { 0.0 })
            .collect();
        let got = inclusive_cumsum(&Tensor::from_vec(v.clone(), n, &Device::Cpu).unwrap())
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let want: Vec<f32> = v
            .iter()
            .scan(0f32, |s, x| {
                *s += x;
                Some(*s)
            })
            .collect();
        assert_eq!(got, want, "n = {n}");
    }
}

#[test]
fn kth_smallest_is_the_sorted_active_values_for_every_k() {
    for (seed, dtype) in [(1u64, DType::F64), (2, DType::F32), (3, DType::F64)] {
        let (b, t) = (5, 9);
        // Values rounded to a coarse grid so that ties occur; inactive entries get huge values
        // that must not count.
        let raw = lcg(seed, b * t);
        let act = lcg(seed + 100, b * t);
        let vals: Vec<f64> = raw
            .iter()
            .zip(&act)
            .map(|(v, a)| {
                if *a > 0.3 {
                    (v * 8.0).floor() / 4.0 - 1.0
                } else {
                    1e6
                }
            })
            .collect();
        let mask: Vec<u8> = act.iter().map(|a| u8::from(*a > 0.3)).collect();
        let vt = Tensor::from_vec(vals.clone(), (b, t), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let mt = Tensor::from_vec(mask.clone(), (b, t), &Device::Cpu).unwrap();
        let mut sorted: Vec<f64> = vals
            .iter()
            .zip(&mask)
            .filter(|(_, m)| **m == 1)
            .map(|(v, _)| *v)
            .collect();
        sorted.sort_by(f64::total_cmp);
        assert!(sorted.len() > 10);
        for (k, want) in sorted.iter().enumerate() {
            assert_eq!(kth_smallest(&vt, &mt, k).unwrap(), *want, "k = {k}");
        }
        assert!(kth_smallest(&vt, &mt, sorted.len()).unwrap().is_nan());
    }
}

#[test]
fn kth_smallest_finds_close_values_exactly() {
    // Values one f32 ulp apart and spread over many orders of magnitude.
    let base = 1.0f32;
    let vals = vec![
        base,
        base.next_up(),
        base.next_up().next_up(),
        1e-30,
        -1e30,
        3.5,
        base.next_down(),
    ];
    let mut sorted: Vec<f64> = vals.iter().map(|v| *v as f64).collect();
    sorted.sort_by(f64::total_cmp);
    let n = vals.len();
    let vt = Tensor::from_vec(vals, n, &Device::Cpu).unwrap();
    let mt = Tensor::ones(n, DType::U8, &Device::Cpu).unwrap();
    for (k, want) in sorted.iter().enumerate() {
        assert_eq!(kth_smallest(&vt, &mt, k).unwrap(), *want, "k = {k}");
    }
}

#[test]
fn ceil_in_dtype_compares_f32_values_as_f64_would() {
    let v = 0.1f32 as f64;
    let thr = v + 1e-12; // between two f32 values
    let c = ceil_in_dtype(thr, DType::F32);
    assert!(c >= thr && (c as f32) as f64 == c);
    assert!(v < c);
    assert_eq!((0.1f32).next_up() as f64, c);
    assert_eq!(ceil_in_dtype(thr, DType::F64), thr);
}
