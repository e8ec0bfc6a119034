//! The WGSL kernel sources (files in `wgsl/` at the repository root) and the
//! modules they are assembled into. Kernels that read weight matrices share
//! `weights.wgsl` (and the row-dot helpers in `dot.wgsl`), which are prepended
//! to the kernel file.

const WEIGHTS: &str = include_str!("../../../wgsl/weights.wgsl");
const DOT: &str = include_str!("../../../wgsl/dot.wgsl");

/// One compiled shader module: a kernel family and its entry points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    Matvec,
    MatvecQ8,
    MatmulTiled,
    Moe,
    Embed,
    Elementwise,
    Norm,
    Rope,
    Attention,
    Conv,
    GatedDelta,
    Hyper,
}

impl Module {
    pub const ALL: [Module; 12] = [
        Module::Matvec,
        Module::MatvecQ8,
        Module::MatmulTiled,
        Module::Moe,
        Module::Embed,
        Module::Elementwise,
        Module::Norm,
        Module::Rope,
        Module::Attention,
        Module::Conv,
        Module::GatedDelta,
        Module::Hyper,
    ];

    /// The kernel family's file name in `wgsl/` (also its name in profiles).
    pub fn name(self) -> &'static str {
        match self {
            Module::Matvec => "matvec",
            Module::MatvecQ8 => "matvec_q8",
            Module::MatmulTiled => "matmul_tiled",
            Module::Moe => "moe",
            Module::Embed => "embed",
            Module::Elementwise => "elementwise",
            Module::Norm => "norm",
            Module::Rope => "rope",
            Module::Attention => "attention",
            Module::Conv => "conv",
            Module::GatedDelta => "gated_delta",
            Module::Hyper => "hyper",
        }
    }

    pub fn entry_points(self) -> &'static [&'static str] {
        match self {
            Module::Matvec => &["matvec"],
            Module::MatvecQ8 => &["quantize_x8", "matvec_q8"],
            Module::MatmulTiled => &["matmul_tiled"],
            Module::Moe => &["moe_gate", "moe_up", "moe_down"],
            Module::Embed => &["embed"],
            Module::Elementwise => {
                &["add", "sigmoid_mul", "add_sigmoid_mul", "silu_mul", "silu_only", "scale", "copy_cols", "delta_gates", "moe_combine"]
            }
            Module::Norm => &["rms_norm", "rms_norm_gated", "l2_normalize", "rms_norm_wide"],
            Module::Rope => &["rope"],
            Module::Attention => &["attention", "attention_sparse"],
            Module::Conv => &["conv1d", "conv_window"],
            Module::GatedDelta => &["gated_delta"],
            Module::Hyper => &["repeat_cols", "hc_mix", "hc_inject", "ple_gate"],
        }
    }

    /// The complete WGSL source of the module.
    pub fn source(self) -> String {
        let with_weights = |kernel: &str| format!("{WEIGHTS}\n{kernel}");
        let with_dot = |kernel: &str| format!("{WEIGHTS}\n{DOT}\n{kernel}");
        match self {
            Module::Matvec => with_dot(include_str!("../../../wgsl/matvec.wgsl")),
            Module::MatvecQ8 => with_dot(include_str!("../../../wgsl/matvec_q8.wgsl")),
            Module::Moe => with_dot(include_str!("../../../wgsl/moe.wgsl")),
            Module::MatmulTiled => with_weights(include_str!("../../../wgsl/matmul_tiled.wgsl")),
            Module::Embed => with_weights(include_str!("../../../wgsl/embed.wgsl")),
            Module::Elementwise => include_str!("../../../wgsl/elementwise.wgsl").to_string(),
            Module::Norm => include_str!("../../../wgsl/norm.wgsl").to_string(),
            Module::Rope => include_str!("../../../wgsl/rope.wgsl").to_string(),
            Module::Attention => include_str!("../../../wgsl/attention.wgsl").to_string(),
            Module::Conv => include_str!("../../../wgsl/conv.wgsl").to_string(),
            Module::GatedDelta => include_str!("../../../wgsl/gated_delta.wgsl").to_string(),
            Module::Hyper => include_str!("../../../wgsl/hyper.wgsl").to_string(),
        }
    }
}
