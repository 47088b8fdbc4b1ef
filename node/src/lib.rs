//! mesh-node: the node that owns all I/O. This crate holds the command-line
//! front end's logic (verification output, benchmarks) and, as later issues
//! land, the steward, transport, coordinator and stage server.

pub mod bench;
pub mod bench_concurrency;
pub mod energy;
pub mod engine_cli;
pub mod exercise;
pub mod inspect;
pub mod journal;
pub mod keys;
pub mod models;
pub mod net;
pub mod node_cli;
pub mod records;
pub mod render;
pub mod serve;
pub mod simulate;
pub mod steward;
pub mod vectors;
pub mod vectors_mesh1;
