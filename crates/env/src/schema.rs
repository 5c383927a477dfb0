//! A small JSON Schema checker for actions: the subset pydantic emits for action models
//! (`type`, `properties`, `required`, `additionalProperties`, `anyOf`, `enum`), reporting
//! pydantic-style issues so the server's `VALIDATION_ERROR` looks like openenv's.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One validation problem, shaped like a pydantic error (`type`, `loc`, `msg`, `input`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationIssue {
    /// Error type: `missing`, `extra_forbidden`, `string_type`, `model_type`...
    #[serde(rename = "type")]
    pub kind: String,
    /// Path of the offending value.
    pub loc: Vec<Value>,
    /// Human-readable message.
    pub msg: String,
    /// The offending input.
    pub input: Value,
}

/// Checks `value` against `schema`; an empty list means valid.
pub fn validate_action(schema: &Value, value: &Value) -> Vec<ValidationIssue> {
    let mut issues = Vec::new();
    check(schema, value, &mut Vec::new(), &mut issues);
    issues
}

fn type_matches(ty: &str, v: &Value) -> bool {
    match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => true,
    }
}

fn check(schema: &Value, v: &Value, loc: &mut Vec<Value>, out: &mut Vec<ValidationIssue>) {
    let Some(s) = schema.as_object() else { return };
    if let Some(any_of) = s.get("anyOf").and_then(Value::as_array) {
        let ok = any_of.iter().any(|alt| {
            let mut sub = Vec::new();
            check(alt, v, &mut loc.clone(), &mut sub);
            sub.is_empty()
        });
        if !ok {
            out.push(issue(
                "union_type",
                loc,
                "Input matches none of the allowed types",
                v,
            ));
        }
        return;
    }
    if let Some(allowed) = s.get("enum").and_then(Value::as_array) {
        if !allowed.contains(v) {
            out.push(issue(
                "enum",
                loc,
                &format!("Input should be one of {allowed:?}"),
                v,
            ));
            return;
        }
    }
    let types: Vec<&str> = match s.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    if !types.is_empty() && !types.iter().any(|t| type_matches(t, v)) {
        let kind = match types[0] {
            "object" => "model_type",
            "string" => "string_type",
            "integer" => "int_type",
            "number" => "float_type",
            "boolean" => "bool_type",
            "array" => "list_type",
            other => other,
        };
        out.push(issue(
            kind,
            loc,
            &format!("Input should be of type {}", types.join(" or ")),
            v,
        ));
        return;
    }
    let Some(obj) = v.as_object() else { return };
    let props = s.get("properties").and_then(Value::as_object);
    if let Some(required) = s.get("required").and_then(Value::as_array) {
        for name in required.iter().filter_map(Value::as_str) {
            if !obj.contains_key(name) {
                loc.push(json!(name));
                out.push(issue("missing", loc, "Field required", v));
                loc.pop();
            }
        }
    }
    let extra_forbidden = matches!(s.get("additionalProperties"), Some(Value::Bool(false)));
    for (name, field) in obj {
        loc.push(json!(name));
        match props.and_then(|p| p.get(name)) {
            Some(field_schema) => check(field_schema, field, loc, out),
            None if extra_forbidden => out.push(issue(
                "extra_forbidden",
                loc,
                "Extra inputs are not permitted",
                field,
            )),
            None => {}
        }
        loc.pop();
    }
}

fn issue(kind: &str, loc: &[Value], msg: &str, input: &Value) -> ValidationIssue {
    ValidationIssue {
        kind: kind.into(),
        loc: loc.to_vec(),
        msg: msg.into(),
        input: input.clone(),
    }
}

/// The required string fields of an object schema, when that is all it requires.
pub(crate) fn required_string_fields(schema: &Value) -> Vec<String> {
    let props = schema.get("properties").and_then(Value::as_object);
    let required = schema.get("required").and_then(Value::as_array);
    let (Some(props), Some(required)) = (props, required) else {
        return vec![];
    };
    required
        .iter()
        .filter_map(Value::as_str)
        .filter(|name| {
            props
                .get(*name)
                .is_some_and(|p| p.get("type").and_then(Value::as_str) == Some("string"))
        })
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The echo env's action schema as openenv-core 0.3.0 serves it on `/schema` (abridged).
    fn echo_schema() -> Value {
        json!({"additionalProperties": false, "properties": {
            "metadata": {"additionalProperties": true, "type": "object"},
            "message": {"type": "string"}}, "required": ["message"], "type": "object"})
    }

    #[test]
    fn valid_and_invalid_actions() {
        assert!(validate_action(&echo_schema(), &json!({"message": "hi"})).is_empty());
        let issues = validate_action(&echo_schema(), &json!({"msg": "x"}));
        let kinds: Vec<&str> = issues.iter().map(|i| i.kind.as_str()).collect();
        assert_eq!(kinds, ["missing", "extra_forbidden"]);
        assert_eq!(issues[0].loc, vec![json!("message")]);
        let issues = validate_action(&echo_schema(), &json!({"message": 3}));
        assert_eq!(issues[0].kind, "string_type");
        assert_eq!(
            validate_action(&echo_schema(), &json!("hi"))[0].kind,
            "model_type"
        );
        assert_eq!(
            required_string_fields(&echo_schema()),
            vec!["message".to_string()]
        );
    }

    #[test]
    fn any_of_optional() {
        let s = json!({"type": "object", "properties": {"x": {"anyOf": [{"type": "string"}, {"type": "null"}]}}});
        assert!(validate_action(&s, &json!({"x": null})).is_empty());
        assert_eq!(validate_action(&s, &json!({"x": 1}))[0].kind, "union_type");
    }
}
