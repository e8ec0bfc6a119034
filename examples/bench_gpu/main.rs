//! GPU benchmarks of the wgpu backend (run by `tools/bench_gpu.sh`):
//!
//! (a) effective bandwidth of the 4-bit (and 8-bit) matvec on a matrix far
//!     larger than the L2 cache, against the device's measured copy bandwidth,
//!     with f32 activations (`MatmulMode::Exact`) and int8 ones (`Int8`);
//! (b) decode tokens/s of a model resident on the GPU against its bandwidth
//!     limit (copy bandwidth / bytes read per token);
//! (c) GPU time per decoded token by kernel (entry point) (timestamp queries).
//!
//!     cargo run --release --example bench_gpu -- [--adapter auto] [--model DIR]
//!
//! (d) with `--gemm T:K:N,...`, prefill-sized 4-bit products only (`gemm.rs`);
//! (e) with `--model DIR --chunks N,...`, prefill only, by chunk size, or with
//!     `--depth-decode N` decode after it (`prefill.rs`).
//!
//! `--no-coop` keeps the prefill products off the GPU's matrix units
//! (`wgsl/matmul_coop.wgsl`), `--no-flash-decode` decode steps at long
//! contexts off `wgsl/flash_decode.wgsl`, for before/after comparisons;
//! `--moe-rows N` runs a prefill's MoE calls in parts of about N tokens (0: whole chunks).
//!
//! `BENCH_GPU_SKIP=k1,k2` decodes without those kernels' dispatches (wrong
//! tokens): the time a token saves is what they cost in the chain, untimed;
//! `BENCH_GPU_SKIP_SWEEP=1` does so for each kernel family in turn.

mod args;
mod gemm;
mod prefill;

use std::time::Instant;

use anyhow::{Context, Result};
use slotstream::generate::Engine;
use slotstream::model::{FeedForward, LoadOptions, Logits};
use slotstream::sampling::argmax;
use slotstream_backend::{Backend, DType, HostMatrix, MatrixData};
use slotstream_wgpu::{MatmulMode, Q4Layout, WgpuBackend, WgpuOptions};

use args::{parse_args, Args};

/// Deterministic pseudo-random words.
struct Lcg(u64);

impl Lcg {
    fn word(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 32) as u32
    }
    fn unit(&mut self) -> f32 {
        self.word() as f32 / u32::MAX as f32 - 0.5
    }
}

fn affine_matrix(rng: &mut Lcg, bits: u32, rows: usize, cols: usize) -> HostMatrix<'static> {
    let group_size = 64;
    let words: Vec<u8> = (0..rows * cols * bits as usize / 32).flat_map(|_| rng.word().to_le_bytes()).collect();
    let groups = rows * cols / group_size;
    let halves = |rng: &mut Lcg, s: f32| -> Vec<u8> {
        (0..groups).flat_map(|_| half::bf16::from_f32(rng.unit() * s).to_le_bytes()).collect()
    };
    let scales = halves(rng, 0.02);
    let biases = halves(rng, 0.1);
    HostMatrix {
        experts: 1,
        rows,
        cols,
        data: MatrixData::Affine { bits, group_size, words: words.into(), scale_dtype: DType::BF16, scales: scales.into(), biases: biases.into() },
    }
}

/// Device copy bandwidth in GB/s, counting bytes read plus bytes written.
fn copy_bandwidth(b: &WgpuBackend, mib: usize, reps: usize) -> Result<f64> {
    let floats = mib * 1024 * 1024 / 4;
    let cols = 4096;
    let rows = floats / cols;
    let data: Vec<f32> = (0..rows * cols).map(|i| (i % 977) as f32).collect();
    let x = b.upload(&data, &[rows, cols])?;
    drop(b.slice_rows(&x, 0, rows)?);
    b.sync()?;
    let t = Instant::now();
    for _ in 0..reps {
        drop(b.slice_rows(&x, 0, rows)?);
    }
    b.sync()?;
    let secs = t.elapsed().as_secs_f64();
    Ok(2.0 * (rows * cols * 4) as f64 * reps as f64 / secs / 1e9)
}

/// What one small dispatch costs: `n` dependent adds of `[1, cols]` rows in a
/// row (each reads the previous one's output) at several flush intervals (0:
/// one submission), then `n` independent adds into distinct outputs (no
/// barrier between them); host recording and submission time and wall time
/// per dispatch.
fn dispatch_floor(b: &WgpuBackend, cols: usize, n: usize) -> Result<()> {
    let y = b.upload(&vec![1e-3; cols], &[1, cols])?;
    let report = |what: &str, flush: u32, t: Instant, recorded: f64| {
        let wall = t.elapsed().as_secs_f64();
        let (record, submit, submits) = b.take_host_time();
        let per = |s: f64| 1e6 * s / n as f64;
        println!(
            "dispatch floor (flush every {flush}): {n} {what} adds of {cols} floats: {:.2} us wall per dispatch; host {:.2} us recording + {:.2} us submitting per dispatch ({submits} submissions, all recorded after {:.1} ms)",
            per(wall),
            per(record),
            per(submit),
            1e3 * recorded
        );
    };
    for flush in [16u32, 0, 64, 256] {
        b.set_flush_every(flush);
        let mut x = b.upload(&vec![0.0; cols], &[1, cols])?;
        b.sync()?;
        b.take_host_time();
        let t = Instant::now();
        for _ in 0..n {
            x = b.add(&x, &y)?;
        }
        let recorded = t.elapsed().as_secs_f64();
        b.sync()?;
        report("dependent", flush, t, recorded);
    }
    for flush in [16u32, 64] {
        b.set_flush_every(flush);
        b.sync()?;
        b.take_host_time();
        let t = Instant::now();
        let outs: Vec<_> = (0..n).map(|_| b.add(&y, &y)).collect::<Result<_, _>>()?;
        let recorded = t.elapsed().as_secs_f64();
        b.sync()?;
        report("independent", flush, t, recorded);
        drop(outs);
    }
    // The same dependent chain timed by timestamp queries (inside one pass,
    // or a pass per dispatch, as the kernel profiles below): what a profile
    // counts for a kernel that does almost nothing.
    if b.set_profiling(true).is_ok() {
        b.set_flush_every(64);
        let mut x = b.upload(&vec![0.0; cols], &[1, cols])?;
        for _ in 0..n.min(1000) {
            x = b.add(&x, &y)?;
        }
        b.sync()?;
        let prof = b.kernel_profile();
        b.set_profiling(false)?;
        let (secs, count) = prof.iter().fold((0.0, 0), |(s, c), (_, t)| (s + t.seconds, c + t.dispatches));
        println!(
            "dispatch floor, timestamped {}: {count} dependent adds: {:.2} us per dispatch by timestamps",
            timed_how(b),
            1e6 * secs / count.max(1) as f64
        );
    }
    Ok(())
}

/// A one-token product: the weight, its input and the bytes counted per
/// product (packed weights with scales and biases, x as f32, the output).
struct Matvec {
    w: slotstream_backend::Weight,
    x: slotstream_backend::Tensor,
    bytes: f64,
}

fn matvec_case(b: &WgpuBackend, bits: u32, rows: usize, cols: usize) -> Result<Matvec> {
    let mut rng = Lcg(bits as u64);
    let m = affine_matrix(&mut rng, bits, rows, cols);
    let w = b.load_weight(&m)?;
    let x = b.upload(&(0..cols).map(|_| rng.unit()).collect::<Vec<_>>(), &[1, cols])?;
    let bytes = (w.bytes + 4 * cols + 4 * rows) as f64;
    Ok(Matvec { w, x, bytes })
}

/// (wall GB/s, kernel-only GB/s, dispatches per product) of `x @ W^T` for one
/// token; kernel-only time is every kernel a product dispatches (int8 mode:
/// quantizing x, then the matvec).
fn matvec_bandwidth(b: &WgpuBackend, mv: &Matvec, reps: usize) -> Result<(f64, f64, f64)> {
    drop(b.matmul(&mv.x, &mv.w)?);
    b.sync()?;
    let t = Instant::now();
    for _ in 0..reps {
        drop(b.matmul(&mv.x, &mv.w)?);
    }
    b.sync()?;
    let wall = t.elapsed().as_secs_f64() / reps as f64;
    let (kernel, dispatches) = match b.set_profiling(true) {
        Ok(()) => {
            for _ in 0..reps {
                drop(b.matmul(&mv.x, &mv.w)?);
            }
            b.sync()?;
            let prof = b.kernel_profile();
            b.set_profiling(false)?;
            let secs: f64 = prof.iter().map(|(_, t)| t.seconds).sum();
            let n: u64 = prof.iter().map(|(_, t)| t.dispatches).sum();
            (secs / reps as f64, n as f64 / reps as f64)
        }
        Err(_) => (f64::NAN, f64::NAN),
    };
    Ok((mv.bytes / wall / 1e9, mv.bytes / kernel / 1e9, dispatches))
}

/// The backend with `options`, with or without bounds checks.
fn open_with(args: &Args, checked: bool, options: WgpuOptions) -> Result<WgpuBackend> {
    Ok(if checked {
        WgpuBackend::with_options(&args.adapter, options)?
    } else {
        // SAFETY: the same kernels and inputs ran with bounds checks first.
        unsafe { WgpuBackend::with_options_unchecked(&args.adapter, options)? }
    })
}

/// The backend in exact mode with the default settings.
fn open(args: &Args, checked: bool) -> Result<WgpuBackend> {
    open_with(args, checked, WgpuOptions { matmul: Some(MatmulMode::Exact), ..WgpuOptions::from_env() })
}

/// `fused`: projections over one input concatenated into one matmul and
/// one-row column slices as views (the default); off: one matmul per
/// projection and a copy per slice (the code before).
#[allow(clippy::too_many_arguments)]
fn decode_bench(args: &Args, dir: &std::path::Path, copy_gbs: f64, checked: bool, layout: &str, flushes: &[u32], fused: bool) -> Result<()> {
    println!(
        "== decode, kernels {} bounds checks, 4-bit layout {layout}, {}",
        if checked { "with" } else { "without" },
        if fused { "fused projections + views" } else { "separate projections + slice copies" }
    );
    std::env::set_var("SLOTSTREAM_FUSED_PROJECTIONS", if fused { "1" } else { "0" });
    // The 4-bit layout: the MLX order (the kernel before interleaving) or interleaved (the default).
    let q4_layout = if layout == "mlx" { Q4Layout::Mlx } else { Q4Layout::Interleaved };
    let options = WgpuOptions { matmul: Some(MatmulMode::Exact), q4_layout, views: fused, flash_decode: args.flash_decode, ..WgpuOptions::from_env() };
    // Decode runs in the CLI's default mode for a GPU (SLOTSTREAM_WGPU_MATMUL overrides).
    let gpu = open_with(args, checked, options)?;
    let gpu = gpu.with_matmul_mode(MatmulMode::from_env(MatmulMode::Int8));
    println!("matmul mode: {:?}", gpu.matmul_mode());
    let handle = gpu.clone();
    let t = Instant::now();
    let e = Engine::load(dir, Box::new(gpu), &LoadOptions { preload_experts: true, ..LoadOptions::default() }.with_env_overrides()?).with_context(|| format!("loading {}", dir.display()))?;
    println!("model: {} ({}), loaded in {:.1} s", dir.display(), e.arch().text.model_type, t.elapsed().as_secs_f64());
    let moe_layers = e.model.layers.iter().filter(|l| matches!(l.ffn, FeedForward::Moe(_))).count();
    let record = e.model.experts.lock().map_err(|_| anyhow::anyhow!("expert cache poisoned"))?.store().record_bytes as usize;
    let embed_read = if std::ptr::eq(&e.model.embed, &e.model.lm_head) { 0 } else { e.model.embed.bytes };
    let per_token = e.model.resident_bytes - embed_read + moe_layers * e.arch().text.num_experts_per_tok * record;
    // Warm up (every expert was read at load): the prompt the decode follows.
    let mut rng = Lcg(7);
    let prompt: Vec<u32> = (0..args.prompt).map(|_| rng.word() % e.vocab_size() as u32).collect();
    let mut state = e.new_state()?;
    // The load's last staged uploads land at the first wait: timed apart from the prompt.
    let t = Instant::now();
    handle.sync()?;
    println!("uploads landed {:.3} s after the load returned ({} upload submissions)", t.elapsed().as_secs_f64(), handle.upload_submissions());
    // BENCH_GPU_HEAT=1: a busy GPU first (1 GiB copies for ~0.3 s), to tell
    // a clock that has not ramped up from a first use of the prefill's work.
    if std::env::var_os("BENCH_GPU_HEAT").is_some() {
        let t = Instant::now();
        let gbs = copy_bandwidth(&handle, 1024, 60)?;
        println!("heated the GPU for {:.2} s ({gbs:.0} GB/s copies)", t.elapsed().as_secs_f64());
    }
    // BENCH_GPU_PROFILE_COLD=1: the cold prefill by kernel (timed).
    let cold_profile = std::env::var_os("BENCH_GPU_PROFILE_COLD").is_some();
    handle.set_profiling(cold_profile)?;
    handle.take_host_time();
    handle.take_creations();
    let t = Instant::now();
    let logits = e.prefill(&prompt, &mut state)?;
    println!("prefill: {} tokens in {:.3} s (cold){}", prompt.len(), t.elapsed().as_secs_f64(), host_costs(&handle));
    if cold_profile {
        let prof = handle.kernel_profile();
        handle.set_profiling(false)?;
        println!("kernel time of the cold prefill by kernel:");
        print_profile(&prof, 1, "ms");
    }
    let mut next = argmax(&logits);
    // Host seconds until `forward` returns (recording and submitting the token).
    let forward_secs = std::cell::Cell::new(0.0f64);
    // As the engine decodes greedy tokens: one ahead where it can (each step
    // records the pass of a token chosen on the device, then reads back the
    // token the step before chose; SLOTSTREAM_DECODE_AHEAD=0 to compare).
    let b = e.backend.as_ref();
    let ahead = e.decode_ahead && b.keeps_chosen_tokens() && e.model.feeds_chosen_tokens(&state);
    println!("decoding one token ahead: {ahead}");
    let pending = std::cell::RefCell::new(None::<(slotstream_backend::Tensor, slotstream_backend::chosen::PendingRead)>);
    let step = |next: &mut u32, state: &mut slotstream::model::SequenceState| -> Result<()> {
        let t0 = Instant::now();
        if !ahead {
            let t = e.model.forward(b, &[*next], state, Logits::Last)?;
            forward_secs.set(forward_secs.get() + t0.elapsed().as_secs_f64());
            *next = argmax(&b.download(&t)?);
            return Ok(());
        }
        let before = pending.borrow_mut().take();
        let logits = match &before {
            Some((chosen, _)) => e.model.forward_chosen(b, chosen, state)?,
            None => e.model.forward(b, &[*next], state, Logits::Last)?,
        };
        let chosen = b.choose_greedy(&logits)?;
        let read = b.start_reading_chosen(&chosen)?;
        forward_secs.set(forward_secs.get() + t0.elapsed().as_secs_f64());
        if let Some((_, read)) = before {
            *next = b.finish_reading_chosen(read)?;
        }
        *pending.borrow_mut() = Some((chosen, read));
        Ok(())
    };
    // BENCH_GPU_SKIP=k1,k2: decode without those kernels' dispatches (wrong
    // tokens; the time saved is what they cost in the chain). Prefill runs them.
    let skip: Vec<String> = std::env::var("BENCH_GPU_SKIP").unwrap_or_default().split(',').filter(|k| !k.is_empty()).map(String::from).collect();
    handle.skip_kernels(&skip.iter().map(String::as_str).collect::<Vec<_>>())?;
    if !skip.is_empty() {
        println!("decoding without the dispatches of {skip:?} (wrong tokens)");
    }
    for i in 0..8 {
        let t = Instant::now();
        step(&mut next, &mut state)?;
        if i < 2 || std::env::var_os("BENCH_GPU_EVERY_STEP").is_some() {
            println!("decode step {i} after the cold prefill: {:.2} ms{}", 1e3 * t.elapsed().as_secs_f64(), host_costs(&handle));
        }
    }
    let mut last_tps = 0.0;
    for &flush in flushes {
        handle.set_flush_every(flush);
        step(&mut next, &mut state)?;
        e.model.experts.lock().map_err(|_| anyhow::anyhow!("expert cache poisoned"))?.reset_stats();
        handle.take_host_time();
        handle.take_thread_time();
        forward_secs.set(0.0);
        let t = Instant::now();
        for _ in 0..args.decode {
            step(&mut next, &mut state)?;
        }
        let secs = t.elapsed().as_secs_f64();
        let stats = e.expert_stats()?;
        let tps = args.decode as f64 / secs;
        let limit = copy_gbs * 1e9 / per_token as f64;
        println!(
            "decode (flush every {flush} dispatches): {tps:.1} tok/s ({:.2} ms/token) over {} tokens; {:.1} MB read per token -> {:.0} GB/s effective; \
             bandwidth limit {limit:.0} tok/s -> {:.2}% of it; expert hit rate {:.3} ({} misses)",
            1e3 / tps,
            args.decode,
            per_token as f64 / 1e6,
            per_token as f64 * tps / 1e9,
            100.0 * tps / limit,
            stats.total.hit_rate(),
            stats.total.misses
        );
        let (record, submit, submits) = handle.take_host_time();
        let thread = handle.take_thread_time();
        let per = |x: f64| 1e3 * x / args.decode as f64;
        println!(
            "  host per token: forward returns after {:.2} ms; recording dispatches {:.2} ms, submitting {:.2} ms ({:.1} submissions); \
             the submission thread {:.2} ms",
            per(forward_secs.get()),
            per(record),
            per(submit),
            submits as f64 / args.decode as f64,
            per(thread)
        );
        last_tps = tps;
    }
    handle.set_profiling(true)?;
    let n = args.decode.min(16);
    for _ in 0..n {
        step(&mut next, &mut state)?;
    }
    let prof = handle.kernel_profile();
    handle.set_profiling(false)?;
    handle.skip_kernels(&[])?;
    println!("kernel time per token by kernel ({n} tokens, timestamp queries {}; wall per token {:.2} ms untimed):", timed_how(&handle), 1e3 / last_tps);
    print_profile(&prof, n, "ms/token");
    // BENCH_GPU_SKIP_SWEEP=1: each kernel family of that profile left out in
    // turn (wrong tokens): what it costs a token untimed, against the full
    // token decoded between. Each measurement decodes a fresh sequence of the
    // prompt, so all of them run at the same context depth.
    if std::env::var_os("BENCH_GPU_SKIP_SWEEP").is_some() {
        let timed = |skip: &[&str]| -> Result<f64> {
            // A token chosen ahead in the sequence before is not this one's.
            if let Some((_, read)) = pending.borrow_mut().take() {
                b.finish_reading_chosen(read)?;
            }
            let mut fresh = e.new_state()?;
            let mut token = argmax(&e.prefill(&prompt, &mut fresh)?);
            handle.skip_kernels(skip)?;
            for _ in 0..4 {
                step(&mut token, &mut fresh)?;
            }
            let t = Instant::now();
            for _ in 0..args.decode {
                step(&mut token, &mut fresh)?;
            }
            handle.skip_kernels(&[])?;
            Ok(1e3 * t.elapsed().as_secs_f64() / args.decode as f64)
        };
        println!("what each kernel family costs a decoded token untimed ({} tokens each; the full token timed before each):", args.decode);
        println!("  {:<26} {:>10} {:>10} {:>12}", "left out", "ms/token", "full", "saved");
        for (family, t) in &prof {
            let full = timed(&[])?;
            let without = timed(&[family.as_str()])?;
            println!("  {family:<26} {without:>10.3} {full:>10.3} {:>9.3} ms ({} dispatches)", full - without, t.dispatches / n as u64);
        }
    }
    // Prefill of the same prompt in a fresh sequence: untimed, then by kernel.
    // A prompt of another length next: the first use of its shapes.
    for (what, n) in [("again", prompt.len()), ("of a new length", prompt.len().saturating_sub(37).max(1)), ("again", prompt.len())] {
        let mut fresh = e.new_state()?;
        handle.sync()?;
        handle.take_host_time();
        handle.take_creations();
        let t = Instant::now();
        drop(e.prefill(&prompt[..n], &mut fresh)?);
        let secs = t.elapsed().as_secs_f64();
        println!("prefill {what}: {n} tokens in {secs:.3} s = {:.0} tok/s{}", n as f64 / secs, host_costs(&handle));
    }
    // As llama-bench's pp256 @ d432: a sequence already holding `depth`
    // tokens (untimed) takes `pp` more, warm; the median of three.
    let (depth, pp) = (args.depth, args.pp);
    let more: Vec<u32> = (0..depth + pp).map(|_| rng.word() % e.vocab_size() as u32).collect();
    let mut rates = Vec::new();
    for _ in 0..3 {
        let mut st = e.new_state()?;
        drop(e.prefill(&more[..depth], &mut st)?);
        handle.sync()?;
        let t = Instant::now();
        drop(e.prefill(&more[depth..], &mut st)?);
        rates.push(pp as f64 / t.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    println!("prefill pp{pp} @ d{depth} (warm, median of 3): {:.0} tok/s ({:.0} / {:.0} / {:.0})", rates[1], rates[0], rates[1], rates[2]);
    let mut fresh = e.new_state()?;
    handle.set_profiling(true)?;
    drop(e.prefill(&prompt, &mut fresh)?);
    let prof = handle.kernel_profile();
    handle.set_profiling(false)?;
    println!("kernel time of one {}-token prefill by kernel (timestamp queries {}):", prompt.len(), timed_how(&handle));
    print_profile(&prof, 1, "ms");
    Ok(())
}

/// Host time and first-use creations since the last look, for a line.
fn host_costs(b: &WgpuBackend) -> String {
    let (record, submit, submits) = b.take_host_time();
    let (buffers, bytes, groups) = b.take_creations();
    format!(
        "; host recording {:.1} ms, submitting {:.1} ms ({submits} submissions); created {buffers} buffers ({:.1} MB), {groups} bind groups",
        1e3 * record,
        1e3 * submit,
        bytes as f64 / 1e6
    )
}

/// How profiles time a dispatch on `b`.
fn timed_how(b: &WgpuBackend) -> &'static str {
    if b.profiles_inside_passes() {
        "inside one pass, the barrier before each dispatch included"
    } else {
        "a pass per dispatch"
    }
}

/// The kernel table of a profile over `n` units (tokens, or one prefill).
fn print_profile(prof: &[(String, slotstream_wgpu::FamilyTime)], n: usize, unit: &str) {
    let total: f64 = prof.iter().map(|(_, t)| t.seconds).sum();
    println!("  {:<18} {:>10} {:>12} {:>7}", "kernel", unit, "dispatches", "share");
    for (family, t) in prof {
        println!(
            "  {family:<18} {:>10.3} {:>12} {:>6.1}%",
            1e3 * t.seconds / n as f64,
            t.dispatches / n as u64,
            100.0 * t.seconds / total
        );
    }
    println!("  {:<14} {:>10.3}", "all kernels", 1e3 * total / n as f64);
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let env = WgpuOptions::from_env();
    let moe_rows = args.moe_rows.unwrap_or(env.moe_rows);
    let b = open_with(&args, true, WgpuOptions { matmul: Some(MatmulMode::Exact), coop_matrix: args.coop, flash_decode: args.flash_decode, moe_rows, ..env })?;
    println!("device: {} (subgroup sizes {:?}; parameters as {})", b.name(), b.subgroup_sizes(), if b.immediates() { "immediates" } else { "uniform buffers" });
    if !args.gemm.is_empty() {
        return gemm::bench(&b, &args.gemm, args.reps);
    }
    if let (Some(dir), false) = (&args.model, args.chunks.is_empty()) {
        return prefill::bench(&b, dir, args.prompt, &args.chunks, args.depth_decode);
    }
    let copy_engine = copy_bandwidth(&b, args.copy_mib, 20)?;
    println!("copy_buffer_to_buffer bandwidth: {copy_engine:.0} GB/s (read + write, {} MiB buffer)", args.copy_mib);
    // The reference ceiling: a copy measured outside wgpu (tools/bench_gpu.sh passes
    // PyTorch's device-to-device copy), else wgpu's own buffer copy.
    let copy = match std::env::var("REFERENCE_COPY_GBS").ok().and_then(|v| v.parse::<f64>().ok()) {
        Some(gbs) => {
            println!("reference copy bandwidth: {gbs:.0} GB/s (REFERENCE_COPY_GBS)");
            gbs
        }
        None => copy_engine,
    };
    dispatch_floor(&b, 2048, 2000)?;
    drop(b);
    // The same number of weight bytes in three shapes (the default, long rows,
    // short rows), the lm_head and the small shapes of the decode benchmark's
    // model, 4-bit interleaved, each in exact mode (f32 activations, before)
    // and int8 mode (after; below INT8_MIN_BYTES that is the exact kernel, so
    // those shapes also run with the int8 kernel forced), then 8-bit (the
    // exact kernel in both modes).
    let (r, c) = (args.rows, args.cols);
    let shapes = [(4, r, c), (4, r / 4, c * 4), (4, r * 4, c / 4), (4, 151936, 2048), (4, 3072, 2048), (4, 512, 2048), (8, r, c)];
    for checked in [true, false].into_iter().filter(|_| args.matvec) {
        let b = open(&args, checked)?;
        for (bits, rows, cols) in shapes {
            // Small matrices sit in L2: time them with more repetitions.
            let reps = if rows * cols < 1 << 24 { args.reps * 4 } else { args.reps };
            let mv = matvec_case(&b, bits, rows, cols)?;
            let exact_out = b.download(&b.matmul(&mv.x, &mv.w)?)?;
            // Int8 mode leaves weights under INT8_MIN_BYTES exact; "int8 forced" lowers that to 0.
            let small = mv.w.bytes < slotstream_wgpu::INT8_MIN_BYTES;
            let mut modes = vec![("exact", MatmulMode::Exact, slotstream_wgpu::INT8_MIN_BYTES)];
            if bits == 4 {
                modes.push(("int8", MatmulMode::Int8, slotstream_wgpu::INT8_MIN_BYTES));
                if small {
                    modes.push(("int8 forced", MatmulMode::Int8, 0));
                }
            }
            for (label, mode, min_bytes) in modes {
                let bm = b.with_matmul_mode(mode).with_int8_min_bytes(min_bytes);
                let out = bm.download(&bm.matmul(&mv.x, &mv.w)?)?;
                let (num, den) = out.iter().zip(&exact_out).fold((0.0f64, 0.0f64), |(n, d), (a, e)| {
                    (n + ((a - e) as f64).powi(2), d + (*e as f64).powi(2))
                });
                let (wall, kernel, dispatches) = matvec_bandwidth(&bm, &mv, reps)?;
                println!(
                    "matvec q{bits} g64 {label} [{rows} x {cols}] ({:.1} MB, bounds checks {}): {wall:.0} GB/s wall ({:.1}% of copy), \
                     {kernel:.0} GB/s kernel-only ({:.1}% of copy), {:.1} us/product ({dispatches:.0} dispatches); rel L2 vs exact {:.2e}",
                    mv.bytes / 1e6,
                    if checked { "on" } else { "off" },
                    100.0 * wall / copy,
                    100.0 * kernel / copy,
                    mv.bytes / (kernel * 1e9) * 1e6,
                    (num / den.max(f64::MIN_POSITIVE)).sqrt()
                );
            }
        }
    }
    if let Some(dir) = &args.model {
        // Before: MLX order, one submission per host read; after: interleaved,
        // several flush intervals (the last one listed is profiled, and used without bounds checks).
        // Before: separate projections and slice copies; after: fused
        // projections and views; each with and without bounds checks.
        let best = *args.flushes.last().unwrap_or(&16);
        if std::env::var("BENCH_SKIP_BEFORE").is_err() {
            decode_bench(&args, dir, copy, true, "interleaved", &[best], false)?;
        }
        decode_bench(&args, dir, copy, true, "interleaved", &args.flushes, true)?;
        if std::env::var("BENCH_SKIP_BEFORE").is_err() {
            decode_bench(&args, dir, copy, false, "interleaved", &[best], false)?;
        }
        decode_bench(&args, dir, copy, false, "interleaved", &[best], true)?;
    }
    Ok(())
}
