//! The kernel registry: the WGSL kernel sources (files in `wgsl/` at the
//! repository root), the modules they are assembled into, each module's
//! entry points and the parameter struct they all take (`params.rs`, which
//! mirrors each module's uniform `Params`). Kernels that read weight matrices
//! share `weights.wgsl` (and the row-dot helpers in `dot.wgsl`), which are
//! prepended to the kernel file.
//!
//! Each kernel family's Rust module (`elementwise.rs`, `norm.rs`, ...) has
//! one typed function per entry point, which builds the module's parameter
//! struct; `Gpu::dispatch` refuses any other type for the entry point
//! ([`ParamsLayout::check`]), the one place a dispatch meets the registry.

use std::any::TypeId;

use crate::params::{self, Params};

/// A parameter struct as the registry knows it: what the shader tests
/// compare a module's WGSL `Params` struct with, and what a dispatch's
/// parameters are checked against.
#[derive(Clone, Copy, Debug)]
pub struct ParamsLayout {
    pub fields: &'static [&'static str],
    pub bytes: usize,
    /// The Rust type's name.
    pub name: &'static str,
    id: TypeId,
}

impl ParamsLayout {
    fn of<P: Params + 'static>() -> ParamsLayout {
        ParamsLayout { fields: P::FIELDS, bytes: std::mem::size_of::<P>(), name: std::any::type_name::<P>(), id: TypeId::of::<P>() }
    }

    /// Whether `P` is this parameter struct; else an error naming `entry`,
    /// the struct it takes and the one it was given.
    pub(crate) fn check<P: Params + 'static>(&self, entry: &str) -> Result<(), String> {
        match TypeId::of::<P>() == self.id {
            true => Ok(()),
            false => Err(format!("kernel '{entry}' takes {}, not {}", self.name, std::any::type_name::<P>())),
        }
    }
}

/// The layout of `WeightDesc` (`wgsl/weights.wgsl`), nested as field `w` in
/// the parameters of every kernel that reads a weight.
pub fn weight_desc_layout() -> ParamsLayout {
    ParamsLayout::of::<params::WeightDesc>()
}

/// How every kernel file declares its parameters (binding 0 of group 0), and
/// the same as immediate data (see [`Module::compiled_source`]).
pub const UNIFORM_PARAMS: &str = "@group(0) @binding(0) var<uniform> p: Params;";
pub const IMMEDIATE_PARAMS: &str = "var<immediate> p: Params;";

/// Every file in `wgsl/` as built in, by name.
const FILES: [(&str, &str); 23] = [
    ("weights.wgsl", include_str!("../../../wgsl/weights.wgsl")),
    ("dot.wgsl", include_str!("../../../wgsl/dot.wgsl")),
    ("reduce.wgsl", include_str!("../../../wgsl/reduce.wgsl")),
    ("moe_common.wgsl", include_str!("../../../wgsl/moe_common.wgsl")),
    ("matvec.wgsl", include_str!("../../../wgsl/matvec.wgsl")),
    ("matvec_q8.wgsl", include_str!("../../../wgsl/matvec_q8.wgsl")),
    ("matmul_common.wgsl", include_str!("../../../wgsl/matmul_common.wgsl")),
    ("matmul_tiled.wgsl", include_str!("../../../wgsl/matmul_tiled.wgsl")),
    ("matmul_coop.wgsl", include_str!("../../../wgsl/matmul_coop.wgsl")),
    ("moe.wgsl", include_str!("../../../wgsl/moe.wgsl")),
    ("route.wgsl", include_str!("../../../wgsl/route.wgsl")),
    ("embed.wgsl", include_str!("../../../wgsl/embed.wgsl")),
    ("elementwise.wgsl", include_str!("../../../wgsl/elementwise.wgsl")),
    ("norm.wgsl", include_str!("../../../wgsl/norm.wgsl")),
    ("rope.wgsl", include_str!("../../../wgsl/rope.wgsl")),
    ("attention.wgsl", include_str!("../../../wgsl/attention.wgsl")),
    ("attention_regs.wgsl", include_str!("../../../wgsl/attention_regs.wgsl")),
    ("flash_attention.wgsl", include_str!("../../../wgsl/flash_attention.wgsl")),
    ("flash_decode.wgsl", include_str!("../../../wgsl/flash_decode.wgsl")),
    ("conv.wgsl", include_str!("../../../wgsl/conv.wgsl")),
    ("gated_delta.wgsl", include_str!("../../../wgsl/gated_delta.wgsl")),
    ("gated_delta_chunked.wgsl", include_str!("../../../wgsl/gated_delta_chunked.wgsl")),
    ("streams.wgsl", include_str!("../../../wgsl/streams.wgsl")),
];

/// Increments a kernel's rising `for` loops may take besides `++`: the
/// subgroup size, workgroup counts and sizes, and positive constants.
const LOOP_STEPS: &[&str] = &[
    "lanes", "nwg.x * nsg", "nwg.x", "nsg", "parts", "256u", "128u", "64u", "TK", "TN", "WG", "TILE", "V_BATCH * parts", "parts * lanes",
    "V_BATCH", "MERGE_BATCH", "wg", "nwg.x * per_wg", "BK", "DK", "4u", "tp", "p.slices", "MERGE_STEP", "CK", "16u",
    "BLOCK", "SB * STEP", "VB", "MERGE_LANES",
];

/// Checks that every loop of a kernel file ends, as the kernels are compiled
/// without wgpu's forced loop bounding (see `gpu.rs`): each is a `for` that
/// declares its counter and rises by `++` or a [`LOOP_STEPS`] step to a `<`
/// bound, or halves down to zero; no `loop` or `while`. Returns how many
/// loops it found, or the first that is not known to end.
pub fn check_loops(text: &str) -> Result<usize, String> {
    let code: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    if let Some(word) = code.split(|c: char| !c.is_alphanumeric() && c != '_').find(|w| *w == "loop" || *w == "while") {
        return Err(format!("`{word}` loops are not allowed (only bounded `for` loops)"));
    }
    let mut loops = 0;
    let mut rest = code.as_str();
    while let Some(at) = rest.find("for (") {
        let body = &rest[at + 5..];
        let mut depth = 1;
        let Some(end) = body.char_indices().find_map(|(i, c)| {
            depth += match c {
                '(' => 1,
                ')' => -1,
                _ => 0,
            };
            (depth == 0).then_some(i)
        }) else {
            return Err("an unclosed `for (`".into());
        };
        let header = &body[..end];
        let parts: Vec<&str> = header.split(';').map(str::trim).collect();
        let known = match (parts.as_slice(), parts.first().and_then(|p| p.strip_prefix("var ")).and_then(|v| v.split_whitespace().next())) {
            ([_, cond, step], Some(var)) => {
                let rising = cond.starts_with(&format!("{var} < ")) && (*step == format!("{var}++") || LOOP_STEPS.iter().any(|s| *step == format!("{var} += {s}")));
                let halving = *cond == format!("{var} > 0u") && *step == format!("{var} >>= 1u");
                rising || halving
            }
            _ => false,
        };
        if !known {
            return Err(format!("`for ({header})` is not a loop known to end"));
        }
        loops += 1;
        rest = &body[end..];
    }
    Ok(loops)
}

/// The built-in text of a file of `wgsl/` (every name the modules join is
/// one of [`FILES`]).
fn builtin(name: &str) -> &'static str {
    FILES.iter().find(|f| f.0 == name).map_or("", |f| f.1)
}

/// A pipeline of an entry point specialised by override constants.
#[derive(Clone, Copy, Debug)]
pub struct Pipeline {
    /// What dispatches name it by.
    pub name: &'static str,
    pub constants: &'static [(&'static str, f64)],
}

/// `flash_attention` for each head dim it is compiled for (`HD`), and with
/// two rows per slot (`ROWS`, prefill) for head dims up to 128.
const FLASH_PIPELINES: [Pipeline; 5] = [
    Pipeline { name: "flash_attention_hd64", constants: &[("HD", 64.0)] },
    Pipeline { name: "flash_attention_hd128", constants: &[("HD", 128.0)] },
    Pipeline { name: "flash_attention_hd256", constants: &[("HD", 256.0)] },
    Pipeline { name: "flash_attention_hd64_r2", constants: &[("HD", 64.0), ("ROWS", 2.0)] },
    Pipeline { name: "flash_attention_hd128_r2", constants: &[("HD", 128.0), ("ROWS", 2.0)] },
];

/// `kv_store` for each head dim of an f16 cache (`HD`).
const KV_STORE_PIPELINES: [Pipeline; 3] = [
    Pipeline { name: "kv_store_hd64", constants: &[("HD", 64.0)] },
    Pipeline { name: "kv_store_hd128", constants: &[("HD", 128.0)] },
    Pipeline { name: "kv_store_hd256", constants: &[("HD", 256.0)] },
];

/// `kv_store_q8` for each head dim of a q8 cache (`HD`).
const KV_STORE_Q8_PIPELINES: [Pipeline; 3] = [
    Pipeline { name: "kv_store_q8_hd64", constants: &[("HD", 64.0)] },
    Pipeline { name: "kv_store_q8_hd128", constants: &[("HD", 128.0)] },
    Pipeline { name: "kv_store_q8_hd256", constants: &[("HD", 256.0)] },
];

/// `flash_decode` for each head dim (`HD`).
const FLASH_DECODE_PIPELINES: [Pipeline; 3] = [
    Pipeline { name: "flash_decode_hd64", constants: &[("HD", 64.0)] },
    Pipeline { name: "flash_decode_hd128", constants: &[("HD", 128.0)] },
    Pipeline { name: "flash_decode_hd256", constants: &[("HD", 256.0)] },
];

/// `flash_merge` for each head dim (`HD`).
const FLASH_MERGE_PIPELINES: [Pipeline; 3] = [
    Pipeline { name: "flash_merge_hd64", constants: &[("HD", 64.0)] },
    Pipeline { name: "flash_merge_hd128", constants: &[("HD", 128.0)] },
    Pipeline { name: "flash_merge_hd256", constants: &[("HD", 256.0)] },
];

/// One compiled shader module: a kernel family and its entry points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    Matvec,
    MatvecQ8,
    MatmulTiled,
    MatmulCoop,
    Moe,
    Route,
    Embed,
    Elementwise,
    Norm,
    Rope,
    Attention,
    FlashAttention,
    FlashDecode,
    Conv,
    GatedDelta,
    Streams,
}

impl Module {
    pub const ALL: [Module; 16] = [
        Module::Matvec,
        Module::MatvecQ8,
        Module::MatmulTiled,
        Module::MatmulCoop,
        Module::Moe,
        Module::Route,
        Module::Embed,
        Module::Elementwise,
        Module::Norm,
        Module::Rope,
        Module::Attention,
        Module::FlashAttention,
        Module::FlashDecode,
        Module::Conv,
        Module::GatedDelta,
        Module::Streams,
    ];

    /// Whether the module runs on the GPU's matrix units (cooperative
    /// matrices of 16 x 16 f16, `wgsl/matmul_coop.wgsl`): compiled only
    /// where the adapter has them ([`crate::gpu::Gpu::coop_matrix`]).
    pub fn needs_coop(self) -> bool {
        self == Module::MatmulCoop
    }

    /// The kernel family's file name in `wgsl/` (also its name in profiles).
    pub fn name(self) -> &'static str {
        match self {
            Module::Matvec => "matvec",
            Module::MatvecQ8 => "matvec_q8",
            Module::MatmulTiled => "matmul_tiled",
            Module::MatmulCoop => "matmul_coop",
            Module::Moe => "moe",
            Module::Route => "route",
            Module::Embed => "embed",
            Module::Elementwise => "elementwise",
            Module::Norm => "norm",
            Module::Rope => "rope",
            Module::Attention => "attention",
            Module::FlashAttention => "flash_attention",
            Module::FlashDecode => "flash_decode",
            Module::Conv => "conv",
            Module::GatedDelta => "gated_delta",
            Module::Streams => "streams",
        }
    }

    pub fn entry_points(self) -> &'static [&'static str] {
        match self {
            Module::Matvec => &["matvec_q4", "matvec_q4_tokens", "matvec", "matvec_epilogue"],
            Module::MatvecQ8 => &["quantize_x8", "matvec_q8_tokens", "matvec_q8"],
            Module::MatmulTiled => &["matmul_tiled", "matmul_wide", "moe_sort", "moe_gate_up_tiled", "moe_down_tiled", "moe_gate_up_wide", "moe_down_wide"],
            Module::MatmulCoop => &["matmul_coop", "moe_gate_up_coop", "moe_down_coop"],
            Module::Moe => &["moe_map", "moe_gate_up", "moe_down", "moe_combine", "moe_down_combine"],
            Module::Route => &["moe_route", "moe_route_matmul", "moe_route_norm", "moe_route_norm_q8", "moe_route_norm_wide"],
            Module::Embed => &["embed", "argmax_parts", "embed_chosen"],
            Module::Elementwise => {
                &["add", "sigmoid_mul", "add_sigmoid_mul", "silu_mul", "silu_only", "scale", "copy_cols", "delta_gates"]
            }
            Module::Norm => &["rms_norm", "rms_norm_gated", "l2_normalize", "rms_norm_wide", "add_rms_norm", "add_rms_norm_1024", "rms_norm_rope"],
            Module::Rope => &["rope"],
            Module::Attention => &[
                "attention",
                "attention_rope",
                "attention_split",
                "attention_split_rope",
                "attention_merge",
                "attention_split_regs",
                "attention_split_rope_regs",
            ],
            Module::FlashAttention => &["flash_attention", "kv_store", "kv_store_q8", "flash_merge"],
            Module::FlashDecode => &["flash_decode"],
            Module::Conv => &["conv1d"],
            Module::GatedDelta => &["gated_delta", "gated_delta_prep", "gated_delta_chunks"],
            Module::Streams => &["repeat_cols", "stream_mean", "add_gated_to_streams", "stream_dot_gate"],
        }
    }

    /// The pipelines compiled from the WGSL entry point `entry` of this
    /// module: one per set of override constants, each under its own name
    /// (what `Gpu::dispatch` takes), or the entry point itself, once.
    pub fn pipelines(self, entry: &'static str) -> &'static [Pipeline] {
        match (self, entry) {
            (Module::FlashAttention, "flash_attention") => &FLASH_PIPELINES,
            (Module::FlashAttention, "kv_store") => &KV_STORE_PIPELINES,
            (Module::FlashAttention, "kv_store_q8") => &KV_STORE_Q8_PIPELINES,
            (Module::FlashAttention, "flash_merge") => &FLASH_MERGE_PIPELINES,
            (Module::FlashDecode, "flash_decode") => &FLASH_DECODE_PIPELINES,
            _ => &[],
        }
    }

    /// The parameter struct every entry point of the module takes (the
    /// Rust mirror of its WGSL `Params`).
    pub fn params(self) -> ParamsLayout {
        use crate::params::*;
        match self {
            Module::Matvec => ParamsLayout::of::<MatvecParams>(),
            Module::MatvecQ8 => ParamsLayout::of::<MatvecQ8Params>(),
            Module::MatmulTiled | Module::MatmulCoop => ParamsLayout::of::<TiledParams>(),
            Module::Moe | Module::Route => ParamsLayout::of::<MoeParams>(),
            Module::Embed => ParamsLayout::of::<EmbedParams>(),
            Module::Elementwise => ParamsLayout::of::<ElementwiseParams>(),
            Module::Norm => ParamsLayout::of::<NormParams>(),
            Module::Rope => ParamsLayout::of::<RopeParams>(),
            Module::Attention => ParamsLayout::of::<AttentionParams>(),
            Module::FlashAttention | Module::FlashDecode => ParamsLayout::of::<FlashParams>(),
            Module::Conv => ParamsLayout::of::<ConvParams>(),
            Module::GatedDelta => ParamsLayout::of::<GatedDeltaParams>(),
            Module::Streams => ParamsLayout::of::<StreamParams>(),
        }
    }

    /// The complete WGSL source of the module, as built in.
    pub fn source(self) -> String {
        match self.assemble(|name| Ok::<_, std::convert::Infallible>(builtin(name).to_string())) {
            Ok(source) => source,
            Err(never) => match never {},
        }
    }

    /// The source the backend compiles: with its parameters as immediate
    /// data (push constants) instead of the uniform buffer at binding 0 when
    /// `immediates` (set with each dispatch, so a kernel reads them without a
    /// memory load first), and with any of its files found in `dir` read from
    /// there instead of the built-in ones ([`WgpuOptions::wgsl_dir`], for
    /// kernel development; each must pass [`check_loops`], as the built-in
    /// ones do in the shader tests). Also says whether any file came from
    /// `dir`.
    ///
    /// [`WgpuOptions::wgsl_dir`]: crate::WgpuOptions::wgsl_dir
    pub fn compiled_source(self, immediates: bool, dir: Option<&std::path::Path>) -> Result<(String, bool), String> {
        if let Some(d) = dir.filter(|d| !d.is_dir()) {
            return Err(format!("kernel sources: {} is not a directory (SLOTSTREAM_WGPU_WGSL_DIR)", d.display()));
        }
        let replaced = std::cell::Cell::new(false);
        let source = self.assemble(|name| {
            let Some(path) = dir.map(|d| d.join(name)) else { return Ok(builtin(name).to_string()) };
            match std::fs::read_to_string(&path) {
                Ok(text) => {
                    check_loops(&text).map_err(|e| format!("kernel source {}: {e} (kernels are compiled without loop bounding; see wgsl/README.md)", path.display()))?;
                    replaced.set(true);
                    Ok(text)
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(builtin(name).to_string()),
                Err(e) => Err(format!("reading kernel source {}: {e}", path.display())),
            }
        })?;
        let source = if immediates { source.replacen(UNIFORM_PARAMS, IMMEDIATE_PARAMS, 1) } else { source };
        Ok((source, replaced.get()))
    }

    /// The module's files (by name, through `file`) in the order they are
    /// joined: the shared helpers its kernels use, then the kernel file.
    fn assemble<E>(self, file: impl Fn(&str) -> Result<String, E>) -> Result<String, E> {
        let names: &[&str] = match self {
            Module::Matvec => &["weights.wgsl", "dot.wgsl", "matvec.wgsl"],
            Module::MatvecQ8 => &["weights.wgsl", "dot.wgsl", "matvec_q8.wgsl"],
            Module::Moe => &["reduce.wgsl", "weights.wgsl", "dot.wgsl", "moe_common.wgsl", "moe.wgsl"],
            Module::Route => &["reduce.wgsl", "weights.wgsl", "dot.wgsl", "moe_common.wgsl", "route.wgsl"],
            Module::MatmulTiled => &["weights.wgsl", "matmul_common.wgsl", "matmul_tiled.wgsl"],
            // First: its `enable` directives open the module.
            Module::MatmulCoop => &["matmul_coop.wgsl", "weights.wgsl", "matmul_common.wgsl"],
            Module::Embed => &["weights.wgsl", "embed.wgsl"],
            Module::Elementwise => &["elementwise.wgsl"],
            Module::Norm => &["norm.wgsl"],
            Module::Rope => &["rope.wgsl"],
            Module::Attention => &["reduce.wgsl", "attention.wgsl", "attention_regs.wgsl"],
            Module::FlashAttention => &["flash_attention.wgsl"],
            Module::FlashDecode => &["flash_decode.wgsl"],
            Module::Conv => &["conv.wgsl"],
            Module::GatedDelta => &["gated_delta.wgsl", "gated_delta_chunked.wgsl"],
            Module::Streams => &["streams.wgsl"],
        };
        let parts = names.iter().map(|name| file(name)).collect::<Result<Vec<_>, E>>()?;
        Ok(parts.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::Module;
    use crate::params::{ElementwiseParams, FlashParams, MoeParams, NormParams, TiledParams};

    #[test]
    fn an_entry_point_takes_its_module_parameter_struct_only() {
        assert_eq!(Module::Norm.params().check::<NormParams>("rms_norm"), Ok(()));
        assert_eq!(Module::Route.params().check::<MoeParams>("moe_route"), Ok(()));
        assert_eq!(Module::MatmulTiled.params().check::<TiledParams>("moe_sort"), Ok(()));
        assert_eq!(Module::FlashAttention.params().check::<FlashParams>("flash_attention_hd128"), Ok(()));
        let refused = Module::Norm.params().check::<ElementwiseParams>("rms_norm").expect_err("another module's struct");
        assert!(refused.contains("'rms_norm'") && refused.contains("NormParams") && refused.contains("ElementwiseParams"), "{refused}");
        // Same-sized structs of different modules are told apart too.
        assert_eq!(Module::Elementwise.params().bytes, Module::Streams.params().bytes);
        assert!(Module::Streams.params().check::<ElementwiseParams>("stream_mean").is_err());
    }
}
