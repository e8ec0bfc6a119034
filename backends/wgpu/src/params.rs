//! What the kernels take: each kernel family's uniform `Params` struct,
//! mirrored field for field as its WGSL declares it (the shader tests
//! compare the two), and the constants the layers below the kernel families
//! size things by. Nothing here depends on another module of the crate, so
//! the kernel registry (`kernels.rs`) and the recorder (`gpu.rs`) can name
//! every parameter type, and each family's typed calls (`elementwise.rs`,
//! `norm.rs`, ...) build theirs from here.

/// A kernel family's uniform parameters, laid out as its WGSL `Params` struct.
pub trait Params: bytemuck::Pod {
    /// The field names in order, as the WGSL struct names them.
    const FIELDS: &'static [&'static str];
}

/// Declares a `#[repr(C)]` parameter struct of u32/f32 fields (and nested
/// parameter structs) with its [`Params`] field list.
macro_rules! params {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
        }

        impl Params for $name {
            const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];
        }
    };
}


// Weights (`weights.rs`).

params! {
    /// `WeightDesc` of `wgsl/weights.wgsl`: how a kernel decodes one weight shard.
    pub struct WeightDesc {
        /// 0 f32, 1 f16, 2 bf16, 3 MLX affine, 4 interleaved 4-bit affine.
        fmt: u32,
        bits: u32,
        group_size: u32,
        /// Scale and bias type: 0 f32, 1 f16, 2 bf16.
        scale_kind: u32,
        cols: u32,
        /// u32 words per row of values.
        row_words: u32,
        scales_off: u32,
        biases_off: u32,
    }
}

// Standalone weights (`matmul.rs`, `chosen.rs`).

params! {
    /// `Params` of `wgsl/matvec.wgsl`.
    pub struct MatvecParams {
        w: WeightDesc,
        /// Rows of the shard.
        rows: u32,
        tokens: u32,
        /// Columns of the output (rows of the whole weight).
        out_cols: u32,
        /// The shard's first output column.
        out_off: u32,
        x_cols: u32,
        /// Rows per subgroup for one token of interleaved 4-bit weights (4 or 8).
        group_rows: u32,
        /// `matvec_epilogue`: [`Epilogue`](crate::matmul::Epilogue) as a number.
        epilogue: u32,
        /// `matvec_epilogue`'s SwiGLU: the first up row.
        half: u32,
        /// One token of interleaved 4-bit weights at four rows per subgroup:
        /// subgroups sharing one quad of rows (1, 2 or 4).
        parts: u32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

params! {
    /// `Params` of `wgsl/matvec_q8.wgsl`.
    pub struct MatvecQ8Params {
        w: WeightDesc,
        rows: u32,
        tokens: u32,
        out_cols: u32,
        out_off: u32,
        x_cols: u32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

params! {
    /// `Params` of `wgsl/matmul_tiled.wgsl` (the dense product and the MoE
    /// tiles over experts, see `moe.rs`).
    pub struct TiledParams {
        w: WeightDesc,
        /// Dense: rows of the shard. MoE: rows of one expert matrix.
        rows: u32,
        /// Dense: tokens. MoE: (token, rank) pairs.
        tokens: u32,
        out_cols: u32,
        out_off: u32,
        x_cols: u32,
        top_k: u32,
        experts: u32,
        key_base: u32,
        slot_base: u32,
        slot_end: u32,
        /// Room in the MoE tile list.
        max_tiles: u32,
        /// Pairs per MoE tile (64, or 128 for the wide kernels).
        tile_pairs: u32,
    }
}

params! {
    /// `Params` of `wgsl/embed.wgsl`.
    pub struct EmbedParams {
        w: WeightDesc,
        /// Token ids.
        count: u32,
        /// The shard's first row.
        row_start: u32,
        shard_rows: u32,
        /// `argmax_parts`, `embed_chosen`: parts of the vocabulary.
        parts: u32,
    }
}

// The expert pool and routing (`moe.rs`).

params! {
    /// `Params` of `wgsl/moe.wgsl` and `wgsl/route.wgsl` (`wgsl/moe_common.wgsl`).
    pub struct MoeParams {
        w: WeightDesc,
        /// Rows of one expert matrix.
        rows: u32,
        /// This dispatch's first assignment (token * top_k + rank; a shared
        /// expert's after all of those: tokens * top_k + token).
        asg_off: u32,
        /// The shard's slots: `slot_base..slot_end`.
        slot_base: u32,
        slot_end: u32,
        x_cols: u32,
        out_cols: u32,
        top_k: u32,
        /// Experts per layer (router logits per token).
        experts: u32,
        /// The layer's first key in the slot table.
        key_base: u32,
        /// 1: renormalise the top-k weights.
        normalize: u32,
        /// Tokens (`moe_route` and the FFN kernels), entries (`moe_map`) or
        /// output values (`moe_combine`).
        n: u32,
        /// `moe_gate_up`: subgroups sharing each of a quad's gate and up rows.
        parts: u32,
        /// `moe_route_norm`: the residual norm's epsilon.
        eps: f32,
        /// `moe_gate_up`, `moe_down_combine`: the shared expert's slot
        /// table key (`NO_SLOT`: none), and its gate logits per token.
        shared_key: u32,
        gate_cols: u32,
        /// Routing kernels: 1 routes at most a subgroup's width of experts in one subgroup.
        route_lanes: u32,
    }
}

/// A slot table entry that names no slot.
pub const NO_SLOT: u32 = u32::MAX;

// `elementwise.rs`.

params! {
    /// `Params` of `wgsl/elementwise.wgsl`.
    pub struct ElementwiseParams {
        /// Output values.
        n: u32,
        /// Values per row of the output (`sigmoid_mul`'s per-row gate,
        /// `copy_cols`, heads of `delta_gates`).
        cols: u32,
        /// Values per row of the input of `copy_cols`.
        src_cols: u32,
        /// First column `copy_cols` copies.
        start: u32,
        /// 1: the sigmoid gate has one value per row.
        b_per_row: u32,
        _pad1: u32,
        /// `scale`'s multiplier.
        factor: f32,
        _pad0: u32,
    }
}

// `norm.rs`.

params! {
    /// `Params` of `wgsl/norm.wgsl`.
    pub struct NormParams {
        groups: u32,
        dim: u32,
        /// 1: multiply by the weight (`rms_norm`).
        has_weight: u32,
        /// Values of the weight: `dim`, or a row's worth (one slice per group of a row).
        weight_len: u32,
        eps: f32,
        /// `l2_normalize`'s multiplier.
        scale: f32,
        /// `rms_norm_gated`: 0 silu, 1 sigmoid.
        gate_act: u32,
        /// `rms_norm_rope`: rotated pairs per head (half the rotary dim).
        half: u32,
        /// `rms_norm_rope`: heads (groups) per token.
        heads: u32,
        /// `rms_norm_rope`: groups, heads per token and eps of the second set (keys).
        groups2: u32,
        heads2: u32,
        eps2: f32,
    }
}

// Rotary embedding and attention (`attention.rs`).

params! {
    /// `Params` of `wgsl/rope.wgsl`.
    pub struct RopeParams {
        n: u32,
        heads: u32,
        head_dim: u32,
        /// Rotated pairs per head (half the rotary dim).
        half: u32,
    }
}

params! {
    /// `Params` of `wgsl/attention.wgsl`.
    pub struct AttentionParams {
        tokens: u32,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        /// Cached positions before this call's tokens.
        past: u32,
        /// Keys per chunk: what one workgroup of `attention_split` attends to.
        chunk: u32,
        scale: f32,
        /// Keys per block of a key selection.
        block: u32,
        /// Words per query in the key selection (0: one row shared by all).
        sel_stride: u32,
        /// Chunks per (token, head); 1 for `attention`.
        splits: u32,
        /// 1: the token's key and value rows come from bindings 8 and 9 and
        /// the kernel writes them to the cache.
        fresh: u32,
        /// 1: q and the fresh key row are normalised and rotated in the
        /// kernel (bindings 10-12; see [`QkRope`](crate::attention::QkRope)).
        rope: u32,
        rope_half: u32,
        q_eps: f32,
        k_eps: f32,
        /// 1: the split kernels merge the splits themselves (binding 13).
        merge: u32,
        /// The cache holds 0: f32, 1: f16, 2: q8 (`FlashParams::kv`).
        kv: u32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

params! {
    /// `Params` of `wgsl/flash_attention.wgsl` and `wgsl/flash_decode.wgsl`.
    pub struct FlashParams {
        tokens: u32,
        heads: u32,
        kv_heads: u32,
        past: u32,
        /// Tokens per workgroup.
        tb: u32,
        /// Key slices per row (a power of two; rows * slices <= 64).
        slices: u32,
        /// Key chunks per (kv head, token block), and keys per chunk.
        splits: u32,
        chunk: u32,
        scale: f32,
        fresh: u32,
        /// The cache holds 0: f32, 1: f16, 2: q8 (`kv_code` in `attention.rs`).
        kv: u32,
        /// `flash_decode`: the last workgroup of each (kv head, pass) merges the chunks.
        merge: u32,
    }
}

/// Workgroups an attention call aims for: about eight resident 256-wide
/// workgroups on each of an H200's 132 SMs, so that decode (a few (token,
/// head) pairs, each a long key range) fills the GPU even with few heads.
pub(crate) const TARGET_WORKGROUPS: usize = 1024;

/// (token, head) pairs `Gpu::merge_counts` has a count for. Split attention
/// has fewer pairs than [`TARGET_WORKGROUPS`] (more fill the GPU unsplit).
pub(crate) const MERGE_PAIRS: usize = TARGET_WORKGROUPS;

// Bindings of attention.wgsl, flash_attention.wgsl and flash_decode.wgsl.
pub(crate) const Q: u32 = 2;
pub(crate) const OUT: u32 = 3;
pub(crate) const KEYS: u32 = 4;
pub(crate) const VALUES: u32 = 5;
pub(crate) const PARTIALS: u32 = 6;
pub(crate) const SELECTION: u32 = 7;
pub(crate) const KNEW: u32 = 8;
pub(crate) const VNEW: u32 = 9;
pub(crate) const ROPE_ANGLES_IN: u32 = 10;
pub(crate) const Q_WEIGHT: u32 = 11;
pub(crate) const K_WEIGHT: u32 = 12;
pub(crate) const MERGE_COUNTS: u32 = 13;

/// Keys from which a decode step (one token) takes `flash_decode` (or
/// `flash_attention`): below, the split kernels, which normalise and rotate
/// q and the fresh key in the same dispatch, are faster.
pub(crate) const FLASH_DECODE_MIN_KEYS: usize = 1024;
/// vec4 runs of a head a `flash_merge` workgroup sums (its `MERGE_RUNS`).
pub(crate) const FLASH_MERGE_RUNS: usize = 8;

// Linear-attention layers (`recurrent.rs`).

params! {
    /// `Params` of `wgsl/conv.wgsl`.
    pub struct ConvParams {
        tokens: u32,
        channels: u32,
        kernel: u32,
        /// Outputs (one thread each).
        n: u32,
        dilation: u32,
        /// `conv1d`: 1 applies silu to the output.
        act: u32,
        /// Values of the new window, written by the threads after the outputs'.
        window_n: u32,
        _pad2: u32,
    }
}

params! {
    /// `Params` of `wgsl/gated_delta.wgsl`.
    pub struct GatedDeltaParams {
        tokens: u32,
        heads: u32,
        key_heads: u32,
        key_dim: u32,
        value_dim: u32,
        /// `gated_delta_step`: q's multiplier after its L2 norm.
        q_scale: f32,
        /// `gated_delta_step`: the L2 norms' epsilon.
        eps: f32,
        /// 1: raw inputs (`gated_delta_step`): norms and gates in the kernel.
        raw: u32,
        /// The chunked form: the window's first token.
        start: u32,
        /// The chunked form: the window's chunks of [`CHUNK`](crate::recurrent::CHUNK) tokens.
        chunks: u32,
        _pad0: u32,
        _pad1: u32,
    }
}

// Multi-stream residuals (`streams.rs`).

params! {
    /// `Params` of `wgsl/streams.wgsl`.
    pub struct StreamParams {
        /// Output values (one thread each).
        n: u32,
        /// Values per stream.
        d: u32,
        streams: u32,
        /// (row, stream) groups of `stream_dot_gate` (one subgroup each).
        groups: u32,
        /// `add_gated_to_streams`: the logit scale; `stream_dot_gate`: 1/sqrt(d).
        factor: f32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}
