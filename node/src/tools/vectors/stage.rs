//! The generator of the stage message vectors
//! (`vectors/mesh/stage-messages.json`, docs/wire.md): one reference body
//! of every `mesh-stage/1` kind with its header read back, and the REWIND
//! payload (speculative decoding) with cases derived mechanically from its
//! reference (every truncation, a trailing byte, every flipped bit, an
//! extra member, a member of the wrong type, a longer encoding of the same
//! number, a payload over the limit), each with the outcome the parsers
//! must give. The generator refuses to write a case the code disagrees
//! with.

use anyhow::ensure;
use mesh_protocol::cbor::Cbor;
use mesh_protocol::hex;
use mesh_protocol::stage_frame::{
    MAX_REWIND_PAYLOAD, Rewind, STAGE_HEADER, StageFrameError, StageHeader, kind,
};
use serde_json::{Value, json};

use crate::tools::vectors::file::VectorFile;

const REQUEST_ID: u64 = 0x0102_0304_0506_0708;
const STEP: u32 = 3;

/// A REWIND payload's outcome as the vectors name it.
fn rewind_outcome(payload: &[u8]) -> Value {
    match Rewind::parse(payload) {
        Ok(rewind) => json!({ "ok": rewind.positions }),
        Err(error) => json!({ "refused": error.kind() }),
    }
}

/// A body's outcome as the vectors name it.
fn header_outcome(body: &[u8]) -> Value {
    match StageHeader::parse(body) {
        Ok((header, payload)) => json!({
            "ok": {
                "kind": header.kind,
                "request_id": header.request_id.to_string(),
                "step": header.step,
                "payload": hex::encode(payload),
            }
        }),
        Err(error) => json!({ "refused": error.kind() }),
    }
}

pub fn generate() -> anyhow::Result<Vec<VectorFile>> {
    let rewind = Rewind { positions: 300 };
    let reference = rewind.encode();
    ensure!(
        hex::encode(&reference) == "a169706f736974696f6e7319012c",
        "the reference REWIND payload is {{\"positions\": 300}} in det-CBOR"
    );
    let payloads: Vec<(u8, &str, Vec<u8>)> = vec![
        (
            kind::OPEN,
            "OPEN",
            Cbor::text_map([
                ("run_id", Cbor::text("run-1")),
                ("capacity", Cbor::Uint(64)),
                ("return_mode", Cbor::text("direct")),
                ("prefill_steps", Cbor::Uint(1)),
            ])
            .encode(),
        ),
        (kind::ACTIVATIONS, "ACTIVATIONS", vec![0xAB; 8]),
        (
            kind::STOP,
            "STOP",
            Cbor::text_map([("terminal_state", Cbor::text("completed"))]).encode(),
        ),
        (kind::DIRECT_OPEN, "DIRECT_OPEN", Vec::new()),
        (kind::REWIND, "REWIND", reference.clone()),
        (kind::FAILED, "FAILED", b"stage 1: why".to_vec()),
        (kind::HIDDEN, "HIDDEN", vec![0xCD; 8]),
    ];
    ensure!(
        payloads.iter().map(|(k, ..)| *k).collect::<Vec<_>>() == kind::ALL,
        "one reference body per kind this version speaks"
    );
    let mut messages = Vec::new();
    for (message_kind, name, payload) in &payloads {
        let body = StageHeader {
            kind: *message_kind,
            request_id: REQUEST_ID,
            step: STEP,
        }
        .encode(payload);
        let outcome = header_outcome(&body);
        ensure!(outcome.get("ok").is_some(), "{name} reads back");
        messages.push(json!({
            "name": name,
            "body": hex::encode(&body),
            "expect": outcome,
        }));
    }
    let rewind_body = StageHeader {
        kind: kind::REWIND,
        request_id: REQUEST_ID,
        step: STEP,
    }
    .encode(&reference);
    let mut header_cases = Vec::new();
    for cut in 0..STAGE_HEADER {
        let outcome = header_outcome(&rewind_body[..cut]);
        ensure!(
            outcome == json!({ "refused": StageFrameError::Short(cut).kind() }),
            "a body of {cut} bytes is short"
        );
        header_cases.push(json!({
            "name": format!("cut_to_{cut}_bytes"),
            "body": hex::encode(&rewind_body[..cut]),
            "expect": outcome,
        }));
    }
    for unknown in [0u8, 6, 16, 19, 255] {
        let mut body = rewind_body.clone();
        body[0] = unknown;
        let outcome = header_outcome(&body);
        ensure!(
            outcome == json!({ "refused": "unknown_kind" }),
            "kind {unknown} is unknown"
        );
        header_cases.push(json!({
            "name": format!("kind_{unknown}"),
            "body": hex::encode(&body),
            "expect": outcome,
        }));
    }

    let mut rewind_cases = vec![json!({
        "name": "reference",
        "payload": hex::encode(&reference),
        "expect": rewind_outcome(&reference),
    })];
    let mut add = |name: String, payload: Vec<u8>| -> anyhow::Result<Value> {
        let outcome = rewind_outcome(&payload);
        rewind_cases.push(json!({
            "name": name,
            "payload": hex::encode(&payload),
            "expect": outcome,
        }));
        Ok(outcome)
    };
    for cut in 0..reference.len() {
        let outcome = add(format!("cut_to_{cut}_bytes"), reference[..cut].to_vec())?;
        ensure!(outcome.get("refused").is_some(), "a cut payload is refused");
    }
    let mut trailing = reference.clone();
    trailing.push(0);
    let outcome = add("trailing_byte".into(), trailing)?;
    ensure!(outcome == json!({ "refused": "not_det_cbor" }), "{outcome}");
    for bit in 0..reference.len() * 8 {
        let mut flipped = reference.clone();
        flipped[bit / 8] ^= 1 << (bit % 8);
        let outcome = add(format!("bit_{bit}_flipped"), flipped.clone())?;
        // Outside the number, a refusal; inside, another number when it is
        // still written in its shortest form, else a refusal.
        let in_number = (reference.len() - 2..reference.len()).contains(&(bit / 8));
        let accepted = match outcome.get("ok").and_then(Value::as_u64) {
            Some(positions) => Rewind { positions }.encode() == flipped,
            None => false,
        };
        ensure!(
            accepted == outcome.get("ok").is_some() && (in_number || !accepted),
            "bit {bit}: {outcome}"
        );
    }
    let extra = Cbor::text_map([("positions", Cbor::Uint(3)), ("step", Cbor::Uint(1))]).encode();
    let outcome = add("extra_member".into(), extra)?;
    ensure!(
        outcome == json!({ "refused": "wrong_members" }),
        "{outcome}"
    );
    let text = Cbor::text_map([("positions", Cbor::text("300"))]).encode();
    let outcome = add("positions_as_text".into(), text)?;
    ensure!(
        outcome == json!({ "refused": "wrong_members" }),
        "{outcome}"
    );
    // 300 as a four-byte uint: the same number, not the shortest form.
    let mut longer = reference[..reference.len() - 3].to_vec();
    longer.extend_from_slice(&[0x1a, 0x00, 0x00, 0x01, 0x2c]);
    let outcome = add("positions_not_shortest".into(), longer)?;
    ensure!(outcome == json!({ "refused": "not_det_cbor" }), "{outcome}");
    let outcome = add("over_the_limit".into(), vec![0xa1; MAX_REWIND_PAYLOAD + 1])?;
    ensure!(outcome == json!({ "refused": "too_long" }), "{outcome}");
    let largest = Rewind {
        positions: u64::MAX,
    }
    .encode();
    let outcome = add("largest_positions".into(), largest)?;
    ensure!(outcome == json!({ "ok": u64::MAX }), "{outcome}");

    let file = json!({
        "description": "mesh-stage/1 message bodies (docs/wire.md): `messages` holds one reference body per kind (kind u8, request_id u64 LE, step u32 LE, payload) with the header it reads back as; `headers` holds bodies that must be refused (short of the 13-byte header, a kind this version does not speak); `rewinds` holds REWIND payloads (det-CBOR {positions}) derived from the reference, each with its outcome: {ok: positions} or {refused: too_long | not_det_cbor | wrong_members}.",
        "messages": messages,
        "headers": header_cases,
        "rewinds": rewind_cases,
    });
    Ok(vec![(
        "mesh/stage-messages.json".into(),
        crate::tools::vectors::file::pretty(&file),
    )])
}
