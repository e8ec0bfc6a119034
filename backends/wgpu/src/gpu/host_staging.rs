//! Staging for expert pool writes in the host's own memory (Vulkan).
//!
//! wgpu gives a mappable buffer memory that is device-local where the
//! adapter offers it host-visible: on a discrete GPU with a resizable BAR
//! (NVIDIA's data-centre cards), the CPU then writes each streamed expert
//! across PCIe into the GPU's memory, write-combined. This staging instead
//! takes memory the host caches and the GPU reads (its copy engine pulls it
//! across PCIe), allocated through Vulkan directly and mapped for its whole
//! life, and wraps each piece as a wgpu buffer to copy from. Each chunk is
//! reused once the submission that copies out of it has completed.
//!
//! `None` where the adapter is not Vulkan or has no such memory; the caller
//! then uses wgpu's own staging.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Bytes of each chunk (a larger write gets a chunk of its own size).
const CHUNK: u64 = 8 << 20;
/// Free chunks kept when staging settles (after a bulk load, the rest go).
const KEEP: usize = 4;

struct Chunk {
    buffer: wgpu::Buffer,
    ptr: *mut u8,
    size: u64,
    /// Bytes handed out since it was taken.
    used: u64,
    /// Set once the last submission copying out of it has completed;
    /// `None` while it has writes not yet sent.
    done: Option<Arc<AtomicBool>>,
}

// The mapping is only written through `&mut HostStaging`, and only in parts
// no submission is reading (a chunk is reused after its copies completed).
unsafe impl Send for Chunk {}

impl Chunk {
    fn free(&self) -> bool {
        self.done.as_ref().is_some_and(|d| d.load(Ordering::Acquire))
    }
}

pub(super) struct HostStaging {
    alloc: vulkan::Allocator,
    chunks: Vec<Chunk>,
    /// The chunk being filled, if any (sent or not: later writes fill it
    /// on past what was sent).
    current: Option<usize>,
    /// Chunks filled since the last send.
    unsent: Vec<usize>,
}

impl HostStaging {
    /// Host-cached staging on `device`, if it is a Vulkan device with such
    /// memory.
    pub(super) fn new(device: &wgpu::Device) -> Option<HostStaging> {
        Some(HostStaging { alloc: vulkan::Allocator::new(device)?, chunks: Vec::new(), current: None, unsent: Vec::new() })
    }

    /// The memory it uses, for logs.
    pub(super) fn describe(&self) -> String {
        self.alloc.describe()
    }

    /// Records a copy of `size` bytes that `fill` writes into `dst` at
    /// `offset` (both multiples of 4) in `encoder`.
    pub(super) fn write(
        &mut self,
        device: &wgpu::Device,
        encoder: &mut wgpu::CommandEncoder,
        dst: &wgpu::Buffer,
        offset: u64,
        size: u64,
        fill: impl FnOnce(&mut wgpu::WriteOnly<'_, [u8]>),
    ) -> Result<(), String> {
        let i = self.room(device, size)?;
        let c = &mut self.chunks[i];
        let at = c.used;
        c.used += size.next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
        // SAFETY: `ptr` maps the chunk's `size` bytes for the chunk's life;
        // `room` gave `at..at + size` within it to this write alone, and no
        // submission reads the chunk until it is sent.
        let bytes = unsafe { std::slice::from_raw_parts_mut(c.ptr.add(at as usize), size as usize) };
        fill(&mut wgpu::WriteOnly::from(bytes));
        encoder.copy_buffer_to_buffer(&c.buffer, at, dst, offset, size);
        Ok(())
    }

    /// A chunk with `size` bytes left: the current one, a free one, or a new one.
    fn room(&mut self, device: &wgpu::Device, size: u64) -> Result<usize, String> {
        if let Some(i) = self.current {
            let c = &mut self.chunks[i];
            if c.size - c.used >= size {
                // Sent and still being copied from: its bytes past `used` are
                // not, and it comes back after the next send's submission.
                if c.done.take().is_some() {
                    self.unsent.push(i);
                }
                return Ok(i);
            }
        }
        let i = match self.chunks.iter().position(|c| c.free() && c.size >= size) {
            Some(i) => i,
            None => {
                let bytes = size.max(CHUNK).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
                let (buffer, ptr) = self.alloc.chunk(device, bytes)?;
                self.chunks.push(Chunk { buffer, ptr, size: bytes, used: 0, done: None });
                self.chunks.len() - 1
            }
        };
        let c = &mut self.chunks[i];
        c.used = 0;
        c.done = None;
        self.current = Some(i);
        self.unsent.push(i);
        Ok(i)
    }

    /// After the submission that copies out of the chunks filled since the
    /// last send: they come back once it has completed.
    pub(super) fn sent(&mut self, queue: &wgpu::Queue) {
        if self.unsent.is_empty() {
            return;
        }
        let done = Arc::new(AtomicBool::new(false));
        for &i in &self.unsent {
            self.chunks[i].done = Some(done.clone());
        }
        self.unsent.clear();
        queue.on_submitted_work_done(move || done.store(true, Ordering::Release));
    }

    /// After waiting for every earlier upload: keeps a few free chunks and
    /// lets the rest go (wgpu frees each once nothing uses it).
    pub(super) fn settle(&mut self) {
        if !self.unsent.is_empty() {
            return;
        }
        self.current = None;
        let mut kept = 0;
        self.chunks.retain(|c| {
            let keep = !c.free() || kept < KEEP;
            kept += usize::from(c.free() && keep);
            keep
        });
    }

    /// Bytes of the chunks it holds (for tests).
    pub(super) fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.size).sum()
    }
}

#[cfg(not(any(target_os = "macos", target_os = "ios")))]
mod vulkan {
    use ash::vk;
    use wgpu::hal::api::Vulkan;

    /// Allocates chunks from a host-visible, host-coherent memory type,
    /// host-cached if one is, preferring one that is not device-local.
    pub(super) struct Allocator {
        raw: ash::Device,
        memory_type: u32,
        flags: vk::MemoryPropertyFlags,
    }

    impl Allocator {
        pub(super) fn new(device: &wgpu::Device) -> Option<Allocator> {
            // SAFETY: the handles are only used while `device` lives (the
            // chunks' wgpu buffers keep it alive), and nothing here destroys
            // what wgpu owns.
            let hal = unsafe { device.as_hal::<Vulkan>() }?;
            let raw = hal.raw_device().clone();
            let instance = hal.shared_instance().raw_instance();
            let props = unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
            // Which memory types a transfer-source buffer may use.
            let probe = unsafe { raw.create_buffer(&source_info(CHUNK_PROBE), None) }.ok()?;
            let bits = unsafe { raw.get_buffer_memory_requirements(probe) }.memory_type_bits;
            unsafe { raw.destroy_buffer(probe, None) };
            let needed = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            let types = &props.memory_types[..props.memory_type_count as usize];
            let score = |f: vk::MemoryPropertyFlags| {
                2 * u32::from(f.contains(vk::MemoryPropertyFlags::HOST_CACHED)) + u32::from(!f.contains(vk::MemoryPropertyFlags::DEVICE_LOCAL))
            };
            let (memory_type, ty) = types
                .iter()
                .enumerate()
                .filter(|(i, t)| bits & (1 << i) != 0 && t.property_flags.contains(needed))
                .max_by_key(|(i, t)| (score(t.property_flags), std::cmp::Reverse(*i)))?;
            // Write-combined device memory is what wgpu already gives.
            if !ty.property_flags.contains(vk::MemoryPropertyFlags::HOST_CACHED) {
                return None;
            }
            Some(Allocator { raw, memory_type: memory_type as u32, flags: ty.property_flags })
        }

        pub(super) fn describe(&self) -> String {
            format!("Vulkan memory type {} ({:?})", self.memory_type, self.flags)
        }

        /// A mapped transfer-source buffer of `size` bytes, and its mapping.
        pub(super) fn chunk(&self, device: &wgpu::Device, size: u64) -> Result<(wgpu::Buffer, *mut u8), String> {
            let raw = &self.raw;
            let fail = |what: &str, e: vk::Result| format!("host staging: {what} of {size} bytes: {e}");
            // SAFETY: each handle made here is destroyed on every error path,
            // and otherwise by the wgpu buffer's drop callback, after wgpu has
            // stopped using it.
            unsafe {
                let buffer = raw.create_buffer(&source_info(size), None).map_err(|e| fail("creating a buffer", e))?;
                let req = raw.get_buffer_memory_requirements(buffer);
                if req.memory_type_bits & (1 << self.memory_type) == 0 {
                    raw.destroy_buffer(buffer, None);
                    return Err(format!("host staging: a buffer of {size} bytes cannot use memory type {}", self.memory_type));
                }
                let info = vk::MemoryAllocateInfo::default().allocation_size(req.size).memory_type_index(self.memory_type);
                let memory = match raw.allocate_memory(&info, None) {
                    Ok(m) => m,
                    Err(e) => {
                        raw.destroy_buffer(buffer, None);
                        return Err(fail("allocating memory", e));
                    }
                };
                let mapped = raw.bind_buffer_memory(buffer, memory, 0).and_then(|_| raw.map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty()));
                let ptr = match mapped {
                    Ok(p) => p.cast::<u8>(),
                    Err(e) => {
                        raw.destroy_buffer(buffer, None);
                        raw.free_memory(memory, None);
                        return Err(fail("mapping memory", e));
                    }
                };
                let owner = raw.clone();
                let hal_buffer = wgpu::hal::vulkan::Buffer::from_raw_externally_owned(
                    buffer,
                    Box::new(move || {
                        owner.destroy_buffer(buffer, None);
                        owner.free_memory(memory, None);
                    }),
                );
                let desc = wgpu::BufferDescriptor { label: Some("host staging"), size, usage: wgpu::BufferUsages::COPY_SRC, mapped_at_creation: false };
                Ok((device.create_buffer_from_hal::<Vulkan>(hal_buffer, &desc), ptr))
            }
        }
    }

    const CHUNK_PROBE: u64 = super::CHUNK;

    fn source_info(size: u64) -> vk::BufferCreateInfo<'static> {
        vk::BufferCreateInfo::default().size(size).usage(vk::BufferUsageFlags::TRANSFER_SRC).sharing_mode(vk::SharingMode::EXCLUSIVE)
    }
}

#[cfg(any(target_os = "macos", target_os = "ios"))]
mod vulkan {
    /// No Vulkan here: unified memory maps the pool itself.
    pub(super) enum Allocator {}

    impl Allocator {
        pub(super) fn new(_: &wgpu::Device) -> Option<Allocator> {
            None
        }

        pub(super) fn describe(&self) -> String {
            match *self {}
        }

        pub(super) fn chunk(&self, _: &wgpu::Device, _: u64) -> Result<(wgpu::Buffer, *mut u8), String> {
            match *self {}
        }
    }
}
