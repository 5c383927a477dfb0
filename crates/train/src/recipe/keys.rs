//! TOML key helpers for error messages: the `[section]` and line of a key, the closest known
//! key, and splitting one table between several `deny_unknown_fields` structs.

use serde::de::DeserializeOwned;

/// Field names of a `deny_unknown_fields` struct, read from serde's "expected one of" message.
pub(super) fn field_names<T: DeserializeOwned>() -> Vec<String> {
    let mut probe = toml::Table::new();
    probe.insert("__composer_probe__".into(), toml::Value::Integer(0));
    match T::deserialize(toml::Value::Table(probe)) {
        Ok(_) => vec![],
        Err(e) => {
            let msg = e.to_string();
            let rest = msg.split_once("expected").map(|x| x.1).unwrap_or("");
            rest.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect()
        }
    }
}

/// Split `table` between several key sets (first match wins); an unknown key is an error
/// naming `section`, the line, and the closest known key.
pub(super) fn split_table(
    table: toml::Table,
    section: &str,
    sets: &[Vec<String>],
    text: &str,
) -> std::result::Result<Vec<toml::Table>, String> {
    let mut out = vec![toml::Table::new(); sets.len()];
    for (k, v) in table {
        match sets.iter().position(|s| s.contains(&k)) {
            Some(i) => {
                out[i].insert(k, v);
            }
            None => {
                let all: Vec<&String> = sets.iter().flatten().collect();
                let best = all
                    .iter()
                    .map(|c| (strsim::jaro_winkler(&k, c), c))
                    .filter(|(s, _)| *s > 0.6)
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map(|(_, c)| format!(" (did you mean `{c}`?)"))
                    .unwrap_or_default();
                return Err(format!(
                    "{}, key `[{section}] {k}`: unknown key{best}",
                    line_of(text, section, &k)
                ));
            }
        }
    }
    Ok(out)
}

/// " line N" of `key` inside `[section]`, or "" when not found.
pub(super) fn line_of(text: &str, section: &str, key: &str) -> String {
    let mut in_section = false;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            in_section = t.trim_matches(|c| c == '[' || c == ']').trim() == section;
        } else if in_section && t.split('=').next().map(str::trim) == Some(key) {
            return format!(" line {}", i + 1);
        }
    }
    String::new()
}

pub(super) fn typed<T: DeserializeOwned>(
    t: toml::Table,
    section: &str,
    text: &str,
) -> std::result::Result<T, String> {
    let keys: Vec<String> = t.keys().cloned().collect();
    T::deserialize(toml::Value::Table(t)).map_err(|e| {
        let msg = e.to_string();
        let key = keys
            .iter()
            .find(|k| msg.contains(&format!("`{k}`")))
            .or(keys.first());
        match key {
            Some(k) => format!(
                "{}, key `[{section}] {k}`: {}",
                line_of(text, section, k),
                msg.trim()
            ),
            None => format!(", section `[{section}]`: {}", msg.trim()),
        }
    })
}

/// The `[section]` header in force at 1-based `line`.
pub(super) fn section_at(text: &str, line: usize) -> String {
    let mut section = String::new();
    for l in text.lines().take(line) {
        let t = l.trim();
        if t.starts_with('[') {
            section = t.trim_matches(|c| c == '[' || c == ']').trim().to_string();
        }
    }
    section
}

/// For serde's "unknown field `x`, expected one of `a`, `b`", the closest expected key.
pub(super) fn suggestion(msg: &str) -> Option<String> {
    let rest = msg.strip_prefix("unknown field `")?;
    let (unknown, expected) = rest.split_once('`')?;
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|k| (strsim::jaro_winkler(unknown, k), k))
        .filter(|(s, _)| *s > 0.6)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.to_string())
}
