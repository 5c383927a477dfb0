//! Teacher traces for the replay channel, in composer-loss's trace-store format
//! ([`composer_loss::Trace`]: prompt/completion token ids, per-token top-K ids and log-probs,
//! reward, passed), read with [`composer_loss::TraceStore`].

use std::path::Path;

use anyhow::Result;

/// One recorded teacher trace (the trace store's row type).
pub use composer_loss::Trace as TeacherTrace;

/// Read and validate a trace file (token ids inside the model's vocabulary of `vocab_size`);
/// errors name file and line.
pub fn read_traces(path: &Path, vocab_size: usize) -> Result<Vec<TeacherTrace>> {
    let store = composer_loss::TraceStore::load_within_vocab(path, vocab_size)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(store.traces)
}
