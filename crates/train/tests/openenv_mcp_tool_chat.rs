//! The trainer's tool episode ([`ToolChatEnv`] over our MCP tool client, driven by
//! `run_episode`) against an MCP-tool environment served by the `openenv` 0.10.0 package
//! itself: crates/env/tests/fixtures/openenv_mcp_env.py (the package's `MCPEnvironment` and
//! `create_app`, four tools of ours), from `$OPENENV_MCP_VENV` (tools/openenv-mcp-venv.sh;
//! unset: SKIPPED, or a failure under `CI`). The package's tool schemas reach the prompt, its
//! tool results and errors come back as `tool` messages in Qwen2.5's format, and its
//! `submit` ends the episode with its reward (1.0 for the reset's `target`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use composer_env::{
    run_episode, EpisodeConfig, EpisodeEnd, OpenEnvClient, OpenEnvClientConfig, ResetOptions,
    TurnEnd, TurnOutput, TurnPolicy,
};
use composer_model::{ChatTemplate, Tokenizer};
use composer_train::tool_calls::{format_tool_call, ToolChat};
use composer_train::tool_env::{ToolChatEnv, ToolEpisodeStats};
use serde_json::json;

/// `$OPENENV_MCP_VENV`, or None (SKIPPED) when unset outside CI.
fn mcp_venv() -> Option<PathBuf> {
    match std::env::var("OPENENV_MCP_VENV") {
        Ok(v) if !v.trim().is_empty() => Some(PathBuf::from(v)),
        _ => {
            let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
            assert!(
                !ci,
                "OPENENV_MCP_VENV is unset but CI is set (tools/openenv-mcp-venv.sh makes it)"
            );
            eprintln!("SKIPPED: openenv_mcp_tool_chat: OPENENV_MCP_VENV is unset");
            None
        }
    }
}

/// The package's server on a free port, killed on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(venv: &Path) -> Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../env/tests/fixtures");
    let child = Command::new(venv.join("bin/python"))
        .args(["-m", "uvicorn", "openenv_mcp_env:app", "--app-dir"])
        .arg(&fixtures)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .env("ENABLE_WEB_INTERFACE", "false")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting uvicorn from $OPENENV_MCP_VENV");
    Server { child, port }
}

/// Plays fixed turns (text, then `<|im_end|>`), as a model would emit them.
struct ScriptedAgent {
    tok: Tokenizer,
    turns: Vec<String>,
    next: usize,
}

#[async_trait]
impl TurnPolicy for ScriptedAgent {
    async fn generate_turn(&mut self, _ctx: &[u32], max_new: usize) -> anyhow::Result<TurnOutput> {
        let text = self.turns.get(self.next).cloned().unwrap_or_default();
        self.next += 1;
        let mut ids = self.tok.encode(&text)?;
        ids.push(self.tok.token_to_id("<|im_end|>").unwrap());
        ids.truncate(max_new);
        Ok(TurnOutput {
            sampler_logprobs: vec![-0.5; ids.len()],
            token_ids: ids,
            policy_version: 1,
            finish_reason: TurnEnd::Stop,
        })
    }
    fn encode(&self, text: &str) -> Vec<u32> {
        self.tok.encode(text).unwrap()
    }
    fn decode(&self, ids: &[u32]) -> String {
        self.tok.decode_skip_special(ids).unwrap()
    }
}

fn qwen25_chat() -> Arc<ToolChat> {
    let source = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/qwen2_5_tools.jinja"),
    )
    .unwrap();
    let t = ChatTemplate {
        source,
        bos_token: String::new(),
        eos_token: "<|im_end|>".into(),
    };
    Arc::new(ToolChat::new(t, Some("You compute with tools.".into()), "qwen2.5").unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_episode_on_the_openenv_packages_mcp_server_gets_tool_messages_and_its_reward() {
    let Some(venv) = mcp_venv() else {
        return;
    };
    let server = start_server(&venv);
    let url = format!("http://127.0.0.1:{}", server.port);
    let t0 = Instant::now();
    let client = loop {
        match OpenEnvClient::connect(&url, OpenEnvClientConfig::default()).await {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "the openenv server at {url} did not come up: {e}"
                );
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    };
    let tok = Tokenizer::from_dir(&common::hf_fixture("qwen2-tiny")).unwrap();
    let turns = vec![
        // One good call and one the server's tool raises on, in one turn.
        format_tool_call("add", &json!({"a": 3, "b": 4}))
            + &format_tool_call("divide", &json!({"a": 1, "b": 0})),
        format_tool_call("submit", &json!({"answer": "7"})),
    ];
    let mut agent = ScriptedAgent {
        tok: Tokenizer::from_dir(&common::hf_fixture("qwen2-tiny")).unwrap(),
        turns,
        next: 0,
    };
    let mut env = ToolChatEnv::new(client.tool_session(), qwen25_chat());
    let mut reset = ResetOptions::default();
    reset.extra.insert("target".into(), json!("7"));
    let cfg = EpisodeConfig {
        max_turns: 4,
        max_total_tokens: 8192,
    };
    let ep = run_episode(&mut agent, &mut env, reset, &cfg)
        .await
        .unwrap();
    composer_env::Env::close(&mut env).await.unwrap();

    assert_eq!(ep.end, EpisodeEnd::Done, "{:?}", ep.end);
    assert_eq!(ep.turns.len(), 2);
    assert_eq!(ep.final_reward, 1.0);
    let stats = ToolEpisodeStats::from_observation(&ep.turns[1].observation).unwrap();
    assert_eq!(stats.malformed_calls, 0, "{stats:?}");
    assert_eq!(stats.tool_calls.len(), 3, "{stats:?}");
    // The prompt: the statement from the reset's metadata and the package's tool schemas.
    let prompt = tok.decode(&ep.token_ids[..ep.prompt_len]).unwrap();
    assert!(
        prompt.contains("Use the tools to compute 7, then submit it."),
        "{prompt}"
    );
    assert!(
        prompt.contains("<tools>") && prompt.contains("\"name\": \"divide\""),
        "{prompt}"
    );
    assert!(prompt.contains("\"description\": \"Adds two integers.\""));
    // The results, as tool messages: the sum, then the server's execution error.
    let obs = tok
        .decode(&ep.token_ids[ep.turns[0].observation_tokens.clone()])
        .unwrap();
    assert!(
        obs.starts_with("\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\nError (execution_error): Error calling tool 'divide': division by zero\n</tool_response>"),
        "{obs}"
    );
    assert!(ep.loss_mask[ep.turns[0].observation_tokens.clone()]
        .iter()
        .all(|&m| m == 0));
}
