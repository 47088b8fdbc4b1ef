//! `mesh-control/1`: one request per stream, handed to the role it is
//! for: a stage's assignments and grant decisions, a coordinator's
//! generations and plans, and the node's own stats.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mesh_protocol::cbor::Cbor;
use mesh_protocol::control::{ControlReply, ControlRequest};

use crate::runtime::clock::lock;
use crate::runtime::net::msg;
use crate::runtime::router::{Handled, ProtocolHandler};
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::slot::Slot;
use crate::runtime::serve::stage::role::StageRole;
use crate::runtime::serve::stats::NodeStats;
use crate::runtime::serve::stats::SliceStats;

/// The control protocol's handler: both roles, and what the node says of
/// itself.
pub(crate) struct Control {
    pub(crate) stage: Arc<StageRole>,
    pub(crate) coordinator: Arc<CoordinatorRole>,
}

impl ProtocolHandler for Control {
    fn accept(
        &self,
        peer: [u8; 32],
        _connection: &quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
    ) -> Handled {
        let (stage, coordinator) = (self.stage.clone(), self.coordinator.clone());
        Box::pin(handle_control(stage, coordinator, peer, send, recv))
    }
}

async fn handle_control(
    stage: Arc<StageRole>,
    coordinator: Arc<CoordinatorRole>,
    peer: [u8; 32],
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) -> anyhow::Result<()> {
    let Some(message) =
        msg::read_cbor(&mut recv, msg::MAX_CONTROL_REQUEST, msg::IDLE_TIMEOUT).await?
    else {
        return Ok(());
    };
    let request = match ControlRequest::from_cbor(&message) {
        Ok(request) => request,
        Err(error) => {
            // A requester reads `error`; a node reads `refused`.
            let reason =
                crate::runtime::serve::coordinator::role::bounded_reason(&error.to_string());
            let reply = if message.get("kind").and_then(Cbor::as_text) == Some("generate") {
                ControlReply::Error { reason }
            } else {
                ControlReply::Refused { reason }
            };
            msg::write_cbor(&mut send, &reply.to_cbor()).await?;
            send.finish()?;
            return Ok(());
        }
    };
    let reply =
        match request {
            ControlRequest::Generate(generate) => {
                crate::runtime::serve::coordinator::request::handle_generate(
                    coordinator,
                    &generate,
                    &mut send,
                )
                .await?;
                None
            }
            ControlRequest::Plan => {
                crate::runtime::serve::coordinator::request::handle_plan(coordinator, &mut send)
                    .await?;
                None
            }
            ControlRequest::Assign(assign) => Some(
                match crate::runtime::serve::stage::assign::handle_assign(&stage, peer, &assign) {
                    Ok((digest, bytes)) => ControlReply::Ready {
                        weights_digest: digest,
                        resident_bytes: bytes as u64,
                        max_requests: stage.shared.max_requests as u64,
                        slice_idle_ms: stage.slice_idle.as_millis() as u64,
                    },
                    Err(error) => refused(&error),
                }
                .to_cbor(),
            ),
            ControlRequest::Authorise(authorise) => Some(
                match crate::runtime::serve::stage::assign::handle_authorise(
                    &stage, peer, &authorise,
                ) {
                    Ok(()) => ControlReply::Authorised,
                    Err(error) => refused(&error),
                }
                .to_cbor(),
            ),
            ControlRequest::Release { request_id } => {
                stage.release(peer, request_id);
                Some(ControlReply::Released.to_cbor())
            }
            ControlRequest::Unassign { run_id } => Some(stage.unassign(peer, &run_id).to_cbor()),
            // A request's timings are the business of its coordinator only.
            ControlRequest::Stats { request_id } => {
                Some(stage.request_stats(&peer, request_id).to_cbor())
            }
            ControlRequest::NodeStats => Some(if may_read_stats(&stage, &peer) {
                node_stats(&stage, &coordinator).await.to_cbor()
            } else {
                ControlReply::Refused {
                    reason: "a node's stats are for its own key, its peers and its coordinators: \
                         give --key with one of those"
                        .into(),
                }
                .to_cbor()
            }),
        };
    if let Some(reply) = reply {
        msg::write_cbor(&mut send, &reply).await?;
    }
    send.finish()?;
    let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    Ok(())
}

/// A refusal to a node, with the error's whole chain as its reason.
fn refused(error: &anyhow::Error) -> ControlReply {
    ControlReply::Refused {
        reason: crate::runtime::serve::coordinator::role::bounded_reason(&format!("{error:#}")),
    }
}

/// Who may read this node's stats: its own key, its configured peers, the
/// coordinators it serves.
fn may_read_stats(stage: &StageRole, peer: &[u8; 32]) -> bool {
    *peer == stage.shared.tls.public_key
        || stage.shared.peers.iter().any(|p| p.key == *peer)
        || stage.serves_coordinator(peer)
}

/// Every pool's occupancy and the node's counters (`mesh-node stats`).
pub(crate) async fn node_stats(stage: &StageRole, coordinator: &CoordinatorRole) -> NodeStats {
    let shared = &stage.shared;
    // Awaited first: no std lock guard may live across it.
    let peer_connections = shared.net.kept().await as u64;
    let slice = |role: &str, slot: &Slot| {
        let (steps, passes) = slot.batcher.steps_and_passes();
        SliceStats {
            role: role.to_string(),
            layer_start: slot.assign.layer_start,
            layer_end: slot.assign.layer_end,
            caches_open: slot.pool.open_requests() as u64,
            max_requests: slot.pool.max_requests() as u64,
            steps,
            passes,
        }
    };
    let mut slices: Vec<SliceStats> = lock(&coordinator.own_slot)
        .iter()
        .map(|own| slice("own", own))
        .collect();
    slices.extend(lock(&stage.slots).values().map(|slot| slice("stage", slot)));
    slices.extend(coordinator.draft_model.as_ref().map(|draft| draft.stats()));
    let counter = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let c = &shared.counters;
    let audits = lock(&coordinator.planning.reputation).audits;
    NodeStats {
        caches_open: slices.iter().map(|s| s.caches_open).sum(),
        caches_kept: stage.kept.parked() as u64,
        slices,
        records_pending: lock(&coordinator.collector).pending() as u64,
        direct_waiters: lock(&coordinator.directs).len() as u64,
        grant_decisions_waiting: lock(&stage.tickets).len() as u64,
        requests_queued: coordinator.queue.waiting() as u64,
        peer_connections,
        requests_completed: counter(&c.requests_completed),
        requests_failed: counter(&c.requests_failed),
        requests_cancelled: counter(&c.requests_cancelled),
        requests_refused_busy: counter(&c.requests_refused_busy),
        requests_refused_route: counter(&c.requests_refused_route),
        requests_refused_other: counter(&c.requests_refused_other),
        tokens_generated: counter(&c.tokens_generated),
        stage_requests: counter(&c.stage_requests),
        stage_refusals: counter(&c.stage_refusals),
        records_proven: counter(&c.records_proven),
        audits_passed: audits.passed,
        audits_failed: audits.failed,
        audits_unconcluded: audits.unconcluded,
        audits_let_go: audits.let_go,
        step_round_trips: c.round_trips.snapshot(),
        step_round_trips_sum_us: c.round_trips.sum_us(),
    }
}
