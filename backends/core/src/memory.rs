//! What a backend holds in device memory, for reports ([`crate::Backend::device_memory`]).

/// Bytes of device memory by use, named as the backend counts them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceMemory {
    /// Every use's bytes now, and their device total (host-side read-back
    /// buffers are listed but not counted in it).
    pub now_bytes: u64,
    pub now: Vec<(&'static str, u64)>,
    /// The device total's high-water mark, each use's bytes at that moment,
    /// and the pooled scratch in use then, by kind.
    pub peak_bytes: u64,
    pub at_peak: Vec<(&'static str, u64)>,
    pub in_use_at_peak: Vec<(&'static str, u64)>,
    /// The most pooled scratch in use at once, by kind at that moment.
    pub scratch_peak_bytes: u64,
    pub scratch_at_peak: Vec<(&'static str, u64)>,
    /// The device allocator's memory blocks and the bytes allocated in them,
    /// where it reports them (blocks hold free space, too).
    pub allocator: Option<(u64, u64)>,
}
