//! Throughput benchmark: training forward+backward tokens/s and decode tokens/s at several
//! batch sizes for a model shape with random weights. Numbers are printed, never asserted.
//! `tools/bench_torch.py` measures the same with transformers for a side-by-side.
//! [`alloc_counter`] is the counting global allocator of the heap measurements.

mod accounting;
pub mod alloc_counter;
mod profile_marks;
pub use accounting::{device_name, peak_bf16_flops, train_flops_per_token, DevicePeakMemory};
pub use profile_marks::profile_phase;

use crate::chunked_logprobs::HeadOptions;
use crate::config::ModelConfig;
use crate::lora::LoraConfig;
use crate::rollout::{generate, GenerationRequest, SamplingParams};
use crate::transformer::Transformer;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use std::time::Instant;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Model shape (random weights).
    pub model: ModelConfig,
    /// Device.
    pub device: Device,
    /// Dtype of the decode model.
    pub decode_dtype: DType,
    /// Dtype of the weights the training forward+backward runs in (bf16 on GPUs, as a
    /// mixed-precision step computes in bf16 from f32 master weights; f32 on CPU).
    pub train_dtype: DType,
    /// Batch sizes to time.
    pub batch_sizes: Vec<usize>,
    /// Sequence length of the training step.
    pub train_seq_len: usize,
    /// Prompt length for decoding.
    pub prompt_len: usize,
    /// Tokens decoded per sample.
    pub decode_tokens: usize,
    /// Timed repetitions of the training step (after one warm-up).
    pub train_iters: usize,
    /// Skip the training measurement (e.g. memory-bound GPU shapes).
    pub skip_train: bool,
    /// Skip the decode measurement.
    pub skip_decode: bool,
    /// Train LoRA adapters of this rank on every projection (`all-linear`, alpha = 2r) over
    /// the frozen base instead of every weight.
    pub lora_r: Option<usize>,
    /// Recompute each decoder layer's activations in the backward (per-layer checkpointing).
    pub gradient_checkpointing: bool,
    /// Run the training step padding-free (TRL's `padding_free`): the batch's rows packed
    /// into one row of segments ([`Transformer::forward_hidden_packed`]; the varlen attention
    /// kernel) instead of the padded batch.
    pub padding_free: bool,
    /// Also time the decode with fixed-shape steps captured as CUDA graphs
    /// ([`EngineConfig::cuda_graphs`](crate::EngineConfig::cuda_graphs)), alternating with
    /// the plain decode.
    pub cuda_graphs: bool,
}

/// The benchmarks' dtype on `device` when none is asked for: bf16 on CUDA, f32 on the CPU.
pub fn default_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

impl BenchConfig {
    /// The default: Qwen2.5-0.5B shape, batch 1/16/64.
    pub fn qwen2_5_0_5b(device: Device) -> Self {
        Self::with_model(ModelConfig::qwen2_5_0_5b(), device)
    }

    /// `model` on `device` in its default dtype ([`default_dtype`]), batch 1/16/64, training
    /// steps of 512 tokens, 64 tokens decoded after 128-token prompts: full-weight training
    /// and decoding both measured, no checkpointing, padded batches.
    fn with_model(model: ModelConfig, device: Device) -> Self {
        let decode_dtype = default_dtype(&device);
        BenchConfig {
            model,
            device,
            decode_dtype,
            train_dtype: decode_dtype,
            batch_sizes: vec![1, 16, 64],
            train_seq_len: 512,
            prompt_len: 128,
            decode_tokens: 64,
            train_iters: 3,
            skip_train: false,
            skip_decode: false,
            cuda_graphs: false,
            lora_r: None,
            gradient_checkpointing: false,
            padding_free: false,
        }
    }

    /// Issue 16's CPU memory shape: a Qwen2 of hidden size 64, 2 layers and Qwen's
    /// 151,936-token vocabulary (`ModelConfig::tiny_qwen2`'s layers), one training step of
    /// 64 × 256 tokens (the fused head keeps the peak RSS far below the 10 GB that the f32
    /// logits alone would take).
    pub fn qwen_vocab_cpu() -> Self {
        let model = ModelConfig {
            max_position_embeddings: 512,
            ..ModelConfig::tiny_qwen2(151_936)
        };
        BenchConfig {
            batch_sizes: vec![64],
            train_seq_len: 257,
            prompt_len: 8,
            decode_tokens: 4,
            train_iters: 1,
            ..Self::with_model(model, Device::Cpu)
        }
    }

    /// A small shape that runs in seconds on a CPU.
    pub fn small_cpu() -> Self {
        let model = ModelConfig {
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 4,
            head_dim: 32,
            max_position_embeddings: 512,
            ..ModelConfig::tiny_qwen2(512)
        };
        BenchConfig {
            train_seq_len: 128,
            prompt_len: 32,
            decode_tokens: 32,
            train_iters: 2,
            ..Self::with_model(model, Device::Cpu)
        }
    }
}

/// The model of a named benchmark shape (`bench model --shape`, `bench rollout --shape`):
/// `small` (CPU-sized: hidden 128, 4 layers, vocab 512), `h256-l4` (hidden 256, 4 layers, 8
/// query / 2 key-value heads × 32, vocab 2048: issue 17's CPU GRPO-step shape),
/// `qwen2.5-0.5b`, `qwen3-0.6b`, `qwen2.5-7b`, or `qwen-vocab` (hidden 64, 2 layers, Qwen's
/// 151,936-token vocabulary).
pub fn shape_model_config(name: &str) -> Result<ModelConfig> {
    Ok(match name {
        "small" => BenchConfig::small_cpu().model,
        "h256-l4" => ModelConfig {
            hidden_size: 256,
            intermediate_size: 768,
            num_hidden_layers: 4,
            num_attention_heads: 8,
            head_dim: 32,
            max_position_embeddings: 2048,
            ..ModelConfig::tiny_qwen2(2048)
        },
        "qwen2.5-0.5b" => ModelConfig::qwen2_5_0_5b(),
        "qwen3-0.6b" => ModelConfig::qwen3_0_6b(),
        "qwen2.5-7b" => ModelConfig::qwen2_5_7b(),
        "qwen-vocab" => BenchConfig::qwen_vocab_cpu().model,
        other => anyhow::bail!(
            "--shape {other:?} is not one of: small, h256-l4, qwen2.5-0.5b, qwen3-0.6b, qwen2.5-7b, \
             qwen-vocab"
        ),
    })
}

/// [`shape_model_config`] with its vocabulary widened to `tokenizer`'s (random weights of a
/// named shape that take a real tokenizer's ids).
pub fn shape_model_config_for(name: &str, tokenizer: &crate::Tokenizer) -> Result<ModelConfig> {
    let mut cfg = shape_model_config(name)?;
    cfg.vocab_size = cfg.vocab_size.max(tokenizer.vocab_size());
    Ok(cfg)
}

/// One batch size's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// Batch size.
    pub batch: usize,
    /// Training forward+backward tokens per second (None if skipped).
    pub train_tokens_per_s: Option<f64>,
    /// Seconds of one extra training step's phases, synchronised between them: decoder
    /// forward, LM head with log-probs, backward (None if training was skipped).
    pub train_phase_s: Option<[f64; 3]>,
    /// Decode tokens per second (prefill excluded; None if skipped).
    pub decode_tokens_per_s: Option<f64>,
    /// The same with CUDA graphs (`cuda_graphs`; None unless asked for).
    pub decode_graphs_tokens_per_s: Option<f64>,
    /// The device's used memory at its peak during this row's training steps (MiB; CUDA
    /// only, [`DevicePeakMemory`]).
    pub peak_device_mib: Option<f64>,
    /// Peak RSS of the process (MB) right after this row's training steps (Linux; the
    /// high-water mark of everything before, too).
    pub peak_rss_after_train_mb: Option<f64>,
}

/// All rows plus the shape measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Parameter count.
    pub num_parameters: usize,
    /// Trainable parameter count (the adapters under LoRA).
    pub num_trainable_parameters: usize,
    /// Training sequence length.
    pub train_seq_len: usize,
    /// Whether the training step ran padding-free (rows packed as segments of one row).
    pub padding_free: bool,
    /// Device, in words.
    pub device: String,
    /// Dtype of the training step.
    #[serde(serialize_with = "dtype_name")]
    pub train_dtype: DType,
    /// Dtype of decoding.
    #[serde(serialize_with = "dtype_name")]
    pub decode_dtype: DType,
    /// Prompt tokens of each decoded sample.
    pub prompt_len: usize,
    /// Tokens decoded per sample (the first, after the prefill, not timed).
    pub decode_tokens: usize,
    /// Peak RSS (MB) after the model was built, before any training step (Linux).
    pub peak_rss_before_train_mb: Option<f64>,
    /// Rows by batch size.
    pub rows: Vec<BenchRow>,
}

/// Peak resident set size of this process in bytes (`VmHWM` of `/proc/self/status`), where
/// the platform has it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn peak_rss_mb() -> Option<f64> {
    peak_rss_bytes().map(|b| b as f64 / 1e6)
}

impl BenchReport {
    /// A plain-text table.
    pub fn table(&self) -> String {
        let mb = |x: Option<f64>| x.map(|m| format!("{m:.0}")).unwrap_or_else(|| "-".into());
        let rate = |x: Option<f64>| x.map(|t| format!("{t:.0}")).unwrap_or_else(|| "-".into());
        let mut s = format!(
            "composer-model bench: {:.1}M params on {} (train {:?}, decode {:?}); peak RSS before training {} MB\n{:>6} {:>16} {:>16} {:>20} {:>22}\n",
            self.num_parameters as f64 / 1e6,
            self.device,
            self.train_dtype,
            self.decode_dtype,
            mb(self.peak_rss_before_train_mb),
            "batch",
            "train tok/s",
            "decode tok/s",
            "decode graphs tok/s",
            "peak RSS after train MB"
        );
        for r in &self.rows {
            s.push_str(&format!(
                "{:>6} {:>16} {:>16} {:>20} {:>22}\n",
                r.batch,
                rate(r.train_tokens_per_s),
                rate(r.decode_tokens_per_s),
                rate(r.decode_graphs_tokens_per_s),
                mb(r.peak_rss_after_train_mb)
            ));
        }
        s
    }
}

fn sync(device: &Device) -> Result<()> {
    device.synchronize()?;
    Ok(())
}

/// A deterministic `[b, t]` batch of token ids below `vocab`.
pub fn bench_input(b: usize, t: usize, vocab: u32, device: &Device) -> Result<Tensor> {
    let ids: Vec<u32> = (0..b * t).map(|i| (i as u32 * 7919 + 13) % vocab).collect();
    Ok(Tensor::from_vec(ids, (b, t), device)?)
}

/// One training step as the trainer takes it: differentiable hidden states, the fused
/// chunked head's next-token log-probs, backward of their negated mean.
pub fn train_step(model: &Transformer, input: &Tensor) -> Result<()> {
    train_step_phases(model, input, false, false).map(|_| ())
}

/// Differentiable hidden states `[B, T, hidden]` of `input`, padded, or (`packed`) from its
/// rows packed as segments of one row.
fn train_hidden(model: &Transformer, input: &Tensor, packed: bool) -> Result<Tensor> {
    if !packed {
        return model.forward_hidden(input, None, None, true);
    }
    let (b, t) = input.dims2()?;
    let rows = input.to_vec2::<u32>()?;
    let batch = crate::transformer::PackedBatch::from_sequences(&rows);
    Ok(model
        .forward_hidden_packed(&batch)?
        .reshape((b, t, model.cfg.hidden_size))?)
}

/// The benchmarks' loss: the mean negative log-likelihood of `targets` `[N, 1]` under the
/// fused LM head on `hidden` `[N, hidden]` (log-probs in f32).
pub fn next_token_nll(model: &Transformer, hidden: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(model
        .head_logprobs(hidden, targets, &HeadOptions::default())?
        .at_ids
        .to_dtype(DType::F32)?
        .mean_all()?
        .neg()?)
}

/// [`train_step`] (padded or `packed`), returning the seconds of its three phases (decoder
/// forward, LM head with log-probs, backward) when `timed` (the device is synchronised
/// between phases).
fn train_step_phases(
    model: &Transformer,
    input: &Tensor,
    packed: bool,
    timed: bool,
) -> Result<[f64; 3]> {
    let (b, t) = input.dims2()?;
    // The phases as `tools/cupti_profile` labels them: the one each lap opens as it closes one.
    const NEXT_PHASE: [&str; 3] = ["LM head and log-probs", "backward", "after the step"];
    let mark = |phase: &str| profile_phase(&format!("train {b}x{t}: {phase}"));
    if timed {
        sync(input.device())?;
        mark("decoder forward");
    }
    let mut marks = [0.0; 3];
    let mut clock = Instant::now();
    let mut lap = |i: usize, dev: &Device| -> Result<()> {
        if timed {
            sync(dev)?;
            marks[i] = clock.elapsed().as_secs_f64();
            mark(NEXT_PHASE[i]);
            clock = Instant::now();
        }
        Ok(())
    };
    let targets = input.narrow(1, 1, t - 1)?.reshape((b * (t - 1), 1))?;
    let hidden = train_hidden(model, input, packed)?
        .narrow(1, 0, t - 1)?
        .reshape((b * (t - 1), model.cfg.hidden_size))?;
    lap(0, input.device())?;
    let loss = next_token_nll(model, &hidden, &targets)?;
    lap(1, input.device())?;
    let _grads = loss.backward()?;
    lap(2, input.device())?;
    Ok(marks)
}

/// Runs the benchmark and returns the numbers (also see [`BenchReport::table`]).
pub fn run(cfg: &BenchConfig) -> Result<BenchReport> {
    // Weights drawn on the device in the training dtype: one copy of the model, trained
    // directly (the benchmark measures the step, not the optimizer's master copy).
    let (model, vars) =
        Transformer::random_init_on_device(&cfg.model, cfg.train_dtype, &cfg.device)?;
    let num_parameters = model.num_parameters();
    let (mut train_model, num_trainable_parameters) = match cfg.lora_r {
        None => (model, num_parameters),
        Some(r) => {
            let targets = vec!["all-linear".to_string()];
            let lora = LoraConfig::new(r, 2.0 * r as f64, 0.0, Some(&targets))?;
            let mut m = model.detached();
            let adapters = m.add_lora(&lora, 0)?;
            let n = adapters.all_vars().iter().map(|v| v.elem_count()).sum();
            (m, n)
        }
    };
    drop(vars);
    train_model.gradient_checkpointing = cfg.gradient_checkpointing;
    let decode_model = if cfg.decode_dtype == cfg.train_dtype {
        train_model.detached()
    } else {
        train_model.detached().to_dtype(cfg.decode_dtype)?
    };
    let vocab = cfg.model.vocab_size as u32;
    let peak_rss_before_train_mb = peak_rss_mb();
    let mut rows = Vec::new();
    for &b in &cfg.batch_sizes {
        let device_memory = DevicePeakMemory::start(&cfg.device);
        let train_tokens_per_s = if cfg.skip_train {
            None
        } else {
            let t = cfg.train_seq_len;
            let input = bench_input(b, t, vocab, &cfg.device)?;
            let step = || train_step_phases(&train_model, &input, cfg.padding_free, false);
            step()?;
            sync(&cfg.device)?;
            let start = Instant::now();
            for _ in 0..cfg.train_iters {
                step()?;
            }
            sync(&cfg.device)?;
            Some((b * t * cfg.train_iters) as f64 / start.elapsed().as_secs_f64())
        };
        let train_phase_s = if cfg.skip_train {
            None
        } else {
            let input = bench_input(b, cfg.train_seq_len, vocab, &cfg.device)?;
            Some(train_step_phases(
                &train_model,
                &input,
                cfg.padding_free,
                true,
            )?)
        };
        let peak_device_mib = device_memory.stop().filter(|_| !cfg.skip_train);
        let peak_rss_after_train_mb = peak_rss_mb();
        let decode_tokens_per_s = if cfg.skip_decode {
            None
        } else {
            Some(decode_rate(cfg, &decode_model, b, false)?)
        };
        // A graph decode that fails (a capture the device refuses) leaves the row's other
        // numbers standing: the error goes to stderr and the cell stays empty.
        let decode_graphs_tokens_per_s = if cfg.cuda_graphs && !cfg.skip_decode {
            decode_rate(cfg, &decode_model, b, true)
                .map_err(|e| eprintln!("bench: decode with CUDA graphs at batch {b} failed: {e:#}"))
                .ok()
        } else {
            None
        };
        rows.push(BenchRow {
            batch: b,
            train_tokens_per_s,
            train_phase_s,
            decode_tokens_per_s,
            decode_graphs_tokens_per_s,
            peak_device_mib,
            peak_rss_after_train_mb,
        });
    }
    Ok(BenchReport {
        num_parameters,
        num_trainable_parameters,
        train_seq_len: cfg.train_seq_len,
        padding_free: cfg.padding_free,
        device: format!("{:?}", cfg.device),
        train_dtype: cfg.train_dtype,
        decode_dtype: cfg.decode_dtype,
        prompt_len: cfg.prompt_len,
        decode_tokens: cfg.decode_tokens,
        peak_rss_before_train_mb,
        rows,
    })
}

/// Decode tokens/s at batch `b`: extra tokens over extra time between a 1-token and an
/// N-token run, so the prefill is excluded; with `cuda_graphs`, the fixed-shape steps (each
/// run captures its graphs: the capture is part of the time, as in a rollout).
fn decode_rate(
    cfg: &BenchConfig,
    decode_model: &Transformer,
    b: usize,
    cuda_graphs: bool,
) -> Result<f64> {
    let vocab = cfg.model.vocab_size as u32;
    let requests: Vec<GenerationRequest> = (0..b)
        .map(|i| GenerationRequest {
            prompt_ids: (0..cfg.prompt_len)
                .map(|j| ((i * 31 + j * 17) as u32) % vocab)
                .collect(),
            num_samples: 1,
            seed: i as u64,
        })
        .collect();
    let params = |n: usize| SamplingParams {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens: n,
        stop_token_ids: Some(vec![]),
        engine: crate::EngineConfig {
            cuda_graphs,
            ..Default::default()
        },
        ..Default::default()
    };
    generate(decode_model, &requests, &params(2))?;
    sync(&cfg.device)?;
    let t0 = Instant::now();
    generate(decode_model, &requests, &params(1))?;
    sync(&cfg.device)?;
    let t_one = t0.elapsed().as_secs_f64();
    let graphs = if cuda_graphs { ", CUDA graphs" } else { "" };
    profile_phase(&format!(
        "decode batch {b}, {} new tokens{graphs}",
        cfg.decode_tokens
    ));
    let t0 = Instant::now();
    generate(decode_model, &requests, &params(cfg.decode_tokens))?;
    sync(&cfg.device)?;
    let t_n = t0.elapsed().as_secs_f64();
    profile_phase(&format!("after decode batch {b}{graphs}"));
    Ok((b * (cfg.decode_tokens - 1)) as f64 / (t_n - t_one).max(1e-9))
}

fn dtype_name<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU shapes are written as changes to `ModelConfig::tiny_qwen2`: they keep the
    /// dimensions their docs (and BENCHMARKS.md's figures) name.
    #[test]
    fn named_cpu_shapes_keep_their_documented_dimensions() {
        let dims = |c: &ModelConfig| {
            [
                c.vocab_size,
                c.hidden_size,
                c.intermediate_size,
                c.num_hidden_layers,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.max_position_embeddings,
            ]
        };
        let shape = |name| dims(&shape_model_config(name).unwrap());
        assert_eq!(shape("small"), [512, 128, 384, 4, 4, 2, 32, 512]);
        assert_eq!(shape("h256-l4"), [2048, 256, 768, 4, 8, 2, 32, 2048]);
        assert_eq!(shape("qwen-vocab"), [151_936, 64, 160, 2, 4, 2, 16, 512]);
        let err = shape_model_config("tiny").unwrap_err().to_string();
        assert!(err.contains("\"tiny\""), "{err}");
    }
}
