//! Unit tests of the crate root's helpers and of the grader's output truncation.
use crate::grading::truncate_text;
use crate::*;

#[test]
fn extract_code_prefers_python_fence() {
    let text = "Here:\n```text\nnot code\n```\n```python\ndef f():\n    return 1\n```\nDone";
    assert_eq!(extract_code(text), "def f():\n    return 1\n");
    assert_eq!(extract_code("```\nx = 1\n```"), "x = 1\n");
    assert_eq!(extract_code("x = 2"), "x = 2");
    assert_eq!(extract_code("```py\ny = 3\n"), "y = 3\n");
}

#[test]
fn truncation_respects_limit_and_char_boundaries() {
    let long = "é".repeat(1000);
    let cut = truncate_text(&long, 100);
    assert!(cut.len() <= 100);
    assert!(cut.ends_with("[truncated]"));
    assert_eq!(truncate_text("short", 100), "short");
}

#[test]
fn identifiers() {
    assert!(is_python_identifier("two_sum"));
    assert!(is_python_identifier("_f1"));
    assert!(!is_python_identifier("1f"));
    assert!(!is_python_identifier("f-g"));
    assert!(!is_python_identifier(""));
}
