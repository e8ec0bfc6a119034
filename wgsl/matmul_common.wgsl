// What the tiled prefill products share (matmul_tiled.wgsl's kernels and
// their matrix-unit forms in matmul_coop.wgsl): the parameters and bindings,
// the staging of weight and x slices, the MoE tile list, and which rows a
// 128 x 128 tile stages and where its outputs go. The bindings and the
// sort buffer's layout are described in matmul_tiled.wgsl.

struct Params {
    w: WeightDesc,
    // Dense: rows of the shard. MoE: rows of one expert matrix (of gate, of down).
    rows: u32,
    // Dense: tokens. MoE: pairs (tokens * top_k).
    tokens: u32,
    out_cols: u32,
    out_off: u32,
    // Columns of x (the weights' columns).
    x_cols: u32,
    top_k: u32,
    experts: u32,
    // The layer's first key in the slot table.
    key_base: u32,
    // The pool shard's slots: slot_base..slot_end.
    slot_base: u32,
    slot_end: u32,
    // Tiles the tile list has room for (ceil(pairs / tile_pairs) + experts).
    max_tiles: u32,
    // Pairs per MoE tile: 64 (moe_*_tiled) or 128 (moe_*_wide).
    tile_pairs: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> xf: array<f32>;
// The same x as 16-byte words, for whole 8-column runs of rows whose length is a multiple of 4.
@group(0) @binding(5) var<storage, read> xv: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> routes: array<u32>;
@group(0) @binding(7) var<storage, read> table: array<u32>;
@group(0) @binding(10) var<storage, read_write> sort: array<atomic<u32>>;
@group(0) @binding(11) var<storage, read> groups: array<u32>;

const NO_SLOT: u32 = 0xffffffffu;
const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 32u;
// Workgroup tiles, column-major in 4-row (4-token) vectors: wt[k * 16 + m / 4][m % 4]
// is weight row m of the tile at column k0 + k.
// Each group of 8 columns is offset by two more vec4s (tile_at_k), so that
// the stores of the four column groups fall in different banks.
// (520: room for matmul_wide's layout, see wide_at.)
var<workgroup> wt: array<vec4<f32>, 520>;
var<workgroup> xt: array<vec4<f32>, 520>;

// Index of the 4-row vector `q` of tile column `k` in wt and xt.
fn tile_at_k(k: u32, q: u32) -> u32 {
    return k * 16u + 2u * (k >> 3u) + q;
}

// One invocation's share of a staged slice, held in registers between the
// global loads (`fetch`) and the workgroup-memory stores (`store`), so that the
// next slice's loads are in flight while the current slice is multiplied.
// 4-bit weights whose 8 columns are whole (`packed`) keep the raw word and its
// (scale, bias); other formats and the ragged edge are dequantized in `fetch`.
struct Staged {
    packed: bool,
    word: u32,
    sb: vec2<f32>,
    w: array<f32, 8>,
    x: array<f32, 8>,
}

// Weight (row, col .. col + 7) and x row `xrow`'s columns col .. col + 7,
// zero past the matrix's columns, for a weight row (`valid`) and an x row
// (`xvalid`) that may be past the end.
fn fetch(row: u32, valid: bool, xrow: u32, xvalid: bool, col: u32) -> Staged {
    let d = p.w;
    var s: Staged;
    s.packed = true;
    s.word = 0u;
    s.sb = vec2<f32>(0.0);
    if (valid) {
        if (d.bits == 4u && (d.fmt == 3u || d.fmt == 4u) && col + 8u <= d.cols && d.group_size % 8u == 0u) {
            let g = (row * d.cols + col) / d.group_size;
            if (d.fmt == 4u) {
                s.word = w_word(q4i_word(d, row, col));
                s.sb = sb_pair(w_word(d.scales_off + g), d.scale_kind);
            } else {
                s.word = w_word(row * d.row_words + col / 8u);
                s.sb = vec2<f32>(w_scale(d, g), w_bias(d, g));
            }
        } else {
            s.packed = false;
            for (var m = 0u; m < 8u; m++) {
                if (col + m < d.cols) {
                    s.w[m] = w_value(d, row, col + m);
                } else {
                    s.w[m] = 0.0;
                }
            }
        }
    }
    if (xvalid && col + 8u <= p.x_cols && p.x_cols % 4u == 0u) {
        let at = (xrow * p.x_cols + col) / 4u;
        let a = xv[at];
        let b = xv[at + 1u];
        s.x = array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
        return s;
    }
    for (var j = 0u; j < 8u; j++) {
        var v = 0.0;
        if (xvalid && col + j < p.x_cols) {
            v = xf[xrow * p.x_cols + col + j];
        }
        s.x[j] = v;
    }
    return s;
}

// Weight j of a fetched share: decoded from its raw word (`packed`) or as fetched.
fn staged_weight(s: Staged, j: u32) -> f32 {
    if (s.packed) {
        return s.sb.x * f32((s.word >> (4u * j)) & 15u) + s.sb.y;
    }
    return s.w[j];
}

// Stores a fetched share as tile row `m` (weights) and tile column `m` (x),
// columns 8 * cg .. + 8 of the slice, in the 64-row layout (tile_at_k) or
// matmul_wide's 128-row one (`wide`, wide_at).
fn store(s: Staged, m: u32, cg: u32, wide: bool) {
    for (var j = 0u; j < 8u; j++) {
        let wv = staged_weight(s, j);
        let at = select(tile_at_k(8u * cg + j, m / 4u), wide_at(8u * cg + j, m / 4u), wide);
        wt[at][m % 4u] = wv;
        xt[at][m % 4u] = s.x[j];
    }
}

// acc[j][c]: tile row 4 * tx + c against tile column 4 * ty + j, over one staged slice.
fn accumulate(acc: ptr<function, array<vec4<f32>, 4>>, tx: u32, ty: u32) {
    for (var k = 0u; k < TK; k++) {
        let a = wt[tile_at_k(k, tx)];
        let b = xt[tile_at_k(k, ty)];
        (*acc)[0] += a * b.x;
        (*acc)[1] += a * b.y;
        (*acc)[2] += a * b.z;
        (*acc)[3] += a * b.w;
    }
}


// matmul_wide: the dense product in 128 x 128 tiles, for products with
// enough of them to fill the GPU: invocation (tx, ty) = (li % 16,
// li / 16) accumulates rows 4tx.. and 64 + 4tx.. (+4) against tokens 4ty.. and
// 64 + 4ty.. (+4), 64 outputs, so each k step's four 16-byte workgroup-memory
// loads feed 64 multiply-adds; slices are 16 columns (DK), staged by 256
// invocations of one weight row and one x row each (m = li / 2, columns
// 8 * (li % 2) .. + 8). Each output is still the sum over k in order, as in
// matmul_tiled, so both give the same bits.
const DM: u32 = 128u;
const DK: u32 = 16u;

// Index of the 4-row vector `q` (of 32) of slice column `k` in wt and xt:
// each group of 8 columns is offset by four more vec4s, so that the two
// column groups' stores fall in different banks.
fn wide_at(k: u32, q: u32) -> u32 {
    return k * 32u + 4u * (k >> 3u) + q;
}

// acc[8h + j]: rows 64h + 4tx .. + 4 against token (j < 4: 4ty + j; else 64 + 4ty + j - 4).
fn wide_accumulate(acc: ptr<function, array<vec4<f32>, 16>>, tx: u32, ty: u32) {
    for (var k = 0u; k < DK; k++) {
        let base = wide_at(k, 0u);
        let a0 = wt[base + tx];
        let a1 = wt[base + 16u + tx];
        let b0 = xt[base + ty];
        let b1 = xt[base + 16u + ty];
        (*acc)[0] += a0 * b0.x;
        (*acc)[1] += a0 * b0.y;
        (*acc)[2] += a0 * b0.z;
        (*acc)[3] += a0 * b0.w;
        (*acc)[4] += a0 * b1.x;
        (*acc)[5] += a0 * b1.y;
        (*acc)[6] += a0 * b1.z;
        (*acc)[7] += a0 * b1.w;
        (*acc)[8] += a1 * b0.x;
        (*acc)[9] += a1 * b0.y;
        (*acc)[10] += a1 * b0.z;
        (*acc)[11] += a1 * b0.w;
        (*acc)[12] += a1 * b1.x;
        (*acc)[13] += a1 * b1.y;
        (*acc)[14] += a1 * b1.z;
        (*acc)[15] += a1 * b1.w;
    }
}

// Four rows from `r` of token `t`'s output, those inside the matrix.
fn wide_put(v: vec4<f32>, r: u32, t: u32) {
    if (t >= p.tokens) {
        return;
    }
    let at = t * p.out_cols + p.out_off + r;
    for (var c = 0u; c < 4u; c++) {
        if (r + c < p.rows) {
            out[at + c] = v[c];
        }
    }
}

// The products of a 128 x 128 tile over every column: invocation li stages
// weight row `r.w` and x row `r.x` (zeros where not valid) of each slice,
// the next slice's loads in flight while the current one is multiplied.
fn wide_products(acc: ptr<function, array<vec4<f32>, 16>>, li: u32, r: WideRows) {
    let m = li / 2u;
    let cg = li % 2u;
    var next = fetch(r.w, r.w_valid, r.x, r.x_valid, 8u * cg);
    for (var k0 = 0u; k0 < p.x_cols; k0 += DK) {
        store(next, m, cg, true);
        workgroupBarrier();
        if (k0 + DK < p.x_cols) {
            next = fetch(r.w, r.w_valid, r.x, r.x_valid, k0 + DK + 8u * cg);
        }
        wide_accumulate(acc, li % 16u, li / 16u);
        workgroupBarrier();
    }
}

// Tile column j (0..8) of invocation row ty: 4ty + j, then 64 + 4ty + j - 4.
fn wide_col(ty: u32, j: u32) -> u32 {
    return select(4u * ty + j, 60u + 4u * ty + j, j >= 4u);
}

// The weight row and x row invocation li stages for a 128 x 128 tile (rows
// of x past the end, or weight rows past the matrix, stage zeros): the
// products' inputs of matmul_wide, moe_gate_up_wide and moe_down_wide, and
// of their tensor-core forms in matmul_coop.wgsl.
struct WideRows {
    w: u32,
    w_valid: bool,
    x: u32,
    x_valid: bool,
}

fn dense_rows(wid: vec3<u32>, li: u32) -> WideRows {
    let row = wid.x * DM + li / 2u;
    let tok = wid.y * DM + li / 2u;
    return WideRows(row, row < p.rows, tok, tok < p.tokens);
}

// matmul_wide's outputs of invocation li (wide_accumulate's layout).
fn dense_put(acc: ptr<function, array<vec4<f32>, 16>>, wid: vec3<u32>, li: u32) {
    let tok0 = wid.y * DM;
    let tx = li % 16u;
    let ty = li / 16u;
    for (var h = 0u; h < 2u; h++) {
        let r = wid.x * DM + 64u * h + 4u * tx;
        for (var j = 0u; j < 4u; j++) {
            wide_put((*acc)[8u * h + j], r, tok0 + 4u * ty + j);
            wide_put((*acc)[8u * h + 4u + j], r, tok0 + 64u + 4u * ty + j);
        }
    }
}


// moe_sort's layout of the sort/groups buffer.
fn cursor_at(e: u32) -> u32 {
    return 1u + e;
}
fn tile_at(i: u32) -> u32 {
    return 1u + p.experts + 2u * i;
}
fn sorted_at(i: u32) -> u32 {
    return 1u + p.experts + 2u * p.max_tiles + i;
}

// The expert of pair `q` when it has a slot in this shard, else NO_SLOT.
fn pair_expert(q: u32) -> u32 {
    let t = q / p.top_k;
    let e = routes[t * 2u * p.top_k + q % p.top_k];
    if (e >= p.experts) {
        return NO_SLOT;
    }
    let slot = table[p.key_base + e];
    if (slot < p.slot_base || slot >= p.slot_end) {
        return NO_SLOT;
    }
    return e;
}

var<workgroup> part_pairs: array<u32, 256>;
var<workgroup> part_tiles: array<u32, 256>;


// The tile list entry of workgroup row `y`: (expert's slot in the shard,
// first sorted position, pairs); pairs 0 past the last tile. Uniform across
// the workgroup.
var<workgroup> wg_tile: vec4<u32>;
fn tile_of(y: u32, li: u32) -> vec4<u32> {
    if (li == 0u) {
        var t = vec4<u32>(0u);
        if (y < groups[0]) {
            let e = groups[tile_at(y)];
            let packed = groups[tile_at(y) + 1u];
            t = vec4<u32>(table[p.key_base + e] - p.slot_base, packed >> 8u, packed & 255u, 0u);
        }
        wg_tile = t;
    }
    return workgroupUniformLoad(&wg_tile);
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}



// moe_gate_up_tiled and moe_down_tiled in 128 x 128 tiles (matmul_wide's
// products), for calls with 128 pairs an expert or more on average.

// The pair of tile row li / 2 (0 past the tile's pairs).
fn tile_pair(tile: vec4<u32>, li: u32) -> u32 {
    if (li / 2u < tile.z) {
        return groups[sorted_at(tile.y + li / 2u)];
    }
    return 0u;
}

// Tile row m: gate (even m) or up (odd m) row i0 + m / 2 of the expert.
fn gate_up_rows(tile: vec4<u32>, wid: vec3<u32>, li: u32) -> WideRows {
    let m = li / 2u;
    let i = wid.x * (DM / 2u) + m / 2u;
    return WideRows(tile.x * 2u * p.rows + (m % 2u) * p.rows + i, i < p.rows, tile_pair(tile, li) / p.top_k, m < tile.z);
}

fn gate_up_put(acc: ptr<function, array<vec4<f32>, 16>>, tile: vec4<u32>, wid: vec3<u32>, li: u32) {
    // acc[8h + j] = (gate a, up a, gate a + 1, up a + 1) for a = i0 + 32h + 2tx.
    let i0 = wid.x * (DM / 2u);
    let tx = li % 16u;
    let ty = li / 16u;
    for (var h = 0u; h < 2u; h++) {
        let a = i0 + 32u * h + 2u * tx;
        for (var j = 0u; j < 8u; j++) {
            let n = wide_col(ty, j);
            if (n < tile.z) {
                let q = groups[sorted_at(tile.y + n)];
                let v = (*acc)[8u * h + j];
                if (a < p.rows) {
                    out[q * p.out_cols + a] = silu(v.x) * v.y;
                }
                if (a + 1u < p.rows) {
                    out[q * p.out_cols + a + 1u] = silu(v.z) * v.w;
                }
            }
        }
    }
}

fn down_rows(tile: vec4<u32>, wid: vec3<u32>, li: u32) -> WideRows {
    let row = wid.x * DM + li / 2u;
    return WideRows(tile.x * p.rows + row, row < p.rows, tile_pair(tile, li), li / 2u < tile.z);
}

fn down_put(acc: ptr<function, array<vec4<f32>, 16>>, tile: vec4<u32>, wid: vec3<u32>, li: u32) {
    let tx = li % 16u;
    let ty = li / 16u;
    for (var h = 0u; h < 2u; h++) {
        let r = wid.x * DM + 64u * h + 4u * tx;
        for (var j = 0u; j < 8u; j++) {
            let n = wide_col(ty, j);
            if (n < tile.z) {
                let q = groups[sorted_at(tile.y + n)];
                let v = (*acc)[8u * h + j];
                for (var c = 0u; c < 4u; c++) {
                    if (r + c < p.rows) {
                        out[q * p.out_cols + r + c] = v[c];
                    }
                }
            }
        }
    }
}
