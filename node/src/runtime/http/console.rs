//! The console: its page, the recent requests and their events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::api::{Api, ApiError, MAX_CONSOLE_STREAMS};
use crate::runtime::client::GenerateSummary;

/// The console: one page, its styles and script inline, no network use.
pub(super) const CONSOLE_HTML: &str = include_str!("console.html");

pub(super) async fn console() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        CONSOLE_HTML,
    )
        .into_response()
}

pub(super) async fn console_requests(State(api): State<Arc<Api>>) -> Response {
    let requests: Vec<Value> = api
        .requests
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .cloned()
        .collect();
    axum::Json(json!({"requests": requests})).into_response()
}

/// The mesh's members: device, memory, measured speed, round trip and the
/// layers each holds now.
pub(super) async fn console_members(State(api): State<Arc<Api>>) -> Response {
    match (api.members)() {
        Some(members) => axum::Json(members).into_response(),
        None => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the node is shutting down")
            .into_response(),
    }
}

/// Server-sent events: one per request that starts or ends.
pub(super) async fn console_events(State(api): State<Arc<Api>>) -> Response {
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
pub(super) fn console_entry(id: &str, summary: &GenerateSummary) -> Value {
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
        // Every served span (the coordinator's and each stage's receipt).
        "energy_uj": details["energy"]["served_span_uj"],
        "energy_provenance": details["energy"]["provenance"],
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
            // A serve one node ran whole has no hops to agree on.
            entry["alone"] = json!(report.form == mesh_protocol::verify::DocumentForm::Mesh1Bundle);
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
