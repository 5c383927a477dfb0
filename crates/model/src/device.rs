//! Device selection from a string (`cpu`, `cuda`, `cuda:N`).
//!
//! Every `cuda:N` of the process is one [`Device`] with one CUDA stream. candle's own
//! `Device::new_cuda` runs each host thread's work on that thread's per-thread default stream,
//! and nothing orders those streams against each other: a tensor written on the trainer's
//! thread (the weights a generator thread samples with, an optimizer update before the next
//! rollout's sampler thread) could be read on another thread's stream before the write
//! finished, and a buffer freed on one stream could be reused while another stream still read
//! it. With one stream per GPU every kernel of the process runs in the order it was issued,
//! whichever thread issued it.

use anyhow::{bail, Result};
use candle_core::Device;

/// `"cpu"` → CPU; `"cuda"` / `"cuda:N"` → that GPU (only when built with the `cuda`
/// feature; otherwise a clear error). The same `cuda:N` always gives the same device (one
/// stream), however many times and from whichever thread it is asked for.
pub fn device_from_str(spec: &str) -> Result<Device> {
    match cuda_ordinal(spec)? {
        None => Ok(Device::Cpu),
        Some(i) => cuda_device(spec.trim(), i),
    }
}

/// Checks `spec` as [`device_from_str`] would, without opening the device: the same errors
/// for a malformed spec or a CUDA device in a build without the `cuda` feature.
pub fn check_device_spec(spec: &str) -> Result<()> {
    if cuda_ordinal(spec)?.is_some() && !cfg!(feature = "cuda") {
        bail!(
            "device `{}` needs a build with the `cuda` feature (cargo build --features cuda)",
            spec.trim()
        );
    }
    Ok(())
}

/// `None` for the CPU, the ordinal for `cuda` / `cuda:N`.
fn cuda_ordinal(spec: &str) -> Result<Option<usize>> {
    let spec = spec.trim();
    if spec == "cpu" {
        return Ok(None);
    }
    if spec == "cuda" {
        return Ok(Some(0));
    }
    match spec.strip_prefix("cuda:").map(str::parse::<usize>) {
        Some(Ok(i)) => Ok(Some(i)),
        Some(Err(_)) => bail!("bad device `{spec}`: expected cuda:<ordinal>"),
        None => bail!("unknown device `{spec}` (expected `cpu`, `cuda` or `cuda:N`)"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(spec: &str, i: usize) -> Result<Device> {
    use anyhow::Context;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    /// Set to `1` to keep cudarc's per-tensor CUDA event tracking (a diagnostic: it orders
    /// tensors across streams, which one stream per device does not need).
    const EVENT_TRACKING_ENV: &str = "COMPOSER_CUDA_EVENT_TRACKING";
    static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    let mut devices = DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(d) = devices.get(&i) {
        return Ok(d.clone());
    }
    let cuda = candle_core::CudaDevice::new_with_stream(i)
        .with_context(|| format!("opening device `{spec}`"))?;
    if std::env::var(EVENT_TRACKING_ENV).as_deref() != Ok("1") {
        // An explicit stream puts cudarc in multi-stream mode, where every allocation creates
        // two CUDA events and every kernel argument waits on and records one — host work per
        // op that a single stream does not need: all of this device's tensors are created,
        // used and freed on its one stream, in issue order.
        // SAFETY: no tensor of this device is ever used on another stream (candle runs every
        // op of a `CudaDevice` on its own stream, and this is the only one made for it).
        unsafe { cuda.disable_event_tracking() };
    }
    let device = Device::Cuda(cuda);
    devices.insert(i, device.clone());
    Ok(device)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(spec: &str, _i: usize) -> Result<Device> {
    bail!("device `{spec}` needs a build with the `cuda` feature (cargo build --features cuda)")
}
