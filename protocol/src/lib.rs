//! Sans-IO wire types, encodings, digests, signing and verification for
//! mesh-node. No I/O, clocks or randomness: callers pass them in.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod advert;
pub mod audit;
pub mod block;
pub mod bundle;
pub mod capsule;
pub mod cbor;
pub mod change;
pub mod control;
pub mod fold;
pub mod grant;
pub mod hex;
pub mod hopcheck;
pub mod identity;
pub mod json;
pub mod mesh1;
pub mod package;
pub mod plan;
pub mod reach;
pub mod receipt;
pub mod replay;
pub mod resume;
pub mod route;
pub mod session;
pub mod split;
pub mod stage_frame;
pub mod stage_receipt;
pub mod tape;
pub mod verify;

pub use ed25519_dalek::{SigningKey, VerifyingKey};
