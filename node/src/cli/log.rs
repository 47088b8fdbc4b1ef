//! `mesh-node log show|prove|checkpoint`: a node's transparency log (every
//! record it sealed, an MMR of record ids, `split-stage.md` §3.3), read
//! from its steward journal (`DATA/steward`) with the node stopped.

use std::path::Path;

use anyhow::Context;
use mesh_protocol::bundle::{Checkpoint, MmrLog};
use serde_json::{Value, json};

use crate::runtime::journal::{Entry, Journal};

/// A node's log as its journal holds it.
struct JournalledLog {
    log: MmrLog,
    /// Its record ids, in order.
    ids: Vec<[u8; 32]>,
    /// The last checkpoint the node issued over it (size, root).
    last_checkpoint: Option<(u64, [u8; 32])>,
}

fn read(data: &Path) -> anyhow::Result<JournalledLog> {
    let records = Journal::read(&data.join("steward"))?;
    let mut log = MmrLog::new();
    let mut ids = Vec::new();
    let mut last_checkpoint = None;
    for record in records {
        match record.entry {
            Entry::Logged { capsule_id } => {
                log.append(&capsule_id);
                ids.push(capsule_id);
            }
            Entry::Checkpointed { size, root } => last_checkpoint = Some((size, root)),
            _ => {}
        }
    }
    Ok(JournalledLog {
        log,
        ids,
        last_checkpoint,
    })
}

/// `log show`: its size, root and records.
pub fn show(data: &Path) -> anyhow::Result<Value> {
    let JournalledLog { log, ids, .. } = read(data)?;
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
    let JournalledLog { log, ids, .. } = read(data)?;
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
/// node's key (the steward key that sealed its records), naming the last
/// checkpoint the node issued as `prev`. It is not journalled (the
/// journal is read only): the node's own next checkpoint names the same
/// `prev`, over a log that only grew.
pub fn checkpoint(data: &Path, key: &mesh_protocol::SigningKey) -> anyhow::Result<Value> {
    let JournalledLog {
        log,
        last_checkpoint: last,
        ..
    } = read(data)?;
    let root = log
        .root()
        .context("the log is empty: nothing to checkpoint")?;
    let did = mesh_protocol::identity::did_key(&key.verifying_key().to_bytes());
    let timestamp = mesh_protocol::capsule::format_timestamp(crate::runtime::clock::now_ms());
    let value = Checkpoint::sign(
        &did,
        log.size(),
        &root,
        last.filter(|(size, _)| *size > 0),
        &timestamp,
        key,
    );
    // What a verifier checks of it: its own signature.
    Checkpoint::from_value_at(&value, "")?
        .verify_signature()
        .context("the checkpoint just signed does not verify")?;
    Ok(value)
}
