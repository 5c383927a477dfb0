//! `ModelConfig`: the architecture hyper-parameters read from a Hugging Face `config.json`
//! (plus `generation_config.json` for the stop tokens), and written back in the layout
//! transformers 5.x writes (`rope_parameters` holding `rope_theta`).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::path::Path;

/// The supported decoder families. Anything else in `model_type` is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelType {
    /// Llama: optional `attention_bias`/`mlp_bias`, untied head by default.
    Llama,
    /// Qwen2: bias on q/k/v projections, no bias on o_proj.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k (`q_norm`, `k_norm`), explicit `head_dim`.
    Qwen3,
}

impl ModelType {
    /// The `model_type` string of the family.
    pub fn as_str(&self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::Qwen2 => "qwen2",
            ModelType::Qwen3 => "qwen3",
        }
    }
    /// The transformers class name written in `architectures`.
    pub fn architecture(&self) -> &'static str {
        match self {
            ModelType::Llama => "LlamaForCausalLM",
            ModelType::Qwen2 => "Qwen2ForCausalLM",
            ModelType::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// Architecture of a decoder-only transformer. All fields are public so a model can be
/// described in code (e.g. the trainer's built-in tiny model) and saved as a `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Family (`llama`, `qwen2`, `qwen3`).
    pub model_type: ModelType,
    /// Rows of the embedding / LM head.
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA when smaller than `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Per-head width (explicit in the config or `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Longest sequence (prompt + completion) the model accepts.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v/o projections (Llama `attention_bias`); Qwen2 always has q/k/v bias.
    pub attention_bias: bool,
    /// Bias on the MLP projections (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// Std of the normal init used by `random_init` (HF `initializer_range`).
    pub initializer_range: f64,
    /// BOS token id, if any.
    pub bos_token_id: Option<u32>,
    /// Stop token ids (config.json `eos_token_id` ∪ generation_config.json `eos_token_id`).
    pub eos_token_ids: Vec<u32>,
    /// Padding token id, if any.
    pub pad_token_id: Option<u32>,
}

impl ModelConfig {
    /// True when the q/k/v projections carry a bias.
    pub fn qkv_bias(&self) -> bool {
        self.model_type == ModelType::Qwen2 || self.attention_bias
    }
    /// True when o_proj carries a bias (Llama with `attention_bias`).
    pub fn o_bias(&self) -> bool {
        self.model_type != ModelType::Qwen2 && self.attention_bias
    }
    /// True for per-head q/k RMSNorm (Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.model_type == ModelType::Qwen3
    }

    /// A small Qwen2-shaped config, handy for tests and the trainer's built-in model.
    pub fn tiny_qwen2(vocab_size: usize) -> Self {
        ModelConfig {
            model_type: ModelType::Qwen2,
            vocab_size,
            hidden_size: 64,
            intermediate_size: 160,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            tie_word_embeddings: true,
            attention_bias: false,
            mlp_bias: false,
            initializer_range: 0.02,
            bos_token_id: None,
            eos_token_ids: vec![],
            pad_token_id: None,
        }
    }

    /// The Qwen2.5-0.5B shape (used by the benchmark with random weights).
    pub fn qwen2_5_0_5b() -> Self {
        ModelConfig {
            model_type: ModelType::Qwen2,
            vocab_size: 151936,
            hidden_size: 896,
            intermediate_size: 4864,
            num_hidden_layers: 24,
            num_attention_heads: 14,
            num_key_value_heads: 2,
            head_dim: 64,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tie_word_embeddings: true,
            attention_bias: false,
            mlp_bias: false,
            initializer_range: 0.02,
            bos_token_id: None,
            eos_token_ids: vec![151643, 151645],
            pad_token_id: None,
        }
    }

    /// The Qwen3-0.6B shape (benchmark, random weights).
    pub fn qwen3_0_6b() -> Self {
        ModelConfig {
            model_type: ModelType::Qwen3,
            hidden_size: 1024,
            intermediate_size: 3072,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            head_dim: 128,
            max_position_embeddings: 40960,
            ..Self::qwen2_5_0_5b()
        }
    }

    /// The Qwen2.5-7B shape (benchmark, random weights).
    pub fn qwen2_5_7b() -> Self {
        ModelConfig {
            vocab_size: 152064,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_hidden_layers: 28,
            num_attention_heads: 28,
            num_key_value_heads: 4,
            head_dim: 128,
            tie_word_embeddings: false,
            ..Self::qwen2_5_0_5b()
        }
    }

    /// Checks the invariants the forward pass relies on; names the offending key.
    pub fn validate(&self) -> Result<()> {
        let pos = |v: usize, k: &str| -> Result<()> {
            if v == 0 {
                bail!("config key `{k}` must be > 0");
            }
            Ok(())
        };
        pos(self.vocab_size, "vocab_size")?;
        pos(self.hidden_size, "hidden_size")?;
        pos(self.intermediate_size, "intermediate_size")?;
        pos(self.num_hidden_layers, "num_hidden_layers")?;
        pos(self.num_attention_heads, "num_attention_heads")?;
        pos(self.num_key_value_heads, "num_key_value_heads")?;
        pos(self.head_dim, "head_dim")?;
        pos(self.max_position_embeddings, "max_position_embeddings")?;
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "config key `num_key_value_heads` ({}) must divide `num_attention_heads` ({})",
                self.num_key_value_heads,
                self.num_attention_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "config key `head_dim` ({}) must be even for RoPE",
                self.head_dim
            );
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            bail!("config key `rope_theta` must be > 0");
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            bail!(
                "config key `rms_norm_eps` must be finite and > 0, got {}",
                self.rms_norm_eps
            );
        }
        if let Some(id) = self
            .eos_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            bail!(
                "config key `eos_token_id` ({id}) is outside the vocabulary (vocab_size = {}): \
                 generation could never stop on it",
                self.vocab_size
            );
        }
        Ok(())
    }

    /// Reads `dir/config.json` and, when present, `dir/generation_config.json` (its
    /// `eos_token_id` is added to the stop ids).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!(
                "model directory {} does not exist or is not a directory",
                dir.display()
            );
        }
        let path = dir.join("config.json");
        let mut cfg = Self::from_file(&path)?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path)
                .with_context(|| format!("reading {}", gen_path.display()))?;
            let v: Value = serde_json::from_str(&text)
                .with_context(|| format!("parsing {} as JSON", gen_path.display()))?;
            if let Some(e) = v.get("eos_token_id") {
                for id in token_id_list(e, "eos_token_id", &gen_path)? {
                    if id as usize >= cfg.vocab_size {
                        bail!(
                            "{}: `eos_token_id` {id} is outside the vocabulary (vocab_size = {})",
                            gen_path.display(),
                            cfg.vocab_size
                        );
                    }
                    if !cfg.eos_token_ids.contains(&id) {
                        cfg.eos_token_ids.push(id);
                    }
                }
            }
        }
        Ok(cfg)
    }

    /// Reads one `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {} as JSON", path.display()))?;
        Self::from_json(&v).with_context(|| format!("in {}", path.display()))
    }

    /// Parses a `config.json` value (transformers 4.x or 5.x layout).
    pub fn from_json(v: &Value) -> Result<Self> {
        let obj = v.as_object().context("config.json must be a JSON object")?;
        let model_type = match obj.get("model_type").and_then(Value::as_str) {
            Some("llama") => ModelType::Llama,
            Some("qwen2") => ModelType::Qwen2,
            Some("qwen3") => ModelType::Qwen3,
            Some(other) => {
                bail!("unsupported model_type `{other}` (supported: llama, qwen2, qwen3)")
            }
            None => bail!("missing or non-string config key `model_type`"),
        };
        let req = |k: &str| -> Result<usize> {
            let x = obj
                .get(k)
                .with_context(|| format!("missing config key `{k}`"))?;
            x.as_u64().map(|u| u as usize).with_context(|| {
                format!("config key `{k}` must be a non-negative integer, got {x}")
            })
        };
        let opt_usize = |k: &str| -> Result<Option<usize>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x.as_u64().map(|u| Some(u as usize)).with_context(|| {
                    format!("config key `{k}` must be a non-negative integer, got {x}")
                }),
            }
        };
        let opt_f64 = |k: &str| -> Result<Option<f64>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .with_context(|| format!("config key `{k}` must be a number, got {x}")),
            }
        };
        let opt_bool = |k: &str| -> Result<Option<bool>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_bool()
                    .map(Some)
                    .with_context(|| format!("config key `{k}` must be a boolean, got {x}")),
            }
        };
        let vocab_size = req("vocab_size")?;
        let hidden_size = req("hidden_size")?;
        let intermediate_size = req("intermediate_size")?;
        let num_hidden_layers = req("num_hidden_layers")?;
        let num_attention_heads = req("num_attention_heads")?;
        let num_key_value_heads = opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_attention_heads == 0 {
            bail!("config key `num_attention_heads` must be > 0");
        }
        let head_dim = opt_usize("head_dim")?.unwrap_or(hidden_size / num_attention_heads);
        let max_position_embeddings = req("max_position_embeddings")?;
        let rms_norm_eps = opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
        if let Some(act) = obj.get("hidden_act") {
            if act.as_str() != Some("silu") {
                bail!("unsupported config key `hidden_act` = {act} (only \"silu\")");
            }
        }
        if opt_bool("use_sliding_window")?.unwrap_or(false) {
            bail!("unsupported config key `use_sliding_window` = true (sliding-window attention)");
        }

        // RoPE: transformers 5.x `rope_parameters`, or 4.x top-level `rope_theta` and
        // optional `rope_scaling`. Only the default (unscaled) RoPE is implemented; any
        // other type would silently give a wrong model, so it is an error.
        let mut rope_theta = opt_f64("rope_theta")?;
        for key in ["rope_parameters", "rope_scaling"] {
            match obj.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Object(rp)) => {
                    let rope_type = rp
                        .get("rope_type")
                        .or_else(|| rp.get("type"))
                        .and_then(Value::as_str)
                        .unwrap_or("default");
                    if rope_type != "default" {
                        bail!(
                            "unsupported RoPE scaling: config key `{key}.rope_type` = \"{rope_type}\" (only \"default\" is implemented)"
                        );
                    }
                    if let Some(t) = rp.get("rope_theta") {
                        rope_theta = Some(t.as_f64().with_context(|| {
                            format!("config key `{key}.rope_theta` must be a number, got {t}")
                        })?);
                    }
                }
                Some(other) => bail!("config key `{key}` must be an object, got {other}"),
            }
        }
        let rope_theta = rope_theta
            .context("missing config key `rope_theta` (top level or inside `rope_parameters`)")?;
        let default_tie = false;
        let tie_word_embeddings = opt_bool("tie_word_embeddings")?.unwrap_or(default_tie);
        let attention_bias = opt_bool("attention_bias")?.unwrap_or(false);
        let mlp_bias = opt_bool("mlp_bias")?.unwrap_or(false);
        let initializer_range = opt_f64("initializer_range")?.unwrap_or(0.02);
        let cfg_path = Path::new("config.json");
        let bos_token_id = match obj.get("bos_token_id") {
            None | Some(Value::Null) => None,
            Some(x) => token_id_list(x, "bos_token_id", cfg_path)?.first().copied(),
        };
        let pad_token_id = match obj.get("pad_token_id") {
            None | Some(Value::Null) => None,
            Some(x) => token_id_list(x, "pad_token_id", cfg_path)?.first().copied(),
        };
        let eos_token_ids = match obj.get("eos_token_id") {
            None | Some(Value::Null) => vec![],
            Some(x) => token_id_list(x, "eos_token_id", cfg_path)?,
        };
        let cfg = ModelConfig {
            model_type,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings,
            rms_norm_eps,
            rope_theta,
            tie_word_embeddings,
            attention_bias,
            mlp_bias,
            initializer_range,
            bos_token_id,
            eos_token_ids,
            pad_token_id,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The `config.json` transformers 5.x writes for this architecture; `dtype` is the
    /// torch dtype name of the saved weights ("float32", "bfloat16", "float16").
    pub fn to_hf_json(&self, dtype: &str) -> Value {
        let mut m = Map::new();
        m.insert(
            "architectures".into(),
            json!([self.model_type.architecture()]),
        );
        m.insert("model_type".into(), json!(self.model_type.as_str()));
        if self.model_type != ModelType::Qwen2 {
            m.insert("attention_bias".into(), json!(self.attention_bias));
        }
        if self.model_type == ModelType::Llama {
            m.insert("mlp_bias".into(), json!(self.mlp_bias));
            m.insert("pretraining_tp".into(), json!(1));
        }
        m.insert("attention_dropout".into(), json!(0.0));
        if let Some(b) = self.bos_token_id {
            m.insert("bos_token_id".into(), json!(b));
        }
        m.insert("dtype".into(), json!(dtype));
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                m.insert("eos_token_id".into(), json!(one));
            }
            many => {
                m.insert("eos_token_id".into(), json!(many));
            }
        }
        m.insert("head_dim".into(), json!(self.head_dim));
        m.insert("hidden_act".into(), json!("silu"));
        m.insert("hidden_size".into(), json!(self.hidden_size));
        m.insert("initializer_range".into(), json!(self.initializer_range));
        m.insert("intermediate_size".into(), json!(self.intermediate_size));
        if self.model_type != ModelType::Llama {
            m.insert(
                "layer_types".into(),
                json!(vec!["full_attention"; self.num_hidden_layers]),
            );
            m.insert("max_window_layers".into(), json!(self.num_hidden_layers));
            m.insert("sliding_window".into(), Value::Null);
            m.insert("use_sliding_window".into(), json!(false));
        }
        m.insert(
            "max_position_embeddings".into(),
            json!(self.max_position_embeddings),
        );
        m.insert(
            "num_attention_heads".into(),
            json!(self.num_attention_heads),
        );
        m.insert("num_hidden_layers".into(), json!(self.num_hidden_layers));
        m.insert(
            "num_key_value_heads".into(),
            json!(self.num_key_value_heads),
        );
        if let Some(p) = self.pad_token_id {
            m.insert("pad_token_id".into(), json!(p));
        }
        m.insert("rms_norm_eps".into(), json!(self.rms_norm_eps));
        m.insert(
            "rope_parameters".into(),
            json!({"rope_theta": self.rope_theta, "rope_type": "default"}),
        );
        m.insert(
            "tie_word_embeddings".into(),
            json!(self.tie_word_embeddings),
        );
        m.insert("transformers_version".into(), json!("5.23.0"));
        m.insert("use_cache".into(), json!(true));
        m.insert("vocab_size".into(), json!(self.vocab_size));
        Value::Object(m)
    }

    /// The `generation_config.json` matching this config.
    pub fn to_generation_config_json(&self) -> Value {
        let mut m = Map::new();
        if let Some(b) = self.bos_token_id {
            m.insert("bos_token_id".into(), json!(b));
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                m.insert("eos_token_id".into(), json!(one));
            }
            many => {
                m.insert("eos_token_id".into(), json!(many));
            }
        }
        if let Some(p) = self.pad_token_id {
            m.insert("pad_token_id".into(), json!(p));
        }
        m.insert("transformers_version".into(), json!("5.23.0"));
        Value::Object(m)
    }
}

/// An `eos_token_id`-style value: an integer or a list of integers.
fn token_id_list(v: &Value, key: &str, file: &Path) -> Result<Vec<u32>> {
    let one = |x: &Value| -> Result<u32> {
        x.as_u64().map(|u| u as u32).with_context(|| {
            format!(
                "key `{key}` in {} must be a token id (integer) or a list of them, got {v}",
                file.display()
            )
        })
    };
    match v {
        Value::Array(a) => a.iter().map(one).collect(),
        x => Ok(vec![one(x)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen2_json() -> Value {
        serde_json::json!({
            "model_type": "qwen2", "vocab_size": 384, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "eos_token_id": 3
        })
    }

    /// An EOS id outside the vocabulary (generation could never stop) and a non-positive or
    /// NaN `rms_norm_eps` are refused naming the key.
    #[test]
    fn eos_outside_the_vocabulary_and_bad_rms_eps_are_refused() {
        assert!(ModelConfig::from_json(&qwen2_json()).is_ok());
        let mut v = qwen2_json();
        v["eos_token_id"] = 99_999.into();
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("eos_token_id") && e.contains("99999"), "{e}");
        for eps in [-1.0, 0.0] {
            let mut v = qwen2_json();
            v["rms_norm_eps"] = eps.into();
            let e = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(e.contains("rms_norm_eps"), "{e}");
        }
    }
}
