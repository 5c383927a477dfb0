//! Prompt text and tokens: `messages` rows rendered with the chat template, the built-in
//! tokenizer's ChatML template, and the screening of prompts against the model's vocabulary
//! and context before training starts.

use anyhow::{bail, Context, Result};
use composer_model::{ChatMessage, ChatTemplate};
use tokenizers::Tokenizer;

use crate::checkpoint;
use crate::data::{Message, PromptRow};
use crate::tokenizer as chartok;

/// Renders `messages` with `template` as transformers' `apply_chat_template(messages,
/// add_generation_prompt=True)`.
pub fn render_messages(template: Option<&ChatTemplate>, messages: &[Message]) -> Result<String> {
    let t = template.context(
        "`messages` rows need a chat template (the checkpoint has no chat_template.jinja and no `chat_template` in tokenizer_config.json)",
    )?;
    let msgs: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage::new(&m.role, &m.content))
        .collect();
    t.render(&msgs, true)
}

/// The ChatML template of the built-in char tokenizer.
pub fn chatml_template() -> ChatTemplate {
    ChatTemplate {
        source: checkpoint::CHATML_TEMPLATE.to_string(),
        bos_token: String::new(),
        eos_token: chartok::EOS_TOKEN.to_string(),
    }
}

/// Checks each prompt's token ids against the model's vocabulary and that it has any (errors
/// naming `at[i]`)
/// and its length against the context `ctx`: an overlong prompt is an error naming `at[i]`,
/// or with `skip` is dropped; returns the kept rows and the number dropped.
pub(crate) fn screen_prompts(
    rows: Vec<PromptRow>,
    at: &[String],
    tok: &Tokenizer,
    vocab: usize,
    ctx: usize,
    skip: bool,
) -> Result<(Vec<PromptRow>, usize)> {
    let mut kept = Vec::with_capacity(rows.len());
    let mut skipped = 0;
    for (r, at) in rows.into_iter().zip(at) {
        let ids = chartok::encode(tok, &r.prompt).with_context(|| format!("{at}: tokenizing"))?;
        if ids.is_empty() {
            // Refused here, with the file and line, not at the rollout that meets the row
            // (which could be hundreds of steps into the run).
            bail!("{at}: the prompt is empty (it tokenizes to nothing)");
        }
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!(
                "{at}: the prompt has token id {id}, outside the model's vocabulary of {vocab} \
                 (the tokenizer is larger than the model's embedding)"
            );
        }
        if ids.len() >= ctx {
            if skip {
                skipped += 1;
                continue;
            }
            bail!(
                "{at}: the prompt is {} tokens, leaving no room in the model's context of {ctx} \
                 tokens (max_position_embeddings); shorten it, or set `[data] overlong_prompts = \
                 \"skip\"` to drop such rows",
                ids.len()
            );
        }
        kept.push(r);
    }
    Ok((kept, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(prompt: &str) -> PromptRow {
        PromptRow {
            prompt: prompt.into(),
            answer: "0".into(),
        }
    }

    #[test]
    fn an_empty_prompt_is_refused_naming_the_line() {
        let tok = chartok::build_char_tokenizer(["abc"]).unwrap();
        let at = vec!["d.jsonl line 1".to_string(), "d.jsonl line 451".to_string()];
        let full = tok.get_vocab_size(true);
        let e = screen_prompts(vec![row("1+1="), row("")], &at, &tok, full, 100, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("d.jsonl line 451") && e.contains("empty"), "{e}");
    }

    #[test]
    fn token_ids_outside_the_vocabulary_are_refused_naming_the_line() {
        let tok = chartok::build_char_tokenizer(["abc"]).unwrap();
        let at = vec![
            "data.jsonl line 1".to_string(),
            "data.jsonl line 2".to_string(),
        ];
        let rows = vec![row("1+1="), row("abc")];
        let full = tok.get_vocab_size(true);
        let (kept, skipped) = screen_prompts(rows.clone(), &at, &tok, full, 100, false).unwrap();
        assert_eq!((kept.len(), skipped), (2, 0));
        // A model whose embedding is smaller than the tokenizer: the row with the largest
        // id is named.
        let max_id = |r: &PromptRow| {
            *chartok::encode(&tok, &r.prompt)
                .unwrap()
                .iter()
                .max()
                .unwrap()
        };
        let small = max_id(&rows[0]).max(max_id(&rows[1])) as usize;
        let e = format!(
            "{:#}",
            screen_prompts(rows, &at, &tok, small, 100, false).unwrap_err()
        );
        assert!(
            e.contains("data.jsonl line") && e.contains("vocabulary"),
            "{e}"
        );
    }
}
