// matmul_tiled: `out[t, out_off + r] = sum_c W[r, c] * x[t, c]` for prefill
// shapes (many tokens), any storage format (see weights.wgsl). Each 16x16
// workgroup computes a 32-row x 32-token tile, staging 32-column slices of the
// dequantized weights and of x in workgroup memory, so each weight value is
// decoded once per 32 tokens.
//
// Bindings: 0 uniform Params; 6 w_words (weight shard, see weights.wgsl); 2 xf [tokens, w.cols] f32;
// 3 out [tokens, out_cols] f32 (read-write).

struct Params {
    w: WeightDesc,
    rows: u32,
    tokens: u32,
    out_cols: u32,
    out_off: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> xf: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const TILE: u32 = 32u;
var<workgroup> w_tile: array<array<f32, 33>, 32>;
var<workgroup> x_tile: array<array<f32, 33>, 32>;

@compute @workgroup_size(16, 16)
fn matmul_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row0 = wid.x * TILE;
    let tok0 = wid.y * TILE;
    let li = lid.y * 16u + lid.x;
    let cols = p.w.cols;
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var k0 = 0u; k0 < cols; k0 += TILE) {
        for (var i = 0u; i < 4u; i++) {
            let e = li * 4u + i;
            let r = e / TILE;
            let k = e % TILE;
            var wv = 0.0;
            if (row0 + r < p.rows && k0 + k < cols) {
                wv = w_value(p.w, row0 + r, k0 + k);
            }
            w_tile[r][k] = wv;
            var xv = 0.0;
            if (tok0 + r < p.tokens && k0 + k < cols) {
                xv = xf[(tok0 + r) * cols + k0 + k];
            }
            x_tile[r][k] = xv;
        }
        workgroupBarrier();
        for (var k = 0u; k < TILE; k++) {
            let w0 = w_tile[lid.x][k];
            let w1 = w_tile[lid.x + 16u][k];
            let x0 = x_tile[lid.y][k];
            let x1 = x_tile[lid.y + 16u][k];
            acc[0] += w0 * x0;
            acc[1] += w1 * x0;
            acc[2] += w0 * x1;
            acc[3] += w1 * x1;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + lid.x + 16u * (i & 1u);
        let t = tok0 + lid.y + 16u * (i >> 1u);
        if (r < p.rows && t < p.tokens) {
            out[t * p.out_cols + p.out_off + r] = acc[i];
        }
    }
}
