//! Plan: the chain the next request goes on, over the configured peers or
//! the mesh's members, and its assignment to every stage.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use mesh_protocol::receipt::Assignment;

use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::slot::Assign;
use crate::runtime::serve::slot::Slot;

pub(crate) struct Run {
    /// The remote stages, in chain order.
    pub(crate) peers: Vec<PeerAddr>,
    /// The planner's projection when the run was planned over a mesh.
    pub(crate) projected_us: Option<u64>,
    pub(crate) assigns: Vec<Assign>,
    pub(crate) topology: Vec<Assignment>,
    pub(crate) keys: Vec<[u8; 32]>,
    pub(crate) own: Arc<Slot>,
    /// Assignments are sent again before a request once the run has been
    /// unused this long: half the shortest time a stage keeps an idle slice.
    pub(crate) refresh_after: Duration,
    /// Assignments are sent again before the next request: one failed, so a
    /// stage may have restarted without its slice.
    pub(crate) stale: std::sync::atomic::AtomicBool,
}

impl Run {
    /// This node runs every layer itself: no stage, no hop, no split.
    pub(crate) fn alone(&self) -> bool {
        self.peers.is_empty()
    }

    /// The backend its serves are authorised and sealed under: a split's,
    /// or a node's that runs every layer alone.
    pub(crate) fn backend(&self) -> &'static str {
        if self.alone() {
            mesh_protocol::replay::LOCAL_BACKEND
        } else {
            mesh_protocol::replay::SPLIT_BACKEND
        }
    }
}

/// A plan and what it was made from.
pub(crate) struct PlanCache {
    pub(crate) generation: u64,
    /// The fewest stages it was planned with.
    pub(crate) at_least: usize,
    /// Every member's data address (an advert can move it without a
    /// change to the member set).
    pub(crate) addresses: Vec<([u8; 32], String)>,
    pub(crate) refused: Vec<[u8; 32]>,
    /// The members left out for a failed audit.
    pub(crate) failed_audit: Vec<[u8; 32]>,
    /// The members left out for a stall.
    pub(crate) stalled: Vec<[u8; 32]>,
    /// The over-claimers' decode times it was planned with.
    pub(crate) planned_speeds: Vec<([u8; 32], u64)>,
    pub(crate) plan: mesh_protocol::plan::Plan,
    pub(crate) usable: Vec<Usable>,
    /// The coordinator and the members as the planner weighed them.
    pub(crate) candidates: Candidates,
}

/// The coordinator as a candidate, and every other member with why it is
/// left out, if it is.
pub(crate) type Candidates = (
    mesh_protocol::plan::Candidate,
    Vec<crate::runtime::planner::Weighed>,
);

/// A chain: the remote stages, every stage's layers, and the planner's
/// projection when it came from a plan over a mesh.
pub(crate) type Chain = (Vec<PeerAddr>, Vec<std::ops::Range<u32>>, Option<u64>);

/// A member the planner could use: its key and data address.
pub(crate) type Usable = ([u8; 32], SocketAddr);

/// The fewest stages of a request's first chain: this node alone will do.
pub const ANY_CHAIN: usize = 1;
/// The fewest stages of the chain a request resumes on: its evidence is a
/// split's (the resume block links the segments' main records).
pub const A_SPLIT: usize = 2;

/// A new plan replaces the current run only when it is this much faster
/// (numerator, denominator: 4/5, at least 20 % less time per token).
pub const MIN_REPLAN_GAIN: (u64, u64) = (4, 5);

/// How long a member that refused its assignment is left out of plans.
pub const REFUSED_MEMBER_PAUSE: Duration = Duration::from_secs(30);

/// How long a coordinator in a mesh plans again, as members join or come
/// back, before it refuses a request it cannot plan for (within the
/// request's own deadline): long enough for a restarted coordinator's
/// members to reconnect.
pub const MESH_SETTLE_WAIT: Duration = Duration::from_secs(20);
/// As `MESH_SETTLE_WAIT`, for a request in flight that lost a stage: the
/// members it can resume over are those the mesh has now (a member that
/// comes back later serves the next request), so it says it could not
/// resume within seconds of the loss, not after the start-up wait.
pub const RESUME_SETTLE_WAIT: Duration = Duration::from_secs(1);
