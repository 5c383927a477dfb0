//! Safetensors encoding of pseudo-gradients and global weights, with compression and a
//! self-verifying checksum.
//!
//! Every object carries `__metadata__.sha256`: SHA-256 over, for each tensor in name order,
//! `name ‖ 0 ‖ dtype ‖ shape (u64 LE each) ‖ raw data`. A decoder recomputes it, so a
//! truncated, overwritten or foreign object is rejected rather than averaged in.

use std::collections::{BTreeMap, HashMap};

use anyhow::{anyhow, bail, Context, Result};
use half::bf16;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use sha2::{Digest, Sha256};

use crate::config::Compression;

/// Format tag in every object's metadata.
pub const FORMAT: &str = "composer-diloco-v1";
/// Prefix of the per-tensor int8 scale tensors.
const SCALE_PREFIX: &str = "__absmax_scale__/";

/// A named flat f32 tensor with its shape (what goes in and comes out of the codec).
#[derive(Debug, Clone, PartialEq)]
pub struct FlatTensor {
    /// Parameter name (or `momentum/<name>` in global objects).
    pub name: String,
    /// Shape of the parameter.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// A decoded object: tensors in name order plus its metadata.
#[derive(Debug, Clone)]
pub struct Decoded {
    /// Tensors (dequantised to f32), sorted by name.
    pub tensors: Vec<FlatTensor>,
    /// String metadata (always has `format` and `sha256`).
    pub metadata: BTreeMap<String, String>,
}

struct Encoded {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "F32",
        Dtype::BF16 => "BF16",
        Dtype::I8 => "I8",
        _ => "other",
    }
}

fn checksum(tensors: &[Encoded]) -> String {
    let mut order: Vec<&Encoded> = tensors.iter().collect();
    order.sort_by(|a, b| a.name.cmp(&b.name));
    let mut h = Sha256::new();
    for t in order {
        h.update(t.name.as_bytes());
        h.update([0u8]);
        h.update(dtype_name(t.dtype).as_bytes());
        for d in &t.shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update(&t.bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn quantize(t: &FlatTensor, compression: Compression, out: &mut Vec<Encoded>) {
    match compression {
        Compression::F32 => out.push(Encoded {
            name: t.name.clone(),
            dtype: Dtype::F32,
            shape: t.shape.clone(),
            bytes: t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }),
        Compression::Bf16 => out.push(Encoded {
            name: t.name.clone(),
            dtype: Dtype::BF16,
            shape: t.shape.clone(),
            bytes: t
                .data
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        }),
        Compression::Int8 => {
            let absmax = t.data.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if absmax > 0.0 { absmax / 127.0 } else { 1.0 };
            out.push(Encoded {
                name: t.name.clone(),
                dtype: Dtype::I8,
                shape: t.shape.clone(),
                bytes: t
                    .data
                    .iter()
                    .map(|v| ((v / scale).round().clamp(-127.0, 127.0) as i8) as u8)
                    .collect(),
            });
            out.push(Encoded {
                name: format!("{SCALE_PREFIX}{}", t.name),
                dtype: Dtype::F32,
                shape: vec![1],
                bytes: scale.to_le_bytes().to_vec(),
            });
        }
    }
}

/// Encodes tensors as one safetensors object with `compression`, adding `format`,
/// `compression` and `sha256` to `metadata`. A NaN or infinite value is an error naming the
/// tensor and index.
pub fn encode(
    tensors: &[FlatTensor],
    compression: Compression,
    metadata: BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut encoded = Vec::with_capacity(tensors.len() * 2);
    for t in tensors {
        // Refused here, not only on decode: int8 would turn NaN into 0 and an Inf into a
        // scale that zeroes the tensor, so a diverged replica's delta would decode as valid.
        if let Some(bad) = t.data.iter().position(|v| !v.is_finite()) {
            bail!(
                "tensor {}: non-finite value {} at index {bad}",
                t.name,
                t.data[bad]
            );
        }
        quantize(t, compression, &mut encoded);
    }
    let mut meta: HashMap<String, String> = metadata.into_iter().collect();
    meta.insert("format".into(), FORMAT.into());
    meta.insert("compression".into(), compression.name().into());
    meta.insert("sha256".into(), checksum(&encoded));
    let views = encoded
        .iter()
        .map(|e| {
            TensorView::new(e.dtype, e.shape.clone(), &e.bytes)
                .map(|v| (e.name.clone(), v))
                .map_err(|err| anyhow!("tensor {}: {err}", e.name))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, Some(meta)).context("serializing safetensors")
}

/// Decodes and verifies an object produced by [`encode`]. Any structural problem or checksum
/// mismatch is an error (callers name the key).
pub fn decode(bytes: &[u8]) -> Result<Decoded> {
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| anyhow!("not a safetensors object: {e}"))?;
    let st =
        SafeTensors::deserialize(bytes).map_err(|e| anyhow!("not a safetensors object: {e}"))?;
    let metadata: BTreeMap<String, String> = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    if metadata.get("format").map(String::as_str) != Some(FORMAT) {
        bail!(
            "metadata.format is {:?}, expected {FORMAT:?}",
            metadata.get("format")
        );
    }
    let expected = metadata
        .get("sha256")
        .ok_or_else(|| anyhow!("metadata.sha256 missing"))?;
    let mut raw = Vec::new();
    for (name, view) in st.tensors() {
        raw.push(Encoded {
            name,
            dtype: view.dtype(),
            shape: view.shape().to_vec(),
            bytes: view.data().to_vec(),
        });
    }
    let actual = checksum(&raw);
    if &actual != expected {
        bail!("checksum mismatch: metadata.sha256 {expected}, content {actual}");
    }
    let scales: HashMap<String, f32> = raw
        .iter()
        .filter_map(|e| {
            e.name.strip_prefix(SCALE_PREFIX).map(|n| {
                let s = e
                    .bytes
                    .get(..4)
                    .map_or(f32::NAN, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                (n.to_string(), s)
            })
        })
        .collect();
    let mut tensors = Vec::new();
    for e in raw.iter().filter(|e| !e.name.starts_with(SCALE_PREFIX)) {
        let numel: usize = e.shape.iter().product();
        let data: Vec<f32> = match e.dtype {
            Dtype::F32 => e
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => e
                .bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::I8 => {
                let s = *scales
                    .get(&e.name)
                    .ok_or_else(|| anyhow!("tensor {}: int8 without a scale", e.name))?;
                e.bytes.iter().map(|b| (*b as i8) as f32 * s).collect()
            }
            other => bail!("tensor {}: unsupported dtype {other:?}", e.name),
        };
        if data.len() != numel {
            bail!(
                "tensor {}: {} values for shape {:?}",
                e.name,
                data.len(),
                e.shape
            );
        }
        if let Some(bad) = data.iter().position(|v| !v.is_finite()) {
            bail!("tensor {}: non-finite value at index {bad}", e.name);
        }
        tensors.push(FlatTensor {
            name: e.name.clone(),
            shape: e.shape.clone(),
            data,
        });
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Decoded { tensors, metadata })
}
