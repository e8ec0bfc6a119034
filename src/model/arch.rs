//! One description of a checkpoint: `config.json` and its quantization, read
//! once into a typed value that answers what the loaders, the planner, the
//! engine and the server ask: which family, which layers are full attention
//! and which Gated DeltaNet, which use routed experts, which tensors are
//! streamed rather than resident, and how large the per-sequence state is.
//!
//! Nothing else in slotstream parses `config.json`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use slotstream_backend::KvCacheType;

use super::config::{MoeConfig, Qwen4Config};
use crate::checkpoint::{Checkpoint, QuantConfig};
use crate::model_files;

/// The model families slotstream runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen3-30B-A3B and relatives: full attention everywhere.
    Qwen3Moe,
    /// Qwen3-Next-80B-A3B: Gated DeltaNet and gated attention, a shared expert.
    Qwen3Next,
    /// Qwen3.8-Flash-Next: qwen3_next plus hyper-connections, QSA, PLE and MTP.
    Qwen4Exp,
    /// Qwen3.5 MoE (Qwen3.5-35B-A3B and relatives): qwen3_next's trunk with
    /// the Gated DeltaNet's projections apart, in a vision-language
    /// checkpoint whose vision tower slotstream skips.
    Qwen35Moe,
}

impl Family {
    /// The `model_type`s slotstream loads (the demo's note names them too).
    pub const SUPPORTED: &'static str = "qwen3_moe, qwen3_next, qwen3_5_moe, qwen4_exp";

    fn from_model_type(model_type: &str, config_path: &Path) -> Result<Family> {
        match model_type {
            "qwen3_moe" => Ok(Family::Qwen3Moe),
            "qwen3_next" => Ok(Family::Qwen3Next),
            "qwen4_exp" => Ok(Family::Qwen4Exp),
            // The vision-language checkpoint, and its language model alone.
            "qwen3_5_moe" | "qwen3_5_moe_text" => Ok(Family::Qwen35Moe),
            "" => bail!("{} has no 'model_type'", config_path.display()),
            other => bail!(
                "model_type '{other}' in {} is not supported (supported: {})",
                config_path.display(),
                Self::SUPPORTED
            ),
        }
    }

    /// `config.json`'s `model_type` for this family.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen3Next => "qwen3_next",
            Family::Qwen4Exp => "qwen4_exp",
            Family::Qwen35Moe => "qwen3_5_moe",
        }
    }
}

/// The token mixer of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention over a KV cache.
    FullAttention,
    /// Gated DeltaNet: a fixed-size recurrent state.
    LinearAttention,
}

/// The shape of one Gated DeltaNet layer, checked once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaDims {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

impl DeltaDims {
    /// Channels of the causal convolution: q, k and v side by side.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Bytes of one layer's per-sequence state: the f32 recurrent matrix of
    /// every value head and the convolution's window of earlier inputs.
    pub fn state_bytes(&self) -> u64 {
        let recurrent = (self.value_heads * self.key_dim * self.value_dim) as u64;
        let conv = (self.conv_kernel.saturating_sub(1) * self.conv_channels()) as u64;
        (recurrent + conv) * 4
    }
}

/// A model directory's `config.json`, read once.
#[derive(Clone, Debug)]
pub struct ModelArch {
    pub dir: PathBuf,
    pub family: Family,
    /// The language model's settings (`text_config` in multimodal checkpoints).
    pub text: MoeConfig,
    /// qwen4_exp's settings beyond the text config.
    pub qwen4: Option<Qwen4Config>,
    pub quant: QuantConfig,
    /// Whether the checkpoint nests the language model (`language_model.`
    /// tensors, `text_config`) beside a vision tower slotstream skips.
    pub multimodal: bool,
    layer_kinds: Vec<LayerKind>,
    /// The whole `config.json`, for clients that show it (`/api/show`).
    pub raw: serde_json::Value,
}

impl ModelArch {
    /// Reads and checks `dir/config.json`.
    pub fn read(dir: &Path) -> Result<ModelArch> {
        let config_path = dir.join("config.json");
        let text = model_files::read_text(&config_path, model_files::CONFIG_MAX_BYTES)
            .with_context(|| format!("reading {} (is {} a model directory?)", config_path.display(), dir.display()))?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", config_path.display()))?;
        Self::from_value(dir, raw).with_context(|| format!("in {}", config_path.display()))
    }

    fn from_value(dir: &Path, raw: serde_json::Value) -> Result<ModelArch> {
        let config_path = dir.join("config.json");
        let family = Family::from_model_type(raw.get("model_type").and_then(|m| m.as_str()).unwrap_or(""), &config_path)?;
        let quant = QuantConfig::from_config(&raw)?;
        let (text, qwen4, multimodal) = match family {
            Family::Qwen4Exp => {
                let t = raw.get("text_config").context("config.json of a qwen4_exp model has no 'text_config'")?;
                (MoeConfig::parse(t)?, Some(Qwen4Config::parse(t)?), true)
            }
            Family::Qwen35Moe => {
                let mut t = match raw.get("text_config") {
                    Some(t) => t.clone(),
                    None if raw.get("model_type").and_then(|m| m.as_str()) == Some("qwen3_5_moe_text") => raw.clone(),
                    None => bail!("config.json of a qwen3_5_moe model has no 'text_config'"),
                };
                // transformers' defaults, which configs need not state: the
                // router always renormalises the chosen experts' weights, and
                // RoPE turns a quarter of each head.
                if let Some(t) = t.as_object_mut() {
                    t.entry("norm_topk_prob").or_insert(true.into());
                    let in_rope = t.get("rope_parameters").is_some_and(|r| r.get("partial_rotary_factor").is_some());
                    if !in_rope {
                        t.entry("partial_rotary_factor").or_insert(0.25.into());
                    }
                }
                let text = MoeConfig::parse(&t)?;
                (text, None, raw.get("text_config").is_some())
            }
            _ => (MoeConfig::parse(&raw)?, None, false),
        };
        let layer_kinds = Self::decide_layer_kinds(family, &text)?;
        let arch = ModelArch { dir: dir.to_path_buf(), family, text, qwen4, quant, multimodal, layer_kinds, raw };
        if arch.layer_kinds.contains(&LayerKind::LinearAttention) {
            arch.delta_dims()?;
        }
        Ok(arch)
    }

    /// qwen3_moe is full attention throughout; the hybrids follow
    /// `layer_types` when given (one entry per layer), else every
    /// `full_attention_interval`-th layer is full attention.
    fn decide_layer_kinds(family: Family, c: &MoeConfig) -> Result<Vec<LayerKind>> {
        let n = c.num_hidden_layers;
        if family == Family::Qwen3Moe {
            return Ok(vec![LayerKind::FullAttention; n]);
        }
        match &c.layer_types {
            Some(types) => {
                if types.len() != n {
                    bail!("config.json layer_types has {} entries for {n} layers", types.len());
                }
                types
                    .iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        "full_attention" => Ok(LayerKind::FullAttention),
                        "linear_attention" => Ok(LayerKind::LinearAttention),
                        other => bail!("config.json layer_types[{i}] is '{other}' (expected full_attention or linear_attention)"),
                    })
                    .collect()
            }
            None => {
                let every = c.full_attention_interval.max(1);
                Ok((0..n)
                    .map(|i| if (i + 1) % every == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
                    .collect())
            }
        }
    }

    pub fn layers(&self) -> usize {
        self.text.num_hidden_layers
    }

    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        self.layer_kinds[layer]
    }

    pub fn attention_layers(&self) -> usize {
        self.layer_kinds.iter().filter(|k| **k == LayerKind::FullAttention).count()
    }

    pub fn delta_layers(&self) -> usize {
        self.layers() - self.attention_layers()
    }

    /// Whether layer `i` uses routed experts (otherwise a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.family == Family::Qwen4Exp || self.text.is_moe_layer(layer)
    }

    pub fn moe_layers(&self) -> usize {
        (0..self.layers()).filter(|&i| self.is_moe_layer(i)).count()
    }

    /// The first MoE layer, whose tensor names tell the checkpoint's layout.
    pub fn first_moe_layer(&self) -> Option<usize> {
        (0..self.layers()).find(|&i| self.is_moe_layer(i))
    }

    /// The Gated DeltaNet shape (an error names a missing or inconsistent field).
    pub fn delta_dims(&self) -> Result<DeltaDims> {
        let c = &self.text;
        let need = |v: Option<usize>, name: &str| v.with_context(|| format!("config.json is missing '{name}'"));
        let dims = DeltaDims {
            key_heads: need(c.linear_num_key_heads, "linear_num_key_heads")?,
            value_heads: need(c.linear_num_value_heads, "linear_num_value_heads")?,
            key_dim: need(c.linear_key_head_dim, "linear_key_head_dim")?,
            value_dim: need(c.linear_value_head_dim, "linear_value_head_dim")?,
            conv_kernel: c.linear_conv_kernel_dim,
        };
        if dims.key_heads == 0 || dims.value_heads % dims.key_heads != 0 {
            bail!("config.json: {} linear value heads are not a multiple of {} key heads", dims.value_heads, dims.key_heads);
        }
        Ok(dims)
    }

    /// End-of-sequence ids from the config.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.text.eos_ids()
    }

    /// The longest context the model takes, when the config states it
    /// (`max_position_embeddings`, extended by YaRN where it asks).
    pub fn context_length(&self) -> Option<u64> {
        self.text.context_length()
    }

    /// The unquantized weights' dtype as the config names it (`torch_dtype`).
    pub fn torch_dtype(&self) -> Option<&str> {
        self.text.torch_dtype.as_ref().and_then(|v| v.as_str())
    }

    /// Bits of the default quantization, when quantized.
    pub fn quant_bits(&self) -> Option<u32> {
        self.quant.default.map(|q| q.bits)
    }

    /// Opens the checkpoint's safetensors files with this quantization (only
    /// the language model's tensors of a multimodal checkpoint).
    pub fn open_checkpoint(&self) -> Result<Checkpoint> {
        let mut ck = Checkpoint::open(&self.dir, self.quant.clone())?;
        if self.multimodal {
            ck.keep_language_model()?;
        }
        Ok(ck)
    }

    /// Whether a checkpoint tensor belongs to a routed expert.
    pub fn is_routed_expert_tensor(name: &str) -> bool {
        name.contains(".switch_mlp.") || name.contains(".mlp.experts.")
    }

    /// Whether a checkpoint tensor is one of qwen4_exp's n-gram table shards.
    pub fn is_ngram_tensor(name: &str) -> bool {
        name.contains(".ngram_embedding.shard_")
    }

    /// Whether a tensor is read on demand rather than kept resident: routed
    /// experts and the n-gram table.
    pub fn is_streamed_tensor(name: &str) -> bool {
        Self::is_routed_expert_tensor(name) || Self::is_ngram_tensor(name)
    }

    /// Bytes of one attention layer's KV cache per position, keys and values
    /// stored as `kv` (the backend's [`slotstream_backend::Backend::kv_cache_type`]).
    pub fn kv_bytes_per_position(&self, kv: KvCacheType) -> u64 {
        (2 * self.text.kv_heads() * kv.bytes(self.text.head_dim())) as u64
    }

    /// Bytes the QSA indexer keeps per position and attention layer (f32 on
    /// the host): the raw key, and a pooled key per block of `ratio`.
    pub fn indexer_bytes_per_position(&self) -> u64 {
        match &self.qwen4 {
            Some(q) => (q.indexer_head_dim + q.indexer_head_dim / q.indexer_compress_ratio) as u64 * 4,
            None => 0,
        }
    }

    /// Per-sequence bytes that grow with the context, per token.
    pub fn context_bytes_per_token(&self, kv: KvCacheType) -> u64 {
        self.attention_layers() as u64 * (self.kv_bytes_per_position(kv) + self.indexer_bytes_per_position())
    }

    /// Per-sequence bytes independent of the context: every Gated DeltaNet
    /// layer's state.
    pub fn fixed_state_bytes(&self) -> u64 {
        match self.delta_dims() {
            Ok(d) => self.delta_layers() as u64 * d.state_bytes(),
            Err(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arch(config: serde_json::Value) -> Result<ModelArch> {
        ModelArch::from_value(Path::new("/nonexistent"), config)
    }

    fn hybrid(extra: serde_json::Value) -> serde_json::Value {
        let mut c = serde_json::json!({
            "model_type": "qwen3_next", "hidden_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 4, "linear_num_value_heads": 2, "linear_num_key_heads": 1,
            "linear_key_head_dim": 4, "linear_value_head_dim": 4
        });
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        c
    }

    #[test]
    fn layer_kinds_follow_layer_types_or_the_interval() {
        let a = arch(hybrid(serde_json::json!({}))).unwrap();
        assert_eq!(a.attention_layers(), 1);
        assert_eq!(a.layer_kind(3), LayerKind::FullAttention);
        let a = arch(hybrid(serde_json::json!({"layer_types":
            ["full_attention", "linear_attention", "linear_attention", "full_attention"]}))).unwrap();
        assert_eq!(a.attention_layers(), 2);
        assert_eq!(a.layer_kind(0), LayerKind::FullAttention);
    }

    #[test]
    fn short_or_unknown_layer_types_are_refused() {
        let e = arch(hybrid(serde_json::json!({"layer_types": ["full_attention"]}))).unwrap_err();
        assert!(format!("{e:#}").contains("1 entries for 4 layers"), "{e:#}");
        let e = arch(hybrid(serde_json::json!({"layer_types": ["x", "x", "x", "x"]}))).unwrap_err();
        assert!(format!("{e:#}").contains("layer_types[0] is 'x'"), "{e:#}");
    }

    #[test]
    fn state_sizes_use_the_kv_dtype() {
        let a = arch(hybrid(serde_json::json!({}))).unwrap();
        // One attention layer, 1 KV head of 4 (hidden 8 / 2 heads): K and V.
        assert_eq!(a.context_bytes_per_token(KvCacheType::F32), 2 * 4 * 4);
        assert_eq!(a.context_bytes_per_token(KvCacheType::F16), 2 * 4 * 2);
        // q8: a block's f16 scale beside its int8 values (one block of 4 here).
        assert_eq!(a.context_bytes_per_token(KvCacheType::Q8), 2 * (4 + 2));
        // Three DeltaNet layers: 2 heads x 4 x 4 f32 plus a 3-step window of 16 channels.
        assert_eq!(a.fixed_state_bytes(), 3 * (2 * 4 * 4 + 3 * 16) * 4);
    }

    #[test]
    fn values_that_would_divide_by_zero_or_overflow_are_refused() {
        for (key, value, says) in [
            ("num_key_value_heads", serde_json::json!(0), "num_key_value_heads (0, at least 1)"),
            ("num_hidden_layers", serde_json::json!(1_000_000_000u64), "num_hidden_layers is 1000000000"),
            ("rope_theta", serde_json::json!(-1.0), "rope_theta"),
            ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps"),
            ("partial_rotary_factor", serde_json::json!(-1.0), "partial_rotary_factor"),
        ] {
            let e = arch(hybrid(serde_json::json!({ key: value }))).unwrap_err();
            assert!(format!("{e:#}").contains(says), "{key}: {e:#}");
        }
    }

    #[test]
    fn every_size_and_rate_is_checked_against_its_range_by_name() {
        for (key, value, says) in [
            ("full_attention_interval", serde_json::json!(0), "full_attention_interval is 0 (expected 1 to 1024)"),
            ("linear_conv_kernel_dim", serde_json::json!(100_000), "linear_conv_kernel_dim is 100000"),
            ("num_attention_heads", serde_json::json!(1_000_000_000u64), "num_attention_heads is 1000000000"),
            ("head_dim", serde_json::json!(0), "head_dim is 0"),
            ("head_dim", serde_json::json!(3), "3 rotary dimensions"),
            ("intermediate_size", serde_json::json!(0), "intermediate_size is 0"),
            ("linear_key_head_dim", serde_json::json!(1 << 30), "linear_key_head_dim is 1073741824"),
            ("max_position_embeddings", serde_json::json!(0), "max_position_embeddings is 0"),
            ("rms_norm_eps", serde_json::json!(1e39), "rms_norm_eps"),
            ("rope_theta", serde_json::json!(0.0), "rope_theta"),
            ("num_experts_per_tok", serde_json::json!(0), "experts per token"),
        ] {
            let e = arch(hybrid(serde_json::json!({ key: value }))).expect_err(key);
            assert!(format!("{e:#}").contains(says), "{key}: {e:#}");
        }
    }

    #[test]
    fn qwen4_exp_settings_are_checked_against_their_ranges_by_name() {
        let config = |key: &str, value: serde_json::Value| {
            let mut text = hybrid(serde_json::json!({
                "head_dim": 4, "hc_count": 4, "hc_lowrank": 8, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                "indexer_head_dim": 4, "indexer_budget": 8, "indexer_compress_ratio": 4, "ngram_size": 3,
                "heads_per_ngram": 2, "split_ngram_parts": 2, "ple_embed_dim": 8, "ple_conv_kernel_size": 4
            }));
            text[key] = value;
            serde_json::json!({ "model_type": "qwen4_exp", "text_config": text })
        };
        arch(config("ple_embed_dim", serde_json::json!(8))).expect("the base config is valid");
        for (key, value, says) in [
            ("split_ngram_parts", serde_json::json!(0), "split_ngram_parts is 0 (expected 1 to 65536)"),
            ("ngram_size", serde_json::json!(1000), "ngram_size is 1000"),
            ("hc_count", serde_json::json!(1 << 20), "hc_count is 1048576"),
            ("ple_conv_kernel_size", serde_json::json!(0), "ple_conv_kernel_size is 0"),
            ("indexer_head_dim", serde_json::json!(0), "indexer_head_dim is 0"),
        ] {
            let e = arch(config(key, value)).expect_err(key);
            assert!(format!("{e:#}").contains(says), "{key}: {e:#}");
        }
    }

    #[test]
    fn qwen3_5_moe_reads_its_text_config_and_renormalises_by_default() {
        let mut text = hybrid(serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
            "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0]}}));
        text["model_type"] = "qwen3_5_moe_text".into();
        let a = arch(serde_json::json!({"model_type": "qwen3_5_moe", "text_config": text.clone()})).unwrap();
        assert_eq!(a.family, Family::Qwen35Moe);
        assert!(a.multimodal && a.text.norm_topk_prob);
        assert_eq!((a.text.rope_theta(), a.text.partial_rotary_factor()), (1e7, 0.5));
        assert_eq!(a.attention_layers(), 1);
        text["norm_topk_prob"] = false.into();
        let a = arch(serde_json::json!({"model_type": "qwen3_5_moe", "text_config": text})).unwrap();
        assert!(!a.text.norm_topk_prob);
        let a = arch(text.clone()).unwrap();
        assert!(a.family == Family::Qwen35Moe && !a.multimodal && !a.text.norm_topk_prob);
        text["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e7});
        text["head_dim"] = 8.into();
        assert_eq!(arch(text.clone()).unwrap().text.partial_rotary_factor(), 0.25);
        let e = arch(serde_json::json!({"model_type": "qwen3_5_moe"})).unwrap_err();
        assert!(format!("{e:#}").contains("no 'text_config'"), "{e:#}");
    }

    #[test]
    fn unknown_families_are_named() {
        let mut c = hybrid(serde_json::json!({}));
        c["model_type"] = "llama".into();
        let e = arch(c).unwrap_err();
        assert!(format!("{e:#}").contains("model_type 'llama'"), "{e:#}");
    }
}
