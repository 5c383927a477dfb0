//! Per-layer gradient checkpointing (`Transformer::gradient_checkpointing`): the backward
//! recomputes each decoder layer's activations, and every trainable parameter gets the same
//! gradient as without checkpointing (within 1e-6 relative to its largest entry), through
//! the padded forward (kernels and compositions, left padding), the padding-free packed
//! forward, and LoRA adapters with dropout (the recomputation replays the forward's masks).

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use composer_model::{token_logprobs, LoraConfig, ModelConfig, PackedBatch, Transformer};

const IDS: [[u32; 9]; 2] = [
    [5, 17, 99, 3, 250, 42, 7, 300, 11],
    [0, 0, 0, 8, 64, 9, 77, 12, 3],
];
const LEFT_PAD: [usize; 2] = [0, 3];

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A loss through the padded forward (left-padded batch, weighted rows).
fn padded_loss(model: &Transformer) -> Tensor {
    let ids = Tensor::new(&IDS, model.device()).unwrap();
    let h = model
        .forward_hidden(&ids.narrow(1, 0, 8).unwrap(), Some(&LEFT_PAD), None, true)
        .unwrap();
    let lp = token_logprobs(&model.logits(&h).unwrap(), &ids.narrow(1, 1, 8).unwrap()).unwrap();
    let w = Tensor::new(&[[1.0f64; 8], [-0.5; 8]], model.device())
        .unwrap()
        .to_dtype(lp.dtype())
        .unwrap();
    (lp * w).unwrap().sum_all().unwrap()
}

/// A loss through the packed forward (the two rows' real tokens).
fn packed_loss(model: &Transformer) -> Tensor {
    let seqs = [&IDS[0][..], &IDS[1][3..]];
    let inputs: Vec<&[u32]> = seqs.iter().map(|s| &s[..s.len() - 1]).collect();
    let targets: Vec<u32> = seqs.iter().flat_map(|s| s[1..].to_vec()).collect();
    let n = targets.len();
    let h = model
        .forward_hidden_packed(&PackedBatch::from_sequences(&inputs))
        .unwrap();
    let target = Tensor::from_vec(targets, (1, n), model.device()).unwrap();
    let lp = token_logprobs(&model.logits(&h.unsqueeze(0).unwrap()).unwrap(), &target).unwrap();
    let w: Vec<f64> = (0..n).map(|i| 1.0 - 0.1 * i as f64).collect();
    let w = Tensor::from_vec(w, (1, n), model.device())
        .unwrap()
        .to_dtype(lp.dtype())
        .unwrap();
    (lp * w).unwrap().sum_all().unwrap()
}

/// Every variable's gradient of `loss(model)`, by name; a variable without one fails.
fn grads(
    model: &Transformer,
    varmap: &VarMap,
    loss: fn(&Transformer) -> Tensor,
) -> Vec<(String, Vec<f64>)> {
    let g = loss(model).backward().unwrap();
    let mut out: Vec<(String, Vec<f64>)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let t = g
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{k} got no gradient"));
            (k.clone(), flat(t))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Gradients with checkpointing equal those without, for each loss and kernel setting.
fn assert_checkpointing_keeps_gradients(what: &str, model: &mut Transformer, varmap: &VarMap) {
    for kernels in [true, false] {
        model.training_kernels = kernels;
        for (loss_name, loss) in [
            ("padded", padded_loss as fn(&Transformer) -> Tensor),
            ("packed", packed_loss),
        ] {
            model.gradient_checkpointing = false;
            let plain = grads(model, varmap, loss);
            model.gradient_checkpointing = true;
            let ckpt = grads(model, varmap, loss);
            model.gradient_checkpointing = false;
            assert_eq!(plain.len(), ckpt.len());
            for ((name, a), (_, b)) in plain.iter().zip(&ckpt) {
                let scale = a.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
                let d = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f64::max)
                    / scale;
                assert!(
                    d <= 1e-6,
                    "{what} kernels={kernels} {loss_name}: gradient of {name} differs by {d:e}"
                );
            }
        }
    }
}

#[test]
fn checkpointing_keeps_every_gradient_on_the_hf_fixtures() {
    for name in common::FIXTURES {
        let (mut model, varmap) =
            Transformer::load_trainable(&common::fixture(name), &Device::Cpu, DType::F64).unwrap();
        assert_checkpointing_keeps_gradients(name, &mut model, &varmap);
    }
}

#[test]
fn checkpointing_keeps_every_gradient_of_a_random_f32_model() {
    let cfg = ModelConfig {
        num_hidden_layers: 3,
        ..ModelConfig::from_dir(&common::fixture("qwen2-tiny")).unwrap()
    };
    let (mut model, varmap) = Transformer::random_init(&cfg, 5, &Device::Cpu).unwrap();
    assert_checkpointing_keeps_gradients("random f32", &mut model, &varmap);
}

#[test]
fn checkpointing_replays_the_lora_dropout_masks() {
    let (mut model, _) =
        Transformer::load_trainable(&common::fixture("qwen3-tiny"), &Device::Cpu, DType::F64)
            .unwrap();
    let cfg = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.3,
        target_modules: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
        .map(String::from)
        .to_vec(),
    };
    let varmap = model.add_lora(&cfg, 9).unwrap();
    // B starts at 0 (A would get no gradient): make it non-zero.
    for (i, (name, var)) in varmap.data().lock().unwrap().iter().enumerate() {
        if name.contains("lora_B") {
            let n = var.elem_count();
            let v: Vec<f64> = (0..n)
                .map(|j| ((j * 7 + i) % 11) as f64 * 0.01 - 0.05)
                .collect();
            var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    for (loss_name, loss) in [
        ("padded", padded_loss as fn(&Transformer) -> Tensor),
        ("packed", packed_loss),
    ] {
        model.gradient_checkpointing = false;
        model.reseed_lora_dropout(21).unwrap();
        let plain = grads(&model, &varmap, loss);
        model.gradient_checkpointing = true;
        model.reseed_lora_dropout(21).unwrap();
        let ckpt = grads(&model, &varmap, loss);
        // Another seed gives other masks, hence other gradients: the check can fail.
        model.reseed_lora_dropout(22).unwrap();
        let other = grads(&model, &varmap, loss);
        let mut differs = false;
        for (((name, a), (_, b)), (_, c)) in plain.iter().zip(&ckpt).zip(&other) {
            let scale = a.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
            let d = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max)
                / scale;
            assert!(
                d <= 1e-6,
                "LoRA {loss_name}: gradient of {name} differs by {d:e}"
            );
            differs |= a.iter().zip(c).any(|(x, y)| (x - y).abs() > 1e-6 * scale);
        }
        assert!(
            differs,
            "LoRA {loss_name}: dropout seeds 21 and 22 gave the same gradients"
        );
    }
}
