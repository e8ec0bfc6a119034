//! Greedy tokens chosen and embedded on the device (`wgsl/embed.wgsl`'s
//! `argmax_parts` and `embed_chosen`; see `slotstream_backend::chosen`): a
//! chosen token is a `[parts, 2]` tensor of each part's best logit and index
//! (u32 words), which the embedding kernel folds itself and the host folds
//! when it reads the token back.

use slotstream_backend::chosen::{Best, PendingRead};
use slotstream_backend::{checks, shape_error, BackendError, Result, Tensor, Weight};

use crate::gpu::{whole, Gpu, StartedRead};
use crate::matmul::{EMBED_OUT, W_WORDS};
use crate::params::EmbedParams;
use crate::tensors::{buf, new_tensor, weight};

const LOGITS: u32 = 5;
const CHOSEN: u32 = 7;

/// Logits each part takes at least, and the most parts (the kernels' workgroup arrays).
const PART_LOGITS: usize = 2048;
const MAX_PARTS: usize = 256;

/// The greedy token of `logits` (`[1, vocab]`) as its parts' bests.
pub(crate) fn choose_greedy(gpu: &Gpu, logits: &Tensor) -> Result<Tensor> {
    let shape = logits.shape();
    if shape.len() != 2 || shape[0] != 1 || shape[1] == 0 || shape[1] > u32::MAX as usize - 1 {
        return Err(shape_error("choose_greedy", format!("logits of shape {shape:?} (one row of at least one logit)")));
    }
    let vocab = shape[1];
    let parts = vocab.div_ceil(PART_LOGITS).clamp(1, MAX_PARTS);
    let (out, ob) = new_tensor(gpu, 2 * parts, vec![parts, 2])?;
    let params = EmbedParams { count: vocab as u32, parts: parts as u32, ..Default::default() };
    gpu.dispatch("argmax_parts", &params, &[(LOGITS, buf(logits)?), (CHOSEN, ob.bind())], [parts as u32, 1, 1])?;
    Ok(out)
}

fn parts_of(chosen: &Tensor) -> Result<usize> {
    match chosen.shape() {
        &[parts, 2] if (1..=MAX_PARTS).contains(&parts) => Ok(parts),
        s => Err(shape_error("embed_chosen", format!("a chosen token of shape {s:?} (one from choose_greedy)"))),
    }
}

/// The embedding row `[1, cols]` of a chosen token.
pub(crate) fn embed_chosen(gpu: &Gpu, table: &Weight, chosen: &Tensor) -> Result<Tensor> {
    let w = weight(table)?;
    checks::token_ids(&[0], w.experts * w.rows)?;
    let parts = parts_of(chosen)?;
    let (out, ob) = new_tensor(gpu, w.cols, vec![1, w.cols])?;
    for s in &w.shards {
        let params = EmbedParams { w: s.desc, count: 1, row_start: s.row_start as u32, shard_rows: s.rows as u32, parts: parts as u32 };
        let binds = [(W_WORDS, whole(&s.buffer)), (EMBED_OUT, ob.bind()), (CHOSEN, buf(chosen)?)];
        gpu.dispatch("embed_chosen", &params, &binds, [w.cols.div_ceil(64) as u32, 1, 1])?;
    }
    Ok(out)
}

/// Starts reading a chosen token's parts back.
pub(crate) fn start_reading(gpu: &Gpu, chosen: &Tensor) -> Result<PendingRead> {
    let parts = parts_of(chosen)?;
    Ok(PendingRead(Box::new(gpu.start_download(buf(chosen)?, 8 * parts as u64)?)))
}

/// The token a started read returns.
pub(crate) fn finish_reading(gpu: &Gpu, read: PendingRead) -> Result<u32> {
    let started = read.0.downcast::<StartedRead>().map_err(|_| BackendError::Device("a read the wgpu backend did not start".into()))?;
    let bytes = gpu.finish_download(*started)?;
    let pairs: Vec<[u32; 2]> = bytes
        .chunks_exact(8)
        .map(|c| [u32::from_le_bytes([c[0], c[1], c[2], c[3]]), u32::from_le_bytes([c[4], c[5], c[6], c[7]])])
        .collect();
    Ok(Best::merge(&pairs))
}
