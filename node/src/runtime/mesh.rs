//! Membership on libp2p: who is in the mesh, what each member says about
//! itself (signed adverts, `protocol::advert`), and how far away it is.
//!
//! libp2p does discovery and liveness only (Kademlia, identify, ping, mDNS,
//! gossipsub for adverts, over TCP + Noise + Yamux); activations stay on the
//! node's QUIC endpoint (docs/mesh.md says why). The node's Ed25519 key is
//! its libp2p identity, so its PeerId and its did:key name the same key, and
//! an advert is only taken from the libp2p peer that signed it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent, behaviour::toggle::Toggle};
use libp2p::{
    Multiaddr, PeerId, StreamProtocol, connection_limits, identify, kad, mdns, noise, ping, tcp,
    yamux,
};
use mesh_protocol::SigningKey;
use mesh_protocol::advert::{Advert, AdvertRefusal, MAX_ADVERT_BYTES, Members, Offered};
use mesh_protocol::identity::{did_key, parse_peer_id};

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::limit::Source;

/// The gossipsub topic adverts travel on.
pub const ADVERT_TOPIC: &str = "mesh-adverts/1";
/// How often a node signs and publishes its advert.
pub const DEFAULT_ADVERT_INTERVAL: Duration = Duration::from_secs(1);
/// How long an advert is believed: a node that stops advertising is gone
/// from every table within this, even when no connection event says so.
pub const DEFAULT_ADVERT_TTL: Duration = Duration::from_secs(5);
/// Ping interval and timeout: a member whose ping fails is dropped at once.
pub const PING_INTERVAL: Duration = Duration::from_secs(1);
pub const PING_TIMEOUT: Duration = Duration::from_secs(2);
/// Peers this node dials on its own (beyond those that dial it): enough for
/// every member of a small mesh to be one hop away.
pub const MAX_DIALED_PEERS: usize = 64;
/// Connections the swarm holds: inbound established, inbound handshaking,
/// and per peer.
pub const MAX_INBOUND_CONNECTIONS: u32 = 128;
pub const MAX_PENDING_INBOUND: u32 = 32;
pub const MAX_CONNECTIONS_PER_PEER: u32 = 2;
/// Inbound connections one source (an IPv4 address, an IPv6 /64) may
/// have handshaking at once: a member needs one or two, and a stranger's
/// raw connections that never handshake take at most these of the
/// `MAX_PENDING_INBOUND` slots.
pub const MAX_PENDING_PER_ADDRESS: usize = 4;
/// How long a connection may take from TCP to an authenticated,
/// multiplexed connection (Noise and Yamux: a few round trips); libp2p's
/// own default is 10 s.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Listen addresses taken from one peer's identify report.
pub const MAX_ADDRESSES_PER_PEER: usize = 8;
const IDENTIFY_PROTOCOL: &str = "/mesh-node/1.0.0";
const KAD_PROTOCOL: &str = "/mesh-node/kad/1.0.0";

/// The facts a node advertises; `seq`, `issued_ms` and `ttl_ms` are filled
/// in at each signing.
pub type AdvertFacts = Arc<dyn Fn() -> Advert + Send + Sync>;

/// How a node takes part in the mesh.
pub struct MeshOptions {
    pub key: SigningKey,
    /// libp2p listen addresses (default `/ip4/0.0.0.0/tcp/0`: any free port,
    /// so several nodes run on one machine).
    pub listen: Vec<Multiaddr>,
    /// Members to dial first (`/ip4/…/tcp/…/p2p/PEERID`).
    pub bootstrap: Vec<Multiaddr>,
    /// Find members on the local network by mDNS.
    pub mdns: bool,
    /// What to advertise; `None` for an observer (`mesh status`).
    pub facts: Option<AdvertFacts>,
    pub advert_interval: Duration,
    pub advert_ttl: Duration,
}

impl std::fmt::Debug for MeshOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshOptions")
            .field("listen", &self.listen)
            .field("bootstrap", &self.bootstrap)
            .field("mdns", &self.mdns)
            .field("advertises", &self.facts.is_some())
            .finish()
    }
}

impl MeshOptions {
    pub fn new(key: SigningKey) -> Self {
        Self {
            key,
            listen: vec![default_listen()],
            bootstrap: Vec::new(),
            mdns: true,
            facts: None,
            advert_interval: DEFAULT_ADVERT_INTERVAL,
            advert_ttl: DEFAULT_ADVERT_TTL,
        }
    }
}

pub fn default_listen() -> Multiaddr {
    Multiaddr::empty()
        .with(Protocol::Ip4(std::net::Ipv4Addr::UNSPECIFIED))
        .with(Protocol::Tcp(0))
}

fn tcp_address(ip: std::net::IpAddr, port: u16) -> Multiaddr {
    let ip = match ip {
        std::net::IpAddr::V4(v4) => Protocol::Ip4(v4),
        std::net::IpAddr::V6(v6) => Protocol::Ip6(v6),
    };
    Multiaddr::empty().with(ip).with(Protocol::Tcp(port))
}

/// The mesh's listen address by the one-port convention: TCP on the QUIC
/// endpoint's address and port number (QUIC is UDP: the two do not clash),
/// or any free TCP port there when that one is taken.
pub fn same_port_listen(quic: std::net::SocketAddr) -> Multiaddr {
    let port = match std::net::TcpListener::bind(quic) {
        Ok(_) => quic.port(),
        Err(_) => 0,
    };
    tcp_address(quic.ip(), port)
}

/// A configured peer's mesh address by the same convention
/// (`/ip4/HOST/tcp/PORT/p2p/PEERID`), to dial as a bootstrap.
pub fn conventional_address(peer: &crate::runtime::net::peers::PeerAddr) -> Option<Multiaddr> {
    let public = libp2p::identity::ed25519::PublicKey::try_from_bytes(&peer.key).ok()?;
    let peer_id = libp2p::identity::PublicKey::from(public).to_peer_id();
    Some(tcp_address(peer.addr.ip(), peer.addr.port()).with(Protocol::P2p(peer_id)))
}

/// A member as this node sees it.
#[derive(Debug, Clone)]
pub struct MemberView {
    pub advert: Advert,
    /// The last ping round trip, when this node is connected to it.
    pub rtt: Option<Duration>,
    /// Milliseconds since its advert was taken.
    pub age_ms: u64,
    /// Milliseconds since it joined (this stay: a member that left and came
    /// back counts from its return).
    pub member_for_ms: u64,
}

#[derive(Default)]
struct State {
    members: Members,
    rtt: HashMap<[u8; 32], Duration>,
    /// Refused adverts by kind.
    refused: BTreeMap<&'static str, u64>,
    /// (sender, kind) pairs already logged: each is logged once.
    logged: HashSet<([u8; 32], &'static str)>,
    addresses: Vec<Multiaddr>,
    connected: HashSet<PeerId>,
    /// Peers whose last connection closed, and when, until they connect
    /// again: a process that died (bounded by MAX_MEMBERS).
    closed: HashMap<[u8; 32], Instant>,
    /// Why the last dial that failed failed (a bootstrap that is down, a
    /// port closed), for the one line a user sees.
    last_dial_error: Option<String>,
    /// Bootstrap addresses given without a peer id, until a handshake
    /// names the node there.
    unpinned: Vec<Multiaddr>,
}

/// Changes to the member set (a join, a leave, a member's first round trip,
/// a new listen address): counted, and waited on.
#[derive(Debug, Default)]
struct Changes {
    notify: tokio::sync::Notify,
    generation: std::sync::atomic::AtomicU64,
}

impl Changes {
    fn bump(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.notify.notify_waiters();
    }
}

/// A running membership: the swarm runs in its own task until dropped.
pub struct Mesh {
    state: Arc<Mutex<State>>,
    publish: tokio::sync::mpsc::Sender<Vec<u8>>,
    changed: Arc<Changes>,
    peer_id: PeerId,
    key: [u8; 32],
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("peer_id", &self.peer_id)
            .finish()
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Refuses an inbound connection while its IP address has
/// `MAX_PENDING_PER_ADDRESS` others handshaking (libp2p's own limits count
/// pending connections in all, not per address).
#[derive(Default)]
struct PendingPerAddress {
    pending: HashMap<libp2p::swarm::ConnectionId, Source>,
    per_address: HashMap<Source, usize>,
}

#[derive(Debug)]
struct TooManyPending(Source);

impl std::fmt::Display for TooManyPending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} has {MAX_PENDING_PER_ADDRESS} connections handshaking already",
            self.0
        )
    }
}

impl std::error::Error for TooManyPending {}

impl PendingPerAddress {
    fn release(&mut self, id: libp2p::swarm::ConnectionId) {
        let Some(source) = self.pending.remove(&id) else {
            return;
        };
        if let Some(count) = self.per_address.get_mut(&source) {
            *count -= 1;
            if *count == 0 {
                self.per_address.remove(&source);
            }
        }
    }
}

impl NetworkBehaviour for PendingPerAddress {
    type ConnectionHandler = libp2p::swarm::dummy::ConnectionHandler;
    type ToSwarm = std::convert::Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        id: libp2p::swarm::ConnectionId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<(), libp2p::swarm::ConnectionDenied> {
        let ip = remote.iter().find_map(|p| match p {
            Protocol::Ip4(ip) => Some(std::net::IpAddr::V4(ip)),
            Protocol::Ip6(ip) => Some(std::net::IpAddr::V6(ip)),
            _ => None,
        });
        let Some(source) = ip.map(Source::of) else {
            return Ok(());
        };
        let count = self.per_address.entry(source).or_default();
        if *count >= MAX_PENDING_PER_ADDRESS {
            return Err(libp2p::swarm::ConnectionDenied::new(TooManyPending(source)));
        }
        *count += 1;
        self.pending.insert(id, source);
        Ok(())
    }

    fn handle_established_inbound_connection(
        &mut self,
        id: libp2p::swarm::ConnectionId,
        _peer: PeerId,
        _local: &Multiaddr,
        _remote: &Multiaddr,
    ) -> Result<libp2p::swarm::THandler<Self>, libp2p::swarm::ConnectionDenied> {
        self.release(id);
        Ok(libp2p::swarm::dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _id: libp2p::swarm::ConnectionId,
        _peer: PeerId,
        _addr: &Multiaddr,
        _role: libp2p::core::Endpoint,
        _port_use: libp2p::core::transport::PortUse,
    ) -> Result<libp2p::swarm::THandler<Self>, libp2p::swarm::ConnectionDenied> {
        Ok(libp2p::swarm::dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: libp2p::swarm::FromSwarm) {
        if let libp2p::swarm::FromSwarm::ListenFailure(failure) = event {
            self.release(failure.connection_id);
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _peer: PeerId,
        _id: libp2p::swarm::ConnectionId,
        event: libp2p::swarm::THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<libp2p::swarm::ToSwarm<Self::ToSwarm, libp2p::swarm::THandlerInEvent<Self>>>
    {
        std::task::Poll::Pending
    }
}

#[derive(NetworkBehaviour)]
struct Behaviour {
    pending: PendingPerAddress,
    limits: connection_limits::Behaviour,
    identify: identify::Behaviour,
    ping: ping::Behaviour,
    kad: kad::Behaviour<kad::store::MemoryStore>,
    mdns: Toggle<mdns::tokio::Behaviour>,
    gossipsub: gossipsub::Behaviour,
}

/// The libp2p keypair of a node key (the same Ed25519 key).
pub fn libp2p_keypair(key: &SigningKey) -> libp2p::identity::Keypair {
    let mut secret = key.to_bytes();
    // The secret is 32 valid bytes, which `ed25519_from_bytes` always takes.
    libp2p::identity::Keypair::ed25519_from_bytes(&mut secret)
        .unwrap_or_else(|_| libp2p::identity::Keypair::generate_ed25519())
}

/// The node key a PeerId names, when it names an Ed25519 key inline.
pub fn peer_key(peer: &PeerId) -> Option<[u8; 32]> {
    parse_peer_id(&peer.to_base58())
}

impl Mesh {
    /// Start the swarm: listen, dial the bootstrap members, advertise.
    pub async fn start(options: MeshOptions) -> anyhow::Result<Mesh> {
        let keypair = libp2p_keypair(&options.key);
        let peer_id = keypair.public().to_peer_id();
        let own_key = options.key.verifying_key().to_bytes();
        let mdns_on = options.mdns;
        let mut swarm = libp2p::SwarmBuilder::with_existing_identity(keypair)
            .with_tokio()
            .with_tcp(
                tcp::Config::default().nodelay(true),
                noise::Config::new,
                yamux::Config::default,
            )
            .context("setting up the mesh's TCP transport")?
            .with_behaviour(|key| {
                let peer_id = key.public().to_peer_id();
                let identify = identify::Behaviour::new(identify::Config::new(
                    IDENTIFY_PROTOCOL.into(),
                    key.public(),
                ));
                let ping = ping::Behaviour::new(
                    ping::Config::new()
                        .with_interval(PING_INTERVAL)
                        .with_timeout(PING_TIMEOUT),
                );
                let mut kad_config = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
                // Routing only: records others would store here are dropped
                // (the mesh keeps none).
                kad_config.set_record_filtering(kad::StoreInserts::FilterBoth);
                let mut kad = kad::Behaviour::with_config(
                    peer_id,
                    kad::store::MemoryStore::new(peer_id),
                    kad_config,
                );
                // Answer queries even where no external address is confirmed
                // (a LAN, loopback): every member is a routing peer.
                kad.set_mode(Some(kad::Mode::Server));
                let mdns = if mdns_on {
                    match mdns::tokio::Behaviour::new(mdns::Config::default(), peer_id) {
                        Ok(m) => Some(m),
                        Err(error) => {
                            tracing::warn!("mDNS is off: {error}");
                            None
                        }
                    }
                } else {
                    None
                };
                let config = gossipsub::ConfigBuilder::default()
                    .heartbeat_interval(Duration::from_millis(500))
                    .validation_mode(gossipsub::ValidationMode::Strict)
                    .validate_messages()
                    .max_transmit_size(MAX_ADVERT_BYTES + 512)
                    .build()
                    .map_err(|e| anyhow::anyhow!("gossipsub configuration: {e}"))?;
                let gossipsub = gossipsub::Behaviour::new(
                    gossipsub::MessageAuthenticity::Signed(key.clone()),
                    config,
                )
                .map_err(|e| anyhow::anyhow!("gossipsub: {e}"))?;
                let limits = connection_limits::Behaviour::new(
                    connection_limits::ConnectionLimits::default()
                        .with_max_established_incoming(Some(MAX_INBOUND_CONNECTIONS))
                        .with_max_pending_incoming(Some(MAX_PENDING_INBOUND))
                        .with_max_established_per_peer(Some(MAX_CONNECTIONS_PER_PEER)),
                );
                Ok(Behaviour {
                    pending: PendingPerAddress::default(),
                    limits,
                    identify,
                    ping,
                    kad,
                    mdns: mdns.into(),
                    gossipsub,
                })
            })
            .map_err(|e| anyhow::anyhow!("building the mesh behaviour: {e}"))?
            .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
            // From TCP to an authenticated, multiplexed connection.
            .with_connection_timeout(HANDSHAKE_TIMEOUT)
            .build();
        let topic = IdentTopic::new(ADVERT_TOPIC);
        swarm
            .behaviour_mut()
            .gossipsub
            .subscribe(&topic)
            .map_err(|e| anyhow::anyhow!("subscribing to adverts: {e}"))?;
        for address in &options.listen {
            swarm
                .listen_on(address.clone())
                .with_context(|| format!("listening on {address}"))?;
        }
        let mut unpinned = Vec::new();
        for address in &options.bootstrap {
            // A plain HOST:PORT names no peer: its id is learned in the
            // handshake (and pinned then, `handle_event`).
            if let Some(Protocol::P2p(peer)) = address.iter().last() {
                swarm
                    .behaviour_mut()
                    .kad
                    .add_address(&peer, address.clone());
            } else {
                unpinned.push(address.clone());
            }
            swarm
                .dial(address.clone())
                .with_context(|| format!("dialling {address}"))?;
        }
        let state = Arc::new(Mutex::new(State {
            unpinned,
            ..State::default()
        }));
        let changed = Arc::new(Changes::default());
        let (publish, published) = tokio::sync::mpsc::channel(16);
        let task = tokio::spawn(run(
            swarm,
            topic,
            published,
            options,
            own_key,
            state.clone(),
            changed.clone(),
        ));
        Ok(Mesh {
            state,
            publish,
            changed,
            peer_id,
            key: own_key,
            task,
        })
    }

    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The addresses others join this node at, each ending in `/p2p/PEERID`.
    pub fn addresses(&self) -> Vec<Multiaddr> {
        lock(&self.state).addresses.clone()
    }

    /// Wait until the swarm listens somewhere (at most `within`).
    pub async fn wait_for_addresses(&self, within: Duration) -> Vec<Multiaddr> {
        let end = Instant::now() + within;
        loop {
            let notified = self.changed.notify.notified();
            let addresses = self.addresses();
            if !addresses.is_empty() || Instant::now() >= end {
                return addresses;
            }
            let _ = tokio::time::timeout_at(end.into(), notified).await;
        }
    }

    /// Peers this node holds a connection to now.
    pub fn connected_peers(&self) -> usize {
        lock(&self.state).connected.len()
    }

    /// Why the last dial that failed failed, if one did.
    pub fn last_dial_error(&self) -> Option<String> {
        lock(&self.state).last_dial_error.clone()
    }

    /// The members whose adverts are current, this node's own included when
    /// it advertises, in node-id order.
    pub fn members(&self) -> Vec<MemberView> {
        let now = now_ms();
        let mut state = lock(&self.state);
        if !state.members.expire(now).is_empty() {
            self.changed.bump();
        }
        state
            .members
            .iter()
            .map(|m| MemberView {
                advert: m.advert.clone(),
                rtt: if m.advert.node_id == self.key {
                    Some(Duration::ZERO)
                } else {
                    state.rtt.get(&m.advert.node_id).copied()
                },
                age_ms: now.saturating_sub(m.received_ms),
                member_for_ms: now.saturating_sub(m.joined_ms),
            })
            .collect()
    }

    /// Whether `key`'s last connection to this node closed at or after
    /// `since` (and it has not connected again): the surest sign its
    /// process is gone. A member dropped for a late advert or a failed ping
    /// is not "closed".
    pub fn closed_since(&self, key: &[u8; 32], since: Instant) -> bool {
        lock(&self.state)
            .closed
            .get(key)
            .is_some_and(|at| *at >= since)
    }

    /// Whether `key` is a member now.
    pub fn is_member(&self, key: &[u8; 32]) -> bool {
        let mut state = lock(&self.state);
        if !state.members.expire(now_ms()).is_empty() {
            self.changed.bump();
        }
        state.members.get(key).is_some()
    }

    /// Refused adverts by kind, since start.
    pub fn refusals(&self) -> BTreeMap<&'static str, u64> {
        lock(&self.state).refused.clone()
    }

    /// Refusals logged: one line per sender and kind, however many came.
    pub fn refusals_logged(&self) -> usize {
        lock(&self.state).logged.len()
    }

    /// Publish bytes on the advert topic as they are: what a peer sending
    /// a forged or replayed advert does (the tests play that peer).
    pub async fn publish_raw(&self, bytes: Vec<u8>) -> anyhow::Result<()> {
        self.publish
            .send(bytes)
            .await
            .map_err(|_| anyhow::anyhow!("the mesh task has stopped"))
    }

    /// Wait for the member set to change (at most `within`).
    pub async fn changed(&self, within: Duration) {
        let _ = tokio::time::timeout(within, self.changed.notify.notified()).await;
    }

    /// How many times the member set has changed: equal numbers, the same
    /// members (their adverts' load and round trips may have moved).
    pub fn generation(&self) -> u64 {
        self.changed
            .generation
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

async fn run(
    mut swarm: libp2p::Swarm<Behaviour>,
    topic: IdentTopic,
    mut published: tokio::sync::mpsc::Receiver<Vec<u8>>,
    options: MeshOptions,
    own_key: [u8; 32],
    state: Arc<Mutex<State>>,
    changed: Arc<Changes>,
) {
    let mut tick = tokio::time::interval(options.advert_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut last_bootstrap: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Some(facts) = &options.facts {
                    let now = now_ms();
                    // Above every earlier seq, also across restarts (the
                    // clock moves on while a node is down).
                    seq = (seq + 1).max(now);
                    let mut advert = facts();
                    advert.node_id = own_key;
                    advert.seq = seq;
                    advert.issued_ms = now;
                    advert.ttl_ms = options.advert_ttl.as_millis() as u64;
                    let bytes = advert.sign(&options.key);
                    // The own advert goes in the own table too: a
                    // coordinator plans over itself and its members alike.
                    let joined = lock(&state).members.offer(&bytes, &own_key, now);
                    if matches!(joined, Ok(Offered::Joined)) {
                        changed.bump();
                    }
                    if let Err(error) = swarm.behaviour_mut().gossipsub.publish(topic.clone(), bytes) {
                        tracing::debug!("advert not published: {error}");
                    }
                }
                let expired = lock(&state).members.expire(now_ms());
                for key in &expired {
                    tracing::info!(member = %did_key(key), "member left: its advert expired");
                }
                if !expired.is_empty() {
                    changed.bump();
                }
                if last_bootstrap.is_none_or(|t| t.elapsed() >= Duration::from_secs(30))
                    && swarm.behaviour_mut().kad.bootstrap().is_ok()
                {
                    last_bootstrap = Some(Instant::now());
                }
            }
            Some(bytes) = published.recv() => {
                if let Err(error) = swarm.behaviour_mut().gossipsub.publish(topic.clone(), bytes) {
                    tracing::debug!("advert not published: {error}");
                }
            }
            event = swarm.select_next_some() => {
                if handle_event(&mut swarm, event, &state, &changed) {
                    // A peer just subscribed to adverts: it hears this
                    // node's now, not at the next tick.
                    tick.reset_immediately();
                }
            }
        }
    }
}

/// A bootstrap address as a user may give it: a multiaddr
/// (`/ip4/HOST/tcp/PORT/p2p/PEERID`, the peer id optional) or a plain
/// `HOST:PORT` (an IP address or a DNS name), whose node id is learned in
/// the handshake.
pub fn parse_bootstrap(text: &str) -> Result<Multiaddr, String> {
    if text.starts_with('/') {
        return text
            .parse()
            .map_err(|e| format!("`{text}` is not a multiaddr: {e}"));
    }
    let (host, port) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("`{text}`: give HOST:PORT or /ip4/HOST/tcp/PORT/p2p/PEERID"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("`{text}`: the port is not a number"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("`{text}`: no host"));
    }
    // A name is resolved once, here (the mesh's transport dials addresses).
    let ip = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ip,
        Err(_) => std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
            .map_err(|e| format!("`{text}`: cannot resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("`{text}`: {host} has no address"))?
            .ip(),
    };
    let start = match ip {
        std::net::IpAddr::V4(ip) => Multiaddr::empty().with(Protocol::Ip4(ip)),
        std::net::IpAddr::V6(ip) => Multiaddr::empty().with(Protocol::Ip6(ip)),
    };
    Ok(start.with(Protocol::Tcp(port)))
}

/// The cause of a failed dial in a few words (libp2p's error repeats the
/// address and nests its causes).
fn dial_cause(said: &str) -> String {
    const KNOWN: [(&str, &str); 6] = [
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Timeout", "timed out"),
        ("No route to host", "no route to host"),
        ("Network is unreachable", "network unreachable"),
        (
            "WrongPeerId",
            "another node answers at that address (its peer id differs)",
        ),
    ];
    KNOWN
        .iter()
        .find(|(pattern, _)| said.contains(pattern))
        .map_or_else(
            || {
                said.lines()
                    .next()
                    .unwrap_or_default()
                    .chars()
                    .take(160)
                    .collect()
            },
            |(_, cause)| cause.to_string(),
        )
}

/// Handle one swarm event; true when this node should advertise now.
fn handle_event(
    swarm: &mut libp2p::Swarm<Behaviour>,
    event: SwarmEvent<BehaviourEvent>,
    state: &Arc<Mutex<State>>,
    changed: &Changes,
) -> bool {
    let local = *swarm.local_peer_id();
    match event {
        SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Subscribed {
            ..
        })) => return true,
        SwarmEvent::NewListenAddr { address, .. } => {
            let full = address.with(Protocol::P2p(local));
            lock(state).addresses.push(full);
            changed.bump();
        }
        SwarmEvent::OutgoingConnectionError { error, .. } => {
            lock(state).last_dial_error = Some(dial_cause(&error.to_string()));
        }
        SwarmEvent::ConnectionEstablished {
            peer_id, endpoint, ..
        } => {
            let mut s = lock(state);
            if let libp2p::core::ConnectedPoint::Dialer { address, .. } = &endpoint
                && let Some(at) = s.unpinned.iter().position(|a| a == address)
            {
                // The node at a plain HOST:PORT bootstrap, as its handshake
                // proved it: pinned from now on.
                let address = s.unpinned.swap_remove(at);
                swarm
                    .behaviour_mut()
                    .kad
                    .add_address(&peer_id, address.clone());
                tracing::info!(
                    node = %peer_key(&peer_id).map_or_else(|| peer_id.to_string(), |k| did_key(&k)),
                    "bootstrap {address} is {}",
                    address.clone().with(Protocol::P2p(peer_id))
                );
            }
            s.connected.insert(peer_id);
            if let Some(key) = peer_key(&peer_id) {
                s.closed.remove(&key);
            }
        }
        SwarmEvent::ConnectionClosed {
            peer_id,
            num_established: 0,
            ..
        } => {
            let mut s = lock(state);
            s.connected.remove(&peer_id);
            if let Some(key) = peer_key(&peer_id) {
                s.rtt.remove(&key);
                if s.closed.len() < mesh_protocol::advert::MAX_MEMBERS {
                    s.closed.insert(key, Instant::now());
                }
                if s.members.remove(&key).is_some() {
                    tracing::info!(member = %did_key(&key), "member left: its connection closed");
                    drop(s);
                    changed.bump();
                }
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
            peer_id,
            info,
            ..
        })) => {
            for address in info.listen_addrs.into_iter().take(MAX_ADDRESSES_PER_PEER) {
                swarm.behaviour_mut().kad.add_address(&peer_id, address);
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Kad(kad::Event::RoutingUpdated {
            peer,
            addresses,
            ..
        })) => {
            let dial = {
                let s = lock(state);
                peer != local
                    && !s.connected.contains(&peer)
                    && s.connected.len() < MAX_DIALED_PEERS
            };
            if dial {
                let _ = swarm.dial(
                    libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
                        .addresses(addresses.into_vec())
                        .build(),
                );
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Mdns(mdns::Event::Discovered(found))) => {
            for (peer, address) in found {
                swarm
                    .behaviour_mut()
                    .kad
                    .add_address(&peer, address.clone());
                let dial = {
                    let s = lock(state);
                    !s.connected.contains(&peer) && s.connected.len() < MAX_DIALED_PEERS
                };
                if dial {
                    let _ = swarm.dial(address);
                }
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Ping(ping::Event { peer, result, .. })) => {
            let Some(key) = peer_key(&peer) else {
                return false;
            };
            match result {
                Ok(rtt) => {
                    let mut s = lock(state);
                    let first = s.rtt.insert(key, rtt).is_none();
                    // A member's first round trip makes it plannable.
                    if first && s.members.get(&key).is_some() {
                        drop(s);
                        changed.bump();
                    }
                }
                Err(error) => {
                    let mut s = lock(state);
                    s.rtt.remove(&key);
                    if s.members.remove(&key).is_some() {
                        tracing::info!(member = %did_key(&key), "member left: ping failed ({error})");
                        drop(s);
                        changed.bump();
                    }
                }
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
            propagation_source,
            message_id,
            message,
        })) => gossip_message(
            swarm,
            state,
            changed,
            propagation_source,
            message_id,
            message,
        ),
        _ => {}
    }
    false
}

/// An advert gossiped by a member, validated before gossipsub forwards it.
fn gossip_message(
    swarm: &mut libp2p::Swarm<Behaviour>,
    state: &Arc<Mutex<State>>,
    changed: &Changes,
    propagation_source: libp2p::PeerId,
    message_id: gossipsub::MessageId,
    message: gossipsub::Message,
) {
    // Strict validation: `source` is the peer that signed the
    // message, whoever forwarded it. Only a peer this node holds a
    // connection to may be a member: one connection cannot bring in
    // any number of made-up identities, and every member has a
    // measured round trip.
    let sender = message
        .source
        .filter(|source| lock(state).connected.contains(source))
        .as_ref()
        .and_then(peer_key);
    let acceptance = match sender {
        // Not connected (or not an Ed25519 peer): not taken, not
        // forwarded.
        None => MessageAcceptance::Ignore,
        Some(sender) => {
            let outcome = lock(state).members.offer(&message.data, &sender, now_ms());
            match outcome {
                Ok(offered) => {
                    if offered == Offered::Joined {
                        tracing::info!(member = %did_key(&sender), "member joined");
                        changed.bump();
                    }
                    MessageAcceptance::Accept
                }
                Err(refusal) => refuse(state, &sender, &refusal),
            }
        }
    };
    let _ = swarm
        .behaviour_mut()
        .gossipsub
        .report_message_validation_result(&message_id, &propagation_source, acceptance);
}

/// Count a refused advert, log it once per sender and kind, and tell
/// gossipsub not to forward it (`Reject` for a forged or malformed one,
/// `Ignore` for a replay or a burst).
fn refuse(state: &Mutex<State>, sender: &[u8; 32], refusal: &AdvertRefusal) -> MessageAcceptance {
    let kind = refusal.kind();
    let mut s = lock(state);
    *s.refused.entry(kind).or_default() += 1;
    if s.logged.len() < 4096 && s.logged.insert((*sender, kind)) {
        tracing::warn!(sender = %did_key(sender), kind, "advert refused: {refusal}");
    }
    match refusal {
        // A replay, a burst or a full table: not the sender's forgery.
        AdvertRefusal::Replayed { .. } | AdvertRefusal::RateLimited(_) | AdvertRefusal::Full => {
            MessageAcceptance::Ignore
        }
        AdvertRefusal::Invalid(_) => MessageAcceptance::Reject,
    }
}

#[cfg(test)]
mod bootstrap_tests {
    use super::*;

    #[test]
    fn a_bootstrap_is_a_multiaddr_or_a_plain_host_and_port() {
        assert_eq!(
            parse_bootstrap("127.0.0.1:4000").unwrap().to_string(),
            "/ip4/127.0.0.1/tcp/4000"
        );
        assert_eq!(
            parse_bootstrap("[::1]:4000").unwrap().to_string(),
            "/ip6/::1/tcp/4000"
        );
        assert_eq!(
            parse_bootstrap("localhost:4000").unwrap().iter().last(),
            Some(Protocol::Tcp(4000))
        );
        let full = "/ip4/10.0.0.1/tcp/9/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo";
        assert_eq!(parse_bootstrap(full).unwrap().to_string(), full);
        for bad in ["4000", "host:port", ":4000", "/not/a/multiaddr"] {
            assert!(parse_bootstrap(bad).is_err(), "{bad}");
        }
    }
}
