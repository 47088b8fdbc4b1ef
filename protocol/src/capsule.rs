//! Stage records as Agent Action Capsules (format 4, JCS): building, sealing
//! and verifying.
//!
//! `capsule_id = SHA-256(JCS(record minus {capsule_id, signature, key_id}))`,
//! and `signature` is the hex of a tagged COSE_Sign1 whose attached payload is
//! the 32 raw bytes of `capsule_id`, signed with Ed25519 by `key_id`.

use coset::{CoseSign1, CoseSign1Builder, Header, HeaderBuilder, TaggedCborSerializable, iana};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::block::{STAGE_BLOCK_MEMBER, Side, StageBlock};
use crate::hex;
use crate::json::{Members, Problem, ShapeError, canonical_bytes};

pub const SPEC_VERSION: &str = "draft-mih-scitt-agent-action-capsule-05";
pub const FORMAT_VERSION: &str = "4";
pub const CANONICALIZATION_ID: &str = "jcs";
/// COSE content type of the signed payload.
pub const CAPSULE_ID_CONTENT_TYPE: &str = "application/agent-action-capsule-id";
/// Longest `signature` hex accepted; the envelope is 181 bytes.
pub const MAX_SIGNATURE_HEX: usize = 1024;
/// Members left out of the `capsule_id` preimage.
pub const UNSIGNED_MEMBERS: [&str; 3] = ["capsule_id", "signature", "key_id"];

/// Why a record is not a valid, sealed capsule.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RecordError {
    #[error("record structure: {0}")]
    Shape(#[from] ShapeError),
    #[error("capsule_id {claimed} does not match the record's content (recomputed {computed})")]
    IdMismatch { claimed: String, computed: String },
    #[error("signature: {0}")]
    Signature(#[from] EnvelopeError),
}

/// Why a COSE_Sign1 producer envelope does not verify.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("signature is not lowercase hex")]
    NotHex,
    #[error("not a tagged COSE_Sign1: {0}")]
    Cbor(String),
    #[error(
        "protected header is not {{alg: EdDSA, content type: {CAPSULE_ID_CONTENT_TYPE}, kid: key_id}}"
    )]
    Header,
    #[error("unprotected header must be empty")]
    UnprotectedHeader,
    #[error("payload is not the 32 bytes of capsule_id")]
    Payload,
    #[error("key_id is not a valid Ed25519 public key")]
    BadKey,
    #[error("Ed25519 signature does not verify under key_id")]
    BadSignature,
}

/// SHA-256 over the JCS form of the record without its unsigned members.
pub fn compute_capsule_id(record: &Value) -> [u8; 32] {
    let preimage = match record {
        Value::Object(map) => {
            let mut map = map.clone();
            for member in UNSIGNED_MEMBERS {
                map.remove(member);
            }
            Value::Object(map)
        }
        other => other.clone(),
    };
    Sha256::digest(canonical_bytes(&preimage)).into()
}

fn expected_protected_header(key_id: &[u8; 32]) -> Header {
    HeaderBuilder::new()
        .algorithm(iana::Algorithm::EdDSA)
        .content_type(CAPSULE_ID_CONTENT_TYPE.to_string())
        .key_id(key_id.to_vec())
        .build()
}

/// The tagged COSE_Sign1 over `capsule_id`, signed by `key`.
pub fn sign_envelope(capsule_id: &[u8; 32], key: &SigningKey) -> Vec<u8> {
    let key_id = key.verifying_key().to_bytes();
    let sign1 = CoseSign1Builder::new()
        .protected(expected_protected_header(&key_id))
        .payload(capsule_id.to_vec())
        .create_signature(b"", |to_be_signed| {
            key.sign(to_be_signed).to_bytes().to_vec()
        })
        .build();
    // Encoding a well-formed CoseSign1 of fixed small fields cannot fail.
    sign1.to_tagged_vec().unwrap_or_default()
}

/// Verify a producer envelope against the capsule id and key it must carry.
pub fn verify_envelope(
    envelope: &[u8],
    capsule_id: &[u8; 32],
    key_id: &[u8; 32],
) -> Result<(), EnvelopeError> {
    let sign1 = CoseSign1::from_tagged_slice(envelope)
        .map_err(|error| EnvelopeError::Cbor(error.to_string()))?;
    if sign1.protected.header != expected_protected_header(key_id) {
        return Err(EnvelopeError::Header);
    }
    if !sign1.unprotected.is_empty() {
        return Err(EnvelopeError::UnprotectedHeader);
    }
    if sign1.payload.as_deref() != Some(capsule_id.as_slice()) {
        return Err(EnvelopeError::Payload);
    }
    let key = VerifyingKey::from_bytes(key_id).map_err(|_| EnvelopeError::BadKey)?;
    sign1.verify_signature(b"", |signature, signed| {
        let signature: [u8; 64] = signature
            .try_into()
            .map_err(|_| EnvelopeError::BadSignature)?;
        key.verify_strict(signed, &Signature::from_bytes(&signature))
            .map_err(|_| EnvelopeError::BadSignature)
    })
}

/// A record whose structure, `capsule_id` and signature have been checked.
#[derive(Debug, Clone, PartialEq)]
pub struct SealedRecord {
    value: Value,
    capsule_id: [u8; 32],
    key_id: [u8; 32],
}

/// The identity members of a record, read without trusting them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedIds {
    pub capsule_id: [u8; 32],
    pub key_id: [u8; 32],
    pub signature_hex: String,
}

/// The Class-1 structure checks: profile (format 4 + JCS), and the shapes of
/// the identity members. Returns the claimed ids.
pub fn class1_check(record: &Value) -> Result<ClaimedIds, ShapeError> {
    let map = record
        .as_object()
        .ok_or_else(|| ShapeError::new("/", Problem::WrongType("an object")))?;
    let text = |key: &'static str| -> Result<&str, ShapeError> {
        map.get(key)
            .ok_or_else(|| ShapeError::new(format!("/{key}"), Problem::Missing))?
            .as_str()
            .ok_or_else(|| ShapeError::new(format!("/{key}"), Problem::WrongType("a string")))
    };
    text("spec_version")?;
    if text("format_version")? != FORMAT_VERSION {
        return Err(ShapeError::invalid(
            "/format_version",
            "only format 4 is accepted",
        ));
    }
    if text("canonicalization_id")? != CANONICALIZATION_ID {
        return Err(ShapeError::invalid(
            "/canonicalization_id",
            "only jcs is accepted",
        ));
    }
    let capsule_id = hex::decode_array(text("capsule_id")?)
        .ok_or_else(|| ShapeError::invalid("/capsule_id", "must be 64 lowercase hex digits"))?;
    let key_id = hex::decode_array(text("key_id")?)
        .ok_or_else(|| ShapeError::invalid("/key_id", "must be 64 lowercase hex digits"))?;
    let signature_hex = text("signature")?;
    if signature_hex.len() > MAX_SIGNATURE_HEX {
        return Err(ShapeError::invalid(
            "/signature",
            "longer than any producer envelope",
        ));
    }
    map.get("model_attestation")
        .and_then(|m| m.get("compute_attestation"))
        .and_then(Value::as_object)
        .ok_or_else(|| {
            ShapeError::new(
                "/model_attestation/compute_attestation",
                Problem::WrongType("an object"),
            )
        })?;
    Ok(ClaimedIds {
        capsule_id,
        key_id,
        signature_hex: signature_hex.to_string(),
    })
}

/// Check that the claimed `capsule_id` recomputes.
pub fn check_capsule_id(record: &Value) -> Result<[u8; 32], RecordError> {
    checked_ids(record).map(|ids| ids.capsule_id)
}

/// Class-1 structure, then the claimed `capsule_id` against the content.
fn checked_ids(record: &Value) -> Result<ClaimedIds, RecordError> {
    let claimed = class1_check(record)?;
    let computed = compute_capsule_id(record);
    if computed != claimed.capsule_id {
        return Err(RecordError::IdMismatch {
            claimed: hex::encode(&claimed.capsule_id),
            computed: hex::encode(&computed),
        });
    }
    Ok(claimed)
}

impl SealedRecord {
    /// Verify a record: Class-1 structure, `capsule_id`, then the COSE
    /// envelope under the record's own `key_id`.
    pub fn verify(record: Value) -> Result<Self, RecordError> {
        let claimed = checked_ids(&record)?;
        let capsule_id = claimed.capsule_id;
        let envelope = hex::decode(&claimed.signature_hex).ok_or(EnvelopeError::NotHex)?;
        verify_envelope(&envelope, &capsule_id, &claimed.key_id)?;
        Ok(Self {
            value: record,
            capsule_id,
            key_id: claimed.key_id,
        })
    }

    /// Seal an unsigned record: compute its id, sign, and add the three
    /// identity members.
    pub fn seal(unsigned: Value, key: &SigningKey) -> Result<Self, RecordError> {
        let mut map = match unsigned {
            Value::Object(map) => map,
            _ => return Err(ShapeError::new("/", Problem::WrongType("an object")).into()),
        };
        for member in UNSIGNED_MEMBERS {
            map.remove(member);
        }
        let capsule_id = compute_capsule_id(&Value::Object(map.clone()));
        let key_id = key.verifying_key().to_bytes();
        let envelope = sign_envelope(&capsule_id, key);
        map.insert("capsule_id".into(), json!(hex::encode(&capsule_id)));
        map.insert("signature".into(), json!(hex::encode(&envelope)));
        map.insert("key_id".into(), json!(hex::encode(&key_id)));
        Ok(Self {
            value: Value::Object(map),
            capsule_id,
            key_id,
        })
    }

    pub fn capsule_id(&self) -> [u8; 32] {
        self.capsule_id
    }
    pub fn key_id(&self) -> [u8; 32] {
        self.key_id
    }
    pub fn value(&self) -> &Value {
        &self.value
    }
    pub fn into_value(self) -> Value {
        self.value
    }

    /// The record's `x-mesh-stage-v1` block, validated.
    pub fn stage_block(&self) -> Result<StageBlock, ShapeError> {
        stage_block_of(&self.value)
    }
}

/// Path of the blocks inside a record.
pub const COMPUTE_ATTESTATION_PATH: &str = "/model_attestation/compute_attestation";

/// Find and validate the `x-mesh-stage-v1` block of any record.
pub fn stage_block_of(record: &Value) -> Result<StageBlock, ShapeError> {
    let path = format!("{COMPUTE_ATTESTATION_PATH}/{STAGE_BLOCK_MEMBER}");
    let block = record
        .pointer(&path)
        .ok_or_else(|| ShapeError::new(path.clone(), Problem::Missing))?;
    StageBlock::from_value_at(block, &path)
}

/// Who writes records: the `operator` and `developer` headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Producer {
    pub operator: String,
    pub developer: String,
}

impl Producer {
    /// This project's own producer headers.
    pub fn mesh_node() -> Self {
        Self {
            operator: "mesh-node".into(),
            developer: format!("mesh-node/{}", env!("CARGO_PKG_VERSION")),
        }
    }
}

/// What every record this crate builds needs from its caller: time and
/// randomness come from outside (sans-IO).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordContext {
    pub producer: Producer,
    /// `YYYY-MM-DDTHH:MM:SS.mmmZ`; see [`format_timestamp`].
    pub timestamp: String,
    /// Fresh random bytes per record, so equal content never repeats an id.
    pub store_nonce: [u8; 32],
    /// The node's chain head, when records are chained.
    pub chain_parent: Option<[u8; 32]>,
}

/// A citation with a purpose, as records list them in `references`.
pub fn citation(digest: &[u8; 32], purpose: &str) -> Value {
    json!({ "type": "capsule", "digest_alg": "SHA-256", "digest": hex::encode(digest), "citation_purpose": purpose })
}

fn envelope_members(
    context: &RecordContext,
    action_id: String,
    model_id: &str,
    provider: &str,
    compute_attestation: Map<String, Value>,
    effect_mode: &str,
) -> Map<String, Value> {
    let mut compute_attestation = compute_attestation;
    compute_attestation.insert(
        "store_nonce".into(),
        json!(hex::encode(&context.store_nonce)),
    );
    let mut map = Map::new();
    map.insert("spec_version".into(), json!(SPEC_VERSION));
    map.insert("format_version".into(), json!(FORMAT_VERSION));
    map.insert("canonicalization_id".into(), json!(CANONICALIZATION_ID));
    map.insert("action_id".into(), json!(action_id));
    map.insert("action_type".into(), json!("fyi"));
    map.insert("operator".into(), json!(context.producer.operator));
    map.insert("developer".into(), json!(context.producer.developer));
    map.insert("timestamp".into(), json!(context.timestamp));
    map.insert("domain".into(), json!("action"));
    map.insert("provenance".into(), json!("collector"));
    map.insert(
        "model_attestation".into(),
        json!({ "model_id": model_id, "provider": provider, "compute_attestation": compute_attestation }),
    );
    map.insert(
        "assurance".into(),
        json!({
            "attestation_mode": "self_attested",
            "effect_mode": effect_mode,
            "ledger_mode": if context.chain_parent.is_some() { "chained" } else { "standalone" },
        }),
    );
    map.insert(
        "disposition".into(),
        json!({ "decision": "accept", "approver": "policy", "human_disposed": false, "verdict_class": "executed" }),
    );
    if let Some(parent) = &context.chain_parent {
        map.insert(
            "chain".into(),
            json!({ "parent_capsule_id": hex::encode(parent), "relation": "follows" }),
        );
    }
    map
}

fn split_action_id(block: &StageBlock) -> String {
    format!(
        "mesh-poc/split-stage/{}/{}/{}/{}/{}",
        block.side.as_str(),
        block.coordinator_node_id,
        block.run_id,
        block.request_id,
        block.stage_index
    )
}

/// Why a record cannot be built from the given block.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum BuildError {
    #[error("the block is not valid in this placement: {0}")]
    Block(#[from] ShapeError),
    #[error("a {wanted} record needs a block with {needed}")]
    WrongPlacement {
        wanted: &'static str,
        needed: &'static str,
    },
}

/// The unsigned stage record a stage node seals about its own slice. A stage
/// record cites nothing.
pub fn stage_record(context: &RecordContext, block: &StageBlock) -> Result<Value, BuildError> {
    StageBlock::from_value(&block.to_value())?;
    if block.side != Side::Stage {
        return Err(BuildError::WrongPlacement {
            wanted: "stage",
            needed: "side stage",
        });
    }
    let mut compute = Map::new();
    compute.insert("x-mesh-poc-v1".into(), json!({ "role": "stage" }));
    compute.insert(STAGE_BLOCK_MEMBER.into(), block.to_value());
    Ok(Value::Object(envelope_members(
        context,
        split_action_id(block),
        "n/a-split-stage",
        "mesh-llm",
        compute,
        "not_applicable",
    )))
}

/// The unsigned stage-exchange record the coordinator seals about remote
/// stage k, citing the stage's own record once it arrived.
pub fn stage_exchange_record(
    context: &RecordContext,
    block: &StageBlock,
    stage_record_id: Option<&[u8; 32]>,
) -> Result<Value, BuildError> {
    StageBlock::from_value(&block.to_value())?;
    if block.side != Side::Coordinator || block.stage_index == 0 {
        return Err(BuildError::WrongPlacement {
            wanted: "stage-exchange",
            needed: "side coordinator and stage_index >= 1",
        });
    }
    let mut compute = Map::new();
    compute.insert("x-mesh-poc-v1".into(), json!({ "role": "stage" }));
    compute.insert(STAGE_BLOCK_MEMBER.into(), block.to_value());
    let mut map = envelope_members(
        context,
        split_action_id(block),
        "n/a-split-stage",
        "mesh-llm",
        compute,
        "not_applicable",
    );
    if let Some(id) = stage_record_id {
        map.insert(
            "references".into(),
            Value::Array(vec![citation(id, "counterparty_half")]),
        );
    }
    Ok(Value::Object(map))
}

/// The unsigned main record of a split request: the coordinator's own
/// slice, its receipt block, and one `split_stage` reference per remote
/// stage's stage-exchange record, in stage order.
pub fn main_record(
    context: &RecordContext,
    model_id: &str,
    own_slice: &StageBlock,
    receipt: &crate::receipt::CoordinatorReceipt,
    stage_exchange_ids: &[[u8; 32]],
) -> Result<Value, BuildError> {
    StageBlock::from_value(&own_slice.to_value())?;
    crate::receipt::CoordinatorReceipt::from_value(&receipt.to_value())?;
    if own_slice.side != Side::Coordinator || own_slice.stage_index != 0 {
        return Err(BuildError::WrongPlacement {
            wanted: "main",
            needed: "side coordinator and stage_index 0",
        });
    }
    let mut compute = Map::new();
    compute.insert("x-mesh-poc-v1".into(), json!({ "role": "served" }));
    compute.insert(STAGE_BLOCK_MEMBER.into(), own_slice.to_value());
    compute.insert(
        crate::receipt::RECEIPT_BLOCK_MEMBER.into(),
        receipt.to_value(),
    );
    let mut map = envelope_members(
        context,
        format!(
            "mesh-node/split/{}/{}/{}",
            own_slice.coordinator_node_id, own_slice.run_id, own_slice.request_id
        ),
        model_id,
        "mesh-node",
        compute,
        "dispatched_unconfirmed",
    );
    map.insert(
        "effect".into(),
        json!({ "status": "dispatched", "type": "inference_completion", "effect_attestation": "host_served_observed" }),
    );
    map.insert(
        "references".into(),
        Value::Array(
            stage_exchange_ids
                .iter()
                .map(|id| citation(id, "split_stage"))
                .collect(),
        ),
    );
    Ok(Value::Object(map))
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for milliseconds since the Unix epoch.
pub fn format_timestamp(unix_millis: u64) -> String {
    let millis = unix_millis % 1000;
    let seconds = unix_millis / 1000;
    let (days, second_of_day) = (seconds / 86_400, seconds % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        second_of_day / 3600,
        second_of_day / 60 % 60,
        second_of_day % 60
    )
}

/// Read the `references` of a record as `(digest, purpose)` pairs.
pub fn references_of(record: &Value) -> Result<Vec<([u8; 32], String)>, ShapeError> {
    let Some(list) = record.get("references") else {
        return Ok(Vec::new());
    };
    let items = list
        .as_array()
        .ok_or_else(|| ShapeError::new("/references", Problem::WrongType("an array")))?;
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let path = format!("/references/{i}");
            let mut m = Members::of(item, &path)?;
            m.string("type")?;
            m.string("digest_alg")?;
            let digest_path = m.path("digest");
            let digest = hex::decode_array(m.string("digest")?).ok_or_else(|| {
                ShapeError::invalid(digest_path, "must be 64 lowercase hex digits")
            })?;
            let purpose = m
                .optional("citation_purpose")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            Ok((digest, purpose))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(format_timestamp(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            format_timestamp(1_790_739_480_000),
            "2026-09-30T03:38:00.000Z"
        );
        assert_eq!(
            format_timestamp(951_782_400_123),
            "2000-02-29T00:00:00.123Z"
        );
    }

    #[test]
    fn envelope_is_181_bytes_and_verifies() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let envelope = sign_envelope(&[1; 32], &key);
        assert_eq!(envelope.len(), 181);
        let key_id = key.verifying_key().to_bytes();
        assert_eq!(verify_envelope(&envelope, &[1; 32], &key_id), Ok(()));
        assert_eq!(
            verify_envelope(&envelope, &[2; 32], &key_id),
            Err(EnvelopeError::Payload)
        );
        let other = SigningKey::from_bytes(&[8; 32]).verifying_key().to_bytes();
        assert_eq!(
            verify_envelope(&envelope, &[1; 32], &other),
            Err(EnvelopeError::Header)
        );
        for index in 0..envelope.len() {
            let mut flipped = envelope.clone();
            flipped[index] ^= 0x01;
            assert!(
                verify_envelope(&flipped, &[1; 32], &key_id).is_err(),
                "byte {index}"
            );
        }
        let mut trailing = envelope.clone();
        trailing.push(0);
        assert!(verify_envelope(&trailing, &[1; 32], &key_id).is_err());
        assert!(verify_envelope(&envelope[..180], &[1; 32], &key_id).is_err());
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use crate::block::tests::valid_block;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn stage_records_round_trip_through_seal_and_verify(
            block in valid_block().prop_filter("stage side", |b| b.side == Side::Stage),
            seed in any::<[u8; 32]>(),
            nonce in any::<[u8; 32]>(),
            millis in 0u64..4_102_444_800_000,
        ) {
            let context = RecordContext {
                producer: Producer::mesh_node(),
                timestamp: format_timestamp(millis),
                store_nonce: nonce,
                chain_parent: None,
            };
            let key = SigningKey::from_bytes(&seed);
            let sealed = SealedRecord::seal(stage_record(&context, &block).unwrap(), &key).unwrap();
            let text = serde_json::to_vec(sealed.value()).unwrap();
            let reread = SealedRecord::verify(crate::json::parse_strict(&text).unwrap()).unwrap();
            prop_assert_eq!(reread.capsule_id(), sealed.capsule_id());
            prop_assert_eq!(reread.key_id(), key.verifying_key().to_bytes());
            prop_assert_eq!(reread.stage_block().unwrap(), block);
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_verifier(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(value) = crate::json::parse_strict(&bytes) {
                let _ = crate::verify::verify_document(&value);
                let _ = SealedRecord::verify(value);
            }
        }

        #[test]
        fn arbitrary_envelopes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = verify_envelope(&bytes, &[0; 32], &[0; 32]);
        }
    }
}
