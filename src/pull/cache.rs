//! The standard Hugging Face hub cache, laid out exactly as `huggingface_hub` lays it
//! out, so models it downloaded are found here and ours are usable by it:
//!
//! ```text
//! $HF_HUB_CACHE/models--ORG--NAME/
//!   blobs/<sha256 for LFS files, git sha1 for small files>
//!   snapshots/<commit>/<path>   relative symlink to ../../blobs/<blob>
//!   refs/<revision>             the commit a branch or tag resolved to
//!   .slotstream/                our own records (other tools ignore it)
//! ```
//!
//! Partial downloads are named `<blob>.slotstream-partial`, not `<blob>.incomplete`:
//! `huggingface_hub` resumes an `.incomplete` file by appending from its length, which
//! would corrupt our sparse, range-by-range file.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::manifest::{Digest, Manifest};

/// The hub cache root: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE` (its old name),
/// else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
/// `~/.cache/huggingface/hub` — the order `huggingface_hub` uses.
pub fn hub_cache_root() -> Result<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
        return Ok(dir);
    }
    Ok(hf_home()?.join("hub"))
}

/// `HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
pub fn hf_home() -> Result<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(home) = var("HF_HOME") {
        return Ok(home);
    }
    if let Some(xdg) = var("XDG_CACHE_HOME") {
        return Ok(xdg.join("huggingface"));
    }
    match var("HOME").or_else(|| var("USERPROFILE")) {
        Some(home) => Ok(home.join(".cache").join("huggingface")),
        None => bail!("cannot find the Hugging Face cache: set HF_HUB_CACHE or HOME"),
    }
}

/// One repository's folder in the hub cache.
#[derive(Clone, Debug)]
pub struct RepoCache {
    dir: PathBuf,
}

impl RepoCache {
    pub fn new(root: &Path, repo: &str) -> RepoCache {
        RepoCache { dir: root.join(format!("models--{}", repo.replace('/', "--"))) }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blobs_dir(&self) -> PathBuf {
        self.dir.join("blobs")
    }

    pub fn blob_path(&self, blob: &str) -> PathBuf {
        self.blobs_dir().join(blob)
    }

    /// Bytes received so far for `blob`, a sparse file of the final size.
    pub fn partial_path(&self, blob: &str) -> PathBuf {
        self.blobs_dir().join(format!("{blob}.slotstream-partial"))
    }

    /// Which byte ranges of the partial file are on disk (see `transfer`).
    pub fn ranges_path(&self, blob: &str) -> PathBuf {
        self.blobs_dir().join(format!("{blob}.slotstream-ranges"))
    }

    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    pub fn snapshot_file(&self, commit: &str, path: &str) -> PathBuf {
        let mut file = self.snapshot_dir(commit);
        file.extend(path.split('/'));
        file
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.join(".slotstream")
    }

    /// Takes the repository's lock, held while the returned file stays open: one
    /// `pull` per model at a time, since two would write the same partial files.
    pub fn lock(&self) -> Result<fs::File> {
        let path = self.state_dir().join("pull.lock");
        if let Ok(meta) = fs::metadata(&path) {
            refuse_special(&path, &meta)?;
        }
        let mut options = fs::OpenOptions::new();
        options.create(true).truncate(false).write(true);
        #[cfg(unix)]
        {
            // Opening a FIFO for writing would wait for a reader; with the
            // flag it fails at once (and the check below names it).
            use std::os::unix::fs::OpenOptionsExt;
            options.custom_flags(libc::O_NONBLOCK);
        }
        let file = options.open(&path).with_context(|| format!("opening {}", path.display()))?;
        refuse_special(&path, &file.metadata().with_context(|| format!("reading {}", path.display()))?)?;
        match fs4::FileExt::try_lock(&file) {
            Ok(()) => Ok(file),
            Err(fs4::TryLockError::WouldBlock) => bail!(
                "another slotstream pull is downloading into {}; wait for it to finish",
                self.dir().display()
            ),
            Err(fs4::TryLockError::Error(e)) => Err(e).with_context(|| format!("locking {}", path.display())),
        }
    }

    pub fn create_dirs(&self) -> Result<()> {
        for dir in [self.blobs_dir(), self.state_dir(), self.dir.join("refs")] {
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(())
    }

    /// The commit `revision` resolves to locally: itself if it is a commit hash, else
    /// what `refs/<revision>` records (`None` when nothing does). A record that is not
    /// a commit hash is an error that does not repeat what the file holds.
    pub fn resolve_revision(&self, revision: &str) -> Result<Option<String>> {
        if super::manifest::is_commit_hash(revision) {
            return Ok(Some(revision.to_string()));
        }
        let path = self.ref_path(revision)?;
        if fs::symlink_metadata(&path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
            return Ok(None);
        }
        // A commit hash and a newline; anything longer is not a ref record.
        let mut record = Vec::new();
        crate::model_files::open_regular(&path)?
            .take(64)
            .read_to_end(&mut record)
            .with_context(|| format!("reading {}", path.display()))?;
        let commit = String::from_utf8_lossy(&record).trim().to_string();
        if !super::manifest::is_commit_hash(&commit) {
            bail!("{} does not hold a commit hash; delete it and pull again", path.display());
        }
        Ok(Some(commit))
    }

    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<()> {
        let path = self.ref_path(revision)?;
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        write_atomically(&path, commit.as_bytes())
    }

    /// `refs/<revision>`, for a revision that is a valid git ref name (so never an
    /// absolute path or one that leaves `refs/`).
    fn ref_path(&self, revision: &str) -> Result<PathBuf> {
        super::manifest::check_revision(revision)?;
        let mut path = self.dir.join("refs");
        path.extend(revision.split('/'));
        Ok(path)
    }

    /// Points `snapshots/<commit>/<path>` at `blobs/<blob>` with a relative symlink, as
    /// `huggingface_hub` does, replacing whatever was there.
    pub fn link_snapshot(&self, commit: &str, path: &str, blob: &str) -> Result<()> {
        let link = self.snapshot_file(commit, path);
        let parent = link.parent().context("snapshot path has no parent")?;
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        let depth = path.split('/').count() + 1; // the path's folders, plus <commit> and snapshots/
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(blob);
        remove_if_present(&link)?;
        make_link(&target, &self.blob_path(blob), &link)
            .with_context(|| format!("linking {} to {}", link.display(), target.display()))
    }

    /// The manifest of an `hf:` model at `commit`, recorded when it was pulled.
    pub fn load_manifest(&self, commit: &str) -> Result<Option<Manifest>> {
        let path = self.state_dir().join(format!("manifest-{commit}.json"));
        match read_state_file(&path)? {
            Some(text) => serde_json::from_str(&text)
                .map(Some)
                .with_context(|| format!("reading {}; delete it and pull again", path.display())),
            None => Ok(None),
        }
    }

    pub fn save_manifest(&self, manifest: &Manifest) -> Result<()> {
        let path = self.state_dir().join(format!("manifest-{}.json", manifest.primary.revision));
        write_atomically(&path, &serde_json::to_vec_pretty(manifest)?)
    }

    fn verified_path(&self) -> PathBuf {
        self.state_dir().join("verified.json")
    }

    /// Files whose content was hashed and matched; see [`VerifiedFiles`].
    pub fn load_verified(&self) -> VerifiedFiles {
        // A missing or unreadable record only means files get hashed again
        // (and saving replaces it).
        let records = read_state_file(&self.verified_path())
            .ok()
            .flatten()
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or_default();
        VerifiedFiles { records, repo: fs::canonicalize(&self.dir).ok() }
    }

    pub fn save_verified(&self, verified: &VerifiedFiles) -> Result<()> {
        write_atomically(&self.verified_path(), &serde_json::to_vec_pretty(&verified.records)?)
    }
}

/// Which files were hashed and matched their pinned digest, keyed by the real file's
/// path. A record holds only while the file keeps the size and modification time it
/// had when hashed, so `run` can trust a file without re-reading 100 GB, and a file
/// that another tool put there is hashed once before it is used.
///
/// A record is keyed by the file's path within its repository's folder
/// (`blobs/<hash>`), so a cache moved or mounted elsewhere (read-only, say)
/// keeps its records; an absolute path is a record an older slotstream wrote.
#[derive(Default, Debug)]
pub struct VerifiedFiles {
    records: BTreeMap<String, VerifiedRecord>,
    /// The repository's folder, its real path.
    repo: Option<PathBuf>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
struct VerifiedRecord {
    size: u64,
    modified_ns: u128,
    digest: Digest,
}

impl VerifiedFiles {
    pub fn is_verified(&self, file: &Path, digest: &Digest) -> bool {
        let Some((real, size, modified_ns)) = file_identity(file) else { return false };
        let want = VerifiedRecord { size, modified_ns, digest: digest.clone() };
        self.keys(&real).iter().any(|key| self.records.get(key) == Some(&want))
    }

    pub fn mark_verified(&mut self, file: &Path, digest: &Digest) {
        if let Some((real, size, modified_ns)) = file_identity(file) {
            for key in self.keys(&real) {
                self.records.remove(&key);
            }
            let key = self.key(&real);
            self.records.insert(key, VerifiedRecord { size, modified_ns, digest: digest.clone() });
        }
    }

    pub fn forget(&mut self, file: &Path) {
        if let Ok(real) = fs::canonicalize(file) {
            for key in self.keys(&real) {
                self.records.remove(&key);
            }
        }
    }

    /// The key of a file (its real path): within the repository's folder
    /// when it lies there, else the whole path.
    fn key(&self, real: &Path) -> String {
        match self.repo.as_deref().and_then(|repo| real.strip_prefix(repo).ok()) {
            Some(within) => within.to_string_lossy().into_owned(),
            None => real.to_string_lossy().into_owned(),
        }
    }

    /// The keys a record of `real` may have: its own, and the whole path an
    /// older record used.
    fn keys(&self, real: &Path) -> Vec<String> {
        let whole = real.to_string_lossy().into_owned();
        let key = self.key(real);
        if key == whole { vec![whole] } else { vec![key, whole] }
    }
}

/// The most a state file of ours (a manifest, the verified-files record, a
/// download's ranges) is read to: a few KB to a few MB in practice.
pub const STATE_FILE_MAX_BYTES: u64 = 64 << 20;

/// Reads one of the cache's state files, `None` when it does not exist. Only a
/// regular file is read (a FIFO in its place would block a reader forever, a
/// link to `/dev/zero` never end), and only up to [`STATE_FILE_MAX_BYTES`].
pub fn read_state_file(path: &Path) -> Result<Option<String>> {
    if let Ok(meta) = fs::metadata(path) {
        refuse_special(path, &meta)?;
    }
    crate::model_files::read_text_if_present(path, STATE_FILE_MAX_BYTES)
        .with_context(|| format!("reading {}; delete it and pull again", path.display()))
}

/// Refuses anything but a regular file where the cache keeps its own records.
fn refuse_special(path: &Path, meta: &fs::Metadata) -> Result<()> {
    if meta.is_file() {
        return Ok(());
    }
    let kind = if meta.is_dir() { "a folder" } else { "a special file (a FIFO, device or socket)" };
    bail!("{} is {kind}, not a regular file: slotstream keeps its pull records there; delete it and pull again", path.display())
}

/// A file's real path, size and modification time.
fn file_identity(file: &Path) -> Option<(PathBuf, u64, u128)> {
    let real = fs::canonicalize(file).ok()?;
    let meta = fs::metadata(&real).ok()?;
    let modified_ns = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?.as_nanos();
    Some((real, meta.len(), modified_ns))
}

/// Replaces `path` with `bytes` so that a crash leaves either the old or the new
/// content, never a mix: write a temporary file, fsync it, rename it over, fsync the
/// folder.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().context("a file to write atomically needs a parent folder")?;
    let mut tmp_name = path.file_name().context("no file name")?.to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let mut file = fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(bytes).with_context(|| format!("writing {}", tmp.display()))?;
    file.sync_all().with_context(|| format!("syncing {}", tmp.display()))?;
    drop(file);
    fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    sync_dir(dir);
    Ok(())
}

/// Makes a rename or new file in `dir` durable. Best effort: not every platform lets a
/// folder be opened and synced, and the data itself is already synced.
pub fn sync_dir(dir: &Path) {
    if let Ok(handle) = fs::File::open(dir) {
        let _ = handle.sync_all();
    }
}

/// Deletes a snapshot entry and, when it is a link into `blobs/`, the blob too.
pub fn delete_snapshot_entry(local: &Path) -> Result<()> {
    if let Ok(target) = fs::canonicalize(local) {
        if target != local {
            remove_if_present(&target)?;
        }
    }
    remove_if_present(local)
}

pub fn remove_if_present(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

#[cfg(unix)]
fn make_link(relative_target: &Path, _blob: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(relative_target, link)
}

/// Where symlinks need privileges, `huggingface_hub` copies the blob; so do we.
#[cfg(not(unix))]
fn make_link(_relative_target: &Path, blob: &Path, link: &Path) -> std::io::Result<()> {
    fs::copy(blob, link).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_paths_follow_huggingface_hub() {
        let repo = RepoCache::new(Path::new("/c"), "org/name");
        assert_eq!(repo.dir(), Path::new("/c/models--org--name"));
        assert_eq!(repo.snapshot_file("abc", "sub/x.json"), Path::new("/c/models--org--name/snapshots/abc/sub/x.json"));
        assert_eq!(repo.blob_path("ff"), Path::new("/c/models--org--name/blobs/ff"));
    }

    #[test]
    fn a_revision_is_never_joined_as_a_path_and_a_bad_ref_is_not_echoed() {
        let scratch = tempfile::tempdir().expect("creating a scratch folder");
        let secret = scratch.path().join("secret.txt");
        fs::write(&secret, "top secret contents").expect("writing the secret");
        let repo = RepoCache::new(&scratch.path().join("hub"), "org/name");
        let absolute = secret.to_string_lossy().into_owned();
        let error = repo.resolve_revision(&absolute).expect_err("an absolute path is not a revision");
        assert!(!format!("{error:#}").contains("top secret"), "{error:#}");
        repo.write_ref(&absolute, "0123456789abcdef0123456789abcdef01234567").expect_err("not a revision");
        assert_eq!(fs::read_to_string(&secret).expect("reading the secret"), "top secret contents");

        fs::create_dir_all(repo.dir().join("refs")).expect("creating refs/");
        fs::write(repo.dir().join("refs/main"), "top secret contents").expect("writing a bad ref");
        let error = repo.resolve_revision("main").expect_err("a ref that holds no commit");
        assert!(!format!("{error:#}").contains("top secret") && format!("{error:#}").contains("refs/main"), "{error:#}");
        assert_eq!(repo.resolve_revision("v2").expect("no such ref is not an error"), None);
    }

    /// Runs `f` on a thread and fails if it has not returned within seconds
    /// (it would block forever on a FIFO opened as a file).
    #[cfg(unix)]
    fn within_seconds<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap_or_else(|_| panic!("{what} blocked on a FIFO"))
    }

    #[cfg(unix)]
    fn make_fifo(path: &Path) {
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("a path without NUL");
        // SAFETY: mkfifo reads a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo: {}", std::io::Error::last_os_error());
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_in_place_of_a_state_file_is_refused_at_once() {
        let scratch = tempfile::tempdir().expect("creating a scratch folder");
        let repo = RepoCache::new(&scratch.path().join("hub"), "org/name");
        repo.create_dirs().expect("creating the cache folders");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        make_fifo(&repo.state_dir().join(format!("manifest-{commit}.json")));
        make_fifo(&repo.state_dir().join("verified.json"));
        make_fifo(&repo.state_dir().join("pull.lock"));

        let (manifest, verified, lock) = within_seconds("reading the state files", move || {
            let manifest = repo.load_manifest(commit).map(|_| ()).map_err(|e| format!("{e:#}"));
            let verified = repo.load_verified().records.len();
            let lock = repo.lock().map(|_| ()).map_err(|e| format!("{e:#}"));
            (manifest, verified, lock)
        });
        let manifest = manifest.expect_err("a FIFO is no manifest");
        assert!(manifest.contains(&format!("manifest-{commit}.json is a special file")), "{manifest}");
        assert!(manifest.contains("delete it and pull again"), "{manifest}");
        assert_eq!(verified, 0, "an unreadable record means files are hashed again");
        let lock = lock.expect_err("a FIFO is no lock file");
        assert!(lock.contains("pull.lock is a special file"), "{lock}");
    }
}
