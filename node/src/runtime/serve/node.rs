//! A running node: its roles put together. It opens the model and the
//! steward, binds the QUIC endpoint, builds the node-wide [`Shared`] part,
//! the stage role and the coordinator role, and hands each protocol to its
//! handler through the [`Router`]; then, optionally, the mesh membership
//! and the HTTP API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use mesh_protocol::SigningKey;
use mesh_protocol::block::ReturnMode;
use mesh_protocol::mesh1::Fidelity;
use mesh_stage::ModelHandle;
use mesh_stage::frame::WireDType;

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::energy::EnergyMeter;
use crate::runtime::net::peers::{PeerAddr, Peers};
use crate::runtime::net::reach::{ALPN_REACH, PublicMembers, Reachability, Rendezvous};
use crate::runtime::net::tls::{self, TlsIdentity};
use crate::runtime::net::{ALPN_CONTROL, ALPN_RECORD_PUSH, ALPN_STAGE};
use crate::runtime::router::Router;
use crate::runtime::serve::batch;
use crate::runtime::serve::control;
use crate::runtime::serve::control::Control;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::role::MAX_DRAFT_TOKENS;
use crate::runtime::serve::coordinator::role::MAX_PREFILL_CHUNK_TOKENS;
use crate::runtime::serve::coordinator::role::MAX_RESUMES;
use crate::runtime::serve::coordinator::role::Settings;
use crate::runtime::serve::push::Push;
use crate::runtime::serve::shared::Shared;
use crate::runtime::serve::shared::engine_context;
use crate::runtime::serve::stage;
use crate::runtime::serve::stage::role::StageRole;
use crate::runtime::serve::stats;
use crate::runtime::serve::stats::NodeStats;
use crate::runtime::serve::stream::StageStreams;
use crate::runtime::steward::Steward;
use anyhow;

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
    /// Requests a coordinator lets wait for a place when all
    /// `max_requests` are taken (0: refused at once).
    pub max_queued: usize,
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
    /// The share of requests a coordinator audits by running their stages'
    /// layers itself (0..=1; 0: none).
    pub audit_rate: f64,
    /// How long a node whose output failed an audit is left out of plans.
    pub audit_pause: Duration,
    /// Keep each audited request's tape here (`replay --tape`).
    pub audit_tapes: Option<PathBuf>,
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
    /// Offer a relay to members behind NATs, within these limits.
    pub relay: Option<crate::runtime::mesh::RelayLimits>,
}

/// A running node.
pub struct Node {
    shared: Arc<Shared>,
    stage: Arc<StageRole>,
    coordinator: Arc<CoordinatorRole>,
    accept: tokio::task::JoinHandle<()>,
    /// Learning and keeping how others reach this node (in a mesh).
    reach: Option<tokio::task::JoinHandle<()>>,
    http: Option<crate::runtime::http::HttpApi>,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(reach) = &self.reach {
            reach.abort();
        }
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("did", &self.shared.tls.did)
            .field("addr", &self.shared.advertise)
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

impl Node {
    /// Open the model and the steward, bind the endpoint, start serving.
    pub async fn start(options: NodeOptions) -> anyhow::Result<Node> {
        tls::install_provider();
        let tls = TlsIdentity::new(&options.key)?;
        // Ports first: one taken is said before the model is read.
        let server = tls::server_config(
            &tls,
            &[ALPN_CONTROL, ALPN_STAGE, ALPN_RECORD_PUSH, ALPN_REACH],
        )?;
        let (endpoint, tunnel, relayed_packets) =
            crate::runtime::net::tunnel::endpoint(server, options.listen).with_context(|| {
                format!("binding {} (is another node using it?)", options.listen)
            })?;
        let http_listener = match options.http {
            Some(listen) => Some(crate::runtime::http::bind(listen).await?),
            None => None,
        };
        let model = crate::runtime::open_model(&options.model)?.on_device(options.device.clone());
        if !options.peers.is_empty() {
            // A coordinator tokenizes every request: its tokenizer is built
            // now, not at the first request. A stage never builds one; a
            // mesh node builds it at its first request as a coordinator.
            model.text()?;
        }
        let training = declared_training(&model);
        let draft_model = match options
            .draft_model
            .as_ref()
            .filter(|_| options.draft_tokens > 0)
        {
            Some(path) => {
                let context = engine_context(&model);
                Some(Arc::new(
                    crate::runtime::serve::coordinator::draft::DraftModel::load(
                        path,
                        &model,
                        options.max_requests.max(1),
                        context,
                    )?,
                ))
            }
            None => None,
        };
        let relay = relay_bounds(&options);
        let steward = open_steward(&options.data, &options.key, options.meter, &model)?;
        let advertise = advertised(&endpoint, options.advertise, options.mesh.is_some())?;
        let shared = Arc::new(Shared {
            net: Peers::new(endpoint.clone(), tls.clone(), tunnel, relayed_packets),
            tls,
            key: options.key.clone(),
            endpoint,
            advertise,
            model,
            steward: Mutex::new(steward),
            counters: stats::Counters::default(),
            mesh: std::sync::OnceLock::new(),
            step_timeout: options.step_timeout,
            request_timeout: options.request_timeout,
            max_requests: options.max_requests,
            record_checkpoints: options.record_checkpoints,
            peers: options.peers.clone(),
            coordinators: options.coordinators.clone(),
        });
        let stage = Arc::new(StageRole::new(
            shared.clone(),
            options.max_slices,
            options.slice_idle,
        ));
        let coordinator = Arc::new(CoordinatorRole::new(
            shared.clone(),
            Settings {
                return_mode: options.return_mode,
                prefill_chunk_tokens: options
                    .prefill_chunk_tokens
                    .clamp(1, MAX_PREFILL_CHUNK_TOKENS),
                draft_tokens: options.draft_tokens.min(MAX_DRAFT_TOKENS),
                max_resumes: options.max_resumes.min(MAX_RESUMES),
                max_queued: options.max_queued,
                wire: options.wire,
                seal_deadline: options.stage_seal_deadline,
                audit_rate: options.audit_rate.clamp(0.0, 1.0),
                audit_pause: options.audit_pause,
                audit_tapes: options.audit_tapes.clone(),
            },
            (options.stages, options.fidelity),
            draft_model,
            training,
        ));
        let mut reach = None;
        if let Some(settings) = &options.mesh {
            let given = options.advertise.is_some();
            let mesh = start_mesh(&shared, &stage, &options.data, settings, given).await?;
            shared.net.route_through(mesh.routes());
            reach = Some(shared.net.keep_reachable(mesh.rendezvous_candidates()));
            let _ = shared.mesh.set(mesh);
        }
        let trusted = shared
            .coordinators
            .iter()
            .copied()
            .chain(shared.peers.iter().map(|p| p.key))
            .collect();
        let accept = Router::new(shared.endpoint.clone(), trusted)
            .accept(
                ALPN_CONTROL,
                Arc::new(Control {
                    stage: stage.clone(),
                    coordinator: coordinator.clone(),
                }),
            )
            .accept(
                ALPN_STAGE,
                Arc::new(StageStreams {
                    stage: stage.clone(),
                    coordinator: coordinator.clone(),
                }),
            )
            .accept(
                ALPN_RECORD_PUSH,
                Arc::new(Push {
                    coordinator: coordinator.clone(),
                }),
            )
            .accept(
                ALPN_REACH,
                Arc::new(Rendezvous::new(
                    shared.tls.clone(),
                    relay,
                    shared.mesh.get().map(|mesh| mesh.membership()),
                    shared
                        .mesh
                        .get()
                        .map(|mesh| Arc::new(mesh.rendezvous_candidates()) as PublicMembers),
                    Some(shared.advertise.ip()),
                )),
            )
            .spawn();
        tokio::spawn(stage::role::release_idle_slices(Arc::downgrade(&stage)));
        let mut node = Node {
            shared,
            stage,
            coordinator,
            accept,
            reach,
            http: None,
        };
        if let Some(listener) = http_listener {
            node.http = Some(node.start_http(listener, options.http_access).await?);
        }
        Ok(node)
    }

    /// The HTTP API, a requester of this node's own coordinator.
    async fn start_http(
        &self,
        listener: tokio::net::TcpListener,
        access: crate::runtime::http::Access,
    ) -> anyhow::Result<crate::runtime::http::HttpApi> {
        // Weak: the API's connections must not keep the steward (and its
        // journal's lock) alive past the node's shutdown.
        let shared = Arc::downgrade(&self.shared);
        let witness: crate::runtime::http::Witness = Arc::new(move |envelope: &[u8]| {
            // Verified before the steward is locked: every step takes that
            // lock, on the node's one async thread by default.
            let sealed = mesh_protocol::mesh1::SealedReceipt::verify(envelope)?;
            let shared = shared.upgrade().context("the node is shutting down")?;
            Ok(lock(&shared.steward).witness_verified(sealed, now_ms())?)
        });
        let (stage, coordinator) = (
            Arc::downgrade(&self.stage),
            Arc::downgrade(&self.coordinator),
        );
        let metrics: crate::runtime::http::Metrics = Arc::new(move || {
            let (stage, coordinator) = (stage.upgrade(), coordinator.upgrade());
            Box::pin(async move {
                let (stage, coordinator) = (stage?, coordinator?);
                Some(control::node_stats(&stage, &coordinator).await.prometheus())
            })
        });
        let (shared, coordinator) = (
            Arc::downgrade(&self.shared),
            Arc::downgrade(&self.coordinator),
        );
        let members: crate::runtime::http::Members = Arc::new(move || {
            let (shared, coordinator) = (shared.upgrade()?, coordinator.upgrade()?);
            Some(member_list(&shared, &coordinator))
        });
        crate::runtime::http::start(
            listener,
            access,
            self.peer_addr(),
            self.model_card()?,
            (witness, metrics, members, self.shared.max_requests),
        )
        .await
    }

    /// The model's name in requests: its file name without extension.
    pub fn model_id(&self) -> String {
        self.shared
            .model
            .path()
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    }

    /// What the HTTP API says about this node's model: its tokenizer is
    /// built here, if no request built it before.
    pub fn model_card(&self) -> anyhow::Result<crate::runtime::http::ModelCard> {
        let model = &self.shared.model;
        Ok(crate::runtime::http::ModelCard {
            id: self.model_id(),
            package_id: model.package_id(),
            context: engine_context(model),
            codec: Arc::clone(model.text()?),
        })
    }

    /// Where the HTTP API listens, when it was asked for.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(crate::runtime::http::HttpApi::addr)
    }

    pub fn did(&self) -> &str {
        &self.shared.tls.did
    }
    pub fn public_key(&self) -> [u8; 32] {
        self.shared.tls.public_key
    }
    pub fn addr(&self) -> SocketAddr {
        self.shared.advertise
    }
    /// The address the endpoint is bound to (the advertised one may be a
    /// proxy or a public address in front of it).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.shared.endpoint.local_addr()
    }
    pub fn peer_addr(&self) -> PeerAddr {
        PeerAddr {
            key: self.public_key(),
            addr: self.addr(),
        }
    }
    /// Whether this node holds a connection to any other member, and why
    /// its last failed dial failed; `None` when it is in no mesh.
    pub fn mesh_reach(&self) -> Option<(bool, Option<String>)> {
        self.shared
            .mesh
            .get()
            .map(|mesh| (mesh.connected_peers() > 0, mesh.last_dial_error()))
    }

    /// How others reach this node's data plane, as last learned (in a
    /// mesh; `Unknown` until a public member answered).
    pub fn reachability(&self) -> Reachability {
        self.shared.net.reachability()
    }

    /// This node's mesh addresses (`…/p2p/PEERID`), once it listens (waits
    /// at most `within`); none when it is in no mesh.
    pub async fn mesh_addresses(&self, within: Duration) -> Vec<libp2p::Multiaddr> {
        match self.shared.mesh.get() {
            Some(mesh) => mesh.wait_for_addresses(within).await,
            None => Vec::new(),
        }
    }
    /// The node's membership, when it is in a mesh.
    pub fn mesh(&self) -> Option<&crate::runtime::mesh::Mesh> {
        self.shared.mesh.get()
    }
    /// Slices held as a stage (at most one per coordinator served).
    pub fn slices_held(&self) -> usize {
        lock(&self.stage.slots).len()
    }
    /// Grant decisions held for requests that have not reached this stage.
    pub fn grant_decisions_waiting(&self) -> usize {
        lock(&self.stage.tickets).len()
    }
    /// Requests this coordinator holds a record-collection slot for.
    pub fn requests_pending_seal(&self) -> usize {
        lock(&self.coordinator.collector).pending()
    }
    /// Every pool's occupancy and the node's counters (`mesh-node stats`).
    pub async fn stats(&self) -> NodeStats {
        control::node_stats(&self.stage, &self.coordinator).await
    }
    pub fn meter_name(&self) -> String {
        lock(&self.shared.steward).meter_name().to_string()
    }

    /// Take no new request (the API answers 503, the coordinator refuses
    /// new requests and those queued, saying it is shutting down; the
    /// stage takes no new slice, so coordinators plan around it), then
    /// wait, at most `within`, for the requests in flight here (as
    /// coordinator or as stage, sealing, or still being written to an API
    /// client) to end; how many were still open when it stopped waiting.
    /// Connections are still accepted meanwhile: a stage's records and a
    /// client's refusal need them.
    pub async fn drain(&self, within: Duration) -> u64 {
        if let Some(http) = &self.http {
            http.close();
        }
        self.coordinator.queue.close();
        self.stage
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let until = std::time::Instant::now() + within;
        loop {
            let stats = self.stats().await;
            let answering = self.http.as_ref().map_or(0, |http| http.in_flight());
            let open = stats.caches_open.saturating_sub(stats.caches_kept)
                + stats.requests_queued
                + stats.records_pending
                + answering as u64;
            if open == 0 || std::time::Instant::now() >= until {
                return open;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn shutdown(self) {
        self.shared.endpoint.close(0u32.into(), b"shutting down");
        self.accept.abort();
        if let Some(reach) = &self.reach {
            reach.abort();
        }
        self.stage.release_all();
        self.shared.endpoint.wait_idle().await;
    }
}

/// The members as the console lists them: each node's device, memory,
/// measured time per token on this model alone, round trip and the layers
/// it holds in the current run (none while a run is being set up); the
/// run's stages alone where there is no mesh (configured peers).
fn member_list(shared: &Shared, coordinator: &CoordinatorRole) -> serde_json::Value {
    use mesh_protocol::identity::did_key;
    let run = coordinator.run.try_lock().ok().and_then(|run| run.clone());
    let layers_of = |key: &[u8; 32]| {
        let run = run.as_ref()?;
        let k = run.keys.iter().position(|held| held == key)?;
        Some([run.assigns[k].layer_start, run.assigns[k].layer_end])
    };
    // What this coordinator's audits found of each node.
    let audits_of = |key: &[u8; 32]| {
        let standing = lock(&coordinator.planning.reputation).standing(key);
        let left_out_s = standing
            .out_until
            .map(|until| {
                until
                    .saturating_duration_since(std::time::Instant::now())
                    .as_secs()
            })
            .filter(|s| *s > 0);
        serde_json::json!({
            "passed": standing.audits_passed,
            "failed": standing.audits_failed,
            "stalls": standing.stalls,
            "refused_assignments": standing.refusals,
            "left_out_s": left_out_s,
        })
    };
    let own = shared.tls.public_key;
    let package = shared.model.package_id();
    let layers = u64::from(shared.model.config().layers);
    let members: Vec<serde_json::Value> = match shared.mesh.get() {
        Some(mesh) => mesh
            .members()
            .iter()
            .map(|m| {
                let model = m.advert.model(&package);
                serde_json::json!({
                    "node_id": did_key(&m.advert.node_id),
                    "this_node": m.advert.node_id == own,
                    "device": m.advert.device,
                    "memory_bytes": m.advert.memory_bytes,
                    "decode_ms_per_token": model.map(|e| e.decode_us_per_layer.saturating_mul(layers) as f64 / 1e3),
                    "rtt_ms": m.rtt.map(|r| r.as_secs_f64() * 1e3),
                    "load": m.advert.load,
                    "model": model.and_then(|e| e.name.clone()),
                    "layers": layers_of(&m.advert.node_id),
                    "audits": audits_of(&m.advert.node_id),
                })
            })
            .collect(),
        None => run
            .iter()
            .flat_map(|run| run.keys.iter())
            .map(|key| {
                serde_json::json!({
                    "node_id": did_key(key),
                    "this_node": *key == own,
                    "layers": layers_of(key),
                })
            })
            .collect(),
    };
    serde_json::json!({ "members": members })
}

/// The node's steward, its journal replayed. A change record that does not
/// have this model's weights in effect refuses every serve it gates: said
/// at start, not per request.
fn open_steward(
    data: &std::path::Path,
    key: &SigningKey,
    meter: Box<dyn EnergyMeter>,
    model: &ModelHandle,
) -> anyhow::Result<Steward> {
    let steward = Steward::open(&data.join("steward"), key.clone(), meter)?;
    for record in steward.change_records() {
        if record.weights_in_effect() != Some(model.weights_digest()) {
            tracing::warn!(
                backend = record.backend(),
                "this model's weights are not the ones its change record has in effect: its serves will be refused until `mesh-node weights record` records them"
            );
            eprintln!(
                "mesh-node: backend {}: this model's weights are not in effect in its change record; serves are refused until `mesh-node weights record --model {}` records them",
                record.backend(),
                model.path().display()
            );
        }
    }
    Ok(steward)
}

/// What this node's relay carries of the data plane (`--relay`): as many
/// circuits, for as long, as its mesh relay.
fn relay_bounds(options: &NodeOptions) -> Option<crate::runtime::net::circuits::RelayBounds> {
    let limits = options.mesh.as_ref()?.relay?;
    Some(crate::runtime::net::circuits::RelayBounds {
        members: limits.reservations,
        circuits: limits.circuits,
        circuit_duration: limits.circuit_duration,
        ..Default::default()
    })
}

/// The address other nodes reach this one at: the one given, else the
/// bound one; on all interfaces in a mesh, the interface the default route
/// leaves by (others on the network must reach it), else loopback.
fn advertised(
    endpoint: &quinn::Endpoint,
    given: Option<SocketAddr>,
    in_mesh: bool,
) -> anyhow::Result<SocketAddr> {
    let bound = endpoint.local_addr()?;
    Ok(given.unwrap_or_else(|| {
        if bound.ip().is_unspecified() {
            let ip = in_mesh
                .then(default_route_ip)
                .flatten()
                .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
            SocketAddr::new(ip, bound.port())
        } else {
            bound
        }
    }))
}

/// Join the mesh: measure this node's decode speed (once per model), and
/// advertise its data address, model, memory, speed and load.
async fn start_mesh(
    shared: &Shared,
    stage: &Arc<StageRole>,
    data: &std::path::Path,
    settings: &MeshSettings,
    advertise_given: bool,
) -> anyhow::Result<crate::runtime::mesh::Mesh> {
    use crate::runtime::{mesh, planner};
    let model = &shared.model;
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
    let weak = Arc::downgrade(stage);
    let reach = shared.net.reach_state();
    let base = mesh_protocol::advert::Advert {
        node_id: shared.tls.public_key,
        seq: 0,
        issued_ms: 0,
        ttl_ms: 0,
        quic: shared.advertise.to_string(),
        device: mesh_stage::device_name(device),
        memory_bytes: memory,
        load: 0,
        via: None,
        rtts: Vec::new(),
        models: vec![mesh_protocol::advert::AdvertModel {
            package_id: model.package_id(),
            layers: model.config().layers,
            decode_us_per_layer: speed,
            precision: Some(model.precision(WireDType::F32).to_string()),
            name: model.path().file_stem().map(|s| {
                s.to_string_lossy()
                    .chars()
                    .take(mesh_protocol::advert::MAX_ADVERT_TEXT)
                    .collect()
            }),
        }],
    };
    let facts: mesh::AdvertFacts = Arc::new(move || {
        let mut advert = base.clone();
        // Behind a NAT, the address a public member sees, and that member;
        // public, the address it sees unless one was given.
        match &*lock(&reach) {
            Reachability::Behind {
                seen,
                via,
                symmetric,
            } => {
                advert.quic = seen.to_string();
                advert.via = Some(mesh_protocol::advert::AdvertVia {
                    node_id: via.key,
                    quic: via.addr.to_string(),
                    relayed: *symmetric,
                });
            }
            Reachability::Public { seen } if !advertise_given => advert.quic = seen.to_string(),
            _ => {}
        }
        if let Some(stage) = weak.upgrade() {
            let open: usize = lock(&stage.slots)
                .values()
                .map(|slot| slot.pool.open_requests())
                .sum();
            advert.load = u32::try_from(open).unwrap_or(u32::MAX);
        }
        advert
    });
    let mut options = mesh::MeshOptions::new(shared.key.clone());
    options.listen = if settings.listen.is_empty() {
        vec![mesh::same_port_listen(
            shared
                .endpoint
                .local_addr()
                .context("the QUIC endpoint's address")?,
        )]
    } else {
        settings.listen.clone()
    };
    options.bootstrap = settings.bootstrap.clone();
    options.mdns = settings.mdns;
    options.relay = settings.relay;
    options.facts = Some(facts);
    mesh::Mesh::start(options).await
}
