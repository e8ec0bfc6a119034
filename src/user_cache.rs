//! slotstream's own cache folder: `$XDG_CACHE_HOME/slotstream`, else
//! `~/.cache/slotstream`. It holds the unpacked demo model and the rates
//! `doctor --measure` measured (`rates.json`); models pulled from the hub
//! live in the Hugging Face cache instead.

use std::path::PathBuf;

use anyhow::{Context, Result};

/// The folder (not created here).
pub fn dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("slotstream"));
    }
    let home = std::env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set: slotstream has no cache folder")?;
    Ok(PathBuf::from(home).join(".cache").join("slotstream"))
}
