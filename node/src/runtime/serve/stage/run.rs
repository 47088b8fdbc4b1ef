//! Run a request on a stage: open the next hop, then every step (forward
//! it, or return the final hidden state), to STOP or a failure.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use mesh_protocol::block::{ReturnMode, SplitKey, TerminalState, Tokens};
use mesh_protocol::cbor::Cbor;
use mesh_protocol::identity::did_key;
use mesh_protocol::mesh1::ServeRequest;
use mesh_protocol::session::{HopSession, RequestScope, Wire};
use mesh_protocol::stage_frame::{MAX_DECODE_ROWS, Rewind};
use mesh_stage::SliceOutput;
use mesh_stage::frame::{WireDType, decode_frame, encode_frame};

use crate::runtime::clock::lock;
use crate::runtime::net::ALPN_STAGE;
use crate::runtime::net::msg::{self, kind};
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::batch;
use crate::runtime::serve::frames::Folding;
use crate::runtime::serve::frames::Frames;
use crate::runtime::serve::frames::drain;
use crate::runtime::serve::frames::failed_reason;
use crate::runtime::serve::frames::max_reply;
use crate::runtime::serve::frames::next_frame;
use crate::runtime::serve::frames::refusal_behind;
use crate::runtime::serve::frames::send_frame;
use crate::runtime::serve::frames::spawn_frames;
use crate::runtime::serve::frames::write_forward;
use crate::runtime::serve::shared::POLICY_DENIED;
use crate::runtime::serve::shared::StageStats;
use crate::runtime::serve::shared::step_timed_out;
use crate::runtime::serve::slot::Slot;
use crate::runtime::serve::stage::admit::StageAdmitted;
use crate::runtime::serve::stage::role::StageRole;
use anyhow;

/// What running a request on a stage left to seal.
pub(crate) struct StageRan {
    pub(crate) slot: Arc<Slot>,
    pub(crate) request_id: u64,
    pub(crate) run_id: String,
    pub(crate) ticket: crate::runtime::steward::ServeTicket,
    pub(crate) served: ServeRequest,
    pub(crate) lanes: Folding,
    pub(crate) tokens: Tokens,
    /// Of `tokens.prefill_received`, the positions its cache came with.
    pub(crate) kept_positions: u64,
    pub(crate) terminal: TerminalState,
}

/// Run: open the next hop, then every step (forward it, or return logits),
/// to STOP or a failure; on a failure, say why upstream once and read what
/// the neighbours still send, so every lane is whole.
pub(crate) async fn run_stage(stage: &Arc<StageRole>, admitted: StageAdmitted) -> StageRan {
    let StageAdmitted {
        slot,
        request_id,
        first,
        run_id,
        prefill_steps,
        deadline,
        return_mode,
        mut ticket,
        served,
        mut cache,
        keep,
        kept_positions,
        silent_steps,
        first_step,
        mut up_send,
        up_recv,
    } = admitted;
    let assign = &slot.assign;
    let coordinator = did_key(&assign.coordinator);
    let k = assign.stage_index;
    let scope = RequestScope {
        split: SplitKey {
            coordinator_node_id: coordinator.clone(),
            run_id: run_id.clone(),
            request_id,
        },
        stage_count: assign.stage_count,
        return_mode,
    };
    let mut lanes = Folding::new(HopSession::new(scope, k));
    lanes.fold(Wire::FromUpstream, &first);

    // Downstream: its send stream, and its reply stream read in step
    // (relayed) or watched whole-frame by a task (direct, `down_watch`).
    let mut down: Option<(quinn::SendStream, Option<quinn::RecvStream>)> = None;
    let mut down_watch: Option<Frames> = None;
    let mut direct: Option<quinn::SendStream> = None;
    let mut upstream = spawn_frames(up_recv, msg::MAX_STAGE_MESSAGE);
    let mut terminal = TerminalState::TransportError;
    let mut tokens = Tokens {
        prefill_received: kept_positions,
        decode: 0,
    };
    let mut stats = StageStats::default();
    // Positions a REWIND may still drop: the last decode step's draft.
    let mut rewindable: usize = 0;
    // Whether upstream stopped sending: then nothing is reported to it.
    let mut upstream_gone = false;
    lock(&stage.shared.steward).begin_engine(&mut ticket);

    let outcome: anyhow::Result<()> = async {
        if let Some(next) = &assign.downstream {
            let (mut send, recv) = stage.shared.net.open(next, ALPN_STAGE).await?;
            lanes.session.open_downstream();
            write_forward(&mut send, &first[4..], &mut lanes, k, 0).await?;
            if return_mode == ReturnMode::Direct {
                down_watch = Some(spawn_frames(recv, max_reply(slot.slice.config().hidden)));
                down = Some((send, None));
            } else {
                down = Some((send, Some(recv)));
            }
        } else if return_mode == ReturnMode::Direct {
            let coordinator_peer = PeerAddr {
                key: assign.coordinator,
                addr: assign.coordinator_addr,
            };
            let (mut send, _recv) = stage.shared.net.open(&coordinator_peer, ALPN_STAGE).await?;
            lanes.session.open_direct();
            let opening = msg::frame(&msg::stage_body(kind::DIRECT_OPEN, request_id, 0, &[]))?;
            send_frame(
                &mut send,
                &opening,
                &mut lanes,
                Wire::DirectSent,
                "on the direct return",
            )
            .await?;
            direct = Some(send);
        }
        loop {
            // In direct mode replies skip this stage, so its downstream writes
            // to it only to say why it stopped: watch for that (or for the
            // stream closing) while waiting for upstream.
            let read = tokio::select! {
                biased;
                () = keep.superseded.notified() => {
                    // Its coordinator resumed it on a new chain that keeps
                    // this cache: the old chain's upstream is gone, even
                    // if its stream still looks open.
                    upstream_gone = true;
                    bail!("superseded: its coordinator resumed it on a new chain");
                }
                read = tokio::time::timeout(deadline.bound(stage.shared.step_timeout), upstream.recv()) => read,
                said = next_frame(&mut down_watch) => {
                    let frame = said
                        .with_context(|| format!("stage {} closed the request", k + 1))??;
                    lanes.fold(Wire::FromDownstream, &frame);
                    let (_, _, _, reason) = msg::parse_stage(&frame)?;
                    bail!("{}", String::from_utf8_lossy(reason));
                }
            };
            let frame = match read {
                Ok(Some(Ok(frame))) => frame,
                Ok(None) => {
                    terminal = TerminalState::TransportError;
                    upstream_gone = true;
                    bail!("upstream closed the request without STOP");
                }
                Ok(Some(Err(error))) => {
                    upstream_gone = true;
                    terminal = TerminalState::TransportError;
                    return Err(error);
                }
                Err(_) => {
                    upstream_gone = true;
                    terminal = TerminalState::TimedOut;
                    if deadline.is_past() {
                        bail!("{}", deadline.passed("upstream"));
                    }
                    return Err(step_timed_out("upstream", stage.shared.step_timeout));
                }
            };
            lanes.fold(Wire::FromUpstream, &frame);
            let (message_kind, id, step, payload) = msg::parse_stage(&frame)?;
            if id != request_id {
                bail!("a frame of request {id} on the stream of request {request_id}");
            }
            // Steps come in order, one after another: an ACTIVATIONS or a
            // REWIND out of turn is not this request's next step.
            let next = first_step + u64::from(stats.steps);
            match message_kind {
                kind::ACTIVATIONS => {
                    if u64::from(step) != next {
                        bail!("step {step} where step {next} was next");
                    }
                    let (activations, wire) = decode_frame(payload, slot.slice.config().hidden)?;
                    // A replay step whose output the next stage, which kept
                    // its cache, does not need.
                    let silent = u64::from(stats.steps) < silent_steps;
                    // A decode step carries the token sampled and the
                    // draft after it: each row is answered, and each gets
                    // the bits it gets decoded alone.
                    let decode = u64::from(stats.steps) >= prefill_steps;
                    let rows = activations.rows;
                    if decode && rows > MAX_DECODE_ROWS {
                        bail!(
                            "a decode step of {rows} positions: at most {MAX_DECODE_ROWS} (a token and its draft)"
                        );
                    }
                    if decode {
                        tokens.decode += rows as u64;
                        rewindable = rows.saturating_sub(1);
                    } else {
                        tokens.prefill_received += rows as u64;
                        rewindable = 0;
                    }
                    stats.steps += 1;
                    let start = Instant::now();
                    let lease = cache.take().context("the request's cache")?;
                    let (output, lease, engine) = slot
                        .batcher
                        .step(
                            batch::StepInput::Hidden(activations),
                            lease,
                            decode,
                            ticket.bill(),
                        )
                        .await?;
                    cache = Some(lease);
                    stats.compute += start.elapsed();
                    if decode {
                        stats.decode_engine += engine;
                    }
                    let metered = lock(&stage.shared.steward).mark_engine(&mut ticket);
                    if let Some(limit) = ticket.limit_uj().filter(|limit| metered >= *limit) {
                        // This steward's part of the serve ends here; the
                        // failure path tells upstream why, once.
                        terminal = TerminalState::PolicyDenied;
                        bail!(
                            "{POLICY_DENIED}: the energy ceiling of {limit} µJ was reached at stage {k} ({metered} µJ metered)"
                        );
                    }
                    match output {
                        SliceOutput::Hidden(_) if silent => {}
                        SliceOutput::Hidden(a) if down.is_some() => {
                            let frame = encode_frame(&a.values, a.rows, a.cols, wire)?;
                            let (send, down_recv) = down
                                .as_mut()
                                .context("a middle stage without a downstream")?;
                            if let Err(error) = write_forward(
                                send,
                                &msg::stage_body(kind::ACTIVATIONS, request_id, step, &frame),
                                &mut lanes,
                                k,
                                step,
                            )
                            .await
                            {
                                let whom = format!("stage {}", k + 1);
                                return Err(match down_recv.as_mut() {
                                    Some(recv) => {
                                        refusal_behind(recv, error, &whom, Some(&mut lanes)).await
                                    }
                                    None => error,
                                });
                            }
                            if return_mode == ReturnMode::Relayed {
                                let recv =
                                    down_recv.as_mut().context("a relayed downstream's replies")?;
                                let wait = deadline.bound(stage.shared.step_timeout);
                                let reply =
                                    match msg::read_checked(recv, max_reply(slot.slice.config().hidden), wait)
                                        .await
                                    {
                                        Err(_) if deadline.is_past() => {
                                            terminal = TerminalState::TimedOut;
                                            bail!("{}", deadline.passed(&format!("stage {}", k + 1)));
                                        }
                                        read => read?,
                                    }
                                    .context("downstream closed before replying")?;
                                lanes.fold(Wire::FromDownstream, &reply);
                                send_frame(
                                    &mut up_send,
                                    &reply,
                                    &mut lanes,
                                    Wire::ToUpstream,
                                    "upstream",
                                )
                                .await?;
                            }
                        }
                        SliceOutput::Logits(_) => bail!("a chain's slice returned logits"),
                        SliceOutput::Hidden(a) => {
                            // The final stage: in f32 whatever the wire, for
                            // the coordinator's output head, every row of a
                            // decode step (each position is sampled or
                            // checks a drafted token), else the step's last.
                            let answered = if decode { a.rows } else { 1 };
                            let rows = a
                                .values
                                .get(a.rows.saturating_sub(answered) * a.cols..)
                                .filter(|rows| !rows.is_empty())
                                .context("the final slice returned no hidden state")?;
                            let payload = encode_frame(rows, answered, a.cols, WireDType::F32)?;
                            let body = msg::stage_body(kind::HIDDEN, request_id, step, &payload);
                            let bytes = msg::frame(&body)?;
                            match &mut direct {
                                Some(send) => {
                                    send_frame(
                                        send,
                                        &bytes,
                                        &mut lanes,
                                        Wire::DirectSent,
                                        "on the direct return",
                                    )
                                    .await?
                                }
                                None => {
                                    send_frame(
                                        &mut up_send,
                                        &bytes,
                                        &mut lanes,
                                        Wire::ToUpstream,
                                        "upstream",
                                    )
                                    .await?
                                }
                            }
                        }
                    }
                }
                kind::REWIND => {
                    // Only the last decode step's draft can be dropped, and
                    // only once: the positions before it are the request's.
                    let Rewind { positions } = Rewind::parse(payload)?;
                    if u64::from(step) != next {
                        bail!("a rewind carrying step {step}, not the next step {next}");
                    }
                    let lease = cache.as_mut().context("the request's cache")?;
                    let held = lease.positions();
                    let keep = usize::try_from(positions).unwrap_or(usize::MAX);
                    if keep >= held {
                        bail!("a rewind to {keep} positions of {held} drops nothing");
                    }
                    if held - keep > rewindable {
                        bail!(
                            "a rewind to {keep} positions of {held} drops more than the last step's draft ({rewindable} positions)"
                        );
                    }
                    lease.cache().truncate(keep)?;
                    rewindable = 0;
                    if let Some((send, _)) = down.as_mut() {
                        write_forward(send, &frame[4..], &mut lanes, k, step).await?;
                    }
                }
                kind::STOP => {
                    let state = Cbor::decode(payload).ok().and_then(|c| {
                        c.get("terminal_state")
                            .and_then(Cbor::as_text)
                            .and_then(TerminalState::parse)
                    });
                    terminal = state.unwrap_or(TerminalState::Completed);
                    // Upstream reads nothing more on this request.
                    upstream_gone = true;
                    if let Some((send, _)) = down.as_mut() {
                        write_forward(send, &frame[4..], &mut lanes, k, step).await?;
                    }
                    return Ok(());
                }
                other => bail!("unexpected stage message kind {other}"),
            }
        }
    }
    .await;
    // A failed request's cache waits a while for a resume to keep it: let
    // go of it now, before the neighbours' last frames are read.
    keep.release(
        cache.take(),
        outcome.is_err()
            && matches!(
                terminal,
                TerminalState::TransportError | TerminalState::TimedOut
            ),
    );
    if let Err(error) = &outcome {
        tracing::warn!(stage = k, request_id, "{error:#}");
        // Upstream is still waiting for this step's reply: say why there is
        // none (a relayed reply is read, and folded, by the node before).
        if !upstream_gone {
            // A steward's stop keeps its `policy_denied` prefix on the way up.
            let reason = format!("{error:#}");
            let reason = if reason.starts_with(POLICY_DENIED) {
                reason
            } else {
                format!("stage {k}: {reason}")
            };
            let body = msg::stage_body(
                kind::FAILED,
                request_id,
                stats.steps,
                failed_reason(&reason),
            );
            if let Ok(bytes) = msg::frame(&body) {
                let _ = send_frame(
                    &mut up_send,
                    &bytes,
                    &mut lanes,
                    Wire::ToUpstream,
                    "upstream",
                )
                .await;
            }
        }
        // Upstream may have sent more before it learned of the failure:
        // read and fold it, so its digest and this one still agree. The
        // downstream ends its part once this stage's stream to it finishes.
        if let Some((send, _)) = down.as_mut() {
            let _ = send.finish();
        }
        if !upstream_gone {
            drain(&mut upstream, &mut lanes, Wire::FromUpstream).await;
        }
        if let Some(watch) = down_watch.as_mut() {
            drain(watch, &mut lanes, Wire::FromDownstream).await;
        }
    }
    slot.touch();
    if let Some((mut send, _)) = down.take() {
        let _ = send.finish();
    }
    if let Some(mut send) = direct.take() {
        let _ = send.finish();
    }
    let _ = up_send.finish();
    stats.fold = lanes.spent;
    stage.record_stats(request_id, stats);

    StageRan {
        slot,
        request_id,
        run_id,
        ticket,
        served,
        lanes,
        tokens,
        kept_positions,
        terminal,
    }
}
