//! Hashing files against their pinned digests, several files at a time.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use sha1::Sha1;
use sha2::{Digest as _, Sha256};

use super::manifest::Digest;
use super::progress::Progress;

/// A file to hash and what it should hash to.
#[derive(Clone, Debug)]
pub struct FileCheck {
    pub label: String,
    pub path: PathBuf,
    pub digest: Digest,
}

/// The digest of `path`'s content in the algorithm `expected` uses, lowercase hex.
pub fn hash_file(path: &Path, expected: &Digest, progress: Option<&Progress>) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata().with_context(|| format!("reading {}", path.display()))?.len();
    let mut hasher: Box<dyn Hasher> = match expected {
        Digest::Sha256(_) => Box::new(Sha256::new()),
        Digest::GitSha1(_) => {
            let mut sha1 = Sha1::new();
            sha1.update(format!("blob {len}\0").as_bytes());
            Box::new(sha1)
        }
    };
    let mut buffer = vec![0u8; 4 << 20];
    loop {
        let read = file.read(&mut buffer).with_context(|| format!("reading {}", path.display()))?;
        if read == 0 {
            break;
        }
        hasher.feed(&buffer[..read]);
        if let Some(progress) = progress {
            progress.add(read as u64);
        }
    }
    Ok(hasher.finish_hex())
}

/// Hashes every file, `threads` at a time, returning each file's actual digest (hex)
/// in order.
pub fn hash_all(checks: &[FileCheck], threads: usize, progress: &Progress) -> Vec<Result<String>> {
    let next = Mutex::new(0usize);
    let results: Vec<Mutex<Option<Result<String>>>> = checks.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1).min(checks.len()) {
            scope.spawn(|| loop {
                let index = {
                    let mut next = next.lock().unwrap_or_else(|e| e.into_inner());
                    let index = *next;
                    *next += 1;
                    index
                };
                let Some(check) = checks.get(index) else { break };
                let result = hash_file(&check.path, &check.digest, Some(progress));
                *results[index].lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
            });
        }
    });
    results
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| Err(anyhow::anyhow!("the file was not hashed")))
        })
        .collect()
}

/// The two hash functions behind one interface.
trait Hasher {
    fn feed(&mut self, bytes: &[u8]);
    fn finish_hex(self: Box<Self>) -> String;
}

impl<D: sha2::Digest> Hasher for D {
    fn feed(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }

    fn finish_hex(self: Box<Self>) -> String {
        crate::hex::lower(&self.finalize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_match_git_and_sha256sum() {
        let dir = std::env::temp_dir().join(format!("slotstream-verify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("hello");
        std::fs::write(&path, b"hello\n").unwrap();
        // `printf 'hello\n' | git hash-object --stdin` and `sha256sum`.
        let git = hash_file(&path, &Digest::GitSha1(String::new()), None).unwrap();
        assert_eq!(git, "ce013625030ba8dba906f756967f9e9ca394464a");
        let sha = hash_file(&path, &Digest::Sha256(String::new()), None).unwrap();
        assert_eq!(sha, "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
