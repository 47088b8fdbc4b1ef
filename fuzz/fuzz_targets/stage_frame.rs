//! Any bytes as a `mesh-stage/1` message body: a typed error or a header
//! that re-encodes to the same bytes, never a panic; a REWIND's payload
//! parses strictly or is refused.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::stage_frame::{Rewind, StageHeader, kind};

fuzz_target!(|data: &[u8]| {
    if let Ok((header, payload)) = StageHeader::parse(data) {
        assert_eq!(header.encode(payload), data);
        if header.kind == kind::REWIND
            && let Ok(rewind) = Rewind::parse(payload)
        {
            assert_eq!(rewind.encode(), payload);
        }
    }
});
