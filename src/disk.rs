//! Free disk space, for `doctor`'s report and `pull`'s check before any byte
//! moves: one measure, so the two never disagree.

use std::path::Path;

use anyhow::{Context, Result};

/// Bytes this user may still write on the file system holding `path`
/// (blocks reserved for root excluded).
pub fn free_bytes(path: &Path) -> Result<u64> {
    fs4::available_space(path).with_context(|| format!("checking free disk space in {}", path.display()))
}
