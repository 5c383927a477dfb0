//! Writes the LoRA adapter of the PEFT parity fixture (tools/ref_lora_peft.sh): a rank-4
//! adapter on every projection of the base checkpoint, `A` from PEFT's init and `B` seeded
//! uniform in ±0.05 (so the adapter changes the logits, as after some training), saved in
//! PEFT's format.
//!
//!     cargo run -p composer-model --example write_lora_fixture -- BASE_DIR OUT_DIR

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use composer_model::{LoraConfig, Transformer};
use rand::{Rng, SeedableRng};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (base, out) = (
        args.get(1)
            .context("usage: write_lora_fixture BASE_DIR OUT_DIR")?,
        args.get(2)
            .context("usage: write_lora_fixture BASE_DIR OUT_DIR")?,
    );
    let mut model = Transformer::load(base.as_ref(), &Device::Cpu, DType::F32)?;
    let cfg = LoraConfig::new(4, 8.0, 0.05, Some(&["all-linear".to_string()]))?;
    let varmap = model.add_lora(&cfg, 1234)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
    let data = varmap.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().filter(|k| k.contains("lora_B")).collect();
    names.sort();
    for name in names {
        let v = &data[name];
        let n = v.elem_count();
        let vals: Vec<f32> = (0..n)
            .map(|_| (rng.random::<f64>() * 0.1 - 0.05) as f32)
            .collect();
        v.set(&Tensor::from_vec(vals, v.shape(), v.device())?)?;
    }
    model.save_lora(out.as_ref(), "qwen2-tiny")?;
    println!("wrote the adapter to {out}");
    Ok(())
}
