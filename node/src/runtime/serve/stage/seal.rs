//! Seal a request on a stage: its steward's receipt for the metered span,
//! and its stage record, pushed to the coordinator over `record-push/1`.

use std::sync::Arc;

use anyhow::Context;
use mesh_protocol::block::{StageBlock, TerminalState, Tokens};
use mesh_protocol::capsule::{
    Producer, RecordContext, SealedRecord, format_timestamp, stage_record,
};
use mesh_protocol::mesh1::{MeshReceipt, ServeRequest, WeightsBinding};
use mesh_protocol::session::SliceFacts;
use mesh_protocol::stage_receipt::{CarriedStageReceipt, STAGE_BACKEND, stage_recipe, stage_route};

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::net::ALPN_RECORD_PUSH;
use crate::runtime::net::msg::{self};
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::slot::Assign;
use crate::runtime::serve::stage::role::StageRole;
use crate::runtime::serve::stage::run::StageRan;

/// Seal: the steward's receipt for the metered span (nothing billed for
/// waiting on a peer that failed), and the stage record, pushed to the
/// coordinator.
pub(crate) async fn seal_stage(stage: &Arc<StageRole>, ran: StageRan) -> anyhow::Result<()> {
    let StageRan {
        slot,
        request_id,
        run_id,
        ticket,
        served,
        lanes,
        tokens,
        kept_positions,
        terminal,
        wire,
        ..
    } = ran;
    let assign = &slot.assign;
    let k = assign.stage_index;
    // The stage's own evidence: its steward's receipt for the metered span,
    // and its stage record, pushed to the coordinator.
    let metered = {
        let mut steward = lock(&stage.shared.steward);
        let weights = Some(stage.shared.model.weights_digest());
        let ticket = ticket.into_sealed();
        if terminal == TerminalState::Completed {
            steward.end_engine(ticket, weights)
        } else {
            // Waiting for a peer that failed or went away is not billed.
            steward.end_engine_at_mark(ticket, weights)
        }
    };
    let sealed = metered.ok().and_then(|metered| {
        let receipt = stage_receipt(
            stage,
            request_id,
            &run_id,
            (k, slot.slice.precision(wire).to_string()),
            (&tokens, kept_positions),
            &served,
            &metered,
        );
        lock(&stage.shared.steward)
            .seal(receipt)
            .inspect_err(|error| tracing::error!(request_id, "stage receipt not sealed: {error}"))
            .ok()
    });
    // A final stage that never opened its direct return folded nothing on
    // it: the session shows the empty lane.
    let block = lanes.session.block(
        &SliceFacts {
            topology_hash: assign.topology_hash.clone(),
            stage_index: k,
            layer_start: slot.slice.range.start,
            layer_end: slot.slice.range.end,
            package_id: stage.shared.model.package_id(),
            manifest_sha256: assign.manifest,
            source_model_sha256: stage.shared.model.package_id(),
        },
        tokens,
        terminal,
    );
    // The receipt first: the coordinator stops waiting once it holds
    // every stage's record, and its requester is owed this stage's served
    // span beside it (seed 001 §3.3).
    if let Some(sealed) = sealed {
        push_stage_receipt(stage, assign, request_id, sealed.envelope).await;
    }
    push_stage_record(stage, assign, &block).await
}

/// Push this stage's `mesh/1` receipt to its coordinator. Best effort: a
/// coordinator that refuses it (an older one reads it as a malformed
/// record) has the stage record all the same, and the receipt stays in
/// this node's journal.
async fn push_stage_receipt(
    stage: &Arc<StageRole>,
    assign: &Assign,
    request_id: u64,
    envelope: Vec<u8>,
) {
    let body = CarriedStageReceipt {
        stage_index: assign.stage_index,
        envelope,
    }
    .push_value(request_id);
    let coordinator = PeerAddr {
        key: assign.coordinator,
        addr: assign.coordinator_addr,
    };
    match push_body(stage, &coordinator, &body).await {
        Ok(reply) if reply["status"] == "received" => {}
        Ok(reply) => tracing::warn!(request_id, "stage receipt refused: {reply}"),
        Err(error) => tracing::warn!(request_id, "stage receipt not pushed: {error:#}"),
    }
}

pub(crate) fn stage_receipt(
    role: &StageRole,
    request_id: u64,
    run_id: &str,
    (stage, precision): (u32, String),
    (tokens, kept): (&Tokens, u64),
    served: &ServeRequest,
    metered: &crate::runtime::steward::Metered,
) -> MeshReceipt {
    let recipe = stage_recipe(stage, run_id, request_id);
    let route = stage_route(run_id);
    let nonce = crate::runtime::keys::random_bytes().unwrap_or([0; 16]);
    MeshReceipt {
        grant_id: metered.grant_id,
        weights: Some(WeightsBinding {
            weights_digest: role.shared.model.weights_digest(),
            precision,
        }),
        // Positions a kept cache came with were read before, by the
        // interrupted request's own receipt: restored here, not read again.
        tokens_in: (tokens.prefill_received + tokens.decode).saturating_sub(kept),
        cache_hit_tokens: kept,
        grant_breach: metered
            .debit
            .as_ref()
            .and_then(|d| d.breach)
            .map(str::to_string),
        ..MeshReceipt::blank(
            served.request_id(),
            STAGE_BACKEND,
            &recipe,
            &route,
            metered.energy,
            nonce,
        )
    }
}

/// Seal a stage's record, log it, and push it to its coordinator: as a
/// `record_push_bundle` (the record, its inclusion proof and a checkpoint
/// of this node's log) when checkpoints are on, else bare; a bundle
/// refused as a malformed request (an older receiver) is pushed again
/// bare, once.
pub(crate) async fn push_stage_record(
    stage: &Arc<StageRole>,
    assign: &Assign,
    block: &StageBlock,
) -> anyhow::Result<()> {
    let context = RecordContext {
        producer: Producer::mesh_node(),
        timestamp: format_timestamp(now_ms()),
        store_nonce: crate::runtime::keys::random_bytes()?,
        chain_parent: None,
    };
    let record = SealedRecord::seal(stage_record(&context, block)?, &stage.shared.key)?;
    // Into this node's transparency log before it leaves.
    let leaf = lock(&stage.shared.steward)
        .log_records(&[record.capsule_id()])?
        .first()
        .copied()
        .context("the record's leaf")?;
    let bundle = stage
        .shared
        .record_checkpoints
        .then(|| stage.shared.log_proof(leaf))
        .flatten()
        .map(|(inclusion, checkpoint)| {
            serde_json::json!({
                "record_push_bundle": 1,
                "capsule": record.value(),
                "inclusion": inclusion,
                "checkpoint": checkpoint,
            })
        });
    let coordinator = PeerAddr {
        key: assign.coordinator,
        addr: assign.coordinator_addr,
    };
    if let Some(bundle) = &bundle {
        let reply = push_body(stage, &coordinator, bundle).await?;
        // An older receiver reads a bundle as a malformed request
        // (split-stage §3.6); a `bundle_malformed` is this record's own
        // fault, and would be refused bare too.
        if reply["reason"] != "request_malformed" {
            if reply["status"] != "received" {
                tracing::warn!("stage record refused: {reply}");
            }
            return Ok(());
        }
        tracing::info!("the coordinator does not read bundles: pushing the record bare");
    }
    let reply = push_body(stage, &coordinator, record.value()).await?;
    if reply["status"] != "received" {
        tracing::warn!("stage record refused: {reply}");
    }
    Ok(())
}

/// One push on `record-push/1`: this node's id, a newline, `body`; the reply.
pub(crate) async fn push_body(
    stage: &Arc<StageRole>,
    coordinator: &PeerAddr,
    body: &serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    let mut bytes = stage.shared.tls.did.as_bytes().to_vec();
    bytes.push(b'\n');
    bytes.extend_from_slice(&serde_json::to_vec(body)?);
    let (mut send, mut recv) = stage.shared.net.open(coordinator, ALPN_RECORD_PUSH).await?;
    tokio::time::timeout(msg::IDLE_TIMEOUT, send.write_all(&bytes))
        .await
        .context("timed out pushing the stage record")??;
    send.finish()?;
    let reply = tokio::time::timeout(msg::IDLE_TIMEOUT, recv.read_to_end(64 * 1024))
        .await
        .context("timed out waiting for the push reply")??;
    Ok(serde_json::from_slice(&reply).unwrap_or_default())
}
