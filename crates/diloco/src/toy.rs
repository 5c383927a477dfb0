//! A tiny regression task for the replica test binary, the tests and the benchmark: a
//! 2-layer tanh MLP (8 → 16 → 1, or wider for the benchmark) fitting a fixed random teacher MLP on synthetic inputs, trained
//! with plain SGD. Deterministic from a seed so separate processes agree on data and init.

use anyhow::Result;
use candle_core::{Device, Tensor, Var};

/// Input width.
pub const IN: usize = 8;
/// Hidden width.
pub const HIDDEN: usize = 16;

/// splitmix64 pseudo-random numbers (deterministic across processes).
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// Next raw 64-bit value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }
    /// `n` normals times `scale`.
    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// The synthetic dataset: `train` samples for training, `eval` held out.
pub struct Dataset {
    /// Training inputs [n, IN].
    pub x: Vec<f32>,
    /// Training targets [n].
    pub y: Vec<f32>,
    /// Held-out inputs.
    pub eval_x: Tensor,
    /// Held-out targets [m, 1].
    pub eval_y: Tensor,
    /// Number of training samples.
    pub n: usize,
}

fn teacher(x: &[f32], w1: &[f32], w2: &[f32]) -> f32 {
    let mut out = 0.0;
    for h in 0..HIDDEN {
        let mut a = 0.0;
        for i in 0..IN {
            a += w1[h * IN + i] * x[i];
        }
        out += w2[h] * a.tanh();
    }
    out
}

impl Dataset {
    /// `n` training and `m` held-out samples from the teacher with seed `seed` (noise σ = 0.05).
    pub fn new(seed: u64, n: usize, m: usize) -> Result<Self> {
        let mut rng = Rng::new(seed);
        let w1 = rng.normals(HIDDEN * IN, 0.5);
        let w2 = rng.normals(HIDDEN, 0.5);
        let mut gen = |k: usize| {
            let x = rng.normals(k * IN, 1.0);
            let y: Vec<f32> = (0..k)
                .map(|i| teacher(&x[i * IN..(i + 1) * IN], &w1, &w2))
                .collect();
            (x, y)
        };
        let (x, mut y) = gen(n);
        let (ex, ey) = gen(m);
        let mut noise = Rng::new(seed.wrapping_add(1));
        for v in &mut y {
            *v += 0.05 * noise.normal();
        }
        Ok(Self {
            x,
            y,
            eval_x: Tensor::from_vec(ex, (m, IN), &Device::Cpu)?,
            eval_y: Tensor::from_vec(ey, (m, 1), &Device::Cpu)?,
            n,
        })
    }

    /// The minibatch of `replica` (of `replicas`) at global inner step `step`: the step's union
    /// batch is `replicas × batch` consecutive samples (cycling), replica k takes slice k — so one
    /// process with batch `replicas × batch` sees exactly the same samples.
    pub fn batch(
        &self,
        step: usize,
        replica: usize,
        replicas: usize,
        batch: usize,
    ) -> Result<(Tensor, Tensor)> {
        let start = step * replicas * batch + replica * batch;
        let mut x = Vec::with_capacity(batch * IN);
        let mut y = Vec::with_capacity(batch);
        for j in 0..batch {
            let i = (start + j) % self.n;
            x.extend_from_slice(&self.x[i * IN..(i + 1) * IN]);
            y.push(self.y[i]);
        }
        Ok((
            Tensor::from_vec(x, (batch, IN), &Device::Cpu)?,
            Tensor::from_vec(y, (batch, 1), &Device::Cpu)?,
        ))
    }
}

/// Student parameters `l1.weight`, `l1.bias`, `l2.weight`, `l2.bias` (seeded init), of the
/// teacher's width [`HIDDEN`].
pub fn init_params(seed: u64) -> Result<Vec<(String, Var)>> {
    init_student(seed, HIDDEN)
}

/// A student `hidden` units wide (the benchmark widens it so that the exchanged bytes are those
/// of a model, not of object headers); at [`HIDDEN`] it is [`init_params`]. Wider students are
/// in the NTK parametrisation (see [`loss`]), so one learning rate suits every width.
pub fn init_student(seed: u64, hidden: usize) -> Result<Vec<(String, Var)>> {
    let mut rng = Rng::new(seed.wrapping_mul(31).wrapping_add(7));
    let d = &Device::Cpu;
    Ok(vec![
        (
            "l1.weight".into(),
            Var::from_vec(rng.normals(hidden * IN, 0.35), (hidden, IN), d)?,
        ),
        (
            "l1.bias".into(),
            Var::from_vec(vec![0f32; hidden], hidden, d)?,
        ),
        (
            "l2.weight".into(),
            Var::from_vec(rng.normals(hidden, 0.25), (1, hidden), d)?,
        ),
        ("l2.bias".into(), Var::from_vec(vec![0f32; 1], 1, d)?),
    ])
}

/// Mean squared error of the student on (x, y). The output layer is multiplied by
/// √(HIDDEN / hidden) (NTK parametrisation: the output's scale and the effect of an SGD step on
/// it do not grow with the width; the factor is exactly 1 at the default width).
pub fn loss(params: &[(String, Var)], x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let hidden = params[1].1.dims()[0];
    let h = x
        .matmul(&params[0].1.as_tensor().t()?)?
        .broadcast_add(params[1].1.as_tensor())?
        .tanh()?;
    let mut out = h.matmul(&params[2].1.as_tensor().t()?)?;
    if hidden != HIDDEN {
        out = (out * (HIDDEN as f64 / hidden as f64).sqrt())?;
    }
    let out = out.broadcast_add(params[3].1.as_tensor())?;
    Ok((out - y)?.sqr()?.mean_all()?)
}

/// One plain SGD step on a minibatch; returns the minibatch loss.
pub fn sgd_step(params: &[(String, Var)], x: &Tensor, y: &Tensor, lr: f64) -> Result<f32> {
    let l = loss(params, x, y)?;
    let grads = l.backward()?;
    for (_, v) in params {
        if let Some(g) = grads.get(v) {
            v.set(&(v.as_tensor() - (g * lr)?)?)?;
        }
    }
    Ok(l.to_scalar::<f32>()?)
}

/// Held-out MSE.
pub fn eval_loss(params: &[(String, Var)], data: &Dataset) -> Result<f32> {
    Ok(loss(params, &data.eval_x, &data.eval_y)?.to_scalar::<f32>()?)
}
