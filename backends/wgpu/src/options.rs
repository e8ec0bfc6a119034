//! The wgpu backend's settings: one value built in code (tests and
//! benchmarks set its fields) or, once, from the three `SLOTSTREAM_WGPU_*`
//! environment variables a user may need ([`VARIABLES`]); nothing below the
//! backend's constructor reads the environment. The measurement settings
//! that BENCHMARKS.md has decided are code-only ([`RETIRED`]).

/// How one-token matmuls of 4-bit weights treat the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulMode {
    /// f32 activations everywhere: the reference the kernel tests compare with
    /// the CPU backend at 1e-5.
    Exact,
    /// One-token products with large interleaved 4-bit weights (resident
    /// weights with 16-bit scales, at least [`WgpuOptions::int8_min_bytes`])
    /// quantize x to int8 per block of 32 columns and use packed integer dot
    /// products (`wgsl/matvec_q8.wgsl`); like the CPU backend's int8
    /// activations this costs a few 1e-3 relative error per matmul.
    /// Everything else is computed as in `Exact`.
    Int8,
}

impl MatmulMode {
    /// The mode `SLOTSTREAM_WGPU_MATMUL` asks for (`exact` or `int8`), else
    /// `default` (read through [`WgpuOptions::from_env`]).
    pub fn from_env(default: MatmulMode) -> MatmulMode {
        WgpuOptions::from_env().matmul.unwrap_or(default)
    }
}

/// How standalone 4-bit weights with 16-bit scales are laid out on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q4Layout {
    /// Rows interleaved for coalesced x reads (fmt 4 of `wgsl/weights.wgsl`).
    Interleaved,
    /// The MLX order, as stored in the checkpoint (for comparing the two).
    Mlx,
}

/// Weights below this many bytes keep f32 activations in int8 mode. Their
/// one-token products are bound by latency, not by arithmetic: on an H200 a
/// 3.6 MB matrix takes 9.7 µs exact and 15.3 µs in int8 (the extra quantize
/// dispatch costs ~5.6 µs), a 176 MB one 97.5 µs exact and 67.0 µs in int8;
/// with int8 at ~0.6x the exact time plus 5.6 µs they break even near 27 MB
/// (BENCHMARKS.md, GPU (a) int8).
pub const INT8_MIN_BYTES: usize = 32 << 20;

/// Interleaved 4-bit weights of at least this many rows take one subgroup per
/// eight rows in the one-token matvec (fewer: four, for more parallelism).
/// None do: with a quad's chunks shared by several subgroups (`matvec_q4`),
/// four rows at every size took B's one-token products (several of 8192
/// rows or more) from 1.39 to 1.26 ms per token on an H200, a larger share
/// than A's, which have none (1.36 -> 1.28; BENCHMARKS.md).
const Q4_EIGHT_ROWS_FROM: usize = usize::MAX;

/// Subgroups that may share a one-token matvec's quad of interleaved 4-bit
/// rows (a row of 2048 columns gives two subgroups a share each, 4096 four).
const MATVEC_SPLIT: usize = 4;

/// Routers of at most this many rows are multiplied and routed in one
/// workgroup for decode. That workgroup walks a 128-row router's columns 16
/// times per lane; as a matmul (every SM) and then `moe_route`, Qwen3-30B-A3B's
/// real shape (128 experts) decoded 21% faster on an H200 (BENCHMARKS.md,
/// "decoding one token ahead").
const ROUTE_ONE_WORKGROUP_ROWS: usize = 64;

/// Fewest router rows that route over several workgroups
/// ([`WgpuOptions::route_wide_rows`]); smaller routers stay in one.
const ROUTE_WIDE_ROWS: usize = 65;

/// Dispatches per submission by default. Each submission costs the host
/// (wgpu encodes and tracks the whole command buffer there) and the GPU a
/// gap; 64 decoded qwen3_moe's trunk 33% faster than 16 on an H200, and a
/// chain of dependent dispatches ran at 2.8-7.9 us each against 4.9-9.9 us
/// (BENCHMARKS.md, issue 14).
const FLUSH_EVERY: u32 = 64;
/// Dispatches before the first periodic submission after one the host asked
/// for (see [`WgpuOptions::flush_first`]).
const FLUSH_FIRST: u32 = 8;

/// Bytes of streamed pool writes staged before they go out without waiting
/// for the table's mapping. On an H200 (A's trunk with 64 experts, a pool of
/// 25%) 4 MiB shortened the time between two MoE layers' reads by ~9 ms a
/// token and decoded 1.049x as fast as sending a layer's writes at once
/// (BENCHMARKS.md, issue 14).
const POOL_SEND_EVERY: u64 = 4 << 20;

/// Bytes staged through the queue before they go out in a submission
/// ([`WgpuOptions::upload_chunk`]; `gpu/uploads.rs`).
const UPLOAD_CHUNK: u64 = 256 << 20;

/// Fewest keys worth a workgroup of their own (below this the partials and
/// the merge cost more than the split saves). Measured on an H200 (qwen3_moe
/// trunk, 32 heads, ~460 keys, bounds checks on; BENCHMARKS.md): split plus
/// merge took 1.73 ms per token at 32, 1.89 at 16, 2.08 at 64, 3.27 at 128.
pub(crate) const MIN_CHUNK: usize = 32;

/// Workgroups a flash attention call aims for by default
/// ([`crate::WgpuOptions::flash_workgroups`]): two per SM of an H200 or H100
/// (132), each 256 invocations; fewer chunks cost less to merge.
const FLASH_TARGET_WORKGROUPS: usize = 264;

/// Tokens per part of a prefill's MoE call ([`crate::WgpuOptions::moe_rows`]).
const MOE_ROWS: usize = 1024;

/// Settings of a [`crate::WgpuBackend`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WgpuOptions {
    /// How one-token 4-bit matmuls treat the activations
    /// (`SLOTSTREAM_WGPU_MATMUL=exact|int8`); `None` lets the backend choose
    /// by adapter: int8 on a real GPU (measured faster, BENCHMARKS.md GPU
    /// (a)), exact on a software rasterizer.
    pub matmul: Option<MatmulMode>,
    /// Int8 mode applies to weights of at least this many bytes
    /// ([`INT8_MIN_BYTES`]; tests and benchmarks use 0 to reach the int8
    /// kernels with small matrices, set in code).
    pub int8_min_bytes: usize,
    /// Whether `slice_cols` of one row may return a view instead of a copy
    /// (false turns views off, for measurements).
    pub views: bool,
    /// Submit recorded work after this many dispatches (0: only when the host
    /// needs data back), so the GPU starts on a layer while the host is still
    /// recording it (set in code).
    pub flush_every: u32,
    /// After a submission the host asked for (a download: the end of a
    /// token), the first periodic submission comes after this many
    /// dispatches and each next one after twice as many, up to `flush_every`,
    /// so the GPU starts on a token while the host records the rest of it
    /// (set in code; 0 submits every `flush_every` from the start).
    pub flush_first: u32,
    /// Layout of standalone 4-bit weights ([`Q4Layout::Mlx`] for comparing
    /// with the MLX order).
    pub q4_layout: Q4Layout,
    /// Interleaved 4-bit weights of at least this many rows use eight rows per
    /// subgroup in one-token matvecs (set in code;
    /// 1 reaches that kernel with small test matrices).
    pub q4_eight_rows_from: usize,
    /// Decode attention splits a query's keys into chunks of at least this
    /// many keys (set in code, for measurements).
    pub attention_min_chunk: usize,
    /// Split decode attention holds a chunk's keys and values in registers
    /// where the chunk is small enough (`attention_split*_regs`;
    /// false keeps `attention_split*`, for
    /// measurements).
    pub attention_regs: bool,
    /// Dense attention of a prefill, or of a decode step over at least
    /// `FLASH_DECODE_MIN_KEYS` keys, takes `flash_attention` (key tiles in
    /// workgroup memory, one workgroup per kv head's query group) where the
    /// head dim is one it is compiled for (`SLOTSTREAM_WGPU_FLASH=0` keeps
    /// the per-head kernels, for measurements and the parity tests).
    pub flash_attention: bool,
    /// Workgroups a `flash_attention` call aims for, by cutting the keys
    /// into chunks (in code only: BENCHMARKS.md's sweeps chose 264).
    pub flash_workgroups: usize,
    /// A MoE call of more tokens runs its experts and their weighted sum in
    /// parts of about this many tokens (0: never), each with the kernels the
    /// whole call takes, so the unweighted outputs (`[tokens, top_k, hidden]`
    /// f32, a chunk's largest scratch) and the experts' activations take a
    /// part's memory, not the chunk's (in code only; `bench_gpu --moe-rows`).
    pub moe_rows: usize,
    /// Prefills with head dims up to 128 give each slot of
    /// `flash_attention` two rows (in code only; one row was slower).
    pub flash_two_rows: bool,
    /// A decode step over a long f16 cache takes `flash_decode` (eight lanes
    /// a key, all of a kv head's query heads at once; in code only: `false`
    /// leaves it to `flash_attention`, for comparisons).
    pub flash_decode: bool,
    /// Prefill products on the GPU's matrix units where the adapter has
    /// them (`wgsl/matmul_coop.wgsl`, int8 mode only; in code only).
    pub coop_matrix: bool,
    /// Split decode attention merges the splits of each (token, head) in the
    /// last of its workgroups to finish, one dispatch instead of two, where
    /// the backend orders memory across workgroups (Vulkan;
    /// false keeps `attention_merge`, for
    /// measurements).
    pub merge_in_split: bool,
    /// A one-token residual norm whose output is routed next runs inside
    /// the routing kernel (`moe_route_norm`; false
    /// keeps it a dispatch of its own, for measurements).
    pub fuse_norms: bool,
    /// One-token matvecs of interleaved 4-bit weights share each quad of rows
    /// among up to this many subgroups, so a lane walks fewer chunks of a row
    /// (set in code; 1 turns the split off, for measurements).
    pub matvec_split: usize,
    /// Two to eight tokens against interleaved 4-bit rows (batched decode)
    /// take `matvec_q4_tokens`, each chunk's weights loaded once for four
    /// tokens and each token's sums the one-token kernel's; false keeps the
    /// generic `matvec` (in code only, for measurements and the test that
    /// compares the two).
    pub matvec_q4_tokens: bool,
    /// Kernel parameters as immediate data (push constants) where the adapter
    /// has them (Vulkan), instead of a uniform buffer slot per dispatch
    /// (false keeps the uniform buffers, for
    /// measurements).
    pub immediates: bool,
    /// Periodic submissions are ended, finished and submitted on a thread of
    /// their own while the calling thread records the next dispatches
    /// (false submits on the calling thread, for
    /// measurements).
    pub submit_thread: bool,
    /// Routers of at most this many rows (experts, plus a shared expert's
    /// gate) are multiplied and routed in one workgroup for decode
    /// (`moe_route_matmul`, `moe_route_norm`); larger ones take the matmul
    /// kernels, then `moe_route` (set in code, for measurements).
    pub route_rows: usize,
    /// One-token routing by an 8-bit router of at least this many rows,
    /// with the residual norm before it, runs over several workgroups where
    /// the backend orders memory across workgroups (Vulkan): each takes a
    /// few rows and the last to finish routes (`moe_route_norm_wide`;
    /// set in code, 0 for never, for measurements).
    pub route_wide_rows: usize,
    /// Profiles write a timestamp after each dispatch inside one compute
    /// pass where the adapter can (each kernel's time then includes the
    /// barrier before it, as in the stream it runs in); else, and with
    /// false, each timed dispatch gets a pass of
    /// its own (the kernel alone, plus a pass's overhead).
    pub time_inside_passes: bool,
    /// While a started read is outstanding (decoding one token ahead: the
    /// GPU still runs the token before), the work recorded goes out in one
    /// submission when the next read starts, without periodic ones: the GPU
    /// has work meanwhile, and each submission costs it time. True keeps the
    /// periodic submissions then too (true, for
    /// measurements).
    pub flush_ahead: bool,
    /// Bytes staged for upload (weights, pool writes) before they go out in
    /// a submission of their own (set in code; see
    /// `gpu/uploads.rs`).
    pub upload_chunk: u64,
    /// Unified-memory adapters write weights and the expert pool through
    /// mapped primary buffers where they can; false stages every write
    /// through the queue as a discrete GPU does (false:
    /// tests on lavapipe take the discrete path this way).
    pub map_primary: bool,
    /// Expert pool writes that go through staging (a discrete GPU) reuse
    /// its buffers from one write to the next; false gives each write the
    /// queue's staging of its own, as before (false,
    /// for measurements).
    pub reuse_staging: bool,
    /// Pool writes (a streamed expert's matrices as they land) wait in
    /// staging until this many bytes are staged ([`POOL_SEND_EVERY`] by
    /// default), the pool's table is next mapped (just before the layer's
    /// MoE) or an upload chunk is staged, and go out in one submission, so
    /// that the GPU copies a layer's first experts into their slots while
    /// the last are read (for measurements, `u64::MAX`: all at the table's
    /// mapping; 0: each as it is written).
    pub pool_send_every: u64,
    /// A pool write (a streamed expert's matrix into its slot's staging or
    /// mapped memory) is filled on the calling thread (0, the default) or in
    /// parts of about this many bytes on rayon's threads side by side
    /// (e.g. 128 KiB as
    /// [`slotstream_backend::POOL_WRITE_PART`], for measurements). Unlike the CPU backend's
    /// slots, NVIDIA's staging memory is not written faster by more threads
    /// (87 against 89 ms per token on an H100), and the threads it takes
    /// slowed the streamer's reads from the SSD: 2.05 against 1.70 ms each,
    /// decode 1.21x with the calling thread alone (BENCHMARKS.md, "evicting
    /// the least needed expert").
    pub pool_write_part: usize,
    /// A pool that holds every expert also holds each MoE layer's shared
    /// expert, which a decoded token then runs as one more rank of the MoE
    /// kernels; false runs it in its own products
    /// (false, for measurements).
    pub shared_in_pool: bool,
    /// The routing kernels with the router's product (`moe_route_matmul`,
    /// `moe_route_norm`) route a router of at most a subgroup's width of
    /// experts (A's and B's 16) in one subgroup, with subgroup reductions
    /// instead of workgroup ones (false, for
    /// measurements).
    pub route_lanes: bool,
    /// A directory whose `.wgsl` files replace the built-in ones of the same
    /// name (`SLOTSTREAM_WGPU_WGSL_DIR`, for kernel development: variants of
    /// a kernel timed without rebuilding; the backend's name then says "kernels
    /// from DIR"; a path that is not a directory is an error).
    pub wgsl_dir: Option<std::path::PathBuf>,
    /// How KV caches store keys and values (`--kv-cache`, in code only);
    /// `None`: f16 in the int8 matmul mode, f32 in the exact one.
    pub kv_cache: Option<slotstream_backend::KvCacheType>,
}

impl Default for WgpuOptions {
    fn default() -> Self {
        WgpuOptions {
            matmul: None,
            int8_min_bytes: INT8_MIN_BYTES,
            views: true,
            flush_every: FLUSH_EVERY,
            flush_first: FLUSH_FIRST,
            q4_layout: Q4Layout::Interleaved,
            q4_eight_rows_from: Q4_EIGHT_ROWS_FROM,
            attention_min_chunk: MIN_CHUNK,
            attention_regs: true,
            flash_attention: true,
            flash_workgroups: FLASH_TARGET_WORKGROUPS,
            flash_two_rows: true,
            flash_decode: true,
            moe_rows: MOE_ROWS,
            coop_matrix: true,
            merge_in_split: true,
            fuse_norms: true,
            matvec_split: MATVEC_SPLIT,
            matvec_q4_tokens: true,
            immediates: true,
            submit_thread: true,
            route_rows: ROUTE_ONE_WORKGROUP_ROWS,
            route_wide_rows: ROUTE_WIDE_ROWS,
            time_inside_passes: true,
            flush_ahead: false,
            upload_chunk: UPLOAD_CHUNK,
            map_primary: true,
            reuse_staging: true,
            pool_send_every: POOL_SEND_EVERY,
            pool_write_part: 0,
            shared_in_pool: true,
            route_lanes: true,
            wgsl_dir: None,
            kv_cache: None,
        }
    }
}

/// What a `SLOTSTREAM_WGPU_*` variable may hold.
#[derive(Clone, Copy)]
enum Value {
    /// `0` or `1`.
    Flag,
    /// One of the words.
    Words(&'static [&'static str]),
    /// A directory.
    Path,
}

/// Every variable [`WgpuOptions::from_env`] reads, and what it may hold: the
/// ones a user may need (exact activations, the per-head attention kernels
/// where a driver mishandles the flash kernels, kernel files under
/// development). The other settings are code-only (tests and benchmarks set
/// the fields).
const VARIABLES: &[(&str, Value)] = &[
    ("SLOTSTREAM_WGPU_MATMUL", Value::Words(&["exact", "int8"])),
    ("SLOTSTREAM_WGPU_FLASH", Value::Flag),
    ("SLOTSTREAM_WGPU_WGSL_DIR", Value::Path),
];

/// Measurement settings that BENCHMARKS.md has decided, once read from the
/// environment: setting one now says so instead of naming every setting.
const RETIRED: &[&str] = &[
    "SLOTSTREAM_WGPU_INT8_MIN_BYTES",
    "SLOTSTREAM_WGPU_VIEWS",
    "SLOTSTREAM_WGPU_FLUSH_EVERY",
    "SLOTSTREAM_WGPU_FLUSH_FIRST",
    "SLOTSTREAM_WGPU_Q4_LAYOUT",
    "SLOTSTREAM_WGPU_Q4_EIGHT_ROWS_FROM",
    "SLOTSTREAM_WGPU_ATTENTION_MIN_CHUNK",
    "SLOTSTREAM_WGPU_ATTENTION_REGS",
    "SLOTSTREAM_WGPU_FLASH_ROWS",
    "SLOTSTREAM_WGPU_FLASH_WORKGROUPS",
    "SLOTSTREAM_WGPU_MERGE_IN_SPLIT",
    "SLOTSTREAM_WGPU_FUSE_NORMS",
    "SLOTSTREAM_WGPU_MATVEC_SPLIT",
    "SLOTSTREAM_WGPU_IMMEDIATES",
    "SLOTSTREAM_WGPU_SUBMIT_THREAD",
    "SLOTSTREAM_WGPU_ROUTE_ROWS",
    "SLOTSTREAM_WGPU_ROUTE_WIDE_ROWS",
    "SLOTSTREAM_WGPU_TIME_INSIDE",
    "SLOTSTREAM_WGPU_FLUSH_AHEAD",
    "SLOTSTREAM_WGPU_UPLOAD_CHUNK_MIB",
    "SLOTSTREAM_WGPU_MAP_PRIMARY",
    "SLOTSTREAM_WGPU_REUSE_STAGING",
    "SLOTSTREAM_WGPU_POOL_SENDS",
    "SLOTSTREAM_WGPU_POOL_WRITE_KB",
    "SLOTSTREAM_WGPU_SHARED_IN_POOL",
    "SLOTSTREAM_WGPU_ROUTE_LANES",
];

/// Why `value` is not what `kind` allows, if it is not.
fn bad_value(kind: Value, value: &str) -> Option<String> {
    match kind {
        Value::Flag if value == "0" || value == "1" => None,
        Value::Flag => Some("0 or 1".into()),
        Value::Words(words) if words.contains(&value) => None,
        Value::Words(words) => Some(words.join(" or ")),
        Value::Path => None,
    }
}

impl WgpuOptions {
    /// Every `SLOTSTREAM_WGPU_*` variable set in `vars` that the backend does
    /// not read, or that holds a value it does not take: a mistyped setting is
    /// an error, not a silent default.
    pub fn check_env(vars: impl IntoIterator<Item = (String, String)>) -> Result<(), String> {
        let mut problems = Vec::new();
        for (name, value) in vars {
            if !name.starts_with("SLOTSTREAM_WGPU_") {
                continue;
            }
            match VARIABLES.iter().find(|(known, _)| *known == name) {
                None if RETIRED.contains(&name.as_str()) => problems.push(format!(
                    "{name} was a measurement setting and is retired: BENCHMARKS.md chose its value (unset it; the settings are {})",
                    VARIABLES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                )),
                None => problems.push(format!(
                    "{name} is not a setting of the wgpu backend (unset it; the settings are {})",
                    VARIABLES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                )),
                Some((_, kind)) => {
                    if let Some(want) = bad_value(*kind, &value) {
                        problems.push(format!("{name}={value:?}: want {want}"));
                    }
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }

    /// [`WgpuOptions::check_env`] on this process's environment.
    pub fn check_process_env() -> Result<(), String> {
        WgpuOptions::check_env(std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned()))))
    }

    /// The defaults, overridden by whichever `SLOTSTREAM_WGPU_*` variables are
    /// set: the one place the wgpu backend reads the environment (values
    /// [`WgpuOptions::check_env`] refuses are left at their defaults here;
    /// opening the backend reports them).
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        let defaults = WgpuOptions::default();
        WgpuOptions {
            matmul: match var("SLOTSTREAM_WGPU_MATMUL").as_deref() {
                Some("exact") => Some(MatmulMode::Exact),
                Some("int8") => Some(MatmulMode::Int8),
                _ => defaults.matmul,
            },
            flash_attention: var("SLOTSTREAM_WGPU_FLASH").map_or(defaults.flash_attention, |v| v != "0"),
            wgsl_dir: var("SLOTSTREAM_WGPU_WGSL_DIR").filter(|v| !v.is_empty()).map(Into::into).or(defaults.wgsl_dir),
            ..defaults
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WgpuOptions;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn mistyped_settings_are_refused() {
        let good = [
            ("SLOTSTREAM_WGPU_FLASH", "0"),
            ("SLOTSTREAM_WGPU_MATMUL", "exact"),
            ("SLOTSTREAM_WGPU_WGSL_DIR", "/tmp/k"),
            ("SLOTSTREAM_OTHER", "x"),
            ("PATH", "/bin"),
        ];
        assert_eq!(WgpuOptions::check_env(vars(&good)), Ok(()));
        let bad = [
            ("SLOTSTREAM_WGPU_FLASH", "yes", "0 or 1"),
            ("SLOTSTREAM_WGPU_FLAHS", "0", "not a setting"),
            ("SLOTSTREAM_WGPU_FLASH_WORKGROUPS", "264", "retired"),
            ("SLOTSTREAM_WGPU_POOL_SENDS", "layer", "retired"),
            ("SLOTSTREAM_WGPU_MATMUL", "fast", "exact or int8"),
        ];
        for (name, value, want) in bad {
            let e = WgpuOptions::check_env(vars(&[(name, value)])).unwrap_err();
            assert!(e.contains(name) && e.contains(want), "{name}={value}: {e}");
        }
    }
}
