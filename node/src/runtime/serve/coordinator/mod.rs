//! The coordinator role: the run (chain) requests go on, the records it
//! collects, and each request's path in phases. A table of contents: the
//! role's state is in [`role`], a request's walk starts in [`request`]:
//!
//! - [`plan`]: the chain ([`runs`]) planned over the mesh and assigned;
//! - [`admit`] (waiting its turn in [`queue`]): the prompt, the request's places, every steward's grant
//!   decision, the router's choice ([`route`], [`decision`]);
//! - [`drive`]: the step loop ([`draft`] drafts, [`text`] shows text,
//!   [`tail`] drains a lost chain's last replies);
//! - [`resume`]: the same request on a new chain, keeping caches ([`keep`]),
//!   without a stage that stalled ([`stall`]);
//! - [`collect`]: the stages' records and the bill;
//! - [`seal`]: the split's records and the `mesh/1` receipt;
//! - [`audit`]: a sampled request's stages run again here, and compared;
//! - [`energy`]: every served span, as the bundle's receipts say;
//! - [`report`]: the reply to the requester.

mod admit;
pub(crate) mod audit;
mod chain;
mod collect;
pub(crate) mod decision;
pub(crate) mod draft;
mod drive;
mod energy;
mod keep;
pub(crate) mod plan;
mod progress;
pub(crate) mod queue;
mod report;
pub(crate) mod reputation;
pub(crate) mod request;
mod resume;
pub(crate) mod role;
pub(crate) mod route;
pub(crate) mod runs;
mod seal;
mod stall;
mod tail;
mod text;

pub use audit::{DEFAULT_AUDIT_PAUSE, DEFAULT_AUDIT_RATE, MAX_TAPE_BYTES};
pub use keep::MAX_KEPT_OUTPUT_BYTES;
pub use queue::{DEFAULT_MAX_QUEUED, MAX_QUEUED};
pub use reputation::MAX_AUDITS_WAITING;
pub use role::{
    DEFAULT_DRAFT_TOKENS, DEFAULT_MAX_RESUMES, DEFAULT_PREFILL_CHUNK_TOKENS, DRAFT_MODEL_TOKENS,
    MAX_DRAFT_TOKENS, MAX_PREFILL_CHUNK_TOKENS, MAX_RESUMES, MAX_UNSERVED_LOGGED,
    one_way_hops_per_step,
};
pub use route::MAX_COSTED_CHAINS;
pub use runs::{MESH_SETTLE_WAIT, MIN_REPLAN_GAIN, REFUSED_MEMBER_PAUSE};
pub use stall::STALL_PAUSE;
