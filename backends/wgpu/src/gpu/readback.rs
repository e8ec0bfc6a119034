//! Reads back to the host: several buffers in one round trip, and reads
//! that start with one submission and finish later (the host records and
//! submits more work in between, and the wait covers only the work
//! submitted up to the read: a decode step's chosen token, read while the
//! next step runs).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use slotstream_backend::{BackendError, Result};

use super::{device_error, Bind, Gpu, Held};

/// Largest started read; larger ones take [`Gpu::download`].
pub const MAX_STARTED_READ: u64 = 1 << 16;

/// A copy to host-readable memory, submitted and not read yet.
pub struct StartedRead {
    staging: wgpu::Buffer,
    bytes: u64,
    index: wgpu::SubmissionIndex,
    _outstanding: Outstanding,
}

/// Counts a started read in [`Gpu`]'s `started_reads` until it is finished
/// or dropped.
struct Outstanding(Arc<AtomicU32>);

impl Outstanding {
    fn new(count: &Arc<AtomicU32>) -> Outstanding {
        count.fetch_add(1, Ordering::Relaxed);
        Outstanding(count.clone())
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Gpu {
    /// Copies each `(src, bytes)` back to the host with one submission of
    /// all recorded work and one wait for it (what [`Gpu::download`] does
    /// for one).
    pub fn download_many(&self, srcs: &[(Bind<'_>, u64)]) -> Result<Vec<Vec<u8>>> {
        if srcs.is_empty() {
            return Ok(Vec::new());
        }
        // Copies start and end on 4-byte boundaries.
        let sizes: Vec<u64> = srcs.iter().map(|&(_, bytes)| bytes.max(4).div_ceil(4) * 4).collect();
        let total: u64 = sizes.iter().sum();
        let mut slot = self.staging.lock().map_err(|_| BackendError::Device("staging buffer poisoned".into()))?;
        if slot.as_ref().is_none_or(|b| b.size() < total) {
            let old = slot.as_ref().map_or(0, |b| b.size());
            let size = total.max(1 << 20);
            *slot = Some(self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("download"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
            self.ledger.sub(Held::Readback, old);
            self.ledger.add(Held::Readback, size);
        }
        let Some(staging) = slot.as_ref() else {
            return Err(BackendError::Device("no staging buffer".into()));
        };
        self.submit_with(|enc| {
            let mut at = 0;
            for (&(src, _), &size) in srcs.iter().zip(&sizes) {
                enc.copy_buffer_to_buffer(src.buffer, src.offset, staging, at, size);
                at += size;
            }
        })?;
        let all = self.read_range(staging, total)?;
        self.downloads.fetch_add(1, Ordering::Relaxed);
        let mut at = 0;
        let mut out = Vec::with_capacity(srcs.len());
        for (&(_, bytes), &size) in srcs.iter().zip(&sizes) {
            out.push(all[at as usize..(at + bytes) as usize].to_vec());
            at += size;
        }
        Ok(out)
    }

    /// Copies `bytes` bytes of `src` (at most [`MAX_STARTED_READ`]) after all
    /// work recorded so far, and submits it without waiting.
    pub fn start_download(&self, src: Bind<'_>, bytes: u64) -> Result<StartedRead> {
        if bytes > MAX_STARTED_READ {
            return Err(BackendError::Device(format!("a started read of {bytes} bytes (at most {MAX_STARTED_READ})")));
        }
        let size = bytes.max(4).div_ceil(4) * 4;
        let reused = self.small_staging.lock().map_err(|_| BackendError::Device("staging buffers poisoned".into()))?.pop();
        let staging = reused.unwrap_or_else(|| {
            self.ledger.add(Held::Readback, MAX_STARTED_READ);
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("started read"),
                size: MAX_STARTED_READ,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        let index = self.submit_with(|enc| enc.copy_buffer_to_buffer(src.buffer, src.offset, &staging, 0, size))?;
        self.queued_ahead.store(true, Ordering::Relaxed);
        Ok(StartedRead { staging, bytes, index, _outstanding: Outstanding::new(&self.started_reads) })
    }

    /// Waits for the submission of a started read (not for work submitted
    /// after it) and returns its bytes.
    pub fn finish_download(&self, read: StartedRead) -> Result<Vec<u8>> {
        let StartedRead { staging, bytes, index, _outstanding } = read;
        let size = bytes.max(4).div_ceil(4) * 4;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..size).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let wait = wgpu::PollType::Wait { submission_index: Some(index), timeout: None };
        self.device.poll(wait).map_err(|e| device_error("waiting for the GPU", e))?;
        rx.recv()
            .map_err(|e| device_error("reading a buffer back", e))?
            .map_err(|e| device_error("mapping a buffer for reading", e))?;
        let mut data = staging.slice(..size).get_mapped_range().map_err(|e| device_error("reading a mapped buffer", e))?.to_vec();
        staging.unmap();
        data.truncate(bytes as usize);
        if let Ok(mut free) = self.small_staging.lock() {
            free.push(staging);
        }
        self.check_errors("running kernels")?;
        Ok(data)
    }

    pub(super) fn read_back(&self, staging: &wgpu::Buffer) -> Result<Vec<u8>> {
        self.read_range(staging, staging.size())
    }

    /// Waits for the GPU and reads the first `size` bytes of a MAP_READ buffer.
    pub(super) fn read_range(&self, staging: &wgpu::Buffer, size: u64) -> Result<Vec<u8>> {
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..size).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait_for_all()?;
        rx.recv()
            .map_err(|e| device_error("reading a buffer back", e))?
            .map_err(|e| device_error("mapping a buffer for reading", e))?;
        let data = staging.slice(..size).get_mapped_range().map_err(|e| device_error("reading a mapped buffer", e))?.to_vec();
        staging.unmap();
        Ok(data)
    }
}
