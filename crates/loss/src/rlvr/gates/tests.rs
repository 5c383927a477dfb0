//! The RLVR gates are tensors in, tensors out: each is checked on tensors against a plain host
//! computation of the same rule (the references' loops), on random batches with inactive
//! tokens whose values must not matter.
use super::*;
use crate::util::tests::lcg;
use candle_core::Device;

const B: usize = 4;
const T: usize = 7;

fn t2(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), (B, T), &Device::Cpu).unwrap()
}

fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(DType::F64).unwrap().to_vec2().unwrap()
}

/// A 0/1 mask with some empty positions and one all-empty row.
fn mask(seed: u64) -> Vec<f64> {
    lcg(seed, B * T)
        .iter()
        .enumerate()
        .map(|(i, x)| if i / T == 2 || *x < 0.25 { 0.0 } else { 1.0 })
        .collect()
}

/// Values in [lo, hi), with `junk` at the masked positions.
fn values(seed: u64, lo: f64, hi: f64, m: &[f64], junk: f64) -> Vec<f64> {
    lcg(seed, B * T)
        .iter()
        .zip(m)
        .map(|(x, w)| if *w > 0.0 { lo + (hi - lo) * x } else { junk })
        .collect()
}

#[test]
fn high_entropy_mask_is_the_quantile_of_the_active_entropies() {
    for (seed, q) in [(1u64, 0.2), (2, 0.5), (3, 0.9), (4, 0.0), (5, 1.0)] {
        let m = mask(seed);
        // Coarse values (ties) and a huge entropy on inactive tokens, which must not count.
        let h: Vec<f64> = values(seed + 10, 0.0, 3.0, &m, 1e9)
            .iter()
            .map(|x| (x * 4.0).round() / 4.0)
            .collect();
        let mut active: Vec<f64> = h
            .iter()
            .zip(&m)
            .filter(|(_, w)| **w > 0.0)
            .map(|(x, _)| *x)
            .collect();
        active.sort_by(f64::total_cmp);
        let pos = (1.0 - q) * (active.len() - 1) as f64;
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        let thr = active[lo] + (active[hi] - active[lo]) * (pos - lo as f64);
        let want: Vec<f64> = h
            .iter()
            .zip(&m)
            .map(|(x, w)| if *w > 0.0 && x * w >= thr { 1.0 } else { 0.0 })
            .collect();
        for dtype in [DType::F64, DType::F32] {
            let mt = t2(&m).to_dtype(dtype).unwrap();
            let got = high_entropy_mask(&t2(&h), &mt, q).unwrap();
            assert_eq!(got.dims(), &[B, T]);
            assert_eq!(got.dtype(), dtype);
            assert_eq!(
                got.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap(),
                want,
                "q = {q} {dtype:?}"
            );
        }
    }
    let zeros = t2(&[0.0; B * T]);
    let got = high_entropy_mask(&t2(&[1.0; B * T]), &zeros, 0.5).unwrap();
    assert_eq!(got.sum_all().unwrap().to_scalar::<f64>().unwrap(), 0.0);
}

#[test]
fn ppo_clip_gates_choose_the_branch_of_the_host_rule() {
    let m = mask(7);
    let r = values(8, 0.5, 1.6, &m, 1.0);
    let a: Vec<f64> = values(9, -2.0, 2.0, &m, 0.0);
    for (delta, dual) in [
        (None, false),
        (Some(1.3), false),
        (None, true),
        (Some(1.1), true),
    ] {
        let cfg = RlvrConfig {
            epsilon: 0.2,
            epsilon_high: Some(0.28),
            delta,
            dual_clip: dual,
            clip_ratio_c: 1.2,
            ..Default::default()
        };
        let got = ppo_clip_gates(&t2(&r), &t2(&a), &cfg).unwrap();
        let (g, c, low, high) = (rows(&got.g), rows(&got.c), rows(&got.low), rows(&got.high));
        let (lo, hi) = (0.8, 1.28);
        let mut clipped_any = false;
        for i in 0..B {
            for j in 0..T {
                let (r, a) = (r[i * T + j], a[i * T + j]);
                let (g1, v1) = match delta {
                    Some(d) if r > d => (0.0, d),
                    _ => (1.0, r),
                };
                let v2 = r.clamp(lo, hi);
                let g2 = f64::from(u8::from(r >= lo && r <= hi));
                let (mut gg, mut vv) = if v1 * a <= v2 * a { (g1, v1) } else { (g2, v2) };
                if dual && a < 0.0 && vv > 1.2 {
                    gg = 0.0;
                    vv = 1.2;
                }
                clipped_any |= gg == 0.0;
                assert_eq!(g[i][j], gg, "g at {i},{j}");
                assert_eq!(c[i][j], if gg > 0.0 { 0.0 } else { vv }, "c at {i},{j}");
                assert_eq!(low[i][j], f64::from(u8::from(r < lo && a < 0.0)));
                assert_eq!(high[i][j], f64::from(u8::from(r > hi && a > 0.0)));
            }
        }
        assert!(clipped_any, "the batch exercises the clip");
    }
}

#[test]
fn off_policy_mask_drops_negative_advantage_rows_that_drifted() {
    let m = mask(11);
    let lp = values(12, -3.0, -0.1, &m, f64::NAN);
    let mu = values(13, -3.0, -0.1, &m, f64::NAN);
    // Row-constant advantages of both signs, and one per-token row.
    let a: Vec<f64> = (0..B * T)
        .map(|k| match k / T {
            0 => -1.0,
            1 => 1.0,
            _ => {
                if k % 2 == 0 {
                    -0.5
                } else {
                    0.5
                }
            }
        })
        .collect();
    let (lp, mu): (Vec<f64>, Vec<f64>) = (
        lp.iter()
            .map(|x| if x.is_nan() { 0.0 } else { *x })
            .collect(),
        mu.iter()
            .map(|x| if x.is_nan() { 0.0 } else { *x })
            .collect(),
    );
    for thr in [-0.5, 0.0, 0.3] {
        let got = rows(&off_policy_mask(&t2(&mu), &t2(&lp), &t2(&m), &t2(&a), thr).unwrap());
        for i in 0..B {
            let n: f64 = (0..T).map(|j| m[i * T + j]).sum();
            let kl: f64 = (0..T)
                .map(|j| (mu[i * T + j] - lp[i * T + j]) * m[i * T + j])
                .sum::<f64>()
                / n.max(1.0);
            for j in 0..T {
                let want = f64::from(u8::from(a[i * T + j] >= 0.0 || kl <= thr));
                assert_eq!(got[i][j], want, "thr {thr} at {i},{j}");
            }
        }
    }
}

#[test]
fn dppo_gates_mask_by_the_probability_difference() {
    let m = mask(21);
    let lp = values(22, -2.0, -0.05, &m, -1.0);
    let inf = values(23, -2.0, -0.05, &m, -1.0);
    let a = values(24, -1.0, 1.0, &m, 0.0);
    let cfg = RlvrConfig {
        dppo_mask_low: 0.05,
        dppo_mask_high: 0.05,
        ..Default::default()
    };
    let (keep, masked, low, high) =
        dppo_gates(&t2(&lp), &t2(&inf), &t2(&m), &t2(&a), &cfg).unwrap();
    let (keep, masked, low, high) = (rows(&keep), rows(&masked), rows(&low), rows(&high));
    let mut n_masked = 0;
    for i in 0..B {
        for j in 0..T {
            let k = i * T + j;
            let d = lp[k].exp() - inf[k].exp();
            let (ih, il) = (d > 0.05, d < -0.05);
            let is_m = if a[k] > 0.0 { ih } else { il };
            n_masked += usize::from(is_m && m[k] > 0.0);
            assert_eq!(masked[i][j], f64::from(u8::from(is_m)));
            assert_eq!(keep[i][j], if is_m { 0.0 } else { m[k] });
            assert_eq!(low[i][j], f64::from(u8::from(a[k] < 0.0 && il)));
            assert_eq!(high[i][j], f64::from(u8::from(a[k] > 0.0 && ih)));
        }
    }
    assert!(n_masked > 0);
}

#[test]
fn clip_cov_takes_at_most_its_quota_in_row_major_order() {
    let m = mask(31);
    let lp = values(32, -3.0, -0.1, &m, 0.0);
    let a = values(33, -3.0, 3.0, &m, 0.0);
    let r = values(34, 0.7, 1.4, &m, 1.0);
    for ratio in [0.05, 0.3, 1.0] {
        let cfg = RlvrConfig {
            clip_cov_ratio: ratio,
            clip_cov_lb: -1.0,
            clip_cov_ub: 5.0,
            ..Default::default()
        };
        let (_, _, corr) = clip_cov_gates(&t2(&r), &t2(&lp), &t2(&m), &t2(&a), &cfg).unwrap();
        let corr: Vec<f64> = rows(&corr).concat();
        // The host rule, row-major.
        let n: f64 = m.iter().sum();
        let ma = a.iter().zip(&m).map(|(x, w)| x * w).sum::<f64>() / (n + 1e-8);
        let ml = lp.iter().zip(&m).map(|(x, w)| x * w).sum::<f64>() / (n + 1e-8);
        let quota = ((ratio * n) as usize).max(1);
        let (lo, hi) = (0.8, 1.2);
        let mut taken = 0;
        let mut qualifying = 0;
        for k in 0..B * T {
            let by_origin = -a[k] * r[k].clamp(lo, hi) > -a[k] * r[k] && m[k] > 0.0;
            let cov = (a[k] - ma) * (lp[k] - ml);
            let q = m[k] > 0.0 && !by_origin && cov > -1.0 && cov < 5.0;
            qualifying += usize::from(q);
            let want = if q && taken < quota {
                taken += 1;
                0.0
            } else {
                1.0
            };
            assert_eq!(corr[k], want, "ratio {ratio} at {k}");
        }
        assert!(qualifying > quota || ratio == 1.0, "the quota binds");
    }
}

#[test]
fn kl_cov_selects_the_top_tokens_with_ties_in_row_major_order() {
    // Advantages and log-probs on a grid: many equal covariances.
    let m = mask(41);
    let a: Vec<f64> = values(42, -2.0, 2.0, &m, 0.0)
        .iter()
        .map(|x| x.round())
        .collect();
    let lp: Vec<f64> = values(43, -3.0, 0.0, &m, 0.0)
        .iter()
        .map(|x| x.round())
        .collect();
    let lr: Vec<f64> = values(44, -0.5, 0.5, &m, 0.0);
    for ratio in [0.1, 0.25, 0.6] {
        let cfg = RlvrConfig {
            kl_cov_ratio: ratio,
            ppo_kl_coef: 2.0,
            ..Default::default()
        };
        let got: Vec<f64> =
            rows(&kl_cov_selection(&t2(&lr), &t2(&lp), &t2(&m), &t2(&a), &cfg).unwrap()).concat();
        let valid: Vec<usize> = (0..B * T).filter(|&k| m[k] > 0.0).collect();
        let nv = valid.len() as f64;
        let ma = valid.iter().map(|&k| a[k]).sum::<f64>() / nv;
        let ml = valid.iter().map(|&k| lp[k]).sum::<f64>() / nv;
        let mut cov: Vec<(f64, usize)> = valid
            .iter()
            .map(|&k| ((a[k] - ma) * (lp[k] - ml), k))
            .collect();
        cov.sort_by(|x, y| y.0.total_cmp(&x.0));
        let quota = ((nv * ratio) as usize).max(1);
        let mut want = vec![0.0; B * T];
        for &(_, k) in cov.iter().take(quota) {
            want[k] = 2.0 * lr[k].signum();
        }
        assert_eq!(got, want, "ratio {ratio}");
        assert_eq!(got.iter().filter(|x| **x != 0.0).count(), quota);
    }
}

#[test]
fn sampler_is_weights_truncate_or_mask_per_token_and_per_sequence() {
    let m = mask(51);
    let old = values(52, -2.0, -0.1, &m, 0.0);
    let smp = values(53, -2.0, -0.1, &m, 0.0);
    let inputs = {
        let mut i = LossInputs::new(
            t2(&old),
            Tensor::zeros(B, DType::F64, &Device::Cpu).unwrap(),
            t2(&m),
        );
        i.sampler_logprobs = Some(t2(&smp));
        i
    };
    for mode in [
        SamplerIsMode::TokenTruncate,
        SamplerIsMode::TokenMask,
        SamplerIsMode::SequenceTruncate,
        SamplerIsMode::SequenceMask,
    ] {
        let cfg = RlvrConfig {
            sampler_importance_sampling_correction: true,
            sampler_importance_sampling_mode: mode,
            sampler_importance_sampling_clip_min: Some(0.5),
            sampler_importance_sampling_clip_max: Some(2.0),
            ..Default::default()
        };
        let mut metrics = RlvrMetrics::default();
        let w = sampler_is_weights(&inputs, &cfg, &t2(&old), &t2(&m), &mut metrics)
            .unwrap()
            .unwrap();
        let w = rows(&w);
        let seq = matches!(
            mode,
            SamplerIsMode::SequenceTruncate | SamplerIsMode::SequenceMask
        );
        let masking = matches!(mode, SamplerIsMode::TokenMask | SamplerIsMode::SequenceMask);
        let mut outside = 0;
        for i in 0..B {
            let d: Vec<f64> = (0..T)
                .map(|j| (old[i * T + j] - smp[i * T + j]) * m[i * T + j])
                .collect();
            let s: f64 = d.iter().sum();
            for j in 0..T {
                let raw = if seq { s.exp() } else { d[j].exp() };
                let out = !(0.5..=2.0).contains(&raw);
                outside += usize::from(out);
                let want = if masking && out {
                    0.0
                } else if masking {
                    raw
                } else {
                    raw.clamp(0.5, 2.0)
                };
                assert!(
                    (w[i][j] - want).abs() <= 1e-12 * want.abs(),
                    "{mode:?} at {i},{j}: {} vs {want}",
                    w[i][j]
                );
            }
        }
        assert!(outside > 0, "{mode:?}: the bounds bind somewhere");
        assert!(metrics.is_weight_clipped_fraction.unwrap() > 0.0);
    }
}
