//! The stage role: the slices this node holds for its coordinators, the
//! grant decisions taken ahead of their requests, the caches kept for a
//! resume, and each request's path through a slice. A table of contents:
//! the role's state is in [`role`], a request's walk starts in [`request`]:
//!
//! - [`assign`]: a slice loaded for a coordinator, a grant decided ahead;
//! - [`admit`]: the OPEN ([`open`]) read and checked, a grant decision, a
//!   cache (or one [`kept`] for a resume);
//! - [`run`]: the request's steps through the slice;
//! - [`seal`]: the steward's receipt, the stage record pushed.

mod admit;
pub(crate) mod assign;
mod kept;
mod open;
pub(crate) mod request;
pub(crate) mod role;
mod run;
mod seal;

pub use role::{DEFAULT_MAX_SLICES, DEFAULT_SLICE_IDLE, MAX_STAGE_OPEN, NO_SLICE, PRE_DECIDED_TTL};
