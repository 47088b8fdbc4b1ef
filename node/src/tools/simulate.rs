//! A split request simulated in memory, end to end through the real record
//! code: frames are generated, folded by both ends of every hop through
//! their hop sessions, each stage seals its record with its own key, and the
//! coordinator seals the receipt. Used by the vector generator and tests;
//! the serving path folds real frames instead.

use mesh_protocol::SigningKey;
use mesh_protocol::block::{ReturnMode, SplitKey, StageBlock, TerminalState, Tokens};
use mesh_protocol::capsule::{
    Producer, RecordContext, SealedRecord, format_timestamp, stage_record,
};
use mesh_protocol::identity::did_key;
use mesh_protocol::receipt::{Assignment, DEFAULT_STAGE_SEAL_DEADLINE_MS};
use mesh_protocol::session::{HopSession, RequestScope, SliceFacts, Wire};
use mesh_protocol::split::{SealEnvironment, SealedSplit, SplitSealInput, seal_split};
use sha2::{Digest, Sha256};

/// Deterministic bytes for a label: SHA-256 in counter mode.
pub fn deterministic_bytes(label: &str, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 32);
    let mut counter = 0u64;
    while out.len() < len {
        let mut h = Sha256::new();
        h.update(label.as_bytes());
        h.update(counter.to_be_bytes());
        out.extend_from_slice(&h.finalize());
        counter += 1;
    }
    out.truncate(len);
    out
}

pub fn deterministic_32(label: &str) -> [u8; 32] {
    Sha256::digest(label.as_bytes()).into()
}

/// The fixed keys of the simulation (seeds are published in vectors/meta.json).
pub fn coordinator_key() -> SigningKey {
    SigningKey::from_bytes(&deterministic_32("mesh-node vectors: coordinator key"))
}

pub fn stage_key(stage: usize) -> SigningKey {
    SigningKey::from_bytes(&deterministic_32(&format!(
        "mesh-node vectors: stage {stage} key"
    )))
}

/// What goes wrong in a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// One byte of one forward frame on hop `hop` altered in flight: the
    /// receiver folds what it read.
    AlterForwardByte {
        hop: usize,
    },
    /// Forward frames 0 and 1 on hop `hop` delivered in swapped order.
    SwapForwardFrames {
        hop: usize,
    },
    /// Stage `stage` never pushes its record.
    StageSilent {
        stage: usize,
    },
    /// Stage `stage` pushes two different records for the same request.
    TwoRecords {
        stage: usize,
    },
    /// Stage `stage` loads a slice other than the one assigned.
    WrongSlice {
        stage: usize,
    },
}

/// One simulated request.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub stages: usize,
    pub return_mode: ReturnMode,
    pub terminal_state: TerminalState,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub fault: Fault,
}

impl Default for Scenario {
    fn default() -> Self {
        Self {
            stages: 3,
            return_mode: ReturnMode::Relayed,
            terminal_state: TerminalState::Completed,
            prefill_tokens: 12,
            decode_tokens: 4,
            fault: Fault::None,
        }
    }
}

pub const RUN_ID: &str = "mesh-split-1790739480000000000";
pub const REQUEST_ID: u64 = 0x5eed_0000_0000_0001;
/// 2026-09-30T03:38:00.000Z
pub const TIMESTAMP_MILLIS: u64 = 1_790_739_480_000;
pub const LAYERS: u32 = 30;
pub const MODEL_ID: &str = "synthetic-llama (seeded weights, not a real model)";

/// The simulated run: everything a requester would receive.
#[derive(Debug, Clone)]
pub struct SimulatedRun {
    pub own: StageBlock,
    pub topology: Vec<Assignment>,
    pub stage_records: Vec<Vec<SealedRecord>>,
    pub sealed: SealedSplit,
}

fn frame(label: &str, len: usize) -> Vec<u8> {
    deterministic_bytes(label, len)
}

/// Fold `frames` on `wire`'s lane of `session`, each in pieces, as bytes
/// come off a stream.
fn fold(session: &mut HopSession, wire: Wire, frames: &[Vec<u8>]) {
    for frame in frames {
        for piece in frame.chunks(61) {
            session.fold_chunk(wire, piece);
        }
        session.end_frame(wire);
    }
}

/// Run the scenario.
pub fn simulate(scenario: &Scenario) -> SimulatedRun {
    let n = scenario.stages;
    let coordinator = coordinator_key();
    let coordinator_id = did_key(&coordinator.verifying_key().to_bytes());
    let package_id = deterministic_32("mesh-node vectors: package");
    let per_stage = LAYERS / n as u32;
    let topology: Vec<Assignment> = (0..n)
        .map(|k| Assignment {
            node_id: if k == 0 {
                coordinator_id.clone()
            } else {
                did_key(&stage_key(k).verifying_key().to_bytes())
            },
            layer_start: k as u32 * per_stage,
            layer_end: if k + 1 == n {
                LAYERS
            } else {
                (k as u32 + 1) * per_stage
            },
            package_id,
        })
        .collect();
    let scope = RequestScope {
        split: SplitKey {
            coordinator_node_id: coordinator_id.clone(),
            run_id: RUN_ID.into(),
            request_id: REQUEST_ID,
        },
        stage_count: n as u32,
        return_mode: scenario.return_mode,
    };
    let relayed = scenario.return_mode == ReturnMode::Relayed;
    let steps = 1 + scenario.decode_tokens as usize;

    // Frames as sent and as received on each hop.
    let mut forward_sent = Vec::new();
    let mut forward_received = Vec::new();
    let mut replies = Vec::new();
    for hop in 0..n - 1 {
        let sent: Vec<Vec<u8>> = (0..steps)
            .map(|step| {
                frame(
                    &format!("forward hop {hop} step {step}"),
                    if step == 0 { 4096 } else { 512 },
                )
            })
            .collect();
        let mut received = sent.clone();
        match scenario.fault {
            Fault::AlterForwardByte { hop: h } if h == hop => received[1][17] ^= 0x01,
            Fault::SwapForwardFrames { hop: h } if h == hop => received.swap(0, 1),
            _ => {}
        }
        forward_sent.push(sent);
        forward_received.push(received);
        replies.push(if relayed {
            (0..steps)
                .map(|step| frame(&format!("reply hop {hop} step {step}"), 24))
                .collect()
        } else {
            Vec::new()
        });
    }
    let direct_frames: Vec<Vec<u8>> = if relayed {
        Vec::new()
    } else {
        (0..steps)
            .map(|step| frame(&format!("direct step {step}"), 24))
            .collect()
    };

    let facts = |k: usize, layer_start: u32, layer_end: u32| SliceFacts {
        topology_hash: mesh_protocol::hex::encode(&deterministic_32("mesh-node vectors: topology")),
        stage_index: k as u32,
        layer_start,
        layer_end,
        package_id,
        manifest_sha256: deterministic_32("mesh-node vectors: manifest"),
        source_model_sha256: deterministic_32("mesh-node vectors: source model"),
    };
    let tokens = Tokens {
        prefill_received: scenario.prefill_tokens,
        decode: scenario.decode_tokens,
    };
    let mut own = HopSession::new(scope.clone(), 0);
    fold(&mut own, Wire::ToDownstream, &forward_sent[0]);
    fold(&mut own, Wire::FromDownstream, &replies[0]);
    fold(&mut own, Wire::DirectReceived, &direct_frames);
    let own = own.block(
        &facts(0, topology[0].layer_start, topology[0].layer_end),
        tokens,
        scenario.terminal_state,
    );

    let timestamp = format_timestamp(TIMESTAMP_MILLIS);
    let mut stage_records: Vec<Vec<SealedRecord>> = vec![Vec::new()];
    for k in 1..n {
        let is_final = k + 1 == n;
        let (layer_start, layer_end) = match scenario.fault {
            Fault::WrongSlice { stage } if stage == k => {
                (topology[k].layer_start + 1, topology[k].layer_end)
            }
            _ => (topology[k].layer_start, topology[k].layer_end),
        };
        let mut session = HopSession::new(scope.clone(), k as u32);
        fold(&mut session, Wire::FromUpstream, &forward_received[k - 1]);
        fold(&mut session, Wire::ToUpstream, &replies[k - 1]);
        if !is_final {
            session.open_downstream();
            fold(&mut session, Wire::ToDownstream, &forward_sent[k]);
            fold(&mut session, Wire::FromDownstream, &replies[k]);
        }
        if is_final && !relayed {
            session.open_direct();
            fold(&mut session, Wire::DirectSent, &direct_frames);
        }
        let block = session.block(
            &facts(k, layer_start, layer_end),
            tokens,
            scenario.terminal_state,
        );
        let mut records = Vec::new();
        let copies = match scenario.fault {
            Fault::StageSilent { stage } if stage == k => 0,
            Fault::TwoRecords { stage } if stage == k => 2,
            _ => 1,
        };
        for copy in 0..copies {
            let record_context = RecordContext {
                producer: Producer::mesh_node(),
                timestamp: timestamp.clone(),
                store_nonce: deterministic_32(&format!(
                    "mesh-node vectors: stage {k} nonce {copy}"
                )),
                chain_parent: None,
            };
            let unsigned =
                stage_record(&record_context, &block).expect("simulated blocks are valid");
            records.push(SealedRecord::seal(unsigned, &stage_key(k)).expect("sealing an object"));
        }
        stage_records.push(records);
    }

    let environment = SealEnvironment {
        producer: Producer::mesh_node(),
        timestamp,
        nonces: (0..n)
            .map(|i| deterministic_32(&format!("mesh-node vectors: coordinator nonce {i}")))
            .collect(),
        chain_head: None,
    };
    let sealed = seal_split(
        &SplitSealInput {
            own: &own,
            topology: &topology,
            manifests: &vec![own.manifest_sha256; topology.len()],
            held: &stage_records,
            not_requested: &[],
            coordinator_term: 1,
            stage_seal_deadline_ms: DEFAULT_STAGE_SEAL_DEADLINE_MS,
            model_id: MODEL_ID,
        },
        &environment,
        &coordinator,
    )
    .expect("simulated splits seal");
    SimulatedRun {
        own,
        topology,
        stage_records,
        sealed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::split::SplitSealError;

    /// Every stage-exchange record carries the manifest assigned to its
    /// stage; a split whose assigned manifests are not one package-wide
    /// value, or that names too few, does not seal.
    #[test]
    fn exchange_records_carry_the_assigned_manifest_and_only_a_package_wide_one() {
        let run = simulate(&Scenario::default());
        for record in &run.sealed.stage_exchange_records {
            assert_eq!(
                record.stage_block().unwrap().manifest_sha256,
                run.own.manifest_sha256
            );
        }
        let environment = SealEnvironment {
            producer: Producer::mesh_node(),
            timestamp: format_timestamp(1_790_000_000_000),
            nonces: vec![[5; 32]; run.topology.len()],
            chain_head: None,
        };
        let seal = |manifests: &[[u8; 32]]| {
            seal_split(
                &SplitSealInput {
                    own: &run.own,
                    topology: &run.topology,
                    manifests,
                    held: &run.stage_records,
                    not_requested: &[],
                    coordinator_term: 1,
                    stage_seal_deadline_ms: DEFAULT_STAGE_SEAL_DEADLINE_MS,
                    model_id: MODEL_ID,
                },
                &environment,
                &coordinator_key(),
            )
        };
        let mut manifests = vec![run.own.manifest_sha256; run.topology.len()];
        assert!(seal(&manifests).is_ok());
        manifests[2][0] ^= 1;
        assert!(matches!(
            seal(&manifests),
            Err(SplitSealError::ManifestNotPackageWide { stage_index: 2 })
        ));
        assert!(matches!(
            seal(&manifests[..2]),
            Err(SplitSealError::ManifestCount {
                expected: 3,
                got: 2
            })
        ));
    }
}

#[cfg(test)]
mod verify_tests {
    use super::*;
    use mesh_protocol::verify::verify_document;

    /// A bundle whose stage-exchange record names another manifest than
    /// the own slice's (re-signed by the coordinator, so only the manifest
    /// is wrong with it) fails the package-wide check.
    #[test]
    fn an_exchange_record_with_another_manifest_fails_the_bundle() {
        let run = simulate(&Scenario::default());
        let mut bundle = run.sealed.bundle();
        let record = &mut bundle["stage_exchange_records"][0];
        let pointer = "/model_attestation/compute_attestation/x-mesh-stage-v1/manifest_sha256";
        *record.pointer_mut(pointer).unwrap() = serde_json::json!("ab".repeat(32));
        *record = SealedRecord::seal(record.clone(), &coordinator_key())
            .unwrap()
            .into_value();
        let report = verify_document(&bundle).unwrap();
        let failed: Vec<String> = report
            .checks
            .iter()
            .filter_map(|c| c.outcome.clone().err())
            .collect();
        assert!(
            failed.iter().any(|e| e.contains("not the own slice's")),
            "{failed:?}"
        );
        let clean = verify_document(&run.sealed.bundle()).unwrap();
        assert!(clean.checks_passed());
    }
}
