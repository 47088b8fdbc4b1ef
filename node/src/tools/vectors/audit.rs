//! The generator of the audit statement vectors (`vectors/mesh/audits.json`,
//! docs/bundle.md): two reference statements (every stage passed; stage 2
//! failed at a step, stage 3 not reached) signed with a published key, and
//! cases derived mechanically from them: one flipped bit in every byte of
//! the signature, another signing key, the statement changed after
//! signing, and statements that do not read as one audit (each member
//! broken in turn, the limits). Each case carries the outcome
//! `SignedAudit` must give; the generator refuses to write one the code
//! disagrees with.

use anyhow::ensure;
use mesh_protocol::SigningKey;
use mesh_protocol::audit::{
    AuditStatement, AuditedStage, MAX_AUDIT_WORDS, MAX_AUDITED_STAGES, SignedAudit, StageVerdict,
};
use mesh_protocol::hex;
use mesh_protocol::identity::did_key;
use serde_json::{Value, json};

use crate::tools::simulate::deterministic_32;
use crate::tools::vectors::file::VectorFile;

fn key(label: &str) -> SigningKey {
    SigningKey::from_bytes(&deterministic_32(label))
}

fn node(label: &str) -> String {
    did_key(&key(label).verifying_key().to_bytes())
}

fn stage(index: u32, verdict: StageVerdict) -> AuditedStage {
    let failed = verdict == StageVerdict::Failed;
    AuditedStage {
        stage_index: index,
        node_id: node(&format!("mesh-node vectors: stage {index}")),
        verdict,
        step: failed.then_some(4),
        expected: failed.then(|| {
            "a reply hashing to sha256:5b1e0c3d2f7a9e8b6c4d1a0f3e2d5c7b9a8f6e4d3c2b1a0f9e8d7c6b5a4f3e2d".into()
        }),
        claimed: failed.then(|| {
            "a reply hashing to sha256:0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9".into()
        }),
    }
}

fn statement(verdicts: &[StageVerdict]) -> AuditStatement {
    AuditStatement {
        coordinator_node_id: node("mesh-node vectors: coordinator"),
        run_id: "mesh-split-1790739480000000000".into(),
        request_id: 18_446_744_073_709_551_557,
        stages: verdicts
            .iter()
            .enumerate()
            .map(|(k, v)| stage(k as u32 + 1, *v))
            .collect(),
    }
}

/// The outcome as the vectors name it: the statement refused, or read with
/// whether the coordinator's signature holds and which stage failed.
fn outcome(audit: &Value, coordinator: &[u8; 32]) -> Value {
    match SignedAudit::from_value_at(audit, "") {
        Err(_) => json!({ "refused": "shape" }),
        Ok(read) => json!({ "ok": {
            "signed_by_coordinator": read.signed_by(coordinator),
            "failed_stage": read.statement.failed().map(|s| s.stage_index),
        }}),
    }
}

pub fn generate() -> anyhow::Result<Vec<VectorFile>> {
    use StageVerdict::{Failed, NotReached, Passed};
    let coordinator = key("mesh-node vectors: coordinator");
    let public = coordinator.verifying_key().to_bytes();
    let passed = SignedAudit::sign(statement(&[Passed, Passed]), &coordinator);
    let failed = SignedAudit::sign(statement(&[Passed, Failed, NotReached]), &coordinator);
    let mut cases = Vec::new();
    let mut add = |name: String, audit: Value, expect: Value| -> anyhow::Result<()> {
        let got = outcome(&audit, &public);
        ensure!(got == expect, "{name}: {got}, not {expect}");
        cases.push(json!({ "name": name, "audit": audit, "expect": expect }));
        Ok(())
    };
    let ok = |signed: bool, failed_stage: Option<u32>| json!({ "ok": { "signed_by_coordinator": signed, "failed_stage": failed_stage } });
    let refused = json!({ "refused": "shape" });
    add("all_passed".into(), passed.to_value(), ok(true, None))?;
    add(
        "stage_2_failed".into(),
        failed.to_value(),
        ok(true, Some(2)),
    )?;
    for byte in 0..64 {
        let mut flipped = failed.clone();
        flipped.signature[byte] ^= 1 << (byte % 8);
        add(
            format!("signature_byte_{byte}_bit_{}_flipped", byte % 8),
            flipped.to_value(),
            ok(false, Some(2)),
        )?;
    }
    let other = SignedAudit::sign(failed.statement.clone(), &key("mesh-node vectors: another"));
    add(
        "signed_by_another_key".into(),
        other.to_value(),
        ok(false, Some(2)),
    )?;
    let mut later = failed.clone();
    later.statement.stages[1].step = Some(5);
    add(
        "step_changed_after_signing".into(),
        later.to_value(),
        ok(false, Some(2)),
    )?;
    let mut hidden = failed.clone();
    hidden.statement.stages[1] = stage(2, Passed);
    hidden.statement.stages[2] = stage(3, Passed);
    add(
        "failure_hidden_after_signing".into(),
        hidden.to_value(),
        ok(false, None),
    )?;

    type Change = Box<dyn Fn(&mut Value)>;
    let broken: Vec<(&str, Change)> = vec![
        (
            "unknown_member",
            Box::new(|v| v["statement"]["note"] = json!("x")),
        ),
        ("version_2", Box::new(|v| v["statement"]["v"] = json!(2))),
        (
            "request_id_as_number",
            Box::new(|v| v["statement"]["request_id"] = json!(7)),
        ),
        (
            "request_id_leading_zero",
            Box::new(|v| v["statement"]["request_id"] = json!("07")),
        ),
        (
            "request_id_past_u64",
            Box::new(|v| v["statement"]["request_id"] = json!("18446744073709551616")),
        ),
        (
            "empty_run_id",
            Box::new(|v| v["statement"]["run_id"] = json!("")),
        ),
        (
            "no_stages",
            Box::new(|v| v["statement"]["stages"] = json!([])),
        ),
        (
            "stage_index_skips",
            Box::new(|v| v["statement"]["stages"][1]["stage_index"] = json!(3)),
        ),
        (
            "node_not_a_did_key",
            Box::new(|v| v["statement"]["stages"][0]["node_id"] = json!("node-1")),
        ),
        (
            "unknown_verdict",
            Box::new(|v| v["statement"]["stages"][0]["verdict"] = json!("maybe")),
        ),
        (
            "failed_without_claimed",
            Box::new(|v| {
                if let Some(s) = v["statement"]["stages"][1].as_object_mut() {
                    s.remove("claimed");
                }
            }),
        ),
        (
            "passed_with_a_step",
            Box::new(|v| v["statement"]["stages"][0]["step"] = json!(1)),
        ),
        (
            "reached_after_a_failure",
            Box::new(|v| v["statement"]["stages"][2]["verdict"] = json!("passed")),
        ),
        (
            "not_reached_first",
            Box::new(|v| v["statement"]["stages"][0]["verdict"] = json!("not_reached")),
        ),
        (
            "words_past_the_limit",
            Box::new(|v| {
                v["statement"]["stages"][1]["expected"] = json!("x".repeat(MAX_AUDIT_WORDS + 1))
            }),
        ),
        (
            "signature_63_bytes",
            Box::new(|v| {
                let short = v["signature"].as_str().unwrap_or_default()[2..].to_string();
                v["signature"] = json!(short);
            }),
        ),
        (
            "unknown_member_beside_the_signature",
            Box::new(|v| v["key"] = json!("x")),
        ),
    ];
    for (name, change) in broken {
        let mut audit = failed.to_value();
        change(&mut audit);
        add(name.into(), audit, refused.clone())?;
    }
    let verdicts = vec![Passed; MAX_AUDITED_STAGES + 1];
    let too_many = SignedAudit::sign(statement(&verdicts), &coordinator);
    add(
        "stages_past_the_limit".into(),
        too_many.to_value(),
        refused.clone(),
    )?;
    let most = SignedAudit::sign(statement(&verdicts[1..]), &coordinator);
    add(
        "stages_at_the_limit".into(),
        most.to_value(),
        ok(true, None),
    )?;

    let file = json!({
        "description": "mesh-node-audit/1 statements (docs/bundle.md, `audit`): a coordinator's signed verdict on a request's remote stages, as a bundle carries it ({statement, signature}). The signature is Ed25519 by `coordinator` over \"mesh-node-audit/1\" 0x00 || the statement's RFC 8785 bytes. Each case's outcome: {refused: shape} when the member does not read as one audit, else {ok: {signed_by_coordinator, failed_stage}}.",
        "coordinator": {
            "public_key": hex::encode(&public),
            "node_id": did_key(&public),
        },
        "cases": cases,
    });
    Ok(vec![(
        "mesh/audits.json".into(),
        crate::tools::vectors::file::pretty(&file),
    )])
}
