//! One DiLoCo replica: publishes pseudo-gradients, closes rounds, applies the outer step.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use candle_core::{DType, Device, Tensor, Var};
use object_store::path::Path;
use object_store::ObjectStore;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use crate::codec::{decode, encode, Decoded, FlatTensor};
use crate::config::{Compression, DilocoConfig};
use crate::outer;
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

    /// Publishes this replica's pseudo-gradient Δ = θ_global − θ_local for the current round's
    /// fragment. The upload runs in the background until [`apply`](Self::apply). If the round
    /// already closed, nothing is published (and if the replica fell further behind, it adopts
    /// the store's latest global weights into `vars`).
    pub async fn publish(&mut self, vars: &[(String, Var)]) -> Result<()> {
        if self.pending.is_some() {
            bail!("diloco: publish called twice for round {}", self.round);
        }
        let start = Instant::now();
        let round = self.round;
        let fragment = self.fragment_of(round);
        if self
            .store
            .exists(&self.keys.closed(round, fragment))
            .await?
        {
            // Only this round closed (e.g. this replica published it, was killed before its
            // checkpoint, and is redoing it): apply it like the first time, from the store's
            // record, so the redo ends bit-identical. Later rounds closed too: jump ahead.
            let before = self.round;
            if self.newest_closed_round().await? > Some(round) {
                self.catch_up().await?;
            }
            let caught_up = self.round != before;
            if caught_up {
                tracing::warn!(
                    "diloco replica {}: behind the run; jumped from round {before} to {}",
                    self.replica_id,
                    self.round
                );
                self.write_global_into(vars, None)?;
            } else {
                tracing::warn!(
                    "diloco replica {}: round {round} closed before it published; applying it without its delta",
                    self.replica_id
                );
            }
            self.pending = Some(Pending {
                round,
                fragment,
                own: None,
                upload: None,
                bytes_up: 0,
                sync_s: start.elapsed().as_secs_f64(),
                caught_up,
            });
            return Ok(());
        }
        // Lossless f32: the object carries θ_local (same size as Δ in f32) and every reader
        // forms Δ = θ_global − θ_local exactly in f64 from the bit-identical θ_global, so no
        // f32 rounding of Δ enters the outer step. Lossy codecs carry Δ itself, whose small
        // values quantise far better than weights.
        let payload = match self.config.compression {
            Compression::F32 => PAYLOAD_LOCAL,
            _ => PAYLOAD_DELTA,
        };
        let mut deltas = Vec::new();
        for name in &self.fragments[fragment] {
            let local = var_to_vec(find_var(vars, name)?)?;
            let data = if payload == PAYLOAD_LOCAL {
                local
            } else {
                outer::pseudo_gradient(&self.global[name], &local)
            };
            deltas.push(FlatTensor {
                name: name.clone(),
                shape: self.shapes[name].clone(),
                data,
            });
        }
        let mut meta = BTreeMap::new();
        meta.insert("kind".into(), "delta".into());
        meta.insert("payload".into(), payload.into());
        meta.insert("round".into(), round.to_string());
        meta.insert("fragment".into(), fragment.to_string());
        meta.insert("replica".into(), self.replica_id.clone());
        let bytes = Bytes::from(encode(&deltas, self.config.compression, meta)?);
        // Everyone averages the decoded object, so this replica uses the decoded one too.
        let decoded = decode(&bytes)?;
        let sha = decoded.metadata["sha256"].clone();
        let len = bytes.len() as u64;
        let key = self.keys.delta(round, fragment, &self.replica_id);
        let store = self.store.clone();
        let upload = tokio::spawn(async move { store.put_create(&key, bytes).await });
        self.pending = Some(Pending {
            round,
            fragment,
            own: Some((DeltaPayload::from_decoded(decoded)?, sha, len)),
            upload: Some(upload),
            bytes_up: len,
            sync_s: start.elapsed().as_secs_f64(),
            caught_up: false,
        });
        Ok(())
    }

    /// Waits for the current round to close, averages the member pseudo-gradients, applies the
    /// outer step to the fragment's global weights, mixes with the local weights
    /// ((1−α)·global + α·local) and writes the result into `vars`. Publishes first if
    /// [`publish`](Self::publish) was not called for this round.
    pub async fn apply(&mut self, vars: &[(String, Var)]) -> Result<RoundReport> {
        if self.pending.is_none() {
            self.publish(vars).await?;
        }
        let mut pending = self.pending.take().expect("pending set by publish");
        self.local_step = 0;
        let start = Instant::now();
        if pending.caught_up {
            return Ok(RoundReport {
                round: pending.round,
                fragment: pending.fragment,
                outer_sync_s: pending.sync_s,
                caught_up: true,
                ..Default::default()
            });
        }
        let (round, fragment) = (pending.round, pending.fragment);
        let own_key = self
            .keys
            .delta(round, fragment, &self.replica_id)
            .to_string();
        let mut own_created = false;
        if let Some(upload) = pending.upload.take() {
            own_created = upload
                .await
                .map_err(|e| anyhow!("diloco: upload task failed: {e}"))?
                .with_context(|| {
                    format!("diloco replica {}: publishing {own_key}", self.replica_id)
                })?;
            if !own_created {
                tracing::warn!("diloco: {own_key} already existed (earlier run of this replica?); using the stored one");
                pending.bytes_up = 0;
            }
        }
        self.bytes_up_total += pending.bytes_up;
        let mut bytes_up = pending.bytes_up;
        let mut bytes_down = 0u64;

        // Deltas seen so far: replica id -> (key, size, sha, tensors).
        let mut valid: BTreeMap<String, Member> = BTreeMap::new();
        let mut tensors: HashMap<String, DeltaPayload> = HashMap::new();
        let mut rejected: BTreeMap<String, String> = BTreeMap::new();
        if let (true, Some((t, sha, len))) = (own_created, pending.own.take()) {
            valid.insert(
                self.replica_id.clone(),
                Member {
                    replica: self.replica_id.clone(),
                    key: own_key.clone(),
                    bytes: len,
                    sha256: sha,
                },
            );
            tensors.insert(own_key.clone(), t);
        }
        let closed_key = self.keys.closed(round, fragment);
        let deadline = Instant::now() + self.config.quorum_timeout();
        let poll = Duration::from_secs_f64(self.config.poll_interval_s);
        let closed: ClosedRound = loop {
            if let Some(b) = self.store.get(&closed_key).await? {
                bytes_down += b.len() as u64;
                break serde_json::from_slice(&b)
                    .with_context(|| format!("diloco: parsing {closed_key}"))?;
            }
            let listing = self
                .store
                .list(&self.keys.delta_dir(round, fragment))
                .await?;
            for obj in listing {
                let key = obj.location.to_string();
                if tensors.contains_key(&key) || rejected.contains_key(&key) {
                    continue;
                }
                let Some(b) = self.store.get(&obj.location).await? else {
                    continue;
                };
                bytes_down += b.len() as u64;
                match self.check_delta(&b, round, fragment) {
                    Ok((replica, d)) => {
                        if key != self.keys.delta(round, fragment, &replica).to_string() {
                            let reason =
                                format!("metadata.replica {replica:?} does not match the key");
                            tracing::warn!("diloco: rejecting pseudo-gradient {key}: {reason}");
                            rejected.insert(key, reason);
                            continue;
                        }
                        let sha = d.metadata["sha256"].clone();
                        valid.insert(
                            replica.clone(),
                            Member {
                                replica,
                                key: key.clone(),
                                bytes: b.len() as u64,
                                sha256: sha,
                            },
                        );
                        tensors.insert(key, DeltaPayload::from_decoded(d)?);
                    }
                    Err(e) => {
                        tracing::warn!("diloco: rejecting corrupt pseudo-gradient {key}: {e:#}");
                        rejected.insert(key, format!("{e:#}"));
                    }
                }
            }
            let timed_out = Instant::now() >= deadline;
            let reason = if valid.len() >= self.config.num_replicas {
                Some("all")
            } else if timed_out && valid.len() >= self.config.min_replicas {
                Some("timeout")
            } else {
                None
            };
            if let Some(reason) = reason {
                let c = ClosedRound {
                    round,
                    fragment,
                    closed_by: self.replica_id.clone(),
                    reason: reason.into(),
                    members: valid.values().cloned().collect(),
                    rejected: rejected
                        .iter()
                        .map(|(key, reason)| Rejected {
                            key: key.clone(),
                            reason: reason.clone(),
                        })
                        .collect(),
                };
                let body = Bytes::from(serde_json::to_vec_pretty(&c)?);
                let len = body.len() as u64;
                if self.store.put_create(&closed_key, body).await? {
                    bytes_up += len;
                    break c;
                }
                continue; // someone else closed it: read theirs
            }
            if timed_out {
                bail!(
                    "diloco round {round} (fragment {fragment}): quorum not reached: {} of min_replicas {} published within quorum_timeout_s {} ({:?}); rejected: {:?}",
                    valid.len(),
                    self.config.min_replicas,
                    self.config.quorum_timeout_s,
                    valid.keys().collect::<Vec<_>>(),
                    rejected
                );
            }
            tokio::time::sleep(poll).await;
        };
        if closed.round != round || closed.fragment != fragment || closed.members.is_empty() {
            bail!("diloco: {closed_key} describes round {} fragment {} with {} members; expected round {round} fragment {fragment}", closed.round, closed.fragment, closed.members.len());
        }

        // Gather exactly the listed set, verified against the pinned checksums.
        let mut member_deltas: Vec<DeltaPayload> = Vec::new();
        for m in &closed.members {
            let have = valid.get(&m.replica).map(|v| v.sha256 == m.sha256) == Some(true)
                && tensors.contains_key(&m.key);
            if !have {
                let key = Path::parse(&m.key)
                    .with_context(|| format!("diloco: member key {:?} in {closed_key}", m.key))?;
                let b = self.store.get(&key).await?.ok_or_else(|| {
                    anyhow!("diloco: {} listed in {closed_key} is missing", m.key)
                })?;
                bytes_down += b.len() as u64;
                let (_, d) = self.check_delta(&b, round, fragment).with_context(|| {
                    format!("diloco: pseudo-gradient {} listed in {closed_key}", m.key)
                })?;
                if d.metadata["sha256"] != m.sha256 || b.len() as u64 != m.bytes {
                    bail!(
                        "diloco: {} does not match the checksum/length pinned in {closed_key}",
                        m.key
                    );
                }
                tensors.insert(m.key.clone(), DeltaPayload::from_decoded(d)?);
            }
            member_deltas.push(
                tensors
                    .remove(&m.key)
                    .ok_or_else(|| anyhow!("diloco: {} listed twice in {closed_key}", m.key))?,
            );
        }
        // Δ in f64 per member and tensor (see `publish` for the two payloads).
        let member_deltas: Vec<Vec<Vec<f64>>> = member_deltas
            .iter()
            .map(|d| {
                d.tensors
                    .iter()
                    .map(|t| {
                        if d.local_weights {
                            outer::pseudo_gradient_f64(&self.global[&t.name], &t.data)
                        } else {
                            t.data.iter().map(|x| *x as f64).collect()
                        }
                    })
                    .collect()
            })
            .collect();

        // Outer step on the fragment.
        let names = self.fragments[fragment].clone();
        let mut new_global: Vec<FlatTensor> = Vec::new();
        let mut new_momentum: Vec<FlatTensor> = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let per_replica: Vec<&[f64]> = member_deltas.iter().map(|d| d[i].as_slice()).collect();
            let avg = outer::average(&per_replica);
            let mut p = self.global[name].clone();
            let mut buf = self.momentum[name].clone();
            outer::sgd_step(
                &mut p,
                &mut buf,
                &avg,
                self.config.outer_lr,
                self.config.outer_momentum,
                self.config.nesterov,
            );
            new_global.push(FlatTensor {
                name: name.clone(),
                shape: self.shapes[name].clone(),
                data: p,
            });
            new_momentum.push(FlatTensor {
                name: format!("momentum/{name}"),
                shape: self.shapes[name].clone(),
                data: buf,
            });
        }
        let mut meta = BTreeMap::new();
        meta.insert("kind".into(), "global".into());
        meta.insert("round".into(), round.to_string());
        meta.insert("fragment".into(), fragment.to_string());
        let mut all = new_global.clone();
        all.extend(new_momentum.iter().cloned());
        let body = Bytes::from(encode(&all, Compression::F32, meta)?);
        let len = body.len() as u64;
        let global_key = self.keys.global(round, fragment);
        if self.store.put_create(&global_key, body).await? {
            bytes_up += len;
            self.adopt(all);
        } else {
            // Someone else's result is the round's result: adopt it bit for bit.
            let theirs = self.fetch_sized(&global_key).await?;
            bytes_down += theirs.1;
            self.check_names(&theirs.0.tensors, &global_key, Some(fragment))?;
            self.adopt(theirs.0.tensors);
        }
        self.bytes_up_total += bytes_up - pending.bytes_up;
        self.bytes_down_total += bytes_down;

        // Mix into the local weights: (1-α)·global + α·local.
        for name in &names {
            let var = find_var(vars, name)?;
            let mixed = if self.config.fragment_update_alpha == 0.0 {
                self.global[name].clone()
            } else {
                outer::merge(
                    &self.global[name],
                    &var_to_vec(var)?,
                    self.config.fragment_update_alpha,
                )
            };
            set_var(var, mixed, &self.shapes[name])?;
        }
        self.round = round + 1;
        let members: Vec<String> = closed.members.iter().map(|m| m.replica.clone()).collect();
        Ok(RoundReport {
            round,
            fragment,
            replicas_in_quorum: members.len(),
            own_delta_used: members.contains(&self.replica_id) && own_created,
            members,
            rejected_keys: {
                let mut keys: BTreeSet<String> = rejected.into_keys().collect();
                keys.extend(closed.rejected.iter().map(|r| r.key.clone()));
                keys.into_iter().collect()
            },
            bytes_up,
            bytes_down,
            outer_sync_s: pending.sync_s + start.elapsed().as_secs_f64(),
            caught_up: false,
        })
    }

    fn adopt(&mut self, tensors: Vec<FlatTensor>) {
        for t in tensors {
            if let Some(name) = t.name.strip_prefix("momentum/") {
                self.momentum.insert(name.to_string(), t.data);
            } else {
                self.global.insert(t.name, t.data);
            }
        }
    }

    async fn fetch(&mut self, key: &Path) -> Result<Decoded> {
        let (d, len) = self.fetch_sized(key).await?;
        self.bytes_down_total += len;
        Ok(d)
    }

    async fn fetch_sized(&self, key: &Path) -> Result<(Decoded, u64)> {
        let b = self
            .store
            .get(key)
            .await?
            .ok_or_else(|| anyhow!("diloco: {key} disappeared"))?;
        let d = decode(&b).with_context(|| format!("diloco: rejecting corrupt object {key}"))?;
        Ok((d, b.len() as u64))
    }

    /// Decodes a delta and checks its metadata and tensors against this round's fragment.
    fn check_delta(
        &self,
        bytes: &[u8],
        round: u64,
        fragment: FragmentId,
    ) -> Result<(String, Decoded)> {
        let d = decode(bytes)?;
        let m = &d.metadata;
        if m.get("kind").map(String::as_str) != Some("delta")
            || m.get("round") != Some(&round.to_string())
            || m.get("fragment") != Some(&fragment.to_string())
        {
            bail!("metadata kind/round/fragment {:?}/{:?}/{:?} do not match round {round} fragment {fragment}", m.get("kind"), m.get("round"), m.get("fragment"));
        }
        let replica = m
            .get("replica")
            .cloned()
            .ok_or_else(|| anyhow!("metadata.replica missing"))?;
        match m.get("payload").map(String::as_str) {
            Some(PAYLOAD_LOCAL) | Some(PAYLOAD_DELTA) => {}
            other => bail!(
                "metadata.payload {other:?} is neither {PAYLOAD_LOCAL:?} nor {PAYLOAD_DELTA:?}"
            ),
        }
        let expected = &self.fragments[fragment];
        if d.tensors.len() != expected.len()
            || d.tensors
                .iter()
                .zip(expected)
                .any(|(t, n)| &t.name != n || t.shape != self.shapes[n])
        {
            bail!(
                "tensor names/shapes do not match fragment {fragment} ({} tensors, expected {:?})",
                d.tensors.len(),
                expected
            );
        }
        Ok((replica, d))
    }

    /// Checks a global/init object's parameter names and shapes (all params, or one fragment).
    fn check_names(
        &self,
        tensors: &[FlatTensor],
        key: &Path,
        fragment: Option<FragmentId>,
    ) -> Result<()> {
        let expected: Vec<&String> = match fragment {
            Some(f) => self.fragments[f].iter().collect(),
            None => self.shapes.keys().collect(),
        };
        let params: Vec<&FlatTensor> = tensors
            .iter()
            .filter(|t| !t.name.starts_with("momentum/"))
            .collect();
        for name in &expected {
            let t = params.iter().find(|t| &&t.name == name).ok_or_else(|| {
                anyhow!("diloco: {key} lacks parameter {name:?} (different model?)")
            })?;
            if t.shape != self.shapes[*name] {
                bail!(
                    "diloco: {key}: parameter {name:?} has shape {:?}, this model {:?}",
                    t.shape,
                    self.shapes[*name]
                );
            }
        }
        if params.len() != expected.len() {
            bail!(
                "diloco: {key} has {} parameters, this model {}",
                params.len(),
                expected.len()
            );
        }
        Ok(())
    }

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
    /// left as the trainer's checkpoint has them.
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
        self.global = global;
        self.momentum = momentum;
        self.round = round;
        self.local_step = 0;
        self.pending = None;
        // A replica killed after publishing round r but before its checkpoint finds just r
        // closed: it redoes r's steps (bit-identically) and adopts the stored result at r's
        // publish, so its resume is exact. Further behind, it jumps to the newest round.
        let behind = self
            .newest_closed_round()
            .await?
            .map_or(0, |newest| (newest + 1).saturating_sub(self.round));
        if behind > 1 && self.catch_up().await? {
            self.write_global_into(vars, None)?;
        }
        Ok(())
    }

    /// The round numbers that have a folder in the store, newest first.
    async fn store_rounds_newest_first(&self) -> Result<Vec<u64>> {
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
    async fn newest_closed_round(&self) -> Result<Option<u64>> {
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
