//! Gradient accumulation: losses normalised by the step's GLOBAL active-token count
//! (`LossScale::from_micro_batches`, TRL's `num_items_in_batch`, PRIME-RL's `rl_scale`) summed
//! over 4 micro-batches equal one big batch — loss and gradients to 1e-10 in f64.
mod common;
use candle_core::{Device, Tensor, Var};
use common::flat;
use composer_loss::*;

const B: usize = 8;
const T: usize = 6;
const MICRO: usize = 4;

struct Batch {
    lp: Vec<f64>,
    old: Vec<f64>,
    sampler: Vec<f64>,
    reference: Vec<f64>,
    entropies: Vec<f64>,
    advantages: Vec<f64>,
    mask: Vec<f64>,
    truncated: Vec<bool>,
}

/// Deterministic pseudo-random values in (0, 1) (a fixed LCG; no dev-dependency).
fn unit(seed: &mut u64) -> f64 {
    *seed = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    ((*seed >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

fn batch() -> Batch {
    let mut s = 7u64;
    let n = B * T;
    let lp: Vec<f64> = (0..n).map(|_| (0.05 + 0.9 * unit(&mut s)).ln()).collect();
    let old: Vec<f64> = lp
        .iter()
        .map(|x| (x + 0.6 * (unit(&mut s) - 0.5)).min(-1e-3))
        .collect();
    let sampler: Vec<f64> = old
        .iter()
        .map(|x| (x + 0.5 * (unit(&mut s) - 0.5)).min(-1e-3))
        .collect();
    let reference = lp.iter().map(|x| x + 0.4 * (unit(&mut s) - 0.5)).collect();
    let entropies = (0..n).map(|_| 0.1 + 2.0 * unit(&mut s)).collect();
    // Very different lengths per micro-batch, so a per-micro-batch mean would differ.
    let lens = [6, 1, 3, 5, 2, 2, 6, 4];
    let mask = (0..n)
        .map(|k| if k % T < lens[k / T] { 1.0 } else { 0.0 })
        .collect();
    Batch {
        lp,
        old,
        sampler,
        reference,
        entropies,
        advantages: vec![1.0, -0.5, 0.3, -1.2, 0.8, -0.1, 0.6, -0.9],
        mask,
        truncated: vec![false, false, true, false, false, false, false, true],
    }
}

/// Rows `r0..r1` of the batch as loss inputs, the trainer log-probs as a fresh `Var`.
fn inputs(b: &Batch, r0: usize, r1: usize) -> (LossInputs, Var) {
    let rows = r1 - r0;
    let sl =
        |v: &[f64]| Tensor::from_vec(v[r0 * T..r1 * T].to_vec(), (rows, T), &Device::Cpu).unwrap();
    let lp = Var::from_tensor(&sl(&b.lp)).unwrap();
    let adv = Tensor::from_vec(b.advantages[r0..r1].to_vec(), rows, &Device::Cpu).unwrap();
    let mut x = LossInputs::new(lp.as_tensor().clone(), adv, sl(&b.mask));
    x.old_logprobs = Some(sl(&b.old));
    x.sampler_logprobs = Some(sl(&b.sampler));
    x.ref_logprobs = Some(sl(&b.reference));
    x.entropies = Some(sl(&b.entropies));
    x.truncated = Some(b.truncated[r0..r1].to_vec());
    (x, lp)
}

/// (big-batch loss, big-batch grad, summed micro loss, concatenated micro grads,
/// summed micro loss with per-micro-batch local normalisers).
fn run(cfg: &RlvrConfig) -> (f64, Vec<f64>, f64, Vec<f64>, f64) {
    let b = batch();
    let (big, big_lp) = inputs(&b, 0, B);
    let big_scale = LossScale::local(&big, cfg.mask_truncated_completions).unwrap();
    let (big_loss, _) = rlvr_loss(&big, cfg, &big_scale).unwrap();
    let big_grad = flat(
        big_loss
            .backward()
            .unwrap()
            .get(big_lp.as_tensor())
            .unwrap(),
    );

    let per = B / MICRO;
    let micro: Vec<(LossInputs, Var)> = (0..MICRO)
        .map(|m| inputs(&b, m * per, (m + 1) * per))
        .collect();
    let refs: Vec<&LossInputs> = micro.iter().map(|(x, _)| x).collect();
    let scale = LossScale::from_micro_batches(&refs, cfg.mask_truncated_completions).unwrap();
    assert_eq!(scale.global_active_tokens, big_scale.global_active_tokens);
    assert_eq!(scale.num_micro_batches, MICRO as f64);
    let (mut loss_sum, mut grads, mut local_sum) = (0.0, Vec::new(), 0.0);
    for (x, lp) in &micro {
        let (l, _) = rlvr_loss(x, cfg, &scale).unwrap();
        loss_sum += flat(&l)[0];
        // One backward per micro-batch, as a training loop accumulates.
        grads.extend(flat(l.backward().unwrap().get(lp.as_tensor()).unwrap()));
        let local = LossScale::local(x, cfg.mask_truncated_completions).unwrap();
        local_sum += flat(&rlvr_loss(x, cfg, &local).unwrap().0)[0] / MICRO as f64;
    }
    (flat(&big_loss)[0], big_grad, loss_sum, grads, local_sum)
}

fn assert_equal(what: &str, cfg: &RlvrConfig) {
    let (big, big_grad, sum, grads, local) = run(cfg);
    assert!(
        (big - sum).abs() < 1e-10,
        "{what}: one batch {big} vs 4 accumulated micro-batches {sum}"
    );
    for (i, (a, b)) in big_grad.iter().zip(&grads).enumerate() {
        assert!((a - b).abs() < 1e-10, "{what}: grad[{i}] {a} vs {b}");
    }
    // Sanity: normalising each micro-batch by its own token count would NOT be equal.
    assert!(
        (big - local).abs() > 1e-6,
        "{what}: the check cannot tell global from local normalisation"
    );
}

#[test]
fn dapo_four_micro_batches_equal_one_batch() {
    // TRL's default loss with its default sampler correction (sequence mask, C_max = 3).
    assert_equal("dapo", &RlvrConfig::default());
    // Everything that changes the normaliser or adds per-token terms.
    let full = RlvrConfig {
        epsilon_high: Some(0.28),
        beta: 0.04,
        entropy_coef: 0.01,
        // TRL 1.16 (the default) takes the entropy bonus as a per-micro-batch mean ÷ G, which is
        // not accumulation-invariant; the pre-1.16 normaliser (global tokens) is.
        entropy_normalization: EntropyNormalization::PolicyNormalizer,
        mask_truncated_completions: true,
        sampler_importance_sampling_mode: SamplerIsMode::TokenTruncate,
        sampler_importance_sampling_clip_min: Some(0.5),
        sampler_importance_sampling_clip_max: Some(2.0),
        ..Default::default()
    };
    assert_equal("dapo + clip-higher + kl + entropy + truncation", &full);
}

#[test]
fn other_global_token_losses_accumulate_exactly() {
    for (what, cfg) in [
        (
            "cispo",
            RlvrConfig {
                loss_type: LossType::Cispo,
                epsilon_high: Some(1.1),
                ..Default::default()
            },
        ),
        (
            "vespo",
            RlvrConfig {
                loss_type: LossType::Vespo,
                sampler_importance_sampling_mode: SamplerIsMode::TokenTruncate,
                ..Default::default()
            },
        ),
        (
            "dppo",
            RlvrConfig {
                loss_type: LossType::Dppo,
                ..Default::default()
            },
        ),
        (
            "verl token-mean",
            RlvrConfig {
                loss_type: LossType::Grpo,
                loss_agg_mode: Some(LossAggMode::TokenMean),
                ..Default::default()
            },
        ),
    ] {
        assert_equal(what, &cfg);
    }
}
