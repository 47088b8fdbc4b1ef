//! `mesh-node bench wan`: a split served through UDP delay proxies on
//! 127.0.0.1, one in front of every node, so each link between two nodes
//! has the round-trip time asked for. Reports the time per output token
//! minus the engine's compute, next to two anchors: the floor (the one-way
//! delays a token's activations cross going around the chain: relayed
//! return crosses every link twice, direct return once plus the final
//! stage's link back to the coordinator) and Mesh-LLM's published cost of
//! 2 x RTT + 4.9 ms per stage boundary.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use mesh_protocol::block::ReturnMode;
use serde_json::{Value, json};

use crate::cli::node_cli::{bench_options, bench_prompt, tempfile_dir, unsplit_generation};
use crate::runtime::serve::{GenerateRequest, Node, PeerAddr, generate_remote};
use crate::tools::delay_proxy::{DelayProxy, LinkShape};

/// Mesh-LLM's published added time per stage boundary, beyond two round
/// trips (GLM-4.7-Flash split over a 20 ms WAN link: +44.9 ms per token,
/// Mesh-LLM/mesh-llm `docs/skippy/WAN_SPLIT_PERF.md`).
pub const MESH_LLM_BOUNDARY_MS: f64 = 4.9;

/// What `bench wan` measures.
#[derive(Debug, Clone)]
pub struct WanBench {
    pub model: PathBuf,
    pub rtts_ms: Vec<f64>,
    pub stages: Vec<usize>,
    pub jitter_ms: f64,
    pub loss: f64,
    pub tokens: usize,
    pub seed: u64,
}

/// A split whose every node sits behind its own delay proxy.
struct WanSplit {
    coordinator: Node,
    client: PeerAddr,
    stages: Vec<Node>,
    proxies: Vec<DelayProxy>,
    scratch: PathBuf,
}

impl WanSplit {
    async fn start(
        model: &Path,
        stages: usize,
        return_mode: ReturnMode,
        shape: LinkShape,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let scratch = tempfile_dir()?;
        let coordinator_key =
            mesh_protocol::SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?);
        let mut nodes = Vec::new();
        let mut proxies = Vec::new();
        let mut peers = Vec::new();
        for k in 1..stages {
            let node = Node::start(bench_options(
                model,
                &scratch,
                k,
                Vec::new(),
                &coordinator_key,
            )?)
            .await?;
            let proxy = DelayProxy::bind(shape, seed.wrapping_add(k as u64))?;
            proxy.forward_to(node.local_addr()?);
            peers.push(PeerAddr {
                key: node.public_key(),
                addr: proxy.addr(),
            });
            nodes.push(node);
            proxies.push(proxy);
        }
        // The coordinator is told its proxy's address before it binds, so
        // the final stage's direct return crosses a delayed link too.
        let proxy = DelayProxy::bind(shape, seed)?;
        let mut options = bench_options(model, &scratch, 0, peers, &coordinator_key)?;
        options.return_mode = return_mode;
        options.advertise = Some(proxy.addr());
        let coordinator = Node::start(options).await?;
        proxy.forward_to(coordinator.local_addr()?);
        proxies.push(proxy);
        // The requester talks to the coordinator without a delay: the bench
        // is about the links inside the chain.
        let client = PeerAddr {
            key: coordinator.public_key(),
            addr: coordinator.local_addr()?,
        };
        Ok(Self {
            coordinator,
            client,
            stages: nodes,
            proxies,
            scratch,
        })
    }

    async fn shutdown(self) -> Vec<Value> {
        self.coordinator.shutdown().await;
        for node in self.stages {
            node.shutdown().await;
        }
        let counts = self
            .proxies
            .iter()
            .map(|p| {
                let c = p.counts();
                json!({
                    "relayed": c.relayed,
                    "dropped": c.dropped,
                    "mean_late_us": c.mean_late_us,
                    "max_late_us": c.max_late_us,
                })
            })
            .collect();
        drop(self.proxies);
        let _ = std::fs::remove_dir_all(&self.scratch);
        counts
    }
}

/// One-way delays a decode step crosses: relayed return goes down and back
/// up every link; direct return goes down and then straight home.
pub fn hops_per_step(stages: usize, return_mode: ReturnMode) -> usize {
    match return_mode {
        ReturnMode::Relayed => 2 * (stages - 1),
        ReturnMode::Direct => stages,
    }
}

pub async fn bench_wan(bench: &WanBench) -> anyhow::Result<Value> {
    anyhow::ensure!(
        bench.stages.iter().all(|s| (2..=8).contains(s)),
        "--stages takes 2 to 8 stages"
    );
    anyhow::ensure!(
        bench.rtts_ms.iter().all(|r| (0.0..=2_000.0).contains(r)),
        "--rtt-ms takes round-trip times of 0 to 2000 ms"
    );
    anyhow::ensure!(
        (0.0..=0.5).contains(&bench.loss),
        "--loss-percent takes 0 to 50"
    );
    anyhow::ensure!(bench.tokens >= 2, "--tokens must be at least 2");
    let prompt = bench_prompt(&bench.model, None)?;
    let mut rows = Vec::new();
    for &rtt in &bench.rtts_ms {
        let shape = LinkShape {
            one_way: Duration::from_secs_f64(rtt / 2e3),
            jitter: Duration::from_secs_f64(bench.jitter_ms / 1e3),
            loss: bench.loss,
        };
        for &stages in &bench.stages {
            for return_mode in [ReturnMode::Relayed, ReturnMode::Direct] {
                // The compute a token takes, measured next to each row: this
                // machine's speed drifts over a run.
                let unsplit = unsplit_generation(&bench.model, &prompt, true, bench.tokens).await?;
                let compute_ms = 1e3 / unsplit.decode_tokens_per_s.max(1e-9);
                let split = WanSplit::start(&bench.model, stages, return_mode, shape, bench.seed)
                    .await
                    .context("starting the split behind its proxies")?;
                let request = GenerateRequest {
                    chat: true,
                    ..GenerateRequest::greedy(&prompt, bench.tokens)
                };
                // Warm up (handshakes, assignment, slice loads), then measure.
                let warm = generate_remote(
                    &split.client,
                    &GenerateRequest {
                        max_tokens: 2,
                        ..request.clone()
                    },
                    &mut |_| {},
                )
                .await;
                let measured = match warm {
                    Ok(_) => generate_remote(&split.client, &request, &mut |_| {}).await,
                    Err(e) => Err(e),
                };
                let proxies = split.shutdown().await;
                let summary = measured.with_context(|| {
                    format!(
                        "{stages} stages, {} return, {rtt} ms RTT",
                        return_mode.as_str()
                    )
                })?;
                let d = &summary.details;
                let rate = d["decode_tokens_per_s"].as_f64().unwrap_or(0.0);
                let per_token_ms = 1e3 / rate.max(1e-9);
                let hops = hops_per_step(stages, return_mode);
                let floor_ms = hops as f64 * (rtt / 2.0 + bench.jitter_ms / 2.0);
                let overhead_ms = per_token_ms - compute_ms;
                rows.push(json!({
                    "rtt_ms": rtt,
                    "stages": stages,
                    "return_mode": return_mode.as_str(),
                    "generated_tokens": d["generated_tokens"],
                    "ms_per_token": per_token_ms,
                    "compute_ms_per_token": compute_ms,
                    "overhead_ms_per_token": overhead_ms,
                    "one_way_delays_per_token": hops,
                    "floor_ms_per_token": floor_ms,
                    "over_floor_ms": overhead_ms - floor_ms,
                    "mesh_llm_ms_per_token": (stages - 1) as f64 * (2.0 * rtt + MESH_LLM_BOUNDARY_MS),
                    "proxies": proxies,
                }));
            }
        }
    }
    Ok(json!({
        "model": bench.model.display().to_string(),
        "decode_tokens": bench.tokens,
        "jitter_ms": bench.jitter_ms,
        "loss": bench.loss,
        "seed": bench.seed,
        "rows": rows,
    }))
}

/// `bench wan` for people.
pub fn render_wan(report: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model {}  {} decode tokens, greedy; jitter {} ms, loss {:.1} %, seed {}",
        report["model"].as_str().unwrap_or(""),
        report["decode_tokens"],
        report["jitter_ms"],
        100.0 * report["loss"].as_f64().unwrap_or(0.0),
        report["seed"],
    );
    let _ = writeln!(
        out,
        "{:>7} {:>6} {:>8} {:>10} {:>9} {:>12} {:>10} {:>11} {:>12}",
        "RTT ms",
        "stages",
        "return",
        "ms/token",
        "compute",
        "minus comp.",
        "floor",
        "over floor",
        "Mesh-LLM"
    );
    for row in report["rows"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:>7.1} {:>6} {:>8} {:>10.2} {:>9.2} {:>12.2} {:>10.2} {:>11.2} {:>12.1}",
            row["rtt_ms"].as_f64().unwrap_or(0.0),
            row["stages"],
            row["return_mode"].as_str().unwrap_or(""),
            row["ms_per_token"].as_f64().unwrap_or(0.0),
            row["compute_ms_per_token"].as_f64().unwrap_or(0.0),
            row["overhead_ms_per_token"].as_f64().unwrap_or(0.0),
            row["floor_ms_per_token"].as_f64().unwrap_or(0.0),
            row["over_floor_ms"].as_f64().unwrap_or(0.0),
            row["mesh_llm_ms_per_token"].as_f64().unwrap_or(0.0),
        );
    }
    out
}
