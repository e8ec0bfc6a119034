//! Greedy tokens chosen on the device (`choose_greedy`, `embed_chosen`, a
//! started read): the token a plain scan of the logits picks, the embedding
//! row `embed` gives for it, and a read that waits only for its own work.

mod common;

use common::check::{affine, matrix};
use common::Rng;
use slotstream_backend::chosen::scan;
use slotstream_backend::{Backend, Tensor};
use slotstream_wgpu::{AdapterChoice, WgpuBackend, WgpuOptions};

fn chosen(b: &dyn Backend, logits: &[f32]) -> u32 {
    let t = b.upload(logits, &[1, logits.len()]).expect("upload");
    let c = b.choose_greedy(&t).expect("choose_greedy");
    let read = b.start_reading_chosen(&c).expect("start reading");
    b.finish_reading_chosen(read).expect("finish reading")
}

#[test]
fn the_device_chooses_what_a_plain_scan_chooses() {
    let Some(b) = common::gpu() else { return };
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let mut cases: Vec<Vec<f32>> = vec![
        vec![1.0],
        vec![nan],
        vec![nan, 5.0, 7.0],
        vec![2.0, nan, 7.0, nan],
        vec![-0.0, 0.0, 0.0],
        vec![0.0, -0.0],
        vec![-inf, -inf],
        vec![1.0, inf, inf, 2.0],
        vec![-inf, nan, -1.0],
    ];
    let mut rng = Rng::new(11);
    for n in [5000, 151_936, 600_000] {
        // Coarse values, so that the largest repeats across parts.
        let mut l: Vec<f32> = (0..n).map(|_| (rng.next() * 64.0).round()).collect();
        cases.push(l.clone());
        l[n - 1] = 1e9;
        l[n / 2] = 1e9;
        cases.push(l.clone());
        l[0] = nan;
        cases.push(l);
    }
    for l in &cases {
        let shown: Vec<f32> = l.iter().take(6).copied().collect();
        assert_eq!(chosen(b, l), scan(l), "{} logits starting {shown:?}", l.len());
    }
}

#[test]
fn the_chosen_token_embeds_as_its_id_and_reads_back_after_later_work() {
    // A backend of its own: it shards weights smaller than the shared one.
    if common::gpu().is_none() {
        return;
    }
    let b = WgpuBackend::new(&AdapterChoice::allow_software()).expect("a wgpu device");
    let mut rng = Rng::new(3);
    let table = matrix(&mut rng, affine(4, 64), 1, 300, 256);
    b.cap_shard_bytes(16 * 1024);
    let w = b.load_weight(&table).expect("load the table");
    b.cap_shard_bytes(0);
    let mut reads = Vec::new();
    let mut rows: Vec<(u32, Tensor)> = Vec::new();
    for id in [0u32, 1, 77, 150, 299] {
        let mut logits = rng.vec(300, 1.0);
        logits[id as usize] = 2.0;
        let t = b.upload(&logits, &[1, 300]).expect("upload");
        let c = b.choose_greedy(&t).expect("choose");
        reads.push((id, b.start_reading_chosen(&c).expect("start reading")));
        rows.push((id, b.embed_chosen(&w, &c).expect("embed_chosen")));
    }
    // Every read started before later tokens' work was recorded and submitted.
    for (id, read) in reads {
        assert_eq!(b.finish_reading_chosen(read).expect("finish reading"), id);
    }
    for (id, row) in rows {
        let want = b.download(&b.embed(&w, &[id]).expect("embed")).expect("download");
        let got = b.download(&row).expect("download");
        assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "row of token {id}");
    }
}

/// Submissions made while recording `adds` dependent adds (periodic ones,
/// every 8 dispatches when nothing holds them back).
fn submissions_during_adds(b: &WgpuBackend, adds: usize) -> u64 {
    let y = b.upload(&[1.0; 16], &[1, 16]).expect("upload");
    let mut x = b.upload(&[0.0; 16], &[1, 16]).expect("upload");
    b.take_host_time();
    for _ in 0..adds {
        x = b.add(&x, &y).expect("add");
    }
    let (_, _, submits) = b.take_host_time();
    assert_eq!(b.download(&x).expect("download")[0], adds as f32);
    submits
}

#[test]
fn no_periodic_submissions_while_a_started_read_is_outstanding_and_nothing_waited() {
    if common::gpu().is_none() {
        return;
    }
    let open = |flush_ahead| {
        let options = WgpuOptions { flush_every: 8, flush_first: 0, flush_ahead, ..WgpuOptions::from_env() };
        WgpuBackend::with_options(&AdapterChoice::allow_software(), options).expect("a wgpu device")
    };
    let b = open(false);
    let start = |b: &WgpuBackend| {
        let c = b.choose_greedy(&b.upload(&[0.5, 2.0, 1.0], &[1, 3]).expect("upload")).expect("choose");
        b.start_reading_chosen(&c).expect("start reading")
    };
    assert!(submissions_during_adds(&b, 40) >= 4, "periodic submissions with no read outstanding");
    // Decoding one token ahead: the next token is recorded while the read of the one before is outstanding.
    let read = start(&b);
    assert_eq!(submissions_during_adds(&b, 40), 0, "no submission while a read is outstanding");
    let next = start(&b);
    assert_eq!(b.finish_reading_chosen(read).expect("finish reading"), 1);
    assert_eq!(submissions_during_adds(&b, 40), 0, "the later read is still outstanding");
    assert_eq!(b.finish_reading_chosen(next).expect("finish reading"), 1);
    assert!(submissions_during_adds(&b, 40) >= 4, "periodic submissions again once every read is finished");
    // A wait for all work (a layer's routed experts, when streaming) drains
    // the GPU: periodic submissions again although a read is outstanding.
    let read = start(&b);
    b.download(&b.upload(&[1.0], &[1, 1]).expect("upload")).expect("download");
    assert!(submissions_during_adds(&b, 40) >= 4, "periodic submissions again after a wait for all work");
    assert_eq!(b.finish_reading_chosen(read).expect("finish reading"), 1);
    // A read dropped unfinished holds nothing back either.
    drop(start(&b));
    assert!(submissions_during_adds(&b, 40) >= 4, "periodic submissions again once the read is dropped");
    // flush_ahead (in code) keeps them.
    let ahead = open(true);
    let read = start(&ahead);
    assert!(submissions_during_adds(&ahead, 40) >= 4, "periodic submissions kept while a read is outstanding");
    drop(read);
}
