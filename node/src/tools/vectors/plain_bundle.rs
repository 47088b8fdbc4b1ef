//! The vectors of the bundle of a serve one node ran whole
//! (`vectors/mesh1/plain-bundles.json`, `docs/bundle.md` form (d)): plain
//! `mesh/1` receipts of the reference steward's chain, each bundle with
//! what `verify` must make of it. The negative cases are derived from the
//! positive ones by one change each (a flipped bit, a member added or
//! removed, another previous envelope, a split's receipt); the generator
//! refuses to write a case the verifier disagrees with.

use anyhow::ensure;
use mesh_protocol::SigningKey;
use mesh_protocol::bundle::{MESH1_BUNDLE_MEMBER, Mesh1Bundle};
use mesh_protocol::mesh1::{MeshReceipt, SealedReceipt};
use mesh_protocol::replay::LOCAL_BACKEND;
use mesh_protocol::verify::verify_document;
use serde_json::{Value, json};

use crate::tools::simulate::deterministic_32;

/// What `verify` must make of a case.
#[derive(Clone, Copy)]
enum Expect {
    /// Every check passes (exit 0).
    Ok,
    /// Understood, and a check fails (exit 1).
    Fails,
    /// Not a bundle of this form (exit 2).
    Unreadable,
}

impl Expect {
    fn as_str(self) -> &'static str {
        match self {
            Expect::Ok => "ok",
            Expect::Fails => "fails",
            Expect::Unreadable => "unreadable",
        }
    }
}

/// The cases, given the reference chain's first receipt (a split's) and
/// its second (plain), both sealed by `steward`.
pub fn cases(
    steward: &SigningKey,
    split: &SealedReceipt,
    before: &SealedReceipt,
) -> anyhow::Result<Value> {
    let seal = |sequence: u64, prev: &SealedReceipt, route: &str, nonce: &str| {
        MeshReceipt {
            backend: LOCAL_BACKEND.into(),
            route: route.into(),
            sequence,
            prev: Some(prev.envelope_id()),
            split: None,
            resumed: None,
            deterministic: Some(true),
            nonce: deterministic_32(nonce)[..16].try_into().unwrap_or([0; 16]),
            ..before.receipt.clone()
        }
        .seal(steward)
    };
    let alone = seal(
        2,
        before,
        "one node holds every layer",
        "mesh-node vectors: plain receipt nonce 2",
    )?;
    let names_a_table = seal(
        3,
        &alone,
        &format!("cheapest-sufficient; table {}", "0".repeat(64)),
        "mesh-node vectors: plain receipt nonce 3",
    )?;
    let bundle = |sealed: &SealedReceipt, prev: Option<&SealedReceipt>| {
        Mesh1Bundle::to_value(&sealed.envelope, prev.map(|p| p.envelope.as_slice()), None)
    };
    let mut flipped = alone.envelope.clone();
    if let Some(last) = flipped.last_mut() {
        *last ^= 1;
    }
    let mut with_member = bundle(&alone, None);
    with_member["stewards"] = json!([]);
    let mut without_envelope = bundle(&alone, None);
    if let Value::Object(map) = &mut without_envelope {
        map.remove("mesh1_envelope");
    }
    let mut marker_two = bundle(&alone, None);
    marker_two[MESH1_BUNDLE_MEMBER] = json!(2);
    let written = [
        ("alone", bundle(&alone, None), Expect::Ok),
        (
            "alone_after_its_previous",
            bundle(&alone, Some(before)),
            Expect::Ok,
        ),
        (
            "previous_is_not_the_one_before",
            bundle(&alone, Some(split)),
            Expect::Fails,
        ),
        ("a_splits_receipt", bundle(split, None), Expect::Fails),
        (
            "envelope_bit_flipped",
            Mesh1Bundle::to_value(&flipped, None, None),
            Expect::Fails,
        ),
        (
            "route_table_named_but_absent",
            bundle(&names_a_table, Some(&alone)),
            Expect::Fails,
        ),
        ("member_added", with_member, Expect::Unreadable),
        ("envelope_missing", without_envelope, Expect::Unreadable),
        ("marker_not_1", marker_two, Expect::Unreadable),
    ];
    let mut cases = Vec::new();
    for (name, bundle, expect) in written {
        let got = match verify_document(&bundle) {
            Err(_) => Expect::Unreadable,
            Ok(report) if report.success() => Expect::Ok,
            Ok(_) => Expect::Fails,
        };
        ensure!(
            got.as_str() == expect.as_str(),
            "plain bundle case {name}: verify gives {}, not {}",
            got.as_str(),
            expect.as_str()
        );
        cases.push(json!({ "name": name, "bundle": bundle, "verify": expect.as_str() }));
    }
    Ok(json!({
        "description": "Bundles of serves one node ran whole (docs/bundle.md, form (d)): `verify` gives `ok` (exit 0), `fails` (exit 1) or `unreadable` (exit 2). Receipts sealed by the reference steward (meta.json).",
        "cases": cases,
    }))
}
