//! Any bytes as a `mesh-control/1` request: a typed error or a request
//! that re-encodes to the same bytes, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::control::ControlRequest;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = ControlRequest::decode(data) {
        assert_eq!(request.to_cbor().encode(), data);
    }
});
