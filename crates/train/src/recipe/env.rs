//! `[env]`: rollouts in an environment instead of the data's prompts and verifiers.

use serde::{Deserialize, Serialize};

use super::defaults::{one, one_usize};

/// `[env]`: roll out in an environment. Each step resets `prompts_per_step` episodes (one
/// reset seed per group, shared by its `num_generations` samples), the policy plays up to
/// `max_turns` turns, and the env's reward replaces the verifiers' score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSection {
    /// `"builtin"` (an env of composer-env, in process), `"openenv"` (a remote server taking
    /// text actions) or `"openenv_tools"` (a remote MCP-tool server, played as a chat with
    /// tools in the chat template's format: see `tool_env`).
    pub kind: String,
    /// Built-in env name: `"code"` (sandboxed Python tasks) or `"echo"`.
    #[serde(default)]
    pub name: Option<String>,
    /// OpenEnv server URL (`http://HOST:PORT`); several servers comma-separated, each running
    /// up to `max_concurrent` episodes.
    #[serde(default)]
    pub url: Option<String>,
    /// Environment variable holding the server URL(s), read when `url` is unset.
    #[serde(default)]
    pub url_env: Option<String>,
    /// Most model turns per episode.
    #[serde(default = "one_usize")]
    pub max_turns: usize,
    /// Most tokens per episode (prompt, model turns and observations).
    #[serde(default = "d_env_max_tokens")]
    pub max_total_tokens: usize,
    /// Most concurrent episodes per server.
    #[serde(default = "d_env_concurrent")]
    pub max_concurrent: usize,
    /// Limit of one env call (reset/step), seconds.
    #[serde(default = "d_env_call_timeout")]
    pub call_timeout_s: f64,
    /// Limit of one whole episode, seconds.
    #[serde(default = "d_env_episode_timeout")]
    pub episode_timeout_s: f64,
    /// Limit of one connection attempt to an OpenEnv server, seconds.
    #[serde(default = "d_env_connect_timeout")]
    pub connect_timeout_s: f64,
    /// How long a server may fail every connection without one success before the pool gives
    /// it up, seconds; when every server is given up the run stops with an error
    /// (composer-env's `PoolConfig::server_down_budget`).
    #[serde(default = "d_env_server_down_budget")]
    pub server_down_budget_s: f64,
    /// Retries of a failed episode (server error, restart...) before its sample is replaced
    /// by a zero-advantage copy of a peer.
    #[serde(default = "d_env_retries")]
    pub episode_retries: usize,
    /// `"final"`: the last step's reward; `"sum"`: the sum over the episode's steps.
    #[serde(default = "d_env_reward")]
    pub reward: String,
    /// Rewards at or above this count as passed (hint channel, pass rates).
    #[serde(default = "one")]
    pub pass_reward: f64,
    /// Template of the first observation (the prompt); `{observation}` is replaced.
    #[serde(default = "d_env_template")]
    pub prompt_template: String,
    /// Template of later observations, appended after each model turn (masked out of the loss).
    #[serde(default = "d_env_template")]
    pub observation_template: String,
    /// `openenv_tools`: a Jinja chat template file to render tools and tool results with,
    /// in place of the checkpoint's own (which must otherwise support tools).
    #[serde(default)]
    pub chat_template: Option<std::path::PathBuf>,
    /// `openenv_tools`: a system message before the task (None: the template's default).
    #[serde(default)]
    pub system_prompt: Option<String>,
}

fn d_env_max_tokens() -> usize {
    1024
}
fn d_env_concurrent() -> usize {
    4
}
fn d_env_call_timeout() -> f64 {
    60.0
}
fn d_env_episode_timeout() -> f64 {
    300.0
}
fn d_env_connect_timeout() -> f64 {
    10.0
}
fn d_env_server_down_budget() -> f64 {
    60.0
}
fn d_env_retries() -> usize {
    1
}
fn d_env_reward() -> String {
    "final".into()
}
fn d_env_template() -> String {
    "{observation}".into()
}
