//! Opening the files of a model directory safely: only regular files (or
//! symlinks to them, as the Hugging Face cache makes), so a FIFO cannot block a
//! load forever and a link to `/dev/zero` cannot be read without end; and text
//! files (configs, tokenizer, chat template) read only up to a size limit.

use std::fs::{self, File, Metadata};
use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// `config.json`, `generation_config.json`, `tokenizer_config.json`: a few KB
/// in practice (a tokenizer config listing many added tokens, a few MB).
pub const CONFIG_MAX_BYTES: u64 = 16 << 20;
/// `tokenizer.json`: 11 MB for Qwen3's 151k-token vocabulary.
pub const TOKENIZER_MAX_BYTES: u64 = 256 << 20;
/// `chat_template.jinja`: a few KB in practice.
pub const TEMPLATE_MAX_BYTES: u64 = 1 << 20;
/// `model.safetensors.index.json`: a few MB for a checkpoint of 100k tensors.
pub const INDEX_MAX_BYTES: u64 = 64 << 20;

/// Opens `path` for reading if it is a regular file (following symlinks);
/// anything else (a FIFO, a device, a socket, a folder) is refused with an
/// error naming the file, without blocking on it.
pub fn open_regular(path: &Path) -> Result<File> {
    if let Ok(meta) = fs::metadata(path) {
        check_regular(path, &meta)?;
    }
    let mut options = fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        // Should the path become a FIFO after the check above, opening it
        // still returns at once; the check below then refuses it. On regular
        // files the flag changes nothing.
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).with_context(|| format!("opening {}", path.display()))?;
    check_regular(path, &file.metadata().with_context(|| format!("reading {}", path.display()))?)?;
    Ok(file)
}

/// Refuses anything but a regular file, naming what it is.
pub fn check_regular(path: &Path, meta: &Metadata) -> Result<()> {
    if meta.is_file() {
        return Ok(());
    }
    let kind = if meta.is_dir() { "a folder" } else { special_kind(meta) };
    bail!(
        "{} is {kind}, not a regular file: a model directory may hold only regular files (or links to them); \
         replace it with the real file",
        path.display()
    )
}

#[cfg(unix)]
fn special_kind(meta: &Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let kind = meta.file_type();
    if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

#[cfg(not(unix))]
fn special_kind(_meta: &Metadata) -> &'static str {
    "a special file"
}

/// Reads a UTF-8 text file of a model directory, refusing a special file or
/// one over `max_bytes` (checked before reading, and while reading, should
/// the file grow).
pub fn read_text(path: &Path, max_bytes: u64) -> Result<String> {
    let file = open_regular(path)?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let too_big = || {
        anyhow::anyhow!(
            "{} is over {} MiB, the most slotstream reads from this file; is it the right file?",
            path.display(),
            max_bytes >> 20
        )
    };
    if len > max_bytes {
        return Err(too_big());
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max_bytes + 1).read_to_end(&mut bytes).with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_big());
    }
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))
}

/// [`read_text`], or `None` when the file does not exist.
pub fn read_text_if_present(path: &Path, max_bytes: u64) -> Result<Option<String>> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => read_text(path, max_bytes).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_over_its_limit_is_refused_by_name() {
        let dir = tempfile::tempdir().expect("creating a scratch folder");
        let path = dir.path().join("tokenizer_config.json");
        fs::write(&path, "x".repeat(2048)).expect("writing a file");
        let error = read_text(&path, 1024).expect_err("over the limit");
        assert!(format!("{error:#}").contains("tokenizer_config.json is over"), "{error:#}");
        assert_eq!(read_text(&path, 4096).expect("under the limit").len(), 2048);
        assert_eq!(read_text_if_present(&dir.path().join("absent.json"), 10).expect("absent is fine"), None);
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_or_a_device_is_refused_without_blocking() {
        let dir = tempfile::tempdir().expect("creating a scratch folder");
        let fifo = dir.path().join("tokenizer.json");
        let c_path = std::ffi::CString::new(fifo.to_string_lossy().as_bytes()).expect("a path without NUL");
        // SAFETY: mkfifo reads a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "making a FIFO");
        let error = read_text(&fifo, 1 << 20).expect_err("a FIFO is not a model file");
        assert!(format!("{error:#}").contains("tokenizer.json is a FIFO"), "{error:#}");

        let zero = dir.path().join("generation_config.json");
        std::os::unix::fs::symlink("/dev/zero", &zero).expect("linking /dev/zero");
        let error = read_text(&zero, 1 << 20).expect_err("a device is not a model file");
        assert!(format!("{error:#}").contains("generation_config.json is a device"), "{error:#}");
    }
}
