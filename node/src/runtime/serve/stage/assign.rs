//! Assign and authorise: a coordinator loads a slice here, and has a grant
//! decided ahead of its request.

use std::sync::Arc;
use std::time::Instant;

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::serve::shared::HeldTicket;
use crate::runtime::serve::slot::Assign;
use crate::runtime::serve::stage::role::PreDecided;
use crate::runtime::serve::stage::role::StageRole;
use anyhow;
use anyhow::{Context, bail};
use mesh_protocol::control::{AssignRequest, AuthoriseRequest};
use mesh_protocol::identity::did_key;

/// A coordinator asks this stage's steward to decide its grant shard for a
/// request before the chain opens; the decision is journalled and held
/// until the request's stream arrives.
pub(crate) fn handle_authorise(
    stage: &Arc<StageRole>,
    peer: [u8; 32],
    request: &AuthoriseRequest,
) -> anyhow::Result<()> {
    let AuthoriseRequest {
        run_id,
        request_id,
        serve_request: serve,
        presentation,
    } = request;
    let (run_id, request_id) = (run_id.as_str(), *request_id);
    let slot = lock(&stage.slots)
        .get(run_id)
        .cloned()
        .context("no slice loaded for that run")?;
    if slot.assign.coordinator != peer {
        bail!("only the run's coordinator may ask");
    }
    stage.expire_pre_decided();
    // Checked and inserted under one lock, so two asks for one request
    // cannot both decide (the steward's lock is taken inside, never the
    // other way round).
    let mut tickets = lock(&stage.tickets);
    if tickets.len() >= stage.shared.max_requests.max(1) * 4 {
        bail!("too many authorised requests waiting to start");
    }
    if tickets.contains_key(&request_id) {
        bail!("request {request_id} is already authorised here");
    }
    let ticket = lock(&stage.shared.steward).authorise(
        Some(presentation),
        serve,
        Some(stage.shared.model.weights_digest()),
        mesh_protocol::stage_receipt::STAGE_BACKEND,
        now_ms(),
    )?;
    tickets.insert(
        request_id,
        PreDecided {
            ticket: HeldTicket::new(&stage.shared, ticket),
            serve: serve.clone(),
            coordinator: peer,
            decided: Instant::now(),
        },
    );
    Ok(())
}

pub(crate) fn handle_assign(
    stage: &Arc<StageRole>,
    peer: [u8; 32],
    request: &AssignRequest,
) -> anyhow::Result<([u8; 32], usize)> {
    if !stage.serves_coordinator(&peer) {
        // Anyone can send these: a line a minute, the others counted.
        if let Some(unlogged) = lock(&stage.assign_refusals_logged).admit(Instant::now()) {
            tracing::warn!(
                "refused an assignment from {0}: not a coordinator this node serves (start it with --coordinator {0} to serve it); {unlogged} more refused since the last such line",
                did_key(&peer)
            );
        }
        bail!("this node does not serve coordinator {}", did_key(&peer));
    }
    if stage.draining.load(std::sync::atomic::Ordering::Relaxed) {
        bail!("this node is shutting down and takes no new slice");
    }
    let assign = Assign::from_request(request)?;
    if assign.coordinator != peer {
        bail!("the assignment names a coordinator other than the node that sent it");
    }
    if assign.package_id != stage.shared.model.package_id() {
        bail!(
            "this node holds package sha256:{}, not the assigned sha256:{}",
            mesh_protocol::hex::encode(&stage.shared.model.package_id()),
            mesh_protocol::hex::encode(&assign.package_id)
        );
    }
    if assign.manifest != stage.shared.model.manifest_sha256() {
        bail!(
            "this node's package has manifest {}, not the assigned {}",
            mesh_protocol::hex::encode(&stage.shared.model.manifest_sha256()),
            mesh_protocol::hex::encode(&assign.manifest)
        );
    }
    if assign.stage_index == 0 || assign.stage_index >= assign.stage_count {
        bail!(
            "stage index {} is not a remote stage of {}",
            assign.stage_index,
            assign.stage_count
        );
    }
    {
        let mut slots = lock(&stage.slots);
        if let Some(slot) = slots.get(&assign.run_id) {
            if slot.assign.coordinator != peer {
                bail!("run {} belongs to another coordinator", assign.run_id);
            }
            slot.touch();
            return Ok((slot.slice.weights_digest(), slot.slice.weight_bytes()));
        }
        // The coordinator's new run keeps these layers here (a re-plan
        // around another node): the loaded slice, and the caches on it,
        // carry over.
        let same_layers = slots
            .values()
            .find(|held| held.holds_layers_of(&assign))
            .cloned();
        if let Some(held) = same_layers {
            let slot = Arc::new(held.reassigned(assign.clone()));
            let answer = (slot.slice.weights_digest(), slot.slice.weight_bytes());
            slots.retain(|_, held| held.assign.coordinator != peer);
            slots.insert(assign.run_id.clone(), slot);
            return Ok(answer);
        }
        stage.check_slice_room(&slots, peer)?;
    }
    tracing::info!(
        run = %assign.run_id,
        "loading layers {}..{} (stage {} of {})",
        assign.layer_start,
        assign.layer_end,
        assign.stage_index,
        assign.stage_count
    );
    let slice = tokio::task::block_in_place(|| {
        stage
            .shared
            .model
            .load_chain_slice(assign.layer_start..assign.layer_end, false)
    })?;
    let answer = (slice.weights_digest(), slice.weight_bytes());
    let slot = stage.shared.slot(slice, assign.clone());
    let mut slots = lock(&stage.slots);
    stage.check_slice_room(&slots, peer)?;
    // A coordinator holds one run here: its newer run replaces the older, whose
    // slice is freed once its last request ends (the caches kept on it
    // cannot serve the new slice: given back now).
    slots.retain(|_, held| {
        let other = held.assign.coordinator != peer;
        if !other {
            stage.kept.evict_parked_on(&held.slice);
        }
        other
    });
    slots.insert(assign.run_id.clone(), slot);
    Ok(answer)
}
