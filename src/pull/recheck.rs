//! `pull --verify`: re-hashes a downloaded copy file by file, reports each one and
//! deletes what does not match its pinned digest, so the next `pull` fetches it again.

use std::fs;
use std::path::Path;

use anyhow::{bail, Result};
use indicatif::DecimalBytes;

use super::cache::{delete_snapshot_entry, RepoCache};
use crate::{console, note};
use super::locate::local_manifest;
use super::manifest::ModelSpec;
use super::progress::Progress;
use super::verify::{self, FileCheck};

/// `pull --verify`: re-hashes the local copy, reports every file, deletes mismatches.
pub(super) fn verify_copy(spec: &ModelSpec, root: &Path, threads: usize) -> Result<()> {
    let repo = RepoCache::new(root, spec.cache_repo());
    let name = spec.display_name();
    let pull_command = format!("slotstream pull {name}");
    let manifest = local_manifest(spec, &repo, &pull_command)?;
    // Verification may delete files: keep a concurrent pull out.
    let _lock = if repo.state_dir().is_dir() { Some(repo.lock()?) } else { None };
    let commit = &manifest.primary.revision;
    if !repo.snapshot_dir(commit).exists() {
        bail!("{name} was never pulled: nothing of it is in {}; `{pull_command}` downloads it", repo.dir().display());
    }
    let mut verified = repo.load_verified();
    let mut checks = Vec::new();
    let mut bad = 0;
    for file in &manifest.files {
        let local = repo.snapshot_file(commit, &file.path);
        match fs::metadata(&local) {
            Ok(meta) if meta.len() == file.size => checks.push(FileCheck {
                label: file.path.clone(),
                path: local,
                digest: file.digest.clone(),
            }),
            Ok(meta) => {
                bad += 1;
                console::print_line(format_args!("PARTIAL   {}: {} of {} bytes", file.path, meta.len(), file.size))?;
            }
            Err(_) if file.optional => console::print_line(format_args!("absent    {} (optional)", file.path))?,
            Err(_) => {
                bad += 1;
                console::print_line(format_args!("MISSING   {}", file.path))?;
            }
        }
    }
    let total = checks.iter().map(|c| fs::metadata(&c.path).map(|m| m.len()).unwrap_or(0)).sum();
    note!("hashing {} file(s) of {name} ({}) in {}", checks.len(), DecimalBytes(total), repo.snapshot_dir(commit).display());
    let progress = Progress::new("hashed", total, 0);
    let results = verify::hash_all(&checks, threads, &progress);
    progress.finish();
    for (check, result) in checks.iter().zip(results) {
        match result {
            Ok(actual) if actual == check.digest.hex() => {
                verified.mark_verified(&check.path, &check.digest);
                console::print_line(format_args!("ok        {}", check.label))?;
            }
            Ok(actual) => {
                bad += 1;
                verified.forget(&check.path);
                delete_snapshot_entry(&check.path)?;
                console::print_line(format_args!(
                    "MISMATCH  {}: {} is {actual}, pinned {}; deleted",
                    check.label,
                    check.digest.algorithm(),
                    check.digest.hex()
                ))?;
            }
            Err(e) => {
                bad += 1;
                console::print_line(format_args!("ERROR     {}: {e:#}", check.label))?;
            }
        }
    }
    if !checks.is_empty() {
        repo.save_verified(&verified)?;
    }
    if bad > 0 {
        bail!("{bad} of {} files of {name} are missing or damaged; download them with:\n  {pull_command}", manifest.files.len());
    }
    console::print_line(format_args!("all {} files of {name} verified", checks.len()))?;
    Ok(())
}

