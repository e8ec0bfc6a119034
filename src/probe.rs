//! A short, bounded measurement of this machine's rates for the plan's
//! decode-speed estimate (`slotstream doctor --measure`):
//!
//! - the disk: batches of a model's own expert records read as the streamer
//!   reads a layer's misses (`O_DIRECT`, every piece its own read, many in
//!   flight), one expert and a token's worth (top-k) at a time; the two
//!   medians give a rate and a latency. At most [`ProbeLimits::disk_bytes`].
//! - the backend: one-token matmuls over a resident matrix in the model's
//!   expert format, larger than CPU caches (weight GB/s), and the bundled
//!   demo model decoding a few tokens (what a layer costs besides its weights).
//! - a missed expert: the model itself decoding a few dozen tokens from a
//!   small pool (the knee's share, within [`ProbeLimits::miss_pool_bytes`]);
//!   what a token took beyond its compute (at most its time not waiting on
//!   reads) and its layers' read latencies, per miss, is what a miss costs a
//!   real decode (reads, the uploads the reads in flight do not hide,
//!   bookkeeping). Both parts are kept for the model. Its hit rate is kept
//!   for the plan as a streaming run's is.
//!
//! The results are kept in `rates.json` ([`crate::plan::RateCache`]) and used
//! by every later plan on this machine, disk and backend.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use slotstream_backend::{Backend, DType, HostMatrix, MatrixData, MatrixFormat};

use crate::experts::{ExpertStore, ExpertTensors};
use crate::generate::{Engine, GenerateRequest};
use crate::model::{LoadOptions, ModelArch};
use crate::plan::rates::{self, ComputeRates, DiskRates, Measured, RateCache, RateKeys, RateSource};
use crate::plan::{ModelCosts, Rates};

mod misses;
pub use misses::{measure_misses, miss_probe_pool, MissProbe, MIN_MISS_DECODE_STEPS};

/// How much a probe may read and run.
#[derive(Clone, Debug)]
pub struct ProbeLimits {
    /// Expert bytes the disk probe reads at most.
    pub disk_bytes: u64,
    /// Read batches at most (each one expert or one token's experts).
    pub disk_batches: usize,
    /// Stop issuing batches after this long (one batch may finish after it).
    pub disk_seconds: f64,
    /// Size of the matrix the weight rate is timed on.
    pub matmul_bytes: usize,
    /// Timed matmul passes at most, and the time after which no pass starts.
    pub matmul_passes: usize,
    pub matmul_seconds: f64,
    /// Tokens the demo model decodes.
    pub decode_tokens: usize,
    /// The model's own decode from a small pool: its pool's bytes at most,
    /// tokens at most, and the time after which no token starts (after at
    /// least [`MIN_MISS_DECODE_STEPS`]).
    pub miss_pool_bytes: u64,
    pub miss_decode_tokens: usize,
    pub miss_decode_seconds: f64,
    /// The prompt's prefill from that pool reads about this long at most at
    /// the disk's measured rate (the prompt's last tokens are kept).
    pub miss_prefill_seconds: f64,
}

impl Default for ProbeLimits {
    fn default() -> ProbeLimits {
        ProbeLimits {
            disk_bytes: 256 << 20,
            disk_batches: 400,
            disk_seconds: 1.5,
            matmul_bytes: 128 << 20,
            matmul_passes: 40,
            matmul_seconds: 0.6,
            decode_tokens: 48,
            miss_pool_bytes: 1 << 30,
            miss_decode_tokens: 256,
            miss_decode_seconds: 3.0,
            miss_prefill_seconds: 3.0,
        }
    }
}

/// What the disk probe measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DiskProbe {
    pub rates: DiskRates,
    pub bytes_read: u64,
    pub batches: usize,
    pub seconds: f64,
    /// Whether reads bypassed the page cache (else the figures are the page
    /// cache's, and say little about the disk).
    pub direct_io: bool,
    /// Experts per batch: one, and a token's worth.
    pub batch_experts: [usize; 2],
}

/// What the backend probe measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ComputeProbe {
    pub rates: ComputeRates,
    pub backend: String,
    pub matmul_bytes: usize,
    pub matmul_passes: usize,
    pub demo_decode_tokens_per_second: f64,
}

/// The routed experts of `arch`'s checkpoint, located as the model's loader
/// locates them (no weights are read).
fn expert_store(arch: &ModelArch) -> Result<ExpertStore> {
    let ck = arch.open_checkpoint()?;
    let mut prefixes = BTreeSet::new();
    let mut tensors = ExpertTensors::PerExpert;
    for name in ck.names() {
        if let Some(i) = name.find(".switch_mlp.") {
            prefixes.insert(name[..i].to_string());
            tensors = ExpertTensors::Stacked;
        } else if let Some(i) = name.find(".mlp.experts.") {
            prefixes.insert(name[..i + ".mlp".len()].to_string());
            if name.ends_with(".experts.gate_up_proj") {
                tensors = ExpertTensors::Fused;
            }
        }
    }
    if prefixes.is_empty() {
        bail!("{} has no routed experts to read", arch.dir.display());
    }
    let prefixes: Vec<String> = prefixes.into_iter().collect();
    let c = &arch.text;
    // As many reads in flight as the model's runs will have.
    let threads = LoadOptions::default().with_env_overrides()?.read_threads;
    ExpertStore::new(&ck, &prefixes, tensors, c.num_experts, c.hidden_size, c.moe_intermediate_size, threads, &[])
}

fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

/// The disk's rates for `arch`'s expert files.
pub fn measure_disk(arch: &ModelArch, limits: &ProbeLimits) -> Result<DiskProbe> {
    let store = expert_store(arch).with_context(|| format!("measuring expert reads from {}", arch.dir.display()))?;
    let record = store.record_bytes.max(1);
    let top_k = arch.text.num_experts_per_tok.clamp(1, store.experts_per_layer);
    let large = top_k.min((limits.disk_bytes / record) as usize);
    if large == 0 {
        bail!("one expert record ({record} bytes) is more than the probe may read ({} bytes)", limits.disk_bytes);
    }
    let sizes = [1, large];
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut rng = ChaCha8Rng::seed_from_u64(0x5107_57ea);
    let (start, mut bytes, mut batches) = (Instant::now(), 0u64, 0usize);
    while batches < limits.disk_batches {
        let which = batches % 2;
        let n = sizes[which];
        let batch_bytes = n as u64 * record;
        let out_of_time = batches >= 4 && start.elapsed().as_secs_f64() >= limits.disk_seconds;
        if bytes + batch_bytes > limits.disk_bytes || out_of_time {
            break;
        }
        let layer = rng.random_range(0..store.layers);
        let experts: Vec<u32> = rand::seq::index::sample(&mut rng, store.experts_per_layer, n).iter().map(|e| e as u32).collect();
        let (_records, seconds) = store.read_many(layer, &experts)?;
        // The first two batches wake the read threads and are not timed.
        if batches >= 2 {
            times[which].push(seconds);
        }
        bytes += batch_bytes;
        batches += 1;
    }
    let (Some(one), Some(many)) = (median(&mut times[0]), median(&mut times[1])) else {
        bail!("the read budget ({} bytes) left too few batches of {record}-byte experts to time", limits.disk_bytes);
    };
    Ok(DiskProbe {
        rates: fit_reads(record, large, one, many),
        bytes_read: bytes,
        batches,
        seconds: start.elapsed().as_secs_f64(),
        direct_io: store.direct_io(),
        batch_experts: sizes,
    })
}

/// Rate and latency from the time of one expert's reads (`one`) and of
/// `n` experts' (`many`): time = latency + bytes / rate. Where `n` experts
/// take no longer than one (small records, reads in parallel), the time is
/// all latency.
pub fn fit_reads(record: u64, n: usize, one: f64, many: f64) -> DiskRates {
    let record = record as f64;
    let extra = many - one;
    if n > 1 && extra > 0.02 * one && extra > 0.0 {
        let read_gbps = (n - 1) as f64 * record / extra / 1e9;
        let read_latency_ms = (one - record / (read_gbps * 1e9)).max(0.0) * 1e3;
        DiskRates { read_gbps, read_latency_ms }
    } else {
        // Bytes cost nothing measurable next to the latency: a rate no
        // expert read in this estimate can feel.
        let read_gbps = (n as f64 * record / many.max(1e-9) / 1e9).max(100.0);
        DiskRates { read_gbps, read_latency_ms: many.max(one) * 1e3 }
    }
}

/// A `rows x cols` matrix in `format` whose values do not matter (the time
/// of a matmul does not depend on them): 0.01-scaled, zero-biased.
fn probe_matrix(format: &MatrixFormat, bytes: usize) -> HostMatrix<'static> {
    let cols = 4096;
    let scale = |dtype: DType, n: usize| -> Vec<u8> {
        let one: Vec<u8> = match dtype {
            DType::F32 => 0.01f32.to_le_bytes().to_vec(),
            DType::F16 => half::f16::from_f32(0.01).to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f32(0.01).to_le_bytes().to_vec(),
        };
        one.repeat(n)
    };
    match *format {
        MatrixFormat::Dense(dtype) => {
            let rows = (bytes / (cols * dtype.size())).max(64);
            HostMatrix { experts: 1, rows, cols, data: MatrixData::Dense { dtype, bytes: Cow::Owned(vec![0; rows * cols * dtype.size()]) } }
        }
        MatrixFormat::Affine { bits, group_size, scale_dtype } => {
            let groups = cols / group_size.max(1);
            let row_bytes = cols * bits as usize / 8 + 2 * groups * scale_dtype.size();
            let rows = (bytes / row_bytes).max(64);
            let data = MatrixData::Affine {
                bits,
                group_size,
                words: Cow::Owned(vec![0x5a; rows * cols * bits as usize / 8]),
                scale_dtype,
                scales: Cow::Owned(scale(scale_dtype, rows * groups)),
                biases: Cow::Owned(vec![0; rows * groups * scale_dtype.size()]),
            };
            HostMatrix { experts: 1, rows, cols, data }
        }
    }
}

/// Weight bytes per second of one-token matmuls over a matrix in `format`:
/// (rate, bytes of the matrix, passes timed).
fn time_matmul(backend: &dyn Backend, format: &MatrixFormat, limits: &ProbeLimits) -> Result<(f64, usize, usize)> {
    let host = probe_matrix(format, limits.matmul_bytes);
    let weight = backend.load_weight(&host).context("loading the probe's matrix")?;
    drop(host);
    let x = backend.upload(&vec![0.5; weight.cols], &[1, weight.cols])?;
    // One untimed pass: first-use costs (pipelines, page faults).
    backend.download(&backend.matmul(&x, &weight)?)?;
    let start = Instant::now();
    let mut passes = 0;
    let mut last = None;
    while passes < limits.matmul_passes.max(1) && (passes < 2 || start.elapsed().as_secs_f64() < limits.matmul_seconds) {
        last = Some(backend.matmul(&x, &weight)?);
        passes += 1;
    }
    if let Some(y) = last {
        backend.download(&y)?; // waits for a device's queue
    }
    let seconds = start.elapsed().as_secs_f64().max(1e-9);
    Ok((weight.bytes as f64 * passes as f64 / seconds / 1e9, weight.bytes, passes))
}

/// The backend's rates for weights stored as `format`: the matmul rate, and
/// the layer cost left of the demo model's decode time once its weights
/// are paid at that rate.
/// The backend comes back for the next probe.
pub fn measure_compute(backend: Box<dyn Backend>, format: &MatrixFormat, limits: &ProbeLimits) -> Result<(ComputeProbe, Box<dyn Backend>)> {
    let name = backend.name();
    let demo = ModelArch::read(&crate::demo::model_dir()?)?;
    let demo_costs = ModelCosts::of(&demo, backend.kv_cache_type())?;
    let options = LoadOptions { preload_experts: true, ..Default::default() }.with_env_overrides()?;
    let engine = Engine::load_arch(&demo, backend, &options).context("loading the demo model to time its decoding")?;
    let (weight_gbps, matmul_bytes, matmul_passes) =
        time_matmul(engine.backend.as_ref(), format, limits).with_context(|| format!("timing matmuls on {name}"))?;
    let prompt_ids = engine.codec.encode("The sea was calm, and the ship", false)?;
    let decode = |max_tokens: usize| -> Result<f64> {
        let request = GenerateRequest { prompt_ids: prompt_ids.clone(), max_tokens, sampling: Default::default(), stop: Vec::new(), ignore_eos: true };
        Ok(engine.generate(&request, |_| ControlFlow::Continue(()))?.stats.decode_tokens_per_second)
    };
    decode(4)?; // warms what the first tokens build
    let tokens_per_second = decode(limits.decode_tokens.max(4))?;
    if !(tokens_per_second.is_finite() && tokens_per_second > 0.0) {
        bail!("the demo model's decode on {name} could not be timed ({tokens_per_second} tokens per second)");
    }
    let weights = demo_costs.active_bytes_per_token() as f64 / (weight_gbps * 1e9);
    let per_layer = (1.0 / tokens_per_second - weights).max(0.0) / demo_costs.moe_layers.max(1) as f64;
    let probe = ComputeProbe {
        rates: ComputeRates { weight_gbps, layer_overhead_ms: per_layer * 1e3 },
        backend: name,
        matmul_bytes,
        matmul_passes,
        demo_decode_tokens_per_second: tokens_per_second,
    };
    let Engine { backend, .. } = engine;
    Ok((probe, backend))
}

/// What `doctor --measure` measured and kept.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Measurement {
    pub compute: ComputeProbe,
    pub disk: Option<DiskProbe>,
    pub misses: Option<MissProbe>,
    /// Why the disk and the misses were not measured, when they were not.
    pub disk_skipped: Option<String>,
    /// Why a miss was not timed in a decode though the disk was measured.
    pub misses_skipped: Option<String>,
}

/// Measures the backend (with weights stored as `format`) and, when
/// `model_dir` holds a model, the disk under it and what a miss costs its
/// decode; records them in `cache` under `keys`.
pub fn measure_into(
    cache: &mut RateCache,
    keys: &RateKeys,
    backend: Box<dyn Backend>,
    format: &MatrixFormat,
    model_dir: Option<&Path>,
    limits: &ProbeLimits,
) -> Result<Measurement> {
    let now = rates::now_unix();
    let arch = match (model_dir, &keys.disk) {
        (Some(dir), Some(_)) => Some(ModelArch::read(dir)?),
        _ => None,
    };
    let disk = match (&arch, &keys.disk) {
        (Some(arch), Some(key)) => {
            let probe = measure_disk(arch, limits)?;
            let how = format!(
                "{} batches of 1 and {} experts, {} bytes in {:.2} s{}",
                probe.batches,
                probe.batch_experts[1],
                probe.bytes_read,
                probe.seconds,
                if probe.direct_io { ", direct I/O" } else { ", through the page cache" }
            );
            cache.record_disk(key, Measured { rates: probe.rates, unix_seconds: now, how });
            Some(probe)
        }
        _ => None,
    };
    let (compute, backend) = measure_compute(backend, format, limits)?;
    let how = format!(
        "{} MB matmul x {}, demo decode {:.1} tok/s",
        compute.matmul_bytes >> 20,
        compute.matmul_passes,
        compute.demo_decode_tokens_per_second
    );
    cache.record_compute(&keys.compute, Measured { rates: compute.rates, unix_seconds: now, how });
    let (mut misses, mut misses_skipped) = (None, None);
    if let (Some(arch), Some(d), Some(key)) = (&arch, &disk, &keys.decode) {
        let measured = RateSource::Measured { unix_seconds: now };
        let rates = Rates {
            compute: compute.rates,
            compute_source: measured.clone(),
            disk: d.rates,
            disk_source: measured,
            miss: None,
            runs_key: None,
        };
        // A model that cannot stream, or whose decode missed nothing, keeps the other rates: a miss then costs its read.
        match measure_misses(arch, backend, &rates, limits) {
            Ok(mut probe) => {
                // Its hit rate is a streaming run's, where the pool had the share a plan would give it.
                let timing = crate::plan::hits::DecodeTiming {
                    backend: probe.backend.clone(),
                    steps: probe.steps,
                    seconds: probe.seconds_per_token * probe.steps as f64,
                };
                probe.hits_kept = probe.at_knee && crate::plan::hits::keep_run(arch, probe.slots, &probe.decode, Some(&timing))?;
                let how = format!(
                    "{} decode steps from {} slots ({} per layer), {:.1} ms per token, hit rate {:.1}%",
                    probe.steps,
                    probe.slots,
                    probe.experts_per_layer,
                    probe.seconds_per_token * 1e3,
                    100.0 * probe.decode.hit_rate()
                );
                cache.record_decode(key, Measured { rates: probe.rates, unix_seconds: now, how });
                misses = Some(probe);
            }
            Err(e) => misses_skipped = Some(format!("{e:#}")),
        }
    }
    let disk_skipped = disk.is_none().then(|| "the model is not on this machine, so its expert reads cannot be timed".to_string());
    Ok(Measurement { compute, disk, misses, disk_skipped, misses_skipped })
}

impl Measurement {
    /// One line per measurement, for the doctor's report.
    pub fn describe(&self) -> String {
        let c = &self.compute;
        let mut s = format!(
            "weights {:.1} GB/s ({} MB matmul x {}), {:.3} ms per layer (demo model decoding at {:.1} tok/s)",
            c.rates.weight_gbps,
            c.matmul_bytes >> 20,
            c.matmul_passes,
            c.rates.layer_overhead_ms,
            c.demo_decode_tokens_per_second
        );
        match (&self.disk, &self.disk_skipped) {
            (Some(d), _) => {
                s += &format!(
                    "\n          expert reads {:.2} GB/s + {:.3} ms ({} batches of 1 and {} experts, {:.1} MB in {:.2} s{})",
                    d.rates.read_gbps,
                    d.rates.read_latency_ms,
                    d.batches,
                    d.batch_experts[1],
                    d.bytes_read as f64 / 1e6,
                    d.seconds,
                    if d.direct_io { ", direct I/O" } else { ", through the page cache: not the disk's rate" }
                )
            }
            (None, Some(why)) => s += &format!("\n          expert reads not measured: {why}"),
            (None, None) => {}
        }
        if let Some(m) = &self.misses {
            let kept = match (m.at_knee, m.hits_kept) {
                (_, true) => "; its hit rate is kept for the plan",
                (true, false) => "",
                (false, _) => "; a pool below the knee, to stay within the probe's memory: its hit rate is not kept",
            };
            s += &format!(
                "\n          a missed expert {:.2} ms beyond {:.2} ms of compute a token in a decode ({} steps from {} of {} \
                 experts per layer, {:.1} ms per token, {:.1} misses per token, hit rate {:.1}%, after a {}-token prompt{kept})",
                m.rates.miss_ms,
                m.rates.token_ms,
                m.steps,
                m.experts_per_layer,
                m.model_experts_per_layer,
                m.seconds_per_token * 1e3,
                m.decode.misses as f64 / m.steps.max(1) as f64,
                100.0 * m.decode.hit_rate(),
                m.prompt_tokens
            );
        }
        if let Some(why) = &self.misses_skipped {
            s += &format!("\n          a missed expert not timed in a decode (it costs its read): {why}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ExpertStore::read_each` hands over every matrix of every record
    /// once, with its pieces' bytes as `read_many` reads them (matrix by
    /// matrix as landed, or each record whole), and the records `ready`
    /// gives once, whole: as soon as it has them (as landed), at the end
    /// when only waited for, or before any read (the earlier handover). It
    /// stops at the first error, `ready`'s own included.
    #[test]
    fn read_each_gives_each_matrix_once_and_stops_at_an_error() {
        use crate::experts::Handover;
        use slotstream_backend::{ExpertMatrix, HostMatrix, MatrixData};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_mlx4");
        let store = expert_store(&ModelArch::read(&dir).expect("fixture config")).expect("expert store");
        let (experts, ahead) = ([3u32, 0, 7, 1, 5], [2u32, 6]);
        let (mut want, _) = store.read_many(1, &experts).expect("read_many");
        want.extend(store.read_many(1, &ahead).expect("read_many").0);
        let bytes = |m: &HostMatrix<'_>| match &m.data {
            MatrixData::Dense { bytes, .. } => vec![bytes.to_vec()],
            MatrixData::Affine { words, scales, biases, .. } => vec![words.to_vec(), scales.to_vec(), biases.to_vec()],
        };
        let own = 3 * experts.len();
        // (as landed, ready without waiting once two matrices were handed over, where the ready records go)
        for (as_landed, early, ready_at) in [(true, true, 2), (true, false, own), (false, true, 0)] {
            let (handed, mut given) = (std::cell::Cell::new(0), false);
            let ready = |block: bool| {
                assert!(!given, "ready is asked again after it gave its records");
                (block || (early && handed.get() == 2)).then(|| {
                    given = true;
                    Ok(store.read_many(1, &ahead).expect("read_many").0)
                })
            };
            let mut seen = Vec::new();
            // (stage, matrices handed over by then)
            let stages = std::cell::RefCell::new(Vec::new());
            let last_own = std::cell::Cell::new(0);
            store
                .read_each(1, &experts, as_landed, ready, |at| stages.borrow_mut().push((at, handed.get())), |i, h| {
                    let e = store.host_expert(&want[i]);
                    let mut check = |which: ExpertMatrix, m: &HostMatrix<'_>| {
                        assert_eq!(bytes(m), bytes(e.matrix(which)), "record {i}, {which:?}");
                        seen.push((i, which));
                    };
                    match h {
                        Handover::Matrix(which, m) => {
                            assert!(as_landed && i < experts.len(), "record {i}: only the call's own records go matrix by matrix, as landed");
                            check(which, m);
                        }
                        Handover::Whole(got) => {
                            assert!(!as_landed || i >= experts.len(), "record {i} went whole");
                            ExpertMatrix::ALL.into_iter().for_each(|which| check(which, got.matrix(which)));
                        }
                    }
                    if i < experts.len() {
                        last_own.set(handed.get());
                    }
                    handed.set(handed.get() + 1);
                    Ok(())
                })
                .expect("read_each");
            // Issued before anything lands; Draining, then Landed, once each,
            // before the last of the call's own groups is handed over.
            use crate::experts::Progress;
            let stages = stages.into_inner();
            let said: Vec<Progress> = stages.iter().map(|s| s.0).collect();
            assert_eq!(said, [Progress::Issued, Progress::Draining, Progress::Landed], "{stages:?}");
            assert_eq!(stages[0].1, 0);
            assert!(stages[2].1 <= last_own.get(), "landed said after the last own handover ({}): {stages:?}", last_own.get());
            let first_ready = seen.iter().position(|&(i, _)| i >= experts.len()).expect("the ready records were handed over");
            assert_eq!(first_ready, ready_at, "as landed: {as_landed}, ready early: {early}");
            seen.sort_by_key(|&(i, which)| (i, which as usize));
            let all: Vec<_> = (0..want.len()).flat_map(|i| ExpertMatrix::ALL.map(|w| (i, w))).collect();
            assert_eq!(seen, all, "as landed: {as_landed}");
            let mut calls = 0;
            let err = store
                .read_each(1, &experts, as_landed, |_| Some(Ok(Vec::new())), |_| {}, |_, _| {
                    calls += 1;
                    anyhow::ensure!(calls < 2, "stop here");
                    Ok(())
                })
                .expect_err("the second handover's error comes back");
            assert_eq!((calls, err.to_string()), (2, "stop here".to_string()), "as landed: {as_landed}");
            let failed = store.read_each(1, &experts, as_landed, |block| block.then(|| Err(anyhow::anyhow!("no guess"))), |_| {}, |_, _| Ok(()));
            assert_eq!(failed.expect_err("ready's error comes back").to_string(), "no guess");
            let never = store.read_each(1, &experts, as_landed, |_| None, |_| {}, |_, _| Ok(()));
            assert!(never.is_err(), "a ready that never comes when waited for is an error");
        }
    }

    #[test]
    fn reads_that_grow_with_bytes_give_a_rate_and_a_latency() {
        // 1 MB records at 0.7 GB/s after 0.4 ms: one takes 0.4 ms + 1.43 ms, eight 0.4 ms + 11.4 ms.
        let (latency, rate) = (0.0004, 0.7e9);
        let rates = fit_reads(1_000_000, 8, latency + 1e6 / rate, latency + 8e6 / rate);
        assert!((rates.read_gbps - 0.7).abs() < 1e-9, "{rates:?}");
        assert!((rates.read_latency_ms - 0.4).abs() < 1e-9, "{rates:?}");
        // Reads in parallel that take as long for eight as for one: all latency.
        let flat = fit_reads(50_000, 4, 0.0005, 0.0005);
        assert_eq!(flat.read_latency_ms, 0.5);
        assert!(flat.read_gbps >= 100.0, "{flat:?}");
    }

    #[test]
    fn the_disk_probe_stays_within_its_budget() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/demo/model");
        let arch = ModelArch::read(&dir).expect("the demo model");
        let record = expert_store(&arch).expect("its experts").record_bytes;
        let limits = ProbeLimits { disk_bytes: 20 * record, disk_batches: 1000, disk_seconds: 60.0, ..Default::default() };
        let probe = measure_disk(&arch, &limits).expect("measuring");
        assert!(probe.bytes_read <= limits.disk_bytes, "{probe:?}");
        assert_eq!(probe.batch_experts, [1, 4], "one expert, and the demo's top-4");
        assert!(probe.rates.read_gbps > 0.0 && probe.rates.read_latency_ms >= 0.0, "{probe:?}");
        let few = ProbeLimits { disk_batches: 6, ..limits };
        assert_eq!(measure_disk(&arch, &few).expect("measuring").batches, 6, "the batch count is a bound too");
        let none = ProbeLimits { disk_bytes: record / 2, ..Default::default() };
        assert!(measure_disk(&arch, &none).is_err(), "a budget smaller than one expert reads nothing");
    }

    #[test]
    fn the_backend_probe_runs_its_passes_and_no_more() {
        let backend = slotstream_cpu::CpuBackend::new();
        let format = MatrixFormat::Affine { bits: 4, group_size: 64, scale_dtype: DType::BF16 };
        let limits = ProbeLimits { matmul_bytes: 1 << 20, matmul_passes: 3, matmul_seconds: 60.0, ..Default::default() };
        let (gbps, bytes, passes) = time_matmul(&backend, &format, &limits).expect("timing");
        assert_eq!(passes, 3);
        assert!(bytes <= 2 << 20 && gbps > 0.0, "{bytes} bytes at {gbps} GB/s");
    }
}
