//! The decode step's new keys and values written into their KV-cache slots in place: one
//! launch for both pools (a layer's key and value pools are the two halves of one tensor),
//! where two scatters took two, each with a `[rows, kv_heads·head_dim]` index.

use super::kernels_apply;
use anyhow::{bail, Result};
use candle_core::{CpuStorage, Device, InplaceOp3, Layout, Tensor, WithDType};

/// The cache slots a forward writes, row by row: on the host (checked against the pool before
/// any write) and on the device (read by the kernel), both from one list.
#[derive(Debug)]
pub struct KvSlots {
    host: Vec<u32>,
    device: Tensor,
}

impl KvSlots {
    /// `slots[r]` is row `r`'s slot; the device copy goes to `device`.
    pub fn new(slots: Vec<u32>, device: &Device) -> Result<Self> {
        let on_device = Tensor::new(slots.as_slice(), device)?;
        Ok(KvSlots {
            host: slots,
            device: on_device,
        })
    }

    /// `slots[r]` is row `r`'s slot, already on the device in `device` (u32 `[rows]`, e.g. a
    /// view of a buffer a CUDA graph reads): the host list is what the write is checked
    /// against, the device tensor what the kernel reads, so the caller keeps them equal.
    pub fn with_device(slots: Vec<u32>, device: Tensor) -> Result<Self> {
        if device.dims() != [slots.len()] || device.dtype() != candle_core::DType::U32 {
            bail!(
                "kv slots: {} host slots but a {:?} {:?} device tensor",
                slots.len(),
                device.dtype(),
                device.dims()
            );
        }
        Ok(KvSlots {
            host: slots,
            device,
        })
    }
}

impl KvSlots {
    /// Rows, one slot each.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// An error naming the first slot outside a pool of `slot_count` slots (`what` names the
    /// op), before anything is written.
    pub(super) fn check(&self, slot_count: usize, what: &str) -> Result<()> {
        match self.host.iter().find(|&&s| s as usize >= slot_count) {
            Some(s) => bail!("{what}: slot {s} is outside the pool's {slot_count}"),
            None => Ok(()),
        }
    }

    /// The slots on the device (u32 `[rows]`).
    pub(super) fn on_device(&self) -> &Tensor {
        &self.device
    }
}

/// Writes `kv` `[2, rows, kv_heads, head_dim]` (the step's keys, then its values) into the
/// slots `slots` of `pool` `[2, slots, kv_heads, head_dim]` (the keys' pool, then the values'),
/// in place. The kernel (CPU f32/f64, CUDA f32/bf16) where it applies; else one scatter per
/// half.
pub fn write_kv_slots(pool: &Tensor, kv: &Tensor, kv_slots: &KvSlots) -> Result<()> {
    let slots = kv_slots.on_device();
    let (two, slot_count, hkv, d) = pool.dims4()?;
    let rows = kv_slots.len();
    if two != 2 || kv.dims() != [2, rows, hkv, d] {
        bail!(
            "kv write: pool {:?} and keys/values {:?} disagree (expected [2, slots, kv_heads, head_dim] and [2, {rows}, kv_heads, head_dim])",
            pool.dims(),
            kv.dims()
        );
    }
    kv_slots.check(slot_count, "kv write")?;
    let devices = [kv.device(), slots.device()];
    if kv.dtype() != pool.dtype() || !devices.iter().all(|d| d.same_device(pool.device())) {
        bail!(
            "kv write: keys/values are {:?} on {:?}, the slots on {:?}, the pool {:?} on {:?}",
            kv.dtype(),
            kv.device(),
            slots.device(),
            pool.dtype(),
            pool.device()
        );
    }
    if rows == 0 {
        return Ok(());
    }
    let width = hkv * d;
    if kernels_apply(pool) && pool.is_contiguous() {
        let op = KvWriteOp {
            rows,
            slot_count,
            width,
        };
        pool.inplace_op3(&kv.contiguous()?, &slots.contiguous()?, &op)?;
        return Ok(());
    }
    let index = slots
        .reshape((rows, 1))?
        .broadcast_as((rows, width))?
        .contiguous()?;
    for part in 0..2 {
        // A reshape of the contiguous half shares its storage: the scatter writes in place.
        let half = pool.get(part)?.reshape((slot_count, width))?;
        half.scatter_set(
            &index,
            &kv.get(part)?.reshape((rows, width))?.contiguous()?,
            0,
        )?;
    }
    Ok(())
}

struct KvWriteOp {
    rows: usize,
    slot_count: usize,
    width: usize,
}

/// The CPU twin of the CUDA kernel: row `r` of each half of `kv` into slot `slots[r]` of the
/// same half of `pool`.
fn write<T: Copy>(pool: &mut [T], kv: &[T], slots: &[u32], slot_count: usize, width: usize) {
    let rows = slots.len();
    for part in 0..2 {
        for (r, &s) in slots.iter().enumerate() {
            let src = (part * rows + r) * width;
            let dst = (part * slot_count + s as usize) * width;
            pool[dst..dst + width].copy_from_slice(&kv[src..src + width]);
        }
    }
}

impl KvWriteOp {
    fn cpu_typed<T: WithDType>(
        &self,
        pool: &mut [T],
        kv: (&CpuStorage, &Layout),
        slots: (&CpuStorage, &Layout),
    ) -> candle_core::Result<()> {
        let kv = super::layout_slice::<T>(kv.0, kv.1, "kv write")?;
        let slots = super::layout_slice::<u32>(slots.0, slots.1, "kv write slots")?;
        if slots.len() != self.rows {
            candle_core::bail!("kv write: {} slots for {} rows", slots.len(), self.rows)
        }
        write(pool, kv, slots, self.slot_count, self.width);
        Ok(())
    }
}

impl InplaceOp3 for KvWriteOp {
    fn name(&self) -> &'static str {
        "kv-write"
    }

    fn cpu_fwd(
        &self,
        pool: &mut CpuStorage,
        lp: &Layout,
        kv: &CpuStorage,
        lk: &Layout,
        slots: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        let Some((a, b)) = lp.contiguous_offsets() else {
            candle_core::bail!("kv write: the pool must be contiguous")
        };
        match pool {
            CpuStorage::F32(p) => self.cpu_typed(&mut p[a..b], (kv, lk), (slots, ls)),
            CpuStorage::F64(p) => self.cpu_typed(&mut p[a..b], (kv, lk), (slots, ls)),
            _ => candle_core::bail!("kv write kernel: f32 or f64 on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        pool: &mut candle_core::CudaStorage,
        lp: &Layout,
        kv: &candle_core::CudaStorage,
        lk: &Layout,
        slots: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        super::decode_cuda::kv_write(
            (pool, lp),
            (kv, lk),
            (slots, ls),
            (self.rows, self.slot_count, self.width),
        )
    }
}
