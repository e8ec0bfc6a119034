//! Typed calls of `wgsl/rope.wgsl` and `wgsl/attention.wgsl`: rotary
//! embedding, and causal (optionally block-sparse) attention against a KV
//! cache the new keys and values were already appended to (`state.rs`).

use slotstream_backend::{attention_qk_norm_composed, checks, BackendError, KeySelection, KvCacheType, QkNorm, Result, Rope, State, Tensor};

use crate::flash_decode::{decode_pipeline, flash_decode};
use crate::gpu::{whole, Bind, Gpu};
use crate::params::{
    AttentionParams, FlashParams, RopeParams, FLASH_DECODE_MIN_KEYS, FLASH_MERGE_RUNS, KEYS, K_WEIGHT, KNEW, MERGE_COUNTS, MERGE_PAIRS,
    OUT, PARTIALS, Q, Q_WEIGHT, ROPE_ANGLES_IN, SELECTION, TARGET_WORKGROUPS, VALUES, VNEW,
};
use crate::state::GpuKvCache;
use crate::tensors::{buf, new_tensor};
use crate::WgpuBackend;

/// `FlashParams::kv` (and `AttentionParams::kv`) of a cache.
fn kv_code(cache: &GpuKvCache) -> u32 {
    match cache.kind {
        KvCacheType::F32 => 0,
        KvCacheType::F16 => 1,
        KvCacheType::Q8 => 2,
    }
}

// Bindings of rope.wgsl.
const ROPE_X: u32 = 2;
const ROPE_OUT: u32 = 3;
const ROPE_ANGLES: u32 = 4;


/// Largest head dim whose query and fresh key the `*_rope` attention kernels
/// stage together (the key in the upper half of the query's workgroup array).
pub(crate) const ROPE_MAX_HEAD_DIM: usize = 256;

/// What decode attention needs to normalise and rotate the raw query and
/// fresh key rows itself (`rope` in `wgsl/attention.wgsl`).
pub(crate) struct QkRope<'a> {
    /// `rope_angles` of the one token.
    pub angles: Bind<'a>,
    pub weights: [Bind<'a>; 2],
    pub eps: [f32; 2],
    pub half: usize,
}

/// Rotary embedding of the `values` values of `x: [tokens, heads, head_dim]`
/// on the first `rotary_dim` values of each head, token `t` at position
/// `start_pos + t`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope(
    gpu: &Gpu,
    x: Bind<'_>,
    out: Bind<'_>,
    values: usize,
    [tokens, heads, head_dim]: [usize; 3],
    rotary_dim: usize,
    rope: Rope,
    start_pos: usize,
) -> Result<()> {
    let half = rotary_dim / 2;
    let angles = rope_angles(gpu, tokens, rotary_dim, rope, start_pos)?;
    let n = values;
    let params = RopeParams { n: n as u32, heads: heads as u32, head_dim: head_dim as u32, half: half as u32 };
    let binds = [(ROPE_X, x), (ROPE_OUT, out), (ROPE_ANGLES, whole(&angles))];
    gpu.dispatch("rope", &params, &binds, Gpu::grid((n as u64).div_ceil(256)))
}

/// The rotary table [`Rope::table`] for positions `start_pos..start_pos +
/// tokens`, as a small input of the next submission.
pub(crate) fn rope_angles(gpu: &Gpu, tokens: usize, rotary_dim: usize, rope: Rope, start_pos: usize) -> Result<wgpu::Buffer> {
    gpu.small_input("rope angles", bytemuck::cast_slice(&rope.table(rotary_dim, start_pos, tokens)))
}

/// Attention of the last `tokens` positions of `cache` (queries `q`) over
/// the cache, into `out: [tokens, heads*head_dim]`: `attention` when one
/// workgroup per (token, head) already fills the GPU (prefill, short
/// contexts), else `attention_split` over key chunks and `attention_merge`
/// (or the split kernel's own merge, [`Gpu::merge_in_split`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    gpu: &Gpu,
    cache: &GpuKvCache,
    q: Bind<'_>,
    out: Bind<'_>,
    tokens: usize,
    heads: usize,
    scale: f32,
    selection: Option<&KeySelection>,
    fresh: Option<(Bind<'_>, Bind<'_>)>,
    rope: Option<QkRope<'_>>,
) -> Result<()> {
    let past = cache.len - tokens;
    // A selection whose every query is dense is plain causal attention: one
    // shared [DENSE] row.
    let (words, most_keys, block, sel_stride) =
        match selection.filter(|sel| sel.blocks.chunks_exact(sel.per_query).any(|r| r[0] != KeySelection::DENSE)) {
            None => (vec![KeySelection::DENSE], past + tokens, 0, 0),
            Some(sel) => {
                let (words, most_keys) = selection_rows(sel, past, tokens);
                (words, most_keys, sel.block, sel.per_query + 1)
            }
        };
    if sel_stride == 0 && rope.is_none() {
        if let Some(pipeline) = decode_pipeline(gpu, cache, tokens, cache.len) {
            return flash_decode(gpu, pipeline, cache, [q, out], heads, scale, fresh);
        }
        if let Some(pipeline) = flash_pipeline(gpu, cache, heads, tokens, cache.len) {
            return flash_attend(gpu, pipeline, cache, [q, out], tokens, heads, scale, fresh);
        }
    }
    if cache.kind == KvCacheType::Q8 && fresh.is_some() {
        // The per-head kernels read q8 but write only f32 and f16 rows.
        return Err(BackendError::Device("a q8 KV cache's new rows go through kv_store_q8 before attention".into()));
    }
    let sel_buf = gpu.small_input("key selection", bytemuck::cast_slice(&words))?;
    let pairs = tokens * heads;
    let (chunk, splits) = split_keys(pairs, most_keys, gpu.attention_min_chunk);
    let params = AttentionParams {
        tokens: tokens as u32,
        heads: heads as u32,
        kv_heads: cache.kv_heads as u32,
        head_dim: cache.head_dim as u32,
        past: past as u32,
        chunk: chunk as u32,
        scale,
        block: block as u32,
        sel_stride: sel_stride as u32,
        splits: splits as u32,
        fresh: fresh.is_some() as u32,
        rope: rope.is_some() as u32,
        rope_half: rope.as_ref().map_or(0, |r| r.half as u32),
        q_eps: rope.as_ref().map_or(0.0, |r| r.eps[0]),
        k_eps: rope.as_ref().map_or(0.0, |r| r.eps[1]),
        kv: kv_code(cache),
        ..Default::default()
    };
    let (keys, values, sel) = ((KEYS, whole(&cache.keys)), (VALUES, whole(&cache.values)), (SELECTION, whole(&sel_buf)));
    // Without fresh rows the kernels never read bindings 8 and 9, which their
    // layouts hold all the same.
    let (knew, vnew) = fresh.unwrap_or((q, q));
    let (knew, vnew) = ((KNEW, knew), (VNEW, vnew));
    // Likewise 10-12 without `rope`.
    let with_rope = rope.is_some();
    let (angles, [qw, kw]) = rope.map_or((q, [q, q]), |r| (r.angles, r.weights));
    let rope_binds = [(ROPE_ANGLES_IN, angles), (Q_WEIGHT, qw), (K_WEIGHT, kw)];
    if splits == 1 {
        let binds = [(Q, q), (OUT, out), keys, values, sel, knew, vnew, rope_binds[0], rope_binds[1], rope_binds[2]];
        let entry = if with_rope { "attention_rope" } else { "attention" };
        return gpu.dispatch(entry, &params, &binds, Gpu::grid(pairs as u64));
    }
    let partials = gpu.alloc_for(crate::gpu::Scratch::Partials, 4 * (pairs * splits * (cache.head_dim + 2)) as u64)?;
    let merge = gpu.merge_in_split && pairs <= MERGE_PAIRS;
    let params = AttentionParams { merge: merge as u32, ..params };
    let counts = (MERGE_COUNTS, whole(&gpu.merge_counts));
    let binds = [(Q, q), (OUT, out), keys, values, (PARTIALS, partials.bind()), sel, knew, vnew, rope_binds[0], rope_binds[1], rope_binds[2], counts];
    // The `_regs` kernels take chunks that fit their registers and hand the
    // rest to the plain ones.
    let entry = match (with_rope, gpu.attention_regs) {
        (true, true) => "attention_split_rope_regs",
        (true, false) => "attention_split_rope",
        (false, true) => "attention_split_regs",
        (false, false) => "attention_split",
    };
    gpu.dispatch(entry, &params, &binds, Gpu::grid((pairs * splits) as u64))?;
    if merge {
        return Ok(());
    }
    gpu.dispatch("attention_merge", &params, &[(OUT, out), (PARTIALS, partials.bind())], Gpu::grid(pairs as u64))
}

/// Fewest keys per flash attention chunk.
const FLASH_MIN_CHUNK: usize = 128;
/// Invocations of `flash_attention` in a slot (one row and key slice).
const FLASH_SLOT_LANES: u32 = 4;
/// Slots of a `flash_attention` workgroup.
const FLASH_SLOTS: usize = 64;

/// The pipelines compiled for a head dim (`kernels.rs`'s `FLASH_PIPELINES`
/// `KV_STORE_PIPELINES` and `FLASH_MERGE_PIPELINES`): `flash_attention`, its two-rows-per-slot form
/// (head dims up to 128), and `kv_store`.
struct HeadDimKernels {
    flash: &'static str,
    two_rows: Option<&'static str>,
    kv_store: &'static str,
    kv_store_q8: &'static str,
    merge: &'static str,
}

fn head_dim_kernels(head_dim: usize) -> Option<HeadDimKernels> {
    let (flash, two_rows, kv_store, kv_store_q8, merge) = match head_dim {
        64 => ("flash_attention_hd64", Some("flash_attention_hd64_r2"), "kv_store_hd64", "kv_store_q8_hd64", "flash_merge_hd64"),
        128 => ("flash_attention_hd128", Some("flash_attention_hd128_r2"), "kv_store_hd128", "kv_store_q8_hd128", "flash_merge_hd128"),
        256 => ("flash_attention_hd256", None, "kv_store_hd256", "kv_store_q8_hd256", "flash_merge_hd256"),
        _ => return None,
    };
    Some(HeadDimKernels { flash, two_rows, kv_store, kv_store_q8, merge })
}

/// Whether `flash_attention` runs here at all: on, with subgroups of whole slots.
fn flash_runs(gpu: &Gpu) -> bool {
    gpu.flash_attention && gpu.subgroup_min >= FLASH_SLOT_LANES && gpu.subgroup_max <= 256
}

/// The `flash_attention` pipeline for this cache's head dim, when the call
/// can take it: dense attention (the caller checks), a head dim it is
/// compiled for, query groups of at most 64 heads, subgroups of whole slots,
/// and a prefill or a decode step over enough keys (`keys`, the fresh
/// ones included) or any step over a q8 cache (as before the per-head
/// kernels read q8; which of the two is faster there is not measured).
pub(crate) fn flash_pipeline(gpu: &Gpu, cache: &GpuKvCache, heads: usize, tokens: usize, keys: usize) -> Option<&'static str> {
    let name = head_dim_kernels(cache.head_dim)?.flash;
    let group = heads / cache.kv_heads.max(1);
    let long_enough = tokens > 1 || keys >= FLASH_DECODE_MIN_KEYS || cache.kind == KvCacheType::Q8;
    (flash_runs(gpu) && group <= FLASH_SLOTS && long_enough && gpu.has_kernel(name)).then_some(name)
}

/// The launch shape of `flash_attention`: tokens per workgroup, key slices,
/// chunks and keys per chunk (a multiple of the kernel's tile, `2048 /
/// head_dim` keys).
fn flash_shape(tokens: usize, heads: usize, kv_heads: usize, head_dim: usize, keys: usize, target: usize, rows_per_slot: usize) -> [usize; 4] {
    let group = heads / kv_heads;
    let tb = (rows_per_slot * FLASH_SLOTS / group).clamp(1, tokens);
    let rows = tb * group;
    let mut slices = 1;
    while rows * slices * 2 <= FLASH_SLOTS {
        slices *= 2;
    }
    let base = kv_heads * tokens.div_ceil(tb);
    let tile = 2048 / head_dim;
    let wanted = target.div_ceil(base).min(keys.div_ceil(FLASH_MIN_CHUNK)).max(1);
    let chunk = keys.div_ceil(wanted).div_ceil(tile) * tile;
    [tb, slices, keys.div_ceil(chunk), chunk]
}

/// Dense causal attention of the last `tokens` positions of `cache` through
/// `flash_attention` (`pipeline`, from [`flash_pipeline`]), then
/// `attention_merge` when the keys were cut into chunks.
#[allow(clippy::too_many_arguments)]
fn flash_attend(
    gpu: &Gpu,
    pipeline: &'static str,
    cache: &GpuKvCache,
    [q, out]: [Bind<'_>; 2],
    tokens: usize,
    heads: usize,
    scale: f32,
    fresh: Option<(Bind<'_>, Bind<'_>)>,
) -> Result<()> {
    let (kv_heads, hd) = (cache.kv_heads, cache.head_dim);
    // Two rows per slot where one row each leaves no slot idle (a prefill).
    let fills = gpu.flash_two_rows && tokens * (heads / kv_heads) > FLASH_SLOTS;
    let two = head_dim_kernels(hd).and_then(|k| k.two_rows).filter(|_| fills);
    let pipeline = two.unwrap_or(pipeline);
    let rows_per_slot = if two.is_some() { 2 } else { 1 };
    let [tb, slices, splits, chunk] = flash_shape(tokens, heads, kv_heads, hd, cache.len, gpu.flash_workgroups, rows_per_slot);
    let params = FlashParams {
        tokens: tokens as u32,
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        past: (cache.len - tokens) as u32,
        tb: tb as u32,
        slices: slices as u32,
        splits: splits as u32,
        chunk: chunk as u32,
        scale,
        fresh: fresh.is_some() as u32,
        kv: kv_code(cache),
        ..Default::default()
    };
    let pairs = tokens * heads;
    // One chunk writes `out` itself and never touches the partials (a
    // prefill's 2,048 rows on Qwen3-30B-A3B's trunk would take 34 MB of them).
    let partial_floats = if splits == 1 { 4 } else { pairs * splits * (hd + 2) };
    let partials = gpu.alloc_for(crate::gpu::Scratch::Partials, 4 * partial_floats as u64)?;
    let (knew, vnew) = fresh.unwrap_or((q, q));
    let (keys, values) = (whole(&cache.keys), whole(&cache.values));
    let binds = [(Q, q), (OUT, out), (KEYS, keys), (VALUES, values), (PARTIALS, partials.bind()), (KNEW, knew), (VNEW, vnew)];
    let groups = kv_heads * tokens.div_ceil(tb) * splits;
    gpu.dispatch(pipeline, &params, &binds, Gpu::grid(groups as u64))?;
    if splits == 1 {
        return Ok(());
    }
    // flash_merge: a workgroup per pair and block of FLASH_MERGE_RUNS vec4 runs.
    let merge = head_dim_kernels(hd).ok_or_else(|| BackendError::Unsupported(format!("flash attention of head dim {hd}")))?.merge;
    let blocks = (hd / 4).div_ceil(FLASH_MERGE_RUNS);
    gpu.dispatch(merge, &params, &[(OUT, out), (PARTIALS, partials.bind())], Gpu::grid((pairs * blocks) as u64))
}

/// The type a new KV cache of heads of `head_dim` keeps when `asked` for
/// one (`WgpuOptions::kv_cache`; `None`: f16 in the fast (int8) matmul
/// `mode`, as the CPU backend does, f32 in the exact one): q8 where
/// `kv_store_q8` is compiled for the head dim (64, 128, 256; `flash_attention`
/// and the per-head kernels read it), f16 where `kv_store` is (the per-head
/// kernels read f16 of any head dim of a multiple of four), else f32.
pub(crate) fn kv_type(gpu: &Gpu, asked: Option<KvCacheType>, mode: crate::MatmulMode, head_dim: usize) -> KvCacheType {
    let fast = mode == crate::MatmulMode::Int8;
    let asked = asked.unwrap_or(if fast { KvCacheType::F16 } else { KvCacheType::F32 });
    let kernels = head_dim_kernels(head_dim);
    let has = |name: fn(&HeadDimKernels) -> &'static str| kernels.as_ref().is_some_and(|k| gpu.has_kernel(name(k)));
    match asked {
        KvCacheType::Q8 if has(|k| k.kv_store_q8) => KvCacheType::Q8,
        KvCacheType::F16 | KvCacheType::Q8 if has(|k| k.kv_store) => KvCacheType::F16,
        _ => KvCacheType::F32,
    }
}

/// Records appending `tokens` rows of keys `k` and values `v` (f32
/// `[tokens, kv_heads*head_dim]`) to `cache`: a copy into an f32 cache,
/// `kv_store` (rounding to f16) into an f16 one, `kv_store_q8` (one
/// invocation per 64 values: two blocks, one word of scales) into a q8 one.
pub(crate) fn append(gpu: &Gpu, cache: &mut GpuKvCache, k: Bind<'_>, v: Bind<'_>, tokens: usize) -> Result<()> {
    if cache.kind == KvCacheType::F32 {
        return cache.append(k, v, tokens);
    }
    let past = cache.len;
    cache.append_in_kernel(tokens)?;
    let hd = cache.head_dim;
    let kernels = head_dim_kernels(hd).ok_or_else(|| BackendError::Unsupported(format!("a {} KV cache of head dim {hd}", cache.kind)))?;
    let q8 = cache.kind == KvCacheType::Q8;
    let entry = if q8 { kernels.kv_store_q8 } else { kernels.kv_store };
    let params = FlashParams { tokens: tokens as u32, kv_heads: cache.kv_heads as u32, past: past as u32, kv: kv_code(cache), ..Default::default() };
    let runs = (tokens * cache.kv_heads * cache.head_dim / if q8 { 64 } else { 4 }) as u64;
    let binds = [(KEYS, whole(&cache.keys)), (VALUES, whole(&cache.values)), (KNEW, k), (VNEW, v)];
    gpu.dispatch(entry, &params, &binds, Gpu::grid(runs.div_ceil(256)))
}

/// Keys per chunk and chunks per (token, head) for `pairs` (token, head)
/// pairs whose longest key range is `most_keys`: enough chunks for about
/// [`TARGET_WORKGROUPS`] workgroups, none shorter than `min_chunk` keys
/// ([`MIN_CHUNK`] unless the options say otherwise; so at most
/// `TARGET_WORKGROUPS + pairs` workgroups and partials).
fn split_keys(pairs: usize, most_keys: usize, min_chunk: usize) -> (usize, usize) {
    let wanted = TARGET_WORKGROUPS.div_ceil(pairs.max(1));
    let chunk = most_keys.div_ceil(wanted).max(min_chunk.max(1));
    (chunk, most_keys.div_ceil(chunk).max(1))
}

/// Query rows of a key selection as `attention.wgsl` reads them, `per_query + 1`
/// words each: `[DENSE, ..]`, or `[count, blocks..]` with the listed blocks that
/// add keys to [`KeySelection::keys_of`]'s set beyond the query's own trailing
/// partial block: UNUSED entries, repeats and blocks not wholly before that
/// partial block are dropped. Also returns the most keys any query sees.
fn selection_rows(sel: &KeySelection, past: usize, tokens: usize) -> (Vec<u32>, usize) {
    let (block, per) = (sel.block, sel.per_query);
    let mut words = vec![0u32; tokens * (per + 1)];
    let mut seen = vec![0u64; ((past + tokens) / block).div_ceil(64).max(1)];
    let mut most = 0;
    for (t, (entries, row)) in sel.blocks.chunks_exact(per).zip(words.chunks_exact_mut(per + 1)).enumerate() {
        let pos = past + t;
        if entries[0] == KeySelection::DENSE {
            row[0] = KeySelection::DENSE;
            most = most.max(pos + 1);
            continue;
        }
        let own = (pos + 1) / block;
        let mut count = 0;
        for &b in entries {
            let bi = b as usize;
            if b == KeySelection::UNUSED || bi >= own || seen[bi / 64] & (1 << (bi % 64)) != 0 {
                continue;
            }
            seen[bi / 64] |= 1 << (bi % 64);
            count += 1;
            row[count] = b;
        }
        for &b in &row[1..=count] {
            seen[b as usize / 64] = 0;
        }
        row[0] = count as u32;
        most = most.max(count * block + pos + 1 - own * block);
    }
    (words, most)
}

/// `Backend::attention` on the wgpu backend: a decode step's new key and
/// value rows are read where they are by the attention kernel, which writes
/// them to the cache itself; a prefill's are appended first.
pub(crate) fn attention(b: &WgpuBackend, [q, k, v]: [&Tensor; 3], cache: &mut State, heads: usize, scale: f32,
    selection: Option<&KeySelection>) -> Result<Tensor> {
    let c = cache.get_mut::<GpuKvCache>().ok_or_else(|| crate::not_ours("the KV cache"))?;
    let hd = c.head_dim;
    let tokens = checks::attention(q, k, v, heads, c.kv_heads, hd, selection)?;
    if hd > 512 {
        return Err(BackendError::Unsupported(format!("attention head dim {hd} (the kernel takes up to 512)")));
    }
    // Only kv_store_q8 writes q8 rows: a q8 decode step appends first too.
    let fresh = if tokens == 1 && c.kind != KvCacheType::Q8 {
        c.append_in_kernel(1)?;
        Some((buf(k)?, buf(v)?))
    } else {
        append(&b.gpu, c, buf(k)?, buf(v)?, tokens)?;
        None
    };
    let (out, ob) = new_tensor(&b.gpu, tokens * heads * hd, vec![tokens, heads * hd])?;
    attend(&b.gpu, c, buf(q)?, ob.bind(), tokens, heads, scale, selection, fresh, None)?;
    Ok(out)
}

/// `Backend::attention_qk_norm` on the wgpu backend: one token (decode) in
/// one kernel that normalises and rotates q and the fresh key as it stages
/// them; everything else composes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_qk_norm(b: &WgpuBackend, [q, k, v]: [&Tensor; 3], cache: &mut State, heads: usize, scale: f32,
    selection: Option<&KeySelection>, norm: &QkNorm<'_>) -> Result<Tensor> {
    let c = cache.get_mut::<GpuKvCache>().ok_or_else(|| crate::not_ours("the KV cache"))?;
    let fits = q.rows() == 1 && norm.head_dim == c.head_dim && norm.weights.iter().all(|w| w.numel() == c.head_dim);
    // Long contexts: flash attention, after one dispatch that normalises and
    // rotates q and k (with the fresh row, c.len + 1 keys).
    let long = (selection.is_none() && flash_pipeline(&b.gpu, c, heads, 1, c.len + 1).is_some()) || c.kind == KvCacheType::Q8;
    if !fits || long || c.head_dim > ROPE_MAX_HEAD_DIM || b.gpu.limits.max_storage_buffers_per_shader_stage < 12 {
        return attention_qk_norm_composed(b, q, k, v, cache, heads, scale, selection, norm);
    }
    let hd = c.head_dim;
    checks::attention(q, k, v, heads, c.kv_heads, hd, selection)?;
    checks::rope(&q.reshape(&[1, heads, hd])?, hd, norm.rotary_dim)?;
    c.append_in_kernel(1)?;
    let angles = rope_angles(&b.gpu, 1, norm.rotary_dim, norm.rope, norm.start_pos)?;
    let rope = QkRope {
        angles: whole(&angles),
        weights: [buf(norm.weights[0])?, buf(norm.weights[1])?],
        eps: norm.eps,
        half: norm.rotary_dim / 2,
    };
    let (out, ob) = new_tensor(&b.gpu, heads * hd, vec![1, heads * hd])?;
    attend(&b.gpu, c, buf(q)?, ob.bind(), 1, heads, scale, selection, Some((buf(k)?, buf(v)?)), Some(rope))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::MIN_CHUNK;

    #[test]
    fn decode_is_split_prefill_is_not() {
        // Decode at 4k keys with 16 heads (Qwen3-Next's 16/2): 64 chunks of 64.
        assert_eq!(split_keys(16, 4096, MIN_CHUNK), (64, 64));
        // Decode at 460 keys with 32 heads: chunks of the smallest size.
        assert_eq!(split_keys(32, 460, MIN_CHUNK), (32, 15));
        // One head over 100k keys: about TARGET_WORKGROUPS chunks.
        let (chunk, splits) = split_keys(1, 100_000, MIN_CHUNK);
        assert!(splits <= TARGET_WORKGROUPS && splits > TARGET_WORKGROUPS / 2 && chunk * splits >= 100_000);
        // Short contexts and long prefills stay in one workgroup per (token, head).
        assert_eq!(split_keys(32, 30, MIN_CHUNK), (32, 1));
        assert_eq!(split_keys(512 * 32, 4096, MIN_CHUNK), (4096, 1));
        // Chunks cover the keys and none is empty.
        for (pairs, keys) in [(8, 1037), (3, 65), (128, 5000), (1, 1)] {
            let (chunk, splits) = split_keys(pairs, keys, MIN_CHUNK);
            assert!(chunk * splits >= keys && chunk * (splits - 1) < keys, "{pairs} pairs, {keys} keys");
        }
    }
}
