//! Answering a request: run it on the coordinator, then reply whole or
//! stream it as server-sent events, ending the generation when the client
//! goes away.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::api::{Api, ApiError, MAX_KEPT_BUNDLES, STALLED_READER_TIMEOUT, STREAM_BACKLOG};
use super::body::{Flavour, Prepared};
use super::console::console_entry;
use super::gate::{Full, Joined, Pass, Queued};
use crate::runtime::client::{GenerateEvent, GenerateRequest, GenerateSummary, generate_events};
use crate::runtime::limit::Source;
use crate::runtime::net::peers::PeerAddr;

/// What the generating task reports.
pub(super) enum Progress {
    Piece(String),
    Done(anyhow::Result<GenerateSummary>),
}

/// Generate `request`, handing each piece and the end to `sender`.
pub(super) async fn generate_into(
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

impl Events for crate::runtime::client::Generating {
    fn next(&mut self) -> impl Future<Output = anyhow::Result<GenerateEvent>> + Send {
        crate::runtime::client::Generating::next(self)
    }
}

/// Hand `events` to `sender` to the end. A client that takes nothing for
/// `stall` ends the request: returning drops the generation, which closes
/// its connection to the coordinator and cancels it on every stage, so a
/// reader that went silent does not hold a cache to the last token.
pub(super) async fn forward(
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
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(super) async fn run(api: Arc<Api>, prepared: Prepared, source: Source) -> Response {
    let Prepared {
        flavour,
        request,
        stream,
        fell_back,
    } = prepared;
    let mut response = answer(api.clone(), flavour, request, stream, source).await;
    if fell_back && let Ok(served) = HeaderValue::from_str(&api.card.id) {
        // The model asked for is not served here: this one answered.
        response
            .headers_mut()
            .insert(HeaderName::from_static(MODEL_FALLBACK_HEADER), served);
    }
    response
}

/// The header that names the model that answered a request naming
/// another.
pub(super) const MODEL_FALLBACK_HEADER: &str = "x-mesh-model-fallback";

async fn answer(
    api: Arc<Api>,
    flavour: Flavour,
    request: GenerateRequest,
    stream: bool,
    source: Source,
) -> Response {
    // A cache at the coordinator, in this source's turn; held by the
    // generating task, so it is given back when the generation ends. A
    // streamed request that waits for one is answered at once with its
    // place in the queue, and streams once its turn comes.
    let pass = match api.gate.join(source) {
        Ok(Joined::Admitted(pass)) => pass,
        Ok(Joined::Queued(queued)) if stream => {
            return queued_stream(api, flavour, request, source, queued);
        }
        Ok(Joined::Queued(queued)) => match queued.wait().await {
            Ok(pass) => pass,
            Err(full) => return busy(&api, source, full).into_response(),
        },
        Err(full) => return busy(&api, source, full).into_response(),
    };
    let (answer, mut receiver, task) = start(api, flavour, request, source, pass);
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
    Sse::new(stream_of(StreamState::new(
        answer,
        receiver,
        Some(first),
        task,
    )))
    .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
    .into_response()
}

/// No cache for `source`'s request: 429, with when to try again (503
/// when the node is shutting down).
fn busy(api: &Api, source: Source, full: Full) -> ApiError {
    api.log_failure(source, &format!("busy: {full}"));
    if full == Full::Closed {
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, full.to_string())
            .code("shutting_down");
    }
    let mut error = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        format!("the API is busy: {full}"),
    )
    .code("busy");
    error.retry_after = Some(1);
    error
}

/// Run `request` on the coordinator holding `pass`: what the answer is
/// made of, the reports, and the task (ended when dropped).
fn start(
    api: Arc<Api>,
    flavour: Flavour,
    request: GenerateRequest,
    source: Source,
    pass: Pass,
) -> (Answer, mpsc::Receiver<Progress>, AbortOnDrop) {
    let max_tokens = request.max_tokens;
    let (sender, receiver) = mpsc::channel(STREAM_BACKLOG);
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
    (answer, receiver, task)
}

/// The events of a stream, one per report.
type EventStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Event, Infallible>> + Send>>;

fn stream_of(state: StreamState) -> EventStream {
    Box::pin(futures_util::stream::unfold(
        state,
        |mut state| async move {
            let event = state.next_event().await?;
            Some((Ok::<Event, Infallible>(event), state))
        },
    ))
}

/// A streamed request that waits for a cache: a comment with how many
/// requests were waiting before it comes at once (an SSE comment, which
/// clients skip), then the answer once its turn comes; a wait that ends
/// without one is an error event (the status, 200, was sent already).
fn queued_stream(
    api: Arc<Api>,
    flavour: Flavour,
    request: GenerateRequest,
    source: Source,
    queued: Queued,
) -> Response {
    use futures_util::StreamExt;
    let place = Event::default().comment(format!(
        "queued: {} request(s) ahead; this answer streams when a place comes free",
        queued.ahead()
    ));
    let turn = futures_util::stream::once(async move {
        match queued.wait().await {
            Ok(pass) => {
                let (answer, receiver, task) = start(api, flavour, request, source, pass);
                stream_of(StreamState::new(answer, receiver, None, task))
            }
            Err(full) => {
                let error = busy(&api, source, full).body().to_string();
                let event: EventStream = Box::pin(futures_util::stream::iter([
                    Ok(Event::default().data(error)),
                    Ok(Event::default().data("[DONE]")),
                ]));
                event
            }
        }
    })
    .flatten();
    let events =
        futures_util::stream::once(async move { Ok::<Event, Infallible>(place) }).chain(turn);
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// Lists a request that was not streamed as cancelled if its handler is
/// dropped before the answer.
pub(super) struct Waiting<'a> {
    pub(super) answer: &'a Answer,
    pub(super) settled: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.answer.cancelled();
        }
    }
}

/// Why the coordinator would not serve: the status OpenAI clients expect.
pub(super) fn refused(error: &anyhow::Error) -> ApiError {
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
pub(super) fn completion_id(flavour: Flavour) -> String {
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
pub(super) fn ended_early(summary: &GenerateSummary) -> Option<ApiError> {
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
pub(super) struct Answer {
    pub(super) api: Arc<Api>,
    pub(super) flavour: Flavour,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) max_tokens: usize,
    pub(super) source: Source,
}

impl Answer {
    /// The console lists the request as refused; one that never reached
    /// the coordinator (which logs what it refuses) is logged here.
    pub(super) fn refused(&self, error: &anyhow::Error) {
        let why = format!("{error:#}");
        if !why.contains("the coordinator refused") {
            self.api.log_failure(self.source, &why);
        }
        self.api
            .publish(json!({"id": self.id, "state": "refused", "max_tokens": self.max_tokens}));
    }

    /// The generation stopped without a summary or an error (its task
    /// ended): said, and logged.
    pub(super) fn ended_without_an_answer(&self) -> Response {
        let why = "the request ended without an answer";
        self.api.log_failure(self.source, why);
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, why).into_response()
    }

    /// The console lists the request as cancelled by its client.
    pub(super) fn cancelled(&self) {
        self.api
            .publish(json!({"id": self.id, "state": "cancelled", "max_tokens": self.max_tokens}));
    }

    /// The console lists the request as it ended.
    pub(super) fn ended(&self, summary: &GenerateSummary) {
        self.api.publish(console_entry(&self.id, summary));
    }

    pub(super) fn object(&self, chunk: bool) -> &'static str {
        match (self.flavour, chunk) {
            (Flavour::Completion, _) => "text_completion",
            (Flavour::Chat, false) => "chat.completion",
            (Flavour::Chat, true) => "chat.completion.chunk",
        }
    }

    /// Token counts and the energy of the request; the bundle is kept for
    /// its link.
    pub(super) fn usage(&self, summary: &GenerateSummary) -> Value {
        let details = &summary.details;
        let request_id = details["request_id"].as_str().unwrap_or("").to_string();
        let prompt_tokens = details["prompt_tokens"].as_u64().unwrap_or(0);
        let completion_tokens = details["generated_tokens"].as_u64().unwrap_or(0);
        let receipt = &details["receipt"];
        // Every served span (the coordinator's and each stage's, from
        // their own receipts), never the coordinator's alone as the whole.
        let spans = &details["energy"];
        let mut energy = json!({
            "microjoules": spans["served_span_uj"],
            "provenance": spans["provenance"],
            "covers": spans["covers"],
            "parts": spans["parts"],
            "stages_without_receipt": spans["stages_without_receipt"],
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
    pub(super) fn finish_reason(summary: &GenerateSummary) -> &str {
        summary.details["finish_reason"].as_str().unwrap_or("stop")
    }

    /// The whole answer of a request that was not streamed.
    pub(super) fn whole(&self, summary: GenerateSummary) -> Response {
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

    pub(super) fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
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
pub(super) struct StreamState {
    pub(super) answer: Answer,
    pub(super) receiver: mpsc::Receiver<Progress>,
    /// The report that decided the status, not yet sent as an event.
    pub(super) first: Option<Progress>,
    /// Events to send before reading further (the last chunk, `[DONE]`).
    pub(super) queued: VecDeque<Event>,
    pub(super) started: bool,
    pub(super) finished: bool,
    pub(super) _task: AbortOnDrop,
}

impl StreamState {
    fn new(
        answer: Answer,
        receiver: mpsc::Receiver<Progress>,
        first: Option<Progress>,
        task: AbortOnDrop,
    ) -> Self {
        Self {
            answer,
            receiver,
            first,
            queued: VecDeque::new(),
            started: false,
            finished: false,
            _task: task,
        }
    }
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
    pub(super) async fn next_event(&mut self) -> Option<Event> {
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

/// Where a generation's events come from: the coordinator, or a test.
pub(super) trait Events {
    fn next(&mut self) -> impl Future<Output = anyhow::Result<GenerateEvent>> + Send;
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
