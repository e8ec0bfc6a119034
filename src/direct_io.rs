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
use std::sync::{Arc, Mutex};

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

/// A buffer of its own anonymous mapping (page-aligned, so `ALIGN`-aligned),
/// of which the first `len` bytes are used. Not from the heap: the process
/// keeps freed heap memory in each thread's arena until 512 MB lie free at
/// its top (`process::tune_allocator`), and with a read thread per arena the
/// streamers' freed buffers stayed there, 0.2-0.4 GB over `--memory-gb` on
/// the flagship slice (BENCHMARKS.md, the flagship section). A mapping goes
/// back to the system when dropped; [`ReadBuffers`] keeps some for reuse.
struct AlignedBuf {
    /// `None` only once given back, in [`RangeBuf`]'s drop.
    map: Option<memmap2::MmapMut>,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Result<AlignedBuf> {
        let map = memmap2::MmapMut::map_anon(len.max(1)).with_context(|| format!("mapping a {len}-byte read buffer"))?;
        Ok(AlignedBuf { map: Some(map), len })
    }
    /// `len` bytes at the start of `map` (at least `len` long).
    fn within(map: memmap2::MmapMut, len: usize) -> AlignedBuf {
        AlignedBuf { map: Some(map), len }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        match &mut self.map {
            Some(m) => &mut m[..self.len],
            None => &mut [],
        }
    }
    fn as_ref(&self) -> &[u8] {
        self.map.as_ref().map_or(&[], |m| &m[..self.len])
    }
}

/// Bytes read by [`DirectFile::read_range`]: the aligned buffer the read
/// filled and where the asked-for range sits in it (nothing is copied out).
/// Read through [`ReadBuffers`], its buffer goes back there when dropped.
pub struct RangeBuf {
    buf: AlignedBuf,
    skip: usize,
    len: usize,
    home: Option<Arc<ReadBuffers>>,
}

impl RangeBuf {
    pub fn bytes(&self) -> &[u8] {
        &self.buf.as_ref()[self.skip..self.skip + self.len]
    }
}

impl Drop for RangeBuf {
    fn drop(&mut self) {
        if let (Some(home), Some(map)) = (self.home.take(), self.buf.map.take()) {
            home.give_back(map);
        }
    }
}

/// Buffers of dropped [`RangeBuf`]s kept for the next reads, up to `keep`
/// bytes (the rest is freed). A streamer reads the same few piece sizes over
/// and over: a kept buffer needs no allocation, no zeroing and no page
/// faults, work that a fresh one puts inside every read (faults where the
/// allocator has handed the memory back to the system).
pub struct ReadBuffers {
    keep: usize,
    free: Mutex<(Vec<memmap2::MmapMut>, usize)>,
}

impl ReadBuffers {
    pub fn new(keep: usize) -> ReadBuffers {
        ReadBuffers { keep, free: Mutex::new((Vec::new(), 0)) }
    }

    /// A kept buffer for `len` bytes, not more than twice the size needed;
    /// else a new one.
    fn take(&self, len: usize) -> Result<AlignedBuf> {
        let need = len.max(1);
        let kept = self.free.lock().ok().and_then(|mut free| {
            let (list, held) = &mut *free;
            let at = list.iter().position(|b| b.len() >= need && b.len() <= 2 * need)?;
            let map = list.swap_remove(at);
            *held -= map.len();
            Some(map)
        });
        match kept {
            Some(map) => Ok(AlignedBuf::within(map, len)),
            None => AlignedBuf::new(len),
        }
    }

    fn give_back(&self, map: memmap2::MmapMut) {
        if let Ok(mut free) = self.free.lock() {
            let (list, held) = &mut *free;
            if *held + map.len() <= self.keep {
                *held += map.len();
                list.push(map);
            }
        }
    }

    /// Bytes kept for reuse now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.free.lock().map_or(0, |f| f.1)
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

    /// `len` bytes at `offset`, in place in a new aligned buffer.
    pub fn read_range(&self, offset: u64, len: usize) -> Result<RangeBuf> {
        self.read_range_in(offset, len, None)
    }

    /// `len` bytes at `offset`, in place in an aligned buffer from `buffers`
    /// (where it goes back once the result is dropped), or a new one.
    pub fn read_range_in(&self, offset: u64, len: usize, buffers: Option<&Arc<ReadBuffers>>) -> Result<RangeBuf> {
        let home = buffers.cloned();
        let buffer = |n: usize| home.as_ref().map_or_else(|| AlignedBuf::new(n), |b| b.take(n));
        let buffer = |n: usize| buffer(n).with_context(|| format!("reading {len} bytes at offset {offset} of {}", self.path.display()));
        let fail = |e: std::io::Error| {
            anyhow::anyhow!("reading {len} bytes at offset {offset} of {}: {e}", self.path.display())
        };
        if !self.direct {
            let mut buf = buffer(len)?;
            self.file.read_exact_at(buf.as_mut(), offset).map_err(fail)?;
            return Ok(RangeBuf { buf, skip: 0, len, home });
        }
        // Direct I/O wants aligned offsets and lengths: read the aligned span
        // around the range. Near the end of the file the span may run past it;
        // read what exists.
        let start = offset / ALIGN as u64 * ALIGN as u64;
        let end = (offset + len as u64).div_ceil(ALIGN as u64) * ALIGN as u64;
        // A kept buffer holds an earlier read's bytes: only the filled part
        // (which covers the range) is ever looked at.
        let mut buf = buffer((end - start) as usize)?;
        let mut filled = 0usize;
        let want = (offset + len as u64 - start) as usize;
        while filled < want {
            let n = self.file.read_at(&mut buf.as_mut()[filled..], start + filled as u64).map_err(fail)?;
            if n == 0 {
                return Err(fail(std::io::ErrorKind::UnexpectedEof.into()));
            }
            filled += n;
        }
        Ok(RangeBuf { buf, skip: (offset - start) as usize, len, home })
    }

    /// `len` bytes at `offset`, copied out.
    pub fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        Ok(self.read_range(offset, len)?.bytes().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(len: usize) -> (tempfile::TempDir, DirectFile, Vec<u8>) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let path = dir.path().join("data.bin");
        std::fs::write(&path, &bytes).expect("writing the test file");
        let file = DirectFile::open(&path).expect("opening the test file");
        (dir, file, bytes)
    }

    #[test]
    fn kept_buffers_are_reused_and_show_only_the_new_reads_bytes() {
        let (_dir, file, bytes) = file_of(64 << 10);
        let buffers = Arc::new(ReadBuffers::new(1 << 20));
        let first = file.read_range_in(100, 20_000, Some(&buffers)).expect("first read");
        assert_eq!(first.bytes(), &bytes[100..20_100]);
        let at = first.buf.as_ref().as_ptr();
        drop(first);
        assert!(buffers.held() >= 20_000, "a dropped read's buffer is kept");
        // A shorter range at another offset takes the same buffer (its
        // earlier bytes still in it) and shows only what it read.
        let second = file.read_range_in(30_001, 12_000, Some(&buffers)).expect("second read");
        assert_eq!(second.buf.as_ref().as_ptr(), at, "the kept buffer is reused");
        assert_eq!(buffers.held(), 0);
        assert_eq!(second.bytes(), &bytes[30_001..42_001]);
        // One much smaller than the kept buffer gets a new one.
        drop(second);
        let small = file.read_range_in(5, 100, Some(&buffers)).expect("small read");
        assert_ne!(small.buf.as_ref().as_ptr(), at);
        assert_eq!(small.bytes(), &bytes[5..105]);
    }

    #[test]
    fn no_more_than_the_bound_is_kept() {
        let (_dir, file, _) = file_of(64 << 10);
        let buffers = Arc::new(ReadBuffers::new(30_000));
        let reads: Vec<RangeBuf> =
            (0..3).map(|i| file.read_range_in(i * 8192, 16_384, Some(&buffers)).expect("read")).collect();
        drop(reads);
        let held = buffers.held();
        assert!(held > 0 && held <= 30_000, "held {held} of a 30000-byte bound");
        let none = Arc::new(ReadBuffers::new(0));
        drop(file.read_range_in(0, 4096, Some(&none)).expect("read"));
        assert_eq!(none.held(), 0);
        // Without buffers the read's own allocation is freed as before.
        assert_eq!(file.read_range(10, 10).expect("read").bytes().len(), 10);
    }
}
