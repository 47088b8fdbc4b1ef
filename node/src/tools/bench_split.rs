//! `mesh-node bench split`: a model decoded unsplit in one process and
//! split over loopback QUIC, side by side, and the harness the other
//! benches start their splits with (`BenchSplit`, each node optionally
//! behind a delay proxy).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use mesh_protocol::block::ReturnMode;
use mesh_stage::DeviceChoice;
use mesh_stage::frame::WireDType;
use mesh_stage::sampling::SamplingParams;

use crate::runtime::energy::EstimatorMeter;
use crate::runtime::serve::{GenerateRequest, Node, NodeOptions, PeerAddr, generate_remote};

use crate::tools::delay_proxy::{DelayProxy, LinkShape, ProxyCounts};

/// `mesh-node bench split`: decode tokens/s unsplit in one process against
/// split over loopback QUIC (2 and 3 stages, relayed and direct return),
/// with the estimated per-hop overhead, the share of time spent folding,
/// and a split token's time in two: the stages' forward passes (set
/// against the unsplit token's) and the rest. Rounds interleave the
/// unsplit run with every split, each round starting one place further
/// along the list, and each ratio is taken within its round (this
/// machine's speed drifts by more than the gaps measured); a row gives
/// the medians over the rounds.
pub async fn bench_split(
    model: PathBuf,
    tokens: usize,
    prompt_tokens: Option<usize>,
    rounds: usize,
    device: DeviceChoice,
) -> anyhow::Result<serde_json::Value> {
    use crate::tools::bench::{completed, median};
    anyhow::ensure!(rounds >= 1, "--rounds must be at least 1");
    let opened = device.open()?;
    // A base model (no chat template, as Gemma 3 270M's file) completes
    // the short prompt as written.
    let handle = mesh_stage::ModelHandle::open(&model)?;
    let chat = prompt_tokens.is_none() && handle.text()?.chat_template().is_ok();
    let prompt = bench_prompt(&model, prompt_tokens)?;
    // A decode step's frame between stages: one row of f32 activations
    // and the frame's header (docs/split-stage.md).
    let frame_bytes = handle.config().hidden * 4 + 64;
    let mut bare_hops = Vec::with_capacity(rounds);
    let configurations = [
        (2usize, ReturnMode::Relayed),
        (3, ReturnMode::Relayed),
        (2, ReturnMode::Direct),
        (3, ReturnMode::Direct),
    ];
    let mut unsplit_runs = Vec::new();
    let mut split_runs: Vec<Vec<serde_json::Value>> = vec![Vec::new(); configurations.len()];
    for round in 0..rounds {
        // Each round starts one place further along (the unsplit run is
        // place 0): over five rounds, or any multiple, a drift within a
        // round favours no configuration.
        let mut measured = Vec::with_capacity(configurations.len());
        let mut unsplit = None;
        bare_hops.push(crate::tools::bare_hop::bare_quic_hop(frame_bytes).await?);
        for place in 0..=configurations.len() {
            let place = (place + round) % (configurations.len() + 1);
            let Some(&(stages, return_mode)) =
                place.checked_sub(1).and_then(|i| configurations.get(i))
            else {
                unsplit = Some(unsplit_generation(&model, &prompt, chat, tokens, &opened).await?);
                continue;
            };
            let split = BenchSplit::start(&model, stages, None, return_mode, &opened).await?;
            let coordinator = &split.coordinator;
            let request = GenerateRequest {
                chat,
                ..GenerateRequest::greedy(&prompt, tokens)
            };
            // Warm up (assignment, slice loads), then measure.
            completed(
                generate_remote(
                    &coordinator.peer_addr(),
                    &GenerateRequest {
                        max_tokens: 2,
                        ..request.clone()
                    },
                    &mut |_| {},
                )
                .await?,
            )?;
            let summary =
                completed(generate_remote(&coordinator.peer_addr(), &request, &mut |_| {}).await?)?;
            split.shutdown().await;
            measured.push((place - 1, summary.details));
        }
        let unsplit = unsplit.context("every round runs the unsplit pipeline")?;
        let unsplit_prefill_ms = unsplit.prefill.as_secs_f64() * 1e3;
        for (i, d) in measured {
            let rate = d["decode_tokens_per_s"].as_f64().unwrap_or(0.0);
            let prefill_ms = d["prefill_ms"].as_f64().unwrap_or(0.0);
            let decode_tokens = crate::tools::bench::decode_tokens(&d);
            // Where a split token's time goes: the stages' forward passes
            // (to set against the unsplit token), and the rest (hops,
            // hand-offs between threads, the coordinator's bookkeeping).
            let engine_ms = d["decode_engine_ms"].as_f64().unwrap_or(0.0) / decode_tokens;
            split_runs[i].push(serde_json::json!({
                "decode_tokens_per_s": rate,
                "engine_ms_per_token": engine_ms,
                "unsplit_ms_per_token": 1e3 / unsplit.decode_tokens_per_s.max(1e-9),
                "rest_ms_per_token": 1e3 / rate.max(1e-9) - engine_ms,
                "ratio_to_unsplit": rate / unsplit.decode_tokens_per_s.max(1e-9),
                "per_hop_overhead_us": d["per_hop_overhead_us"].as_f64().unwrap_or(0.0),
                "fold_share": d["fold_share"].as_f64().unwrap_or(0.0),
                "prompt_tokens": d["prompt_tokens"],
                "prefill_ms": prefill_ms,
                "prefill_ratio_to_unsplit": prefill_ms / unsplit_prefill_ms.max(1e-9),
            }));
        }
        unsplit_runs.push(unsplit);
    }
    let mut rows = vec![serde_json::json!({
        "configuration": "unsplit, in process",
        "stages": 1,
        "decode_tokens_per_s": median(unsplit_runs.iter().map(|u| u.decode_tokens_per_s)),
        "ratio_to_unsplit": 1.0,
        "engine_ms_per_token": median(unsplit_runs.iter().map(|u| 1e3 / u.decode_tokens_per_s.max(1e-9))),
        "ratio_samples": vec![1.0; rounds],
        "prompt_tokens": unsplit_runs[0].prompt_tokens,
        "prefill_ms": median(unsplit_runs.iter().map(|u| u.prefill.as_secs_f64() * 1e3)),
        "prefill_ratio_to_unsplit": 1.0,
    })];
    let bare_hop_us = median(bare_hops.iter().map(|d| d.as_secs_f64() * 1e6));
    for (&(stages, return_mode), runs) in configurations.iter().zip(&split_runs) {
        let of = |key: &str| median(runs.iter().map(|r| r[key].as_f64().unwrap_or(0.0)));
        rows.push(serde_json::json!({
            "configuration": format!("{stages} stages, {}", return_mode.as_str()),
            "stages": stages,
            "return_mode": return_mode.as_str(),
            "decode_tokens_per_s": of("decode_tokens_per_s"),
            "ratio_to_unsplit": of("ratio_to_unsplit"),
            "engine_ms_per_token": of("engine_ms_per_token"),
            "unsplit_ms_per_token": of("unsplit_ms_per_token"),
            "rest_ms_per_token": of("rest_ms_per_token"),
            "ratio_samples": runs.iter().map(|r| r["ratio_to_unsplit"].clone()).collect::<Vec<_>>(),
            "per_hop_overhead_us": of("per_hop_overhead_us"),
            "per_hop_over_bare_quic_us": of("per_hop_overhead_us") - bare_hop_us,
            "fold_share": of("fold_share"),
            "prompt_tokens": runs[0]["prompt_tokens"],
            "prefill_ms": of("prefill_ms"),
            "prefill_ratio_to_unsplit": of("prefill_ratio_to_unsplit"),
        }));
    }
    Ok(serde_json::json!({
        "model": model.display().to_string(),
        "device": device.to_string(),
        "decode_tokens": tokens,
        "rounds": rounds,
        "rows": rows,
        "bare_quic_hop": {
            "frame_bytes": frame_bytes,
            "us_per_hop": bare_hop_us,
            "samples_us": bare_hops.iter().map(|d| d.as_secs_f64() * 1e6).collect::<Vec<_>>(),
        },
    }))
}

/// The prompt the split benches send: a short chat request, or plain text
/// of about `prompt_tokens` tokens.
pub(crate) fn bench_prompt(model: &Path, prompt_tokens: Option<usize>) -> anyhow::Result<String> {
    Ok(match prompt_tokens {
        None => "Write a long story about a dragon who learns to fly.".to_string(),
        Some(wanted) => {
            let handle = mesh_stage::ModelHandle::open(model)?;
            let sentence = "The old harbour town kept its records in a tower by the water, and every ship that came in was written down with its cargo and its crew. ";
            let per = handle.text()?.encode(sentence)?.len().max(1);
            sentence.repeat(wanted.div_ceil(per))
        }
    })
}

/// What one greedy generation took in this process, the whole model in one
/// slice: the reference a split is measured against.
pub(crate) struct UnsplitRun {
    pub decode_tokens_per_s: f64,
    pub prefill: Duration,
    pub prompt_tokens: usize,
}

pub(crate) async fn unsplit_generation(
    model: &Path,
    prompt: &str,
    chat: bool,
    tokens: usize,
    device: &mesh_stage::Device,
) -> anyhow::Result<UnsplitRun> {
    let (model, prompt, device) = (model.to_path_buf(), prompt.to_string(), device.clone());
    tokio::task::spawn_blocking(move || -> anyhow::Result<UnsplitRun> {
        let handle = mesh_stage::ModelHandle::open(&model)?.on_device(device);
        let layers = handle.config().layers;
        let pipeline = mesh_stage::pipeline::Pipeline::new(
            vec![handle.load_slice(0..layers)?],
            WireDType::F32,
        )?;
        let text = if chat {
            handle
                .text()?
                .chat_prompt(&prompt)
                .unwrap_or_else(|_| prompt.clone())
        } else {
            prompt
        };
        let ids = handle.text()?.encode(&text)?;
        let mut sampler = mesh_stage::sampling::Sampler::new(SamplingParams::greedy());
        let generation = pipeline.generate(&ids, tokens, &mut sampler, &|_| false, &mut |_| {})?;
        Ok(UnsplitRun {
            decode_tokens_per_s: generation.timings.decode_tokens_per_s(),
            prefill: generation.timings.prefill,
            prompt_tokens: ids.len(),
        })
    })
    .await?
}

/// `bench split` for people.
pub fn render_split(report: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model {}  {} decode tokens, greedy, f32 activations, prompt of {} tokens, medians of {} rounds",
        report["model"].as_str().unwrap_or(""),
        report["decode_tokens"],
        report["rows"][0]["prompt_tokens"],
        report["rounds"]
    );
    let _ = writeln!(
        out,
        "{:<34} {:>12} {:>8} {:>11} {:>9} {:>12} {:>10} {:>11} {:>8}",
        "configuration",
        "decode tok/s",
        "ratio",
        "engine ms",
        "rest ms",
        "µs/hop/step",
        "folding",
        "prefill ms",
        "ratio"
    );
    for row in report["rows"].as_array().into_iter().flatten() {
        let hop = row["per_hop_overhead_us"]
            .as_f64()
            .map_or("-".to_string(), |us| format!("{us:.0}"));
        let fold = row["fold_share"]
            .as_f64()
            .map_or("-".to_string(), |f| format!("{:.3}%", 100.0 * f));
        let rest = row["rest_ms_per_token"]
            .as_f64()
            .map_or("-".to_string(), |ms| format!("{ms:.2}"));
        let _ = writeln!(
            out,
            "{:<34} {:>12.1} {:>8.3} {:>11.2} {:>9} {:>12} {:>10} {:>11.1} {:>8.3}",
            row["configuration"].as_str().unwrap_or(""),
            row["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            row["ratio_to_unsplit"].as_f64().unwrap_or(0.0),
            row["engine_ms_per_token"].as_f64().unwrap_or(0.0),
            rest,
            hop,
            fold,
            row["prefill_ms"].as_f64().unwrap_or(0.0),
            row["prefill_ratio_to_unsplit"].as_f64().unwrap_or(0.0),
        );
    }
    let bare = &report["bare_quic_hop"];
    let _ = writeln!(
        out,
        "a bare QUIC hop (three endpoints in a ring forwarding {}-byte messages, no stage): {:.0} µs, median of the rounds",
        bare["frame_bytes"],
        bare["us_per_hop"].as_f64().unwrap_or(0.0)
    );
    out
}

pub(crate) fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "mesh-node-bench-split-{}-{}",
        std::process::id(),
        u64::from_le_bytes(crate::runtime::keys::random_bytes()?)
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A split of `stages` nodes on 127.0.0.1 for the benches: stages 1.. start
/// first, then node 0 coordinating them (serving the HTTP API on `http`
/// when given), all with their data in one scratch directory; for the WAN
/// bench, every node behind its own delay proxy.
#[derive(Debug)]
pub struct BenchSplit {
    pub coordinator: Node,
    stages: Vec<Node>,
    proxies: Vec<DelayProxy>,
    scratch: PathBuf,
}

impl BenchSplit {
    /// Every node of the split computes on `device`.
    pub async fn start(
        model: &Path,
        stages: usize,
        http: Option<SocketAddr>,
        return_mode: ReturnMode,
        device: &mesh_stage::Device,
    ) -> anyhow::Result<Self> {
        Self::start_with(
            model,
            stages,
            (http, return_mode),
            device,
            None,
            (0, None),
            0.0,
        )
        .await
    }

    /// A split on the CPU whose coordinator audits `audit_rate` of its
    /// requests.
    pub async fn audited(
        model: &Path,
        stages: usize,
        return_mode: ReturnMode,
        audit_rate: f64,
    ) -> anyhow::Result<Self> {
        let cpu = &mesh_stage::Device::Cpu;
        Self::start_with(
            model,
            stages,
            (None, return_mode),
            cpu,
            None,
            (0, None),
            audit_rate,
        )
        .await
    }

    /// Every node behind its own [`DelayProxy`] shaped `shape` (seeded from
    /// `seed`): each link between two nodes crosses one proxy. The
    /// coordinator drafts `drafts.0` tokens after each sampled token, with
    /// the draft model `drafts.1` when there is one.
    pub async fn behind_proxies(
        model: &Path,
        stages: usize,
        return_mode: ReturnMode,
        (shape, seed): (LinkShape, u64),
        drafts: (usize, Option<&Path>),
    ) -> anyhow::Result<Self> {
        Self::start_with(
            model,
            stages,
            (None, return_mode),
            &mesh_stage::Device::Cpu,
            Some((shape, seed)),
            drafts,
            0.0,
        )
        .await
    }

    async fn start_with(
        model: &Path,
        stages: usize,
        (http, return_mode): (Option<SocketAddr>, ReturnMode),
        device: &mesh_stage::Device,
        links: Option<(LinkShape, u64)>,
        (draft_tokens, draft_model): (usize, Option<&Path>),
        audit_rate: f64,
    ) -> anyhow::Result<Self> {
        let scratch = tempfile_dir()?;
        let coordinator_key =
            mesh_protocol::SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?);
        let mut nodes = Vec::new();
        let mut proxies = Vec::new();
        let mut peers = Vec::new();
        for k in 1..stages {
            let mut options = bench_options(model, &scratch, k, Vec::new(), &coordinator_key)?;
            options.device = device.clone();
            let node = Node::start(options).await?;
            let addr = match links {
                Some((shape, seed)) => {
                    let proxy = DelayProxy::bind(shape, seed.wrapping_add(k as u64))?;
                    proxy.forward_to(node.local_addr()?);
                    let addr = proxy.addr();
                    proxies.push(proxy);
                    addr
                }
                None => node.addr(),
            };
            peers.push(PeerAddr {
                key: node.public_key(),
                addr,
            });
            nodes.push(node);
        }
        // The coordinator is told its proxy's address before it binds, so
        // the final stage's direct return crosses a delayed link too.
        let own_proxy = links
            .map(|(shape, seed)| DelayProxy::bind(shape, seed))
            .transpose()?;
        let mut options = bench_options(model, &scratch, 0, peers, &coordinator_key)?;
        options.device = device.clone();
        options.http = http;
        options.return_mode = return_mode;
        options.draft_tokens = draft_tokens;
        options.draft_model = draft_model.map(Path::to_path_buf);
        options.audit_rate = audit_rate;
        options.advertise = own_proxy.as_ref().map(DelayProxy::addr);
        let coordinator = Node::start(options).await?;
        if let Some(proxy) = own_proxy {
            proxy.forward_to(coordinator.local_addr()?);
            proxies.push(proxy);
        }
        Ok(Self {
            coordinator,
            stages: nodes,
            proxies,
            scratch,
        })
    }

    /// Where a requester reaches the coordinator: its bound address, never
    /// through its proxy (the WAN bench is about the links inside the chain).
    pub fn requester_addr(&self) -> anyhow::Result<PeerAddr> {
        Ok(PeerAddr {
            key: self.coordinator.public_key(),
            addr: self.coordinator.local_addr()?,
        })
    }

    /// Stop every node and remove the scratch directory; what each proxy
    /// did, when there were proxies.
    pub async fn shutdown(self) -> Vec<ProxyCounts> {
        self.coordinator.shutdown().await;
        for node in self.stages {
            node.shutdown().await;
        }
        let counts = self.proxies.iter().map(DelayProxy::counts).collect();
        drop(self.proxies);
        let _ = std::fs::remove_dir_all(&self.scratch);
        counts
    }
}

/// Bench nodes: node 0 coordinates with `coordinator_key`, the others
/// serve it.
pub(crate) fn bench_options(
    model: &Path,
    scratch: &Path,
    k: usize,
    peers: Vec<PeerAddr>,
    coordinator_key: &mesh_protocol::SigningKey,
) -> anyhow::Result<NodeOptions> {
    Ok(NodeOptions {
        key: if k == 0 {
            coordinator_key.clone()
        } else {
            mesh_protocol::SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?)
        },
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        advertise: None,
        model: model.to_path_buf(),
        device: mesh_stage::Device::Cpu,
        data: scratch.join(format!("node-{k}")),
        peers,
        coordinators: vec![coordinator_key.verifying_key().to_bytes()],
        max_slices: crate::runtime::serve::DEFAULT_MAX_SLICES,
        slice_idle: crate::runtime::serve::DEFAULT_SLICE_IDLE,
        stage_seal_deadline: crate::runtime::records::DEFAULT_DEADLINE,
        step_timeout: Duration::from_secs(60),
        request_timeout: crate::runtime::serve::DEFAULT_REQUEST_TIMEOUT,
        max_requests: 2,
        max_queued: 0,
        prefill_chunk_tokens: crate::runtime::serve::DEFAULT_PREFILL_CHUNK_TOKENS,
        // Benches measure plain decoding unless they ask for drafts.
        draft_tokens: 0,
        draft_model: None,
        max_resumes: crate::runtime::serve::DEFAULT_MAX_RESUMES,
        // Benches measure serving; an audit would share the cores.
        audit_rate: 0.0,
        audit_pause: crate::runtime::serve::DEFAULT_AUDIT_PAUSE,
        audit_tapes: None,
        return_mode: ReturnMode::Relayed,
        wire: WireDType::F32,
        meter: Box::new(EstimatorMeter::default()),
        http: None,
        http_access: Default::default(),
        mesh: None,
        stages: None,
        fidelity: crate::runtime::serve::DEFAULT_FIDELITY,
        record_checkpoints: true,
    })
}
