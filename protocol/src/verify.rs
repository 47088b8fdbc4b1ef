//! Offline verification of whatever a requester holds: a hop-check case, a
//! Mesh-LLM `record_push_bundle`, or this project's `mesh_bundle`. Every
//! check made is listed in the report, passed or failed, so a reader can see
//! what was and was not verified.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use thiserror::Error;

use crate::block::{Side, StageBlock};
use crate::bundle::{
    MESH_BUNDLE_MEMBER, MESH1_BUNDLE_MEMBER, Mesh1Bundle, MeshBundle, RecordPushBundle,
};
use crate::capsule::{SealedRecord, check_capsule_id, references_of, stage_block_of};
use crate::hex;
use crate::hopcheck::{Carried, HopReport, check_hops};
use crate::json::{Members, ShapeError};
use crate::receipt::{CoordinatorReceipt, RECEIPT_BLOCK_MEMBER};

/// Which kind of document was verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocumentForm {
    /// `{own, receipt, carried: [{capsule_id, block}]}`: blocks without records.
    HopCase,
    /// Mesh-LLM's `record_push_bundle`.
    RecordPushBundle,
    /// This project's `mesh_bundle`.
    MeshBundle,
    /// This project's `mesh1_bundle`: a serve one node ran whole.
    Mesh1Bundle,
}

impl DocumentForm {
    pub fn as_str(self) -> &'static str {
        match self {
            DocumentForm::HopCase => "hop_case",
            DocumentForm::RecordPushBundle => "record_push_bundle",
            DocumentForm::MeshBundle => "mesh_bundle",
            DocumentForm::Mesh1Bundle => "mesh1_bundle",
        }
    }
}

/// One check made, and its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// What was checked (`main record 9c31…`, `stage record ee55…`).
    pub subject: String,
    /// Which property (`capsule_id recomputes`, `COSE signature`, ...).
    pub property: &'static str,
    /// `Err` carries why it failed.
    pub outcome: Result<(), String>,
}

/// The whole verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    pub form: DocumentForm,
    pub checks: Vec<Check>,
    /// The hop check, when the document describes a split.
    pub hop: Option<HopReport>,
    /// Why the hop check could not run, when it could not.
    pub hop_error: Option<String>,
    /// A resumed request's earlier segments, in order, each checked as a
    /// bundle of its own; this report is the final segment's.
    pub earlier_segments: Vec<SegmentReport>,
    /// The resume block the `mesh/1` receipt carries, when it carries one.
    pub resume: Option<crate::resume::ResumeBlock>,
    /// The stages' own receipts the bundle carries that belong to their
    /// stage (each also a check), in stage order.
    pub stage_receipts: Vec<StageReceiptReport>,
    /// The coordinator's audit the bundle carries (each of its checks is
    /// also a check).
    pub audit: Option<crate::audit::AuditStatement>,
}

/// A stage's own `mesh/1` receipt, checked against the stage it is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageReceiptReport {
    pub stage_index: u32,
    pub node: String,
    pub sealed: crate::mesh1::SealedReceipt,
}

/// One earlier segment of a resumed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentReport {
    pub report: VerifyReport,
    /// Stage indices the resume block says were lost in this segment.
    pub lost_stages: Vec<u32>,
}

impl SegmentReport {
    /// Every check passed, and what did not agree is explained by the loss
    /// the receipt declares: only lost stages' cells are `not_received`,
    /// and only hops that touch a lost stage have gaps. A disagreement
    /// anywhere else, or a lost stage whose record arrived and disagrees,
    /// is not excused.
    pub fn success(&self) -> bool {
        let Some(hop) = &self.report.hop else {
            return false;
        };
        let stages = hop.cells.len() as u32;
        let touches_lost = |hop_index: u32, lane: crate::fold::Lane| {
            let ends = match lane {
                crate::fold::Lane::DirectReturn => [hop_index, 0],
                _ => [hop_index, hop_index + 1],
            };
            ends.iter().any(|e| self.lost_stages.contains(e))
        };
        self.report.checks_passed()
            && hop.cells.iter().all(|cell| match cell.state {
                crate::hopcheck::CellState::Ok | crate::hopcheck::CellState::CoordinatorSlice => {
                    true
                }
                crate::hopcheck::CellState::NotReceived => {
                    self.lost_stages.contains(&cell.stage_index)
                }
                _ => false,
            })
            && hop.lanes.iter().all(|lane| match lane.state {
                crate::hopcheck::LaneState::Agree | crate::hopcheck::LaneState::NotApplicable => {
                    true
                }
                crate::hopcheck::LaneState::Gap => {
                    lane.hop_index < stages && touches_lost(lane.hop_index, lane.lane)
                }
                _ => false,
            })
    }
}

impl VerifyReport {
    /// A report of `form` with nothing checked yet.
    fn empty(form: DocumentForm) -> Self {
        Self {
            form,
            checks: Vec::new(),
            hop: None,
            hop_error: None,
            earlier_segments: Vec::new(),
            resume: None,
            stage_receipts: Vec::new(),
            audit: None,
        }
    }

    pub fn checks_passed(&self) -> bool {
        self.checks.iter().all(|c| c.outcome.is_ok()) && self.hop_error.is_none()
    }

    /// Every check passed and, for a split, every hand-off agrees and every
    /// stage's record matched its assignment.
    pub fn success(&self) -> bool {
        self.checks_passed()
            && self
                .hop
                .as_ref()
                .is_none_or(|hop| hop.handoffs_agree && hop.all_cells_ok())
            && self.earlier_segments.iter().all(SegmentReport::success)
    }

    /// The report as one JSON object: the hop check's `cells`, `lanes`,
    /// `handoffs_agree` and `terminal_state` at the top level, exactly as the
    /// published `expect` objects, plus what else was checked.
    pub fn to_value(&self) -> Value {
        let mut object = match &self.hop {
            Some(hop) => hop.to_expect_value(),
            None => json!({}),
        };
        if let Value::Object(map) = &mut object {
            map.insert("form".into(), json!(self.form.as_str()));
            map.insert("ok".into(), json!(self.success()));
            map.insert(
                "checks".into(),
                Value::Array(
                    self.checks
                        .iter()
                        .map(|c| {
                            json!({
                                "subject": c.subject, "property": c.property,
                                "ok": c.outcome.is_ok(), "error": c.outcome.as_ref().err(),
                            })
                        })
                        .collect(),
                ),
            );
            if let Some(error) = &self.hop_error {
                map.insert("hop_error".into(), json!(error));
            }
            if let Some(hop) = &self.hop {
                map.insert("return_mode".into(), json!(hop.return_mode.as_str()));
            }
            if let Some(resume) = &self.resume {
                map.insert("resumed".into(), resume.to_value());
            }
            if let Some(audit) = &self.audit {
                map.insert("audit".into(), audit.to_value());
            }
            if !self.stage_receipts.is_empty() {
                map.insert(
                    "stage_receipts".into(),
                    self.stage_receipts
                        .iter()
                        .map(|r| {
                            json!({
                                "stage_index": r.stage_index,
                                "node": r.node,
                                "energy_uj": r.sealed.receipt.energy.uj(),
                                "energy_provenance": r.sealed.receipt.energy.provenance().as_str(),
                                "precision": r.sealed.receipt.weights.as_ref().map(|w| &w.precision),
                                "envelope_id": hex::encode(&r.sealed.envelope_id()),
                            })
                        })
                        .collect(),
                );
            }
            if !self.earlier_segments.is_empty() {
                map.insert(
                    "earlier_segments".into(),
                    Value::Array(
                        self.earlier_segments
                            .iter()
                            .map(|segment| {
                                let mut value = segment.report.to_value();
                                value["ok"] = json!(segment.success());
                                value["lost_stages"] = json!(segment.lost_stages);
                                value
                            })
                            .collect(),
                    ),
                );
            }
        }
        object
    }
}

/// The document is not any form this verifier reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DocumentError {
    #[error(
        "not a recognised document: expected a hop case {{own, receipt, carried}}, a record_push_bundle, a mesh_bundle or a mesh1_bundle"
    )]
    UnknownForm,
    #[error("{0}")]
    Shape(#[from] ShapeError),
}

/// Verify any supported document.
pub fn verify_document(document: &Value) -> Result<VerifyReport, DocumentError> {
    let object = document.as_object().ok_or(DocumentError::UnknownForm)?;
    if object.contains_key("record_push_bundle") {
        verify_record_push_bundle(document)
    } else if object.contains_key(MESH_BUNDLE_MEMBER) {
        verify_mesh_bundle(document)
    } else if object.contains_key(MESH1_BUNDLE_MEMBER) {
        verify_mesh1_bundle(document)
    } else if object.contains_key("own") && object.contains_key("receipt") {
        verify_hop_case(document)
    } else {
        Err(DocumentError::UnknownForm)
    }
}

fn short(id: &[u8; 32]) -> String {
    hex::encode(&id[..6])
}

/// Form (a): blocks only; there are no records, ids or signatures to check.
pub fn verify_hop_case(document: &Value) -> Result<VerifyReport, DocumentError> {
    let mut m = Members::of(document, "")?;
    let own_value = m.required("own")?;
    let receipt_value = m.required("receipt")?;
    let carried_path = m.path("carried");
    let carried_values = m.array("carried")?;
    // A published case also names itself and its expectation.
    m.optional("name");
    m.optional("note");
    m.optional("expect");
    m.finish()?;
    let mut carried = Vec::with_capacity(carried_values.len());
    for (i, item) in carried_values.iter().enumerate() {
        let mut c = Members::of(item, &format!("{carried_path}/{i}"))?;
        let capsule_id = c.string("capsule_id")?.to_string();
        let block = c.optional("block");
        c.finish()?;
        carried.push(Carried { capsule_id, block });
    }
    let mut report = VerifyReport::empty(DocumentForm::HopCase);
    let own = StageBlock::from_value_at(own_value, "/own");
    let receipt = CoordinatorReceipt::from_value_at(receipt_value, "/receipt");
    report.checks.push(Check {
        subject: "own slice".into(),
        property: "x-mesh-stage-v1 block valid",
        outcome: own.as_ref().map(|_| ()).map_err(ToString::to_string),
    });
    report.checks.push(Check {
        subject: "coordinator receipt".into(),
        property: "x-mesh-coordinator-receipt-v1 valid",
        outcome: receipt.as_ref().map(|_| ()).map_err(ToString::to_string),
    });
    if let (Ok(own), Ok(receipt)) = (own, receipt) {
        run_hop_check(&mut report, &own, &receipt, &carried);
    }
    Ok(report)
}

fn run_hop_check(
    report: &mut VerifyReport,
    own: &StageBlock,
    receipt: &CoordinatorReceipt,
    carried: &[Carried<'_>],
) {
    match check_hops(own, receipt, carried) {
        Ok(hop) => report.hop = Some(hop),
        Err(error) => report.hop_error = Some(error.to_string()),
    }
}

/// Verify a main record and pull out its own slice and receipt.
fn verify_main_record(
    report: &mut VerifyReport,
    record: &Value,
) -> Option<(SealedRecord, Option<(StageBlock, CoordinatorReceipt)>)> {
    let subject = match record.get("capsule_id").and_then(Value::as_str) {
        Some(id) => format!("main record {}", id.get(..12).unwrap_or(id)),
        None => "main record".to_string(),
    };
    let sealed = match SealedRecord::verify(record.clone()) {
        Ok(sealed) => sealed,
        Err(error) => {
            report.checks.push(Check {
                subject,
                property: "capsule_id recomputes and COSE signature verifies",
                outcome: Err(error.to_string()),
            });
            return None;
        }
    };
    report.checks.push(Check {
        subject: subject.clone(),
        property: "capsule_id recomputes and COSE signature verifies",
        outcome: Ok(()),
    });
    let receipt_path = format!("/model_attestation/compute_attestation/{RECEIPT_BLOCK_MEMBER}");
    let Some(receipt_value) = record.pointer(&receipt_path) else {
        // Not a split: no own slice, no receipt, no hop check.
        return Some((sealed, None));
    };
    let own = stage_block_of(record);
    let receipt = CoordinatorReceipt::from_value_at(receipt_value, &receipt_path);
    report.checks.push(Check {
        subject: subject.clone(),
        property: "own-slice block valid (side coordinator, stage 0)",
        outcome: match &own {
            Ok(block) if block.side == Side::Coordinator && block.stage_index == 0 => Ok(()),
            Ok(_) => Err("the main record's block is not the coordinator's own slice".into()),
            Err(error) => Err(error.to_string()),
        },
    });
    report.checks.push(Check {
        subject,
        property: "coordinator receipt block valid",
        outcome: receipt.as_ref().map(|_| ()).map_err(ToString::to_string),
    });
    match (own, receipt) {
        (Ok(own), Ok(receipt)) => {
            let assigned = &receipt.topology[0].assignment;
            report.checks.push(Check {
                subject: "own slice".into(),
                property: "equals topology[0].assignment",
                outcome: if (own.layer_start, own.layer_end, own.package_id)
                    == (
                        assigned.layer_start,
                        assigned.layer_end,
                        assigned.package_id,
                    ) {
                    Ok(())
                } else {
                    Err("the coordinator's slice differs from what it routed to itself".into())
                },
            });
            Some((sealed, Some((own, receipt))))
        }
        _ => Some((sealed, None)),
    }
}

/// Check carried stage records (the door's checks, repeated offline) and
/// return what the hop check should see of each.
fn verify_carried<'a>(
    report: &mut VerifyReport,
    records: &'a [Value],
    receipt: Option<&CoordinatorReceipt>,
) -> Vec<Carried<'a>> {
    let cited: BTreeSet<[u8; 32]> = receipt
        .map(|r| r.stages.iter().flat_map(|s| s.cited()).collect())
        .unwrap_or_default();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut carried = Vec::with_capacity(records.len());
    for (i, record) in records.iter().enumerate() {
        let claimed = record
            .get("capsule_id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let subject = format!("stage record {}", claimed.get(..12).unwrap_or(&claimed));
        let subject = if claimed.is_empty() {
            format!("stage record #{i}")
        } else {
            subject
        };
        let id_ok = check_capsule_id(record);
        report.checks.push(Check {
            subject: subject.clone(),
            property: "capsule_id recomputes",
            outcome: id_ok.as_ref().map(|_| ()).map_err(ToString::to_string),
        });
        let sealed = if id_ok.is_ok() {
            let verified = SealedRecord::verify(record.clone());
            report.checks.push(Check {
                subject: subject.clone(),
                property: "COSE signature verifies under its key_id",
                outcome: verified.as_ref().map(|_| ()).map_err(ToString::to_string),
            });
            verified.ok()
        } else {
            None
        };
        if let Some(sealed) = &sealed {
            let duplicate = seen.insert(claimed.clone(), i).is_some();
            report.checks.push(Check {
                subject: subject.clone(),
                property: "carried once",
                outcome: if duplicate {
                    Err("carried more than once".into())
                } else {
                    Ok(())
                },
            });
            if let Some(receipt) = receipt {
                report.checks.push(Check {
                    subject: subject.clone(),
                    property: "cited by the receipt",
                    outcome: if cited.contains(&sealed.capsule_id()) {
                        Ok(())
                    } else {
                        Err("no stage entry of the receipt cites it".into())
                    },
                });
                let block = sealed.stage_block();
                report.checks.push(Check {
                    subject: subject.clone(),
                    property: "stage block valid, side stage, same split",
                    outcome: match &block {
                        Ok(b) if b.side == Side::Stage && b.split_key() == receipt.split_key() => {
                            Ok(())
                        }
                        Ok(_) => Err("not a stage-side block of this split".into()),
                        Err(error) => Err(error.to_string()),
                    },
                });
            }
        }
        // A record whose id or signature fails is read as having no block,
        // which the hop check counts as rejected.
        let block = sealed.as_ref().and_then(|_| {
            record.pointer(&format!(
                "{}/{}",
                crate::capsule::COMPUTE_ATTESTATION_PATH,
                crate::block::STAGE_BLOCK_MEMBER
            ))
        });
        carried.push(Carried {
            capsule_id: claimed,
            block,
        });
    }
    carried
}

/// Form (b): Mesh-LLM's `record_push_bundle`.
pub fn verify_record_push_bundle(document: &Value) -> Result<VerifyReport, DocumentError> {
    let bundle = RecordPushBundle::from_value(document)?;
    let mut report = VerifyReport::empty(DocumentForm::RecordPushBundle);
    let main = verify_main_record(&mut report, bundle.capsule);
    verify_log_proof(
        &mut report,
        main.as_ref().map(|(sealed, _)| sealed),
        &bundle.proof,
        &bundle.checkpoint,
    );
    let split = main.as_ref().and_then(|(_, split)| split.as_ref());
    let records: &[Value] = bundle
        .split_stage_records
        .map(Vec::as_slice)
        .unwrap_or_default();
    let carried = verify_carried(&mut report, records, split.map(|(_, r)| r));
    if let Some((own, receipt)) = split {
        run_hop_check(&mut report, own, receipt, &carried);
    } else if !records.is_empty() {
        report.hop_error =
            Some("stage records are carried but the main record has no valid split".into());
    }
    Ok(report)
}

/// The main record's place in its sealer's transparency log: the
/// checkpoint's signature, that the main record's key signed it, and the
/// inclusion proof under its root.
fn verify_log_proof(
    report: &mut VerifyReport,
    main: Option<&SealedRecord>,
    proof: &crate::bundle::InclusionProof,
    checkpoint: &crate::bundle::Checkpoint,
) {
    let checkpoint_subject = format!(
        "checkpoint {} size {}",
        checkpoint.log_id, checkpoint.mmr_size
    );
    report.checks.push(Check {
        subject: checkpoint_subject.clone(),
        property: "Ed25519 signature over its JCS digest",
        outcome: checkpoint.verify_signature().map_err(|e| e.to_string()),
    });
    if let Some(sealed) = main {
        report.checks.push(Check {
            subject: checkpoint_subject,
            property: "signed by the main record's key",
            outcome: if sealed.key_id() == checkpoint.key_id {
                Ok(())
            } else {
                Err("checkpoint key_id differs from the main record's key_id".into())
            },
        });
        report.checks.push(Check {
            subject: format!("main record {}", short(&sealed.capsule_id())),
            property: "MMR inclusion proof under the checkpoint root",
            outcome: crate::bundle::verify_inclusion(proof, checkpoint, &sealed.capsule_id())
                .map_err(|e| e.to_string()),
        });
    }
}

/// Form (c): this project's `mesh_bundle`.
pub fn verify_mesh_bundle(document: &Value) -> Result<VerifyReport, DocumentError> {
    check_mesh_bundle(document).map(|checked| checked.report)
}

/// Form (d): this project's `mesh1_bundle`, a serve one node ran whole:
/// its receipt verifies and carries no split or resume (a split's evidence
/// is its records, which only a `mesh_bundle` carries), follows the
/// previous envelope when given, and its route table recomputes.
pub fn verify_mesh1_bundle(document: &Value) -> Result<VerifyReport, DocumentError> {
    let bundle = Mesh1Bundle::from_value(document)?;
    let mut report = VerifyReport::empty(DocumentForm::Mesh1Bundle);
    let sealed = match crate::mesh1::SealedReceipt::verify(&bundle.mesh1_envelope) {
        Ok(sealed) => sealed,
        Err(error) => {
            report.checks.push(Check {
                subject: "mesh/1 receipt".into(),
                property: "COSE signature and receipt rules",
                outcome: Err(error.to_string()),
            });
            return Ok(report);
        }
    };
    let subject = format!("mesh/1 receipt #{}", sealed.receipt.sequence);
    report.checks.push(Check {
        subject: subject.clone(),
        property: "COSE signature and receipt rules",
        outcome: Ok(()),
    });
    report.checks.push(Check {
        subject: subject.clone(),
        property: "a serve one node ran whole (backend mesh-node/local, no split, no resume)",
        outcome: match (&sealed.receipt.split, &sealed.receipt.resumed) {
            _ if sealed.receipt.backend != crate::replay::LOCAL_BACKEND => Err(format!(
                "the receipt's backend is {:?}, not {:?}: a stage's or another backend's receipt is not a whole serve",
                sealed.receipt.backend,
                crate::replay::LOCAL_BACKEND
            )),
            (None, None) => Ok(()),
            _ => Err(
                "the receipt is a split's: its records come in a mesh_bundle, not a mesh1_bundle"
                    .into(),
            ),
        },
    });
    if let Some(previous) = &bundle.mesh1_prev_envelope {
        report.checks.push(follows(subject, &sealed, previous));
    }
    verify_route_table(&mut report, bundle.route, &sealed.receipt);
    Ok(report)
}

/// A verified main record, with its own slice and split receipt when it
/// carries a valid split.
type MainRecord = (SealedRecord, Option<(StageBlock, CoordinatorReceipt)>);

/// A `mesh_bundle` checked: the report, what its main record gave, and
/// whether it stands alone (no envelope, no segments of its own), as an
/// earlier segment of a resumed request must.
struct CheckedBundle {
    report: VerifyReport,
    main: Option<MainRecord>,
    standalone: bool,
}

fn check_mesh_bundle(document: &Value) -> Result<CheckedBundle, DocumentError> {
    let bundle = MeshBundle::from_value(document)?;
    let mut report = VerifyReport::empty(DocumentForm::MeshBundle);
    let main = verify_main_record(&mut report, bundle.main_record);
    if let Some((proof, checkpoint)) = &bundle.log_proof {
        verify_log_proof(
            &mut report,
            main.as_ref().map(|(sealed, _)| sealed),
            proof,
            checkpoint,
        );
    }
    let split = main.as_ref().and_then(|(_, split)| split.as_ref());
    let carried = verify_carried(
        &mut report,
        bundle.split_stage_records,
        split.map(|(_, r)| r),
    );
    let mut resumed = None;
    if let Some((sealed, _)) = &main {
        verify_stage_exchange_records(
            &mut report,
            sealed,
            split.map(|(own, _)| own.manifest_sha256),
            bundle.stage_exchange_records,
        );
        if let Some(envelope) = &bundle.mesh1_envelope {
            let receipt = verify_mesh1_link(
                &mut report,
                sealed,
                envelope,
                bundle.mesh1_prev_envelope.as_deref(),
            );
            if let Some(receipt) = &receipt {
                verify_route_table(&mut report, bundle.route, &receipt.receipt);
            }
            resumed = receipt.and_then(|receipt| receipt.receipt.resumed);
        }
    }
    if let Some((_, receipt)) = split {
        let stewards = bundle.stewards.as_deref();
        if let (Some(stewards), Some((sealed, _))) = (stewards, &main) {
            report.checks.push(Check {
                subject: "stewards".into(),
                property: "entry 0 is the coordinator; each stage once, as routed",
                outcome: check_stewards(stewards, receipt, &sealed.key_id())
                    .map_err(|e| e.to_string()),
            });
        }
        verify_stage_keys(
            &mut report,
            receipt,
            bundle.split_stage_records,
            stewards.unwrap_or_default(),
        );
        verify_stage_receipts(&mut report, receipt, &bundle.stage_receipts);
    }
    match split {
        Some((own, receipt)) => run_hop_check(&mut report, own, receipt, &carried),
        None => {
            report.hop_error =
                Some("the main record carries no valid split (own slice and receipt)".into())
        }
    }
    if let Some(audit) = &bundle.audit {
        verify_audit(&mut report, audit, main.as_ref());
    }
    verify_segments(&mut report, &bundle, resumed.as_deref(), main.as_ref());
    Ok(CheckedBundle {
        report,
        standalone: bundle.mesh1_envelope.is_none() && bundle.earlier_segments.is_empty(),
        main,
    })
}

/// The coordinator's audit: signed with the main record's key, naming this
/// request and its chain's stages in order, and every stage passed. A
/// failed audit names the stage that computed wrongly.
fn verify_audit(
    report: &mut VerifyReport,
    audit: &crate::audit::SignedAudit,
    main: Option<&MainRecord>,
) {
    let statement = &audit.statement;
    let subject = format!("audit of request {}", statement.request_id);
    let Some((sealed, Some((own, receipt)))) = main else {
        report.checks.push(Check {
            subject,
            property: "checked against the main record's split",
            outcome: Err("the main record carries no valid split".into()),
        });
        return;
    };
    report.checks.push(Check {
        subject: subject.clone(),
        property: "signed by the coordinator (the main record's key)",
        outcome: if audit.signed_by(&sealed.key_id()) {
            Ok(())
        } else {
            Err("the signature is not the main record's key's".into())
        },
    });
    let nodes = routed_nodes(receipt);
    let names_it = statement.coordinator_node_id == own.coordinator_node_id
        && statement.run_id == own.run_id
        && statement.request_id == own.request_id
        && statement.stages.len() + 1 == nodes.len()
        && statement
            .stages
            .iter()
            .zip(nodes.iter().skip(1))
            .all(|(stage, node)| &stage.node_id == node);
    report.checks.push(Check {
        subject: subject.clone(),
        property: "names this request and its chain's stages",
        outcome: if names_it {
            Ok(())
        } else {
            Err("it names another request, run or chain".into())
        },
    });
    report.checks.push(Check {
        subject,
        property: "every stage's output is what its layers give",
        outcome: match statement.failed() {
            None => Ok(()),
            Some(failed) => Err(format!(
                "stage {} ({}) computed wrongly{}: its layers give {}, it sent {}",
                failed.stage_index,
                failed.node_id,
                failed
                    .step
                    .map_or(String::new(), |step| format!(" at step {step}")),
                failed.expected.as_deref().unwrap_or("?"),
                failed.claimed.as_deref().unwrap_or("?"),
            )),
        },
    });
    report.audit = Some(statement.clone());
}

/// The chain nodes a split receipt routed, stage 0 first.
fn routed_nodes(receipt: &CoordinatorReceipt) -> Vec<String> {
    receipt
        .topology
        .iter()
        .map(|entry| entry.assignment.node_id.clone())
        .collect()
}

/// A main record and its split receipt, when it carries a valid split.
fn routed(main: &MainRecord) -> Option<(&SealedRecord, &CoordinatorReceipt)> {
    let (sealed, split) = main;
    split.as_ref().map(|(_, receipt)| (sealed, receipt))
}

/// A resumed request: the receipt's resume block (`resumed`, from the
/// verified envelope) lists every segment, and the bundle carries exactly
/// those, each checked as a bundle of its own.
fn verify_segments(
    report: &mut VerifyReport,
    bundle: &MeshBundle<'_>,
    resumed: Option<&[u8]>,
    main: Option<&MainRecord>,
) {
    let Some(bytes) = resumed else {
        if !bundle.earlier_segments.is_empty() {
            report.checks.push(Check {
                subject: "earlier segments".into(),
                property: "listed by the receipt's resume block",
                outcome: Err(format!(
                    "the bundle carries {} earlier segments but the receipt lists none",
                    bundle.earlier_segments.len()
                )),
            });
        }
        return;
    };
    // The receipt verified, so its resume block parses.
    let Some(block) = crate::json::parse_strict(bytes)
        .ok()
        .and_then(|value| crate::resume::ResumeBlock::from_value(&value).ok())
    else {
        return;
    };
    report.checks.push(Check {
        subject: "resume block".into(),
        property: "the bundle carries every segment it lists",
        outcome: if block.segments.len() == bundle.earlier_segments.len() + 1 {
            Ok(())
        } else {
            Err(format!(
                "the receipt lists {} segments, the bundle carries {}",
                block.segments.len(),
                bundle.earlier_segments.len() + 1
            ))
        },
    });
    let segment_matches = |entry: &crate::resume::Segment,
                           sealed: &SealedRecord,
                           receipt: &CoordinatorReceipt|
     -> Result<(), String> {
        if entry.main_record != sealed.capsule_id() {
            return Err("its main record is not the one the receipt lists".into());
        }
        if entry.run_id != receipt.run_id {
            return Err(format!(
                "it ran as {}, the receipt lists {}",
                receipt.run_id, entry.run_id
            ));
        }
        if entry.nodes != routed_nodes(receipt) {
            return Err("its chain is not the one the receipt lists".into());
        }
        Ok(())
    };
    let final_segment = main.and_then(routed);
    if let (Some(last), Some((sealed, receipt))) = (block.segments.last(), final_segment) {
        report.checks.push(Check {
            subject: format!("segment {}", block.segments.len() - 1),
            property: "main record, run and chain are the resume block's last segment",
            outcome: segment_matches(last, sealed, receipt),
        });
    }
    for (k, (document, entry)) in bundle
        .earlier_segments
        .iter()
        .zip(&block.segments)
        .enumerate()
    {
        let subject = format!("segment {k}");
        let checked = match check_mesh_bundle(document) {
            Ok(checked) if checked.standalone => checked,
            outcome => {
                report.checks.push(Check {
                    subject,
                    property: "a bundle of its own",
                    outcome: Err(match outcome {
                        Ok(_) => "an earlier segment carries no envelope or segments of its own"
                            .to_string(),
                        Err(error) => error.to_string(),
                    }),
                });
                continue;
            }
        };
        let segment = checked.main.as_ref().and_then(routed);
        let lost_stages: Vec<u32> = segment.map_or_else(Vec::new, |(_, receipt)| {
            routed_nodes(receipt)
                .iter()
                .enumerate()
                .filter(|(_, node)| entry.lost.contains(node))
                .filter_map(|(k, _)| u32::try_from(k).ok())
                .collect()
        });
        report.checks.push(Check {
            subject: subject.clone(),
            property: "main record, run and chain are the resume block's",
            outcome: match segment {
                Some((sealed, receipt)) => segment_matches(entry, sealed, receipt),
                None => Err("its main record carries no valid split".into()),
            },
        });
        if let (Some((sealed, _)), Some((final_sealed, _))) = (segment, final_segment) {
            report.checks.push(Check {
                subject,
                property: "sealed by the same coordinator",
                outcome: if sealed.key_id() == final_sealed.key_id() {
                    Ok(())
                } else {
                    Err("another key signed this segment's main record".into())
                },
            });
        }
        report.earlier_segments.push(SegmentReport {
            report: checked.report,
            lost_stages,
        });
    }
    report.resume = Some(block);
}

/// The coordinator's stage-exchange records must be exactly the ones the main
/// record cites as `split_stage`, signed by the same key.
fn verify_stage_exchange_records(
    report: &mut VerifyReport,
    main: &SealedRecord,
    own_manifest: Option<[u8; 32]>,
    records: &[Value],
) {
    let cited: Vec<[u8; 32]> = match references_of(main.value()) {
        Ok(refs) => refs
            .into_iter()
            .filter(|(_, purpose)| purpose == "split_stage")
            .map(|(digest, _)| digest)
            .collect(),
        Err(error) => {
            report.checks.push(Check {
                subject: "main record".into(),
                property: "references well formed",
                outcome: Err(error.to_string()),
            });
            return;
        }
    };
    let mut ids = Vec::new();
    for record in records {
        let subject = format!(
            "stage-exchange record {}",
            record
                .get("capsule_id")
                .and_then(Value::as_str)
                .and_then(|s| s.get(..12))
                .unwrap_or("?")
        );
        let outcome = SealedRecord::verify(record.clone())
            .map_err(|e| e.to_string())
            .and_then(|sealed| {
                if sealed.key_id() != main.key_id() {
                    return Err("not signed by the coordinator's key".to_string());
                }
                match sealed.stage_block() {
                    Ok(b) if b.side == Side::Coordinator && b.stage_index >= 1 => {
                        // A manifest is package-wide: what the coordinator
                        // assigned any stage is what it holds itself.
                        if own_manifest.is_some_and(|own| own != b.manifest_sha256) {
                            return Err(format!(
                                "stage {}'s manifest_sha256 is not the own slice's (a manifest is package-wide)",
                                b.stage_index
                            ));
                        }
                    }
                    Ok(_) => return Err("not a stage-exchange block".to_string()),
                    Err(e) => return Err(e.to_string()),
                }
                ids.push(sealed.capsule_id());
                Ok(())
            });
        report.checks.push(Check {
            subject,
            property: "capsule_id, COSE signature by the coordinator, exchange block, package-wide manifest",
            outcome,
        });
    }
    report.checks.push(Check {
        subject: "main record".into(),
        property: "split_stage references name the carried stage-exchange records",
        outcome: if ids == cited {
            Ok(())
        } else {
            Err(format!(
                "main record cites {} stage-exchange records, bundle carries {} matching",
                cited.len(),
                ids.iter().filter(|id| cited.contains(id)).count()
            ))
        },
    });
}

/// The route table beside a receipt (SPEC §4): it recomputes to the
/// receipt's signed `route` line. A receipt whose line names a table
/// needs the table; one that names none (sealed before routing, or by
/// another implementation) is not checked.
fn verify_route_table(
    report: &mut VerifyReport,
    table: Option<&Value>,
    receipt: &crate::mesh1::MeshReceipt,
) {
    let outcome = match table {
        Some(table) => crate::route::check_table(table, receipt)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        None if receipt.route.contains("; table ") => {
            Err("the receipt's route names a route table the bundle does not carry".into())
        }
        None => return,
    };
    report.checks.push(Check {
        subject: "route table".into(),
        property: "every backend weighed; the cheapest admissible chosen, as the receipt's route says",
        outcome,
    });
}

/// The `mesh/1` receipt: it verifies, it was sealed by the key that signed
/// the main record, its `split` member is exactly that record's receipt
/// block, and (given the previous envelope) it follows it in the chain.
fn verify_mesh1_link(
    report: &mut VerifyReport,
    main: &SealedRecord,
    envelope: &[u8],
    previous: Option<&[u8]>,
) -> Option<crate::mesh1::SealedReceipt> {
    let sealed = match crate::mesh1::SealedReceipt::verify(envelope) {
        Ok(sealed) => sealed,
        Err(error) => {
            report.checks.push(Check {
                subject: "mesh/1 receipt".into(),
                property: "COSE signature and receipt rules",
                outcome: Err(error.to_string()),
            });
            return None;
        }
    };
    let subject = format!("mesh/1 receipt #{}", sealed.receipt.sequence);
    report.checks.push(Check {
        subject: subject.clone(),
        property: "COSE signature and receipt rules",
        outcome: Ok(()),
    });
    report.checks.push(Check {
        subject: subject.clone(),
        property: "sealed by the main record's signer",
        outcome: if sealed.receipt.steward == crate::identity::did_key(&main.key_id()) {
            Ok(())
        } else {
            Err("the receipt's steward is not the key that signed the main record".into())
        },
    });
    let block = main.value().pointer(&format!(
        "{}/{RECEIPT_BLOCK_MEMBER}",
        crate::capsule::COMPUTE_ATTESTATION_PATH
    ));
    report.checks.push(Check {
        subject: subject.clone(),
        property: "`split` is the main record's coordinator receipt block",
        outcome: match (block, &sealed.receipt.split) {
            (Some(block), Some(bytes)) if crate::json::canonical_bytes(block) == *bytes => Ok(()),
            (_, None) => Err("the receipt carries no split block".into()),
            _ => Err("the receipt's split block differs from the main record's".into()),
        },
    });
    if let Some(previous) = previous {
        report.checks.push(follows(subject, &sealed, previous));
    }
    Some(sealed)
}

/// The check that `sealed` follows the `previous` envelope in its
/// steward's chain (sequence and `prev`).
fn follows(subject: String, sealed: &crate::mesh1::SealedReceipt, previous: &[u8]) -> Check {
    Check {
        subject,
        property: "follows the previous envelope (sequence, prev)",
        outcome: crate::mesh1::SealedReceipt::verify(previous)
            .map_err(|e| format!("previous envelope: {e}"))
            .and_then(|p| sealed.check_follows(&p).map_err(|e| e.to_string())),
    }
}

/// A bundle's `stewards` list that cannot be believed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StewardsError {
    #[error("the stewards list is empty")]
    Empty,
    #[error(
        "entry 0 must be stage 0, the coordinator that signed the main record, not stage {stage_index} {node_id}"
    )]
    FirstNotCoordinator { stage_index: u32, node_id: String },
    #[error("stage {0} is listed more than once")]
    DuplicateIndex(u32),
    #[error("stage {index} is listed but the receipt routes only {stage_count} stages")]
    UnknownIndex { index: u32, stage_count: usize },
    #[error("stage {index} is listed as {listed} but the receipt routed it to {assigned}")]
    NotAssigned {
        index: u32,
        listed: String,
        assigned: String,
    },
    #[error("stage {0} is routed by the receipt but missing from the list")]
    Missing(u32),
}

/// The `stewards` list of a bundle: entry 0 is stage 0 and names the
/// coordinator whose key signed the main record; every stage the receipt
/// routes is listed once, with the node it routed it to.
pub fn check_stewards(
    stewards: &[(u32, String)],
    receipt: &CoordinatorReceipt,
    main_key: &[u8; 32],
) -> Result<(), StewardsError> {
    let (first_index, first_node) = stewards.first().ok_or(StewardsError::Empty)?;
    let coordinator = crate::identity::did_key(main_key);
    if *first_index != 0 || *first_node != coordinator || receipt.coordinator_node_id != coordinator
    {
        return Err(StewardsError::FirstNotCoordinator {
            stage_index: *first_index,
            node_id: first_node.clone(),
        });
    }
    let mut seen = BTreeSet::new();
    for (index, node) in stewards {
        if !seen.insert(*index) {
            return Err(StewardsError::DuplicateIndex(*index));
        }
        let entry = receipt
            .topology
            .get(*index as usize)
            .ok_or(StewardsError::UnknownIndex {
                index: *index,
                stage_count: receipt.topology.len(),
            })?;
        if *node != entry.assignment.node_id {
            return Err(StewardsError::NotAssigned {
                index: *index,
                listed: node.clone(),
                assigned: entry.assignment.node_id.clone(),
            });
        }
    }
    if let Some(missing) = (0..receipt.topology.len())
        .filter_map(|k| u32::try_from(k).ok())
        .find(|k| !seen.contains(k))
    {
        return Err(StewardsError::Missing(missing));
    }
    Ok(())
}

/// Where the receipt routes a stage to a node whose id is a did:key, the
/// stage's record must be signed by that node's key (this closes the gap the
/// Mesh-LLM design leaves open, for bundles that name their stewards).
/// Each stage receipt the bundle carries is its stage's: a stage the
/// split routes (not the coordinator's), carried once, sealed by the node
/// routed it, naming this split's stage, run and request.
fn verify_stage_receipts(
    report: &mut VerifyReport,
    receipt: &CoordinatorReceipt,
    carried: &[crate::stage_receipt::CarriedStageReceipt],
) {
    for (i, entry) in carried.iter().enumerate() {
        let k = entry.stage_index;
        let node = receipt
            .topology
            .get(k as usize)
            .filter(|_| k > 0)
            .map(|t| t.assignment.node_id.clone());
        let outcome = match node {
            None => Err(format!("stage {k} is not a stage the split routed")),
            Some(_) if carried[..i].iter().any(|e| e.stage_index == k) => {
                Err(format!("stage {k}'s receipt is carried twice"))
            }
            Some(node) => crate::stage_receipt::check_stage_receipt(
                &entry.envelope,
                k,
                &receipt.run_id,
                receipt.request_id,
                &node,
            )
            .map(|sealed| {
                report.stage_receipts.push(StageReceiptReport {
                    stage_index: k,
                    node,
                    sealed,
                })
            })
            .map_err(|e| e.to_string()),
        };
        report.checks.push(Check {
            subject: format!("stage {k}'s mesh/1 receipt"),
            property: "sealed by the node routed the stage, for this split's request",
            outcome,
        });
    }
    report.stage_receipts.sort_by_key(|r| r.stage_index);
}

fn verify_stage_keys(
    report: &mut VerifyReport,
    receipt: &CoordinatorReceipt,
    records: &[Value],
    stewards: &[(u32, String)],
) {
    for record in records {
        let Ok(sealed) = SealedRecord::verify(record.clone()) else {
            continue;
        };
        let Ok(block) = sealed.stage_block() else {
            continue;
        };
        let Some(entry) = receipt.topology.get(block.stage_index as usize) else {
            continue;
        };
        let Some(assigned) = crate::identity::parse_did_key(&entry.assignment.node_id) else {
            continue;
        };
        let listed = stewards
            .iter()
            .find(|(k, _)| *k == block.stage_index)
            .map(|(_, node)| node.as_str());
        report.checks.push(Check {
            subject: format!("stage record {}", hex::encode(&sealed.capsule_id()[..6])),
            property: "signed by the node the receipt routed its stage to",
            outcome: if sealed.key_id() == assigned
                && listed.is_none_or(|n| n == entry.assignment.node_id)
            {
                Ok(())
            } else {
                Err(format!(
                    "stage {} was routed to {}",
                    block.stage_index, entry.assignment.node_id
                ))
            },
        });
    }
}
