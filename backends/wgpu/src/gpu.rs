//! The device, its cached pipelines and the lazy command recorder.
//!
//! Every op records one compute pass into a single pending command encoder;
//! nothing reaches the GPU until a submission: a read back to the host
//! (`download_many`), a write into the expert pool, or a periodic flush. A
//! resident decode step is one submission; a streaming one adds one per MoE
//! layer (its routed ids with the next layer's guess). Small per-dispatch
//! parameters go into 256-byte slots of uniform "arena" buffers that are
//! filled with one `write_buffer` per arena just before the submission they
//! belong to.

mod buffers;
mod coop;
mod held;
mod memory;
mod pipelines;
mod profile;
mod readback;
mod record;
mod submit;
mod uploads;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use slotstream_backend::{BackendError, Result};

use crate::kernels::{Module, ParamsLayout};
use crate::options::WgpuOptions;
use crate::params::Params;
pub use buffers::{whole, Bind, GpuBuf};
pub use memory::{Claim, Held, Ledger, Scratch};
use buffers::FreeList;
pub use profile::FamilyTime;
use profile::Timing;
pub use readback::StartedRead;

/// Bytes of one dispatch's parameter slot (the uniform offset alignment).
const PARAM_SLOT: u64 = 256;
/// Parameter slots per arena buffer.
const ARENA_SLOTS: u64 = 256;
/// Workgroups per dispatch dimension guaranteed by WebGPU.
pub const MAX_GROUPS: u32 = 65535;

fn device_error(what: &str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Device(format!("{what}: {e}"))
}

/// Bind groups are reused when a dispatch binds the same buffers at the same
/// parameter slot as an earlier one, which is the common case from one decoded
/// token to the next (pooled buffers recycle in the same order). The cache
/// holds its buffers alive, so it is cleared when it grows past this.
const MAX_CACHED_BIND_GROUPS: usize = 16384;

type BindKey = (&'static str, u64, Vec<(u32, wgpu::Buffer, u64, u64)>);

struct Kernel {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    /// What profiles sum the kernel's time under: its entry point.
    family: &'static str,
    /// The parameter struct its dispatches take (its module's, [`Module::params`]).
    params: ParamsLayout,
}

#[derive(Default)]
struct Pending {
    /// The open compute pass, shared by consecutive dispatches (wgpu inserts
    /// the barriers between them); ended before any copy or submission.
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: Option<wgpu::CommandEncoder>,
    params: Vec<u8>,
    slots_used: u64,
    arenas: Vec<wgpu::Buffer>,
    timing: Option<Timing>,
    /// Dispatches recorded since the last submission.
    since_submit: u32,
    /// A dispatch held back for the next op to take over (`held.rs`).
    held: Option<held::Held>,
    /// Dispatches after which the next periodic submission comes (0: every
    /// `flush_every`); see [`WgpuOptions::flush_first`].
    flush_at: u32,
    /// Small per-call storage inputs (token ids, expert assignments, routing
    /// weights, rope tables): entry i of the ring serves the i-th such input
    /// of a submission and is written with the submission's parameters, so
    /// steady-state decoding creates no buffers (and reuses bind groups).
    ring: Vec<wgpu::Buffer>,
    ring_data: Vec<Vec<u8>>,
    /// The ring entry holding each distinct input of this submission.
    ring_index: HashMap<Vec<u8>, usize>,
    /// Kernels whose dispatches are not recorded ([`crate::WgpuBackend::skip_kernels`]).
    skipped: Vec<String>,
}

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// Whether `slice_cols` of one row may return a view instead of a copy
    /// ([`WgpuOptions::views`]).
    pub views: bool,
    /// Decode attention's smallest key chunk ([`WgpuOptions::attention_min_chunk`]).
    pub attention_min_chunk: usize,
    /// [`WgpuOptions::attention_regs`].
    pub attention_regs: bool,
    /// [`WgpuOptions::flash_attention`].
    pub flash_attention: bool,
    /// [`WgpuOptions::flash_workgroups`].
    pub flash_workgroups: usize,
    /// [`WgpuOptions::flash_two_rows`].
    pub flash_two_rows: bool,
    /// The matrix-unit products (`wgsl/matmul_coop.wgsl`) are compiled
    /// ([`WgpuOptions::coop_matrix`] and an adapter that has them).
    pub coop_matrix: bool,
    /// Why the driver refused to compile them, where it did (the backend's
    /// name says so; the products then take `matmul_wide`).
    pub coop_refused: Option<String>,
    /// Split attention merges its splits in its last workgroup per pair
    /// ([`WgpuOptions::merge_in_split`], Vulkan only), with these counts
    /// (`merge_counts` in `wgsl/attention.wgsl`, zero between dispatches;
    /// word 0 also counts `moe_route_norm_wide`'s workgroups).
    pub merge_in_split: bool,
    pub merge_counts: wgpu::Buffer,
    /// Most subgroups sharing a one-token matvec's quad of rows ([`WgpuOptions::matvec_split`]).
    pub matvec_split: usize,
    /// `WgpuOptions::matvec_q4_tokens`.
    pub matvec_q4_tokens: bool,
    /// Routing of at most a subgroup's width of experts in one subgroup ([`WgpuOptions::route_lanes`]).
    pub route_lanes: bool,
    /// Largest subgroup the adapter may run: dispatch sizes assume it so that
    /// one subgroup per row never leaves rows unassigned.
    pub subgroup_max: u32,
    pub subgroup_min: u32,
    pub mapped_primary: bool,
    /// Whether kernels take their parameters as immediate data
    /// ([`WgpuOptions::immediates`]) rather than from the uniform arena.
    pub immediates: bool,
    /// Where some kernel files were read from instead of the built-in ones.
    pub kernels_from: Option<std::path::PathBuf>,
    kernels: HashMap<&'static str, Kernel>,
    /// Host-readable buffer reused by every download (grown as needed).
    staging: Mutex<Option<wgpu::Buffer>>,
    /// Small host-readable buffers of started reads ([`Gpu::start_download`]), for reuse.
    small_staging: Mutex<Vec<wgpu::Buffer>>,
    bind_groups: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    pending: Mutex<Pending>,
    free: FreeList,
    /// Device memory by use and its high-water mark ([`memory`]).
    pub ledger: Arc<Ledger>,
    error: Arc<Mutex<Option<String>>>,
    profile: Mutex<Option<HashMap<&'static str, FamilyTime>>>,
    can_time: bool,
    /// Profiles time dispatches inside one pass ([`WgpuOptions::time_inside_passes`]).
    pub time_inside: bool,
    /// Submissions the host asked for (downloads, pool writes, flushes); the
    /// periodic ones of `flush_every` are not counted.
    pub submissions: Arc<std::sync::atomic::AtomicU64>,
    /// Waits for all submitted work to read data back ([`Gpu::download_many`]).
    pub downloads: Arc<std::sync::atomic::AtomicU64>,
    /// A smaller binding size to shard to than the adapter allows (0: none),
    /// so tests can exercise sharding with small weights.
    pub binding_cap: std::sync::atomic::AtomicU64,
    /// Submit recorded work after this many dispatches (0: only when the host
    /// needs data back), so the GPU starts on a layer while the host is still
    /// recording it. [`WgpuOptions::flush_every`] sets the initial value.
    pub flush_every: std::sync::atomic::AtomicU32,
    /// [`WgpuOptions::flush_first`].
    flush_first: u32,
    /// Started reads not finished or dropped yet ([`Gpu::start_download`]).
    started_reads: Arc<std::sync::atomic::AtomicU32>,
    /// Whether the GPU may still run work submitted before a started read:
    /// set when a read starts, cleared by any wait for all work. Periodic
    /// submissions wait while this holds and a read is outstanding (the GPU
    /// has the token before; a layer that waited for its routed experts has
    /// drained it), unless `flush_ahead`.
    queued_ahead: std::sync::atomic::AtomicBool,
    flush_ahead: bool,
    /// Host time spent recording dispatches and submitting them (ns), for
    /// benchmarks: whether a token is bound by the host or by the GPU.
    pub host_time: HostTime,
    /// The thread that ends, finishes and submits periodic submissions
    /// ([`WgpuOptions::submit_thread`]); `None`: the recording thread does.
    submitter: Option<submit::Submitter>,
    /// Bytes staged for upload since the last upload submission ([`uploads`]).
    uploads: Mutex<uploads::Uploads>,
    /// [`WgpuOptions::upload_chunk`].
    upload_chunk: u64,
    /// [`WgpuOptions::reuse_staging`].
    reuse_staging: bool,
    /// [`WgpuOptions::pool_send_every`].
    pool_send_every: u64,
    /// [`WgpuOptions::pool_write_part`].
    pub(crate) pool_write_part: usize,
}

/// Nanoseconds the host spent in [`Gpu::dispatch`] (recording) and in
/// `queue.submit` with its parameter uploads (submitting).
#[derive(Default)]
pub struct HostTime {
    pub record_ns: std::sync::atomic::AtomicU64,
    pub submit_ns: std::sync::atomic::AtomicU64,
    pub submits: std::sync::atomic::AtomicU64,
    /// Time the submission thread spent on periodic submissions (off the
    /// recording thread).
    pub thread_ns: Arc<std::sync::atomic::AtomicU64>,
    /// Activation buffers created (not reused from the free list), their
    /// bytes, and bind groups created (not found in the cache).
    pub buffers: std::sync::atomic::AtomicU64,
    pub buffer_bytes: std::sync::atomic::AtomicU64,
    pub bind_groups: std::sync::atomic::AtomicU64,
}

impl Gpu {
    /// Opens a device on `adapter` and compiles every kernel (with wgpu's
    /// bounds checks unless `bounds_checks` is false).
    pub fn open(adapter: wgpu::Adapter, options: &WgpuOptions, bounds_checks: bool) -> Result<Gpu> {
        let info = adapter.get_info();
        let limits = adapter.limits();
        let features = adapter.features();
        let unified = matches!(info.device_type, wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu);
        let mapped_primary = unified && options.map_primary && features.contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
        let can_time = features.contains(wgpu::Features::TIMESTAMP_QUERY);
        let time_inside = can_time && options.time_inside_passes && features.contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);
        // Immediate data on Vulkan only for now: the Metal path keeps the
        // uniform arena until it has been measured on a Mac.
        let largest_params = Module::ALL.iter().map(|m| m.params().bytes).max().unwrap_or(0);
        let immediates = options.immediates
            && info.backend == wgpu::Backend::Vulkan
            && features.contains(wgpu::Features::IMMEDIATES)
            && largest_params as u64 <= limits.max_immediate_size as u64;
        let mut wanted = wgpu::Features::SUBGROUP;
        if immediates {
            wanted |= wgpu::Features::IMMEDIATES;
        }
        if mapped_primary {
            wanted |= wgpu::Features::MAPPABLE_PRIMARY_BUFFERS;
        }
        if can_time {
            wanted |= wgpu::Features::TIMESTAMP_QUERY;
        }
        if time_inside {
            wanted |= wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        }
        let coop_matrix = options.coop_matrix && coop::usable(&adapter, &info, &limits);
        if coop_matrix {
            wanted |= coop::FEATURES;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("slotstream"),
            required_features: wanted,
            required_limits: limits.clone(),
            // SAFETY: cooperative matrices are wgpu's one experimental feature
            // used, and only by matmul_coop.wgsl's three kernels, whose outputs
            // the device checks compare with matmul_wide's (BENCHMARKS.md).
            experimental_features: match coop_matrix {
                true => unsafe { wgpu::ExperimentalFeatures::enabled() },
                false => wgpu::ExperimentalFeatures::disabled(),
            },
            // Blocks of 8-64 MiB (Performance's 128-256 may leave a block unused per memory type).
            memory_hints: wgpu::MemoryHints::MemoryUsage,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| device_error(&format!("opening a device on {}", info.name), e))?;
        let error: Arc<Mutex<Option<String>>> = Arc::default();
        let sink = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut slot) = sink.lock() {
                slot.get_or_insert_with(|| e.to_string());
            }
        }));
        // Entry points of 1024 invocations (`*_1024`), for adapters that allow
        // them in subgroups of 8 or more (their workgroup memory has a slot
        // per subgroup for 128).
        let wide_workgroups = limits.max_compute_invocations_per_workgroup >= 1024
            && limits.max_compute_workgroup_size_x >= 1024
            && info.subgroup_min_size >= 8;
        let (kernels, kernels_from, coop_refused) = pipelines::compile(&device, options, immediates, bounds_checks, wide_workgroups, coop_matrix)?;
        let coop_matrix = coop_matrix && coop_refused.is_none();
        let (subgroup_min, subgroup_max) = (info.subgroup_min_size.max(1), info.subgroup_max_size.max(1));
        let host_time = HostTime::default();
        let merge_in_split = options.merge_in_split && orders_across_workgroups(info.backend);
        let merge_counts = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("attention merge counts"),
            size: 4 * crate::params::MERGE_PAIRS as u64,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let submitter = match options.submit_thread {
            true => Some(submit::Submitter::start(queue.clone(), host_time.thread_ns.clone())?),
            false => None,
        };
        let gpu = Gpu {
            device,
            queue,
            info,
            limits,
            views: options.views,
            attention_min_chunk: options.attention_min_chunk,
            attention_regs: options.attention_regs,
            flash_attention: options.flash_attention,
            flash_workgroups: options.flash_workgroups,
            flash_two_rows: options.flash_two_rows,
            coop_matrix,
            coop_refused,
            merge_in_split,
            merge_counts,
            matvec_split: options.matvec_split,
            matvec_q4_tokens: options.matvec_q4_tokens,
            route_lanes: options.route_lanes,
            subgroup_max,
            subgroup_min,
            mapped_primary,
            immediates,
            kernels_from,
            kernels,
            staging: Mutex::default(),
            small_staging: Mutex::default(),
            bind_groups: Mutex::default(),
            pending: Mutex::default(),
            free: Arc::default(),
            ledger: Arc::default(),
            error,
            profile: Mutex::new(None),
            can_time,
            time_inside,
            submissions: Arc::default(),
            downloads: Arc::default(),
            binding_cap: std::sync::atomic::AtomicU64::new(0),
            flush_every: std::sync::atomic::AtomicU32::new(options.flush_every),
            flush_first: options.flush_first,
            started_reads: Arc::default(),
            queued_ahead: std::sync::atomic::AtomicBool::new(false),
            flush_ahead: options.flush_ahead,
            host_time,
            submitter,
            uploads: Default::default(),
            upload_chunk: options.upload_chunk.max(1),
            reuse_staging: options.reuse_staging,
            pool_send_every: options.pool_send_every,
            pool_write_part: options.pool_write_part,
        };
        gpu.check_errors("compiling the WGSL kernels")?;
        Ok(gpu)
    }

    fn check_errors(&self, during: &str) -> Result<()> {
        let mut slot = self.error.lock().map_err(|_| BackendError::Device("error slot poisoned".into()))?;
        match slot.take() {
            Some(e) => Err(BackendError::Device(format!("wgpu reported an error while {during}: {e}"))),
            None => Ok(()),
        }
    }

    fn pending(&self) -> Result<std::sync::MutexGuard<'_, Pending>> {
        self.pending.lock().map_err(|_| BackendError::Device("the command recorder was poisoned by a panic".into()))
    }

    /// Largest storage buffer binding, the size weights and pools are sharded to.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    /// Largest weight or pool shard: the binding limit, or the test cap.
    pub fn max_shard(&self) -> u64 {
        match self.binding_cap.load(std::sync::atomic::Ordering::Relaxed) {
            0 => self.max_binding(),
            cap => cap.min(self.max_binding()),
        }
    }

    fn encoder<'a>(&self, p: &'a mut Pending) -> &'a mut wgpu::CommandEncoder {
        p.pass = None;
        p.encoder.get_or_insert_with(|| {
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("ops") })
        })
    }

    /// Records a buffer-to-buffer copy in op order.
    pub fn copy(&self, src: &wgpu::Buffer, src_off: u64, dst: &wgpu::Buffer, dst_off: u64, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let mut p = self.pending()?;
        self.release_held(&mut p)?;
        self.encoder(&mut p).copy_buffer_to_buffer(src, src_off, dst, dst_off, bytes);
        Ok(())
    }

    /// Records zero-filling a buffer in op order.
    pub fn clear(&self, dst: &wgpu::Buffer) -> Result<()> {
        let mut p = self.pending()?;
        self.release_held(&mut p)?;
        self.encoder(&mut p).clear_buffer(dst, 0, None);
        Ok(())
    }

    /// Records one dispatch of `entry` with `params` (its module's parameter
    /// struct) at binding 0 and `binds` (binding index, buffer) as the rest.
    /// Only the typed kernel calls of the family modules call this.
    pub(crate) fn dispatch<P: Params>(&self, entry: &str, params: &P, binds: &[(u32, Bind<'_>)], groups: [u32; 3]) -> Result<()> {
        let start = std::time::Instant::now();
        let flush = self.record(entry, params, binds, groups)?;
        self.host_time.record_ns.fetch_add(start.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        if flush {
            return self.submit_periodic();
        }
        Ok(())
    }

    /// [`orders_across_workgroups`] of this adapter's backend.
    pub fn orders_across_workgroups(&self) -> bool {
        orders_across_workgroups(self.info.backend)
    }

    /// Whether the adapter runs the kernel `entry` (the `*_1024` ones need
    /// workgroups that large).
    /// What the backend's name says of the kernels: files read from a
    /// directory, the matrix-unit kernels refused by the driver.
    pub fn kernel_notes(&self) -> String {
        let from = self.kernels_from.as_ref().map_or(String::new(), |d| format!("; kernels from {}", d.display()));
        from + &self.coop_refused.as_ref().map_or(String::new(), |e| format!("; the driver refused the matrix-unit kernels: {e}"))
    }

    pub fn has_kernel(&self, entry: &str) -> bool {
        self.kernels.contains_key(entry)
    }

    /// Workgroups for kernels that give each of `items` one subgroup, in
    /// workgroups of `wg` invocations.
    pub fn subgroup_grid(&self, items: usize, wg: u32) -> u32 {
        let per_wg = (wg / self.subgroup_max).max(1) as usize;
        items.div_ceil(per_wg).clamp(1, MAX_GROUPS as usize) as u32
    }

    /// Subgroups that share one row group of a one-token product whose rows
    /// hold `chunks` 16-byte chunks: enough for each lane to take about one
    /// chunk, at most [`WgpuOptions::matvec_split`](crate::WgpuOptions::matvec_split).
    pub fn row_parts(&self, chunks: usize) -> usize {
        self.matvec_split.min(chunks.div_ceil(self.subgroup_max as usize)).max(1)
    }

    /// A 1-D dispatch of `n` workgroups, folded into two dimensions when needed.
    pub fn grid(n: u64) -> [u32; 3] {
        let max = MAX_GROUPS as u64;
        if n <= max {
            [n as u32, 1, 1]
        } else {
            [MAX_GROUPS, n.div_ceil(max) as u32, 1]
        }
    }

    /// Submits everything recorded so far (after `extra`, which may add copies),
    /// and returns the submission.
    fn submit_with(&self, extra: impl FnOnce(&mut wgpu::CommandEncoder)) -> Result<wgpu::SubmissionIndex> {
        self.submit_inner(Some(extra))?.ok_or_else(|| BackendError::Device("a counted submission went to the submission thread".into()))
    }

    /// A periodic submission (`flush_every`).
    fn submit_periodic(&self) -> Result<()> {
        self.submit_inner(None::<fn(&mut wgpu::CommandEncoder)>).map(drop)
    }

    /// `asked`: a submission the host asked for (a download, a pool write, a
    /// flush), counted in `submissions`, with `extra` commands after the
    /// recorded ones; `None`: one of the periodic submissions `flush_every`
    /// adds, which the submission thread takes where there is one (timed
    /// work is submitted here, where its timestamps are read back). Returns
    /// the submission when it was made here.
    fn submit_inner(&self, asked: Option<impl FnOnce(&mut wgpu::CommandEncoder)>) -> Result<Option<wgpu::SubmissionIndex>> {
        let start = std::time::Instant::now();
        let mut guard = self.pending()?;
        let p = &mut *guard;
        self.release_held(p)?;
        let counted = asked.is_some();
        let thread = self.submitter.as_ref().filter(|_| !counted && p.timing.is_none());
        if thread.is_none() {
            // Submissions handed to the thread go first (the lock keeps new ones out).
            self.wait_submitted()?;
        }
        let pass = p.pass.take();
        let mut encoder = p.encoder.take().unwrap_or_else(|| {
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("ops") })
        });
        let writes = self.take_writes(p);
        p.since_submit = 0;
        // A submission the host asked for ends a token (or a pool write):
        // the next ones start small and double, so the GPU starts early.
        p.flush_at = if counted { self.flush_first } else { p.flush_at.saturating_mul(2) };
        let timing = p.timing.take();
        let index = match thread {
            Some(submitter) => {
                submitter.send(submit::Job { pass, encoder, writes })?;
                None
            }
            None => {
                drop(pass);
                if let Some(extra) = asked {
                    extra(&mut encoder);
                }
                for (buffer, data) in writes {
                    self.queue.write_buffer(&buffer, 0, &data);
                }
                let staging = timing.as_ref().and_then(|t| t.resolve(&self.device, &mut encoder));
                let index = self.queue.submit([encoder.finish()]);
                if let (Some(t), Some(staging)) = (&timing, staging) {
                    self.record_timings(t, &staging)?;
                }
                Some(index)
            }
        };
        self.host_time.submit_ns.fetch_add(start.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        self.host_time.submits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if counted {
            self.submissions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(t) = timing {
            p.timing = Some(t.restart());
        }
        self.check_errors("running kernels")?;
        Ok(index)
    }

    /// The queue writes a submission needs before its commands: the used
    /// slots of the parameter arenas and the ring's inputs (both reset for
    /// the next submission).
    fn take_writes(&self, p: &mut Pending) -> Vec<(wgpu::Buffer, Vec<u8>)> {
        let mut writes = Vec::new();
        let used = p.slots_used;
        for (i, arena) in p.arenas.iter().enumerate() {
            let first = i as u64 * ARENA_SLOTS;
            if first >= used {
                break;
            }
            let end = (used.min(first + ARENA_SLOTS) * PARAM_SLOT) as usize;
            writes.push((arena.clone(), p.params[(first * PARAM_SLOT) as usize..end].to_vec()));
        }
        p.slots_used = 0;
        p.params.clear();
        writes.extend(p.ring.iter().cloned().zip(p.ring_data.drain(..)));
        p.ring_index.clear();
        writes
    }

    /// Waits until the submission thread has submitted everything handed to it.
    pub(crate) fn wait_submitted(&self) -> Result<()> {
        self.submitter.as_ref().map_or(Ok(()), |s| s.wait())
    }

    /// Submits all recorded work without waiting for it.
    pub fn flush(&self) -> Result<()> {
        {
            let p = self.pending()?;
            if p.encoder.is_none() && p.held.is_none() {
                // Nothing recorded; what the submission thread holds is submitted
                // before any queue write or wait that follows.
                self.wait_submitted()?;
                drop(p);
                return self.check_errors("running kernels");
            }
        }
        self.submit_with(|_| {}).map(drop)
    }

    /// Copies `bytes` bytes of `src` back to the host: submits all recorded
    /// work and waits for it (the one kind of GPU-to-CPU sync).
    pub fn download(&self, src: Bind<'_>, bytes: u64) -> Result<Vec<u8>> {
        Ok(self.download_many(&[(src, bytes)])?.into_iter().next().unwrap_or_default())
    }

    /// Waits until the GPU has run all submitted work.
    pub(crate) fn wait_for_all(&self) -> Result<()> {
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| device_error("waiting for the GPU", e))?;
        self.queued_ahead.store(false, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// Whether kernels on `backend` may hand results from one workgroup to
/// another through storage barriers (device scope as naga emits them for
/// Vulkan; Metal's threadgroup barrier does not promise it): the merge in
/// split attention and routing over several workgroups rest on it.
fn orders_across_workgroups(backend: wgpu::Backend) -> bool {
    backend == wgpu::Backend::Vulkan
}
