//! An episode cut short by the token budget (`EpisodeEnd::TokenBudget`) is graded through
//! `Env::end_truncated`, whether the model's turn or the env's observation overflows.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use common::ScriptedPolicy;
use composer_env::{
    run_episode, Action, Env, EnvError, EpisodeConfig, EpisodeEnd, ResetOptions, StepResult,
};
use serde_json::{Map, Value};

/// Steps earn 0.1 and return `obs_len` bytes of observation; grading a cut-short episode
/// gives 0.9 and is counted.
struct GradingEnv {
    obs_len: usize,
    graded: Arc<AtomicUsize>,
}

fn result(text: String, reward: Option<f64>, feedback: Option<String>) -> StepResult {
    StepResult {
        observation: Map::new(),
        text,
        reward,
        done: false,
        feedback,
    }
}

#[async_trait]
impl Env for GradingEnv {
    async fn reset(&mut self, _opts: ResetOptions) -> Result<StepResult, EnvError> {
        Ok(result("task".into(), None, None))
    }
    async fn step(&mut self, _action: Action) -> Result<StepResult, EnvError> {
        Ok(result("o".repeat(self.obs_len), Some(0.1), None))
    }
    async fn close(&mut self) -> Result<(), EnvError> {
        Ok(())
    }
    async fn end_truncated(&mut self) -> Result<Option<StepResult>, EnvError> {
        self.graded.fetch_add(1, Ordering::SeqCst);
        let mut r = result(String::new(), Some(0.9), Some("graded".into()));
        r.done = true;
        Ok(Some(r))
    }
    fn action_schema(&self) -> Option<Value> {
        None
    }
}

async fn play(message: &str, obs_len: usize, max_total_tokens: usize) -> (usize, f64, f64) {
    let graded = Arc::new(AtomicUsize::new(0));
    let mut env = GradingEnv {
        obs_len,
        graded: Arc::clone(&graded),
    };
    let mut policy = ScriptedPolicy::new(&[message]);
    let cfg = EpisodeConfig {
        max_turns: 50,
        max_total_tokens,
    };
    let ep = run_episode(&mut policy, &mut env, ResetOptions::default(), &cfg)
        .await
        .unwrap();
    assert_eq!(ep.end, EpisodeEnd::TokenBudget, "{:?}", ep.end);
    assert!(ep.truncated && !ep.done);
    assert!(ep.token_ids.len() <= max_total_tokens);
    let last = ep.turns.last().expect("at least one turn");
    assert_eq!(last.feedback.as_deref(), Some("graded"));
    assert_eq!(last.reward, 0.9);
    (
        graded.load(Ordering::SeqCst),
        ep.final_reward,
        ep.total_reward,
    )
}

#[tokio::test]
async fn a_turn_over_the_token_budget_is_graded() {
    // The model's turn (500 bytes) overflows a 200-token budget.
    let (graded, final_reward, _) = play(&"a".repeat(500), 1, 200).await;
    assert_eq!((graded, final_reward), (1, 0.9));
}

#[tokio::test]
async fn an_observation_over_the_token_budget_is_graded() {
    // A valid action, then a 1000-byte observation that cannot fit a 300-token budget: the
    // step's 0.1 is replaced by the grade's 0.9.
    let (graded, final_reward, total) = play(r#"{"a": 1}"#, 1000, 300).await;
    assert_eq!((graded, final_reward), (1, 0.9));
    assert!((total - 0.9).abs() < 1e-9, "{total}");
}
