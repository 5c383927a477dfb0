//! The `code` verifier: a JSONL row's answer holds the unit tests, the completion's code runs
//! against them in the sandbox (a real python3 subprocess), reward = fraction passed.

use composer_train::recipe::VerifierSpec;
use composer_train::verifiers::{CodeAnswer, RewardFn};

fn code_reward() -> RewardFn {
    RewardFn::from_specs(&[VerifierSpec {
        kind: "code".into(),
        weight: 1.0,
        pattern: None,
    }])
    .unwrap()
}

const ANSWER: &str = r#"{"entry_point": "add", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]}"#;

#[test]
fn code_verifier_scores_the_fraction_of_tests_passed() {
    let r = code_reward();
    let right = "```python\ndef add(a, b):\n    return a + b\n```";
    assert_eq!(r.score(right, ANSWER).0, 1.0);
    // `a + 2` is right only where b == 2: tests 1 and 3 of 4.
    let half = "```python\ndef add(a, b):\n    return a + 2\n```";
    assert_eq!(r.score(half, ANSWER).0, 0.5);
    let missing = "def sub(a, b):\n    return a - b\n";
    assert_eq!(r.score(missing, ANSWER).0, 0.0);
    assert_eq!(r.max_reward(), 1.0);
}

#[test]
fn malformed_code_answers_score_zero_and_parse_errors_say_why() {
    let r = code_reward();
    let right = "def add(a, b):\n    return a + b\n";
    assert_eq!(r.score(right, "3").0, 0.0);
    let e = CodeAnswer::parse("3").unwrap_err().to_string();
    assert!(e.contains("entry_point") && e.contains("tests"), "{e}");
    let e = CodeAnswer::parse(r#"{"entry_point": "add", "tests": []}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tests"), "{e}");
}
