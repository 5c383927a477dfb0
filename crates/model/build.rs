//! With `--features cuda`: compiles the training ops' CUDA kernels (src/ops/kernels.cu, with
//! the LM head's softmax algebra in head_kernels.cuh, the embedding backward in
//! embedding_kernels.cuh and the bias add in linear_kernels.cuh), the
//! var-len flash attention (src/ops/attention_kernels.cu, with its tensor-core kernels in
//! attention_tc_kernels.cuh) and the rollout engine's decode kernels (src/ops/decode_kernels.cu,
//! with the tensor-core paged decode in decode_tc_kernels.cuh, the skinny products in
//! decode_gemm_kernels.cuh, the device sampler in sample_kernels.cuh and deterministic mode's
//! batch-invariant kernels in rows_invariant_kernels.cuh), all sharing src/ops/cuda_common.cuh, to PTX, one module each,
//! with the toolkit's `nvcc` (`NVCC`, else `nvcc` on PATH; see ../shared/cuda/setup-toolkit.sh).
//! The PTX targets compute capability 8.0 (bf16 arithmetic) and is compiled for the actual GPU
//! by the driver when first loaded. Without the feature nothing is built.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/ops/kernels.cu");
    println!("cargo:rerun-if-changed=src/ops/attention_kernels.cu");
    println!("cargo:rerun-if-changed=src/ops/attention_tc_kernels.cuh");
    println!("cargo:rerun-if-changed=src/ops/embedding_kernels.cuh");
    println!("cargo:rerun-if-changed=src/ops/head_kernels.cuh");
    println!("cargo:rerun-if-changed=src/ops/linear_kernels.cuh");
    println!("cargo:rerun-if-changed=src/ops/decode_kernels.cu");
    println!("cargo:rerun-if-changed=src/ops/decode_tc_kernels.cuh");
    println!("cargo:rerun-if-changed=src/ops/decode_gemm_kernels.cuh");
    println!("cargo:rerun-if-changed=src/ops/rows_invariant_kernels.cuh");
    println!("cargo:rerun-if-changed=src/ops/sample_kernels.cuh");
    println!("cargo:rerun-if-changed=src/ops/cuda_common.cuh");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    for (src, ptx) in [
        ("src/ops/kernels.cu", "ops.ptx"),
        ("src/ops/attention_kernels.cu", "attention.ptx"),
        ("src/ops/decode_kernels.cu", "decode.ptx"),
    ] {
        let status = Command::new(&nvcc)
            .args(["--ptx", "-arch=compute_80", "-O3", src, "-o"])
            .arg(out_dir.join(ptx))
            .status()
            .unwrap_or_else(|e| {
                panic!("running `{nvcc}` to build {src} (the cuda feature needs the CUDA toolkit: ../shared/cuda/setup-toolkit.sh): {e}")
            });
        assert!(status.success(), "`{nvcc} --ptx {src}` failed");
    }
}
