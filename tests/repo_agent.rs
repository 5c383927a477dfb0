//! The trainer's MCP-tool client against a real `composer-rl serve-env repo` process on the
//! shipped repository tasks: scripted agents playing through the Qwen2.5 chat format (tool
//! calls parsed from the model's text, tool results appended as masked `tool` messages), and
//! `recipes/repo_agent.toml` training a few steps end to end.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use composer_env::{
    run_episode, Episode, EpisodeConfig, EpisodeEnd, OpenEnvClient, OpenEnvClientConfig,
    ResetOptions, TurnEnd, TurnOutput, TurnPolicy,
};
use composer_model::{ChatTemplate, Tokenizer};
use composer_train::tool_calls::ToolChat;
use composer_train::tool_env::{ToolChatEnv, ToolEpisodeStats};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn shared() -> PathBuf {
    std::env::var("COMPOSER_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(ROOT).join("../shared"))
}

/// A `serve-env repo` server on a free port, killed on drop.
struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_server() -> Server {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(["serve-env", "repo", "--tasks"])
        .arg(Path::new(ROOT).join("crates/env/repo_tasks/tasks"))
        .args(["--port", &port.to_string(), "--max-sessions", "8"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting composer-rl serve-env repo");
    let url = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "server did not listen"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Server { child, url }
}

/// Plays fixed turns (text, then the `<|im_end|>` stop token), as a model would emit them.
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
        Path::new(ROOT).join("crates/model/tests/fixtures/qwen2_5_tools.jinja"),
    )
    .unwrap();
    let t = ChatTemplate {
        source,
        bos_token: String::new(),
        eos_token: "<|im_end|>".into(),
    };
    Arc::new(ToolChat::new(t, Some("You restore deleted code.".into()), "qwen2.5").unwrap())
}

fn call(name: &str, args: serde_json::Value) -> String {
    composer_train::tool_calls::format_tool_call(name, &args)
}

fn play(server: &Server, task: &str, turns: Vec<String>) -> Episode {
    play_with_limit(server, task, turns, 6)
}

fn play_with_limit(server: &Server, task: &str, turns: Vec<String>, max_turns: usize) -> Episode {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = OpenEnvClient::connect(&server.url, OpenEnvClientConfig::default())
            .await
            .unwrap();
        let mut env = ToolChatEnv::new(client.tool_session(), qwen25_chat());
        let mut agent = ScriptedAgent {
            tok: Tokenizer::from_dir(&shared().join("fixtures/hf-tiny/qwen2-tiny")).unwrap(),
            turns,
            next: 0,
        };
        let reset = ResetOptions {
            task_id: Some(task.into()),
            ..Default::default()
        };
        let cfg = EpisodeConfig {
            max_turns,
            max_total_tokens: 60_000,
        };
        let ep = run_episode(&mut agent, &mut env, reset, &cfg)
            .await
            .unwrap();
        composer_env::Env::close(&mut env).await.unwrap();
        ep
    })
}

#[test]
fn an_honest_scripted_agent_restores_the_code_and_malformed_calls_are_observations() {
    let server = start_server();
    let original = std::fs::read_to_string(
        Path::new(ROOT).join("crates/env/repo_tasks/source/textkit/numbers.py"),
    )
    .unwrap();
    let turns = vec![
        // Bad JSON, an unknown tool and arguments that miss `path`: three malformed calls,
        // then a good one, all in one turn.
        format!(
            "Let me look.\n<tool_call>\n{{not json}}\n</tool_call>\n{}\n{}\n{}",
            call("delete_everything", serde_json::json!({})),
            call("read_file", serde_json::json!({"start_line": 1})),
            call(
                "read_file",
                serde_json::json!({"path": "textkit/numbers.py"})
            ),
        ),
        "I see it. No call in this turn.".to_string(),
        call(
            "write_file",
            serde_json::json!({"path": "textkit/numbers.py", "content": original}),
        ) + &call("run_tests", serde_json::json!({})),
        call("submit", serde_json::json!({})),
    ];
    let ep = play(&server, "textkit-numbers-gcd", turns);
    assert_eq!(ep.end, EpisodeEnd::Done, "{:?}", ep.end);
    assert_eq!(ep.turns.len(), 4);
    assert_eq!(ep.final_reward, 1.0);
    let stats = ToolEpisodeStats::from_observation(&ep.turns[3].observation).unwrap();
    assert_eq!(stats.malformed_calls, 3, "{stats:?}");
    assert_eq!(stats.turns_without_call, 1);
    assert_eq!(
        stats
            .tool_calls
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .collect::<Vec<_>>(),
        vec![
            ("read_file", 1),
            ("run_tests", 1),
            ("submit", 1),
            ("write_file", 1)
        ]
    );
    let (passed, total) = stats.tests.unwrap();
    assert!(total > 0 && passed == total, "{stats:?}");
    assert!(stats.verifier_s.unwrap() > 0.0 && stats.tool_s >= stats.verifier_s.unwrap());
    // The feedback of the last step is the grader's report (the hint channel's input).
    assert!(ep.turns[3]
        .feedback
        .as_deref()
        .unwrap_or("")
        .contains("passed"));

    // Only the model's tokens are trained: observation tokens are masked, and they hold the
    // tool results in the template's format, errors included.
    let tok = Tokenizer::from_dir(&shared().join("fixtures/hf-tiny/qwen2-tiny")).unwrap();
    for t in &ep.turns {
        assert!(ep.loss_mask[t.model_tokens.clone()].iter().all(|&m| m == 1));
        assert!(ep.loss_mask[t.observation_tokens.clone()]
            .iter()
            .all(|&m| m == 0));
    }
    let first_obs = tok
        .decode(&ep.token_ids[ep.turns[0].observation_tokens.clone()])
        .unwrap();
    assert!(
        first_obs.starts_with("\n<|im_start|>user\n<tool_response>\nError (malformed_call)"),
        "{first_obs}"
    );
    assert_eq!(
        first_obs.matches("<tool_response>").count(),
        4,
        "{first_obs}"
    );
    assert!(
        first_obs.contains("Error (tool_not_found)") && first_obs.contains("Error (invalid_args)")
    );
    assert!(first_obs.contains("def gcd"), "{first_obs}");
    assert!(first_obs.ends_with("<|im_start|>assistant\n"));
    let nudge = tok
        .decode(&ep.token_ids[ep.turns[1].observation_tokens.clone()])
        .unwrap();
    assert!(
        nudge.contains("<|im_start|>user\nNo tool call found"),
        "{nudge}"
    );
    // The prompt shows the tools and the statement.
    let prompt = tok.decode(&ep.token_ids[..ep.prompt_len]).unwrap();
    assert!(prompt.contains("<tools>") && prompt.contains("\"name\": \"replace_in_file\""));
    assert!(prompt.contains("`gcd` in `textkit/numbers.py` is not implemented"));
}

#[test]
fn a_do_nothing_agent_scores_below_one() {
    let server = start_server();
    let ep = play(
        &server,
        "textkit-numbers-gcd",
        vec![call("submit", serde_json::json!({}))],
    );
    assert_eq!(ep.end, EpisodeEnd::Done);
    assert!(ep.final_reward < 0.5, "{}", ep.final_reward);
}

#[test]
fn an_episode_cut_short_at_the_turn_limit_is_graded() {
    // REPO_ENV: an episode ends at submit, a turn limit or a token budget, and is graded.
    let server = start_server();
    let original = std::fs::read_to_string(
        Path::new(ROOT).join("crates/env/repo_tasks/source/textkit/numbers.py"),
    )
    .unwrap();
    let restore = call(
        "write_file",
        serde_json::json!({"path": "textkit/numbers.py", "content": original}),
    );
    // Restores the code but never submits: the runner's submit grades it at the limit.
    let ep = play_with_limit(
        &server,
        "textkit-numbers-gcd",
        vec![restore, "Done, I think.".into()],
        2,
    );
    assert_eq!(ep.end, EpisodeEnd::MaxTurns, "{:?}", ep.end);
    assert_eq!(ep.final_reward, 1.0);
    let stats = ToolEpisodeStats::from_observation(&ep.turns[1].observation).unwrap();
    assert!(stats.graded_at_limit, "{stats:?}");
    assert!(
        !stats.tool_calls.contains_key("submit"),
        "not the agent's call"
    );
    let (passed, total) = stats.tests.unwrap();
    assert!(total > 0 && passed == total, "{stats:?}");
    assert!(stats.verifier_s.unwrap() > 0.0);
    // Doing nothing until the limit scores 0, and the grader's failure report is the
    // feedback (the hint channel's input).
    let ep = play_with_limit(&server, "textkit-numbers-gcd", vec!["Hmm.".into()], 1);
    assert_eq!(ep.end, EpisodeEnd::MaxTurns);
    assert_eq!(ep.final_reward, 0.0);
    let feedback = ep.turns[0].feedback.clone().unwrap_or_default();
    assert!(
        feedback.contains("passed 0/") && feedback.contains("FAILED"),
        "{feedback}"
    );
}

#[test]
fn record_traces_for_repo_tasks_refuses_bad_input_with_the_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe_text =
        std::fs::read_to_string(Path::new(ROOT).join("recipes/repo_agent.toml")).unwrap();
    let fixture = shared().join("fixtures/hf-tiny/qwen2-tiny");
    let recipe = recipe_text
        .replace(
            "path = \"../shared/fixtures/hf-tiny/qwen2-tiny\"",
            &format!("path = {fixture:?}"),
        )
        .replace(
            "url_env = \"REPO_ENV_URL\"",
            // Never contacted: every check below fails before the server is.
            "url = \"http://127.0.0.1:9\"",
        )
        .replace(
            "chat_template = \"crates/model/tests/fixtures/qwen2_5_tools.jinja\"",
            &format!(
                "chat_template = {:?}",
                Path::new(ROOT).join("crates/model/tests/fixtures/qwen2_5_tools.jinja")
            ),
        );
    let run = |recipe: &str, restore_from: &Path| -> String {
        let path = tmp.path().join("r.toml");
        std::fs::write(&path, recipe).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_composer-rl"))
            .args(["record-traces", "--repo-tasks"])
            .arg(Path::new(ROOT).join("crates/env/repo_tasks/tasks"))
            .arg("--restore-from")
            .arg(restore_from)
            .arg("--recipe")
            .arg(&path)
            .arg("--out")
            .arg(tmp.path().join("t.jsonl"))
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // The original repository lacks the removed file: the (first) task and the file are named.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = run(&recipe, &empty);
    let first =
        &composer_env::repo::load_tasks(&Path::new(ROOT).join("crates/env/repo_tasks/tasks"))
            .unwrap()[0];
    assert!(
        err.contains(&format!("task {}", first.id())) && err.contains(&first.spec.removed[0].file),
        "{err}"
    );
    // A recipe without a tool env, or with too few turns for the teacher, names the key.
    let source = Path::new(ROOT).join("crates/env/repo_tasks/source");
    let without_env = format!(
        "{}{}",
        &recipe[..recipe.find("\n[env]\n").unwrap() + 1],
        &recipe[recipe.find("\n[output]\n").unwrap() + 1..]
    );
    let err = run(&without_env, &source);
    assert!(err.contains("[env] kind"), "{err}");
    let err = run(&recipe.replace("max_turns = 4", "max_turns = 1"), &source);
    assert!(err.contains("[env] max_turns"), "{err}");
    // Without --repo-tasks, the sampling mode's flags are required.
    let out = Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(["record-traces", "--out"])
        .arg(tmp.path().join("t.jsonl"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--model") && err.contains("--data"), "{err}");
}

#[test]
fn repo_agent_recipe_trains_a_few_steps_with_hints_and_recorded_teacher_episodes() {
    let server = start_server();
    let tmp = tempfile::tempdir().unwrap();
    // The tiny fixture checkpoint with room for tool prompts (RoPE: no learned positions).
    let model = tmp.path().join("qwen2-tiny-8k");
    std::fs::create_dir(&model).unwrap();
    let fixture = shared().join("fixtures/hf-tiny/qwen2-tiny");
    for f in std::fs::read_dir(&fixture).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), model.join(f.file_name())).unwrap();
    }
    let cfg_path = model.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = serde_json::json!(16384);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();

    // The shipped recipe, pointed at this server and the 8k fixture, shortened to two steps.
    let recipe_text =
        std::fs::read_to_string(Path::new(ROOT).join("recipes/repo_agent.toml")).unwrap();
    let recipe = recipe_text
        .replace(
            "path = \"../shared/fixtures/hf-tiny/qwen2-tiny\"",
            &format!("path = {model:?}"),
        )
        .replace(
            "url_env = \"REPO_ENV_URL\"",
            &format!("url = {:?}", server.url),
        )
        .replace(
            "chat_template = \"crates/model/tests/fixtures/qwen2_5_tools.jinja\"",
            &format!(
                "chat_template = {:?}",
                Path::new(ROOT).join("crates/model/tests/fixtures/qwen2_5_tools.jinja")
            ),
        )
        .replace("steps = 4", "steps = 2")
        .replace("prompts_per_step = 2", "prompts_per_step = 1")
        .replace("max_turns = 4", "max_turns = 2");

    // Recorded teacher episodes, one per shipped task, in the trace format: the CLI's
    // scripted honest teacher plays each task on the server with the recipe's chat format.
    let record_recipe = tmp.path().join("record.toml");
    std::fs::write(&record_recipe, &recipe).unwrap();
    let traces = tmp.path().join("teacher_episodes.jsonl");
    let tasks_dir = Path::new(ROOT).join("crates/env/repo_tasks/tasks");
    let out = Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(["record-traces", "--repo-tasks"])
        .arg(&tasks_dir)
        .arg("--restore-from")
        .arg(Path::new(ROOT).join("crates/env/repo_tasks/source"))
        .arg("--recipe")
        .arg(&record_recipe)
        .arg("--out")
        .arg(&traces)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n_tasks = std::fs::read_dir(&tasks_dir).unwrap().count();
    assert!(
        stdout.contains(&format!(
            "wrote {n_tasks} teacher episodes ({n_tasks} passed)"
        )),
        "{stdout}"
    );
    let store = composer_loss::TraceStore::load(&traces).unwrap();
    assert_eq!(store.traces.len(), n_tasks);
    for t in &store.traces {
        assert!(t.passed && t.reward == 1.0 && t.teacher == "scripted-restore");
        // The tool results between the teacher's turns are masked out of replay.
        let mask = t.loss_mask.as_ref().expect("a multi-turn trace has a mask");
        assert!(mask.contains(&0) && mask.contains(&1));
    }

    let recipe = recipe.replace(
        "# [replay]\n# traces = [\"runs/repo_agent/teacher_episodes.jsonl\"]",
        &format!("[replay]\ntraces = [{traces:?}]"),
    );
    let recipe_path = tmp.path().join("repo_agent.toml");
    std::fs::write(&recipe_path, recipe).unwrap();
    let run = tmp.path().join("run");
    let out = composer_train::run_train(&composer_train::TrainOptions {
        recipe_path: Some(recipe_path),
        quiet: true,
        run_dir_override: Some(run.clone()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(out.steps_completed, 2);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|l: &serde_json::Value| l["kind"] == "train")
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        let turns = l["env/turns"].as_array().unwrap_or_else(|| panic!("{l}"));
        assert_eq!(turns.len(), 2, "{l}");
        assert!(turns.iter().all(|t| (1..=2).contains(&t.as_u64().unwrap())));
        for key in [
            "env/malformed_calls",
            "env/turns_without_call",
            "env/sandbox_s",
        ] {
            assert_eq!(l[key].as_array().map(Vec::len), Some(2), "{key}: {l}");
        }
        assert!(l["env/tool_calls"].is_object(), "{l}");
        // Every episode is graded, at `submit` or at the turn limit: tests passed and the
        // verifier wall are there for each.
        for key in ["env/tests_passed", "env/tests_total", "env/verifier_s"] {
            assert_eq!(l[key].as_array().map(Vec::len), Some(2), "{key}: {l}");
        }
        // The teacher episodes cover every task: replay trains on them each step.
        let replay = l["loss/replay"].as_f64().unwrap();
        assert!(replay.is_finite() && replay != 0.0, "{l}");
        // The fixture never passes, so no peer solution: each sample's hint is the grader's
        // failure report, and the hint channel trains on it.
        assert_eq!(l["hint/samples"].as_f64(), Some(2.0), "{l}");
        let hint = l["loss/hint"].as_f64().unwrap();
        assert!(hint.is_finite() && hint != 0.0, "{l}");
    }
}
