// Prefill-sized products in 64 x 64 output tiles (and 128 x 128, see
// matmul_wide), any weight format (see weights.wgsl): each workgroup
// stages 32-column slices of 64 dequantized weight rows and of 64 x rows in
// workgroup memory (16 KiB), and each of its
// 256 invocations accumulates a 4 x 4 block of outputs, so a weight value is
// decoded once per 64 rows of x and every workgroup-memory load feeds four
// multiply-adds. The next slice's global loads are issued before the current
// slice is multiplied (see Staged), so their latency hides behind it.
//
//   matmul_tiled:     out[t, out_off + r] = sum_c W[r, c] * x[t, c]   (dense weights)
//   matmul_wide:      the same in 128 x 128 tiles
//   moe_sort:         one workgroup: groups the (token, rank) pairs of one MoE call
//                     by expert (only experts with a slot in this pool shard), and
//                     lists the call's tiles: up to tile_pairs pairs of one expert each
//   moe_gate_up_tiled: act[pair, i] = silu(gate row i . x[token]) * (up row i . x[token])
//                     over the tile list (gate and up of the expert's slot, side by
//                     side in one pool matrix as in moe.wgsl)
//   moe_down_tiled:   vals[pair, r] = down row r . act[pair] over the tile list
//   moe_gate_up_wide, moe_down_wide: the same in 128 x 128 tiles (128 pairs a tile)
// The MoE forms give each expert's weights to whole tiles of its pairs, so a
// pool row is read once per 64 of them instead of once per pair; the weighted
// sum over ranks is moe.wgsl's moe_combine.
//
// Bindings: 0 uniform Params; 6 w_words (a weight shard or pool shard, see weights.wgsl);
// 2 xf f32 rows of x_cols and 5 xv (the same buffer as vec4s); 3 out f32 (read-write); 4 routes u32 [tokens, 2 * top_k];
// 7 table u32 (the pool's slot table); 10 sort (moe_sort's output, atomics) and
// 11 groups (the same buffer, read by the tiled kernels): word 0 the number of
// tiles, then `experts` cursors, then `max_tiles` tiles (expert, first sorted
// position << 8 | pairs), then the sorted pair indices.

@compute @workgroup_size(256)
fn matmul_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row0 = wid.x * TM;
    let tok0 = wid.y * TN;
    let m = li / 4u;
    let cg = li % 4u;
    let tx = li % 16u;
    let ty = li / 16u;
    var acc: array<vec4<f32>, 4>;
    var next = fetch(row0 + m, row0 + m < p.rows, tok0 + m, tok0 + m < p.tokens, 8u * cg);
    for (var k0 = 0u; k0 < p.x_cols; k0 += TK) {
        store(next, m, cg, false);
        workgroupBarrier();
        if (k0 + TK < p.x_cols) {
            next = fetch(row0 + m, row0 + m < p.rows, tok0 + m, tok0 + m < p.tokens, k0 + TK + 8u * cg);
        }
        accumulate(&acc, tx, ty);
        workgroupBarrier();
    }
    for (var j = 0u; j < 4u; j++) {
        let t = tok0 + 4u * ty + j;
        for (var c = 0u; c < 4u; c++) {
            let r = row0 + 4u * tx + c;
            if (r < p.rows && t < p.tokens) {
                out[t * p.out_cols + p.out_off + r] = acc[j][c];
            }
        }
    }
}

@compute @workgroup_size(256)
fn matmul_wide(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    var acc: array<vec4<f32>, 16>;
    wide_products(&acc, li, dense_rows(wid, li));
    dense_put(&acc, wid, li);
}

@compute @workgroup_size(256)
fn moe_sort(@builtin(local_invocation_index) li: u32) {
    for (var e = li; e < p.experts; e += 256u) {
        atomicStore(&sort[cursor_at(e)], 0u);
    }
    storageBarrier();
    workgroupBarrier();
    for (var q = li; q < p.tokens; q += 256u) {
        let e = pair_expert(q);
        if (e != NO_SLOT) {
            atomicAdd(&sort[cursor_at(e)], 1u);
        }
    }
    storageBarrier();
    workgroupBarrier();
    // Each invocation owns a run of experts: its pairs and tiles, then an
    // exclusive scan over the invocations.
    let per = (p.experts + 255u) / 256u;
    let e0 = min(li * per, p.experts);
    let e1 = min(e0 + per, p.experts);
    let tp = max(p.tile_pairs, 1u);
    var pairs = 0u;
    var tiles = 0u;
    for (var e = e0; e < e1; e++) {
        let n = atomicLoad(&sort[cursor_at(e)]);
        pairs += n;
        tiles += (n + tp - 1u) / tp;
    }
    part_pairs[li] = pairs;
    part_tiles[li] = tiles;
    workgroupBarrier();
    if (li == 0u) {
        var sp = 0u;
        var st = 0u;
        for (var i = 0u; i < 256u; i++) {
            let np = part_pairs[i];
            let nt = part_tiles[i];
            part_pairs[i] = sp;
            part_tiles[i] = st;
            sp += np;
            st += nt;
        }
        atomicStore(&sort[0], st);
    }
    workgroupBarrier();
    var pos = part_pairs[li];
    var tile = part_tiles[li];
    for (var e = e0; e < e1; e++) {
        let n = atomicLoad(&sort[cursor_at(e)]);
        for (var s = 0u; s < n; s += tp) {
            atomicStore(&sort[tile_at(tile)], e);
            atomicStore(&sort[tile_at(tile) + 1u], ((pos + s) << 8u) | min(tp, n - s));
            tile++;
        }
        atomicStore(&sort[cursor_at(e)], pos);
        pos += n;
    }
    storageBarrier();
    workgroupBarrier();
    for (var q = li; q < p.tokens; q += 256u) {
        let e = pair_expert(q);
        if (e != NO_SLOT) {
            let at = atomicAdd(&sort[cursor_at(e)], 1u);
            atomicStore(&sort[sorted_at(at)], q);
        }
    }
}

@compute @workgroup_size(256)
fn moe_gate_up_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tile = tile_of(wid.y, li);
    if (tile.z == 0u) {
        return;
    }
    // Tile row m: gate (even m) or up (odd m) row i0 + m / 2 of the expert.
    let i0 = wid.x * (TM / 2u);
    let m = li / 4u;
    let cg = li % 4u;
    let i = i0 + m / 2u;
    let row = tile.x * 2u * p.rows + (m % 2u) * p.rows + i;
    var pair = 0u;
    if (m < tile.z) {
        pair = groups[sorted_at(tile.y + m)];
    }
    let tx = li % 16u;
    let ty = li / 16u;
    var acc: array<vec4<f32>, 4>;
    var next = fetch(row, i < p.rows, pair / p.top_k, m < tile.z, 8u * cg);
    for (var k0 = 0u; k0 < p.x_cols; k0 += TK) {
        store(next, m, cg, false);
        workgroupBarrier();
        if (k0 + TK < p.x_cols) {
            next = fetch(row, i < p.rows, pair / p.top_k, m < tile.z, k0 + TK + 8u * cg);
        }
        accumulate(&acc, tx, ty);
        workgroupBarrier();
    }
    // acc[j] = (gate i, up i, gate i + 1, up i + 1) for i = i0 + 2 * tx.
    for (var j = 0u; j < 4u; j++) {
        let n = 4u * ty + j;
        if (n < tile.z) {
            let q = groups[sorted_at(tile.y + n)];
            let a = i0 + 2u * tx;
            if (a < p.rows) {
                out[q * p.out_cols + a] = silu(acc[j].x) * acc[j].y;
            }
            if (a + 1u < p.rows) {
                out[q * p.out_cols + a + 1u] = silu(acc[j].z) * acc[j].w;
            }
        }
    }
}

@compute @workgroup_size(256)
fn moe_down_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tile = tile_of(wid.y, li);
    if (tile.z == 0u) {
        return;
    }
    let row0 = wid.x * TM;
    let m = li / 4u;
    let cg = li % 4u;
    var pair = 0u;
    if (m < tile.z) {
        pair = groups[sorted_at(tile.y + m)];
    }
    let tx = li % 16u;
    let ty = li / 16u;
    var acc: array<vec4<f32>, 4>;
    let wrow = tile.x * p.rows + row0 + m;
    var next = fetch(wrow, row0 + m < p.rows, pair, m < tile.z, 8u * cg);
    for (var k0 = 0u; k0 < p.x_cols; k0 += TK) {
        store(next, m, cg, false);
        workgroupBarrier();
        if (k0 + TK < p.x_cols) {
            next = fetch(wrow, row0 + m < p.rows, pair, m < tile.z, k0 + TK + 8u * cg);
        }
        accumulate(&acc, tx, ty);
        workgroupBarrier();
    }
    for (var j = 0u; j < 4u; j++) {
        let n = 4u * ty + j;
        if (n < tile.z) {
            let q = groups[sorted_at(tile.y + n)];
            for (var c = 0u; c < 4u; c++) {
                let r = row0 + 4u * tx + c;
                if (r < p.rows) {
                    out[q * p.out_cols + r] = acc[j][c];
                }
            }
        }
    }
}

@compute @workgroup_size(256)
fn moe_gate_up_wide(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tile = tile_of(wid.y, li);
    if (tile.z == 0u) {
        return;
    }
    var acc: array<vec4<f32>, 16>;
    wide_products(&acc, li, gate_up_rows(tile, wid, li));
    gate_up_put(&acc, tile, wid, li);
}

@compute @workgroup_size(256)
fn moe_down_wide(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tile = tile_of(wid.y, li);
    if (tile.z == 0u) {
        return;
    }
    var acc: array<vec4<f32>, 16>;
    wide_products(&acc, li, down_rows(tile, wid, li));
    down_put(&acc, tile, wid, li);
}
