//! Exact async resume from any checkpoint, including one written between `checkpoint_every`
//! steps (Ctrl-C, SIGTERM, an env server gone).
//!
//! Step t of an async run samples with the weights of step [`sampling_step`]`(t)`, up to
//! `max_staleness` steps behind. A checkpoint of step m on a `checkpoint_every` boundary is
//! enough to continue (no later step samples with older weights), but one between boundaries
//! is not: it also carries the weights of the steps before m that the steps after m sample
//! with, as `checkpoint/async-weights/step-J-of-M.safetensors`, and a resumed run samples with
//! them exactly as the uninterrupted run did. They are written inside the checkpoint before
//! it is published, so a checkpoint never lacks them.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

/// The folder of a checkpoint holding the weights later steps sample with.
pub const SNAPSHOT_DIR: &str = "async-weights";

/// The step whose weights sample step `step`: `max(step − 1 − k, c)`, where c is the last
/// `checkpoint_every` boundary before `step` (a barrier: right after a checkpoint the
/// generator waits for the checkpointed weights), never before `floor_step`, the oldest step
/// whose weights the run holds.
pub fn sampling_step(step: usize, k: usize, checkpoint_every: usize, floor_step: usize) -> usize {
    let lagged = step.saturating_sub(1 + k);
    let barrier = match checkpoint_every {
        0 => 0,
        ck => (step - 1) / ck * ck,
    };
    lagged.max(barrier).max(floor_step)
}

/// The steps before `m` whose weights the steps after `m` sample with (none when `m` is a
/// `checkpoint_every` boundary).
pub fn steps_needed_after(m: usize, k: usize, checkpoint_every: usize) -> Vec<usize> {
    (m + 1..=m + 1 + k)
        .map(|t| sampling_step(t, k, checkpoint_every, 0))
        .filter(|&j| j < m)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn file_name(step: usize, of: usize) -> String {
    format!("step-{step}-of-{of}.safetensors")
}

/// The files of `snapshots` (step, weights) that the checkpoint of step `m` carries, under
/// `async-weights/` (written inside the checkpoint, atomically with it).
pub fn snapshot_files(
    m: usize,
    snapshots: &[(usize, HashMap<String, Tensor>)],
) -> Result<Vec<(String, Vec<u8>)>> {
    snapshots
        .iter()
        .map(|(step, weights)| {
            let name = format!("{SNAPSHOT_DIR}/{}", file_name(*step, m));
            Ok((name, crate::checkpoint::safetensors_bytes(weights)?))
        })
        .collect()
}

/// One stored weight snapshot: (policy version step, weights by name, its file).
pub type Snapshot = (usize, HashMap<String, Tensor>, PathBuf);

/// The weights a checkpoint of step `m` carries for later steps: (step, weights, file),
/// oldest first; none when it has no `async-weights/` (a boundary checkpoint).
pub fn read_snapshots(checkpoint: &Path, m: usize, device: &Device) -> Result<Vec<Snapshot>> {
    let dir = checkpoint.join(SNAPSHOT_DIR);
    if !dir.is_dir() {
        return Ok(vec![]);
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry
            .with_context(|| format!("listing {}", dir.display()))?
            .path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let step = name
            .strip_prefix("step-")
            .and_then(|r| r.strip_suffix(&format!("-of-{m}.safetensors")))
            .and_then(|s| s.parse::<usize>().ok());
        let Some(step) = step.filter(|&j| j < m) else {
            continue;
        };
        let weights = candle_core::safetensors::load(&path, device)
            .with_context(|| format!("reading {}", path.display()))?;
        out.push((step, weights, path));
    }
    out.sort_by_key(|(step, _, _)| *step);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_between_checkpoints_need_the_older_weights() {
        // k = 1, a checkpoint every 2: step 4 samples with step 2's weights.
        assert_eq!(sampling_step(4, 1, 2, 0), 2);
        assert_eq!(steps_needed_after(3, 1, 2), vec![2]);
        assert_eq!(steps_needed_after(2, 1, 2), Vec::<usize>::new());
        // k = 3, every 10: steps 6..=9 sample with 2..=5.
        assert_eq!(steps_needed_after(5, 3, 10), vec![2, 3, 4]);
        // The floor clamps to the weights a run holds.
        assert_eq!(sampling_step(4, 1, 2, 3), 3);
    }

    #[test]
    fn snapshots_round_trip_for_their_own_step_only() {
        let dir = tempfile::tempdir().unwrap();
        let w = HashMap::from([(
            "w".to_string(),
            Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap(),
        )]);
        for (name, bytes) in snapshot_files(5, &[(3, w.clone()), (4, w)]).unwrap() {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes).unwrap();
        }
        let read = read_snapshots(dir.path(), 5, &Device::Cpu).unwrap();
        let steps: Vec<usize> = read.iter().map(|(s, _, _)| *s).collect();
        assert_eq!(steps, vec![3, 4]);
        assert_eq!(read[0].1["w"].to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
        assert!(read_snapshots(dir.path(), 6, &Device::Cpu)
            .unwrap()
            .is_empty());
    }
}
