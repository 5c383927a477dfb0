//! The sampler/trainer mismatch metrics of the RLVR loss: max |log π_old − log μ| and the k3
//! KL estimate over the active tokens only, computed whenever sampler log-probs are given.

use candle_core::{Device, Tensor};
use composer_loss::{rlvr_loss, LossInputs, LossScale, RlvrConfig};

fn t2(v: &[[f32; 3]; 2]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

#[test]
fn mismatch_is_measured_on_active_tokens_and_zero_when_equal() {
    let trainer = [[-0.5f32, -1.0, -2.0], [-0.25, -0.75, -3.0]];
    let adv = Tensor::new(&[1.0f32, -1.0], &Device::Cpu).unwrap();
    // The last token of row 1 is padding: its (large) difference must not count.
    let mask = t2(&[[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]);
    let mut inputs = LossInputs::new(t2(&trainer), adv, mask);
    let cfg = RlvrConfig::default();
    let scale = LossScale::local(&inputs, false).unwrap();

    // No sampler log-probs: nothing to measure.
    let (_, m) = rlvr_loss(&inputs, &cfg, &scale).unwrap();
    assert_eq!((m.mismatch_max_abs, m.mismatch_kl), (None, None));

    // Identical log-probs: exactly zero.
    inputs.sampler_logprobs = Some(t2(&trainer));
    let (_, m) = rlvr_loss(&inputs, &cfg, &scale).unwrap();
    assert_eq!(m.mismatch_max_abs, Some(0.0));
    assert_eq!(m.mismatch_kl, Some(0.0));

    // d = log π − log μ on the active tokens: 0.1, 0, -0.2, 0.3, 0 (padding: 5.0, ignored).
    let sampler = [[-0.6f32, -1.0, -1.8], [-0.55, -0.75, 2.0]];
    inputs.sampler_logprobs = Some(t2(&sampler));
    let (_, m) = rlvr_loss(&inputs, &cfg, &scale).unwrap();
    let d: Vec<f64> = (0..2)
        .flat_map(|i| (0..3).map(move |j| (i, j)))
        .filter(|&(i, j)| !(i == 1 && j == 2))
        .map(|(i, j)| trainer[i][j] as f64 - sampler[i][j] as f64)
        .collect();
    let max_abs = d.iter().fold(0f64, |a, x| a.max(x.abs()));
    let k3 = d.iter().map(|x| x.exp() - x - 1.0).sum::<f64>() / d.len() as f64;
    assert!((max_abs - 0.3).abs() < 1e-6, "{max_abs}");
    assert!((m.mismatch_max_abs.unwrap() - max_abs).abs() < 1e-12);
    assert!((m.mismatch_kl.unwrap() - k3).abs() < 1e-12, "{m:?} vs {k3}");
    assert!(k3 > 0.0);
}
