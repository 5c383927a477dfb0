//! Launchers of the CUDA kernels in `kernels.cu` (built to PTX by build.rs) for contiguous f32
//! and bf16 storages. The ops' `cuda_fwd` and their backward ops call these; their CPU twins
//! are the same ops' `cpu_fwd`, and `tests/ops/` (`COMPOSER_TEST_DEVICE=cuda`) compares the two
//! on a GPU. The varlen attention's launchers are in `attention_cuda.rs`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/ops.ptx"));
pub(super) const MODULE: &str = "composer_model_ops";

/// Dispatches `$body` with the type alias `$t` bound to the element type of `$dtype`.
macro_rules! typed {
    ($dtype:expr, $what:expr, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            other => candle_core::bail!(
                "{}: the CUDA kernel handles f32 and bf16, got {other:?}",
                $what
            ),
        }
    };
}
pub(super) use typed;

/// The kernel's exported name for `dtype` (`name_f32`, `name_bf16`).
pub(super) fn kernel_name(name: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 => Ok(format!("{name}_f32")),
        DType::BF16 => Ok(format!("{name}_bf16")),
        other => candle_core::bail!("{name}: the CUDA kernel handles f32 and bf16, got {other:?}"),
    }
}

/// The contiguous elements of `s` under `l` as a typed view.
pub(super) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{what}: expected a contiguous tensor")
    };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// Shared memory a block gets without opting in.
const DEFAULT_SHARED_BYTES: usize = 48 * 1024;

/// Launches `b` (a builder of `f`) with `cfg`, first opting `f` in to `cfg`'s shared memory
/// when it is past the 48 KiB a kernel gets by default; `what` names the op in the error.
///
/// # Safety
/// As `LaunchArgs::launch`: the arguments pushed match the kernel's signature.
pub(super) unsafe fn launch_opted_in(
    f: &impl std::ops::Deref<Target = CudaFunction>,
    b: &mut LaunchArgs<'_>,
    cfg: LaunchConfig,
    what: &str,
) -> Result<()> {
    if cfg.shared_mem_bytes as usize > DEFAULT_SHARED_BYTES {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            cfg.shared_mem_bytes as i32,
        )
        .map_err(|e| {
            candle_core::Error::Msg(format!(
                "{what}: the GPU refused {} bytes of shared memory for a block: {e}",
                cfg.shared_mem_bytes
            ))
        })?;
    }
    // SAFETY: the caller's.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

pub(super) fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every element is written by the kernel launched next.
    unsafe { dev.alloc::<T>(n.max(1)) }
}

/// Threads per block of a row kernel over rows of `d` elements.
fn row_threads(d: usize) -> u32 {
    match d {
        0..=256 => (d.div_ceil(32) * 32).max(32) as u32,
        257..=4096 => 256,
        _ => 512,
    }
}

/// One block per row.
pub(super) fn rows_config(rows: usize, d: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (row_threads(d), 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride element-wise launch over `n` elements.
pub(super) fn elementwise_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The CUDA storages and layouts behind tensors' storage guards (`Tensor::storage_and_layout`).
fn cuda_parts<'g, G: std::ops::Deref<Target = Storage>>(
    guards: &'g [(G, &'g Layout)],
    what: &str,
) -> Result<Vec<(&'g CudaStorage, &'g Layout)>> {
    guards
        .iter()
        .map(|(g, l)| match &**g {
            Storage::Cuda(s) => Ok((s, *l)),
            _ => candle_core::bail!("{what}: the CUDA kernel got a non-CUDA tensor"),
        })
        .collect()
}

/// Runs a launcher on the CUDA storages of `inputs` (made contiguous) and wraps its output as
/// a tensor of `shape` without a gradient graph (backward passes need none).
pub(super) fn on_tensors(
    inputs: &[&Tensor],
    shape: Shape,
    what: &str,
    f: impl FnOnce(&[(&CudaStorage, &Layout)]) -> Result<CudaStorage>,
) -> Result<Tensor> {
    let owned: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<_>>()?;
    let guards: Vec<_> = owned.iter().map(|t| t.storage_and_layout()).collect();
    let out = f(&cuda_parts(&guards, what)?)?;
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        shape,
        BackpropOp::none(),
        false,
    ))
}

/// Launches the row kernel `name` (one block per row of `d` elements) as
/// `name(inputs.., out, rows, d, eps)`, `out` a fresh buffer of `out_rows · d` elements in the
/// inputs' dtype: the shape of the RMSNorm kernels.
fn launch_norm_rows(
    name: &str,
    inputs: &[(&CudaStorage, &Layout)],
    out_rows: usize,
    rows: usize,
    d: usize,
    eps: f64,
) -> Result<CudaStorage> {
    let dev = inputs[0].0.device().clone();
    let dtype = inputs[0].0.dtype();
    let (rows_i, d_i, eps_f) = (rows as i32, d as i32, eps as f32);
    typed!(dtype, name, |T| {
        let views = inputs
            .iter()
            .map(|(s, l)| view::<T>(s, l, name))
            .collect::<Result<Vec<_>>>()?;
        let out = alloc::<T>(&dev, out_rows * d)?;
        let f = dev.get_or_load_custom_func(&kernel_name(name, dtype)?, MODULE, PTX)?;
        let mut b = f.builder();
        for v in &views {
            b.arg(v);
        }
        b.arg(&out).arg(&rows_i).arg(&d_i).arg(&eps_f);
        // SAFETY: the norm kernels take (inputs.., out, rows, d, eps); `out` holds what they
        // write.
        unsafe { b.launch(rows_config(rows, d)) }.w()?;
        Ok(T::wrap_cuda_slice(out, dev))
    })
}

/// RMSNorm forward of `x` `[rows, d]` with `w` `[d]`.
pub(crate) fn rms_norm_fwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    eps: f64,
) -> Result<CudaStorage> {
    let d = w.1.shape().elem_count();
    let rows = x.1.shape().elem_count() / d.max(1);
    launch_norm_rows("rms_norm_fwd", &[x, w], rows, rows, d, eps)
}

/// `[x + δ | RMSNorm(x + δ)·w]` into one buffer of `2·rows·d` (the decode's fused residual add).
pub(crate) fn add_rms_norm_fwd(
    x: (&CudaStorage, &Layout),
    delta: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    eps: f64,
) -> Result<CudaStorage> {
    let d = w.1.shape().elem_count();
    let rows = x.1.shape().elem_count() / d.max(1);
    launch_norm_rows("add_rms_norm_fwd", &[x, delta, w], 2 * rows, rows, d, eps)
}

/// RMSNorm backward: `(∂x, ∂w)` in one pass over `x` and `∂y` (`rms_norm_bwd`: a warp a row,
/// ∂w's column sums per warp in shared memory, per block in `partial`), then ∂w summed over the
/// blocks in block order (`rms_norm_bwd_dw_sum`): deterministic, no atomics.
pub(crate) fn rms_norm_bwd(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let dtype = x.dtype();
    let d = w.elem_count();
    let rows = x.elem_count() / d.max(1);
    let max_d = super::rms_norm::CUDA_BWD_MAX_D;
    if d == 0 || d > max_d {
        candle_core::bail!("rms_norm backward: {d} columns (the CUDA kernel takes 1..={max_d})")
    }
    let warps = (max_d / d).clamp(1, 8);
    // About 4,096 elements a warp, at most 1,024 blocks of partial sums; the grid depends on
    // the shape only, so ∂w's summation order is the same on every card.
    let blocks = (rows * d)
        .div_ceil(4096 * warps)
        .clamp(1, 1024)
        .min(rows.div_ceil(warps).max(1));
    let (rows_i, d_i, blocks_i, eps_f) = (rows as i32, d as i32, blocks as i32, eps as f32);
    // ∂w in its own buffer: a narrow of ∂x's would keep ∂x alive as long as the gradient.
    let mut dw_storage = None;
    let dx = on_tensors(&[x, w, dy], x.shape().clone(), "rms_norm backward", |a| {
        let dev = a[0].0.device().clone();
        typed!(dtype, "rms_norm backward", |T| {
            let xv = view::<T>(a[0].0, a[0].1, "rms_norm")?;
            let wv = view::<T>(a[1].0, a[1].1, "rms_norm")?;
            let gv = view::<T>(a[2].0, a[2].1, "rms_norm")?;
            let dx = alloc::<T>(&dev, rows * d)?;
            let dw = alloc::<T>(&dev, d)?;
            let partial = alloc::<f32>(&dev, blocks * d)?;
            let f =
                dev.get_or_load_custom_func(&kernel_name("rms_norm_bwd", dtype)?, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&xv).arg(&wv).arg(&gv).arg(&dx).arg(&partial);
            b.arg(&rows_i).arg(&d_i).arg(&eps_f);
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (32 * warps as u32, 1, 1),
                shared_mem_bytes: (warps * d * 4) as u32,
            };
            // SAFETY: (x, w, dy, dx, partial, rows, d, eps) as the kernel takes them; a warp's
            // d floats of shared memory each; `partial` holds blocks·d floats.
            unsafe { b.launch(cfg) }.w()?;
            let f = dev.get_or_load_custom_func(
                &kernel_name("rms_norm_bwd_dw_sum", dtype)?,
                MODULE,
                PTX,
            )?;
            let mut b = f.builder();
            b.arg(&partial).arg(&dw).arg(&blocks_i).arg(&d_i);
            let cfg = LaunchConfig {
                grid_dim: (d.div_ceil(32) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (partial, dw, blocks, d) as the kernel takes them.
            unsafe { b.launch(cfg) }.w()?;
            dw_storage = Some(T::wrap_cuda_slice(dw, dev.clone()));
            Ok(T::wrap_cuda_slice(dx, dev))
        })
    })?;
    let Some(dw) = dw_storage else {
        candle_core::bail!("rms_norm backward: no ∂w was written")
    };
    let dw = Tensor::from_storage(
        Storage::Cuda(dw),
        w.shape().clone(),
        BackpropOp::none(),
        false,
    );
    Ok((dx, dw))
}

/// RoPE of `x` (`[n, h, d]`, or `[B, T, H, D]` ↔ `[B, H, T, D]` as `layout` says) with
/// `cos`/`sin` `[n, d/2]` (rotation back when `inverse`).
pub(crate) fn rope(
    x: (&CudaStorage, &Layout),
    cos: &Tensor,
    sin: &Tensor,
    inverse: bool,
    layout: super::rope::RopeLayout,
) -> Result<CudaStorage> {
    let dtype = x.0.dtype();
    let ((n, h, d, t_len), _) = layout.dims(x.1.dims())?;
    let dev = x.0.device().clone();
    let (n_i, h_i, d_i) = (n as i32, h as i32, d as i32);
    let (t_i, heads_major) = (t_len as i32, layout.heads_major());
    let sign: f32 = if inverse { -1.0 } else { 1.0 };
    let cos = cos.contiguous()?;
    let sin = sin.contiguous()?;
    let guards = [cos.storage_and_layout(), sin.storage_and_layout()];
    let tables = cuda_parts(&guards, "rope")?;
    typed!(dtype, "rope", |T| {
        let xv = view::<T>(x.0, x.1, "rope")?;
        let (cv, sv) = (
            view::<T>(tables[0].0, tables[0].1, "rope")?,
            view::<T>(tables[1].0, tables[1].1, "rope")?,
        );
        let y = alloc::<T>(&dev, n * h * d)?;
        let f = dev.get_or_load_custom_func(&kernel_name("rope", dtype)?, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&xv)
            .arg(&cv)
            .arg(&sv)
            .arg(&y)
            .arg(&n_i)
            .arg(&h_i)
            .arg(&d_i)
            .arg(&sign)
            .arg(&t_i)
            .arg(&heads_major);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(elementwise_config(n * h * d / 2)) }.w()?;
        Ok(T::wrap_cuda_slice(y, dev))
    })
}

/// [`super::qkv_bias_rope`]'s kernel: `[q | k | v]` (biases added, q and k rotated) from the
/// packed projection rows `qkv`.
pub(crate) fn qkv_bias_rope(
    qkv: (&CudaStorage, &Layout),
    bias: Option<&Tensor>,
    (cos, sin): (&Tensor, &Tensor),
    heads: super::QkvHeads,
) -> Result<CudaStorage> {
    let dev = qkv.0.device().clone();
    let dtype = qkv.0.dtype();
    let n = qkv.1.shape().elem_count();
    let rows = n / heads.packed_width().max(1);
    let ints = [rows, heads.num_heads, heads.num_kv_heads, heads.head_dim].map(|x| x as i32);
    let has_bias = i32::from(bias.is_some());
    // The tables and the bias are the op's own contiguous tensors: hold their storages while
    // the kernel is enqueued.
    let mut extra: Vec<&Tensor> = vec![cos, sin];
    extra.extend(bias);
    let guards: Vec<_> = extra.iter().map(|t| t.storage_and_layout()).collect();
    let storages = cuda_parts(&guards, "qkv_bias_rope")?;
    typed!(dtype, "qkv_bias_rope", |T| {
        let input = view::<T>(qkv.0, qkv.1, "qkv_bias_rope qkv")?;
        let tables = (
            view::<T>(storages[0].0, storages[0].1, "qkv_bias_rope cos")?,
            view::<T>(storages[1].0, storages[1].1, "qkv_bias_rope sin")?,
        );
        // Without a bias the kernel never reads it: the input stands in for the pointer.
        let bias = match storages.get(2) {
            Some((s, l)) => view::<T>(s, l, "qkv_bias_rope bias")?,
            None => view::<T>(qkv.0, qkv.1, "qkv_bias_rope qkv")?,
        };
        let out = alloc::<T>(&dev, n)?;
        let f = dev.get_or_load_custom_func(&kernel_name("qkv_bias_rope", dtype)?, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&input)
            .arg(&bias)
            .arg(&has_bias)
            .arg(&tables.0)
            .arg(&tables.1)
            .arg(&out);
        for x in &ints {
            b.arg(x);
        }
        // SAFETY: the arguments match the kernel's signature; `out` holds rows·(nh+2nkv)·d.
        unsafe { b.launch(elementwise_config(n / 2)) }.w()?;
        Ok(T::wrap_cuda_slice(out, dev))
    })
}

/// SwiGLU forward `silu(g)·u`.
pub(crate) fn swiglu_fwd(
    g: (&CudaStorage, &Layout),
    u: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dtype = g.0.dtype();
    let dev = g.0.device().clone();
    let n = g.1.shape().elem_count();
    let n_u = n as u64;
    typed!(dtype, "swiglu", |T| {
        let (gv, uv) = (
            view::<T>(g.0, g.1, "swiglu")?,
            view::<T>(u.0, u.1, "swiglu")?,
        );
        let y = alloc::<T>(&dev, n)?;
        let f = dev.get_or_load_custom_func(&kernel_name("swiglu_fwd", dtype)?, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&gv).arg(&uv).arg(&y).arg(&n_u);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(elementwise_config(n)) }.w()?;
        Ok(T::wrap_cuda_slice(y, dev))
    })
}

/// SwiGLU forward from packed rows `[gate | up]` of `2·inter`.
pub(crate) fn swiglu_packed_fwd(
    gate_up: (&CudaStorage, &Layout),
    inter: usize,
) -> Result<CudaStorage> {
    let dtype = gate_up.0.dtype();
    let dev = gate_up.0.device().clone();
    let n = gate_up.1.shape().elem_count() / 2;
    let (n_u, inter_u) = (n as u64, inter as u64);
    typed!(dtype, "swiglu_packed", |T| {
        let gu = view::<T>(gate_up.0, gate_up.1, "swiglu_packed")?;
        let y = alloc::<T>(&dev, n)?;
        let f =
            dev.get_or_load_custom_func(&kernel_name("swiglu_packed_fwd", dtype)?, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&gu).arg(&y).arg(&n_u).arg(&inter_u);
        // SAFETY: the arguments match the kernel's signature; `gu` holds 2·n elements.
        unsafe { b.launch(elementwise_config(n)) }.w()?;
        Ok(T::wrap_cuda_slice(y, dev))
    })
}

/// SwiGLU backward: `[∂g | ∂u]` as one `[2·n]` tensor.
pub(crate) fn swiglu_bwd(g: &Tensor, u: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let dtype = g.dtype();
    let n = g.elem_count();
    let n_u = n as u64;
    on_tensors(&[g, u, dy], Shape::from(2 * n), "swiglu backward", |a| {
        let dev = a[0].0.device().clone();
        typed!(dtype, "swiglu backward", |T| {
            let gv = view::<T>(a[0].0, a[0].1, "swiglu")?;
            let uv = view::<T>(a[1].0, a[1].1, "swiglu")?;
            let dv = view::<T>(a[2].0, a[2].1, "swiglu")?;
            let out = alloc::<T>(&dev, 2 * n)?;
            let f = dev.get_or_load_custom_func(&kernel_name("swiglu_bwd", dtype)?, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&gv).arg(&uv).arg(&dv).arg(&out).arg(&n_u);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { b.launch(elementwise_config(n)) }.w()?;
            Ok(T::wrap_cuda_slice(out, dev))
        })
    })
}

/// One of AdamW's two in-place passes (`adamw_moments` / `adamw_params` in kernels.cu, f32):
/// `name(dst, src, n, scalars…)` over the `n` elements of a parameter, `dst` updated in place.
pub(crate) fn adamw_pass(
    name: &str,
    dst: (&mut CudaStorage, &Layout),
    src: (&CudaStorage, &Layout),
    n: usize,
    scalars: &[f64],
) -> Result<()> {
    let dev = src.0.device().clone();
    let (a, b) = super::contiguous_range(dst.1, name, "updated tensor")?;
    let src = view::<f32>(src.0, src.1, name)?;
    let mut dst = dst.0.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
    let f = dev.get_or_load_custom_func(&kernel_name(name, DType::F32)?, MODULE, PTX)?;
    let n64 = n as u64;
    let scalars: Vec<f32> = scalars.iter().map(|&x| x as f32).collect();
    let mut builder = f.builder();
    builder.arg(&mut dst).arg(&src).arg(&n64);
    for x in &scalars {
        builder.arg(x);
    }
    // SAFETY: the arguments match the kernel's signature; `dst` holds the pass's elements
    // (n for a parameter, 2n for its moments) and `src` the other's, as adamw_update checked.
    unsafe { builder.launch(elementwise_config(n)) }.w()?;
    Ok(())
}

/// `acc += x` in place (`add_into_f32_<dtype of x>` in kernels.cu): `acc` f32, `x` f32 or bf16,
/// both contiguous with the same element count.
pub(crate) fn add_into_f32(
    acc: (&mut CudaStorage, &Layout),
    x: (&CudaStorage, &Layout),
) -> Result<()> {
    let dev = x.0.device().clone();
    let (a, b) = super::contiguous_range(acc.1, "add_into", "sum")?;
    let name = kernel_name("add_into_f32", x.0.dtype())?;
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut acc = acc.0.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
    let n = (b - a) as u64;
    typed!(x.0.dtype(), "add_into", |T| {
        let xs = view::<T>(x.0, x.1, "add_into")?;
        if xs.len() != b - a {
            candle_core::bail!("add_into: {} elements and {}", b - a, xs.len())
        }
        let mut builder = f.builder();
        builder.arg(&mut acc).arg(&xs).arg(&n);
        // SAFETY: the arguments match the kernel's signature; both hold n elements.
        unsafe { builder.launch(elementwise_config(b - a)) }.w()?;
    });
    Ok(())
}
