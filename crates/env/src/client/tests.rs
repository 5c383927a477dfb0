//! Unit tests of the client's URL handling, frames and MCP detection.
use super::session::{closes_session, parse_frame};
use super::*;

#[test]
fn urls() {
    let (h, w) = server_urls("http://127.0.0.1:8765/").unwrap();
    assert_eq!(
        (h.as_str(), w.as_str()),
        ("http://127.0.0.1:8765", "ws://127.0.0.1:8765/ws")
    );
    let (h, w) = server_urls("ws://host:1/ws").unwrap();
    assert_eq!(
        (h.as_str(), w.as_str()),
        ("http://host:1", "ws://host:1/ws")
    );
    assert!(server_urls("127.0.0.1:8765").is_err());
    assert!(server_urls("ftp://x").is_err());
    assert!(server_urls("http://").is_err());
}

#[test]
fn error_frames() {
    let e = parse_frame(r#"{"type":"error","data":{"message":"Invalid message","code":"VALIDATION_ERROR","errors":[]}}"#).unwrap_err();
    assert!(matches!(e, EnvError::InvalidAction { .. }) && !closes_session(&e));
    let e = parse_frame(r#"{"type":"error","data":{"message":"x","code":"CAPACITY_REACHED","active_sessions":1,"max_sessions":1}}"#).unwrap_err();
    assert!(matches!(e, EnvError::Capacity(_)) && closes_session(&e));
    let e = parse_frame(r#"{"type":"error","data":{"message":"boom","code":"EXECUTION_ERROR"}}"#)
        .unwrap_err();
    assert!(!closes_session(&e));
    let e = parse_frame(r#"{"type":"error","data":{"message":"'text'","code":"SESSION_ERROR"}}"#)
        .unwrap_err();
    assert!(closes_session(&e));
    assert!(parse_frame("nope").is_err());
}
