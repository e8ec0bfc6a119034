//! What the expert cache counts: per MoE layer and for the whole pool.

use serde::Serialize;

/// Counters of one MoE layer (or of all of them).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct CacheCounters {
    /// Experts found in the pool: distinct experts per call while the pool
    /// streams; once it holds every expert, routing no longer comes back to
    /// the host and each routed (token, expert) pair counts as a hit.
    pub hits: u64,
    pub misses: u64,
    /// Of the misses, those run from the staging pool (a long call's misses
    /// with no free slot), read for the call and dropped after it.
    pub staged: u64,
    pub bytes_read: u64,
    /// Seconds the read threads were busy (wall time of each batch of reads).
    pub read_seconds: f64,
    /// Seconds compute stood still waiting for reads (and for the writes
    /// into slots of the experts read).
    pub wait_seconds: f64,
    /// Seconds spent writing experts read into their slots (as each lands,
    /// on the thread that collects the reads).
    pub write_seconds: f64,
    /// Experts read ahead of their layer's call (guessed from the layer
    /// before), and how many of them the call then needed. Their bytes and
    /// read time count in `bytes_read` and `read_seconds`; a used one counts
    /// as a miss that nobody waited to read.
    pub read_ahead: u64,
    pub read_ahead_used: u64,
    /// Seconds with at least one expert read in flight ([`super::ExpertStore::busy_seconds`],
    /// counted as each streaming call has its experts): beside the decode's
    /// seconds, how long the disk stood idle between reads.
    pub disk_busy_seconds: f64,
    /// Reads (pieces of records) that ended, and their seconds in flight
    /// summed: over `disk_busy_seconds`, the reads in flight on average
    /// while any was; over `disk_reads`, a read's mean time.
    pub disk_reads: u64,
    pub disk_read_seconds: f64,
    /// Seconds from the streaming call before's end to this call's own reads
    /// being issued: the compute between two MoE layers' reads (on a GPU
    /// with its read-back of the routes), where only guesses keep the disk busy.
    pub lead_seconds: f64,
    /// Seconds from a call's last read landing to the call handing its
    /// compute over: the last records' writes, the slot table, and the
    /// compute itself on a backend that runs it there and then (the CPU).
    pub tail_seconds: f64,
}

impl CacheCounters {
    pub(super) fn add(&mut self, o: &CacheCounters) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.staged += o.staged;
        self.bytes_read += o.bytes_read;
        self.read_seconds += o.read_seconds;
        self.wait_seconds += o.wait_seconds;
        self.write_seconds += o.write_seconds;
        self.read_ahead += o.read_ahead;
        self.read_ahead_used += o.read_ahead_used;
        self.disk_busy_seconds += o.disk_busy_seconds;
        self.disk_reads += o.disk_reads;
        self.disk_read_seconds += o.disk_read_seconds;
        self.lead_seconds += o.lead_seconds;
        self.tail_seconds += o.tail_seconds;
    }

    /// What was counted since `earlier` (counters of the same pool).
    pub fn since(&self, earlier: &CacheCounters) -> CacheCounters {
        CacheCounters {
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            staged: self.staged.saturating_sub(earlier.staged),
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            read_seconds: (self.read_seconds - earlier.read_seconds).max(0.0),
            wait_seconds: (self.wait_seconds - earlier.wait_seconds).max(0.0),
            write_seconds: (self.write_seconds - earlier.write_seconds).max(0.0),
            read_ahead: self.read_ahead.saturating_sub(earlier.read_ahead),
            read_ahead_used: self.read_ahead_used.saturating_sub(earlier.read_ahead_used),
            disk_busy_seconds: (self.disk_busy_seconds - earlier.disk_busy_seconds).max(0.0),
            disk_reads: self.disk_reads.saturating_sub(earlier.disk_reads),
            disk_read_seconds: (self.disk_read_seconds - earlier.disk_read_seconds).max(0.0),
            lead_seconds: (self.lead_seconds - earlier.lead_seconds).max(0.0),
            tail_seconds: (self.tail_seconds - earlier.tail_seconds).max(0.0),
        }
    }

    pub fn read_gb_per_second(&self) -> f64 {
        if self.read_seconds > 0.0 {
            self.bytes_read as f64 / self.read_seconds / 1e9
        } else {
            0.0
        }
    }

    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// Statistics of the expert cache.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CacheStats {
    /// Routed-expert slots.
    pub slots: usize,
    /// Bytes of the whole pool: its routed slots and `shared_bytes` of
    /// shared experts held beside them.
    pub pool_bytes: usize,
    pub shared_bytes: usize,
    /// Bytes of the staging pool long calls' misses run from (0 until one has).
    pub staging_bytes: usize,
    pub direct_io: bool,
    pub total: CacheCounters,
    pub per_layer: Vec<CacheCounters>,
}

/// Where the counting of a prompt's expert reads started ([`super::ExpertCache::mark_reads`]).
#[derive(Clone, Debug)]
pub struct ReadMark {
    pub(super) epoch: u32,
    pub(super) counters: CacheCounters,
}

/// What a prompt (or any stretch of calls since a [`ReadMark`]) read of the
/// routed experts: its bytes read as passes over the distinct experts that
/// missed. Expert-major prefill reads each missed expert once per chunk.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct PromptReads {
    pub hits: u64,
    pub misses: u64,
    /// Misses run from the staging pool (not kept in the pool).
    pub staged: u64,
    pub bytes_read: u64,
    /// Distinct experts that missed at least once, and their bytes.
    pub missed_experts: u64,
    pub missed_bytes: u64,
    /// `bytes_read / missed_bytes` (0 when nothing missed).
    pub passes: f64,
}

impl PromptReads {
    /// `read 1.23 GB of experts, 1.05 passes over 384 missed (0.17 GB; 300 run from staging)`.
    pub fn describe(&self) -> String {
        format!(
            "read {:.2} GB of experts, {:.2} passes over the {} that missed ({:.2} GB; {} runs from staging)",
            self.bytes_read as f64 / 1e9,
            self.passes,
            self.missed_experts,
            self.missed_bytes as f64 / 1e9,
            self.staged
        )
    }

    pub(super) fn new(counters: &CacheCounters, missed_experts: u64, record_bytes: u64) -> PromptReads {
        let missed_bytes = missed_experts * record_bytes;
        PromptReads {
            hits: counters.hits,
            misses: counters.misses,
            staged: counters.staged,
            bytes_read: counters.bytes_read,
            missed_experts,
            missed_bytes,
            passes: if missed_bytes > 0 { counters.bytes_read as f64 / missed_bytes as f64 } else { 0.0 },
        }
    }
}
