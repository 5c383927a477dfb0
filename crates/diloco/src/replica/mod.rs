//! One DiLoCo replica: publishes pseudo-gradients, closes rounds, applies the outer step.
//!
//! The outer round (publish, apply) lives in `round`, catching up with the store and the
//! replica's checkpoints in `state`; both are `impl DilocoReplica` blocks over the types here.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use bytes::Bytes;
use candle_core::{DType, Device, Tensor, Var};
use object_store::path::Path;
use object_store::ObjectStore;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use crate::codec::{encode, Decoded, FlatTensor};
use crate::config::{Compression, DilocoConfig};
use crate::store::{Keys, RetryingStore};

/// `payload` metadata of a delta object holding θ_local (lossless f32 codec).
const PAYLOAD_LOCAL: &str = "local-weights";
/// `payload` metadata of a delta object holding Δ = θ_global − θ_local (bf16 / int8 codecs).
const PAYLOAD_DELTA: &str = "pseudo-gradient";

/// Index of a model fragment (0..num_fragments).
pub type FragmentId = usize;

/// What a trainer does after an inner step (see [`DilocoReplica::phase_after`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Nothing to do: keep training.
    Train,
    /// Publish this fragment's pseudo-gradient (upload runs in the background).
    Publish(FragmentId),
    /// Wait for the round's quorum and apply the outer step to this fragment.
    Apply(FragmentId),
    /// Publish and apply at once (τ = 0).
    PublishAndApply(FragmentId),
}

/// What one round did, for the progress bar and the `diloco/*` metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundReport {
    /// The round applied (`diloco/round`).
    pub round: u64,
    /// The fragment it updated.
    pub fragment: FragmentId,
    /// Replicas whose pseudo-gradients were averaged (`diloco/replicas`).
    pub replicas_in_quorum: usize,
    /// Their ids, sorted.
    pub members: Vec<String>,
    /// Delta objects rejected as corrupt/foreign (skipped, with a warning).
    pub rejected_keys: Vec<String>,
    /// Whether this replica's own pseudo-gradient was part of the round.
    pub own_delta_used: bool,
    /// Bytes this replica uploaded for the round.
    pub bytes_up: u64,
    /// Bytes this replica downloaded for the round.
    pub bytes_down: u64,
    /// Seconds spent blocked in publish + apply (`time/outer_sync_s`).
    pub outer_sync_s: f64,
    /// The replica was behind and jumped to the store's latest global weights instead.
    pub caught_up: bool,
}

/// Membership of a closed round (`closed.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClosedRound {
    /// Round number.
    pub round: u64,
    /// Fragment synced in the round.
    pub fragment: FragmentId,
    /// Replica whose conditional put created this object.
    pub closed_by: String,
    /// `"all"` (every expected replica published) or `"timeout"`.
    pub reason: String,
    /// The pseudo-gradients every replica averages, sorted by replica id.
    pub members: Vec<Member>,
    /// Objects under the round's delta folder that the closer rejected (corrupt, truncated,
    /// foreign or misnamed), with the reason; never averaged. Every replica reports them.
    #[serde(default)]
    pub rejected: Vec<Rejected>,
}

/// A delta object rejected when a round closed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rejected {
    /// Object key.
    pub key: String,
    /// Why it was rejected (decode or metadata error).
    pub reason: String,
}

/// One averaged pseudo-gradient object, pinned by length and checksum.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Member {
    /// Replica id.
    pub replica: String,
    /// Object key.
    pub key: String,
    /// Object length in bytes.
    pub bytes: u64,
    /// `metadata.sha256` of the object.
    pub sha256: String,
}

/// A decoded delta object: θ_local (lossless f32 codec) or Δ itself (lossy codecs).
struct DeltaPayload {
    local_weights: bool,
    tensors: Vec<FlatTensor>,
}

impl DeltaPayload {
    fn from_decoded(d: Decoded) -> Result<Self> {
        let local_weights = match d.metadata.get("payload").map(String::as_str) {
            Some(PAYLOAD_LOCAL) => true,
            Some(PAYLOAD_DELTA) => false,
            other => {
                bail!("metadata.payload {other:?}: expected {PAYLOAD_LOCAL:?} or {PAYLOAD_DELTA:?}")
            }
        };
        Ok(Self {
            local_weights,
            tensors: d.tensors,
        })
    }
}

struct Pending {
    round: u64,
    fragment: FragmentId,
    /// Own decoded delta (what everyone else will read), with its sha and size, if published.
    own: Option<(DeltaPayload, String, u64)>,
    upload: Option<JoinHandle<Result<bool>>>,
    bytes_up: u64,
    sync_s: f64,
    caught_up: bool,
}

/// A DiLoCo replica (one per training process).
///
/// Outer-state consistency: every replica computes the outer step itself from the member set
/// in `closed.json` (summed in replica-id order), then tries to create `global.safetensors`
/// (weights + momentum of the fragment). The first writer wins; the others download the
/// winner's object and adopt it, so all replicas hold bit-identical global weights and
/// momentum even across devices, and a late or restarted replica recovers both from the store.
pub struct DilocoReplica {
    store: RetryingStore,
    keys: Keys,
    replica_id: String,
    config: DilocoConfig,
    shapes: BTreeMap<String, Vec<usize>>,
    fragments: Vec<Vec<String>>,
    global: HashMap<String, Vec<f32>>,
    momentum: HashMap<String, Vec<f32>>,
    round: u64,
    local_step: usize,
    pending: Option<Pending>,
    bytes_up_total: u64,
    bytes_down_total: u64,
}

fn var_to_vec(var: &Var) -> Result<Vec<f32>> {
    Ok(var
        .as_tensor()
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

fn set_var(var: &Var, data: Vec<f32>, shape: &[usize]) -> Result<()> {
    let t = Tensor::from_vec(data, shape, &Device::Cpu)?
        .to_dtype(var.dtype())?
        .to_device(var.device())?;
    var.set(&t)?;
    Ok(())
}

fn find_var<'a>(vars: &'a [(String, Var)], name: &str) -> Result<&'a Var> {
    vars.iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
        .ok_or_else(|| anyhow!("diloco: parameter {name:?} missing from the vars passed in"))
}

/// Splits names (sorted) into `n` contiguous groups of roughly equal element count.
fn split_fragments(shapes: &BTreeMap<String, Vec<usize>>, n: usize) -> Result<Vec<Vec<String>>> {
    if shapes.len() < n {
        bail!(
            "diloco.num_fragments ({n}) exceeds the number of parameters ({})",
            shapes.len()
        );
    }
    let total: usize = shapes.values().map(|s| s.iter().product::<usize>()).sum();
    let mut groups: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut acc = 0usize;
    let names: Vec<&String> = shapes.keys().collect();
    for (i, name) in names.iter().enumerate() {
        let numel: usize = shapes[*name].iter().product();
        // Target group by the element midpoint, but leave at least one name per later group.
        let mut g = ((acc + numel / 2) * n / total.max(1)).min(n - 1);
        let remaining_names = names.len() - i;
        let first_empty = groups.iter().position(|g| g.is_empty()).unwrap_or(n);
        let empty_after = n - first_empty;
        if remaining_names <= empty_after {
            g = first_empty;
        }
        // Groups stay contiguous: never go back to an earlier group.
        let last_used = groups.iter().rposition(|g| !g.is_empty()).unwrap_or(0);
        g = g.max(last_used);
        groups[g].push((*name).clone());
        acc += numel;
    }
    Ok(groups)
}

fn validate_id(id: &str) -> Result<()> {
    if id.is_empty()
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!("diloco replica id {id:?}: use 1+ characters from [A-Za-z0-9_-]");
    }
    Ok(())
}

impl DilocoReplica {
    /// Joins the run under `prefix` in `store` with the trainer's parameters `vars` (f32 master
    /// weights; any device). The first replica publishes `vars` as the initial global weights
    /// (conditional put); every other replica, and any replica rejoining later, adopts the
    /// store's latest global weights and momentum and writes them into `vars`.
    pub async fn join(
        store: Arc<dyn ObjectStore>,
        prefix: Path,
        replica_id: &str,
        config: DilocoConfig,
        vars: &[(String, Var)],
    ) -> Result<Self> {
        config.validate()?;
        validate_id(replica_id)?;
        let mut shapes = BTreeMap::new();
        let mut init = Vec::new();
        for (name, var) in vars {
            shapes.insert(name.clone(), var.dims().to_vec());
            init.push(FlatTensor {
                name: name.clone(),
                shape: var.dims().to_vec(),
                data: var_to_vec(var)?,
            });
        }
        if shapes.len() != vars.len() {
            bail!("diloco: duplicate parameter names in the vars passed to join");
        }
        let fragments = split_fragments(&shapes, config.num_fragments)?;
        let store = RetryingStore::new(
            store,
            config.store_retry_budget(),
            config.store_retries,
            Duration::from_secs_f64(config.store_backoff_s),
        );
        let mut me = Self {
            store,
            keys: Keys::new(prefix),
            replica_id: replica_id.to_string(),
            config,
            shapes,
            fragments,
            global: HashMap::new(),
            momentum: HashMap::new(),
            round: 0,
            local_step: 0,
            pending: None,
            bytes_up_total: 0,
            bytes_down_total: 0,
        };
        let init_key = me.keys.init();
        let mut meta = BTreeMap::new();
        meta.insert("kind".into(), "init".into());
        let bytes = Bytes::from(encode(&init, Compression::F32, meta)?);
        let len = bytes.len() as u64;
        let init_values = if me.store.put_create(&init_key, bytes).await? {
            me.bytes_up_total += len;
            init
        } else {
            let theirs = me.fetch(&init_key).await?;
            me.check_names(&theirs.tensors, &init_key, None)?;
            theirs.tensors
        };
        for t in init_values {
            me.momentum.insert(t.name.clone(), vec![0.0; t.data.len()]);
            me.global.insert(t.name, t.data);
        }
        me.catch_up().await?;
        me.write_global_into(vars, None)?;
        Ok(me)
    }

    /// Replica id.
    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }
    /// Next round this replica will publish to / apply.
    pub fn round(&self) -> u64 {
        self.round
    }
    /// Inner steps since the last applied round.
    pub fn local_step(&self) -> usize {
        self.local_step
    }
    /// The configuration.
    pub fn config(&self) -> &DilocoConfig {
        &self.config
    }
    /// Parameter names of each fragment.
    pub fn fragments(&self) -> &[Vec<String>] {
        &self.fragments
    }
    /// Total bytes uploaded since join.
    pub fn bytes_up_total(&self) -> u64 {
        self.bytes_up_total
    }
    /// Total bytes downloaded since join.
    pub fn bytes_down_total(&self) -> u64 {
        self.bytes_down_total
    }
    /// The current global weights of a parameter (as of the last applied round).
    pub fn global(&self, name: &str) -> Option<&[f32]> {
        self.global.get(name).map(Vec::as_slice)
    }
    /// The current outer momentum buffer of a parameter.
    pub fn momentum(&self, name: &str) -> Option<&[f32]> {
        self.momentum.get(name).map(Vec::as_slice)
    }

    /// The fragment synced in `round`.
    pub fn fragment_of(&self, round: u64) -> FragmentId {
        (round % self.config.num_fragments as u64) as usize
    }

    /// What to do once `steps_since_sync` inner steps have completed since the last applied
    /// round (torchft StreamingDiLoCo: publish at period − τ, apply at period = H / F).
    pub fn phase_after(&self, steps_since_sync: usize) -> Phase {
        let period = self.config.round_period();
        let publish_at = period - self.config.fragment_sync_delay;
        let f = self.fragment_of(self.round);
        match (steps_since_sync == publish_at, steps_since_sync >= period) {
            (true, true) => Phase::PublishAndApply(f),
            (true, false) => Phase::Publish(f),
            (false, true) => Phase::Apply(f),
            (false, false) => Phase::Train,
        }
    }

    /// Counts one inner step without acting (for callers that drive [`publish`](Self::publish)
    /// and [`apply`](Self::apply) themselves from [`phase_after`](Self::phase_after);
    /// `apply` resets the count).
    pub fn count_step(&mut self) {
        self.local_step += 1;
    }

    /// Call after every inner optimizer step: counts the step and publishes / applies when the
    /// schedule says so. Returns the report when a round was applied (vars then hold the new
    /// weights).
    pub async fn after_inner_step(
        &mut self,
        vars: &[(String, Var)],
    ) -> Result<Option<RoundReport>> {
        self.local_step += 1;
        match self.phase_after(self.local_step) {
            Phase::Train => Ok(None),
            Phase::Publish(_) => {
                self.publish(vars).await?;
                Ok(None)
            }
            Phase::Apply(_) | Phase::PublishAndApply(_) => Ok(Some(self.apply(vars).await?)),
        }
    }
}

mod round;
mod state;
