//! Model architectures.
//!
//! - [`arch`]: a checkpoint's `config.json`, read once into [`ModelArch`].
//! - [`blocks`]: attention, Gated DeltaNet, MLP, MoE, norms, projections:
//!   the pieces the families share.
//! - [`layer`], [`decoder`]: a decoder layer (mixer + feed-forward around a
//!   residual wiring) and the whole model with its per-sequence state;
//!   `batch.rs`: one decode step of several sequences in one pass.
//! - [`speculative`]: the state a draft head for speculative decoding keeps.
//! - [`load`], [`options`]: what every loader shares, and how to load.
//! - One file or folder per family: `qwen3_moe.rs`, `qwen3_next.rs`,
//!   `qwen3_5_moe.rs`, `qwen4_exp/` (hyper-connections, PLE and its n-gram table, QSA, MTP).
//!   Adding a family is a new file and a line in [`load`].

pub mod arch;
mod batch;
pub mod blocks;
pub mod config;
pub mod decoder;
pub mod layer;
pub mod load;
pub mod options;
mod qwen3_5_moe;
mod qwen3_moe;
pub(crate) mod qwen3_next;
pub mod qwen4_exp;
pub mod speculative;

pub use arch::{Family, LayerKind, ModelArch};
pub use decoder::{on_compute_threads, DecoderModel, DraftHead, Logits, SequenceState, Snapshot};
pub use layer::{DecoderLayer, FeedForward, LayerState, Mixer, MixerState, PreNorm, RowCacheStats};
pub use options::{ExpertSlots, LoadOptions, DEFAULT_NGRAM_CACHE_BYTES};

use anyhow::{Context, Result};
use slotstream_backend::Backend;

/// Builds the model `arch` describes on `backend`.
pub fn load(arch: &ModelArch, backend: &dyn Backend, opts: &LoadOptions) -> Result<DecoderModel> {
    let result = match arch.family {
        Family::Qwen3Moe => qwen3_moe::load(arch, backend, opts),
        Family::Qwen3Next => qwen3_next::load(arch, backend, opts),
        Family::Qwen4Exp => qwen4_exp::load(arch, backend, opts),
        Family::Qwen35Moe => qwen3_5_moe::load(arch, backend, opts),
    };
    result.with_context(|| format!("loading the {} model in {}", arch.family.model_type(), arch.dir.display()))
}

