//! The listener and its routes: each endpoint reads its request, and
//! answers through [`super::answer`].

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::answer::run;
use super::api::{
    Api, ApiError, BODY_READ_TIMEOUT, CONSOLE_EVENT_BACKLOG, MAX_BODY_BYTES, MAX_CONSOLE_STREAMS,
    MAX_KEPT_BUNDLES, Members, Metrics, ModelCard, Witness,
};
use super::body::{
    Prepared, body_error, chat_prompt, check_chat, check_completion, completion_prompt,
    derive_granted, model_package, parse,
};
use super::console::{console, console_events, console_members, console_requests};
use super::guard::Access;
use crate::runtime::limit::Source;
use crate::runtime::net::peers::PeerAddr;

/// A running HTTP API; dropping it stops the listener.
#[derive(Debug)]
pub struct HttpApi {
    pub(super) addr: SocketAddr,
    pub(super) task: tokio::task::JoinHandle<()>,
    pub(super) gate: super::gate::Gate,
}

impl HttpApi {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests this API is answering now (each holds a place at its gate
    /// until its last byte is written).
    pub fn in_flight(&self) -> usize {
        self.gate.in_flight()
    }

    /// Take no new request (each is answered 503); those being answered
    /// run on.
    pub fn close(&self) {
        self.gate.close();
    }
}

impl Drop for HttpApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serve the API on `listener` (bound before the node's model is opened:
/// `bind`) for the coordinator at `coordinator`, whose slices hold
/// `max_requests` requests at once.
pub async fn start(
    listener: tokio::net::TcpListener,
    access: Access,
    coordinator: PeerAddr,
    card: ModelCard,
    (witness, metrics, members, max_requests): (Witness, Metrics, Members, usize),
) -> anyhow::Result<HttpApi> {
    let addr = listener.local_addr()?;
    let gate = super::gate::Gate::new(max_requests);
    let api = Arc::new(Api {
        coordinator,
        card,
        witness,
        metrics,
        members,
        gate: gate.clone(),
        failures_logged: Mutex::new(crate::runtime::limit::PerMinute::new(60)),
        bundles: Mutex::new(VecDeque::new()),
        requests: Mutex::new(VecDeque::new()),
        events: tokio::sync::broadcast::channel(CONSOLE_EVENT_BACKLOG).0,
        console_streams: Arc::new(tokio::sync::Semaphore::new(MAX_CONSOLE_STREAMS)),
    });
    let router = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
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
        .route("/v1/mesh/members", get(console_members))
        .route("/v1/mesh/events", get(console_events))
        .route("/", get(console))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(api);
    let task = tokio::spawn(super::conn::accept_loop(listener, router, Arc::new(access)));
    Ok(HttpApi { addr, task, gate })
}

/// Bind the API's address, saying which when it cannot be had.
pub async fn bind(listen: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context;
    tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the HTTP API to {listen} (is another node using it?)"))
}

pub(super) async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint").code("not_found")
}

/// Whether the API is up: it answers, and says which model it serves.
/// (Whether the coordinator can serve a request now is `stats`'.)
pub(super) async fn health(State(api): State<Arc<Api>>) -> Response {
    axum::Json(serde_json::json!({ "status": "ok", "model": api.card.id })).into_response()
}

/// `GET /metrics`: the node's figures for a Prometheus scraper (what
/// `mesh-node stats --prometheus` prints).
pub(super) async fn metrics_text(State(api): State<Arc<Api>>) -> Response {
    match (api.metrics)().await {
        Some(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        None => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the node is shutting down")
            .into_response(),
    }
}

pub(super) async fn models(State(api): State<Arc<Api>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [model_object(&api.card)],
    }))
    .into_response()
}

pub(super) fn model_object(card: &ModelCard) -> Value {
    json!({
        "id": card.id,
        "object": "model",
        "created": 0,
        "owned_by": "mesh-node",
        "mesh": {
            "package_id": model_package(card),
            "context_length": card.context,
            "chat_template": card.codec.chat_template().is_ok(),
        },
    })
}

/// The steward's node id: the subject a grant for this coordinator names
/// (seed 001 §2.3).
pub(super) async fn steward(State(api): State<Arc<Api>>) -> Response {
    axum::Json(json!({
        "steward": mesh_protocol::identity::did_key(&api.coordinator.key),
    }))
    .into_response()
}

pub(super) async fn bundle(State(api): State<Arc<Api>>, Path(id): Path<String>) -> Response {
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

/// The body of a POST: JSON only (a form or text body is what a web page
/// can send cross-site without asking first; a body with no type is read
/// as JSON unless a page sent it), read within `BODY_READ_TIMEOUT`.
pub(super) async fn read_body(request: axum::extract::Request) -> Result<Bytes, ApiError> {
    use axum::extract::FromRequest;
    let headers = request.headers();
    let json = match headers.get(header::CONTENT_TYPE) {
        Some(value) => value
            .to_str()
            .is_ok_and(|v| v.trim_start().starts_with("application/json")),
        // A client that names no type (curl -d, a hand-written script) is
        // read as JSON; a browser's page can send a typeless body too, but
        // then names its origin, and is held to the type.
        None => !headers.contains_key(header::ORIGIN),
    };
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

pub(super) fn rejected(rejection: BytesRejection) -> ApiError {
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
pub(super) async fn checked(
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
pub(super) fn source_of(request: &axum::extract::Request) -> Source {
    request
        .extensions()
        .get::<Source>()
        .copied()
        .unwrap_or_else(|| Source::of(std::net::Ipv4Addr::UNSPECIFIED.into()))
}

pub(super) async fn completions(
    State(api): State<Arc<Api>>,
    request: axum::extract::Request,
) -> Response {
    let source = source_of(&request);
    match checked(&api, request, check_completion).await {
        Ok(prepared) => run(api, prepared, source).await,
        Err(error) => error.into_response(),
    }
}

pub(super) async fn chat_completions(
    State(api): State<Arc<Api>>,
    request: axum::extract::Request,
) -> Response {
    let source = source_of(&request);
    match checked(&api, request, check_chat).await {
        Ok(prepared) => run(api, prepared, source).await,
        Err(error) => error.into_response(),
    }
}

/// `POST /v1/mesh/granted_serve_request`: the request a body (completion
/// when it has `prompt`, chat when it has `messages`) is served as.
pub(super) async fn granted_serve_request(
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
pub(super) async fn witness_receipt(
    State(api): State<Arc<Api>>,
    request: axum::extract::Request,
) -> Response {
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
