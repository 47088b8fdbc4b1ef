//! Any bytes as a mesh/1 envelope, a det-CBOR value, a grant and a
//! presentation: typed errors, never a panic; whatever decodes re-encodes
//! to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::cbor::Cbor;
use mesh_protocol::grant::{Presentation, SignedGrant};
use mesh_protocol::mesh1::SealedReceipt;

fuzz_target!(|data: &[u8]| {
    let _ = SealedReceipt::verify(data);
    if let Ok(value) = Cbor::decode(data) {
        assert_eq!(value.encode(), data);
    }
    if let Ok(grant) = SignedGrant::decode(data) {
        assert_eq!(grant.encode(), data);
    }
    if let Ok(presentation) = Presentation::decode(data) {
        assert_eq!(presentation.encode(), data);
    }
});
