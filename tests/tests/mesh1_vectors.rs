//! The committed `mesh/1` vectors hold: the signed core is canonical and the
//! envelope reproduces from it with the published key; every receipt,
//! plain bundle and grant case verifies or is refused as it says.

use std::path::PathBuf;

use mesh_protocol::SigningKey;
use mesh_protocol::cbor::Cbor;
use mesh_protocol::grant::{GrantGate, Presentation};
use mesh_protocol::hex;
use mesh_protocol::mesh1::{SealedReceipt, ServeRequest, sign_core_unchecked};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../vectors/mesh1")
}

fn hex_file(name: &str) -> Vec<u8> {
    hex::decode(std::fs::read_to_string(dir().join(name)).unwrap().trim()).unwrap()
}

fn json(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(dir().join(name)).unwrap()).unwrap()
}

#[test]
fn the_reference_envelope_reproduces_from_its_core_and_key() {
    let meta = json("meta.json");
    let seed = hex::decode_array::<32>(meta["steward"]["seed_hex"].as_str().unwrap()).unwrap();
    let core = hex_file("reference/signed_core.hex");
    assert_eq!(
        Cbor::decode(&core).unwrap().encode(),
        core,
        "the core is canonical CBOR"
    );
    let envelope = hex_file("reference/envelope.hex");
    assert_eq!(
        sign_core_unchecked(core.clone(), &SigningKey::from_bytes(&seed)),
        envelope
    );
    let sealed = SealedReceipt::verify(&envelope).unwrap();
    assert_eq!(sealed.core, core);
    assert_eq!(hex::encode(&sealed.envelope_id()), meta["envelope_id"]);
    assert_eq!(sealed.receipt.steward, meta["steward"]["did"]);
    let next = SealedReceipt::verify(&hex_file("reference/next_envelope.hex")).unwrap();
    next.check_follows(&sealed).unwrap();
    assert!(sealed.check_follows(&next).is_err());
}

#[test]
fn receipt_cases_verify_as_labelled() {
    for case in json("receipts.json").as_array().unwrap() {
        let bytes = hex::decode(case["envelope_hex"].as_str().unwrap()).unwrap();
        assert_eq!(
            SealedReceipt::verify(&bytes).is_ok(),
            case["valid"] == true,
            "{}",
            case["name"]
        );
    }
}

/// Each bundle of a serve one node ran whole verifies, fails or is
/// unreadable as it says (`docs/bundle.md`, form (d)).
#[test]
fn plain_bundle_cases_verify_as_labelled() {
    let cases = json("plain-bundles.json");
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 9);
    for case in cases {
        let got = match mesh_protocol::verify::verify_document(&case["bundle"]) {
            Err(_) => "unreadable",
            Ok(report) if report.success() => "ok",
            Ok(_) => "fails",
        };
        assert_eq!(got, case["verify"], "{}", case["name"]);
    }
}

#[test]
fn grant_cases_are_decided_as_labelled() {
    let grants = json("grants.json");
    let request = ServeRequest::from_cbor(
        &Cbor::decode(&hex::decode(grants["request_cbor_hex"].as_str().unwrap()).unwrap()).unwrap(),
    )
    .unwrap();
    for case in grants["cases"].as_array().unwrap() {
        let mut gate = GrantGate::new(case["steward"].as_str().unwrap());
        for prior in case["prior_presentations_hex"].as_array().unwrap() {
            let p = Presentation::decode(&hex::decode(prior.as_str().unwrap()).unwrap()).unwrap();
            gate.decide(&p, &request, None, case["now_ms"].as_u64().unwrap())
                .unwrap();
        }
        let outcome = match Presentation::decode(
            &hex::decode(case["presentation_hex"].as_str().unwrap()).unwrap(),
        ) {
            Err(_) => "malformed".to_string(),
            Ok(p) => match gate.decide(&p, &request, None, case["now_ms"].as_u64().unwrap()) {
                Ok(_) => "authorised".into(),
                Err(refusal) => refusal.label().into(),
            },
        };
        assert_eq!(
            outcome,
            case["expect"].as_str().unwrap(),
            "{}",
            case["name"]
        );
    }
    let total: u64 = grants["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["budget_uj"].as_u64().unwrap())
        .sum();
    let root = mesh_protocol::grant::SignedGrant::decode(
        &hex::decode(grants["root_hex"].as_str().unwrap()).unwrap(),
    )
    .unwrap();
    assert!(
        total <= root.grant.budget_uj,
        "shards never sum above their parent"
    );
}
