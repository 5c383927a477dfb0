//! Repository tasks (issue 18): a feature was deleted from a Python code base, the agent
//! restores it with tools over a sandboxed working copy, and hidden tests grade it.
//!
//! - [`task`]: the on-disk format (`DIR/<id>/task.toml`, `repo/`, `visible_tests/`,
//!   `hidden_tests/`) and [`load_tasks`].
//! - [`tools`]: [`RepoEpisode`] with the seven tools of `REPO_ENV.md` ([`tool_specs`],
//!   [`RepoEpisode::call_tool`]); a server wraps it per session.
//! - [`env`]: [`RepoEnv`], the tasks as an [`crate::Env`] with MCP tools (`serve-env repo`).
//! - [`grade`]: grading the candidate cannot reach (see that module for the design).
//! - [`make_tasks`]: builds tasks from a Python repository with a test suite.

pub mod env;
pub mod grade;
pub mod make_tasks;
pub mod task;
pub mod tools;

pub use env::RepoEnv;
pub use grade::{grade_working_copy, RepoGrade};
pub use make_tasks::{make_tasks, MakeTasksReport};
pub use task::{load_task, load_tasks, RepoRewardMode, RepoTask, TaskFile};
pub use tools::{
    require_private_root, tool_specs, EpisodeBudget, RepoEpisode, ToolError, ToolErrorKind,
    ToolOutput, ToolSpec,
};

/// Picks a task by id, or by `seed` (modulo the number of tasks) when no id is given.
pub fn pick_task<'a>(
    tasks: &'a [RepoTask],
    task_id: Option<&str>,
    seed: Option<u64>,
) -> anyhow::Result<&'a RepoTask> {
    match task_id {
        Some(id) => tasks
            .iter()
            .find(|t| t.id() == id)
            .ok_or_else(|| anyhow::anyhow!("no task with id {id:?}")),
        None if tasks.is_empty() => anyhow::bail!("no tasks loaded"),
        None => Ok(&tasks[(seed.unwrap_or(0) % tasks.len() as u64) as usize]),
    }
}
