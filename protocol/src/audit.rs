//! The audit statement (`mesh-node-audit/1`): what a coordinator found when
//! it ran a request's remote stages' layers itself, on the inputs each was
//! given, and compared the bytes each sent. It names every stage in chain
//! order with its verdict: `passed`, `failed` (the first stage whose bytes
//! differ: what its layers give, what it sent, and the step where that is
//! known) or `not_reached` (after a failure there is no honest input to run
//! the next stage on). The coordinator signs it, and a request's bundle
//! carries it (member `audit`); `verify` checks the signature against the
//! main record's key, that it names the bundle's request and stages, and
//! fails a bundle whose audit failed.
//!
//! ```text
//! signed message = "mesh-node-audit/1" 0x00 || RFC 8785 (JCS) bytes of the statement
//! signature      = Ed25519, 64 bytes, by the coordinator (the main record's key)
//! ```

use serde_json::{Value, json};

use crate::block::parse_request_id;
use crate::hex;
use crate::identity::parse_did_key;
use crate::json::{Members, ShapeError, canonical_bytes};

/// The statement's version.
pub const AUDIT_VERSION: u64 = 1;
/// Stages one statement names (the planner's own bound on a chain).
pub const MAX_AUDITED_STAGES: usize = 64;
/// The longest `expected` or `claimed` text.
pub const MAX_AUDIT_WORDS: usize = 256;
/// The domain the signature is made in.
pub const AUDIT_DOMAIN: &[u8] = b"mesh-node-audit/1\0";

/// One stage's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageVerdict {
    /// Its bytes are what its layers give on its input.
    Passed,
    /// Its bytes differ.
    Failed,
    /// A stage before it failed: nothing honest to run it on.
    NotReached,
}

impl StageVerdict {
    pub fn as_str(self) -> &'static str {
        match self {
            StageVerdict::Passed => "passed",
            StageVerdict::Failed => "failed",
            StageVerdict::NotReached => "not_reached",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        [Self::Passed, Self::Failed, Self::NotReached]
            .into_iter()
            .find(|v| v.as_str() == text)
    }
}

/// One remote stage of the audited chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditedStage {
    pub stage_index: u32,
    /// The node that served it, as a did:key.
    pub node_id: String,
    pub verdict: StageVerdict,
    /// A failed stage: the step whose bytes differ first, where known.
    pub step: Option<u32>,
    /// A failed stage: what its layers give, and what it sent.
    pub expected: Option<String>,
    pub claimed: Option<String>,
}

/// The whole statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditStatement {
    pub coordinator_node_id: String,
    pub run_id: String,
    pub request_id: u64,
    /// Every remote stage, stage 1 first.
    pub stages: Vec<AuditedStage>,
}

impl AuditStatement {
    pub fn to_value(&self) -> Value {
        json!({
            "v": AUDIT_VERSION,
            "coordinator_node_id": self.coordinator_node_id,
            "run_id": self.run_id,
            "request_id": self.request_id.to_string(),
            "stages": self.stages.iter().map(|s| {
                let mut entry = json!({
                    "stage_index": s.stage_index,
                    "node_id": s.node_id,
                    "verdict": s.verdict.as_str(),
                });
                if let Some(step) = s.step {
                    entry["step"] = json!(step);
                }
                if let Some(expected) = &s.expected {
                    entry["expected"] = json!(expected);
                }
                if let Some(claimed) = &s.claimed {
                    entry["claimed"] = json!(claimed);
                }
                entry
            }).collect::<Vec<_>>(),
        })
    }

    /// Read a statement, refusing unknown members, another version, a
    /// request id not in canonical decimal, more than
    /// [`MAX_AUDITED_STAGES`] stages or none, stage indices that do not run
    /// 1, 2, … in order, nodes that are not did:keys, and verdicts that do
    /// not read as one audit: stages passed, then at most one failed (with
    /// what was expected and claimed), then only `not_reached`.
    pub fn from_value(value: &Value) -> Result<Self, ShapeError> {
        Self::from_value_at(value, "")
    }

    /// [`AuditStatement::from_value`], its members' paths under `path`.
    pub fn from_value_at(value: &Value, path: &str) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, path)?;
        if m.u64("v")? != AUDIT_VERSION {
            return Err(ShapeError::invalid(m.path("v"), "version 1"));
        }
        let coordinator_node_id = m.non_empty_string("coordinator_node_id")?.to_string();
        let run_id = m.non_empty_string("run_id")?.to_string();
        let request_path = m.path("request_id");
        let request_id = parse_request_id(m.string("request_id")?)
            .ok_or_else(|| ShapeError::invalid(request_path, "a canonical decimal u64"))?;
        let stages_path = m.path("stages");
        let listed = m.array("stages")?;
        m.finish()?;
        if listed.is_empty() || listed.len() > MAX_AUDITED_STAGES {
            return Err(ShapeError::invalid(
                stages_path,
                format!("1 to {MAX_AUDITED_STAGES} stages"),
            ));
        }
        let mut stages: Vec<AuditedStage> = Vec::with_capacity(listed.len());
        for (k, entry) in listed.iter().enumerate() {
            let at = format!("{stages_path}/{k}");
            let stage = audited_stage(entry, &at)?;
            if stage.stage_index as usize != k + 1 {
                return Err(ShapeError::invalid(
                    at,
                    format!("stage {} where stage {} was next", stage.stage_index, k + 1),
                ));
            }
            let before = stages.last().map(|s| s.verdict);
            let follows = match stage.verdict {
                StageVerdict::Passed | StageVerdict::Failed => {
                    matches!(before, None | Some(StageVerdict::Passed))
                }
                StageVerdict::NotReached => matches!(
                    before,
                    Some(StageVerdict::Failed | StageVerdict::NotReached)
                ),
            };
            if !follows {
                return Err(ShapeError::invalid(
                    at,
                    "stages passed, then at most one failed, then only not_reached",
                ));
            }
            stages.push(stage);
        }
        Ok(Self {
            coordinator_node_id,
            run_id,
            request_id,
            stages,
        })
    }

    /// The stage that failed, if one did.
    pub fn failed(&self) -> Option<&AuditedStage> {
        self.stages
            .iter()
            .find(|s| s.verdict == StageVerdict::Failed)
    }

    /// The bytes the coordinator signs.
    pub fn signing_message(&self) -> Vec<u8> {
        let mut message = AUDIT_DOMAIN.to_vec();
        message.extend_from_slice(&canonical_bytes(&self.to_value()));
        message
    }
}

fn audited_stage(entry: &Value, at: &str) -> Result<AuditedStage, ShapeError> {
    let mut s = Members::of(entry, at)?;
    let stage_index = s.u32("stage_index")?;
    let node_path = s.path("node_id");
    let node_id = s.string("node_id")?.to_string();
    if parse_did_key(&node_id).is_none() {
        return Err(ShapeError::invalid(node_path, "a did:key"));
    }
    let verdict_path = s.path("verdict");
    let verdict = StageVerdict::parse(s.string("verdict")?)
        .ok_or_else(|| ShapeError::invalid(verdict_path, "passed, failed or not_reached"))?;
    let step = if s.present("step") {
        Some(s.u32("step")?)
    } else {
        None
    };
    let words = |s: &mut Members<'_>, key: &'static str| -> Result<Option<String>, ShapeError> {
        if !s.present(key) {
            return Ok(None);
        }
        let path = s.path(key);
        let text = s.non_empty_string(key)?;
        if text.len() > MAX_AUDIT_WORDS {
            return Err(ShapeError::invalid(
                path,
                format!("at most {MAX_AUDIT_WORDS} bytes"),
            ));
        }
        Ok(Some(text.to_string()))
    };
    let expected = words(&mut s, "expected")?;
    let claimed = words(&mut s, "claimed")?;
    s.finish()?;
    let failed = verdict == StageVerdict::Failed;
    if failed != (expected.is_some() && claimed.is_some())
        || (!failed && (step.is_some() || expected.is_some() || claimed.is_some()))
    {
        return Err(ShapeError::invalid(
            at,
            "a failed stage says what was expected and claimed (and may name its step); no other does",
        ));
    }
    Ok(AuditedStage {
        stage_index,
        node_id,
        verdict,
        step,
        expected,
        claimed,
    })
}

/// A statement with its coordinator's signature: a bundle's `audit` member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedAudit {
    pub statement: AuditStatement,
    pub signature: [u8; 64],
}

impl SignedAudit {
    pub fn sign(statement: AuditStatement, key: &crate::SigningKey) -> Self {
        use ed25519_dalek::Signer;
        let signature = key.sign(&statement.signing_message()).to_bytes();
        Self {
            statement,
            signature,
        }
    }

    /// Whether the signature is `signer`'s (strict Ed25519).
    pub fn signed_by(&self, signer: &[u8; 32]) -> bool {
        crate::VerifyingKey::from_bytes(signer).is_ok_and(|key| {
            key.verify_strict(
                &self.statement.signing_message(),
                &ed25519_dalek::Signature::from_bytes(&self.signature),
            )
            .is_ok()
        })
    }

    pub fn to_value(&self) -> Value {
        json!({
            "statement": self.statement.to_value(),
            "signature": hex::encode(&self.signature),
        })
    }

    pub fn from_value_at(value: &Value, path: &str) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, path)?;
        let statement_path = m.path("statement");
        let statement = AuditStatement::from_value_at(m.required("statement")?, &statement_path)?;
        let signature_path = m.path("signature");
        let signature = hex::decode_array::<64>(m.string("signature")?)
            .ok_or_else(|| ShapeError::invalid(signature_path, "64 bytes of hex"))?;
        m.finish()?;
        Ok(Self {
            statement,
            signature,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::did_key;

    fn key(seed: u8) -> crate::SigningKey {
        crate::SigningKey::from_bytes(&[seed; 32])
    }

    fn node(seed: u8) -> String {
        did_key(&key(seed).verifying_key().to_bytes())
    }

    pub(crate) fn failed_at_two() -> AuditStatement {
        AuditStatement {
            coordinator_node_id: node(1),
            run_id: "mesh-split-1".into(),
            request_id: 18_446_744_073_709_551_615,
            stages: vec![
                AuditedStage {
                    stage_index: 1,
                    node_id: node(2),
                    verdict: StageVerdict::Passed,
                    step: None,
                    expected: None,
                    claimed: None,
                },
                AuditedStage {
                    stage_index: 2,
                    node_id: node(3),
                    verdict: StageVerdict::Failed,
                    step: Some(4),
                    expected: Some("a reply hashing to sha256:00".into()),
                    claimed: Some("a reply hashing to sha256:11".into()),
                },
                AuditedStage {
                    stage_index: 3,
                    node_id: node(4),
                    verdict: StageVerdict::NotReached,
                    step: None,
                    expected: None,
                    claimed: None,
                },
            ],
        }
    }

    #[test]
    fn a_statement_round_trips_and_its_signature_is_the_coordinators() {
        let signed = SignedAudit::sign(failed_at_two(), &key(1));
        let value = signed.to_value();
        let read = SignedAudit::from_value_at(&value, "/audit").unwrap();
        assert_eq!(read, signed);
        assert!(read.signed_by(&key(1).verifying_key().to_bytes()));
        assert!(!read.signed_by(&key(2).verifying_key().to_bytes()));
        assert_eq!(read.statement.failed().map(|s| s.stage_index), Some(2));
        let mut flipped = read.clone();
        flipped.statement.stages[1].step = Some(5);
        assert!(!flipped.signed_by(&key(1).verifying_key().to_bytes()));
    }

    /// The repository's vectors (`vectors/mesh/audits.json`, `mesh-node
    /// vectors write`): every case gets the outcome the file names.
    #[test]
    fn the_audit_vectors_hold() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../vectors/mesh/audits.json");
        let document: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let coordinator =
            hex::decode_array::<32>(document["coordinator"]["public_key"].as_str().unwrap())
                .unwrap();
        let cases = document["cases"].as_array().unwrap();
        assert!(cases.len() > 80);
        for case in cases {
            let got = match SignedAudit::from_value_at(&case["audit"], "") {
                Err(_) => json!({ "refused": "shape" }),
                Ok(read) => {
                    // What is read writes back as it came.
                    assert_eq!(read.to_value(), case["audit"], "{}", case["name"]);
                    json!({ "ok": {
                        "signed_by_coordinator": read.signed_by(&coordinator),
                        "failed_stage": read.statement.failed().map(|s| s.stage_index),
                    }})
                }
            };
            assert_eq!(got, case["expect"], "{}", case["name"]);
        }
    }

    #[test]
    fn statements_that_do_not_read_as_one_audit_are_refused() {
        type Change = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Change)> = vec![
            ("unknown member", Box::new(|v| v["extra"] = json!(1))),
            ("version", Box::new(|v| v["v"] = json!(2))),
            ("request id", Box::new(|v| v["request_id"] = json!("007"))),
            ("no stages", Box::new(|v| v["stages"] = json!([]))),
            (
                "out of order",
                Box::new(|v| v["stages"][0]["stage_index"] = json!(2)),
            ),
            (
                "not a did:key",
                Box::new(|v| v["stages"][0]["node_id"] = json!("alice")),
            ),
            (
                "failed without words",
                Box::new(|v| {
                    v["stages"][1].as_object_mut().unwrap().remove("claimed");
                }),
            ),
            (
                "passed with a step",
                Box::new(|v| v["stages"][0]["step"] = json!(1)),
            ),
            (
                "reached after a failure",
                Box::new(|v| v["stages"][2]["verdict"] = json!("passed")),
            ),
            (
                "not reached first",
                Box::new(|v| v["stages"][0]["verdict"] = json!("not_reached")),
            ),
            (
                "long words",
                Box::new(|v| v["stages"][1]["expected"] = json!("x".repeat(257))),
            ),
        ];
        for (name, change) in cases {
            let mut value = failed_at_two().to_value();
            change(&mut value);
            assert!(AuditStatement::from_value(&value).is_err(), "{name}");
        }
    }
}
