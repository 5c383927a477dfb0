//! The code env's feedback between attempts: the model learns which test failed and how, never
//! the test's source or an assertion's message — they hold the expected values, which a second
//! attempt could hard-code (reward without solving the task). The full report (for the hint
//! channel's teacher, after the episode) stays the step's `feedback`, and the last attempt's
//! observation may show it (no attempt follows).

use std::sync::Arc;

use composer_env::{CodeEnv, CodeEnvConfig, Env, ResetOptions};
use composer_sandbox::CodeTask;
use serde_json::json;

fn env() -> CodeEnv {
    let task = CodeTask {
        id: "secret".into(),
        prompt: "Write f(x).".into(),
        entry_point: "f".into(),
        tests: vec![
            "assert f(2) == 4".into(),
            "assert f(7) == 987654321, 'expected 987654321'".into(),
        ],
    };
    CodeEnv::new(CodeEnvConfig {
        tasks: Arc::new(vec![task]),
        max_attempts: 2,
        ..Default::default()
    })
    .unwrap()
}

#[tokio::test]
async fn a_next_attempt_is_not_shown_the_expected_values() {
    let mut env = env();
    env.reset(ResetOptions::default()).await.unwrap();
    let first = env
        .step(json!({"code": "def f(x):\n    return 2 * x\n"}))
        .await
        .unwrap();
    assert!(!first.done);
    for shown in [
        first.text.as_str(),
        first.observation["feedback"].as_str().unwrap(),
    ] {
        assert!(
            shown.contains("passed 1/2") && shown.contains("first failing test: #2"),
            "{shown}"
        );
        assert!(shown.contains("AssertionError"), "{shown}");
        assert!(
            !shown.contains("987654321") && !shown.contains("f(7)"),
            "{shown}"
        );
    }
    let full = first.feedback.unwrap();
    assert!(
        full.contains("987654321"),
        "the full report keeps the test: {full}"
    );
    // The last attempt: nothing follows, the full report is shown.
    let last = env
        .step(json!({"code": "def f(x):\n    return 0\n"}))
        .await
        .unwrap();
    assert!(last.done);
    assert!(last.text.contains("assert f(2) == 4"), "{}", last.text);
}
