//! The committed advert vectors hold: the reference advert reproduces from
//! its published key and fields, and every case verifies or is refused as
//! it says; the member-table sequence gives each step's outcome.

use std::path::PathBuf;

use mesh_protocol::SigningKey;
use mesh_protocol::advert::{Advert, AdvertModel, AdvertRefusal, Members, Offered};
use mesh_protocol::hex;
use mesh_protocol::identity::{parse_did_key, parse_peer_id};
use serde_json::Value;

fn vectors() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../vectors/mesh/adverts.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn the_reference_advert_reproduces_from_its_key_and_fields() {
    let v = vectors();
    let seed = hex::decode_array::<32>(v["node"]["seed_hex"].as_str().unwrap()).unwrap();
    let key = SigningKey::from_bytes(&seed);
    let did = parse_did_key(v["node"]["did"].as_str().unwrap()).unwrap();
    assert_eq!(did, key.verifying_key().to_bytes());
    assert_eq!(
        parse_peer_id(v["node"]["peer_id"].as_str().unwrap()),
        Some(did)
    );
    let r = &v["reference"];
    let advert = Advert {
        node_id: did,
        seq: r["seq"].as_u64().unwrap(),
        issued_ms: r["issued_ms"].as_u64().unwrap(),
        ttl_ms: r["ttl_ms"].as_u64().unwrap(),
        quic: r["quic"].as_str().unwrap().into(),
        device: r["device"].as_str().unwrap().into(),
        memory_bytes: r["memory_bytes"].as_u64().unwrap(),
        load: r["load"].as_u64().unwrap() as u32,
        via: None,
        rtts: Vec::new(),
        models: r["models"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| AdvertModel {
                package_id: hex::decode_array(m["package_id"].as_str().unwrap()).unwrap(),
                layers: m["layers"].as_u64().unwrap() as u32,
                decode_us_per_layer: m["decode_us_per_layer"].as_u64().unwrap(),
                precision: m["precision"].as_str().map(str::to_string),
                name: m["name"].as_str().map(str::to_string),
            })
            .collect(),
    };
    // Ed25519 signatures are deterministic: the same key and content give
    // the same bytes.
    assert_eq!(
        hex::encode(&advert.sign(&key)),
        r["advert_hex"].as_str().unwrap()
    );
}

#[test]
fn every_case_verifies_or_is_refused_as_labelled() {
    let v = vectors();
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() >= 15);
    for case in cases {
        let bytes = hex::decode(case["advert_hex"].as_str().unwrap()).unwrap();
        let from = parse_did_key(case["from_peer"].as_str().unwrap()).unwrap();
        let got = match Advert::verify(&bytes, &from, case["now_ms"].as_u64().unwrap()) {
            Ok(_) => "ok".to_string(),
            Err(error) => AdvertRefusal::Invalid(error).kind().to_string(),
        };
        assert_eq!(got, case["expect"].as_str().unwrap(), "{}", case["name"]);
    }
}

#[test]
fn the_table_sequence_gives_each_outcome() {
    let v = vectors();
    let node = parse_did_key(v["node"]["did"].as_str().unwrap()).unwrap();
    let mut table = Members::default();
    for step in v["table_sequence"].as_array().unwrap() {
        let bytes = hex::decode(step["advert_hex"].as_str().unwrap()).unwrap();
        let got = match table.offer(&bytes, &node, step["now_ms"].as_u64().unwrap()) {
            Ok(Offered::Joined) => "joined".to_string(),
            Ok(Offered::Updated) => "updated".to_string(),
            Err(refusal) => refusal.kind().to_string(),
        };
        assert_eq!(got, step["expect"].as_str().unwrap(), "{}", step["name"]);
    }
}
