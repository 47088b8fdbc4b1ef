//! A stage's own `mesh/1` receipt for its part of a split serve, and how it
//! reaches the requester: the stage pushes it to its coordinator on
//! `record-push/1` beside its stage record, and the coordinator's bundle
//! carries it (`stage_receipts`), so the requester sees every stage's
//! served span, each under its own steward's signature, and never only the
//! coordinator's presented as the whole (seed 001 §3.3).
//!
//! A stage receipt names the split it served in its `recipe`
//! ([`stage_recipe`]): a verifier ties it to a stage of a bundle's split by
//! that text, by its backend, and by its steward being the node the split
//! receipt routed the stage to.

use serde_json::{Value, json};
use thiserror::Error;

use crate::hex;
use crate::json::{Members, ShapeError};
use crate::mesh1::{MAX_ENVELOPE_BYTES, Mesh1Error, SealedReceipt};

/// The backend a stage's receipt names.
pub const STAGE_BACKEND: &str = "mesh-node/stage";

/// The marker member of a stage receipt's push on `record-push/1`.
pub const STAGE_RECEIPT_PUSH_MEMBER: &str = "mesh1_stage_receipt";

/// The recipe of stage `stage`'s receipt for request `request_id` of run
/// `run_id`: the text that ties it to that split.
pub fn stage_recipe(stage: u32, run_id: &str, request_id: u64) -> String {
    format!("stage {stage} of run {run_id}, request {request_id}")
}

/// The route line of a stage's receipt: a stage is assigned, not routed.
pub fn stage_route(run_id: &str) -> String {
    format!("assigned by coordinator for run {run_id}")
}

/// Why a stage receipt does not belong to the stage it is offered for.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StageReceiptError {
    #[error("the envelope does not verify: {0}")]
    Envelope(#[from] Mesh1Error),
    #[error("sealed by {got}, not by {expected}, the node routed this stage")]
    Steward { got: String, expected: String },
    #[error("backend `{0}` is not a stage's ({STAGE_BACKEND})")]
    Backend(String),
    #[error("its recipe `{got}` does not name this split's stage (`{expected}`)")]
    Recipe { got: String, expected: String },
}

/// Check a stage receipt's envelope against the stage it is offered for:
/// it verifies, its steward is `node` (the did:key the split routed stage
/// `stage` to), and it names the stage's backend and this split's stage,
/// run and request.
pub fn check_stage_receipt(
    envelope: &[u8],
    stage: u32,
    run_id: &str,
    request_id: u64,
    node: &str,
) -> Result<SealedReceipt, StageReceiptError> {
    let sealed = SealedReceipt::verify(envelope)?;
    let receipt = &sealed.receipt;
    if receipt.steward != node {
        return Err(StageReceiptError::Steward {
            got: receipt.steward.clone(),
            expected: node.to_string(),
        });
    }
    if receipt.backend != STAGE_BACKEND {
        return Err(StageReceiptError::Backend(receipt.backend.clone()));
    }
    let expected = stage_recipe(stage, run_id, request_id);
    if receipt.recipe != expected {
        return Err(StageReceiptError::Recipe {
            got: receipt.recipe.clone(),
            expected,
        });
    }
    Ok(sealed)
}

/// A stage receipt as it travels: pushed to the coordinator, and carried
/// in the requester's bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CarriedStageReceipt {
    pub stage_index: u32,
    /// The COSE_Sign1 envelope, as its steward sealed it.
    pub envelope: Vec<u8>,
}

impl CarriedStageReceipt {
    /// As a bundle's `stage_receipts` holds it.
    pub fn to_value(&self) -> Value {
        json!({
            "stage_index": self.stage_index,
            "envelope": hex::encode(&self.envelope),
        })
    }

    pub fn from_value_at(value: &Value, path: &str) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, path)?;
        let stage_index = m.u32("stage_index")?;
        let envelope = envelope_member(&mut m, "envelope")?;
        m.finish()?;
        Ok(Self {
            stage_index,
            envelope,
        })
    }

    /// The push body on `record-push/1` (after the sender line):
    /// `{"mesh1_stage_receipt": 1, "request_id": "<u64>", "stage_index",
    /// "envelope"}`.
    pub fn push_value(&self, request_id: u64) -> Value {
        json!({
            STAGE_RECEIPT_PUSH_MEMBER: 1,
            "request_id": request_id.to_string(),
            "stage_index": self.stage_index,
            "envelope": hex::encode(&self.envelope),
        })
    }

    /// Read a push body: the request it is for, and the receipt.
    pub fn from_push_value(value: &Value) -> Result<(u64, Self), ShapeError> {
        let mut m = Members::of(value, "")?;
        let marker = m.path(STAGE_RECEIPT_PUSH_MEMBER);
        if m.u64(STAGE_RECEIPT_PUSH_MEMBER)? != 1 {
            return Err(ShapeError::invalid(marker, "must be 1"));
        }
        let id_path = m.path("request_id");
        let request_id = crate::block::parse_request_id(m.string("request_id")?)
            .ok_or_else(|| ShapeError::invalid(id_path, "a decimal u64"))?;
        let stage_index = m.u32("stage_index")?;
        let envelope = envelope_member(&mut m, "envelope")?;
        m.finish()?;
        Ok((
            request_id,
            Self {
                stage_index,
                envelope,
            },
        ))
    }
}

fn envelope_member(m: &mut Members<'_>, key: &'static str) -> Result<Vec<u8>, ShapeError> {
    let path = m.path(key);
    m.string(key)
        .ok()
        .filter(|t| t.len() <= 2 * MAX_ENVELOPE_BYTES)
        .and_then(hex::decode)
        .ok_or_else(|| ShapeError::invalid(path, "lowercase hex of a COSE envelope"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SigningKey;
    use crate::identity::did_key;
    use crate::mesh1::{Energy, MeshReceipt};
    use proptest::prelude::*;

    fn sealed(key: &SigningKey, recipe: &str, backend: &str) -> Vec<u8> {
        let mut receipt = MeshReceipt::blank(
            [1; 32],
            backend,
            recipe,
            &stage_route("run-1"),
            Energy::estimator(1234),
            [2; 16],
        );
        receipt.steward = did_key(&key.verifying_key().to_bytes());
        receipt.seal(key).unwrap().envelope
    }

    #[test]
    fn a_stage_receipt_belongs_only_to_its_stage_node_and_split() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let node = did_key(&key.verifying_key().to_bytes());
        let envelope = sealed(&key, &stage_recipe(2, "run-1", 99), STAGE_BACKEND);
        let checked = check_stage_receipt(&envelope, 2, "run-1", 99, &node).unwrap();
        assert_eq!(checked.receipt.energy.uj(), 1234);
        // Another stage, run or request, another node, another backend.
        for (stage, run, request) in [(1, "run-1", 99), (2, "run-2", 99), (2, "run-1", 98)] {
            assert!(matches!(
                check_stage_receipt(&envelope, stage, run, request, &node),
                Err(StageReceiptError::Recipe { .. })
            ));
        }
        let other = did_key(&SigningKey::from_bytes(&[8; 32]).verifying_key().to_bytes());
        assert!(matches!(
            check_stage_receipt(&envelope, 2, "run-1", 99, &other),
            Err(StageReceiptError::Steward { .. })
        ));
        let coordinator = sealed(&key, &stage_recipe(2, "run-1", 99), "mesh-node/split");
        assert!(matches!(
            check_stage_receipt(&coordinator, 2, "run-1", 99, &node),
            Err(StageReceiptError::Backend(_))
        ));
        let mut flipped = envelope.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(matches!(
            check_stage_receipt(&flipped, 2, "run-1", 99, &node),
            Err(StageReceiptError::Envelope(_))
        ));
    }

    #[test]
    fn pushes_and_bundle_entries_read_back_strictly() {
        let carried = CarriedStageReceipt {
            stage_index: 3,
            envelope: vec![0xd2, 0x84, 1, 2],
        };
        let push = carried.push_value(u64::MAX);
        assert_eq!(
            CarriedStageReceipt::from_push_value(&push).unwrap(),
            (u64::MAX, carried.clone())
        );
        let entry = carried.to_value();
        assert_eq!(
            CarriedStageReceipt::from_value_at(&entry, "").unwrap(),
            carried
        );
        let mut extra = push.clone();
        extra["note"] = json!(1);
        assert!(CarriedStageReceipt::from_push_value(&extra).is_err());
        let mut upper = entry;
        upper["envelope"] = json!("D284");
        assert!(CarriedStageReceipt::from_value_at(&upper, "").is_err());
    }

    proptest! {
        #[test]
        fn a_push_body_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(value) = crate::json::parse_strict(&bytes) {
                let _ = CarriedStageReceipt::from_push_value(&value);
                let _ = CarriedStageReceipt::from_value_at(&value, "");
            }
        }
    }
}
