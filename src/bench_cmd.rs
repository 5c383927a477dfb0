//! `composer-rl bench …`: model throughput (`bench model`), and the embedded default's
//! sync-vs-async and channel comparisons.

use anyhow::{Context, Result};

use crate::args::BenchCommand;

/// Runs one `bench` subcommand and prints its table (or JSON).
pub(crate) fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Model {
            shape,
            device,
            batch,
            skip_train,
            skip_decode,
            lora,
            gradient_checkpointing,
            padding_free,
            dtype,
            train_seq_len,
            json,
        } => {
            let device = composer_model::device_from_str(&device)?;
            let mut cfg = match shape.as_str() {
                "small" => composer_model::bench::BenchConfig::small_cpu(),
                "qwen2.5-0.5b" => composer_model::bench::BenchConfig::qwen2_5_0_5b(device.clone()),
                "qwen3-0.6b" => composer_model::bench::BenchConfig {
                    model: composer_model::ModelConfig::qwen3_0_6b(),
                    ..composer_model::bench::BenchConfig::qwen2_5_0_5b(device.clone())
                },
                "qwen2.5-7b" => composer_model::bench::BenchConfig {
                    model: composer_model::ModelConfig::qwen2_5_7b(),
                    ..composer_model::bench::BenchConfig::qwen2_5_0_5b(device.clone())
                },
                "qwen-vocab" => composer_model::bench::BenchConfig::qwen_vocab_cpu(),
                other => anyhow::bail!(
                    "--shape {other:?} is not one of: small, qwen2.5-0.5b, qwen3-0.6b, qwen2.5-7b, qwen-vocab"
                ),
            };
            cfg.skip_decode = skip_decode;
            cfg.lora_r = lora;
            cfg.gradient_checkpointing = gradient_checkpointing;
            cfg.padding_free = padding_free;
            if let Some(t) = train_seq_len {
                let need = t.max(cfg.prompt_len + cfg.decode_tokens);
                if need > cfg.model.max_position_embeddings {
                    anyhow::bail!(
                        "--train-seq-len {t} is over the shape's max_position_embeddings = {}",
                        cfg.model.max_position_embeddings
                    );
                }
                cfg.train_seq_len = t;
            }
            cfg.device = device;
            if let Some(b) = batch {
                cfg.batch_sizes = b;
            }
            cfg.skip_train |= skip_train;
            if let Some(d) = dtype {
                let d = parse_dtype(&d).context("--dtype")?;
                cfg.train_dtype = d;
                cfg.decode_dtype = d;
            }
            let report = composer_model::bench::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("{}", report.table());
            }
            Ok(())
        }
        BenchCommand::Async {
            reward_latency_s,
            max_staleness,
            seed,
            target,
            max_steps,
            out_dir,
        } => {
            let table = composer_train::bench_async(&composer_train::AsyncBenchOptions {
                seed,
                reward_latency_s,
                max_staleness,
                target,
                max_steps,
                out_dir,
            })?;
            println!("{table}");
            Ok(())
        }
        BenchCommand::Rollout {
            model,
            batch,
            new_tokens,
            repeats,
            prompt,
            python,
            skip_reference,
            json,
        } => bench_rollout(
            &composer_model::bench_rollout::RolloutBenchOptions {
                model_dir: model,
                batch,
                new_tokens,
                repeats,
                prompt,
            },
            python,
            skip_reference,
            json,
        ),
        BenchCommand::Channels {
            seeds,
            target,
            max_steps,
            out_dir,
            arms,
            hint_weight,
            replay_weight,
        } => {
            let (_, table) = composer_train::bench_channels(&composer_train::BenchOptions {
                seeds,
                target,
                max_steps,
                out_dir,
                arms,
                hint_weight,
                replay_weight,
            })?;
            println!("{table}");
            Ok(())
        }
    }
}

/// transformers' side of `bench rollout`, run with `python` (tools/bench_generate_hf.py).
const BENCH_GENERATE_HF_PY: &str = include_str!("../tools/bench_generate_hf.py");

/// `bench rollout`: ours, then transformers' `generate` on the same ids, then the table.
fn bench_rollout(
    opts: &composer_model::bench_rollout::RolloutBenchOptions,
    python: Option<std::path::PathBuf>,
    skip_reference: bool,
    json: bool,
) -> Result<()> {
    if !opts.model_dir.join("config.json").is_file() {
        anyhow::bail!(
            "--model {}: no config.json there (an HF checkpoint directory is needed)",
            opts.model_dir.display()
        );
    }
    let ours = composer_model::bench_rollout::bench_rollout(opts)?;
    let reference = if skip_reference {
        None
    } else {
        let python = python
            .or_else(|| std::env::var_os("COMPOSER_BENCH_PYTHON").map(Into::into))
            .unwrap_or_else(|| "python3".into());
        let ids: Vec<String> = ours.prompt_ids.iter().map(u32::to_string).collect();
        let out = std::process::Command::new(&python)
            .arg("-c")
            .arg(BENCH_GENERATE_HF_PY)
            .arg("--model")
            .arg(&opts.model_dir)
            .args(["--prompt-ids", &ids.join(",")])
            .args(["--batch", &opts.batch.to_string()])
            .args(["--new-tokens", &opts.new_tokens.to_string()])
            .args(["--repeats", &opts.repeats.to_string()])
            .args(["--threads", &ours.threads.to_string()])
            .output()
            .with_context(|| format!("running {} (--python)", python.display()))?;
        if !out.status.success() {
            anyhow::bail!(
                "the transformers reference failed ({}; --python {} needs torch and                  transformers, or pass --skip-reference): {}",
                out.status,
                python.display(),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
        }
        let line = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = serde_json::from_str(line.trim())
            .with_context(|| format!("the reference printed {line:?}"))?;
        Some(v)
    };
    if json {
        println!(
            "{}",
            serde_json::json!({"composer_rl": ours, "transformers": reference})
        );
        return Ok(());
    }
    let fmt = |xs: &[f64]| {
        xs.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "decode, {} samples x {} new tokens, {} prompt tokens, f32 on the CPU, {} threads",
        opts.batch,
        opts.new_tokens,
        ours.prompt_ids.len(),
        ours.threads
    );
    println!("| side | tokens/s (median) | runs |");
    println!("|---|---:|---|");
    println!(
        "| composer-rl | {:.0} | {} |",
        ours.tokens_per_s,
        fmt(&ours.runs_tokens_per_s)
    );
    if let Some(r) = &reference {
        let theirs = r["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        let runs: Vec<f64> = r["runs_tokens_per_s"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
        println!(
            "| transformers {} generate (torch {}) | {theirs:.0} | {} |",
            r["transformers"].as_str().unwrap_or("?"),
            r["torch"].as_str().unwrap_or("?"),
            fmt(&runs)
        );
        println!(
            "ratio composer-rl / transformers: {:.2}",
            ours.tokens_per_s / theirs
        );
    }
    println!(
        "deterministic mode: max |sampler - scorer| log-prob over {} tokens = {:e}",
        ours.deterministic_tokens, ours.deterministic_max_abs_diff
    );
    Ok(())
}

/// `f32`, `bf16` or `f16` as a candle dtype.
fn parse_dtype(name: &str) -> Result<candle_core::DType> {
    match name {
        "f32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "f16" => Ok(candle_core::DType::F16),
        other => anyhow::bail!("dtype {other:?} is not one of: f32, bf16, f16"),
    }
}
