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
//! - `progress`: bars on a terminal, plain lines elsewhere, events for an observer.
//! - `installed`: the complete models in the cache (for `serve`), and deleting one.

mod cache;
mod hub;
mod installed;
mod locate;
mod manifest;
mod progress;
mod puller;
mod recheck;
mod transfer;
mod verify;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;

use cache::hub_cache_root;
use manifest::ModelSpec;
use puller::Puller;

pub use hub::{HubRefused, NetworkSettings};
pub use installed::{client_name, delete_installed, installed_models, InstalledModel};
pub use locate::{locate_model, locate_model_in};
pub use manifest::DEFAULT_MODEL;
pub use progress::{PullEvent, PullObserver};
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
    let snapshot = leaving_no_empty_folders(&spec, &root, || {
        Puller::new(&spec, &root, hub, options.skip_optional)?.pull(&options.transfer)
    })?;
    crate::console::print_line(format_args!("{} is ready in {}", spec.display_name(), snapshot.display()))?;
    Ok(())
}

/// Where `serve` pulls from and into.
#[derive(Clone, Debug)]
pub struct PullSource {
    /// The hub cache (`HF_HUB_CACHE`, ...).
    pub cache_root: PathBuf,
    /// The hub's address (`HF_ENDPOINT`, else huggingface.co).
    pub endpoint: String,
    pub token: Option<String>,
    pub network: NetworkSettings,
    pub transfer: TransferSettings,
}

impl PullSource {
    /// The cache, hub and token `slotstream pull` would use, with its default settings.
    pub fn from_env() -> Result<PullSource> {
        let (endpoint, token) = hub::endpoint_and_token_from_env();
        Ok(PullSource {
            cache_root: hub_cache_root()?,
            endpoint,
            token,
            network: NetworkSettings::default(),
            transfer: TransferSettings::default(),
        })
    }
}

/// Pulls `spec` (a known name or `hf:ORG/NAME[@REV]`) as `slotstream pull` does,
/// telling `observer` how it goes (the manifest first, then each file's bytes and
/// verification); returns the complete snapshot folder.
pub fn pull_model(source: &PullSource, spec: &str, observer: Arc<dyn PullObserver>) -> Result<PathBuf> {
    observer.event(PullEvent::Manifest);
    let spec = ModelSpec::parse(spec)?;
    let hub = hub::HubClient::new(&source.endpoint, source.token.clone(), source.network.clone());
    leaving_no_empty_folders(&spec, &source.cache_root, || {
        Puller::new(&spec, &source.cache_root, hub, false)?.observed_by(observer).pull(&source.transfer)
    })
}

/// Runs `pull` (which makes the model's cache folders first); when it fails
/// having kept nothing (no network, no such repository), removes the folders
/// it made: the model's, and the cache's own where it was made for it.
fn leaving_no_empty_folders(spec: &ModelSpec, root: &Path, pull: impl FnOnce() -> Result<PathBuf>) -> Result<PathBuf> {
    let root_existed = root.exists();
    let result = pull();
    if result.is_err() {
        let repo = cache::RepoCache::new(root, spec.cache_repo());
        // Not while another pull of the model holds them.
        if holds_nothing(repo.dir()) {
            if let Ok(_lock) = repo.lock() {
                let _ = std::fs::remove_dir_all(repo.dir());
            }
        }
        if !root_existed {
            let _ = std::fs::remove_dir(root); // only if empty
        }
    }
    result
}

/// Whether `dir` holds folders and `pull`'s lock file only (an unreadable
/// entry counts as something).
fn holds_nothing(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else { return false };
    entries.into_iter().all(|entry| {
        let Ok(entry) = entry else { return false };
        match entry.file_type() {
            Ok(kind) if kind.is_dir() => holds_nothing(&entry.path()),
            Ok(kind) if kind.is_file() => entry.file_name() == "pull.lock",
            _ => false,
        }
    })
}

/// Checks a model name the way `pull` reads it, without touching the network
/// or the disk; returns the name clients will use for it.
pub fn check_spec(spec: &str) -> Result<String> {
    ModelSpec::parse(spec)?;
    Ok(client_name(spec))
}

/// Whether a known model is in the cache, and whether the rest of it would
/// fit on the disk that holds the cache (for `doctor`).
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct InstallStatus {
    pub model: String,
    /// The complete, verified copy, if there is one.
    pub installed_at: Option<std::path::PathBuf>,
    /// Where it would be downloaded to.
    pub cache: std::path::PathBuf,
    /// Every file of the model (optional ones included).
    pub download_bytes: u64,
    /// Free space in the cache's file system; `None` where it cannot be measured.
    pub cache_free_bytes: Option<u64>,
}

impl InstallStatus {
    /// The status of `name`, a model with a compiled-in manifest.
    pub fn of_known(name: &str) -> Result<InstallStatus> {
        let ModelSpec::Known { manifest, .. } = ModelSpec::parse(name)? else {
            anyhow::bail!("{name} is not a model with a compiled-in manifest");
        };
        let cache = hub_cache_root()?;
        // Measured on the cache or, before it exists, on the folder it would be made in.
        let measured = cache.ancestors().find(|p| p.exists()).unwrap_or(&cache).to_path_buf();
        Ok(InstallStatus {
            model: name.to_string(),
            installed_at: locate_model_in(&cache, name).ok(),
            download_bytes: manifest.files.iter().map(|f| f.size).sum(),
            cache_free_bytes: crate::disk::free_bytes(&measured).ok(),
            cache,
        })
    }

    /// Whether a download would fit (`None`: installed already, or unknown).
    pub fn would_fit(&self) -> Option<bool> {
        match (&self.installed_at, self.cache_free_bytes) {
            (None, Some(free)) => Some(free >= self.download_bytes),
            _ => None,
        }
    }
}
