//! Greedy tokens chosen on the device (`choose_greedy`, `embed_chosen`, a
//! started read): the token a plain scan of the logits picks, the embedding
//! row `embed` gives for it, and a read that waits only for its own work.

mod common;

use common::check::{affine, matrix};
use common::Rng;
use slotstream_backend::chosen::scan;
use slotstream_backend::{Backend, Tensor};
use slotstream_wgpu::{AdapterChoice, WgpuBackend};

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
