//! Hooks for tests, benchmarks and profiling: what the adapter offers, kernel
//! timings, submission counts, and knobs that reach code paths small test
//! inputs would not.

use std::sync::Arc;

use slotstream_backend::{shape_error, Backend, DeviceMemory, ExpertPool, Result, Tensor};

use crate::gpu::FamilyTime;
use crate::tensors::buf;
use crate::weights::GpuPool;
use crate::{matmul, MatmulMode, WgpuBackend};

impl WgpuBackend {
    /// The backend's name: the adapter, how uploads go, the matmul mode,
    /// the KV cache asked for and the kernels' notes.
    pub(crate) fn describe(&self) -> String {
        let i = &self.gpu.info;
        let (fresh, each) = (!self.options.reuse_staging, self.options.pool_send_every == 0);
        let staging = format!("staging uploads{}{}", if fresh { ", fresh for each pool write" } else { "" }, if each { ", pool writes sent as written" } else { "" });
        let uploads = if self.gpu.mapped_primary { "mapped primary buffers".to_string() } else { staging };
        let mode = match (self.matmul_mode(), self.matmul_choice().coop(&self.gpu)) {
            (MatmulMode::Exact, _) => "",
            (MatmulMode::Int8, coop) => if coop { ", int8 activations for large 4-bit matmuls, prefill products on the matrix units" } else { ", int8 activations for large 4-bit matmuls" },
        };
        let from = self.gpu.kernel_notes();
        let kv = self.options.kv_cache.map_or(String::new(), |_| format!(", {} KV cache", self.kv_cache_type()));
        format!("wgpu ({}, {:?}; {uploads}{mode}{kv}{from})", i.name, i.backend)
    }

    /// Device memory by use, its high-water mark and the pooled scratch's
    /// (`gpu/memory.rs`), with the allocator's blocks where wgpu reports them.
    pub fn memory_report(&self) -> DeviceMemory {
        self.gpu.ledger.report(self.gpu.device.generate_allocator_report())
    }

    /// The int8 form of a one-row `x` exactly as `matvec_q8` reads it, one
    /// `[even bytes, odd bytes, sum bits, scale bits]` entry per 8 columns
    /// (see `wgsl/matvec_q8.wgsl`): lets tests check the quantize kernel
    /// against a host reference.
    pub fn quantized_x8(&self, x: &Tensor) -> Result<Vec<[u32; 4]>> {
        let cols = x.cols();
        if x.rows() != 1 || cols % 32 != 0 {
            return Err(shape_error("quantized_x8", format!("x {:?} (one row of a multiple of 32 columns)", x.shape())));
        }
        let xq = matmul::quantize_x8(&self.gpu, buf(x)?, 1, cols)?;
        let bytes = self.gpu.download(xq.bind(), 2 * cols as u64)?;
        Ok(bytes
            .chunks_exact(16)
            .map(|e| std::array::from_fn(|k| u32::from_le_bytes([e[4 * k], e[4 * k + 1], e[4 * k + 2], e[4 * k + 3]])))
            .collect())
    }

    /// The adapter's type (a software rasterizer reports `Cpu`).
    pub fn device_type(&self) -> wgpu::DeviceType {
        self.gpu.info.device_type
    }

    /// Shards weights and expert pools to at most `bytes` per buffer (instead
    /// of the adapter's binding limit) from now on, and runs the chunked
    /// gated delta rule in windows of at most that many bytes of chunk
    /// records: lets tests exercise sharding and windows with small inputs.
    /// 0 restores the adapter's limit.
    pub fn cap_shard_bytes(&self, bytes: u64) {
        self.gpu.binding_cap.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records no dispatch of the kernels `names` from now on (an empty
    /// list: every kernel again). Their outputs keep whatever they held, so
    /// results are wrong: for benchmarks that measure what each kernel
    /// family costs in the chain of a decoded token (`bench_gpu`'s
    /// `BENCH_GPU_SKIP`), never for output.
    pub fn skip_kernels(&self, names: &[&str]) -> Result<()> {
        self.gpu.skip_kernels(names)
    }

    /// Bytes of one slot's larger matrix in an expert pool of this backend:
    /// with [`WgpuBackend::cap_shard_bytes`], tests size shards in slots.
    pub fn expert_pool_slot_bytes(&self, pool: &ExpertPool) -> Option<usize> {
        pool.get::<GpuPool>().map(GpuPool::largest_slot_matrix)
    }

    /// Submissions that sent staged uploads on (weights and pool writes, a
    /// chunk at a time: see [`WgpuOptions::upload_chunk`](crate::WgpuOptions::upload_chunk)).
    pub fn upload_submissions(&self) -> u64 {
        self.gpu.upload_submissions()
    }

    /// Smallest and largest subgroup size the adapter reports.
    pub fn subgroup_sizes(&self) -> (u32, u32) {
        (self.gpu.subgroup_min, self.gpu.subgroup_max)
    }

    /// Whether kernels take their parameters as immediate data (push
    /// constants) rather than from a uniform buffer.
    pub fn immediates(&self) -> bool {
        self.gpu.immediates
    }

    /// Whether split decode attention merges its splits in its own last
    /// workgroups (one dispatch) rather than in `attention_merge`.
    pub fn merges_in_split(&self) -> bool {
        self.gpu.merge_in_split
    }

    /// Whether kernels hand results between workgroups through device-scope
    /// storage barriers (Vulkan): the merge in split attention, routing over
    /// several workgroups.
    pub fn orders_across_workgroups(&self) -> bool {
        self.gpu.orders_across_workgroups()
    }

    /// Whether uploads into the expert pool map the (unified-memory) buffers
    /// directly instead of going through staging copies.
    pub fn uses_mapped_primary_buffers(&self) -> bool {
        self.gpu.mapped_primary
    }

    /// Starts or stops timing each kernel dispatch (needs timestamp queries).
    /// While on, every submission waits for its timings.
    pub fn set_profiling(&self, on: bool) -> Result<()> {
        self.gpu.set_profiling(on)
    }

    /// Whether profiles time each dispatch inside one compute pass (the
    /// barrier before it included) rather than in a pass of its own.
    pub fn profiles_inside_passes(&self) -> bool {
        self.gpu.time_inside
    }

    /// GPU time by kernel family (the `wgsl/` file) since profiling started.
    pub fn kernel_profile(&self) -> Vec<(String, FamilyTime)> {
        self.gpu.profile()
    }

    /// Submits recorded work after every `n` dispatches (0: only when the
    /// host reads data back or writes the expert pool).
    pub fn set_flush_every(&self, n: u32) {
        self.gpu.flush_every.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Counts command submissions the host asked for (downloads, pool writes,
    /// flushes; not the periodic ones of [`WgpuBackend::set_flush_every`]),
    /// i.e. the round trips; stays valid after the backend is moved into an
    /// engine.
    pub fn submission_counter(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.gpu.submissions.clone()
    }

    /// Counts the calls of `Gpu::download` / `download_many` (one wait each,
    /// however many buffers it reads); stays valid after the backend is moved.
    pub fn download_counter(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.gpu.downloads.clone()
    }

    /// Host seconds spent recording dispatches and submitting them, and the
    /// number of submissions, since the last call (which resets them).
    pub fn take_host_time(&self) -> (f64, f64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let t = &self.gpu.host_time;
        let ns = |a: &std::sync::atomic::AtomicU64| a.swap(0, Relaxed) as f64 * 1e-9;
        (ns(&t.record_ns), ns(&t.submit_ns), t.submits.swap(0, Relaxed))
    }

    /// Activation buffers created since the last call (not reused from the
    /// free list), their bytes, and bind groups created (not cached): what a
    /// first use of each shape costs beside its kernels.
    pub fn take_creations(&self) -> (u64, u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let t = &self.gpu.host_time;
        (t.buffers.swap(0, Relaxed), t.buffer_bytes.swap(0, Relaxed), t.bind_groups.swap(0, Relaxed))
    }

    /// Host seconds the submission thread spent submitting periodic
    /// submissions (off the calling thread) since the last call.
    pub fn take_thread_time(&self) -> f64 {
        self.gpu.host_time.thread_ns.swap(0, std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
    }

    /// Submits recorded work and waits until the GPU is idle.
    pub fn sync(&self) -> Result<()> {
        self.gpu.flush()?;
        self.gpu.wait_for_all()
    }
}
