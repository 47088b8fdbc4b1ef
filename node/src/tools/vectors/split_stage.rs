//! The generator of this project's own split-stage vectors
//! (`vectors/split-stage/`).
//! Every file is a pure function of fixed seeds, so regenerating must leave
//! the committed files unchanged (CI checks it).
//!
//! Negative cases are derived mechanically from positive ones: a flipped bit,
//! a truncation, trailing bytes, reordering, a wrong key, a missing or an
//! unknown member. Each case states what it must verify as, by construction;
//! the generator refuses to write a case the verifier disagrees with.

use anyhow::{Context, bail, ensure};
use mesh_protocol::block::{ReturnMode, StageBlock, TerminalState};
use mesh_protocol::capsule::SealedRecord;
use mesh_protocol::fold::{Lane, LaneContext, fold_frames};
use mesh_protocol::hex;
use mesh_protocol::hopcheck::{CellState, LaneState};
use mesh_protocol::verify::{verify_document, verify_hop_case};
use serde_json::{Value, json};

use crate::tools::simulate::{
    Fault, Scenario, coordinator_key, deterministic_32, deterministic_bytes, simulate, stage_key,
};
use crate::tools::vectors::file::{VectorFile, pretty};

/// The split-stage vector files.
pub fn generate() -> anyhow::Result<Vec<VectorFile>> {
    let (hop_cases, bundles) = hop_cases_and_bundles()?;
    let mut files = vec![
        ("split-stage/meta.json".to_string(), pretty(&meta())),
        ("split-stage/fold.json".to_string(), pretty(&fold_cases())),
        (
            "split-stage/blocks.json".to_string(),
            pretty(&block_cases()?),
        ),
        (
            "split-stage/records.json".to_string(),
            pretty(&record_cases()?),
        ),
        ("split-stage/hop-cases.json".to_string(), pretty(&hop_cases)),
        (
            "split-stage/mmr-logs.json".to_string(),
            pretty(&mmr_log_cases()?),
        ),
    ];
    for (name, bundle) in bundles {
        files.push((format!("split-stage/bundles/{name}.json"), pretty(&bundle)));
    }
    Ok(files)
}

/// Transparency logs of 1 to 64 records (`split-stage.md` §3.3): for each
/// size, a checkpoint signed by a fixed key (naming the checkpoint of the
/// size before) and inclusion proofs of the first, middle and last record,
/// each checked here by the rules the published bundles pass; then proofs
/// and checkpoints with one thing changed, each of which must fail.
fn mmr_log_cases() -> anyhow::Result<Value> {
    use mesh_protocol::bundle::{Checkpoint, MmrLog, verify_inclusion};
    let key =
        mesh_protocol::SigningKey::from_bytes(&deterministic_32("mesh-node vectors: log steward"));
    let did = mesh_protocol::identity::did_key(&key.verifying_key().to_bytes());
    let id = |i: u64| deterministic_32(&format!("mesh-node vectors: log record {i}"));
    let mut log = MmrLog::new();
    let mut previous: Option<(u64, [u8; 32])> = None;
    let mut logs = Vec::new();
    let mut last = None;
    for n in 1..=64u64 {
        log.append(&id(n - 1));
        let root = log
            .root()
            .context("a log of one record or more has a root")?;
        let value = Checkpoint::sign(
            &did,
            log.size(),
            &root,
            previous,
            "2026-12-01T00:00:00Z",
            &key,
        );
        let checkpoint = Checkpoint::from_value_at(&value, "")?;
        checkpoint.verify_signature()?;
        let mut leaves = vec![0, (n - 1) / 2, n - 1];
        leaves.dedup();
        let mut proofs = Vec::new();
        for leaf in leaves {
            let proof = log.prove(leaf).context("a proof of a logged record")?;
            verify_inclusion(&proof, &checkpoint, &id(leaf))?;
            proofs.push(json!({
                "capsule_id": hex::encode(&id(leaf)),
                "leaf_index": leaf,
                "proof": proof.to_value(),
            }));
            last = Some((proof, value.clone(), id(leaf)));
        }
        logs.push(json!({ "records": n, "checkpoint": value, "proofs": proofs }));
        previous = Some((log.size(), root));
    }
    // Derived refusals, from the last proof of the 64-record log.
    let (proof, checkpoint, capsule_id) = last.context("64 logs were built")?;
    let mut refusals = Vec::new();
    let mut refuse = |name: &str,
                      proof: &mesh_protocol::bundle::InclusionProof,
                      checkpoint: &Value,
                      capsule_id: &[u8; 32]|
     -> anyhow::Result<()> {
        let parsed = Checkpoint::from_value_at(checkpoint, "")?;
        let holds = parsed.verify_signature().is_ok()
            && verify_inclusion(proof, &parsed, capsule_id).is_ok();
        ensure!(!holds, "{name} still verifies");
        refusals.push(json!({
            "name": name,
            "capsule_id": hex::encode(capsule_id),
            "proof": proof.to_value(),
            "checkpoint": checkpoint,
        }));
        Ok(())
    };
    let mut changed = proof.clone();
    if let Some(first) = changed.witness.first_mut() {
        first[0] ^= 1;
    }
    refuse("witness_bit_flipped", &changed, &checkpoint, &capsule_id)?;
    let mut changed = proof.clone();
    changed.leaf_index = changed.leaf_index.saturating_sub(1);
    refuse("another_leaf_index", &changed, &checkpoint, &capsule_id)?;
    let mut changed = proof.clone();
    changed.size += 1;
    refuse(
        "size_not_the_checkpoints",
        &changed,
        &checkpoint,
        &capsule_id,
    )?;
    let mut other = capsule_id;
    other[31] ^= 1;
    refuse("another_record", &proof, &checkpoint, &other)?;
    let mut altered = checkpoint.clone();
    altered["root"] = json!("00".repeat(32));
    refuse("checkpoint_root_altered", &proof, &altered, &capsule_id)?;
    let mut unsigned = checkpoint.clone();
    unsigned["timestamp"] = json!("2026-12-01T00:00:01Z");
    refuse(
        "checkpoint_changed_after_signing",
        &proof,
        &unsigned,
        &capsule_id,
    )?;
    Ok(json!({
        "generator": "mesh-node vectors write (node/src/tools/vectors/split_stage.rs)",
        "description": "Transparency logs (docs/split-stage.md §3.3, docs/bundle.md): record i is SHA-256 of \"mesh-node vectors: log record {i}\" and the log steward's seed SHA-256 of \"mesh-node vectors: log steward\"; for each log of 1 to 64 records, a checkpoint signed by the log steward (naming the checkpoint of the log one record shorter) and inclusion proofs of its first, middle and last record, all of which verify; `refusals` change one thing of the 64-record log's last proof or checkpoint, and must fail.",
        "log_steward": did,
        "logs": logs,
        "refusals": refusals,
    }))
}

fn meta() -> Value {
    json!({
        "generator": "mesh-node vectors write (node/src/tools/vectors/split_stage.rs)",
        "description": "mesh-node's own split-stage vectors: lane folds, x-mesh-stage-v1 blocks, sealed stage records, hop-check cases and requester bundles. Every key and nonce below is fixed so the files regenerate byte for byte. See docs/split-stage.md.",
        "keys": {
            "coordinator_seed": hex::encode(&deterministic_32("mesh-node vectors: coordinator key")),
            "coordinator_key_id": hex::encode(&coordinator_key().verifying_key().to_bytes()),
            "stage_seeds": (1..5).map(|k| json!({
                "stage": k,
                "seed": hex::encode(&deterministic_32(&format!("mesh-node vectors: stage {k} key"))),
                "key_id": hex::encode(&stage_key(k).verifying_key().to_bytes()),
            })).collect::<Vec<_>>(),
            "seed_rule": "seed = SHA-256(label) for the labels 'mesh-node vectors: coordinator key' and 'mesh-node vectors: stage <k> key'",
        },
        "frames_rule": "frame bytes are SHA-256 in counter mode: SHA-256(label || u64be(counter)) concatenated and truncated",
        "timestamp": mesh_protocol::capsule::format_timestamp(crate::tools::simulate::TIMESTAMP_MILLIS),
    })
}

fn fold_case(
    name: &str,
    salt: &[u8],
    hop: u32,
    lane: Lane,
    frames: &[Vec<u8>],
    derived_from: Option<&str>,
) -> Value {
    let context = LaneContext {
        salt,
        coordinator_node_id: "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp",
        run_id: crate::tools::simulate::RUN_ID,
        request_id: crate::tools::simulate::REQUEST_ID,
        hop_index: hop,
        lane,
    };
    let digest = fold_frames(&context, frames);
    json!({
        "name": name,
        "derived_from": derived_from,
        "salt_hex": hex::encode(salt),
        "coordinator_node_id": context.coordinator_node_id,
        "run_id": context.run_id,
        "request_id": context.request_id.to_string(),
        "hop_index": hop,
        "lane": lane.as_str(),
        "frames_hex": frames.iter().map(|f| hex::encode(f)).collect::<Vec<_>>(),
        "expect": { "frames": digest.frames, "digest": digest.digest_string() },
    })
}

fn fold_cases() -> Value {
    let frames: Vec<Vec<u8>> = (0..3)
        .map(|i| deterministic_bytes(&format!("fold frame {i}"), 40 + i * 7))
        .collect();
    let mut flipped = frames.clone();
    flipped[1][5] ^= 0x01;
    let mut truncated = frames.clone();
    truncated[2].pop();
    let mut trailing = frames.clone();
    trailing[0].push(0);
    let mut reordered = frames.clone();
    reordered.swap(0, 2);
    let base = "three_frames_forward";
    json!([
        fold_case("empty_forward", b"", 0, Lane::Forward, &[], None),
        fold_case(
            "empty_frame_counts",
            b"",
            0,
            Lane::Forward,
            &[Vec::new()],
            None
        ),
        fold_case(base, b"", 0, Lane::Forward, &frames, None),
        fold_case(
            "three_frames_reply",
            b"",
            0,
            Lane::Reply,
            &frames,
            Some(base)
        ),
        fold_case(
            "three_frames_direct_return",
            b"",
            2,
            Lane::DirectReturn,
            &frames,
            Some(base)
        ),
        fold_case(
            "other_hop_index",
            b"",
            1,
            Lane::Forward,
            &frames,
            Some(base)
        ),
        fold_case(
            "salted_part_b",
            &deterministic_32("salt"),
            0,
            Lane::Forward,
            &frames,
            Some(base)
        ),
        fold_case("flipped_bit", b"", 0, Lane::Forward, &flipped, Some(base)),
        fold_case(
            "truncated_frame",
            b"",
            0,
            Lane::Forward,
            &truncated,
            Some(base)
        ),
        fold_case(
            "trailing_byte",
            b"",
            0,
            Lane::Forward,
            &trailing,
            Some(base)
        ),
        fold_case(
            "reordered_frames",
            b"",
            0,
            Lane::Forward,
            &reordered,
            Some(base)
        ),
        fold_case(
            "frames_merged",
            b"",
            0,
            Lane::Forward,
            &[frames.concat()],
            Some(base)
        ),
        fold_case(
            "one_frame_64k",
            b"",
            0,
            Lane::Forward,
            &[deterministic_bytes("large frame", 65_536)],
            None
        ),
    ])
}

/// Members every placement requires.
const ALWAYS_REQUIRED: [&str; 15] = [
    "v",
    "side",
    "coordinator_node_id",
    "run_id",
    "request_id",
    "topology_hash",
    "stage_index",
    "stage_count",
    "layer_start",
    "layer_end",
    "package_id",
    "manifest_sha256",
    "source_model_sha256",
    "return_mode",
    "terminal_state",
];

fn block_cases() -> anyhow::Result<Value> {
    let relayed = simulate(&Scenario::default());
    let direct = simulate(&Scenario {
        return_mode: ReturnMode::Direct,
        ..Scenario::default()
    });
    let exchange =
        |run: &crate::tools::simulate::SimulatedRun, k: usize| -> anyhow::Result<StageBlock> {
            Ok(run.sealed.stage_exchange_records[k - 1].stage_block()?)
        };
    let stage = |run: &crate::tools::simulate::SimulatedRun,
                 k: usize|
     -> anyhow::Result<StageBlock> { Ok(run.stage_records[k][0].stage_block()?) };
    let positives: Vec<(&str, StageBlock, &[&str])> = vec![
        (
            "own_slice_relayed",
            relayed.own.clone(),
            &["downstream", "tokens"],
        ),
        (
            "own_slice_direct",
            direct.own.clone(),
            &["downstream", "tokens", "direct_return"],
        ),
        (
            "middle_stage_relayed",
            stage(&relayed, 1)?,
            &["upstream", "downstream", "tokens"],
        ),
        (
            "final_stage_relayed",
            stage(&relayed, 2)?,
            &["upstream", "tokens"],
        ),
        (
            "final_stage_direct",
            stage(&direct, 2)?,
            &["upstream", "tokens", "direct_return"],
        ),
        (
            "exchange_stage_1",
            exchange(&relayed, 1)?,
            &[
                "coordinator_term",
                "data_path_observed",
                "coordinator_observed",
            ],
        ),
        (
            "exchange_final_relayed",
            exchange(&relayed, 2)?,
            &["coordinator_term", "data_path_observed"],
        ),
        (
            "exchange_final_direct",
            exchange(&direct, 2)?,
            &[
                "coordinator_term",
                "data_path_observed",
                "coordinator_observed",
            ],
        ),
    ];
    let mut cases = Vec::new();
    for (name, block, placement_required) in positives {
        let value = block.to_value();
        cases.push(json!({ "name": name, "valid": true, "derived_from": null, "block": value }));
        let mut derived = |suffix: String, mutate: &dyn Fn(&mut serde_json::Map<String, Value>)| {
            let mut copy = value.clone();
            if let Value::Object(map) = &mut copy {
                mutate(map);
            }
            cases.push(json!({ "name": format!("{name}/{suffix}"), "valid": false, "derived_from": name, "block": copy }));
        };
        for member in ALWAYS_REQUIRED.iter().chain(placement_required) {
            derived(format!("missing_{member}"), &|map| {
                map.remove(*member);
            });
        }
        derived("unknown_member".into(), &|map| {
            map.insert("session_id".into(), json!("42"));
        });
        derived("request_id_as_number".into(), &|map| {
            map.insert("request_id".into(), json!(7));
        });
        derived("request_id_leading_zero".into(), &|map| {
            map.insert("request_id".into(), json!("07"));
        });
        derived("package_id_truncated".into(), &|map| {
            let text = map["package_id"].as_str().unwrap_or_default();
            map.insert("package_id".into(), json!(text[..text.len() - 1]));
        });
        derived("manifest_uppercase".into(), &|map| {
            let text = map["manifest_sha256"]
                .as_str()
                .unwrap_or_default()
                .to_uppercase();
            map.insert("manifest_sha256".into(), json!(text));
        });
        derived("version_bit_flipped".into(), &|map| {
            map.insert("v".into(), json!(1 ^ 2));
        });
        derived("layer_range_reversed".into(), &|map| {
            let (start, end) = (map["layer_start"].clone(), map["layer_end"].clone());
            map.insert("layer_start".into(), end);
            map.insert("layer_end".into(), start);
        });
        derived("unknown_terminal_state".into(), &|map| {
            map.insert("terminal_state".into(), json!("finished"));
        });
    }
    for case in &cases {
        let parsed = StageBlock::from_value(&case["block"]);
        ensure!(
            parsed.is_ok() == case["valid"].as_bool().unwrap_or_default(),
            "block case {} does not verify as constructed: {parsed:?}",
            case["name"]
        );
    }
    Ok(Value::Array(cases))
}

fn record_cases() -> anyhow::Result<Value> {
    let run = simulate(&Scenario::default());
    let stage_record = run.stage_records[1][0].value().clone();
    let exchange_record = run.sealed.stage_exchange_records[0].value().clone();
    let main_record = run.sealed.main_record.value().clone();
    let mut cases = vec![
        json!({ "name": "stage_record", "valid": true, "derived_from": null, "record": stage_record }),
        json!({ "name": "stage_exchange_record", "valid": true, "derived_from": null, "record": exchange_record }),
        json!({ "name": "main_record", "valid": true, "derived_from": null, "record": main_record }),
    ];
    let signature_hex = stage_record["signature"]
        .as_str()
        .context("sealed records are signed")?;
    let envelope = hex::decode(signature_hex).context("signature hex")?;
    let with = |member: &str, value: Value| {
        let mut copy = stage_record.clone();
        copy[member] = value;
        copy
    };
    let mut push = |name: &str, valid: bool, record: Value| {
        cases.push(json!({ "name": name, "valid": valid, "derived_from": "stage_record", "record": record }));
    };
    // Bits flipped at the envelope's landmarks: protected header, kid,
    // payload, and the signature itself.
    for (label, offset) in [
        ("tag", 0usize),
        ("protected_alg", 6),
        ("kid", 50),
        ("payload", 90),
        ("signature", 150),
        ("last_byte", envelope.len() - 1),
    ] {
        let mut flipped = envelope.clone();
        flipped[offset] ^= 0x01;
        push(
            &format!("envelope_bit_flipped_{label}"),
            false,
            with("signature", json!(hex::encode(&flipped))),
        );
    }
    push(
        "envelope_truncated",
        false,
        with(
            "signature",
            json!(hex::encode(&envelope[..envelope.len() - 1])),
        ),
    );
    let mut trailing = envelope.clone();
    trailing.push(0);
    push(
        "envelope_trailing_byte",
        false,
        with("signature", json!(hex::encode(&trailing))),
    );
    let mut id =
        hex::decode(stage_record["capsule_id"].as_str().unwrap_or_default()).unwrap_or_default();
    if let Some(first) = id.first_mut() {
        *first ^= 0x80;
    }
    push(
        "capsule_id_bit_flipped",
        false,
        with("capsule_id", json!(hex::encode(&id))),
    );
    push(
        "content_changed_after_seal",
        false,
        with("timestamp", json!("2026-09-30T03:38:00.001Z")),
    );
    let other_key = stage_key(4);
    push(
        "wrong_key_id",
        false,
        with(
            "key_id",
            json!(hex::encode(&other_key.verifying_key().to_bytes())),
        ),
    );
    let resealed = SealedRecord::seal(stage_record.clone(), &other_key)?;
    let mut signed_by_other = resealed.value().clone();
    signed_by_other["key_id"] = stage_record["key_id"].clone();
    push("signed_by_another_key", false, signed_by_other);
    // Member order is not part of the canonical form: reordering keeps the id.
    let mut reordered = serde_json::Map::new();
    if let Value::Object(map) = &stage_record {
        for (key, value) in map.iter().rev() {
            reordered.insert(key.clone(), value.clone());
        }
    }
    push("members_reordered", true, Value::Object(reordered));
    let mut unknown_format = stage_record.clone();
    unknown_format["format_version"] = json!("2");
    push("format_version_2", false, unknown_format);
    for case in &cases {
        let verified = SealedRecord::verify(case["record"].clone());
        ensure!(
            verified.is_ok() == case["valid"].as_bool().unwrap_or_default(),
            "record case {} does not verify as constructed: {verified:?}",
            case["name"]
        );
    }
    Ok(Value::Array(cases))
}

/// What a hop-check scenario must show, by construction.
struct Intent {
    agree: bool,
    cell: Option<(u32, CellState)>,
    lane: Option<(u32, Lane, LaneState)>,
}

fn hop_cases_and_bundles() -> anyhow::Result<(Value, Vec<(String, Value)>)> {
    let scenarios: Vec<(&str, Scenario, Intent)> = vec![
        (
            "relayed_all_agree",
            Scenario::default(),
            Intent {
                agree: true,
                cell: Some((2, CellState::Ok)),
                lane: Some((1, Lane::Reply, LaneState::Agree)),
            },
        ),
        (
            "direct_all_agree",
            Scenario {
                return_mode: ReturnMode::Direct,
                ..Scenario::default()
            },
            Intent {
                agree: true,
                cell: None,
                lane: Some((2, Lane::DirectReturn, LaneState::Agree)),
            },
        ),
        (
            "two_stage_relayed",
            Scenario {
                stages: 2,
                ..Scenario::default()
            },
            Intent {
                agree: true,
                cell: Some((1, CellState::Ok)),
                lane: None,
            },
        ),
        (
            "five_stage_direct",
            Scenario {
                stages: 5,
                return_mode: ReturnMode::Direct,
                ..Scenario::default()
            },
            Intent {
                agree: true,
                cell: Some((4, CellState::Ok)),
                lane: Some((4, Lane::DirectReturn, LaneState::Agree)),
            },
        ),
        (
            "forward_byte_altered_in_flight",
            Scenario {
                fault: Fault::AlterForwardByte { hop: 1 },
                ..Scenario::default()
            },
            Intent {
                agree: false,
                cell: None,
                lane: Some((1, Lane::Forward, LaneState::Break)),
            },
        ),
        (
            "forward_frames_reordered",
            Scenario {
                fault: Fault::SwapForwardFrames { hop: 0 },
                ..Scenario::default()
            },
            Intent {
                agree: false,
                cell: None,
                lane: Some((0, Lane::Forward, LaneState::Break)),
            },
        ),
        (
            "stage_silent",
            Scenario {
                fault: Fault::StageSilent { stage: 2 },
                ..Scenario::default()
            },
            Intent {
                agree: false,
                cell: Some((2, CellState::NotReceived)),
                lane: Some((1, Lane::Forward, LaneState::Gap)),
            },
        ),
        (
            "two_records_one_stage",
            Scenario {
                fault: Fault::TwoRecords { stage: 1 },
                ..Scenario::default()
            },
            Intent {
                agree: false,
                cell: Some((1, CellState::Conflict)),
                lane: Some((0, Lane::Forward, LaneState::Gap)),
            },
        ),
        (
            "stage_loaded_other_slice",
            Scenario {
                fault: Fault::WrongSlice { stage: 1 },
                ..Scenario::default()
            },
            Intent {
                agree: true,
                cell: Some((1, CellState::Disagrees)),
                lane: None,
            },
        ),
        (
            "timed_out_relayed",
            Scenario {
                terminal_state: TerminalState::TimedOut,
                ..Scenario::default()
            },
            Intent {
                agree: true,
                cell: None,
                lane: Some((0, Lane::Reply, LaneState::Agree)),
            },
        ),
    ];
    let mut cases = Vec::new();
    let mut bundles = Vec::new();
    for (name, scenario, intent) in scenarios {
        let run = simulate(&scenario);
        let carried: Vec<Value> = run
            .sealed
            .carried
            .iter()
            .map(|record| {
                json!({
                    "capsule_id": hex::encode(&record.capsule_id()),
                    "block": record.value()["model_attestation"]["compute_attestation"]["x-mesh-stage-v1"],
                })
            })
            .collect();
        let mut case = json!({
            "name": name,
            "own": run.own.to_value(),
            "receipt": run.sealed.receipt.to_value(),
            "carried": carried,
        });
        let report = verify_hop_case(&case)?;
        let hop = report
            .hop
            .as_ref()
            .context("hop cases always run the check")?;
        if hop.handoffs_agree != intent.agree {
            bail!(
                "{name}: handoffs_agree is {} but the scenario intends {}",
                hop.handoffs_agree,
                intent.agree
            );
        }
        if let Some((stage, state)) = intent.cell {
            ensure!(
                hop.cells[stage as usize].state == state,
                "{name}: cell {stage} is {:?}",
                hop.cells[stage as usize].state
            );
        }
        if let Some((hop_index, lane, state)) = intent.lane {
            let found = hop
                .lanes
                .iter()
                .find(|l| l.hop_index == hop_index && l.lane == lane)
                .map(|l| l.state);
            ensure!(
                found == Some(state),
                "{name}: hop {hop_index} {lane} is {found:?}, intended {state:?}"
            );
        }
        case["expect"] = hop.to_expect_value();
        cases.push(case);

        let bundle = run.sealed.bundle();
        let full = verify_document(&bundle)?;
        ensure!(
            full.checks_passed(),
            "{name}: bundle checks fail: {:?}",
            full.checks
        );
        ensure!(
            full.hop.as_ref() == Some(hop),
            "{name}: bundle and case disagree"
        );
        bundles.push((name.to_string(), bundle));
    }
    let listed = stewards_bundles(&bundles[0].1, &cases[0]["receipt"])?;
    bundles.extend(listed);
    cases.extend(carried_twice_cases(&cases[0])?);
    Ok((Value::Array(cases), bundles))
}

/// Bundles derived from `base` with a `stewards` list, as a coordinator
/// writes one: the true list verifies; a list naming a stage twice, not
/// starting with the coordinator, naming a stage the receipt does not
/// route, leaving one out, or naming another node for a stage fails.
fn stewards_bundles(base: &Value, receipt: &Value) -> anyhow::Result<Vec<(String, Value)>> {
    let routed: Vec<Value> = receipt["topology"]
        .as_array()
        .context("a receipt has a topology")?
        .iter()
        .enumerate()
        .map(|(k, entry)| json!({ "stage_index": k, "node_id": entry["assignment"]["node_id"] }))
        .collect();
    ensure!(routed.len() == 3, "the base bundle routes three stages");
    let stranger = mesh_protocol::identity::did_key(&stage_key(9).verifying_key().to_bytes());
    let variants = [
        ("stewards_listed", routed.clone(), true),
        (
            "stewards_duplicate_index",
            vec![routed[0].clone(), routed[1].clone(), routed[1].clone()],
            false,
        ),
        (
            "stewards_first_not_coordinator",
            vec![routed[1].clone(), routed[0].clone(), routed[2].clone()],
            false,
        ),
        (
            "stewards_unknown_index",
            vec![
                routed[0].clone(),
                routed[1].clone(),
                routed[2].clone(),
                json!({ "stage_index": 3, "node_id": routed[2]["node_id"] }),
            ],
            false,
        ),
        (
            "stewards_missing_stage",
            vec![routed[0].clone(), routed[2].clone()],
            false,
        ),
        (
            "stewards_other_node",
            vec![
                routed[0].clone(),
                json!({ "stage_index": 1, "node_id": stranger }),
                routed[2].clone(),
            ],
            false,
        ),
    ];
    let mut out = Vec::new();
    for (name, list, passes) in variants {
        let mut bundle = base.clone();
        bundle["stewards"] = Value::Array(list);
        let report = verify_document(&bundle)?;
        ensure!(
            report.checks_passed() == passes,
            "{name}: checks pass is {} but the case intends {passes}: {:?}",
            report.checks_passed(),
            report.checks
        );
        out.push((name.to_string(), bundle));
    }
    Ok(out)
}

/// Hop cases derived from `base` (every cell ok) by carrying stage 1's
/// record a second time under the same id: identical, it is one record;
/// with another block (its token count changed), the id names two blocks
/// and neither can be believed, so stage 1 is a conflict, not first-wins.
fn carried_twice_cases(base: &Value) -> anyhow::Result<Vec<Value>> {
    let first = base["carried"][0].clone();
    let mut altered = first.clone();
    let decode = altered["block"]["tokens"]["decode"]
        .as_u64()
        .context("a carried block counts its decode tokens")?;
    altered["block"]["tokens"]["decode"] = json!(decode + 1);
    let mut cases = Vec::new();
    for (name, copy, stage_1) in [
        ("record_carried_twice", first, CellState::Ok),
        ("one_id_two_blocks", altered, CellState::Conflict),
    ] {
        let mut case = base.clone();
        case["name"] = json!(name);
        if let Some(object) = case.as_object_mut() {
            object.remove("expect");
        }
        case["carried"]
            .as_array_mut()
            .context("a hop case carries an array")?
            .push(copy);
        let report = verify_hop_case(&case)?;
        let hop = report
            .hop
            .as_ref()
            .context("hop cases always run the check")?;
        ensure!(
            hop.cells[1].state == stage_1,
            "{name}: cell 1 is {:?}",
            hop.cells[1].state
        );
        case["expect"] = hop.to_expect_value();
        cases.push(case);
    }
    Ok(cases)
}
