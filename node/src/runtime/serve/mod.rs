//! A serving node: stage server for any coordinator, and coordinator over
//! its configured peers. All I/O of split serving lives here.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use mesh_protocol::SigningKey;
use mesh_protocol::block::{ReturnMode, SplitKey, StageBlock, TerminalState, Tokens};
use mesh_protocol::capsule::{
    Producer, RecordContext, SealedRecord, format_timestamp, stage_record,
};
use mesh_protocol::cbor::{Cbor, Fields};
use mesh_protocol::control::{
    AssignRequest, AuthoriseRequest, ControlReply, ControlRequest, MAX_CONTROL_TEXT,
};
use mesh_protocol::identity::{did_key, parse_did_key};
use mesh_protocol::mesh1::{
    DecisionOutcome, Fidelity, FidelityReport, MeshReceipt, ServeRequest, WeightsBinding, opening,
    output_commitment, prompt_hash, prompt_payload,
};
use mesh_protocol::receipt::Assignment;
use mesh_protocol::session::{HopSession, RequestScope, SliceFacts, Wire};
use mesh_protocol::split::{SealEnvironment, SplitSealInput, seal_split};
use mesh_protocol::stage_frame::{MAX_DECODE_ROWS, Rewind};
use mesh_stage::cache::{CacheLease, CachePool};
use mesh_stage::frame::{WireDType, decode_frame, encode_frame};
use mesh_stage::sampling::Sampler;
use mesh_stage::{LayerSlice, ModelHandle, SliceOutput};
use tokio::sync::oneshot;

use crate::runtime::energy::EnergyMeter;
use crate::runtime::net::msg::{self, kind};
pub use crate::runtime::net::peers::PeerAddr;
use crate::runtime::net::tls::{self, TlsIdentity};
use crate::runtime::net::{ALPN_CONTROL, ALPN_RECORD_PUSH, ALPN_STAGE};
use crate::runtime::records::{Collector, signed_refusal};
use crate::runtime::steward::Steward;

mod batch;
mod coordinator;
mod decision;
mod draft;
mod kept;
mod route;
mod stats;
pub use crate::runtime::client::{
    GenerateEvent, GenerateRequest, GenerateSummary, Generating, GrantedServe,
    MAX_PROMPT_BYTES_PER_TOKEN, RequestBounds, generate_events, generate_remote,
    node_stats_remote, plan_remote,
};
pub use coordinator::{
    DEFAULT_DRAFT_TOKENS, DEFAULT_PREFILL_CHUNK_TOKENS, DRAFT_MODEL_TOKENS, MAX_DRAFT_TOKENS,
    MAX_PREFILL_CHUNK_TOKENS, one_way_hops_per_step,
};
pub use stats::{NodeStats, ROUND_TRIP_BUCKETS_US, SliceStats};

/// The training corpus `model` declares in its metadata (SPEC §3.7), when
/// it declares one in a form a receipt can bind; a malformed declaration
/// is reported and bound to nothing.
fn declared_training(model: &ModelHandle) -> Option<mesh_protocol::mesh1::TrainingBinding> {
    use mesh_protocol::mesh1::{TrainingAuthority, TrainingBinding};
    let (digest, authority) = match model.declared_training() {
        (None, None) => return None,
        (digest, authority) => (digest.unwrap_or_default(), authority.unwrap_or_default()),
    };
    match (
        mesh_protocol::hex::decode_array(digest),
        TrainingAuthority::parse(authority),
    ) {
        (Some(training_digest), Some(authority)) => Some(TrainingBinding {
            training_digest,
            authority,
        }),
        _ => {
            tracing::warn!(
                "the model declares a training corpus this node cannot bind (both a digest of 64 \
                 hex and an authority of signed, logged or opaque are needed): its receipts name none"
            );
            None
        }
    }
}

/// The fidelity a coordinator rates its model at unless configured
/// (SPEC §3.2: F2 of F0..F4, a mid-grade model).
pub const DEFAULT_FIDELITY: Fidelity = Fidelity::F2;

/// How a node serves.
#[derive(Debug)]
pub struct NodeOptions {
    pub key: SigningKey,
    pub listen: SocketAddr,
    /// The address other nodes reach this one at (default: the bound address).
    pub advertise: Option<SocketAddr>,
    pub model: PathBuf,
    /// Where this node's slices compute (opened once, by whoever starts the
    /// node; the nodes of one process share it).
    pub device: mesh_stage::Device,
    pub data: PathBuf,
    pub peers: Vec<PeerAddr>,
    /// Coordinators whose assignments this node accepts as a stage (by key).
    pub coordinators: Vec<[u8; 32]>,
    /// Most slices held at once (one per coordinator; a newer run replaces).
    pub max_slices: usize,
    /// A slice no request used for this long is freed (its coordinator
    /// assigns it again on its next request).
    pub slice_idle: Duration,
    pub stage_seal_deadline: Duration,
    pub step_timeout: Duration,
    /// The longest a request may take, and what one that names no timeout
    /// gets.
    pub request_timeout: Duration,
    pub max_requests: usize,
    pub return_mode: ReturnMode,
    /// Prompt positions per prefill step (1..=MAX_PREFILL_CHUNK_TOKENS).
    pub prefill_chunk_tokens: usize,
    /// Tokens a coordinator drafts after each token it samples (with
    /// `draft_model`, else by prompt lookup), verified by the chain in the
    /// same step (0..=MAX_DRAFT_TOKENS; 0 turns speculative decoding off).
    /// Greedy requests only.
    pub draft_tokens: usize,
    /// A small model with the served model's tokenizer that a coordinator
    /// holds whole and drafts with (else drafts come from prompt lookup).
    pub draft_model: Option<PathBuf>,
    /// How many times one request may go on over a new chain after losing
    /// a stage (a chain planned over a mesh only).
    pub max_resumes: usize,
    pub wire: WireDType,
    pub meter: Box<dyn EnergyMeter>,
    /// Serve the OpenAI-compatible HTTP API here (a coordinator; off when
    /// `None`).
    pub http: Option<SocketAddr>,
    /// Which hosts and origins the HTTP API answers besides its own.
    pub http_access: crate::runtime::http::Access,
    /// Take part in a mesh (libp2p membership and adverts); a coordinator
    /// without `peers` plans over its members.
    pub mesh: Option<MeshSettings>,
    /// Pin the number of stages a coordinator plans (default: the planner
    /// decides, at least 2).
    pub stages: Option<usize>,
    /// The fidelity a coordinator rates its model at (SPEC §3.2): what the
    /// router admits a request's floor against.
    pub fidelity: Fidelity,
    /// Sign checkpoints of this node's transparency log for what it sends
    /// (default on): a stage pushes `record_push_bundle`s, a coordinator's
    /// bundle proves its main record.
    pub record_checkpoints: bool,
}

/// How a node takes part in a mesh.
#[derive(Debug, Clone)]
pub struct MeshSettings {
    /// Empty: TCP on the QUIC endpoint's address and port number.
    pub listen: Vec<libp2p::Multiaddr>,
    pub bootstrap: Vec<libp2p::Multiaddr>,
    pub mdns: bool,
    /// Memory offered for weights and KV (default: what is free at start).
    pub memory_bytes: Option<u64>,
    /// Advertise this decode speed instead of measuring it.
    pub decode_us_per_layer: Option<u64>,
}

/// Per-request figures a stage keeps for a while (asked for by `stats`).
#[derive(Debug, Clone, Copy, Default)]
pub struct StageStats {
    /// Each step from handing it to the slice's worker to its output back.
    pub compute: Duration,
    /// The engine's own time on decode steps (a prompt's chunks, the queue
    /// and the hand-offs to and from the worker excluded).
    pub decode_engine: Duration,
    pub fold: Duration,
    pub steps: u32,
}

#[derive(Debug, Clone)]
struct Assign {
    run_id: String,
    package_id: [u8; 32],
    layer_start: u32,
    layer_end: u32,
    stage_index: u32,
    stage_count: u32,
    coordinator: [u8; 32],
    coordinator_addr: SocketAddr,
    /// The only node that may open requests on this stage: the previous one.
    upstream: [u8; 32],
    downstream: Option<PeerAddr>,
    topology_hash: String,
    manifest: [u8; 32],
}

impl Assign {
    fn to_cbor(&self) -> Cbor {
        ControlRequest::Assign(AssignRequest {
            run_id: self.run_id.clone(),
            package_id: self.package_id,
            manifest_sha256: self.manifest,
            layer_start: self.layer_start,
            layer_end: self.layer_end,
            stage_index: self.stage_index,
            stage_count: self.stage_count,
            coordinator: did_key(&self.coordinator),
            coordinator_addr: self.coordinator_addr.to_string(),
            topology_hash: self.topology_hash.clone(),
            upstream: did_key(&self.upstream),
            downstream: self.downstream.as_ref().map(PeerAddr::to_string),
        })
        .to_cbor()
    }

    /// The node's own form of an assignment.
    fn from_request(a: &AssignRequest) -> anyhow::Result<Self> {
        Ok(Self {
            run_id: a.run_id.clone(),
            package_id: a.package_id,
            layer_start: a.layer_start,
            layer_end: a.layer_end,
            stage_index: a.stage_index,
            stage_count: a.stage_count,
            coordinator: parse_did_key(&a.coordinator)
                .context("assign: coordinator is not a did:key")?,
            coordinator_addr: a
                .coordinator_addr
                .parse()
                .context("assign: coordinator_addr")?,
            upstream: parse_did_key(&a.upstream).context("assign: upstream is not a did:key")?,
            downstream: a
                .downstream
                .as_deref()
                .map(str::parse::<PeerAddr>)
                .transpose()?,
            topology_hash: a.topology_hash.clone(),
            manifest: a.manifest_sha256,
        })
    }
}

struct Slot {
    slice: Arc<LayerSlice>,
    /// Shared with the slot of a later run on the same layers, so a cache
    /// kept across a resume stays counted once, in one pool.
    pool: Arc<CachePool>,
    /// Runs every step on this slice, batching concurrent requests.
    batcher: Arc<batch::Batcher>,
    assign: Assign,
    /// When a request last opened or ended on this slice.
    last_used: Mutex<Instant>,
}

impl Slot {
    fn new(slice: LayerSlice, max_requests: usize, context: usize, assign: Assign) -> Self {
        let slice = Arc::new(slice);
        Self {
            batcher: Arc::new(batch::Batcher::start(slice.clone(), max_requests)),
            slice,
            pool: Arc::new(CachePool::new(max_requests, context)),
            assign,
            last_used: Mutex::new(Instant::now()),
        }
    }

    /// The same loaded layers under a new run's assignment: nothing is
    /// loaded again, and the caches of requests on the old run (a kept
    /// cache among them) stay valid on the new one.
    fn reassigned(&self, assign: Assign) -> Self {
        Self {
            slice: self.slice.clone(),
            pool: self.pool.clone(),
            batcher: self.batcher.clone(),
            assign,
            last_used: Mutex::new(Instant::now()),
        }
    }

    /// Whether this slot holds the layers `assign` names, of the same
    /// coordinator: a new run may take it over.
    fn holds_layers_of(&self, assign: &Assign) -> bool {
        self.assign.coordinator == assign.coordinator
            && self.assign.package_id == assign.package_id
            && self.assign.layer_start == assign.layer_start
            && self.assign.layer_end == assign.layer_end
    }

    fn touch(&self) {
        *lock(&self.last_used) = Instant::now();
    }
}

struct Run {
    /// The remote stages, in chain order.
    peers: Vec<PeerAddr>,
    /// The planner's projection when the run was planned over a mesh.
    projected_us: Option<u64>,
    assigns: Vec<Assign>,
    topology: Vec<Assignment>,
    keys: Vec<[u8; 32]>,
    own: Arc<Slot>,
    /// Assignments are sent again before a request once the run has been
    /// unused this long: half the shortest time a stage keeps an idle slice.
    refresh_after: Duration,
    /// Assignments are sent again before the next request: one failed, so a
    /// stage may have restarted without its slice.
    stale: std::sync::atomic::AtomicBool,
}

type DirectStream = (quinn::SendStream, quinn::RecvStream, Vec<u8>);
/// A coordinator waiting for its final stage's direct return: the key that
/// stage must prove, and where to hand the stream.
type DirectWaiter = ([u8; 32], oneshot::Sender<DirectStream>);
/// A stage's grant decision taken ahead of its request's chain.
struct PreDecided {
    ticket: crate::runtime::steward::ServeTicket,
    serve: ServeRequest,
    /// The coordinator that asked.
    coordinator: [u8; 32],
    decided: Instant,
}

/// How long a stage holds a grant decision for a request whose chain never
/// reaches it; then the decision is released (and the release journalled).
pub const PRE_DECIDED_TTL: Duration = Duration::from_secs(60);
/// Largest first message of a `mesh-stage/1` stream (OPEN or DIRECT_OPEN),
/// read before the sender is checked.
pub const MAX_STAGE_OPEN: usize = 4096;
/// How long a frame reader waits for its stream's next frame: the consumer
/// applies the step timeout, so this one never ends first.
const WATCH_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);
/// Resumes of one request, unless configured.
pub const DEFAULT_MAX_RESUMES: usize = 2;
/// The most resumes one request may have: its receipt lists every segment.
pub const MAX_RESUMES: usize = mesh_protocol::resume::MAX_SEGMENTS - 1;
/// How long a node keeps reading a peer's stream after a request failed.
pub const DRAIN_WAIT: Duration = Duration::from_secs(1);
/// How a FAILED reply starts when a steward stopped its part of a serve at
/// the request's energy ceiling (the serve's terminal state).
pub const POLICY_DENIED: &str = "policy_denied";
/// Slices a stage node holds at once unless configured.
pub const DEFAULT_MAX_SLICES: usize = 2;
/// How long a stage keeps a slice no request uses, unless configured.
pub const DEFAULT_SLICE_IDLE: Duration = Duration::from_secs(15 * 60);
/// What a stage answers for a run whose slice it does not hold (never
/// assigned, replaced, freed as idle, or lost in a restart): the request
/// fails, and the coordinator assigns again before its next one.
pub const NO_SLICE: &str = "no slice loaded for run";

struct Inner {
    tls: TlsIdentity,
    key: SigningKey,
    endpoint: quinn::Endpoint,
    advertise: SocketAddr,
    model: ModelHandle,
    peers: Vec<PeerAddr>,
    coordinators: Vec<[u8; 32]>,
    max_slices: usize,
    slice_idle: Duration,
    deadline: Duration,
    step_timeout: Duration,
    request_timeout: Duration,
    max_requests: usize,
    return_mode: ReturnMode,
    prefill_chunk_tokens: usize,
    draft_tokens: usize,
    draft_model: Option<Arc<draft::DraftModel>>,
    max_resumes: usize,
    wire: WireDType,
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    run: tokio::sync::Mutex<Option<Arc<Run>>>,
    steward: Mutex<Steward>,
    /// Connections this node opened to peers, kept for reuse.
    net: crate::runtime::net::peers::Peers,
    directs: Mutex<HashMap<u64, DirectWaiter>>,
    collector: Mutex<Collector>,
    collected: tokio::sync::Notify,
    stats: Mutex<VecDeque<(u64, StageStats)>>,
    coordinator_term: u64,
    /// Grant decisions taken ahead of a request's chain, by request id.
    tickets: Mutex<HashMap<u64, PreDecided>>,
    /// The coordinator's record chain head.
    chain_head: Mutex<Option<[u8; 32]>>,
    /// The coordinator's own slice of its current run (for `stats`; the
    /// run itself is behind an async lock held while stages load).
    own_slot: Mutex<Option<Arc<Slot>>>,
    counters: stats::Counters,
    /// Set once at start when the node takes part in a mesh.
    mesh: std::sync::OnceLock<crate::runtime::mesh::Mesh>,
    stages: Option<usize>,
    /// Members that refused an assignment, left out of plans until then.
    refused: Mutex<HashMap<[u8; 32], Instant>>,
    /// Refusals recorded since start (a retry after a new one is at once).
    refusals: std::sync::atomic::AtomicU64,
    /// The last plan over the mesh, for the member set (its generation) and
    /// the refused members it was made for.
    plan_cache: Mutex<Option<PlanCache>>,
    /// Caches of requests a resume may take over.
    kept: kept::KeptCaches,
    fidelity: Fidelity,
    /// What serves cost per chain, for the route table.
    route_costs: Mutex<route::RouteCosts>,
    /// Router refusals journalled (`MAX_REFUSALS_JOURNALLED` a minute).
    refusal_journal: Mutex<crate::runtime::limit::PerMinute>,
    /// Refused assignments from strangers logged (one a minute).
    assign_refusals_logged: Mutex<crate::runtime::limit::PerMinute>,
    /// Requests refused or failed, logged (`MAX_UNSERVED_LOGGED` a minute).
    unserved_logged: Mutex<crate::runtime::limit::PerMinute>,
    /// The training corpus the model declares (SPEC §3.7), bound on the
    /// coordinator's receipts.
    training: Option<mesh_protocol::mesh1::TrainingBinding>,
    /// Checkpoint this node's log for what it sends: stage pushes as
    /// `record_push_bundle`s, the requester's bundle with the main
    /// record's inclusion proof.
    record_checkpoints: bool,
}

/// A plan and what it was made from.
struct PlanCache {
    generation: u64,
    /// Every member's data address (an advert can move it without a
    /// change to the member set).
    addresses: Vec<([u8; 32], String)>,
    refused: Vec<[u8; 32]>,
    plan: mesh_protocol::plan::Plan,
    usable: Vec<Usable>,
    /// The coordinator and the members as the planner weighed them.
    candidates: Candidates,
}

/// The coordinator as a candidate, and every other member with why it is
/// left out, if it is.
type Candidates = (
    mesh_protocol::plan::Candidate,
    Vec<crate::runtime::planner::Weighed>,
);

/// A chain: the remote stages, every stage's layers, and the planner's
/// projection when it came from a plan over a mesh.
type Chain = (Vec<PeerAddr>, Vec<std::ops::Range<u32>>, Option<u64>);
/// A member the planner could use: its key and data address.
type Usable = ([u8; 32], SocketAddr);
/// A new plan replaces the current run only when it is this much faster
/// (numerator, denominator: 4/5, at least 20 % less time per token).
pub const MIN_REPLAN_GAIN: (u64, u64) = (4, 5);
/// How long a member that refused its assignment is left out of plans.
pub const REFUSED_MEMBER_PAUSE: Duration = Duration::from_secs(30);
/// Requests a coordinator refused or that failed, logged a minute (one line
/// each; past this they are counted in the next line).
pub const MAX_UNSERVED_LOGGED: u32 = 120;
/// How long a coordinator in a mesh plans again, as members join or come
/// back, before it refuses a request it cannot plan for (within the
/// request's own deadline): long enough for a restarted coordinator's
/// members to reconnect.
pub const MESH_SETTLE_WAIT: Duration = Duration::from_secs(20);

/// A running node.
pub struct Node {
    inner: Arc<Inner>,
    accept: tokio::task::JoinHandle<()>,
    http: Option<crate::runtime::http::HttpApi>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("did", &self.inner.tls.did)
            .field("addr", &self.inner.advertise)
            .finish()
    }
}

/// The local address of the interface the default route leaves by: a UDP
/// socket "connected" to a documentation address (no packet is sent).
fn default_route_ip() -> Option<std::net::IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    socket.connect("192.0.2.1:9").ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Node {
    /// Open the model and the steward, bind the endpoint, start serving.
    pub async fn start(options: NodeOptions) -> anyhow::Result<Node> {
        tls::install_provider();
        let tls = TlsIdentity::new(&options.key)?;
        let model = crate::runtime::open_model(&options.model)?.on_device(options.device.clone());
        let training = declared_training(&model);
        let draft_model = match options
            .draft_model
            .as_ref()
            .filter(|_| options.draft_tokens > 0)
        {
            Some(path) => {
                let context = engine_context(&model);
                Some(Arc::new(draft::DraftModel::load(
                    path,
                    &model,
                    options.max_requests.max(1),
                    context,
                )?))
            }
            None => None,
        };
        let steward = Steward::open(
            &options.data.join("steward"),
            options.key.clone(),
            options.meter,
        )?;
        // A change record that does not have this model's weights in effect
        // refuses every serve it gates: say so at start, not per request.
        for record in steward.change_records() {
            if record.weights_in_effect() != Some(model.weights_digest()) {
                tracing::warn!(
                    backend = record.backend(),
                    "this model's weights are not the ones its change record has in effect: its serves will be refused until `mesh-node weights record` records them"
                );
                eprintln!(
                    "mesh-node: backend {}: this model's weights are not in effect in its change record; serves are refused until `mesh-node weights record --model {}` records them",
                    record.backend(),
                    options.model.display()
                );
            }
        }
        let server = tls::server_config(&tls, &[ALPN_CONTROL, ALPN_STAGE, ALPN_RECORD_PUSH])?;
        let endpoint = quinn::Endpoint::server(server, options.listen)
            .with_context(|| format!("binding {}", options.listen))?;
        let bound = endpoint.local_addr()?;
        let advertise = options.advertise.unwrap_or_else(|| {
            if bound.ip().is_unspecified() {
                // In a mesh, others on the network must reach it: the
                // address of the interface the default route leaves by.
                let ip = options
                    .mesh
                    .as_ref()
                    .and_then(|_| default_route_ip())
                    .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
                SocketAddr::new(ip, bound.port())
            } else {
                bound
            }
        });
        let net = crate::runtime::net::peers::Peers::new(endpoint.clone(), tls.clone());
        let inner = Arc::new(Inner {
            tls,
            key: options.key,
            endpoint,
            advertise,
            model,
            peers: options.peers,
            coordinators: options.coordinators,
            max_slices: options.max_slices.max(1),
            slice_idle: options.slice_idle,
            deadline: options.stage_seal_deadline,
            step_timeout: options.step_timeout,
            request_timeout: options.request_timeout,
            max_requests: options.max_requests,
            return_mode: options.return_mode,
            prefill_chunk_tokens: options
                .prefill_chunk_tokens
                .clamp(1, MAX_PREFILL_CHUNK_TOKENS),
            draft_tokens: options.draft_tokens.min(MAX_DRAFT_TOKENS),
            draft_model,
            max_resumes: options.max_resumes.min(MAX_RESUMES),
            wire: options.wire,
            slots: Mutex::new(HashMap::new()),
            run: tokio::sync::Mutex::new(None),
            steward: Mutex::new(steward),
            net,
            directs: Mutex::new(HashMap::new()),
            collector: Mutex::new(Collector::default()),
            collected: tokio::sync::Notify::new(),
            stats: Mutex::new(VecDeque::new()),
            coordinator_term: now_ms(),
            tickets: Mutex::new(HashMap::new()),
            chain_head: Mutex::new(None),
            own_slot: Mutex::new(None),
            counters: stats::Counters::default(),
            mesh: std::sync::OnceLock::new(),
            stages: options.stages,
            refused: Mutex::new(HashMap::new()),
            refusals: std::sync::atomic::AtomicU64::new(0),
            plan_cache: Mutex::new(None),
            kept: kept::KeptCaches::default(),
            fidelity: options.fidelity,
            route_costs: Mutex::new(route::RouteCosts::default()),
            refusal_journal: Mutex::new(crate::runtime::limit::PerMinute::new(
                crate::runtime::journal::MAX_REFUSALS_JOURNALLED,
            )),
            assign_refusals_logged: Mutex::new(crate::runtime::limit::PerMinute::new(1)),
            unserved_logged: Mutex::new(crate::runtime::limit::PerMinute::new(MAX_UNSERVED_LOGGED)),
            training,
            record_checkpoints: options.record_checkpoints,
        });
        if let Some(settings) = &options.mesh {
            let mesh = start_mesh(&inner, &options.data, settings).await?;
            let _ = inner.mesh.set(mesh);
        }
        let accept = tokio::spawn(accept_loop(inner.clone()));
        tokio::spawn(release_idle_slices(Arc::downgrade(&inner)));
        let mut node = Node {
            inner,
            accept,
            http: None,
        };
        if let Some(listen) = options.http {
            let card = node.model_card();
            // Weak: the API's connections must not keep the steward (and
            // its journal's lock) alive past the node's shutdown.
            let inner = Arc::downgrade(&node.inner);
            let witness: crate::runtime::http::Witness = Arc::new(move |envelope: &[u8]| {
                // Verified before the steward is locked: every step takes
                // that lock, on the node's one async thread by default.
                let sealed = mesh_protocol::mesh1::SealedReceipt::verify(envelope)?;
                let inner = inner.upgrade().context("the node is shutting down")?;
                Ok(lock(&inner.steward).witness_verified(sealed, now_ms())?)
            });
            node.http = Some(
                crate::runtime::http::start(
                    listen,
                    options.http_access,
                    node.peer_addr(),
                    card,
                    (witness, options.max_requests),
                )
                .await?,
            );
        }
        Ok(node)
    }

    /// What the HTTP API says about this node's model.
    pub fn model_card(&self) -> crate::runtime::http::ModelCard {
        let model = &self.inner.model;
        crate::runtime::http::ModelCard {
            id: model
                .path()
                .file_stem()
                .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned()),
            package_id: model.package_id(),
            context: engine_context(model),
            codec: model.text().clone(),
        }
    }

    /// Where the HTTP API listens, when it was asked for.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(crate::runtime::http::HttpApi::addr)
    }

    pub fn did(&self) -> &str {
        &self.inner.tls.did
    }
    pub fn public_key(&self) -> [u8; 32] {
        self.inner.tls.public_key
    }
    pub fn addr(&self) -> SocketAddr {
        self.inner.advertise
    }
    /// The address the endpoint is bound to (the advertised one may be a
    /// proxy or a public address in front of it).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.endpoint.local_addr()
    }
    pub fn peer_addr(&self) -> PeerAddr {
        PeerAddr {
            key: self.public_key(),
            addr: self.addr(),
        }
    }
    /// This node's mesh addresses (`…/p2p/PEERID`), once it listens (waits
    /// at most `within`); none when it is in no mesh.
    pub async fn mesh_addresses(&self, within: Duration) -> Vec<libp2p::Multiaddr> {
        match self.inner.mesh.get() {
            Some(mesh) => mesh.wait_for_addresses(within).await,
            None => Vec::new(),
        }
    }
    /// The node's membership, when it is in a mesh.
    pub fn mesh(&self) -> Option<&crate::runtime::mesh::Mesh> {
        self.inner.mesh.get()
    }
    /// Slices held as a stage (at most one per coordinator served).
    pub fn slices_held(&self) -> usize {
        lock(&self.inner.slots).len()
    }
    /// Grant decisions held for requests that have not reached this stage.
    pub fn grant_decisions_waiting(&self) -> usize {
        lock(&self.inner.tickets).len()
    }
    /// Requests this coordinator holds a record-collection slot for.
    pub fn requests_pending_seal(&self) -> usize {
        lock(&self.inner.collector).pending()
    }
    /// Every pool's occupancy and the node's counters (`mesh-node stats`).
    pub async fn stats(&self) -> NodeStats {
        self.inner.node_stats().await
    }
    pub fn meter_name(&self) -> String {
        lock(&self.inner.steward).meter_name().to_string()
    }

    pub async fn shutdown(self) {
        self.inner.endpoint.close(0u32.into(), b"shutting down");
        self.accept.abort();
        // Decisions for requests that will now never arrive are released, so
        // none stays in the journal as unresolved.
        let waiting: Vec<PreDecided> = lock(&self.inner.tickets).drain().map(|(_, d)| d).collect();
        for decided in waiting {
            self.inner.release_ticket(decided.ticket);
        }
        self.inner.endpoint.wait_idle().await;
    }
}

/// Connections from strangers a node holds open at once; more are closed
/// once their key is known (configured peers and coordinators still get in).
pub const MAX_CONNECTIONS: usize = 512;
/// Handshakes in progress at once; past this, unvalidated source addresses
/// get a stateless retry and validated ones are refused.
pub const MAX_HANDSHAKES: usize = 128;

/// Free the slices no request has used for `slice_idle`, and release grant
/// decisions whose requests never came, until the node stops.
async fn release_idle_slices(inner: std::sync::Weak<Inner>) {
    loop {
        let every = match inner.upgrade() {
            Some(inner) => {
                (inner.slice_idle / 4).clamp(Duration::from_millis(50), PRE_DECIDED_TTL / 4)
            }
            None => return,
        };
        tokio::time::sleep(every).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        inner.expire_pre_decided();
        inner.kept.expire();
        let released: Vec<String> = {
            let mut slots = lock(&inner.slots);
            let idle: Vec<String> = slots
                .iter()
                // A request in flight holds a clone of its slot.
                .filter(|(_, slot)| {
                    Arc::strong_count(slot) == 1
                        && lock(&slot.last_used).elapsed() >= inner.slice_idle
                })
                .map(|(run, _)| run.clone())
                .collect();
            for run in &idle {
                if let Some(slot) = slots.remove(run) {
                    inner.kept.evict_parked_on(&slot.slice);
                }
            }
            idle
        };
        for run in released {
            tracing::info!(run, "released an idle slice");
        }
    }
}

async fn accept_loop(inner: Arc<Inner>) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let handshaking = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    while let Some(incoming) = inner.endpoint.accept().await {
        let Ok(handshake) = handshaking.clone().try_acquire_owned() else {
            // Under a flood of handshakes, make unproven source addresses
            // prove themselves (a stateless retry) before any work is done.
            if incoming.remote_address_validated() {
                incoming.refuse();
            } else {
                let _ = incoming.retry();
            }
            continue;
        };
        let (inner, open) = (inner.clone(), open.clone());
        tokio::spawn(async move {
            let connection = incoming.await;
            drop(handshake);
            let Ok(connection) = connection else {
                return;
            };
            let alpn = connection
                .handshake_data()
                .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                .and_then(|d| d.protocol);
            let Some(peer) = tls::peer_key(&connection) else {
                return;
            };
            // Strangers share MAX_CONNECTIONS; a configured coordinator or
            // peer is let in even when strangers hold them all.
            let permit = open.try_acquire_owned().ok();
            // Configured ones only: a mesh member is anyone who joined.
            let known_peer =
                inner.coordinators.contains(&peer) || inner.peers.iter().any(|p| p.key == peer);
            if permit.is_none() && !known_peer {
                connection.close(2u32.into(), b"busy: too many connections");
                return;
            }
            let _permit = permit;
            let known = [ALPN_CONTROL, ALPN_STAGE, ALPN_RECORD_PUSH];
            if !alpn.as_deref().is_some_and(|a| known.contains(&a)) {
                connection.close(1u32.into(), b"unknown protocol");
                return;
            }
            loop {
                let Ok((send, recv)) = connection.accept_bi().await else {
                    return;
                };
                let inner = inner.clone();
                let alpn = alpn.clone();
                tokio::spawn(async move {
                    let outcome = match alpn.as_deref() {
                        Some(a) if a == ALPN_CONTROL => {
                            handle_control(inner, peer, send, recv).await
                        }
                        Some(a) if a == ALPN_STAGE => handle_stage(inner, peer, send, recv).await,
                        Some(a) if a == ALPN_RECORD_PUSH => {
                            handle_push(inner, peer, send, recv).await
                        }
                        _ => Ok(()),
                    };
                    if let Err(error) = outcome {
                        tracing::warn!(peer = %did_key(&peer), "stream: {error:#}");
                    }
                });
            }
        });
    }
}

/// The longest sequence a request may run to on `model` in this engine.
fn engine_context(model: &ModelHandle) -> usize {
    model
        .config()
        .context
        .min(mesh_stage::model::MAX_ENGINE_CONTEXT)
}

impl Inner {
    /// The longest sequence a request may run to on this node's model.
    fn context(&self) -> usize {
        engine_context(&self.model)
    }

    /// A loaded slice, ready to serve: its cache pool and batch worker.
    fn slot(&self, slice: LayerSlice, assign: Assign) -> Arc<Slot> {
        Arc::new(Slot::new(slice, self.max_requests, self.context(), assign))
    }

    /// Refuse a new slice when the slices of other coordinators fill the bound
    /// (the sender's own run is replaced, so it never counts against it).
    fn check_slice_room(
        &self,
        slots: &HashMap<String, Arc<Slot>>,
        coordinator: [u8; 32],
    ) -> anyhow::Result<()> {
        let others = slots
            .values()
            .filter(|s| s.assign.coordinator != coordinator)
            .count();
        if others >= self.max_slices {
            bail!(
                "this node already holds its maximum of {} slices",
                self.max_slices
            );
        }
        Ok(())
    }

    /// Close a grant decision whose serve never ran: the steward journals the
    /// (empty) span, so nothing stays open or charged at its ceiling.
    fn release_ticket(&self, ticket: crate::runtime::steward::ServeTicket) {
        if let Err(error) =
            lock(&self.steward).end_engine(ticket, Some(self.model.weights_digest()))
        {
            tracing::warn!("releasing an unused grant decision: {error}");
        }
    }

    /// Release grant decisions whose requests never arrived.
    fn expire_pre_decided(&self) {
        let stale: Vec<PreDecided> = {
            let mut tickets = lock(&self.tickets);
            let ids: Vec<u64> = tickets
                .iter()
                .filter(|(_, d)| d.decided.elapsed() >= PRE_DECIDED_TTL)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| tickets.remove(id)).collect()
        };
        for decided in stale {
            self.release_ticket(decided.ticket);
        }
    }

    fn record_stats(&self, request_id: u64, stats: StageStats) {
        let mut all = lock(&self.stats);
        all.push_back((request_id, stats));
        while all.len() > 256 {
            all.pop_front();
        }
    }
}

// ---------------------------------------------------------------- control

async fn handle_control(
    inner: Arc<Inner>,
    peer: [u8; 32],
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) -> anyhow::Result<()> {
    let Some(message) =
        msg::read_cbor(&mut recv, msg::MAX_CONTROL_REQUEST, msg::IDLE_TIMEOUT).await?
    else {
        return Ok(());
    };
    let request = match ControlRequest::from_cbor(&message) {
        Ok(request) => request,
        Err(error) => {
            // A requester reads `error`; a node reads `refused`.
            let kind = if message.get("kind").and_then(Cbor::as_text) == Some("generate") {
                "error"
            } else {
                "refused"
            };
            let reason = coordinator::bounded_reason(&error.to_string());
            let reply = if kind == "error" {
                ControlReply::Error { reason }
            } else {
                ControlReply::Refused { reason }
            };
            msg::write_cbor(&mut send, &reply.to_cbor()).await?;
            send.finish()?;
            return Ok(());
        }
    };
    match request {
        ControlRequest::Assign(assign) => {
            let reply = match handle_assign(&inner, peer, &assign) {
                Ok((digest, bytes)) => ControlReply::Ready {
                    weights_digest: digest,
                    resident_bytes: bytes as u64,
                    max_requests: inner.max_requests as u64,
                    slice_idle_ms: inner.slice_idle.as_millis() as u64,
                },
                Err(error) => refused(&error),
            };
            msg::write_cbor(&mut send, &reply.to_cbor()).await?;
        }
        ControlRequest::Generate(generate) => {
            coordinator::handle_generate(inner, &generate, &mut send).await?
        }
        ControlRequest::Plan => coordinator::handle_plan(inner, &mut send).await?,
        ControlRequest::Release { request_id } => {
            // The request was refused elsewhere before any work ran here:
            // close the decision with the (empty) span it metered.
            let held = {
                let mut tickets = lock(&inner.tickets);
                // Only the coordinator that asked for the decision may release it.
                match tickets.get(&request_id) {
                    Some(decided) if decided.coordinator == peer => tickets.remove(&request_id),
                    _ => None,
                }
            };
            if let Some(decided) = held {
                inner.release_ticket(decided.ticket);
            }
            msg::write_cbor(&mut send, &ControlReply::Released.to_cbor()).await?;
        }
        ControlRequest::Unassign { run_id } => {
            let freed = {
                let mut slots = lock(&inner.slots);
                // Only the coordinator that assigned a slice may free it.
                match slots.get(&run_id) {
                    Some(slot) if slot.assign.coordinator == peer => slots.remove(&run_id),
                    _ => None,
                }
            };
            if let Some(slot) = &freed {
                inner.kept.evict_parked_on(&slot.slice);
            }
            let reply = match freed {
                Some(_) => {
                    tracing::info!(run = %run_id, "released a slice its coordinator no longer uses");
                    ControlReply::Released
                }
                None => ControlReply::Refused {
                    reason: "no slice of that run from this coordinator".into(),
                },
            };
            msg::write_cbor(&mut send, &reply.to_cbor()).await?;
        }
        ControlRequest::Authorise(authorise) => {
            let reply = match handle_authorise(&inner, peer, &authorise) {
                Ok(()) => ControlReply::Authorised,
                Err(error) => refused(&error),
            };
            msg::write_cbor(&mut send, &reply.to_cbor()).await?;
        }
        ControlRequest::NodeStats => {
            let reply = if inner.may_read_stats(&peer) {
                inner.node_stats().await.to_cbor()
            } else {
                ControlReply::Refused {
                    reason: "a node's stats are for its own key, its peers and its coordinators: \
                             give --key with one of those"
                        .into(),
                }
                .to_cbor()
            };
            msg::write_cbor(&mut send, &reply).await?;
        }
        ControlRequest::Stats { request_id } => {
            // A request's timings are the business of its coordinator only.
            let found = lock(&inner.stats)
                .iter()
                .rev()
                .find(|(id, _)| *id == request_id)
                .filter(|_| inner.serves_coordinator(&peer))
                .map(|(_, s)| *s);
            let stats = found.unwrap_or_default();
            let reply = ControlReply::Stats {
                found: found.is_some(),
                compute_us: stats.compute.as_micros() as u64,
                decode_engine_us: stats.decode_engine.as_micros() as u64,
                fold_us: stats.fold.as_micros() as u64,
                steps: stats.steps.into(),
            };
            msg::write_cbor(&mut send, &reply.to_cbor()).await?;
        }
    }
    send.finish()?;
    let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    Ok(())
}

/// A coordinator asks this stage's steward to decide its grant shard for a
/// request before the chain opens; the decision is journalled and held
/// until the request's stream arrives.
fn handle_authorise(
    inner: &Arc<Inner>,
    peer: [u8; 32],
    request: &AuthoriseRequest,
) -> anyhow::Result<()> {
    let AuthoriseRequest {
        run_id,
        request_id,
        serve_request: serve,
        presentation,
    } = request;
    let (run_id, request_id) = (run_id.as_str(), *request_id);
    let slot = lock(&inner.slots)
        .get(run_id)
        .cloned()
        .context("no slice loaded for that run")?;
    if slot.assign.coordinator != peer {
        bail!("only the run's coordinator may ask");
    }
    inner.expire_pre_decided();
    // Checked and inserted under one lock, so two asks for one request
    // cannot both decide (the steward's lock is taken inside, never the
    // other way round).
    let mut tickets = lock(&inner.tickets);
    if tickets.len() >= inner.max_requests.max(1) * 4 {
        bail!("too many authorised requests waiting to start");
    }
    if tickets.contains_key(&request_id) {
        bail!("request {request_id} is already authorised here");
    }
    let ticket = lock(&inner.steward).authorise(
        Some(presentation),
        serve,
        Some(inner.model.weights_digest()),
        "mesh-node/stage",
        now_ms(),
    )?;
    tickets.insert(
        request_id,
        PreDecided {
            ticket,
            serve: serve.clone(),
            coordinator: peer,
            decided: Instant::now(),
        },
    );
    Ok(())
}

fn handle_assign(
    inner: &Arc<Inner>,
    peer: [u8; 32],
    request: &AssignRequest,
) -> anyhow::Result<([u8; 32], usize)> {
    if !inner.serves_coordinator(&peer) {
        // Anyone can send these: a line a minute, the others counted.
        if let Some(unlogged) = lock(&inner.assign_refusals_logged).admit(Instant::now()) {
            tracing::warn!(
                "refused an assignment from {0}: not a coordinator this node serves (start it with --coordinator {0} to serve it); {unlogged} more refused since the last such line",
                did_key(&peer)
            );
        }
        bail!("this node does not serve coordinator {}", did_key(&peer));
    }
    let assign = Assign::from_request(request)?;
    if assign.coordinator != peer {
        bail!("the assignment names a coordinator other than the node that sent it");
    }
    if assign.package_id != inner.model.package_id() {
        bail!(
            "this node holds package sha256:{}, not the assigned sha256:{}",
            mesh_protocol::hex::encode(&inner.model.package_id()),
            mesh_protocol::hex::encode(&assign.package_id)
        );
    }
    if assign.manifest != inner.model.manifest_sha256() {
        bail!(
            "this node's package has manifest {}, not the assigned {}",
            mesh_protocol::hex::encode(&inner.model.manifest_sha256()),
            mesh_protocol::hex::encode(&assign.manifest)
        );
    }
    if assign.stage_index == 0 || assign.stage_index >= assign.stage_count {
        bail!(
            "stage index {} is not a remote stage of {}",
            assign.stage_index,
            assign.stage_count
        );
    }
    {
        let mut slots = lock(&inner.slots);
        if let Some(slot) = slots.get(&assign.run_id) {
            if slot.assign.coordinator != peer {
                bail!("run {} belongs to another coordinator", assign.run_id);
            }
            slot.touch();
            return Ok((slot.slice.weights_digest(), slot.slice.weight_bytes()));
        }
        // The coordinator's new run keeps these layers here (a re-plan
        // around another node): the loaded slice, and the caches on it,
        // carry over.
        let same_layers = slots
            .values()
            .find(|held| held.holds_layers_of(&assign))
            .cloned();
        if let Some(held) = same_layers {
            let slot = Arc::new(held.reassigned(assign.clone()));
            let answer = (slot.slice.weights_digest(), slot.slice.weight_bytes());
            slots.retain(|_, held| held.assign.coordinator != peer);
            slots.insert(assign.run_id.clone(), slot);
            return Ok(answer);
        }
        inner.check_slice_room(&slots, peer)?;
    }
    tracing::info!(
        run = %assign.run_id,
        "loading layers {}..{} (stage {} of {})",
        assign.layer_start,
        assign.layer_end,
        assign.stage_index,
        assign.stage_count
    );
    let slice = tokio::task::block_in_place(|| {
        inner
            .model
            .load_chain_slice(assign.layer_start..assign.layer_end, false)
    })?;
    let answer = (slice.weights_digest(), slice.weight_bytes());
    let slot = inner.slot(slice, assign.clone());
    let mut slots = lock(&inner.slots);
    inner.check_slice_room(&slots, peer)?;
    // A coordinator holds one run here: its newer run replaces the older, whose
    // slice is freed once its last request ends (the caches kept on it
    // cannot serve the new slice: given back now).
    slots.retain(|_, held| {
        let other = held.assign.coordinator != peer;
        if !other {
            inner.kept.evict_parked_on(&held.slice);
        }
        other
    });
    slots.insert(assign.run_id.clone(), slot);
    Ok(answer)
}

// ------------------------------------------------------------------ stage

/// A wait for a step's message ran out: name it, and the setting that bounds it.
/// One request's deadline: every wait of the request, at every node, ends
/// by it. The coordinator sets it when it reads the request; each stage
/// learns the time left from OPEN.
#[derive(Debug, Clone, Copy)]
pub(super) struct Deadline {
    at: tokio::time::Instant,
    total: Duration,
}

impl Deadline {
    fn after(total: Duration) -> Self {
        let total = total.min(MAX_REQUEST_TIMEOUT);
        Self {
            at: tokio::time::Instant::now() + total,
            total,
        }
    }
    fn at(&self) -> tokio::time::Instant {
        self.at
    }
    fn left(&self) -> Duration {
        self.at
            .saturating_duration_since(tokio::time::Instant::now())
    }
    fn is_past(&self) -> bool {
        self.left().is_zero()
    }
    /// `wait`, or less when the deadline is nearer.
    fn bound(&self, wait: Duration) -> Duration {
        wait.min(self.left())
    }
    /// Why a request ended at its deadline.
    fn passed(&self, waiting_for: &str) -> String {
        format!(
            "timed out: the request's deadline of {} ms passed while waiting for {waiting_for}",
            self.total.as_millis()
        )
    }
}

/// How long a request may take when neither it nor the configuration says.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// The longest any request may take, whatever is configured or asked.
pub const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

fn step_timed_out(whom: &str, timeout: Duration) -> anyhow::Error {
    anyhow!(
        "timed out: no reply from {whom} within the step timeout of {} ms (serve --step-timeout-ms)",
        timeout.as_millis()
    )
}

/// A node that refuses a request answers FAILED and stops reading, so the
/// next write to it fails: report its reason rather than the write's. The
/// answer is folded as received (the refusing side folded it as sent when it
/// had lanes; when it refused before any, its hop has no record to compare).
async fn refusal_behind(
    recv: &mut quinn::RecvStream,
    error: anyhow::Error,
    whom: &str,
    lanes: Option<&mut Folding>,
) -> anyhow::Error {
    let reply = msg::read_checked(recv, MAX_FAILED_REPLY, DRAIN_WAIT).await;
    if let Ok(Some(frame)) = reply
        && let Ok((kind::FAILED, _, _, reason)) = msg::parse_stage(&frame)
    {
        if let Some(lanes) = lanes {
            lanes.fold(Wire::FromDownstream, &frame);
        }
        return anyhow!("{whom} refused: {}", String::from_utf8_lossy(reason));
    }
    error
}

/// The longest FAILED reply read: its reason is a line or an error chain.
const MAX_FAILED_REPLY: usize = 64 * 1024;

/// A FAILED reply's reason, cut (at a character) to what a reader takes.
fn failed_reason(reason: &str) -> &[u8] {
    let mut end = reason.len().min(MAX_FAILED_REPLY - 1024);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason.as_bytes()[..end]
}

/// The longest reply a stage sends upstream: a FAILED reason, or the final
/// stage's hidden state at a decode step's positions (at most
/// `MAX_DECODE_ROWS`), in f32 (`hidden` wide).
fn max_reply(hidden: usize) -> usize {
    (mesh_protocol::stage_frame::STAGE_HEADER
        + mesh_stage::frame::FRAME_HEADER_BYTES
        + 4 * hidden * MAX_DECODE_ROWS)
        .max(MAX_FAILED_REPLY)
}

/// Whole frames of a stream, read by their own task so that waiting on them
/// can be abandoned (in a `select!`) without losing part of a frame. The
/// channel ends when the stream finishes; a read error is its last item.
type Frames = tokio::sync::mpsc::Receiver<anyhow::Result<Vec<u8>>>;

fn spawn_frames(mut recv: quinn::RecvStream, max: usize) -> Frames {
    let (sender, frames) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        loop {
            let read = tokio::select! {
                read = msg::read_checked(&mut recv, max, WATCH_TIMEOUT) => read,
                // The request is over: stop reading for it.
                () = sender.closed() => return,
            };
            let last = !matches!(read, Ok(Some(_)));
            let item = match read {
                Ok(Some(frame)) => Ok(frame),
                Ok(None) => return,
                Err(error) => Err(error),
            };
            if sender.send(item).await.is_err() || last {
                return;
            }
        }
    });
    frames
}

/// The next frame of `frames`, or never when there is none to wait on.
async fn next_frame(frames: &mut Option<Frames>) -> Option<anyhow::Result<Vec<u8>>> {
    match frames {
        Some(frames) => frames.recv().await,
        None => std::future::pending().await,
    }
}

/// After a failure, keep reading what a peer still sends on this request,
/// folding it, until it finishes or `DRAIN_WAIT` passes: a frame it wrote
/// before it learned of the failure is then in both ends' digests.
async fn drain(frames: &mut Frames, lanes: &mut Folding, wire: Wire) {
    drain_for(frames, lanes, wire, DRAIN_WAIT).await;
}

/// `drain`, for up to `bound`.
async fn drain_for(frames: &mut Frames, lanes: &mut Folding, wire: Wire, bound: Duration) {
    let until = tokio::time::Instant::now() + bound;
    while let Ok(Some(Ok(frame))) = tokio::time::timeout_at(until, frames.recv()).await {
        lanes.fold(wire, &frame);
    }
}

/// Refuse a request on its stage stream with a FAILED reply, before any
/// lane is folded.
async fn refuse_stage(
    inner: &Inner,
    up_send: &mut quinn::SendStream,
    request_id: u64,
    reason: String,
) -> anyhow::Result<()> {
    stats::Counters::bump(&inner.counters.stage_refusals);
    let body = msg::stage_body(kind::FAILED, request_id, 0, failed_reason(&reason));
    msg::write(up_send, &body).await?;
    let _ = up_send.finish();
    Ok(())
}

/// A request's lanes at this node (the protocol's hop session folds every
/// frame; the serving code only moves bytes), and the time spent folding.
struct Folding {
    session: HopSession,
    spent: Duration,
}

impl Folding {
    fn new(session: HopSession) -> Self {
        Self {
            session,
            spent: Duration::ZERO,
        }
    }

    /// Fold one whole frame, exactly as it crossed, on `wire`'s lane.
    fn fold(&mut self, wire: Wire, frame: &[u8]) {
        let start = Instant::now();
        self.session.fold(wire, frame);
        self.spent += start.elapsed();
    }
}

#[cfg(feature = "fault-injection")]
fn inject_fault(stage_index: u32, step: u32, bytes: &mut [u8]) {
    // MESH_FAULT_FLIP_FORWARD=STAGE:STEP:OFFSET alters one byte of the
    // forward frame that stage STAGE writes at STEP, after it was folded.
    if let Ok(spec) = std::env::var("MESH_FAULT_FLIP_FORWARD") {
        let parts: Vec<usize> = spec.split(':').filter_map(|p| p.parse().ok()).collect();
        if let [stage, at_step, offset] = parts[..]
            && stage == stage_index as usize
            && at_step == step as usize
            && let Some(byte) = bytes.get_mut(offset)
        {
            *byte ^= 0x01;
        }
    }
}

/// Fold a whole frame as written on `wire`, then send it.
async fn send_frame(
    send: &mut quinn::SendStream,
    bytes: &[u8],
    lanes: &mut Folding,
    wire: Wire,
    towards: &str,
) -> anyhow::Result<()> {
    lanes.fold(wire, bytes);
    tokio::time::timeout(msg::IDLE_TIMEOUT, send.write_all(bytes))
        .await
        .with_context(|| format!("timed out writing {towards}"))??;
    Ok(())
}

/// Frame and send a forward message, folding it first; the test-only fault
/// hook alters the bytes after the fold, as corruption in flight would.
async fn write_forward(
    send: &mut quinn::SendStream,
    body: &[u8],
    lanes: &mut Folding,
    stage_index: u32,
    step: u32,
) -> anyhow::Result<()> {
    let bytes = msg::frame(body)?;
    lanes.fold(Wire::ToDownstream, &bytes);
    #[cfg(feature = "fault-injection")]
    let bytes = {
        let mut bytes = bytes;
        inject_fault(stage_index, step, &mut bytes);
        bytes
    };
    let _ = (stage_index, step);
    tokio::time::timeout(msg::IDLE_TIMEOUT, send.write_all(&bytes))
        .await
        .context("timed out writing downstream")??;
    Ok(())
}

/// What a stage reads from OPEN.
struct StageOpen {
    run_id: String,
    capacity: usize,
    prefill_steps: u64,
    /// `prefill_steps` as sent: in a resume that keeps caches, the
    /// replay's steps (none when every remote stage kept its cache), which
    /// the stage before a kept one sends no further, so a kept stage's
    /// first step is numbered this.
    replay_steps: u64,
    deadline: Deadline,
    return_mode: ReturnMode,
    /// A resumed request names the interrupted one: a stage where that
    /// one still runs (its upstream lost, its stream not yet timed out)
    /// ends it now.
    resumes: Option<u64>,
    keep: Option<StageResume>,
    /// The coordinator's signature over the resume claim
    /// (`resume::claim_message`): checked before anything is ended or kept.
    resume_sig: Option<Vec<u8>>,
}

/// OPEN of a resumed request whose chain keeps caches: the stages from
/// `kept_from` on take over the caches the interrupted request built, cut
/// back to `positions`; the stages before them rebuild theirs from the
/// prefill steps (the replay), and the last of those sends the replay no
/// further.
#[derive(Debug, Clone, Copy)]
struct StageResume {
    of: u64,
    kept_from: u32,
    positions: u64,
}

impl StageOpen {
    fn parse(payload: &[u8], inner: &Inner) -> anyhow::Result<Self> {
        let open = Cbor::decode(payload).context("malformed OPEN")?;
        let mut f = Fields::of(&open)?.text_limit(MAX_CONTROL_TEXT);
        let replay_steps = f.opt_uint("prefill_steps")?.unwrap_or(1);
        let mut parsed = Self {
            run_id: f.text("run_id")?.to_string(),
            capacity: f.uint("capacity")? as usize,
            prefill_steps: replay_steps.max(1),
            replay_steps,
            // The time its coordinator left the request, and one step
            // timeout more: at the deadline the coordinator's STOP ends the
            // request after the step in flight, and the coordinator reads
            // what this stage still sends for that long, so every hop's
            // lanes stay whole. This stage's own clock ends the request only
            // when its coordinator has gone quiet.
            deadline: Deadline::after(
                f.opt_uint("deadline_ms")?
                    .map_or(inner.request_timeout, Duration::from_millis)
                    .saturating_add(inner.step_timeout),
            ),
            return_mode: match f.opt_text("return_mode")? {
                Some("direct") => ReturnMode::Direct,
                _ => ReturnMode::Relayed,
            },
            resumes: f.opt_uint("resume_of")?,
            keep: None,
            resume_sig: f.opt_bytes("resume_sig")?.map(<[u8]>::to_vec),
        };
        parsed.keep = match (
            parsed.resumes,
            f.opt_uint("kept_from")?,
            f.opt_uint("keep_positions")?,
        ) {
            (_, None, None) => None,
            (Some(_), Some(0), Some(_)) => bail!("OPEN: kept_from names a remote stage"),
            (Some(of), Some(kept_from), Some(positions)) => Some(StageResume {
                of,
                kept_from: u32::try_from(kept_from).context("OPEN: kept_from")?,
                positions,
            }),
            _ => bail!("OPEN: kept_from and keep_positions come together, with resume_of"),
        };
        // Only a direct return lets a stage leave the replay's replies out:
        // relayed, every step's reply comes back through every stage.
        if parsed.keep.is_some() && parsed.return_mode != ReturnMode::Direct {
            bail!("OPEN: a resume that keeps caches needs the direct return");
        }
        if parsed.resumes.is_some() != parsed.resume_sig.is_some() {
            bail!("OPEN: resume_of and resume_sig come together");
        }
        if let Some(keep) = parsed.keep
            && keep.positions >= parsed.capacity as u64
        {
            bail!("OPEN: keep_positions leaves no room in the request's capacity");
        }
        // Carried down the chain as they are; the assignment is what counts.
        f.opt_text("coordinator")?;
        f.opt_uint("stage_count")?;
        f.finish().context("OPEN")?;
        Ok(parsed)
    }
}

/// One request on a stage, in phases: admit (OPEN read and checked, the
/// sender the assigned upstream, a grant decision, a cache), run (the
/// request's steps, then whatever the neighbours still send) and seal (the
/// steward's receipt, the stage record pushed to the coordinator).
async fn handle_stage(
    inner: Arc<Inner>,
    peer: [u8; 32],
    up_send: quinn::SendStream,
    up_recv: quinn::RecvStream,
) -> anyhow::Result<()> {
    let Some(admitted) = admit_stage(&inner, peer, up_send, up_recv).await? else {
        return Ok(());
    };
    let ran = run_stage(&inner, admitted).await;
    // A failed run was reported and logged where it failed; its record is
    // sealed and pushed all the same.
    seal_stage(&inner, ran).await
}

/// A request a stage took.
struct StageAdmitted {
    slot: Arc<Slot>,
    request_id: u64,
    /// OPEN, as it came: folded, and forwarded to the next stage.
    first: Vec<u8>,
    run_id: String,
    prefill_steps: u64,
    deadline: Deadline,
    return_mode: ReturnMode,
    ticket: crate::runtime::steward::ServeTicket,
    served: ServeRequest,
    cache: Option<CacheLease>,
    /// Its entry among the caches a resume may keep.
    keep: kept::KeepHandle,
    /// Positions its cache came with (taken over from an interrupted
    /// request), counted as prefilled.
    kept_positions: u64,
    /// Prefill steps it runs but sends no further: the next stage kept its
    /// cache.
    silent_steps: u64,
    /// The number its first ACTIVATIONS carries.
    first_step: u64,
    up_send: quinn::SendStream,
    up_recv: quinn::RecvStream,
}

/// What running a request on a stage left to seal.
struct StageRan {
    slot: Arc<Slot>,
    request_id: u64,
    run_id: String,
    ticket: crate::runtime::steward::ServeTicket,
    served: ServeRequest,
    lanes: Folding,
    tokens: Tokens,
    /// Of `tokens.prefill_received`, the positions its cache came with.
    kept_positions: u64,
    terminal: TerminalState,
}

/// Admit: read OPEN (or hand a direct return to the request waiting for
/// it), check its sender is this slice's upstream, decide the grant, open
/// the cache. `None`: handed off or refused (FAILED already sent).
async fn admit_stage(
    inner: &Arc<Inner>,
    peer: [u8; 32],
    mut up_send: quinn::SendStream,
    mut up_recv: quinn::RecvStream,
) -> anyhow::Result<Option<StageAdmitted>> {
    // Only an opening message's worth is read before the sender is checked.
    let first = msg::read(&mut up_recv, MAX_STAGE_OPEN, msg::IDLE_TIMEOUT)
        .await?
        .context("empty stage stream")?;
    let (message_kind, request_id, _, payload) = msg::parse_stage(&first)?;
    if message_kind == kind::DIRECT_OPEN {
        let waiting = {
            let mut directs = lock(&inner.directs);
            match directs.get(&request_id) {
                // Only the final stage the request was routed to may open it.
                Some((expected, _)) if *expected == peer => directs.remove(&request_id),
                _ => None,
            }
        };
        match waiting {
            Some((_, sender)) => {
                let _ = sender.send((up_send, up_recv, first));
            }
            None => bail!(
                "a direct-return stream for request {request_id}, which is not waiting for one from this peer"
            ),
        }
        return Ok(None);
    }
    if message_kind != kind::OPEN {
        bail!("a stage stream must start with OPEN");
    }
    let open = match StageOpen::parse(payload, inner) {
        Ok(open) => open,
        Err(error) => {
            return refuse_stage(inner, &mut up_send, request_id, format!("{error:#}"))
                .await
                .map(|()| None);
        }
    };
    let StageOpen {
        run_id,
        capacity,
        prefill_steps,
        replay_steps,
        deadline,
        return_mode,
        resumes,
        keep: resume,
        resume_sig,
    } = open;
    let slot = lock(&inner.slots).get(&run_id).cloned();
    let Some(slot) = slot else {
        return refuse_stage(
            inner,
            &mut up_send,
            request_id,
            format!("{NO_SLICE} {run_id}"),
        )
        .await
        .map(|()| None);
    };
    if slot.assign.upstream != peer {
        return refuse_stage(
            inner,
            &mut up_send,
            request_id,
            format!(
                "{} is not the upstream of this stage of run {run_id}",
                did_key(&peer)
            ),
        )
        .await
        .map(|()| None);
    }
    slot.touch();
    let assign = &slot.assign;

    // Decide (or take the decision already made for) the grant first, then
    // the cache: a refusal at either releases what the other holds.
    inner.expire_pre_decided();
    inner.kept.expire();
    let pre_decided = {
        let mut tickets = lock(&inner.tickets);
        match tickets.get(&request_id) {
            Some(decided) if decided.coordinator == assign.coordinator => {
                tickets.remove(&request_id)
            }
            _ => None,
        }
    };
    let (ticket, served) = match pre_decided {
        Some(decided) => (decided.ticket, decided.serve),
        None => {
            let serve = span_request(capacity);
            let decided = lock(&inner.steward).authorise(
                None,
                &serve,
                Some(inner.model.weights_digest()),
                "mesh-node/stage",
                now_ms(),
            );
            match decided {
                Ok(ticket) => (ticket, serve),
                Err(error) => {
                    return refuse_stage(inner, &mut up_send, request_id, format!("{error}"))
                        .await
                        .map(|()| None);
                }
            }
        }
    };
    // The request's cache: freed when `cache` is dropped, on every path.
    // A resumed request takes over the cache its interrupted segment built
    // here when its chain keeps this stage's layers; on its coordinator's
    // signed word only, never on an upstream stage's.
    let k = assign.stage_index;
    if let Some(interrupted) = resumes {
        let claim = mesh_protocol::resume::ResumeClaim {
            run_id: run_id.clone(),
            request_id,
            resume_of: interrupted,
            keep: resume.map(|r| (u64::from(r.kept_from), r.positions)),
        };
        let refusal = if interrupted == request_id {
            Some("a request cannot resume itself".to_string())
        } else if resume.is_some_and(|r| r.kept_from > assign.stage_count) {
            // `kept_from == stage_count`: no remote stage keeps its cache
            // (the final stage was lost), the coordinator keeps its own.
            Some(format!(
                "kept_from is past the {} stages",
                assign.stage_count
            ))
        } else if !mesh_protocol::resume::claim_signed_by(
            &claim,
            resume_sig.as_deref().unwrap_or_default(),
            &assign.coordinator,
        ) {
            Some("the resume is not signed by this run's coordinator".to_string())
        } else {
            None
        };
        if let Some(reason) = refusal {
            inner.release_ticket(ticket);
            return refuse_stage(inner, &mut up_send, request_id, format!("OPEN: {reason}"))
                .await
                .map(|()| None);
        }
    }
    let kept_here = resume.filter(|r| k >= r.kept_from);
    if let (Some(interrupted), None) = (resumes, kept_here) {
        // Its place in the pool is given back before this request takes one.
        inner
            .kept
            .end(assign.coordinator, interrupted, DRAIN_WAIT * 2)
            .await;
    }
    let opened = match kept_here {
        Some(r) => take_kept(inner, &slot, r, request_id, capacity).await,
        None => open_cache(inner, &slot, request_id, capacity),
    };
    let cache = match opened {
        Ok(cache) => {
            stats::Counters::bump(&inner.counters.stage_requests);
            Some(cache)
        }
        Err(error) => {
            inner.release_ticket(ticket);
            return refuse_stage(inner, &mut up_send, request_id, format!("{error:#}"))
                .await
                .map(|()| None);
        }
    };
    let keep = inner
        .kept
        .register(slot.assign.coordinator, request_id, &slot.slice);
    Ok(Some(StageAdmitted {
        kept_positions: kept_here.map_or(0, |r| r.positions),
        first_step: if kept_here.is_some() { replay_steps } else { 0 },
        // A stage that kept its cache gets no replay: its first step decodes.
        prefill_steps: if kept_here.is_some() {
            0
        } else {
            prefill_steps
        },
        silent_steps: match resume {
            Some(r) if k + 1 == r.kept_from => prefill_steps,
            _ => 0,
        },
        slot,
        request_id,
        first,
        run_id,
        deadline,
        return_mode,
        ticket,
        served,
        cache,
        keep,
        up_send,
        up_recv,
    }))
}

/// A new cache for a request, giving back parked caches on the slice when
/// they are what stands in the way.
fn open_cache(
    inner: &Inner,
    slot: &Slot,
    request_id: u64,
    capacity: usize,
) -> anyhow::Result<CacheLease> {
    loop {
        match slot.pool.open(&slot.slice, request_id, capacity) {
            Err(mesh_stage::EngineError::Busy(_)) if inner.kept.evict_oldest_on(&slot.slice) => {}
            opened => return Ok(opened?),
        }
    }
}

/// The cache an interrupted request built on this slice, for the resumed
/// request that carries it on: cut back to the positions every kept stage
/// holds, counted in the pool under the new request's id.
async fn take_kept(
    inner: &Inner,
    slot: &Slot,
    resume: StageResume,
    request_id: u64,
    capacity: usize,
) -> anyhow::Result<CacheLease> {
    let wait = inner.step_timeout.min(DRAIN_WAIT * 2);
    let mut lease = inner
        .kept
        .take(slot.assign.coordinator, resume.of, &slot.slice, wait)
        .await?;
    let positions = usize::try_from(resume.positions).context("keep_positions")?;
    if lease.cache().capacity() < capacity {
        bail!(
            "the kept cache holds {} positions, the request asks for {capacity}",
            lease.cache().capacity()
        );
    }
    if lease.positions() < positions {
        bail!(
            "the kept cache of request {} holds {} positions, not {positions}",
            resume.of,
            lease.positions()
        );
    }
    lease.cache().truncate(positions)?;
    lease.rekey(request_id)?;
    Ok(lease)
}

/// Run: open the next hop, then every step (forward it, or return logits),
/// to STOP or a failure; on a failure, say why upstream once and read what
/// the neighbours still send, so every lane is whole.
async fn run_stage(inner: &Arc<Inner>, admitted: StageAdmitted) -> StageRan {
    let StageAdmitted {
        slot,
        request_id,
        first,
        run_id,
        prefill_steps,
        deadline,
        return_mode,
        mut ticket,
        served,
        mut cache,
        keep,
        kept_positions,
        silent_steps,
        first_step,
        mut up_send,
        up_recv,
    } = admitted;
    let assign = &slot.assign;
    let coordinator = did_key(&assign.coordinator);
    let k = assign.stage_index;
    let scope = RequestScope {
        split: SplitKey {
            coordinator_node_id: coordinator.clone(),
            run_id: run_id.clone(),
            request_id,
        },
        stage_count: assign.stage_count,
        return_mode,
    };
    let mut lanes = Folding::new(HopSession::new(scope, k));
    lanes.fold(Wire::FromUpstream, &first);

    // Downstream: its send stream, and its reply stream read in step
    // (relayed) or watched whole-frame by a task (direct, `down_watch`).
    let mut down: Option<(quinn::SendStream, Option<quinn::RecvStream>)> = None;
    let mut down_watch: Option<Frames> = None;
    let mut direct: Option<quinn::SendStream> = None;
    let mut upstream = spawn_frames(up_recv, msg::MAX_STAGE_MESSAGE);
    let mut terminal = TerminalState::TransportError;
    let mut tokens = Tokens {
        prefill_received: kept_positions,
        decode: 0,
    };
    let mut stats = StageStats::default();
    // Positions a REWIND may still drop: the last decode step's draft.
    let mut rewindable: usize = 0;
    // Whether upstream stopped sending: then nothing is reported to it.
    let mut upstream_gone = false;
    lock(&inner.steward).begin_engine(&mut ticket);

    let outcome: anyhow::Result<()> = async {
        if let Some(next) = &assign.downstream {
            let (mut send, recv) = inner.net.open(next, ALPN_STAGE).await?;
            lanes.session.open_downstream();
            write_forward(&mut send, &first[4..], &mut lanes, k, 0).await?;
            if return_mode == ReturnMode::Direct {
                down_watch = Some(spawn_frames(recv, max_reply(slot.slice.config().hidden)));
                down = Some((send, None));
            } else {
                down = Some((send, Some(recv)));
            }
        } else if return_mode == ReturnMode::Direct {
            let coordinator_peer = PeerAddr {
                key: assign.coordinator,
                addr: assign.coordinator_addr,
            };
            let (mut send, _recv) = inner.net.open(&coordinator_peer, ALPN_STAGE).await?;
            lanes.session.open_direct();
            let opening = msg::frame(&msg::stage_body(kind::DIRECT_OPEN, request_id, 0, &[]))?;
            send_frame(
                &mut send,
                &opening,
                &mut lanes,
                Wire::DirectSent,
                "on the direct return",
            )
            .await?;
            direct = Some(send);
        }
        loop {
            // In direct mode replies skip this stage, so its downstream writes
            // to it only to say why it stopped: watch for that (or for the
            // stream closing) while waiting for upstream.
            let read = tokio::select! {
                biased;
                () = keep.superseded.notified() => {
                    // Its coordinator resumed it on a new chain that keeps
                    // this cache: the old chain's upstream is gone, even
                    // if its stream still looks open.
                    upstream_gone = true;
                    bail!("superseded: its coordinator resumed it on a new chain");
                }
                read = tokio::time::timeout(deadline.bound(inner.step_timeout), upstream.recv()) => read,
                said = next_frame(&mut down_watch) => {
                    let frame = said
                        .with_context(|| format!("stage {} closed the request", k + 1))??;
                    lanes.fold(Wire::FromDownstream, &frame);
                    let (_, _, _, reason) = msg::parse_stage(&frame)?;
                    bail!("{}", String::from_utf8_lossy(reason));
                }
            };
            let frame = match read {
                Ok(Some(Ok(frame))) => frame,
                Ok(None) => {
                    terminal = TerminalState::TransportError;
                    upstream_gone = true;
                    bail!("upstream closed the request without STOP");
                }
                Ok(Some(Err(error))) => {
                    upstream_gone = true;
                    terminal = TerminalState::TransportError;
                    return Err(error);
                }
                Err(_) => {
                    upstream_gone = true;
                    terminal = TerminalState::TimedOut;
                    if deadline.is_past() {
                        bail!("{}", deadline.passed("upstream"));
                    }
                    return Err(step_timed_out("upstream", inner.step_timeout));
                }
            };
            lanes.fold(Wire::FromUpstream, &frame);
            let (message_kind, id, step, payload) = msg::parse_stage(&frame)?;
            if id != request_id {
                bail!("a frame of request {id} on the stream of request {request_id}");
            }
            // Steps come in order, one after another: an ACTIVATIONS or a
            // REWIND out of turn is not this request's next step.
            let next = first_step + u64::from(stats.steps);
            match message_kind {
                kind::ACTIVATIONS => {
                    if u64::from(step) != next {
                        bail!("step {step} where step {next} was next");
                    }
                    let (activations, wire) = decode_frame(payload, slot.slice.config().hidden)?;
                    // A replay step whose output the next stage, which kept
                    // its cache, does not need.
                    let silent = u64::from(stats.steps) < silent_steps;
                    // A decode step carries the token sampled and the
                    // draft after it: each row is answered, and each gets
                    // the bits it gets decoded alone.
                    let decode = u64::from(stats.steps) >= prefill_steps;
                    let rows = activations.rows;
                    if decode && rows > MAX_DECODE_ROWS {
                        bail!(
                            "a decode step of {rows} positions: at most {MAX_DECODE_ROWS} (a token and its draft)"
                        );
                    }
                    if decode {
                        tokens.decode += rows as u64;
                        rewindable = rows.saturating_sub(1);
                    } else {
                        tokens.prefill_received += rows as u64;
                        rewindable = 0;
                    }
                    stats.steps += 1;
                    let start = Instant::now();
                    let lease = cache.take().context("the request's cache")?;
                    let (output, lease, engine) = slot
                        .batcher
                        .step(
                            batch::StepInput::Hidden(activations),
                            lease,
                            decode,
                            ticket.bill(),
                        )
                        .await?;
                    cache = Some(lease);
                    stats.compute += start.elapsed();
                    if decode {
                        stats.decode_engine += engine;
                    }
                    let metered = lock(&inner.steward).mark_engine(&mut ticket);
                    if let Some(limit) = ticket.limit_uj().filter(|limit| metered >= *limit) {
                        // This steward's part of the serve ends here; the
                        // failure path tells upstream why, once.
                        terminal = TerminalState::PolicyDenied;
                        bail!(
                            "{POLICY_DENIED}: the energy ceiling of {limit} µJ was reached at stage {k} ({metered} µJ metered)"
                        );
                    }
                    match output {
                        SliceOutput::Hidden(_) if silent => {}
                        SliceOutput::Hidden(a) if down.is_some() => {
                            let frame = encode_frame(&a.values, a.rows, a.cols, wire)?;
                            let (send, down_recv) = down
                                .as_mut()
                                .context("a middle stage without a downstream")?;
                            if let Err(error) = write_forward(
                                send,
                                &msg::stage_body(kind::ACTIVATIONS, request_id, step, &frame),
                                &mut lanes,
                                k,
                                step,
                            )
                            .await
                            {
                                let whom = format!("stage {}", k + 1);
                                return Err(match down_recv.as_mut() {
                                    Some(recv) => {
                                        refusal_behind(recv, error, &whom, Some(&mut lanes)).await
                                    }
                                    None => error,
                                });
                            }
                            if return_mode == ReturnMode::Relayed {
                                let recv =
                                    down_recv.as_mut().context("a relayed downstream's replies")?;
                                let wait = deadline.bound(inner.step_timeout);
                                let reply =
                                    match msg::read_checked(recv, max_reply(slot.slice.config().hidden), wait)
                                        .await
                                    {
                                        Err(_) if deadline.is_past() => {
                                            terminal = TerminalState::TimedOut;
                                            bail!("{}", deadline.passed(&format!("stage {}", k + 1)));
                                        }
                                        read => read?,
                                    }
                                    .context("downstream closed before replying")?;
                                lanes.fold(Wire::FromDownstream, &reply);
                                send_frame(
                                    &mut up_send,
                                    &reply,
                                    &mut lanes,
                                    Wire::ToUpstream,
                                    "upstream",
                                )
                                .await?;
                            }
                        }
                        SliceOutput::Logits(_) => bail!("a chain's slice returned logits"),
                        SliceOutput::Hidden(a) => {
                            // The final stage: in f32 whatever the wire, for
                            // the coordinator's output head, every row of a
                            // decode step (each position is sampled or
                            // checks a drafted token), else the step's last.
                            let answered = if decode { a.rows } else { 1 };
                            let rows = a
                                .values
                                .get(a.rows.saturating_sub(answered) * a.cols..)
                                .filter(|rows| !rows.is_empty())
                                .context("the final slice returned no hidden state")?;
                            let payload = encode_frame(rows, answered, a.cols, WireDType::F32)?;
                            let body = msg::stage_body(kind::HIDDEN, request_id, step, &payload);
                            let bytes = msg::frame(&body)?;
                            match &mut direct {
                                Some(send) => {
                                    send_frame(
                                        send,
                                        &bytes,
                                        &mut lanes,
                                        Wire::DirectSent,
                                        "on the direct return",
                                    )
                                    .await?
                                }
                                None => {
                                    send_frame(
                                        &mut up_send,
                                        &bytes,
                                        &mut lanes,
                                        Wire::ToUpstream,
                                        "upstream",
                                    )
                                    .await?
                                }
                            }
                        }
                    }
                }
                kind::REWIND => {
                    // Only the last decode step's draft can be dropped, and
                    // only once: the positions before it are the request's.
                    let Rewind { positions } = Rewind::parse(payload)?;
                    if u64::from(step) != next {
                        bail!("a rewind carrying step {step}, not the next step {next}");
                    }
                    let lease = cache.as_mut().context("the request's cache")?;
                    let held = lease.positions();
                    let keep = usize::try_from(positions).unwrap_or(usize::MAX);
                    if keep >= held {
                        bail!("a rewind to {keep} positions of {held} drops nothing");
                    }
                    if held - keep > rewindable {
                        bail!(
                            "a rewind to {keep} positions of {held} drops more than the last step's draft ({rewindable} positions)"
                        );
                    }
                    lease.cache().truncate(keep)?;
                    rewindable = 0;
                    if let Some((send, _)) = down.as_mut() {
                        write_forward(send, &frame[4..], &mut lanes, k, step).await?;
                    }
                }
                kind::STOP => {
                    let state = Cbor::decode(payload).ok().and_then(|c| {
                        c.get("terminal_state")
                            .and_then(Cbor::as_text)
                            .and_then(TerminalState::parse)
                    });
                    terminal = state.unwrap_or(TerminalState::Completed);
                    // Upstream reads nothing more on this request.
                    upstream_gone = true;
                    if let Some((send, _)) = down.as_mut() {
                        write_forward(send, &frame[4..], &mut lanes, k, step).await?;
                    }
                    return Ok(());
                }
                other => bail!("unexpected stage message kind {other}"),
            }
        }
    }
    .await;
    // A failed request's cache waits a while for a resume to keep it: let
    // go of it now, before the neighbours' last frames are read.
    keep.release(
        cache.take(),
        outcome.is_err()
            && matches!(
                terminal,
                TerminalState::TransportError | TerminalState::TimedOut
            ),
    );
    if let Err(error) = &outcome {
        tracing::warn!(stage = k, request_id, "{error:#}");
        // Upstream is still waiting for this step's reply: say why there is
        // none (a relayed reply is read, and folded, by the node before).
        if !upstream_gone {
            // A steward's stop keeps its `policy_denied` prefix on the way up.
            let reason = format!("{error:#}");
            let reason = if reason.starts_with(POLICY_DENIED) {
                reason
            } else {
                format!("stage {k}: {reason}")
            };
            let body = msg::stage_body(
                kind::FAILED,
                request_id,
                stats.steps,
                failed_reason(&reason),
            );
            if let Ok(bytes) = msg::frame(&body) {
                let _ = send_frame(
                    &mut up_send,
                    &bytes,
                    &mut lanes,
                    Wire::ToUpstream,
                    "upstream",
                )
                .await;
            }
        }
        // Upstream may have sent more before it learned of the failure:
        // read and fold it, so its digest and this one still agree. The
        // downstream ends its part once this stage's stream to it finishes.
        if let Some((send, _)) = down.as_mut() {
            let _ = send.finish();
        }
        if !upstream_gone {
            drain(&mut upstream, &mut lanes, Wire::FromUpstream).await;
        }
        if let Some(watch) = down_watch.as_mut() {
            drain(watch, &mut lanes, Wire::FromDownstream).await;
        }
    }
    slot.touch();
    if let Some((mut send, _)) = down.take() {
        let _ = send.finish();
    }
    if let Some(mut send) = direct.take() {
        let _ = send.finish();
    }
    let _ = up_send.finish();
    stats.fold = lanes.spent;
    inner.record_stats(request_id, stats);

    StageRan {
        slot,
        request_id,
        run_id,
        ticket,
        served,
        lanes,
        tokens,
        kept_positions,
        terminal,
    }
}

/// Seal: the steward's receipt for the metered span (nothing billed for
/// waiting on a peer that failed), and the stage record, pushed to the
/// coordinator.
async fn seal_stage(inner: &Arc<Inner>, ran: StageRan) -> anyhow::Result<()> {
    let StageRan {
        slot,
        request_id,
        run_id,
        ticket,
        served,
        lanes,
        tokens,
        kept_positions,
        terminal,
        ..
    } = ran;
    let assign = &slot.assign;
    let k = assign.stage_index;
    // The stage's own evidence: its steward's receipt for the metered span,
    // and its stage record, pushed to the coordinator.
    let metered = {
        let mut steward = lock(&inner.steward);
        let weights = Some(inner.model.weights_digest());
        if terminal == TerminalState::Completed {
            steward.end_engine(ticket, weights)
        } else {
            // Waiting for a peer that failed or went away is not billed.
            steward.end_engine_at_mark(ticket, weights)
        }
    };
    if let Ok(metered) = metered {
        let receipt = stage_receipt(
            inner,
            request_id,
            &run_id,
            k,
            (&tokens, kept_positions),
            &served,
            &metered,
        );
        if let Err(error) = lock(&inner.steward).seal(receipt) {
            tracing::error!(request_id, "stage receipt not sealed: {error}");
        }
    }
    // A final stage that never opened its direct return folded nothing on
    // it: the session shows the empty lane.
    let block = lanes.session.block(
        &SliceFacts {
            topology_hash: assign.topology_hash.clone(),
            stage_index: k,
            layer_start: slot.slice.range.start,
            layer_end: slot.slice.range.end,
            package_id: inner.model.package_id(),
            manifest_sha256: assign.manifest,
            source_model_sha256: inner.model.package_id(),
        },
        tokens,
        terminal,
    );
    push_stage_record(inner, assign, &block).await
}

/// The request a stage's steward meters a span for: a stage never sees the
/// prompt, so it names the span by its positions only.
fn span_request(capacity: usize) -> ServeRequest {
    ServeRequest {
        prompt_hash: [0; 32],
        prompt_tokens: u32::try_from(capacity).unwrap_or(u32::MAX),
        max_tokens: 0,
        fidelity_floor: Fidelity::F0,
        joule_ceiling_uj: u64::MAX,
        decision: None,
    }
}

fn stage_receipt(
    inner: &Inner,
    request_id: u64,
    run_id: &str,
    stage: u32,
    (tokens, kept): (&Tokens, u64),
    served: &ServeRequest,
    metered: &crate::runtime::steward::Metered,
) -> MeshReceipt {
    let recipe = format!("stage {stage} of run {run_id}, request {request_id}");
    let route = format!("assigned by coordinator for run {run_id}");
    let nonce = crate::runtime::keys::random_bytes().unwrap_or([0; 16]);
    MeshReceipt {
        grant_id: metered.grant_id,
        weights: Some(WeightsBinding {
            weights_digest: inner.model.weights_digest(),
            precision: "q8_0/f32".into(),
        }),
        // Positions a kept cache came with were read before, by the
        // interrupted request's own receipt: restored here, not read again.
        tokens_in: (tokens.prefill_received + tokens.decode).saturating_sub(kept),
        cache_hit_tokens: kept,
        grant_breach: metered
            .debit
            .as_ref()
            .and_then(|d| d.breach)
            .map(str::to_string),
        ..MeshReceipt::blank(
            served.request_id(),
            "mesh-node/stage",
            &recipe,
            &route,
            metered.energy,
            nonce,
        )
    }
}

/// Seal a stage's record, log it, and push it to its coordinator: as a
/// `record_push_bundle` (the record, its inclusion proof and a checkpoint
/// of this node's log) when checkpoints are on, else bare; a bundle
/// refused as a malformed request (an older receiver) is pushed again
/// bare, once.
async fn push_stage_record(
    inner: &Arc<Inner>,
    assign: &Assign,
    block: &StageBlock,
) -> anyhow::Result<()> {
    let context = RecordContext {
        producer: Producer::mesh_node(),
        timestamp: format_timestamp(now_ms()),
        store_nonce: crate::runtime::keys::random_bytes()?,
        chain_parent: None,
    };
    let record = SealedRecord::seal(stage_record(&context, block)?, &inner.key)?;
    // Into this node's transparency log before it leaves.
    let leaf = lock(&inner.steward)
        .log_records(&[record.capsule_id()])?
        .first()
        .copied()
        .context("the record's leaf")?;
    let bundle = inner
        .record_checkpoints
        .then(|| log_proof(inner, leaf))
        .flatten()
        .map(|(inclusion, checkpoint)| {
            serde_json::json!({
                "record_push_bundle": 1,
                "capsule": record.value(),
                "inclusion": inclusion,
                "checkpoint": checkpoint,
            })
        });
    let coordinator = PeerAddr {
        key: assign.coordinator,
        addr: assign.coordinator_addr,
    };
    if let Some(bundle) = &bundle {
        let reply = push_body(inner, &coordinator, bundle).await?;
        // An older receiver reads a bundle as a malformed request
        // (split-stage §3.6); a `bundle_malformed` is this record's own
        // fault, and would be refused bare too.
        if reply["reason"] != "request_malformed" {
            if reply["status"] != "received" {
                tracing::warn!("stage record refused: {reply}");
            }
            return Ok(());
        }
        tracing::info!("the coordinator does not read bundles: pushing the record bare");
    }
    let reply = push_body(inner, &coordinator, record.value()).await?;
    if reply["status"] != "received" {
        tracing::warn!("stage record refused: {reply}");
    }
    Ok(())
}

/// One push on `record-push/1`: this node's id, a newline, `body`; the reply.
async fn push_body(
    inner: &Arc<Inner>,
    coordinator: &PeerAddr,
    body: &serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    let mut bytes = inner.tls.did.as_bytes().to_vec();
    bytes.push(b'\n');
    bytes.extend_from_slice(&serde_json::to_vec(body)?);
    let (mut send, mut recv) = inner.net.open(coordinator, ALPN_RECORD_PUSH).await?;
    tokio::time::timeout(msg::IDLE_TIMEOUT, send.write_all(&bytes))
        .await
        .context("timed out pushing the stage record")??;
    send.finish()?;
    let reply = tokio::time::timeout(msg::IDLE_TIMEOUT, recv.read_to_end(64 * 1024))
        .await
        .context("timed out waiting for the push reply")??;
    Ok(serde_json::from_slice(&reply).unwrap_or_default())
}

/// A record's place (leaf `main_leaf`) in this node's log: its inclusion
/// proof and a checkpoint it is proven under (the requester's bundle, a
/// stage's push).
fn log_proof(inner: &Inner, main_leaf: u64) -> Option<(serde_json::Value, serde_json::Value)> {
    let (proof, checkpoint) =
        lock(&inner.steward).prove_and_checkpoint(main_leaf, &format_timestamp(now_ms()))?;
    Some((
        serde_json::json!({ "leaf_index": main_leaf, "proof": proof.to_value() }),
        checkpoint,
    ))
}

/// A refusal to a node, with the error's whole chain as its reason.
fn refused(error: &anyhow::Error) -> ControlReply {
    ControlReply::Refused {
        reason: coordinator::bounded_reason(&format!("{error:#}")),
    }
}

// ----------------------------------------------------------- record-push/1

async fn handle_push(
    inner: Arc<Inner>,
    peer: [u8; 32],
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) -> anyhow::Result<()> {
    // Only a node assigned a stage of a split this coordinator holds open has
    // a record to push: anyone else is refused before its body is read.
    if !lock(&inner.collector).expects_from(&peer) {
        let reply = signed_refusal(
            &inner.key,
            b"",
            crate::runtime::records::PushRefusal::NotAStageOfThisSplit,
        );
        send.write_all(&serde_json::to_vec(&reply)?).await?;
        send.finish()?;
        let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
        return Ok(());
    }
    let body = match tokio::time::timeout(msg::IDLE_TIMEOUT, recv.read_to_end(msg::MAX_RECORD_PUSH))
        .await
    {
        Ok(Ok(body)) => body,
        Ok(Err(_)) => {
            let reply = signed_refusal(
                &inner.key,
                b"",
                crate::runtime::records::PushRefusal::TooLarge,
            );
            send.write_all(&serde_json::to_vec(&reply)?).await?;
            send.finish()?;
            return Ok(());
        }
        Err(_) => bail!("timed out reading a record push"),
    };
    let outcome = lock(&inner.collector).offer(&peer, &body);
    let reply = match outcome {
        Ok(received) => {
            if received == crate::runtime::records::Received::Proven {
                stats::Counters::bump(&inner.counters.records_proven);
            }
            inner.collected.notify_waiters();
            serde_json::json!({ "status": "received" })
        }
        Err(refusal) => signed_refusal(&inner.key, &body, refusal),
    };
    send.write_all(&serde_json::to_vec(&reply)?).await?;
    send.finish()?;
    let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    Ok(())
}

// ------------------------------------------------------------ mesh

/// Join the mesh: measure this node's decode speed (once per model), and
/// advertise its data address, model, memory, speed and load.
async fn start_mesh(
    inner: &Arc<Inner>,
    data: &std::path::Path,
    settings: &MeshSettings,
) -> anyhow::Result<crate::runtime::mesh::Mesh> {
    use crate::runtime::{mesh, planner};
    let model = &inner.model;
    let speed = match settings.decode_us_per_layer {
        Some(us) => us.max(1),
        None => tokio::task::block_in_place(|| {
            let _elsewhere = batch::elsewhere::Pass::begin();
            planner::decode_speed(model, data)
        })?,
    };
    // A GPU node holds its slices in the GPU's memory, not the host's.
    let device = model.device();
    let memory = match settings.memory_bytes {
        Some(bytes) => Some(bytes),
        None => match mesh_stage::gpu_free_memory(device)? {
            Some(gpu) => Some(gpu),
            None => planner::available_memory(),
        },
    }
    .context("cannot tell this machine's free memory: give --memory-mib")?;
    let weak = Arc::downgrade(inner);
    let base = mesh_protocol::advert::Advert {
        node_id: inner.tls.public_key,
        seq: 0,
        issued_ms: 0,
        ttl_ms: 0,
        quic: inner.advertise.to_string(),
        device: mesh_stage::device_name(device),
        memory_bytes: memory,
        load: 0,
        models: vec![mesh_protocol::advert::AdvertModel {
            package_id: model.package_id(),
            layers: model.config().layers,
            decode_us_per_layer: speed,
        }],
    };
    let facts: mesh::AdvertFacts = Arc::new(move || {
        let mut advert = base.clone();
        if let Some(inner) = weak.upgrade() {
            let open: usize = lock(&inner.slots)
                .values()
                .map(|slot| slot.pool.open_requests())
                .sum();
            advert.load = u32::try_from(open).unwrap_or(u32::MAX);
        }
        advert
    });
    let mut options = mesh::MeshOptions::new(inner.key.clone());
    options.listen = if settings.listen.is_empty() {
        vec![mesh::same_port_listen(
            inner
                .endpoint
                .local_addr()
                .context("the QUIC endpoint's address")?,
        )]
    } else {
        settings.listen.clone()
    };
    options.bootstrap = settings.bootstrap.clone();
    options.mdns = settings.mdns;
    options.facts = Some(facts);
    mesh::Mesh::start(options).await
}

impl Inner {
    /// Whether this node takes assignments from `peer`: a configured
    /// coordinator, or, when none is configured and the node is in a mesh,
    /// any current member of the mesh.
    pub(super) fn serves_coordinator(&self, peer: &[u8; 32]) -> bool {
        if self.coordinators.is_empty() {
            self.mesh.get().is_some_and(|m| m.is_member(peer))
        } else {
            self.coordinators.contains(peer)
        }
    }

    /// Whether `key`'s mesh connection closed at or after `since`: its
    /// process is gone, and nothing more will come from it.
    pub(super) fn left_mesh_since(&self, key: &[u8; 32], since: Instant) -> bool {
        self.mesh.get().is_some_and(|m| m.closed_since(key, since))
    }

    /// The chain the next run uses: the configured peers split by bytes, or
    /// the planner's choice over the mesh's current members. Over a mesh the
    /// current run is kept while every stage of it is still a usable member
    /// and the new plan is not `MIN_REPLAN_GAIN` faster: round trips jitter,
    /// and each new run costs every stage a new assignment.
    fn chain(&self, current: Option<&Run>) -> anyhow::Result<Chain> {
        let layers = self.model.config().layers;
        if !self.peers.is_empty() {
            let stages = self.peers.len() as u32 + 1;
            if stages > layers {
                bail!("{stages} stages for a model of {layers} layers");
            }
            if stages as usize > mesh_protocol::receipt::MAX_STAGES {
                bail!(
                    "{stages} stages: a split's receipt routes at most {}",
                    mesh_protocol::receipt::MAX_STAGES
                );
            }
            // By bytes, not layer counts: the first slice (this node's) also
            // holds the embedding and the output head.
            let ranges =
                mesh_stage::split_by_bytes(&self.model.layer_bytes().with_head_on_first(), stages);
            return Ok((self.peers.clone(), ranges, None));
        }
        let Some(mesh) = self.mesh.get() else {
            bail!(
                "this node has no peers to split over; start it with --peer NODEID@HOST:PORT, \
                 or join a mesh (--bootstrap MULTIADDR, or mDNS on a LAN)"
            );
        };
        let (mut plan, usable, (own, others)) = self.plan_now(mesh)?;
        // A chain that lost a stage keeps its survivors where they were
        // (their loaded layers, and the caches a resumed request keeps)
        // when that costs little more than the best plan.
        if let Some(run) = current
            && run.projected_us.is_some()
            && !run.peers.iter().all(|p| usable.contains(&(p.key, p.addr)))
        {
            let interrupted: Vec<([u8; 32], std::ops::Range<u32>)> = run
                .keys
                .iter()
                .zip(&run.assigns)
                .map(|(key, a)| (*key, a.layer_start..a.layer_end))
                .collect();
            if let Some(kept) = mesh_protocol::plan::keep_in_place(
                &crate::runtime::planner::model_shape(&self.model),
                &own,
                &others,
                &interrupted,
                &plan,
                MIN_REPLAN_GAIN,
            ) {
                plan = kept;
            }
        }
        if let Some(run) = current
            && let Some(before) = run.projected_us
            && run.peers.iter().all(|p| usable.contains(&(p.key, p.addr)))
            && plan
                .projected_us_per_token
                .saturating_mul(MIN_REPLAN_GAIN.1)
                > before.saturating_mul(MIN_REPLAN_GAIN.0)
        {
            let ranges = run
                .assigns
                .iter()
                .map(|a| a.layer_start..a.layer_end)
                .collect();
            return Ok((run.peers.clone(), ranges, Some(before)));
        }
        let members = mesh.members();
        let mut peers = Vec::new();
        for stage in &plan.stages[1..] {
            let advert = members
                .iter()
                .find(|m| m.advert.node_id == stage.node_id)
                .map(|m| &m.advert)
                .context("a planned member left while planning")?;
            peers.push(PeerAddr {
                key: stage.node_id,
                addr: advert.quic.parse().context("a member's data address")?,
            });
        }
        let ranges = plan.stages.iter().map(|s| s.layers.clone()).collect();
        Ok((peers, ranges, Some(plan.projected_us_per_token)))
    }

    /// The planner's plan over the mesh as it is now, and the members it
    /// could have used (key and data address).
    fn plan_now(
        &self,
        mesh: &crate::runtime::mesh::Mesh,
    ) -> anyhow::Result<(mesh_protocol::plan::Plan, Vec<Usable>, Candidates)> {
        use mesh_protocol::plan::{LeftOut, Stages};
        // Planning weighs every member (milliseconds for a large model and
        // mesh): the same member set and refusals give the plan made last.
        // The generation first: a change after it makes the next call plan
        // again, never a plan cached under a generation it did not see.
        let generation = mesh.generation();
        let members = mesh.members();
        let addresses: Vec<([u8; 32], String)> = members
            .iter()
            .map(|m| (m.advert.node_id, m.advert.quic.clone()))
            .collect();
        let refused_now: Vec<[u8; 32]> = {
            let mut refused = lock(&self.refused);
            // A pause ends when it runs out, or when the member left and
            // came back since (a restarted node is not the one that refused).
            let member_for: HashMap<[u8; 32], Duration> = members
                .iter()
                .map(|m| (m.advert.node_id, Duration::from_millis(m.member_for_ms)))
                .collect();
            let now = Instant::now();
            refused.retain(|key, until| {
                let refused_ago =
                    REFUSED_MEMBER_PAUSE.saturating_sub(until.saturating_duration_since(now));
                now < *until && member_for.get(key).is_none_or(|stay| *stay >= refused_ago)
            });
            let mut keys: Vec<[u8; 32]> = refused.keys().copied().collect();
            keys.sort_unstable();
            keys
        };
        if let Some(cached) = lock(&self.plan_cache).as_ref()
            && cached.generation == generation
            && cached.refused == refused_now
            && cached.addresses == addresses
        {
            return Ok((
                cached.plan.clone(),
                cached.usable.clone(),
                cached.candidates.clone(),
            ));
        }
        let (own, mut others) = crate::runtime::planner::candidates(
            &self.model.package_id(),
            &self.tls.public_key,
            &members,
        )?;
        // The refusals the plan is cached under are the ones it weighs.
        for (candidate, reason) in &mut others {
            if reason.is_none() && refused_now.binary_search(&candidate.node_id).is_ok() {
                *reason = Some(LeftOut::Refused);
            }
        }
        let stages = match self.stages {
            Some(n) if n < 2 => bail!("split serving needs at least 2 stages, not {n}"),
            Some(n) => Stages::Pinned(n),
            None => Stages::AtLeast(2),
        };
        let usable: Vec<Usable> = others
            .iter()
            .filter(|(_, reason)| reason.is_none())
            .filter_map(|(candidate, _)| {
                let advert = &members
                    .iter()
                    .find(|m| m.advert.node_id == candidate.node_id)?
                    .advert;
                Some((candidate.node_id, advert.quic.parse().ok()?))
            })
            .collect();
        let plan = mesh_protocol::plan::plan(
            &crate::runtime::planner::model_shape(&self.model),
            &own,
            &others,
            stages,
        )
        .map_err(|error| {
            anyhow!(
                "no plan over the mesh's {} member(s): {error}",
                members.len()
            )
        })?;
        *lock(&self.plan_cache) = Some(PlanCache {
            generation,
            addresses,
            refused: refused_now,
            plan: plan.clone(),
            usable: usable.clone(),
            candidates: (own.clone(), others.clone()),
        });
        Ok((plan, usable, (own, others)))
    }
}

// ------------------------------------------------------------ coordinator

impl Inner {
    /// Tell a stage its slice of `run_id` is no longer used (best effort,
    /// bounded: a stage that is gone or slow frees it by its idle timer).
    async fn unassign_remote(
        self: &Arc<Self>,
        peer: &PeerAddr,
        run_id: &str,
    ) -> anyhow::Result<()> {
        let message = ControlRequest::Unassign {
            run_id: run_id.to_string(),
        }
        .to_cbor();
        let exchange = async {
            let (mut send, mut recv) = self.net.open(peer, ALPN_CONTROL).await?;
            msg::exchange(&mut send, &mut recv, &message, Duration::from_secs(5)).await
        };
        match tokio::time::timeout(Duration::from_secs(10), exchange).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(error),
            Err(_) => bail!("no answer within 10 s"),
        }
    }

    /// Send every remote stage its assignment at once and wait for all to be
    /// ready; the time after which they are to be sent again.
    async fn assign_remote(
        self: &Arc<Self>,
        peers: &[PeerAddr],
        assigns: &[Assign],
    ) -> anyhow::Result<Duration> {
        let mut waits = Vec::new();
        for (peer, assign) in peers.iter().zip(assigns.iter().skip(1)) {
            let inner = self.clone();
            let peer = peer.clone();
            let message = assign.to_cbor();
            waits.push(tokio::spawn(async move {
                let (mut send, mut recv) = inner.net.open(&peer, ALPN_CONTROL).await?;
                let reply = msg::exchange(&mut send, &mut recv, &message, Duration::from_secs(300))
                    .await?
                    .context("no answer to the assignment")?;
                match ControlReply::from_cbor(&reply)? {
                    ControlReply::Ready { slice_idle_ms, .. } => {
                        Ok::<Duration, anyhow::Error>(Duration::from_millis(slice_idle_ms))
                    }
                    ControlReply::Refused { reason } => bail!("{peer} refused its slice: {reason}"),
                    other => bail!("{peer} answered `{}` to its assignment", other.kind()),
                }
            }));
        }
        let mut shortest = DEFAULT_SLICE_IDLE;
        let mut failed = None;
        for (peer, wait) in peers.iter().zip(waits) {
            match wait.await.map_err(|e| anyhow!("assignment task: {e}")) {
                Ok(Ok(idle)) => shortest = shortest.min(idle),
                Ok(Err(error)) | Err(error) => {
                    if self.mesh.get().is_some() {
                        // The next plan goes around it for a while.
                        lock(&self.refused).insert(peer.key, Instant::now() + REFUSED_MEMBER_PAUSE);
                        self.refusals
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    failed.get_or_insert(error);
                }
            }
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(shortest / 2),
        }
    }

    /// The run for the next request: the current one while its chain is
    /// still the one to use (re-sending its assignments when a stage may
    /// have lost its slice), or a new run (a new `run_id`) over the chain
    /// the configured peers or the mesh's members give now. Requests in
    /// flight keep the run they started on. Over a mesh, a chain whose
    /// assignment is refused is planned again around the refusing member.
    async fn ensure_run(self: &Arc<Self>) -> anyhow::Result<Arc<Run>> {
        let until = Instant::now() + MESH_SETTLE_WAIT;
        loop {
            let refused_before = self.refusals.load(std::sync::atomic::Ordering::Relaxed);
            match self.ensure_run_once().await {
                Err(error) if self.mesh.get().is_some() && Instant::now() < until => {
                    tracing::info!("planning again: {error:#}");
                    let refused_now =
                        self.refusals.load(std::sync::atomic::Ordering::Relaxed) > refused_before;
                    if let Some(mesh) = self.mesh.get().filter(|_| !refused_now) {
                        // Members may still be joining (a node just
                        // started, or this one restarted and they are
                        // reconnecting): wait for the mesh to change. A
                        // member that refused is planned around at once.
                        let left = until.saturating_duration_since(Instant::now());
                        mesh.changed(left.min(Duration::from_secs(2))).await;
                    }
                }
                outcome => return outcome,
            }
        }
    }

    async fn ensure_run_once(self: &Arc<Self>) -> anyhow::Result<Arc<Run>> {
        let mut guard = self.run.lock().await;
        let (peers, ranges, projected_us) = self.chain(guard.as_deref())?;
        if let Some(run) = guard.as_ref().filter(|run| {
            run.peers == peers
                && run
                    .assigns
                    .iter()
                    .map(|a| a.layer_start..a.layer_end)
                    .eq(ranges.iter().cloned())
        }) {
            let stale = run.stale.swap(false, std::sync::atomic::Ordering::Relaxed);
            if stale || lock(&run.own.last_used).elapsed() >= run.refresh_after {
                // A stage may have freed its slice as idle, or restarted:
                // assigning again keeps the slice it holds, or loads it anew.
                if let Err(error) = self.assign_remote(&run.peers, &run.assigns).await {
                    run.stale.store(true, std::sync::atomic::Ordering::Relaxed);
                    return Err(error);
                }
                run.own.touch();
            }
            return Ok(run.clone());
        }
        let stages = ranges.len() as u32;
        let run_id = format!(
            "mesh-split-{}",
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        let mut keys = vec![self.tls.public_key];
        keys.extend(peers.iter().map(|p| p.key));
        let topology: Vec<Assignment> = ranges
            .iter()
            .zip(&keys)
            .map(|(r, key)| Assignment {
                node_id: did_key(key),
                layer_start: r.start,
                layer_end: r.end,
                package_id: self.model.package_id(),
            })
            .collect();
        let topology_hash = {
            let cbor = Cbor::Array(
                topology
                    .iter()
                    .map(|a| {
                        Cbor::text_map([
                            ("node_id", Cbor::text(&a.node_id)),
                            ("layer_start", Cbor::Uint(a.layer_start.into())),
                            ("layer_end", Cbor::Uint(a.layer_end.into())),
                        ])
                    })
                    .collect(),
            );
            mesh_protocol::hex::encode(blake3::hash(&cbor.encode()).as_bytes())
        };
        let mut assigns = Vec::new();
        for (k, range) in ranges.iter().enumerate() {
            let assign = Assign {
                run_id: run_id.clone(),
                package_id: self.model.package_id(),
                layer_start: range.start,
                layer_end: range.end,
                stage_index: k as u32,
                stage_count: stages,
                coordinator: self.tls.public_key,
                coordinator_addr: self.advertise,
                upstream: keys[k.saturating_sub(1)],
                downstream: peers.get(k).cloned(),
                topology_hash: topology_hash.clone(),
                manifest: self.model.manifest_sha256(),
            };
            assigns.push(assign);
        }
        // Remote stages load in parallel with the own slice.
        let remote = {
            let inner = self.clone();
            let (peers, assigns) = (peers.clone(), assigns.clone());
            tokio::spawn(async move { inner.assign_remote(&peers, &assigns).await })
        };
        let own_range = ranges[0].clone();
        // The coordinator holds the output head: the final stage returns its
        // hidden state, and the logits are computed (and sampled) here. A
        // new run on the same own layers keeps the loaded slice (and the
        // caches of requests resumed onto it).
        let kept_own = guard
            .as_ref()
            .filter(|old| old.own.holds_layers_of(&assigns[0]))
            .map(|old| Arc::new(old.own.reassigned(assigns[0].clone())));
        let own = match kept_own {
            Some(own) => own,
            None => {
                let own_slice =
                    tokio::task::block_in_place(|| self.model.load_chain_slice(own_range, true))?;
                self.slot(own_slice, assigns[0].clone())
            }
        };
        let refresh_after = remote
            .await
            .map_err(|e| anyhow!("assignment task: {e}"))??;
        tracing::info!(
            run_id,
            stages,
            ranges = ?ranges,
            "a new run: assigned every stage"
        );
        let run = Arc::new(Run {
            peers,
            projected_us,
            assigns,
            topology,
            keys,
            own,
            refresh_after,
            stale: std::sync::atomic::AtomicBool::new(false),
        });
        *lock(&self.own_slot) = Some(run.own.clone());
        if let Some(old) = guard.replace(run.clone()) {
            // Stages the new plan left out free their slices now rather
            // than when their idle timer runs out; not while a request still
            // runs on the old run (its OPEN may not have reached them yet).
            let dropped: Vec<PeerAddr> = old
                .peers
                .iter()
                .filter(|p| !run.peers.contains(p))
                .cloned()
                .collect();
            if !dropped.is_empty() {
                let inner = self.clone();
                tokio::spawn(async move {
                    let run_id = old.assigns[0].run_id.clone();
                    let waited = Instant::now();
                    // This task holds the last reference but for requests.
                    while Arc::strong_count(&old) > 1 && waited.elapsed() < inner.request_timeout {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    drop(old);
                    for peer in dropped {
                        if let Err(error) = inner.unassign_remote(&peer, &run_id).await {
                            tracing::debug!(peer = %peer.did(), "unassign: {error:#}");
                        }
                    }
                });
            }
        }
        Ok(run)
    }
}
