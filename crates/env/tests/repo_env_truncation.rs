//! A repository-task episode cut short by the trainer (turn limit or token budget, before
//! `submit`) is graded through `Env::end_truncated`, as REPO_ENV.md says: the working copy's
//! reward reaches the episode, and the grade is reported as a cut-short one.

mod common;

use std::path::{Path, PathBuf};

use common::ScriptedPolicy;
use composer_env::repo::{EpisodeBudget, RepoEnv};
use composer_env::{run_episode, Env, EpisodeConfig, EpisodeEnd, ResetOptions};
use serde_json::{json, Value};

const TASK: &str = "textkit-strings-caesar";

fn repo_tasks() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("repo_tasks")
}

fn env() -> Box<dyn Env> {
    let factory = RepoEnv::factory(&repo_tasks().join("tasks"), EpisodeBudget::default())
        .expect("the shipped tasks serve");
    factory().expect("an env")
}

fn reset() -> ResetOptions {
    ResetOptions {
        task_id: Some(TASK.into()),
        ..ResetOptions::default()
    }
}

/// The model's one turn: a `call_tool` action (JSON, as `run_episode` parses it).
fn turn(tool: &str, arguments: Value) -> String {
    json!({"type": "call_tool", "tool_name": tool, "arguments": arguments}).to_string()
}

/// Plays one model turn then hits the turn limit; returns the episode.
async fn one_turn(message: &str) -> composer_env::Episode {
    let mut env = env();
    let mut policy = ScriptedPolicy::new(&[message]);
    let cfg = EpisodeConfig {
        max_turns: 1,
        max_total_tokens: 1 << 20,
    };
    let ep = run_episode(&mut policy, env.as_mut(), reset(), &cfg)
        .await
        .unwrap();
    env.close().await.unwrap();
    ep
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_short_restoration_is_graded_and_rewarded() {
    let original = std::fs::read_to_string(repo_tasks().join("source/textkit/strings.py")).unwrap();
    let ep = one_turn(&turn(
        "write_file",
        json!({"path": "textkit/strings.py", "content": original}),
    ))
    .await;
    assert_eq!(ep.end, EpisodeEnd::MaxTurns, "{:?}", ep.end);
    assert!(ep.truncated && !ep.done);
    let last = ep.turns.last().expect("one turn");
    assert!(last.invalid_action.is_none(), "{:?}", last.invalid_action);
    // The write itself earns nothing; the grade at the cut gives the full reward.
    assert_eq!(ep.final_reward, 1.0, "{:?}", last.feedback);
    assert_eq!(last.reward, 1.0);
    let feedback = last.feedback.as_deref().expect("the grade's feedback");
    assert!(feedback.starts_with("passed "), "{feedback}");
    let grade = &last.observation["metadata"]["grade"];
    assert_eq!(grade["reward"], 1.0, "{grade}");
    assert!(grade["total"].as_u64().unwrap() >= 1, "{grade}");
    assert_eq!(last.observation["metadata"]["truncated"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_short_episode_that_restored_nothing_scores_zero_with_a_report() {
    let ep = one_turn(&turn("list_files", json!({}))).await;
    assert_eq!(ep.end, EpisodeEnd::MaxTurns);
    let last = ep.turns.last().expect("one turn");
    assert_eq!(ep.final_reward, 0.0);
    let feedback = last.feedback.as_deref().expect("graded even at 0");
    assert!(
        feedback.starts_with("passed 0/") && feedback.contains("FAILED"),
        "{feedback}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_truncated_needs_an_episode_and_ends_it() {
    let mut env = env();
    assert!(
        env.end_truncated().await.unwrap().is_none(),
        "nothing to grade before reset"
    );
    env.reset(reset()).await.unwrap();
    let r = env.end_truncated().await.unwrap().expect("graded");
    assert!(r.done);
    assert_eq!(r.reward, Some(0.0));
    let state = env.state().await.unwrap();
    assert_eq!(state["done"], true, "{state}");
    assert_eq!(state["turns"], 0, "the grade is not a tool call: {state}");
    // The episode is over: a tool call is an error observation, and the grade stays.
    let after = env
        .step(json!({"type": "call_tool", "tool_name": "run_tests"}))
        .await
        .unwrap();
    assert!(after.done);
    assert!(after.text.contains("the episode is over"), "{}", after.text);
    let again = env.end_truncated().await.unwrap().expect("the same grade");
    assert_eq!(again.feedback, r.feedback);
    env.close().await.unwrap();
}
