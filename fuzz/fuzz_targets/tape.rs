//! Any bytes as an audit tape (`mesh-node-tape/1`): a typed error or a tape
//! that re-encodes to the same bytes, never a panic, and a count the bytes
//! do not bear allocates nothing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mesh_protocol::tape::Tape;

fuzz_target!(|data: &[u8]| {
    if let Ok(tape) = Tape::decode(data) {
        assert_eq!(tape.encode(), data);
    }
});
