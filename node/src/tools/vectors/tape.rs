//! The generator of the audit tape vectors (`vectors/mesh/tapes.json`,
//! docs/bundle.md): a reference tape of real `mesh-stage/1` frames (OPEN,
//! two steps, STOP to stage 1; two HIDDEN replies back), and cases derived
//! mechanically from it (cut at every byte, a trailing byte, each magic
//! byte flipped, frame lengths past the limits, a count the bytes do not
//! bear), each with the outcome `Tape::decode` must give; the generator
//! refuses to write a case the code disagrees with.

use anyhow::ensure;
use mesh_protocol::hex;
use mesh_protocol::tape::{MAX_TAPE_FRAME, TAPE_MAGIC, Tape};
use serde_json::{Value, json};

use crate::runtime::net::msg::{self, kind};
use crate::tools::vectors::file::VectorFile;

fn outcome(bytes: &[u8]) -> Value {
    match Tape::decode(bytes) {
        Ok(tape) => json!({ "ok": {
            "request_id": tape.request_id.to_string(),
            "forward": tape.forward.len(),
            "replies": tape.replies.len(),
        }}),
        Err(error) => json!({ "refused": error.kind() }),
    }
}

fn reference() -> anyhow::Result<Tape> {
    let request_id = 0x0807_0605_0403_0201;
    let frame = |kind: u8, step: u32, payload: &[u8]| {
        msg::frame(&msg::stage_body(kind, request_id, step, payload))
    };
    Ok(Tape {
        request_id,
        forward: vec![
            frame(kind::OPEN, 0, b"\xa1\x63cap\x18\x40")?,
            frame(kind::ACTIVATIONS, 0, &[1, 2, 3, 4, 5, 6, 7, 8])?,
            frame(kind::ACTIVATIONS, 1, &[9, 10, 11, 12])?,
            frame(kind::STOP, 2, b"\xa0")?,
        ],
        replies: vec![
            frame(kind::HIDDEN, 0, &[13, 14, 15, 16])?,
            frame(kind::HIDDEN, 1, &[17, 18, 19, 20])?,
        ],
    })
}

pub fn generate() -> anyhow::Result<Vec<VectorFile>> {
    let reference = reference()?.encode();
    let mut cases = Vec::new();
    let mut add = |name: String, bytes: Vec<u8>, expect: Value| -> anyhow::Result<()> {
        let got = outcome(&bytes);
        ensure!(got == expect, "{name}: {got}, not {expect}");
        cases.push(json!({ "name": name, "tape": hex::encode(&bytes), "expect": expect }));
        Ok(())
    };
    let read = outcome(&reference);
    ensure!(
        read["ok"]["forward"] == 4 && read["ok"]["replies"] == 2,
        "{read}"
    );
    add("reference".into(), reference.clone(), read)?;
    let empty = Tape {
        request_id: 0,
        forward: Vec::new(),
        replies: Vec::new(),
    };
    add(
        "no_frames".into(),
        empty.encode(),
        json!({ "ok": { "request_id": "0", "forward": 0, "replies": 0 } }),
    )?;
    for cut in 0..reference.len() {
        let expect = if cut < TAPE_MAGIC.len() {
            json!({ "refused": "magic" })
        } else {
            json!({ "refused": "short" })
        };
        add(
            format!("cut_to_{cut}_bytes"),
            reference[..cut].to_vec(),
            expect,
        )?;
    }
    let mut trailing = reference.clone();
    trailing.push(0);
    add(
        "trailing_byte".into(),
        trailing,
        json!({ "refused": "trailing" }),
    )?;
    for byte in 0..TAPE_MAGIC.len() {
        let mut flipped = reference.clone();
        flipped[byte] ^= 0x01;
        add(
            format!("magic_byte_{byte}_flipped"),
            flipped,
            json!({ "refused": "magic" }),
        )?;
    }
    // The first frame's length: just after the magic, the id and the count.
    let first_length = TAPE_MAGIC.len() + 8 + 4;
    let mut zero = reference.clone();
    zero[first_length..first_length + 4].copy_from_slice(&0u32.to_le_bytes());
    add(
        "frame_of_0_bytes".into(),
        zero,
        json!({ "refused": "frame_length" }),
    )?;
    let mut huge = reference.clone();
    let past = u32::try_from(MAX_TAPE_FRAME + 1)?;
    huge[first_length..first_length + 4].copy_from_slice(&past.to_le_bytes());
    add(
        "frame_past_the_limit".into(),
        huge,
        json!({ "refused": "frame_length" }),
    )?;
    let mut counted = reference.clone();
    counted[first_length - 4..first_length].copy_from_slice(&u32::MAX.to_le_bytes());
    add(
        "count_past_the_bytes".into(),
        counted,
        json!({ "refused": "short" }),
    )?;

    let file = json!({
        "description": "mesh-node-tape/1 files (docs/bundle.md, `replay --tape`): a coordinator's frames to stage 1 and the final stage's replies, whole. Layout: \"mesh-node-tape/1\\n\" (17 bytes) || request_id u64 LE || F u32 LE || F x (length u32 LE || frame) || R u32 LE || R x (length || frame); each frame 1 to 64 MiB, the file at most 64 MiB, nothing after. Each case's outcome: {ok: {request_id (decimal), forward, replies}} or {refused: too_long | magic | short | frame_length | trailing}.",
        "cases": cases,
    });
    Ok(vec![(
        "mesh/tapes.json".into(),
        crate::tools::vectors::file::pretty(&file),
    )])
}
