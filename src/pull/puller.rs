//! One `pull` of one model: what the cache already holds is checked (and kept when
//! it matches), what the hub has for the rest is checked against the pins before any
//! byte moves, then the missing files are downloaded, verified and linked into the
//! snapshot.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use indicatif::DecimalBytes;

use super::cache::{self, delete_snapshot_entry, remove_if_present, RepoCache, VerifiedFiles};
use super::hub::{FileMetadata, HubClient};
use super::locate::LocalState;
use super::manifest::{is_commit_hash, Digest, Manifest, ManifestFile, ModelSpec, Source};
use super::progress::{Progress, PullEvent, PullObserver};
use super::transfer::{self, Download, TransferSettings};
use super::verify::{self, FileCheck};
use crate::disk;
use crate::note;

/// Hub metadata fetched while listing an `hf:` model, by file path.
type MetadataByPath = HashMap<String, (Source, FileMetadata)>;

/// One `pull` of one model into its cache folder.
pub(super) struct Puller {
    hub: HubClient,
    repo: RepoCache,
    name: String,
    manifest: Manifest,
    /// Metadata already fetched while building an `hf:` manifest, by path.
    known_metadata: MetadataByPath,
    skip_optional: bool,
    verified: Mutex<VerifiedFiles>,
    /// Hears per-file progress (the server's `/api/pull`); `None` for the command line.
    observer: Option<Arc<dyn PullObserver>>,
    _lock: fs::File,
}

/// A file that has to come over the network.
struct PlannedDownload {
    file: ManifestFile,
    blob: String,
    download: Download,
}

impl Puller {
    pub(super) fn new(spec: &ModelSpec, root: &Path, hub: HubClient, skip_optional: bool) -> Result<Puller> {
        let repo = RepoCache::new(root, spec.cache_repo());
        repo.create_dirs()?;
        let lock = repo.lock()?;
        let mut known_metadata = HashMap::new();
        let manifest = match spec {
            ModelSpec::Known { manifest, .. } => manifest.clone(),
            ModelSpec::Hub { repo: repo_id, revision } => {
                let (manifest, metadata) = manifest_from_hub(&hub, repo_id, revision)?;
                repo.save_manifest(&manifest)?;
                if !is_commit_hash(revision) {
                    repo.write_ref(revision, &manifest.primary.revision)?;
                }
                known_metadata = metadata;
                manifest
            }
        };
        let verified = Mutex::new(repo.load_verified());
        Ok(Puller {
            hub,
            repo,
            name: spec.display_name(),
            manifest,
            known_metadata,
            skip_optional,
            verified,
            observer: None,
            _lock: lock,
        })
    }

    /// Reports progress to `observer` as well.
    pub(super) fn observed_by(mut self, observer: Arc<dyn PullObserver>) -> Puller {
        self.observer = Some(observer);
        self
    }

    fn tell(&self, event: PullEvent) {
        if let Some(observer) = &self.observer {
            observer.event(event);
        }
    }

    fn commit(&self) -> &str {
        &self.manifest.primary.revision
    }

    /// Completes the model in the cache; returns its snapshot folder.
    pub(super) fn pull(&self, settings: &TransferSettings) -> Result<PathBuf> {
        let wanted: Vec<&ManifestFile> =
            self.manifest.files.iter().filter(|f| !(self.skip_optional && f.optional)).collect();

        // What is already in the cache, from us or from another tool.
        let mut unverified = Vec::new();
        let mut absent = Vec::new();
        for &file in &wanted {
            let local = self.repo.snapshot_file(self.commit(), &file.path);
            let state = LocalState::of(&local, file, &self.lock_verified());
            match state {
                LocalState::Verified => self.tell(PullEvent::File {
                    path: file.path.clone(),
                    digest: digest_label(&file.digest),
                    total: file.size,
                    completed: file.size,
                }),
                LocalState::Unverified => unverified.push((file.clone(), local)),
                LocalState::Missing => absent.push(file.clone()),
                LocalState::WrongSize(_) => {
                    note!("{}: the copy in the cache is partial or damaged; fetching it again", file.path);
                    self.delete_local(&local)?;
                    absent.push(file.clone());
                }
            }
        }
        absent.extend(self.adopt_existing(unverified, settings.connections)?);
        // Sizes are known before any request (pinned, or listed by the hub):
        // a download that cannot fit is refused before the first byte moves.
        let absent_bytes: u64 = absent.iter().map(|f| f.size).sum();
        if absent_bytes > 0 {
            check_free_space(&self.repo.blobs_dir(), absent_bytes.saturating_sub(partial_bytes_on_disk(&self.repo.blobs_dir())))?;
        }

        // What the hub has for the rest; a blob that is already there is checked, not fetched.
        let mut planned = Vec::new();
        let mut blobs_present = Vec::new();
        for file in absent {
            // A file the hub cannot describe stops the run: the hub is unreachable or
            // disagrees with the pins, and either way the other files would fail alike.
            let plan = self.plan_download(&file).with_context(|| format!("preparing to download {}", file.path))?;
            match plan {
                Some(plan) => match fs::metadata(self.repo.blob_path(&plan.blob)) {
                    Ok(meta) if meta.len() == file.size => blobs_present.push(plan),
                    _ => planned.push(plan),
                },
                None => note!("{}: optional, not available from any source; skipped", file.path),
            }
        }
        let blob_checks = blobs_present
            .iter()
            .map(|plan| {
                self.repo.link_snapshot(self.commit(), &plan.file.path, &plan.blob)?;
                Ok((plan.file.clone(), self.repo.snapshot_file(self.commit(), &plan.file.path)))
            })
            .collect::<Result<Vec<_>>>()?;
        let refetch = self.adopt_existing(blob_checks, settings.connections)?;
        for plan in blobs_present {
            if refetch.contains(&plan.file) {
                planned.push(plan);
            }
        }

        // Files with identical content share one blob: fetch it once, link it for each.
        let mut seen_blobs = std::collections::HashSet::new();
        let (planned, same_content): (Vec<_>, Vec<_>) =
            planned.into_iter().partition(|plan| seen_blobs.insert(plan.blob.clone()));
        let mut failures = if planned.is_empty() { Vec::new() } else { self.download(&planned, settings)? };
        for plan in same_content {
            if self.repo.blob_path(&plan.blob).exists() {
                self.repo.link_snapshot(self.commit(), &plan.file.path, &plan.blob)?;
            } else {
                failures.push(format!("{}: its content is another file's, which did not complete", plan.file.path));
            }
        }
        if !failures.is_empty() {
            bail!(
                "{} of {} files of {} did not complete:\n{}\nRun `slotstream pull {}` again: it \
                 resumes where it stopped and keeps every byte already verified.",
                failures.len(),
                wanted.len(),
                self.name,
                failures.iter().map(|f| format!("  - {f}\n")).collect::<String>(),
                self.name
            );
        }
        Ok(self.repo.snapshot_dir(self.commit()))
    }

    /// Hashes files already in the snapshot that we have not verified (another tool
    /// downloaded them, or we were stopped between hashing and recording). Returns the
    /// ones that did not match; those were deleted.
    fn adopt_existing(
        &self,
        files: Vec<(ManifestFile, PathBuf)>,
        threads: usize,
    ) -> Result<Vec<ManifestFile>> {
        if files.is_empty() {
            return Ok(Vec::new());
        }
        let checks: Vec<FileCheck> = files
            .iter()
            .map(|(file, local)| FileCheck { label: file.path.clone(), path: local.clone(), digest: file.digest.clone() })
            .collect();
        let total = files.iter().map(|(f, _)| f.size).sum();
        note!("checking {} file(s) already in the cache ({})", files.len(), DecimalBytes(total));
        for (file, _) in &files {
            self.tell(PullEvent::Verifying { path: file.path.clone() });
        }
        let progress = Progress::new("checked", total, 0);
        let results = verify::hash_all(&checks, threads, &progress);
        progress.finish();
        let mut refetch = Vec::new();
        for ((file, local), result) in files.into_iter().zip(results) {
            let actual = result?;
            if actual == file.digest.hex() {
                self.record_verified(&local, &file.digest)?;
            } else {
                note!(
                    "{}: the copy in the cache does not match its pinned {} ({}, expected {}); deleted it, fetching it again",
                    file.path,
                    file.digest.algorithm(),
                    actual,
                    file.digest.hex()
                );
                self.delete_local(&local)?;
                refetch.push(file);
            }
        }
        Ok(refetch)
    }

    /// Finds where the file can be fetched and checks the hub agrees with the pins.
    /// `None` for an optional file no source has.
    fn plan_download(&self, file: &ManifestFile) -> Result<Option<PlannedDownload>> {
        let (source, metadata) = match self.known_metadata.get(&file.path) {
            Some(found) => found.clone(),
            None => match self.find_source(&file.path)? {
                Some(found) => found,
                None if file.optional => return Ok(None),
                None => bail!(
                    "no source has this file ({} at {}); the pinned revision may have been removed from the hub",
                    self.manifest.primary.repo,
                    self.commit()
                ),
            },
        };
        if let Some(commit) = metadata.commit.as_deref().filter(|c| *c != source.revision) {
            bail!("asked {} for commit {} but it answered for commit {commit}", source.repo, source.revision);
        }
        if metadata.size != file.size {
            bail!(
                "the hub reports {} bytes but {} are pinned; refusing a file that differs from the manifest",
                metadata.size,
                file.size
            );
        }
        if metadata.is_lfs && matches!(file.digest, Digest::Sha256(_)) && metadata.etag != file.digest.hex() {
            bail!(
                "the hub reports sha256 {} but {} is pinned; refusing a file that differs from the manifest",
                metadata.etag,
                file.digest.hex()
            );
        }
        let blob = metadata.etag.clone();
        let download = Download {
            label: file.path.clone(),
            url: self.hub.resolve_url(&source.repo, &source.revision, &file.path),
            size: file.size,
            partial: self.repo.partial_path(&blob),
            ranges: self.repo.ranges_path(&blob),
        };
        Ok(Some(PlannedDownload { file: file.clone(), blob, download }))
    }

    /// The first of the primary repository and its mirrors that has `path`.
    fn find_source(&self, path: &str) -> Result<Option<(Source, FileMetadata)>> {
        let sources = std::iter::once(&self.manifest.primary).chain(&self.manifest.mirrors);
        for source in sources {
            if let Some(metadata) = self.hub.file_metadata(&source.repo, &source.revision, path)? {
                return Ok(Some((source.clone(), metadata)));
            }
        }
        Ok(None)
    }

    /// Fetches the planned files; returns one message per file that failed.
    fn download(&self, planned: &[PlannedDownload], settings: &TransferSettings) -> Result<Vec<String>> {
        let downloads: Vec<Download> = planned.iter().map(|p| p.download.clone()).collect();
        let total: u64 = downloads.iter().map(|d| d.size).sum();
        let on_disk: u64 = downloads.iter().map(transfer::bytes_already_done).sum();
        check_free_space(&self.repo.blobs_dir(), total - on_disk)?;
        note!(
            "downloading {} file(s) of {}: {} to fetch{}, {} connection(s)",
            downloads.len(),
            self.name,
            DecimalBytes(total - on_disk),
            if on_disk > 0 { format!(" ({} already on disk)", DecimalBytes(on_disk)) } else { String::new() },
            settings.connections
        );
        let files = planned.iter().map(|p| {
            let done = transfer::bytes_already_done(&p.download);
            (p.file.path.clone(), digest_label(&p.file.digest), p.file.size, done)
        });
        let progress = Progress::new("downloaded", total, on_disk).observed(self.observer.clone(), files);
        let by_label: HashMap<&str, &PlannedDownload> =
            planned.iter().map(|p| (p.download.label.as_str(), p)).collect();
        let finish = |download: &Download| -> Result<()> {
            let plan = by_label.get(download.label.as_str()).context("finished an unplanned download")?;
            self.install(plan, &progress)
        };
        let outcomes = transfer::download_all(&self.hub, &downloads, settings, &progress, &finish);
        progress.finish();
        Ok(planned
            .iter()
            .zip(outcomes)
            .filter_map(|(plan, outcome)| outcome.err().map(|e| format!("{}: {e:#}", plan.file.path)))
            .collect())
    }

    /// Hashes a completed partial file; on a match moves it into `blobs/` and links it
    /// into the snapshot, otherwise deletes it.
    fn install(&self, plan: &PlannedDownload, progress: &Progress) -> Result<()> {
        let download = &plan.download;
        let digest = &plan.file.digest;
        progress.verifying(&plan.file.path);
        if download.size >= 256 << 20 {
            progress.println(&format!("{}: all bytes received, verifying", plan.file.path));
        }
        let actual = verify::hash_file(&download.partial, digest, None)?;
        if actual != digest.hex() {
            transfer::discard_partial(download)?;
            bail!(
                "the downloaded file's {} is {actual}, but {} is pinned: it was corrupted in \
                 transit or the hub's copy changed. The corrupt file was deleted; run the \
                 command again to download it again",
                digest.algorithm(),
                digest.hex()
            );
        }
        let blob = self.repo.blob_path(&plan.blob);
        fs::rename(&download.partial, &blob)
            .with_context(|| format!("moving {} to {}", download.partial.display(), blob.display()))?;
        cache::sync_dir(&self.repo.blobs_dir());
        remove_if_present(&download.ranges)?;
        self.repo.link_snapshot(self.commit(), &plan.file.path, &plan.blob)?;
        self.record_verified(&blob, digest)?;
        progress.println(&format!("{}: verified ({} {})", plan.file.path, digest.algorithm(), digest.hex()));
        Ok(())
    }

    fn lock_verified(&self) -> std::sync::MutexGuard<'_, VerifiedFiles> {
        self.verified.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record_verified(&self, file: &Path, digest: &Digest) -> Result<()> {
        let mut verified = self.lock_verified();
        verified.mark_verified(file, digest);
        self.repo.save_verified(&verified)
    }

    /// Forgets a snapshot entry's verification and deletes it (and its blob).
    fn delete_local(&self, local: &Path) -> Result<()> {
        self.lock_verified().forget(local);
        delete_snapshot_entry(local)
    }
}

/// A digest as Ollama's progress stream writes one: `sha256:<hex>` (`sha1:<hex>` for
/// the git hash of a small file).
fn digest_label(digest: &Digest) -> String {
    match digest {
        Digest::Sha256(hex) => format!("sha256:{hex}"),
        Digest::GitSha1(hex) => format!("sha1:{hex}"),
    }
}

/// Builds the manifest of an `hf:` model from the hub: the file list at the revision,
/// then each file's size and digest from its `resolve` headers.
fn manifest_from_hub(
    hub: &HubClient,
    repo: &str,
    revision: &str,
) -> Result<(Manifest, MetadataByPath)> {
    let info = hub.repo_info(repo, revision)?;
    if !is_commit_hash(&info.sha) {
        bail!("the hub answered commit {:?} for {repo}@{revision}, which is not a commit hash", info.sha);
    }
    note!("{repo}@{revision} is commit {}: {} file(s)", info.sha, info.siblings.len());
    let source = Source { repo: repo.to_string(), revision: info.sha.clone() };
    let mut files = Vec::new();
    let mut metadata = HashMap::new();
    for sibling in info.siblings {
        let path = sibling.rfilename;
        if path.split('/').any(|part| part.is_empty() || part == "." || part == "..") {
            bail!("the hub listed a file with an unsafe path {path:?} in {repo}");
        }
        // Ask at the resolved commit, so every file comes from the same revision.
        let meta = hub
            .file_metadata(repo, &info.sha, &path)?
            .with_context(|| format!("{repo} lists {path} but the hub has no such file at {}", info.sha))?;
        let digest = if meta.is_lfs { Digest::Sha256(meta.etag.clone()) } else { Digest::GitSha1(meta.etag.clone()) };
        let hex_len = if meta.is_lfs { 64 } else { 40 };
        if meta.etag.len() != hex_len || !meta.etag.chars().all(|c| c.is_ascii_hexdigit()) {
            bail!(
                "the hub's ETag {:?} for {path} is not a {}; cannot verify this file",
                meta.etag,
                digest.algorithm()
            );
        }
        files.push(ManifestFile { path: path.clone(), size: meta.size, digest, optional: false });
        metadata.insert(path, (source.clone(), meta));
    }
    Ok((Manifest { primary: source, mirrors: Vec::new(), files }, metadata))
}

/// Space partial downloads already take in `blobs` (allocated blocks, so a
/// sparse partial file counts only what it holds).
fn partial_bytes_on_disk(blobs: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(blobs) else { return 0 };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".slotstream-partial"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| allocated_bytes(&m))
        .sum()
}

#[cfg(unix)]
fn allocated_bytes(meta: &fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    (meta.blocks() * 512).min(meta.len())
}

#[cfg(not(unix))]
fn allocated_bytes(meta: &fs::Metadata) -> u64 {
    meta.len()
}

/// Refuses to start moving bytes that cannot fit.
fn check_free_space(dir: &Path, needed: u64) -> Result<()> {
    let available = disk::free_bytes(dir)?;
    // Room for the progress records and small files written alongside.
    let headroom = 16 << 20;
    if available < needed + headroom {
        bail!(
            "not enough free disk space in {}: {} more needed, {} available. Free some space, \
             or point HF_HUB_CACHE at a larger disk, and run the command again",
            dir.display(),
            DecimalBytes(needed + headroom),
            DecimalBytes(available)
        );
    }
    Ok(())
}

/// The fault-injecting hub server of `tests/pull.rs`, for tests of pinned manifests
/// (which only the library can construct).
#[cfg(test)]
#[allow(dead_code)]
#[path = "../../tests/pull_support/mod.rs"]
mod test_hub;

#[cfg(test)]
mod tests {
    use super::test_hub::{noise, HubServer, RepoFile, COMMIT};
    use super::*;
    use crate::pull::hub::NetworkSettings;
    use sha2::Digest as _;
    use std::time::Duration;

    fn fast_network() -> NetworkSettings {
        NetworkSettings {
            stall_timeout: Duration::from_millis(500),
            max_attempts: 3,
            first_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            connect_timeout: Duration::from_millis(500),
        }
    }

    /// A compiled-in-style manifest for the test server's files: sha256 pins for every
    /// file, a mirror, and an optional file that no source has.
    fn pinned_manifest(files: &[RepoFile]) -> Manifest {
        let mut pinned: Vec<ManifestFile> = files
            .iter()
            .map(|f| ManifestFile {
                path: f.path.clone(),
                size: f.content.len() as u64,
                digest: Digest::Sha256(test_hub::hex(&sha2::Sha256::digest(&f.content))),
                optional: false,
            })
            .collect();
        pinned.push(ManifestFile {
            path: "mtp.safetensors".into(),
            size: 10,
            digest: Digest::Sha256("0".repeat(64)),
            optional: true,
        });
        Manifest {
            primary: Source { repo: "org/name".into(), revision: COMMIT.into() },
            mirrors: vec![Source { repo: "org/mirror".into(), revision: COMMIT.into() }],
            files: pinned,
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("slotstream-pinned-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_pinned_model_is_fetched_verified_by_sha256_and_skips_an_absent_optional_file() {
        let files = vec![
            RepoFile { path: "config.json".into(), content: b"{}".to_vec(), lfs: false },
            RepoFile { path: "model.safetensors".into(), content: noise(300_000, 7), lfs: true },
        ];
        let server = HubServer::start(files.clone());
        let root = scratch("ok");
        let spec = ModelSpec::Known { name: "test:pinned".into(), manifest: pinned_manifest(&files) };
        let hub = HubClient::new(&server.endpoint(), None, fast_network());
        let settings = TransferSettings { connections: 2, chunk_bytes: 65536, checkpoint_bytes: 16384 };
        Puller::new(&spec, &root, hub, false).unwrap().pull(&settings).unwrap();

        let repo = RepoCache::new(&root, "org/name");
        let verified = repo.load_verified();
        for file in &pinned_manifest(&files).files[..2] {
            let local = repo.snapshot_file(COMMIT, &file.path);
            assert!(verified.is_verified(&local, &file.digest), "{} is not recorded as verified", file.path);
        }
        // Small files keep the hub's git-sha1 blob name, as huggingface_hub names them.
        assert!(repo.blob_path(&files[0].blob_name()).is_file());
        assert!(!repo.snapshot_file(COMMIT, "mtp.safetensors").exists());
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn a_download_that_cannot_fit_is_refused_with_the_sizes() {
        let error = check_free_space(&std::env::temp_dir(), 1 << 62).unwrap_err();
        let message = format!("{error:#}");
        assert!(message.contains("not enough free disk space") && message.contains("HF_HUB_CACHE"), "{message}");
    }

    #[test]
    fn a_hub_file_that_differs_from_the_pins_is_refused_before_any_byte_moves() {
        let files = vec![RepoFile { path: "model.safetensors".into(), content: noise(100_000, 8), lfs: true }];
        let server = HubServer::start(files.clone());
        let root = scratch("refused");
        let mut manifest = pinned_manifest(&files);
        manifest.files[0].digest = Digest::Sha256("ab".repeat(32));
        let spec = ModelSpec::Known { name: "test:pinned".into(), manifest };
        let hub = HubClient::new(&server.endpoint(), None, fast_network());
        let error = Puller::new(&spec, &root, hub, false).unwrap().pull(&TransferSettings::default()).unwrap_err();
        assert!(format!("{error:#}").contains("differs from the manifest"), "{error:#}");
        assert!(server.take_log().content_bytes.is_empty(), "bytes moved for a refused file");
        let _ = fs::remove_dir_all(&root);
    }
}

