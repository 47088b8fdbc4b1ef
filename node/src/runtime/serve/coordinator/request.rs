//! One generate request at the coordinator, from the control stream to its
//! report: the run it goes on, then its phases in order (admit, drive,
//! resume, collect, seal, report).

use std::sync::Arc;
use std::time::Instant;

use crate::runtime::client::GenerateRequest;
use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::net::msg;
use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::admit::admit_in_turn;
use crate::runtime::serve::coordinator::audit;
use crate::runtime::serve::coordinator::collect::collect;
use crate::runtime::serve::coordinator::drive::Driven;
use crate::runtime::serve::coordinator::drive::drive;
use crate::runtime::serve::coordinator::progress::Progress;
use crate::runtime::serve::coordinator::report::report;
use crate::runtime::serve::coordinator::resume::keep_plan;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::role::MAX_RESUMES;
use crate::runtime::serve::coordinator::role::is_busy;
use crate::runtime::serve::coordinator::role::is_route_refusal;
use crate::runtime::serve::coordinator::role::send_error;
use crate::runtime::serve::coordinator::runs::{A_SPLIT, ANY_CHAIN, Run};
use crate::runtime::serve::coordinator::seal::Interrupted;
use crate::runtime::serve::coordinator::seal::seal;
use crate::runtime::serve::coordinator::seal::seal_interrupted;
use crate::runtime::serve::coordinator::stall;
use crate::runtime::serve::shared::Deadline;
use crate::runtime::serve::stats;
use anyhow::anyhow;
use mesh_protocol::block::TerminalState;
use mesh_protocol::control::ControlReply;
use mesh_protocol::control::GenerateRequestMessage;
use mesh_protocol::identity::did_key;
use serde_json::json;

/// `plan`: set up the split if needed and name every stage's steward, so a
/// requester can shard a grant over them.
pub(crate) async fn handle_plan(
    coordinator: Arc<CoordinatorRole>,
    send: &mut quinn::SendStream,
) -> anyhow::Result<()> {
    match coordinator.ensure_run(ANY_CHAIN).await {
        Ok(run) => {
            let plan = ControlReply::Plan {
                run_id: run.assigns[0].run_id.clone(),
                stewards: run.keys.iter().map(did_key).collect(),
            };
            msg::write_cbor(send, &plan.to_cbor()).await
        }
        Err(error) => send_error(send, &format!("cannot set up the split: {error:#}")).await,
    }
}

pub(crate) async fn handle_generate(
    coordinator: Arc<CoordinatorRole>,
    message: &GenerateRequestMessage,
    send: &mut quinn::SendStream,
) -> anyhow::Result<()> {
    let refused_other =
        || stats::Counters::bump(&coordinator.shared.counters.requests_refused_other);
    let request = GenerateRequest::from_message(message);
    // One deadline for the whole request, from here: loading the split,
    // every step at every stage, every wait in between.
    let timeout = request
        .timeout
        .map_or(coordinator.shared.request_timeout, |t| {
            t.min(coordinator.shared.request_timeout)
        });
    let deadline = Deadline::after(timeout);
    // Every request that is not served gets a line saying why (at most
    // `MAX_UNSERVED_LOGGED` a minute: strangers can send refusals at will;
    // the next line counts those left out).
    let refuse = |reason: String| {
        if let Some(unlogged) = lock(&coordinator.unserved_logged).admit(Instant::now()) {
            tracing::warn!(unlogged, "a request refused: {reason}");
        }
        reason
    };
    let run = match run_by(&coordinator, deadline, ANY_CHAIN).await {
        Some(Ok(run)) => run,
        Some(Err(error)) => {
            refused_other();
            let reason = refuse(format!("cannot set up the split: {error:#}"));
            return send_error(send, &reason).await;
        }
        None => {
            refused_other();
            let reason = refuse(deadline.passed("the split to load"));
            return send_error(send, &reason).await;
        }
    };
    match serve_request(&coordinator, &run, &request, deadline, send).await {
        Ok(()) => Ok(()),
        Err(error) => {
            if is_busy(&error) {
                stats::Counters::bump(&coordinator.shared.counters.requests_refused_busy);
            } else if !is_route_refusal(&error) {
                refused_other();
            }
            let reason = refuse(format!("{error:#}"));
            send_error(send, &reason).await
        }
    }
}

/// The run a request goes on, planned and assigned within `deadline`
/// (`None` when the deadline passed first). Loading runs on to the end in
/// its own task even then, so the next request finds the split ready.
pub(crate) async fn run_by(
    coordinator: &Arc<CoordinatorRole>,
    deadline: Deadline,
    at_least: usize,
) -> Option<anyhow::Result<Arc<Run>>> {
    let loading = {
        let coordinator = coordinator.clone();
        tokio::spawn(async move { coordinator.ensure_run(at_least).await })
    };
    match tokio::time::timeout_at(deadline.at(), loading).await {
        Ok(Ok(outcome)) => Some(outcome),
        Ok(Err(error)) => Some(Err(anyhow!("its task ended: {error}"))),
        Err(_) => None,
    }
}

/// One request at the coordinator, in phases a reader can follow: admit
/// (the prompt, the request's places, every steward's grant decision),
/// drive (the chain, step by step), collect (the bill and the stages'
/// records), seal (the split's records and the `mesh/1` receipt) and report
/// (to the requester). What the request holds is released by its `Held` on
/// every path out of any phase.
pub(crate) async fn serve_request(
    coordinator: &Arc<CoordinatorRole>,
    run: &Arc<Run>,
    request: &GenerateRequest,
    deadline: Deadline,
    requester: &mut quinn::SendStream,
) -> anyhow::Result<()> {
    let mut admitted = admit_in_turn(coordinator, run, request, deadline).await?;
    let requester_gone = watch_requester(&mut admitted, requester);
    if let Some(ticket) = admitted.held.ticket.as_mut() {
        lock(&coordinator.shared.steward).begin_engine(ticket);
    }
    let mut progress = Progress::new(coordinator, request, &admitted, requester_gone);
    let mut run = run.clone();
    let mut interrupted: Vec<Interrupted<'_>> = Vec::new();
    let mut driven = loop {
        let mut driven = drive(
            coordinator,
            &run,
            request,
            deadline,
            &mut admitted,
            &mut progress,
            requester,
        )
        .await?;
        if let (Some(last), Some(replayed)) = (progress.resumes.last_mut(), driven.replayed_in) {
            last["replay_ms"] = json!(replayed.as_secs_f64() * 1e3);
        }
        if !driven.resumable {
            break driven;
        }
        stall::blame(coordinator, &run, admitted.request_id, &mut driven).await;
        let lost: Vec<String> = interrupted
            .iter()
            .flat_map(|i| &i.driven.lost)
            .chain(&driven.lost)
            .map(did_key)
            .collect();
        let lost = if lost.is_empty() {
            "no node".to_string()
        } else {
            lost.join(", ")
        };
        let failure = driven.failure.take().unwrap_or_default();
        // A segment that was to keep caches and failed before its first
        // token (a kept stage could not take its cache) is redone without
        // keeping, and that redo is not counted against --max-resumes; the
        // resume block's bound holds all the same.
        let failed_keep = |admitted: &Admitted<'_>, driven: &Driven| {
            admitted.keep.is_some() && driven.tokens == 0
        };
        let counted = interrupted
            .iter()
            .filter(|i| !failed_keep(&i.admitted, &i.driven))
            .count();
        if (!failed_keep(&admitted, &driven) && counted >= coordinator.settings.max_resumes)
            || interrupted.len() >= MAX_RESUMES
        {
            driven.failure = Some(format!(
                "{failure}; not resumed: {} resumes already (--max-resumes), lost {lost}",
                interrupted.len(),
            ));
            break driven;
        }
        // Re-plan over the members left, then go on from the next token.
        let noticed = Instant::now();
        let noticed_unix_ms = now_ms();
        tracing::info!(
            request_id = admitted.request_id,
            tokens = progress.tokens.len(),
            "resuming on a new chain: {failure}"
        );
        let next = match run_by(coordinator, deadline, A_SPLIT).await {
            Some(Ok(next)) => next,
            Some(Err(error)) => {
                driven.failure = Some(format!(
                    "{failure}; could not resume (lost {lost}): {error:#}"
                ));
                break driven;
            }
            None => {
                driven.terminal = TerminalState::TimedOut;
                driven.failure = Some(format!(
                    "{failure}; could not resume (lost {lost}): {}",
                    deadline.passed("a new chain to resume on")
                ));
                break driven;
            }
        };
        let keep = keep_plan(coordinator, &run, &next, &admitted, &driven, &progress);
        let resumed = match admitted.resume(coordinator, &next, keep).await {
            Ok(resumed) => resumed,
            Err(error) => {
                driven.failure = Some(format!("{failure}; could not resume: {error:#}"));
                break driven;
            }
        };
        driven.failure = Some(failure);
        progress.resumes.push(json!({
            "at_token": progress.tokens.len(),
            "lost": driven.lost.iter().map(did_key).collect::<Vec<_>>(),
            "kept": resumed.keep.as_ref().map_or(Vec::new(), |keep| keep.nodes.iter().map(did_key).collect()),
            "replayed_positions": resumed.keep.as_ref().map_or(
                admitted.prompt_ids.len() + progress.tokens.len(),
                |keep| if keep.from == 1 { 0 } else { keep.positions },
            ),
            "replan_ms": noticed.elapsed().as_secs_f64() * 1e3,
            "noticed_unix_ms": noticed_unix_ms,
        }));
        // The lost chain's cache at this node is not needed again.
        admitted.held.release_cache();
        interrupted.push(Interrupted {
            run: std::mem::replace(&mut run, next),
            admitted: std::mem::replace(&mut admitted, resumed),
            driven,
        });
    };
    // The tokens are all in: the draft cache goes back before sealing.
    progress.drafter.release().await;
    let earlier = seal_interrupted(coordinator, interrupted).await?;
    let collected = collect(coordinator, &mut admitted, &mut driven).await?;
    // A sampled request is audited once its stages' records are in.
    let (tape, records) = (driven.tape.take(), &collected.stages.records);
    let audit = audit::audit_request(coordinator, &run, &admitted, records, (tape, deadline)).await;
    let mut sealed = seal(
        coordinator,
        &run,
        &admitted,
        &driven,
        &progress,
        collected,
        earlier,
    )?;
    sealed.carry(audit);
    report(
        coordinator,
        &run,
        &admitted,
        &driven,
        &progress,
        sealed,
        requester,
    )
    .await
}

/// A requester that closes its connection or stops reading (QUIC
/// STOP_SENDING: how a client cancels) ends the request at the next step as
/// `client_cancelled`, on every stage: the flag the drive checks, set by a
/// task the request holds.
fn watch_requester(
    admitted: &mut Admitted<'_>,
    requester: &quinn::SendStream,
) -> Arc<std::sync::atomic::AtomicBool> {
    let requester_gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let gone = requester_gone.clone();
    let stopped = requester.stopped();
    admitted.held.watcher = Some(tokio::spawn(async move {
        let _ = stopped.await;
        gone.store(true, std::sync::atomic::Ordering::Relaxed);
    }));
    requester_gone
}
