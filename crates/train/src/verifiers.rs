//! Built-in verifiers: exact match, numeric match (`\boxed{}` or the last number), regex; several
//! combine as a weighted sum.

use anyhow::Result;
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
                "regex" => Verifier::Regex(s.pattern.clone().unwrap_or_default()),
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
