//! Built-in verifiers: exact match, numeric match (`\boxed{}` or the last number), regex, and
//! code with unit tests run in the sandbox; several combine as a weighted sum.

use anyhow::{Context, Result};
use regex::Regex;

use crate::recipe::VerifierSpec;

/// One reward function over (completion text, reference answer) → [0, 1].
#[derive(Debug, Clone)]
pub enum Verifier {
    /// 1 when the trimmed completion equals the trimmed answer.
    Exact,
    /// 1 when the completion's number (`\boxed{..}` content if present, else the last number)
    /// equals the answer's number.
    Numeric,
    /// 1 when the regex (with `{answer}` replaced by the escaped answer) matches.
    Regex(String),
    /// The fraction of unit tests the completion's Python code passes, run in
    /// composer-sandbox (time, memory, process, file-size limits; no network). The row's
    /// `answer` is a JSON object `{"entry_point": "f", "tests": ["assert f(1) == 2", ...]}`
    /// (see [`CodeAnswer`]); a malformed one scores 0.
    Code,
}

/// The reference answer of a `code` verifier row.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeAnswer {
    /// Name of the function the completion must define.
    pub entry_point: String,
    /// Test statements (typically `assert`s), each run separately.
    pub tests: Vec<String>,
}

impl CodeAnswer {
    /// Parses a row's `answer`; the error names what is wrong.
    pub fn parse(answer: &str) -> Result<Self> {
        let a: CodeAnswer = serde_json::from_str(answer).map_err(|e| {
            anyhow::anyhow!(
                "a `code` verifier's answer must be JSON {{\"entry_point\": ..., \"tests\": [...]}}: {e}"
            )
        })?;
        if a.tests.is_empty() {
            anyhow::bail!("a `code` verifier's answer has no tests");
        }
        Ok(a)
    }
}

impl Verifier {
    /// Score one completion.
    pub fn score(&self, completion: &str, answer: &str) -> f64 {
        let ok = match self {
            Verifier::Exact => completion.trim() == answer.trim(),
            Verifier::Numeric => match (extract_number(completion), extract_number(answer)) {
                (Some(a), Some(b)) => (a - b).abs() <= 1e-9 * b.abs().max(1.0),
                _ => false,
            },
            Verifier::Regex(p) => Regex::new(&p.replace("{answer}", &regex::escape(answer.trim())))
                .map(|r| r.is_match(completion))
                .unwrap_or(false),
            Verifier::Code => return score_code(completion, answer),
        };
        if ok {
            1.0
        } else {
            0.0
        }
    }
}

/// The number a completion states: the content of the last `\boxed{...}` if any, else the
/// last number in the text (commas inside numbers ignored).
pub fn extract_number(text: &str) -> Option<f64> {
    let num = Regex::new(r"-?\d[\d,]*(?:\.\d+)?").ok()?;
    let source = match text.rfind("\\boxed{") {
        Some(i) => {
            let rest = &text[i + 7..];
            &rest[..rest.find('}').unwrap_or(rest.len())]
        }
        None => text,
    };
    let m = num.find_iter(source).last()?;
    m.as_str().replace(',', "").parse().ok()
}

/// Weighted sum of verifiers.
#[derive(Debug, Clone)]
pub struct RewardFn {
    /// (verifier, weight).
    pub parts: Vec<(Verifier, f64)>,
}

impl RewardFn {
    /// Build from recipe specs (validated by the recipe parser).
    pub fn from_specs(specs: &[VerifierSpec]) -> Result<Self> {
        let mut parts = Vec::new();
        for s in specs {
            let v = match s.kind.as_str() {
                "exact" => Verifier::Exact,
                "numeric" => Verifier::Numeric,
                "regex" => {
                    // The pattern is checked here, once, with a stand-in answer: a missing one
                    // would match everything and a broken one nothing, silently.
                    let p = s
                        .pattern
                        .clone()
                        .context("the regex verifier needs a pattern")?;
                    regex::Regex::new(&p.replace("{answer}", "0"))
                        .with_context(|| format!("the regex verifier's pattern {p:?}"))?;
                    Verifier::Regex(p)
                }
                "code" => Verifier::Code,
                k => anyhow::bail!("unknown verifier kind {k:?}"),
            };
            parts.push((v, s.weight));
        }
        Ok(Self { parts })
    }

    /// Total reward and its components.
    pub fn score(&self, completion: &str, answer: &str) -> (f64, Vec<f64>) {
        let comps: Vec<f64> = self
            .parts
            .iter()
            .map(|(v, _)| v.score(completion, answer))
            .collect();
        let total = comps.iter().zip(&self.parts).map(|(c, (_, w))| c * w).sum();
        (total, comps)
    }

    /// Largest reachable reward (sum of positive weights): "solved" means reaching it.
    pub fn max_reward(&self) -> f64 {
        self.parts.iter().map(|(_, w)| w.max(0.0)).sum()
    }
}

/// Fraction of the answer's tests that the completion's code passes in the sandbox.
fn score_code(completion: &str, answer: &str) -> f64 {
    let Ok(a) = CodeAnswer::parse(answer) else {
        return 0.0;
    };
    let task = composer_sandbox::CodeTask {
        id: "dataset".into(),
        prompt: String::new(),
        entry_point: a.entry_point,
        tests: a.tests,
    };
    let code = composer_sandbox::extract_code(completion);
    composer_sandbox::grade(
        &code,
        &task,
        &composer_sandbox::SandboxLimits::default(),
        composer_sandbox::RewardMode::FractionPassed,
    )
    .reward
}
