//! The QUIC data plane: identities, framing, and the three protocols
//! (`mesh-control/1`, `mesh-stage/1`, `record-push/1`), and how a node
//! behind a NAT is reached (`mesh-reach/1`).

pub mod addr;
pub mod circuits;
pub mod msg;
pub mod peers;
pub mod reach;
pub mod tls;
pub mod tunnel;

pub const ALPN_CONTROL: &[u8] = b"mesh-control/1";
pub const ALPN_STAGE: &[u8] = b"mesh-stage/1";
pub const ALPN_RECORD_PUSH: &[u8] = b"record-push/1";
