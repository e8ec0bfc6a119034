//! Finding a downloaded model offline, for `run` and `serve`: its snapshot folder
//! when every required file is there and was verified, else an error that names
//! what is missing and the `slotstream pull` command that completes it.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use indicatif::DecimalBytes;

use super::cache::{hub_cache_root, RepoCache, VerifiedFiles};
use super::manifest::{Manifest, ManifestFile, ModelSpec};

/// The local snapshot folder of `spec` (a known model name or `hf:ORG/NAME[@REV]`) in
/// the hub cache, if every required file is there at its pinned size and was verified
/// by hash when it arrived. Otherwise an error naming what is missing or partial and
/// the exact `slotstream pull` command that completes it. Files are not re-hashed here
/// (that is `pull --verify`); a file that ever failed verification was deleted.
pub fn locate_model(spec: &str) -> Result<PathBuf> {
    locate_model_in(&hub_cache_root()?, spec)
}

/// [`locate_model`] in the cache rooted at `cache_root`.
pub fn locate_model_in(cache_root: &Path, spec: &str) -> Result<PathBuf> {
    let spec = ModelSpec::parse(spec)?;
    let repo = RepoCache::new(cache_root, spec.cache_repo());
    let pull_command = format!("slotstream pull {}", spec.display_name());
    let manifest = local_manifest(&spec, &repo, &pull_command)?;
    let snapshot = repo.snapshot_dir(&manifest.primary.revision);
    let verified = repo.load_verified();
    let problems: Vec<String> = manifest
        .files
        .iter()
        .filter_map(|file| {
            let local = repo.snapshot_file(&manifest.primary.revision, &file.path);
            let state = LocalState::of(&local, file, &verified);
            match state {
                LocalState::Missing if file.optional => None,
                LocalState::Verified => None,
                _ => Some(state.describe(file)),
            }
        })
        .collect();
    if problems.is_empty() {
        return Ok(snapshot);
    }
    let mut listing = problems.iter().take(12).map(|p| format!("  - {p}\n")).collect::<String>();
    if problems.len() > 12 {
        listing.push_str(&format!("  - and {} more\n", problems.len() - 12));
    }
    bail!(
        "{} is not ready in {}:\n{listing}Download and verify what is missing (it resumes where it stopped) with:\n  {pull_command}",
        spec.display_name(),
        snapshot.display()
    )
}

/// The manifest of `spec` known without the network: compiled in, or recorded by the
/// `pull` that fetched an `hf:` model.
pub(super) fn local_manifest(spec: &ModelSpec, repo: &RepoCache, pull_command: &str) -> Result<Manifest> {
    let revision = match spec {
        ModelSpec::Known { manifest, .. } => return Ok(manifest.clone()),
        ModelSpec::Hub { revision, .. } => revision,
    };
    let name = spec.display_name();
    let Some(commit) = repo.resolve_revision(revision)? else {
        bail!("{name} is not downloaded (nothing in {}). Download it with:\n  {pull_command}", repo.dir().display());
    };
    match repo.load_manifest(&commit)? {
        Some(manifest) => Ok(manifest),
        None => bail!(
            "{name} (commit {commit}) in {} was not downloaded by slotstream, so its files were \
             never checked. Check and complete it with:\n  {pull_command}",
            repo.dir().display()
        ),
    }
}

/// What the cache holds for one file.
pub(super) enum LocalState {
    Missing,
    WrongSize(u64),
    Unverified,
    Verified,
}

impl LocalState {
    pub(super) fn of(local: &Path, file: &ManifestFile, verified: &VerifiedFiles) -> LocalState {
        match fs::metadata(local) {
            Err(_) => LocalState::Missing,
            Ok(meta) if meta.len() != file.size => LocalState::WrongSize(meta.len()),
            Ok(_) if verified.is_verified(local, &file.digest) => LocalState::Verified,
            Ok(_) => LocalState::Unverified,
        }
    }

    pub(super) fn describe(&self, file: &ManifestFile) -> String {
        let path = &file.path;
        let size = DecimalBytes(file.size);
        match self {
            LocalState::Missing => format!("{path} ({size}) is missing"),
            LocalState::WrongSize(len) => {
                format!("{path} is partial or damaged: {len} bytes instead of {}", file.size)
            }
            LocalState::Unverified => format!("{path} ({size}) has not been verified yet"),
            LocalState::Verified => format!("{path} is verified"),
        }
    }
}

