//! `mesh-node log show|prove|checkpoint`: a node's transparency log (every
//! record it sealed, an MMR of record ids, `split-stage.md` §3.3), read
//! from its steward journal (`DATA/steward`) with the node stopped.

use std::path::Path;

use anyhow::Context;
use mesh_protocol::bundle::{Checkpoint, MmrLog};
use serde_json::{Value, json};

use crate::runtime::journal::{Entry, Journal};

/// The log as the journal holds it, and its record ids in order.
fn read(data: &Path) -> anyhow::Result<(MmrLog, Vec<[u8; 32]>)> {
    let records = Journal::read(&data.join("steward"))?;
    let mut log = MmrLog::new();
    let mut ids = Vec::new();
    for record in records {
        if let Entry::Logged { capsule_id } = record.entry {
            log.append(&capsule_id);
            ids.push(capsule_id);
        }
    }
    Ok((log, ids))
}

/// `log show`: its size, root and records.
pub fn show(data: &Path) -> anyhow::Result<Value> {
    let (log, ids) = read(data)?;
    Ok(json!({
        "records": ids.len(),
        "mmr_size": log.size(),
        "root": log.root().map(|r| mesh_protocol::hex::encode(&r)),
        "record_ids": ids.iter().map(|id| mesh_protocol::hex::encode(id)).collect::<Vec<_>>(),
    }))
}

/// `log prove ID`: the inclusion proof of one record at the log's size.
pub fn prove(data: &Path, capsule_id: &str) -> anyhow::Result<Value> {
    let id = mesh_protocol::hex::decode_array::<32>(capsule_id.trim())
        .context("a record id is 32 bytes of hex")?;
    let (log, ids) = read(data)?;
    let leaf = ids
        .iter()
        .position(|logged| *logged == id)
        .with_context(|| format!("record {capsule_id} is not in this node's log"))?;
    let proof = log.prove(leaf as u64).context("no proof at this size")?;
    Ok(json!({
        "leaf_index": leaf,
        "proof": proof.to_value(),
        "root": log.root().map(|r| mesh_protocol::hex::encode(&r)),
    }))
}

/// `log checkpoint`: a checkpoint of the log as it is, signed by the
/// node's key (the steward key that sealed its records).
pub fn checkpoint(data: &Path, key: &mesh_protocol::SigningKey) -> anyhow::Result<Value> {
    let (log, _) = read(data)?;
    let root = log
        .root()
        .context("the log is empty: nothing to checkpoint")?;
    let did = mesh_protocol::identity::did_key(&key.verifying_key().to_bytes());
    let timestamp = mesh_protocol::capsule::format_timestamp(crate::runtime::serve::now_ms());
    let value = Checkpoint::sign(&did, log.size(), &root, None, &timestamp, key);
    // What a verifier checks of it: its own signature.
    Checkpoint::from_value_at(&value, "")?
        .verify_signature()
        .context("the checkpoint just signed does not verify")?;
    Ok(value)
}
