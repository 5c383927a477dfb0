//! f64 finite-difference gradient checks for every loss of the crate.
//!
//! For each loss, candle's backward w.r.t. the trainable inputs (trainer log-probs; student
//! top-K log-probs; DPO policy sums; entropies for the entropy bonus) is compared with central
//! differences (h = 1e-5) of the same Rust function, to 1e-6 (relative above magnitude 1).
//!
//! Stop-gradients are checked two ways:
//! * inputs the references detach (old, sampler, reference and teacher log-probs) are passed
//!   as `Var`s and must receive no gradient (absent or all zero);
//! * terms that the references detach although they are computed from the trainer's own
//!   log-probs (CISPO's capped ratio sg(min(r, ε_high)), VESPO's sequence weight sg(φ),
//!   the hint channel's IS weight sg(min(π/π_old, cap)) and sampled-token coefficient
//!   sg(log π_S − log π_T)) are held fixed in the finite differences by shifting their
//!   partner inputs (old / sampler / teacher token log-probs) by the same perturbation, so
//!   log π − log π_old is unchanged and only the differentiated factor moves. The backward
//!   must match that, and (where it matters) differ from the naive derivative.

#[path = "../common/mod.rs"]
mod common;

mod composer;
mod hint;
mod replay;
mod rlvr;

use candle_core::{backprop::GradStore, Device, Tensor, Var};
use common::flat;
use composer_loss::*;
use std::collections::BTreeMap;

const B: usize = 4;
const T: usize = 5;
const H: f64 = 1e-5;
const TOL: f64 = 1e-6;

/// SplitMix64: deterministic inputs without a dev-dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    fn normal(&mut self) -> f64 {
        let u1 = self.uniform(1e-12, 1.0);
        let u2 = self.uniform(0.0, 1.0);
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

fn tensor(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
}

fn var(v: &[f64], shape: &[usize]) -> Var {
    Var::from_tensor(&tensor(v, shape)).unwrap()
}

fn grad_or_zero(grads: &GradStore, v: &Var, n: usize) -> Vec<f64> {
    grads.get(v.as_tensor()).map(flat).unwrap_or(vec![0.0; n])
}

/// The detached input must receive no gradient.
fn assert_no_grad(grads: &GradStore, v: &Var, what: &str) {
    if let Some(g) = grads.get(v.as_tensor()) {
        assert!(
            flat(g).iter().all(|x| *x == 0.0),
            "{what}: a detached input received a gradient"
        );
    }
}

/// Central differences of `f` at `x0`.
fn fd_grad(x0: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    (0..x0.len())
        .map(|i| {
            let mut xp = x0.to_vec();
            let mut xm = x0.to_vec();
            xp[i] += H;
            xm[i] -= H;
            (f(&xp) - f(&xm)) / (2.0 * H)
        })
        .collect()
}

/// Central differences of `f` at `x0`, compared with `analytic`.
fn fd_check(what: &str, x0: &[f64], analytic: &[f64], f: impl Fn(&[f64]) -> f64) {
    assert_eq!(x0.len(), analytic.len(), "{what}: gradient length");
    for (i, fd) in fd_grad(x0, f).into_iter().enumerate() {
        let a = analytic[i];
        assert!(
            (fd - a).abs() <= TOL * a.abs().max(1.0),
            "{what}[{i}]: backward {a}, finite difference {fd}"
        );
    }
}

fn shifted(base: &[f64], x: &[f64], x0: &[f64]) -> Vec<f64> {
    base.iter()
        .zip(x.iter().zip(x0))
        .map(|(b, (x, x0))| b + (x - x0))
        .collect()
}
