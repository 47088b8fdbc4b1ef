//! Moving a request's frames on its QUIC streams: each frame is folded
//! into the request's lanes (the protocol's hop session, [`Folding`])
//! before it is written or as it is read; whole frames read by their own
//! tasks, drained after a failure so every lane stays whole.

use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use mesh_protocol::session::{HopSession, Wire};
use mesh_protocol::stage_frame::MAX_DECODE_ROWS;

use crate::runtime::net::msg::{self, kind};
use crate::runtime::serve::shared::DRAIN_WAIT;

/// How long a frame reader waits for its stream's next frame: the consumer
/// applies the step timeout, so this one never ends first.
pub(crate) const WATCH_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// A node that refuses a request answers FAILED and stops reading, so the
/// next write to it fails: report its reason rather than the write's. The
/// answer is folded as received (the refusing side folded it as sent when it
/// had lanes; when it refused before any, its hop has no record to compare).
pub(crate) async fn refusal_behind(
    recv: &mut quinn::RecvStream,
    error: anyhow::Error,
    whom: &str,
    lanes: Option<&mut Folding>,
) -> anyhow::Error {
    let reply = msg::read_checked(recv, MAX_FAILED_REPLY, DRAIN_WAIT).await;
    if let Ok(Some(frame)) = reply
        && let Ok((kind::FAILED, _, _, reason)) = msg::parse_stage(&frame)
    {
        if let Some(lanes) = lanes {
            lanes.fold(Wire::FromDownstream, &frame);
        }
        return anyhow!("{whom} refused: {}", String::from_utf8_lossy(reason));
    }
    error
}

/// The longest FAILED reply read: its reason is a line or an error chain.
pub(crate) const MAX_FAILED_REPLY: usize = 64 * 1024;

/// A FAILED reply's reason, cut (at a character) to what a reader takes.
pub(crate) fn failed_reason(reason: &str) -> &[u8] {
    let mut end = reason.len().min(MAX_FAILED_REPLY - 1024);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

/// The longest reply a stage sends upstream: a FAILED reason, or the final
/// stage's hidden state at a decode step's positions (at most
/// `MAX_DECODE_ROWS`), in f32 (`hidden` wide).
pub(crate) fn max_reply(hidden: usize) -> usize {
    (mesh_protocol::stage_frame::STAGE_HEADER
        + mesh_stage::frame::FRAME_HEADER_BYTES
        + 4 * hidden * MAX_DECODE_ROWS)
        .max(MAX_FAILED_REPLY)
}

/// Whole frames of a stream, read by their own task so that waiting on them
/// can be abandoned (in a `select!`) without losing part of a frame. The
/// channel ends when the stream finishes; a read error is its last item.
pub(crate) type Frames = tokio::sync::mpsc::Receiver<anyhow::Result<Vec<u8>>>;

pub(crate) fn spawn_frames(mut recv: quinn::RecvStream, max: usize) -> Frames {
    let (sender, frames) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        loop {
            let read = tokio::select! {
                read = msg::read_checked(&mut recv, max, WATCH_TIMEOUT) => read,
                // The request is over: stop reading for it.
                () = sender.closed() => return,
            };
            let last = !matches!(read, Ok(Some(_)));
            let item = match read {
                Ok(Some(frame)) => Ok(frame),
                Ok(None) => return,
                Err(error) => Err(error),
            };
            if sender.send(item).await.is_err() || last {
                return;
            }
        }
    });
    frames
}

/// The next frame of `frames`, or never when there is none to wait on.
pub(crate) async fn next_frame(frames: &mut Option<Frames>) -> Option<anyhow::Result<Vec<u8>>> {
    match frames {
        Some(frames) => frames.recv().await,
        None => std::future::pending().await,
    }
}

/// After a failure, keep reading what a peer still sends on this request,
/// folding it, until it finishes or `DRAIN_WAIT` passes: a frame it wrote
/// before it learned of the failure is then in both ends' digests.
pub(crate) async fn drain(frames: &mut Frames, lanes: &mut Folding, wire: Wire) {
    drain_for(frames, lanes, wire, DRAIN_WAIT).await;
}

/// `drain`, for up to `bound`.
pub(crate) async fn drain_for(
    frames: &mut Frames,
    lanes: &mut Folding,
    wire: Wire,
    bound: Duration,
) {
    let until = tokio::time::Instant::now() + bound;
    while let Ok(Some(Ok(frame))) = tokio::time::timeout_at(until, frames.recv()).await {
        lanes.fold(wire, &frame);
    }
}

/// A request's lanes at this node (the protocol's hop session folds every
/// frame; the serving code only moves bytes), and the time spent folding.
pub(crate) struct Folding {
    pub(crate) session: HopSession,
    pub(crate) spent: Duration,
}

impl Folding {
    pub(crate) fn new(session: HopSession) -> Self {
        Self {
            session,
            spent: Duration::ZERO,
        }
    }

    /// Fold one whole frame, exactly as it crossed, on `wire`'s lane.
    pub(crate) fn fold(&mut self, wire: Wire, frame: &[u8]) {
        let start = Instant::now();
        self.session.fold(wire, frame);
        self.spent += start.elapsed();
    }
}

/// A dishonest stage, for tests: `MESH_FAULT_WRONG_OUTPUT=P` nudges each
/// output this node computes a little with probability P (1: every one,
/// as altered weights would), before it is folded and sent: every hop
/// agrees, and only an audit can tell.
#[cfg(feature = "fault-injection")]
pub(crate) fn compute_wrongly(output: mesh_stage::SliceOutput) -> mesh_stage::SliceOutput {
    let share = std::env::var("MESH_FAULT_WRONG_OUTPUT")
        .ok()
        .and_then(|p| p.parse::<f64>().ok())
        .unwrap_or(0.0);
    match output {
        mesh_stage::SliceOutput::Hidden(mut a) if crate::runtime::keys::chance(share) => {
            for value in a.values.iter_mut().step_by(97) {
                *value += 0.25;
            }
            mesh_stage::SliceOutput::Hidden(a)
        }
        output => output,
    }
}

/// A stage that accepts and then stalls, for tests: with
/// `MESH_FAULT_STALL=1` this node holds every step it is given for an
/// hour before computing it.
#[cfg(feature = "fault-injection")]
pub(crate) async fn stall_if_told() {
    if std::env::var_os("MESH_FAULT_STALL").is_some() {
        tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
    }
}

#[cfg(feature = "fault-injection")]
pub(crate) fn inject_fault(stage_index: u32, step: u32, bytes: &mut [u8]) {
    // MESH_FAULT_FLIP_FORWARD=STAGE:STEP:OFFSET alters one byte of the
    // forward frame that stage STAGE writes at STEP, after it was folded.
    if let Ok(spec) = std::env::var("MESH_FAULT_FLIP_FORWARD") {
        let parts: Vec<usize> = spec.split(':').filter_map(|p| p.parse().ok()).collect();
        if let [stage, at_step, offset] = parts[..]
            && stage == stage_index as usize
            && at_step == step as usize
            && let Some(byte) = bytes.get_mut(offset)
        {
            *byte ^= 0x01;
        }
    }
}

/// Fold a whole frame as written on `wire`, then send it.
pub(crate) async fn send_frame(
    send: &mut quinn::SendStream,
    bytes: &[u8],
    lanes: &mut Folding,
    wire: Wire,
    towards: &str,
) -> anyhow::Result<()> {
    lanes.fold(wire, bytes);
    tokio::time::timeout(msg::IDLE_TIMEOUT, send.write_all(bytes))
        .await
        .with_context(|| format!("timed out writing {towards}"))??;
    Ok(())
}

/// Frame and send a forward message, folding it first; the test-only fault
/// hook alters the bytes after the fold, as corruption in flight would.
pub(crate) async fn write_forward(
    send: &mut quinn::SendStream,
    body: &[u8],
    lanes: &mut Folding,
    stage_index: u32,
    step: u32,
) -> anyhow::Result<()> {
    let bytes = msg::frame(body)?;
    lanes.fold(Wire::ToDownstream, &bytes);
    #[cfg(feature = "fault-injection")]
    let bytes = {
        let mut bytes = bytes;
        inject_fault(stage_index, step, &mut bytes);
        bytes
    };
    let _ = (stage_index, step);
    tokio::time::timeout(msg::IDLE_TIMEOUT, send.write_all(&bytes))
        .await
        .context("timed out writing downstream")??;
    Ok(())
}
