//! JSONL datasets. RL prompts: `{"prompt": "...", "answer": "..."}` or
//! `{"messages": [{"role": "user", "content": "..."}], "answer": "..."}` (rendered with the
//! model's chat template). Supervised warm-up rows: `{"prompt": "...", "completion": "..."}`.
//! Every error names the file and the 1-based line.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// One RL prompt with its reference answer.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRow {
    /// Prompt text as the model sees it (chat already rendered).
    pub prompt: String,
    /// Reference answer for the verifiers.
    pub answer: String,
}

/// One supervised example.
#[derive(Debug, Clone, PartialEq)]
pub struct SftRow {
    /// Prompt text (no loss).
    pub prompt: String,
    /// Completion text (loss on these tokens).
    pub completion: String,
}

/// A chat message.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Message {
    /// `system` | `user` | `assistant`.
    pub role: String,
    /// Text.
    pub content: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRow {
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    answer: Option<serde_json::Value>,
    completion: Option<String>,
}

/// Renders chat messages into a prompt string ending where the assistant's turn begins.
pub type ChatRenderer<'a> = &'a dyn Fn(&[Message]) -> Result<String>;

/// ChatML rendering (`<|im_start|>role\ncontent<|im_end|>\n` ..., then
/// `<|im_start|>assistant\n`): the built-in tiny model's chat template.
pub fn render_chatml(messages: &[Message]) -> Result<String> {
    let mut s = String::new();
    for m in messages {
        s.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    s.push_str("<|im_start|>assistant\n");
    Ok(s)
}

fn read_rows(path: &Path) -> Result<Vec<(usize, RawRow)>> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading dataset {}", path.display()))?;
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            let at = e.utf8_error().valid_up_to();
            let line = 1 + e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count();
            bail!(
                "{} line {line}: not valid UTF-8 (byte {at} of the file)",
                path.display()
            );
        }
    };
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row: RawRow = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not a valid row", path.display(), i + 1))?;
        rows.push((i + 1, row));
    }
    if rows.is_empty() {
        bail!("{}: no rows", path.display());
    }
    Ok(rows)
}

/// Load RL prompts: each row needs `prompt` or `messages`, and `answer` (string or number).
pub fn load_prompts(path: &Path, chat: ChatRenderer) -> Result<Vec<PromptRow>> {
    Ok(load_prompts_with_lines(path, chat)?
        .into_iter()
        .map(|(_, r)| r)
        .collect())
}

/// [`load_prompts`], each row with its 1-based line in the file.
pub fn load_prompts_with_lines(path: &Path, chat: ChatRenderer) -> Result<Vec<(usize, PromptRow)>> {
    let mut out = Vec::new();
    for (line, row) in read_rows(path)? {
        let at = || format!("{} line {line}", path.display());
        let prompt = match (row.prompt, row.messages) {
            (Some(p), None) => p,
            (None, Some(m)) => {
                chat(&m).with_context(|| format!("{}: rendering `messages`", at()))?
            }
            (Some(_), Some(_)) => bail!("{}: set `prompt` or `messages`, not both", at()),
            (None, None) => bail!("{}: missing `prompt` (or `messages`)", at()),
        };
        let answer = match row.answer {
            Some(serde_json::Value::String(s)) => s,
            Some(serde_json::Value::Number(n)) => n.to_string(),
            Some(_) => bail!("{}: `answer` must be a string or a number", at()),
            None => bail!("{}: missing `answer`", at()),
        };
        out.push((line, PromptRow { prompt, answer }));
    }
    Ok(out)
}

/// sha256 of a file's bytes as `sha256:<hex>`: the identity of a dataset or a tokenizer.
pub fn file_sha256(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(format!("sha256:{:x}", Sha256::digest(&bytes)))
}

/// Load supervised rows: each needs `prompt` (or `messages`) and `completion`.
pub fn load_sft(path: &Path, chat: ChatRenderer) -> Result<Vec<SftRow>> {
    let mut out = Vec::new();
    for (line, row) in read_rows(path)? {
        let at = || format!("{} line {line}", path.display());
        let prompt = match (row.prompt, row.messages) {
            (Some(p), None) => p,
            (None, Some(m)) => {
                chat(&m).with_context(|| format!("{}: rendering `messages`", at()))?
            }
            (Some(_), Some(_)) => bail!("{}: set `prompt` or `messages`, not both", at()),
            (None, None) => bail!("{}: missing `prompt` (or `messages`)", at()),
        };
        let completion = row
            .completion
            .with_context(|| format!("{}: missing `completion`", at()))?;
        out.push(SftRow { prompt, completion });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dataset with bytes that are not UTF-8 names the line they are on.
    #[test]
    fn non_utf8_bytes_are_named_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        let mut bytes = b"{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n".repeat(12);
        bytes.extend_from_slice(b"{\"prompt\": \"\xff\", \"answer\": \"2\"}\n");
        std::fs::write(&p, bytes).unwrap();
        let e = match read_rows(&p) {
            Ok(_) => panic!("read"),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains("line 13") && e.contains("UTF-8"), "{e}");
    }
}
