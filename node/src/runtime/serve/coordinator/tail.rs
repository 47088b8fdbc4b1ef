//! What a failed segment still reads from its survivors, so every lane of
//! a healthy hop is whole when it is sealed.

use std::time::Duration;

use crate::runtime::serve::coordinator::role::DirectStream;
use crate::runtime::serve::frames::Folding;
use crate::runtime::serve::frames::Frames;
use crate::runtime::serve::frames::drain_for;
use crate::runtime::serve::frames::spawn_frames;
use crate::runtime::serve::shared::DRAIN_WAIT;
use anyhow::bail;
use mesh_protocol::session::Wire;
use tokio::sync::oneshot;

/// What a failed segment still has to read from its survivors, after the
/// drive loop: owned, so it can finish in the background while the request
/// goes on over a new chain.
pub(crate) struct Tail {
    pub(crate) unfinished: bool,
    pub(crate) reply_owed: bool,
    pub(crate) direct_mode: bool,
    pub(crate) step_timeout: Duration,
    pub(crate) reply_limit: usize,
    pub(crate) relayed: Option<Frames>,
    pub(crate) stage1: Option<Frames>,
    pub(crate) direct: Option<Frames>,
    pub(crate) direct_waiter: Option<oneshot::Receiver<DirectStream>>,
}

/// Which ends of the chain's own streams left the mesh.
#[derive(Clone, Copy)]
pub(crate) struct Gone {
    pub(crate) stage1: bool,
    pub(crate) final_stage: bool,
}

impl Tail {
    /// Read and fold what the neighbours still send, each wait bounded, so
    /// every lane of a healthy hop is whole; nothing from a stage gone.
    pub(crate) async fn drain(mut self, lanes: &mut Folding, gone: Gone) {
        let drain_bound = if self.reply_owed {
            self.step_timeout + DRAIN_WAIT
        } else {
            DRAIN_WAIT
        };
        if self.unfinished
            && !gone.stage1
            && let Some(relayed) = self.relayed.as_mut()
        {
            drain_for(relayed, lanes, Wire::FromDownstream, drain_bound).await;
        }
        // Stage 1 may have said more after the step that failed (a stage
        // further on closing): read and fold it, so hop 0 still agrees.
        if self.unfinished
            && !gone.stage1
            && let Some(stage1) = self.stage1.as_mut()
        {
            drain_for(stage1, lanes, Wire::FromDownstream, drain_bound).await;
        }
        // Likewise the direct return: the final stage may have opened it (and
        // folded its opening) before the failure reached it, or before a
        // deadline that passed ahead of the first step: its opening is read
        // and folded then too, so nothing it folded as sent is left unread.
        if self.direct_mode && (self.unfinished || self.direct.is_none()) && !gone.final_stage {
            let drain_bound = if self.unfinished {
                drain_bound
            } else {
                DRAIN_WAIT
            };
            if self.direct.is_none()
                && let Ok(Ok((_send, stream, opening))) =
                    tokio::time::timeout(drain_bound, wait_direct(&mut self.direct_waiter)).await
            {
                lanes.fold(Wire::DirectReceived, &opening);
                self.direct = Some(spawn_frames(stream, self.reply_limit));
            }
            if let Some(frames) = self.direct.as_mut() {
                drain_for(frames, lanes, Wire::DirectReceived, drain_bound).await;
            }
        }
    }
}

/// A segment's own lanes: whole, or still being drained from survivors.
pub(crate) enum SegmentLanes {
    Ready(Box<Folding>),
    Draining(tokio::task::JoinHandle<Folding>),
}

impl SegmentLanes {
    /// Wait for a drain still running.
    pub(crate) async fn settle(&mut self) -> anyhow::Result<()> {
        if let SegmentLanes::Draining(task) = self {
            let lanes = task.await?;
            *self = SegmentLanes::Ready(Box::new(lanes));
        }
        Ok(())
    }

    /// The lanes, once settled.
    pub(crate) fn whole(&self) -> anyhow::Result<&Folding> {
        match self {
            SegmentLanes::Ready(lanes) => Ok(lanes),
            SegmentLanes::Draining(_) => bail!("a segment's lanes are still being read"),
        }
    }
}

/// The final stage's direct-return stream, once it opens it.
pub(crate) async fn wait_direct(
    waiter: &mut Option<oneshot::Receiver<DirectStream>>,
) -> anyhow::Result<DirectStream> {
    match waiter {
        Some(waiter) => Ok(waiter.await?),
        None => std::future::pending().await,
    }
}
