//! Datasheet numbers of the accelerators and the architectures of known model sizes: the
//! constants every wall formula reads.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Accelerator kind with the datasheet numbers the estimator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuKind {
    /// NVIDIA H100 SXM5 80 GB.
    H100,
    /// NVIDIA H200 SXM 141 GB.
    H200,
    /// NVIDIA A100 SXM4 80 GB.
    A100,
    /// NVIDIA L40S 48 GB (PCIe, no NVLink).
    L40s,
    /// A CPU server (rough numbers; for smoke runs).
    Cpu,
}

/// Hardware numbers of one device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuSpec {
    /// Memory bandwidth (bytes/s).
    pub hbm_bytes_per_s: f64,
    /// Dense bf16 peak (FLOP/s), without sparsity.
    pub bf16_flops: f64,
    /// Device memory (bytes).
    pub memory_bytes: f64,
    /// Intra-node link bandwidth per direction (bytes/s): NVLink, or PCIe where there is none.
    pub link_bytes_per_s: f64,
    /// Inter-node network bandwidth per device (bytes/s).
    pub network_bytes_per_s: f64,
}

impl GpuKind {
    /// Datasheet numbers. Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: 3.35 TB/s
    /// HBM3, 989 TFLOP/s dense BF16 (1979 with sparsity), 80 GB, NVLink 900 GB/s
    /// bidirectional → 450 GB/s per direction); NVIDIA H200 datasheet (4.8 TB/s HBM3e, 141 GB,
    /// same compute and NVLink as H100); NVIDIA A100 datasheet (SXM4 80 GB: 2.039 TB/s, 312
    /// TFLOP/s BF16, NVLink 600 GB/s → 300 per direction); NVIDIA L40S datasheet (864 GB/s
    /// GDDR6, 362 TFLOP/s dense BF16, 48 GB, PCIe Gen4 x16 64 GB/s → 32 per direction).
    /// Network: 400 Gb/s (50 GB/s) NDR InfiniBand per H100/H200, 200 Gb/s (25 GB/s) HDR per
    /// A100/L40S. CPU: an assumed 16-core AVX-512 server socket (≈100 GB/s sustained DRAM,
    /// ≈2 TFLOP/s, 128 GB, 10 GB/s memcpy, 10 GbE) — order-of-magnitude only.
    pub fn spec(self) -> GpuSpec {
        match self {
            GpuKind::H100 => GpuSpec {
                hbm_bytes_per_s: 3.35e12,
                bf16_flops: 989e12,
                memory_bytes: 80e9,
                link_bytes_per_s: 450e9,
                network_bytes_per_s: 50e9,
            },
            GpuKind::H200 => GpuSpec {
                hbm_bytes_per_s: 4.8e12,
                bf16_flops: 989e12,
                memory_bytes: 141e9,
                link_bytes_per_s: 450e9,
                network_bytes_per_s: 50e9,
            },
            GpuKind::A100 => GpuSpec {
                hbm_bytes_per_s: 2.039e12,
                bf16_flops: 312e12,
                memory_bytes: 80e9,
                link_bytes_per_s: 300e9,
                network_bytes_per_s: 25e9,
            },
            GpuKind::L40s => GpuSpec {
                hbm_bytes_per_s: 864e9,
                bf16_flops: 362e12,
                memory_bytes: 48e9,
                link_bytes_per_s: 32e9,
                network_bytes_per_s: 25e9,
            },
            GpuKind::Cpu => GpuSpec {
                hbm_bytes_per_s: 100e9,
                bf16_flops: 2e12,
                memory_bytes: 128e9,
                link_bytes_per_s: 10e9,
                network_bytes_per_s: 1.25e9,
            },
        }
    }

    /// Parses `h100`, `h200`, `a100`, `l40s`, `cpu` (case-insensitive).
    pub fn parse(name: &str) -> Result<GpuKind> {
        Ok(match name.trim().to_ascii_lowercase().as_str() {
            "h100" => GpuKind::H100,
            "h200" => GpuKind::H200,
            "a100" => GpuKind::A100,
            "l40s" => GpuKind::L40s,
            "cpu" => GpuKind::Cpu,
            other => bail!("unknown --gpu {other:?}: expected one of h100, h200, a100, l40s, cpu"),
        })
    }

    /// Lower-case name, as parsed.
    pub fn name(self) -> &'static str {
        match self {
            GpuKind::H100 => "h100",
            GpuKind::H200 => "h200",
            GpuKind::A100 => "a100",
            GpuKind::L40s => "l40s",
            GpuKind::Cpu => "cpu",
        }
    }
}

/// The shape of the transformer, for KV-cache bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelArch {
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Key/value heads (GQA).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

/// Qwen2.5 family configs (config.json of Qwen/Qwen2.5-{0.5,1.5,3,7,14,32,72}B): parameter
/// count, layers, hidden, kv heads, head dim.
const QWEN25_ARCHS: [(f64, usize, usize, usize, usize); 7] = [
    (0.49e9, 24, 896, 2, 64),
    (1.54e9, 28, 1536, 2, 128),
    (3.09e9, 36, 2048, 2, 128),
    (7.62e9, 28, 3584, 4, 128),
    (14.7e9, 48, 5120, 8, 128),
    (32.8e9, 64, 5120, 8, 128),
    (72.7e9, 80, 8192, 8, 128),
];

impl ModelArch {
    /// The Qwen2.5 config whose parameter count is nearest to `params` (in log scale).
    pub fn for_params(params: f64) -> ModelArch {
        let target = params.max(1.0).ln();
        let best = QWEN25_ARCHS
            .iter()
            .min_by(|a, b| {
                (a.0.ln() - target)
                    .abs()
                    .total_cmp(&(b.0.ln() - target).abs())
            })
            .copied()
            .unwrap_or(QWEN25_ARCHS[3]);
        ModelArch {
            layers: best.1,
            hidden: best.2,
            kv_heads: best.3,
            head_dim: best.4,
        }
    }

    /// KV-cache bytes per token in bf16: K and V (2) · layers · kv_heads · head_dim · 2 bytes.
    pub fn kv_bytes_per_token(&self) -> f64 {
        (2 * self.layers * self.kv_heads * self.head_dim * 2) as f64
    }
}
