//! Reading checkpoint bytes around the page cache: the one floor both
//! streamers (routed experts, the n-gram table's rows) stand on.
//!
//! Files are opened with `O_DIRECT` (Linux) or `F_NOCACHE` (macOS) so that
//! streamed bytes do not pile up in a page cache the memory budget cannot see.
//! Where the file system refuses that, plain reads are used and
//! [`DirectFile::is_direct`] says so (the run summary reports it).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::model_files;

/// Alignment for direct I/O: offsets, lengths and buffer addresses.
const ALIGN: usize = 4096;

/// A file opened for reads that bypass the page cache where the OS allows.
pub struct DirectFile {
    path: PathBuf,
    file: File,
    direct: bool,
}

/// A heap buffer whose usable part starts at an `ALIGN` boundary.
struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let raw = vec![0u8; len + ALIGN];
        let start = raw.as_ptr().align_offset(ALIGN);
        AlignedBuf { raw, start, len }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
    fn as_ref(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }
}

/// Bytes read by [`DirectFile::read_range`]: the aligned buffer the read
/// filled and where the asked-for range sits in it (nothing is copied out).
pub struct RangeBuf {
    buf: AlignedBuf,
    skip: usize,
    len: usize,
}

impl RangeBuf {
    pub fn bytes(&self) -> &[u8] {
        &self.buf.as_ref()[self.skip..self.skip + self.len]
    }
}

impl DirectFile {
    pub fn open(path: &Path) -> Result<DirectFile> {
        // Opening a FIFO would block; a device would read without end.
        let meta = std::fs::metadata(path).with_context(|| format!("opening {} for streamed reads", path.display()))?;
        model_files::check_regular(path, &meta)?;
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::OpenOptionsExt;
            if let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
                return Ok(DirectFile { path: path.to_path_buf(), file, direct: true });
            }
        }
        let file = File::open(path).with_context(|| format!("opening {} for streamed reads", path.display()))?;
        #[cfg(target_os = "macos")]
        {
            use std::os::unix::io::AsRawFd;
            // SAFETY: fcntl on a descriptor we own; F_NOCACHE only changes caching.
            let ok = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) } != -1;
            return Ok(DirectFile { path: path.to_path_buf(), file, direct: ok });
        }
        #[allow(unreachable_code)]
        Ok(DirectFile { path: path.to_path_buf(), file, direct: false })
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// `len` bytes at `offset`, in place in an aligned buffer.
    pub fn read_range(&self, offset: u64, len: usize) -> Result<RangeBuf> {
        let fail = |e: std::io::Error| {
            anyhow::anyhow!("reading {len} bytes at offset {offset} of {}: {e}", self.path.display())
        };
        if !self.direct {
            let mut buf = AlignedBuf::new(len);
            self.file.read_exact_at(buf.as_mut(), offset).map_err(fail)?;
            return Ok(RangeBuf { buf, skip: 0, len });
        }
        // Direct I/O wants aligned offsets and lengths: read the aligned span
        // around the range. Near the end of the file the span may run past it;
        // read what exists.
        let start = offset / ALIGN as u64 * ALIGN as u64;
        let end = (offset + len as u64).div_ceil(ALIGN as u64) * ALIGN as u64;
        let mut buf = AlignedBuf::new((end - start) as usize);
        let mut filled = 0usize;
        let want = (offset + len as u64 - start) as usize;
        while filled < want {
            let n = self.file.read_at(&mut buf.as_mut()[filled..], start + filled as u64).map_err(fail)?;
            if n == 0 {
                return Err(fail(std::io::ErrorKind::UnexpectedEof.into()));
            }
            filled += n;
        }
        Ok(RangeBuf { buf, skip: (offset - start) as usize, len })
    }

    /// `len` bytes at `offset`, copied out.
    pub fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        Ok(self.read_range(offset, len)?.bytes().to_vec())
    }
}
