//! The committed vectors are exactly what the generator writes, and every
//! case in them verifies as it says.

use std::path::PathBuf;

use mesh_protocol::block::StageBlock;
use mesh_protocol::capsule::SealedRecord;
use mesh_protocol::verify::verify_document;
use proptest::prelude::*;
use serde_json::Value;

fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../vectors")
}

#[test]
fn regenerating_leaves_no_diff() {
    let differing = mesh_node::tools::vectors::write_or_check(&vectors_dir(), true).unwrap();
    assert!(
        differing.is_empty(),
        "run `mesh-node vectors write`; these differ: {differing:?}"
    );
}

fn load(relative: &str) -> Value {
    serde_json::from_slice(&std::fs::read(vectors_dir().join(relative)).unwrap()).unwrap()
}

#[test]
fn committed_cases_verify_as_labelled() {
    for case in load("split-stage/blocks.json").as_array().unwrap() {
        assert_eq!(
            StageBlock::from_value(&case["block"]).is_ok(),
            case["valid"] == true,
            "{}",
            case["name"]
        );
    }
    for case in load("split-stage/records.json").as_array().unwrap() {
        assert_eq!(
            SealedRecord::verify(case["record"].clone()).is_ok(),
            case["valid"] == true,
            "{}",
            case["name"]
        );
    }
    let folds = load("split-stage/fold.json");
    let folds = folds.as_array().unwrap();
    for case in folds {
        if let Some(base) = case["derived_from"].as_str() {
            let base = folds.iter().find(|c| c["name"] == base).unwrap();
            assert_ne!(
                case["expect"]["digest"], base["expect"]["digest"],
                "{}",
                case["name"]
            );
        }
    }
    for case in load("split-stage/hop-cases.json").as_array().unwrap() {
        let report = verify_document(case).unwrap();
        assert_eq!(
            report.hop.unwrap().to_expect_value(),
            case["expect"],
            "{}",
            case["name"]
        );
    }
}

/// Replace one value somewhere in a bundle: the verifier answers with a
/// report or a typed error, never a panic, and never reports success for a
/// changed signed member.
fn mutate(value: &mut Value, path: &[usize], replacement: &Value) -> bool {
    let Some((first, rest)) = path.split_first() else {
        *value = replacement.clone();
        return true;
    };
    match value {
        Value::Object(map) if !map.is_empty() => {
            let key = map.keys().nth(first % map.len()).unwrap().clone();
            mutate(map.get_mut(&key).unwrap(), rest, replacement)
        }
        Value::Array(items) if !items.is_empty() => {
            let len = items.len();
            mutate(&mut items[first % len], rest, replacement)
        }
        _ => {
            *value = replacement.clone();
            true
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn mutated_bundles_never_panic(
        path in proptest::collection::vec(any::<usize>(), 1..8),
        replacement in prop_oneof![
            Just(Value::Null), Just(serde_json::json!(0)), Just(serde_json::json!("x")),
            Just(serde_json::json!(u64::MAX)), Just(serde_json::json!({})), Just(serde_json::json!([])),
            Just(serde_json::json!(-1)), Just(serde_json::json!(true)),
        ],
    ) {
        let mut bundle = load("split-stage/bundles/direct_all_agree.json");
        let original = bundle.clone();
        mutate(&mut bundle, &path, &replacement);
        if let Ok(report) = verify_document(&bundle)
            && bundle != original
            && report.success()
        {
            // Only members outside every signature may change unnoticed:
            // the bundle's own list of stage-exchange records is not signed.
            prop_assert!(
                bundle["main_record"] == original["main_record"]
                    && bundle["split_stage_records"] == original["split_stage_records"]
            );
        }
    }

    /// A plain bundle (form (d)) changed anywhere is never verified, but
    /// for the previous envelope left out (a link a requester may drop):
    /// its other members are the marker and the signed envelope.
    #[test]
    fn mutated_plain_bundles_never_panic_or_pass(
        case in 0usize..2,
        path in proptest::collection::vec(any::<usize>(), 1..4),
        replacement in prop_oneof![
            Just(Value::Null), Just(serde_json::json!(0)), Just(serde_json::json!("x")),
            Just(serde_json::json!(u64::MAX)), Just(serde_json::json!({})), Just(serde_json::json!([])),
            Just(serde_json::json!("d2")), Just(serde_json::json!(true)),
        ],
    ) {
        let mut bundle = load("mesh1/plain-bundles.json")["cases"][case]["bundle"].clone();
        let original = bundle.clone();
        mutate(&mut bundle, &path, &replacement);
        if bundle != original
            && let Ok(report) = verify_document(&bundle)
        {
            prop_assert!(
                !report.success()
                    || (bundle["mesh1_envelope"] == original["mesh1_envelope"]
                        && bundle["mesh1_bundle"] == 1
                        && bundle["mesh1_prev_envelope"].is_null()),
                "{bundle}"
            );
        }
    }
}
