//! One segment's streams to its chain: the forward stream to stage 1, the
//! replies (relayed through stage 1, or returned direct by the final
//! stage), and the waits on them, each bounded and watching the members.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mesh_protocol::block::ReturnMode;
use mesh_protocol::identity::did_key;
use mesh_protocol::session::Wire;
use tokio::sync::oneshot;

use crate::runtime::net::msg::{self, kind};
use crate::runtime::serve::coordinator::audit::Tape;
use crate::runtime::serve::coordinator::role::{CoordinatorRole, DirectStream};
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::coordinator::tail::{Tail, wait_direct};
use crate::runtime::serve::frames::{
    Folding, Frames, next_frame, refusal_behind, spawn_frames, write_forward,
};
use crate::runtime::serve::shared::{DRAIN_WAIT, Deadline, step_timed_out};

/// The streams of one segment's chain, from OPEN to the tail.
pub(crate) struct Chain {
    send: quinn::SendStream,
    /// Stage 1's stream back, read in place (relayed replies while the
    /// deadline is further than a step timeout, off a mesh).
    recv: Option<quinn::RecvStream>,
    return_mode: ReturnMode,
    reply_limit: usize,
    /// Relayed replies read through a task (over a mesh, or once the
    /// deadline is nearer than a step timeout).
    relayed: Option<Frames>,
    /// Direct mode: stage 1's own stream, which it writes only to say why
    /// it stopped.
    stage1: Option<Frames>,
    /// Direct mode: the final stage's return, once it opens it, and whether
    /// it ended.
    direct: Option<Frames>,
    direct_closed: bool,
    direct_waiter: Option<oneshot::Receiver<DirectStream>>,
    /// An audited request's frames to stage 1 and replies back.
    pub(crate) tape: Option<Tape>,
}

/// What a wait for a reply watches besides the streams: the deadline, the
/// step timeout and the chain's members.
pub(crate) struct Watch<'a> {
    pub(crate) coordinator: &'a CoordinatorRole,
    pub(crate) run: &'a Run,
    pub(crate) deadline: Deadline,
    /// When the segment started: members gone since then are lost.
    pub(crate) since: Instant,
}

impl Chain {
    /// The chain once OPEN went down. Direct mode reads stage 1's stream
    /// and the final stage's return each through a task, whole frames at a
    /// time, so a wait on both can be abandoned without losing bytes.
    pub(crate) fn new(
        send: quinn::SendStream,
        recv: quinn::RecvStream,
        return_mode: ReturnMode,
        reply_limit: usize,
        direct_waiter: Option<oneshot::Receiver<DirectStream>>,
    ) -> Self {
        let (recv, stage1) = match return_mode {
            ReturnMode::Direct => (None, Some(spawn_frames(recv, reply_limit))),
            ReturnMode::Relayed => (Some(recv), None),
        };
        Self {
            send,
            recv,
            return_mode,
            reply_limit,
            relayed: None,
            stage1,
            direct: None,
            direct_closed: false,
            direct_waiter,
            tape: None,
        }
    }

    /// Direct return: the prompt's chunks go down one after the other
    /// without waiting for their replies, so stage k works on chunk i+1
    /// while stage k+1 works on chunk i (a relayed stage waits for each
    /// reply before it reads the next chunk).
    pub(crate) fn pipelined(&self) -> bool {
        self.return_mode == ReturnMode::Direct
    }

    /// Write one message down to stage 1 on the forward lane.
    pub(crate) async fn write(
        &mut self,
        lanes: &mut Folding,
        body: &[u8],
        step: u32,
    ) -> anyhow::Result<()> {
        if let Some(tape) = self.tape.as_mut() {
            tape.forward(body);
        }
        write_forward(&mut self.send, body, lanes, 0, step).await
    }

    /// Write one message down to stage 1 on the forward lane; when the
    /// write fails, the reason stage 1 gave for refusing it, if it gave one.
    pub(crate) async fn send_down(
        &mut self,
        lanes: &mut Folding,
        body: &[u8],
        step: u32,
    ) -> anyhow::Result<()> {
        if let Err(error) = self.write(lanes, body, step).await {
            return Err(match self.recv.as_mut() {
                Some(recv) => refusal_behind(recv, error, "stage 1", Some(lanes)).await,
                None => error,
            });
        }
        Ok(())
    }

    /// The next reply, folded; None when the deadline passed first.
    pub(crate) async fn next_reply(
        &mut self,
        lanes: &mut Folding,
        watch: &Watch<'_>,
    ) -> anyhow::Result<Option<Vec<u8>>> {
        let step_timeout = watch.coordinator.shared.step_timeout;
        let wait = watch.deadline.bound(step_timeout);
        match self.recv.as_mut() {
            Some(recv) if wait == step_timeout && watch.run.projected_us.is_none() => {
                let reply = msg::read_checked(recv, self.reply_limit, step_timeout)
                    .await
                    .map_err(|e| step_failure(e, "stage 1", step_timeout))?
                    .context("stage 1 closed the request")?;
                lanes.fold(Wire::FromDownstream, &reply);
                Ok(Some(reply))
            }
            _ if self.return_mode == ReturnMode::Relayed => {
                self.next_relayed(lanes, watch, wait).await
            }
            _ => self.next_direct(lanes, watch, wait).await,
        }
    }

    /// A relayed reply read through a task, so the wait can end without
    /// losing part of a frame: over a mesh, where it also watches the
    /// members (a stage whose process died is noticed when its mesh
    /// connection closes, not at QUIC's idle timeout), and once the
    /// deadline is nearer than a step timeout.
    async fn next_relayed(
        &mut self,
        lanes: &mut Folding,
        watch: &Watch<'_>,
        wait: Duration,
    ) -> anyhow::Result<Option<Vec<u8>>> {
        if self.relayed.is_none() {
            self.relayed = self
                .recv
                .take()
                .map(|recv| spawn_frames(recv, self.reply_limit));
        }
        let arrived = tokio::select! {
            arrived = tokio::time::timeout(wait, next_frame(&mut self.relayed)) => arrived,
            gone = stage_left(watch.coordinator, watch.run, watch.since) => {
                bail!("stage {} left the mesh", did_key(&gone));
            }
        };
        let Ok(arrived) = arrived else {
            if watch.deadline.is_past() {
                return Ok(None);
            }
            let step_timeout = watch.coordinator.shared.step_timeout;
            return Err(step_timed_out("stage 1", step_timeout));
        };
        let reply = arrived.context("stage 1 closed the request")??;
        lanes.fold(Wire::FromDownstream, &reply);
        Ok(Some(reply))
    }

    /// A direct reply from the final stage (its return opened on the first
    /// one), or the reason stage 1 gives on its own stream for stopping.
    async fn next_direct(
        &mut self,
        lanes: &mut Folding,
        watch: &Watch<'_>,
        wait: Duration,
    ) -> anyhow::Result<Option<Vec<u8>>> {
        let first_peer = &watch.run.peers[0];
        let final_stage = &watch.run.peers[watch.run.peers.len() - 1];
        let mut until = tokio::time::Instant::now() + wait;
        loop {
            tokio::select! {
                opened = wait_direct(&mut self.direct_waiter), if self.direct.is_none() => {
                    self.direct_waiter = None;
                    let (_send, stream, opening) =
                        opened.context("the direct return was never opened")?;
                    lanes.fold(Wire::DirectReceived, &opening);
                    self.direct = Some(spawn_frames(stream, self.reply_limit));
                }
                arrived = next_frame(&mut self.direct), if !self.direct_closed => {
                    let Some(arrived) = arrived else {
                        // The final stage ends its return after telling
                        // stage 1 why it stopped (a FAILED relayed up, on
                        // another connection): wait a moment for that
                        // reason instead of racing it.
                        self.direct_closed = true;
                        until = until.min(tokio::time::Instant::now() + DRAIN_WAIT);
                        continue;
                    };
                    let reply = arrived.with_context(|| {
                        format!("the final stage ({}) was lost", final_stage.did())
                    })?;
                    lanes.fold(Wire::DirectReceived, &reply);
                    return Ok(Some(reply));
                }
                said = next_frame(&mut self.stage1) => {
                    let frame = said
                        .context("stage 1 closed the request")?
                        .with_context(|| format!("stage 1 ({}) was lost", first_peer.did()))?;
                    lanes.fold(Wire::FromDownstream, &frame);
                    // In direct mode stage 1's own stream only says why the
                    // chain stopped.
                    if msg::parse_stage(&frame)?.0 != kind::FAILED {
                        bail!("stage 1 sent a reply on its own stream in direct mode");
                    }
                    return Ok(Some(frame));
                }
                gone = stage_left(watch.coordinator, watch.run, watch.since) => {
                    // Its connection in the mesh closed: a process gone is
                    // known at once, not after the QUIC idle timeout.
                    bail!("stage {} left the mesh", did_key(&gone));
                }
                () = tokio::time::sleep_until(until) => {
                    if watch.deadline.is_past() {
                        return Ok(None);
                    }
                    if self.direct_closed {
                        bail!("the final stage closed the direct return");
                    }
                    let whom = if self.direct.is_none() {
                        "the final stage's direct return"
                    } else {
                        "the final stage"
                    };
                    let step_timeout = watch.coordinator.shared.step_timeout;
                    return Err(step_timed_out(whom, step_timeout));
                }
            }
        }
    }

    /// Finish the forward stream and hand what the neighbours still send to
    /// the tail. A deadline that passed while a reply was owed: the reply
    /// still comes (stage 1 finishes its step, reads STOP and ends its
    /// stream; a stage's own deadline is a step timeout later than this
    /// one), and is read and folded, so hop 0 still agrees.
    pub(crate) fn into_tail(
        mut self,
        failed: bool,
        reply_owed: bool,
        step_timeout: Duration,
    ) -> Tail {
        let _ = self.send.finish();
        Tail {
            unfinished: failed || reply_owed,
            reply_owed,
            direct_mode: self.return_mode == ReturnMode::Direct,
            step_timeout,
            reply_limit: self.reply_limit,
            relayed: self.relayed,
            stage1: self.stage1,
            direct: self.direct,
            direct_waiter: self.direct_waiter,
        }
    }
}

/// The first of the chain's stages whose mesh connection closed (checked
/// on every change, and every 250 ms); never, for a node in no mesh. A
/// member only late with its advert or a ping still counts as there:
/// QUIC's own idle timeout judges it.
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
fn step_failure(error: anyhow::Error, whom: &str, timeout: Duration) -> anyhow::Error {
    if error.to_string().contains("timed out") {
        step_timed_out(whom, timeout)
    } else {
        error.context(format!("waiting for {whom}'s reply"))
    }
}
