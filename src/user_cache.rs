//! slotstream's own cache folder: `$XDG_CACHE_HOME/slotstream`, else
//! `~/.cache/slotstream`. It holds the unpacked demo model, the rates
//! `doctor --measure` measured (`rates.json`) and the hit rates streaming
//! runs measured (`hits.json`); models pulled from the hub live in the
//! Hugging Face cache instead.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A larger file is not one of ours.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// The folder (not created here).
pub fn dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("slotstream"));
    }
    let home = std::env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set: slotstream has no cache folder")?;
    Ok(PathBuf::from(home).join(".cache").join("slotstream"))
}

/// The JSON file at `path` (`T::default()` if it does not exist). Errors
/// say the file holds no `what` and end with `remedy`.
pub fn read_json<T: DeserializeOwned + Default>(path: &Path, what: &str, remedy: &str) -> Result<T> {
    let len = match std::fs::metadata(path) {
        Ok(meta) => meta.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(T::default()),
        Err(e) => return Err(e).with_context(|| format!("reading {what} from {}", path.display())),
    };
    if len > MAX_FILE_BYTES {
        bail!("{} is {len} bytes, more than {what} take: {remedy}", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {what} from {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a file of {what}: {remedy}", path.display()))
}

/// Writes `value` to `path` whole (a temporary file renamed into place, so a
/// reader never sees half of it).
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension(format!("json.{}.partial", std::process::id()));
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} into place", tmp.display()))
}
