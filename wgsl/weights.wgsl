// Weight decoding shared by every kernel that reads a weight matrix (prepended
// to matvec.wgsl, moe.wgsl, matmul_tiled.wgsl and embed.wgsl at load time).
//
// Bindings 1 (`w`, 16-byte words) and 6 (`w_words`, the same buffer as u32):
// one weight shard. It holds, in order:
//   values: `rows` rows of `row_words` u32 words each (rows start 16-byte aligned);
//           f32 (fmt 0), f16 (fmt 1) or bf16 (fmt 2) pairs, or MLX affine (fmt 3)
//           `bits`-bit values packed little-endian, value i of a word at bits*i.
//   scales, biases (affine only), from u32 word `scales_off` / `biases_off`:
//           `rows * cols / group_size` values each, f32 (scale_kind 0), f16 (1)
//           or bf16 (2), two 16-bit values per word; `w = scale * q + bias`.
//
// fmt 4: 4-bit affine with 16-bit scales, rows interleaved for coalesced x
// reads (see `interleave_q4_row` in backends/wgpu/src/weights.rs). A row's
// 16-byte chunks form tiles of 32 (the last tile has `t` <= 32); word k of
// chunk v of tile j holds columns 1024j + 8tk + 8v .. +8 (nibble m: column
// +m), so chunk v of every word reads x right after chunk v-1. Scales and
// biases are one u32 per group from `scales_off` (= `biases_off`): the scale
// in the low 16 bits, the bias in the high 16.

struct WeightDesc {
    fmt: u32,
    bits: u32,
    group_size: u32,
    scale_kind: u32,
    cols: u32,
    row_words: u32,
    scales_off: u32,
    biases_off: u32,
}

@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
// The same shard as single words, for scalar reads (scales, biases, single
// values): a 4-byte load instead of a 16-byte one.
@group(0) @binding(6) var<storage, read> w_words: array<u32>;

fn w_word(i: u32) -> u32 {
    return w_words[i];
}

// Element `idx` of a float array of kind `kind` (0 f32, 1 f16, 2 bf16) starting at word `base`.
fn packed_float(base: u32, idx: u32, kind: u32) -> f32 {
    if (kind == 0u) {
        return bitcast<f32>(w_word(base + idx));
    }
    let word = w_word(base + (idx >> 1u));
    let h = (word >> ((idx & 1u) * 16u)) & 0xffffu;
    if (kind == 1u) {
        return unpack2x16float(h).x;
    }
    return bitcast<f32>(h << 16u);
}

// (scale, bias) of an fmt-4 group from its packed pair word.
fn sb_pair(word: u32, kind: u32) -> vec2<f32> {
    if (kind == 1u) {
        return unpack2x16float(word);
    }
    return vec2<f32>(bitcast<f32>(word << 16u), bitcast<f32>(word & 0xffff0000u));
}

fn w_scale(d: WeightDesc, g: u32) -> f32 {
    if (d.fmt == 4u) {
        return sb_pair(w_word(d.scales_off + g), d.scale_kind).x;
    }
    return packed_float(d.scales_off, g, d.scale_kind);
}

fn w_bias(d: WeightDesc, g: u32) -> f32 {
    if (d.fmt == 4u) {
        return sb_pair(w_word(d.scales_off + g), d.scale_kind).y;
    }
    return packed_float(d.biases_off, g, d.scale_kind);
}

// Index of the fmt-4 word that holds column `col` of row `row` (with
// columns col - col % 8 .. + 8).
fn q4i_word(d: WeightDesc, row: u32, col: u32) -> u32 {
    let chunks = d.row_words / 4u;
    let src = col >> 3u;
    let j = src >> 7u;
    let r = src & 127u;
    let t = min(32u, chunks - 32u * j);
    return row * d.row_words + 128u * j + 4u * (r % t) + r / t;
}

// Dequantized element (row, col) of the shard.
fn w_value(d: WeightDesc, row: u32, col: u32) -> f32 {
    if (d.fmt == 4u) {
        let word = w_word(q4i_word(d, row, col));
        let q = (word >> ((col & 7u) * 4u)) & 15u;
        let sb = sb_pair(w_word(d.scales_off + (row * d.cols + col) / d.group_size), d.scale_kind);
        return sb.x * f32(q) + sb.y;
    }
    if (d.fmt == 3u) {
        let per_word = 32u / d.bits;
        let word = w_word(row * d.row_words + col / per_word);
        let q = (word >> ((col % per_word) * d.bits)) & ((1u << d.bits) - 1u);
        let g = (row * d.cols + col) / d.group_size;
        return w_scale(d, g) * f32(q) + w_bias(d, g);
    }
    if (d.fmt == 0u) {
        return bitcast<f32>(w_word(row * d.row_words + col));
    }
    return packed_float(row * d.row_words, col, d.fmt);
}
