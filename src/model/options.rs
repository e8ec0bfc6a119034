//! How a model is loaded: the expert pool's size and what else to load or keep.

/// How many expert slots to give the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertSlots {
    /// One slot per expert of every layer: nothing is ever evicted.
    All,
    /// A fixed number of slots (at least one token's experts).
    Count(usize),
}

/// Options for [`load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub expert_slots: ExpertSlots,
    /// Load the MTP head when the checkpoint has one.
    pub mtp: bool,
    /// With the MTP head, draft nothing while other sequences decode
    /// (`generate::MtpBeside::Pause`) instead of drafting for each.
    pub mtp_pause_beside_others: bool,
    /// Bound of the dequantized n-gram row cache (qwen4_exp's PLE).
    pub ngram_cache_bytes: usize,
    /// When the pool has a slot for every expert, read them all at load, so
    /// that a resident model's first tokens wait on no reads.
    pub preload_experts: bool,
    /// Concatenate linear layers over one input into one weight (one matmul).
    /// Off only for before/after measurements.
    pub fuse_projections: bool,
    /// Decode greedy tokens one ahead where the backend and model allow
    /// (`generate::Engine::decode_ahead`). Off only for before/after measurements.
    pub decode_ahead: bool,
    /// Expert reads in flight at once (the streamer's read threads).
    pub read_threads: usize,
    /// How many of each token's guessed experts for the next MoE layer a
    /// streaming decode reads ahead (`ExpertCache::read_ahead`; 0: none;
    /// `None`: `experts::DEFAULT_READ_AHEAD`).
    pub read_ahead: Option<usize>,
    /// Write a streamed expert's matrices to its slot as they land, and
    /// what was read ahead as soon as it has (`ExpertCache::write_as_landed`).
    /// Off only for before/after measurements.
    pub write_as_landed: bool,
    /// Keep streamed pieces' read buffers for later reads
    /// (`ExpertStore::keep_read_buffers`). Off only for before/after
    /// measurements.
    pub reuse_read_buffers: bool,
    /// When a streamed layer's guess for the next MoE layer is read
    /// (`ExpertCache::ahead_start`). Other than the default only for
    /// before/after measurements.
    pub ahead_start: crate::experts::Progress,
    /// How a streaming pool's missed experts choose their slots
    /// (`ExpertCache::set_eviction`). Other than the default only for
    /// before/after measurements.
    pub eviction: crate::experts::Eviction,
    /// Where to write each streaming MoE call's experts
    /// (`ExpertCache::trace_routing`), for tools/peer/eviction_sim.py.
    pub routing_trace: Option<std::path::PathBuf>,
}

/// Default bound of the n-gram row cache.
pub const DEFAULT_NGRAM_CACHE_BYTES: usize = 64 << 20;

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            expert_slots: ExpertSlots::All,
            mtp: false,
            mtp_pause_beside_others: false,
            ngram_cache_bytes: DEFAULT_NGRAM_CACHE_BYTES,
            preload_experts: false,
            fuse_projections: true,
            decode_ahead: true,
            read_threads: crate::experts::ExpertStore::READ_THREADS,
            read_ahead: None,
            write_as_landed: true,
            reuse_read_buffers: true,
            ahead_start: crate::experts::Progress::Landed,
            eviction: crate::experts::Eviction::default(),
            routing_trace: None,
        }
    }
}

impl LoadOptions {
    /// Applies the measurement knobs `SLOTSTREAM_FUSED_PROJECTIONS=0` (keep
    /// projections apart), `SLOTSTREAM_DECODE_AHEAD=0` (wait for each
    /// token before recording the next), `SLOTSTREAM_READ_AHEAD=N` (guessed
    /// experts per token read ahead, 0-64; 0 reads none before its layer is
    /// routed), `SLOTSTREAM_READ_THREADS=N`
    /// (1-256 expert reads in flight; anything else is an error naming the
    /// variable) and `SLOTSTREAM_WRITE_AS_LANDED=0` (the earlier handover of
    /// streamed experts: what was read ahead first, then each expert whole)
    /// `SLOTSTREAM_REUSE_READ_BUFFERS=0` (a new buffer for every read) and
    /// `SLOTSTREAM_AHEAD_START=issued|draining|landed` (when the guess for
    /// the next layer is read: as the layer's own reads go out, once a read
    /// thread would stand idle, or once they have landed, the default) and
    /// `SLOTSTREAM_EVICTION=frequency[:HALF_LIFE]|clock` (which slots missed
    /// experts take: those of the experts needed least lately, counts halved
    /// every HALF_LIFE tokens, the default; or CLOCK's) and
    /// `SLOTSTREAM_ROUTING_TRACE=FILE` (each streaming MoE call's experts,
    /// a line each) and `SLOTSTREAM_MTP_BESIDE=draft|pause` (whether a
    /// sequence with the MTP head drafts while others decode, the default,
    /// or pauses until it decodes alone). The only place they are read.
    pub fn with_env_overrides(mut self) -> anyhow::Result<Self> {
        let off = |name: &str| std::env::var(name).is_ok_and(|v| v == "0");
        if off("SLOTSTREAM_FUSED_PROJECTIONS") {
            self.fuse_projections = false;
        }
        if off("SLOTSTREAM_DECODE_AHEAD") {
            self.decode_ahead = false;
        }
        if off("SLOTSTREAM_WRITE_AS_LANDED") {
            self.write_as_landed = false;
        }
        if off("SLOTSTREAM_REUSE_READ_BUFFERS") {
            self.reuse_read_buffers = false;
        }
        if let Ok(v) = std::env::var("SLOTSTREAM_AHEAD_START") {
            use crate::experts::Progress;
            self.ahead_start = match v.trim() {
                "issued" => Progress::Issued,
                "draining" => Progress::Draining,
                "landed" => Progress::Landed,
                _ => anyhow::bail!("SLOTSTREAM_AHEAD_START={v:?}: expected issued, draining or landed (unset it for the default, landed)"),
            };
        }
        if let Ok(v) = std::env::var("SLOTSTREAM_EVICTION") {
            self.eviction = crate::experts::Eviction::parse(&v).ok_or_else(|| {
                anyhow::anyhow!("SLOTSTREAM_EVICTION={v:?}: expected frequency, calls (each may add :<half-life in tokens>) or clock (unset it for the default, frequency:{})", crate::experts::DEFAULT_HALF_LIFE)
            })?;
        }
        if let Ok(v) = std::env::var("SLOTSTREAM_MTP_BESIDE") {
            self.mtp_pause_beside_others = match v.trim() {
                "draft" => false,
                "pause" => true,
                _ => anyhow::bail!("SLOTSTREAM_MTP_BESIDE={v:?}: expected draft or pause (unset it for the default, draft)"),
            };
        }
        if let Some(path) = std::env::var_os("SLOTSTREAM_ROUTING_TRACE").filter(|p| !p.is_empty()) {
            self.routing_trace = Some(path.into());
        }
        if let Ok(v) = std::env::var("SLOTSTREAM_READ_AHEAD") {
            self.read_ahead = Some(v.trim().parse::<usize>().ok().filter(|n| *n <= 64).ok_or_else(|| {
                anyhow::anyhow!("SLOTSTREAM_READ_AHEAD={v:?}: expected how many guessed experts per token to read ahead, 0 to 64 (unset it for the default, {})", crate::experts::DEFAULT_READ_AHEAD)
            })?);
        }
        if let Ok(v) = std::env::var("SLOTSTREAM_READ_THREADS") {
            self.read_threads = v.trim().parse::<usize>().ok().filter(|n| (1..=256).contains(n)).ok_or_else(|| {
                anyhow::anyhow!("SLOTSTREAM_READ_THREADS={v:?}: expected a number of expert reads in flight from 1 to 256 (unset it for the default, {})", self.read_threads)
            })?;
        }
        Ok(self)
    }
}
