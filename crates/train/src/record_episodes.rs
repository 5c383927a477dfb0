//! `composer-rl record-traces --repo-tasks DIR --restore-from SRC --recipe R`: teacher
//! episodes on repository tasks for the replay channel. A scripted honest teacher plays each
//! task against the recipe's OpenEnv tool server exactly as the policy would (same chat
//! format, tokenizer, tool-call syntax and limits): it writes back every removed file from
//! the original repository `SRC`, runs the visible tests, then submits. Each episode is
//! written in the trace format ([`crate::tool_env::episode_trace`]: the tool results masked
//! out), with the grader's reward.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use composer_env::{run_episode, EpisodeConfig, OpenEnvClient, ResetOptions, TurnEnd, TurnOutput};
use composer_env::{Env, TurnPolicy};
use composer_loss::TraceWriter;
use serde_json::json;
use tokenizers::Tokenizer;

use crate::env_rollout::{client_config, server_url, wrap_observation};
use crate::recipe::EnvSection;
use crate::record_traces::RecordSummary;
use crate::tokenizer as chartok;
use crate::tool_calls::{format_tool_call, ToolChat};
use crate::tool_env::{episode_trace, ToolChatEnv};

/// The teacher name written into every trace.
pub const SCRIPTED_TEACHER: &str = "scripted-restore";

/// What to record.
#[derive(Debug, Clone)]
pub struct RecordEpisodesOptions {
    /// The training recipe: `[model] path` (tokenizer and chat template) and `[env]` (kind
    /// `openenv_tools`: the server, the chat format, turn and token limits, `pass_reward`).
    pub recipe: PathBuf,
    /// The task directory the server serves (each task's `[[removed]]` files).
    pub tasks_dir: PathBuf,
    /// The original repository the tasks were made from (`make-tasks --repo`).
    pub restore_from: PathBuf,
    /// Trace file to write (JSONL, truncated).
    pub out: PathBuf,
}

/// Plays fixed turns (each ends with the template's stop token), tokenised as the policy's
/// turns are.
struct ScriptedTeacher<'a> {
    tok: &'a Tokenizer,
    section: &'a EnvSection,
    eos_id: u32,
    turns: Vec<String>,
    next: usize,
}

#[async_trait]
impl TurnPolicy for ScriptedTeacher<'_> {
    async fn generate_turn(&mut self, _ctx: &[u32], max_new: usize) -> Result<TurnOutput> {
        let text = self.turns.get(self.next).cloned().unwrap_or_default();
        self.next += 1;
        let mut ids = chartok::encode(self.tok, &text)?;
        ids.push(self.eos_id);
        let finish_reason = if ids.len() > max_new {
            TurnEnd::Length
        } else {
            TurnEnd::Stop
        };
        ids.truncate(max_new);
        Ok(TurnOutput {
            sampler_logprobs: vec![0.0; ids.len()],
            token_ids: ids,
            policy_version: 0,
            finish_reason,
        })
    }
    fn encode(&self, text: &str) -> Vec<u32> {
        chartok::encode(self.tok, text).unwrap_or_default()
    }
    fn decode(&self, ids: &[u32]) -> String {
        chartok::decode(self.tok, ids)
    }
    fn encode_observation(&self, text: &str, turn: usize) -> Vec<u32> {
        self.encode(&wrap_observation(
            &self.section.prompt_template,
            &self.section.observation_template,
            text,
            turn,
        ))
    }
}

/// The honest teacher's turns for one task: write back each removed file and run the
/// visible tests; then submit.
fn teacher_turns(files: &[(String, String)]) -> Vec<String> {
    let mut first: String = files
        .iter()
        .map(|(path, content)| {
            format_tool_call("write_file", &json!({"path": path, "content": content}))
        })
        .collect::<Vec<_>>()
        .join("\n");
    first.push('\n');
    first.push_str(&format_tool_call("run_tests", &json!({})));
    vec![first, format_tool_call("submit", &json!({}))]
}

/// `(repo-relative path, original text)` of the files one task removed.
type RestoredFiles = Vec<(String, String)>;

/// Each task's id and the original text of the files it removed. Errors name the task and
/// the file, before any episode runs.
fn restore_plan(tasks_dir: &Path, restore_from: &Path) -> Result<Vec<(String, RestoredFiles)>> {
    let tasks = composer_env::repo::load_tasks(tasks_dir)
        .with_context(|| format!("--repo-tasks {}", tasks_dir.display()))?;
    let mut plan = Vec::with_capacity(tasks.len());
    for task in &tasks {
        if task.spec.removed.is_empty() {
            bail!(
                "task {}: task.toml has no [[removed]] entry, so there is nothing to restore",
                task.id()
            );
        }
        let mut files = Vec::new();
        for r in &task.spec.removed {
            let path = restore_from.join(&r.file);
            let text = std::fs::read_to_string(&path).with_context(|| {
                format!(
                    "task {}: reading the original of `{}` from --restore-from ({})",
                    task.id(),
                    r.file,
                    path.display()
                )
            })?;
            files.push((r.file.clone(), text));
        }
        plan.push((task.id().to_string(), files));
    }
    Ok(plan)
}

/// Plays the scripted teacher on every task of `o.tasks_dir` and writes the traces.
pub fn record_repo_episodes(o: &RecordEpisodesOptions) -> Result<RecordSummary> {
    let recipe = crate::recipe::load_recipe(&o.recipe)?;
    let at = o.recipe.display();
    let section = match &recipe.env {
        Some(s) if s.kind == "openenv_tools" => s.clone(),
        _ => bail!(
            "{at}: key `[env] kind` must be \"openenv_tools\" to record repository episodes \
             (the teacher plays the recipe's tool server)"
        ),
    };
    if section.max_turns < 2 {
        bail!(
            "{at}: key `[env] max_turns` is {}; the teacher needs 2 turns (restore and test, \
             then submit)",
            section.max_turns
        );
    }
    let model_dir = recipe.model.path.clone().with_context(|| {
        format!("{at}: key `[model] path`: the teacher needs the checkpoint's tokenizer")
    })?;
    let tok = composer_model::Tokenizer::from_dir(&model_dir)?;
    let template = composer_model::ChatTemplate::from_dir(&model_dir, Some(&tok))?;
    let chat: Arc<ToolChat> = crate::tool_env::tool_chat_for(&section, template.as_ref())?;
    let eos = chat.eos_token().to_string();
    if eos.is_empty() {
        bail!(
            "{}: the checkpoint names no eos_token, so a turn cannot end",
            model_dir.display()
        );
    }
    let eos_id = chartok::token_id(&tok.inner, &eos)
        .with_context(|| format!("{}: the stop token", model_dir.display()))?;
    let plan = restore_plan(&o.tasks_dir, &o.restore_from)?;

    let url = server_url(&section)?;
    let url = url.split(',').next().unwrap_or(&url).trim().to_string();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let client = runtime
        .block_on(OpenEnvClient::connect(&url, client_config(&section)))
        .with_context(|| format!("key `[env] url`: OpenEnv server {url}"))?;
    let cfg = EpisodeConfig {
        max_turns: section.max_turns,
        max_total_tokens: section.max_total_tokens,
    };
    let mut writer = TraceWriter::create(&o.out).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut summary = RecordSummary {
        traces: 0,
        passed: 0,
        prompts_without_pass: 0,
    };
    for (id, files) in plan {
        let mut teacher = ScriptedTeacher {
            tok: &tok.inner,
            section: &section,
            eos_id,
            turns: teacher_turns(&files),
            next: 0,
        };
        let ep = runtime.block_on(async {
            let mut env = ToolChatEnv::new(client.tool_session(), chat.clone());
            let reset = ResetOptions {
                task_id: Some(id.clone()),
                ..Default::default()
            };
            let ep = run_episode(&mut teacher, &mut env, reset, &cfg).await;
            let _ = env.close().await;
            ep
        })?;
        if let composer_env::EpisodeEnd::EnvFailed { message, .. } = &ep.end {
            bail!("task {id}: the episode failed: {message}");
        }
        let Some(trace) = episode_trace(&ep, SCRIPTED_TEACHER, section.pass_reward) else {
            bail!("task {id}: the episode has no completion (the prompt fills the token budget?)");
        };
        summary.traces += 1;
        summary.passed += usize::from(trace.passed);
        summary.prompts_without_pass += usize::from(!trace.passed);
        writer.write(&trace).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    writer.flush().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(summary)
}
