//! The agent's time is charged to the agent: a repository episode whose step outlasts the
//! pool's call timeout, or that spends the pool's episode time, is graded (`TimeBudget`),
//! never an env failure. Were it a failure, the trainer would retry it or replace it by a
//! copy of a successful peer, so a policy could hide every losing attempt behind a slow
//! command (`sleep`, or code that hangs the grader).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::ScriptedPolicy;
use composer_env::repo::{EpisodeBudget, RepoEnv};
use composer_env::{
    EnvError, EnvPool, EpisodeConfig, EpisodeEnd, FailureKind, PoolConfig, ResetOptions,
};
use serde_json::{json, Value};

const TASK: &str = "textkit-strings-caesar";

fn repo_tasks() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("repo_tasks")
}

fn pool(call_timeout: Duration, episode_timeout: Duration) -> EnvPool {
    let factory = RepoEnv::factory(&repo_tasks().join("tasks"), EpisodeBudget::default())
        .expect("the shipped tasks serve");
    let mut pool = EnvPool::new(PoolConfig {
        call_timeout,
        episode_timeout,
        ..Default::default()
    });
    pool.add_server("repo", factory, 1);
    pool
}

fn reset() -> ResetOptions {
    ResetOptions {
        task_id: Some(TASK.into()),
        ..ResetOptions::default()
    }
}

/// A model turn: one `call_tool` action.
fn turn(tool: &str, arguments: Value) -> String {
    json!({"type": "call_tool", "tool_name": tool, "arguments": arguments}).to_string()
}

/// The turn that restores the task's file (the right answer).
fn restore() -> String {
    let original = std::fs::read_to_string(repo_tasks().join("source/textkit/strings.py")).unwrap();
    turn(
        "write_file",
        json!({"path": "textkit/strings.py", "content": original}),
    )
}

fn sleep_turn(seconds: f64) -> String {
    turn(
        "run_shell",
        json!({"command": "sleep 30", "timeout_s": seconds}),
    )
}

/// Asserts the episode was graded at the time limit with the restored file's full reward.
fn assert_graded(ep: &composer_env::Episode) {
    assert_eq!(ep.end, EpisodeEnd::TimeBudget, "{:?}", ep.end);
    assert!(ep.truncated && !ep.done);
    let last = ep.turns.last().expect("turns were played");
    assert_eq!(ep.final_reward, 1.0, "{:?}", last.feedback);
    assert_eq!(last.observation["metadata"]["truncated"], true);
    let feedback = last.feedback.as_deref().expect("the grade's report");
    assert!(feedback.starts_with("passed "), "{feedback}");
}

/// A step that runs past the pool's call timeout (a slow command) ends the episode graded:
/// the in-process env keeps the episode of the call it was cut from, and grades it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_past_the_call_timeout_is_graded_not_failed() {
    let pool = pool(Duration::from_secs(6), Duration::from_secs(300));
    let mut policy = ScriptedPolicy::new(&[&restore(), &sleep_turn(6.5)]);
    let cfg = EpisodeConfig {
        max_turns: 4,
        max_total_tokens: 1 << 20,
    };
    let ep = pool.run_episode(&mut policy, reset(), &cfg).await.unwrap();
    assert_graded(&ep);
    assert_eq!(ep.turns.len(), 2);
    let stats = pool.stats();
    assert_eq!((stats.episodes_ok, stats.episodes_failed), (1, 0));
    assert_eq!(stats.failures.timeout, 1, "the slow step is still counted");
}

/// An agent that spends the episode's time (many slow commands) is graded when its time
/// budget (`episode_timeout - 2 × call_timeout`) is spent, before the hard timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_episode_past_its_time_budget_is_graded_not_failed() {
    let pool = pool(Duration::from_secs(8), Duration::from_secs(22));
    let mut policy = ScriptedPolicy::new(&[&restore(), &sleep_turn(2.0)]);
    let cfg = EpisodeConfig {
        max_turns: 40,
        max_total_tokens: 1 << 20,
    };
    let t0 = std::time::Instant::now();
    let ep = pool.run_episode(&mut policy, reset(), &cfg).await.unwrap();
    assert_graded(&ep);
    assert!(ep.turns.len() < 40, "{} turns", ep.turns.len());
    assert!(t0.elapsed() < Duration::from_secs(22), "{:?}", t0.elapsed());
    assert_eq!(pool.stats().episodes_failed, 0);
}

/// An env whose second step times out; it grades a cut-short episode (0.9) when `grades`.
struct SlowEnv {
    steps: usize,
    grades: bool,
}

#[async_trait::async_trait]
impl composer_env::Env for SlowEnv {
    async fn reset(&mut self, _: ResetOptions) -> Result<composer_env::StepResult, EnvError> {
        Ok(step_result(None))
    }
    async fn step(&mut self, _: Value) -> Result<composer_env::StepResult, EnvError> {
        self.steps += 1;
        if self.steps < 2 {
            return Ok(step_result(Some(0.1)));
        }
        Err(EnvError::Timeout {
            seconds: 1.0,
            during: "step".into(),
        })
    }
    async fn close(&mut self) -> Result<(), EnvError> {
        Ok(())
    }
    async fn end_truncated(&mut self) -> Result<Option<composer_env::StepResult>, EnvError> {
        Ok(self.grades.then(|| {
            let mut r = step_result(Some(0.9));
            r.done = true;
            r
        }))
    }
    fn action_schema(&self) -> Option<Value> {
        None
    }
}

fn step_result(reward: Option<f64>) -> composer_env::StepResult {
    composer_env::StepResult {
        observation: serde_json::Map::new(),
        text: "obs".into(),
        reward,
        done: false,
        feedback: None,
    }
}

/// `run_episode`: a step timeout is graded when the env grades (`TimeBudget`), and stays an
/// env failure when it cannot (a hung server is still a failure).
#[tokio::test]
async fn a_step_timeout_is_graded_when_the_env_grades_and_a_failure_otherwise() {
    let cfg = EpisodeConfig {
        max_turns: 5,
        max_total_tokens: 4096,
    };
    for grades in [true, false] {
        let mut env = SlowEnv { steps: 0, grades };
        let mut policy = ScriptedPolicy::new(&[r#"{"a": 1}"#]);
        let ep = composer_env::run_episode(&mut policy, &mut env, ResetOptions::default(), &cfg)
            .await
            .unwrap();
        assert_eq!(ep.turns.len(), 2);
        if grades {
            assert_eq!(ep.end, EpisodeEnd::TimeBudget);
            assert!(ep.truncated);
            assert_eq!(ep.final_reward, 0.9);
            assert!((ep.total_reward - 1.0).abs() < 1e-9, "{}", ep.total_reward);
        } else {
            match &ep.end {
                EpisodeEnd::EnvFailed { kind, .. } => assert_eq!(*kind, FailureKind::Timeout),
                other => panic!("{other:?}"),
            }
        }
    }
}
