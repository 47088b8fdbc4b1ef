//! What rides around stage records: Mesh-LLM's `record_push_bundle` (an MMR
//! inclusion proof and a signed checkpoint of the sender's log) and this
//! project's own requester bundle `mesh_bundle`.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::hex;
use crate::json::{Members, Problem, ShapeError, canonical_bytes};

/// Most stage records one bundle may carry (counted before any is read).
pub const MAX_CARRIED_RECORDS: usize = 64;
/// Longest witness path or peak list accepted: an MMR of 2^64 nodes has
/// fewer than 64 levels.
pub const MAX_PROOF_PATH: usize = 64;

/// Why an inclusion proof or checkpoint does not hold.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProofError {
    #[error("{0}")]
    Shape(#[from] ShapeError),
    #[error("mmr size {0} is not the size of any MMR")]
    BadSize(u64),
    #[error("leaf {leaf_index} is not in an MMR of size {size}")]
    LeafOutOfRange { leaf_index: u64, size: u64 },
    #[error("the witness path does not end at a peak")]
    NotAPeak,
    #[error("peaks_left/peaks_right do not match the MMR's {0} peaks")]
    PeakCount(usize),
    #[error("recomputed root {computed} differs from the checkpoint's {claimed}")]
    RootMismatch { computed: String, claimed: String },
    #[error("checkpoint key_id is not a valid Ed25519 public key")]
    BadKey,
    #[error("checkpoint signature does not verify under its key_id")]
    BadSignature,
}

/// MMR leaf hash of a record: SHA-256(0x00 ‖ capsule_id).
pub fn mmr_leaf(capsule_id: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(capsule_id);
    h.finalize().into()
}

/// Interior node at 0-based position `pos`: SHA-256(u64be(pos+1) ‖ left ‖ right).
pub fn mmr_node(pos: u64, left: &[u8; 32], right: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update((pos + 1).to_be_bytes());
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// Bag peaks right to left, each step SHA-256(right ‖ left).
pub fn bag_peaks(peaks: &[[u8; 32]]) -> Option<[u8; 32]> {
    let (last, rest) = peaks.split_last()?;
    let mut acc = *last;
    for left in rest.iter().rev() {
        let mut h = Sha256::new();
        h.update(acc);
        h.update(left);
        acc = h.finalize().into();
    }
    Some(acc)
}

fn bit_length(x: u64) -> u32 {
    64 - x.leading_zeros()
}

/// Height of the node at 0-based position `pos` (leaves are 0).
fn pos_height(pos: u64) -> u32 {
    let mut one_based = pos.saturating_add(1);
    // Strip whole left subtrees until the position is the root of a perfect tree.
    while one_based != 0 && (one_based & (one_based + 1)) != 0 {
        let top = 1u64 << (bit_length(one_based) - 1);
        one_based = one_based - top + 1;
    }
    bit_length(one_based).saturating_sub(1)
}

/// Peak positions of an MMR with `size` nodes, left to right; `None` when no
/// MMR has that size.
pub fn mmr_peaks(size: u64) -> Option<Vec<u64>> {
    let mut peaks = Vec::new();
    let mut offset = 0u64;
    let mut remaining = size;
    let mut previous_height = u32::MAX;
    while remaining > 0 {
        // The largest perfect tree (2^(h+1) - 1 nodes) that fits.
        let height = bit_length(remaining.saturating_add(1)).saturating_sub(2);
        let tree = (1u64 << (height + 1)) - 1;
        if height >= previous_height {
            return None;
        }
        peaks.push(offset + tree - 1);
        offset += tree;
        remaining -= tree;
        previous_height = height;
    }
    Some(peaks)
}

/// 0-based MMR position of leaf `index`.
pub fn leaf_position(index: u64) -> Option<u64> {
    index
        .checked_mul(2)
        .map(|twice| twice - u64::from(index.count_ones()))
}

/// An inclusion proof of one leaf in an MMR of `size` nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InclusionProof {
    pub size: u64,
    pub leaf_index: u64,
    pub witness: Vec<[u8; 32]>,
    pub peaks_left: Vec<[u8; 32]>,
    pub peaks_right: Vec<[u8; 32]>,
}

fn hex_list(m: &mut Members<'_>, key: &'static str) -> Result<Vec<[u8; 32]>, ShapeError> {
    m.list(
        key,
        MAX_PROOF_PATH,
        "must be 64 lowercase hex digits",
        |item| item.as_str().and_then(hex::decode_array),
    )
}

impl InclusionProof {
    pub fn from_value_at(value: &Value, path: &str) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, path)?;
        let v_path = m.path("v");
        if m.u64("v")? != 1 {
            return Err(ShapeError::invalid(v_path, "must be 1"));
        }
        let kind_path = m.path("kind");
        if m.string("kind")? != "inclusion" {
            return Err(ShapeError::invalid(kind_path, "must be inclusion"));
        }
        let size = m.u64("size")?;
        let leaf_index = m.u64("leaf_index")?;
        let witness = hex_list(&mut m, "witness")?;
        let peaks_left = hex_list(&mut m, "peaks_left")?;
        let peaks_right = hex_list(&mut m, "peaks_right")?;
        m.finish()?;
        Ok(Self {
            size,
            leaf_index,
            witness,
            peaks_left,
            peaks_right,
        })
    }

    pub fn to_value(&self) -> Value {
        let list = |items: &[[u8; 32]]| items.iter().map(|d| hex::encode(d)).collect::<Vec<_>>();
        json!({
            "v": 1, "kind": "inclusion", "size": self.size, "leaf_index": self.leaf_index,
            "witness": list(&self.witness), "peaks_left": list(&self.peaks_left), "peaks_right": list(&self.peaks_right),
        })
    }

    /// The root this proof puts `leaf` under.
    pub fn root_for(&self, leaf: &[u8; 32]) -> Result<[u8; 32], ProofError> {
        let peaks = mmr_peaks(self.size).ok_or(ProofError::BadSize(self.size))?;
        let out_of_range = ProofError::LeafOutOfRange {
            leaf_index: self.leaf_index,
            size: self.size,
        };
        let mut pos = leaf_position(self.leaf_index).ok_or(out_of_range.clone())?;
        if pos >= self.size {
            return Err(out_of_range);
        }
        let mut hash = *leaf;
        for (height, sibling) in (0u32..).zip(&self.witness) {
            if pos_height(pos.saturating_add(1)) > height {
                // `pos` is a right child; its parent follows it.
                let parent = pos + 1;
                hash = mmr_node(parent, sibling, &hash);
                pos = parent;
            } else {
                let parent = 1u64
                    .checked_shl(height + 1)
                    .and_then(|step| pos.checked_add(step))
                    .ok_or(ProofError::NotAPeak)?;
                hash = mmr_node(parent, &hash, sibling);
                pos = parent;
            }
            if pos >= self.size {
                return Err(ProofError::NotAPeak);
            }
        }
        let peak_index = peaks
            .iter()
            .position(|p| *p == pos)
            .ok_or(ProofError::NotAPeak)?;
        if self.peaks_left.len() != peak_index
            || self.peaks_right.len() != peaks.len() - peak_index - 1
        {
            return Err(ProofError::PeakCount(peaks.len()));
        }
        let mut all = self.peaks_left.clone();
        all.push(hash);
        all.extend_from_slice(&self.peaks_right);
        bag_peaks(&all).ok_or(ProofError::PeakCount(peaks.len()))
    }
}

/// A signed checkpoint of a node's MMR log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub value: Value,
    pub log_id: String,
    pub mmr_size: u64,
    pub root: [u8; 32],
    pub prev_size: u64,
    pub prev_root: Option<[u8; 32]>,
    pub key_id: [u8; 32],
    pub timestamp: String,
    pub signature: [u8; 64],
}

impl Checkpoint {
    pub fn from_value_at(value: &Value, path: &str) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, path)?;
        let v_path = m.path("v");
        if m.u64("v")? != 1 {
            return Err(ShapeError::invalid(v_path, "must be 1"));
        }
        let kind_path = m.path("kind");
        if m.string("kind")? != "mmr_checkpoint" {
            return Err(ShapeError::invalid(kind_path, "must be mmr_checkpoint"));
        }
        let log_id = m.string("log_id")?.to_string();
        let mmr_size = m.u64("mmr_size")?;
        let hex32 = |m: &mut Members<'_>, key: &'static str| {
            let p = m.path(key);
            m.string(key).and_then(|t| {
                hex::decode_array(t)
                    .ok_or_else(|| ShapeError::invalid(p, "must be 64 lowercase hex digits"))
            })
        };
        let root = hex32(&mut m, "root")?;
        let prev_size = m.u64("prev_size")?;
        let prev_path = m.path("prev_root");
        let prev_text = m.string("prev_root")?;
        let prev_root = match (prev_size, prev_text) {
            (0, "") => None,
            (0, _) => {
                return Err(ShapeError::invalid(
                    prev_path,
                    "must be empty when prev_size is 0",
                ));
            }
            (_, text) => Some(hex::decode_array(text).ok_or_else(|| {
                ShapeError::invalid(prev_path, "must be 64 lowercase hex digits")
            })?),
        };
        let key_id = hex32(&mut m, "key_id")?;
        let timestamp = m.string("timestamp")?.to_string();
        let sig_path = m.path("signature");
        let signature = hex::decode_array(m.string("signature")?)
            .ok_or_else(|| ShapeError::invalid(sig_path, "must be 128 lowercase hex digits"))?;
        m.finish()?;
        Ok(Self {
            value: value.clone(),
            log_id,
            mmr_size,
            root,
            prev_size,
            prev_root,
            key_id,
            timestamp,
            signature,
        })
    }

    /// Lowercase hex of SHA-256(JCS(checkpoint minus `signature`)): the
    /// signed message, and the `checkpoint_digest` a receiver reports.
    pub fn digest_hex(value: &Value) -> String {
        let mut unsigned = value.clone();
        if let Value::Object(map) = &mut unsigned {
            map.remove("signature");
        }
        hex::encode(&Sha256::digest(canonical_bytes(&unsigned)))
    }

    pub fn verify_signature(&self) -> Result<(), ProofError> {
        let key = VerifyingKey::from_bytes(&self.key_id).map_err(|_| ProofError::BadKey)?;
        key.verify_strict(
            Self::digest_hex(&self.value).as_bytes(),
            &Signature::from_bytes(&self.signature),
        )
        .map_err(|_| ProofError::BadSignature)
    }

    /// Build and sign a checkpoint (for this project's own logs and vectors).
    pub fn sign(
        log_id: &str,
        mmr_size: u64,
        root: &[u8; 32],
        prev: Option<(u64, [u8; 32])>,
        timestamp: &str,
        key: &SigningKey,
    ) -> Value {
        let mut value = json!({
            "v": 1, "kind": "mmr_checkpoint", "log_id": log_id, "mmr_size": mmr_size,
            "root": hex::encode(root),
            "prev_size": prev.map_or(0, |(size, _)| size),
            "prev_root": prev.map_or(String::new(), |(_, root)| hex::encode(&root)),
            "key_id": hex::encode(&key.verifying_key().to_bytes()),
            "timestamp": timestamp,
        });
        let signature = key.sign(Self::digest_hex(&value).as_bytes());
        if let Value::Object(map) = &mut value {
            map.insert(
                "signature".into(),
                json!(hex::encode(&signature.to_bytes())),
            );
        }
        value
    }
}

/// An append-only MMR of record ids, enough to issue inclusion proofs.
#[derive(Debug, Clone, Default)]
pub struct MmrLog {
    /// Nodes from position `offset` on.
    nodes: Vec<[u8; 32]>,
    /// Positions before it were forgotten but for `pinned`.
    offset: u64,
    /// The peaks when the log last forgot (position, hash): what appending
    /// and proving later records still need of the nodes before `offset`.
    pinned: Vec<(u64, [u8; 32])>,
    leaves: u64,
}

impl MmrLog {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn size(&self) -> u64 {
        self.offset + self.nodes.len() as u64
    }

    /// Nodes held in memory.
    pub fn held(&self) -> usize {
        self.nodes.len() + self.pinned.len()
    }

    fn node(&self, pos: u64) -> Option<[u8; 32]> {
        match pos.checked_sub(self.offset) {
            Some(at) => self.nodes.get(usize::try_from(at).ok()?).copied(),
            None => self
                .pinned
                .iter()
                .find(|(p, _)| *p == pos)
                .map(|(_, hash)| *hash),
        }
    }

    /// Forget the nodes of all but about the last `keep` positions: the
    /// log goes on (its size, root and the proofs of the records in the
    /// positions kept, and of every later one, are unchanged), holding the
    /// peaks of the log as it stood where it forgot, which is all that
    /// appending and proving later records need of what came before. What
    /// keeps a long-lived node's log in bounded memory; the journal keeps
    /// every record id.
    pub fn forget(&mut self, keep: u64) {
        // Forget up to a size the log once had (a whole number of merges),
        // never before what was already forgotten.
        let mut until = self.size().saturating_sub(keep);
        while until > self.offset && mmr_peaks(until).is_none() {
            until -= 1;
        }
        if until <= self.offset {
            return;
        }
        let Some(peaks) = mmr_peaks(until) else {
            return;
        };
        // Each peak then is after what was forgotten before, or was a peak
        // there too (a peak stays one until a merge covers it).
        let Some(pinned) = peaks
            .iter()
            .map(|p| self.node(*p).map(|hash| (*p, hash)))
            .collect::<Option<Vec<_>>>()
        else {
            return;
        };
        let drop = usize::try_from(until - self.offset).unwrap_or(usize::MAX);
        self.nodes.drain(..drop.min(self.nodes.len()));
        self.offset = until;
        self.pinned = pinned;
    }

    /// Append a record; returns its leaf index.
    pub fn append(&mut self, capsule_id: &[u8; 32]) -> u64 {
        let leaf_index = self.leaves;
        self.leaves += 1;
        self.nodes.push(mmr_leaf(capsule_id));
        let mut height = 0;
        while pos_height(self.size()) > height {
            let pos = self.size();
            // The right child was just pushed; the left is a node after the
            // last forgetting, or a peak pinned then.
            let (Some(right), Some(left)) =
                (self.node(pos - 1), self.node(pos - (1u64 << (height + 1))))
            else {
                // Unreachable: `forget` keeps every node a merge needs.
                debug_assert!(false, "an MMR merge at {pos} lost a child");
                break;
            };
            self.nodes.push(mmr_node(pos, &left, &right));
            height += 1;
        }
        leaf_index
    }

    pub fn root(&self) -> Option<[u8; 32]> {
        let peaks = mmr_peaks(self.size())?;
        let hashes: Vec<[u8; 32]> = peaks.iter().map(|p| self.node(*p)).collect::<Option<_>>()?;
        bag_peaks(&hashes)
    }

    /// The inclusion proof of leaf `leaf_index` at the current size
    /// (`None` for a leaf appended before the log last forgot, unless the
    /// peaks it kept give its whole path).
    pub fn prove(&self, leaf_index: u64) -> Option<InclusionProof> {
        let peaks = mmr_peaks(self.size())?;
        let mut pos = leaf_position(leaf_index)?;
        if pos >= self.size() {
            return None;
        }
        let mut witness = Vec::new();
        let mut height = 0u32;
        while !peaks.contains(&pos) {
            if pos_height(pos + 1) > height {
                witness.push(self.node(pos - ((1u64 << (height + 1)) - 1))?);
                pos += 1;
            } else {
                witness.push(self.node(pos + (1u64 << (height + 1)) - 1)?);
                pos += 1u64 << (height + 1);
            }
            height += 1;
        }
        let index = peaks.iter().position(|p| *p == pos)?;
        let peak_hash = |p: &u64| self.node(*p);
        Some(InclusionProof {
            size: self.size(),
            leaf_index,
            witness,
            peaks_left: peaks[..index]
                .iter()
                .map(peak_hash)
                .collect::<Option<_>>()?,
            peaks_right: peaks[index + 1..]
                .iter()
                .map(peak_hash)
                .collect::<Option<_>>()?,
        })
    }
}

/// The members of a Mesh-LLM `record_push_bundle`, shape-checked.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordPushBundle<'a> {
    pub capsule: &'a Value,
    pub leaf_index: u64,
    pub proof: InclusionProof,
    pub checkpoint: Checkpoint,
    pub split_stage_records: Option<&'a Vec<Value>>,
}

impl<'a> RecordPushBundle<'a> {
    /// Exact members and types; records themselves are checked by the caller.
    pub fn from_value(value: &'a Value) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, "")?;
        let marker_path = m.path("record_push_bundle");
        if m.u64("record_push_bundle")? != 1 {
            return Err(ShapeError::invalid(marker_path, "must be 1"));
        }
        let capsule_path = m.path("capsule");
        let capsule = m.required("capsule")?;
        if !capsule.is_object() {
            return Err(ShapeError::new(
                capsule_path,
                Problem::WrongType("an object"),
            ));
        }
        let inclusion_path = m.path("inclusion");
        let mut inclusion = Members::of(m.required("inclusion")?, &inclusion_path)?;
        let leaf_index = inclusion.u64("leaf_index")?;
        let proof_path = inclusion.path("proof");
        let proof = InclusionProof::from_value_at(inclusion.required("proof")?, &proof_path)?;
        inclusion.finish()?;
        if proof.leaf_index != leaf_index {
            return Err(ShapeError::invalid(
                proof_path,
                "leaf_index differs from inclusion.leaf_index",
            ));
        }
        let checkpoint_path = m.path("checkpoint");
        let checkpoint = Checkpoint::from_value_at(m.required("checkpoint")?, &checkpoint_path)?;
        let records_path = m.path("split_stage_records");
        let split_stage_records = match m.optional("split_stage_records") {
            None => None,
            Some(Value::Array(items)) => {
                if items.is_empty() || items.len() > MAX_CARRIED_RECORDS {
                    return Err(ShapeError::invalid(
                        records_path,
                        format!("must carry 1 to {MAX_CARRIED_RECORDS} records"),
                    ));
                }
                Some(items)
            }
            Some(_) => {
                return Err(ShapeError::new(
                    records_path,
                    Problem::WrongType("an array"),
                ));
            }
        };
        m.finish()?;
        Ok(Self {
            capsule,
            leaf_index,
            proof,
            checkpoint,
            split_stage_records,
        })
    }

    /// The inclusion proof puts `capsule_id` under the checkpoint's root.
    pub fn verify_inclusion(&self, capsule_id: &[u8; 32]) -> Result<(), ProofError> {
        verify_inclusion(&self.proof, &self.checkpoint, capsule_id)
    }
}

/// `proof` puts `capsule_id` under `checkpoint`'s root, at its size.
pub fn verify_inclusion(
    proof: &InclusionProof,
    checkpoint: &Checkpoint,
    capsule_id: &[u8; 32],
) -> Result<(), ProofError> {
    if proof.size != checkpoint.mmr_size {
        return Err(ProofError::RootMismatch {
            computed: format!("proof for size {}", proof.size),
            claimed: format!("checkpoint of size {}", checkpoint.mmr_size),
        });
    }
    let computed = proof.root_for(&mmr_leaf(capsule_id))?;
    if computed != checkpoint.root {
        return Err(ProofError::RootMismatch {
            computed: hex::encode(&computed),
            claimed: hex::encode(&checkpoint.root),
        });
    }
    Ok(())
}

/// The marker member of this project's requester bundle.
pub const MESH_BUNDLE_MEMBER: &str = "mesh_bundle";

/// The marker member of the bundle of a serve one node ran whole.
pub const MESH1_BUNDLE_MEMBER: &str = "mesh1_bundle";

/// The bundle of a serve one node ran whole (`docs/bundle.md`, form (d)):
/// no split, so no records and no hops; its `mesh/1` receipt, the one
/// before it in the same steward's chain, and the route table its `route`
/// line names. Shape-checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Mesh1Bundle<'a> {
    pub mesh1_envelope: Vec<u8>,
    pub mesh1_prev_envelope: Option<Vec<u8>>,
    pub route: Option<&'a Value>,
}

/// An optional member holding the lowercase hex of a COSE envelope, at
/// most `MAX_ENVELOPE_BYTES` once decoded.
fn envelope_member(m: &mut Members<'_>, key: &'static str) -> Result<Option<Vec<u8>>, ShapeError> {
    let path = m.path(key);
    m.optional(key)
        .map(|v| {
            v.as_str()
                .filter(|t| t.len() <= 2 * crate::mesh1::MAX_ENVELOPE_BYTES)
                .and_then(hex::decode)
                .ok_or_else(|| {
                    ShapeError::invalid(path.clone(), "must be lowercase hex of a COSE envelope")
                })
        })
        .transpose()
}

impl<'a> Mesh1Bundle<'a> {
    pub fn from_value(value: &'a Value) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, "")?;
        let marker_path = m.path(MESH1_BUNDLE_MEMBER);
        if m.u64(MESH1_BUNDLE_MEMBER)? != 1 {
            return Err(ShapeError::invalid(marker_path, "must be 1"));
        }
        let envelope_path = m.path("mesh1_envelope");
        let mesh1_envelope = envelope_member(&mut m, "mesh1_envelope")?
            .ok_or_else(|| ShapeError::new(envelope_path, Problem::Missing))?;
        let mesh1_prev_envelope = envelope_member(&mut m, "mesh1_prev_envelope")?;
        let route = m.optional("route");
        m.finish()?;
        Ok(Self {
            mesh1_envelope,
            mesh1_prev_envelope,
            route,
        })
    }

    /// Assemble a bundle document.
    pub fn to_value(envelope: &[u8], previous: Option<&[u8]>, route: Option<Value>) -> Value {
        let mut bundle = json!({
            MESH1_BUNDLE_MEMBER: 1,
            "mesh1_envelope": hex::encode(envelope),
        });
        if let Value::Object(map) = &mut bundle {
            if let Some(previous) = previous {
                map.insert("mesh1_prev_envelope".into(), json!(hex::encode(previous)));
            }
            if let Some(route) = route {
                map.insert("route".into(), route);
            }
        }
        bundle
    }
}

/// The `mesh/1` envelope and the route table a requester bundle carries:
/// a `mesh_bundle` (a split, which may carry no envelope) or a
/// `mesh1_bundle` (a serve one node ran whole).
pub fn carried_receipt(value: &Value) -> Result<(Option<Vec<u8>>, Option<&Value>), ShapeError> {
    if value.get(MESH1_BUNDLE_MEMBER).is_some() {
        let bundle = Mesh1Bundle::from_value(value)?;
        return Ok((Some(bundle.mesh1_envelope), bundle.route));
    }
    let bundle = MeshBundle::from_value(value)?;
    Ok((bundle.mesh1_envelope, bundle.route))
}

/// This project's requester bundle (`docs/bundle.md`), shape-checked.
#[derive(Debug, Clone, PartialEq)]
pub struct MeshBundle<'a> {
    pub main_record: &'a Value,
    pub split_stage_records: &'a [Value],
    pub stage_exchange_records: &'a [Value],
    /// The coordinator's `mesh/1` receipt envelope (hex), when it sealed one.
    pub mesh1_envelope: Option<Vec<u8>>,
    /// The previous envelope of the same steward (hex), for the chain link.
    pub mesh1_prev_envelope: Option<Vec<u8>>,
    /// The node id (did:key) that served each stage, as the coordinator
    /// assigned (`None` when the bundle lists none; checked by the verifier).
    pub stewards: Option<Vec<(u32, String)>>,
    /// The main record's place in the coordinator's transparency log: the
    /// inclusion proof and the signed checkpoint it is proven under
    /// (together, as in a `record_push_bundle`).
    pub log_proof: Option<(InclusionProof, Checkpoint)>,
    /// A resumed request's earlier segments, in order, each a bundle of this
    /// form without envelopes or segments of its own; the final segment is
    /// this bundle. Empty when the request ran on one chain.
    pub earlier_segments: &'a [Value],
    /// The route table the receipt's `route` line names (SPEC §4; read by
    /// `route::check_table`).
    pub route: Option<&'a Value>,
    /// The stages' own `mesh/1` receipts that reached the coordinator
    /// (`stage_receipt`), at most one per stage; empty when none is
    /// carried.
    pub stage_receipts: Vec<crate::stage_receipt::CarriedStageReceipt>,
    /// The coordinator's audit of the request, when it was sampled for one
    /// (`crate::audit`).
    pub audit: Option<crate::audit::SignedAudit>,
}

impl<'a> MeshBundle<'a> {
    pub fn from_value(value: &'a Value) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, "")?;
        let marker_path = m.path(MESH_BUNDLE_MEMBER);
        if m.u64(MESH_BUNDLE_MEMBER)? != 1 {
            return Err(ShapeError::invalid(marker_path, "must be 1"));
        }
        let main_path = m.path("main_record");
        let main_record = m.required("main_record")?;
        if !main_record.is_object() {
            return Err(ShapeError::new(main_path, Problem::WrongType("an object")));
        }
        let records_path = m.path("split_stage_records");
        let split_stage_records = m.array("split_stage_records")?;
        if split_stage_records.len() > MAX_CARRIED_RECORDS {
            return Err(ShapeError::invalid(
                records_path,
                format!("more than {MAX_CARRIED_RECORDS} records"),
            ));
        }
        let exchange_path = m.path("stage_exchange_records");
        let stage_exchange_records = m.array("stage_exchange_records")?;
        if stage_exchange_records.len() > MAX_CARRIED_RECORDS {
            return Err(ShapeError::invalid(
                exchange_path,
                format!("more than {MAX_CARRIED_RECORDS} records"),
            ));
        }
        let mesh1_envelope = envelope_member(&mut m, "mesh1_envelope")?;
        let mesh1_prev_envelope = envelope_member(&mut m, "mesh1_prev_envelope")?;
        let stewards_path = m.path("stewards");
        let stewards = match m.optional("stewards") {
            None => None,
            Some(Value::Array(items)) if items.len() <= MAX_CARRIED_RECORDS + 1 => Some(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| {
                        let mut e = Members::of(item, &format!("{stewards_path}/{i}"))?;
                        let index = e.u32("stage_index")?;
                        let node = e.non_empty_string("node_id")?.to_string();
                        e.finish()?;
                        Ok((index, node))
                    })
                    .collect::<Result<Vec<_>, ShapeError>>()?,
            ),
            Some(_) => {
                return Err(ShapeError::new(
                    stewards_path,
                    Problem::WrongType("an array of at most 65 entries"),
                ));
            }
        };
        let log_proof = match (m.optional("inclusion"), m.optional("checkpoint")) {
            (None, None) => None,
            (Some(inclusion), Some(checkpoint)) => {
                let inclusion_path = m.path("inclusion");
                let mut i = Members::of(inclusion, &inclusion_path)?;
                let leaf_index = i.u64("leaf_index")?;
                let proof_path = i.path("proof");
                let proof = InclusionProof::from_value_at(i.required("proof")?, &proof_path)?;
                i.finish()?;
                if proof.leaf_index != leaf_index {
                    return Err(ShapeError::invalid(
                        proof_path,
                        "leaf_index differs from inclusion.leaf_index",
                    ));
                }
                let checkpoint = Checkpoint::from_value_at(checkpoint, &m.path("checkpoint"))?;
                Some((proof, checkpoint))
            }
            _ => {
                return Err(ShapeError::invalid(
                    m.path("inclusion"),
                    "inclusion and checkpoint come together",
                ));
            }
        };
        let segments_path = m.path("earlier_segments");
        let earlier_segments: &[Value] = match m.optional("earlier_segments") {
            None => &[],
            Some(Value::Array(items)) if items.len() < crate::resume::MAX_SEGMENTS => items,
            Some(_) => {
                return Err(ShapeError::new(
                    segments_path,
                    Problem::WrongType("an array of fewer than 8 bundles"),
                ));
            }
        };
        let route = m.optional("route");
        let receipts_path = m.path("stage_receipts");
        let stage_receipts = match m.optional("stage_receipts") {
            None => Vec::new(),
            Some(Value::Array(items)) if items.len() <= MAX_CARRIED_RECORDS => items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    crate::stage_receipt::CarriedStageReceipt::from_value_at(
                        item,
                        &format!("{receipts_path}/{i}"),
                    )
                })
                .collect::<Result<Vec<_>, ShapeError>>()?,
            Some(_) => {
                return Err(ShapeError::new(
                    receipts_path,
                    Problem::WrongType("an array of at most 64 stage receipts"),
                ));
            }
        };
        let audit_path = m.path("audit");
        let audit = m
            .optional("audit")
            .map(|audit| crate::audit::SignedAudit::from_value_at(audit, &audit_path))
            .transpose()?;
        m.finish()?;
        Ok(Self {
            main_record,
            split_stage_records,
            stage_exchange_records,
            mesh1_envelope,
            mesh1_prev_envelope,
            stewards,
            log_proof,
            earlier_segments,
            route,
            stage_receipts,
            audit,
        })
    }

    /// Assemble a bundle document.
    pub fn to_value(
        main_record: &Value,
        split_stage_records: &[Value],
        stage_exchange_records: &[Value],
    ) -> Value {
        json!({
            MESH_BUNDLE_MEMBER: 1,
            "main_record": main_record,
            "split_stage_records": split_stage_records,
            "stage_exchange_records": stage_exchange_records,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The repository's transparency-log vectors
    /// (`vectors/split-stage/mmr-logs.json`, `mesh-node vectors write`):
    /// every proof of every log of 1 to 64 records verifies under its
    /// checkpoint, each checkpoint names the one before, and every derived
    /// refusal fails.
    #[test]
    fn the_mmr_log_vectors_hold() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../vectors/split-stage/mmr-logs.json"
        );
        let document: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let logs = document["logs"].as_array().unwrap();
        assert_eq!(logs.len(), 64);
        let mut previous: Option<(u64, [u8; 32])> = None;
        for log in logs {
            let checkpoint = Checkpoint::from_value_at(&log["checkpoint"], "").unwrap();
            checkpoint.verify_signature().unwrap();
            assert_eq!(
                previous,
                checkpoint
                    .prev_root
                    .map(|root| (checkpoint.prev_size, root))
            );
            for proven in log["proofs"].as_array().unwrap() {
                let proof = InclusionProof::from_value_at(&proven["proof"], "").unwrap();
                let id = hex::decode_array(proven["capsule_id"].as_str().unwrap()).unwrap();
                verify_inclusion(&proof, &checkpoint, &id).unwrap();
            }
            previous = Some((checkpoint.mmr_size, checkpoint.root));
        }
        let refusals = document["refusals"].as_array().unwrap();
        assert!(refusals.len() >= 6);
        for refusal in refusals {
            let checkpoint = Checkpoint::from_value_at(&refusal["checkpoint"], "").unwrap();
            let proof = InclusionProof::from_value_at(&refusal["proof"], "").unwrap();
            let id = hex::decode_array(refusal["capsule_id"].as_str().unwrap()).unwrap();
            assert!(
                checkpoint.verify_signature().is_err()
                    || verify_inclusion(&proof, &checkpoint, &id).is_err(),
                "{}",
                refusal["name"]
            );
        }
    }
    use proptest::prelude::*;

    #[test]
    fn heights_and_peaks() {
        let heights: Vec<u32> = (0..11).map(pos_height).collect();
        assert_eq!(heights, [0, 0, 1, 0, 0, 1, 2, 0, 0, 1, 0]);
        assert_eq!(mmr_peaks(0), Some(vec![]));
        assert_eq!(mmr_peaks(1), Some(vec![0]));
        assert_eq!(mmr_peaks(2), None);
        assert_eq!(mmr_peaks(4), Some(vec![2, 3]));
        assert_eq!(mmr_peaks(11), Some(vec![6, 9, 10]));
        assert_eq!(leaf_position(2), Some(3));
        assert_eq!(leaf_position(4), Some(7));
    }

    proptest! {
        /// A log that forgets, as often as it likes and keeping any number
        /// of recent positions, keeps its size and root, and proves every
        /// record in the positions it kept, and every later one, exactly
        /// as a log that never forgot.
        #[test]
        fn a_log_that_forgets_goes_on_as_one_that_never_did(
            steps in proptest::collection::vec((any::<bool>(), 0u64..12), 1..120),
        ) {
            let id = |i: usize| blake3::hash(&i.to_le_bytes()).into();
            let mut whole = MmrLog::new();
            let mut forgetting = MmrLog::new();
            // The first leaf whose proof must survive every forgetting.
            let mut provable_from = 0u64;
            for (i, (forget, keep)) in steps.iter().enumerate() {
                whole.append(&id(i));
                forgetting.append(&id(i));
                if *forget {
                    forgetting.forget(*keep);
                    // Every leaf at a position not before size - keep.
                    let floor = forgetting.size().saturating_sub(*keep);
                    while leaf_position(provable_from).is_some_and(|p| p < floor) {
                        provable_from += 1;
                    }
                }
                prop_assert_eq!(forgetting.size(), whole.size());
                prop_assert_eq!(forgetting.root(), whole.root());
            }
            for leaf in 0..steps.len() as u64 {
                match forgetting.prove(leaf) {
                    Some(proof) => prop_assert_eq!(Some(proof), whole.prove(leaf)),
                    None => prop_assert!(leaf < provable_from, "leaf {} lost", leaf),
                }
            }
        }

        #[test]
        fn every_leaf_proves_against_the_root(leaves in 1usize..40) {
            let mut log = MmrLog::new();
            let ids: Vec<[u8; 32]> = (0..leaves).map(|i| [i as u8; 32]).collect();
            for (i, id) in ids.iter().enumerate() {
                prop_assert_eq!(log.append(id), i as u64);
            }
            let root = log.root().unwrap();
            for (i, id) in ids.iter().enumerate() {
                let proof = log.prove(i as u64).unwrap();
                prop_assert_eq!(proof.root_for(&mmr_leaf(id)), Ok(root));
                let other = [0xff; 32];
                prop_assert_ne!(proof.root_for(&mmr_leaf(&other)), Ok(root));
                let parsed = InclusionProof::from_value_at(&proof.to_value(), "").unwrap();
                prop_assert_eq!(parsed, proof);
            }
        }

        #[test]
        fn proofs_never_panic(size in any::<u64>(), leaf_index in any::<u64>(), w in 0usize..70, l in 0usize..3, r in 0usize..3) {
            let proof = InclusionProof { size, leaf_index, witness: vec![[1; 32]; w], peaks_left: vec![[2; 32]; l], peaks_right: vec![[3; 32]; r] };
            let _ = proof.root_for(&[0; 32]);
        }
    }

    #[test]
    fn checkpoint_signs_and_verifies() {
        let key = SigningKey::from_bytes(&[5; 32]);
        let value = Checkpoint::sign("log", 3, &[9; 32], None, "2026-09-30T03:38:00.000Z", &key);
        let checkpoint = Checkpoint::from_value_at(&value, "").unwrap();
        assert_eq!(checkpoint.verify_signature(), Ok(()));
        let mut tampered = value.clone();
        tampered["mmr_size"] = json!(4);
        let tampered = Checkpoint::from_value_at(&tampered, "").unwrap();
        assert_eq!(tampered.verify_signature(), Err(ProofError::BadSignature));
    }
}
