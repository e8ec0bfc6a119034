//! Building blocks the families share, written against the backend trait:
//! attention (optionally gated, partial RoPE, sparse key selection), Gated
//! DeltaNet, dense MLP, routed experts with an optional shared expert,
//! RMSNorm and the pre-norm residual, and fused projections with named outputs.

pub mod attention;
pub mod delta;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod projections;
