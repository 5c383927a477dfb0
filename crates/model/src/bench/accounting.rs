//! What a throughput figure is put against: the FLOPs a training token costs (for MFU), the
//! card's peak, and the device memory a workload held at its peak.

use crate::config::ModelConfig;
use candle_core::Device;

/// FLOPs of one training token (forward + backward) at sequence length `seq`: 6·N for the
/// matrix products of full training, 4·N under LoRA (no weight gradients of the frozen base),
/// N excluding an untied input embedding (a lookup), plus causal attention's 6·L·H·d·T (half
/// of full attention's 12·L·H·d·T). `num_parameters` counts a tied embedding once.
pub fn train_flops_per_token(
    cfg: &ModelConfig,
    num_parameters: usize,
    seq: usize,
    lora: bool,
) -> f64 {
    let embedding = cfg.vocab_size * cfg.hidden_size;
    let matmul = if cfg.tie_word_embeddings {
        num_parameters
    } else {
        num_parameters.saturating_sub(embedding)
    };
    let per_param = if lora { 4.0 } else { 6.0 };
    let attention = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq;
    per_param * matmul as f64 + attention as f64
}

/// The card's dense bf16 peak in FLOP/s from its name (H100/H200 SXM: 989 TFLOP/s, A100:
/// 312), for MFU; `None` on the CPU or an unknown card.
pub fn peak_bf16_flops(device: &Device) -> Option<f64> {
    let name = device_name(device)?;
    if name.contains("H100") || name.contains("H200") {
        Some(989e12)
    } else if name.contains("A100") {
        Some(312e12)
    } else {
        None
    }
}

/// The CUDA device's name (`None` on the CPU).
pub fn device_name(device: &Device) -> Option<String> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => d.cuda_stream().context().name().ok(),
        _ => None,
    }
}

/// The device's used memory (all of the card's, the CUDA context included: what `nvidia-smi`
/// shows), sampled every 10 ms from a thread while it lives; `tools/bench_torch.py` measures
/// PyTorch's side the same way. Samples nothing on the CPU.
pub struct DevicePeakMemory {
    #[cfg(feature = "cuda")]
    sampler: Option<(
        std::sync::Arc<std::sync::atomic::AtomicBool>,
        std::thread::JoinHandle<f64>,
    )>,
}

impl DevicePeakMemory {
    /// Starts sampling `device` (a no-op off CUDA).
    pub fn start(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            use std::sync::atomic::{AtomicBool, Ordering};
            let ctx = d.cuda_stream().context().clone();
            let done = std::sync::Arc::new(AtomicBool::new(false));
            let stop = done.clone();
            let thread = std::thread::spawn(move || {
                let used = || {
                    ctx.mem_get_info().map_or(0.0, |(free, total)| {
                        (total - free) as f64 / (1u64 << 20) as f64
                    })
                };
                let mut peak = used();
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    peak = peak.max(used());
                }
                peak.max(used())
            });
            return DevicePeakMemory {
                sampler: Some((done, thread)),
            };
        }
        let _ = device;
        DevicePeakMemory {
            #[cfg(feature = "cuda")]
            sampler: None,
        }
    }

    /// Stops sampling: the peak in MiB (`None` off CUDA).
    pub fn stop(self) -> Option<f64> {
        #[cfg(feature = "cuda")]
        if let Some((done, thread)) = self.sampler {
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            return thread.join().ok();
        }
        None
    }
}
