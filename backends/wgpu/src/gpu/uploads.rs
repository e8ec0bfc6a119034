//! Uploads through the queue go out in chunks. `queue.write_buffer` and
//! buffers written at creation stage their bytes in host memory until the
//! next submission; loading a model records no dispatch, so without this
//! every weight of the model would wait in staging for the first prompt,
//! whose submission then copied them all (and freed the staging) before its
//! first kernel. Each [`crate::WgpuOptions::upload_chunk`] bytes (256 MiB
//! by default) now go out in a submission of their own, after the chunk
//! before has landed: the GPU copies one chunk while the host reads the
//! next from disk, and staging holds at most two.
//! An expert (or, streamed, each of its matrices as it lands) written to
//! the pool goes through staging memory reused from one write to the next
//! (a [`wgpu::util::StagingBelt`]) instead of the queue's, which allocates
//! staging anew for each write (nine per expert); on an H200, side by side
//! on one host, streamed decode per GB/s of the disk's rate was the same
//! (1.229 against 1.231) and writes took 128 against 118 ms per token: no
//! gain shown (BENCHMARKS.md, "a streamed expert written as it lands").
//! The copies wait in it until 4 MiB are staged or the pool's table is
//! next mapped (just before the layer's MoE), and go out in one submission:
//! about 4 per streamed layer of A's trunk, instead of one per matrix as it
//! lands (about 860 a token, 30-40 ms a token more host time for the same
//! decode) or one per layer (the GPU then copied the whole layer's experts
//! after the last landed, ~9 ms a token more between two layers' reads;
//! BENCHMARKS.md, "a layer's pool writes in one submission" and "pool
//! writes every 4 MiB").

use slotstream_backend::{BackendError, Result};

use super::{device_error, Gpu, Held};

/// Size of each buffer of the staging reused for pool writes (a larger
/// write gets a buffer of its own size).
const POOL_STAGING_BUFFER: u64 = 8 << 20;

/// Bytes staged and not yet sent, bytes sent since an upload was last
/// waited for, and the last upload submission.
#[derive(Default)]
pub(super) struct Uploads {
    staged: u64,
    unsettled: u64,
    last: Option<wgpu::SubmissionIndex>,
    /// Upload submissions so far (for tests).
    pub(super) submissions: u64,
    /// Staging reused for pool writes, and the copies out of it recorded
    /// since the last send. Dropped after each wait for earlier uploads, so
    /// a bulk load keeps no more of it than a chunk or two.
    belt: Option<wgpu::util::StagingBelt>,
    copies: Option<wgpu::CommandEncoder>,
}

/// Staged and unsettled upload bytes below which [`Gpu::settle_uploads`] does not wait.
const SETTLE_MIN_BYTES: u64 = 32 << 20;

impl Gpu {
    /// Notes `bytes` staged for upload; a whole chunk goes out now (after
    /// the chunk before it has landed).
    pub(crate) fn staged(&self, bytes: u64) -> Result<()> {
        let mut u = self.uploads.lock().map_err(|_| BackendError::Device("upload counter poisoned".into()))?;
        u.staged += bytes;
        self.ledger.set(Held::UploadStaging, u.staged + u.unsettled);
        if u.staged < self.upload_chunk {
            return Ok(());
        }
        self.send(&mut u, true)
    }

    /// Sends what is staged and waits until every upload has landed, so
    /// that wgpu frees its staging (host-visible memory, which on a
    /// discrete GPU with a large BAR is device memory): before a KV cache
    /// grows, the load's last chunk (up to `upload_chunk` bytes) would
    /// otherwise stay beside the cache and a prefill's first activations.
    /// Less than `SETTLE_MIN_BYTES` in flight (a decode step's streamed
    /// experts) is left to land on its own: a wait there would hold the
    /// step's reads behind its compute.
    pub(crate) fn settle_uploads(&self) -> Result<()> {
        let mut u = self.uploads.lock().map_err(|_| BackendError::Device("upload counter poisoned".into()))?;
        if u.staged + u.unsettled < SETTLE_MIN_BYTES {
            return Ok(());
        }
        self.send(&mut u, true)?;
        if let Some(index) = u.last.take() {
            let wait = wgpu::PollType::Wait { submission_index: Some(index), timeout: None };
            self.device.poll(wait).map_err(|e| device_error("waiting for an upload", e))?;
        }
        u.unsettled = 0;
        self.ledger.set(Held::UploadStaging, 0);
        Ok(())
    }

    /// Sends what is staged when `due` says so, after the last upload has
    /// landed once a chunk's worth has gone out unwaited (a wait could also
    /// wait for the compute queued before that upload: a streamed prefill's
    /// previous batch, so it is not made for less).
    fn send_if(&self, due: impl FnOnce(&Uploads) -> bool) -> Result<()> {
        let mut u = self.uploads.lock().map_err(|_| BackendError::Device("upload counter poisoned".into()))?;
        if !due(&u) {
            return Ok(());
        }
        let settle = u.unsettled + u.staged >= self.upload_chunk;
        self.send(&mut u, settle)
    }

    /// Submits the staged bytes, after the last upload has landed when
    /// `settle` (so staging holds at most about two chunks).
    fn send(&self, u: &mut Uploads, settle: bool) -> Result<()> {
        // As every queue operation: after what the submission thread holds.
        self.wait_submitted()?;
        if settle {
            if let Some(index) = u.last.take() {
                let wait = wgpu::PollType::Wait { submission_index: Some(index), timeout: None };
                self.device.poll(wait).map_err(|e| device_error("waiting for an upload", e))?;
            }
            u.unsettled = 0;
        }
        let copies = u.copies.take().map(|encoder| {
            if let Some(belt) = u.belt.as_mut() {
                // Its buffers unmapped, ready to be copied from.
                belt.finish();
            }
            encoder.finish()
        });
        u.last = Some(self.queue.submit(copies));
        if settle {
            // Its buffers still being copied from are freed once they are.
            u.belt = None;
        } else if let Some(belt) = u.belt.as_mut() {
            // Each buffer comes back once the GPU has copied out of it.
            belt.recall();
        }
        u.unsettled += u.staged;
        u.staged = 0;
        u.submissions += 1;
        self.ledger.set(Held::UploadStaging, u.unsettled);
        Ok(())
    }

    /// After an expert or one of its matrices was written to the pool:
    /// leaves the copies staged for [`Gpu::send_pool_writes`], which mapping
    /// the pool's table makes, until
    /// [`WgpuOptions::pool_send_every`](crate::WgpuOptions) bytes or a
    /// chunk's worth are staged (so staging stays bounded whatever a layer
    /// misses); with `pool_send_every` 0, sends them at once.
    pub(crate) fn pool_written(&self) -> Result<()> {
        self.send_if(|u| u.staged > 0 && u.staged >= self.upload_chunk.min(self.pool_send_every))
    }

    /// Sends the pool writes' copies left staged, if any (the queue's own
    /// writes go out with any submission).
    pub(crate) fn send_pool_writes(&self) -> Result<()> {
        self.send_if(|u| u.copies.is_some())
    }

    /// Upload submissions so far.
    pub fn upload_submissions(&self) -> u64 {
        self.uploads.lock().map(|u| u.submissions).unwrap_or(0)
    }

    /// [`Gpu::write_with`] for an expert pool's slots: through staging
    /// memory reused from one write to the next, copied out by the next
    /// send ([`Gpu::pool_written`], [`Gpu::send_pool_writes`]), which the caller must make before anything else
    /// reads `dst`.
    pub fn write_pool(&self, dst: &wgpu::Buffer, offset: u64, len: usize, fill: impl FnOnce(&mut wgpu::WriteOnly<'_, [u8]>)) -> Result<()> {
        let Some(size) = wgpu::BufferSize::new(len as u64) else {
            return Ok(());
        };
        let aligned = offset % wgpu::COPY_BUFFER_ALIGNMENT == 0 && size.get() % wgpu::COPY_BUFFER_ALIGNMENT == 0;
        if self.mapped_primary || !self.reuse_staging || !aligned || offset + size.get() > dst.size() {
            // The queue's write checks what the staging belt would assert.
            return self.write_with(dst, offset, len, fill);
        }
        self.flush()?;
        let mut guard = self.uploads.lock().map_err(|_| BackendError::Device("upload counter poisoned".into()))?;
        let u = &mut *guard;
        let belt = u.belt.get_or_insert_with(|| wgpu::util::StagingBelt::new(self.device.clone(), POOL_STAGING_BUFFER));
        let encoder = u.copies.get_or_insert_with(|| self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("pool writes") }));
        let mut view = belt.write_buffer(encoder, dst, offset, size);
        fill(&mut view.slice(..));
        drop(view);
        u.staged += len as u64;
        self.ledger.set(Held::UploadStaging, u.staged + u.unsettled);
        Ok(())
    }

    /// Writes `len` bytes at `offset` of `dst` that `fill` puts in place,
    /// after all recorded work (records are submitted first, because queue
    /// writes land before the next submission's commands): in the mapped
    /// (unified-memory) buffer, or in the queue's staging for it.
    pub fn write_with(&self, dst: &wgpu::Buffer, offset: u64, len: usize, fill: impl FnOnce(&mut wgpu::WriteOnly<'_, [u8]>)) -> Result<()> {
        let Some(size) = wgpu::BufferSize::new(len as u64) else {
            return Ok(());
        };
        self.flush()?;
        if self.mapped_primary {
            let start = offset / wgpu::MAP_ALIGNMENT * wgpu::MAP_ALIGNMENT;
            let end = (offset + len as u64).div_ceil(wgpu::MAP_ALIGNMENT) * wgpu::MAP_ALIGNMENT;
            let end = end.min(dst.size());
            let slice = dst.slice(start..end);
            let (tx, rx) = std::sync::mpsc::channel();
            slice.map_async(wgpu::MapMode::Write, move |r| {
                let _ = tx.send(r);
            });
            self.wait_for_all()?;
            rx.recv()
                .map_err(|e| device_error("mapping a buffer for writing", e))?
                .map_err(|e| device_error("mapping a buffer for writing", e))?;
            {
                let mut view = slice.get_mapped_range_mut().map_err(|e| device_error("writing a mapped buffer", e))?;
                let at = (offset - start) as usize;
                fill(&mut view.slice(at..at + len));
            }
            dst.unmap();
        } else {
            let mut view = self
                .queue
                .write_buffer_with(dst, offset, size)
                .ok_or_else(|| BackendError::Device(format!("writing {len} bytes at {offset} of a {} byte buffer", dst.size())))?;
            fill(&mut view.slice(..));
            drop(view);
            self.staged(len as u64)?;
        }
        Ok(())
    }
}
