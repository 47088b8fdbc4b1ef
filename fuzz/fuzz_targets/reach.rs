//! Any bytes as a `mesh-reach/1` request, as the answer to each request,
//! and as a relay frame: a typed refusal or a message that encodes back to
//! the same bytes, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::reach::{ReachAnswer, ReachRequest, parse_relay_frame, relay_frame};

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = ReachRequest::decode(data) {
        assert_eq!(request.encode(), data);
    }
    for request in [
        ReachRequest::Observe,
        ReachRequest::Introduce { node: [1; 32] },
        ReachRequest::Relay,
    ] {
        if let Ok(answer) = ReachAnswer::decode(&request, data) {
            assert_eq!(answer.encode(), data);
        }
    }
    if let Ok((peer, packet)) = parse_relay_frame(data) {
        assert_eq!(relay_frame(&peer, packet).ok().as_deref(), Some(data));
    }
});
