//! The generator of the `mesh-reach/1` vectors (`vectors/mesh/reach.json`,
//! docs/mesh.md "Reachability"): one reference body of every request, every
//! answer code read as the answer to every request, and relay frames; with
//! cases derived mechanically from the references (every truncation (an
//! address cut short may read as a shorter address), a
//! trailing byte, every flipped bit of the kind byte, a flipped bit in an
//! address, an address in another written form, a body over the limit, a
//! frame whose length is over the packet limit), each with the outcome the
//! decoders must give. The generator refuses to write a case the code
//! disagrees with.

use anyhow::ensure;
use mesh_protocol::hex;
use mesh_protocol::reach::{
    MAX_REACH_MESSAGE, MAX_RELAYED_PACKET, ReachAnswer, ReachRequest, parse_relay_frame,
    relay_frame,
};
use serde_json::{Value, json};

use crate::tools::simulate::deterministic_32;
use crate::tools::vectors::file::{VectorFile, pretty};

fn request_outcome(body: &[u8]) -> Value {
    match ReachRequest::decode(body) {
        Ok(request @ (ReachRequest::Observe | ReachRequest::Relay)) => {
            json!({ "ok": { "request": request.name() } })
        }
        Ok(request @ ReachRequest::Introduce { node }) => {
            json!({ "ok": { "request": request.name(), "node": hex::encode(&node) } })
        }
        Ok(request @ ReachRequest::Punch { asker, at }) => json!({
            "ok": { "request": request.name(), "asker": hex::encode(&asker), "at": at.to_string() }
        }),
        Ok(request @ ReachRequest::DialBack { node, at }) => json!({
            "ok": { "request": request.name(), "node": hex::encode(&node), "at": at.to_string() }
        }),
        Err(error) => json!({ "refused": error.kind() }),
    }
}

fn answer_outcome(request: &ReachRequest, body: &[u8]) -> Value {
    match ReachAnswer::decode(request, body) {
        Ok(answer @ ReachAnswer::Observed { reachable, seen }) => json!({
            "ok": { "answer": answer.name(), "reachable": reachable, "seen": seen.to_string() }
        }),
        Ok(answer) => json!({ "ok": { "answer": answer.name() } }),
        Err(error) => json!({ "refused": error.kind() }),
    }
}

fn frame_outcome(frame: &[u8]) -> Value {
    match parse_relay_frame(frame) {
        Ok((peer, packet)) => json!({
            "ok": { "peer": hex::encode(&peer), "packet": hex::encode(packet) }
        }),
        Err(error) => json!({ "refused": error.kind() }),
    }
}

pub fn generate() -> anyhow::Result<Vec<VectorFile>> {
    let node = deterministic_32("mesh-node vectors: a node behind a NAT");
    let asker = deterministic_32("mesh-node vectors: a member asking");
    let references = [
        ("observe", ReachRequest::Observe),
        ("introduce", ReachRequest::Introduce { node }),
        (
            "punch",
            ReachRequest::Punch {
                asker,
                at: "198.51.100.7:40123".parse()?,
            },
        ),
        (
            "punch_ipv6",
            ReachRequest::Punch {
                asker,
                at: "[2001:db8::7]:40123".parse()?,
            },
        ),
        ("relay", ReachRequest::Relay),
        (
            "dial_back",
            ReachRequest::DialBack {
                node,
                at: "198.51.100.9:7001".parse()?,
            },
        ),
    ];
    let mut requests: Vec<Value> = Vec::new();
    let mut request = |name: String, body: &[u8], expect: Value| -> anyhow::Result<()> {
        let got = request_outcome(body);
        ensure!(
            got == expect,
            "request {name}: expected {expect}, the code says {got}"
        );
        requests.push(json!({ "name": name, "body_hex": hex::encode(body), "expect": expect }));
        Ok(())
    };
    for (name, reference) in &references {
        let body = reference.encode();
        request(name.to_string(), &body, request_outcome(&body))?;
        ensure!(
            request_outcome(&body).get("ok").is_some(),
            "the reference {name} reads back"
        );
        for cut in 0..body.len() {
            let got = request_outcome(&body[..cut]);
            // An address cut short may be another address ("…:40123" to
            // "…:4012"): only the kind and the key must be whole.
            ensure!(
                got.get("ok").is_none() || cut > 33,
                "{name} cut to {cut} bytes read"
            );
            request(format!("{name}_truncated_to_{cut}"), &body[..cut], got)?;
        }
        let mut trailing = body.clone();
        trailing.push(b'0');
        let got = request_outcome(&trailing);
        ensure!(got.get("ok").is_none(), "{name} with a trailing byte read");
        request(format!("{name}_trailing_byte"), &trailing, got)?;
        for bit in 0..8 {
            let mut flipped = body.clone();
            flipped[0] ^= 1 << bit;
            let got = request_outcome(&flipped);
            request(format!("{name}_kind_bit_{bit}_flipped"), &flipped, got)?;
        }
    }
    let punch = references[2].1.encode();
    let mut flipped = punch.clone();
    // The address's first digit: '1' becomes '0', a leading zero.
    flipped[33] ^= 0x01;
    request(
        "punch_address_bit_flipped".into(),
        &flipped,
        json!({ "refused": "address" }),
    )?;
    let mut long_form = punch[..33].to_vec();
    long_form.extend_from_slice(b"[2001:db8:0:0:0:0:0:7]:40123");
    request(
        "punch_address_not_in_its_one_form".into(),
        &long_form,
        json!({ "refused": "address" }),
    )?;
    let mut over = punch[..33].to_vec();
    over.resize(MAX_REACH_MESSAGE + 1, b'1');
    request(
        "over_the_limit".into(),
        &over,
        json!({ "refused": "too_long" }),
    )?;

    // Every answer code, and an OBSERVED, as the answer to each request.
    let observed = |reachable: bool| ReachAnswer::Observed {
        reachable,
        seen: "198.51.100.7:40123"
            .parse()
            .unwrap_or(([0, 0, 0, 0], 0).into()),
    };
    let mut bodies: Vec<(String, Vec<u8>)> = (0u8..=6)
        .map(|code| (format!("code_{code}"), vec![code]))
        .collect();
    bodies.push(("observed_reachable".into(), observed(true).encode()));
    bodies.push(("observed_behind_a_nat".into(), observed(false).encode()));
    bodies.push(("busy_trailing_byte".into(), vec![2, 0]));
    bodies.push(("observed_no_address".into(), vec![1, b':']));
    let mut answers: Vec<Value> = Vec::new();
    for (request_name, request) in &references {
        for (name, body) in &bodies {
            answers.push(json!({
                "name": format!("{name}_to_{request_name}"),
                "request_hex": hex::encode(&request.encode()),
                "body_hex": hex::encode(body),
                "expect": answer_outcome(request, body),
            }));
        }
    }

    let peer = deterministic_32("mesh-node vectors: a relayed peer");
    let packet: Vec<u8> = (0..40u8).collect();
    let frame = relay_frame(&peer, &packet)?;
    let fullest = relay_frame(&peer, &[0x5a; MAX_RELAYED_PACKET])?;
    let mut over = frame[..32].to_vec();
    over.extend_from_slice(&u16::try_from(MAX_RELAYED_PACKET + 1)?.to_le_bytes());
    over.resize(34 + MAX_RELAYED_PACKET + 1, 0);
    let mut trailing = frame.clone();
    trailing.push(0);
    let mut frames: Vec<Value> = Vec::new();
    for (name, bytes, ok) in [
        ("reference", frame.clone(), true),
        ("the_longest_packet", fullest, true),
        ("empty_packet", relay_frame(&peer, &[])?, true),
        ("length_over_the_limit", over, false),
        ("truncated_head", frame[..33].to_vec(), false),
        ("truncated_packet", frame[..frame.len() - 1].to_vec(), false),
        ("trailing_byte", trailing, false),
    ] {
        let expect = frame_outcome(&bytes);
        ensure!(
            expect.get("ok").is_some() == ok,
            "relay frame {name}: {expect}"
        );
        frames.push(json!({ "name": name, "frame_hex": hex::encode(&bytes), "expect": expect }));
    }

    let file = json!({
        "description": "mesh-reach/1 bodies (docs/mesh.md, Reachability): requests, answers read as the answer to a request, relay frames; each with what the decoders must give",
        "limits": {
            "max_reach_message": MAX_REACH_MESSAGE,
            "max_relayed_packet": MAX_RELAYED_PACKET,
        },
        "requests": requests,
        "answers": answers,
        "relay_frames": frames,
    });
    Ok(vec![("mesh/reach.json".into(), pretty(&file))])
}
