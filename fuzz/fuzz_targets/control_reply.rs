//! Any bytes as a `mesh-control/1` reply (what a coordinator reads from a
//! stage, a requester from a coordinator): a typed error or a reply that
//! re-encodes to the same bytes, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::control::ControlReply;

fuzz_target!(|data: &[u8]| {
    if let Ok(reply) = ControlReply::decode(data) {
        assert_eq!(reply.to_cbor().encode(), data);
    }
});
