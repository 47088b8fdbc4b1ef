//! The OpenAI-compatible HTTP API of a coordinator (`serve --http`):
//! `/v1/models`, `/v1/completions` and `/v1/chat/completions` (with
//! `stream: true` as server-sent events), and `/v1/mesh/bundles/{id}`.
//!
//! The API is a requester of its own node: each HTTP request becomes one
//! `generate` request on the node's QUIC endpoint, so admission, deadlines,
//! grants and records are exactly those of any other requester, and a
//! client that goes away drops that request's connection, which cancels it
//! on every stage. docs/api.md lists every endpoint, field and error.

mod answer;
mod api;
mod body;
mod conn;
mod console;
mod gate;
mod guard;
mod server;

pub use conn::{
    FIRST_BYTE_TIMEOUT, HEADER_READ_TIMEOUT, MAX_CONNECTIONS_PER_SOURCE, MAX_HEAD_BYTES,
    MAX_HTTP_BUFFER, MAX_HTTP_CONNECTIONS, Source,
};
pub use gate::{MAX_QUEUED, MAX_QUEUED_PER_SOURCE, QUEUE_WAIT};
pub use guard::Access;

pub use api::{
    BODY_READ_TIMEOUT, MAX_BODY_BYTES, MAX_CONSOLE_REQUESTS, MAX_CONSOLE_STREAMS, MAX_KEPT_BUNDLES,
    MAX_MESSAGES, Members, Metrics, ModelCard, STALLED_READER_TIMEOUT, Witness,
};
pub use server::{HttpApi, bind, start};
