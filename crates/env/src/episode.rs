//! Token-faithful multi-turn episodes: [`run_episode`] alternates model turns
//! ([`TurnPolicy::generate_turn`]) and env steps until `done`, a turn limit, a token budget
//! or (with [`run_episode_until`]) a time budget.
//!
//! The episode's token sequence is built by appending, never by re-tokenising a transcript:
//! the model's own tokens go in exactly as sampled (loss mask 1, the sampler's log-probs and
//! policy version kept), env observations go in via [`TurnPolicy::encode_observation`]
//! (loss mask 0, log-prob 0, policy version 0).

use std::ops::Range;
use std::time::Instant;

use anyhow::ensure;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::env::{Env, EnvError, FailureKind, ResetOptions};
use crate::schema::{required_string_fields, validate_action};

/// Why a model turn stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnEnd {
    /// End-of-sequence token or stop sequence.
    Stop,
    /// The per-turn token limit (or the episode's token budget).
    Length,
}

/// One model turn as sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnOutput {
    /// Sampled token ids (without the context).
    pub token_ids: Vec<u32>,
    /// The sampler's log-probability of each sampled token (same length as `token_ids`).
    pub sampler_logprobs: Vec<f32>,
    /// Version of the policy weights that sampled this turn.
    pub policy_version: u64,
    /// Why generation stopped.
    pub finish_reason: TurnEnd,
}

/// The model side of an episode (the trainer implements it with the real model).
#[async_trait]
pub trait TurnPolicy: Send {
    /// Samples one turn continuing `context_ids`, at most `max_new_tokens` tokens.
    async fn generate_turn(
        &mut self,
        context_ids: &[u32],
        max_new_tokens: usize,
    ) -> anyhow::Result<TurnOutput>;
    /// Tokenises text (no special tokens added unless the policy wants them).
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Detokenises ids.
    fn decode(&self, ids: &[u32]) -> String;
    /// Tokens of an env observation; `turn` 0 is the reset observation (the task prompt).
    /// Override to wrap observations in the chat template (e.g. a user/tool message followed
    /// by the assistant header); the default is plain [`TurnPolicy::encode`].
    fn encode_observation(&self, text: &str, turn: usize) -> Vec<u32> {
        let _ = turn;
        self.encode(text)
    }
}

/// Limits of one episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpisodeConfig {
    /// Most model turns.
    pub max_turns: usize,
    /// Most tokens in the whole sequence (prompt, model turns and observations).
    pub max_total_tokens: usize,
}

impl Default for EpisodeConfig {
    fn default() -> Self {
        EpisodeConfig {
            max_turns: 4,
            max_total_tokens: 4096,
        }
    }
}

/// How an episode ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
pub enum EpisodeEnd {
    /// The env said `done`.
    Done,
    /// `max_turns` model turns without `done` (truncated).
    MaxTurns,
    /// The token budget ran out (truncated).
    TokenBudget,
    /// The episode's time ran out (truncated and graded like a turn limit): a step outlasted
    /// its timeout, or the time budget of [`run_episode_until`] was spent. Time the agent's
    /// own actions take (slow commands, many tool calls, code that hangs the grader) is
    /// charged to the agent this way; were it an [`EpisodeEnd::EnvFailed`], a policy could
    /// turn each losing attempt into a failure that the trainer retries or replaces by a
    /// peer's copy.
    TimeBudget,
    /// The env failed (timeout, connection lost, server error): the episode is unusable.
    EnvFailed {
        /// Failure cause.
        kind: FailureKind,
        /// The error.
        message: String,
    },
}

/// One model turn and the env's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// Positions of the model's tokens in [`Episode::token_ids`].
    pub model_tokens: Range<usize>,
    /// The model's text (decoded from its tokens, for parsing and logs only).
    pub action_text: String,
    /// Why the model's turn stopped.
    pub finish_reason: TurnEnd,
    /// Policy version that sampled the turn.
    pub policy_version: u64,
    /// The parsed action (None when it could not be parsed).
    pub action: Option<Value>,
    /// Why the action was rejected (unparseable, or refused by the env's schema).
    pub invalid_action: Option<String>,
    /// Positions of the observation's tokens in [`Episode::token_ids`] (empty when none was
    /// appended, e.g. after the last turn).
    pub observation_tokens: Range<usize>,
    /// The observation rendered as text.
    pub observation_text: String,
    /// The observation object (empty for an invalid action).
    pub observation: Map<String, Value>,
    /// Reward of the step (0 for an invalid action or a null reward).
    pub reward: f64,
    /// Whether the env said done.
    pub done: bool,
    /// Feedback text of the step (e.g. a failing test's output).
    pub feedback: Option<String>,
}

/// A finished episode, ready for the trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Episode {
    /// The whole token sequence: prompt, then model turns and observations.
    pub token_ids: Vec<u32>,
    /// 1 = model token (trained), 0 = prompt / observation token.
    pub loss_mask: Vec<u8>,
    /// The sampler's log-prob per token (0 where masked).
    pub sampler_logprobs: Vec<f32>,
    /// Policy version per token (0 where masked).
    pub policy_versions: Vec<u64>,
    /// Tokens of the reset observation (the prompt).
    pub prompt_len: usize,
    /// The reset observation as text.
    pub initial_observation: String,
    /// The reset observation object.
    pub initial_observation_fields: Map<String, Value>,
    /// The turns in order.
    pub turns: Vec<Turn>,
    /// Reward of the last step (0 when none).
    pub final_reward: f64,
    /// Sum of the step rewards.
    pub total_reward: f64,
    /// The env said done.
    pub done: bool,
    /// Cut by the turn limit or token budget.
    pub truncated: bool,
    /// Why it ended.
    pub end: EpisodeEnd,
}

impl Episode {
    fn empty() -> Self {
        Episode {
            token_ids: Vec::new(),
            loss_mask: Vec::new(),
            sampler_logprobs: Vec::new(),
            policy_versions: Vec::new(),
            prompt_len: 0,
            initial_observation: String::new(),
            initial_observation_fields: Map::new(),
            turns: Vec::new(),
            final_reward: 0.0,
            total_reward: 0.0,
            done: false,
            truncated: false,
            end: EpisodeEnd::MaxTurns,
        }
    }

    /// An episode that failed before producing anything.
    pub fn failed(err: &EnvError) -> Self {
        let mut ep = Self::empty();
        ep.end = EpisodeEnd::EnvFailed {
            kind: err.kind(),
            message: err.to_string(),
        };
        ep
    }

    fn push_context(&mut self, ids: &[u32]) -> Range<usize> {
        let start = self.token_ids.len();
        self.token_ids.extend_from_slice(ids);
        self.loss_mask.resize(self.token_ids.len(), 0);
        self.sampler_logprobs.resize(self.token_ids.len(), 0.0);
        self.policy_versions.resize(self.token_ids.len(), 0);
        start..self.token_ids.len()
    }

    fn push_model(&mut self, ids: &[u32], logprobs: &[f32], version: u64) -> Range<usize> {
        let start = self.token_ids.len();
        self.token_ids.extend_from_slice(ids);
        self.loss_mask.resize(self.token_ids.len(), 1);
        self.sampler_logprobs.extend_from_slice(logprobs);
        self.policy_versions.resize(self.token_ids.len(), version);
        start..self.token_ids.len()
    }
}

/// Finds the first JSON object in `text` (```json fenced blocks first, then any `{`) that
/// passes `accept`.
fn find_json_object(text: &str, accept: impl Fn(&Value) -> bool) -> Option<Value> {
    let mut starts: Vec<usize> = Vec::new();
    for (pos, _) in text.match_indices("```json") {
        if let Some(nl) = text[pos..].find('\n') {
            starts.push(pos + nl + 1);
        }
    }
    // Bounded: a long code answer full of braces must not make parsing quadratic.
    starts.extend(text.match_indices('{').map(|(i, _)| i).take(64));
    for start in starts {
        let slice = text[start..].trim_start();
        let mut values = serde_json::Deserializer::from_str(slice).into_iter::<Value>();
        if let Some(Ok(v)) = values.next() {
            if v.is_object() && accept(&v) {
                return Some(v);
            }
        }
    }
    None
}

/// Parses a model's text into an action for `schema`: a JSON object in the text that fits
/// the schema (a ```json block or inline); else, when the schema has exactly one required
/// string field, the whole text as that field. Without a schema, any JSON object in the text.
/// The error says why no action could be made.
pub fn parse_action(text: &str, schema: Option<&Value>) -> Result<Value, String> {
    match schema {
        Some(schema) => {
            if let Some(v) = find_json_object(text, |v| validate_action(schema, v).is_empty()) {
                return Ok(v);
            }
            let fields = required_string_fields(schema);
            let n_required = schema
                .get("required")
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            if fields.len() == 1 && n_required == 1 {
                let mut m = Map::new();
                m.insert(fields[0].clone(), Value::String(text.to_string()));
                return Ok(Value::Object(m));
            }
            Err(format!(
                "no JSON object matching the action schema found in the model output (schema: {})",
                schema
            ))
        }
        None => find_json_object(text, |_| true)
            .ok_or_else(|| "no JSON object found in the model output".to_string()),
    }
}

/// Lets `env` grade an episode cut short after at least one turn ([`Env::end_truncated`]):
/// the grade's reward, feedback and observation fields go to the last turn and the episode's
/// final reward. A failing grade makes the episode [`EpisodeEnd::EnvFailed`]. Returns whether
/// the env graded it.
async fn grade_truncated(env: &mut dyn Env, ep: &mut Episode) -> bool {
    let Some(last) = ep.turns.last_mut() else {
        return false;
    };
    match env.end_truncated().await {
        Ok(None) => false,
        Ok(Some(r)) => {
            let reward = r.reward.unwrap_or(0.0);
            ep.total_reward += reward - last.reward;
            last.reward = reward;
            last.feedback = r.feedback;
            last.observation.extend(r.observation);
            ep.final_reward = reward;
            true
        }
        Err(e) => {
            ep.end = EpisodeEnd::EnvFailed {
                kind: e.kind(),
                message: e.to_string(),
            };
            false
        }
    }
}

/// A step that ran past its timeout (`err`, an [`EnvError::Timeout`]) after the model's turn
/// `turn`: the episode ends [`EpisodeEnd::TimeBudget`] and the env grades what the agent did
/// ([`Env::end_truncated`]). Only an env that cannot grade (or whose grading fails too) makes
/// it an [`EpisodeEnd::EnvFailed`], as before: a hung server still counts as a failure.
async fn end_on_step_timeout(
    env: &mut dyn Env,
    mut ep: Episode,
    turn: Turn,
    err: EnvError,
) -> Episode {
    ep.turns.push(turn);
    ep.truncated = true;
    ep.end = EpisodeEnd::TimeBudget;
    ep.final_reward = 0.0;
    if !grade_truncated(env, &mut ep).await && ep.end == EpisodeEnd::TimeBudget {
        ep.end = EpisodeEnd::EnvFailed {
            kind: err.kind(),
            message: err.to_string(),
        };
    }
    ep
}

/// Runs one episode of `policy` in `env` (which the caller closes). Env failures end the
/// episode with [`EpisodeEnd::EnvFailed`], except a step that times out, which ends it
/// [`EpisodeEnd::TimeBudget`] with the env's grade when the env grades; invalid actions are
/// zero-reward steps with a reason (the reason is shown to the model as the observation).
/// Errors: only policy failures and policy outputs that break the contract (log-prob count ≠
/// token count).
pub async fn run_episode<P: TurnPolicy + ?Sized>(
    policy: &mut P,
    env: &mut dyn Env,
    reset: ResetOptions,
    cfg: &EpisodeConfig,
) -> anyhow::Result<Episode> {
    run_episode_until(policy, env, reset, cfg, None).await
}

/// [`run_episode`] with a time budget: no model turn after the first starts past `deadline`;
/// the episode then ends [`EpisodeEnd::TimeBudget`], truncated and graded like a turn limit
/// (the pool's episode timeout, so that a slow agent is graded rather than failed).
pub async fn run_episode_until<P: TurnPolicy + ?Sized>(
    policy: &mut P,
    env: &mut dyn Env,
    reset: ResetOptions,
    cfg: &EpisodeConfig,
    deadline: Option<Instant>,
) -> anyhow::Result<Episode> {
    let first = match env.reset(reset).await {
        Ok(r) => r,
        Err(e) => return Ok(Episode::failed(&e)),
    };
    let schema = env.action_schema();
    let mut ep = Episode::empty();
    let prompt_ids = policy.encode_observation(&first.text, 0);
    ep.initial_observation = first.text;
    ep.initial_observation_fields = first.observation;
    if prompt_ids.len() >= cfg.max_total_tokens {
        ep.truncated = true;
        ep.end = EpisodeEnd::TokenBudget;
        return Ok(ep);
    }
    ep.push_context(&prompt_ids);
    ep.prompt_len = prompt_ids.len();

    for turn_index in 0..cfg.max_turns {
        if turn_index > 0 && deadline.is_some_and(|d| Instant::now() >= d) {
            ep.truncated = true;
            ep.end = EpisodeEnd::TimeBudget;
            grade_truncated(env, &mut ep).await;
            return Ok(ep);
        }
        let remaining = cfg.max_total_tokens.saturating_sub(ep.token_ids.len());
        if remaining == 0 {
            ep.truncated = true;
            ep.end = EpisodeEnd::TokenBudget;
            grade_truncated(env, &mut ep).await;
            return Ok(ep);
        }
        let out = policy.generate_turn(&ep.token_ids, remaining).await?;
        ensure!(
            out.sampler_logprobs.len() == out.token_ids.len(),
            "TurnPolicy returned {} tokens but {} sampler log-probs",
            out.token_ids.len(),
            out.sampler_logprobs.len()
        );
        let over_budget = out.token_ids.len() > remaining;
        let kept = out.token_ids.len().min(remaining);
        let model_tokens = ep.push_model(
            &out.token_ids[..kept],
            &out.sampler_logprobs[..kept],
            out.policy_version,
        );
        let action_text = policy.decode(&out.token_ids[..kept]);
        let mut turn = Turn {
            model_tokens,
            action_text,
            finish_reason: if over_budget {
                TurnEnd::Length
            } else {
                out.finish_reason
            },
            policy_version: out.policy_version,
            action: None,
            invalid_action: None,
            observation_tokens: ep.token_ids.len()..ep.token_ids.len(),
            observation_text: String::new(),
            observation: Map::new(),
            reward: 0.0,
            done: false,
            feedback: None,
        };
        let parsed = if env.takes_turn_text() {
            Ok(serde_json::json!({
                "text": turn.action_text,
                "stopped": turn.finish_reason == TurnEnd::Stop,
            }))
        } else {
            parse_action(&turn.action_text, schema.as_ref())
        };
        match parsed {
            Err(reason) => {
                turn.observation_text = format!("Invalid action: {reason}");
                turn.invalid_action = Some(reason);
            }
            Ok(action) => {
                turn.action = Some(action.clone());
                match env.step(action).await {
                    Ok(r) => {
                        turn.reward = r.reward.unwrap_or(0.0);
                        turn.done = r.done;
                        turn.feedback = r.feedback;
                        turn.observation_text = r.text;
                        turn.observation = r.observation;
                        ep.total_reward += turn.reward;
                        ep.final_reward = turn.reward;
                    }
                    Err(EnvError::InvalidAction { message, .. }) => {
                        turn.observation_text = format!("Invalid action: {message}");
                        turn.invalid_action = Some(message);
                    }
                    Err(e @ EnvError::Timeout { .. }) => {
                        return Ok(end_on_step_timeout(env, ep, turn, e).await);
                    }
                    Err(e) => {
                        ep.turns.push(turn);
                        ep.end = EpisodeEnd::EnvFailed {
                            kind: e.kind(),
                            message: e.to_string(),
                        };
                        return Ok(ep);
                    }
                }
            }
        }
        if turn.invalid_action.is_some() {
            ep.final_reward = 0.0;
        }
        let done = turn.done;
        let last_turn = turn_index + 1 == cfg.max_turns;
        if done || over_budget || last_turn {
            ep.turns.push(turn);
            ep.done = done;
            ep.truncated = !done;
            ep.end = if done {
                EpisodeEnd::Done
            } else if over_budget {
                EpisodeEnd::TokenBudget
            } else {
                EpisodeEnd::MaxTurns
            };
            if !done {
                grade_truncated(env, &mut ep).await;
            }
            return Ok(ep);
        }
        let obs_ids = policy.encode_observation(&turn.observation_text, turn_index + 1);
        if ep.token_ids.len() + obs_ids.len() >= cfg.max_total_tokens {
            ep.turns.push(turn);
            ep.truncated = true;
            ep.end = EpisodeEnd::TokenBudget;
            grade_truncated(env, &mut ep).await;
            return Ok(ep);
        }
        turn.observation_tokens = ep.push_context(&obs_ids);
        ep.turns.push(turn);
    }
    // max_turns == 0: nothing generated.
    ep.truncated = true;
    ep.end = EpisodeEnd::MaxTurns;
    Ok(ep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parse_action_cases() {
        let echo = json!({"type": "object", "additionalProperties": false,
            "properties": {"message": {"type": "string"}}, "required": ["message"]});
        // A JSON object fitting the schema wins.
        let a = parse_action(
            "I will say ```json\n{\"message\": \"hi\"}\n```",
            Some(&echo),
        )
        .unwrap();
        assert_eq!(a, json!({"message": "hi"}));
        // Otherwise the whole text goes into the only required string field.
        let a = parse_action("just text {not json}", Some(&echo)).unwrap();
        assert_eq!(a, json!({"message": "just text {not json}"}));
        // Two required fields and no JSON: an error with a reason.
        let two = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"]});
        assert!(parse_action("nothing here", Some(&two))
            .unwrap_err()
            .contains("no JSON object"));
        assert_eq!(
            parse_action(r#"x {"a": "1", "b": 2} y"#, Some(&two)).unwrap(),
            json!({"a": "1", "b": 2})
        );
        assert!(parse_action("no schema, no json", None).is_err());
        assert_eq!(parse_action(r#"{"k": 1}"#, None).unwrap(), json!({"k": 1}));
    }
}
