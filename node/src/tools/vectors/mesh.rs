//! The generator of the node advert vectors (`vectors/mesh/adverts.json`,
//! docs/mesh.md): a reference advert signed with a published key, and
//! cases derived mechanically from it (every flipped bit of a sample of
//! positions, truncation, a trailing byte, another signing key, another
//! sending peer, expiry, a future issue time, limits), each with the
//! outcome `Advert::verify` must give, plus a member-table sequence
//! (replay, rate limit). The generator refuses to write a case the code
//! disagrees with.

use anyhow::ensure;
use mesh_protocol::SigningKey;
use mesh_protocol::advert::{
    Advert, AdvertModel, AdvertRefusal, AdvertRtt, AdvertVia, MAX_ADVERT_SKEW_MS,
    MAX_ADVERT_TTL_MS, Members,
};
use mesh_protocol::hex;
use mesh_protocol::identity::{did_key, peer_id};
use serde_json::{Value, json};

use crate::tools::simulate::deterministic_32;
use crate::tools::vectors::file::VectorFile;

/// 2026-09-30T03:38:00.000Z
const NOW_MS: u64 = 1_790_739_480_000;

fn key(label: &str) -> SigningKey {
    SigningKey::from_bytes(&deterministic_32(label))
}

fn reference(node: &SigningKey) -> Advert {
    Advert {
        node_id: node.verifying_key().to_bytes(),
        seq: NOW_MS,
        issued_ms: NOW_MS,
        ttl_ms: 5_000,
        quic: "192.0.2.10:7420".into(),
        device: "cpu".into(),
        memory_bytes: 8 << 30,
        load: 1,
        via: None,
        rtts: Vec::new(),
        models: vec![AdvertModel {
            package_id: deterministic_32("mesh-node vectors: a package id"),
            layers: 30,
            decode_us_per_layer: 412,
            precision: Some("q4_1 (f32+q4_1+q8_0); products q8/f32; device cpu; wire f32".into()),
            name: Some("SmolLM2-135M-Instruct.Q4_1".into()),
        }],
    }
}

/// The outcome as the vectors name it: `ok` or the refusal's kind.
fn outcome(result: Result<Advert, mesh_protocol::advert::AdvertError>) -> String {
    match result {
        Ok(_) => "ok".into(),
        Err(error) => AdvertRefusal::Invalid(error).kind().into(),
    }
}

pub fn generate() -> anyhow::Result<Vec<VectorFile>> {
    let node = key("mesh-node vectors: advertising node key");
    let other = key("mesh-node vectors: another key");
    let me = node.verifying_key().to_bytes();
    let them = other.verifying_key().to_bytes();
    let advert = reference(&node);
    let bytes = advert.sign(&node);
    let mut cases: Vec<Value> = Vec::new();
    let mut case = |name: String, bytes: &[u8], from: &[u8; 32], now: u64, expect: &str| {
        let got = outcome(Advert::verify(bytes, from, now));
        ensure!(
            got == expect,
            "case {name}: expected {expect}, the code says {got}"
        );
        cases.push(json!({
            "name": name,
            "advert_hex": hex::encode(bytes),
            "from_peer": did_key(from),
            "now_ms": now,
            "expect": expect,
        }));
        Ok(())
    };
    case("reference".into(), &bytes, &me, NOW_MS, "ok")?;
    // Bits flipped at a spread of positions: envelope head, content,
    // signature. Each must be refused (which refusal depends on where).
    for position in [
        0,
        1,
        5,
        20,
        40,
        bytes.len() / 2,
        bytes.len() - 70,
        bytes.len() - 1,
    ] {
        let mut flipped = bytes.clone();
        flipped[position] ^= 0x01;
        let got = outcome(Advert::verify(&flipped, &me, NOW_MS));
        ensure!(got != "ok", "a flipped bit at {position} verified");
        case(
            format!("bit_flipped_at_{position}"),
            &flipped,
            &me,
            NOW_MS,
            &got,
        )?;
    }
    let truncated = &bytes[..bytes.len() - 1];
    case("truncated".into(), truncated, &me, NOW_MS, "malformed")?;
    let mut trailing = bytes.clone();
    trailing.push(0x00);
    case("trailing_byte".into(), &trailing, &me, NOW_MS, "malformed")?;
    case(
        "signed_by_another_key".into(),
        &advert.sign(&other),
        &me,
        NOW_MS,
        "bad_signature",
    )?;
    case(
        "sent_by_another_peer".into(),
        &bytes,
        &them,
        NOW_MS,
        "key_mismatch",
    )?;
    case("expired".into(), &bytes, &me, advert.expires_ms(), "stale")?;
    case(
        "last_valid_moment".into(),
        &bytes,
        &me,
        advert.expires_ms() - 1,
        "ok",
    )?;
    case(
        "issued_in_the_future".into(),
        &bytes,
        &me,
        NOW_MS - MAX_ADVERT_SKEW_MS - 1,
        "from_the_future",
    )?;
    let mut long = advert.clone();
    long.ttl_ms = MAX_ADVERT_TTL_MS + 1;
    case(
        "ttl_over_limit".into(),
        &long.sign(&node),
        &me,
        NOW_MS,
        "malformed",
    )?;
    let mut twice = advert.clone();
    twice.models.push(twice.models[0].clone());
    case(
        "package_named_twice".into(),
        &twice.sign(&node),
        &me,
        NOW_MS,
        "malformed",
    )?;
    let mut huge = advert.clone();
    huge.device = "x".repeat(mesh_protocol::advert::MAX_ADVERT_TEXT + 1);
    huge.models = (0..8u8)
        .map(|i| AdvertModel {
            package_id: [i; 32],
            layers: 1,
            decode_us_per_layer: 1,
            precision: None,
            name: None,
        })
        .collect();
    huge.quic = format!("[{}]:65535", "1:2:3:4:5:6:7:8");
    let huge_bytes = huge.sign(&node);
    let expect = if huge_bytes.len() > mesh_protocol::advert::MAX_ADVERT_BYTES {
        "oversized"
    } else {
        "malformed"
    };
    case(
        "device_text_over_limit".into(),
        &huge_bytes,
        &me,
        NOW_MS,
        expect,
    )?;

    let mut wordy = advert.clone();
    wordy.models[0].precision = Some("q".repeat(mesh_protocol::advert::MAX_ADVERT_PRECISION + 1));
    case(
        "precision_over_limit".into(),
        &wordy.sign(&node),
        &me,
        NOW_MS,
        "malformed",
    )?;
    let mut named = advert.clone();
    named.models[0].name = Some("n".repeat(mesh_protocol::advert::MAX_ADVERT_TEXT + 1));
    case(
        "name_over_limit".into(),
        &named.sign(&node),
        &me,
        NOW_MS,
        "malformed",
    )?;
    // A node behind a NAT names the member it is reached through; it may
    // not name itself.
    let mut behind = advert.clone();
    behind.quic = "198.51.100.7:40123".into();
    behind.via = Some(AdvertVia {
        node_id: them,
        quic: "192.0.2.1:7420".into(),
        relayed: false,
    });
    case(
        "behind_a_nat".into(),
        &behind.sign(&node),
        &me,
        NOW_MS,
        "ok",
    )?;
    let mut symmetric = behind.clone();
    if let Some(via) = symmetric.via.as_mut() {
        via.relayed = true;
    }
    case(
        "behind_a_symmetric_nat".into(),
        &symmetric.sign(&node),
        &me,
        NOW_MS,
        "ok",
    )?;
    let mut itself = behind.clone();
    itself.via = Some(AdvertVia {
        node_id: me,
        quic: "192.0.2.1:7420".into(),
        relayed: false,
    });
    case(
        "via_itself".into(),
        &itself.sign(&node),
        &me,
        NOW_MS,
        "malformed",
    )?;
    // Round trips to other members: in node id order, each once.
    let mut measured = advert.clone();
    measured.rtts = vec![
        AdvertRtt {
            node_id: them,
            rtt_us: 41_250,
        },
        AdvertRtt {
            node_id: [0xee; 32],
            rtt_us: 830,
        },
    ];
    measured.rtts.sort_by_key(|r| r.node_id);
    case(
        "with_round_trips".into(),
        &measured.sign(&node),
        &me,
        NOW_MS,
        "ok",
    )?;
    let mut unordered = measured.clone();
    unordered.rtts.reverse();
    case(
        "round_trips_out_of_order".into(),
        &unordered.sign(&node),
        &me,
        NOW_MS,
        "malformed",
    )?;
    let mut to_itself = measured.clone();
    to_itself.rtts = vec![AdvertRtt {
        node_id: me,
        rtt_us: 1,
    }];
    case(
        "round_trip_to_itself".into(),
        &to_itself.sign(&node),
        &me,
        NOW_MS,
        "malformed",
    )?;
    // The most an advert may say (eight models, each naming the longest
    // precision, the longest address to be reached through, and the most
    // round trips) fits the size limit.
    let mut fullest = advert.clone();
    fullest.models = (0..8u8)
        .map(|i| AdvertModel {
            package_id: [i; 32],
            layers: 1,
            decode_us_per_layer: 1,
            precision: Some("p".repeat(mesh_protocol::advert::MAX_ADVERT_PRECISION)),
            name: Some("n".repeat(mesh_protocol::advert::MAX_ADVERT_TEXT)),
        })
        .collect();
    fullest.quic = format!("[{}]:65535", "1:2:3:4:5:6:7:8");
    fullest.device = "d".repeat(mesh_protocol::advert::MAX_ADVERT_TEXT);
    fullest.via = Some(AdvertVia {
        node_id: them,
        quic: format!("[{}]:65535", "1:2:3:4:5:6:7:8"),
        relayed: true,
    });
    fullest.rtts = (0..mesh_protocol::advert::MAX_ADVERT_RTTS as u8)
        .map(|i| AdvertRtt {
            node_id: [0x80 + i; 32],
            rtt_us: mesh_protocol::advert::MAX_ADVERT_RTT_US,
        })
        .collect();
    case(
        "the_most_an_advert_says".into(),
        &fullest.sign(&node),
        &me,
        NOW_MS,
        "ok",
    )?;

    // The member table: each offer in order, and what it must give.
    let mut table = Members::default();
    let mut sequence = Vec::new();
    let later = |seq: u64, at: u64| {
        let mut a = reference(&node);
        a.seq = seq;
        a.issued_ms = at;
        a.sign(&node)
    };
    for (name, offer, at, expect) in [
        ("first", bytes.clone(), NOW_MS, "joined"),
        ("same_again", bytes.clone(), NOW_MS + 1_000, "replayed"),
        (
            "older_seq",
            later(NOW_MS - 1, NOW_MS),
            NOW_MS + 1_000,
            "replayed",
        ),
        (
            "too_soon",
            later(NOW_MS + 100, NOW_MS + 100),
            NOW_MS + 100,
            "rate_limited",
        ),
        (
            "next",
            later(NOW_MS + 1_000, NOW_MS + 1_000),
            NOW_MS + 1_000,
            "updated",
        ),
    ] {
        let got = match table.offer(&offer, &me, at) {
            Ok(mesh_protocol::advert::Offered::Joined) => "joined".to_string(),
            Ok(mesh_protocol::advert::Offered::Updated) => "updated".to_string(),
            Err(refusal) => refusal.kind().to_string(),
        };
        ensure!(
            got == expect,
            "table step {name}: expected {expect}, got {got}"
        );
        sequence.push(json!({
            "name": name,
            "advert_hex": hex::encode(&offer),
            "now_ms": at,
            "expect": expect,
        }));
    }

    let document = json!({
        "about": "mesh-advert/1 node adverts (docs/mesh.md): each case is Advert::verify(advert, from_peer, now_ms); table_sequence offers each advert in order to one member table, all from the advertising node",
        "node": {
            "seed_hex": hex::encode(&node.to_bytes()),
            "did": did_key(&me),
            "peer_id": peer_id(&me),
        },
        "reference": {
            "advert_hex": hex::encode(&bytes),
            "node_id": did_key(&advert.node_id),
            "seq": advert.seq,
            "issued_ms": advert.issued_ms,
            "ttl_ms": advert.ttl_ms,
            "quic": advert.quic,
            "device": advert.device,
            "memory_bytes": advert.memory_bytes,
            "load": advert.load,
            "models": advert.models.iter().map(|m| {
                let mut model = json!({
                    "package_id": hex::encode(&m.package_id),
                    "layers": m.layers,
                    "decode_us_per_layer": m.decode_us_per_layer,
                });
                if let (Some(precision), Some(map)) = (&m.precision, model.as_object_mut()) {
                    map.insert("precision".into(), json!(precision));
                }
                if let (Some(name), Some(map)) = (&m.name, model.as_object_mut()) {
                    map.insert("name".into(), json!(name));
                }
                model
            }).collect::<Vec<_>>(),
        },
        "cases": cases,
        "table_sequence": sequence,
    });
    Ok(vec![(
        "mesh/adverts.json".into(),
        crate::tools::vectors::file::pretty(&document),
    )])
}
