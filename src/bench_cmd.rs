//! `composer-rl bench …`: model throughput (`bench model`), and the embedded default's
//! sync-vs-async and channel comparisons.

use anyhow::{Context, Result};

use crate::args::BenchCommand;

/// `value` of the flag `name`, refused unless finite and within `lo..=hi` (checked before any
/// run: a NaN would otherwise surface as a generated recipe's error).
fn check_range(name: &str, value: f64, lo: f64, hi: f64) -> Result<()> {
    if !(value.is_finite() && (lo..=hi).contains(&value)) {
        anyhow::bail!("{name} must be a number in [{lo}, {hi}], got {value}");
    }
    Ok(())
}

/// The embedded default's stopping flags: an accuracy to reach and a step cap.
fn check_stop(stop: &crate::args::BenchStopArgs) -> Result<()> {
    check_range("--target", stop.target, 0.0, 1.0)?;
    if stop.max_steps == 0 {
        anyhow::bail!("--max-steps must be at least 1");
    }
    Ok(())
}

/// Runs one `bench` subcommand and prints its table (or JSON).
pub(crate) fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Model(a) => crate::bench_model_cmd::run(a),
        BenchCommand::Async(a) => {
            check_stop(&a.stop)?;
            check_range("--reward-latency-s", a.reward_latency_s, 0.0, 3600.0)?;
            let table = composer_train::bench_async(&composer_train::AsyncBenchOptions {
                seed: a.seed,
                reward_latency_s: a.reward_latency_s,
                max_staleness: a.max_staleness,
                target: a.stop.target,
                max_steps: a.stop.max_steps,
                out_dir: a.out_dir,
            })?;
            println!("{table}");
            Ok(())
        }
        BenchCommand::Rollout(a) => match a.workload.as_str() {
            "decode" => {
                let (device, dtype) = device_and_dtype(&a.device, a.dtype.as_deref())?;
                bench_rollout(
                    &composer_model::bench_rollout::RolloutBenchOptions {
                        model_dir: a.model,
                        shape: a.shape,
                        device,
                        dtype,
                        cuda_graphs: a.cuda_graphs,
                        batch: a.batch,
                        new_tokens: a.new_tokens.unwrap_or(128),
                        repeats: a.repeats,
                        prompt: a.prompt,
                    },
                    a.reference,
                    a.json,
                )
            }
            "grpo" => {
                let opts = composer_model::bench_rollout_grpo::GrpoRolloutOptions {
                    prompts: a.prompts,
                    group: a.group,
                    max_new_tokens: a.new_tokens.unwrap_or(256),
                    prompt_len: parse_len_range(&a.prompt_len)?,
                    mean_completion: a.mean_completion,
                    rows: a.max_running,
                    repeats: a.repeats,
                    cuda_graphs: a.cuda_graphs,
                };
                let shape = a.shape.as_deref();
                let (device, dtype) = device_and_dtype(&a.device, a.dtype.as_deref())?;
                bench_rollout_grpo(&opts, &a.model, shape, &device, dtype, a.json)
            }
            other => anyhow::bail!("--workload {other:?} is not one of: decode, grpo"),
        },
        BenchCommand::Grpo(a) => bench_grpo_checked(a),
        BenchCommand::Channels(a) => {
            check_stop(&a.stop)?;
            check_range("--hint-weight", a.hint_weight, 0.0, 1e6)?;
            check_range("--replay-weight", a.replay_weight, 0.0, 1e6)?;
            let (_, table) = composer_train::bench_channels(&composer_train::BenchOptions {
                seeds: a.seeds,
                target: a.stop.target,
                max_steps: a.stop.max_steps,
                out_dir: a.out_dir,
                arms: a.arms,
                hint_weight: a.hint_weight,
                replay_weight: a.replay_weight,
            })?;
            println!("{table}");
            Ok(())
        }
    }
}

/// `bench grpo` after its float flag is checked.
fn bench_grpo_checked(a: crate::args::BenchGrpoArgs) -> Result<()> {
    check_range("--learning-rate", a.learning_rate, f64::MIN_POSITIVE, 1.0)?;
    bench_grpo(
        &composer_train::bench_grpo::GrpoStepBenchOptions {
            model_dir: a.model,
            shape: a.shape,
            prompts: a.prompts,
            group: a.group,
            new_tokens: a.new_tokens,
            steps: a.steps,
            loss_type: a.loss_type,
            learning_rate: a.learning_rate,
            device: a.device,
            bf16: a.bf16,
            out_dir: a.out_dir,
        },
        a.reference,
        a.json,
    )
}

/// transformers' side of `bench rollout`, run with `python` (tools/bench_generate_hf.py).
const BENCH_GENERATE_HF_PY: &str = include_str!("../tools/bench_generate_hf.py");

/// `bench rollout`: ours, then transformers' `generate` on the same ids, then the table.
fn bench_rollout(
    opts: &composer_model::bench_rollout::RolloutBenchOptions,
    reference_args: crate::args::ReferenceArgs,
    json: bool,
) -> Result<()> {
    let crate::args::ReferenceArgs {
        python,
        skip_reference,
    } = reference_args;
    if opts.shape.is_none() && !opts.model_dir.join("config.json").is_file() {
        anyhow::bail!(
            "--model {}: no config.json there (an HF checkpoint directory is needed)",
            opts.model_dir.display()
        );
    }
    if opts.shape.is_some() && !opts.model_dir.join("tokenizer.json").is_file() {
        anyhow::bail!(
            "--model {}: no tokenizer.json there (with --shape, --model names the tokenizer)",
            opts.model_dir.display()
        );
    }
    // transformers' side loads the checkpoint on the CPU in f32: only that is side by side.
    let mut unlike = Vec::new();
    if let Some(shape) = &opts.shape {
        unlike.push(format!("--shape {shape}"));
    }
    if !opts.device.is_cpu() {
        unlike.push(format!("--device {:?}", opts.device));
    }
    if opts.dtype != candle_core::DType::F32 {
        unlike.push(format!("--dtype {}", opts.dtype.as_str()));
    }
    if !skip_reference && !unlike.is_empty() {
        anyhow::bail!(
            "bench rollout: transformers' side runs the --model checkpoint on the CPU in f32, \
             not with {}; pass --skip-reference (tools/bench_torch.py times HF generate on a GPU)",
            unlike.join(", ")
        );
    }
    let ours = composer_model::bench_rollout::bench_rollout(opts)?;
    let reference = if skip_reference {
        None
    } else {
        let ids: Vec<String> = ours.prompt_ids.iter().map(u32::to_string).collect();
        let args = [
            ("--model", opts.model_dir.clone().into()),
            ("--prompt-ids", ids.join(",").into()),
            ("--batch", opts.batch.to_string().into()),
            ("--new-tokens", opts.new_tokens.to_string().into()),
            ("--repeats", opts.repeats.to_string().into()),
            ("--threads", ours.threads.to_string().into()),
        ];
        Some(run_python_reference(
            python,
            BENCH_GENERATE_HF_PY,
            &args,
            "the transformers reference",
            "torch and transformers",
        )?)
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
        "decode, {} samples x {} new tokens, {} prompt tokens, {} on {}{}, {} CPU threads",
        opts.batch,
        opts.new_tokens,
        ours.prompt_ids.len(),
        ours.dtype,
        ours.device,
        if ours.cuda_graphs {
            " (CUDA graphs)"
        } else {
            ""
        },
        ours.threads
    );
    println!("| side | tokens/s (median) | runs |");
    println!("|---|---:|---|");
    println!(
        "| composer-rl | {:.0} | {} |",
        ours.tokens_per_s,
        fmt(&ours.runs_tokens_per_s)
    );
    println!(
        "| composer-rl, deterministic mode | {:.0} | {} |",
        ours.deterministic_tokens_per_s,
        fmt(&ours.deterministic_runs_tokens_per_s)
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
        "deterministic mode: {:.2}x the engine's tokens/s; max |sampler - scorer| log-prob over {} tokens = {:e}",
        ours.deterministic_tokens_per_s / ours.tokens_per_s,
        ours.deterministic_tokens,
        ours.deterministic_max_abs_diff
    );
    Ok(())
}

/// `bench rollout --workload grpo`: the model (random weights of `--shape` on `--device`, or
/// the checkpoint of `--model`), then the three schedules' table.
fn bench_rollout_grpo(
    opts: &composer_model::bench_rollout_grpo::GrpoRolloutOptions,
    model_dir: &std::path::Path,
    shape: Option<&str>,
    device: &candle_core::Device,
    dtype: candle_core::DType,
    json: bool,
) -> Result<()> {
    let model = match shape {
        Some(shape) => {
            let cfg = composer_model::bench::shape_model_config(shape)?;
            composer_model::Transformer::random_init_on_device(&cfg, dtype, device)?.0
        }
        None => composer_model::Policy::load(model_dir, device, dtype)?.model,
    };
    let report = composer_model::bench_rollout_grpo::bench_grpo_rollout(&model, opts)?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.table(device, dtype.as_str()));
    }
    Ok(())
}

/// `--device` and `--dtype` (default: bf16 on CUDA, f32 on the CPU), each error naming its
/// flag.
fn device_and_dtype(
    device: &str,
    dtype: Option<&str>,
) -> Result<(candle_core::Device, candle_core::DType)> {
    let device = composer_model::device_from_str(device).context("--device")?;
    let dtype = match dtype {
        Some(d) => parse_dtype(d).context("--dtype")?,
        None => composer_model::bench::default_dtype(&device),
    };
    Ok((device, dtype))
}

/// `LO..HI` (or one length `N`) as a prompt-length range, `--prompt-len`.
fn parse_len_range(s: &str) -> Result<(usize, usize)> {
    let parse = |x: &str| {
        x.trim()
            .parse::<usize>()
            .with_context(|| format!("--prompt-len {s:?}: {x:?} is not a token count"))
    };
    match s.split_once("..") {
        Some((lo, hi)) => Ok((parse(lo)?, parse(hi.trim_start_matches('='))?)),
        None => {
            let n = parse(s)?;
            Ok((n, n))
        }
    }
}

/// Runs a reference script (`script`'s text via `python -c`) with `flags` (name, value) and
/// parses the JSON line it prints; `python` defaults to $COMPOSER_BENCH_PYTHON, else python3.
pub(crate) fn run_python_reference(
    python: Option<std::path::PathBuf>,
    script: &str,
    flags: &[(&str, std::ffi::OsString)],
    what: &str,
    needs: &str,
) -> Result<serde_json::Value> {
    let argv: Vec<std::ffi::OsString> = flags
        .iter()
        .flat_map(|(name, value)| [(*name).into(), value.clone()])
        .collect();
    let needs = format!("{needs}, or pass --skip-reference");
    run_python_script(python, script, &argv, what, &needs)
}

/// [`run_python_reference`] with the script's arguments as they are.
pub(crate) fn run_python_script(
    python: Option<std::path::PathBuf>,
    script: &str,
    argv: &[std::ffi::OsString],
    what: &str,
    needs: &str,
) -> Result<serde_json::Value> {
    let python = python
        .or_else(|| std::env::var_os("COMPOSER_BENCH_PYTHON").map(Into::into))
        .unwrap_or_else(|| "python3".into());
    let out = std::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .args(argv)
        .output()
        .with_context(|| format!("running {} (--python)", python.display()))?;
    if !out.status.success() {
        anyhow::bail!(
            "{what} failed ({}; --python {} needs {needs}): {}",
            out.status,
            python.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or("");
    serde_json::from_str(line.trim()).with_context(|| format!("{what} printed {line:?}"))
}

/// TRL's side of `bench grpo`, run with `python` (tools/bench_grpo_trl.py).
const BENCH_GRPO_TRL_PY: &str = include_str!("../tools/bench_grpo_trl.py");

/// `bench grpo`: composer-rl's trainer, then TRL's GRPOTrainer on the same prompts and shape.
fn bench_grpo(
    opts: &composer_train::bench_grpo::GrpoStepBenchOptions,
    reference_args: crate::args::ReferenceArgs,
    json: bool,
) -> Result<()> {
    let crate::args::ReferenceArgs {
        python,
        skip_reference,
    } = reference_args;
    let ours = composer_train::bench_grpo::bench_grpo_step(opts)?;
    let reference = if skip_reference {
        None
    } else {
        let threads = candle_core::utils::get_num_threads();
        let args = [
            ("--model", ours.model_dir.clone().into()),
            ("--prompts-file", ours.prompts_file.clone().into()),
            ("--prompts", opts.prompts.to_string().into()),
            ("--group", opts.group.to_string().into()),
            ("--new-tokens", opts.new_tokens.to_string().into()),
            ("--steps", opts.steps.to_string().into()),
            ("--learning-rate", opts.learning_rate.to_string().into()),
            ("--loss-type", opts.loss_type.clone().into()),
            ("--threads", threads.to_string().into()),
            ("--device", opts.device.clone().into()),
            ("--dtype", if opts.bf16 { "bf16" } else { "f32" }.into()),
        ];
        Some(run_python_reference(
            python,
            BENCH_GRPO_TRL_PY,
            &args,
            "TRL's GRPOTrainer",
            "torch, transformers, datasets and trl 1.16",
        )?)
    };
    // TRL's step times, and their median computed the way ours is (gpu_summary.py reads it).
    let floats = |r: &serde_json::Value, key: &str| -> Vec<f64> {
        r[key]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default()
    };
    let trl_step_s = reference.as_ref().map(|r| floats(r, "step_s"));
    let trl_median_step_s = trl_step_s
        .as_deref()
        .map(composer_train::bench_grpo::median_after_warmup);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "options": opts,
                "composer_rl": ours,
                "trl": reference,
                "trl_median_step_s": trl_median_step_s,
            })
        );
        return Ok(());
    }
    let secs = |xs: &[f64]| {
        xs.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "whole GRPO steps on {}: {} prompts x {} samples, up to {} new tokens, loss {}, {} on {}, {} steps \
         (the first a warm-up; medians of the rest)",
        opts.shape.as_deref().map_or_else(
            || opts.model_dir.display().to_string(),
            |s| format!("random weights of shape {s}")
        ),
        opts.prompts,
        opts.group,
        opts.new_tokens,
        opts.loss_type,
        if opts.bf16 { "bf16" } else { "f32" },
        opts.device,
        opts.steps
    );
    println!("| side | median step s | steps s | mean completion tokens |");
    println!("|---|---:|---|---:|");
    let o = &ours.steps;
    println!(
        "| composer-rl | {:.3} | {} | {:.1} |",
        o.median_step_s,
        secs(&o.step_s),
        o.mean_completion_length
    );
    if let (Some(r), Some(step_s), Some(theirs)) = (&reference, &trl_step_s, trl_median_step_s) {
        let lengths = floats(r, "mean_completion_length");
        println!(
            "| TRL {} GRPOTrainer (transformers {}, torch {}) | {theirs:.3} | {} | {:.1} |",
            r["trl"].as_str().unwrap_or("?"),
            r["transformers"].as_str().unwrap_or("?"),
            r["torch"].as_str().unwrap_or("?"),
            secs(step_s),
            lengths.iter().sum::<f64>() / lengths.len().max(1) as f64
        );
        println!(
            "step time composer-rl / TRL: {:.2} (the issue's target: <= 0.5)",
            o.median_step_s / theirs
        );
    }
    let [rollout, reward, train, sync] = ours.walls_s;
    println!(
        "composer-rl's walls (medians): rollout {rollout:.3} s, reward {reward:.3} s, train \
         {train:.3} s, weight sync {sync:.3} s"
    );
    Ok(())
}

/// `f32`, `bf16` or `f16` as a candle dtype.
pub(crate) fn parse_dtype(name: &str) -> Result<candle_core::DType> {
    match name {
        "f32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "f16" => Ok(candle_core::DType::F16),
        other => anyhow::bail!("dtype {other:?} is not one of: f32, bf16, f16"),
    }
}
