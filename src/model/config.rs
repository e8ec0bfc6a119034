//! `config.json` as transformers and mlx-lm write it for the Qwen MoE families,
//! accepting the key variants each tool uses. Only [`super::arch`] reads it.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use slotstream_backend::{GateAct, Rope, Yarn};

fn default_eps() -> f32 {
    1e-6
}
fn default_one() -> usize {
    1
}
fn default_interval() -> usize {
    4
}
fn default_conv() -> usize {
    4
}

/// `eos_token_id` is an integer in some configs and a list in others.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// transformers >= 5 nests RoPE settings under `rope_parameters`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct RopeParameters {
    pub rope_theta: Option<f32>,
    pub rope_type: Option<String>,
    pub partial_rotary_factor: Option<f32>,
}

/// The union of what qwen3_moe and qwen3_next configs carry.
#[derive(Clone, Debug, Deserialize)]
pub struct MoeConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub rope_theta: Option<f32>,
    pub partial_rotary_factor: Option<f32>,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    pub intermediate_size: Option<usize>,

    #[serde(alias = "num_local_experts", alias = "n_routed_experts")]
    pub num_experts: usize,
    #[serde(alias = "moe_topk", alias = "top_k")]
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// transformers' default for both families is `false`.
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "default_one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,

    // Gated DeltaNet (qwen3_next).
    pub linear_num_value_heads: Option<usize>,
    pub linear_num_key_heads: Option<usize>,
    pub linear_key_head_dim: Option<usize>,
    pub linear_value_head_dim: Option<usize>,
    #[serde(default = "default_conv")]
    pub linear_conv_kernel_dim: usize,
    #[serde(default = "default_interval")]
    pub full_attention_interval: usize,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,

    pub eos_token_id: Option<TokenIds>,
    pub bos_token_id: Option<TokenIds>,

    /// The trained context length (shown to clients).
    pub max_position_embeddings: Option<u64>,
    /// The dtype of unquantized weights (shown to clients).
    #[serde(default)]
    pub torch_dtype: Option<serde_json::Value>,
    /// YaRN, when `rope_scaling` (or `rope_parameters`) asks for it.
    #[serde(skip)]
    pub yarn: Option<Yarn>,
}

impl MoeConfig {
    pub fn parse(value: &serde_json::Value) -> Result<MoeConfig> {
        let mut c: MoeConfig = serde_json::from_value(value.clone())
            .context("config.json is missing a field this architecture needs, or has one of the wrong type")?;
        c.yarn = rope_scaling(value, c.max_position_embeddings)?;
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<()> {
        if self.attention_bias {
            bail!("config.json sets attention_bias: true, which these Qwen families never use and slotstream does not support");
        }
        if self.num_attention_heads == 0 || self.kv_heads() == 0 || self.num_attention_heads % self.kv_heads() != 0 {
            bail!(
                "config.json: num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({}, at least 1)",
                self.num_attention_heads,
                self.kv_heads()
            );
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            bail!("config.json: {} experts per token of {} experts", self.num_experts_per_tok, self.num_experts);
        }
        // Sizes far past any published model are a corrupt file, not a model:
        // refused before anything is planned or allocated from them.
        for (name, value, most) in [
            ("num_hidden_layers", self.num_hidden_layers, 1024),
            ("hidden_size", self.hidden_size, 65536),
            ("num_experts", self.num_experts, 65536),
            ("vocab_size", self.vocab_size, 4 << 20),
            ("moe_intermediate_size", self.moe_intermediate_size, 1 << 20),
            ("num_attention_heads", self.num_attention_heads, 1024),
            ("num_experts_per_tok", self.num_experts_per_tok, 1024),
            ("decoder_sparse_step", self.decoder_sparse_step, 1024),
            ("full_attention_interval", self.full_attention_interval, 1024),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim, 64),
        ] {
            check_range(name, value, 1, most)?;
        }
        for (name, value, most) in [
            ("num_key_value_heads", self.num_key_value_heads, 1024),
            ("head_dim", self.head_dim, 4096),
            ("intermediate_size", self.intermediate_size, 1 << 20),
            ("linear_num_value_heads", self.linear_num_value_heads, 1024),
            ("linear_num_key_heads", self.linear_num_key_heads, 1024),
            ("linear_key_head_dim", self.linear_key_head_dim, 4096),
            ("linear_value_head_dim", self.linear_value_head_dim, 4096),
        ] {
            if let Some(value) = value {
                check_range(name, value, 1, most)?;
            }
        }
        check_range("shared_expert_intermediate_size", self.shared_expert_intermediate_size, 0, 1 << 20)?;
        check_range("head_dim", self.head_dim(), 1, 4096)?;
        if let Some(context) = self.max_position_embeddings {
            if !(1..=1 << 24).contains(&context) {
                bail!("config.json: max_position_embeddings is {context} (expected 1 to {})", 1u64 << 24);
            }
        }
        if let Some(context) = self.context_length().filter(|&n| n > 1 << 24) {
            bail!("config.json: rope_scaling extends the context to {context} positions (expected at most {})", 1u64 << 24);
        }
        let theta = self.rope_theta();
        if !(theta.is_finite() && theta > 0.0) {
            bail!("config.json: rope_theta {theta} is not a positive number");
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            bail!("config.json: rms_norm_eps {} is not between 0 and 1", self.rms_norm_eps);
        }
        let factor = self.partial_rotary_factor();
        if !(factor > 0.0 && factor <= 1.0) {
            bail!("config.json: partial_rotary_factor {factor} is not in (0, 1]");
        }
        let rotary = (self.head_dim() as f32 * factor) as usize;
        if rotary < 2 || rotary % 2 != 0 {
            bail!(
                "config.json: head_dim {} x partial_rotary_factor {factor} gives {rotary} rotary dimensions \
                 (expected a positive even number)",
                self.head_dim()
            );
        }
        Ok(())
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn rope_theta(&self) -> f32 {
        self.rope_theta
            .or_else(|| self.rope_parameters.as_ref().and_then(|r| r.rope_theta))
            .unwrap_or(10000.0)
    }

    /// The rotary embedding: `rope_theta`, YaRN-scaled where the config asks.
    pub fn rope(&self) -> Rope {
        Rope { theta: self.rope_theta(), yarn: self.yarn }
    }

    /// The longest context the model takes: `max_position_embeddings`, or
    /// YaRN's trained context times its factor where that is longer.
    pub fn context_length(&self) -> Option<u64> {
        let scaled = self.yarn.map(|y| (y.original_context * y.factor).round() as u64);
        match (self.max_position_embeddings, scaled) {
            (Some(m), Some(s)) => Some(m.max(s)),
            (m, s) => m.or(s),
        }
    }

    pub fn partial_rotary_factor(&self) -> f32 {
        self.partial_rotary_factor
            .or_else(|| self.rope_parameters.as_ref().and_then(|r| r.partial_rotary_factor))
            .unwrap_or(1.0)
    }

    /// Whether layer `i` uses routed experts (otherwise a dense MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i) && self.num_experts > 0 && (i + 1) % self.decoder_sparse_step.max(1) == 0
    }

    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id.as_ref().map(|t| t.to_vec()).unwrap_or_default()
    }

    pub fn dense_intermediate(&self, layer: usize) -> Result<usize> {
        self.intermediate_size.with_context(|| {
            format!("layer {layer} is a dense MLP layer but config.json has no intermediate_size")
        })
    }
}

/// YaRN from `rope_scaling`, or from transformers 5's `rope_parameters`
/// (the same keys), as the HF convention defines them: `factor`,
/// `original_max_position_embeddings` (default: `max_position_embeddings`),
/// `beta_fast` (32), `beta_slow` (1), `attention_factor` (default: from
/// `factor`, `mscale` and `mscale_all_dim`), `truncate` (true). `None` for
/// unscaled RoPE; any other scaling is refused.
fn rope_scaling(config: &serde_json::Value, max_positions: Option<u64>) -> Result<Option<Yarn>> {
    let present = |key| config.get(key).filter(|v: &&serde_json::Value| !v.is_null());
    let Some((key, scaling)) = present("rope_scaling").map(|s| ("rope_scaling", s)).or_else(|| present("rope_parameters").map(|s| ("rope_parameters", s)))
    else {
        return Ok(None);
    };
    let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
    match kind {
        "default" => return Ok(None),
        "yarn" => {}
        other => bail!("config.json {key} asks for '{other}' RoPE scaling ({scaling}), which slotstream does not support (only 'yarn' and unscaled RoPE)"),
    }
    let number = |name: &str| -> Result<Option<f64>> {
        match scaling.get(name) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v.as_f64().filter(|x| x.is_finite()).map(Some).with_context(|| format!("config.json {key}: {name} is {v}, not a number")),
        }
    };
    let factor = number("factor")?.with_context(|| format!("config.json {key}: YaRN needs a 'factor' (how many times the trained context)"))?;
    if !(1.0..=1024.0).contains(&factor) {
        bail!("config.json {key}: YaRN factor {factor} is not between 1 and 1024");
    }
    let original = match number("original_max_position_embeddings")? {
        Some(n) => n,
        None => max_positions.with_context(|| {
            format!("config.json {key}: YaRN needs original_max_position_embeddings (or max_position_embeddings)")
        })? as f64,
    };
    if !(1.0..=(1u64 << 24) as f64).contains(&original) {
        bail!("config.json {key}: original_max_position_embeddings {original} is not between 1 and {}", 1u64 << 24);
    }
    let (beta_fast, beta_slow) = (number("beta_fast")?.unwrap_or(32.0), number("beta_slow")?.unwrap_or(1.0));
    if !(beta_fast > 0.0 && beta_slow > 0.0) {
        bail!("config.json {key}: YaRN beta_fast {beta_fast} and beta_slow {beta_slow} must be positive");
    }
    let attention_factor = match number("attention_factor")? {
        Some(a) => a,
        None => Yarn::default_attention_factor(factor, number("mscale")?, number("mscale_all_dim")?),
    };
    if !(attention_factor > 0.0 && attention_factor.is_finite()) {
        bail!("config.json {key}: YaRN attention factor {attention_factor} is not a positive number");
    }
    let truncate = match scaling.get("truncate") {
        None | Some(serde_json::Value::Null) => true,
        Some(v) => v.as_bool().with_context(|| format!("config.json {key}: truncate is {v}, not true or false"))?,
    };
    Ok(Some(Yarn { factor, original_context: original, beta_fast, beta_slow, attention_factor, truncate }))
}

/// Refuses a value outside `least..=most`, naming the key and the range.
fn check_range(name: &str, value: usize, least: usize, most: usize) -> Result<()> {
    if !(least..=most).contains(&value) {
        bail!("config.json: {name} is {value} (expected {least} to {most})");
    }
    Ok(())
}

/// The qwen4_exp settings beyond the text config (hyper-connections, the QSA
/// indexer, the n-gram embedding), from `text_config`.
#[derive(Clone, Debug, Deserialize)]
pub struct Qwen4Config {
    pub hc_count: usize,
    pub hc_lowrank: usize,
    pub indexer_n_heads: usize,
    pub indexer_kv_heads: usize,
    pub indexer_head_dim: usize,
    pub indexer_budget: usize,
    pub indexer_compress_ratio: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub split_ngram_parts: usize,
    pub ple_embed_dim: usize,
    #[serde(default)]
    pub ple_layer_ids: Vec<usize>,
    pub ple_conv_kernel_size: usize,
    #[serde(default = "sigmoid")]
    pub output_gate_type: String,
}

fn sigmoid() -> String {
    "sigmoid".into()
}

impl Qwen4Config {
    /// From `text_config`.
    pub fn parse(text: &serde_json::Value) -> Result<Qwen4Config> {
        let q: Qwen4Config = serde_json::from_value(text.clone())
            .context("config.json text_config is missing a qwen4_exp field (hyper-connection, indexer or n-gram settings)")?;
        if q.hc_count == 0 || q.indexer_compress_ratio == 0 || q.ngram_size < 2 || q.heads_per_ngram == 0 {
            bail!("config.json text_config: hc_count, indexer_compress_ratio and heads_per_ngram must be positive and ngram_size at least 2");
        }
        for (name, value, least, most) in [
            ("hc_count", q.hc_count, 1, 64),
            ("hc_lowrank", q.hc_lowrank, 1, 65536),
            ("indexer_n_heads", q.indexer_n_heads, 1, 1024),
            ("indexer_head_dim", q.indexer_head_dim, 1, 4096),
            ("indexer_budget", q.indexer_budget, 1, 1 << 24),
            ("indexer_compress_ratio", q.indexer_compress_ratio, 1, 4096),
            ("ngram_size", q.ngram_size, 2, 16),
            ("heads_per_ngram", q.heads_per_ngram, 1, 256),
            ("split_ngram_parts", q.split_ngram_parts, 1, 65536),
            ("ple_embed_dim", q.ple_embed_dim, 1, 65536),
            ("ple_conv_kernel_size", q.ple_conv_kernel_size, 1, 64),
        ] {
            check_range(name, value, least, most).context("in text_config")?;
        }
        if q.indexer_kv_heads != 1 {
            bail!("config.json text_config: indexer_kv_heads {} is not supported (the indexer has one key head)", q.indexer_kv_heads);
        }
        if q.indexer_budget % q.indexer_compress_ratio != 0 || q.indexer_budget == 0 {
            bail!(
                "config.json text_config: indexer_budget {} is not a positive multiple of indexer_compress_ratio {}",
                q.indexer_budget, q.indexer_compress_ratio
            );
        }
        q.gate_act()?;
        Ok(q)
    }

    pub fn gate_act(&self) -> Result<GateAct> {
        match self.output_gate_type.as_str() {
            "sigmoid" => Ok(GateAct::Sigmoid),
            "silu" | "swish" => Ok(GateAct::Silu),
            other => bail!("config.json text_config: output_gate_type '{other}' is not supported (sigmoid or silu)"),
        }
    }

    /// N-gram heads per token: every order from 2 to `ngram_size`, `heads_per_ngram` each.
    pub fn ngram_heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: serde_json::Value) -> Result<MoeConfig> {
        let mut c = serde_json::json!({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "rope_theta": 1e6, "max_position_embeddings": 40960});
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        MoeConfig::parse(&c)
    }

    #[test]
    fn yarn_scales_the_rope_and_the_context() {
        // Qwen3's recipe: factor 4 over the trained 32768.
        let c = config(serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})).unwrap();
        let yarn = c.rope().yarn.expect("yarn");
        assert_eq!((yarn.factor, yarn.original_context, yarn.beta_fast, yarn.beta_slow, yarn.truncate), (4.0, 32768.0, 32.0, 1.0, true));
        assert!((yarn.attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        assert_eq!(c.context_length(), Some(131072));
        // `type` (older configs), an explicit attention factor, and transformers 5's rope_parameters.
        let c = config(serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 2, "attention_factor": 1.5}})).unwrap();
        assert_eq!((c.rope().yarn.unwrap().attention_factor, c.context_length()), (1.5, Some(81920)));
        let c = config(serde_json::json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7, "factor": 8, "original_max_position_embeddings": 4096}})).unwrap();
        assert_eq!(c.context_length(), Some(40960));
        // Unscaled: none.
        assert_eq!(config(serde_json::json!({"rope_scaling": null})).unwrap().rope().yarn, None);
        assert_eq!(config(serde_json::json!({"rope_scaling": {"rope_type": "default"}})).unwrap().context_length(), Some(40960));
    }

    #[test]
    fn other_scalings_and_bad_yarn_values_are_refused_by_name() {
        for (scaling, says) in [
            (serde_json::json!({"rope_type": "linear", "factor": 2.0}), "'linear' RoPE scaling"),
            (serde_json::json!({"type": "dynamic", "factor": 2.0}), "'dynamic' RoPE scaling"),
            (serde_json::json!({"rope_type": "yarn"}), "needs a 'factor'"),
            (serde_json::json!({"rope_type": "yarn", "factor": 0.5}), "factor 0.5"),
            (serde_json::json!({"rope_type": "yarn", "factor": "4"}), "factor is \"4\", not a number"),
            (serde_json::json!({"rope_type": "yarn", "factor": 4, "beta_fast": -1}), "beta_fast"),
            (serde_json::json!({"rope_type": "yarn", "factor": 4, "truncate": 1}), "truncate"),
            (serde_json::json!({"rope_type": "yarn", "factor": 1000, "original_max_position_embeddings": 1 << 20}), "extends the context"),
        ] {
            let e = config(serde_json::json!({ "rope_scaling": scaling })).unwrap_err();
            assert!(format!("{e:#}").contains(says), "{scaling}: {e:#}");
        }
    }
}
