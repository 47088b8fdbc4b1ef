//! The API's state, its limits and its errors in OpenAI's shape.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use mesh_stage::text::TextCodec;
use serde_json::{Value, json};

use crate::runtime::limit::Source;
use crate::runtime::net::peers::PeerAddr;

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// How long a client may take to send a request's body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Pieces of a streamed answer held for a client that reads slower than
/// they come.
pub(super) const STREAM_BACKLOG: usize = 32;

/// How long a streamed answer waits for a client that stopped reading
/// before the request is ended (`client_cancelled` on every stage), so a
/// reader that went silent does not hold a cache until the last token.
pub const STALLED_READER_TIMEOUT: Duration = Duration::from_secs(10);

/// Most messages in one chat request.
pub const MAX_MESSAGES: usize = 256;

/// Bundles kept for `/v1/mesh/bundles/{id}`, the most recent first out last.
pub const MAX_KEPT_BUNDLES: usize = 64;

/// Requests the console lists, the most recent last.
pub const MAX_CONSOLE_REQUESTS: usize = 32;

/// Console event streams open at once: each holds a connection for as long
/// as its page is open, so without a cap a stranger could hold every
/// connection slot the API has.
pub const MAX_CONSOLE_STREAMS: usize = 16;

/// Console events not yet sent to a slow console; it then reloads the list.
pub(super) const CONSOLE_EVENT_BACKLOG: usize = 64;

/// `max_tokens` of a completion that names none (OpenAI's default).
pub(super) const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// `max_tokens` of a chat completion that names none, at most what the
/// context leaves.
pub(super) const DEFAULT_CHAT_TOKENS: usize = 1024;

/// What the API says about the model its node serves.
#[derive(Debug, Clone)]
pub struct ModelCard {
    /// The model's name in requests: its file name without extension.
    pub id: String,
    pub package_id: [u8; 32],
    /// Positions a request may use, prompt and answer together.
    pub context: usize,
    pub codec: Arc<TextCodec>,
}

/// Shows the coordinator's steward a receipt (seed 001 §2.2): what it
/// decided (`steward::Witness`).
pub type Witness =
    Arc<dyn Fn(&[u8]) -> anyhow::Result<crate::runtime::steward::Witness> + Send + Sync>;

/// The node's figures in Prometheus' text format (`NodeStats::prometheus`),
/// `None` once the node is shutting down.
pub type Metrics = Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send>>
        + Send
        + Sync,
>;

/// The mesh's members as the console lists them (`GET /v1/mesh/members`),
/// `None` once the node is shutting down.
pub type Members = Arc<dyn Fn() -> Option<Value> + Send + Sync>;

pub(super) struct Api {
    pub(super) coordinator: PeerAddr,
    pub(super) card: ModelCard,
    pub(super) witness: Witness,
    pub(super) metrics: Metrics,
    pub(super) members: Members,
    /// The coordinator's caches, shared fairly between sources.
    pub(super) gate: super::gate::Gate,
    /// Requests this API answered with its own error, logged (strangers
    /// can cause them at will: a line a second at most, the rest counted).
    pub(super) failures_logged: Mutex<crate::runtime::limit::PerMinute>,
    pub(super) bundles: Mutex<VecDeque<(String, Arc<Value>)>>,
    /// What the console shows of recent requests (no prompt, no output).
    pub(super) requests: Mutex<VecDeque<Value>>,
    /// Tells open consoles that a request started or ended.
    pub(super) events: tokio::sync::broadcast::Sender<Value>,
    /// Places for console event streams (`MAX_CONSOLE_STREAMS`).
    pub(super) console_streams: Arc<tokio::sync::Semaphore>,
}

impl Api {
    /// Log why this API answered a request with its own error (the
    /// coordinator logs what it refused or what failed on the chain).
    pub(super) fn log_failure(&self, source: Source, why: &str) {
        let admitted = self
            .failures_logged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit(std::time::Instant::now());
        if let Some(unlogged) = admitted {
            tracing::warn!(%source, unlogged, "an API request was not served: {why}");
        }
    }

    /// A request started or ended: list it and tell the consoles.
    pub(super) fn publish(&self, entry: Value) {
        {
            let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            let id = entry["id"].clone();
            match requests.iter_mut().find(|r| r["id"] == id) {
                Some(known) => *known = entry.clone(),
                None => {
                    if requests.len() >= MAX_CONSOLE_REQUESTS {
                        requests.pop_front();
                    }
                    requests.push_back(entry.clone());
                }
            }
        }
        let _ = self.events.send(entry);
    }
}

/// An error in OpenAI's shape.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    pub(super) kind: &'static str,
    pub(super) code: Option<&'static str>,
    pub(super) message: String,
    pub(super) retry_after: Option<u64>,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        let kind = match status.as_u16() {
            400..=499 => "invalid_request_error",
            _ => "server_error",
        };
        Self {
            status,
            kind,
            code: None,
            message: message.into(),
            retry_after: None,
        }
    }
    pub(super) fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    pub(super) fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    pub(super) fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": null,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
