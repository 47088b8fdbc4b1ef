//! The coordinator's sealing of one split request (§4.3): plan each remote
//! stage's receipt entry from the stage records it holds, seal one
//! stage-exchange record per remote stage (each chained `follows`), then the
//! main record chained after the last of them, and assemble the requester's
//! bundle.

use ed25519_dalek::SigningKey;
use serde_json::Value;

use crate::block::{CoordinatorObserved, DirectReturn, ReturnMode, Side, StageBlock};
use crate::bundle::MeshBundle;
use crate::capsule::{
    BuildError, Producer, RecordContext, RecordError, SealedRecord, main_record,
    stage_exchange_record,
};
use crate::receipt::{
    Assignment, CoordinatorReceipt, HopRole, StageBundle, TopologyEntry, plan_stage,
};

/// Everything the coordinator knows when it seals.
#[derive(Debug, Clone)]
pub struct SplitSealInput<'a> {
    /// The coordinator's own slice (side coordinator, stage 0).
    pub own: &'a StageBlock,
    /// What was routed, stage 0 first.
    pub topology: &'a [Assignment],
    /// The manifest SHA-256 assigned to each stage, stage 0 first: the
    /// package-wide value, so every entry equals the own slice's.
    pub manifests: &'a [[u8; 32]],
    /// Stage records held per stage index (index 0 is ignored); each already
    /// passed the door's checks.
    pub held: &'a [Vec<SealedRecord>],
    /// Stages whose records were not asked for.
    pub not_requested: &'a [u32],
    pub coordinator_term: u64,
    pub stage_seal_deadline_ms: u64,
    pub model_id: &'a str,
}

/// Clock and randomness for the records of one seal.
#[derive(Debug, Clone)]
pub struct SealEnvironment {
    pub producer: Producer,
    pub timestamp: String,
    /// One fresh nonce per record sealed (stage-exchange records, then main).
    pub nonces: Vec<[u8; 32]>,
    /// The coordinator's chain head before this seal.
    pub chain_head: Option<[u8; 32]>,
}

/// What one seal produced.
#[derive(Debug, Clone)]
pub struct SealedSplit {
    pub receipt: CoordinatorReceipt,
    pub stage_exchange_records: Vec<SealedRecord>,
    pub main_record: SealedRecord,
    /// Every held stage record, conflicts included, in stage order.
    pub carried: Vec<SealedRecord>,
}

impl SealedSplit {
    /// The requester's bundle document.
    pub fn bundle(&self) -> Value {
        let carried: Vec<Value> = self.carried.iter().map(|r| r.value().clone()).collect();
        let exchange: Vec<Value> = self
            .stage_exchange_records
            .iter()
            .map(|r| r.value().clone())
            .collect();
        MeshBundle::to_value(self.main_record.value(), &carried, &exchange)
    }

    /// The coordinator's chain head after this seal.
    pub fn chain_head(&self) -> [u8; 32] {
        self.main_record.capsule_id()
    }
}

/// Why a split could not be sealed.
#[derive(Debug, thiserror::Error)]
pub enum SplitSealError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("{0}")]
    Inconsistent(&'static str),
    #[error("{got} manifests for {expected} stages")]
    ManifestCount { expected: usize, got: usize },
    #[error(
        "stage {stage_index} was assigned another manifest than the own slice's: a manifest is package-wide"
    )]
    ManifestNotPackageWide { stage_index: usize },
}

/// Seal a split (see the module documentation).
pub fn seal_split(
    input: &SplitSealInput<'_>,
    environment: &SealEnvironment,
    key: &SigningKey,
) -> Result<SealedSplit, SplitSealError> {
    let own = input.own;
    let n = input.topology.len();
    if input.manifests.len() != n {
        return Err(SplitSealError::ManifestCount {
            expected: n,
            got: input.manifests.len(),
        });
    }
    if let Some(stage_index) = input
        .manifests
        .iter()
        .position(|m| *m != own.manifest_sha256)
    {
        return Err(SplitSealError::ManifestNotPackageWide { stage_index });
    }
    if own.side != Side::Coordinator || own.stage_index != 0 {
        return Err(SplitSealError::Inconsistent(
            "the own slice must be side coordinator, stage 0",
        ));
    }
    if usize::try_from(own.stage_count).ok() != Some(n) || n < 2 {
        return Err(SplitSealError::Inconsistent(
            "topology length must equal the own slice's stage_count",
        ));
    }
    let first = &input.topology[0];
    if first.node_id != own.coordinator_node_id
        || (first.layer_start, first.layer_end, first.package_id)
            != (own.layer_start, own.layer_end, own.package_id)
    {
        return Err(SplitSealError::Inconsistent(
            "topology[0] must be the coordinator's own slice",
        ));
    }
    if environment.nonces.len() < n {
        return Err(SplitSealError::Inconsistent(
            "one nonce per sealed record is needed",
        ));
    }
    let split_key = own.split_key();
    let direct = own.return_mode == ReturnMode::Direct;

    let mut stages = vec![StageBundle::NotRequested];
    let mut carried = Vec::new();
    let mut stage_records: Vec<Option<[u8; 32]>> = vec![None];
    for k in 1..n {
        let index =
            u32::try_from(k).map_err(|_| SplitSealError::Inconsistent("too many stages"))?;
        let held: Vec<&SealedRecord> = input
            .held
            .get(k)
            .map(|records| {
                records
                    .iter()
                    .filter(|r| {
                        r.stage_block().is_ok_and(|b| {
                            b.side == Side::Stage
                                && b.stage_index == index
                                && b.split_key() == split_key
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        carried.extend(held.iter().map(|r| (*r).clone()));
        let bundle = if input.not_requested.contains(&index) {
            StageBundle::NotRequested
        } else {
            plan_stage(&held.iter().map(|r| r.capsule_id()).collect::<Vec<_>>())
        };
        stage_records.push(match &bundle {
            StageBundle::Present(reference) => Some(reference.digest),
            _ => None,
        });
        stages.push(bundle);
    }
    carried.sort_by_key(|r| {
        (
            r.stage_block().map(|b| b.stage_index).unwrap_or(u32::MAX),
            r.capsule_id(),
        )
    });
    carried.dedup_by_key(|r| r.capsule_id());

    let receipt = CoordinatorReceipt {
        run_id: own.run_id.clone(),
        topology: input
            .topology
            .iter()
            .enumerate()
            .map(|(k, assignment)| TopologyEntry {
                role: if k == 0 {
                    HopRole::Coordinator
                } else {
                    HopRole::Stage
                },
                observation_point: None,
                assignment: assignment.clone(),
            })
            .collect(),
        stages,
        coordinator_node_id: own.coordinator_node_id.clone(),
        request_id: own.request_id,
        stage_seal_deadline_ms: input.stage_seal_deadline_ms,
    };
    CoordinatorReceipt::from_value(&receipt.to_value()).map_err(BuildError::from)?;

    let mut chain_head = environment.chain_head;
    let mut exchange = Vec::with_capacity(n - 1);
    for (k, (assignment, stage_record)) in input
        .topology
        .iter()
        .zip(&stage_records)
        .enumerate()
        .skip(1)
    {
        let index =
            u32::try_from(k).map_err(|_| SplitSealError::Inconsistent("too many stages"))?;
        let is_final = k + 1 == n;
        let observed = k == 1 || (direct && is_final);
        let block = StageBlock {
            side: Side::Coordinator,
            stage_index: index,
            layer_start: assignment.layer_start,
            layer_end: assignment.layer_end,
            package_id: assignment.package_id,
            manifest_sha256: input.manifests[k],
            upstream: None,
            downstream: None,
            direct_return: None,
            tokens: None,
            coordinator_term: Some(input.coordinator_term),
            data_path_observed: Some(observed),
            coordinator_observed: observed.then_some(CoordinatorObserved {
                downstream: if k == 1 { own.downstream } else { None },
                direct_return_received: match (direct && is_final, own.direct_return) {
                    (true, Some(DirectReturn::Received(lane))) => Some(lane),
                    _ => None,
                },
            }),
            ..own.clone()
        };
        let context = RecordContext {
            producer: environment.producer.clone(),
            timestamp: environment.timestamp.clone(),
            store_nonce: environment.nonces[k - 1],
            chain_parent: chain_head,
        };
        let unsigned = stage_exchange_record(&context, &block, stage_record.as_ref())?;
        let sealed = SealedRecord::seal(unsigned, key)?;
        chain_head = Some(sealed.capsule_id());
        exchange.push(sealed);
    }
    let context = RecordContext {
        producer: environment.producer.clone(),
        timestamp: environment.timestamp.clone(),
        store_nonce: environment.nonces[n - 1],
        chain_parent: chain_head,
    };
    let exchange_ids: Vec<[u8; 32]> = exchange.iter().map(SealedRecord::capsule_id).collect();
    let unsigned = main_record(&context, input.model_id, own, &receipt, &exchange_ids)?;
    let main = SealedRecord::seal(unsigned, key)?;
    Ok(SealedSplit {
        receipt,
        stage_exchange_records: exchange,
        main_record: main,
        carried,
    })
}
