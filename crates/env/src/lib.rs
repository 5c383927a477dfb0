//! composer-env: the environment side of composer-rl.
//!
//! - [`Env`]: the async `reset` / `step` / `close` interface every environment implements,
//!   with text observations, rewards, `done` and feedback text.
//! - Built-ins: [`CodeEnv`] (sandboxed Python graded by unit tests) and [`EchoEnv`] (the
//!   OpenEnv echo env), made by [`builtin_env_factory`].
//! - [`OpenEnvClient`] / [`RemoteEnv`]: an OpenEnv server over WebSocket `/ws` + HTTP.
//! - [`serve_env`]: serves any [`EnvFactory`] with the OpenEnv protocol.
//! - [`EnvPool`]: bounded concurrent episodes over several servers/factories, with latency
//!   percentiles (the τ_V wall) and failure counts by cause; sessions are reused across
//!   episodes.
//! - [`repo`]: repository feature-deletion tasks (tools, episodes, grading, task making).
//! - [`run_episode`]: token-faithful multi-turn episodes driven by a [`TurnPolicy`].
//! - [`ToolEnv`]: episodes through MCP tools (OpenEnv's `list_tools` / `call_tool`).

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod builtin;
mod client;
mod env;
mod episode;
mod pool;
pub mod repo;
mod schema;
mod server;
mod tools_client;

pub use builtin::{builtin_env_factory, CodeEnv, CodeEnvConfig, EchoEnv, TaskSelection};
pub use client::{OpenEnvClient, OpenEnvClientConfig, RemoteEnv};
pub use env::{
    parse_reward, render_observation, Action, Env, EnvError, EnvFactory, FailureKind, ResetOptions,
    StepResult, STEP_TIME_LIMIT_KEY,
};
pub use episode::{
    parse_action, run_episode, run_episode_until, Episode, EpisodeConfig, EpisodeEnd, Turn,
    TurnEnd, TurnOutput, TurnPolicy,
};
pub use pool::{
    EnvPool, FailureCounts, LatencySummary, PoolConfig, PoolStats, PooledEnv, ServerStats,
};
pub use schema::{validate_action, ValidationIssue};
pub use server::{serve_env, serve_env_until, ServeConfig};
pub use tools_client::{parse_tool_listing, ToolCallOutcome, ToolDef, ToolEnv};
