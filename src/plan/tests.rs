//! Planner cases for simulated machines, computed with the flagship's real sizes
//! and pinned as snapshots (snapshots/plan__*.snap).

use super::*;

fn summary(p: &Plan) -> serde_json::Value {
    let r = |b: u64| (b as f64 / 1e8).round() / 10.0;
    serde_json::json!({
        "mode": p.mode.label(),
        "reason": p.reason,
        "target_gb": r(p.target_bytes),
        "slots": p.slots,
        "experts_per_layer": (p.experts_per_layer * 10.0).round() / 10.0,
        "pool_gb": r(p.pool_bytes),
        "peak_gb": r(p.peak_bytes),
        "prefill_chunk": p.prefill_chunk,
        "mtp": p.mtp,
        "notes": p.notes,
    })
}

/// A plan's peak without the activations its prefill chunk has beyond the
/// smallest chunk's (they grow into whatever memory the pool leaves).
fn peak_at_the_smallest_chunk(p: &Plan, model: &ModelCosts) -> u64 {
    p.peak_bytes - (p.prefill_chunk - DEFAULT_PREFILL_CHUNK) as u64 * model.activation_bytes_per_token()
}

fn case(name: &str, machine: MachineMemory, req: PlanRequest) -> Plan {
    let model = ModelCosts::flagship();
    let p = plan(&model, &machine, &PlanRequest { context_tokens: 4096, ..req }).expect("plan");
    insta::with_settings!({ snapshot_path => "../../snapshots", prepend_module_to_snapshot => false }, {
        insta::assert_json_snapshot!(format!("plan__{name}"), summary(&p));
    });
    p
}

fn mac(ram: f64, available: f64) -> MachineMemory {
    MachineMemory::simulated(ram, Some(available), Some(machine::macos::default_working_set((ram * 1e9) as u64) as f64 / 1e9))
}

/// Not streamed here yet, the flagship's routing is not measured: auto
/// plans with the reference's knee (33 GB, 205 of 512 per layer).
#[test]
fn flagship_48gb_pristine_plans_the_knee() {
    let p = case("48gb_pristine", mac(48.0, 40.0), PlanRequest::default());
    assert!((32.0e9..34.0e9).contains(&(p.target_bytes as f64)), "the knee is about 33 GB");
    assert!(p.reason.contains("the reference's"), "{}", p.reason);
}

/// The flagship after runs here measured FreeToken's routing (93.3% hits at
/// 36.6% of the experts).
fn flagship_with_skewed_routing() -> ModelCosts {
    let run = hits::HitRun { share: 0.366, hit_rate: 0.933, expert_uses: 10_000, unix_seconds: 0, timing: None };
    ModelCosts { hit_curve: hits::HitRateCurve::fit(&[run]).expect("fits"), ..ModelCosts::flagship() }
}

#[test]
fn flagship_48gb_busy_clamps_to_reclaimable() {
    let p = case("48gb_busy", mac(48.0, 20.0), PlanRequest::default());
    assert!(p.peak_bytes <= 20_000_000_000 - 2_400_000_000 + 1);
}

#[test]
fn flagship_16gb_pristine() {
    let p = case("16gb_pristine", mac(16.0, 12.0), PlanRequest::default());
    assert!(p.peak_bytes <= 10_500_000_000, "16 GB machine: under 70% of RAM and the working set");
}

#[test]
fn flagship_16gb_busy_runs_at_the_floor() {
    let p = case("16gb_busy", mac(16.0, 5.0), PlanRequest::default());
    assert_eq!(p.slots, FLOOR_EXPERTS_PER_LAYER * 48);
    assert!(!p.notes.is_empty());
}

#[test]
fn flagship_8gb() {
    let p = case("8gb", mac(8.0, 6.0), PlanRequest::default());
    assert_eq!(p.slots, FLOOR_EXPERTS_PER_LAYER * 48, "never below the model's minimum");
}

#[test]
fn flagship_128gb_holds_every_expert() {
    let p = case("128gb", mac(128.0, 110.0), PlanRequest::default());
    assert_eq!(p.slots, 48 * 512, "the whole model fits in 128 GB: no expert should stream");
    assert!(p.reason.starts_with("resident:"), "{}", p.reason);
}

/// The case: `doctor --sim-ram 128 --sim-available 120` chose the knee
/// although its own table showed every expert fitting.
#[test]
fn a_model_that_fits_is_resident_and_one_that_does_not_streams_at_the_knee() {
    let flagship = ModelCosts::flagship();
    let req = PlanRequest { context_tokens: 4096, ..Default::default() };
    let roomy = plan(&flagship, &MachineMemory::simulated(128.0, Some(120.0), None), &req).unwrap();
    assert_eq!(roomy.slots, flagship.total_experts(), "{roomy:?}");
    assert!(roomy.reason.starts_with("resident:"), "{}", roomy.reason);
    let tight = plan(&flagship, &MachineMemory::simulated(64.0, Some(60.0), None), &req).unwrap();
    assert_eq!(tight.slots, 48 * 205, "{tight:?}");
    assert!(tight.reason.starts_with("streaming:") && tight.reason.contains("knee"), "{}", tight.reason);
    // Once runs here measured its routing, the knee is the one its rates and
    // routing give (reads 8% of the compute): on this simulated Linux machine
    // (a 0.7 GB/s disk, 2 cores) more cache pays longer than the reference's.
    let skewed = flagship_with_skewed_routing();
    let roomier = MachineMemory::simulated(96.0, Some(90.0), None);
    let knee = knee::Knee::of(&skewed, &roomier.rates, FLOOR_EXPERTS_PER_LAYER);
    assert!(knee.measured && knee.experts_per_layer > 205, "{knee:?}");
    let measured = plan(&skewed, &roomier, &req).unwrap();
    assert_eq!(measured.slots, 48 * knee.experts_per_layer, "{measured:?}");
    assert!(measured.reason.contains("knee") && measured.reason.contains("of the compute"), "{}", measured.reason);
    // Its fast disk and routing, a smaller knee than the reference's share.
    let fast = MachineMemory { rates: Rates { disk: rates::DiskRates { read_gbps: 17.3, read_latency_ms: 0.05 }, ..roomier.rates.clone() }, ..roomier };
    let small = plan(&skewed, &fast, &req).unwrap();
    assert!(small.slots < 48 * 205 && small.reason.contains("knee"), "{small:?}");

    // A 2.5 GB synthetic qwen3_moe (the issue's: 64 experts per layer, top-8).
    let synthetic = ModelCosts {
        name: "synthetic".into(),
        resident_bytes: 120_000_000,
        expert_record_bytes: 2_654_208,
        moe_layers: 14,
        experts_per_layer: 64,
        top_k: 8,
        hidden_size: 2048,
        moe_intermediate: 768,
        kv_bytes_per_token: 14 * 2 * 4 * 128 * 2,
        context_length: None,
        state_bytes: 0,
        extra_bytes: 0,
        mtp_bytes: 0,
        full_pool_extra_bytes: 0,
        expert_format: ModelCosts::flagship().expert_format,
        hit_curve: hits::HitRateCurve::ASSUMED,
    };
    let fits = plan(&synthetic, &MachineMemory::simulated(24.0, Some(23.0), None), &req).unwrap();
    assert_eq!(fits.slots, 14 * 64, "a 2.5 GB model on a 24 GB machine: {fits:?}");
    let over = plan(&synthetic, &MachineMemory::simulated(4.0, Some(3.4), None), &req).unwrap();
    assert!(over.slots < 14 * 64 && over.slots >= 14 * FLOOR_EXPERTS_PER_LAYER, "{over:?}");
    assert!(over.reason.starts_with("streaming:"), "{}", over.reason);
    assert!(over.peak_bytes <= 3_400_000_000 - 1_500_000_000 + 1, "within what is reclaimable: {over:?}");
}

/// The bundled demo model (13.5 MB) is resident on any machine that runs it.
#[test]
fn the_demo_model_is_resident() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/demo/model");
    let demo = ModelCosts::from_model_dir(&dir, slotstream_backend::KvCacheType::F32).expect("the demo model's costs");
    let p = plan(&demo, &MachineMemory::simulated(4.0, Some(3.0), None), &PlanRequest { context_tokens: 4096, ..Default::default() })
        .unwrap();
    assert_eq!(p.slots, demo.total_experts(), "{p:?}");
    assert!(p.reason.starts_with("resident:"), "{}", p.reason);
}

/// MTP's head is left out when only that keeps every expert resident.
#[test]
fn auto_mtp_never_costs_residency() {
    let flagship = ModelCosts::flagship();
    let req = PlanRequest { context_tokens: 4096, mtp: MtpMode::Auto, ..Default::default() };
    // Without the head the model needs ~71.6 GB; give auto ~72 GB.
    let machine = MachineMemory::simulated(110.0, Some(78.0), None);
    let p = plan(&flagship, &machine, &req).unwrap();
    assert_eq!(p.slots, flagship.total_experts(), "{p:?}");
    assert!(!p.mtp && p.notes.iter().any(|n| n.contains("holding them all is faster")), "{p:?}");
}

#[test]
fn explicit_memory_on_a_busy_machine_is_kept_with_a_note() {
    let p = case("48gb_busy_memory_30", mac(48.0, 20.0), PlanRequest { memory_gb: Some(30.0), ..Default::default() });
    assert_eq!(p.target_bytes, 30_000_000_000);
    assert!(p.peak_bytes <= 30_000_000_000);
    assert!(p.notes.iter().any(|n| n.contains("never changed")));
}

#[test]
fn knob_precedence() {
    let m = mac(48.0, 40.0);
    let model = ModelCosts::flagship();
    let all = PlanRequest { experts_per_layer: Some(30), pool_gb: Some(10.0), memory_gb: Some(20.0), context_tokens: 4096, ..Default::default() };
    assert_eq!(plan(&model, &m, &all).unwrap().slots, 30 * 48);
    let pool = PlanRequest { experts_per_layer: None, ..all.clone() };
    assert_eq!(plan(&model, &m, &pool).unwrap().slots, (10e9 / 2_764_800.0) as usize);
    let mem = PlanRequest { pool_gb: None, ..pool };
    assert_eq!(plan(&model, &m, &mem).unwrap().mode, PlanMode::MemoryGb);
}

#[test]
fn mtp_follows_the_request_and_the_room_left() {
    let flagship = ModelCosts::flagship();
    let req = |mtp| PlanRequest { context_tokens: 4096, mtp, ..Default::default() };
    // 48 GB: room for the head at the knee.
    let p = plan(&flagship, &mac(48.0, 40.0), &req(MtpMode::Auto)).unwrap();
    assert!(p.mtp, "{p:?}");
    let off = plan(&flagship, &mac(48.0, 40.0), &req(MtpMode::Off)).unwrap();
    assert!(!off.mtp);
    // At the knee the pool stays the same and the head comes on top.
    assert_eq!(p.slots, off.slots);
    assert_eq!(peak_at_the_smallest_chunk(&p, &flagship), peak_at_the_smallest_chunk(&off, &flagship) + flagship.mtp_bytes);
    // 16 GB busy: the head would squeeze the pool, so auto leaves it off; on forces it.
    let busy = mac(16.0, 6.5);
    assert!(!plan(&flagship, &busy, &req(MtpMode::Auto)).unwrap().mtp);
    assert!(plan(&flagship, &busy, &req(MtpMode::On)).unwrap().mtp);
    // A model whose tokens read few bytes: auto leaves MTP off, on forces it.
    let small = ModelCosts { resident_bytes: 10_000_000, expert_record_bytes: 100_000, ..flagship.clone() };
    let p = plan(&small, &mac(48.0, 40.0), &req(MtpMode::Auto)).unwrap();
    assert!(!p.mtp && p.notes.iter().any(|n| n.contains("MTP off")), "{p:?}");
    assert!(plan(&small, &mac(48.0, 40.0), &req(MtpMode::On)).unwrap().mtp);
    // No head: on is an error, auto is off.
    let none = ModelCosts { mtp_bytes: 0, ..flagship };
    assert_eq!(plan(&none, &busy, &req(MtpMode::On)).unwrap_err(), PlanError::NoMtpHead);
    assert!(!plan(&none, &busy, &req(MtpMode::Auto)).unwrap().mtp);
}

#[test]
fn impossible_explicit_sizes_are_refused_with_the_minimum() {
    let m = mac(48.0, 40.0);
    let err = plan(&ModelCosts::flagship(), &m, &PlanRequest { memory_gb: Some(3.0), context_tokens: 4096, ..Default::default() }).unwrap_err();
    assert!(matches!(err, PlanError::TooSmall { .. }), "{err}");
    assert!(err.to_string().contains("--memory-gb"));
}

/// The compiled-in flagship costs equal what the published tensor table says.
#[test]
fn flagship_costs_match_the_reference_tensor_table() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/reference/qwen3.8-flash-next/tensor_shapes.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipped: {} is not on this machine", path.display());
        return;
    };
    let table: serde_json::Value = serde_json::from_str(&text).unwrap();
    let (mut experts, mut resident) = (0u64, 0u64);
    for (name, t) in table.as_object().unwrap() {
        let n: u64 = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product();
        let size = match t["dtype"].as_str().unwrap() { "BF16" | "F16" => 2, "U32" | "F32" => 4, "I64" => 8, _ => 1 };
        if name.contains(".switch_mlp.") {
            experts += n * size;
        } else if !name.contains("ngram_embedding.shard_") && !name.starts_with("vision_tower.") {
            resident += n * size;
        }
    }
    let f = ModelCosts::flagship();
    assert_eq!(experts, f.routed_expert_bytes());
    assert_eq!(resident, f.resident_bytes);
}

fn arithmetic_model() -> ModelCosts {
    ModelCosts {
        name: "arithmetic".into(),
        resident_bytes: 100_000_000,
        expert_record_bytes: 1_000_000,
        moe_layers: 10,
        experts_per_layer: 64,
        top_k: 8,
        hidden_size: 1024,
        moe_intermediate: 256,
        kv_bytes_per_token: 0,
        context_length: None,
        state_bytes: 0,
        extra_bytes: 0,
        mtp_bytes: 0,
        full_pool_extra_bytes: 0,
        expert_format: ModelCosts::flagship().expert_format,
        hit_curve: hits::HitRateCurve::ASSUMED,
    }
}

/// A pool of every expert on a backend that also keeps the shared experts'
/// copies in it costs those bytes too: the peak counts them, and a memory
/// size that holds every record but not the copies gets a streaming pool.
#[test]
fn a_full_pool_counts_the_shared_experts_it_holds() {
    let m = mac(48.0, 40.0);
    let model = ModelCosts { full_pool_extra_bytes: 50_000_000, ..arithmetic_model() };
    let all = model.total_experts();
    let every = PlanRequest { experts_per_layer: Some(64), context_tokens: 0, ..Default::default() };
    let (with, without) = (plan(&model, &m, &every).unwrap(), plan(&arithmetic_model(), &m, &every).unwrap());
    assert_eq!((with.slots, without.slots), (all, all));
    assert_eq!(with.peak_bytes, without.peak_bytes + 50_000_000);
    // Every record fits, the copies do not: a streaming pool, no copies,
    // and room for the staging its long calls run misses from (32 records
    // here, of which the 10 MB spare holds 10).
    let tight = PlanRequest { experts_per_layer: None, memory_gb: Some((without.peak_bytes + 10_000_000) as f64 / 1e9), ..every };
    assert_eq!(plan(&arithmetic_model(), &m, &tight).unwrap().slots, all);
    let p = plan(&model, &m, &tight).unwrap();
    assert_eq!(model.staging_bytes(), 32 * model.expert_record_bytes);
    assert_eq!(p.slots, all - 22);
    assert!(p.peak_bytes <= p.target_bytes, "{} > {}: the pool, staging or activations past --memory-gb", p.peak_bytes, p.target_bytes);
}

fn arithmetic_rates() -> Rates {
    use rates::{ComputeRates, DiskRates, RateSource};
    Rates::unmeasured(
        ComputeRates { weight_gbps: 10.0, layer_overhead_ms: 0.5 },
        DiskRates { read_gbps: 1.0, read_latency_ms: 2.0 },
        RateSource::Defaults,
    )
}

fn with_decode(rates: &Rates, miss_ms: f64, token_ms: f64) -> Rates {
    let miss = rates::Measured { rates: rates::MissRates { miss_ms, token_ms }, unix_seconds: 0, how: String::new() };
    Rates { miss: Some(miss), ..rates.clone() }
}

/// The estimate's arithmetic with given rates: weights at the weight rate, a
/// cost per layer, and a pool smaller than the model paying its misses at the
/// read rate plus one latency per layer that misses.
#[test]
fn the_estimate_adds_weights_layers_and_misses_at_the_given_rates() {
    use rates::ComputeRates;
    let model = arithmetic_model();
    let rates = arithmetic_rates();
    // Resident: (100 MB + 10 x 8 x 1 MB) at 10 GB/s = 18 ms, and 10 x 0.5 ms.
    let resident = model.estimate_decode_tokens_per_second(640, &rates);
    assert!((resident - 1.0 / 0.023).abs() < 1e-9, "{resident}");
    // A quarter of each layer cached: hits 0.25^0.6; misses read at 1 GB/s,
    // and each layer that misses any of its 8 pays 2 ms.
    let hit: f64 = 0.25f64.powf(0.6);
    assert!((model.hit_rate(160) - hit).abs() < 1e-12);
    let seconds = 0.023 + (1.0 - hit) * 80e6 / 1e9 + 10.0 * (1.0 - hit.powi(8)) * 0.002;
    let streaming = model.estimate_decode_tokens_per_second(160, &rates);
    assert!((streaming - 1.0 / seconds).abs() < 1e-9, "{streaming} vs {}", 1.0 / seconds);
    // Twice the weight rate helps the resident plan, never the disk's part.
    let faster = Rates { compute: ComputeRates { weight_gbps: 20.0, ..rates.compute }, ..rates.clone() };
    assert!((model.estimate_decode_tokens_per_second(640, &faster) - 1.0 / 0.014).abs() < 1e-9);
}

/// The model's own decode from a small pool, timed here, prices a streaming
/// token: its compute as the probe split it, each miss at the probe's cost,
/// and the disk's latency per layer that misses; a resident plan has no
/// misses and computes at the compute rates.
#[test]
fn a_timed_decode_prices_each_miss_and_the_compute_of_a_streaming_token() {
    let model = arithmetic_model();
    let rates = with_decode(&arithmetic_rates(), 2.5, 30.0);
    let hit: f64 = 0.25f64.powf(0.6);
    let misses = (1.0 - hit) * 80.0;
    let seconds = 0.030 + misses * 0.0025 + 10.0 * (1.0 - hit.powi(8)) * 0.002;
    let streaming = model.estimate_decode_tokens_per_second(160, &rates);
    assert!((streaming - 1.0 / seconds).abs() < 1e-9, "{streaming} vs {}", 1.0 / seconds);
    assert!(streaming < model.estimate_decode_tokens_per_second(160, &arithmetic_rates()), "2.5 ms a miss is slower than 1 ms of reading");
    assert_eq!(model.estimate_decode_tokens_per_second(640, &rates), model.estimate_decode_tokens_per_second(640, &arithmetic_rates()));
    let time = model.decode_time(hit, &rates);
    assert!((time.misses - misses * 0.0025).abs() < 1e-12 && (time.total() - seconds).abs() < 1e-12, "{time:?}");
}

/// The probe's split: the token's compute at the compute rates (23 ms here),
/// the rest per miss; but never more compute than the decode spent not
/// waiting on reads (the rates were measured apart, on a busy machine), so
/// the estimate at the decode's hit rate is the decode's own time either
/// way; none without misses.
#[test]
fn a_timed_decode_gives_back_its_own_time() {
    use costs::DecodeSample;
    let model = arithmetic_model();
    let rates = arithmetic_rates();
    let samples = [(0.1, 0.5, 0.05), (0.1, 0.5, 0.08), (0.3, 0.2, 0.29), (0.04, 0.9, 0.02), (0.05, 0.5, 0.001)];
    for (seconds_per_token, hit_rate, waited) in samples {
        let sample = DecodeSample { seconds_per_token, hit_rate, waited_seconds_per_token: waited };
        let miss = model.miss_rates_from_decode(&sample, &rates).expect("misses to time");
        let back = model.decode_time(hit_rate, &with_decode(&rates, miss.miss_ms, miss.token_ms)).total();
        assert!((back - seconds_per_token).abs() < 1e-12, "{sample:?}: {miss:?} gives {back}");
    }
    // 0.1 s at hit 0.5: 40 misses, 10 layers x 2 ms x (1 - 0.5^8) of latency.
    let latency = 10.0 * 0.002 * (1.0 - 0.5f64.powi(8));
    let split = |waited: f64| {
        let sample = DecodeSample { seconds_per_token: 0.1, hit_rate: 0.5, waited_seconds_per_token: waited };
        model.miss_rates_from_decode(&sample, &rates).expect("misses")
    };
    let (within, beyond) = (split(0.05), split(0.08));
    assert!((within.token_ms - 23.0).abs() < 1e-9 && (within.miss_ms - (0.1 - 0.023 - latency) / 40.0 * 1e3).abs() < 1e-9, "{within:?}");
    assert!((beyond.token_ms - 20.0).abs() < 1e-9 && (beyond.miss_ms - (0.08 - latency) / 40.0 * 1e3).abs() < 1e-9, "{beyond:?}");
    let all_hits = DecodeSample { seconds_per_token: 0.05, hit_rate: 1.0, waited_seconds_per_token: 0.0 };
    assert_eq!(model.miss_rates_from_decode(&all_hits, &rates), None);
    let no_time = DecodeSample { seconds_per_token: f64::NAN, hit_rate: 0.5, waited_seconds_per_token: 0.0 };
    assert_eq!(model.miss_rates_from_decode(&no_time, &rates), None);
}

/// A compute rate measured after the timed decode (another model's
/// `--measure` replaces it) moves the resident estimate only: the streaming
/// one keeps the compute its misses were priced against, so at the probe's
/// hit rate it is still the probe's time.
#[test]
fn a_later_compute_rate_leaves_a_timed_decode_whole() {
    use costs::DecodeSample;
    use rates::ComputeRates;
    let model = arithmetic_model();
    let sample = DecodeSample { seconds_per_token: 0.1, hit_rate: 0.5, waited_seconds_per_token: 0.05 };
    let miss = model.miss_rates_from_decode(&sample, &arithmetic_rates()).expect("misses");
    let then = with_decode(&arithmetic_rates(), miss.miss_ms, miss.token_ms);
    let now = Rates { compute: ComputeRates { weight_gbps: 20.0, layer_overhead_ms: 0.2 }, ..then.clone() };
    for slots in [100, 240, 400, 600] {
        let (a, b) = (model.estimate_decode_tokens_per_second(slots, &then), model.estimate_decode_tokens_per_second(slots, &now));
        assert!((a - b).abs() < 1e-9 * a, "{slots} slots: {a} vs {b} tok/s");
    }
    assert!((model.decode_time(0.5, &now).total() - 0.1).abs() < 1e-12);
    assert!(model.estimate_decode_tokens_per_second(640, &now) > model.estimate_decode_tokens_per_second(640, &then), "resident");
}

/// The arithmetic model with its runs: at each `(share, hit rate, [seconds
/// per token of its runs, oldest first])`, timed on `machine` with a third
/// of each token waiting on reads.
fn with_timed_runs(machine: &str, shares: &[(f64, f64, &[f64])]) -> ModelCosts {
    let mut cache = hits::HitCache::default();
    let mut clock = 0;
    for &(share, hit_rate, times) in shares {
        for &seconds_per_token in times {
            clock += 1;
            let timing = speeds::RunTiming {
                machine: machine.into(),
                seconds_per_token,
                waited_seconds_per_token: seconds_per_token / 3.0,
                steps: 47,
            };
            let run = hits::HitRun { share, hit_rate, expert_uses: 3000, unix_seconds: clock, timing: Some(timing) };
            cache.record("m", "/models/m", run);
        }
    }
    ModelCosts { hit_curve: cache.curve("m"), ..arithmetic_model() }
}

fn here(rates: &Rates) -> Rates {
    Rates { runs_key: Some("here".into()), ..rates.clone() }
}

/// A streaming pool the model ran at on this machine is estimated at its
/// runs' time: the median of the newest three there (a stalled run among
/// them does not move it; an older run is not among them). Another
/// machine's runs, a machine the rates were not read for, and a resident
/// pool use the rates.
#[test]
fn timed_runs_at_the_pool_size_give_its_estimate() {
    let rates = here(&arithmetic_rates());
    // 160 of 640 slots: a quarter. The oldest run (0.5 s) is not among the newest three; 0.4 s is a stall.
    let model = with_timed_runs("here", &[(0.25, 0.4, &[0.5, 0.1, 0.4, 0.12])]);
    let estimate = model.estimate_decode(160, &rates);
    assert!((estimate.seconds_per_token - 0.12).abs() < 1e-12, "{estimate:?}");
    let Some(estimate::FromRuns::AtShare { point }) = &estimate.from_runs else { panic!("{estimate:?}") };
    assert_eq!(point.runs, 4);
    let two = with_timed_runs("here", &[(0.25, 0.4, &[0.1, 0.2])]);
    assert!((two.estimate_decode(160, &rates).seconds_per_token - 0.15).abs() < 1e-12, "two runs: their mean");

    let from_rates = model.decode_time(model.hit_rate(160), &rates).total();
    let elsewhere = with_timed_runs("another host | cpu (2 threads) | /dev/vda1 (253:1)", &[(0.25, 0.4, &[0.1])]);
    for (what, model, rates) in
        [("another machine's runs", &elsewhere, rates.clone()), ("no machine: rates not read", &model, arithmetic_rates())]
    {
        let estimate = model.estimate_decode(160, &rates);
        assert_eq!(estimate.from_runs, None, "{what}");
        assert!((estimate.seconds_per_token - from_rates).abs() < 1e-12, "{what}: {estimate:?}");
    }
    let resident = model.estimate_decode(640, &rates);
    assert_eq!(resident, arithmetic_model().estimate_decode(640, &rates), "a resident pool has no misses to time");
    let nonsense = with_timed_runs("here", &[(0.25, 0.4, &[f64::NAN, -1.0])]);
    assert_eq!(nonsense.estimate_decode(160, &rates).from_runs, None, "times that are not times are passed over");
}

/// Between two shares the model ran at, the time per token is linear in
/// misses per token (a token's compute plus what each miss costs); beyond
/// them, the nearest share's time is split as the probe's decode is (the
/// compute at the compute rates, the rest per miss) and priced at the pool's
/// own misses, which gives back that share's time at that share.
#[test]
fn timed_runs_between_and_beyond_their_shares() {
    let rates = here(&arithmetic_rates());
    let model = with_timed_runs("here", &[(0.25, 0.3, &[0.10]), (0.5, 0.6, &[0.06])]);
    let misses = |slots: usize| model.misses_per_token(model.hit_rate(slots));
    // 240 slots: 0.375 of the experts, between the runs at 160 and 320.
    let between = model.estimate_decode(240, &rates);
    let along = (misses(240) - misses(160)) / (misses(320) - misses(160));
    assert!(along > 0.0 && along < 1.0, "{along}");
    assert!((between.seconds_per_token - (0.10 + (0.06 - 0.10) * along)).abs() < 1e-12, "{between:?}");
    assert!(matches!(between.from_runs, Some(estimate::FromRuns::Between { .. })), "{between:?}");

    // 480 slots: beyond the largest share; the run at 320 split at the rates.
    let at_half = model.hit_rate(320);
    let sample = costs::DecodeSample { seconds_per_token: 0.06, hit_rate: at_half, waited_seconds_per_token: 0.02 };
    let split = model.miss_rates_from_decode(&sample, &rates).expect("the run missed");
    let beyond = model.estimate_decode(480, &rates);
    let want = model.decode_time(model.hit_rate(480), &with_decode(&rates, split.miss_ms, split.token_ms)).total();
    assert!((beyond.seconds_per_token - want).abs() < 1e-12 && want < 0.06, "{beyond:?} vs {want}");
    assert_eq!(
        beyond.from_runs,
        Some(estimate::FromRuns::Nearest { point: model.hit_curve.timed.points("here")[1].clone(), miss_ms: split.miss_ms })
    );
    assert!((model.decode_time(at_half, &with_decode(&rates, split.miss_ms, split.token_ms)).total() - 0.06).abs() < 1e-12);
    // 80 slots: below the smallest share, slower than it.
    assert!(model.estimate_decode(80, &rates).seconds_per_token > 0.10);
}

/// The banner says where a streaming pool's speed figure came from.
#[test]
fn the_banner_says_whether_the_speed_is_measured_from_runs_or_the_rates() {
    let machine = |rates: Rates| MachineMemory { rates, ..MachineMemory::simulated(64.0, Some(60.0), None) };
    let model = with_timed_runs("here", &[(0.25, 0.3, &[0.10, 0.11]), (0.5, 0.6, &[0.06])]);
    let request = |n| PlanRequest { experts_per_layer: Some(n), context_tokens: 4096, ..Default::default() };
    let line = |model: &ModelCosts, rates: Rates, n| {
        let m = machine(rates);
        let p = plan(model, &m, &request(n)).expect("plans");
        let banner = p.banner(model, &m);
        banner.lines().find(|l| l.trim_start().starts_with("speed:")).map(str::to_string).unwrap_or_default()
    };
    let at = line(&model, here(&arithmetic_rates()), 16);
    assert!(at.contains("measured from 2 runs of this model here at this pool's size (the newest 2's median 105.0 ms a token)"), "{at}");
    let between = line(&model, here(&arithmetic_rates()), 24);
    assert!(between.contains("measured from 3 runs of this model here, between 2 runs at 16 and 1 run at 32 of 64"), "{between}");
    let beyond = line(&model, here(&arithmetic_rates()), 48);
    assert!(
        beyond.contains("measured from 1 run of this model here at 32 of 64 experts per layer (60.0 ms a token), at this pool's misses"),
        "{beyond}"
    );
    let rates = line(&model, arithmetic_rates(), 16);
    assert!(rates.contains("from the rates and hit rate above (this model's streaming runs were not timed on this machine"), "{rates}");
    assert_eq!(line(&model, here(&arithmetic_rates()), 64), "", "a resident pool has no speed line");
}

/// The prefill chunk takes what memory the pool leaves, in steps of the
/// smallest chunk, up to the planned context and the longest chunk.
#[test]
fn the_prefill_chunk_grows_with_the_memory_left_up_to_the_context() {
    let model = arithmetic_model();
    let per_token = model.activation_bytes_per_token();
    // 24 rows of 1024 + 3 x 8 rows of 1024 + 3 x 8 rows of 256, as f32.
    assert_eq!(per_token, ((24 + 24) * 1024 + 24 * 256) * 4);
    assert_eq!(prefill_chunk(&model, 0, 32768), DEFAULT_PREFILL_CHUNK);
    // Room for 1000 tokens more than the smallest chunk: 1256, down to a whole step.
    assert_eq!(prefill_chunk(&model, 1000 * per_token, 32768), 1024);
    assert_eq!(prefill_chunk(&model, 1 << 40, 32768), MAX_PREFILL_CHUNK);
    assert_eq!(prefill_chunk(&model, 1 << 40, 3000), 3072, "no longer than the context needs, in whole steps");
    assert_eq!(prefill_chunk(&model, 1 << 40, 0), DEFAULT_PREFILL_CHUNK);
    // A plan on a roomy machine gives the long chunk and counts it in the peak.
    let req = PlanRequest { experts_per_layer: Some(16), context_tokens: 8192, ..Default::default() };
    let p = plan(&model, &mac(48.0, 40.0), &req).unwrap();
    assert_eq!(p.prefill_chunk, MAX_PREFILL_CHUNK);
    assert_eq!(p.peak_bytes - peak_at_the_smallest_chunk(&p, &model), (MAX_PREFILL_CHUNK - DEFAULT_PREFILL_CHUNK) as u64 * per_token);
}

/// With no context asked for, the context grows to what memory allows; where
/// that is short of 32k tokens an auto pool gives slots for it, and says so;
/// an explicit pool keeps its slots.
#[test]
fn the_default_context_trades_pool_slots_for_kv_and_says_so() {
    let model = ModelCosts::flagship();
    let fixed = PlanRequest { context_tokens: 4096, ..Default::default() };
    let grow = PlanRequest { grow_to: Some(usize::MAX), ..fixed.clone() };
    let (before, after) = (plan(&model, &mac(48.0, 40.0), &fixed).unwrap(), plan(&model, &mac(48.0, 40.0), &grow).unwrap());
    assert_eq!(before.context_tokens, 4096);
    assert!(after.context_tokens >= context::AUTO_CONTEXT_FLOOR && after.slots < before.slots, "{after:?}");
    let kv = (after.context_tokens - 4096) as u64 * model.kv_bytes_per_token;
    assert!(after.notes.iter().any(|n| n.contains("to the KV cache")), "{:?}", after.notes);
    // The peak holds the longer context's KV in place of the slots given.
    let traded = (before.slots - after.slots) as u64 * model.expert_record_bytes;
    assert_eq!(peak_at_the_smallest_chunk(&after, &model), peak_at_the_smallest_chunk(&before, &model) - traded + kv);
    assert!(after.banner(&model, &mac(48.0, 40.0)).contains(&format!("context: {} tokens", after.context_tokens)));
    // Plenty of memory: the model's whole context, the pool untouched.
    let big = plan(&model, &MachineMemory::simulated(512.0, Some(480.0), None), &grow).unwrap();
    assert_eq!(big.context_tokens, 262_144);
    let explicit = PlanRequest { experts_per_layer: Some(100), ..grow };
    let p = plan(&model, &mac(48.0, 40.0), &explicit).unwrap();
    assert_eq!(p.experts_per_layer, 100.0);
    assert!(!p.notes.iter().any(|n| n.contains("to the KV cache")), "{:?}", p.notes);
}

/// The default context grows with a smaller KV cache: the planner counts
/// KV bytes per token by the backend's KV type (`--kv-cache`), so q8 gives
/// a longer context than f16, and f16 than f32, in the same memory and pool.
#[test]
fn the_default_context_grows_with_a_smaller_kv_cache() {
    use slotstream_backend::KvCacheType;
    let grow = PlanRequest { experts_per_layer: Some(100), context_tokens: 4096, grow_to: Some(usize::MAX), ..Default::default() };
    let context = |kv| {
        let model = ModelCosts::flagship_with_kv(kv);
        plan(&model, &mac(32.0, 28.0), &grow).unwrap().context_tokens
    };
    let [f32_ctx, f16_ctx, q8_ctx] = [KvCacheType::F32, KvCacheType::F16, KvCacheType::Q8].map(context);
    assert!(f32_ctx < f16_ctx && f16_ctx < q8_ctx, "f32 {f32_ctx}, f16 {f16_ctx}, q8 {q8_ctx}");
    assert!(q8_ctx < 262_144, "the model's whole context fit: the test needs a tighter machine");
}

/// Four sequences by default where three more sequences' KV and state fit
/// beside the plan, two where one more does, else one; the banner says which.
#[test]
fn the_parallel_default_is_what_the_memory_left_holds() {
    let model = ModelCosts { kv_bytes_per_token: 1000, state_bytes: 5000, ..arithmetic_model() };
    let (n, each) = parallel_within(&model, 100_000, 0);
    assert_eq!((n, each), (1, model.kv_bytes_per_token * PARALLEL_CONTEXT as u64 + model.state_bytes));
    assert_eq!(parallel_within(&model, 100_000, each).0, 2);
    assert_eq!(parallel_within(&model, 100_000, 3 * each - 1).0, 2);
    assert_eq!(parallel_within(&model, 100_000, 3 * each).0, DEFAULT_PARALLEL);
    assert_eq!(parallel_within(&model, 10, 0).1, model.kv_bytes_per_token * 10 + model.state_bytes, "no more than the context");
    // Every expert fits with room to spare: four.
    let roomy = plan(&model, &mac(48.0, 40.0), &PlanRequest { context_tokens: 4096, ..Default::default() }).unwrap();
    assert_eq!(roomy.slots, roomy.total_experts);
    assert_eq!(roomy.parallel, DEFAULT_PARALLEL, "{roomy:?}");
    assert!(roomy.banner(&model, &mac(48.0, 40.0)).contains("parallel: 4 sequences at once"));
    // The flagship streams on 48 GB: its pool takes what auto may use.
    let flagship = ModelCosts::flagship();
    let tight = plan(&flagship, &mac(48.0, 40.0), &PlanRequest { context_tokens: 4096, ..Default::default() }).unwrap();
    assert!(tight.slots < tight.total_experts);
    assert_eq!(tight.parallel, 1, "{tight:?}");
    assert!(tight.banner(&flagship, &mac(48.0, 40.0)).contains("parallel: 1 sequence at a time"));
}
