//! The serving core: a node's two roles and the protocols that reach them.
//!
//! - [`node`]: a running node, put together: [`Shared`](shared::Shared)
//!   (identity, steward, model, peer connections, counters, mesh), the
//!   [`stage`] role and the [`coordinator`] role, each protocol's handler
//!   given to the router;
//! - [`control`], [`stream`], [`push`]: the handlers of `mesh-control/1`,
//!   `mesh-stage/1` and `record-push/1`, each handing its requests to the
//!   role they are for;
//! - [`frames`]: moving a request's frames on its streams, every one
//!   folded into its lanes by the protocol's hop session;
//! - [`slot`], [`batch`]: a loaded slice and the worker that batches its
//!   steps; [`stats`]: the node's pools and counters.
//!
//! docs/architecture.md walks one request through these.

pub(crate) mod batch;
mod control;
pub(crate) mod coordinator;
pub(crate) mod frames;
mod node;
mod push;
pub(crate) mod shared;
pub(crate) mod slot;
mod stage;
pub(crate) mod stats;
mod stream;

pub use crate::runtime::client::{
    GenerateEvent, GenerateRequest, GenerateSummary, Generating, GrantedServe,
    MAX_PROMPT_BYTES_PER_TOKEN, RequestBounds, generate_events, generate_remote, node_stats_remote,
    plan_remote,
};
pub use crate::runtime::clock::now_ms;
pub use crate::runtime::net::peers::PeerAddr;
pub use crate::runtime::router::{MAX_CONNECTIONS, MAX_HANDSHAKES};
pub use coordinator::{
    DEFAULT_AUDIT_PAUSE, DEFAULT_AUDIT_RATE, DEFAULT_DRAFT_TOKENS, DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_RESUMES, DEFAULT_PREFILL_CHUNK_TOKENS, DRAFT_MODEL_TOKENS, MAX_AUDITS_WAITING,
    MAX_COSTED_CHAINS, MAX_DRAFT_TOKENS, MAX_KEPT_OUTPUT_BYTES, MAX_PREFILL_CHUNK_TOKENS,
    MAX_QUEUED, MAX_RESUMES, MAX_TAPE_BYTES, MAX_UNSERVED_LOGGED, MESH_SETTLE_WAIT,
    MIN_REPLAN_GAIN, REFUSED_MEMBER_PAUSE, STALL_PAUSE, one_way_hops_per_step,
};
pub use node::{DEFAULT_FIDELITY, MeshSettings, Node, NodeOptions};
pub use shared::{
    DEFAULT_REQUEST_TIMEOUT, DRAIN_WAIT, MAX_REQUEST_TIMEOUT, POLICY_DENIED, StageStats,
};
pub use stage::{
    DEFAULT_MAX_SLICES, DEFAULT_SLICE_IDLE, MAX_STAGE_OPEN, NO_SLICE, PRE_DECIDED_TTL,
};
pub use stats::{NodeStats, ROUND_TRIP_BUCKETS_US, SliceStats};
