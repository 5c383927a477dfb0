//! Tool episodes in the chat template's own format: prompts with tools and tool results
//! appended after a model turn must read exactly as transformers renders the whole
//! conversation (Qwen2.5's template; references from tools/ref_chat_tools.py).

mod common;

use composer_model::{ChatMessage, ChatTemplate};
use composer_train::tool_calls::{parse_tool_calls, ToolChat};
use serde_json::Value;

fn model_fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(name)
}

fn qwen25() -> ChatTemplate {
    ChatTemplate {
        source: std::fs::read_to_string(model_fixture("qwen2_5_tools.jinja")).unwrap(),
        bos_token: String::new(),
        eos_token: "<|im_end|>".into(),
    }
}

fn reference_case(name: &str) -> Value {
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(model_fixture("qwen2_5_tools_reference.json")).unwrap(),
    )
    .unwrap();
    r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()
        .clone()
}

#[test]
fn prompt_turn_and_tool_results_concatenate_to_the_transformers_rendering() {
    let case = reference_case("system_then_tool_results");
    let msgs: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
    let tools: Vec<Value> = serde_json::from_value(case["tools"].clone()).unwrap();
    let chat = ToolChat::new(qwen25(), Some(msgs[0].content.clone()), "qwen2.5").unwrap();
    let prompt = chat.prompt(&msgs[1].content, &tools).unwrap();
    // The model's turn as sampled: its text, then the stop token `<|im_end|>`.
    let turn = format!("{}<|im_end|>", msgs[2].content);
    let calls = parse_tool_calls(&msgs[2].content);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].as_ref().unwrap().name, "submit");
    let after = chat
        .after_turn(
            &[msgs[3].content.clone(), msgs[4].content.clone()],
            true,
            "tool",
            &tools,
        )
        .unwrap();
    assert_eq!(
        format!("{prompt}{turn}{after}"),
        case["rendered"].as_str().unwrap()
    );
    // A turn cut by the token limit gets the end of the assistant message from the template.
    let cut = chat
        .after_turn(&[msgs[3].content.clone()], false, "tool", &tools)
        .unwrap();
    assert!(
        cut.starts_with("<|im_end|>\n<|im_start|>user\n<tool_response>\n"),
        "{cut:?}"
    );
}

#[test]
fn the_default_system_prompt_is_the_templates() {
    let case = reference_case("prompt_with_tools");
    let msgs: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
    let tools: Vec<Value> = serde_json::from_value(case["tools"].clone()).unwrap();
    let chat = ToolChat::new(qwen25(), None, "qwen2.5").unwrap();
    assert_eq!(
        chat.prompt(&msgs[0].content, &tools).unwrap(),
        case["rendered"].as_str().unwrap()
    );
}

#[test]
fn the_fixture_checkpoints_plain_template_is_refused_with_its_name() {
    let dir = common::hf_fixture("qwen2-tiny");
    let t = ChatTemplate::from_dir(&dir, None).unwrap().unwrap();
    let e = ToolChat::new(t, None, "the checkpoint's chat template").unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("the checkpoint's chat template") && msg.contains("<tool_call>"),
        "{msg}"
    );
}
