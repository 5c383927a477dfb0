//! `cargo run --release -p composer-train --example train -- [RECIPE] [--resume RUN_DIR]
//! [--run-dir DIR] [--steps N] [--quiet]`: the training entry point without the CLI crate.

use std::path::PathBuf;

use composer_train::{run_train, TrainOptions};

fn main() -> anyhow::Result<()> {
    let mut opts = TrainOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--resume" => opts.resume = args.next().map(PathBuf::from),
            "--run-dir" => opts.run_dir_override = args.next().map(PathBuf::from),
            "--steps" => opts.max_steps_override = args.next().and_then(|s| s.parse().ok()),
            "--quiet" => opts.quiet = true,
            p => opts.recipe_path = Some(PathBuf::from(p)),
        }
    }
    let out = run_train(&opts)?;
    println!("{out:?}");
    Ok(())
}
