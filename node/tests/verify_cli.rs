//! `mesh-node verify` as a requester runs it: one file in, a table or one
//! JSON object out, and an exit status that means something.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

mod common;

fn mesh_node() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mesh-node"))
}

fn shared_vectors() -> Option<PathBuf> {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/vectors/mesh-llm-capsules");
    if dir.is_dir() {
        return Some(dir);
    }
    common::skipped(
        format!(
            "published vectors not found at {}: test SKIPPED",
            dir.display()
        ),
        "MESH_REQUIRE_SHARED",
    )
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn verify_json(path: &Path) -> (i32, Value) {
    let output = mesh_node()
        .arg("verify")
        .arg("--json")
        .arg(path)
        .output()
        .unwrap();
    let code = output.status.code().expect("exited, not killed");
    let value: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (code, value)
}

fn expect_members(value: &Value) -> Value {
    serde_json::json!({
        "cells": value["cells"], "lanes": value["lanes"],
        "handoffs_agree": value["handoffs_agree"], "terminal_state": value["terminal_state"],
    })
}

#[test]
fn every_published_hop_case_prints_its_expected_object() {
    let Some(dir) = shared_vectors() else { return };
    let cases: Value =
        serde_json::from_slice(&std::fs::read(dir.join("split-stage/hop-cases.json")).unwrap())
            .unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 16);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let file = scratch.path().join(format!("{name}.json"));
        let only_inputs = serde_json::json!({ "own": case["own"], "receipt": case["receipt"], "carried": case["carried"] });
        std::fs::write(&file, serde_json::to_vec_pretty(&only_inputs).unwrap()).unwrap();
        let (code, value) = verify_json(&file);
        assert_eq!(expect_members(&value), case["expect"], "{name}");
        let cells_ok = case["expect"]["cells"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| matches!(c["state"].as_str(), Some("ok" | "coordinator_slice")));
        let expected_code = if case["expect"]["handoffs_agree"] == true && cells_ok {
            0
        } else {
            1
        };
        assert_eq!(code, expected_code, "{name}");
    }
}

#[test]
fn published_rust_bundles_verify() {
    let Some(dir) = shared_vectors() else { return };
    let (code, value) = verify_json(&dir.join("split-stage/rust-split-bundle.json"));
    assert_eq!(code, 0, "{value:#}");
    assert_eq!(value["handoffs_agree"], true);
    assert_eq!(value["form"], "record_push_bundle");
    let (code, value) = verify_json(&dir.join("record_push_bundle_rust.json"));
    assert_eq!(code, 0, "{value:#}");
    assert!(
        value.get("handoffs_agree").is_none(),
        "a plain bundle has no hops"
    );
}

#[test]
fn own_bundles_exit_by_their_outcome() {
    let bundles = repo().join("vectors/split-stage/bundles");
    for (name, code) in [
        ("relayed_all_agree", 0),
        ("direct_all_agree", 0),
        ("five_stage_direct", 0),
        ("timed_out_relayed", 0),
        ("forward_byte_altered_in_flight", 1),
        ("forward_frames_reordered", 1),
        ("stage_silent", 1),
        ("two_records_one_stage", 1),
        ("stage_loaded_other_slice", 1),
        ("stewards_listed", 0),
        ("stewards_duplicate_index", 1),
        ("stewards_first_not_coordinator", 1),
        ("stewards_unknown_index", 1),
        ("stewards_missing_stage", 1),
        ("stewards_other_node", 1),
    ] {
        let (actual, value) = verify_json(&bundles.join(format!("{name}.json")));
        assert_eq!(actual, code, "{name}: {value:#}");
        assert_eq!(value["form"], "mesh_bundle");
    }
}

#[test]
fn human_output_shows_the_table_and_terminal_state() {
    let output = mesh_node()
        .arg("verify")
        .arg(repo().join("vectors/split-stage/bundles/forward_byte_altered_in_flight.json"))
        .output()
        .unwrap();
    let text = String::from_utf8(output.stdout).unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(text.contains("1 → 2          ✕ break"), "{text}");
    assert!(text.contains("Hand-offs agree: NO"), "{text}");
    assert!(text.contains("terminal state: completed"), "{text}");
    assert!(text.contains("COSE signature verifies"), "{text}");
}

#[test]
fn unreadable_input_exits_2_naming_file_and_position() {
    let scratch = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u8], &str); 5] = [
        ("truncated.json", b"{\"own\": {", "line 1, column 9"),
        ("trailing.json", b"{} {}", "line 1, column 4"),
        (
            "duplicate.json",
            b"{\"own\": 1, \"own\": 2}",
            "duplicate member `own`",
        ),
        ("unknown.json", b"[1, 2]", "not a recognised document"),
        (
            "bundle_shape.json",
            b"{\"mesh_bundle\": 1, \"main_record\": {}}",
            "/split_stage_records",
        ),
    ];
    for (name, bytes, needle) in cases {
        let file = scratch.path().join(name);
        std::fs::write(&file, bytes).unwrap();
        let output = mesh_node().arg("verify").arg(&file).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{name}: {stderr}");
        assert!(
            stderr.contains(name) && stderr.contains(needle),
            "{name}: {stderr}"
        );
    }
    let output = mesh_node()
        .arg("verify")
        .arg(scratch.path().join("absent.json"))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn garbage_never_panics() {
    let scratch = tempfile::tempdir().unwrap();
    let bundle =
        std::fs::read(repo().join("vectors/split-stage/bundles/direct_all_agree.json")).unwrap();
    for cut in [1, 100, 1000, bundle.len() / 2, bundle.len() - 2] {
        let file = scratch.path().join(format!("cut{cut}.json"));
        std::fs::write(&file, &bundle[..cut]).unwrap();
        let status = mesh_node()
            .arg("verify")
            .arg(&file)
            .output()
            .unwrap()
            .status;
        assert_eq!(status.code(), Some(2), "cut at {cut}");
    }
}

#[test]
fn mesh1_envelopes_verify_raw_or_hex_with_their_chain_link() {
    let reference = repo().join("vectors/mesh1/reference");
    let scratch = tempfile::tempdir().unwrap();
    let raw = scratch.path().join("envelope.cbor");
    let hex_text = std::fs::read_to_string(reference.join("envelope.hex")).unwrap();
    std::fs::write(&raw, mesh_protocol::hex::decode(hex_text.trim()).unwrap()).unwrap();
    for first in [raw.clone(), reference.join("envelope.hex")] {
        let status = mesh_node()
            .arg("verify")
            .arg(&first)
            .output()
            .unwrap()
            .status;
        assert_eq!(status.code(), Some(0), "{}", first.display());
        let linked = mesh_node()
            .arg("verify")
            .arg(reference.join("next_envelope.hex"))
            .arg("--prev")
            .arg(&first)
            .output()
            .unwrap();
        assert_eq!(
            linked.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&linked.stdout)
        );
    }
    let backwards = mesh_node()
        .arg("verify")
        .arg(&raw)
        .arg("--prev")
        .arg(reference.join("next_envelope.hex"))
        .output()
        .unwrap();
    assert_eq!(backwards.status.code(), Some(1));
    let (code, value) = verify_json(&reference.join("next_envelope.hex"));
    assert_eq!(code, 0);
    assert_eq!(value["sequence"], 1);
    assert_eq!(value["energy_provenance"], "HwShunt");
    let mut tampered = mesh_protocol::hex::decode(hex_text.trim()).unwrap();
    let last = tampered.len() - 1;
    tampered[last] ^= 1;
    std::fs::write(&raw, &tampered).unwrap();
    assert_eq!(
        mesh_node()
            .arg("verify")
            .arg(&raw)
            .output()
            .unwrap()
            .status
            .code(),
        Some(1)
    );
}
