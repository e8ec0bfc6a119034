//! bench_gpu's command line (see main.rs for what each mode measures).

use anyhow::{bail, Context, Result};
use slotstream_wgpu::AdapterChoice;

use super::gemm;

pub struct Args {
    pub adapter: AdapterChoice,
    pub model: Option<std::path::PathBuf>,
    pub copy_mib: usize,
    pub rows: usize,
    pub cols: usize,
    pub reps: usize,
    pub prompt: usize,
    pub decode: usize,
    /// Flush intervals (dispatches per submission, `WgpuOptions::flush_every`) to time decode with (after).
    pub flushes: Vec<u32>,
    /// Time the one-token products of several shapes (`--no-matvec` skips them).
    pub matvec: bool,
    /// The warm prefill measurement: `pp` tokens after `depth` (llama-bench's `-p` and `-d`).
    pub depth: usize,
    pub pp: usize,
    pub gemm: Vec<(usize, usize, usize)>,
    pub chunks: Vec<usize>,
    /// With --chunks: greedy tokens decoded after each timed prefill.
    pub depth_decode: usize,
    /// Prefill products on the matrix units where the adapter has them (`--no-coop`: never).
    pub coop: bool,
    /// A decode step over a long f16 cache takes `flash_decode` (`--no-flash-decode`: `flash_attention`).
    pub flash_decode: bool,
    /// Tokens per part of a prefill's MoE call (`--moe-rows`, 0: the whole chunk; `WgpuOptions::moe_rows`).
    pub moe_rows: Option<usize>,
}

pub fn parse_args() -> Result<Args> {
    let mut a = Args { adapter: AdapterChoice::auto(), model: None, copy_mib: 1024, rows: 65536, cols: 8192, reps: 50, prompt: 256, decode: 64, flushes: vec![0, 8, 12, 24, 16], depth: 432, pp: 256, matvec: true, gemm: Vec::new(), chunks: Vec::new(), depth_decode: 0, coop: true, flash_decode: true, moe_rows: None };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--adapter" => a.adapter = value()?.parse()?,
            "--model" => a.model = Some(value()?.into()),
            "--copy-mib" => a.copy_mib = value()?.parse()?,
            "--rows" => a.rows = value()?.parse()?,
            "--cols" => a.cols = value()?.parse()?,
            "--reps" => a.reps = value()?.parse()?,
            "--prompt" => a.prompt = value()?.parse()?,
            "--decode" => a.decode = value()?.parse()?,
            "--depth" => a.depth = value()?.parse()?,
            "--pp" => a.pp = value()?.parse()?,
            "--flush" => a.flushes = value()?.split(',').map(|v| v.trim().parse()).collect::<Result<_, _>>()?,
            "--no-matvec" => a.matvec = false,
            "--no-coop" => a.coop = false,
            "--no-flash-decode" => a.flash_decode = false,
            "--moe-rows" => a.moe_rows = Some(value()?.parse()?),
            "--gemm" => a.gemm = gemm::parse_shapes(&value()?)?,
            "--depth-decode" => a.depth_decode = value()?.parse()?,
            "--chunks" => a.chunks = value()?.split(',').map(|v| v.trim().parse()).collect::<Result<_, _>>()?,
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}
