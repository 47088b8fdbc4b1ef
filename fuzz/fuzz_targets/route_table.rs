//! Any bytes as a route table (the `route` member of a requester's bundle,
//! SPEC §4): a typed refusal, or a table that recomputes and reads back to
//! the same route, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::route::Route;

fuzz_target!(|data: &[u8]| {
    if let Ok(document) = mesh_protocol::json::parse_strict(data) {
        if let Ok(route) = Route::from_json(&document) {
            assert_eq!(Route::from_json(&route.to_json()), Ok(route));
        }
    }
});
