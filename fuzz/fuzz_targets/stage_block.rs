//! Any JSON value as an x-mesh-stage-v1 block, a coordinator receipt and a
//! sealed record; a block that parses must serialise back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::block::StageBlock;
use mesh_protocol::capsule::SealedRecord;
use mesh_protocol::receipt::CoordinatorReceipt;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = mesh_protocol::json::parse_strict(data) else { return };
    if let Ok(block) = StageBlock::from_value(&value) {
        assert_eq!(StageBlock::from_value(&block.to_value()).as_ref(), Ok(&block));
    }
    if let Ok(receipt) = CoordinatorReceipt::from_value(&value) {
        assert_eq!(CoordinatorReceipt::from_value(&receipt.to_value()).as_ref(), Ok(&receipt));
    }
    let _ = SealedRecord::verify(value);
});
