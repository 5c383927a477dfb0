//! A repository env's replies stay small whatever the agent sends: a huge or control-character
//! tool name or argument is never echoed back in full (JSON escapes would amplify it sixfold),
//! so an agent cannot make replies outgrow a client's message limit and fail the episode.

use std::path::Path;

use composer_env::repo::{EpisodeBudget, RepoEnv};
use composer_env::{EnvError, ResetOptions};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_tool_names_and_actions_get_small_replies() {
    let tasks = Path::new(env!("CARGO_MANIFEST_DIR")).join("repo_tasks/tasks");
    let factory = RepoEnv::factory(&tasks, EpisodeBudget::default()).unwrap();
    let mut env = factory().unwrap();
    env.reset(ResetOptions {
        task_id: Some("textkit-strings-caesar".into()),
        ..ResetOptions::default()
    })
    .await
    .unwrap();
    let ctrl = "\u{1}".repeat(100_000);
    let r = env
        .step(json!({"type": "call_tool", "tool_name": ctrl, "arguments": {}}))
        .await
        .expect("an unknown tool is an error observation");
    assert!(!r.done);
    let size = r.to_wire().to_string().len();
    assert!(size < 8192, "a reply of {size} bytes");
    assert_eq!(r.observation["error"]["error_type"], "tool_not_found");
    // A malformed action is refused without echoing it whole.
    let e = env
        .step(json!({"type": "call_tool", "tool_name": 5, "arguments": {"x": ctrl}}))
        .await
        .expect_err("tool_name must be a string");
    match e {
        EnvError::InvalidAction { message, errors } => {
            assert!(message.contains("tool_name"), "{message}");
            let size = errors.to_string().len();
            assert!(size < 8192, "errors of {size} bytes");
        }
        other => panic!("{other:?}"),
    }
    // The session goes on.
    let r = env
        .step(json!({"type": "call_tool", "tool_name": "list_files", "arguments": {}}))
        .await
        .unwrap();
    assert!(r.text.contains("textkit/strings.py"), "{}", r.text);
    env.close().await.unwrap();
}
