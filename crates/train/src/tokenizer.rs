//! Character-level tokenizer for the built-in tiny model.
//!
//! Built with the `tokenizers` crate as a BPE model with no merges over the data's characters
//! (each character is its own token), plus the special tokens `<|endoftext|>`, `<|im_start|>`,
//! `<|im_end|>`, and a `Fuse` decoder so decoding concatenates characters. It serialises to a
//! `tokenizer.json` that Hugging Face `tokenizers` / transformers load as-is.

use std::collections::BTreeSet;

use anyhow::{anyhow, Result};
use tokenizers::decoders::fuse::Fuse;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::{AddedToken, DecoderWrapper, Tokenizer};

/// End-of-text token: the end of every completion.
pub const EOS_TOKEN: &str = "<|endoftext|>";
/// Chat template turn start.
pub const IM_START: &str = "<|im_start|>";
/// Chat template turn end.
pub const IM_END: &str = "<|im_end|>";
/// Unknown-character token.
pub const UNK_TOKEN: &str = "<|unk|>";

/// Build a char-level tokenizer covering every character of `texts` (plus printable ASCII
/// digits and basic punctuation so that small prompt variations still tokenize).
/// Special tokens get ids 0..4: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|unk|>`.
pub fn build_char_tokenizer<'a>(texts: impl IntoIterator<Item = &'a str>) -> Result<Tokenizer> {
    let mut chars: BTreeSet<char> = texts.into_iter().flat_map(|t| t.chars()).collect();
    chars.extend("0123456789+-*=\n ".chars());
    let specials = [EOS_TOKEN, IM_START, IM_END, UNK_TOKEN];
    let mut vocab: Vocab = Vocab::default();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert(s.to_string(), i as u32);
    }
    for c in chars {
        let id = vocab.len() as u32;
        vocab.entry(c.to_string()).or_insert(id);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .unk_token(UNK_TOKEN.to_string())
        .build()
        .map_err(|e| anyhow!("building the char-level tokenizer: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_decoder(Some(DecoderWrapper::Fuse(Fuse::new())));
    tok.add_special_tokens(&specials.map(|s| AddedToken::from(s, true)));
    Ok(tok)
}

/// Encode `text` to ids (no special tokens added).
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok
        .encode(text, false)
        .map_err(|e| anyhow!("tokenizing {text:?}: {e}"))?
        .get_ids()
        .to_vec())
}

/// Decode ids to text, skipping special tokens.
pub fn decode(tok: &Tokenizer, ids: &[u32]) -> String {
    tok.decode(ids, true).unwrap_or_default()
}

/// The id of a special token, with an error naming it when absent.
pub fn token_id(tok: &Tokenizer, token: &str) -> Result<u32> {
    tok.token_to_id(token)
        .ok_or_else(|| anyhow!("tokenizer has no token {token:?}"))
}
