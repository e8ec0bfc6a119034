//! The models `pull` completed in the hub cache, for `serve` to list and serve
//! by name, and deleting one of them (`/api/delete`). Only models with a
//! manifest (compiled in, or recorded by our `pull`) count: what another tool
//! downloaded was never verified, and is neither listed nor deleted here.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::cache::RepoCache;
use super::locate::locate_model_in;
use super::manifest::{is_commit_hash, known_model_names, Manifest, ModelSpec};

/// A complete, verified model in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstalledModel {
    /// The name clients use: a known model's name, `ORG/NAME` for a hub
    /// repository's `main`, `ORG/NAME@REV` for another revision or a commit.
    pub name: String,
    /// The same model as `slotstream pull` spells it.
    pub spec: String,
    /// Its snapshot folder.
    pub dir: PathBuf,
}

/// The name clients use for a pull spec (`hf:ORG/NAME` is `ORG/NAME`).
pub fn client_name(spec: &str) -> String {
    let name = spec.strip_prefix("hf:").unwrap_or(spec);
    name.strip_suffix("@main").unwrap_or(name).to_string()
}

/// Every complete, verified model in the cache rooted at `root`, known models
/// first, then hub repositories in folder order. A cache that does not exist
/// holds none.
pub fn installed_models(root: &Path) -> Vec<InstalledModel> {
    let mut found: Vec<InstalledModel> = Vec::new();
    let mut add = |spec: String| {
        let Ok(dir) = locate_model_in(root, &spec) else { return };
        if !found.iter().any(|m| m.dir == dir) {
            found.push(InstalledModel { name: client_name(&spec), spec, dir });
        }
    };
    for name in known_model_names() {
        add(name.to_string());
    }
    let Ok(entries) = fs::read_dir(root) else { return found };
    let mut repos: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("models--")))
        .collect();
    repos.sort();
    for dir in repos {
        for spec in pulled_specs(root, &dir) {
            add(spec);
        }
    }
    found
}

/// The `hf:` specs of the manifests our `pull` recorded in one repository
/// folder: each commit under the revisions whose refs point at it, or under
/// its own hash when none does.
fn pulled_specs(root: &Path, dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir.join(".slotstream")) else { return Vec::new() };
    let refs = read_refs(&dir.join("refs"));
    let mut specs = Vec::new();
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(commit) = file_name.strip_prefix("manifest-").and_then(|n| n.strip_suffix(".json")) else { continue };
        if !is_commit_hash(commit) {
            continue;
        }
        let record = super::cache::read_state_file(&entry.path()).ok().flatten();
        let Some(manifest) = record.and_then(|text| serde_json::from_str::<Manifest>(&text).ok()) else {
            continue;
        };
        // The folder must be the one the recorded repository is kept in.
        if RepoCache::new(root, &manifest.primary.repo).dir() != dir {
            continue;
        }
        let revisions: Vec<&str> = refs.iter().filter(|(_, c)| c == commit).map(|(r, _)| r.as_str()).collect();
        let revisions = if revisions.is_empty() { vec![commit] } else { revisions };
        for revision in revisions {
            let spec = if revision == "main" {
                format!("hf:{}", manifest.primary.repo)
            } else {
                format!("hf:{}@{revision}", manifest.primary.repo)
            };
            if ModelSpec::parse(&spec).is_ok() {
                specs.push(spec);
            }
        }
    }
    specs.sort();
    specs
}

/// `(revision, commit)` for every ref file under `refs` (`refs/pr/1` included).
fn read_refs(refs: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut folders = vec![(refs.to_path_buf(), String::new())];
    while let Some((folder, prefix)) = folders.pop() {
        let Ok(entries) = fs::read_dir(&folder) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let revision = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            let Ok(kind) = entry.file_type() else { continue };
            if kind.is_dir() {
                folders.push((entry.path(), revision));
            } else if kind.is_file() {
                let commit = fs::read_to_string(entry.path()).unwrap_or_default().trim().to_string();
                if is_commit_hash(&commit) {
                    out.push((revision, commit));
                }
            }
        }
    }
    out
}

/// Deletes `model` from the cache rooted at `root`: its snapshot, the refs and
/// manifest that name its commit, and every blob no other snapshot links to;
/// the repository's whole folder when no other revision is left. Refused while
/// a pull writes into the same repository.
pub fn delete_installed(root: &Path, model: &InstalledModel) -> Result<()> {
    let spec = ModelSpec::parse(&model.spec)?;
    let repo = RepoCache::new(root, spec.cache_repo());
    let Some(commit) = model.dir.file_name().map(|c| c.to_string_lossy().into_owned()) else {
        bail!("{} has no snapshot folder", model.dir.display());
    };
    if model.dir != repo.snapshot_dir(&commit) || !is_commit_hash(&commit) {
        bail!("{} is not a snapshot of {} in {}", model.dir.display(), model.name, root.display());
    }
    let _lock = repo.lock().with_context(|| format!("deleting {}", model.name))?;
    let snapshots = repo.dir().join("snapshots");
    let others: Vec<PathBuf> = fs::read_dir(&snapshots)
        .with_context(|| format!("reading {}", snapshots.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| *p != model.dir)
        .collect();
    if others.is_empty() {
        return fs::remove_dir_all(repo.dir()).with_context(|| format!("removing {}", repo.dir().display()));
    }
    fs::remove_dir_all(&model.dir).with_context(|| format!("removing {}", model.dir.display()))?;
    for (revision, pointed) in read_refs(&repo.dir().join("refs")) {
        if pointed == commit {
            let mut path = repo.dir().join("refs");
            path.extend(revision.split('/'));
            super::cache::remove_if_present(&path)?;
        }
    }
    super::cache::remove_if_present(&repo.state_dir().join(format!("manifest-{commit}.json")))?;
    let kept: HashSet<PathBuf> = others.iter().flat_map(|s| linked_blobs(s)).collect();
    let Ok(blobs) = fs::read_dir(repo.blobs_dir()) else { return Ok(()) };
    for blob in blobs.flatten().map(|e| e.path()) {
        let partial = blob.extension().is_some_and(|x| x.to_string_lossy().starts_with("slotstream-"));
        let real = fs::canonicalize(&blob).unwrap_or_else(|_| blob.clone());
        if !partial && !kept.contains(&real) {
            super::cache::remove_if_present(&blob)?;
        }
    }
    Ok(())
}

/// The blobs a snapshot's links point at.
fn linked_blobs(snapshot: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut folders = vec![snapshot.to_path_buf()];
    while let Some(folder) = folders.pop() {
        let Ok(entries) = fs::read_dir(&folder) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => folders.push(path),
                _ => {
                    if let Ok(target) = fs::canonicalize(&path) {
                        out.push(target);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_names_drop_the_hf_prefix_and_main() {
        assert_eq!(client_name("hf:org/name"), "org/name");
        assert_eq!(client_name("hf:org/name@v1"), "org/name@v1");
        assert_eq!(client_name("qwen3.8-flash-next:4bit"), "qwen3.8-flash-next:4bit");
    }

    #[test]
    fn a_missing_cache_holds_no_models() {
        let scratch = tempfile::tempdir().expect("a scratch folder");
        assert!(installed_models(&scratch.path().join("nothing-here")).is_empty());
        assert!(installed_models(scratch.path()).is_empty());
    }
}
