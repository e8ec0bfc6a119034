//! slotstream: run Mixture-of-Experts language models, on the CPU or a GPU,
//! with the routed experts streamed from disk into a fixed pool of cache slots.

pub mod checkpoint;
pub mod demo;
pub mod direct_io;
pub mod experts;
pub mod generate;
pub mod model;
pub mod plan;
pub mod pull;
pub mod sampling;
pub mod server;
pub mod tokenizer;
