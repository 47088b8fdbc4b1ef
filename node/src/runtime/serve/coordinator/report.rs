//! Report: the stages' own figures, then the text, the details and the
//! bundle, to the requester.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mesh_protocol::block::TerminalState;
use mesh_protocol::control::{ControlReply, ControlRequest};
use serde_json::json;

use crate::runtime::clock::lock;
use crate::runtime::net::ALPN_CONTROL;
use crate::runtime::net::msg::{self};
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::drive::Driven;
use crate::runtime::serve::coordinator::energy::energy_parts;
use crate::runtime::serve::coordinator::progress::Progress;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::role::one_way_hops_per_step;
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::coordinator::seal::Sealed;
use crate::runtime::serve::shared::StageStats;
use crate::runtime::serve::stats;
use anyhow;

/// Report: the stages' own figures (best effort), then `done` or `failed`
/// with the details and the bundle; a cancelled request is sealed all the
/// same, with nobody to tell.
pub(crate) async fn report(
    coordinator: &Arc<CoordinatorRole>,
    run: &Arc<Run>,
    admitted: &Admitted<'_>,
    driven: &Driven,
    progress: &Progress,
    sealed: Sealed,
    requester: &mut quinn::SendStream,
) -> anyhow::Result<()> {
    let request_id = admitted.request_id;
    let prompt_ids = &admitted.prompt_ids;
    let Driven {
        terminal,
        failure,
        fold_time,
        ..
    } = driven;
    let Progress {
        tokens,
        printed,
        finish_reason,
        own_compute,
        own_decode_engine,
        round_trips,
        decode_round_trips,
        started,
        resumes,
        ..
    } = progress;
    let prefill_time = progress.prefill_time.unwrap_or_default();
    let decode_time = progress
        .last_token_at
        .zip(progress.first_token_at)
        .map_or(Duration::ZERO, |(last, first)| last.duration_since(first));
    let terminal = *terminal;
    let Sealed { bundle, envelope } = sealed;
    let counters = &coordinator.shared.counters;
    counters
        .tokens_generated
        .fetch_add(tokens.len() as u64, std::sync::atomic::Ordering::Relaxed);
    if terminal == TerminalState::ClientCancelled {
        // Sealed and journalled all the same; there is nobody to tell.
        stats::Counters::bump(&counters.requests_cancelled);
        log_ended(admitted, progress, terminal, run.assigns.len());
        return Ok(());
    }
    let n = run.assigns.len() as u32;
    let run_id = run.assigns[0].run_id.clone();
    let coordinator_id = coordinator.shared.tls.did.clone();
    let return_mode = coordinator.settings.return_mode;
    // Per-stage compute, as each stage reports it.
    let mut stages = vec![
        json!({ "stage_index": 0, "node_id": coordinator_id, "layers": [run.own.slice.range.start, run.own.slice.range.end], "compute_ms": own_compute.as_secs_f64() * 1e3, "decode_engine_ms": own_decode_engine.as_secs_f64() * 1e3, "fold_us": fold_time.as_micros() as u64 }),
    ];
    // Decode steps of one row each: what an advert's speed is per token.
    let plain_steps = (!progress.drafted).then_some(progress.decode_steps);
    let (remote_compute, remote_decode_engine) =
        stage_figures(coordinator, run, (request_id, plain_steps), &mut stages).await;
    let decode_engine = *own_decode_engine + remote_decode_engine;
    let steps = tokens.len().max(1) as f64;
    let hops = one_way_hops_per_step(n as usize, return_mode) as f64;
    let overhead = round_trips.saturating_sub(remote_compute);
    let decision = admitted
        .decision
        .as_ref()
        .zip(progress.decided.as_ref())
        .map(|(plan, probabilities)| plan.to_json(probabilities));
    let mut details = json!({
        "request_id": request_id.to_string(),
        "run_id": run_id,
        "return_mode": return_mode.as_str(),
        "prompt_tokens": prompt_ids.len(),
        "generated_tokens": tokens.len(),
        "finish_reason": finish_reason,
        "token_ids": tokens,
        "prefill_ms": prefill_time.as_secs_f64() * 1e3,
        "decode_tokens_per_s": (tokens.len().saturating_sub(1)) as f64 / decode_time.as_secs_f64().max(1e-9),
        "decode_round_trip_ms": decode_round_trips.as_secs_f64() * 1e3 / progress.decode_steps.max(1) as f64,
        "decode_steps": progress.decode_steps,
        // Every stage's engine time on decode steps, the coordinator's
        // slice and head included: what the decode tokens cost without the
        // chain and without the hand-offs to each slice's worker. Asked of
        // the last chain's stages only: after a resume it leaves out the
        // stages of the chains lost.
        "decode_engine_ms": decode_engine.as_secs_f64() * 1e3,
        "spec_proposed": progress.spec_proposed,
        "spec_accepted": progress.spec_accepted,
        "drafts_from": progress.drafted.then(|| progress.drafter.source()),
        "stages": stages,
        "resumes": resumes,
        "per_hop_overhead_us": overhead.as_secs_f64() * 1e6 / steps / hops.max(1.0),
        "fold_share": fold_time.as_secs_f64() / started.elapsed().as_secs_f64().max(1e-9),
        "receipt": {
            "steward": envelope.receipt.steward,
            "sequence": envelope.receipt.sequence,
            "envelope_id": mesh_protocol::hex::encode(&envelope.envelope_id()),
            "energy_uj": envelope.receipt.energy.uj(),
            "energy_provenance": envelope.receipt.energy.provenance().as_str(),
            "uj_per_accepted_token": envelope.receipt.uj_per_accepted_token(),
            "grant_id": envelope.receipt.grant_id.map(|g| mesh_protocol::hex::encode(&g)),
            "grant_breach": envelope.receipt.grant_breach,
            "precision": envelope.receipt.weights.as_ref().map(|w| &w.precision),
        },
        "energy": energy_parts(&bundle, &envelope),
    });
    // A decision's answer is the chosen option; its figures are in the
    // details.
    let text = match &decision {
        Some(answer) => answer["chosen"].as_str().unwrap_or_default().to_string(),
        None => printed.clone(),
    };
    if let (Some(answer), serde_json::Value::Object(map)) = (decision, &mut details) {
        map.insert("decision".into(), answer);
    }
    let done = ControlReply::Finished {
        failed: failure.is_some(),
        text,
        terminal_state: terminal.as_str().to_string(),
        error: failure.clone().unwrap_or_default(),
        details: serde_json::to_vec(&details)?,
        bundle: serde_json::to_vec(&bundle)?,
    }
    .to_cbor();
    stats::Counters::bump(if failure.is_some() {
        &counters.requests_failed
    } else {
        &counters.requests_completed
    });
    if let Some(failure) = &failure
        && let Some(unlogged) = lock(&coordinator.unserved_logged).admit(Instant::now())
    {
        tracing::warn!(
            request_id,
            terminal_state = terminal.as_str(),
            tokens = tokens.len(),
            unlogged,
            "a request failed: {failure}"
        );
    }
    msg::write_cbor(requester, &done).await?;
    log_ended(admitted, progress, terminal, run.assigns.len());
    Ok(())
}

/// One line per request served, to its end or not: its figures, never
/// its text.
fn log_ended(admitted: &Admitted<'_>, progress: &Progress, terminal: TerminalState, stages: usize) {
    tracing::info!(
        request_id = admitted.request_id,
        prompt_tokens = admitted.prompt_ids.len(),
        tokens = progress.tokens.len(),
        ms = progress.started.elapsed().as_millis() as u64,
        outcome = terminal.as_str(),
        stages,
        "a request ended"
    );
}

/// Each stage's figures for the request, appended to `stages`; their
/// compute and their decode engine time, summed. Best effort: asked of
/// every stage at once, and a stage that is gone costs the requester at
/// most STATS_WAIT.
async fn stage_figures(
    coordinator: &Arc<CoordinatorRole>,
    run: &Run,
    (request_id, plain_steps): (u64, Option<u64>),
    stages: &mut Vec<serde_json::Value>,
) -> (Duration, Duration) {
    let mut compute = Duration::ZERO;
    let mut decode_engine = Duration::ZERO;
    let asked: Vec<_> = run
        .peers
        .iter()
        .map(|peer| {
            let (coordinator, peer) = (coordinator.clone(), peer.clone());
            tokio::spawn(async move {
                tokio::time::timeout(STATS_WAIT, query_stats(&coordinator, &peer, request_id)).await
            })
        })
        .collect();
    // Each stage's advertised speed, read once for the request.
    let package = coordinator.shared.model.package_id();
    let advertised: Vec<([u8; 32], u64)> = match (coordinator.shared.mesh.get(), plain_steps) {
        (Some(mesh), Some(_)) => mesh
            .members()
            .iter()
            .filter_map(|m| {
                Some((
                    m.advert.node_id,
                    m.advert.model(&package)?.decode_us_per_layer,
                ))
            })
            .collect(),
        _ => Vec::new(),
    };
    for (k, (peer, asked)) in run.peers.iter().zip(asked).enumerate() {
        let stats = match asked.await {
            Ok(Ok(Ok(Some(stats)))) => stats,
            _ => StageStats::default(),
        };
        compute += stats.compute;
        decode_engine += stats.decode_engine;
        let a = &run.topology[k + 1];
        let advert = advertised.iter().find(|(node, _)| *node == peer.key);
        if let (Some(steps), Some((node, advertised))) = (plain_steps, advert) {
            let layer_steps = steps * u64::from(a.layer_end - a.layer_start);
            measured_speed(coordinator, (node, *advertised), &stats, layer_steps);
        }
        stages.push(json!({ "stage_index": k + 1, "node_id": peer.did(), "layers": [a.layer_start, a.layer_end], "compute_ms": stats.compute.as_secs_f64() * 1e3, "decode_engine_ms": stats.decode_engine.as_secs_f64() * 1e3, "fold_us": stats.fold.as_micros() as u64, "steps": stats.steps }));
    }
    (compute, decode_engine)
}

/// What a stage's decode steps took per layer per token, set against its
/// advert in the node's standing (over a mesh, where plans use adverts).
fn measured_speed(
    coordinator: &CoordinatorRole,
    (node, advertised): (&[u8; 32], u64),
    stats: &StageStats,
    layer_steps: u64,
) {
    let measured = u64::try_from(stats.decode_engine.as_micros()).unwrap_or(u64::MAX);
    if layer_steps > 0 && measured > 0 {
        lock(&coordinator.planning.reputation).measured(*node, advertised, measured / layer_steps);
    }
}

/// How long the coordinator waits for the stages' figures after a request.
pub(crate) const STATS_WAIT: Duration = Duration::from_millis(750);

/// A stage's figures for a request it ended its part of; none while it is
/// still inside the request (or never had it).
pub(crate) async fn query_stats(
    coordinator: &Arc<CoordinatorRole>,
    peer: &PeerAddr,
    request_id: u64,
) -> anyhow::Result<Option<StageStats>> {
    let (mut send, mut recv) = coordinator.shared.net.open(peer, ALPN_CONTROL).await?;
    let request = ControlRequest::Stats { request_id }.to_cbor();
    let reply = msg::exchange(&mut send, &mut recv, &request, Duration::from_secs(2))
        .await?
        .context("no stats")?;
    match ControlReply::from_cbor(&reply)? {
        ControlReply::Stats {
            found,
            compute_us,
            decode_engine_us,
            fold_us,
            steps,
        } => Ok(found.then(|| StageStats {
            compute: Duration::from_micros(compute_us),
            decode_engine: Duration::from_micros(decode_engine_us),
            fold: Duration::from_micros(fold_us),
            steps: u32::try_from(steps).unwrap_or(u32::MAX),
        })),
        other => bail!("a stage answered `{}` to stats", other.kind()),
    }
}
