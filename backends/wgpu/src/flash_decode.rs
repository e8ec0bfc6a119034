//! A decode step's attention over a long f16 KV cache: `wgsl/flash_decode.wgsl`
//! (the keys cut into chunks, each a workgroup's, merged in the last one of
//! each kv head, or by `flash_attention.wgsl`'s `flash_merge` where workgroups
//! cannot hand partials to each other).

use slotstream_backend::{BackendError, KvCacheType, Result};

use crate::gpu::{whole, Bind, Gpu};
use crate::params::{FlashParams, FLASH_DECODE_MIN_KEYS, FLASH_MERGE_RUNS, KEYS, KNEW, MERGE_COUNTS, MERGE_PAIRS, OUT, PARTIALS, Q, VALUES, VNEW};
use crate::state::GpuKvCache;

/// Query heads of a kv head a workgroup takes (`ROWS`): groups over eight
/// take more passes.
const ROWS: usize = 8;
/// Keys a workgroup walks at a time (`BLOCK`): chunks are whole blocks.
const BLOCK: usize = 128;
/// Most chunks of a call (`MAX_SPLITS`: the merge's weights fit the kernel's
/// score array).
const MAX_SPLITS: usize = 128;

/// Whether the adapter's subgroups hold whole keys' eight lanes (8 to 128
/// lanes, the workgroup's 128 in whole subgroups). wgpu reports 4 to 64 for
/// every Metal adapter; Apple's GPUs run 32-wide SIMD groups.
fn lanes_of_eight(gpu: &Gpu) -> bool {
    let apple = gpu.info.backend == wgpu::Backend::Metal && gpu.info.name.starts_with("Apple");
    (gpu.subgroup_min >= 8 || apple) && gpu.subgroup_max <= 128
}

/// The `flash_decode` pipeline for this cache, when a call can take it: one
/// token of dense attention over at least `FLASH_DECODE_MIN_KEYS` keys (the
/// fresh one included) of an f16 cache of a head dim it is compiled for,
/// on an adapter whose subgroups hold whole keys ([`lanes_of_eight`]).
pub(crate) fn decode_pipeline(gpu: &Gpu, cache: &GpuKvCache, tokens: usize, keys: usize) -> Option<&'static str> {
    let name = match cache.head_dim {
        64 => "flash_decode_hd64",
        128 => "flash_decode_hd128",
        256 => "flash_decode_hd256",
        _ => return None,
    };
    let fits = tokens == 1 && keys >= FLASH_DECODE_MIN_KEYS && cache.kind == KvCacheType::F16 && cache.kv_heads > 0;
    (gpu.flash_attention && fits && lanes_of_eight(gpu) && gpu.has_kernel(name)).then_some(name)
}

/// Chunks and keys per chunk for `keys` keys when `others` workgroups (kv
/// heads times passes) share each chunk index: about `target` workgroups in
/// all, chunks of whole blocks, at most `MAX_SPLITS` of them.
fn decode_split(keys: usize, others: usize, target: usize) -> (usize, usize) {
    let wanted = target.div_ceil(others.max(1)).clamp(1, MAX_SPLITS);
    let chunk = keys.div_ceil(wanted).div_ceil(BLOCK).max(1) * BLOCK;
    (keys.div_ceil(chunk), chunk)
}

/// One token's attention through `flash_decode` (`pipeline`, from
/// [`decode_pipeline`]): the query `q` [1, heads * head_dim] against every
/// key of `cache` (whose length counts the token; with `fresh`, its key and
/// value rows, which the kernel writes to the cache).
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_decode(
    gpu: &Gpu,
    pipeline: &'static str,
    cache: &GpuKvCache,
    [q, out]: [Bind<'_>; 2],
    heads: usize,
    scale: f32,
    fresh: Option<(Bind<'_>, Bind<'_>)>,
) -> Result<()> {
    let (kv_heads, hd) = (cache.kv_heads, cache.head_dim);
    let passes = (heads / kv_heads).div_ceil(ROWS);
    let others = kv_heads * passes;
    let (splits, chunk) = decode_split(cache.len, others, gpu.flash_workgroups);
    let merge = gpu.merge_in_split && others <= MERGE_PAIRS;
    let params = FlashParams {
        tokens: 1,
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        past: (cache.len - 1) as u32,
        splits: splits as u32,
        chunk: chunk as u32,
        scale,
        fresh: fresh.is_some() as u32,
        kv: 1,
        merge: merge as u32,
        ..Default::default()
    };
    let partials = gpu.alloc_for(crate::gpu::Scratch::Partials, 4 * (heads * splits * (hd + 2)) as u64)?;
    let (knew, vnew) = fresh.unwrap_or((q, q));
    let binds = [
        (Q, q),
        (OUT, out),
        (KEYS, whole(&cache.keys)),
        (VALUES, whole(&cache.values)),
        (PARTIALS, partials.bind()),
        (KNEW, knew),
        (VNEW, vnew),
        (MERGE_COUNTS, whole(&gpu.merge_counts)),
    ];
    gpu.dispatch(pipeline, &params, &binds, Gpu::grid((others * splits) as u64))?;
    if splits == 1 || merge {
        return Ok(());
    }
    let merge_kernel = match hd {
        64 => "flash_merge_hd64",
        128 => "flash_merge_hd128",
        256 => "flash_merge_hd256",
        _ => return Err(BackendError::Unsupported(format!("flash attention of head dim {hd}"))),
    };
    let blocks = (hd / 4).div_ceil(FLASH_MERGE_RUNS);
    gpu.dispatch(merge_kernel, &params, &[(OUT, out), (PARTIALS, partials.bind())], Gpu::grid((heads * blocks) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_blocks_that_cover_the_keys() {
        // A at depth 8k: 4 kv heads, one pass, 264 workgroups wanted -> 64 chunks of 128.
        assert_eq!(decode_split(8193, 4, 264), (65, 128));
        assert_eq!(decode_split(8192, 4, 264), (64, 128));
        // 32k keys: chunks of four blocks.
        assert_eq!(decode_split(32000, 4, 264), (63, 512));
        // One kv head over 128k keys: at most MAX_SPLITS chunks.
        let (splits, chunk) = decode_split(131_072, 1, 264);
        assert_eq!((splits, chunk), (MAX_SPLITS, 1024));
        for (keys, others) in [(1024, 1), (1025, 2), (5000, 8), (70_000, 3), (1, 1)] {
            let (splits, chunk) = decode_split(keys, others, 264);
            assert!(chunk % BLOCK == 0 && splits <= MAX_SPLITS, "{keys} keys");
            assert!(chunk * splits >= keys && chunk * (splits - 1) < keys, "{keys} keys, {others}: {splits} x {chunk}");
        }
    }
}
