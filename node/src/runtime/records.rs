//! `record-push/1` at the coordinator: stage records arrive, are verified
//! before they are acknowledged, and are held per split until the
//! coordinator seals (or refused with a signed reason).

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ed25519_dalek::Signer;
use mesh_protocol::SigningKey;
use mesh_protocol::block::{Side, SplitKey};
use mesh_protocol::capsule::{SealedRecord, format_timestamp};
use mesh_protocol::identity::did_key;
use mesh_protocol::json::{canonical_bytes, parse_strict};
use mesh_protocol::stage_receipt::{
    CarriedStageReceipt, STAGE_RECEIPT_PUSH_MEMBER, check_stage_receipt,
};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Most splits held open at once.
pub const MAX_PENDING_SPLITS: usize = 256;
/// Distinct records kept per stage: a second is kept as a conflict, a third
/// is refused.
pub const MAX_RECORDS_PER_STAGE: usize = 2;
/// Checkpoints remembered per stage key, to refuse one that contradicts
/// them (the oldest are forgotten first).
pub const MAX_CHECKPOINTS_PER_STAGE: usize = 64;
/// Stage keys whose checkpoints are remembered (the one heard from least
/// recently is forgotten first).
pub const MAX_CHECKPOINTED_STAGES: usize = 256;

/// Why a push is refused (the `reason` of a signed refusal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushRefusal {
    RequestMalformed,
    BundleMalformed,
    SignatureUnverified,
    InclusionUnverified,
    CheckpointEquivocation,
    NotAStageOfThisSplit,
    OverCap,
    TooLarge,
}

impl PushRefusal {
    pub fn reason(self) -> &'static str {
        match self {
            PushRefusal::RequestMalformed => "request_malformed",
            PushRefusal::BundleMalformed => "bundle_malformed",
            PushRefusal::SignatureUnverified => "signature_unverified",
            PushRefusal::InclusionUnverified => "inclusion_unverified",
            PushRefusal::CheckpointEquivocation => "checkpoint_equivocation",
            PushRefusal::NotAStageOfThisSplit => "not_a_stage_of_this_split",
            PushRefusal::OverCap => "over_cap",
            PushRefusal::TooLarge => "over_size_cap",
        }
    }
}

/// How an acknowledged record came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// Bare: the record alone.
    Bare,
    /// A record (or stage receipt) already held, pushed again.
    Again,
    /// A stage's own `mesh/1` receipt for its part of the split.
    Receipt,
    /// In a `record_push_bundle`, proven in the stage's log under a
    /// checkpoint it signed.
    Proven,
}

/// A split the coordinator is serving or waiting to seal.
#[derive(Debug)]
pub struct PendingSplit {
    pub key: SplitKey,
    /// Public key of the node assigned to each stage (index 0: the coordinator).
    pub assigned: Vec<[u8; 32]>,
    pub records: Vec<Vec<SealedRecord>>,
    /// Each stage's own `mesh/1` receipt, once it came (index 0, the
    /// coordinator's, stays empty: it seals its own).
    pub receipts: Vec<Option<CarriedStageReceipt>>,
}

impl PendingSplit {
    pub fn complete(&self) -> bool {
        self.records.iter().skip(1).all(|r| !r.is_empty())
    }
}

/// The (size, root) of a stage's log checkpoints seen, oldest first.
type SeenCheckpoints = std::collections::VecDeque<(u64, [u8; 32])>;

/// Splits by request id, and the checkpoints each stage's log showed.
#[derive(Debug, Default)]
pub struct Collector {
    pending: HashMap<u64, PendingSplit>,
    /// Per stage key, in the order last heard from: the sizes and roots of
    /// its log's checkpoints seen in its pushes.
    checkpoints: Vec<([u8; 32], SeenCheckpoints)>,
}

impl Collector {
    pub fn open(&mut self, key: SplitKey, assigned: Vec<[u8; 32]>) -> bool {
        if self.pending.len() >= MAX_PENDING_SPLITS {
            return false;
        }
        let stages = assigned.len();
        self.pending.insert(
            key.request_id,
            PendingSplit {
                key,
                assigned,
                records: vec![Vec::new(); stages],
                receipts: vec![None; stages],
            },
        );
        true
    }

    /// Whether `key` is assigned a stage (other than the coordinator's) of
    /// any split held open: only such a peer has a record to push.
    pub fn expects_from(&self, key: &[u8; 32]) -> bool {
        self.pending
            .values()
            .any(|split| split.assigned.iter().skip(1).any(|k| k == key))
    }

    /// Splits held open.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    pub fn take(&mut self, request_id: u64) -> Option<PendingSplit> {
        self.pending.remove(&request_id)
    }

    pub fn is_complete(&self, request_id: u64) -> bool {
        self.pending
            .get(&request_id)
            .is_none_or(PendingSplit::complete)
    }

    /// Complete but for the stages whose node `gone` says is gone.
    pub fn is_complete_except(&self, request_id: u64, gone: impl Fn(&[u8; 32]) -> bool) -> bool {
        self.pending.get(&request_id).is_none_or(|split| {
            split
                .records
                .iter()
                .zip(&split.assigned)
                .skip(1)
                .all(|(records, key)| !records.is_empty() || gone(key))
        })
    }

    /// Verify a pushed body from the peer whose key the transport proved.
    pub fn offer(&mut self, sender_key: &[u8; 32], body: &[u8]) -> Result<Received, PushRefusal> {
        if body.len() > crate::runtime::net::msg::MAX_RECORD_PUSH {
            return Err(PushRefusal::TooLarge);
        }
        let newline = body
            .iter()
            .position(|b| *b == b'\n')
            .ok_or(PushRefusal::RequestMalformed)?;
        let claimed =
            std::str::from_utf8(&body[..newline]).map_err(|_| PushRefusal::RequestMalformed)?;
        if claimed != did_key(sender_key) {
            // The self-declared sender must be the peer the transport authenticated.
            return Err(PushRefusal::SignatureUnverified);
        }
        let value =
            parse_strict(&body[newline + 1..]).map_err(|_| PushRefusal::RequestMalformed)?;
        if value.get(STAGE_RECEIPT_PUSH_MEMBER).is_some() {
            return self.offer_stage_receipt(sender_key, &value);
        }
        // A bundle (split-stage §3.3) carries the record with its inclusion
        // in the stage's log under a checkpoint the stage signed; it carries
        // no stage records of its own (only the coordinator's to the
        // requester does).
        let (value, proven) = if value.get("record_push_bundle").is_some() {
            let bundle = mesh_protocol::bundle::RecordPushBundle::from_value(&value)
                .map_err(|_| PushRefusal::BundleMalformed)?;
            if bundle.split_stage_records.is_some() {
                return Err(PushRefusal::BundleMalformed);
            }
            (
                bundle.capsule.clone(),
                Some((bundle.proof, bundle.checkpoint)),
            )
        } else {
            (value, None)
        };
        let malformed = if proven.is_some() {
            PushRefusal::BundleMalformed
        } else {
            PushRefusal::RequestMalformed
        };
        if mesh_protocol::capsule::class1_check(&value).is_err()
            || mesh_protocol::capsule::check_capsule_id(&value).is_err()
        {
            return Err(malformed);
        }
        let record = SealedRecord::verify(value).map_err(|_| PushRefusal::SignatureUnverified)?;
        if record.key_id() != *sender_key {
            return Err(PushRefusal::SignatureUnverified);
        }
        if let Some((proof, checkpoint)) = &proven {
            // Signed by the stage's own key over its own log, and the record
            // proven in it, before anything is acknowledged.
            if checkpoint.key_id != *sender_key
                || checkpoint.log_id != did_key(sender_key)
                || checkpoint.verify_signature().is_err()
                || mesh_protocol::bundle::verify_inclusion(proof, checkpoint, &record.capsule_id())
                    .is_err()
            {
                return Err(PushRefusal::InclusionUnverified);
            }
        }
        let block = record
            .stage_block()
            .map_err(|_| PushRefusal::RequestMalformed)?;
        if block.side != Side::Stage {
            return Err(PushRefusal::NotAStageOfThisSplit);
        }
        let pending = self
            .pending
            .get_mut(&block.request_id)
            .ok_or(PushRefusal::NotAStageOfThisSplit)?;
        let index = block.stage_index as usize;
        if block.split_key() != pending.key
            || pending.assigned.get(index) != Some(sender_key)
            || index == 0
        {
            return Err(PushRefusal::NotAStageOfThisSplit);
        }
        let Some(pending) = self.pending.get(&block.request_id) else {
            return Err(PushRefusal::NotAStageOfThisSplit);
        };
        let held = &pending.records[index];
        let again = held.iter().any(|r| r.capsule_id() == record.capsule_id());
        if !again && held.len() >= MAX_RECORDS_PER_STAGE {
            return Err(PushRefusal::OverCap);
        }
        // The stage's log claims: the size and root it checkpoints, and the
        // checkpoint it names before. Checked always; remembered only with
        // a record newly held, so pushing one record again and again cannot
        // crowd out what a stage claimed.
        if let Some((_, checkpoint)) = &proven {
            let mut claims = vec![(checkpoint.mmr_size, checkpoint.root)];
            claims.extend(
                checkpoint
                    .prev_root
                    .map(|root| (checkpoint.prev_size, root)),
            );
            self.weigh_checkpoints(sender_key, &claims, !again)?;
        }
        if again {
            return Ok(Received::Again);
        }
        let Some(pending) = self.pending.get_mut(&block.request_id) else {
            return Err(PushRefusal::NotAStageOfThisSplit);
        };
        pending.records[index].push(record);
        Ok(if proven.is_some() {
            Received::Proven
        } else {
            Received::Bare
        })
    }

    /// A stage's own receipt for its part of a split held open: it must be
    /// the sender's stage of that split, sealed by the sender, naming the
    /// split's stage, run and request (`check_stage_receipt`); one per
    /// stage (the same again is acknowledged, another refused).
    fn offer_stage_receipt(
        &mut self,
        sender_key: &[u8; 32],
        value: &Value,
    ) -> Result<Received, PushRefusal> {
        let (request_id, carried) = CarriedStageReceipt::from_push_value(value)
            .map_err(|_| PushRefusal::RequestMalformed)?;
        let pending = self
            .pending
            .get_mut(&request_id)
            .ok_or(PushRefusal::NotAStageOfThisSplit)?;
        let index = carried.stage_index as usize;
        if index == 0 || pending.assigned.get(index) != Some(sender_key) {
            return Err(PushRefusal::NotAStageOfThisSplit);
        }
        check_stage_receipt(
            &carried.envelope,
            carried.stage_index,
            &pending.key.run_id,
            request_id,
            &did_key(sender_key),
        )
        .map_err(|_| PushRefusal::SignatureUnverified)?;
        match &pending.receipts[index] {
            Some(held) if *held == carried => Ok(Received::Again),
            Some(_) => Err(PushRefusal::OverCap),
            None => {
                pending.receipts[index] = Some(carried);
                Ok(Received::Receipt)
            }
        }
    }

    /// A stage's log claims (size, root), from a checkpoint and the one it
    /// names before, must not contradict one it made before at the same
    /// size (two roots for one size of one log is a forked log); nothing is
    /// remembered when one does, or unless `remember`. Pushes of concurrent requests may arrive
    /// out of order, so a smaller size than the newest is not refused.
    fn weigh_checkpoints(
        &mut self,
        stage: &[u8; 32],
        claims: &[(u64, [u8; 32])],
        remember: bool,
    ) -> Result<(), PushRefusal> {
        let known = self.checkpoints.iter().position(|(key, _)| key == stage);
        let seen_before = known.map(|at| &self.checkpoints[at].1);
        let forked = claims.iter().any(|(size, root)| {
            seen_before
                .into_iter()
                .flatten()
                .chain(claims.iter())
                .any(|(held, held_root)| held == size && held_root != root)
        });
        if forked {
            return Err(PushRefusal::CheckpointEquivocation);
        }
        if !remember {
            return Ok(());
        }
        // Taken out and put back last: the stage heard from last is
        // forgotten last.
        let (key, mut seen) = match known {
            Some(at) => self.checkpoints.remove(at),
            None => {
                if self.checkpoints.len() >= MAX_CHECKPOINTED_STAGES {
                    self.checkpoints.remove(0);
                }
                (*stage, SeenCheckpoints::default())
            }
        };
        for (size, root) in claims {
            if !seen.iter().any(|(held, _)| held == size) {
                if seen.len() >= MAX_CHECKPOINTS_PER_STAGE {
                    seen.pop_front();
                }
                seen.push_back((*size, *root));
            }
        }
        self.checkpoints.push((key, seen));
        Ok(())
    }
}

/// A refusal signed by the receiver, in Mesh-LLM's shape.
pub fn signed_refusal(key: &SigningKey, body: &[u8], refusal: PushRefusal) -> Value {
    let issued_at = format_timestamp(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    );
    let request_digest = mesh_protocol::hex::encode(&Sha256::digest(body));
    let signed = json!({ "issued_at": issued_at, "reason": refusal.reason(), "request_digest": request_digest });
    let sig = key.sign(&canonical_bytes(&signed));
    json!({
        "request_digest": request_digest,
        "reason": refusal.reason(),
        "issued_at": issued_at,
        "key_id": mesh_protocol::hex::encode(&key.verifying_key().to_bytes()),
        "sig": mesh_protocol::hex::encode(&sig.to_bytes()),
    })
}

/// Check a signed refusal (what a pushing stage does with the answer).
pub fn refusal_verifies(refusal: &Value) -> bool {
    let text = |k: &str| refusal[k].as_str().unwrap_or_default().to_string();
    let signed = json!({ "issued_at": text("issued_at"), "reason": text("reason"), "request_digest": text("request_digest") });
    let (Some(key), Some(sig)) = (
        mesh_protocol::hex::decode_array::<32>(&text("key_id")),
        mesh_protocol::hex::decode_array::<64>(&text("sig")),
    ) else {
        return false;
    };
    mesh_protocol::VerifyingKey::from_bytes(&key)
        .and_then(|k| {
            k.verify_strict(
                &canonical_bytes(&signed),
                &ed25519_dalek::Signature::from_bytes(&sig),
            )
        })
        .is_ok()
}

/// How long the coordinator waits for stage records unless configured.
pub const DEFAULT_DEADLINE: Duration =
    Duration::from_millis(mesh_protocol::receipt::DEFAULT_STAGE_SEAL_DEADLINE_MS);
