//! `composer-rl`: the command line. Each subcommand maps its flags onto one library call; the
//! work lives in the crates (`composer-train`, `composer-model`, `composer-env`,
//! `composer-telemetry`), so this file stays a table of contents.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

mod args;
mod bench_cmd;
mod bench_model_cmd;

use args::{
    train_help, BenchCommand, GenerateArgs, PlanArgs, RecordTracesArgs, ScoreArgs, ServeEnvArgs,
    TrainArgs,
};

#[derive(Parser)]
#[command(
    name = "composer-rl",
    version,
    about = "RL post-training for coding-agent language models: RLVR + hint self-distillation + trace replay",
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train with a recipe (no recipe: the embedded default, which needs no download, server or GPU).
    #[command(after_long_help = train_help())]
    Train(TrainArgs),
    /// Sample completions from a Hugging Face checkpoint (token ids + sampler log-probs).
    Generate(GenerateArgs),
    /// Teacher-forced next-token log-probs of a text under a checkpoint.
    Score(ScoreArgs),
    /// Sample a teacher checkpoint on a prompt dataset and write replay traces (token ids +
    /// the teacher's top-K log-probs, reward, passed) in the trace store's JSONL format.
    RecordTraces(RecordTracesArgs),
    /// Export a LoRA checkpoint (adapter_config.json + adapter_model.safetensors): the PEFT
    /// adapter, or with `--merge` its base model with the adapter folded in (full HF weights).
    Export {
        /// The checkpoint directory (e.g. RUN_DIR/checkpoint of a `use_peft = true` run).
        checkpoint: PathBuf,
        /// Output directory (tokenizer files are copied along).
        #[arg(long)]
        out: PathBuf,
        /// Write full merged weights (config.json + model.safetensors) instead of the adapter.
        #[arg(long)]
        merge: bool,
    },
    /// Write the self-contained HTML report of a run (RUN_DIR/report.html) and print its summary.
    Report {
        /// The run directory (holds metrics.jsonl and recipe.toml).
        run_dir: PathBuf,
    },
    /// Estimate the four walls (rollout, verifier, trainer, weight sync) and recommend a layout.
    Plan(PlanArgs),
    /// List every metrics.jsonl key with its unit and meaning (the source of docs/METRICS.md).
    MetricsKeys {
        /// Print the Markdown table of docs/METRICS.md instead of plain lines.
        #[arg(long)]
        markdown: bool,
    },
    /// Serve a built-in environment over the OpenEnv protocol (HTTP + WebSocket /ws).
    ServeEnv(ServeEnvArgs),
    /// Build repository tasks from a Python repository with a test suite (one per function
    /// body and one per module that can be removed and whose tests notice; see
    /// crates/env/REPO_TASKS.md).
    MakeTasks {
        /// The Python repository (its modules and `test_*.py` files).
        #[arg(long)]
        repo: PathBuf,
        /// Output task directory (one `<id>/` per task).
        #[arg(long)]
        out: PathBuf,
    },
    /// Benchmarks: model throughput, or the channel comparison of the embedded default.
    #[command(subcommand)]
    Bench(BenchCommand),
}

fn main() -> ExitCode {
    // Before any thread starts: candle re-derives the thread count on every matmul unless
    // RAYON_NUM_THREADS is set (a user's own value is kept).
    composer_model::configure_cpu_threads();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,composer=info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run(Cli::parse()) {
        // A run stopped by SIGINT / SIGTERM (checkpoint written) exits 130 / 143.
        Ok(()) => composer_train::signals::pending()
            .map_or(ExitCode::SUCCESS, |sig| ExitCode::from(sig.exit_code())),
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) if a.diloco_replica_id.is_some() => {
            let replica_id = a.diloco_replica_id.unwrap_or_default();
            let recipe_path = a.recipe.context(
                "a DiLoCo replica needs a recipe file with a [diloco] section (RECIPE argument)",
            )?;
            // `--resume RUN_DIR` resumes this replica's own run directory.
            let run_dir_override = a.resume.clone().or(a.run_dir);
            let outcome = composer_diloco::run_replica(&composer_diloco::ReplicaOptions {
                recipe_path,
                replica_id,
                store_url: a.diloco_store,
                run_dir_override,
                max_steps_override: a.steps,
                resume: a.resume.is_some(),
                quiet: a.quiet,
            })?;
            println!(
                "replica {replica_id} run {}: {} steps, {} rounds, final greedy accuracy {}, \
                 {:.1} MB up / {:.1} MB down, {:.1} s",
                outcome.run_dir.display(),
                outcome.steps_completed,
                outcome.rounds,
                outcome
                    .final_accuracy
                    .map_or("n/a".to_string(), |a| format!("{:.1}%", 100.0 * a)),
                outcome.bytes_up as f64 / 1e6,
                outcome.bytes_down as f64 / 1e6,
                outcome.wall_s
            );
            Ok(())
        }
        Command::Train(a) => {
            let outcome = composer_train::run_train(&composer_train::TrainOptions {
                recipe_path: a.recipe,
                resume: a.resume,
                quiet: a.quiet,
                run_dir_override: a.run_dir,
                max_steps_override: a.steps,
                overwrite: a.overwrite,
            })?;
            println!(
                "run {}: {} steps, final greedy accuracy {}, {:.1} s",
                outcome.run_dir.display(),
                outcome.steps_completed,
                outcome
                    .final_accuracy
                    .map_or("n/a".to_string(), |a| format!("{:.1}%", 100.0 * a)),
                outcome.wall_s
            );
            Ok(())
        }
        Command::Generate(a) => {
            // Refuse an absurd request before the model loads, not after minutes of decoding
            // or an out-of-memory kill.
            check_generate_budget(a.num_samples, a.max_new_tokens)?;
            let json = a.json;
            let out = composer_model::generate_cli(&composer_model::GenerateOptions {
                model_dir: a.model,
                prompt: a.prompt,
                chat: a.chat,
                max_new_tokens: a.max_new_tokens,
                temperature: a.temperature,
                top_p: a.top_p,
                top_k: a.top_k,
                min_p: a.min_p,
                seed: a.seed,
                num_samples: a.num_samples,
                device: a.device,
                deterministic: a.deterministic,
            })?;
            if json {
                println!("{}", serde_json::to_string(&out)?);
            } else {
                for (i, s) in out["samples"].as_array().into_iter().flatten().enumerate() {
                    println!(
                        "--- sample {i} ({})",
                        s["finish_reason"].as_str().unwrap_or("?")
                    );
                    println!("{}", s["completion_text"].as_str().unwrap_or(""));
                }
            }
            Ok(())
        }
        Command::RecordTraces(a) => {
            let out = a.out.clone();
            if let (Some(tasks_dir), Some(restore_from), Some(recipe)) =
                (a.repo_tasks, a.restore_from, a.recipe)
            {
                let summary = composer_train::record_episodes::record_repo_episodes(
                    &composer_train::record_episodes::RecordEpisodesOptions {
                        recipe,
                        tasks_dir,
                        restore_from,
                        out: a.out,
                    },
                )?;
                println!(
                    "wrote {} teacher episodes ({} passed) to {}; {} tasks have no passing episode",
                    summary.traces,
                    summary.passed,
                    out.display(),
                    summary.prompts_without_pass
                );
                return Ok(());
            }
            let (Some(model_dir), Some(data)) = (a.model, a.data) else {
                anyhow::bail!("record-traces needs --model and --data (or --repo-tasks)");
            };
            let summary = composer_train::record_traces::record_traces(
                &composer_train::record_traces::RecordTracesOptions {
                    model_dir,
                    data,
                    out: a.out,
                    append: a.append,
                    teacher: a.teacher,
                    num_samples: a.num_samples,
                    top_k: a.top_k,
                    max_new_tokens: a.max_new_tokens,
                    temperature: a.temperature,
                    seed: a.seed,
                    verifier: a.verifier,
                    verifier_pattern: a.verifier_pattern,
                    device: a.device,
                },
            )?;
            println!(
                "wrote {} traces ({} passed) to {}; {} prompts have no passing trace",
                summary.traces,
                summary.passed,
                out.display(),
                summary.prompts_without_pass
            );
            Ok(())
        }
        Command::Score(a) => {
            let input = match (a.text, a.ids, a.batch) {
                (Some(t), _, _) => composer_model::ScoreInput::Text(t),
                (_, Some(ids), _) => composer_model::ScoreInput::Ids(ids),
                (_, _, Some(f)) => composer_model::ScoreInput::Batch(f),
                (None, None, None) => anyhow::bail!("score needs --text, --ids or --batch"),
            };
            let batch = matches!(input, composer_model::ScoreInput::Batch(_));
            let out = composer_model::score_cli(&composer_model::ScoreOptions {
                model_dir: a.model,
                input,
                temperature: a.temperature,
                device: a.device,
                deterministic: a.deterministic,
            })?;
            if a.json || batch {
                println!("{}", serde_json::to_string(&out)?);
            } else {
                let ids = out["input_ids"].as_array().cloned().unwrap_or_default();
                let lps = out["next_token_logprobs"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                for (t, lp) in lps.iter().enumerate() {
                    println!(
                        "{:>5} {:>8} {:>10.5}",
                        t + 1,
                        ids[t + 1],
                        lp.as_f64().unwrap_or(f64::NAN)
                    );
                }
            }
            Ok(())
        }
        Command::MakeTasks { repo, out } => {
            let report = composer_env::repo::make_tasks(&repo, &out)?;
            for id in &report.created {
                println!("created {id}");
            }
            for (what, why) in &report.skipped {
                println!("skipped {what}: {why}");
            }
            for (test, error) in &report.failing_on_original {
                println!("not used (fails on the original): {test}: {error}");
            }
            Ok(())
        }
        Command::Export {
            checkpoint,
            out,
            merge,
        } => {
            if !checkpoint.is_dir() {
                anyhow::bail!(
                    "export {}: no such checkpoint directory",
                    checkpoint.display()
                );
            }
            composer_model::lora::export_adapter(&checkpoint, &out, merge)?;
            println!("wrote {}", out.display());
            Ok(())
        }
        Command::Report { run_dir } => {
            println!("{}", composer_telemetry::report::report_cli(&run_dir)?);
            Ok(())
        }
        Command::Plan(a) => {
            let opts = composer_plan::PlanOptions {
                from_run: a.from_run,
                params: a.params,
                mean_output: a.mean_output,
                p95_output: a.p95_output,
                prompt_tokens: a.prompt_tokens,
                samples_per_step: a.samples_per_step,
                env_latency: a.env_latency,
                env_latency_p95: a.env_latency_p95,
                env_concurrency: a.env_concurrency,
                env_calls: a.env_calls,
                staleness: a.staleness,
                gpus: a.gpus,
                gpu: a.gpu,
                layers: a.layers,
                hidden: a.hidden,
                kv_heads: a.kv_heads,
                head_dim: a.head_dim,
                mfu: a.mfu,
                weight_copies: a.weight_copies,
                json: a.json,
            };
            println!("{}", composer_plan::plan_cli(&opts)?);
            Ok(())
        }
        Command::MetricsKeys { markdown } => {
            use composer_telemetry::metric_keys;
            if markdown {
                print!("{}", metric_keys::markdown());
            } else {
                for k in metric_keys::ALL {
                    println!("{:<28} {:<9} {}", k.name, k.unit.as_str(), k.description);
                }
            }
            Ok(())
        }
        Command::ServeEnv(a) => {
            let factory = match (a.env.as_str(), &a.tasks) {
                ("repo", Some(dir)) => composer_env::repo::RepoEnv::factory(
                    dir,
                    composer_env::repo::EpisodeBudget::default(),
                )
                .with_context(|| {
                    format!("loading repository tasks from --tasks {}", dir.display())
                })?,
                ("repo", None) => anyhow::bail!("serve-env repo needs --tasks DIR"),
                (other, Some(_)) => {
                    anyhow::bail!("--tasks is for `serve-env repo`, not `serve-env {other}`")
                }
                (other, None) => composer_env::builtin_env_factory(other)?,
            };
            // A name (`localhost`) as well as an address: the first address it resolves to.
            let addr: SocketAddr =
                std::net::ToSocketAddrs::to_socket_addrs(&(a.host.as_str(), a.port))
                    .ok()
                    .and_then(|mut it| it.next())
                    .with_context(|| {
                        format!(
                            "--host {} --port {}: not an address or a name that resolves to one",
                            a.host, a.port
                        )
                    })?;
            let config = composer_env::ServeConfig {
                max_sessions: a.max_sessions,
                ..Default::default()
            };
            if a.max_sessions == 0 {
                anyhow::bail!("--max-sessions must be at least 1 (every session would be refused)");
            }
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let env = a.env.clone();
            runtime.block_on(composer_env::serve_env(factory, addr, config, |bound| {
                eprintln!(
                    "serving env `{env}` on http://{bound} (WebSocket ws://{bound}/ws); Ctrl-C stops"
                )
            }))
        }
        Command::Bench(cmd) => bench_cmd::run(cmd),
    }
}

/// Most `--max-new-tokens` of `generate`: longer than any supported model's context.
const MAX_NEW_TOKENS_LIMIT: usize = 32_768;
/// Most `--num-samples` of `generate` (all are decoded as one batch).
const NUM_SAMPLES_LIMIT: usize = 1024;
/// Most tokens of one `generate` call (samples × new tokens): the KV cache of the whole batch
/// is held at once, so beyond this a run spends minutes or exhausts memory.
const GENERATE_TOKEN_BUDGET: usize = 1 << 20;

/// Refuses `generate` flags outside a sane budget, naming the flag.
fn check_generate_budget(num_samples: usize, max_new_tokens: usize) -> Result<()> {
    if num_samples == 0 || num_samples > NUM_SAMPLES_LIMIT {
        anyhow::bail!(
            "--num-samples {num_samples} is out of range; allowed: 1..={NUM_SAMPLES_LIMIT}"
        );
    }
    if max_new_tokens > MAX_NEW_TOKENS_LIMIT {
        anyhow::bail!(
            "--max-new-tokens {max_new_tokens} is out of range; allowed: 0..={MAX_NEW_TOKENS_LIMIT}"
        );
    }
    let total = num_samples.saturating_mul(max_new_tokens);
    if total > GENERATE_TOKEN_BUDGET {
        anyhow::bail!(
            "--num-samples {num_samples} × --max-new-tokens {max_new_tokens} = {total} tokens is \
             over the budget of {GENERATE_TOKEN_BUDGET} tokens per call; lower either flag"
        );
    }
    Ok(())
}
