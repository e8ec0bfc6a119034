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

fn w_scale(d: WeightDesc, g: u32) -> f32 {
    return packed_float(d.scales_off, g, d.scale_kind);
}

fn w_bias(d: WeightDesc, g: u32) -> f32 {
    return packed_float(d.biases_off, g, d.scale_kind);
}

// Dequantized element (row, col) of the shard.
fn w_value(d: WeightDesc, row: u32, col: u32) -> f32 {
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
