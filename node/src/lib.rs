//! mesh-node: the node that owns all I/O.
//!
//! - `runtime`: what a running node is: the serving core (`serve`), the
//!   transport (`net`), the steward and its journal, records, energy
//!   meters, keys. It depends on nothing below.
//! - `cli`: the commands' logic (serve, generate, demo, grants), the model
//!   download, and human-readable output.
//! - `tools`: vector generators, benchmarks, the exercise and inspection
//!   commands; they use the runtime, never the other way round.

pub mod cli;
pub mod runtime;
pub mod tools;
