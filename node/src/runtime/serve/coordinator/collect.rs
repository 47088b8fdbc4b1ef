//! Collect: the request's bill at its steward, and the stages' records.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::runtime::clock::lock;
use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::drive::Driven;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use anyhow::Context;
use mesh_protocol::block::TerminalState;
use mesh_protocol::capsule::SealedRecord;
use mesh_protocol::stage_receipt::CarriedStageReceipt;

/// The request's bill and what its stages sent.
pub(crate) struct Collected {
    pub(crate) metered: crate::runtime::steward::Metered,
    pub(crate) stages: StageEvidence,
}

/// What a segment's stages sent: their records (by stage index), and
/// their own `mesh/1` receipts, in stage order, for those that came.
#[derive(Default)]
pub(crate) struct StageEvidence {
    pub(crate) records: Vec<Vec<SealedRecord>>,
    pub(crate) receipts: Vec<CarriedStageReceipt>,
}

/// Collect: close the request's bill at its steward (nothing billed for
/// waiting on a peer that failed), then wait, up to the seal deadline, for
/// every stage's record.
pub(crate) async fn collect(
    coordinator: &Arc<CoordinatorRole>,
    admitted: &mut Admitted<'_>,
    driven: &mut Driven,
) -> anyhow::Result<Collected> {
    let held = &mut admitted.held;
    let terminal = driven.terminal;
    held.release_cache();
    let ticket = held
        .ticket
        .take()
        .context("the coordinator's grant decision")?
        .into_sealed();
    let metered = {
        let mut steward = lock(&coordinator.shared.steward);
        let weights = Some(coordinator.shared.model.weights_digest());
        if terminal == TerminalState::Completed {
            steward.end_engine(ticket, weights)?
        } else {
            // Waiting for a peer that failed or went away is not billed.
            steward.end_engine_at_mark(ticket, weights)?
        }
    };
    let until = Instant::now() + coordinator.settings.seal_deadline;
    let stages = await_records(coordinator, admitted, driven, until).await?;
    Ok(Collected { metered, stages })
}

/// Wait for the segment's survivors to finish (its lanes whole: a stage
/// seals its record when its part ends), then, until `until`, for every
/// stage record of the segment; in a mesh, not for those of stages that
/// left it during the segment (their records will not come). Takes the
/// segment's record slot, with the stage receipts that came before.
pub(crate) async fn await_records(
    coordinator: &Arc<CoordinatorRole>,
    admitted: &mut Admitted<'_>,
    driven: &mut Driven,
    until: Instant,
) -> anyhow::Result<StageEvidence> {
    driven.lanes.settle().await?;
    let request_id = admitted.request_id;
    let left_mesh = |key: &[u8; 32]| coordinator.shared.left_mesh_since(key, driven.started);
    loop {
        let notified = coordinator.collected.notified();
        if lock(&coordinator.collector).is_complete_except(request_id, left_mesh) {
            break;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        // A member leaving is not a record arriving: look again now and then.
        let wait = match coordinator.shared.mesh.get() {
            Some(_) => left.min(Duration::from_millis(100)),
            None => left,
        };
        let _ = tokio::time::timeout(wait, notified).await;
    }
    let pending = lock(&coordinator.collector).take(request_id);
    admitted.held.collector = false;
    Ok(
        pending.map_or_else(StageEvidence::default, |p| StageEvidence {
            records: p.records,
            receipts: p.receipts.into_iter().flatten().collect(),
        }),
    )
}
