//! The skinny decode product's CUDA side ([`super::decode_product`],
//! [`super::decode_qkv_into_cache`]): when the kernel serves a product (its plan and the
//! inputs' dtype, device, alignment and storages), and the candle ops that launch it
//! (`decode_cuda.rs` holds the launchers).

use super::{skinny_plan, skinny_settings, DecodeEpilogue, SkinnyPlan, SplitCounters};
use super::{InputNorm, KvSlots, QkvHeads};
use anyhow::Result;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp2, DType, InplaceOp1, Layout, Shape, Storage, Tensor};
use std::sync::Mutex;

/// The plan of the skinny product of contiguous `x` `[rows, k]` and `w` `[out, k]` with
/// `epilogue`, where the kernel serves it: both bf16 on the counters' device, counters for
/// every tile, both starting 16-byte aligned (a CUDA storage is a whole allocation,
/// 256-byte aligned; a view starts `start_offset` elements into it, and `k` % 8 == 0 keeps
/// every row aligned for the kernel's 16-byte copies). `None`: cuBLAS instead.
pub(super) fn plan_for(
    x: &Tensor,
    w: &Tensor,
    out: usize,
    epilogue: DecodeEpilogue,
    counters: &SplitCounters,
) -> Result<Option<SkinnyPlan>> {
    let (rows, k) = x.dims2()?;
    let Some(plan) = skinny_plan(rows, out, k, epilogue, skinny_settings().1) else {
        return Ok(None);
    };
    let serves = plan.tiles <= counters.0.dim(0)?
        && [x, w].iter().all(|t| {
            t.dtype() == DType::BF16
                && t.device().same_device(counters.0.device())
                && t.layout().start_offset().is_multiple_of(8)
        });
    Ok(serves.then_some(plan))
}

/// What a skinny launch reads besides x and w: the input norm's weight (contiguous) and
/// eps, the residual (contiguous).
pub(super) struct Fused {
    norm: Option<(Tensor, f64)>,
    residual: Option<Tensor>,
}

impl Fused {
    /// Where the kernel serves them — bf16 on the device of `x` and `w`, the norm's weight
    /// 16-byte aligned (read 8 at a time), neither sharing a storage with `x` or `w` (the
    /// launch holds those) — `norm` and `residual` made contiguous; `None`: the caller
    /// takes the separate ops.
    pub(super) fn of(
        norm: Option<InputNorm>,
        residual: Option<&Tensor>,
        (x, w): (&Tensor, &Tensor),
    ) -> Result<Option<Fused>> {
        let norm = norm
            .map(|n| Ok::<_, anyhow::Error>((n.weight.contiguous()?, n.eps)))
            .transpose()?;
        let residual = residual.map(Tensor::contiguous).transpose()?;
        let fused = Fused { norm, residual };
        let storage = |t: &Tensor| -> *const Storage { &*t.storage_and_layout().0 };
        let (xs, ws) = (storage(x), storage(w));
        let serves = fused.tensors().all(|t| {
            t.dtype() == DType::BF16
                && t.device().same_device(x.device())
                && !std::ptr::eq(storage(t), xs)
                && !std::ptr::eq(storage(t), ws)
        }) && fused
            .norm
            .as_ref()
            .is_none_or(|(nw, _)| nw.layout().start_offset().is_multiple_of(8));
        Ok(serves.then_some(fused))
    }

    /// The tensors, to check against an in-place op's storage.
    fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.norm.iter().map(|(w, _)| w).chain(&self.residual)
    }
}

impl Fused {
    /// `launch` with the norm weight's storage and eps and the residual's storage, under
    /// read guards held across it (`what` names the op in an error).
    fn with_storages<R>(
        &self,
        what: &str,
        launch: impl FnOnce(
            crate::ops::decode_cuda::NormArg,
            Option<(&candle_core::CudaStorage, &Layout)>,
        ) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let norm_g = self
            .norm
            .as_ref()
            .map(|(w, eps)| (w.storage_and_layout(), eps));
        let norm = match &norm_g {
            Some(((g, l), eps)) => Some((cuda_storage(g, what)?, *l, **eps as f32)),
            None => None,
        };
        let residual_g = self.residual.as_ref().map(|r| r.storage_and_layout());
        let residual = match &residual_g {
            Some((g, l)) => Some((cuda_storage(g, what)?, *l)),
            None => None,
        };
        launch(norm, residual)
    }
}

/// The CUDA storage under a read guard (`what` names the op in the error).
fn cuda_storage<'s>(
    s: &'s Storage,
    what: &str,
) -> candle_core::Result<&'s candle_core::CudaStorage> {
    match s {
        Storage::Cuda(s) => Ok(s),
        _ => candle_core::bail!("{what}: an input is not on the CUDA device"),
    }
}

/// [`super::decode_qkv_into_cache`] on the kernel: q, or `None` where the kernel does not
/// serve (the caller then runs the three ops). The caller checked every slot.
#[allow(clippy::too_many_arguments)]
pub(super) fn qkv_on_kernel(
    (x, norm, w): (&Tensor, Option<InputNorm>, &Tensor),
    bias: Option<&Tensor>,
    (cos, sin): (&Tensor, &Tensor),
    heads: QkvHeads,
    pool: &Tensor,
    slots: &KvSlots,
    counters: &SplitCounters,
) -> Result<Option<Tensor>> {
    let (rows, k) = x.dims2()?;
    let QkvHeads {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
    } = heads;
    let width = heads.packed_width();
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let Some(plan) = plan_for(&x, &w, width, DecodeEpilogue::Product, counters)? else {
        return Ok(None);
    };
    let Some(fused) = Fused::of(norm, None, (&x, &w))? else {
        return Ok(None);
    };
    let (two, slot_count, pool_kv, pool_d) = pool.dims4()?;
    // What the op reads besides x, w and the counters (plan_for checked those).
    let mut others = vec![cos, sin, slots.on_device()];
    others.extend(bias);
    others.extend(fused.tensors());
    let serves = super::qkv_head_dim_served(d)
        && (two, pool_kv, pool_d) == (2, nkv, d)
        && slots.len() == rows
        && cos.dims() == [rows, d / 2]
        && sin.dims() == [rows, d / 2]
        && bias.is_none_or(|b| b.dims() == [width])
        && pool.is_contiguous()
        && [cos, sin, pool]
            .into_iter()
            .chain(bias)
            .all(|t| t.dtype() == DType::BF16)
        && slots.on_device().dtype() == DType::U32
        && others
            .iter()
            .chain([&pool])
            .all(|t| t.device().same_device(x.device()));
    if !serves {
        return Ok(None);
    }
    // The op holds the pool's write lock while it reads the others: one of them sharing the
    // pool's storage would wait on itself.
    let pool_storage: *const Storage = &*pool.storage_and_layout().0;
    let shares = [&x, &w, &counters.0]
        .into_iter()
        .chain(others)
        .any(|t| std::ptr::eq(&*t.storage_and_layout().0, pool_storage));
    if shares {
        anyhow::bail!("decode q/k/v: an input shares the KV pool's storage");
    }
    let bias = bias.map(Tensor::contiguous).transpose()?;
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let slots = slots.on_device().contiguous()?;
    let op = QkvIntoCache {
        plan,
        x: &x,
        w: &w,
        bias: bias.as_ref(),
        cos: &cos,
        sin: &sin,
        slots: &slots,
        counters: &counters.0,
        fused: &fused,
        dims: (rows, k, nh, nkv, d, slot_count),
        q: Mutex::new(None),
    };
    pool.inplace_op1(&op)?;
    let q =
        op.q.lock()
            .map_err(|_| anyhow::anyhow!("decode q/k/v: poisoned"))?
            .take();
    let Some(q) = q else {
        anyhow::bail!("decode q/k/v: the kernel gave no q")
    };
    let q = Tensor::from_storage(Storage::Cuda(q), (rows, nh, d), BackpropOp::none(), false);
    Ok(Some(q))
}

/// The q/k/v kernel as an in-place op on the pool (the keys and values written into it);
/// q, the op's other output, comes back through `q`.
struct QkvIntoCache<'a> {
    plan: SkinnyPlan,
    x: &'a Tensor,
    w: &'a Tensor,
    bias: Option<&'a Tensor>,
    cos: &'a Tensor,
    sin: &'a Tensor,
    slots: &'a Tensor,
    counters: &'a Tensor,
    fused: &'a Fused,
    /// rows, in, heads, kv heads, head_dim, the pool's slots.
    dims: (usize, usize, usize, usize, usize, usize),
    q: Mutex<Option<candle_core::CudaStorage>>,
}

impl InplaceOp1 for QkvIntoCache<'_> {
    fn name(&self) -> &'static str {
        "skinny-qkv"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!(
            "skinny q/k/v: a CUDA kernel (decode_qkv_into_cache takes the three ops on the CPU)"
        )
    }

    fn cuda_fwd(
        &self,
        pool: &mut candle_core::CudaStorage,
        lp: &Layout,
    ) -> candle_core::Result<()> {
        fn cuda(s: &Storage) -> candle_core::Result<&candle_core::CudaStorage> {
            cuda_storage(s, "skinny q/k/v")
        }
        let (xg, xl) = self.x.storage_and_layout();
        let (wg, wl) = self.w.storage_and_layout();
        let (cg, cl) = self.counters.storage_and_layout();
        let (cos_g, cos_l) = self.cos.storage_and_layout();
        let (sin_g, sin_l) = self.sin.storage_and_layout();
        let (sg, sl) = self.slots.storage_and_layout();
        let bias_g = self.bias.map(|b| b.storage_and_layout());
        let bias = match &bias_g {
            Some((g, l)) => Some((cuda(g)?, *l)),
            None => None,
        };
        let (rows, k, nh, nkv, d, slot_count) = self.dims;
        let q = self.fused.with_storages("skinny q/k/v", |norm, _| {
            crate::ops::decode_cuda::skinny_qkv(
                (cuda(&xg)?, xl),
                (cuda(&wg)?, wl),
                (cuda(&cg)?, cl),
                &self.plan,
                norm,
                bias,
                ((cuda(&cos_g)?, cos_l), (cuda(&sin_g)?, sin_l)),
                (pool, lp),
                (cuda(&sg)?, sl),
                (rows, k),
                (nh, nkv, d, slot_count),
            )
        })?;
        *self
            .q
            .lock()
            .map_err(|_| candle_core::Error::Msg("skinny q/k/v: poisoned".into()))? = Some(q);
        Ok(())
    }
}

/// The kernel as a candle op over `(x, w)`, both contiguous bf16 on one CUDA device, with
/// [`plan_for`]'s plan.
pub(super) struct SkinnyProduct<'a> {
    pub(super) plan: SkinnyPlan,
    pub(super) epilogue: DecodeEpilogue,
    pub(super) counters: &'a Tensor,
    pub(super) fused: Fused,
}

impl CustomOp2 for SkinnyProduct<'_> {
    fn name(&self) -> &'static str {
        "skinny-product"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("skinny product: a CUDA kernel (decode_product takes linear on the CPU)")
    }

    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, k) = lx.shape().dims2()?;
        let (out, _) = lw.shape().dims2()?;
        let (cg, cl) = self.counters.storage_and_layout();
        let counters = (cuda_storage(&cg, "skinny product")?, cl);
        let swiglu = self.epilogue == DecodeEpilogue::Swiglu;
        let y = self
            .fused
            .with_storages("skinny product", |norm, residual| {
                crate::ops::decode_cuda::skinny_product(
                    (x, lx),
                    (w, lw),
                    counters,
                    &self.plan,
                    norm,
                    residual,
                    swiglu,
                    (rows, out, k),
                )
            })?;
        let cols = match self.epilogue {
            DecodeEpilogue::Product => out,
            DecodeEpilogue::Swiglu => out / 2,
        };
        Ok((y, Shape::from((rows, cols))))
    }
}
