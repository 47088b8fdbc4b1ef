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
use mesh_stage::cache::CacheLease;
use mesh_stage::frame::{Activations, WireDType, decode_frame, encode_frame};
use tokio::sync::Notify;

use crate::runtime::clock::lock;
use crate::runtime::net::ALPN_STAGE;
use crate::runtime::net::msg::{self, kind};
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::batch;
use crate::runtime::serve::frames::{
    Folding, Frames, drain, failed_reason, max_reply, next_frame, refusal_behind, send_frame,
    spawn_frames, write_forward,
};
use crate::runtime::serve::shared::{
    Deadline, HeldTicket, POLICY_DENIED, StageStats, step_timed_out,
};
use crate::runtime::serve::slot::Slot;
use crate::runtime::serve::stage::admit::StageAdmitted;
use crate::runtime::serve::stage::kept::KeepHandle;
use crate::runtime::serve::stage::role::StageRole;

/// What running a request on a stage left to seal.
pub(crate) struct StageRan {
    pub(crate) slot: Arc<Slot>,
    pub(crate) request_id: u64,
    pub(crate) run_id: String,
    pub(crate) ticket: HeldTicket,
    pub(crate) served: ServeRequest,
    pub(crate) lanes: Folding,
    pub(crate) tokens: Tokens,
    /// Of `tokens.prefill_received`, the positions its cache came with.
    pub(crate) kept_positions: u64,
    pub(crate) terminal: TerminalState,
    /// The wire format of the frames it computed on (f32 when none came).
    pub(crate) wire: WireDType,
}

/// Run: open the next hop, then every step (forward it, or return the
/// final hidden state), to STOP or a failure; on a failure, say why
/// upstream once and read what the neighbours still send, so every lane is
/// whole.
pub(crate) async fn run_stage(stage: &Arc<StageRole>, admitted: StageAdmitted) -> StageRan {
    let mut run = StageRun::new(stage, admitted);
    lock(&stage.shared.steward).begin_engine(&mut run.ticket);
    let outcome = run.run().await;
    run.finish(outcome).await
}

/// Which steps a request sends this stage, as OPEN announced them.
struct StepPlan {
    /// Steps before the first decode step.
    prefill_steps: u64,
    /// Prefill steps it runs but sends no further: the next stage kept its
    /// cache.
    silent_steps: u64,
    /// The number its first ACTIVATIONS carries.
    first_step: u64,
}

/// The stage's neighbours on one request.
struct Links {
    /// Upstream's frames, read whole by a task, and the stream back to it.
    upstream: Frames,
    up_send: quinn::SendStream,
    /// Whether upstream stopped sending: then nothing is reported to it.
    upstream_gone: bool,
    /// Downstream: its send stream, and its reply stream read in step
    /// (relayed) or watched whole-frame by a task (direct, `down_watch`).
    down: Option<(quinn::SendStream, Option<quinn::RecvStream>)>,
    down_watch: Option<Frames>,
    /// The final stage's direct return to the coordinator.
    direct: Option<quinn::SendStream>,
}

/// One request running on this stage.
struct StageRun<'a> {
    stage: &'a Arc<StageRole>,
    slot: Arc<Slot>,
    request_id: u64,
    run_id: String,
    served: ServeRequest,
    /// OPEN, as it came: forwarded to the next stage.
    first: Vec<u8>,
    plan: StepPlan,
    deadline: Deadline,
    return_mode: ReturnMode,
    ticket: HeldTicket,
    cache: Option<CacheLease>,
    keep: Option<KeepHandle>,
    superseded: Arc<Notify>,
    kept_positions: u64,
    lanes: Folding,
    links: Links,
    terminal: TerminalState,
    tokens: Tokens,
    stats: StageStats,
    /// Positions a REWIND may still drop: the last decode step's draft.
    rewindable: usize,
    /// The wire format of the last frame it computed on.
    wire: WireDType,
}

impl<'a> StageRun<'a> {
    fn new(stage: &'a Arc<StageRole>, admitted: StageAdmitted) -> Self {
        let StageAdmitted {
            slot,
            request_id,
            first,
            run_id,
            prefill_steps,
            deadline,
            return_mode,
            ticket,
            served,
            cache,
            keep,
            kept_positions,
            silent_steps,
            first_step,
            up_send,
            up_recv,
        } = admitted;
        let assign = &slot.assign;
        let scope = RequestScope {
            split: SplitKey {
                coordinator_node_id: did_key(&assign.coordinator),
                run_id: run_id.clone(),
                request_id,
            },
            stage_count: assign.stage_count,
            return_mode,
        };
        let mut lanes = Folding::new(HopSession::new(scope, assign.stage_index));
        lanes.fold(Wire::FromUpstream, &first);
        Self {
            stage,
            request_id,
            run_id,
            served,
            first,
            plan: StepPlan {
                prefill_steps,
                silent_steps,
                first_step,
            },
            deadline,
            return_mode,
            ticket,
            cache,
            superseded: keep.superseded.clone(),
            keep: Some(keep),
            kept_positions,
            lanes,
            links: Links {
                upstream: spawn_frames(up_recv, msg::MAX_STAGE_MESSAGE),
                up_send,
                upstream_gone: false,
                down: None,
                down_watch: None,
                direct: None,
            },
            terminal: TerminalState::TransportError,
            wire: WireDType::F32,
            tokens: Tokens {
                prefill_received: kept_positions,
                decode: 0,
            },
            stats: StageStats::default(),
            rewindable: 0,
            slot,
        }
    }

    /// This stage's index in the chain.
    fn k(&self) -> u32 {
        self.slot.assign.stage_index
    }

    fn reply_limit(&self) -> usize {
        max_reply(self.slot.slice.config().hidden)
    }

    /// Open the next hop, then run every step to STOP or a failure.
    async fn run(&mut self) -> anyhow::Result<()> {
        self.open_next().await?;
        loop {
            let frame = self.next_upstream().await?;
            self.lanes.fold(Wire::FromUpstream, &frame);
            let (message_kind, id, step, payload) = msg::parse_stage(&frame)?;
            let request_id = self.request_id;
            if id != request_id {
                bail!("a frame of request {id} on the stream of request {request_id}");
            }
            // Steps come in order, one after another: an ACTIVATIONS or a
            // REWIND out of turn is not this request's next step.
            let next = self.plan.first_step + u64::from(self.stats.steps);
            match message_kind {
                kind::ACTIVATIONS => {
                    if u64::from(step) != next {
                        bail!("step {step} where step {next} was next");
                    }
                    self.activations(step, payload).await?
                }
                kind::REWIND => self.rewind(step, next, payload, &frame).await?,
                kind::STOP => {
                    self.stop(step, payload, &frame).await?;
                    return Ok(());
                }
                other => bail!("unexpected stage message kind {other}"),
            }
        }
    }

    /// The next hop: the next stage (OPEN forwarded), or for the final
    /// stage in direct mode, the direct return to the coordinator.
    async fn open_next(&mut self) -> anyhow::Result<()> {
        let k = self.k();
        let net = &self.stage.shared.net;
        let assign = &self.slot.assign;
        if let Some(next) = &assign.downstream {
            let (mut send, recv) = net.open(next, ALPN_STAGE).await?;
            self.lanes.session.open_downstream();
            write_forward(&mut send, &self.first[4..], &mut self.lanes, k, 0).await?;
            if self.return_mode == ReturnMode::Direct {
                self.links.down_watch = Some(spawn_frames(recv, self.reply_limit()));
                self.links.down = Some((send, None));
            } else {
                self.links.down = Some((send, Some(recv)));
            }
        } else if self.return_mode == ReturnMode::Direct {
            let coordinator = PeerAddr {
                key: assign.coordinator,
                addr: assign.coordinator_addr,
            };
            let (mut send, _recv) = net.open(&coordinator, ALPN_STAGE).await?;
            self.lanes.session.open_direct();
            let opening = msg::frame(&msg::stage_body(kind::DIRECT_OPEN, self.request_id, 0, &[]))?;
            send_frame(
                &mut send,
                &opening,
                &mut self.lanes,
                Wire::DirectSent,
                "on the direct return",
            )
            .await?;
            self.links.direct = Some(send);
        }
        Ok(())
    }

    /// The next frame from upstream, within the step timeout. In direct
    /// mode replies skip this stage, so its downstream writes to it only
    /// to say why it stopped: watch for that (or for the stream closing)
    /// while waiting.
    async fn next_upstream(&mut self) -> anyhow::Result<Vec<u8>> {
        let k = self.k();
        let step_timeout = self.stage.shared.step_timeout;
        let links = &mut self.links;
        let read = tokio::select! {
            biased;
            () = self.superseded.notified() => {
                // Its coordinator resumed it on a new chain that keeps this
                // cache: the old chain's upstream is gone, even if its
                // stream still looks open.
                links.upstream_gone = true;
                bail!("superseded: its coordinator resumed it on a new chain");
            }
            read = tokio::time::timeout(self.deadline.bound(step_timeout), links.upstream.recv()) => read,
            said = next_frame(&mut links.down_watch) => {
                let frame = said
                    .with_context(|| format!("stage {} closed the request", k + 1))??;
                self.lanes.fold(Wire::FromDownstream, &frame);
                let (_, _, _, reason) = msg::parse_stage(&frame)?;
                bail!("{}", String::from_utf8_lossy(reason));
            }
        };
        let (terminal, error) = match read {
            Ok(Some(Ok(frame))) => return Ok(frame),
            Ok(None) => (
                TerminalState::TransportError,
                anyhow::anyhow!("upstream closed the request without STOP"),
            ),
            Ok(Some(Err(error))) => (TerminalState::TransportError, error),
            Err(_) if self.deadline.is_past() => (
                TerminalState::TimedOut,
                anyhow::anyhow!("{}", self.deadline.passed("upstream")),
            ),
            Err(_) => (
                TerminalState::TimedOut,
                step_timed_out("upstream", step_timeout),
            ),
        };
        self.links.upstream_gone = true;
        self.terminal = terminal;
        Err(error)
    }

    /// One step through the slice: counted, computed, metered; its output
    /// sent on, or returned by the final stage.
    async fn activations(&mut self, step: u32, payload: &[u8]) -> anyhow::Result<()> {
        let k = self.k();
        let (activations, wire) = decode_frame(payload, self.slot.slice.config().hidden)?;
        self.wire = wire;
        let steps = u64::from(self.stats.steps);
        // A replay step whose output the next stage, which kept its cache,
        // does not need.
        let silent = steps < self.plan.silent_steps;
        // A decode step carries the token sampled and the draft after it:
        // each row is answered, and each gets the bits it gets decoded
        // alone.
        let decode = steps >= self.plan.prefill_steps;
        let rows = activations.rows;
        if decode && rows > MAX_DECODE_ROWS {
            bail!(
                "a decode step of {rows} positions: at most {MAX_DECODE_ROWS} (a token and its draft)"
            );
        }
        if decode {
            self.tokens.decode += rows as u64;
            self.rewindable = rows.saturating_sub(1);
        } else {
            self.tokens.prefill_received += rows as u64;
            self.rewindable = 0;
        }
        self.stats.steps += 1;
        #[cfg(feature = "fault-injection")]
        crate::runtime::serve::frames::stall_if_told().await;
        let start = Instant::now();
        let lease = self.cache.take().context("the request's cache")?;
        let input = batch::StepInput::Hidden(activations);
        let bill = self.ticket.bill();
        let (output, lease, engine) = self.slot.batcher.step(input, lease, decode, bill).await?;
        #[cfg(feature = "fault-injection")]
        let output = crate::runtime::serve::frames::compute_wrongly(output);
        self.cache = Some(lease);
        self.stats.compute += start.elapsed();
        if decode {
            self.stats.decode_engine += engine;
        }
        let metered = lock(&self.stage.shared.steward).mark_engine(&mut self.ticket);
        if let Some(limit) = self.ticket.limit_uj().filter(|limit| metered >= *limit) {
            // This steward's part of the serve ends here; the failure path
            // tells upstream why, once.
            self.terminal = TerminalState::PolicyDenied;
            bail!(
                "{POLICY_DENIED}: the energy ceiling of {limit} µJ was reached at stage {k} ({metered} µJ metered)"
            );
        }
        match output {
            SliceOutput::Hidden(_) if silent => Ok(()),
            SliceOutput::Hidden(a) if self.links.down.is_some() => {
                let frame = encode_frame(&a.values, a.rows, a.cols, wire)?;
                self.forward(step, &frame).await
            }
            SliceOutput::Logits(_) => bail!("a chain's slice returned logits"),
            SliceOutput::Hidden(a) => self.return_final(step, &a, decode).await,
        }
    }

    /// A middle stage's output on to the next stage; relayed, its reply
    /// read and passed up.
    async fn forward(&mut self, step: u32, frame: &[u8]) -> anyhow::Result<()> {
        let k = self.k();
        let reply_limit = self.reply_limit();
        let (send, down_recv) = self
            .links
            .down
            .as_mut()
            .context("a middle stage without a downstream")?;
        let body = msg::stage_body(kind::ACTIVATIONS, self.request_id, step, frame);
        if let Err(error) = write_forward(send, &body, &mut self.lanes, k, step).await {
            let whom = format!("stage {}", k + 1);
            return Err(match down_recv.as_mut() {
                Some(recv) => refusal_behind(recv, error, &whom, Some(&mut self.lanes)).await,
                None => error,
            });
        }
        if self.return_mode != ReturnMode::Relayed {
            return Ok(());
        }
        let recv = down_recv
            .as_mut()
            .context("a relayed downstream's replies")?;
        let wait = self.deadline.bound(self.stage.shared.step_timeout);
        let reply = match msg::read_checked(recv, reply_limit, wait).await {
            Err(_) if self.deadline.is_past() => {
                self.terminal = TerminalState::TimedOut;
                bail!("{}", self.deadline.passed(&format!("stage {}", k + 1)));
            }
            read => read?,
        }
        .context("downstream closed before replying")?;
        self.lanes.fold(Wire::FromDownstream, &reply);
        send_frame(
            &mut self.links.up_send,
            &reply,
            &mut self.lanes,
            Wire::ToUpstream,
            "upstream",
        )
        .await
    }

    /// The final stage's output: in f32 whatever the wire, for the
    /// coordinator's output head, every row of a decode step (each
    /// position is sampled or checks a drafted token), else the step's
    /// last; up the chain, or on the direct return.
    async fn return_final(
        &mut self,
        step: u32,
        a: &Activations,
        decode: bool,
    ) -> anyhow::Result<()> {
        let answered = if decode { a.rows } else { 1 };
        let rows = a
            .values
            .get(a.rows.saturating_sub(answered) * a.cols..)
            .filter(|rows| !rows.is_empty())
            .context("the final slice returned no hidden state")?;
        let payload = encode_frame(rows, answered, a.cols, WireDType::F32)?;
        let body = msg::stage_body(kind::HIDDEN, self.request_id, step, &payload);
        let bytes = msg::frame(&body)?;
        match &mut self.links.direct {
            Some(send) => {
                send_frame(
                    send,
                    &bytes,
                    &mut self.lanes,
                    Wire::DirectSent,
                    "on the direct return",
                )
                .await
            }
            None => {
                send_frame(
                    &mut self.links.up_send,
                    &bytes,
                    &mut self.lanes,
                    Wire::ToUpstream,
                    "upstream",
                )
                .await
            }
        }
    }

    /// Only the last decode step's draft can be dropped, and only once:
    /// the positions before it are the request's.
    async fn rewind(
        &mut self,
        step: u32,
        next: u64,
        payload: &[u8],
        frame: &[u8],
    ) -> anyhow::Result<()> {
        let Rewind { positions } = Rewind::parse(payload)?;
        if u64::from(step) != next {
            bail!("a rewind carrying step {step}, not the next step {next}");
        }
        let lease = self.cache.as_mut().context("the request's cache")?;
        let held = lease.positions();
        let keep = usize::try_from(positions).unwrap_or(usize::MAX);
        if keep >= held {
            bail!("a rewind to {keep} positions of {held} drops nothing");
        }
        let rewindable = self.rewindable;
        if held - keep > rewindable {
            bail!(
                "a rewind to {keep} positions of {held} drops more than the last step's draft ({rewindable} positions)"
            );
        }
        lease.cache().truncate(keep)?;
        self.rewindable = 0;
        self.pass_down(frame, step).await
    }

    /// How the request ended, from its coordinator; passed down the chain.
    async fn stop(&mut self, step: u32, payload: &[u8], frame: &[u8]) -> anyhow::Result<()> {
        let state = Cbor::decode(payload).ok().and_then(|c| {
            c.get("terminal_state")
                .and_then(Cbor::as_text)
                .and_then(TerminalState::parse)
        });
        self.terminal = state.unwrap_or(TerminalState::Completed);
        // Upstream reads nothing more on this request.
        self.links.upstream_gone = true;
        self.pass_down(frame, step).await
    }

    /// A message from upstream on to the next stage, as it came.
    async fn pass_down(&mut self, frame: &[u8], step: u32) -> anyhow::Result<()> {
        let k = self.k();
        if let Some((send, _)) = self.links.down.as_mut() {
            write_forward(send, &frame[4..], &mut self.lanes, k, step).await?;
        }
        Ok(())
    }

    /// The request ended: its cache let go (parked for a resume after a
    /// failure), a failure said upstream once and the neighbours' last
    /// frames read, the streams finished, the stats recorded.
    async fn finish(mut self, outcome: anyhow::Result<()>) -> StageRan {
        // A failed request's cache waits a while for a resume to keep it:
        // let go of it now, before the neighbours' last frames are read.
        let resumable = matches!(
            self.terminal,
            TerminalState::TransportError | TerminalState::TimedOut
        );
        if let Some(keep) = self.keep.take() {
            keep.release(self.cache.take(), outcome.is_err() && resumable);
        }
        if let Err(error) = &outcome {
            self.report_failure(error).await;
        }
        self.slot.touch();
        if let Some((mut send, _)) = self.links.down.take() {
            let _ = send.finish();
        }
        if let Some(mut send) = self.links.direct.take() {
            let _ = send.finish();
        }
        let _ = self.links.up_send.finish();
        self.stats.fold = self.lanes.spent;
        self.stage.record_stats(self.request_id, self.stats);
        StageRan {
            slot: self.slot,
            request_id: self.request_id,
            run_id: self.run_id,
            ticket: self.ticket,
            served: self.served,
            lanes: self.lanes,
            tokens: self.tokens,
            kept_positions: self.kept_positions,
            terminal: self.terminal,
            wire: self.wire,
        }
    }

    /// Upstream is still waiting for this step's reply: say why there is
    /// none (a relayed reply is read, and folded, by the node before); then
    /// read what the neighbours sent before they learned of it.
    async fn report_failure(&mut self, error: &anyhow::Error) {
        let k = self.k();
        tracing::warn!(stage = k, request_id = self.request_id, "{error:#}");
        if !self.links.upstream_gone {
            // A steward's stop keeps its `policy_denied` prefix on the way up.
            let reason = format!("{error:#}");
            let reason = if reason.starts_with(POLICY_DENIED) {
                reason
            } else {
                format!("stage {k}: {reason}")
            };
            let steps = self.stats.steps;
            let body =
                msg::stage_body(kind::FAILED, self.request_id, steps, failed_reason(&reason));
            if let Ok(bytes) = msg::frame(&body) {
                let _ = send_frame(
                    &mut self.links.up_send,
                    &bytes,
                    &mut self.lanes,
                    Wire::ToUpstream,
                    "upstream",
                )
                .await;
            }
        }
        // Upstream may have sent more before it learned of the failure:
        // read and fold it, so its digest and this one still agree. The
        // downstream ends its part once this stage's stream to it finishes.
        if let Some((send, _)) = self.links.down.as_mut() {
            let _ = send.finish();
        }
        if !self.links.upstream_gone {
            drain(
                &mut self.links.upstream,
                &mut self.lanes,
                Wire::FromUpstream,
            )
            .await;
        }
        if let Some(watch) = self.links.down_watch.as_mut() {
            drain(watch, &mut self.lanes, Wire::FromDownstream).await;
        }
    }
}
