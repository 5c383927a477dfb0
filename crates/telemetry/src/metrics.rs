//! The metrics file: one JSON object per line (`RUN_DIR/metrics.jsonl`), flushed after every
//! line so a crashed or killed run keeps everything up to its last step.
//!
//! Training steps write a line with `"kind":"train"`, evaluations a line with `"kind":"eval"`;
//! both carry `step`. Every reader here accepts missing keys (a run without async actors has no
//! `staleness/*`, a run without DiLoCo has no `diloco/*`).

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// The metric key contract shared by the trainer (writer) and the summary/report (readers).
pub mod keys {
    pub use crate::metric_keys::names::*;
    pub use crate::metric_keys::{KIND_DILOCO, KIND_EVAL, KIND_TRAIN};
}

/// Appends metric records to a JSONL file, one object per line, flushed after each line.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl MetricsWriter {
    /// Creates (or truncates) `path`, creating its parent directories.
    pub fn create(path: &Path) -> Result<Self> {
        create_parent(path)?;
        let file = File::create(path)
            .with_context(|| format!("creating metrics file {}", path.display()))?;
        Ok(Self::from_file(path, file))
    }

    /// Opens `path` for appending (creating it if absent).
    pub fn open_append(path: &Path) -> Result<Self> {
        create_parent(path)?;
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening metrics file {} for append", path.display()))?;
        Ok(Self::from_file(path, file))
    }

    /// Opens `path` for a run resumed from the checkpoint of step `last_step`: records with
    /// `step > last_step` (written after that checkpoint, and about to be re-done) are dropped,
    /// all others (including records without a `step`) are kept in order, each as its original
    /// bytes: the kept lines are copied, never re-serialised, because a parse + re-format round
    /// trip can change a float's last digit (one ULP) and a resumed run must not rewrite
    /// history. The file is rewritten atomically (temp file in the same directory + fsync +
    /// rename), so a crash during the rewrite leaves either the old or the new file. A final
    /// line cut short by a crash (no trailing newline, not valid JSON) is dropped with a
    /// warning; any other bad line is an error naming the file and line. A missing file is
    /// created.
    pub fn open_resume(path: &Path, last_step: u64) -> Result<Self> {
        if !path.exists() {
            return Self::create(path);
        }
        let kept = read_raw_lines(path)?
            .into_iter()
            .filter(
                |(_, record)| match record.get(keys::STEP).and_then(Value::as_f64) {
                    Some(step) => step <= last_step as f64,
                    None => true,
                },
            )
            .map(|(raw, _)| raw);
        composer_fsutil::write_atomic_with(path, |out| {
            for raw in kept {
                out.write_all(raw.as_bytes())?;
                out.write_all(b"\n")?;
            }
            Ok(())
        })
        .with_context(|| format!("rewriting {}", path.display()))?;
        Self::open_append(path)
    }

    fn from_file(path: &Path, file: File) -> Self {
        Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        }
    }

    /// The file this writer appends to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one record (must be a JSON object) as one line and flushes it.
    pub fn write(&mut self, record: &Value) -> Result<()> {
        if !record.is_object() {
            bail!(
                "metrics record for {} must be a JSON object, got {}",
                self.path.display(),
                type_name(record)
            );
        }
        // Serialise first so a line is written whole or not at all.
        let mut line = serde_json::to_vec(record)
            .with_context(|| format!("serialising a metrics record for {}", self.path.display()))?;
        line.push(b'\n');
        self.out
            .write_all(&line)
            .and_then(|_| self.out.flush())
            .with_context(|| format!("writing metrics to {}", self.path.display()))
    }
}

fn create_parent(path: &Path) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent)
            .with_context(|| format!("creating directory {}", parent.display()))?;
    }
    Ok(())
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Reads every record of a metrics JSONL file. Blank lines are skipped. A bad line is an error
/// naming the file and the 1-based line number, except a final line without a trailing newline
/// that does not parse (a write cut short by a crash), which is dropped with a warning.
pub fn read_metrics(path: &Path) -> Result<Vec<Value>> {
    Ok(read_raw_lines(path)?.into_iter().map(|(_, v)| v).collect())
}

/// [`read_metrics`] for the readers that draw conclusions from the values (`report`,
/// `plan --from-run`): also refuses, naming the file, line and key, a value no run can write:
/// a negative or over-[`MAX_SECONDS`] duration, or a negative or over-[`MAX_COUNT`] count,
/// token, byte or step number (checked for the schema's keys, scalars and array items; other
/// keys and non-numbers are left alone). Such a value is corruption, and summing or charting
/// it gives nonsense shares or an infinite axis.
pub fn read_metrics_checked(path: &Path) -> Result<Vec<Value>> {
    let mut records = Vec::new();
    for (line_no, _, record) in read_numbered_lines(path)? {
        check_values(&record)
            .map_err(|e| anyhow::anyhow!("{} line {line_no}: {e}", path.display()))?;
        records.push(record);
    }
    Ok(records)
}

/// Largest duration (seconds) [`read_metrics_checked`] accepts: about 31.7 years.
pub const MAX_SECONDS: f64 = 1e9;
/// Largest count, token, byte or step number [`read_metrics_checked`] accepts (about u64's
/// range / 18): far above any real run, far below where sums lose their meaning.
pub const MAX_COUNT: f64 = 1e18;

/// The [`read_metrics_checked`] rule for one record.
fn check_values(record: &Value) -> std::result::Result<(), String> {
    use crate::metric_keys::{lookup, Unit};
    let Some(fields) = record.as_object() else {
        return Ok(());
    };
    for (key, value) in fields {
        let Some(schema) = lookup(key) else { continue };
        let max = match schema.unit {
            Unit::Seconds => MAX_SECONDS,
            Unit::Step | Unit::Count | Unit::Tokens | Unit::TokensPerSecond | Unit::Bytes => {
                MAX_COUNT
            }
            _ => continue,
        };
        let values: Vec<f64> = match value {
            Value::Array(items) => items.iter().filter_map(Value::as_f64).collect(),
            other => other.as_f64().into_iter().collect(),
        };
        if let Some(bad) = values.iter().find(|v| !(0.0..=max).contains(*v)) {
            return Err(format!(
                "{key} = {} is out of range for a value in {} (0 to {max:e})",
                if bad.abs() < 1e6 {
                    bad.to_string()
                } else {
                    format!("{bad:e}")
                },
                schema.unit.as_str()
            ));
        }
    }
    Ok(())
}

/// Every record of a metrics file with its line exactly as stored (without the line end), under
/// the rules of [`read_metrics`]. Resume copies the raw text so kept lines stay byte-identical.
fn read_raw_lines(path: &Path) -> Result<Vec<(String, Value)>> {
    Ok(read_numbered_lines(path)?
        .into_iter()
        .map(|(_, raw, v)| (raw, v))
        .collect())
}

/// [`read_raw_lines`] with each record's 1-based line number (for errors naming the line).
fn read_numbered_lines(path: &Path) -> Result<Vec<(usize, String, Value)>> {
    let file =
        File::open(path).with_context(|| format!("opening metrics file {}", path.display()))?;
    let mut reader = BufReader::new(file);
    let mut records = Vec::new();
    let mut line = String::new();
    let mut line_no = 0usize;
    loop {
        line.clear();
        let n = reader
            .read_line(&mut line)
            .with_context(|| format!("{}: reading line {}", path.display(), line_no + 1))?;
        if n == 0 {
            break;
        }
        line_no += 1;
        let complete = line.ends_with('\n');
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(text) {
            Ok(v) if v.is_object() => {
                let raw = line.strip_suffix('\n').unwrap_or(&line);
                let raw = raw.strip_suffix('\r').unwrap_or(raw);
                records.push((line_no, raw.to_string(), v));
            }
            Ok(v) => bail!(
                "{} line {}: expected a JSON object, got {}",
                path.display(),
                line_no,
                type_name(&v)
            ),
            Err(e) if !complete => {
                tracing::warn!(
                    "{} line {}: dropping a truncated final line ({e})",
                    path.display(),
                    line_no
                );
            }
            Err(e) => bail!("{} line {}: invalid JSON: {e}", path.display(), line_no),
        }
    }
    Ok(records)
}

/// A numeric field of a record, if present and a number.
pub fn num(record: &Value, key: &str) -> Option<f64> {
    record
        .get(key)
        .and_then(Value::as_f64)
        .filter(|x| x.is_finite())
}

/// The numbers in an array field of a record (non-numbers are skipped).
pub fn nums(record: &Value, key: &str) -> Vec<f64> {
    record
        .get(key)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_f64)
                .filter(|x| x.is_finite())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether a record is a training-step line: `kind == "train"`, or no `kind` and not an eval
/// line (older files without `kind`).
pub fn is_train(record: &Value) -> bool {
    match record.get(keys::KIND).and_then(Value::as_str) {
        Some(kind) => kind == keys::KIND_TRAIN,
        None => record.get(keys::EVAL_ACCURACY).is_none(),
    }
}

/// Whether a record is an evaluation line (`kind == "eval"`, or carries `eval/accuracy`).
pub fn is_eval(record: &Value) -> bool {
    match record.get(keys::KIND).and_then(Value::as_str) {
        Some(kind) => kind == keys::KIND_EVAL,
        None => record.get(keys::EVAL_ACCURACY).is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn write_then_read_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/metrics.jsonl");
        let mut w = MetricsWriter::create(&path).unwrap();
        w.write(&json!({"step": 1, "kind": "train", "reward/mean": 0.5}))
            .unwrap();
        w.write(&json!({"step": 1, "kind": "eval", "eval/accuracy": 0.25}))
            .unwrap();
        // Flushed per line: visible before the writer is dropped.
        let back = read_metrics(&path).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0]["reward/mean"], 0.5);
        assert!(is_train(&back[0]) && is_eval(&back[1]));
        assert!(w.write(&json!([1, 2])).is_err());
    }

    #[test]
    fn resume_drops_steps_after_checkpoint_and_appends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut w = MetricsWriter::create(&path).unwrap();
        for step in 1..=5 {
            w.write(&json!({"step": step, "kind": "train"})).unwrap();
        }
        w.write(&json!({"note": "no step"})).unwrap();
        drop(w);
        // A crash mid-write leaves a partial last line.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"step\": 6, \"ki").unwrap();
        drop(f);

        let mut w = MetricsWriter::open_resume(&path, 3).unwrap();
        w.write(&json!({"step": 4, "kind": "train", "resumed": true}))
            .unwrap();
        let back = read_metrics(&path).unwrap();
        let steps: Vec<Option<u64>> = back.iter().map(|r| r["step"].as_u64()).collect();
        assert_eq!(steps, vec![Some(1), Some(2), Some(3), None, Some(4)]);
        assert_eq!(back[4]["resumed"], true);
        // No temp file left behind.
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn resume_of_missing_file_creates_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut w = MetricsWriter::open_resume(&path, 10).unwrap();
        w.write(&json!({"step": 11})).unwrap();
        assert_eq!(read_metrics(&path).unwrap().len(), 1);
    }

    #[test]
    fn bad_lines_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        fs::write(&path, "{\"step\":1}\n\nnot json\n{\"step\":2}\n").unwrap();
        let err = format!("{:#}", read_metrics(&path).unwrap_err());
        assert!(err.contains("metrics.jsonl line 3"), "{err}");

        fs::write(&path, "{\"step\":1}\n[1,2]\n").unwrap();
        let err = format!("{:#}", read_metrics(&path).unwrap_err());
        assert!(
            err.contains("line 2") && err.contains("JSON object"),
            "{err}"
        );

        let missing = dir.path().join("nope.jsonl");
        let err = format!("{:#}", read_metrics(&missing).unwrap_err());
        assert!(err.contains("nope.jsonl"), "{err}");
        // Resume refuses to rewrite a file with a corrupt middle line (never lose data).
        fs::write(&path, "{\"step\":1}\nbad\n{\"step\":2}\n").unwrap();
        assert!(MetricsWriter::open_resume(&path, 1).is_err());
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"step\":1}\nbad\n{\"step\":2}\n"
        );
    }
}
