//! The flags of each subcommand (clap derive structs), kept apart from the dispatch in
//! `main.rs`.

use std::path::PathBuf;

use clap::{Args, Subcommand};

pub(crate) fn train_help() -> String {
    format!(
        "A complete example recipe (every section, with comments):\n\n{}",
        composer_train::EXAMPLE_RECIPE
    )
}

#[derive(Args)]
pub(crate) struct TrainArgs {
    /// Recipe (TOML). Omit to run the embedded default.
    pub(crate) recipe: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its last checkpoint.
    #[arg(long, value_name = "RUN_DIR")]
    pub(crate) resume: Option<PathBuf>,
    /// Plain log lines instead of a progress bar.
    #[arg(long)]
    pub(crate) quiet: bool,
    /// Override `[output] run_dir`.
    #[arg(long, value_name = "DIR")]
    pub(crate) run_dir: Option<PathBuf>,
    /// Start a fresh run even if the run directory already holds one (its metrics and
    /// checkpoint are replaced).
    #[arg(long, conflicts_with = "resume")]
    pub(crate) overwrite: bool,
    /// Override `[train] steps`.
    #[arg(long)]
    pub(crate) steps: Option<usize>,
    /// Run as DiLoCo replica I (0-based) of the recipe's `[diloco]` section: train H inner
    /// steps, then meet the other replicas through the object store for an outer step.
    #[arg(long, value_name = "I")]
    pub(crate) diloco_replica_id: Option<usize>,
    /// Object store URL of the DiLoCo rendezvous (a folder path, file://, s3://BUCKET/PREFIX);
    /// overrides `[diloco] store`.
    #[arg(long, value_name = "URL", requires = "diloco_replica_id")]
    pub(crate) diloco_store: Option<String>,
}

#[derive(Args)]
pub(crate) struct GenerateArgs {
    /// Checkpoint directory (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Prompt text.
    #[arg(long)]
    pub(crate) prompt: String,
    /// Render the prompt as one user message through the model's chat template.
    #[arg(long)]
    pub(crate) chat: bool,
    /// Most tokens per sample (0 = none; at most 32768).
    #[arg(long, default_value_t = 64)]
    pub(crate) max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_p: f64,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub(crate) top_k: usize,
    /// Keep tokens with p >= min_p * p_max (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) min_p: f64,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Samples of the prompt (1..=1024).
    #[arg(long, default_value_t = 1)]
    pub(crate) num_samples: usize,
    /// Print `{"samples":[...]}` as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// `cpu` or `cuda:N` (with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Batch-invariant decoding: log-probs equal `score --deterministic`'s bitwise (slower).
    #[arg(long)]
    pub(crate) deterministic: bool,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "ids", "batch"])))]
pub(crate) struct ScoreArgs {
    /// Checkpoint directory.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Text to score (tokenized without special tokens).
    #[arg(long)]
    pub(crate) text: Option<String>,
    /// Exact token ids to score, e.g. `--ids 1,2,3` (commas or spaces).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) ids: Option<String>,
    /// JSON Lines file of `{"prompt_ids":[...],"completion_ids":[...]}` rows: prints
    /// `{"rows":[{"prompt_len","completion_logprobs"}]}` (JSON, whatever --json says).
    #[arg(long, value_name = "FILE")]
    pub(crate) batch: Option<PathBuf>,
    /// Score under log softmax(logits / T), the sampler's distribution at temperature T.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) temperature: f64,
    /// Print `{"input_ids":[...],"next_token_logprobs":[...]}` as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// Batch-invariant scoring: equal bitwise to `generate --deterministic`'s log-probs.
    #[arg(long)]
    pub(crate) deterministic: bool,
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

#[derive(Args)]
pub(crate) struct RecordTracesArgs {
    /// Teacher checkpoint directory (Hugging Face format).
    #[arg(long, required_unless_present = "repo_tasks")]
    pub(crate) model: Option<PathBuf>,
    /// JSONL prompts: `prompt` or `messages` (rendered with the teacher's chat template), and
    /// `answer`.
    #[arg(long, required_unless_present = "repo_tasks")]
    pub(crate) data: Option<PathBuf>,
    /// Repository tasks (a `make-tasks` output, served by the recipe's `[env]` server): record
    /// a scripted teacher's episodes on each instead of sampling `--model` on `--data`.
    #[arg(long, requires_all = ["restore_from", "recipe"], conflicts_with_all = ["model", "data"])]
    pub(crate) repo_tasks: Option<PathBuf>,
    /// With --repo-tasks: the original repository (`make-tasks --repo`) the teacher restores
    /// the removed files from.
    #[arg(long)]
    pub(crate) restore_from: Option<PathBuf>,
    /// With --repo-tasks: the training recipe (`[model] path` and `[env] kind =
    /// "openenv_tools"`), so the episodes are rendered as the policy's are.
    #[arg(long)]
    pub(crate) recipe: Option<PathBuf>,
    /// Trace file to write (truncated unless --append).
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Append to --out (one store for several teachers); refused if the store's traces were
    /// recorded with another tokenizer or top-K.
    #[arg(long, conflicts_with = "repo_tasks")]
    pub(crate) append: bool,
    /// The teacher's name in the traces (default: the --model directory's name).
    #[arg(long, conflicts_with = "repo_tasks")]
    pub(crate) teacher: Option<String>,
    /// Completions per prompt.
    #[arg(long, default_value_t = 1)]
    pub(crate) num_samples: usize,
    /// Top-K ids and log-probs recorded per completion token.
    #[arg(long, default_value_t = 8)]
    pub(crate) top_k: usize,
    #[arg(long, default_value_t = 64)]
    pub(crate) max_new_tokens: usize,
    /// Sampling temperature (0 = greedy); recorded log-probs are at temperature 1.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) temperature: f64,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Verifier scoring completions against `answer`: exact | numeric | regex.
    #[arg(long, default_value = "numeric")]
    pub(crate) verifier: String,
    /// The regex verifier's pattern (`{answer}` is replaced by the escaped answer).
    #[arg(long)]
    pub(crate) verifier_pattern: Option<String>,
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

#[derive(Args)]
pub(crate) struct PlanArgs {
    /// Plan from a run's measured walls instead of a shape.
    #[arg(long, value_name = "RUN_DIR")]
    pub(crate) from_run: Option<PathBuf>,
    /// Parameter count, e.g. 7e9.
    #[arg(long)]
    pub(crate) params: Option<f64>,
    /// Mean completion length (tokens).
    #[arg(long)]
    pub(crate) mean_output: Option<f64>,
    /// p95 completion length (tokens).
    #[arg(long)]
    pub(crate) p95_output: Option<f64>,
    /// Prompt length (tokens).
    #[arg(long)]
    pub(crate) prompt_tokens: Option<f64>,
    /// Completions per step.
    #[arg(long)]
    pub(crate) samples_per_step: Option<usize>,
    /// Mean environment/verifier latency per call (s).
    #[arg(long)]
    pub(crate) env_latency: Option<f64>,
    /// p95 environment latency (s).
    #[arg(long)]
    pub(crate) env_latency_p95: Option<f64>,
    /// Concurrent environment calls.
    #[arg(long)]
    pub(crate) env_concurrency: Option<usize>,
    /// Environment calls per sample.
    #[arg(long)]
    pub(crate) env_calls: Option<f64>,
    /// Staleness the recipe tolerates (policy versions).
    #[arg(long)]
    pub(crate) staleness: Option<u32>,
    /// GPU count.
    #[arg(long)]
    pub(crate) gpus: Option<usize>,
    /// GPU kind: h100, h200, a100, l40s, cpu.
    #[arg(long)]
    pub(crate) gpu: Option<String>,
    #[arg(long)]
    pub(crate) layers: Option<usize>,
    #[arg(long)]
    pub(crate) hidden: Option<usize>,
    #[arg(long)]
    pub(crate) kv_heads: Option<usize>,
    #[arg(long)]
    pub(crate) head_dim: Option<usize>,
    /// Achievable fraction of peak FLOP/s (default 0.4).
    #[arg(long)]
    pub(crate) mfu: Option<f64>,
    /// Weight copies published per update.
    #[arg(long)]
    pub(crate) weight_copies: Option<usize>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args)]
pub(crate) struct BenchModelArgs {
    /// `small` (CPU-sized), `qwen2.5-0.5b`, `qwen3-0.6b`, `qwen2.5-7b` (random weights of
    /// that shape) or `qwen-vocab` (hidden 64, 2 layers, Qwen's 151,936-token vocabulary:
    /// the LM head's memory).
    #[arg(long, default_value = "small")]
    pub(crate) shape: String,
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Batch sizes, comma separated.
    #[arg(long, value_delimiter = ',')]
    pub(crate) batch: Option<Vec<usize>>,
    /// Decode only (skip the training forward+backward).
    #[arg(long)]
    pub(crate) skip_train: bool,
    /// Training only (skip decoding).
    #[arg(long, conflicts_with = "skip_train")]
    pub(crate) skip_decode: bool,
    /// Train LoRA adapters of rank R on every projection over the frozen base.
    #[arg(long, value_name = "R")]
    pub(crate) lora: Option<usize>,
    /// Recompute each decoder layer's activations in the backward.
    #[arg(long)]
    pub(crate) gradient_checkpointing: bool,
    /// Train padding-free: each batch's rows packed as segments of one row (the varlen
    /// attention kernel instead of attention over the padded batch).
    #[arg(long)]
    pub(crate) padding_free: bool,
    /// Dtype of the training step and of decoding: f32, bf16 or f16 (default: bf16 on
    /// CUDA, f32 on CPU).
    #[arg(long)]
    pub(crate) dtype: Option<String>,
    /// Sequence length of the training step.
    #[arg(long)]
    pub(crate) train_seq_len: Option<usize>,
    /// Prompt tokens of each decoded sample (default 128 on the model shapes): a long prompt
    /// times the decode over a long context, where the attention's keys dominate.
    #[arg(long, conflicts_with = "skip_decode")]
    pub(crate) prompt_len: Option<usize>,
    /// Also decode with the engine's fixed-shape steps captured as CUDA graphs
    /// (`[rollout] cuda_graphs`), timed beside the plain decode in the same run.
    #[arg(long, conflicts_with = "skip_decode")]
    pub(crate) cuda_graphs: bool,
    /// Also run PyTorch's side (tools/bench_torch.py: transformers, sdpa, eager) on the same
    /// shape, batch, sequence and dtype, before ours, and print both with ratios.
    #[arg(long, conflicts_with = "skip_train")]
    pub(crate) torch: bool,
    /// With --torch, also PyTorch with `torch.compile` (training only).
    #[arg(long, requires = "torch")]
    pub(crate) torch_compile: bool,
    /// Python for --torch: torch and transformers (peft for --lora) (default:
    /// $COMPOSER_BENCH_PYTHON, else python3).
    #[arg(long, requires = "torch")]
    pub(crate) python: Option<PathBuf>,
    /// The card's peak dense FLOP/s in TFLOP/s for MFU (default: from its name: H100/H200
    /// 989, A100 312; none on the CPU).
    #[arg(long)]
    pub(crate) peak_tflops: Option<f64>,
    /// Print the numbers as JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args)]
pub(crate) struct ServeEnvArgs {
    /// Environment: `code` (sandboxed Python tasks), `echo`, or `repo` (repository tasks
    /// with MCP tools, from `--tasks`; see REPO_ENV.md).
    pub(crate) env: String,
    /// Task directory of `repo` (`<id>/task.toml`, `repo/`, `visible_tests/`, `hidden_tests/`).
    #[arg(long)]
    pub(crate) tasks: Option<PathBuf>,
    #[arg(long, default_value_t = 8000)]
    pub(crate) port: u16,
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) host: String,
    /// Concurrent sessions (WebSocket and HTTP `/mcp`-made) before CAPACITY_REACHED.
    #[arg(long, default_value_t = 4)]
    pub(crate) max_sessions: usize,
}

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// Training forward+backward and decode throughput (tokens/s) at batch 1, 16, 64; with
    /// `--torch`, PyTorch's eager (and `--torch-compile`'s compiled) side on the same card in
    /// the same run, with peak memory, MFU and ratios.
    Model(BenchModelArgs),
    /// Sync vs async layouts on the embedded default with a deliberately slow verifier: wall
    /// time to the target accuracy.
    Async(BenchAsyncArgs),
    /// Decode throughput of the rollout engine on an HF checkpoint (CPU, f32) side by side with
    /// transformers' `generate` on the same prompt ids, and deterministic mode's
    /// sampler-vs-scorer log-prob difference.
    Rollout(BenchRolloutArgs),
    /// Whole GRPO steps (rollout, reward, train, weight publish) of the trainer on an HF
    /// checkpoint beside TRL's GRPOTrainer on the same checkpoint, prompts and shape
    /// (tools/bench_grpo_trl.py via --python): median step seconds and their ratio.
    Grpo(BenchGrpoArgs),
    /// RLVR alone vs + hint vs + hint + replay on the embedded default: samples to target accuracy.
    Channels(BenchChannelsArgs),
}

// The stopping rule of the embedded default's comparisons (`bench async`, `bench channels`):
// a run stops at the target greedy accuracy or after the step budget.
#[derive(Args)]
pub(crate) struct BenchStopArgs {
    #[arg(long, default_value_t = 0.9)]
    pub(crate) target: f64,
    #[arg(long, default_value_t = 150)]
    pub(crate) max_steps: usize,
}

#[derive(Args)]
pub(crate) struct BenchAsyncArgs {
    /// Seconds added to every sample's verification.
    #[arg(long, default_value_t = 0.004)]
    pub(crate) reward_latency_s: f64,
    /// Staleness bounds of the async arms, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub(crate) max_staleness: Vec<u64>,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    #[command(flatten)]
    pub(crate) stop: BenchStopArgs,
    #[arg(long, default_value = "runs/bench-async")]
    pub(crate) out_dir: PathBuf,
}

#[derive(Args)]
pub(crate) struct BenchRolloutArgs {
    /// `decode`: the engine's decode tokens/s vs transformers' `generate` on one prompt
    /// (`--batch` samples × `--new-tokens`); `grpo`: a GRPO-shaped rollout (`--prompts` ×
    /// `--group` samples, up to `--new-tokens`, spread completion lengths) under static
    /// batches vs continuous batching vs all at once, with the prefill saved by prefix
    /// sharing.
    #[arg(long, default_value = "decode")]
    pub(crate) workload: String,
    /// HF checkpoint directory.
    #[arg(long, default_value = "../shared/fixtures/hf-tiny/qwen2-tiny")]
    pub(crate) model: PathBuf,
    /// Random weights of this shape instead of `--model`'s (`small`, `h256-l4`,
    /// `qwen2.5-0.5b`, `qwen3-0.6b`, `qwen2.5-7b`); `--model` gives the tokenizer.
    #[arg(long)]
    pub(crate) shape: Option<String>,
    /// `cpu`, `cuda` or `cuda:N` (`decode` off the CPU needs --skip-reference: transformers'
    /// side runs on the CPU).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// f32, bf16 or f16 (default: bf16 on CUDA, f32 on CPU).
    #[arg(long)]
    pub(crate) dtype: Option<String>,
    /// `decode`: samples decoded together.
    #[arg(long, default_value_t = 8)]
    pub(crate) batch: usize,
    /// New tokens per sample: exactly this many (`decode`, default 128), at most this
    /// many (`grpo`, default 256).
    #[arg(long)]
    pub(crate) new_tokens: Option<usize>,
    /// Timed runs per side / arm after one warm-up (medians are compared).
    #[arg(long, default_value_t = 3)]
    pub(crate) repeats: usize,
    /// `decode`: the prompt text.
    #[arg(
        long,
        default_value = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    )]
    pub(crate) prompt: String,
    /// `grpo`: prompts.
    #[arg(long, default_value_t = 16)]
    pub(crate) prompts: usize,
    /// `grpo`: samples per prompt.
    #[arg(long, default_value_t = 8)]
    pub(crate) group: usize,
    /// `grpo`: rows the static and continuous arms hold at once (a multiple of --group).
    #[arg(long, default_value_t = 32)]
    pub(crate) max_running: usize,
    /// `grpo`: prompt lengths, `LO..HI` (spread evenly over the prompts) or one length.
    #[arg(long, default_value = "64..256")]
    pub(crate) prompt_len: String,
    /// `grpo`: every N-th token id stops a sample (completion lengths roughly geometric
    /// with mean N under a random model's near-uniform logits, capped at --new-tokens).
    #[arg(long, default_value_t = 96)]
    pub(crate) mean_completion: usize,
    /// The engine's decode steps replayed as CUDA graphs (`[rollout] cuda_graphs`): `decode`
    /// runs the engine so; `grpo` adds the continuous arm so.
    #[arg(long)]
    pub(crate) cuda_graphs: bool,
    #[command(flatten)]
    pub(crate) reference: ReferenceArgs,
    /// Print the numbers as JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args)]
pub(crate) struct BenchGrpoArgs {
    /// HF checkpoint directory (with --shape: where the tokenizer comes from).
    #[arg(long, default_value = "../shared/fixtures/hf-tiny/qwen2-tiny")]
    pub(crate) model: PathBuf,
    /// Random weights of this shape (`small`, `h256-l4`, `qwen2.5-0.5b`, `qwen3-0.6b`, …)
    /// written as an HF checkpoint with --model's tokenizer; both sides train it.
    #[arg(long)]
    pub(crate) shape: Option<String>,
    /// Prompts per step.
    #[arg(long, default_value_t = 8)]
    pub(crate) prompts: usize,
    /// Samples per prompt (num_generations).
    #[arg(long, default_value_t = 8)]
    pub(crate) group: usize,
    /// Most new tokens per sample (TRL is forced to exactly this many).
    #[arg(long, default_value_t = 16)]
    pub(crate) new_tokens: usize,
    /// Steps per side; the first is a warm-up, the median of the rest is compared.
    #[arg(long, default_value_t = 4)]
    pub(crate) steps: usize,
    /// The loss (TRL's loss_type).
    #[arg(long, default_value = "dapo")]
    pub(crate) loss_type: String,
    #[arg(long, default_value_t = 1e-6)]
    pub(crate) learning_rate: f64,
    /// `cpu`, `cuda` or `cuda:N` (both sides).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// bf16 compute on both sides (f32 masters on ours, TRL's `bf16=True`).
    #[arg(long)]
    pub(crate) bf16: bool,
    /// Where the prompts, recipe and run go.
    #[arg(long, default_value = "runs/bench-grpo")]
    pub(crate) out_dir: PathBuf,
    #[command(flatten)]
    pub(crate) reference: ReferenceArgs,
    /// Print the numbers as JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args)]
pub(crate) struct BenchChannelsArgs {
    /// Seeds, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    pub(crate) seeds: Vec<u64>,
    #[command(flatten)]
    pub(crate) stop: BenchStopArgs,
    #[arg(long, default_value = "runs/bench-channels")]
    pub(crate) out_dir: PathBuf,
    /// Arms to run, comma separated: rlvr, hint (RLVR + hint), hint+replay.
    #[arg(long, value_delimiter = ',', default_value = "rlvr,hint,hint+replay")]
    pub(crate) arms: Vec<String>,
    /// Hint channel weight α in the arms with the hint channel.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) hint_weight: f64,
    /// Replay channel weight β in the hint+replay arm.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) replay_weight: f64,
}

/// The Python reference side of `bench rollout` (`decode`: transformers' `generate`) and
/// `bench grpo` (TRL 1.16's GRPOTrainer), run in a subprocess beside ours.
#[derive(Args)]
pub(crate) struct ReferenceArgs {
    /// Python for the reference side: torch and transformers (`bench rollout`), plus datasets
    /// and trl 1.16 (`bench grpo`) (default: $COMPOSER_BENCH_PYTHON, else python3).
    #[arg(long)]
    pub(crate) python: Option<PathBuf>,
    /// Only composer-rl's side, no reference.
    #[arg(long)]
    pub(crate) skip_reference: bool,
}
