//! Probe: warm-up accuracy vs steps for a recipe (development aid).
use std::path::PathBuf;

use composer_train::trainer::{evaluate, open_session, warmup, TrainOptions};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = TrainOptions {
        recipe_path: args.first().map(PathBuf::from),
        run_dir_override: Some(PathBuf::from("/tmp/probe-run")),
        ..Default::default()
    };
    let mut s = open_session(&opts)?;
    let mut w = s.recipe.warmup.clone().expect("warmup section");
    let chunk = w.steps;
    let t0 = std::time::Instant::now();
    for i in 1..=10 {
        w.steps = chunk;
        let loss = warmup(&mut s, &w)?;
        let acc = evaluate(&s)?;
        println!("steps {} loss {loss:.4} acc {:.3} t {:.1}s", i * chunk, acc, t0.elapsed().as_secs_f64());
    }
    Ok(())
}
