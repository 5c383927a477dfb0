//! `composer-rl`: the command line. Each subcommand maps its flags onto one library call; the
//! work lives in the crates (`composer-train`, `composer-model`, `composer-env`,
//! `composer-telemetry`), so this file stays a table of contents.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

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

fn train_help() -> String {
    format!(
        "A complete example recipe (every section, with comments):\n\n{}",
        composer_train::EXAMPLE_RECIPE
    )
}

#[derive(Args)]
struct TrainArgs {
    /// Recipe (TOML). Omit to run the embedded default.
    recipe: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its last checkpoint.
    #[arg(long, value_name = "RUN_DIR")]
    resume: Option<PathBuf>,
    /// Plain log lines instead of a progress bar.
    #[arg(long)]
    quiet: bool,
    /// Override `[output] run_dir`.
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// Start a fresh run even if the run directory already holds one (its metrics and
    /// checkpoint are replaced).
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// Override `[train] steps`.
    #[arg(long)]
    steps: Option<usize>,
    /// Run as DiLoCo replica I (0-based) of the recipe's `[diloco]` section: train H inner
    /// steps, then meet the other replicas through the object store for an outer step.
    #[arg(long, value_name = "I")]
    diloco_replica_id: Option<usize>,
    /// Object store URL of the DiLoCo rendezvous (a folder path, file://, s3://BUCKET/PREFIX);
    /// overrides `[diloco] store`.
    #[arg(long, value_name = "URL", requires = "diloco_replica_id")]
    diloco_store: Option<String>,
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text.
    #[arg(long)]
    prompt: String,
    /// Render the prompt as one user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Most tokens per sample (0 = none; at most 32768).
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Samples of the prompt (1..=1024).
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
    /// Print `{"samples":[...]}` as JSON.
    #[arg(long)]
    json: bool,
    /// `cpu` or `cuda:N` (with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Batch-invariant decoding: log-probs equal `score --deterministic`'s bitwise (slower).
    #[arg(long)]
    deterministic: bool,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "ids", "batch"])))]
struct ScoreArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Text to score (tokenized without special tokens).
    #[arg(long)]
    text: Option<String>,
    /// Exact token ids to score, e.g. `--ids 1,2,3` (commas or spaces).
    #[arg(long, allow_hyphen_values = true)]
    ids: Option<String>,
    /// JSON Lines file of `{"prompt_ids":[...],"completion_ids":[...]}` rows: prints
    /// `{"rows":[{"prompt_len","completion_logprobs"}]}` (JSON, whatever --json says).
    #[arg(long, value_name = "FILE")]
    batch: Option<PathBuf>,
    /// Score under log softmax(logits / T), the sampler's distribution at temperature T.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Print `{"input_ids":[...],"next_token_logprobs":[...]}` as JSON.
    #[arg(long)]
    json: bool,
    /// Batch-invariant scoring: equal bitwise to `generate --deterministic`'s log-probs.
    #[arg(long)]
    deterministic: bool,
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args)]
struct RecordTracesArgs {
    /// Teacher checkpoint directory (Hugging Face format).
    #[arg(long, required_unless_present = "repo_tasks")]
    model: Option<PathBuf>,
    /// JSONL prompts: `prompt` or `messages` (rendered with the teacher's chat template), and
    /// `answer`.
    #[arg(long, required_unless_present = "repo_tasks")]
    data: Option<PathBuf>,
    /// Repository tasks (a `make-tasks` output, served by the recipe's `[env]` server): record
    /// a scripted teacher's episodes on each instead of sampling `--model` on `--data`.
    #[arg(long, requires_all = ["restore_from", "recipe"], conflicts_with_all = ["model", "data"])]
    repo_tasks: Option<PathBuf>,
    /// With --repo-tasks: the original repository (`make-tasks --repo`) the teacher restores
    /// the removed files from.
    #[arg(long)]
    restore_from: Option<PathBuf>,
    /// With --repo-tasks: the training recipe (`[model] path` and `[env] kind =
    /// "openenv_tools"`), so the episodes are rendered as the policy's are.
    #[arg(long)]
    recipe: Option<PathBuf>,
    /// Trace file to write (truncated unless --append).
    #[arg(long)]
    out: PathBuf,
    /// Append to --out (one store for several teachers); refused if the store's traces were
    /// recorded with another tokenizer or top-K.
    #[arg(long, conflicts_with = "repo_tasks")]
    append: bool,
    /// The teacher's name in the traces (default: the --model directory's name).
    #[arg(long, conflicts_with = "repo_tasks")]
    teacher: Option<String>,
    /// Completions per prompt.
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
    /// Top-K ids and log-probs recorded per completion token.
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature (0 = greedy); recorded log-probs are at temperature 1.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Verifier scoring completions against `answer`: exact | numeric | regex.
    #[arg(long, default_value = "numeric")]
    verifier: String,
    /// The regex verifier's pattern (`{answer}` is replaced by the escaped answer).
    #[arg(long)]
    verifier_pattern: Option<String>,
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args)]
struct PlanArgs {
    /// Plan from a run's measured walls instead of a shape.
    #[arg(long, value_name = "RUN_DIR")]
    from_run: Option<PathBuf>,
    /// Parameter count, e.g. 7e9.
    #[arg(long)]
    params: Option<f64>,
    /// Mean completion length (tokens).
    #[arg(long)]
    mean_output: Option<f64>,
    /// p95 completion length (tokens).
    #[arg(long)]
    p95_output: Option<f64>,
    /// Prompt length (tokens).
    #[arg(long)]
    prompt_tokens: Option<f64>,
    /// Completions per step.
    #[arg(long)]
    samples_per_step: Option<usize>,
    /// Mean environment/verifier latency per call (s).
    #[arg(long)]
    env_latency: Option<f64>,
    /// p95 environment latency (s).
    #[arg(long)]
    env_latency_p95: Option<f64>,
    /// Concurrent environment calls.
    #[arg(long)]
    env_concurrency: Option<usize>,
    /// Environment calls per sample.
    #[arg(long)]
    env_calls: Option<f64>,
    /// Staleness the recipe tolerates (policy versions).
    #[arg(long)]
    staleness: Option<u32>,
    /// GPU count.
    #[arg(long)]
    gpus: Option<usize>,
    /// GPU kind: h100, h200, a100, l40s, cpu.
    #[arg(long)]
    gpu: Option<String>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    hidden: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    head_dim: Option<usize>,
    /// Achievable fraction of peak FLOP/s (default 0.4).
    #[arg(long)]
    mfu: Option<f64>,
    /// Weight copies published per update.
    #[arg(long)]
    weight_copies: Option<usize>,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ServeEnvArgs {
    /// Environment: `code` (sandboxed Python tasks), `echo`, or `repo` (repository tasks
    /// with MCP tools, from `--tasks`; see REPO_ENV.md).
    env: String,
    /// Task directory of `repo` (`<id>/task.toml`, `repo/`, `visible_tests/`, `hidden_tests/`).
    #[arg(long)]
    tasks: Option<PathBuf>,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Concurrent sessions (WebSocket and HTTP `/mcp`-made) before CAPACITY_REACHED.
    #[arg(long, default_value_t = 4)]
    max_sessions: usize,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Training forward+backward and decode throughput (tokens/s) at batch 1, 16, 64.
    Model {
        /// `small` (CPU-sized), `qwen2.5-0.5b`, `qwen3-0.6b`, `qwen2.5-7b` (random weights of
        /// that shape) or `qwen-vocab` (hidden 64, 2 layers, Qwen's 151,936-token vocabulary:
        /// the LM head's memory).
        #[arg(long, default_value = "small")]
        shape: String,
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Batch sizes, comma separated.
        #[arg(long, value_delimiter = ',')]
        batch: Option<Vec<usize>>,
        /// Decode only (skip the training forward+backward).
        #[arg(long)]
        skip_train: bool,
        /// Training only (skip decoding).
        #[arg(long, conflicts_with = "skip_train")]
        skip_decode: bool,
        /// Train LoRA adapters of rank R on every projection over the frozen base.
        #[arg(long, value_name = "R")]
        lora: Option<usize>,
        /// Recompute each decoder layer's activations in the backward.
        #[arg(long)]
        gradient_checkpointing: bool,
        /// Dtype of the training step and of decoding: f32, bf16 or f16 (default: bf16 on
        /// CUDA, f32 on CPU).
        #[arg(long)]
        dtype: Option<String>,
        /// Sequence length of the training step.
        #[arg(long)]
        train_seq_len: Option<usize>,
        /// Print the numbers as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Sync vs async layouts on the embedded default with a deliberately slow verifier: wall
    /// time to the target accuracy.
    Async {
        /// Seconds added to every sample's verification.
        #[arg(long, default_value_t = 0.004)]
        reward_latency_s: f64,
        /// Staleness bounds of the async arms, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        max_staleness: Vec<u64>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 0.9)]
        target: f64,
        #[arg(long, default_value_t = 150)]
        max_steps: usize,
        #[arg(long, default_value = "runs/bench-async")]
        out_dir: PathBuf,
    },
    /// RLVR alone vs + hint vs + hint + replay on the embedded default: samples to target accuracy.
    Channels {
        /// Seeds, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
        seeds: Vec<u64>,
        #[arg(long, default_value_t = 0.9)]
        target: f64,
        #[arg(long, default_value_t = 150)]
        max_steps: usize,
        #[arg(long, default_value = "runs/bench-channels")]
        out_dir: PathBuf,
        /// Arms to run, comma separated: rlvr, hint (RLVR + hint), hint+replay.
        #[arg(long, value_delimiter = ',', default_value = "rlvr,hint,hint+replay")]
        arms: Vec<String>,
        /// Hint channel weight α in the arms with the hint channel.
        #[arg(long, default_value_t = 1.0)]
        hint_weight: f64,
        /// Replay channel weight β in the hint+replay arm.
        #[arg(long, default_value_t = 0.5)]
        replay_weight: f64,
    },
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
            let addr: SocketAddr = format!("{}:{}", a.host, a.port).parse().with_context(|| {
                format!(
                    "--host {} --port {} is not a socket address",
                    a.host, a.port
                )
            })?;
            let config = composer_env::ServeConfig {
                max_sessions: a.max_sessions,
                ..Default::default()
            };
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            eprintln!(
                "serving env `{}` on http://{addr} (WebSocket ws://{addr}/ws); Ctrl-C stops",
                a.env
            );
            runtime.block_on(composer_env::serve_env(factory, addr, config))
        }
        Command::Bench(BenchCommand::Model {
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
        }) => {
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
            if let Some(t) = train_seq_len {
                cfg.train_seq_len = t;
            }
            let report = composer_model::bench::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("{}", report.table());
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Async {
            reward_latency_s,
            max_staleness,
            seed,
            target,
            max_steps,
            out_dir,
        }) => {
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
        Command::Bench(BenchCommand::Channels {
            seeds,
            target,
            max_steps,
            out_dir,
            arms,
            hint_weight,
            replay_weight,
        }) => {
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

/// `f32`, `bf16` or `f16` as a candle dtype.
fn parse_dtype(name: &str) -> Result<candle_core::DType> {
    match name {
        "f32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "f16" => Ok(candle_core::DType::F16),
        other => anyhow::bail!("dtype {other:?} is not one of: f32, bf16, f16"),
    }
}
