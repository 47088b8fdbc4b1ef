//! Drive: run the chain step by step to the last token, the deadline, a
//! cancel, a ceiling or a failure. A segment's own state is a [`Segment`];
//! its streams are a [`Chain`].

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mesh_protocol::block::{ReturnMode, TerminalState};
use mesh_protocol::cbor::Cbor;
use mesh_protocol::control::ControlReply;
use mesh_protocol::session::HopSession;
use mesh_protocol::stage_frame::Rewind;
use mesh_stage::SliceOutput;
use mesh_stage::frame::{Activations, WireDType, decode_frame, encode_frame};
use tokio::sync::oneshot;

use crate::runtime::client::GenerateRequest;
use crate::runtime::clock::lock;
use crate::runtime::net::ALPN_STAGE;
use crate::runtime::net::msg::{self, kind};
use crate::runtime::serve::batch;
use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::audit::{self, Tape};
use crate::runtime::serve::coordinator::chain::{Chain, Watch};
use crate::runtime::serve::coordinator::keep::{KeepPlan, MAX_KEPT_OUTPUT_BYTES};
use crate::runtime::serve::coordinator::progress::Progress;
use crate::runtime::serve::coordinator::role::{CoordinatorRole, DirectStream};
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::coordinator::tail::{Gone, SegmentLanes, Tail};
use crate::runtime::serve::coordinator::text::shown_end;
use crate::runtime::serve::frames::{Folding, max_reply};
use crate::runtime::serve::shared::{Deadline, POLICY_DENIED};
use crate::runtime::steward::ServeTicket;

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
    /// What an audited segment sent to stage 1 and got back.
    pub(crate) tape: Option<Tape>,
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
    let mut segment = Segment::new(coordinator, run, request, deadline, admitted, progress);
    let outcome = segment.run_chain(requester).await;
    Ok(segment.conclude(outcome).await)
}

/// The steps a segment runs before it samples: the prompt (or a resumed
/// segment's replay) in chunks, each its own step, so no step of a long
/// prompt outlasts the step timeout. A segment that keeps caches replays
/// every position but the last to the stages that rebuild theirs ("silent"
/// steps: no reply comes back), then runs the last token as a decode step
/// through the whole chain.
struct Schedule {
    /// Each prefill step's positions in the prefix.
    chunks: Vec<Range<usize>>,
    /// The leading steps that only replay: no reply comes back for them.
    silent: usize,
    /// The segment keeps caches from the segment before.
    kept: bool,
    /// The own cache was kept: the silent steps send the outputs it sent
    /// before, not computed again.
    replay_own: bool,
}

impl Schedule {
    fn new(prefix: usize, keep: Option<&KeepPlan>, chunk: usize) -> Self {
        let chunk = chunk.max(1);
        let chunks_of = |end: usize| {
            (0..end)
                .step_by(chunk)
                .map(move |start| start..(start + chunk).min(end))
        };
        match keep {
            Some(keep) => {
                // No replay when every remote stage kept its cache (then the
                // coordinator kept its own too).
                let replayed = if keep.from == 1 { 0 } else { keep.positions };
                let mut chunks: Vec<Range<usize>> = chunks_of(replayed).collect();
                let silent = chunks.len();
                chunks.push(keep.positions..prefix);
                Self {
                    chunks,
                    silent,
                    kept: true,
                    replay_own: keep.own,
                }
            }
            None => Self {
                chunks: chunks_of(prefix).collect(),
                silent: 0,
                kept: false,
                replay_own: false,
            },
        }
    }

    /// Steps that decode, as the stages count them: every step after the
    /// prompt's, and a kept chain's first step (the prompt's last position,
    /// sent as a decode step through the whole chain).
    fn decodes(&self, step: u32) -> bool {
        let step = step as usize;
        step >= self.chunks.len() || (self.kept && step + 1 == self.chunks.len())
    }

    /// Prefill step `step`'s tokens (none past the prompt's steps).
    fn input(&self, prefix: &[u32], step: u32) -> Vec<u32> {
        self.chunks
            .get(step as usize)
            .and_then(|chunk| prefix.get(chunk.clone()))
            .unwrap_or_default()
            .to_vec()
    }

    /// The prefill steps OPEN announces: the replay's when caches are kept.
    fn announced(&self) -> usize {
        if self.kept {
            self.silent
        } else {
            self.chunks.len()
        }
    }
}

/// Where the step loop stands.
struct Cursor {
    step: u32,
    /// Step `step`'s tokens, while they are still to be computed and sent.
    input: Vec<u32>,
    to_send: bool,
    /// Replies owed for steps sent. A deadline that passes while waiting
    /// leaves one owed: it is drained after STOP.
    owed: u32,
    /// When the latest step went down.
    trip: Instant,
}

/// One segment of a request: one chain driven from OPEN to its end.
struct Segment<'s, 'h> {
    coordinator: &'s Arc<CoordinatorRole>,
    run: &'s Arc<Run>,
    request: &'s GenerateRequest,
    deadline: Deadline,
    admitted: &'s mut Admitted<'h>,
    progress: &'s mut Progress,
    /// The prompt and every token so far: a segment after a loss replays
    /// them as a prefill, which rebuilds the new chain's caches.
    prefix: Vec<u32>,
    schedule: Schedule,
    cursor: Cursor,
    /// Tokens generated before this segment.
    first_token: usize,
    started: Instant,
    lanes: Folding,
    direct_waiter: Option<oneshot::Receiver<DirectStream>>,
    /// Speculative decoding: after each token sampled, up to `draft_tokens`
    /// drafted (by the draft model, else by prompt lookup) go down in the
    /// same step; greedy verification keeps those the model itself
    /// chooses, so the tokens are those of plain greedy decoding.
    drafting: bool,
    history: Vec<u32>,
    /// The draft riding on the decode step in flight.
    draft: Vec<u32>,
    own_decode_rows: u64,
    replayed_in: Option<Duration>,
    budget_stop: Option<String>,
    /// Sampled for an audit: the chain keeps a tape, then it is here.
    tape: Option<Tape>,
}

impl<'s, 'h> Segment<'s, 'h> {
    fn new(
        coordinator: &'s Arc<CoordinatorRole>,
        run: &'s Arc<Run>,
        request: &'s GenerateRequest,
        deadline: Deadline,
        admitted: &'s mut Admitted<'h>,
        progress: &'s mut Progress,
    ) -> Self {
        let first_token = progress.tokens.len();
        let prefix: Vec<u32> = admitted
            .prompt_ids
            .iter()
            .chain(&progress.tokens)
            .copied()
            .collect();
        let lanes = Folding::new(HopSession::new(admitted.scope.clone(), 0));
        let direct_waiter =
            if coordinator.settings.return_mode == ReturnMode::Direct && !run.alone() {
                let (sender, receiver) = oneshot::channel();
                let final_stage = run.keys[run.assigns.len() - 1];
                lock(&coordinator.directs).insert(admitted.request_id, (final_stage, sender));
                admitted.held.direct = true;
                Some(receiver)
            } else {
                None
            };
        let started = Instant::now();
        let schedule = Schedule::new(
            prefix.len(),
            admitted.keep.as_ref(),
            coordinator.settings.prefill_chunk_tokens,
        );
        let hidden_size = run.own.slice.config().hidden;
        match &admitted.keep {
            // The own cache was kept: so are its outputs, up to the
            // positions kept.
            Some(keep) if keep.own => {
                if let Some(outputs) = progress.own_outputs.as_mut() {
                    outputs.truncate(keep.positions * hidden_size);
                }
            }
            // A fresh own cache: its outputs are computed again (kept for
            // a replay onto another chain; alone, there is none to replay to).
            _ => progress.own_outputs = (!run.alone()).then(Vec::new),
        }
        let drafting = coordinator.settings.draft_tokens > 0
            && admitted.decision.is_none()
            && request.sampling.temperature <= 0.0;
        let history = prefix.clone();
        if drafting {
            progress.drafted = true;
            // The draft model takes the prompt (or the replay) while the
            // chain prefills it.
            progress.drafter.prefill(&history);
        }
        let input = schedule.input(&prefix, 0);
        let tape = audit::tape_if_sampled(coordinator, run, admitted);
        Self {
            coordinator,
            run,
            request,
            deadline,
            admitted,
            progress,
            prefix,
            schedule,
            cursor: Cursor {
                step: 0,
                input,
                to_send: true,
                owed: 0,
                trip: Instant::now(),
            },
            first_token,
            started,
            lanes,
            direct_waiter,
            drafting,
            history,
            draft: Vec::new(),
            own_decode_rows: 0,
            replayed_in: None,
            budget_stop: None,
            tape,
        }
    }

    fn hidden_size(&self) -> usize {
        self.run.own.slice.config().hidden
    }

    /// The next step's prefill chunk goes down next.
    fn advance(&mut self) {
        self.cursor.step += 1;
        self.cursor.input = self.schedule.input(&self.prefix, self.cursor.step);
        self.cursor.to_send = true;
    }

    /// Open the chain, run its steps, STOP it when it is healthy: how the
    /// steps ended, and what its streams still have to say (nothing, when
    /// this node runs every layer alone).
    async fn run_chain(
        &mut self,
        requester: &mut quinn::SendStream,
    ) -> anyhow::Result<(anyhow::Result<TerminalState>, Option<Tail>)> {
        if self.run.alone() {
            return Ok((self.steps_alone(requester).await, None));
        }
        let mut chain = self.open_chain().await?;
        let result = self.steps(&mut chain, requester).await;
        // STOP enters the forward lane only when the chain is healthy. After
        // a failure stage 1 may have stopped reading, and a frame it never
        // read folded here would read as tampering on a healthy hop: the
        // stream is just finished, and each stage records what it saw.
        if let Ok(state) = &result {
            let stop = Cbor::text_map([("terminal_state", Cbor::text(state.as_str()))]);
            let step = self.cursor.step;
            let body = msg::stage_body(kind::STOP, self.admitted.request_id, step, &stop.encode());
            chain.write(&mut self.lanes, &body, step).await?;
        }
        // Only a chain that completed is audited: after it ended otherwise
        // a reply may come after STOP, and is not on the tape.
        self.tape = chain
            .tape
            .take()
            .filter(|_| matches!(result, Ok(TerminalState::Completed)));
        let step_timeout = self.coordinator.shared.step_timeout;
        let tail = chain.into_tail(result.is_err(), self.cursor.owed > 0, step_timeout);
        Ok((result, Some(tail)))
    }

    /// Connect to stage 1 and send OPEN.
    async fn open_chain(&mut self) -> anyhow::Result<Chain> {
        let (send, recv) = self
            .coordinator
            .shared
            .net
            .open(&self.run.peers[0], ALPN_STAGE)
            .await?;
        let open = self.open_message();
        let body = msg::stage_body(kind::OPEN, self.admitted.request_id, 0, &open.encode());
        let mut chain = Chain::new(
            send,
            recv,
            self.coordinator.settings.return_mode,
            max_reply(self.hidden_size()),
            self.direct_waiter.take(),
        );
        chain.tape = self.tape.take();
        chain.write(&mut self.lanes, &body, 0).await?;
        Ok(chain)
    }

    fn open_message(&self) -> Cbor {
        let coordinator = self.coordinator;
        let run_id = self.run.assigns[0].run_id.clone();
        let keep = self.admitted.keep.as_ref();
        let capacity = self.admitted.prompt_ids.len() + self.admitted.max_new;
        let mut open = vec![
            ("run_id", Cbor::text(&run_id)),
            ("coordinator", Cbor::text(&coordinator.shared.tls.did)),
            ("stage_count", Cbor::Uint(self.run.assigns.len() as u64)),
            ("capacity", Cbor::Uint(capacity as u64)),
            (
                "return_mode",
                Cbor::text(coordinator.settings.return_mode.as_str()),
            ),
            (
                "prefill_steps",
                Cbor::Uint(self.schedule.announced() as u64),
            ),
            (
                "deadline_ms",
                Cbor::Uint(self.deadline.left().as_millis() as u64),
            ),
        ];
        if let Some(interrupted) = self.admitted.resumes {
            // Signed: a stage ends or hands over a request of this
            // coordinator only on its word, not on an upstream stage's.
            let claim = mesh_protocol::resume::ResumeClaim {
                run_id,
                request_id: self.admitted.request_id,
                resume_of: interrupted,
                keep: keep.map(|keep| (u64::from(keep.from), keep.positions as u64)),
            };
            let signature = mesh_protocol::resume::sign_claim(&claim, &coordinator.shared.key);
            open.extend([
                ("resume_of", Cbor::Uint(interrupted)),
                ("resume_sig", Cbor::bytes(signature.to_vec())),
            ]);
        }
        if let Some(keep) = keep {
            open.extend([
                ("kept_from", Cbor::Uint(keep.from.into())),
                ("keep_positions", Cbor::Uint(keep.positions as u64)),
            ]);
        }
        Cbor::text_map(open)
    }

    /// The step loop: send each step down, read its reply, sample; until
    /// the last token, the deadline, a cancel, a ceiling or a failure.
    async fn steps(
        &mut self,
        chain: &mut Chain,
        requester: &mut quinn::SendStream,
    ) -> anyhow::Result<TerminalState> {
        loop {
            // Between steps the chain is healthy: STOP tells every stage
            // how the request ended.
            if let Some(ended) = self.ended_between_steps() {
                return Ok(ended);
            }
            if self.cursor.to_send {
                let Some(frame) = self.own_frame().await? else {
                    return Ok(TerminalState::PolicyDenied);
                };
                if self.send_step(chain, &frame).await? {
                    continue;
                }
            }
            let watch = Watch {
                coordinator: self.coordinator,
                run: self.run,
                deadline: self.deadline,
                since: self.started,
            };
            let Some(reply) = chain.next_reply(&mut self.lanes, &watch).await? else {
                return Ok(TerminalState::TimedOut);
            };
            if let Some(tape) = chain.tape.as_mut() {
                tape.reply(&reply);
            }
            let Some(hidden) = self.take_reply(&reply)? else {
                continue;
            };
            if let Some(state) = self.sample(hidden, Some(&mut *chain), requester).await? {
                return Ok(state);
            }
        }
    }

    /// How the request ends before its next step, if it does: its
    /// deadline passed, or its requester went away.
    fn ended_between_steps(&self) -> Option<TerminalState> {
        if self.deadline.is_past() {
            Some(TerminalState::TimedOut)
        } else if self.progress.requester_gone.load(Ordering::Relaxed) {
            Some(TerminalState::ClientCancelled)
        } else {
            None
        }
    }

    /// The step loop of a node that runs every layer: each step through the
    /// own slice, then the head, with no chain between.
    async fn steps_alone(
        &mut self,
        requester: &mut quinn::SendStream,
    ) -> anyhow::Result<TerminalState> {
        loop {
            if let Some(ended) = self.ended_between_steps() {
                return Ok(ended);
            }
            let Some(hidden) = self.own_output().await? else {
                return Ok(TerminalState::PolicyDenied);
            };
            // A prefill chunk's last position is sampled only for the
            // prompt's last chunk.
            if (self.cursor.step as usize) + 1 < self.schedule.chunks.len() {
                self.advance();
                continue;
            }
            // A prefill step samples its last position; a decode step every
            // row (the token sampled and its draft), as a chain returns them.
            let rows = if self.schedule.decodes(self.cursor.step) {
                hidden.rows
            } else {
                1
            };
            let tail = hidden.rows.saturating_sub(rows) * hidden.cols;
            let hidden = Activations {
                values: hidden.values.get(tail..).unwrap_or_default().to_vec(),
                rows,
                cols: hidden.cols,
            };
            // The draft computed with this step was proposed, as a chain's
            // is once it goes down.
            self.progress.spec_proposed += self.draft.len() as u64;
            if let Some(state) = self.sample(hidden, None, requester).await? {
                return Ok(state);
            }
        }
    }

    /// The frame of the own slice's output for the step: computed, or for
    /// the replay of a kept own cache, the outputs it sent before. None when
    /// the grant's energy ceiling was reached.
    async fn own_frame(&mut self) -> anyhow::Result<Option<Vec<u8>>> {
        let step = self.cursor.step as usize;
        let hidden_size = self.hidden_size();
        let wire = self.coordinator.settings.wire;
        if self.schedule.replay_own && step < self.schedule.silent {
            let chunk = self.coordinator.settings.prefill_chunk_tokens.max(1);
            let kept = self.admitted.keep.as_ref().map_or(0, |keep| keep.positions);
            let rows = (step * chunk)..kept.min((step + 1) * chunk);
            let outputs = self
                .progress
                .own_outputs
                .as_ref()
                .and_then(|out| out.get(rows.start * hidden_size..rows.end * hidden_size))
                .context("the own slice's kept outputs")?;
            return Ok(Some(encode_frame(outputs, rows.len(), hidden_size, wire)?));
        }
        let Some(hidden) = self.own_output().await? else {
            return Ok(None);
        };
        Ok(Some(encode_frame(
            &hidden.values,
            hidden.rows,
            hidden.cols,
            wire,
        )?))
    }

    /// The own slice's output for the step's input. None when the grant's
    /// energy ceiling was reached.
    async fn own_output(&mut self) -> anyhow::Result<Option<Activations>> {
        let step = self.cursor.step as usize;
        let compute_start = Instant::now();
        let held = &mut self.admitted.held;
        let lease = held.cache.take().context("the request's cache")?;
        // The engine runs a prompt's chunk's rows together; a kept chain's
        // first step is one row, which gets the same bits either way.
        let decode = step >= self.schedule.chunks.len();
        let counted_as_decode = self.schedule.decodes(self.cursor.step);
        if counted_as_decode {
            self.own_decode_rows += self.cursor.input.len() as u64;
        }
        let bill = held.ticket.as_ref().and_then(|t| t.bill());
        let input = batch::StepInput::Tokens(std::mem::take(&mut self.cursor.input));
        let (output, lease, engine) = self
            .run
            .own
            .batcher
            .step(input, lease, decode, bill)
            .await?;
        held.cache = Some(lease);
        self.progress.own_compute += compute_start.elapsed();
        if counted_as_decode {
            self.progress.own_decode_engine += engine;
        }
        let tokens = self.progress.tokens.len();
        if let Some(stop) = ceiling_reached(self.coordinator, held.ticket.as_deref_mut(), tokens) {
            self.budget_stop = Some(stop);
            return Ok(None);
        }
        let SliceOutput::Hidden(hidden) = output else {
            bail!("the coordinator's slice returned logits")
        };
        // Kept while they fit, for a replay after a loss.
        let outputs = &mut self.progress.own_outputs;
        if outputs
            .as_ref()
            .is_some_and(|out| (out.len() + hidden.values.len()) * 4 > MAX_KEPT_OUTPUT_BYTES)
        {
            *outputs = None;
        }
        if let Some(out) = outputs.as_mut() {
            out.extend_from_slice(&hidden.values);
        }
        Ok(Some(hidden))
    }

    /// Send the step's frame down to stage 1. True when the next step goes
    /// down at once: after a replay step (no reply comes back for it) and
    /// between a pipelined prompt's chunks.
    async fn send_step(&mut self, chain: &mut Chain, frame: &[u8]) -> anyhow::Result<bool> {
        self.cursor.trip = Instant::now();
        let step = self.cursor.step;
        let body = msg::stage_body(kind::ACTIVATIONS, self.admitted.request_id, step, frame);
        chain.send_down(&mut self.lanes, &body, step).await?;
        // A draft is proposed once the chain has it, whether or not its
        // reply comes back in this segment.
        self.progress.spec_proposed += self.draft.len() as u64;
        if (step as usize) < self.schedule.silent {
            self.advance();
            return Ok(true);
        }
        self.cursor.owed += 1;
        if chain.pipelined() && (step as usize) + 1 < self.schedule.chunks.len() {
            self.advance();
            return Ok(true);
        }
        self.cursor.to_send = false;
        Ok(false)
    }

    /// Check a reply and count its round trip; the final hidden state to
    /// sample from, or None when nothing is sampled at this step (a
    /// pipelined prompt's earlier chunk, a prefill chunk another follows).
    fn take_reply(&mut self, reply: &[u8]) -> anyhow::Result<Option<Activations>> {
        let request_id = self.admitted.request_id;
        // Replies come in the order their steps went down.
        let answered = self.cursor.step + 1 - self.cursor.owed;
        self.cursor.owed -= 1;
        // A step's round trip, from its send to its reply; the earlier
        // chunks of a pipelined prompt overlap the last one's and are not
        // counted apart.
        if self.cursor.owed == 0 {
            let round_trip = self.cursor.trip.elapsed();
            self.progress.round_trips += round_trip;
            if self.schedule.decodes(answered) {
                self.progress.decode_round_trips += round_trip;
            }
            self.coordinator
                .shared
                .counters
                .round_trips
                .record(round_trip);
        }
        let (reply_kind, id, reply_step, payload) = msg::parse_stage(reply)?;
        if id != request_id {
            bail!("a reply for request {id} on request {request_id}");
        }
        if reply_kind == kind::FAILED {
            let reason = String::from_utf8_lossy(payload);
            if reason.starts_with(POLICY_DENIED) {
                // That stage has ended its part: no STOP follows into a
                // chain it no longer reads.
                self.budget_stop = Some(format!("a stage stopped the serve: {reason}"));
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
        let (hidden, dtype) =
            decode_frame(payload, self.hidden_size()).context("the final stage's hidden state")?;
        // A row per position of a decode step (the token sampled and its
        // draft); one row, the last position, for a prefill step.
        let rows = 1 + self.draft.len();
        if hidden.rows != rows || dtype != WireDType::F32 {
            bail!(
                "the final stage returned {} rows of {dtype:?}, not {rows} of F32",
                hidden.rows
            );
        }
        if hidden.values.iter().any(|v| !v.is_finite()) {
            bail!("the final stage returned a hidden state that is not finite");
        }
        // A pipelined prompt's earlier chunks: only the last is sampled.
        if self.cursor.owed > 0 {
            return Ok(None);
        }
        // A prefill chunk's last position is not sampled: the next chunk
        // follows.
        if (self.cursor.step as usize) + 1 < self.schedule.chunks.len() {
            self.advance();
            return Ok(None);
        }
        Ok(Some(hidden))
    }

    /// The final hidden state through the own head: a decision scored, or
    /// tokens sampled and shown (a draft's accepted ones too); then the
    /// caches rewound past a rejected draft and the next step's input
    /// drafted. Some state when the request ended.
    async fn sample(
        &mut self,
        hidden: Activations,
        chain: Option<&mut Chain>,
        requester: &mut quinn::SendStream,
    ) -> anyhow::Result<Option<TerminalState>> {
        let step = self.cursor.step;
        let head_start = Instant::now();
        let held = &mut self.admitted.held;
        let bill = held.ticket.as_ref().and_then(|t| t.bill());
        let (logits, engine) = self.run.own.batcher.logits(hidden, bill).await?;
        self.progress.own_compute += head_start.elapsed();
        if self.schedule.decodes(step) {
            self.progress.own_decode_engine += engine;
        }
        let tokens = self.progress.tokens.len();
        if let Some(stop) = ceiling_reached(self.coordinator, held.ticket.as_deref_mut(), tokens) {
            self.budget_stop = Some(stop);
            return Ok(Some(TerminalState::PolicyDenied));
        }
        if step as usize + 1 == self.schedule.chunks.len() {
            // The first segment's prefill is the prompt's; a later one's is
            // the replay that rebuilt a new chain.
            if self.progress.prefill_time.is_none() {
                self.progress.prefill_time = Some(self.started.elapsed());
            } else {
                self.replayed_in.get_or_insert(self.started.elapsed());
            }
        }
        if let Some(decision) = &self.admitted.decision {
            // A typed decision is answered here: every option scored at
            // the prompt's last position, nothing sampled.
            self.progress.decided = Some(decision.score(logits.last().context("no logits")?)?);
            self.progress.finish_reason = "stop";
            return Ok(Some(TerminalState::Completed));
        }
        if self.schedule.decodes(step) {
            self.progress.decode_steps += 1;
        }
        let proposed = std::mem::take(&mut self.draft);
        let (accepted, next, ended) = self.show(&logits, &proposed, requester).await?;
        self.progress.spec_accepted += accepted as u64;
        if ended == Some(TerminalState::ClientCancelled) {
            return Ok(ended);
        }
        self.cursor.step += 1;
        if ended.is_some() {
            return Ok(ended);
        }
        let rejected = proposed.len() - accepted;
        if rejected > 0 {
            self.rewind(chain, rejected).await?;
        }
        if self.drafting {
            self.draft = self.propose().await;
        }
        self.cursor.input = std::iter::once(next)
            .chain(self.draft.iter().copied())
            .collect();
        self.cursor.to_send = true;
        Ok(None)
    }

    /// Sample the rows: row i once every drafted token before it was the
    /// model's own choice; the first that is not ends the step, and the
    /// token chosen in its place goes on. Each token is shown to the
    /// requester as it comes. The drafted tokens accepted, the last token,
    /// and how the request ended, when it did in this step.
    async fn show(
        &mut self,
        logits: &[Vec<f32>],
        proposed: &[u32],
        requester: &mut quinn::SendStream,
    ) -> anyhow::Result<(usize, u32, Option<TerminalState>)> {
        let codec = self.coordinator.shared.model.text()?;
        let max_new = self.admitted.max_new;
        let progress = &mut *self.progress;
        let mut accepted = 0;
        let mut next = 0;
        for (i, row) in logits.iter().enumerate() {
            next = progress.sampler.sample(row).context("no logits")?;
            let agreed = proposed.get(i) == Some(&next);
            accepted += usize::from(agreed);
            progress.tokens.push(next);
            let now = Instant::now();
            progress.first_token_at.get_or_insert(now);
            progress.last_token_at = Some(now);
            self.history.push(next);
            let eos = codec.is_eos(next);
            let last = eos || progress.tokens.len() >= max_new;
            let decoded = if eos {
                progress.text.text()
            } else {
                progress.text.push(codec, next)?
            };
            let (end, stopped) = shown_end(decoded, &self.request.stop, last);
            let shown = decoded.get(..end).unwrap_or("");
            let piece = shown
                .strip_prefix(progress.printed.as_str())
                .unwrap_or("")
                .to_string();
            progress.printed = shown.to_string();
            // Every token but an end-of-sequence one is announced; an
            // end-of-sequence one only when it releases held-back text.
            if !eos || !piece.is_empty() {
                let token = ControlReply::Token {
                    id: next.into(),
                    text: piece,
                };
                if msg::write_cbor(requester, &token.to_cbor()).await.is_err() {
                    return Ok((accepted, next, Some(TerminalState::ClientCancelled)));
                }
            }
            if eos || stopped {
                progress.finish_reason = "stop";
            }
            if last || stopped {
                return Ok((accepted, next, Some(TerminalState::Completed)));
            }
            if !agreed {
                break;
            }
        }
        Ok((accepted, next, None))
    }

    /// The rejected positions leave every cache before the next step: the
    /// own one here, the stages' (when there is a chain) by REWIND.
    async fn rewind(&mut self, chain: Option<&mut Chain>, rejected: usize) -> anyhow::Result<()> {
        let lease = self
            .admitted
            .held
            .cache
            .as_mut()
            .context("the request's cache")?;
        let positions = lease.positions() - rejected;
        lease.cache().truncate(positions)?;
        let hidden_size = self.hidden_size();
        if let Some(out) = self.progress.own_outputs.as_mut() {
            out.truncate(positions * hidden_size);
        }
        let Some(chain) = chain else {
            return Ok(());
        };
        let rewind = Rewind {
            positions: positions as u64,
        };
        let step = self.cursor.step;
        let body = msg::stage_body(
            kind::REWIND,
            self.admitted.request_id,
            step,
            &rewind.encode(),
        );
        chain.send_down(&mut self.lanes, &body, step).await
    }

    /// The next step's draft. All of a draft accepted gives one token more
    /// than it holds: never past max_tokens.
    async fn propose(&mut self) -> Vec<u32> {
        let room = self
            .admitted
            .max_new
            .saturating_sub(self.progress.tokens.len() + 1)
            .min(self.coordinator.settings.draft_tokens);
        // The draft model's passes are this request's alone.
        let drafting = self
            .admitted
            .held
            .ticket
            .as_ref()
            .and_then(|t| t.bill())
            .map(|bill| bill.computing(1));
        let draft = self.progress.drafter.propose(&self.history, room).await;
        drop(drafting);
        draft
    }

    /// What the segment gave: its lanes (drained now, or in the background
    /// for a chain that will be resumed), how it ended, what it lost.
    async fn conclude(
        self,
        outcome: anyhow::Result<(anyhow::Result<TerminalState>, Option<Tail>)>,
    ) -> Driven {
        let Segment {
            coordinator,
            run,
            deadline,
            admitted,
            progress,
            prefix,
            first_token,
            started,
            mut lanes,
            own_decode_rows,
            replayed_in,
            budget_stop,
            tape,
            ..
        } = self;
        // The stages that left the mesh during this segment: lost, for a
        // chain planned over the mesh.
        let lost: Vec<[u8; 32]> = run.keys[1..]
            .iter()
            .filter(|key| {
                run.projected_us.is_some() && coordinator.shared.left_mesh_since(key, started)
            })
            .copied()
            .collect();
        let (outcome, tail) = match outcome {
            Ok((result, tail)) => (result, tail),
            Err(error) => (Err(error), None),
        };
        // A stage that left the mesh has nothing more to say: its streams
        // are not drained (they would end only at the QUIC idle timeout).
        let gone = Gone {
            stage1: run.keys.get(1).is_some_and(|key| lost.contains(key)),
            final_stage: lost.contains(&run.keys[run.assigns.len() - 1]),
        };
        let chain_failed = outcome.is_err() && budget_stop.is_none();
        let tokens = progress.tokens.len();
        // A failed chain that will be resumed is drained in the background:
        // the survivors' last frames complete this segment's lanes by the
        // time it is sealed, and the request goes on at once.
        let resumable = chain_failed
            && !run.alone()
            && run.projected_us.is_some()
            && !deadline.is_past()
            && tokens < admitted.max_new;
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
        let (terminal, failure) = terminal_of(outcome, budget_stop, deadline, tokens);
        run.own.touch();
        // A chain that failed (not one a requester's deadline or cancel
        // ended) may have lost a stage's slice: assign again before the
        // next request.
        if chain_failed {
            run.stale.store(true, Ordering::Relaxed);
        }
        let keep = admitted.keep.as_ref();
        Driven {
            terminal,
            failure,
            lanes,
            fold_time,
            started,
            resumable,
            lost,
            first_token,
            tokens: tokens - first_token,
            prefilled: keep.map_or(prefix.len(), |keep| keep.positions),
            replayed_in,
            // Claimed only once the chain answered: a kept stage that could
            // not take its cache refuses the request.
            kept: keep
                .filter(|_| tokens > first_token)
                .map_or(Vec::new(), |keep| keep.nodes.clone()),
            own_decode_rows,
            tape,
        }
    }
}

/// How a segment ended, and why in words, from how its steps ended.
fn terminal_of(
    outcome: anyhow::Result<TerminalState>,
    budget_stop: Option<String>,
    deadline: Deadline,
    tokens: usize,
) -> (TerminalState, Option<String>) {
    match outcome {
        Ok(TerminalState::TimedOut) => (
            TerminalState::TimedOut,
            Some(deadline.passed("the next token")),
        ),
        Ok(TerminalState::ClientCancelled) => (
            TerminalState::ClientCancelled,
            Some(format!("the requester went away after {tokens} tokens")),
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
    }
}

/// The coordinator's steward meters its compute so far; past the grant's
/// energy ceiling, why the serve stops there.
fn ceiling_reached(
    coordinator: &CoordinatorRole,
    ticket: Option<&mut ServeTicket>,
    tokens: usize,
) -> Option<String> {
    let ticket = ticket?;
    let metered = lock(&coordinator.shared.steward).mark_engine(ticket);
    let limit = ticket.limit_uj().filter(|limit| metered >= *limit)?;
    Some(format!(
        "the energy ceiling of {limit} µJ was reached at the coordinator ({metered} µJ metered) after {tokens} tokens"
    ))
}
