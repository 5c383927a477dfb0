//! One outer round of a replica: publishing its pseudo-gradient and applying the round's
//! accepted payloads (the outer step), with the checks on what is fetched.
use crate::codec::{decode, encode, Decoded, FlatTensor};
use crate::config::Compression;
use crate::outer;
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use candle_core::Var;
use object_store::path::Path;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use super::{
    find_var, set_var, var_to_vec, ClosedRound, DeltaPayload, DilocoReplica, FragmentId, Member,
    Pending, Rejected, RoundReport, PAYLOAD_DELTA, PAYLOAD_LOCAL,
};

impl DilocoReplica {
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
        let bytes = Bytes::from(encode(&deltas, self.config.compression, meta).with_context(
            || {
                format!(
                    "diloco replica {}: encoding its round {round} pseudo-gradient",
                    self.replica_id
                )
            },
        )?);
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

    pub(super) fn adopt(&mut self, tensors: Vec<FlatTensor>) {
        for t in tensors {
            if let Some(name) = t.name.strip_prefix("momentum/") {
                self.momentum.insert(name.to_string(), t.data);
            } else {
                self.global.insert(t.name, t.data);
            }
        }
    }

    pub(super) async fn fetch(&mut self, key: &Path) -> Result<Decoded> {
        let (d, len) = self.fetch_sized(key).await?;
        self.bytes_down_total += len;
        Ok(d)
    }

    pub(super) async fn fetch_sized(&self, key: &Path) -> Result<(Decoded, u64)> {
        let b = self
            .store
            .get(key)
            .await?
            .ok_or_else(|| anyhow!("diloco: {key} disappeared"))?;
        let d = decode(&b).with_context(|| format!("diloco: rejecting corrupt object {key}"))?;
        Ok((d, b.len() as u64))
    }

    /// Decodes a delta and checks its metadata and tensors against this round's fragment.
    pub(super) fn check_delta(
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
    pub(super) fn check_names(
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
}
