//! Admit a request on a stage: read OPEN, check its sender is this
//! slice's upstream, decide the grant, open (or take over) the cache.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use mesh_protocol::block::ReturnMode;
use mesh_protocol::identity::did_key;
use mesh_protocol::mesh1::ServeRequest;
use mesh_stage::cache::CacheLease;

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::net::msg::{self, kind};
use crate::runtime::serve::frames::failed_reason;
use crate::runtime::serve::shared::DRAIN_WAIT;
use crate::runtime::serve::shared::Deadline;
use crate::runtime::serve::shared::HeldTicket;
use crate::runtime::serve::slot::Assign;
use crate::runtime::serve::slot::Slot;
use crate::runtime::serve::stage::kept;
use crate::runtime::serve::stage::open::StageOpen;
use crate::runtime::serve::stage::open::StageResume;
use crate::runtime::serve::stage::role::NO_SLICE;
use crate::runtime::serve::stage::role::StageRole;
use crate::runtime::serve::stats;
use crate::runtime::steward::StewardError;
use anyhow;
use mesh_protocol::mesh1::Fidelity;

/// A request a stage took.
pub(crate) struct StageAdmitted {
    pub(crate) slot: Arc<Slot>,
    pub(crate) request_id: u64,
    /// OPEN, as it came: folded, and forwarded to the next stage.
    pub(crate) first: Vec<u8>,
    pub(crate) run_id: String,
    pub(crate) prefill_steps: u64,
    pub(crate) deadline: Deadline,
    pub(crate) return_mode: ReturnMode,
    pub(crate) ticket: HeldTicket,
    pub(crate) served: ServeRequest,
    pub(crate) cache: Option<CacheLease>,
    /// Its entry among the caches a resume may keep.
    pub(crate) keep: kept::KeepHandle,
    /// Positions its cache came with (taken over from an interrupted
    /// request), counted as prefilled.
    pub(crate) kept_positions: u64,
    /// Prefill steps it runs but sends no further: the next stage kept its
    /// cache.
    pub(crate) silent_steps: u64,
    /// The number its first ACTIVATIONS carries.
    pub(crate) first_step: u64,
    pub(crate) up_send: quinn::SendStream,
    pub(crate) up_recv: quinn::RecvStream,
}

/// Admit: OPEN (`first`, read by the protocol's handler) checked, its
/// sender this slice's upstream, the grant decided, the cache opened.
/// `None`: refused (FAILED already sent).
pub(crate) async fn admit_stage(
    stage: &Arc<StageRole>,
    peer: [u8; 32],
    (mut up_send, up_recv): (quinn::SendStream, quinn::RecvStream),
    first: Vec<u8>,
) -> anyhow::Result<Option<StageAdmitted>> {
    let (_, request_id, _, payload) = msg::parse_stage(&first)?;
    let open = match StageOpen::parse(payload, stage) {
        Ok(open) => open,
        Err(error) => {
            return refuse_stage(stage, &mut up_send, request_id, format!("{error:#}"))
                .await
                .map(|()| None);
        }
    };
    let StageOpen {
        run_id,
        capacity,
        prefill_steps,
        replay_steps,
        deadline,
        return_mode,
        resumes,
        keep: resume,
        resume_sig,
    } = open;
    let slot = lock(&stage.slots).get(&run_id).cloned();
    let Some(slot) = slot else {
        return refuse_stage(
            stage,
            &mut up_send,
            request_id,
            format!("{NO_SLICE} {run_id}"),
        )
        .await
        .map(|()| None);
    };
    if slot.assign.upstream != peer {
        return refuse_stage(
            stage,
            &mut up_send,
            request_id,
            format!(
                "{} is not the upstream of this stage of run {run_id}",
                did_key(&peer)
            ),
        )
        .await
        .map(|()| None);
    }
    slot.touch();
    let assign = &slot.assign;

    // Decide (or take the decision already made for) the grant first, then
    // the cache: a refusal at either releases what the other holds.
    stage.expire_pre_decided();
    stage.kept.expire();
    let (ticket, served) = match decide_grant(stage, request_id, assign.coordinator, capacity) {
        Ok(decided) => decided,
        Err(error) => {
            return refuse_stage(stage, &mut up_send, request_id, format!("{error}"))
                .await
                .map(|()| None);
        }
    };
    // The request's cache: freed when `cache` is dropped, on every path.
    // A resumed request takes over the cache its interrupted segment built
    // here when its chain keeps this stage's layers; on its coordinator's
    // signed word only, never on an upstream stage's.
    let k = assign.stage_index;
    if let Some(interrupted) = resumes {
        let refusal = resume_refusal(
            assign,
            &run_id,
            request_id,
            interrupted,
            resume,
            resume_sig.as_deref(),
        );
        if let Some(reason) = refusal {
            // The decision is closed before the refusal leaves.
            drop(ticket);
            return refuse_stage(stage, &mut up_send, request_id, format!("OPEN: {reason}"))
                .await
                .map(|()| None);
        }
    }
    let kept_here = resume.filter(|r| k >= r.kept_from);
    if let (Some(interrupted), None) = (resumes, kept_here) {
        // Its place in the pool is given back before this request takes one.
        stage
            .kept
            .end(assign.coordinator, interrupted, DRAIN_WAIT * 2)
            .await;
    }
    let opened = match kept_here {
        Some(r) => take_kept(stage, &slot, r, request_id, capacity).await,
        None => open_cache(stage, &slot, request_id, capacity).await,
    };
    let cache = match opened {
        Ok(cache) => {
            stats::Counters::bump(&stage.shared.counters.stage_requests);
            Some(cache)
        }
        Err(error) => {
            drop(ticket);
            return refuse_stage(stage, &mut up_send, request_id, format!("{error:#}"))
                .await
                .map(|()| None);
        }
    };
    let keep = stage
        .kept
        .register(slot.assign.coordinator, request_id, &slot.slice);
    Ok(Some(StageAdmitted {
        kept_positions: kept_here.map_or(0, |r| r.positions),
        first_step: if kept_here.is_some() { replay_steps } else { 0 },
        // A stage that kept its cache gets no replay: its first step decodes.
        prefill_steps: if kept_here.is_some() {
            0
        } else {
            prefill_steps
        },
        silent_steps: match resume {
            Some(r) if k + 1 == r.kept_from => prefill_steps,
            _ => 0,
        },
        slot,
        request_id,
        first,
        run_id,
        deadline,
        return_mode,
        ticket,
        served,
        cache,
        keep,
        up_send,
        up_recv,
    }))
}

/// The grant decision for a request: the one its coordinator asked for
/// ahead of the chain, else one taken now for the span alone.
fn decide_grant(
    stage: &StageRole,
    request_id: u64,
    coordinator: [u8; 32],
    capacity: usize,
) -> Result<(HeldTicket, ServeRequest), StewardError> {
    let pre_decided = {
        let mut tickets = lock(&stage.tickets);
        match tickets.get(&request_id) {
            Some(decided) if decided.coordinator == coordinator => tickets.remove(&request_id),
            _ => None,
        }
    };
    if let Some(decided) = pre_decided {
        return Ok((decided.ticket, decided.serve));
    }
    let serve = span_request(capacity);
    let ticket = lock(&stage.shared.steward).authorise(
        None,
        &serve,
        Some(stage.shared.model.weights_digest()),
        mesh_protocol::stage_receipt::STAGE_BACKEND,
        now_ms(),
    )?;
    Ok((HeldTicket::new(&stage.shared, ticket), serve))
}

/// Why a resumed request's OPEN is refused: a resume is taken on its
/// coordinator's signed word only, never on an upstream stage's.
fn resume_refusal(
    assign: &Assign,
    run_id: &str,
    request_id: u64,
    interrupted: u64,
    resume: Option<StageResume>,
    resume_sig: Option<&[u8]>,
) -> Option<String> {
    let claim = mesh_protocol::resume::ResumeClaim {
        run_id: run_id.to_string(),
        request_id,
        resume_of: interrupted,
        keep: resume.map(|r| (u64::from(r.kept_from), r.positions)),
    };
    if interrupted == request_id {
        Some("a request cannot resume itself".to_string())
    } else if resume.is_some_and(|r| r.kept_from > assign.stage_count) {
        // `kept_from == stage_count`: no remote stage keeps its cache
        // (the final stage was lost), the coordinator keeps its own.
        Some(format!(
            "kept_from is past the {} stages",
            assign.stage_count
        ))
    } else if !mesh_protocol::resume::claim_signed_by(
        &claim,
        resume_sig.unwrap_or_default(),
        &assign.coordinator,
    ) {
        Some("the resume is not signed by this run's coordinator".to_string())
    } else {
        None
    }
}

/// How often a stage looks again for a place a request is giving back.
const PLACE_POLL: Duration = Duration::from_millis(5);

/// How long a full stage looks for a place before it refuses: a
/// request's end reaches a stage within a hop or two, milliseconds on
/// any link the planner would use.
const PLACE_WAIT: Duration = Duration::from_millis(250);

/// A new cache for a request, giving back parked caches on the slice when
/// they are what stands in the way. A full pool is asked again for up to
/// [`PLACE_WAIT`]: the coordinator admits its next request as soon as it
/// has the last token of one, while this stage may still be closing that
/// request's stream, so with every place taken the next one is moments
/// away. Only an assigned coordinator's requests get here, and at most
/// four times `max_requests` of them at once (the tickets), so the wait
/// is bounded in count as well as time.
pub(crate) async fn open_cache(
    stage: &StageRole,
    slot: &Slot,
    request_id: u64,
    capacity: usize,
) -> anyhow::Result<CacheLease> {
    let until = tokio::time::Instant::now() + PLACE_WAIT;
    loop {
        match slot.pool.open(&slot.slice, request_id, capacity) {
            Err(mesh_stage::EngineError::Busy(_)) if stage.kept.evict_oldest_on(&slot.slice) => {}
            Err(mesh_stage::EngineError::Busy(_)) if tokio::time::Instant::now() < until => {
                tokio::time::sleep(PLACE_POLL).await;
            }
            opened => return Ok(opened?),
        }
    }
}

/// The cache an interrupted request built on this slice, for the resumed
/// request that carries it on: cut back to the positions every kept stage
/// holds, counted in the pool under the new request's id.
pub(crate) async fn take_kept(
    stage: &StageRole,
    slot: &Slot,
    resume: StageResume,
    request_id: u64,
    capacity: usize,
) -> anyhow::Result<CacheLease> {
    let wait = stage.shared.step_timeout.min(DRAIN_WAIT * 2);
    let mut lease = stage
        .kept
        .take(slot.assign.coordinator, resume.of, &slot.slice, wait)
        .await?;
    let positions = usize::try_from(resume.positions).context("keep_positions")?;
    if lease.cache().capacity() < capacity {
        bail!(
            "the kept cache holds {} positions, the request asks for {capacity}",
            lease.cache().capacity()
        );
    }
    if lease.positions() < positions {
        bail!(
            "the kept cache of request {} holds {} positions, not {positions}",
            resume.of,
            lease.positions()
        );
    }
    lease.cache().truncate(positions)?;
    lease.rekey(request_id)?;
    Ok(lease)
}

/// Refuse a request on its stage stream with a FAILED reply, before any
/// lane is folded.
pub(crate) async fn refuse_stage(
    stage: &StageRole,
    up_send: &mut quinn::SendStream,
    request_id: u64,
    reason: String,
) -> anyhow::Result<()> {
    stats::Counters::bump(&stage.shared.counters.stage_refusals);
    let body = msg::stage_body(kind::FAILED, request_id, 0, failed_reason(&reason));
    msg::write(up_send, &body).await?;
    let _ = up_send.finish();
    Ok(())
}

/// The request a stage's steward meters a span for: a stage never sees the
/// prompt, so it names the span by its positions only.
pub(crate) fn span_request(capacity: usize) -> ServeRequest {
    ServeRequest {
        prompt_hash: [0; 32],
        prompt_tokens: u32::try_from(capacity).unwrap_or(u32::MAX),
        max_tokens: 0,
        fidelity_floor: Fidelity::F0,
        joule_ceiling_uj: u64::MAX,
        decision: None,
    }
}
