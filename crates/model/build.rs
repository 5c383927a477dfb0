//! With `--features cuda`: compiles the training ops' CUDA kernels (src/ops/kernels.cu) to PTX
//! with the toolkit's `nvcc` (`NVCC`, else `nvcc` on PATH; see ../shared/cuda/setup-toolkit.sh).
//! The PTX targets compute capability 8.0 (bf16 arithmetic) and is compiled for the actual GPU
//! by the driver when first loaded. Without the feature nothing is built.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/ops/kernels.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("ops.ptx");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let status = Command::new(&nvcc)
        .args(["--ptx", "-arch=compute_80", "-O3", "src/ops/kernels.cu", "-o"])
        .arg(&out)
        .status()
        .unwrap_or_else(|e| {
            panic!("running `{nvcc}` to build src/ops/kernels.cu (the cuda feature needs the CUDA toolkit: ../shared/cuda/setup-toolkit.sh): {e}")
        });
    assert!(status.success(), "`{nvcc} --ptx src/ops/kernels.cu` failed");
}
