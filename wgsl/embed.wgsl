// embed: dequantized embedding rows for token ids, any storage format (see
// weights.wgsl). One thread per output value; a dispatch covers one weight
// shard (rows [row_start, row_start + shard_rows)) and writes only the ids in it.
//
// argmax_parts: the greedy token of one row of `count` logits, in `parts`
// parts (one workgroup each): chosen[2k] = the part's largest logit (f32
// bits), chosen[2k + 1] = its index (the lowest among equals; NO_TOKEN when
// the part has none). NaN never wins, except at index 0, which it wins
// outright (as a plain scan that starts from logit 0 keeps it).
// embed_chosen: embed of the token those parts choose (every workgroup folds
// them itself), one row; backends/core/src/chosen.rs holds the same order.
//
// Bindings: 0 uniform Params; 6 w_words (weight shard, see weights.wgsl); 3 out [count, cols] f32
// (read-write); 4 ids [count] u32; 5 logits [count] f32; 7 chosen [parts, 2] u32 (read-write).

struct Params {
    w: WeightDesc,
    count: u32,
    row_start: u32,
    shard_rows: u32,
    // argmax_parts, embed_chosen: parts of the vocabulary (at most 256).
    parts: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;
@group(0) @binding(5) var<storage, read> logits: array<f32>;
@group(0) @binding(7) var<storage, read_write> chosen: array<u32>;

@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let i = gid.y;
    if (col >= p.w.cols || i >= p.count) {
        return;
    }
    let id = ids[i];
    if (id >= p.row_start && id < p.row_start + p.shard_rows) {
        out[i * p.w.cols + col] = w_value(p.w, id - p.row_start, col);
    }
}

const NO_TOKEN: u32 = 0xFFFFFFFFu;
var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;

// Whether candidate (v, i) beats (v0, i0): a real index beats none, then the
// larger value, then the lower index.
fn beats(v: f32, i: u32, v0: f32, i0: u32) -> bool {
    return i != NO_TOKEN && (i0 == NO_TOKEN || v > v0 || (v == v0 && i < i0));
}

// Offers candidate (v, i) to invocation li's entry of best_v/best_i (its best
// so far; best_i[li] = NO_TOKEN before the first offer).
fn offer(li: u32, v: f32, i: u32) {
    if (beats(v, i, best_v[li], best_i[li])) {
        best_v[li] = v;
        best_i[li] = i;
    }
}

// Folds entries [0, n) of best_v/best_i (n a power of two) into entry 0;
// every invocation of the workgroup calls it.
fn fold_best(li: u32, n: u32) {
    workgroupBarrier();
    for (var s = n / 2u; s > 0u; s >>= 1u) {
        if (li < s && beats(best_v[li + s], best_i[li + s], best_v[li], best_i[li])) {
            best_v[li] = best_v[li + s];
            best_i[li] = best_i[li + s];
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn argmax_parts(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let per = (p.count + p.parts - 1u) / p.parts;
    let start = wid.x * per;
    let end = min(p.count, start + per);
    best_i[li] = NO_TOKEN;
    for (var i = start + li; i < end; i += 256u) {
        let bits = bitcast<u32>(logits[i]);
        var v = bitcast<f32>(bits);
        if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
            if (i != 0u) {
                continue;
            }
            // +infinity: a NaN first logit wins.
            v = bitcast<f32>(0x7F800000u | (bits & 0u));
        }
        offer(li, v, i);
    }
    fold_best(li, 256u);
    if (li == 0u) {
        chosen[2u * wid.x] = bitcast<u32>(best_v[0]);
        chosen[2u * wid.x + 1u] = best_i[0];
    }
}

@compute @workgroup_size(64)
fn embed_chosen(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    best_i[li] = NO_TOKEN;
    for (var k = li; k < p.parts; k += 64u) {
        offer(li, bitcast<f32>(chosen[2u * k]), chosen[2u * k + 1u]);
    }
    fold_best(li, 64u);
    // No candidate at all (every logit NaN): token 0, as the host's argmax.
    let id = select(best_i[0], 0u, best_i[0] == NO_TOKEN);
    let col = gid.x;
    if (col < p.w.cols && id >= p.row_start && id < p.row_start + p.shard_rows) {
        out[col] = w_value(p.w, id - p.row_start, col);
    }
}
