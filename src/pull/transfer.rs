//! Moving bytes: each file is split into fixed-size chunks fetched with ranged GETs
//! over a shared pool of connections, written in place into a sparse partial file.
//!
//! Exact resume: next to the partial file a small record (`*.slotstream-ranges`) says
//! how many bytes of each chunk are on disk. Bytes are fsync'd before the record that
//! counts them is replaced (atomically, also fsync'd), so after `kill -9` or a power
//! cut the record never claims bytes that are not there, and the next run fetches only
//! what the record does not cover.

use std::fs::{self, File, OpenOptions};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};

use super::cache::{remove_if_present, write_atomically};
use super::hub::{Failure, HubClient};
use super::progress::Progress;

#[derive(Clone, Debug)]
pub struct TransferSettings {
    /// Parallel connections shared by all files.
    pub connections: usize,
    /// Size of one ranged request; the last chunk of a file may be shorter.
    pub chunk_bytes: u64,
    /// How often (in bytes received per connection) progress is made durable.
    pub checkpoint_bytes: u64,
}

impl TransferSettings {
    /// Splits a file that is smaller than `connections` full chunks so that every
    /// connection still gets a share, but not into pieces smaller than 1 MiB.
    fn chunk_size_for(&self, file_size: u64) -> u64 {
        let share = file_size.div_ceil(self.connections.max(1) as u64).max(1 << 20);
        self.chunk_bytes.min(share).max(1)
    }
}

impl Default for TransferSettings {
    fn default() -> Self {
        TransferSettings { connections: 8, chunk_bytes: 64 << 20, checkpoint_bytes: 8 << 20 }
    }
}

/// One file to fetch into `partial`.
#[derive(Clone, Debug)]
pub struct Download {
    /// How messages name the file (its path in the repository).
    pub label: String,
    pub url: String,
    pub size: u64,
    pub partial: PathBuf,
    pub ranges: PathBuf,
}

/// The durable record of which bytes of a partial file are on disk.
#[derive(Serialize, Deserialize, Debug)]
struct RangeRecord {
    size: u64,
    chunk_bytes: u64,
    /// Bytes on disk at the start of each chunk.
    done: Vec<u64>,
}

impl RangeRecord {
    fn fresh(size: u64, chunk_bytes: u64) -> RangeRecord {
        RangeRecord { size, chunk_bytes, done: vec![0; size.div_ceil(chunk_bytes) as usize] }
    }

    fn chunk_range(&self, chunk: usize) -> (u64, u64) {
        let start = chunk as u64 * self.chunk_bytes;
        (start, (start + self.chunk_bytes).min(self.size))
    }

    fn bytes_done(&self) -> u64 {
        self.done.iter().sum()
    }

    /// Loads the record for `download` if it describes that file and its partial file
    /// is still there at full length; anything else means starting over.
    fn load(download: &Download) -> Option<RangeRecord> {
        let record: RangeRecord = serde_json::from_str(&super::cache::read_state_file(&download.ranges).ok()??).ok()?;
        let partial_len = fs::metadata(&download.partial).ok()?.len();
        let consistent = record.size == download.size
            && partial_len == download.size
            && record.chunk_bytes > 0
            && record.done.len() as u64 == download.size.div_ceil(record.chunk_bytes)
            && (0..record.done.len()).all(|c| {
                let (start, end) = record.chunk_range(c);
                record.done[c] <= end - start
            });
        consistent.then_some(record)
    }
}

/// Bytes of `download` already on disk from an earlier run.
pub fn bytes_already_done(download: &Download) -> u64 {
    RangeRecord::load(download).map(|r| r.bytes_done()).unwrap_or(0)
}

/// Deletes a partial download and its record.
pub fn discard_partial(download: &Download) -> Result<()> {
    remove_if_present(&download.partial)?;
    remove_if_present(&download.ranges)
}

struct FileInProgress<'a> {
    download: &'a Download,
    file: File,
    record: Mutex<RangeRecord>,
    chunks_left: AtomicUsize,
    outcome: Mutex<Option<Result<()>>>,
}

enum Task {
    Chunk(usize, usize),
    /// Every byte is on disk (perhaps from an earlier run): hand the file over.
    Finish(usize),
}

/// Downloads every file, `settings.connections` ranged requests at a time, calling
/// `finish` (which verifies and installs the file) as soon as a file is complete.
/// Returns one outcome per download, in order; a failure of one file does not stop
/// the others.
pub fn download_all(
    hub: &HubClient,
    downloads: &[Download],
    settings: &TransferSettings,
    progress: &Progress,
    finish: &(dyn Fn(&Download) -> Result<()> + Sync),
) -> Vec<Result<()>> {
    let mut files = Vec::new();
    let mut tasks = std::collections::VecDeque::new();
    let mut outcomes: Vec<Option<Result<()>>> = Vec::new();
    for download in downloads {
        match open_partial(download, settings.chunk_size_for(download.size)) {
            Ok((file, record)) => {
                let pending: Vec<usize> = (0..record.done.len())
                    .filter(|&c| {
                        let (start, end) = record.chunk_range(c);
                        record.done[c] < end - start
                    })
                    .collect();
                let index = files.len();
                if pending.is_empty() {
                    tasks.push_back(Task::Finish(index));
                }
                tasks.extend(pending.iter().map(|&c| Task::Chunk(index, c)));
                files.push(FileInProgress {
                    download,
                    file,
                    record: Mutex::new(record),
                    chunks_left: AtomicUsize::new(pending.len()),
                    outcome: Mutex::new(None),
                });
                outcomes.push(None);
            }
            Err(e) => outcomes.push(Some(Err(e))),
        }
    }

    let tasks = Mutex::new(tasks);
    let workers = settings.connections.max(1).min(lock(&tasks).len());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    // Take the task in its own statement: the queue must not stay locked
                    // while the task runs.
                    if progress.cancelled() {
                        break; // the rest stays for the next pull to resume
                    }
                    let next = lock(&tasks).pop_front();
                    let Some(task) = next else { break };
                    let (index, result) = match task {
                        Task::Finish(index) => (index, Some(finish(files[index].download))),
                        Task::Chunk(index, chunk) => {
                            let file = &files[index];
                            if lock(&file.outcome).is_some() {
                                continue; // the file already failed; save the bandwidth
                            }
                            match fetch_chunk(hub, file, chunk, settings, progress) {
                                Err(e) => (index, Some(Err(e))),
                                Ok(()) if file.chunks_left.fetch_sub(1, Ordering::AcqRel) == 1 => {
                                    (index, Some(finish(file.download)))
                                }
                                Ok(()) => (index, None),
                            }
                        }
                    };
                    if let Some(result) = result {
                        lock(&files[index].outcome).get_or_insert(result);
                    }
                }
            });
        }
    });

    let mut files = files.into_iter();
    outcomes
        .into_iter()
        .map(|outcome| match outcome {
            Some(failed_to_open) => failed_to_open,
            None => files.next().and_then(|f| f.outcome.into_inner().unwrap_or_else(|e| e.into_inner())).unwrap_or_else(|| {
                Err(if progress.cancelled() { anyhow!("the pull was cancelled before this file was complete") } else { anyhow!("the download stopped before it finished") })
            }),
        })
        .collect()
}

/// Opens the partial file, resuming from its record when that is consistent, else
/// starting a fresh sparse file of the final size.
fn open_partial(download: &Download, chunk_bytes: u64) -> Result<(File, RangeRecord)> {
    let open = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&download.partial)
            .with_context(|| format!("opening {}", download.partial.display()))
    };
    if let Some(record) = RangeRecord::load(download) {
        return Ok((open()?, record));
    }
    discard_partial(download)?;
    let file = open()?;
    file.set_len(download.size)
        .with_context(|| format!("sizing {} to {} bytes", download.partial.display(), download.size))?;
    let record = RangeRecord::fresh(download.size, chunk_bytes);
    write_atomically(&download.ranges, &serde_json::to_vec(&record)?)?;
    Ok((file, record))
}

/// Fetches whatever of `chunk` is not on disk yet, retrying on network trouble.
fn fetch_chunk(
    hub: &HubClient,
    file: &FileInProgress,
    chunk: usize,
    settings: &TransferSettings,
    progress: &Progress,
) -> Result<()> {
    let (start, end) = lock(&file.record).chunk_range(chunk);
    let span = ChunkSpan { index: chunk, start, end };
    let mut position = start + lock(&file.record).done[chunk];
    let mut failures = 0;
    let mut buffer = vec![0u8; 256 << 10];
    while position < span.end {
        let attempt_start = position;
        let attempt = fetch_range(hub, file, &span, &mut position, settings, progress, &mut buffer);
        if position > attempt_start {
            failures = 0;
            checkpoint(file, chunk, position - span.start)?;
        }
        match attempt {
            Ok(()) => {}
            Err(Failure::Fatal(e)) => return Err(e),
            Err(Failure::Retry(e, retry_after)) => {
                failures += 1;
                let label = &file.download.label;
                if failures >= hub.settings.max_attempts {
                    return Err(e.context(format!(
                        "downloading {label}: gave up after {failures} attempts without progress; \
                         run the command again to resume"
                    )));
                }
                if progress.cancelled() {
                    return Err(cancelled(&file.download.label));
                }
                progress.note_retry(&format!("{label}: {e:#}; retrying"));
                std::thread::sleep(hub.backoff(failures, retry_after));
            }
        }
    }
    Ok(())
}

/// The error of a download stopped because its pull was cancelled.
fn cancelled(label: &str) -> anyhow::Error {
    anyhow!("{label}: the pull was cancelled; the bytes received so far are kept, and pulling again resumes from them")
}

/// One chunk of a file: its index and byte range (end exclusive).
struct ChunkSpan {
    index: usize,
    start: u64,
    end: u64,
}

/// One ranged request for bytes `*position..span.end`, advancing `*position` as bytes
/// are written.
fn fetch_range(
    hub: &HubClient,
    file: &FileInProgress,
    span: &ChunkSpan,
    position: &mut u64,
    settings: &TransferSettings,
    progress: &Progress,
    buffer: &mut [u8],
) -> Result<(), Failure> {
    let download = file.download;
    let chunk_end = span.end;
    let response = hub.get_range(&download.url, *position, chunk_end)?;
    check_content_range(&response, *position, chunk_end, download)?;
    let mut body = response.into_body().into_reader();
    let mut since_checkpoint = 0;
    while *position < chunk_end {
        let want = buffer.len().min((chunk_end - *position) as usize);
        let received = std::io::Read::read(&mut body, &mut buffer[..want]).map_err(|e| {
            Failure::Retry(anyhow!(e).context(format!("receiving {} at byte {position}", download.label)), None)
        })?;
        if received == 0 {
            return Err(Failure::Retry(
                anyhow!("the server closed the connection at byte {position} of {}", download.label),
                None,
            ));
        }
        write_at(&file.file, &buffer[..received], *position).map_err(|e| {
            Failure::Fatal(anyhow!(e).context(format!(
                "writing {}; is the disk full?",
                download.partial.display()
            )))
        })?;
        *position += received as u64;
        progress.add_to(&download.label, received as u64);
        if progress.cancelled() {
            // `fetch_chunk` records what is on disk before it returns.
            return Err(Failure::Fatal(cancelled(&download.label)));
        }
        since_checkpoint += received as u64;
        if since_checkpoint >= settings.checkpoint_bytes && *position < chunk_end {
            checkpoint(file, span.index, *position - span.start).map_err(Failure::Fatal)?;
            since_checkpoint = 0;
        }
    }
    Ok(())
}

/// The server must send exactly the bytes asked for, of a file of the expected size;
/// anything else (a proxy that ignored Range, a file that changed) is not written.
fn check_content_range(
    response: &ureq::http::Response<ureq::Body>,
    start: u64,
    end: u64,
    download: &Download,
) -> Result<(), Failure> {
    let headers = response.headers();
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if response.status().as_u16() == 200 {
        // A whole-file answer is fine only when the whole file was asked for.
        return if start == 0 && end == download.size {
            Ok(())
        } else {
            Err(Failure::Fatal(anyhow!(
                "the server ignored the byte range request for {}; it does not support resumable downloads",
                download.label
            )))
        };
    }
    let expected = format!("bytes {start}-{}/{}", end - 1, download.size);
    match text("content-range") {
        Some(range) if range.trim() == expected => Ok(()),
        Some(range) => Err(Failure::Retry(
            anyhow!(
                "the server sent Content-Range {range:?} for {}, expected {expected:?} (did the file change?)",
                download.label
            ),
            None,
        )),
        None => Err(Failure::Retry(anyhow!("the server sent no Content-Range for {}", download.label), None)),
    }
}

/// Makes the first `done` bytes of `chunk` durable: data first, then the record.
fn checkpoint(file: &FileInProgress, chunk: usize, done: u64) -> Result<()> {
    let download = file.download;
    file.file.sync_data().with_context(|| format!("syncing {}", download.partial.display()))?;
    let mut record = lock(&file.record);
    if done > record.done[chunk] {
        record.done[chunk] = done;
        write_atomically(&download.ranges, &serde_json::to_vec(&*record)?)?;
    }
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A worker that panicked leaves consistent data behind: every update is one store.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(unix)]
fn write_at(file: &File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, bytes, offset)
}

#[cfg(windows)]
fn write_at(file: &File, mut bytes: &[u8], mut offset: u64) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let written = std::os::windows::fs::FileExt::seek_write(file, bytes, offset)?;
        bytes = &bytes[written..];
        offset += written as u64;
    }
    Ok(())
}
