//! The qwen4_exp settings beyond the text config (hyper-connections, the QSA
//! indexer, the n-gram embedding), read by [`crate::model::arch`].

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use slotstream_backend::GateAct;

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
