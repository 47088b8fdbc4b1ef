//! Nodes in this process on 127.0.0.1 with ephemeral ports, for the tests
//! that drive `Node` directly.

use std::path::{Path, PathBuf};
use std::time::Duration;

use mesh_node::runtime::energy::{EnergyMeter, EstimatorMeter};
use mesh_node::runtime::serve::{
    GenerateRequest, GenerateSummary, GrantedServe, Node, NodeOptions, PeerAddr, generate_remote,
};
use mesh_protocol::SigningKey;
use mesh_protocol::block::ReturnMode;
use mesh_stage::frame::WireDType;

pub fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

pub fn public(key: &SigningKey) -> [u8; 32] {
    key.verifying_key().to_bytes()
}

pub fn synthetic(dir: &Path) -> PathBuf {
    synthetic_with(dir, &mesh_stage::synthetic::SyntheticSpec::default())
}

/// The synthetic model `spec` describes, as an f32 GGUF under `dir`.
pub fn synthetic_with(dir: &Path, spec: &mesh_stage::synthetic::SyntheticSpec) -> PathBuf {
    mesh_stage::synthetic::write_synthetic(
        &dir.join("model"),
        spec,
        &[candle_core::quantized::GgmlDType::F32],
    )
    .unwrap()
    .gguf(candle_core::quantized::GgmlDType::F32)
    .unwrap()
    .to_path_buf()
}

pub struct Setup<'a> {
    pub model: &'a Path,
    pub data: PathBuf,
    pub key: SigningKey,
    pub peers: Vec<PeerAddr>,
    pub coordinators: Vec<[u8; 32]>,
    pub max_requests: usize,
    /// Requests the coordinator lets wait for a place (0: refused at once).
    pub max_queued: usize,
    /// The share of requests the coordinator audits.
    pub audit_rate: f64,
    pub max_slices: usize,
    pub slice_idle: Duration,
    pub step_timeout: Duration,
    pub return_mode: ReturnMode,
    pub prefill_chunk_tokens: usize,
    /// Tokens the coordinator drafts after each sampled token (0: off).
    pub draft_tokens: usize,
    /// The model it drafts with (else prompt lookup).
    pub draft_model: Option<PathBuf>,
    /// The estimator's power: what this node's steward bills per second.
    pub milliwatts: u64,
    /// The power the router's estimate assumes, when not `milliwatts`: a
    /// coordinator that underestimates what its serves cost (to reach the
    /// ceilings its stewards enforce while a serve runs).
    pub estimate_milliwatts: Option<u64>,
    /// Serve the HTTP API (on an ephemeral loopback port).
    pub http: bool,
    /// The hosts and origins the HTTP API answers besides its own.
    pub http_access: mesh_node::runtime::http::Access,
    pub mesh: Option<mesh_node::runtime::serve::MeshSettings>,
    pub stages: Option<usize>,
    /// The fidelity the coordinator rates its model at.
    pub fidelity: mesh_protocol::mesh1::Fidelity,
    /// Checkpoint the node's log for what it sends (stage pushes as bundles).
    pub record_checkpoints: bool,
}

impl<'a> Setup<'a> {
    pub fn new(model: &'a Path, data: PathBuf, key: SigningKey) -> Self {
        Self {
            model,
            data,
            key,
            peers: Vec::new(),
            coordinators: Vec::new(),
            max_requests: 4,
            max_queued: mesh_node::runtime::serve::DEFAULT_MAX_QUEUED,
            audit_rate: mesh_node::runtime::serve::DEFAULT_AUDIT_RATE,
            max_slices: 2,
            slice_idle: Duration::from_secs(600),
            return_mode: ReturnMode::Relayed,
            prefill_chunk_tokens: mesh_node::runtime::serve::DEFAULT_PREFILL_CHUNK_TOKENS,
            draft_tokens: mesh_node::runtime::serve::DEFAULT_DRAFT_TOKENS,
            draft_model: None,
            milliwatts: mesh_node::runtime::energy::DEFAULT_ESTIMATOR_MILLIWATTS,
            estimate_milliwatts: None,
            step_timeout: Duration::from_secs(20),
            http: false,
            http_access: Default::default(),
            mesh: None,
            stages: None,
            fidelity: mesh_node::runtime::serve::DEFAULT_FIDELITY,
            record_checkpoints: true,
        }
    }

    /// Stage `name` (key `seed`) serving the coordinator of key 1.
    pub fn stage(model: &'a Path, dir: &Path, name: &str, seed: u8) -> Self {
        let mut stage = Self::new(model, dir.join(name), key(seed));
        stage.coordinators = vec![public(&key(1))];
        stage
    }

    /// The coordinator (key 1) over `peers`.
    pub fn coordinator(model: &'a Path, dir: &Path, peers: Vec<PeerAddr>) -> Self {
        let mut coordinator = Self::new(model, dir.join("a"), key(1));
        coordinator.peers = peers;
        coordinator
    }

    pub async fn start(self) -> Node {
        self.try_start().await.unwrap()
    }

    pub async fn try_start(self) -> anyhow::Result<Node> {
        Node::start(NodeOptions {
            key: self.key,
            listen: "127.0.0.1:0".parse().unwrap(),
            advertise: None,
            model: self.model.to_path_buf(),
            device: mesh_stage::Device::Cpu,
            data: self.data,
            peers: self.peers,
            coordinators: self.coordinators,
            max_slices: self.max_slices,
            slice_idle: self.slice_idle,
            stage_seal_deadline: Duration::from_millis(500),
            step_timeout: self.step_timeout,
            request_timeout: mesh_node::runtime::serve::DEFAULT_REQUEST_TIMEOUT,
            max_requests: self.max_requests,
            max_queued: self.max_queued,
            return_mode: self.return_mode,
            prefill_chunk_tokens: self.prefill_chunk_tokens,
            draft_tokens: self.draft_tokens,
            draft_model: self.draft_model,
            max_resumes: mesh_node::runtime::serve::DEFAULT_MAX_RESUMES,
            audit_rate: self.audit_rate,
            audit_pause: mesh_node::runtime::serve::DEFAULT_AUDIT_PAUSE,
            audit_tapes: None,
            wire: WireDType::F32,
            meter: match self.estimate_milliwatts {
                None => Box::new(EstimatorMeter {
                    milliwatts: self.milliwatts,
                }),
                Some(estimates) => Box::new(Underestimating {
                    bills: EstimatorMeter {
                        milliwatts: self.milliwatts,
                    },
                    estimates: EstimatorMeter {
                        milliwatts: estimates,
                    },
                }),
            },
            http: self
                .http
                .then(|| std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            http_access: self.http_access,
            mesh: self.mesh,
            stages: self.stages,
            fidelity: self.fidelity,
            record_checkpoints: self.record_checkpoints,
        })
        .await
    }
}

/// A meter that bills at one power and has the router estimate at
/// another.
#[derive(Debug)]
struct Underestimating {
    bills: EstimatorMeter,
    estimates: EstimatorMeter,
}

impl EnergyMeter for Underestimating {
    fn name(&self) -> &str {
        "estimator"
    }
    fn begin(&self) -> mesh_node::runtime::energy::MeterSpan {
        self.bills.begin()
    }
    fn end(&self, span: mesh_node::runtime::energy::MeterSpan) -> mesh_protocol::mesh1::Energy {
        self.bills.end(span)
    }
    fn estimator(&self) -> EstimatorMeter {
        self.estimates.clone()
    }
}

/// A coordinator (key 1) over two stages (keys 2 and 3) that serve it.
pub async fn three_nodes(model: &Path, dir: &Path) -> (Node, Node, Node) {
    let b = Setup::stage(model, dir, "b", 2).start().await;
    let c = Setup::stage(model, dir, "c", 3).start().await;
    let a = Setup::coordinator(model, dir, vec![b.peer_addr(), c.peer_addr()]);
    (a.start().await, b, c)
}

pub fn request(prompt: &str, max_tokens: usize, grant: Option<GrantedServe>) -> GenerateRequest {
    GenerateRequest {
        grant,
        ..GenerateRequest::greedy(prompt, max_tokens)
    }
}

/// The `mesh/1` receipt a request's bundle carries, verified.
pub fn receipt_of(summary: &GenerateSummary) -> mesh_protocol::mesh1::MeshReceipt {
    let bundle = summary.bundle.as_ref().expect("a bundle");
    let envelope = mesh_protocol::hex::decode(bundle["mesh1_envelope"].as_str().unwrap()).unwrap();
    mesh_protocol::mesh1::SealedReceipt::verify(&envelope)
        .unwrap()
        .receipt
}

pub async fn ask(
    coordinator: &PeerAddr,
    request: &GenerateRequest,
) -> anyhow::Result<GenerateSummary> {
    generate_remote(coordinator, request, &mut |_| {}).await
}

/// Each prompt asked alone, one after another, then all of them at once
/// (greedy, `max_tokens` each): both lists of answers in prompt order,
/// every one of them served without an error.
pub async fn alone_then_at_once(
    coordinator: &PeerAddr,
    prompts: &[String],
    max_tokens: usize,
) -> (Vec<GenerateSummary>, Vec<GenerateSummary>) {
    let mut alone = Vec::new();
    for prompt in prompts {
        let summary = ask(coordinator, &request(prompt, max_tokens, None))
            .await
            .unwrap();
        assert!(summary.error.is_none(), "{:?}", summary.error);
        alone.push(summary);
    }
    let at_once: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            let (coordinator, request) = (coordinator.clone(), request(prompt, max_tokens, None));
            tokio::spawn(async move { ask(&coordinator, &request).await })
        })
        .collect();
    let mut together = Vec::new();
    for task in at_once {
        let summary = task.await.unwrap().unwrap();
        assert!(summary.error.is_none(), "{:?}", summary.error);
        together.push(summary);
    }
    (alone, together)
}

/// What a request that was to be refused said: the error its summary
/// carries, or the one it ended with.
pub fn refusal(outcome: anyhow::Result<GenerateSummary>) -> String {
    match outcome {
        Ok(summary) => summary.error.unwrap_or_default(),
        Err(error) => format!("{error:#}"),
    }
}

/// `mesh-node verify --json` on a bundle: its exit code and report.
pub fn verify(dir: &Path, bundle: &serde_json::Value) -> (i32, serde_json::Value) {
    let path = dir.join("bundle.json");
    std::fs::write(&path, serde_json::to_vec(bundle).unwrap()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mesh-node"))
        .args(["verify", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        serde_json::from_slice(&out.stdout).unwrap(),
    )
}

/// No lane of a verified bundle reads as tampering.
pub fn no_lane_breaks(report: &serde_json::Value) {
    let lanes = report["lanes"].as_array().unwrap();
    assert!(
        lanes.iter().all(|lane| lane["state"] != "break"),
        "a healthy hop reads as tampered: {report:#}"
    );
}

/// A QUIC client proving `identity`, connected to `node` on `alpn`.
pub async fn connect(
    identity: &mesh_node::runtime::net::tls::TlsIdentity,
    node: &PeerAddr,
    alpn: &'static [u8],
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    mesh_node::runtime::net::tls::install_provider();
    let mut endpoint = quinn::Endpoint::client((std::net::Ipv4Addr::LOCALHOST, 0).into())?;
    endpoint.set_default_client_config(mesh_node::runtime::net::tls::client_config(
        identity, node.key, alpn,
    )?);
    let connection = tokio::time::timeout(
        Duration::from_secs(5),
        endpoint.connect(node.addr, "mesh-node")?,
    )
    .await??;
    Ok((endpoint, connection))
}

/// A stand-in stage 2 that accepts its assignment and every request, and
/// never answers a step: requests through it stall until it is closed.
pub async fn stalling_stage(key: &SigningKey) -> (quinn::Endpoint, PeerAddr) {
    let (endpoint, peer, _) = observed_stalling_stage(key).await;
    (endpoint, peer)
}

/// The stalling stage, and the ids of the requests opened on it.
pub async fn observed_stalling_stage(
    key: &SigningKey,
) -> (
    quinn::Endpoint,
    PeerAddr,
    std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
) {
    scripted_stage(key, std::sync::Arc::new(|_, _| None)).await
}

/// A stage's reply to ACTIVATIONS of (request id, step): a message body to
/// send back on the same stream, or none.
pub type Script = std::sync::Arc<dyn Fn(u64, u32) -> Option<Vec<u8>> + Send + Sync>;

/// `observed_stalling_stage`, but answering each ACTIVATIONS as `script`
/// says: a final stage that replies what a test chooses.
pub async fn scripted_stage(
    key: &SigningKey,
    script: Script,
) -> (
    quinn::Endpoint,
    PeerAddr,
    std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
) {
    let opened = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = opened.clone();
    mesh_node::runtime::net::tls::install_provider();
    let identity = mesh_node::runtime::net::tls::TlsIdentity::new(key).unwrap();
    let endpoint = quinn::Endpoint::server(
        mesh_node::runtime::net::tls::server_config(
            &identity,
            &[
                mesh_node::runtime::net::ALPN_CONTROL,
                mesh_node::runtime::net::ALPN_STAGE,
                mesh_node::runtime::net::ALPN_RECORD_PUSH,
            ],
        )
        .unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    let peer = PeerAddr {
        key: public(key),
        addr: endpoint.local_addr().unwrap(),
    };
    let accepting = endpoint.clone();
    tokio::spawn(async move {
        while let Some(incoming) = accepting.accept().await {
            let seen = seen.clone();
            let script = script.clone();
            tokio::spawn(async move {
                let Ok(connection) = incoming.await else {
                    return;
                };
                while let Ok((mut send, mut recv)) = connection.accept_bi().await {
                    let seen = seen.clone();
                    let script = script.clone();
                    tokio::spawn(async move {
                        let mut held = Vec::new();
                        while let Ok(Some(frame)) = mesh_node::runtime::net::msg::read(
                            &mut recv,
                            mesh_node::runtime::net::msg::MAX_STAGE_MESSAGE,
                            Duration::from_secs(600),
                        )
                        .await
                        {
                            if let Ok((
                                mesh_node::runtime::net::msg::kind::OPEN,
                                request_id,
                                _,
                                _,
                            )) = mesh_node::runtime::net::msg::parse_stage(&frame)
                            {
                                seen.lock().unwrap().push(request_id);
                            }
                            if let Ok((
                                mesh_node::runtime::net::msg::kind::ACTIVATIONS,
                                request_id,
                                step,
                                _,
                            )) = mesh_node::runtime::net::msg::parse_stage(&frame)
                                && let Some(body) = script(request_id, step)
                            {
                                let _ = mesh_node::runtime::net::msg::write(&mut send, &body).await;
                            }
                            if let Ok(message) = mesh_protocol::cbor::Cbor::decode(&frame[4..])
                                && message
                                    .get("kind")
                                    .and_then(mesh_protocol::cbor::Cbor::as_text)
                                    == Some("assign")
                            {
                                // Keeps its slice ten minutes, so the
                                // coordinator does not assign again before
                                // every request.
                                let ready = mesh_protocol::control::ControlReply::Ready {
                                    weights_digest: [0; 32],
                                    resident_bytes: 0,
                                    max_requests: 8,
                                    slice_idle_ms: 600_000,
                                };
                                let _ = mesh_node::runtime::net::msg::write_cbor(
                                    &mut send,
                                    &ready.to_cbor(),
                                )
                                .await;
                                let _ = send.finish();
                            }
                            held.push(frame);
                        }
                    });
                }
            });
        }
    });
    (endpoint, peer, opened)
}

pub async fn all_stats(nodes: &[Node]) -> Vec<mesh_node::runtime::serve::NodeStats> {
    let mut stats = Vec::new();
    for node in nodes {
        stats.push(node.stats().await);
    }
    stats
}

/// Wait until every pool of `nodes` is empty, polling; fails past `bound`
/// (counted from `since`) with the stats it last saw.
pub async fn pools_empty_within(
    nodes: &[Node],
    since: std::time::Instant,
    bound: Duration,
    what: &str,
) {
    loop {
        let stats = all_stats(nodes).await;
        if stats
            .iter()
            .all(mesh_node::runtime::serve::NodeStats::pools_empty)
        {
            return;
        }
        assert!(
            since.elapsed() < bound,
            "still held {:?} after {what}: {stats:#?}",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Wait until the coordinator has counted its one cancelled request: it
/// seals a cancelled request (its stages' records, its receipt) first.
pub async fn cancel_counted_within(coordinator: &Node, since: std::time::Instant, bound: Duration) {
    while coordinator.stats().await.requests_cancelled == 0 {
        assert!(since.elapsed() < bound, "never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A root grant of `budget_uj` to a holder, sharded evenly over the
/// stewards of `coordinator`'s split: (shards file, holder key file).
pub async fn grants(dir: &Path, coordinator: &Node, budget_uj: u64) -> (PathBuf, PathBuf) {
    grants_for_weights(dir, coordinator, budget_uj, &[]).await
}

/// [`grants`], the root restricted to the weights `model_in` (a ModelIn
/// caveat of weights digests in hex; none: no restriction).
pub async fn grants_for_weights(
    dir: &Path,
    coordinator: &Node,
    budget_uj: u64,
    model_in: &[String],
) -> (PathBuf, PathBuf) {
    let owner = dir.join("owner.key");
    let holder = dir.join("holder.key");
    std::fs::write(&owner, mesh_protocol::hex::encode(&[5u8; 32])).unwrap();
    std::fs::write(&holder, mesh_protocol::hex::encode(&[6u8; 32])).unwrap();
    let root = dir.join("root.grant");
    let shards = dir.join("shards.cbor");
    mesh_node::cli::node_cli::grant_issue(
        &owner,
        &mesh_protocol::identity::did_key(&public(&key(6))),
        budget_uj,
        Duration::from_secs(3600),
        (None, model_in),
        &root,
    )
    .unwrap();
    mesh_node::cli::node_cli::grant_shard(
        &root,
        &holder,
        &coordinator.peer_addr().to_string(),
        &shards,
    )
    .await
    .unwrap();
    (shards, holder)
}

/// A request riding on the shards, one presentation per steward.
pub fn granted(
    shards: &Path,
    holder: &Path,
    prompt: &str,
    max_tokens: usize,
    ceiling_uj: u64,
) -> GrantedServe {
    let serve = GrantedServe::derive(prompt, max_tokens, 4, ceiling_uj);
    let presentations =
        mesh_node::cli::node_cli::presentations_for(shards, holder, &serve).unwrap();
    GrantedServe {
        serve,
        presentations,
    }
}
