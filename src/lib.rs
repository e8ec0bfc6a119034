//! slotstream: run Mixture-of-Experts language models, on the CPU or a GPU,
//! with the routed experts streamed from disk into a fixed pool of cache slots.

pub mod backend_spec;
pub mod chat;
pub mod checkpoint;
pub mod constrain;
pub mod console;
pub mod demo;
pub mod dialect;
pub mod direct_io;
pub mod disk;
pub mod doctor;
pub mod experts;
pub mod generate;
pub mod hex;
pub mod memory_cap;
pub mod launch;
pub mod model;
pub mod model_files;
pub mod model_ref;
pub mod plan;
pub mod probe;
pub mod process;
pub mod pull;
pub mod run_report;
pub mod sampling;
pub mod server;
pub mod tokenizer;
pub mod user_cache;
