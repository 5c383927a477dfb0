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

/// `f32`, `bf16` or `f16` as a candle dtype.
fn parse_dtype(name: &str) -> Result<candle_core::DType> {
    match name {
        "f32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "f16" => Ok(candle_core::DType::F16),
        other => anyhow::bail!("dtype {other:?} is not one of: f32, bf16, f16"),
    }
}
