//! Tokenizer (`tokenizer.json` through the `tokenizers` crate) and the Jinja chat template
//! (`chat_template.jinja`, or `tokenizer_config.json`'s `chat_template`) through `minijinja`,
//! configured like transformers' renderer (trim_blocks, lstrip_blocks, `raise_exception`).

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::Path;

/// A `tokenizers::Tokenizer` plus the special tokens named in `tokenizer_config.json`.
#[derive(Clone)]
pub struct Tokenizer {
    /// The wrapped tokenizer.
    pub inner: tokenizers::Tokenizer,
    /// `tokenizer_config.json` as read (or synthesised), written back on save.
    pub config: Value,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Reads `dir/tokenizer.json` and, if present, `dir/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            bail!("missing tokenizer file {}", path.display());
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow!("loading {}: {e}", path.display()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let config = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("reading {}", cfg_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("parsing {} as JSON", cfg_path.display()))?
        } else {
            json!({})
        };
        Ok(Tokenizer { inner, config })
    }

    /// Wraps an in-memory tokenizer (e.g. the trainer's character-level one).
    pub fn from_tokenizers(inner: tokenizers::Tokenizer) -> Self {
        Tokenizer {
            inner,
            config: json!({}),
        }
    }

    /// Token ids of `text`, without special tokens (no BOS/EOS added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing text: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids` (special tokens kept, so a round trip is faithful).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("decoding token ids: {e}"))
    }

    /// Display text of `ids` without special tokens, as transformers'
    /// `decode(ids, skip_special_tokens=True)` (the CLI's `completion_text`).
    pub fn decode_skip_special(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("decoding token ids: {e}"))
    }

    /// Number of ids the tokenizer can produce (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Largest id the tokenizer can produce (added tokens included), or None when empty.
    /// Ids need not be contiguous, so this, not [`Tokenizer::vocab_size`], bounds the
    /// embedding rows a tokenizer needs.
    pub fn max_token_id(&self) -> Option<u32> {
        self.inner.get_vocab(true).into_values().max()
    }

    /// Id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// A special token string named in `tokenizer_config.json` (`eos_token`, `bos_token`,
    /// `pad_token`; plain string or `{"content": ...}`).
    pub fn special_token(&self, key: &str) -> Option<String> {
        match self.config.get(key)? {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
            _ => None,
        }
    }

    /// Id of `eos_token` from `tokenizer_config.json`, if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.special_token("eos_token")
            .and_then(|t| self.token_to_id(&t))
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("tokenizer.json");
        let text = self
            .inner
            .to_string(true)
            .map_err(|e| anyhow!("serialising tokenizer: {e}"))?;
        crate::checkpoint::write_atomic(&path, text.as_bytes())?;
        let mut cfg = self.config.clone();
        if let Value::Object(m) = &mut cfg {
            // The template lives in chat_template.jinja (transformers 5 layout).
            m.remove("chat_template");
            m.entry("tokenizer_class")
                .or_insert(json!("PreTrainedTokenizerFast"));
        }
        crate::checkpoint::write_atomic(
            &dir.join("tokenizer_config.json"),
            serde_json::to_string_pretty(&cfg)?.as_bytes(),
        )
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// Message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A Hugging Face chat template (Jinja source plus the special tokens it may reference).
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// Jinja source.
    pub source: String,
    /// `bos_token` passed to the template.
    pub bos_token: String,
    /// `eos_token` passed to the template.
    pub eos_token: String,
}

impl ChatTemplate {
    /// Reads `dir/chat_template.jinja`, else `chat_template` from `dir/tokenizer_config.json`
    /// (a string, or a list of `{name, template}` where `default` is used). None if neither.
    pub fn from_dir(dir: &Path, tokenizer: Option<&Tokenizer>) -> Result<Option<Self>> {
        let bos = tokenizer
            .and_then(|t| t.special_token("bos_token"))
            .unwrap_or_default();
        let eos = tokenizer
            .and_then(|t| t.special_token("eos_token"))
            .unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            Some(
                std::fs::read_to_string(&jinja)
                    .with_context(|| format!("reading {}", jinja.display()))?,
            )
        } else {
            let cfg_path = dir.join("tokenizer_config.json");
            let from_cfg = match tokenizer {
                Some(t) => t.config.get("chat_template").cloned(),
                None if cfg_path.exists() => {
                    let text = std::fs::read_to_string(&cfg_path)
                        .with_context(|| format!("reading {}", cfg_path.display()))?;
                    let v: Value = serde_json::from_str(&text)
                        .with_context(|| format!("parsing {} as JSON", cfg_path.display()))?;
                    v.get("chat_template").cloned()
                }
                None => None,
            };
            match from_cfg {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|e| e.get("name").and_then(Value::as_str) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|e| e.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                Some(other) => bail!(
                    "{}: key `chat_template` must be a string or a list, got {other}",
                    cfg_path.display()
                ),
            }
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let t = ChatTemplate {
            source,
            bos_token: bos,
            eos_token: eos,
        };
        // Fail early on a template that does not parse.
        t.env()
            .with_context(|| format!("chat template in {}", dir.display()))?;
        Ok(Some(t))
    }

    fn env(&self) -> Result<minijinja::Environment<'static>> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<minijinja::Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.set_unknown_method_callback(pycompat_method);
        env.add_filter("tojson", python_tojson);
        env.add_template_owned("chat", self.source.clone())
            .map_err(|e| anyhow!("parsing chat template: {e}"))?;
        Ok(env)
    }

    /// Renders the prompt for `messages`; `add_generation_prompt` appends the assistant
    /// turn header, as transformers' `apply_chat_template` does.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders `messages` with tool definitions, as transformers'
    /// `apply_chat_template(messages, tools=tools)`: `tools` is the template's `tools`
    /// variable (None renders as Python's `None`), each entry a JSON object such as
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`.
    /// `tojson` is transformers' (Python `json.dumps` with `", "` / `": "` separators, no
    /// ASCII escaping); object keys come out sorted (serde_json maps are ordered by key).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = self.env()?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| anyhow!("chat template: {e}"))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .map_err(|e| anyhow!("rendering chat template: {e}"))
    }

    /// Writes `chat_template.jinja` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        crate::checkpoint::write_atomic(&dir.join("chat_template.jinja"), self.source.as_bytes())
    }
}

/// transformers' `tojson` filter: `json.dumps(value, ensure_ascii=False)` (separators
/// `", "` and `": "`), or indented with `indent=N` (separators `","` and `": "`), as the
/// renderer of `apply_chat_template` defines it (minijinja's own `tojson` is compact and
/// HTML-escapes, which would change what the model sees).
fn python_tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    use minijinja::{Error, ErrorKind};
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json: Value = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = Vec::new();
    let fmt = PythonJsonFormatter {
        indent,
        depth: 0,
        has_items: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(&json, &mut ser)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    // Safe: the template author asked for JSON text, not HTML (no auto-escaping is on).
    Ok(minijinja::Value::from_safe_string(text))
}

/// A serde_json formatter that writes what Python's `json.dumps` writes.
struct PythonJsonFormatter {
    indent: Option<usize>,
    depth: usize,
    has_items: bool,
}

impl PythonJsonFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(n) = self.indent {
            w.write_all(b"\n")?;
            w.write_all(" ".repeat(n * self.depth).as_bytes())?;
        }
        Ok(())
    }
    fn separator<W: ?Sized + std::io::Write>(&self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            let sep: &[u8] = if self.indent.is_some() { b"," } else { b", " };
            w.write_all(sep)?;
        }
        self.newline(w)
    }
    fn open<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.depth += 1;
        self.has_items = false;
        w.write_all(b)
    }
    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.depth -= 1;
        if self.has_items {
            self.newline(w)?;
        }
        self.has_items = true;
        w.write_all(b)
    }
}

impl serde_json::ser::Formatter for PythonJsonFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.separator(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_items = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.separator(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_items = true;
        Ok(())
    }
}

/// The Python string/dict methods HF chat templates commonly call (`.strip()`,
/// `.startswith()`, `.items()`, ...), which Jinja2 inherits from Python.
fn pycompat_method(
    _state: &minijinja::State,
    value: &minijinja::Value,
    method: &str,
    args: &[minijinja::Value],
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    use minijinja::{Error, ErrorKind, Value as V};
    let arg_str =
        |i: usize| -> Option<String> { args.get(i).and_then(|a| a.as_str().map(str::to_string)) };
    if let Some(s) = value.as_str() {
        let out = match method {
            "strip" => match arg_str(0) {
                Some(c) => V::from(s.trim_matches(|ch| c.contains(ch))),
                None => V::from(s.trim()),
            },
            "lstrip" => match arg_str(0) {
                Some(c) => V::from(s.trim_start_matches(|ch| c.contains(ch))),
                None => V::from(s.trim_start()),
            },
            "rstrip" => match arg_str(0) {
                Some(c) => V::from(s.trim_end_matches(|ch| c.contains(ch))),
                None => V::from(s.trim_end()),
            },
            "startswith" => V::from(arg_str(0).is_some_and(|p| s.starts_with(&p))),
            "endswith" => V::from(arg_str(0).is_some_and(|p| s.ends_with(&p))),
            "upper" => V::from(s.to_uppercase()),
            "lower" => V::from(s.to_lowercase()),
            "split" => match arg_str(0) {
                Some(sep) => V::from(s.split(sep.as_str()).map(V::from).collect::<Vec<_>>()),
                None => V::from(s.split_whitespace().map(V::from).collect::<Vec<_>>()),
            },
            "replace" => match (arg_str(0), arg_str(1)) {
                (Some(a), Some(b)) => V::from(s.replace(&a, &b)),
                _ => return Err(Error::new(ErrorKind::MissingArgument, "replace(old, new)")),
            },
            _ => {
                return Err(Error::new(
                    ErrorKind::UnknownMethod,
                    format!("string has no method {method}"),
                ))
            }
        };
        return Ok(out);
    }
    if value.kind() == minijinja::value::ValueKind::Map {
        match method {
            "items" => {
                let mut items = Vec::new();
                for k in value.try_iter()? {
                    let v = value.get_item(&k)?;
                    items.push(V::from(vec![k, v]));
                }
                return Ok(V::from(items));
            }
            "keys" => return Ok(V::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => {
                let mut vals = Vec::new();
                for k in value.try_iter()? {
                    vals.push(value.get_item(&k)?);
                }
                return Ok(V::from(vals));
            }
            "get" => {
                let key = args.first().cloned().unwrap_or_default();
                let v = value.get_item(&key)?;
                return Ok(if v.is_undefined() {
                    args.get(1).cloned().unwrap_or(V::from(()))
                } else {
                    v
                });
            }
            _ => {}
        }
    }
    Err(Error::new(
        ErrorKind::UnknownMethod,
        format!("no method {method}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_tokenizer() -> Tokenizer {
        let shared = match std::env::var("COMPOSER_SHARED") {
            Ok(p) if !p.is_empty() => std::path::PathBuf::from(p),
            _ => std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared")),
        };
        Tokenizer::from_dir(&shared.join("fixtures/hf-tiny/qwen2-tiny")).expect("fixture")
    }

    #[test]
    fn decode_skip_special_drops_special_tokens_only() {
        let tok = fixture_tokenizer();
        // 1 = `<|im_start|>`, 2 = `<|im_end|>` (special added tokens of the fixture).
        let mut ids = vec![1];
        ids.extend(tok.encode("def add").unwrap());
        ids.push(2);
        assert_eq!(tok.decode(&ids).unwrap(), "<|im_start|>def add<|im_end|>");
        assert_eq!(tok.decode_skip_special(&ids).unwrap(), "def add");
    }
}
