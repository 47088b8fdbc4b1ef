//! `record-push/1` at a coordinator: pushes are verified before they are
//! acknowledged, and refusals are signed by the receiver.

use std::time::Duration;

use mesh_node::runtime::energy::EstimatorMeter;
use mesh_node::runtime::net::ALPN_RECORD_PUSH;
use mesh_node::runtime::net::tls::{self, TlsIdentity};
use mesh_node::runtime::records::{Received, refusal_verifies};
use mesh_node::runtime::serve::{Node, NodeOptions};
use mesh_protocol::SigningKey;
use mesh_protocol::block::{ReturnMode, StageBlock};
use mesh_protocol::capsule::{Producer, RecordContext, SealedRecord, stage_record};
use mesh_protocol::identity::did_key;
use mesh_stage::frame::WireDType;
use serde_json::Value;
use sha2::Digest;

/// Stage 1's block of a simulated split, sealed as a stage record by `key`.
fn simulated_stage_record(key: &SigningKey) -> (StageBlock, SealedRecord) {
    let run =
        mesh_node::tools::simulate::simulate(&mesh_node::tools::simulate::Scenario::default());
    let block = run.stage_records[1][0].stage_block().unwrap();
    let context = RecordContext {
        producer: Producer::mesh_node(),
        timestamp: "2026-11-30T00:00:00.000Z".into(),
        store_nonce: [4; 32],
        chain_parent: None,
    };
    let record = SealedRecord::seal(stage_record(&context, &block).unwrap(), key).unwrap();
    (block, record)
}

/// A collector holding open the split of `block`, with `stage_key`
/// assigned its stage (the others stand-in keys).
fn collector_expecting(
    block: &StageBlock,
    stage_key: [u8; 32],
) -> mesh_node::runtime::records::Collector {
    let mut collector = mesh_node::runtime::records::Collector::default();
    let assigned: Vec<[u8; 32]> = (0..block.stage_count as usize)
        .map(|k| {
            if k == block.stage_index as usize {
                stage_key
            } else {
                [k as u8; 32]
            }
        })
        .collect();
    assert!(collector.open(block.split_key(), assigned));
    collector
}

/// A push's bytes: the claimed sender, a newline, the body.
fn push_body(claimed: &str, value: &Value) -> Vec<u8> {
    let mut body = claimed.as_bytes().to_vec();
    body.push(b'\n');
    body.extend(serde_json::to_vec(value).unwrap());
    body
}

async fn push(node: &Node, key: &SigningKey, claimed: &str, record: &Value) -> Value {
    tls::install_provider();
    let identity = TlsIdentity::new(key).unwrap();
    let mut endpoint = quinn::Endpoint::client((std::net::Ipv4Addr::LOCALHOST, 0).into()).unwrap();
    endpoint.set_default_client_config(
        tls::client_config(&identity, node.public_key(), ALPN_RECORD_PUSH).unwrap(),
    );
    let connection = endpoint
        .connect(node.addr(), "mesh-node")
        .unwrap()
        .await
        .unwrap();
    let (mut send, mut recv) = connection.open_bi().await.unwrap();
    send.write_all(&push_body(claimed, record)).await.unwrap();
    send.finish().unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), recv.read_to_end(65536))
        .await
        .unwrap()
        .unwrap();
    serde_json::from_slice(&reply).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_from_unknown_keys_are_refused_with_signed_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let model = mesh_stage::synthetic::write_synthetic(
        &dir.path().join("model"),
        &mesh_stage::synthetic::SyntheticSpec::default(),
        &[candle_core::quantized::GgmlDType::F32],
    )
    .unwrap();
    let node = Node::start(NodeOptions {
        key: SigningKey::from_bytes(&[1; 32]),
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: None,
        model: model
            .gguf(candle_core::quantized::GgmlDType::F32)
            .unwrap()
            .to_path_buf(),
        device: mesh_stage::Device::Cpu,
        data: dir.path().join("node"),
        peers: Vec::new(),
        coordinators: Vec::new(),
        max_slices: 1,
        slice_idle: Duration::from_secs(60),
        stage_seal_deadline: Duration::from_millis(500),
        step_timeout: Duration::from_secs(5),
        request_timeout: mesh_node::runtime::serve::DEFAULT_REQUEST_TIMEOUT,
        max_requests: 2,
        max_queued: 0,
        prefill_chunk_tokens: mesh_node::runtime::serve::DEFAULT_PREFILL_CHUNK_TOKENS,
        draft_tokens: mesh_node::runtime::serve::DEFAULT_DRAFT_TOKENS,
        draft_model: None,
        max_resumes: mesh_node::runtime::serve::DEFAULT_MAX_RESUMES,
        audit_rate: 0.0,
        audit_pause: mesh_node::runtime::serve::DEFAULT_AUDIT_PAUSE,
        audit_tapes: None,
        return_mode: ReturnMode::Relayed,
        wire: WireDType::F32,
        meter: Box::new(EstimatorMeter::default()),
        http: None,
        http_access: Default::default(),
        mesh: None,
        stages: None,
        fidelity: mesh_node::runtime::serve::DEFAULT_FIDELITY,
        record_checkpoints: true,
    })
    .await
    .unwrap();

    // A well-formed stage record, signed by a key this coordinator never assigned.
    let stranger = SigningKey::from_bytes(&[9; 32]);
    let (_, record) = simulated_stage_record(&stranger);

    let reply = push(
        &node,
        &stranger,
        &did_key(&stranger.verifying_key().to_bytes()),
        record.value(),
    )
    .await;
    assert_eq!(reply["reason"], "not_a_stage_of_this_split", "{reply}");
    assert!(
        refusal_verifies(&reply),
        "the refusal is signed by the coordinator"
    );
    assert_eq!(
        reply["key_id"],
        mesh_protocol::hex::encode(&node.public_key())
    );

    // A stranger's body is not even read.
    assert_eq!(
        reply["request_digest"],
        mesh_protocol::hex::encode(&sha2::Sha256::digest(b"")),
        "{reply}"
    );
    let mut forged = reply.clone();
    forged["reason"] = Value::from("policy_decline");
    assert!(!refusal_verifies(&forged), "a refusal cannot be altered");
    node.shutdown().await;
}

/// What the collector checks of a push from a node that is assigned a stage
/// (strangers are refused before their body is read, above).
#[test]
fn an_assigned_stage_is_held_to_its_claims_and_its_signature() {
    let stage = SigningKey::from_bytes(&[9; 32]);
    let (block, record) = simulated_stage_record(&stage);
    let stage_key = stage.verifying_key().to_bytes();
    let mut collector = collector_expecting(&block, stage_key);
    assert!(collector.expects_from(&stage_key));
    let own = did_key(&stage_key);
    // Claiming to be someone else than the transport proved.
    let other = did_key(&SigningKey::from_bytes(&[8; 32]).verifying_key().to_bytes());
    assert_eq!(
        collector.offer(&stage_key, &push_body(&other, record.value())),
        Err(mesh_node::runtime::records::PushRefusal::SignatureUnverified)
    );
    // A record whose signature does not hold.
    let mut tampered = record.value().clone();
    tampered["timestamp"] = Value::from("2026-11-30T00:00:00.001Z");
    assert_eq!(
        collector.offer(&stage_key, &push_body(&own, &tampered)),
        Err(mesh_node::runtime::records::PushRefusal::RequestMalformed)
    );
    // The genuine record is held.
    assert_eq!(
        collector.offer(&stage_key, &push_body(&own, record.value())),
        Ok(Received::Bare)
    );
}

/// A stage's own `mesh/1` receipt is held for its stage only when that
/// stage's node sealed it for this split's stage, run and request; once.
#[test]
fn a_stage_receipt_is_held_only_for_the_stage_that_sealed_it() {
    use mesh_node::runtime::records::PushRefusal;
    use mesh_protocol::mesh1::{Energy, MeshReceipt};
    use mesh_protocol::stage_receipt::{
        CarriedStageReceipt, STAGE_BACKEND, stage_recipe, stage_route,
    };
    let stage = SigningKey::from_bytes(&[9; 32]);
    let (block, _) = simulated_stage_record(&stage);
    let stage_key = stage.verifying_key().to_bytes();
    let own = did_key(&stage_key);
    let mut collector = collector_expecting(&block, stage_key);
    let key = block.split_key();
    let sealed_by = |signer: &SigningKey, recipe: &str| {
        let mut receipt = MeshReceipt::blank(
            [3; 32],
            STAGE_BACKEND,
            recipe,
            &stage_route(&key.run_id),
            Energy::estimator(5_000),
            [6; 16],
        );
        receipt.steward = did_key(&signer.verifying_key().to_bytes());
        receipt.seal(signer).unwrap().envelope
    };
    let ours = stage_recipe(block.stage_index, &key.run_id, key.request_id);
    let push = |envelope: Vec<u8>, stage_index: u32, request_id: u64| {
        push_body(
            &own,
            &CarriedStageReceipt {
                stage_index,
                envelope,
            }
            .push_value(request_id),
        )
    };
    // Sealed by another node, for another stage, run or request: refused.
    let stranger = SigningKey::from_bytes(&[8; 32]);
    assert_eq!(
        collector.offer(
            &stage_key,
            &push(
                sealed_by(&stranger, &ours),
                block.stage_index,
                key.request_id
            )
        ),
        Err(PushRefusal::SignatureUnverified)
    );
    let elsewhere = stage_recipe(block.stage_index, "another-run", key.request_id);
    assert_eq!(
        collector.offer(
            &stage_key,
            &push(
                sealed_by(&stage, &elsewhere),
                block.stage_index,
                key.request_id
            )
        ),
        Err(PushRefusal::SignatureUnverified)
    );
    assert_eq!(
        collector.offer(
            &stage_key,
            &push(sealed_by(&stage, &ours), 0, key.request_id)
        ),
        Err(PushRefusal::NotAStageOfThisSplit)
    );
    assert_eq!(
        collector.offer(
            &stage_key,
            &push(
                sealed_by(&stage, &ours),
                block.stage_index,
                key.request_id + 1
            )
        ),
        Err(PushRefusal::NotAStageOfThisSplit)
    );
    // Its own: held once; the same again acknowledged, another refused.
    let envelope = sealed_by(&stage, &ours);
    assert_eq!(
        collector.offer(
            &stage_key,
            &push(envelope.clone(), block.stage_index, key.request_id)
        ),
        Ok(Received::Receipt)
    );
    assert_eq!(
        collector.offer(
            &stage_key,
            &push(envelope, block.stage_index, key.request_id)
        ),
        Ok(Received::Again)
    );
    let mut second = MeshReceipt::blank(
        [4; 32],
        STAGE_BACKEND,
        &ours,
        &stage_route(&key.run_id),
        Energy::estimator(1),
        [7; 16],
    );
    second.steward = own.clone();
    assert_eq!(
        collector.offer(
            &stage_key,
            &push(
                second.seal(&stage).unwrap().envelope,
                block.stage_index,
                key.request_id
            )
        ),
        Err(PushRefusal::OverCap)
    );
    let held = collector.take(key.request_id).unwrap();
    assert!(held.receipts[block.stage_index as usize].is_some());
    assert!(
        held.records.iter().all(Vec::is_empty),
        "a receipt is not a record"
    );
}

/// A stage's `record_push_bundle` (split-stage §3.3) is acknowledged only
/// when the record is proven in the stage's own log under a checkpoint the
/// stage signed, and no checkpoint contradicts one it showed before.
#[test]
fn a_pushed_bundle_is_proven_in_the_stages_log_before_it_is_acknowledged() {
    use mesh_protocol::bundle::{Checkpoint, MmrLog};
    let stage = SigningKey::from_bytes(&[9; 32]);
    let (block, record) = simulated_stage_record(&stage);
    let stage_key = stage.verifying_key().to_bytes();
    let own = did_key(&stage_key);
    let mut collector = collector_expecting(&block, stage_key);
    // The stage's log: two earlier records, then this one (leaf 2).
    let mut log = MmrLog::new();
    log.append(&[1; 32]);
    log.append(&[2; 32]);
    let leaf = log.append(&record.capsule_id());
    let bundle = |key: &SigningKey, leaf: u64, root: [u8; 32]| {
        serde_json::json!({
            "record_push_bundle": 1,
            "capsule": record.value(),
            "inclusion": { "leaf_index": leaf, "proof": log.prove(leaf).unwrap().to_value() },
            "checkpoint": Checkpoint::sign(&own, log.size(), &root, None, "2026-12-02T00:00:00.000Z", key),
        })
    };
    let body = |value: &Value| push_body(&own, value);
    let root = log.root().unwrap();
    use mesh_node::runtime::records::PushRefusal::*;
    // A checkpoint signed by another key proves nothing of this stage's log.
    let other = SigningKey::from_bytes(&[8; 32]);
    assert_eq!(
        collector.offer(&stage_key, &body(&bundle(&other, leaf, root))),
        Err(InclusionUnverified)
    );
    // Another leaf's proof does not prove this record.
    assert_eq!(
        collector.offer(&stage_key, &body(&bundle(&stage, 1, root))),
        Err(InclusionUnverified)
    );
    // A bundle from a stage carries no stage records, and no other member.
    let mut carrying = bundle(&stage, leaf, root);
    carrying["split_stage_records"] = serde_json::json!([record.value()]);
    assert_eq!(
        collector.offer(&stage_key, &body(&carrying)),
        Err(BundleMalformed)
    );
    let mut extra = bundle(&stage, leaf, root);
    extra["note"] = Value::from(1);
    assert_eq!(
        collector.offer(&stage_key, &body(&extra)),
        Err(BundleMalformed)
    );
    // A checkpoint of another log than the stage's own.
    let mut elsewhere = bundle(&stage, leaf, root);
    elsewhere["checkpoint"] = Checkpoint::sign(
        "did:key:another-log",
        log.size(),
        &root,
        None,
        "2026-12-02T00:00:00.000Z",
        &stage,
    );
    assert_eq!(
        collector.offer(&stage_key, &body(&elsewhere)),
        Err(InclusionUnverified)
    );
    // The genuine bundle is acknowledged as proven; pushed again, as held.
    assert_eq!(
        collector.offer(&stage_key, &body(&bundle(&stage, leaf, root))),
        Ok(Received::Proven)
    );
    assert_eq!(
        collector.offer(&stage_key, &body(&bundle(&stage, leaf, root))),
        Ok(Received::Again)
    );
    // A second root for the same log size, signed by the stage: a forked
    // log, refused.
    let mut forked = MmrLog::new();
    forked.append(&[7; 32]);
    forked.append(&[2; 32]);
    forked.append(&record.capsule_id());
    let forked_bundle = serde_json::json!({
        "record_push_bundle": 1,
        "capsule": record.value(),
        "inclusion": { "leaf_index": 2, "proof": forked.prove(2).unwrap().to_value() },
        "checkpoint": Checkpoint::sign(&own, forked.size(), &forked.root().unwrap(), None, "2026-12-02T00:00:01.000Z", &stage),
    });
    assert_eq!(
        collector.offer(&stage_key, &body(&forked_bundle)),
        Err(CheckpointEquivocation)
    );
}
