//! `mesh-node weights plan|record|show`: a backend's weights change record
//! (SPEC §6.5), kept in the node's steward journal (`DATA/steward`), and
//! `verify --change-record`'s coverage check.
//!
//! `plan` and `record` open the journal as its steward, so the node must be
//! stopped; a serving node reads the record when it starts, and from then
//! on serves and seals only the weights in effect.

use std::path::{Path, PathBuf};

use anyhow::Context;
use mesh_protocol::change::{
    ChangeEntry, ChangeKind, ChangeRecord, Coverage, Plan, SealedChange, WeightsChange,
};
use mesh_protocol::mesh1::{Fidelity, SealedReceipt};
use serde_json::{Value, json};

use crate::runtime::steward::Steward;

/// The backend a coordinator's receipts name (`mesh-node/split`).
pub const DEFAULT_BACKEND: &str = mesh_protocol::replay::SPLIT_BACKEND;

/// What a `weights` command names the backend and its model by.
#[derive(Debug, Clone)]
pub struct Target {
    pub data: PathBuf,
    pub key: PathBuf,
    pub backend: String,
    /// The model file: its name is the recipe, its weights digest the `to`.
    pub model: PathBuf,
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn fidelity(level: u64) -> anyhow::Result<Fidelity> {
    Fidelity::from_level(level).with_context(|| format!("fidelity {level}: give 0 to 4"))
}

fn steward(target: &Target) -> anyhow::Result<Steward> {
    let key = crate::runtime::keys::load(&target.key)?;
    Ok(Steward::open(
        &target.data.join("steward"),
        key,
        Box::new(crate::runtime::energy::EstimatorMeter::default()),
    )?)
}

/// The recipe a coordinator's receipts name for `model`: its file name.
pub fn recipe_of(model: &Path) -> String {
    model
        .file_name()
        .map_or("model".to_string(), |f| f.to_string_lossy().into_owned())
}

fn describe(sealed: &SealedChange) -> Value {
    let entry = &sealed.entry;
    let mut value = json!({
        "id": mesh_protocol::hex::encode(&sealed.id()),
        "seq": entry.seq,
        "backend": entry.backend,
        "recipe": entry.recipe,
        "made_at": entry.made_at,
    });
    match &entry.kind {
        ChangeKind::Plan(plan) => {
            value["kind"] = json!("plan");
            value["precisions"] = json!(plan.precisions);
            value["fidelity_floor"] = json!(plan.fidelity_floor.level());
            value["validation"] = json!(plan.validation);
            value["foresees"] = json!(plan.foresees);
            value["risk_assessment"] = json!(plan.risk_assessment);
        }
        ChangeKind::Weights(change) => {
            value["kind"] = json!("weights");
            value["from"] = json!(change.from.map(|f| mesh_protocol::hex::encode(&f)));
            value["to"] = json!(mesh_protocol::hex::encode(&change.to));
            value["precision"] = json!(change.precision);
            value["fidelity"] = json!(change.fidelity.level());
            value["plan"] = json!(change.plan.map(|p| mesh_protocol::hex::encode(&p)));
            value["validation_result"] = json!(change.validation_result);
            value["effective_from"] = json!(change.effective_from);
            value["reason"] = json!(change.reason);
        }
    }
    value
}

/// `weights plan`: record the changes the steward foresees.
pub fn plan(
    target: &Target,
    precisions: Vec<String>,
    fidelity_floor: u64,
    validation: String,
    foresees: String,
    risk_assessment: Option<String>,
) -> anyhow::Result<Value> {
    let mut steward = steward(target)?;
    let sealed = steward.record_change(entry(
        target,
        ChangeKind::Plan(Plan {
            precisions,
            fidelity_floor: fidelity(fidelity_floor)?,
            validation,
            foresees,
            risk_assessment,
        }),
    ))?;
    Ok(describe(&sealed))
}

/// An entry of `target`'s record, made now; the steward sets its place in
/// the record (and a weights change's `effective_from`).
fn entry(target: &Target, kind: ChangeKind) -> ChangeEntry {
    ChangeEntry {
        backend: target.backend.clone(),
        recipe: recipe_of(&target.model),
        seq: 0,
        prev: None,
        made_at: now_s(),
        kind,
    }
}

/// What `weights record` records besides the model.
#[derive(Debug, Clone)]
pub struct Change {
    /// `None`: the model's own (`ModelHandle::precision`).
    pub precision: Option<String>,
    pub fidelity: u64,
    pub plan: Option<String>,
    pub validation_result: Option<String>,
    pub reason: String,
}

/// `weights record`: the model's weights are in effect from now on.
pub fn record(target: &Target, change: Change) -> anyhow::Result<Value> {
    let handle = mesh_stage::ModelHandle::open(&target.model)?;
    let to = handle.weights_digest();
    // What a CPU node serving it with the default wire names.
    let precision = change.precision.unwrap_or_else(|| {
        handle
            .precision(mesh_stage::frame::WireDType::F32)
            .to_string()
    });
    let mut steward = steward(target)?;
    let from = steward
        .change_record(&target.backend)
        .and_then(ChangeRecord::weights_in_effect);
    let plan = change
        .plan
        .as_deref()
        .map(|hex| mesh_protocol::hex::decode_array::<32>(hex).context("--plan is 32 bytes of hex"))
        .transpose()?;
    let sealed = steward.record_change(entry(
        target,
        ChangeKind::Weights(WeightsChange {
            from,
            to,
            precision: Some(precision),
            fidelity: fidelity(change.fidelity)?,
            plan,
            validation_result: change.validation_result,
            // Set by the steward: its next receipt, the first served on them.
            effective_from: 0,
            reason: change.reason,
        }),
    ))?;
    Ok(describe(&sealed))
}

/// A record as `show --out` writes it and `verify --change-record` reads it.
pub fn record_document(record: &ChangeRecord) -> Value {
    json!({
        "mesh_change_record": 1,
        "backend": record.backend(),
        "steward_did": record.entries().first().map(|e| mesh_protocol::identity::did_key(&e.steward)),
        "record": record.entries().iter().map(|e| mesh_protocol::hex::encode(&e.envelope)).collect::<Vec<_>>(),
    })
}

/// `weights show`: every backend's record in the journal, read-only (the
/// node stopped).
pub fn show(data: &Path, backend: Option<&str>) -> anyhow::Result<Vec<ChangeRecord>> {
    let records = crate::runtime::journal::Journal::read(&data.join("steward"))?;
    let mut by_backend: std::collections::BTreeMap<String, Vec<Vec<u8>>> = Default::default();
    let mut steward = None;
    for record in records {
        if let crate::runtime::journal::Entry::Changed { envelope } = record.entry {
            let sealed = SealedChange::verify(&envelope)?;
            steward.get_or_insert(sealed.steward);
            by_backend
                .entry(sealed.entry.backend.clone())
                .or_default()
                .push(envelope);
        }
    }
    let mut out = Vec::new();
    for (name, envelopes) in by_backend {
        if backend.is_some_and(|b| b != name) {
            continue;
        }
        let key = steward.context("a change record without a steward")?;
        let record = ChangeRecord::from_envelopes(&name, key, envelopes.iter().map(Vec::as_slice))
            .map_err(|(k, e)| anyhow::anyhow!("{name}: entry {k}: {e}"))?;
        out.push(record);
    }
    Ok(out)
}

/// Render records for people.
pub fn render(records: &[ChangeRecord]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if records.is_empty() {
        out.push_str("no change record: every backend serves whatever weights its engine loads\n");
    }
    for record in records {
        let _ = writeln!(
            out,
            "backend {}: {} entries",
            record.backend(),
            record.entries().len()
        );
        for sealed in record.entries() {
            let e = &sealed.entry;
            let what = match &e.kind {
                ChangeKind::Plan(plan) => format!(
                    "plan     precisions {:?}, floor F{}, foresees {:?}",
                    plan.precisions,
                    plan.fidelity_floor.level(),
                    plan.foresees
                ),
                ChangeKind::Weights(w) => format!(
                    "weights  {} -> {} from receipt {}{}, {:?}",
                    w.from
                        .map_or("(none)".into(), |f| mesh_protocol::hex::encode(&f[..8])),
                    mesh_protocol::hex::encode(&w.to[..8]),
                    w.effective_from,
                    if w.plan.is_some() {
                        ", under a plan"
                    } else {
                        ", unplanned"
                    },
                    w.reason
                ),
            };
            let _ = writeln!(out, "  #{} {} {what}", e.seq, e.recipe);
        }
        if let Some(weights) = record.weights_in_effect() {
            let _ = writeln!(out, "  in effect: {}", mesh_protocol::hex::encode(&weights));
        }
    }
    out
}

/// Read a record document (`weights show --out`).
pub fn read_record(path: &Path) -> anyhow::Result<ChangeRecord> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let value = mesh_protocol::json::parse_strict(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", path.display()))?;
    let backend = value["backend"].as_str().context("no `backend`")?;
    let steward = value["steward_did"]
        .as_str()
        .and_then(mesh_protocol::identity::parse_did_key)
        .context("no `steward_did`")?;
    let envelopes = value["record"]
        .as_array()
        .context("no `record`")?
        .iter()
        .map(|e| {
            e.as_str()
                .and_then(mesh_protocol::hex::decode)
                .context("an entry is not hex")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    ChangeRecord::from_envelopes(backend, steward, envelopes.iter().map(Vec::as_slice))
        .map_err(|(k, e)| anyhow::anyhow!("entry {k}: {e}"))
}

/// `verify RECEIPT --change-record FILE`: whether the receipt is covered.
pub fn coverage(receipt: &SealedReceipt, record: &ChangeRecord) -> Result<Value, String> {
    match record.covers(&receipt.receipt) {
        Coverage::Covered(entry) => Ok(json!({
            "covered": true,
            "by": describe(entry),
        })),
        Coverage::NotCovered(why) => Err(why),
    }
}
