//! `mesh-node bench api`: the same greedy request, in alternating rounds,
//! through the coordinator's HTTP API (streamed, as an OpenAI client reads
//! it) and as a `generate --coordinator` requester on QUIC, on one
//! three-node split in this process: time to first token, decode tokens/s,
//! and what the API layer adds per token.

use crate::tools::bench::{completed, median};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};

/// A prompt a base or chat model continues for many tokens.
const PROMPT: &str = "Once upon a time, in a small village by the sea, there lived";

/// One measured request.
#[derive(Debug, Clone, Copy)]
struct Timing {
    first_token: Duration,
    total: Duration,
    tokens: usize,
}

impl Timing {
    fn decode_rate(&self) -> f64 {
        let decode = self.total.saturating_sub(self.first_token).as_secs_f64();
        (self.tokens.saturating_sub(1)) as f64 / decode.max(1e-9)
    }
}

async fn over_quic(coordinator: &PeerAddr, tokens: usize) -> anyhow::Result<Timing> {
    let request = GenerateRequest::greedy(PROMPT, tokens);
    let started = Instant::now();
    let mut first: Option<Duration> = None;
    let summary = generate_remote(coordinator, &request, &mut |piece| {
        if first.is_none() && !piece.is_empty() {
            first = Some(started.elapsed());
        }
    })
    .await
    .and_then(completed)?;
    let total = started.elapsed();
    Ok(Timing {
        first_token: first.unwrap_or(total),
        total,
        tokens: summary.details["generated_tokens"].as_u64().unwrap_or(0) as usize,
    })
}

/// A streamed `/v1/completions` request read as server-sent events.
fn over_http(api: SocketAddr, model: &str, tokens: usize) -> anyhow::Result<Timing> {
    let body = json!({
        "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": true,
    })
    .to_string();
    let started = Instant::now();
    let mut stream = TcpStream::connect(api)?;
    stream.set_read_timeout(Some(Duration::from_secs(600)))?;
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: {api}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut first: Option<Duration> = None;
    let mut generated = 0;
    for line in BufReader::new(stream).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return Ok(Timing {
                first_token: first.context("no token arrived")?,
                total: started.elapsed(),
                tokens: generated,
            });
        }
        let chunk: Value = serde_json::from_str(data)?;
        if let Some(error) = chunk.get("error") {
            bail!("the API answered {error}");
        }
        if let Some(usage) = chunk.get("usage") {
            generated = usage["completion_tokens"].as_u64().unwrap_or(0) as usize;
        }
        let text = chunk["choices"][0]["text"].as_str().unwrap_or("");
        if first.is_none() && !text.is_empty() {
            first = Some(started.elapsed());
        }
    }
    bail!("the stream ended without [DONE]")
}

pub async fn bench_api(model: &Path, tokens: usize, rounds: usize) -> anyhow::Result<Value> {
    let split = crate::tools::bench_split::BenchSplit::start(
        model,
        3,
        Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        mesh_protocol::block::ReturnMode::Relayed,
        &mesh_stage::Device::Cpu,
    )
    .await?;
    let coordinator = &split.coordinator;
    let api = coordinator.http_addr().context("the API did not start")?;
    let model_id = coordinator.model_id();
    let peer = coordinator.peer_addr();
    // Warm up both paths (assignment, slice loads, connections).
    over_quic(&peer, 2).await?;
    let warm = model_id.clone();
    tokio::task::spawn_blocking(move || over_http(api, &warm, 2)).await??;
    let mut quic = Vec::new();
    let mut http = Vec::new();
    for _ in 0..rounds.max(1) {
        // On a worker, as the API's own requests run, not on this thread.
        let to = peer.clone();
        quic.push(tokio::spawn(async move { over_quic(&to, tokens).await }).await??);
        let id = model_id.clone();
        http.push(tokio::task::spawn_blocking(move || over_http(api, &id, tokens)).await??);
    }
    split.shutdown().await;
    let summary = |runs: &[Timing]| {
        json!({
            "first_token_ms": median(runs.iter().map(|t| t.first_token.as_secs_f64() * 1e3)),
            "total_ms": median(runs.iter().map(|t| t.total.as_secs_f64() * 1e3)),
            "decode_tokens_per_s": median(runs.iter().map(Timing::decode_rate)),
            "tokens": runs.first().map_or(0, |t| t.tokens),
        })
    };
    let (q, h) = (summary(&quic), summary(&http));
    let per_token_us =
        (h["total_ms"].as_f64().unwrap_or(0.0) - q["total_ms"].as_f64().unwrap_or(0.0)) * 1e3
            / (tokens.max(1) as f64);
    Ok(json!({
        "benchmark": "api",
        "model": model.display().to_string(),
        "stages": 3,
        "rounds": rounds,
        "max_tokens": tokens,
        "generate_coordinator": q,
        "http_api_streamed": h,
        "ratio_decode_api_to_quic": h["decode_tokens_per_s"].as_f64().unwrap_or(0.0)
            / q["decode_tokens_per_s"].as_f64().unwrap_or(1.0).max(1e-9),
        "api_first_token_extra_ms": h["first_token_ms"].as_f64().unwrap_or(0.0)
            - q["first_token_ms"].as_f64().unwrap_or(0.0),
        "api_cost_per_token_us": per_token_us,
    }))
}

pub fn render_api(report: &Value) -> String {
    let row = |name: &str, r: &Value| {
        format!(
            "  {name:<28} first token {:>7.1} ms   decode {:>6.1} tok/s   total {:>7.1} ms ({} tokens)\n",
            r["first_token_ms"].as_f64().unwrap_or(0.0),
            r["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            r["total_ms"].as_f64().unwrap_or(0.0),
            r["tokens"],
        )
    };
    format!(
        "one greedy request over a 3-node split, medians of {} alternating rounds\n{}{}  the API: decode at {:.2}x, first token {:+.1} ms, {:+.0} us per token\n",
        report["rounds"],
        row("generate --coordinator", &report["generate_coordinator"]),
        row("HTTP API, streamed", &report["http_api_streamed"]),
        report["ratio_decode_api_to_quic"].as_f64().unwrap_or(0.0),
        report["api_first_token_extra_ms"].as_f64().unwrap_or(0.0),
        report["api_cost_per_token_us"].as_f64().unwrap_or(0.0),
    )
}
