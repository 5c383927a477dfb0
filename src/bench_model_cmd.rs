//! `composer-rl bench model`: composer-model's training and decode throughput on a shape, and
//! with `--torch` PyTorch's on the same card in the same run (tools/bench_torch.py: eager with
//! sdpa, and `--torch-compile`), side by side with peak memory, MFU and ratios.
//!
//! PyTorch runs first, in child processes, before this process opens the device: each side's
//! device memory is then its own (sampled the same way on both sides: the card's used memory
//! every 10 ms, the CUDA context included).

use anyhow::{Context, Result};
use composer_model::bench::{self, BenchConfig, BenchReport};
use serde_json::Value;

use crate::args::BenchModelArgs;
use crate::bench_cmd::{parse_dtype, run_python_script};

/// PyTorch's side of `bench model --torch`.
const BENCH_TORCH_PY: &str = include_str!("../tools/bench_torch.py");

/// Runs `bench model` and prints its table (or JSON).
/// Largest batch `bench model` takes (a typo like 100000000 must not start a run).
const MAX_BENCH_BATCH: usize = 4096;

pub(crate) fn run(a: BenchModelArgs) -> Result<()> {
    composer_model::device::check_device_spec(&a.device).context("--device")?;
    let mut cfg = config(&a)?;
    if a.peak_tflops.is_some_and(|t| t.is_nan() || t <= 0.0) {
        anyhow::bail!("--peak-tflops must be > 0");
    }
    // A reference that fails (out of memory on a shape ours fits, a missing package) is a
    // row of the table, not the end of the run.
    let mut torch = Vec::new();
    for compile in [false, true] {
        if a.torch && (!compile || a.torch_compile) {
            torch.push(run_torch(&a, &cfg, compile).unwrap_or_else(|e| {
                let framework = if compile {
                    "torch.compile"
                } else {
                    "torch eager"
                };
                serde_json::json!({"framework": framework, "error": format!("{e:#}")})
            }));
        }
    }
    cfg.device = composer_model::device_from_str(&a.device)?;
    let ours = bench::run(&cfg)?;
    let peak = a
        .peak_tflops
        .map(|t| t * 1e12)
        .or_else(|| bench::peak_bf16_flops(&cfg.device));
    let flops = bench::train_flops_per_token(
        &cfg.model,
        ours.num_parameters,
        cfg.train_seq_len,
        cfg.lora_r.is_some(),
    );
    if a.json {
        if torch.is_empty() {
            println!("{}", serde_json::to_string(&ours)?);
        } else {
            let json = serde_json::json!({
                "composer_rl": ours,
                "torch": torch,
                "train_flops_per_token": flops,
                "peak_flops": peak,
            });
            println!("{json}");
        }
        return Ok(());
    }
    println!("{}", ours.table());
    if !torch.is_empty() {
        println!("{}", side_by_side(&ours, &torch, flops, peak));
    }
    Ok(())
}

/// The benchmark's configuration from the command line (the device is opened later).
fn config(a: &BenchModelArgs) -> Result<BenchConfig> {
    let base = match a.shape.as_str() {
        "small" => BenchConfig::small_cpu(),
        "qwen-vocab" => BenchConfig::qwen_vocab_cpu(),
        _ => BenchConfig::qwen2_5_0_5b(candle_core::Device::Cpu),
    };
    let mut cfg = BenchConfig {
        model: bench::shape_model_config(&a.shape)?,
        ..base
    };
    cfg.skip_decode = a.skip_decode;
    cfg.cuda_graphs = a.cuda_graphs;
    cfg.lora_r = a.lora;
    cfg.gradient_checkpointing = a.gradient_checkpointing;
    cfg.padding_free = a.padding_free;
    if let Some(p) = a.prompt_len {
        // Saturating: a huge --prompt-len must not wrap round to a small one.
        let need = p.saturating_add(cfg.decode_tokens);
        if p == 0 || need > cfg.model.max_position_embeddings {
            anyhow::bail!(
                "--prompt-len {p}: must be at least 1, and with the {} decoded tokens within the shape's max_position_embeddings = {}",
                cfg.decode_tokens,
                cfg.model.max_position_embeddings
            );
        }
        cfg.prompt_len = p;
    }
    if let Some(t) = a.train_seq_len {
        if t < 2 {
            anyhow::bail!("--train-seq-len {t}: must be at least 2 (a next token to predict)");
        }
        let need = t.max(cfg.prompt_len + cfg.decode_tokens);
        if need > cfg.model.max_position_embeddings {
            anyhow::bail!(
                "--train-seq-len {t} is over the shape's max_position_embeddings = {}",
                cfg.model.max_position_embeddings
            );
        }
        cfg.train_seq_len = t;
    }
    if let Some(b) = &a.batch {
        if let Some(bad) = b.iter().find(|&&n| !(1..=MAX_BENCH_BATCH).contains(&n)) {
            anyhow::bail!("--batch {bad}: each batch size must be in 1..={MAX_BENCH_BATCH}");
        }
        cfg.batch_sizes = b.clone();
    }
    cfg.skip_train |= a.skip_train;
    let on_cuda = a.device.trim().starts_with("cuda");
    let dtype = match &a.dtype {
        Some(d) => parse_dtype(d).context("--dtype")?,
        None if on_cuda => candle_core::DType::BF16,
        None => candle_core::DType::F32,
    };
    cfg.train_dtype = dtype;
    cfg.decode_dtype = dtype;
    Ok(cfg)
}

/// PyTorch's report for `cfg` (eager, or `compile`d), from tools/bench_torch.py.
fn run_torch(a: &BenchModelArgs, cfg: &BenchConfig, compile: bool) -> Result<Value> {
    let dtype = match cfg.train_dtype {
        candle_core::DType::BF16 => "bf16",
        candle_core::DType::F16 => "f16",
        _ => "f32",
    };
    let batches: Vec<String> = cfg.batch_sizes.iter().map(usize::to_string).collect();
    let hf = cfg.model.to_hf_json(dtype);
    let mut flags: Vec<(&str, std::ffi::OsString)> = vec![
        ("--config-json", hf.to_string().into()),
        ("--device", a.device.trim().into()),
        ("--dtype", dtype.into()),
        ("--batch", batches.join(",").into()),
        ("--train-seq-len", cfg.train_seq_len.to_string().into()),
        ("--train-iters", cfg.train_iters.to_string().into()),
        ("--prompt-len", cfg.prompt_len.to_string().into()),
        ("--decode-tokens", cfg.decode_tokens.to_string().into()),
    ];
    if let Some(r) = cfg.lora_r {
        flags.push(("--lora", r.to_string().into()));
    }
    let mut argv: Vec<std::ffi::OsString> = flags
        .into_iter()
        .flat_map(|(name, value)| [name.into(), value])
        .collect();
    argv.push("--json".into());
    if compile {
        argv.push("--compile".into());
    }
    if cfg.skip_decode || compile {
        argv.push("--skip-decode".into());
    }
    let what = if compile {
        "the torch.compile reference"
    } else {
        "the PyTorch eager reference"
    };
    let needs = if cfg.lora_r.is_some() {
        "torch, transformers and peft, or run without --torch"
    } else {
        "torch and transformers, or run without --torch"
    };
    run_python_script(a.python.clone(), BENCH_TORCH_PY, &argv, what, needs)
}

/// The training side-by-side: each batch's tokens/s, peak memory and MFU per side, and ours
/// over each reference.
fn side_by_side(ours: &BenchReport, torch: &[Value], flops: f64, peak: Option<f64>) -> String {
    let mfu = |tps: f64| {
        peak.map_or("-".to_string(), |p| {
            format!("{:.1}%", 100.0 * tps * flops / p)
        })
    };
    let mem = |device_mib: Option<f64>, rss_mb: Option<f64>| match (device_mib, rss_mb) {
        (Some(m), _) => format!("{:.1} GiB", m / 1024.0),
        (None, Some(r)) => format!("{r:.0} MB RSS"),
        _ => "-".into(),
    };
    let params: Vec<String> = torch
        .iter()
        .map(|t| {
            t["num_parameters"]
                .as_u64()
                .map_or("?".into(), |n| n.to_string())
        })
        .collect();
    let mut s = format!(
        "training side by side (same shape, batch, sequence and dtype; parameters: composer-rl {}, torch {}; memory: the device's peak used, or the process's peak RSS on the CPU)\n| batch | side | train tok/s | peak memory | MFU | composer-rl / side |\n|---:|---|---:|---:|---:|---:|\n",
        ours.num_parameters,
        params.join(" / ")
    );
    for r in &ours.rows {
        let Some(tps) = r.train_tokens_per_s else {
            continue;
        };
        s.push_str(&format!(
            "| {} | composer-rl | {tps:.0} | {} | {} | |\n",
            r.batch,
            mem(r.peak_device_mib, r.peak_rss_after_train_mb),
            mfu(tps)
        ));
        for side in torch {
            let row = side["rows"].as_array().and_then(|rows| {
                rows.iter()
                    .find(|x| x["batch"].as_u64() == Some(r.batch as u64))
            });
            let name = side["framework"].as_str().unwrap_or("torch");
            match row.and_then(|x| x["train_tokens_per_s"].as_f64().map(|t| (x, t))) {
                Some((x, theirs)) => s.push_str(&format!(
                    "| {} | {name} | {theirs:.0} | {} | {} | {:.2}x |\n",
                    r.batch,
                    mem(x["peak_device_mib"].as_f64(), x["peak_rss_mb"].as_f64()),
                    mfu(theirs),
                    tps / theirs
                )),
                None => {
                    let why = side["error"].as_str().unwrap_or("no row for this batch");
                    s.push_str(&format!("| {} | {name} | failed: {why} | | | |\n", r.batch));
                }
            }
        }
    }
    s
}
