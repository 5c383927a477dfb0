//! Hugging Face safetensors checkpoints: `model.safetensors`, or shards
//! `model-0000i-of-0000n.safetensors` listed by `model.safetensors.index.json`.
//! Weights may be stored as f32, bf16 or f16; other dtypes are an error naming the tensor.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Tensors read from a checkpoint directory, by name, plus where they came from.
pub struct LoadedCheckpoint {
    /// Tensor name → (tensor in the stored dtype, on the requested device).
    pub tensors: HashMap<String, Tensor>,
    /// Tensor name → file it was read from (for error messages).
    pub files: HashMap<String, PathBuf>,
    /// Number of shard files (1 for a single `model.safetensors`).
    pub num_shards: usize,
}

impl LoadedCheckpoint {
    /// After the model took its tensors: an error when what is left holds a decoder layer the
    /// config does not have (`model.layers.{i}` with i ≥ `num_hidden_layers`), which would
    /// otherwise be dropped silently — a config that does not describe its checkpoint. Other
    /// leftovers (a tied `lm_head.weight`, old `rotary_emb.inv_freq` buffers) are fine.
    pub fn check_no_extra_layers(&self, num_hidden_layers: usize) -> Result<()> {
        let extra = self
            .tensors
            .keys()
            .filter_map(|k| {
                let rest = k.strip_prefix("model.layers.")?;
                rest.split('.').next()?.parse::<usize>().ok()
            })
            .filter(|&i| i >= num_hidden_layers)
            .max();
        if let Some(i) = extra {
            bail!(
                "the checkpoint has weights of layer {i} but config.json says num_hidden_layers =                  {num_hidden_layers}: the config does not describe this checkpoint"
            );
        }
        Ok(())
    }

    /// Takes tensor `name`, checking its shape and converting to `dtype`; errors name the
    /// tensor and the file.
    pub fn take(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let t = self.tensors.remove(name).with_context(|| {
            format!("checkpoint is missing tensor `{name}` (expected shape {shape:?})")
        })?;
        if t.dims() != shape {
            let file = self
                .files
                .get(name)
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            bail!(
                "tensor `{name}` in {file} has shape {:?}, expected {shape:?}",
                t.dims()
            );
        }
        Ok(t.to_dtype(dtype)?)
    }
}

/// Lists the safetensors files of a checkpoint directory: the shards named by the index when
/// `model.safetensors.index.json` exists, else `model.safetensors`.
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {} as JSON", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .with_context(|| format!("{}: missing object key `weight_map`", index.display()))?;
        let mut files: Vec<String> = Vec::new();
        for (name, f) in map {
            let f = f.as_str().with_context(|| {
                format!(
                    "{}: weight_map[`{name}`] must be a file name",
                    index.display()
                )
            })?;
            if !files.iter().any(|x| x == f) {
                files.push(f.to_string());
            }
        }
        files.sort();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join(SINGLE_FILE);
    if !single.exists() {
        if dir.join(crate::lora_adapter::ADAPTER_CONFIG_FILE).is_file() {
            bail!(
                "no weights in {}: it is a PEFT LoRA adapter ({}), not a model; write full \
                 weights with `composer-rl export {} --out DIR --merge` and use DIR",
                dir.display(),
                crate::lora_adapter::ADAPTER_CONFIG_FILE,
                dir.display()
            );
        }
        bail!(
            "no weights in {}: neither {SINGLE_FILE} nor {INDEX_FILE} exists",
            dir.display()
        );
    }
    Ok(vec![single])
}

/// Reads every tensor of the checkpoint in `dir` onto `device` in its stored dtype.
pub fn load_dir(dir: &Path, device: &Device) -> Result<LoadedCheckpoint> {
    let files = checkpoint_files(dir)?;
    let mut out = LoadedCheckpoint {
        tensors: HashMap::new(),
        files: HashMap::new(),
        num_shards: files.len(),
    };
    for file in &files {
        let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .with_context(|| format!("parsing {} as safetensors", file.display()))?;
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                safetensors::Dtype::F16 => DType::F16,
                other => bail!(
                    "tensor `{name}` in {} has unsupported dtype {other:?} (supported: F32, BF16, F16)",
                    file.display()
                ),
            };
            let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), device)
                .with_context(|| format!("tensor `{name}` in {}", file.display()))?;
            out.files.insert(name.clone(), file.clone());
            out.tensors.insert(name, t);
        }
    }
    Ok(out)
}

/// torch dtype name used in config.json.
pub fn torch_dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

/// Writes `bytes` to `path` atomically (temp file in the same directory, then rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    composer_fsutil::write_atomic(path, bytes)
        .with_context(|| format!("writing {}", path.display()))
}

/// Serialises named tensors (all the same dtype) as safetensors with `{"format":"pt"}`
/// metadata, which transformers expects.
fn serialize(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let data: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.contiguous()?)))
        .collect::<Result<_>>()?;
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    Ok(safetensors::serialize(
        data.iter().map(|(n, t)| (n.as_str(), t)),
        Some(meta),
    )?)
}

/// Writes `tensors` as one safetensors file at `path` (atomically, current dtypes).
pub fn save_file(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    write_atomic(path, &serialize(tensors)?)
}

/// Saves tensors into `dir` as `model.safetensors` (`num_shards <= 1`) or as
/// `num_shards` files `model-0000i-of-0000n.safetensors` plus the index, the layout
/// transformers' `save_pretrained` writes. Tensors are written in their current dtype.
pub fn save_dir(dir: &Path, tensors: &[(String, Tensor)], num_shards: usize) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Remove a stale layout of the other kind so loaders do not pick up old weights.
    let index_path = dir.join(INDEX_FILE);
    if num_shards <= 1 {
        if index_path.exists() {
            std::fs::remove_file(&index_path)
                .with_context(|| format!("removing {}", index_path.display()))?;
        }
        let bytes = serialize(tensors)?;
        return write_atomic(&dir.join(SINGLE_FILE), &bytes);
    }
    let single = dir.join(SINGLE_FILE);
    if single.exists() {
        std::fs::remove_file(&single).with_context(|| format!("removing {}", single.display()))?;
    }
    let bytes_of = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
    let total: usize = tensors.iter().map(|(_, t)| bytes_of(t)).sum();
    let per_shard = total.div_ceil(num_shards).max(1);
    let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
    let mut cur = 0usize;
    for (name, t) in tensors {
        if cur >= per_shard && shards.len() < num_shards {
            shards.push(Vec::new());
            cur = 0;
        }
        cur += bytes_of(t);
        shards
            .last_mut()
            .expect("non-empty")
            .push((name.clone(), t.clone()));
    }
    while shards.len() < num_shards {
        shards.push(Vec::new());
    }
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let fname = format!("model-{:05}-of-{:05}.safetensors", i + 1, num_shards);
        write_atomic(&dir.join(&fname), &serialize(shard)?)?;
        for (n, _) in shard {
            weight_map.insert(n.clone(), fname.clone());
        }
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_atomic(
        &index_path,
        serde_json::to_string_pretty(&index)?.as_bytes(),
    )
}
