//! A stage that accepted a request and then stalls. After a chain's step
//! timed out, the coordinator finishes its stream to stage 1, and each
//! stage that is still answering ends its part in turn as its upstream
//! closes (its figures then come back for the request). The first stage
//! in chain order still inside the request once those before it have ended
//! theirs is the one the chain waited on: it is counted as lost for the
//! segment (its record will not come, and the resume block says so) and
//! left out of plans for `STALL_PAUSE`, so the request resumes without it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mesh_protocol::block::TerminalState;
use mesh_protocol::identity::did_key;

use crate::runtime::clock::lock;
use crate::runtime::journal::Judgement;
use crate::runtime::serve::coordinator::audit;
use crate::runtime::serve::coordinator::drive::Driven;
use crate::runtime::serve::coordinator::report::{STATS_WAIT, query_stats};
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::shared::DRAIN_WAIT;

/// How long a node that stalled is left out of plans.
pub const STALL_PAUSE: Duration = Duration::from_secs(10 * 60);

/// How often the stages are asked whether they ended their part.
const ASK_EVERY: Duration = Duration::from_millis(250);

/// A segment of a chain planned over a mesh that timed out on a step: name
/// the stage it waited on, count it lost, leave it out of plans.
pub(crate) async fn blame(
    coordinator: &Arc<CoordinatorRole>,
    run: &Run,
    request_id: u64,
    driven: &mut Driven,
) {
    if driven.terminal != TerminalState::TimedOut || run.projected_us.is_none() {
        return;
    }
    let Some((k, staller)) = staller(coordinator, run, request_id).await else {
        return;
    };
    if driven.lost.contains(&staller) {
        return;
    }
    tracing::warn!(
        request_id,
        "stage {} ({}) stalled past the step timeout; left out of plans for {} s",
        k + 1,
        did_key(&staller),
        STALL_PAUSE.as_secs()
    );
    audit::journal_judgement(coordinator, staller, Judgement::Stalled, STALL_PAUSE);
    lock(&coordinator.planning.reputation).stalled(staller, Instant::now() + STALL_PAUSE);
    driven.lost.push(staller);
}

/// Whether asking a stage failed because no path to it is left.
fn is_unreachable(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<crate::runtime::net::tunnel::RelayGone>()
            .is_some()
    })
}

/// The first stage still inside the request once those before it ended
/// their part (each gets a drain's time per stage before it), or the first
/// that cannot be asked at all, with its place in `run.peers`; none when
/// every stage ended its part.
async fn staller(
    coordinator: &Arc<CoordinatorRole>,
    run: &Run,
    request_id: u64,
) -> Option<(usize, [u8; 32])> {
    let until = Instant::now() + DRAIN_WAIT * (run.peers.len() as u32 + 2);
    loop {
        let mut inside = None;
        for (k, peer) in run.peers.iter().enumerate() {
            let asked =
                tokio::time::timeout(STATS_WAIT, query_stats(coordinator, peer, request_id));
            match asked.await {
                Ok(Ok(Some(_))) => {}
                // Cannot be asked at all (no path to it: its relay went
                // away): it will not end its part in any drain's time.
                Ok(Err(error)) if is_unreachable(&error) => return Some((k, peer.key)),
                // Still inside, or slow to say: it may yet end its part.
                _ => {
                    inside = Some((k, peer.key));
                    break;
                }
            }
        }
        let inside = inside?;
        if Instant::now() >= until {
            return Some(inside);
        }
        tokio::time::sleep(ASK_EVERY).await;
    }
}
