//! The inverse-CDF sampler (the device's) against the CPU sampler and an f64 reference.

use super::*;

/// `log softmax(x / t)` of one row, in f64.
fn log_softmax_f64(x: &[f64], t: f64) -> Vec<f64> {
    let m = x.iter().map(|v| v / t).fold(f64::NEG_INFINITY, f64::max);
    let lse = x.iter().map(|v| (v / t - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|v| v / t - lse).collect()
}

/// The f64 inverse CDF over `exp(logp)`: the first id whose cumulative probability exceeds
/// `u · Σp` (with p > 0), and how far `u · Σp` is from the nearest CDF boundary (a draw
/// that close may fall on either side in f32).
fn inverse_cdf_reference(logp: &[f64], u: f64) -> (u32, f64) {
    let p: Vec<f64> = logp.iter().map(|l| l.exp()).collect();
    let target = u * p.iter().sum::<f64>();
    let (mut acc, mut pick, mut margin) = (0.0, None, f64::INFINITY);
    for (i, &pi) in p.iter().enumerate() {
        acc += pi;
        if pi > 0.0 {
            margin = margin.min((acc - target).abs());
            if pick.is_none() && acc > target {
                pick = Some(i);
            }
        }
    }
    let last = p.iter().rposition(|&pi| pi > 0.0).unwrap();
    (pick.unwrap_or(last) as u32, margin)
}

/// The filters' kept set of one row of f64 log-probs, written from their definitions
/// (transformers' order: top-k keeping ties, top-p over the top-k set renormalised keeping
/// ties, min-p against the row's max), with how close the row's values are to deciding
/// otherwise (a value or a cumulative mass that near a boundary may fall either way in f32):
/// the log-probs with dropped tokens at −∞.
fn filtered_reference(logp: &[f64], f: &SampleFilter) -> (Vec<f64>, f64) {
    let max = logp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut desc: Vec<f64> = logp.iter().copied().filter(|l| l.is_finite()).collect();
    desc.sort_by(|a, b| b.total_cmp(a));
    let mut keep = vec![true; logp.len()];
    let mut fragile = f64::INFINITY;
    let near = |cut: f64, fragile: &mut f64| {
        for &l in logp.iter().filter(|l| l.is_finite() && **l != cut) {
            *fragile = fragile.min((l - cut).abs());
        }
    };
    let mut cut_k = f64::NEG_INFINITY;
    if f.top_k > 0 && f.top_k < desc.len() {
        cut_k = desc[f.top_k - 1];
        near(cut_k, &mut fragile);
    }
    if f.top_p < 1.0 {
        let set: Vec<f64> = desc.iter().copied().filter(|&l| l >= cut_k).collect();
        let target = f.top_p * set.iter().map(|l| l.exp()).sum::<f64>();
        let mut acc = 0.0;
        let mut cut_p = max;
        for &l in &set {
            let before = acc;
            acc += l.exp();
            if acc >= target {
                cut_p = l;
                fragile = fragile.min((acc - target).min(target - before).abs() * 1e2);
                break;
            }
        }
        near(cut_p, &mut fragile);
        for (k, &l) in keep.iter_mut().zip(logp) {
            *k &= l >= cut_p;
        }
    }
    if f.min_p > 0.0 {
        let cut_m = max + f.min_p.ln();
        near(cut_m, &mut fragile);
        for (k, &l) in keep.iter_mut().zip(logp) {
            *k &= l >= cut_m;
        }
    }
    let kept = logp
        .iter()
        .zip(&keep)
        .map(|(&l, &k)| {
            if k && l >= cut_k {
                l
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    (kept, fragile)
}

/// On `$COMPOSER_TEST_DEVICE` (default `cpu`): the inverse-CDF sampler (on CUDA the device
/// kernel, f32 and bf16 logits) draws, for the same uniforms, the tokens the CPU sampler and
/// an f64 inverse CDF draw, with their log-probs, at temperatures 1 and 0.7, over vocabularies
/// of 384, 1,000 and 151,936 tokens, with no filter, top-k, top-p, min-p and all three; rows
/// with masked (−∞) tokens, uniforms 0 and next to 1.
#[test]
fn inverse_cdf_sampler_on_the_device_draws_what_the_cpu_draws() {
    let dev = common::test_device();
    let dtypes: &[DType] = if dev.is_cpu() {
        &[DType::F32]
    } else {
        &[DType::F32, DType::BF16]
    };
    let (mut draws, mut compared) = (0, 0);
    let filters = [
        SampleFilter::OFF,
        SampleFilter {
            top_k: 20,
            ..SampleFilter::OFF
        },
        SampleFilter {
            top_p: 0.9,
            ..SampleFilter::OFF
        },
        SampleFilter {
            min_p: 0.05,
            ..SampleFilter::OFF
        },
        SampleFilter {
            top_k: 50,
            top_p: 0.8,
            min_p: 0.02,
        },
    ];
    for (rows, vocab, seed) in [(48, 384, 11), (9, 1000, 12), (3, 151_936, 13)] {
        let mut x: Vec<f64> = values(rows * vocab, seed).iter().map(|v| 6.0 * v).collect();
        // Row 1: only every 7th token possible.
        for (i, v) in x[vocab..2 * vocab].iter_mut().enumerate() {
            if i % 7 != 3 {
                *v = f64::NEG_INFINITY;
            }
        }
        let mut uniforms: Vec<f64> = values(rows, seed + 100)
            .iter()
            .map(|v| (v + 1.0) / 2.0)
            .collect();
        uniforms[0] = 0.0;
        uniforms[rows - 1] = 1.0 - 1e-12;
        for &dtype in dtypes {
            let cpu = Tensor::from_vec(x.clone(), (rows, vocab), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            // What the logits hold in `dtype`.
            let held = cpu.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
            let on_dev = cpu.to_device(&dev).unwrap();
            for (t, filter) in [1.0, 0.7].into_iter().flat_map(|t| filters.map(|f| (t, f))) {
                let (tokens, lps) = sample_inverse_cdf(&on_dev, t, &filter, &uniforms).unwrap();
                let cpu_f32 = cpu.to_dtype(DType::F32).unwrap();
                let (cpu_tokens, _) = sample_inverse_cdf(&cpu_f32, t, &filter, &uniforms).unwrap();
                assert_eq!((tokens.len(), lps.len()), (rows, rows));
                for r in 0..rows {
                    let logp = log_softmax_f64(&held[r], t);
                    let (kept, fragile) = filtered_reference(&logp, &filter);
                    let (want, cdf_margin) = inverse_cdf_reference(&kept, uniforms[r]);
                    let margin = cdf_margin.min(fragile);
                    let what = format!(
                        "{dtype:?} V={vocab} T={t} {filter:?} row {r} u={}: device {}, cpu {}, reference {want} (margin {margin:e})",
                        uniforms[r], tokens[r], cpu_tokens[r]
                    );
                    // Within 1e-6 of a CDF boundary f32 rounding may pick the neighbour.
                    draws += 1;
                    if margin > 1e-6 {
                        assert_eq!(tokens[r], want, "{what}");
                        assert_eq!(cpu_tokens[r], want, "{what}");
                        compared += 1;
                    }
                    let tok_lp = logp[tokens[r] as usize];
                    assert!(tok_lp.is_finite(), "{what}: drew a masked token");
                    if fragile > 1e-5 {
                        for (who, tok) in [("device", tokens[r]), ("cpu", cpu_tokens[r])] {
                            assert!(
                                kept[tok as usize].is_finite(),
                                "{what}: the {who} drew a token the filter drops"
                            );
                        }
                    }
                    assert!(
                        (lps[r] as f64 - tok_lp).abs() <= 1e-4,
                        "{what}: log-prob {} vs {tok_lp}",
                        lps[r]
                    );
                }
            }
        }
    }
    // Boundary cases are rare: nearly every draw was compared.
    assert!(
        compared * 10 >= draws * 9,
        "{compared} of {draws} draws compared"
    );
    // Bad input: no temperature, a uniform per row missing, a filter out of range.
    let logits = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
    let off = SampleFilter::OFF;
    let e = sample_inverse_cdf(&logits, 0.0, &off, &[0.5, 0.5]).unwrap_err();
    assert!(e.to_string().contains("temperature > 0"), "{e}");
    let e = sample_inverse_cdf(&logits, 1.0, &off, &[0.5]).unwrap_err();
    assert!(e.to_string().contains("1 uniforms for 2 rows"), "{e}");
    for bad in [
        SampleFilter { top_p: 0.0, ..off },
        SampleFilter { min_p: 1.5, ..off },
    ] {
        let e = sample_inverse_cdf(&logits, 1.0, &bad, &[0.5, 0.5]).unwrap_err();
        assert!(e.to_string().contains("top_p must be in (0, 1]"), "{e}");
    }
}
