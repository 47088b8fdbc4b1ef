//! mesh-node: the node that owns all I/O. This crate holds the command-line
//! front end's logic (verification output, benchmarks) and, as later issues
//! land, the steward, transport, coordinator and stage server.

pub mod bench;
pub mod render;
pub mod simulate;
pub mod vectors;
