//! The OpenAI-compatible HTTP API of a coordinator (`serve --http`):
//! `/v1/models`, `/v1/completions` and `/v1/chat/completions` (with
//! `stream: true` as server-sent events), and `/v1/mesh/bundles/{id}`.
//!
//! The API is a requester of its own node: each HTTP request becomes one
//! `generate` request on the node's QUIC endpoint, so admission, deadlines,
//! grants and records are exactly those of any other requester, and a
//! client that goes away drops that request's connection, which cancels it
//! on every stage. docs/api.md lists every endpoint, field and error.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use mesh_protocol::control::{MAX_STOP_BYTES, MAX_STOP_SEQUENCES};
use mesh_stage::sampling::SamplingParams;
use mesh_stage::text::TextCodec;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::runtime::client::{
    GenerateEvent, GenerateRequest, GenerateSummary, MAX_PROMPT_BYTES_PER_TOKEN, generate_events,
};
use crate::runtime::net::peers::PeerAddr;

mod conn;
mod gate;
mod guard;
pub use conn::{
    FIRST_BYTE_TIMEOUT, HEADER_READ_TIMEOUT, MAX_CONNECTIONS_PER_SOURCE, MAX_HEAD_BYTES,
    MAX_HTTP_BUFFER, MAX_HTTP_CONNECTIONS, Source,
};
pub use gate::{MAX_QUEUED, MAX_QUEUED_PER_SOURCE, QUEUE_WAIT};
pub use guard::Access;

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// How long a client may take to send a request's body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Pieces of a streamed answer held for a client that reads slower than
/// they come.
const STREAM_BACKLOG: usize = 32;
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
const CONSOLE_EVENT_BACKLOG: usize = 64;
/// The console: one page, its styles and script inline, no network use.
const CONSOLE_HTML: &str = include_str!("console.html");
/// `max_tokens` of a completion that names none (OpenAI's default).
const DEFAULT_COMPLETION_TOKENS: usize = 16;
/// `max_tokens` of a chat completion that names none, at most what the
/// context leaves.
const DEFAULT_CHAT_TOKENS: usize = 1024;

/// What the API says about the model its node serves.
#[derive(Debug, Clone)]
pub struct ModelCard {
    /// The model's name in requests: its file name without extension.
    pub id: String,
    pub package_id: [u8; 32],
    /// Positions a request may use, prompt and answer together.
    pub context: usize,
    pub codec: TextCodec,
}

/// Shows the coordinator's steward a receipt (seed 001 §2.2): what it
/// decided (`steward::Witness`).
pub type Witness =
    Arc<dyn Fn(&[u8]) -> anyhow::Result<crate::runtime::steward::Witness> + Send + Sync>;

struct Api {
    coordinator: PeerAddr,
    card: ModelCard,
    witness: Witness,
    /// The coordinator's caches, shared fairly between sources.
    gate: gate::Gate,
    /// Requests this API answered with its own error, logged (strangers
    /// can cause them at will: a line a second at most, the rest counted).
    failures_logged: Mutex<crate::runtime::limit::PerMinute>,
    bundles: Mutex<VecDeque<(String, Arc<Value>)>>,
    /// What the console shows of recent requests (no prompt, no output).
    requests: Mutex<VecDeque<Value>>,
    /// Tells open consoles that a request started or ended.
    events: tokio::sync::broadcast::Sender<Value>,
    /// Places for console event streams (`MAX_CONSOLE_STREAMS`).
    console_streams: Arc<tokio::sync::Semaphore>,
}

impl Api {
    /// Log why this API answered a request with its own error (the
    /// coordinator logs what it refused or what failed on the chain).
    fn log_failure(&self, source: Source, why: &str) {
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
    fn publish(&self, entry: Value) {
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

/// A running HTTP API; dropping it stops the listener.
#[derive(Debug)]
pub struct HttpApi {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl HttpApi {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HttpApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Bind `listen` and serve the API for the coordinator at `coordinator`,
/// whose slices hold `max_requests` requests at once.
pub async fn start(
    listen: SocketAddr,
    access: Access,
    coordinator: PeerAddr,
    card: ModelCard,
    (witness, max_requests): (Witness, usize),
) -> anyhow::Result<HttpApi> {
    use anyhow::Context;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the HTTP API to {listen}"))?;
    let addr = listener.local_addr()?;
    let api = Arc::new(Api {
        coordinator,
        card,
        witness,
        gate: gate::Gate::new(max_requests),
        failures_logged: Mutex::new(crate::runtime::limit::PerMinute::new(60)),
        bundles: Mutex::new(VecDeque::new()),
        requests: Mutex::new(VecDeque::new()),
        events: tokio::sync::broadcast::channel(CONSOLE_EVENT_BACKLOG).0,
        console_streams: Arc::new(tokio::sync::Semaphore::new(MAX_CONSOLE_STREAMS)),
    });
    let router = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/mesh/bundles/{id}", get(bundle))
        .route("/v1/mesh/steward", get(steward))
        .route("/v1/mesh/witness", post(witness_receipt))
        .route(
            "/v1/mesh/granted_serve_request",
            post(granted_serve_request),
        )
        .route("/v1/mesh/requests", get(console_requests))
        .route("/v1/mesh/events", get(console_events))
        .route("/", get(console))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(api);
    let task = tokio::spawn(conn::accept_loop(listener, router, Arc::new(access)));
    Ok(HttpApi { addr, task })
}

/// An error in OpenAI's shape.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    message: String,
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
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
    fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    fn body(&self) -> Value {
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

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint").code("not_found")
}

async fn models(State(api): State<Arc<Api>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [model_object(&api.card)],
    }))
    .into_response()
}

fn model_object(card: &ModelCard) -> Value {
    json!({
        "id": card.id,
        "object": "model",
        "created": 0,
        "owned_by": "mesh-node",
        "mesh": {
            "package_id": model_package(card),
            "context_length": card.context,
            "chat_template": card.codec.chat_template().is_some(),
        },
    })
}

async fn console() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        CONSOLE_HTML,
    )
        .into_response()
}

async fn console_requests(State(api): State<Arc<Api>>) -> Response {
    let requests: Vec<Value> = api
        .requests
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .cloned()
        .collect();
    axum::Json(json!({"requests": requests})).into_response()
}

/// Server-sent events: one per request that starts or ends.
async fn console_events(State(api): State<Arc<Api>>) -> Response {
    let Ok(place) = api.console_streams.clone().try_acquire_owned() else {
        let mut error = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{MAX_CONSOLE_STREAMS} consoles are open already; close one or retry later"),
        );
        error.retry_after = Some(30);
        return error.into_response();
    };
    let receiver = api.events.subscribe();
    // The place is held by the stream and freed with it.
    let events =
        futures_util::stream::unfold((receiver, place), |(mut receiver, place)| async move {
            loop {
                match receiver.recv().await {
                    Ok(entry) => {
                        return Some((
                            Ok::<Event, Infallible>(Event::default().data(entry.to_string())),
                            (receiver, place),
                        ));
                    }
                    // A console that fell behind reloads the list on the next
                    // event; nothing is queued for it past the backlog.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// What the console shows of a finished request: its stages, each hop's
/// lanes as `mesh-node verify` prints them, the verdict of the same checks,
/// its energy. Never its prompt or output.
fn console_entry(id: &str, summary: &GenerateSummary) -> Value {
    let details = &summary.details;
    let mut entry = json!({
        "id": id,
        "state": if summary.error.is_some() { "failed" } else { "finished" },
        "terminal_state": summary.terminal_state,
        "request_id": details["request_id"],
        "prompt_tokens": details["prompt_tokens"],
        "generated_tokens": details["generated_tokens"],
        "decode_tokens_per_s": details["decode_tokens_per_s"],
        "per_hop_overhead_us": details["per_hop_overhead_us"],
        "energy_uj": details["receipt"]["energy_uj"],
        "energy_provenance": details["receipt"]["energy_provenance"],
        "stages": details["stages"],
    });
    let Some(bundle) = &summary.bundle else {
        return entry;
    };
    match mesh_protocol::verify::verify_document(bundle) {
        Ok(report) => {
            let passed = report.checks.iter().filter(|c| c.outcome.is_ok()).count();
            entry["verify"] = json!({
                "ok": report.success(),
                "checks_passed": passed,
                "checks": report.checks.len(),
            });
            if let Some(hop) = &report.hop {
                entry["handoffs_agree"] = json!(hop.handoffs_agree);
                entry["lanes"] = hop
                    .lanes
                    .iter()
                    .map(|l| {
                        json!({
                            "hop_index": l.hop_index,
                            "lane": l.lane.as_str(),
                            "state": l.state.as_str(),
                            "glyph": l.state.glyph(),
                        })
                    })
                    .collect();
            }
        }
        Err(error) => entry["verify"] = json!({"ok": false, "error": error.to_string()}),
    }
    entry
}

/// The steward's node id: the subject a grant for this coordinator names
/// (seed 001 §2.3).
async fn steward(State(api): State<Arc<Api>>) -> Response {
    axum::Json(json!({
        "steward": mesh_protocol::identity::did_key(&api.coordinator.key),
    }))
    .into_response()
}

async fn bundle(State(api): State<Arc<Api>>, Path(id): Path<String>) -> Response {
    let found = api
        .bundles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find(|(kept, _)| *kept == id)
        .map(|(_, bundle)| bundle.clone());
    match found {
        Some(bundle) => axum::Json(bundle.as_ref().clone()).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no bundle {id} here (this coordinator keeps its last {MAX_KEPT_BUNDLES})"),
        )
        .code("not_found")
        .into_response(),
    }
}

/// One string or several (OpenAI's `stop` and `prompt`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// What `/v1/completions` and `/v1/chat/completions` share.
#[derive(Debug, Deserialize)]
struct Common {
    /// Presentations of grants (seed 001 §2.1), hex: one for the
    /// coordinator's steward, or one per stage in order ("" where none).
    jcp_presentation: Option<OneOrMany>,
    #[serde(default)]
    metadata: Metadata,
    model: String,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Option<OneOrMany>,
    #[serde(default)]
    stream: bool,
    n: Option<u64>,
}

/// OpenAI's `metadata`, with the members a granted request names.
#[derive(Debug, Default, Deserialize)]
struct Metadata {
    /// The energy ceiling a granted request is served under (required with
    /// `jcp_presentation`); a number or its decimal text.
    joule_ceiling_uj: Option<Value>,
    /// The requester's estimate of the prompt's tokens, as signed for.
    prompt_tokens: Option<Value>,
}

/// A number, or its decimal text (OpenAI's `metadata` values are text).
fn metadata_number(value: &Option<Value>, name: &str) -> Result<Option<u64>, ApiError> {
    match value {
        None => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| ApiError::bad(format!("`metadata.{name}` must be a whole number"))),
        Some(Value::String(s)) => s
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad(format!("`metadata.{name}` must be a whole number"))),
        Some(_) => Err(ApiError::bad(format!(
            "`metadata.{name}` must be a whole number"
        ))),
    }
}

#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: OneOrMany,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(body_error)
}

fn body_error(error: serde_json::Error) -> ApiError {
    ApiError::bad(format!("the request body: {error}"))
}

/// Which endpoint a request came in on: the shapes of its answers differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavour {
    Completion,
    Chat,
}

/// A request checked and ready for the coordinator.
struct Prepared {
    flavour: Flavour,
    request: GenerateRequest,
    stream: bool,
}

/// The body of a POST: JSON only (a form or text body is what a web page
/// can send cross-site without asking first), read within
/// `BODY_READ_TIMEOUT`.
async fn read_body(request: axum::extract::Request) -> Result<Bytes, ApiError> {
    use axum::extract::FromRequest;
    let json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    if !json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send the body as JSON with Content-Type: application/json",
        ));
    }
    match tokio::time::timeout(BODY_READ_TIMEOUT, Bytes::from_request(request, &())).await {
        Ok(body) => body.map_err(rejected),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "the request body took too long to arrive",
        )),
    }
}

fn rejected(rejection: BytesRejection) -> ApiError {
    let status = rejection.status();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!("the request body is over {MAX_BODY_BYTES} bytes")
    } else {
        rejection.body_text()
    };
    ApiError::new(status, message)
}

/// Parse and check a request off the async workers: tokenizing a long
/// prompt is CPU work that must not stall the node's other requests.
async fn checked(
    api: &Arc<Api>,
    request: axum::extract::Request,
    check: fn(&Api, Bytes) -> Result<Prepared, ApiError>,
) -> Result<Prepared, ApiError> {
    let body = read_body(request).await?;
    let api = api.clone();
    tokio::task::spawn_blocking(move || check(&api, body))
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "checking the request failed",
            )
        })?
}

/// The source a request came from (set by the connection it came on).
fn source_of(request: &axum::extract::Request) -> Source {
    request
        .extensions()
        .get::<Source>()
        .copied()
        .unwrap_or_else(|| Source::of(std::net::Ipv4Addr::UNSPECIFIED.into()))
}

async fn completions(State(api): State<Arc<Api>>, request: axum::extract::Request) -> Response {
    let source = source_of(&request);
    match checked(&api, request, check_completion).await {
        Ok(prepared) => run(api, prepared, source).await,
        Err(error) => error.into_response(),
    }
}

fn check_completion(api: &Api, body: Bytes) -> Result<Prepared, ApiError> {
    let (prompt, common) = completion_prompt(parse(&body)?)?;
    prepare(api, Flavour::Completion, prompt, common)
}

/// A completion's prompt, as served: its one string.
fn completion_prompt(body: CompletionBody) -> Result<(String, Common), ApiError> {
    let mut prompts = body.prompt.into_vec();
    match (prompts.pop(), prompts.is_empty()) {
        (Some(prompt), true) => Ok((prompt, body.common)),
        _ => Err(ApiError::bad("`prompt` must be one string")),
    }
}

/// A chat's prompt, as served: its messages in the model's template.
fn chat_prompt(api: &Api, body: ChatBody) -> Result<(String, Common), ApiError> {
    Ok((render_chat(&api.card.codec, body.messages)?, body.common))
}

async fn chat_completions(
    State(api): State<Arc<Api>>,
    request: axum::extract::Request,
) -> Response {
    let source = source_of(&request);
    match checked(&api, request, check_chat).await {
        Ok(prepared) => run(api, prepared, source).await,
        Err(error) => error.into_response(),
    }
}

fn check_chat(api: &Api, body: Bytes) -> Result<Prepared, ApiError> {
    let (prompt, common) = chat_prompt(api, parse(&body)?)?;
    prepare(api, Flavour::Chat, prompt, common)
}

fn render_chat(codec: &TextCodec, messages: Vec<Message>) -> Result<String, ApiError> {
    let Some(template) = codec.chat_template() else {
        return Err(ApiError::bad(
            "this model has no chat template (a base model): use /v1/completions",
        ));
    };
    if messages.is_empty() || messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad(format!(
            "`messages` must hold 1 to {MAX_MESSAGES} messages"
        )));
    }
    let mut turns = Vec::with_capacity(messages.len());
    for message in messages {
        let role = match message.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::bad(format!(
                    "role `{other}` is not supported (system, developer, user, assistant)"
                )));
            }
        };
        let content = match message.content {
            Content::Text(text) => text,
            Content::Parts(parts) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(piece)) => text.push_str(&piece),
                        (kind, _) => {
                            return Err(ApiError::bad(format!(
                                "content part `{kind}` is not supported (text only)"
                            )));
                        }
                    }
                }
                text
            }
        };
        if let Some(token) = codec.control_token_in(&content) {
            return Err(ApiError::bad(format!(
                "a message holds the model's control token `{token}`, which would be read as \
                 a turn marker; remove it"
            )));
        }
        turns.push((role, content));
    }
    Ok(template.render(&turns))
}

fn prepare(
    api: &Api,
    flavour: Flavour,
    prompt: String,
    mut common: Common,
) -> Result<Prepared, ApiError> {
    let card = &api.card;
    if common.model != card.id && common.model != model_package(card) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "model `{}` is not served here; this coordinator serves `{}`",
                common.model, card.id
            ),
        )
        .code("model_not_found"));
    }
    if common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("`n` must be 1"));
    }
    let temperature = common.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad("`temperature` must be between 0 and 2"));
    }
    let top_p = common.top_p.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&top_p) || top_p == 0.0 {
        return Err(ApiError::bad("`top_p` must be above 0 and at most 1"));
    }
    let stop = common
        .stop
        .take()
        .map(OneOrMany::into_vec)
        .unwrap_or_default();
    if stop.len() > MAX_STOP_SEQUENCES
        || stop
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::bad(format!(
            "`stop` must be at most {MAX_STOP_SEQUENCES} sequences of 1 to {MAX_STOP_BYTES} bytes"
        )));
    }
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty"));
    }
    if prompt.len() > card.context.saturating_mul(MAX_PROMPT_BYTES_PER_TOKEN) {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "a prompt of {} bytes cannot fit this model's context of {} tokens",
                prompt.len(),
                card.context
            ),
        )
        .code("context_length_exceeded"));
    }
    let prompt_tokens = card
        .codec
        .encode(&prompt)
        .map_err(|e| ApiError::bad(format!("the prompt: {e}")))?
        .len();
    if prompt_tokens >= card.context {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the prompt is {prompt_tokens} tokens; this model's context is {}",
                card.context
            ),
        )
        .code("context_length_exceeded"));
    }
    let room = card.context - prompt_tokens;
    let max_tokens = match common.max_completion_tokens.or(common.max_tokens) {
        Some(0) => return Err(ApiError::bad("`max_tokens` must be at least 1")),
        Some(n) if n as usize > room => {
            return Err(ApiError::bad(format!(
                "{prompt_tokens} prompt tokens and max_tokens {n} are more than this model's context of {}",
                card.context
            ))
            .code("context_length_exceeded"));
        }
        Some(n) => n as usize,
        None => match flavour {
            Flavour::Completion => DEFAULT_COMPLETION_TOKENS.min(room),
            Flavour::Chat => DEFAULT_CHAT_TOKENS.min(room),
        },
    };
    let grant = match &common.jcp_presentation {
        None => None,
        Some(presentations) => Some(granted(&prompt, &common, presentations)?),
    };
    let seed = common.seed.unwrap_or_else(|| {
        let mut bytes = [0u8; 8];
        // A seedless request samples differently each time, as with any
        // OpenAI server; a failing OS source only makes it predictable.
        let _ = getrandom::fill(&mut bytes);
        u64::from_le_bytes(bytes)
    });
    Ok(Prepared {
        flavour,
        stream: common.stream,
        request: GenerateRequest {
            prompt,
            max_tokens,
            chat: false,
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_k: 0,
                top_p: top_p as f32,
                seed,
            },
            grant,
            timeout: None,
            stop,
            bounds: Default::default(),
            decision: None,
        },
    })
}

/// The `mesh/1` request a granted body is served as, derived from the body
/// alone (seed 001 §2.3), so a client can sign presentations for its id:
/// the prompt as served (a chat rendered with the model's template), the
/// body's own `max_tokens` and `metadata.joule_ceiling_uj`, and its
/// estimate of the prompt's tokens (`metadata.prompt_tokens`, else a
/// quarter of its bytes, rounded up). `POST /v1/mesh/granted_serve_request`
/// returns it for a body.
fn derive_granted(
    prompt: &str,
    common: &Common,
) -> Result<mesh_protocol::mesh1::ServeRequest, ApiError> {
    let ceiling = metadata_number(&common.metadata.joule_ceiling_uj, "joule_ceiling_uj")?
        .ok_or_else(|| {
            ApiError::bad("a granted request names its own `metadata.joule_ceiling_uj`")
        })?;
    let max_tokens = common
        .max_completion_tokens
        .or(common.max_tokens)
        .ok_or_else(|| ApiError::bad("a granted request names its own `max_tokens`"))?;
    let estimate = match metadata_number(&common.metadata.prompt_tokens, "prompt_tokens")? {
        Some(n) => n,
        None => prompt.len().div_ceil(4) as u64,
    };
    Ok(crate::runtime::client::GrantedServe::derive(
        prompt,
        max_tokens as usize,
        u32::try_from(estimate).unwrap_or(u32::MAX),
        ceiling,
    ))
}

fn granted(
    prompt: &str,
    common: &Common,
    presentations: &OneOrMany,
) -> Result<crate::runtime::client::GrantedServe, ApiError> {
    let serve = derive_granted(prompt, common)?;
    let presentations = match presentations {
        OneOrMany::One(one) => vec![one.clone()],
        OneOrMany::Many(many) => many.clone(),
    };
    if presentations.is_empty() || presentations.len() > mesh_protocol::receipt::MAX_STAGES {
        return Err(ApiError::bad(
            "`jcp_presentation` must hold 1 to 64 presentations",
        ));
    }
    let presentations = presentations
        .iter()
        .enumerate()
        .map(|(k, hex)| {
            let bytes = mesh_protocol::hex::decode(hex)
                .ok_or_else(|| ApiError::bad("`jcp_presentation` holds text that is not hex"))?;
            // "" stands for no presentation at that stage; anything else
            // must be one, or the coordinator would refuse it as its own
            // failure (503) instead of the caller's.
            if !bytes.is_empty() {
                mesh_protocol::grant::Presentation::decode(&bytes).map_err(|error| {
                    ApiError::bad(format!(
                        "`jcp_presentation` {k} is not a grant presentation: {error}"
                    ))
                })?;
            }
            Ok(bytes)
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(crate::runtime::client::GrantedServe {
        serve,
        presentations,
    })
}

/// `POST /v1/mesh/granted_serve_request`: the request a body (completion
/// when it has `prompt`, chat when it has `messages`) is served as.
async fn granted_serve_request(
    State(api): State<Arc<Api>>,
    request: axum::extract::Request,
) -> Response {
    let derived = async {
        let body = read_body(request).await?;
        let api = api.clone();
        tokio::task::spawn_blocking(move || -> Result<Value, ApiError> {
            let value: Value = parse(&body)?;
            let (prompt, common) = if value.get("messages").is_some() {
                chat_prompt(&api, serde_json::from_value(value).map_err(body_error)?)?
            } else {
                completion_prompt(serde_json::from_value(value).map_err(body_error)?)?
            };
            let serve = derive_granted(&prompt, &common)?;
            Ok(json!({
                "serve_request": {
                    "prompt_hash": mesh_protocol::hex::encode(&serve.prompt_hash),
                    "prompt_tokens": serve.prompt_tokens,
                    "max_tokens": serve.max_tokens,
                    "fidelity_floor": format!("{:?}", serve.fidelity_floor),
                    "joule_ceiling_uj": serve.joule_ceiling_uj,
                    "cbor_hex": mesh_protocol::hex::encode(&serve.to_cbor().encode()),
                },
                "request_id": mesh_protocol::hex::encode(&serve.request_id()),
            }))
        })
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "deriving the request failed",
            )
        })?
    };
    match derived.await {
        Ok(value) => axum::Json(value).into_response(),
        Err(error) => error.into_response(),
    }
}

/// `POST /v1/mesh/witness` with `{"envelope_hex": …}` (a response's
/// `usage.energy.envelope_hex`; a `receipt` member beside it is ignored):
/// 200 when the steward's journal holds that receipt, 409 when it does not
/// (the steward then refuses every grant), 400 when it is not a receipt
/// this steward sealed.
async fn witness_receipt(State(api): State<Arc<Api>>, request: axum::extract::Request) -> Response {
    #[derive(Deserialize)]
    struct Shown {
        envelope_hex: String,
    }
    let shown = match read_body(request)
        .await
        .and_then(|body| parse::<Shown>(&body))
    {
        Ok(shown) => shown,
        Err(error) => return error.into_response(),
    };
    let Some(envelope) = mesh_protocol::hex::decode(&shown.envelope_hex) else {
        return ApiError::bad("`envelope_hex` is not hex").into_response();
    };
    let witness = api.witness.clone();
    use crate::runtime::steward::{StewardError, Witness};
    match tokio::task::spawn_blocking(move || witness(&envelope)).await {
        Ok(Ok(Witness::Held)) => axum::Json(json!({"held": true})).into_response(),
        Ok(Ok(Witness::Halted)) => ApiError::new(
            StatusCode::CONFLICT,
            "the steward's journal does not hold this receipt: it now refuses every grant",
        )
        .code("receipt_not_held")
        .into_response(),
        Ok(Ok(Witness::Acknowledged)) => ApiError::new(
            StatusCode::CONFLICT,
            "the steward's journal does not hold this receipt; its operator acknowledged it \
             (a halt cleared, a lost journal tail accepted), so grants are still honoured",
        )
        .code("receipt_not_held")
        .into_response(),
        // The halt could not be journalled: the steward's failure, not the
        // caller's.
        Ok(Err(error))
            if matches!(
                error.downcast_ref::<StewardError>(),
                Some(StewardError::Journal(_) | StewardError::NotJournalled(_))
            ) =>
        {
            tracing::error!("a witness showing could not be journalled: {error:#}");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the steward could not journal its decision: {error:#}"),
            )
            .into_response()
        }
        Ok(Err(error)) => {
            ApiError::bad(format!("not a receipt this steward sealed: {error:#}")).into_response()
        }
        Err(_) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the witness check failed",
        )
        .into_response(),
    }
}

fn model_package(card: &ModelCard) -> String {
    format!("sha256:{}", mesh_protocol::hex::encode(&card.package_id))
}

/// What the generating task reports.
enum Progress {
    Piece(String),
    Done(anyhow::Result<GenerateSummary>),
}

/// Generate `request`, handing each piece and the end to `sender`.
async fn generate_into(
    coordinator: &PeerAddr,
    request: &GenerateRequest,
    sender: &mpsc::Sender<Progress>,
    source: Source,
) {
    match generate_events(coordinator, request).await {
        Ok(mut generating) => {
            forward(&mut generating, sender, source, STALLED_READER_TIMEOUT).await;
        }
        Err(error) => {
            let _ = sender.send(Progress::Done(Err(error))).await;
        }
    }
}

/// Where a generation's events come from: the coordinator, or a test.
trait Events {
    fn next(&mut self) -> impl Future<Output = anyhow::Result<GenerateEvent>> + Send;
}

impl Events for crate::runtime::client::Generating {
    fn next(&mut self) -> impl Future<Output = anyhow::Result<GenerateEvent>> + Send {
        crate::runtime::client::Generating::next(self)
    }
}

/// Hand `events` to `sender` to the end. A client that takes nothing for
/// `stall` ends the request: returning drops the generation, which closes
/// its connection to the coordinator and cancels it on every stage, so a
/// reader that went silent does not hold a cache to the last token.
async fn forward(
    events: &mut impl Events,
    sender: &mpsc::Sender<Progress>,
    source: Source,
    stall: Duration,
) {
    loop {
        let (progress, last) = match events.next().await {
            Ok(GenerateEvent::Token(piece)) => (Progress::Piece(piece), false),
            Ok(GenerateEvent::Finished(summary)) => (Progress::Done(Ok(*summary)), true),
            Err(error) => (Progress::Done(Err(error)), true),
        };
        match tokio::time::timeout(stall, sender.send(progress)).await {
            Ok(Ok(())) if !last => {}
            Ok(_) => return,
            Err(_) => {
                tracing::warn!(
                    %source,
                    "an API request ended: its client read nothing for {} s",
                    stall.as_secs_f64()
                );
                return;
            }
        }
    }
}

/// Aborts the generating task when the response is dropped (the client went
/// away): its QUIC connection to the coordinator closes, which cancels the
/// request on every stage.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn run(api: Arc<Api>, prepared: Prepared, source: Source) -> Response {
    let Prepared {
        flavour,
        request,
        stream,
    } = prepared;
    let max_tokens = request.max_tokens;
    // A cache at the coordinator, in this source's turn; held by the
    // generating task, so it is given back when the generation ends.
    let pass = match api.gate.enter(source).await {
        Ok(pass) => pass,
        Err(full) => {
            api.log_failure(source, &format!("busy: {full}"));
            let mut error = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the API is busy: {full}"),
            )
            .code("busy");
            error.retry_after = Some(1);
            return error.into_response();
        }
    };
    let (sender, mut receiver) = mpsc::channel(STREAM_BACKLOG);
    let coordinator = api.coordinator.clone();
    let task = AbortOnDrop(tokio::spawn(async move {
        let _pass = pass;
        generate_into(&coordinator, &request, &sender, source).await;
    }));
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let answer = Answer {
        api: api.clone(),
        flavour,
        id: completion_id(flavour),
        created,
        max_tokens,
        source,
    };
    api.publish(json!({"id": answer.id, "state": "running", "max_tokens": max_tokens}));
    if !stream {
        // A client that goes away drops this future: the guard lists the
        // request as cancelled.
        let mut waiting = Waiting {
            answer: &answer,
            settled: false,
        };
        loop {
            match receiver.recv().await {
                // The summary carries the whole text.
                Some(Progress::Piece(_)) => {}
                Some(Progress::Done(Ok(summary))) => {
                    waiting.settled = true;
                    return answer.whole(summary);
                }
                Some(Progress::Done(Err(error))) => {
                    waiting.settled = true;
                    answer.refused(&error);
                    return refused(&error).into_response();
                }
                None => return answer.ended_without_an_answer(),
            }
        }
    }
    // Streamed: the status is decided by the first report, so a refusal
    // (busy, too long) is still an HTTP error, not an event.
    let first = match receiver.recv().await {
        Some(Progress::Done(Err(error))) => {
            answer.refused(&error);
            return refused(&error).into_response();
        }
        Some(first) => first,
        None => return answer.ended_without_an_answer(),
    };
    let state = StreamState {
        answer,
        receiver,
        first: Some(first),
        queued: VecDeque::new(),
        started: false,
        finished: false,
        _task: task,
    };
    let events = futures_util::stream::unfold(state, |mut state| async move {
        let event = state.next_event().await?;
        Some((Ok::<Event, Infallible>(event), state))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// Lists a request that was not streamed as cancelled if its handler is
/// dropped before the answer.
struct Waiting<'a> {
    answer: &'a Answer,
    settled: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.answer.cancelled();
        }
    }
}

/// Why the coordinator would not serve: the status OpenAI clients expect.
fn refused(error: &anyhow::Error) -> ApiError {
    let message = format!("{error:#}");
    if message.contains("too many concurrent requests") {
        let mut error = ApiError::new(StatusCode::TOO_MANY_REQUESTS, message);
        error.retry_after = Some(1);
        return error.code("busy");
    }
    if message.contains("grant refused") {
        let status = if message.contains("caller-not-issuer") {
            StatusCode::UNAUTHORIZED
        } else if message.contains("steward-halted") {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::FORBIDDEN
        };
        let kind = if status == StatusCode::SERVICE_UNAVAILABLE {
            "server_error"
        } else {
            "invalid_request_error"
        };
        return ApiError {
            status,
            kind,
            code: Some("grant_refused"),
            message,
            retry_after: None,
        };
    }
    if message.contains("exceeds the context") {
        return ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, message)
            .code("context_length_exceeded");
    }
    let mut error = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the mesh could not serve the request: {message}"),
    );
    error.retry_after = Some(5);
    error
}

/// An id for one answer, known before the first chunk (the mesh's
/// request id is known only at the end; `usage.energy` carries it).
fn completion_id(flavour: Flavour) -> String {
    let mut bytes = [0u8; 12];
    let _ = getrandom::fill(&mut bytes);
    let prefix = match flavour {
        Flavour::Completion => "cmpl",
        Flavour::Chat => "chatcmpl",
    };
    format!("{prefix}-{}", mesh_protocol::hex::encode(&bytes))
}

/// A request the mesh ended before its end: 504 past its deadline, 502
/// otherwise.
fn ended_early(summary: &GenerateSummary) -> Option<ApiError> {
    let error = summary.error.as_ref()?;
    let status = if summary.terminal_state == "timed_out" {
        StatusCode::GATEWAY_TIMEOUT
    } else {
        StatusCode::BAD_GATEWAY
    };
    Some(ApiError::new(
        status,
        format!(
            "the mesh ended the request early ({}): {error}",
            summary.terminal_state
        ),
    ))
}

/// Builds the response bodies of one request.
struct Answer {
    api: Arc<Api>,
    flavour: Flavour,
    id: String,
    created: u64,
    max_tokens: usize,
    source: Source,
}

impl Answer {
    /// The console lists the request as refused; one that never reached
    /// the coordinator (which logs what it refuses) is logged here.
    fn refused(&self, error: &anyhow::Error) {
        let why = format!("{error:#}");
        if !why.contains("the coordinator refused") {
            self.api.log_failure(self.source, &why);
        }
        self.api
            .publish(json!({"id": self.id, "state": "refused", "max_tokens": self.max_tokens}));
    }

    /// The generation stopped without a summary or an error (its task
    /// ended): said, and logged.
    fn ended_without_an_answer(&self) -> Response {
        let why = "the request ended without an answer";
        self.api.log_failure(self.source, why);
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, why).into_response()
    }

    /// The console lists the request as cancelled by its client.
    fn cancelled(&self) {
        self.api
            .publish(json!({"id": self.id, "state": "cancelled", "max_tokens": self.max_tokens}));
    }

    /// The console lists the request as it ended.
    fn ended(&self, summary: &GenerateSummary) {
        self.api.publish(console_entry(&self.id, summary));
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.flavour, chunk) {
            (Flavour::Completion, _) => "text_completion",
            (Flavour::Chat, false) => "chat.completion",
            (Flavour::Chat, true) => "chat.completion.chunk",
        }
    }

    /// Token counts and the energy of the request; the bundle is kept for
    /// its link.
    fn usage(&self, summary: &GenerateSummary) -> Value {
        let details = &summary.details;
        let request_id = details["request_id"].as_str().unwrap_or("").to_string();
        let prompt_tokens = details["prompt_tokens"].as_u64().unwrap_or(0);
        let completion_tokens = details["generated_tokens"].as_u64().unwrap_or(0);
        let receipt = &details["receipt"];
        let mut energy = json!({
            "microjoules": receipt["energy_uj"],
            "provenance": receipt["energy_provenance"],
            "receipt": receipt,
            "envelope_hex": summary.bundle.as_ref().map_or(Value::Null, |b| b["mesh1_envelope"].clone()),
        });
        if let Some(bundle) = &summary.bundle {
            let mut kept = self.api.bundles.lock().unwrap_or_else(|p| p.into_inner());
            if kept.len() >= MAX_KEPT_BUNDLES {
                kept.pop_front();
            }
            kept.push_back((request_id.clone(), Arc::new(bundle.clone())));
            energy["bundle"] = json!(format!("/v1/mesh/bundles/{request_id}"));
        }
        energy["request_id"] = json!(request_id);
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "energy": energy,
        })
    }

    /// The coordinator's own reason: `stop` for an end-of-sequence token or
    /// a stop sequence, `length` for max_tokens.
    fn finish_reason(summary: &GenerateSummary) -> &str {
        summary.details["finish_reason"].as_str().unwrap_or("stop")
    }

    /// The whole answer of a request that was not streamed.
    fn whole(&self, summary: GenerateSummary) -> Response {
        self.ended(&summary);
        if let Some(error) = ended_early(&summary) {
            return error.into_response();
        }
        let usage = self.usage(&summary);
        let finish_reason = Self::finish_reason(&summary);
        let choice = match self.flavour {
            Flavour::Completion => json!({
                "index": 0, "text": summary.text, "logprobs": null, "finish_reason": finish_reason,
            }),
            Flavour::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": summary.text},
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
        };
        axum::Json(json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.api.card.id,
            "choices": [choice],
            "usage": usage,
        }))
        .into_response()
    }

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        let choice = match self.flavour {
            Flavour::Completion => json!({
                "index": 0,
                "text": delta.get("content").cloned().unwrap_or(json!("")),
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
            Flavour::Chat => json!({
                "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason,
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.api.card.id,
            "choices": [choice],
        })
    }
}

/// Where a streamed answer stands.
struct StreamState {
    answer: Answer,
    receiver: mpsc::Receiver<Progress>,
    /// The report that decided the status, not yet sent as an event.
    first: Option<Progress>,
    /// Events to send before reading further (the last chunk, `[DONE]`).
    queued: VecDeque<Event>,
    started: bool,
    finished: bool,
    _task: AbortOnDrop,
}

impl Drop for StreamState {
    fn drop(&mut self) {
        // The client went away before the end: the request is cancelled.
        if !self.finished {
            self.answer.cancelled();
        }
    }
}

impl StreamState {
    async fn next_event(&mut self) -> Option<Event> {
        if let Some(event) = self.queued.pop_front() {
            return Some(event);
        }
        if self.finished {
            return None;
        }
        if !self.started {
            self.started = true;
            if self.answer.flavour == Flavour::Chat {
                let chunk = self
                    .answer
                    .chunk(json!({"role": "assistant", "content": ""}), None);
                return Some(Event::default().data(chunk.to_string()));
            }
        }
        let progress = match self.first.take() {
            Some(progress) => progress,
            None => self.receiver.recv().await?,
        };
        match progress {
            Progress::Piece(piece) => {
                let chunk = self.answer.chunk(json!({"content": piece}), None);
                Some(Event::default().data(chunk.to_string()))
            }
            Progress::Done(Ok(summary)) => {
                self.finished = true;
                self.answer.ended(&summary);
                if let Some(error) = ended_early(&summary) {
                    return Some(Event::default().data(error.body().to_string()));
                }
                let mut last = self
                    .answer
                    .chunk(json!({}), Some(Answer::finish_reason(&summary)));
                last["usage"] = self.answer.usage(&summary);
                self.queued.push_back(Event::default().data("[DONE]"));
                Some(Event::default().data(last.to_string()))
            }
            Progress::Done(Err(error)) => {
                self.finished = true;
                self.answer.refused(&error);
                Some(Event::default().data(refused(&error).body().to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A coordinator that never stops sending tokens.
    struct Endless;

    impl Events for Endless {
        async fn next(&mut self) -> anyhow::Result<GenerateEvent> {
            tokio::task::yield_now().await;
            Ok(GenerateEvent::Token("x".into()))
        }
    }

    /// A streamed answer whose client stopped reading is ended once the
    /// bounded backlog stays full for the stall timeout.
    #[tokio::test]
    async fn a_client_that_stops_reading_ends_its_generation() {
        let (sender, receiver) = mpsc::channel(STREAM_BACKLOG);
        let stall = Duration::from_millis(100);
        let started = std::time::Instant::now();
        let source = Source::of(std::net::Ipv4Addr::LOCALHOST.into());
        tokio::time::timeout(
            Duration::from_secs(10),
            forward(&mut Endless, &sender, source, stall),
        )
        .await
        .expect("the generation ended");
        assert!(started.elapsed() >= stall);
        assert_eq!(receiver.len(), STREAM_BACKLOG, "nothing past the backlog");
    }
}
