//! `slotstream pull`: get a model into the standard Hugging Face cache, pinned,
//! resumable and verified, and [`locate_model`] for `run`/`serve` to find it.
//!
//! - `manifest`: known models (compiled-in pins) and `hf:ORG/NAME[@REV]` specs.
//! - `cache`: the hub cache layout shared with `huggingface_hub` and other tools.
//! - `locate`: finding a complete, verified model offline.
//! - `hub`: the hub's HTTP API, with retries.
//! - `puller`: one pull of one model, from what the cache holds to what it lacks.
//! - `transfer`: parallel ranged downloads that resume exactly after any interruption.
//! - `verify`: hashing against the pinned digests.
//! - `recheck`: `pull --verify`, re-hashing a downloaded copy.
//! - `progress`: bars on a terminal, plain lines elsewhere.

mod cache;
mod hub;
mod locate;
mod manifest;
mod progress;
mod puller;
mod recheck;
mod transfer;
mod verify;

use anyhow::Result;

use cache::hub_cache_root;
use manifest::ModelSpec;
use puller::Puller;

pub use hub::NetworkSettings;
pub use locate::{locate_model, locate_model_in};
pub use manifest::DEFAULT_MODEL;
pub use transfer::TransferSettings;

/// What `slotstream pull` is asked to do.
#[derive(Clone, Debug)]
pub struct PullOptions {
    /// A known name (`qwen3.8-flash-next:4bit`) or `hf:ORG/NAME[@REVISION]`.
    pub model: String,
    /// Re-hash the downloaded copy instead of downloading (`transfer.connections`
    /// files at a time); a file that does not match is deleted.
    pub verify: bool,
    /// Leave out optional files (the flagship's MTP head).
    pub skip_optional: bool,
    pub network: NetworkSettings,
    pub transfer: TransferSettings,
}

/// Runs `slotstream pull`.
pub fn run_pull(options: &PullOptions) -> Result<()> {
    let spec = ModelSpec::parse(&options.model)?;
    let root = hub_cache_root()?;
    if options.verify {
        return recheck::verify_copy(&spec, &root, options.transfer.connections);
    }
    let hub = hub::HubClient::from_env(options.network.clone());
    Puller::new(&spec, &root, hub, options.skip_optional)?.pull(&options.transfer)
}
