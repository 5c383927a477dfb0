//! DiLoCo communication benchmark (issue 7 §6); see [`composer_diloco::bench`].
//!
//! `cargo run --release -p composer-diloco --example diloco_bench -- [--target 0.03] [--max-steps 3000]
//! [--student-hidden 16]`

use anyhow::Result;
use composer_diloco::bench::{run_benchmark, BenchOptions};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<()> {
    let mut opts = BenchOptions::default();
    if let Some(v) = arg("--target") {
        opts.target = v.parse()?;
    }
    if let Some(v) = arg("--max-steps") {
        opts.max_steps = v.parse()?;
    }
    if let Some(v) = arg("--student-hidden") {
        opts.student_hidden = v.parse()?;
    }
    print!("{}", run_benchmark(&opts)?);
    Ok(())
}
