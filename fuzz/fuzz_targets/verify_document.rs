//! Any bytes through the same path as `mesh-node verify FILE`: strict JSON,
//! then the form dispatcher (hop case, record_push_bundle, mesh_bundle).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(document) = mesh_protocol::json::parse_strict(data) {
        if let Ok(report) = mesh_protocol::verify::verify_document(&document) {
            let _ = report.to_value();
        }
    }
});
