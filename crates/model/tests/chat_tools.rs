//! Chat templates with `tools=`: composer-model's renderer against transformers'
//! `apply_chat_template` on the Qwen2.5 template (references from tools/ref_chat_tools.py).

use composer_model::{ChatMessage, ChatTemplate};
use serde_json::Value;

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn qwen25() -> ChatTemplate {
    ChatTemplate {
        source: std::fs::read_to_string(fixture("qwen2_5_tools.jinja")).unwrap(),
        bos_token: String::new(),
        eos_token: "<|im_end|>".into(),
    }
}

#[test]
fn qwen25_tools_render_like_transformers() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen2_5_tools_reference.json")).unwrap(),
    )
    .unwrap();
    let t = qwen25();
    let cases = reference["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    for case in cases {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let tools: Option<Vec<Value>> = serde_json::from_value(case["tools"].clone()).unwrap();
        let got = t
            .render_with_tools(
                &messages,
                tools.as_deref(),
                case["add_generation_prompt"].as_bool().unwrap(),
            )
            .unwrap();
        assert_eq!(
            got,
            case["rendered"].as_str().unwrap(),
            "case {}",
            case["name"]
        );
    }
}

#[test]
fn tojson_indent_matches_python() {
    // json.dumps({"a": [1, {"b": "é"}], "c": {}}, indent=2, ensure_ascii=False)
    let t = ChatTemplate {
        source: "{{ x | tojson(indent=2) }}|{{ x | tojson }}".into(),
        bos_token: String::new(),
        eos_token: String::new(),
    };
    let env_tools = [serde_json::json!({"a": [1, {"b": "é"}], "c": {}, "d": []})];
    // The template reads `tools[0]` through a one-message wrapper template instead.
    let t2 = ChatTemplate {
        source: t.source.replace('x', "tools[0]"),
        ..t
    };
    let got = t2.render_with_tools(&[], Some(&env_tools), false).unwrap();
    assert_eq!(
        got,
        "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"é\"\n    }\n  ],\n  \"c\": {},\n  \"d\": []\n}|{\"a\": [1, {\"b\": \"é\"}], \"c\": {}, \"d\": []}"
    );
}
