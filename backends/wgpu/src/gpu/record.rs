//! Recording one dispatch into the pending command encoder: its bind group
//! (cached), its compute pass, its parameters (a uniform arena slot or
//! immediate data), and when the recorded work is due for a submission.

use std::num::NonZeroU64;

use slotstream_backend::{BackendError, Result};

use super::{Bind, BindKey, Gpu, Kernel, Pending, ARENA_SLOTS, MAX_CACHED_BIND_GROUPS, PARAM_SLOT};
use crate::params::Params;

impl Gpu {
    /// Records one dispatch; true when `flush_every` asks for a submission now.
    pub(super) fn record<P: Params>(&self, entry: &str, params: &P, binds: &[(u32, Bind<'_>)], groups: [u32; 3]) -> Result<bool> {
        let found = self.kernel::<P>(entry)?;
        if groups.contains(&0) {
            return Ok(false);
        }
        if groups.iter().any(|&g| g > self.limits.max_compute_workgroups_per_dimension) {
            return Err(BackendError::Device(format!("{entry}: {groups:?} workgroups exceed the adapter's limit")));
        }
        let (entry, kernel) = found.ok_or_else(|| no_kernel(entry))?;
        let mut guard = self.pending()?;
        let p = &mut *guard;
        self.release_held(p)?;
        self.record_in(p, entry, kernel, bytemuck::bytes_of(params), binds, groups)
    }

    /// The kernel `entry` names, if the adapter has it, with its registered
    /// name; an error if it takes parameters of another type than `P` (its
    /// module's struct in the registry): the one place where a dispatch's
    /// parameters are checked ([`ParamsLayout::check`]).
    ///
    /// [`ParamsLayout::check`]: crate::kernels::ParamsLayout::check
    pub(super) fn kernel<P: Params>(&self, entry: &str) -> Result<Option<(&'static str, &Kernel)>> {
        let Some((&name, kernel)) = self.kernels.get_key_value(entry) else {
            return Ok(None);
        };
        kernel.params.check::<P>(name).map_err(BackendError::Device)?;
        Ok(Some((name, kernel)))
    }

    /// Records no dispatch of the kernels `names` from now on (none: all
    /// again); see [`crate::WgpuBackend::skip_kernels`].
    pub(crate) fn skip_kernels(&self, names: &[&str]) -> Result<()> {
        if let Some(k) = names.iter().find(|k| !self.kernels.contains_key(**k)) {
            return Err(BackendError::Device(format!("no kernel named '{k}' to skip")));
        }
        self.pending()?.skipped = names.iter().map(|k| k.to_string()).collect();
        Ok(())
    }

    /// [`Gpu::record`] of a looked-up kernel, with the recorder locked.
    pub(super) fn record_in(
        &self,
        p: &mut Pending,
        entry: &'static str,
        kernel: &Kernel,
        params: &[u8],
        binds: &[(u32, Bind<'_>)],
        groups: [u32; 3],
    ) -> Result<bool> {
        if !p.skipped.is_empty() && p.skipped.iter().any(|k| k == entry) {
            return Ok(false);
        }
        if self.immediates {
            return self.record_immediate(p, entry, kernel, params, binds, groups);
        }
        let slot = p.slots_used;
        p.slots_used += 1;
        let arena_index = (slot / ARENA_SLOTS) as usize;
        let offset = (slot % ARENA_SLOTS) * PARAM_SLOT;
        while p.arenas.len() <= arena_index {
            self.ledger.add(super::Held::Inputs, ARENA_SLOTS * PARAM_SLOT);
            p.arenas.push(self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("params"),
                size: ARENA_SLOTS * PARAM_SLOT,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        let start = (slot * PARAM_SLOT) as usize;
        p.params.resize(start + PARAM_SLOT as usize, 0);
        let Some(slot_bytes) = p.params.get_mut(start..start + params.len()) else {
            return Err(BackendError::Device(format!("{entry}: {} parameter bytes exceed a {PARAM_SLOT}-byte slot", params.len())));
        };
        slot_bytes.copy_from_slice(params);
        let arena = wgpu::BufferBinding { buffer: &p.arenas[arena_index], offset, size: NonZeroU64::new(PARAM_SLOT) };
        let bind_group = self.bind_group(entry, kernel, slot, binds, Some(arena))?;
        self.dispatch_in(p, kernel, &bind_group, None, groups)
    }

    /// Records the dispatch itself in the open pass (or a new one), timed
    /// when profiling: `immediates` are its parameters as immediate data.
    fn dispatch_in(&self, p: &mut Pending, kernel: &Kernel, bind_group: &wgpu::BindGroup, immediates: Option<&[u8]>, groups: [u32; 3]) -> Result<bool> {
        let fresh = p.pass.is_none();
        let timestamp_writes = p.timing.as_mut().and_then(|t| t.next_pass(kernel.family, fresh));
        let pass = self.open_pass(&mut p.pass, &mut p.encoder, timestamp_writes)?;
        pass.set_pipeline(&kernel.pipeline);
        pass.set_bind_group(0, bind_group, &[]);
        if let Some(params) = immediates {
            pass.set_immediates(0, params);
        }
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        if let Some(t) = p.timing.as_mut() {
            t.after_dispatch(kernel.family, pass);
        }
        p.since_submit += 1;
        Ok(self.flush_due(p))
    }

    /// Whether the dispatches recorded since the last submission are enough
    /// for a periodic one: `flush_every`, or fewer early in a token; none
    /// while a started read is outstanding and nothing has waited for the
    /// GPU since it started (it still has the work before the read), unless
    /// `flush_ahead`.
    fn flush_due(&self, p: &Pending) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let every = self.flush_every.load(Relaxed);
        let at = if p.flush_at == 0 { every } else { p.flush_at.min(every) };
        let ahead = self.started_reads.load(Relaxed) > 0 && self.queued_ahead.load(Relaxed);
        every > 0 && p.since_submit >= at && (self.flush_ahead || !ahead)
    }

    /// The bind group of one dispatch (cached): `params` at binding 0 when
    /// parameters come from the uniform arena (`slot` is then part of the key).
    fn bind_group(
        &self,
        entry: &'static str,
        kernel: &Kernel,
        slot: u64,
        binds: &[(u32, Bind<'_>)],
        params: Option<wgpu::BufferBinding<'_>>,
    ) -> Result<wgpu::BindGroup> {
        let key: BindKey = (entry, slot, binds.iter().map(|(i, b)| (*i, b.buffer.clone(), b.offset, b.size)).collect());
        let mut cache = self.bind_groups.lock().map_err(|_| BackendError::Device("bind group cache poisoned".into()))?;
        if cache.len() >= MAX_CACHED_BIND_GROUPS {
            cache.clear();
        }
        if let Some(bg) = cache.get(&key) {
            return Ok(bg.clone());
        }
        let mut entries = Vec::with_capacity(binds.len() + 1);
        if let Some(params) = params {
            entries.push(wgpu::BindGroupEntry { binding: 0, resource: wgpu::BindingResource::Buffer(params) });
        }
        for (binding, b) in binds {
            let resource = if b.size == 0 {
                b.buffer.as_entire_binding()
            } else {
                wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer: b.buffer, offset: b.offset, size: NonZeroU64::new(b.size) })
            };
            entries.push(wgpu::BindGroupEntry { binding: *binding, resource });
        }
        self.host_time.bind_groups.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor { label: Some(entry), layout: &kernel.layout, entries: &entries });
        cache.insert(key, bg.clone());
        Ok(bg)
    }

    /// The open compute pass, or a new one (a dispatch timed by a pass of its
    /// own gets one each).
    fn open_pass<'p>(
        &self,
        pass: &'p mut Option<wgpu::ComputePass<'static>>,
        encoder: &mut Option<wgpu::CommandEncoder>,
        timestamp_writes: Option<wgpu::ComputePassTimestampWrites<'_>>,
    ) -> Result<&'p mut wgpu::ComputePass<'static>> {
        if timestamp_writes.is_some() || pass.is_none() {
            *pass = None;
            let encoder = encoder.get_or_insert_with(|| {
                self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("ops") })
            });
            let begun = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("ops"), timestamp_writes });
            *pass = Some(begun.forget_lifetime());
        }
        pass.as_mut().ok_or_else(|| BackendError::Device("no open compute pass".into()))
    }

    /// [`Gpu::record`] for kernels that take their parameters as immediate
    /// data: no arena slot, and bind groups keyed by their buffers alone.
    fn record_immediate(
        &self,
        p: &mut Pending,
        entry: &'static str,
        kernel: &Kernel,
        params: &[u8],
        binds: &[(u32, Bind<'_>)],
        groups: [u32; 3],
    ) -> Result<bool> {
        if params.len() % 4 != 0 || params.len() as u64 > self.limits.max_immediate_size as u64 {
            return Err(BackendError::Device(format!("{entry}: {} parameter bytes do not fit the immediate data", params.len())));
        }
        let bind_group = self.bind_group(entry, kernel, u64::MAX, binds, None)?;
        self.dispatch_in(p, kernel, &bind_group, Some(params), groups)
    }
}

pub(super) fn no_kernel(entry: &str) -> BackendError {
    BackendError::Device(format!("no kernel named '{entry}'"))
}
