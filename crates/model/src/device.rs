//! Device selection from a string (`cpu`, `cuda`, `cuda:N`).

use anyhow::{bail, Result};
use candle_core::Device;

/// `"cpu"` → CPU; `"cuda"` / `"cuda:N"` → that GPU (only when built with the `cuda`
/// feature; otherwise a clear error).
pub fn device_from_str(spec: &str) -> Result<Device> {
    let spec = spec.trim();
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = if spec == "cuda" {
        Some(0)
    } else if let Some(n) = spec.strip_prefix("cuda:") {
        match n.parse::<usize>() {
            Ok(i) => Some(i),
            Err(_) => bail!("bad device `{spec}`: expected cuda:<ordinal>"),
        }
    } else {
        None
    };
    match ordinal {
        None => bail!("unknown device `{spec}` (expected `cpu`, `cuda` or `cuda:N`)"),
        Some(i) => cuda_device(spec, i),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(spec: &str, i: usize) -> Result<Device> {
    use anyhow::Context;
    Device::new_cuda(i).with_context(|| format!("opening device `{spec}`"))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(spec: &str, _i: usize) -> Result<Device> {
    bail!("device `{spec}` needs a build with the `cuda` feature (cargo build --features cuda)")
}
