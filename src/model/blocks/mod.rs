//! Building blocks the families share, written against the backend trait:
//! attention (optionally gated, partial RoPE, sparse key selection), Gated
//! DeltaNet, dense MLP, routed experts with an optional shared expert,
//! RMSNorm, fused projections with named outputs, and reading weights by name.

pub mod attention;
pub mod delta;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod projections;
pub mod weights;
