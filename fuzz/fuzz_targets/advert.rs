//! Any bytes as a signed node advert, and as an offer to a member table: a
//! typed refusal or an advert that re-signs to a valid one, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::advert::{Advert, Members};

fuzz_target!(|data: &[u8]| {
    if let Ok(advert) = Advert::verify_signature(data) {
        assert!(advert.ttl_ms > 0);
        let _ = Advert::verify(data, &advert.node_id, advert.issued_ms);
    }
    let mut table = Members::default();
    let _ = table.offer(data, &[0; 32], 0);
});
