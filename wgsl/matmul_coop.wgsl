// matmul_wide, moe_gate_up_wide and moe_down_wide on the GPU's matrix units
// (cooperative matrices: tensor cores on NVIDIA, through
// VK_KHR_cooperative_matrix), for adapters that multiply 16 x 16 f16
// matrices into f32 ones in subgroups of 32. Joined with weights.wgsl and
// matmul_common.wgsl (this file first, for its `enable`s), whose staging (fetch), row choice (dense_rows,
// gate_up_rows, down_rows) and outputs (dense_put, gate_up_put, down_put)
// they share: only the products differ.
//
// The same 128 x 128 tile as matmul_wide: each invocation stages one weight
// row and one x row of each 32-column slice (li / 2, columns 16 * (li % 2)
// .. + 16), as f16, into workgroup memory; subgroup s of the eight
// multiplies weight rows 32 * (s % 4) .. + 32 by tokens 64 * (s / 4) .. + 64
// (two A and four B matrices of 16 x 16 per 16 columns, eight f32
// accumulators). The weights and x are rounded to f16 (a relative 2^-11 each)
// and summed in f32 in the matrix units' order, so these kernels are not
// bit for bit with matmul_wide: the backend takes them in its int8 mode
// only, never in exact mode. The accumulators then go through workgroup
// memory, 32 rows at a time, into matmul_wide's per-invocation layout, so
// the outputs are written by the same code.

enable f16;
enable wgpu_cooperative_matrix;

const CK: u32 = 32u;
// Row stride of the staged slices in halves (80 bytes: rows start 16 bytes
// apart in the banks).
const CS: u32 = 40u;
// Token stride of the accumulators' staging (32 rows of f32, padded).
const CO: u32 = 36u;

var<workgroup> wc: array<f16, 5120>;
var<workgroup> xc: array<f16, 5120>;
var<workgroup> oc: array<f32, 4608>;

// A share of a slice: columns col .. col + 16 of the invocation's rows.
struct CoopStaged {
    a: Staged,
    b: Staged,
}

fn coop_fetch(r: WideRows, col: u32) -> CoopStaged {
    return CoopStaged(fetch(r.w, r.w_valid, r.x, r.x_valid, col), fetch(r.w, r.w_valid, r.x, r.x_valid, col + 8u));
}

fn coop_store_half(s: Staged, at: u32) {
    for (var j = 0u; j < 8u; j++) {
        wc[at + j] = f16(staged_weight(s, j));
        xc[at + j] = f16(s.x[j]);
    }
}

// The products of a 128 x 128 tile over every column, into acc in
// wide_accumulate's layout (acc[8h + j]: rows 64h + 4tx .. + 4 against token
// wide_col(ty, j), tx = li % 16, ty = li / 16).
fn coop_products(acc: ptr<function, array<vec4<f32>, 16>>, li: u32, sg: u32, r: WideRows) {
    let at = (li / 2u) * CS + 16u * (li % 2u);
    let rb = 32u * (sg % 4u);
    let tb = 64u * (sg / 4u);
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c03 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c13 = coop_mat16x16<f32, C>();
    var next = coop_fetch(r, 16u * (li % 2u));
    for (var k0 = 0u; k0 < p.x_cols; k0 += CK) {
        coop_store_half(next.a, at);
        coop_store_half(next.b, at + 8u);
        workgroupBarrier();
        if (k0 + CK < p.x_cols) {
            next = coop_fetch(r, k0 + CK + 16u * (li % 2u));
        }
        for (var kk = 0u; kk < CK; kk += 16u) {
            // A: weight rows (row-major, stride CS); B: x rows as columns.
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&wc[rb * CS + kk], CS);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&wc[(rb + 16u) * CS + kk], CS);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&xc[tb * CS + kk], CS);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&xc[(tb + 16u) * CS + kk], CS);
            let b2 = coopLoad<coop_mat16x16<f16, B>>(&xc[(tb + 32u) * CS + kk], CS);
            let b3 = coopLoad<coop_mat16x16<f16, B>>(&xc[(tb + 48u) * CS + kk], CS);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
        }
        workgroupBarrier();
    }
    // Rows 32q .. + 32 at a time (subgroups 4 apart hold them): stored
    // token-major (oc[t * CO + row - 32q]), then read by the invocations
    // whose acc holds them.
    let tx = li % 16u;
    let ty = li / 16u;
    for (var q = 0u; q < 4u; q++) {
        if (sg % 4u == q) {
            coopStore(c00, &oc[tb * CO], CO);
            coopStore(c01, &oc[(tb + 16u) * CO], CO);
            coopStore(c02, &oc[(tb + 32u) * CO], CO);
            coopStore(c03, &oc[(tb + 48u) * CO], CO);
            coopStore(c10, &oc[tb * CO + 16u], CO);
            coopStore(c11, &oc[(tb + 16u) * CO + 16u], CO);
            coopStore(c12, &oc[(tb + 32u) * CO + 16u], CO);
            coopStore(c13, &oc[(tb + 48u) * CO + 16u], CO);
        }
        workgroupBarrier();
        // acc[8h + j] holds rows 64h + 4tx: in this block where 2h + tx / 8 == q.
        let h = q / 2u;
        if (tx / 8u == q % 2u) {
            let row = 4u * (tx % 8u);
            for (var j = 0u; j < 8u; j++) {
                let b = wide_col(ty, j) * CO + row;
                (*acc)[8u * h + j] = vec4<f32>(oc[b], oc[b + 1u], oc[b + 2u], oc[b + 3u]);
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn matmul_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sg: u32) {
    var acc: array<vec4<f32>, 16>;
    coop_products(&acc, li, sg, dense_rows(wid, li));
    dense_put(&acc, wid, li);
}

@compute @workgroup_size(256)
fn moe_gate_up_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sg: u32) {
    let tile = tile_of(wid.y, li);
    if (tile.z == 0u) {
        return;
    }
    var acc: array<vec4<f32>, 16>;
    coop_products(&acc, li, sg, gate_up_rows(tile, wid, li));
    gate_up_put(&acc, tile, wid, li);
}

@compute @workgroup_size(256)
fn moe_down_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sg: u32) {
    let tile = tile_of(wid.y, li);
    if (tile.z == 0u) {
        return;
    }
    var acc: array<vec4<f32>, 16>;
    coop_products(&acc, li, sg, down_rows(tile, wid, li));
    down_put(&acc, tile, wid, li);
}
