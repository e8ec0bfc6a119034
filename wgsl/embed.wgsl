// embed: dequantized embedding rows for token ids, any storage format (see
// weights.wgsl). One thread per output value; a dispatch covers one weight
// shard (rows [row_start, row_start + shard_rows)) and writes only the ids in it.
//
// Bindings: 0 uniform Params; 6 w_words (weight shard, see weights.wgsl); 3 out [count, cols] f32
// (read-write); 4 ids [count] u32.

struct Params {
    w: WeightDesc,
    count: u32,
    row_start: u32,
    shard_rows: u32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;

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
