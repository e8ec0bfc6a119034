//! Model architectures.
//!
//! - [`arch`]: a checkpoint's `config.json`, read once into [`ModelArch`].
//! - [`blocks`]: attention, Gated DeltaNet, MLP, MoE, norms, projections:
//!   the pieces the families share.
//! - [`layer`], [`decoder`]: a decoder layer (mixer + feed-forward around a
//!   residual wiring) and the whole model with its per-sequence state.
//! - [`speculative`]: what a draft head for speculative decoding provides.
//! - One file or folder per family: `qwen3_moe.rs`, `qwen3_next.rs`,
//!   `qwen4_exp/` (hyper-connections, PLE and its n-gram table, QSA, MTP).
//!   Adding a family is a new file and a line in [`load::load`].

pub mod arch;
pub mod blocks;
pub mod config;
pub mod decoder;
pub mod layer;
pub mod load;
mod qwen3_moe;
mod qwen3_next;
pub mod qwen4_exp;
pub mod speculative;

pub use arch::{Family, LayerKind, ModelArch};
pub use decoder::{on_compute_threads, DecoderModel, Logits, SequenceState, Snapshot};
pub use layer::{DecoderLayer, FeedForward, LayerState, Mixer, MixerState, RowCacheStats};
pub use load::{load, ExpertSlots, LoadOptions, DEFAULT_NGRAM_CACHE_BYTES};
