//! The layer-slice engine: a node holding layers `[a, b)` of a model loads
//! only those weights and runs only those layers. No networking lives here.
//!
//! This crate is filled by the engine issue; for now it only pins the
//! dependency direction `protocol <- stage <- node`.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub use mesh_protocol as protocol;
