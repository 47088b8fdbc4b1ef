//! Any bytes as a stage's receipt push on `record-push/1` (after the
//! sender line): a typed refusal, or a push that reads back the same, and
//! whose envelope is either refused or checked against a stage; never a
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::stage_receipt::{CarriedStageReceipt, check_stage_receipt};

fuzz_target!(|data: &[u8]| {
    if let Ok(document) = mesh_protocol::json::parse_strict(data) {
        if let Ok((request_id, carried)) = CarriedStageReceipt::from_push_value(&document) {
            assert_eq!(
                CarriedStageReceipt::from_push_value(&carried.push_value(request_id)),
                Ok((request_id, carried.clone()))
            );
            let _ = check_stage_receipt(
                &carried.envelope,
                carried.stage_index,
                "run",
                request_id,
                "did:key:z6Mk",
            );
        }
    }
});
