//! Catching up with the store (adopting the newest global weights) and the replica's
//! checkpoints (save, load, the store's round listing).
use crate::codec::{decode, encode, FlatTensor};
use crate::config::Compression;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::Var;
use std::collections::{BTreeMap, HashMap};

use super::{find_var, set_var, DilocoReplica, FragmentId};

impl DilocoReplica {
    /// Adopts the newest global weights + momentum of every fragment found in the store and
    /// moves `round` past them (never backwards). Returns whether anything changed.
    pub async fn catch_up(&mut self) -> Result<bool> {
        let f_count = self.config.num_fragments as u64;
        let rounds = self.store_rounds_newest_first().await?;
        let mut newest: Option<u64> = None;
        for f in 0..f_count {
            for &r in rounds.iter().filter(|r| *r % f_count == f) {
                if r < self.round {
                    break; // this replica already holds that fragment's state
                }
                let key = self.keys.global(r, f as usize);
                if !self.store.exists(&key).await? {
                    continue;
                }
                let d = self.fetch(&key).await?;
                self.check_names(&d.tensors, &key, Some(f as usize))?;
                self.adopt(d.tensors);
                newest = Some(newest.map_or(r, |n: u64| n.max(r)));
                break;
            }
        }
        match newest {
            Some(r) if r + 1 > self.round => {
                self.round = r + 1;
                self.local_step = 0;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Writes the current global weights into `vars` (all fragments, or one).
    pub fn write_global_into(
        &self,
        vars: &[(String, Var)],
        fragment: Option<FragmentId>,
    ) -> Result<()> {
        let names: Vec<&String> = match fragment {
            Some(f) => self.fragments[f].iter().collect(),
            None => self.shapes.keys().collect(),
        };
        for name in names {
            set_var(
                find_var(vars, name)?,
                self.global[name].clone(),
                &self.shapes[name],
            )?;
        }
        Ok(())
    }

    /// Saves the outer state (round, global weights snapshot, momentum) to a safetensors file.
    pub fn save_state(&self, path: &std::path::Path) -> Result<()> {
        composer_fsutil::write_atomic(path, &self.state_bytes()?)
            .with_context(|| format!("writing diloco state {}", path.display()))
    }

    /// The outer state as the bytes of a safetensors file, for the trainer's checkpoint
    /// (which writes it atomically with the weights it belongs to).
    pub fn state_bytes(&self) -> Result<Vec<u8>> {
        let mut all = Vec::new();
        for (name, shape) in &self.shapes {
            all.push(FlatTensor {
                name: format!("global/{name}"),
                shape: shape.clone(),
                data: self.global[name].clone(),
            });
            all.push(FlatTensor {
                name: format!("momentum/{name}"),
                shape: shape.clone(),
                data: self.momentum[name].clone(),
            });
        }
        let mut meta = BTreeMap::new();
        meta.insert("kind".into(), "replica-state".into());
        meta.insert("round".into(), self.round.to_string());
        meta.insert("replica".into(), self.replica_id.clone());
        encode(&all, Compression::F32, meta)
    }

    /// Restores the outer state saved by [`save_state`](Self::save_state), then adopts any newer
    /// rounds from the store (writing them into `vars`). Local weights in `vars` are otherwise
    /// left as the trainer's checkpoint has them. A state ahead of the store's newest round
    /// (it belongs to another run or store) is an error, and nothing is changed.
    pub async fn load_state(
        &mut self,
        path: &std::path::Path,
        vars: &[(String, Var)],
    ) -> Result<()> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let d = decode(&bytes).with_context(|| format!("diloco state {}", path.display()))?;
        let round: u64 = d
            .metadata
            .get("round")
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| anyhow!("diloco state {}: metadata.round missing", path.display()))?;
        let mut global = HashMap::new();
        let mut momentum = HashMap::new();
        for t in d.tensors {
            let (map, name) = if let Some(n) = t.name.strip_prefix("global/") {
                (&mut global, n.to_string())
            } else if let Some(n) = t.name.strip_prefix("momentum/") {
                (&mut momentum, n.to_string())
            } else {
                bail!(
                    "diloco state {}: unexpected tensor {:?}",
                    path.display(),
                    t.name
                );
            };
            match self.shapes.get(&name) {
                Some(s) if *s == t.shape => {
                    map.insert(name, t.data);
                }
                _ => bail!(
                    "diloco state {}: tensor {name:?} {:?} does not match this model",
                    path.display(),
                    t.shape
                ),
            }
        }
        if global.len() != self.shapes.len() || momentum.len() != self.shapes.len() {
            bail!(
                "diloco state {}: {} global / {} momentum tensors for {} parameters",
                path.display(),
                global.len(),
                momentum.len(),
                self.shapes.len()
            );
        }
        // A state at round R applied round R − 1, whose global weights the store then holds.
        // A store whose rounds stop earlier belongs to another run (or an older copy): the
        // replica would publish round R while its peers wait at an earlier round, and each
        // side would time out and train alone. (A store with no round at all is a fresh one
        // the run is moved to, which the state seeds.)
        let newest = self.newest_closed_round().await?;
        if let Some(newest) = newest.filter(|n| round > n + 1) {
            bail!(
                "diloco state {} is at round {round}, but the store's newest round is {newest} \
                 (prefix {:?}): this state belongs to another run or store",
                path.display(),
                self.keys.prefix().as_ref()
            );
        }
        self.global = global;
        self.momentum = momentum;
        self.round = round;
        self.local_step = 0;
        self.pending = None;
        // A replica killed after publishing round r but before its checkpoint finds just r
        // closed: it redoes r's steps (bit-identically) and adopts the stored result at r's
        // publish, so its resume is exact. Further behind, it jumps to the newest round.
        let behind = newest.map_or(0, |newest| (newest + 1).saturating_sub(self.round));
        if behind > 1 && self.catch_up().await? {
            self.write_global_into(vars, None)?;
        }
        Ok(())
    }

    /// The round numbers that have a folder in the store, newest first.
    pub(super) async fn store_rounds_newest_first(&self) -> Result<Vec<u64>> {
        let mut rounds: Vec<u64> = self
            .store
            .list_dirs(self.keys.prefix())
            .await?
            .iter()
            .filter_map(|d| d.strip_prefix("round-")?.parse().ok())
            .collect();
        rounds.sort_unstable_by(|a, b| b.cmp(a));
        Ok(rounds)
    }

    /// The newest round whose global weights the store holds.
    pub(super) async fn newest_closed_round(&self) -> Result<Option<u64>> {
        let f_count = self.config.num_fragments as u64;
        let rounds = self.store_rounds_newest_first().await?;
        for r in rounds {
            let fragment = (r % f_count) as usize;
            if self.store.exists(&self.keys.global(r, fragment)).await? {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }
}
