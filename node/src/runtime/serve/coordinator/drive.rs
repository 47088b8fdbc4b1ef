//! Drive: run the chain step by step to the last token, the deadline, a
//! cancel, a ceiling or a failure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mesh_protocol::block::{ReturnMode, TerminalState};
use mesh_protocol::cbor::Cbor;
use mesh_protocol::control::ControlReply;
use mesh_protocol::identity::did_key;
use mesh_protocol::session::{HopSession, Wire};
use mesh_protocol::stage_frame::Rewind;
use mesh_stage::SliceOutput;
use mesh_stage::frame::{WireDType, decode_frame, encode_frame};
use mesh_stage::sampling::Sampler;
use mesh_stage::text::TextStream;
use tokio::sync::oneshot;

use crate::runtime::client::GenerateRequest;
use crate::runtime::clock::lock;
use crate::runtime::net::ALPN_STAGE;
use crate::runtime::net::msg::{self, kind};
use crate::runtime::serve::batch;
use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::keep::MAX_KEPT_OUTPUT_BYTES;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::coordinator::tail::Gone;
use crate::runtime::serve::coordinator::tail::SegmentLanes;
use crate::runtime::serve::coordinator::tail::Tail;
use crate::runtime::serve::coordinator::tail::wait_direct;
use crate::runtime::serve::coordinator::text::shown_end;
use crate::runtime::serve::frames::Folding;
use crate::runtime::serve::frames::Frames;
use crate::runtime::serve::frames::max_reply;
use crate::runtime::serve::frames::next_frame;
use crate::runtime::serve::frames::refusal_behind;
use crate::runtime::serve::frames::spawn_frames;
use crate::runtime::serve::frames::write_forward;
use crate::runtime::serve::shared::DRAIN_WAIT;
use crate::runtime::serve::shared::Deadline;
use crate::runtime::serve::shared::POLICY_DENIED;
use crate::runtime::serve::shared::step_timed_out;
use anyhow;

/// What a request carries from one segment to the next: what it generated
/// and what it measured, over every chain it ran on.
pub(crate) struct Progress {
    pub(crate) tokens: Vec<u32>,
    /// The text of the tokens but end-of-sequence ones.
    pub(crate) text: TextStream,
    pub(crate) printed: String,
    /// Why a completed generation ended, in OpenAI's words: `stop` for an
    /// end-of-sequence token or a stop sequence, `length` for max_tokens.
    pub(crate) finish_reason: &'static str,
    pub(crate) sampler: Sampler,
    pub(crate) own_compute: Duration,
    /// The engine's own time on decode steps (their slice step and head),
    /// hand-offs to and from the slice's worker not included.
    pub(crate) own_decode_engine: Duration,
    pub(crate) round_trips: Duration,
    /// The round trips of decode steps alone (what a token waits for).
    pub(crate) decode_round_trips: Duration,
    /// The prompt's prefill, on the first chain.
    pub(crate) prefill_time: Option<Duration>,
    /// When the first and the latest token were sampled: the decode rate
    /// is taken between them, so closing the chain (records, sealing)
    /// is not counted as decoding.
    pub(crate) first_token_at: Option<Instant>,
    pub(crate) last_token_at: Option<Instant>,
    pub(crate) started: Instant,
    /// Set when the requester closes its connection or stops reading.
    pub(crate) requester_gone: Arc<std::sync::atomic::AtomicBool>,
    /// Each resume's figures, for the details.
    pub(crate) resumes: Vec<serde_json::Value>,
    /// The own slice's outputs so far (one row per position, in f32), while
    /// they fit in `MAX_KEPT_OUTPUT_BYTES`: what a new stage after it is
    /// replayed from.
    pub(crate) own_outputs: Option<Vec<f32>>,
    /// Whether the serve, as far as it went, repeats bit for bit.
    pub(crate) deterministic: bool,
    /// A decision's probability per option, once scored.
    pub(crate) decided: Option<Vec<f64>>,
    /// Decode steps answered (fewer than tokens when drafts are accepted).
    pub(crate) decode_steps: u64,
    /// Where its drafts come from; kept across segments (its cache on a
    /// draft model is the request's, not a chain's).
    pub(crate) drafter: super::draft::Drafter,
    /// Whether the request drafted (greedy, drafting on, not a decision).
    pub(crate) drafted: bool,
    /// Drafted tokens sent for verification, and those the model chose.
    pub(crate) spec_proposed: u64,
    pub(crate) spec_accepted: u64,
}

/// What driving one chain (one segment of the request) gave.
pub(crate) struct Driven {
    pub(crate) terminal: TerminalState,
    pub(crate) failure: Option<String>,
    pub(crate) lanes: SegmentLanes,
    pub(crate) fold_time: Duration,
    pub(crate) started: Instant,
    /// The chain failed in a way a new chain may get past: a stage lost,
    /// a transport error, a step that timed out, with time left.
    pub(crate) resumable: bool,
    /// Stages that left the mesh during the segment.
    pub(crate) lost: Vec<[u8; 32]>,
    /// Tokens generated before this segment.
    pub(crate) first_token: usize,
    /// Tokens this segment generated.
    pub(crate) tokens: usize,
    /// Positions prefilled at its start (the prompt, and any replay).
    pub(crate) prefilled: usize,
    /// How long a resumed segment's replay took to its first token.
    pub(crate) replayed_in: Option<Duration>,
    /// Nodes that kept their caches from the segment before.
    pub(crate) kept: Vec<[u8; 32]>,
    /// Positions this segment's own slice ran in decode steps (drafts
    /// included): its block's `decode`.
    pub(crate) own_decode_rows: u64,
}

/// Drive: open the chain and run it step by step to the last token, the
/// deadline, a cancel, a ceiling or a failure; then STOP (or just finish)
/// and read what the neighbours still send, so every lane is whole.
pub(crate) async fn drive(
    coordinator: &Arc<CoordinatorRole>,
    run: &Arc<Run>,
    request: &GenerateRequest,
    deadline: Deadline,
    admitted: &mut Admitted<'_>,
    progress: &mut Progress,
    requester: &mut quinn::SendStream,
) -> anyhow::Result<Driven> {
    let codec = coordinator.shared.model.text();
    let decision = admitted.decision.clone();
    let held = &mut admitted.held;
    let request_id = admitted.request_id;
    let max_new = admitted.max_new;
    let capacity = admitted.prompt_ids.len() + max_new;
    // A segment after a loss starts from the prompt and every token so far:
    // replayed as a prefill, it rebuilds the new chain's caches.
    let first_token = progress.tokens.len();
    let prefix: Vec<u32> = admitted
        .prompt_ids
        .iter()
        .chain(&progress.tokens)
        .copied()
        .collect();
    let n = run.assigns.len() as u32;
    let run_id = run.assigns[0].run_id.clone();
    let coordinator_id = coordinator.shared.tls.did.clone();
    let return_mode = coordinator.settings.return_mode;
    let mut lanes = Folding::new(HopSession::new(admitted.scope.clone(), 0));
    let mut direct_waiter = if return_mode == ReturnMode::Direct {
        let (sender, receiver) = oneshot::channel();
        lock(&coordinator.directs).insert(request_id, (run.keys[n as usize - 1], sender));
        held.direct = true;
        Some(receiver)
    } else {
        None
    };
    let Progress {
        tokens,
        text,
        printed,
        finish_reason,
        sampler,
        own_compute,
        own_decode_engine,
        round_trips,
        decode_round_trips,
        prefill_time,
        first_token_at,
        last_token_at,
        requester_gone,
        own_outputs,
        decided,
        decode_steps,
        drafter,
        drafted,
        spec_proposed,
        spec_accepted,
        ..
    } = progress;
    let started = Instant::now();
    let mut replayed_in: Option<Duration> = None;
    let mut budget_stop: Option<String> = None;
    let keep = admitted.keep.clone();
    let hidden_size = run.own.slice.config().hidden;
    // The prompt runs through the chain in chunks, each its own step, so no
    // step of a long prompt outlasts the step timeout. A segment that keeps
    // caches replays every position but the last to the stages that rebuild
    // theirs ("silent" steps: no reply comes back), then runs the last token
    // as a decode step through the whole chain.
    let (prefill, silent): (Vec<&[u32]>, usize) = match &keep {
        Some(keep) => {
            // No replay when every remote stage kept its cache (then the
            // coordinator kept its own too).
            let replayed = if keep.from == 1 { 0 } else { keep.positions };
            let mut steps: Vec<&[u32]> = prefix[..replayed]
                .chunks(coordinator.settings.prefill_chunk_tokens)
                .collect();
            let silent = steps.len();
            steps.push(&prefix[keep.positions..]);
            (steps, silent)
        }
        None => (
            prefix
                .chunks(coordinator.settings.prefill_chunk_tokens)
                .collect(),
            0,
        ),
    };
    // Steps that decode, as the stages count them: every step after the
    // prompt's, and a kept chain's first step (the prompt's last position,
    // sent as a decode step through the whole chain).
    let kept = keep.is_some();
    let prefill_steps = prefill.len();
    let decodes = |step: u32| {
        let step = step as usize;
        step >= prefill_steps || (kept && step + 1 == prefill_steps)
    };
    let replay_own = keep.as_ref().is_some_and(|keep| keep.own);
    match &keep {
        // The own cache was kept: so are its outputs, up to the positions kept.
        Some(keep) if keep.own => {
            if let Some(outputs) = own_outputs.as_mut() {
                outputs.truncate(keep.positions * hidden_size);
            }
        }
        // A fresh own cache: its outputs are computed again.
        _ => *own_outputs = Some(Vec::new()),
    }
    let first_peer = run.peers[0].clone();
    let final_stage = run.peers[run.peers.len() - 1].clone();
    // Speculative decoding: after each token sampled, up to `draft_tokens`
    // drafted (by the draft model, else by prompt lookup) go down in the
    // same step; greedy verification keeps those the model itself chooses,
    // so the tokens are those of plain greedy decoding.
    let drafting = coordinator.settings.draft_tokens > 0
        && decision.is_none()
        && request.sampling.temperature <= 0.0;
    let mut history = prefix.clone();
    if drafting {
        *drafted = true;
        // The draft model takes the prompt (or the replay) while the chain
        // prefills it.
        drafter.prefill(&history);
    }
    // The draft riding on the decode step in flight.
    let mut draft: Vec<u32> = Vec::new();
    let mut own_decode_rows: u64 = 0;

    let outcome: anyhow::Result<(anyhow::Result<TerminalState>, Tail)> = async {
        let (mut send, recv) = coordinator.shared.net.open(&first_peer, ALPN_STAGE).await?;
        let mut open = vec![
            ("run_id", Cbor::text(&run_id)),
            ("coordinator", Cbor::text(&coordinator_id)),
            ("stage_count", Cbor::Uint(n.into())),
            ("capacity", Cbor::Uint(capacity as u64)),
            ("return_mode", Cbor::text(return_mode.as_str())),
            (
                "prefill_steps",
                Cbor::Uint(if keep.is_some() { silent } else { prefill.len() } as u64),
            ),
            ("deadline_ms", Cbor::Uint(deadline.left().as_millis() as u64)),
        ];
        if let Some(interrupted) = admitted.resumes {
            // Signed: a stage ends or hands over a request of this
            // coordinator only on its word, not on an upstream stage's.
            let claim = mesh_protocol::resume::ResumeClaim {
                run_id: run_id.clone(),
                request_id,
                resume_of: interrupted,
                keep: keep
                    .as_ref()
                    .map(|keep| (u64::from(keep.from), keep.positions as u64)),
            };
            open.extend([
                ("resume_of", Cbor::Uint(interrupted)),
                (
                    "resume_sig",
                    Cbor::bytes(mesh_protocol::resume::sign_claim(&claim, &coordinator.shared.key).to_vec()),
                ),
            ]);
        }
        if let Some(keep) = &keep {
            open.extend([
                ("kept_from", Cbor::Uint(keep.from.into())),
                ("keep_positions", Cbor::Uint(keep.positions as u64)),
            ]);
        }
        let open = Cbor::text_map(open);
        write_forward(
            &mut send,
            &msg::stage_body(kind::OPEN, request_id, 0, &open.encode()),
            &mut lanes,
            0,
            0,
        )
        .await?;
        // Direct mode: the final stage's return, and stage 1's own stream
        // (which it writes only to say why it stopped), each read whole-frame
        // by a task so a wait on both can be abandoned without losing bytes.
        let mut direct: Option<Frames> = None;
        let mut direct_closed = false;
        let mut stage1: Option<Frames> = None;
        let reply_limit = max_reply(run.own.slice.config().hidden);
        let mut recv = Some(recv);
        if return_mode == ReturnMode::Direct {
            stage1 = recv.take().map(|recv| spawn_frames(recv, reply_limit));
        }
        // Relayed replies once the deadline is nearer than a step timeout.
        let mut relayed: Option<Frames> = None;
        let mut step: u32 = 0;
        let mut input: Vec<u32> = prefill[0].to_vec();
        // Whether a step sent still owes its reply (a deadline that passes
        // while waiting leaves it owed: it is drained after STOP), and how
        // many do.
        let mut reply_owed = false;
        let mut owed: u32 = 0;
        // Direct return: the prompt's chunks go down one after the other
        // without waiting for their replies, so stage k works on chunk i+1
        // while stage k+1 works on chunk i (a relayed stage waits for each
        // reply before it reads the next chunk).
        let pipelined = return_mode == ReturnMode::Direct;
        // Whether `input` (step `step`) is still to be computed and sent.
        let mut to_send = true;
        let mut trip = Instant::now();
        let result: anyhow::Result<TerminalState> = async {
            loop {
                // Between steps the chain is healthy: STOP tells every stage
                // how the request ended.
                if deadline.is_past() {
                    return Ok(TerminalState::TimedOut);
                }
                if requester_gone.load(std::sync::atomic::Ordering::Relaxed) {
                    return Ok(TerminalState::ClientCancelled);
                }
                if to_send {
                    let frame = if replay_own && (step as usize) < silent {
                        // The replay of a kept own cache: the outputs it
                        // sent before, not computed again.
                        let chunk = coordinator.settings.prefill_chunk_tokens;
                        let rows = (step as usize * chunk)..(keep.as_ref().map_or(0, |k| k.positions)).min((step as usize + 1) * chunk);
                        let kept = own_outputs
                            .as_ref()
                            .and_then(|out| out.get(rows.start * hidden_size..rows.end * hidden_size))
                            .context("the own slice's kept outputs")?;
                        encode_frame(kept, rows.len(), hidden_size, coordinator.settings.wire)?
                    } else {
                        let compute_start = Instant::now();
                        let lease = held.cache.take().context("the request's cache")?;
                        // The engine runs a prompt's chunk's rows together;
                        // a kept chain's first step is one row, which gets
                        // the same bits either way.
                        let decode = step as usize >= prefill.len();
                        let counted_as_decode = decodes(step);
                        if counted_as_decode {
                            own_decode_rows += input.len() as u64;
                        }
                        let bill = held.ticket.as_ref().and_then(|t| t.bill());
                        let (output, lease, engine) = run
                            .own
                            .batcher
                            .step(batch::StepInput::Tokens(std::mem::take(&mut input)), lease, decode, bill)
                            .await?;
                        held.cache = Some(lease);
                        *own_compute += compute_start.elapsed();
                        if counted_as_decode {
                            *own_decode_engine += engine;
                        }
                        if let Some(stop) = ceiling_reached(coordinator, held.ticket.as_mut(), tokens.len()) {
                            budget_stop = Some(stop);
                            return Ok(TerminalState::PolicyDenied);
                        }
                        let SliceOutput::Hidden(hidden) = output else {
                            bail!("the coordinator's slice returned logits")
                        };
                        // Kept while they fit, for a replay after a loss.
                        if own_outputs.as_ref().is_some_and(|out| {
                            (out.len() + hidden.values.len()) * 4 > MAX_KEPT_OUTPUT_BYTES
                        }) {
                            *own_outputs = None;
                        }
                        if let Some(out) = own_outputs.as_mut() {
                            out.extend_from_slice(&hidden.values);
                        }
                        encode_frame(&hidden.values, hidden.rows, hidden.cols, coordinator.settings.wire)?
                    };
                    trip = Instant::now();
                    let body = msg::stage_body(kind::ACTIVATIONS, request_id, step, &frame);
                    send_down(&mut send, &mut recv, &mut lanes, &body, step).await?;
                    // A draft is proposed once the chain has it, whether or
                    // not its reply comes back in this segment.
                    *spec_proposed += draft.len() as u64;
                    if (step as usize) < silent {
                        // A replay step: no reply comes back for it.
                        step += 1;
                        input = prefill[step as usize].to_vec();
                        continue;
                    }
                    reply_owed = true;
                    owed += 1;
                    if pipelined && (step as usize) + 1 < prefill.len() {
                        step += 1;
                        input = prefill[step as usize].to_vec();
                        continue;
                    }
                    to_send = false;
                }
                let wait = deadline.bound(coordinator.shared.step_timeout);
                let reply = match recv.as_mut() {
                    Some(recv) if wait == coordinator.shared.step_timeout && run.projected_us.is_none() => {
                        let reply =
                            msg::read_checked(recv, reply_limit, coordinator.shared.step_timeout)
                                .await
                                .map_err(|e| step_failure(e, "stage 1", coordinator.shared.step_timeout))?
                                .context("stage 1 closed the request")?;
                        lanes.fold(Wire::FromDownstream, &reply);
                        reply
                    }
                    _ if return_mode == ReturnMode::Relayed => {
                        // Read through a task, so the wait can end without
                        // losing part of a frame: over a mesh, where it also
                        // watches the members (a stage whose process died is
                        // noticed when its mesh connection closes, not at
                        // QUIC's idle timeout), and once the deadline is
                        // nearer than a step timeout.
                        if relayed.is_none() {
                            relayed = recv.take().map(|recv| spawn_frames(recv, reply_limit));
                        }
                        let arrived = tokio::select! {
                            arrived = tokio::time::timeout(wait, next_frame(&mut relayed)) => arrived,
                            gone = stage_left(coordinator, run, started) => {
                                bail!("stage {} left the mesh", did_key(&gone));
                            }
                        };
                        let Ok(arrived) = arrived else {
                            if deadline.is_past() {
                                return Ok(TerminalState::TimedOut);
                            }
                            return Err(step_timed_out("stage 1", coordinator.shared.step_timeout));
                        };
                        let reply = arrived.context("stage 1 closed the request")??;
                        lanes.fold(Wire::FromDownstream, &reply);
                        reply
                    }
                    _ => {
                        let mut until = tokio::time::Instant::now() + wait;
                        loop {
                            tokio::select! {
                                opened = wait_direct(&mut direct_waiter), if direct.is_none() => {
                                    direct_waiter = None;
                                    let (_send, stream, opening) =
                                        opened.context("the direct return was never opened")?;
                                    lanes.fold(Wire::DirectReceived, &opening);
                                    direct = Some(spawn_frames(stream, reply_limit));
                                }
                                arrived = next_frame(&mut direct), if !direct_closed => {
                                    let Some(arrived) = arrived else {
                                        // The final stage ends its return after telling
                                        // stage 1 why it stopped (a FAILED relayed up, on
                                        // another connection): wait a moment for that
                                        // reason instead of racing it.
                                        direct_closed = true;
                                        until = until.min(tokio::time::Instant::now() + DRAIN_WAIT);
                                        continue;
                                    };
                                    let reply = arrived.with_context(|| {
                                        format!("the final stage ({}) was lost", final_stage.did())
                                    })?;
                                    lanes.fold(Wire::DirectReceived, &reply);
                                    break reply;
                                }
                                said = next_frame(&mut stage1) => {
                                    let frame = said
                                        .context("stage 1 closed the request")?
                                        .with_context(|| format!("stage 1 ({}) was lost", first_peer.did()))?;
                                    lanes.fold(Wire::FromDownstream, &frame);
                                    // In direct mode stage 1's own stream only
                                    // says why the chain stopped.
                                    if msg::parse_stage(&frame)?.0 != kind::FAILED {
                                        bail!("stage 1 sent a reply on its own stream in direct mode");
                                    }
                                    break frame;
                                }
                                gone = stage_left(coordinator, run, started) => {
                                    // Its connection in the mesh closed: a
                                    // process gone is known at once, not after
                                    // the QUIC idle timeout.
                                    bail!("stage {} left the mesh", did_key(&gone));
                                }
                                () = tokio::time::sleep_until(until) => {
                                    if deadline.is_past() {
                                        return Ok(TerminalState::TimedOut);
                                    }
                                    if direct_closed {
                                        bail!("the final stage closed the direct return");
                                    }
                                    let whom = if direct.is_none() { "the final stage's direct return" } else { "the final stage" };
                                    return Err(step_timed_out(whom, coordinator.shared.step_timeout));
                                }
                            }
                        }
                    }
                };
                // Replies come in the order their steps went down.
                let answered = step + 1 - owed;
                owed -= 1;
                reply_owed = owed > 0;
                // A step's round trip, from its send to its reply; the
                // earlier chunks of a pipelined prompt overlap the last one's
                // and are not counted apart.
                if owed == 0 {
                    let round_trip = trip.elapsed();
                    *round_trips += round_trip;
                    if decodes(answered) {
                        *decode_round_trips += round_trip;
                    }
                    coordinator.shared.counters.round_trips.record(round_trip);
                }
                let (reply_kind, id, reply_step, payload) = msg::parse_stage(&reply)?;
                if id != request_id {
                    bail!("a reply for request {id} on request {request_id}");
                }
                if reply_kind == kind::FAILED {
                    let reason = String::from_utf8_lossy(payload);
                    if reason.starts_with(POLICY_DENIED) {
                        // That stage has ended its part: no STOP follows
                        // into a chain it no longer reads.
                        budget_stop = Some(format!("a stage stopped the serve: {reason}"));
                        bail!("{reason}");
                    }
                    bail!("a stage failed: {reason}");
                }
                if reply_kind != kind::HIDDEN {
                    bail!("a malformed reply (kind {reply_kind})");
                }
                if reply_step != answered {
                    bail!("a reply for step {reply_step} to step {answered}");
                }
                let (hidden, dtype) = decode_frame(payload, run.own.slice.config().hidden)
                    .context("the final stage's hidden state")?;
                // A row per position of a decode step (the token sampled
                // and its draft); one row, the last position, for a
                // prefill step.
                if hidden.rows != 1 + draft.len() || dtype != WireDType::F32 {
                    bail!(
                        "the final stage returned {} rows of {dtype:?}, not {} of F32",
                        hidden.rows,
                        1 + draft.len()
                    );
                }
                if hidden.values.iter().any(|v| !v.is_finite()) {
                    bail!("the final stage returned a hidden state that is not finite");
                }
                // A pipelined prompt's earlier chunks: only the last is sampled.
                if owed > 0 {
                    continue;
                }
                // A prefill chunk's last position is not sampled: the next
                // chunk follows.
                if let Some(chunk) = prefill.get(step as usize + 1) {
                    step += 1;
                    input = chunk.to_vec();
                    to_send = true;
                    continue;
                }
                let head_start = Instant::now();
                let bill = held.ticket.as_ref().and_then(|t| t.bill());
                let (logits, engine) = run.own.batcher.logits(hidden, bill).await?;
                *own_compute += head_start.elapsed();
                if decodes(step) {
                    *own_decode_engine += engine;
                }
                if let Some(stop) = ceiling_reached(coordinator, held.ticket.as_mut(), tokens.len()) {
                    budget_stop = Some(stop);
                    return Ok(TerminalState::PolicyDenied);
                }
                if step as usize + 1 == prefill.len() {
                    // The first segment's prefill is the prompt's; a later
                    // one's is the replay that rebuilt a new chain.
                    if prefill_time.is_none() {
                        *prefill_time = Some(started.elapsed());
                    } else {
                        replayed_in.get_or_insert(started.elapsed());
                    }
                }
                if let Some(decision) = &decision {
                    // A typed decision is answered here: every option
                    // scored at the prompt's last position, nothing sampled.
                    *decided = Some(decision.score(logits.last().context("no logits")?)?);
                    *finish_reason = "stop";
                    return Ok(TerminalState::Completed);
                }
                if decodes(step) {
                    *decode_steps += 1;
                }
                // Row i is sampled once every drafted token before it was
                // the model's own choice; the first that is not ends the
                // step, and the token chosen in its place goes on.
                let proposed = std::mem::take(&mut draft);
                let mut accepted = 0;
                let mut next = 0;
                // How the request ended, when it did in this step.
                let mut ended = None;
                for (i, row) in logits.iter().enumerate() {
                    next = sampler.sample(row).context("no logits")?;
                    let agreed = proposed.get(i) == Some(&next);
                    accepted += usize::from(agreed);
                    tokens.push(next);
                    let now = Instant::now();
                    first_token_at.get_or_insert(now);
                    *last_token_at = Some(now);
                    history.push(next);
                    let eos = codec.is_eos(next);
                    let last = eos || tokens.len() >= max_new;
                    let decoded = if eos {
                        text.text()
                    } else {
                        text.push(codec, next)?
                    };
                    let (end, stopped) = shown_end(decoded, &request.stop, last);
                    let shown = decoded.get(..end).unwrap_or("");
                    let piece = shown
                        .strip_prefix(printed.as_str())
                        .unwrap_or("")
                        .to_string();
                    *printed = shown.to_string();
                    // Every token but an end-of-sequence one is announced; an
                    // end-of-sequence one only when it releases held-back text.
                    if !eos || !piece.is_empty() {
                        let token = ControlReply::Token {
                            id: next.into(),
                            text: piece,
                        };
                        if msg::write_cbor(requester, &token.to_cbor()).await.is_err() {
                            ended = Some(TerminalState::ClientCancelled);
                            break;
                        }
                    }
                    if eos || stopped {
                        *finish_reason = "stop";
                    }
                    if last || stopped {
                        ended = Some(TerminalState::Completed);
                        break;
                    }
                    if !agreed {
                        break;
                    }
                }
                *spec_accepted += accepted as u64;
                if ended == Some(TerminalState::ClientCancelled) {
                    return Ok(TerminalState::ClientCancelled);
                }
                step += 1;
                if let Some(state) = ended {
                    return Ok(state);
                }
                let rejected = proposed.len() - accepted;
                if rejected > 0 {
                    // The rejected positions leave every cache before the
                    // next step: the own one here, the stages' by REWIND.
                    let lease = held.cache.as_mut().context("the request's cache")?;
                    let positions = lease.positions() - rejected;
                    lease.cache().truncate(positions)?;
                    if let Some(out) = own_outputs.as_mut() {
                        out.truncate(positions * hidden_size);
                    }
                    let rewind = Rewind {
                        positions: positions as u64,
                    };
                    let body = msg::stage_body(kind::REWIND, request_id, step, &rewind.encode());
                    send_down(&mut send, &mut recv, &mut lanes, &body, step).await?;
                }
                if drafting {
                    // All of a draft accepted gives one token more than it
                    // holds: never past max_tokens.
                    let room = max_new.saturating_sub(tokens.len() + 1).min(coordinator.settings.draft_tokens);
                    // The draft model's passes are this request's alone.
                    let drafting = held
                        .ticket
                        .as_ref()
                        .and_then(|t| t.bill())
                        .map(|bill| bill.computing(1));
                    draft = drafter.propose(&history, room).await;
                    drop(drafting);
                }
                input = std::iter::once(next).chain(draft.iter().copied()).collect();
                to_send = true;
            }
        }
        .await;
        // STOP enters the forward lane only when the chain is healthy. After a
        // failure stage 1 may have stopped reading, and a frame it never read
        // folded here would read as tampering on a healthy hop: the stream is
        // just finished, and each stage records what it saw.
        if let Ok(state) = &result {
            let stop = Cbor::text_map([("terminal_state", Cbor::text(state.as_str()))]);
            write_forward(
                &mut send,
                &msg::stage_body(kind::STOP, request_id, step, &stop.encode()),
                &mut lanes,
                0,
                step,
            )
            .await?;
        }
        let _ = send.finish();
        let tail = Tail {
            // A deadline that passed while a reply was owed: the reply still
            // comes (stage 1 finishes its step, reads STOP and ends its
            // stream; a stage's own deadline is a step timeout later than
            // this one), and is read and folded, so hop 0 still agrees.
            unfinished: result.is_err() || reply_owed,
            reply_owed,
            direct_mode: return_mode == ReturnMode::Direct,
            step_timeout: coordinator.shared.step_timeout,
            reply_limit,
            relayed,
            stage1,
            direct,
            direct_waiter: direct_waiter.take(),
        };
        Ok((result, tail))
    }
    .await;
    // The stages that left the mesh during this segment: lost, for a chain
    // planned over the mesh.
    let lost: Vec<[u8; 32]> = run.keys[1..]
        .iter()
        .filter(|key| {
            run.projected_us.is_some() && coordinator.shared.left_mesh_since(key, started)
        })
        .copied()
        .collect();
    let (outcome, tail) = match outcome {
        Ok((result, tail)) => (result, Some(tail)),
        Err(error) => (Err(error), None),
    };
    // A stage that left the mesh has nothing more to say: its streams are
    // not drained (they would end only at the QUIC idle timeout).
    let gone = Gone {
        stage1: lost.contains(&run.keys[1]),
        final_stage: lost.contains(&run.keys[n as usize - 1]),
    };
    let chain_failed = outcome.is_err() && budget_stop.is_none();
    // A failed chain that will be resumed is drained in the background: the
    // survivors' last frames complete this segment's lanes by the time it is
    // sealed, and the request goes on at once.
    let resumable =
        chain_failed && run.projected_us.is_some() && !deadline.is_past() && tokens.len() < max_new;
    // Folding time in the drive itself (a drain after it is not counted).
    let fold_time = lanes.spent;
    let lanes = match tail {
        Some(tail) if resumable => SegmentLanes::Draining(tokio::spawn(async move {
            tail.drain(&mut lanes, gone).await;
            lanes
        })),
        Some(tail) => {
            tail.drain(&mut lanes, gone).await;
            SegmentLanes::Ready(Box::new(lanes))
        }
        None => SegmentLanes::Ready(Box::new(lanes)),
    };
    let (terminal, failure) = match outcome {
        Ok(TerminalState::TimedOut) => (
            TerminalState::TimedOut,
            Some(deadline.passed("the next token")),
        ),
        Ok(TerminalState::ClientCancelled) => (
            TerminalState::ClientCancelled,
            Some(format!(
                "the requester went away after {} tokens",
                tokens.len()
            )),
        ),
        Ok(state) => (state, budget_stop),
        Err(_) if budget_stop.is_some() => (TerminalState::PolicyDenied, budget_stop),
        Err(error) => {
            let state = if error.to_string().contains("timed out") {
                TerminalState::TimedOut
            } else {
                TerminalState::TransportError
            };
            (state, Some(format!("{error:#}")))
        }
    };
    run.own.touch();
    // A chain that failed (not one a requester's deadline or cancel ended)
    // may have lost a stage's slice: assign again before the next request.
    if chain_failed {
        run.stale.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(Driven {
        terminal,
        failure,
        lanes,
        fold_time,
        started,
        resumable,
        lost,
        first_token,
        tokens: tokens.len() - first_token,
        prefilled: keep.as_ref().map_or(prefix.len(), |keep| keep.positions),
        replayed_in,
        // Claimed only once the chain answered: a kept stage that could
        // not take its cache refuses the request.
        kept: keep
            .as_ref()
            .filter(|_| tokens.len() > first_token)
            .map_or(Vec::new(), |keep| keep.nodes.clone()),
        own_decode_rows,
    })
}

/// Write one message down to stage 1 on the forward lane; when the write
/// fails, the reason stage 1 gave for refusing it, if it gave one.
pub(crate) async fn send_down(
    send: &mut quinn::SendStream,
    recv: &mut Option<quinn::RecvStream>,
    lanes: &mut Folding,
    body: &[u8],
    step: u32,
) -> anyhow::Result<()> {
    if let Err(error) = write_forward(send, body, lanes, 0, step).await {
        return Err(match recv.as_mut() {
            Some(recv) => refusal_behind(recv, error, "stage 1", Some(lanes)).await,
            None => error,
        });
    }
    Ok(())
}

/// The coordinator's steward meters its compute so far; past the grant's
/// energy ceiling, why the serve stops there.
pub(crate) fn ceiling_reached(
    coordinator: &CoordinatorRole,
    ticket: Option<&mut crate::runtime::steward::ServeTicket>,
    tokens: usize,
) -> Option<String> {
    let ticket = ticket?;
    let metered = lock(&coordinator.shared.steward).mark_engine(ticket);
    let limit = ticket.limit_uj().filter(|limit| metered >= *limit)?;
    Some(format!(
        "the energy ceiling of {limit} µJ was reached at the coordinator ({metered} µJ metered) after {tokens} tokens"
    ))
}

/// The first of `stages` whose mesh connection closed (checked on every
/// change, and every 250 ms); never, for a node in no mesh. A member only
/// late with its advert or a ping still counts as there: QUIC's own idle
/// timeout judges it.
pub(crate) async fn stage_left(
    coordinator: &CoordinatorRole,
    run: &Run,
    since: Instant,
) -> [u8; 32] {
    // Only a chain planned over the mesh: a configured peer's mesh
    // connection says nothing of its QUIC one.
    let Some(mesh) = coordinator
        .shared
        .mesh
        .get()
        .filter(|_| run.projected_us.is_some())
    else {
        return std::future::pending().await;
    };
    let stages = &run.keys[1..];
    loop {
        if let Some(gone) = stages
            .iter()
            .find(|k| coordinator.shared.left_mesh_since(k, since))
        {
            return *gone;
        }
        mesh.changed(Duration::from_millis(250)).await;
    }
}

/// Name the wait that ran out, and the setting that bounds it.
pub(crate) fn step_failure(error: anyhow::Error, whom: &str, timeout: Duration) -> anyhow::Error {
    if error.to_string().contains("timed out") {
        step_timed_out(whom, timeout)
    } else {
        error.context(format!("waiting for {whom}'s reply"))
    }
}
