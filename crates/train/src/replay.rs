//! Teacher traces for the replay channel, in composer-loss's trace-store format
//! ([`composer_loss::Trace`]: prompt/completion token ids, per-token top-K ids and log-probs,
//! reward, passed), read with [`composer_loss::TraceStore`].

use std::path::Path;

use anyhow::{bail, Result};

/// One recorded teacher trace (the trace store's row type).
pub use composer_loss::Trace as TeacherTrace;

/// Read and validate a trace file; errors name file and line.
pub fn read_traces(path: &Path, vocab_size: usize) -> Result<Vec<TeacherTrace>> {
    let store = composer_loss::TraceStore::load(path).map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, t) in store.traces.iter().enumerate() {
        let bad = t
            .prompt_ids
            .iter()
            .chain(&t.completion_ids)
            .chain(t.topk_ids.iter().flatten())
            .any(|&id| id as usize >= vocab_size);
        if bad {
            bail!(
                "{}: trace #{} has a token id outside the vocabulary ({vocab_size})",
                path.display(),
                i + 1
            );
        }
    }
    Ok(store.traces)
}
