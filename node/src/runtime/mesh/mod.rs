//! Membership on libp2p: who is in the mesh, what each member says about
//! itself (signed adverts, `protocol::advert`), and how far away it is.
//!
//! libp2p does discovery and liveness only (Kademlia, identify, ping, mDNS,
//! gossipsub for adverts, over TCP + Noise + Yamux); activations stay on the
//! node's QUIC endpoint (docs/mesh.md says why). The node's Ed25519 key is
//! its libp2p identity, so its PeerId and its did:key name the same key, and
//! an advert is only taken from the libp2p peer that signed it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::gossipsub::IdentTopic;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use mesh_protocol::SigningKey;
use mesh_protocol::advert::Advert;

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::net::peers::PeerAddr;

mod settings;
mod state;
mod swarm;

pub use settings::*;
pub use state::peer_key;
use state::{Changes, State};

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
pub fn conventional_address(peer: &PeerAddr) -> Option<Multiaddr> {
    let public = libp2p::identity::ed25519::PublicKey::try_from_bytes(&peer.key).ok()?;
    let peer_id = libp2p::identity::PublicKey::from(public).to_peer_id();
    Some(tcp_address(peer.addr.ip(), peer.addr.port()).with(Protocol::P2p(peer_id)))
}

/// A member as this node sees it.
#[derive(Debug, Clone)]
pub struct MemberView {
    pub advert: Advert,
    /// The round trip to it, the smallest of its last `RTT_SAMPLES` pings,
    /// when this node is connected to it.
    pub rtt: Option<Duration>,
    /// Milliseconds since its advert was taken.
    pub age_ms: u64,
    /// Milliseconds since it joined (this stay: a member that left and came
    /// back counts from its return).
    pub member_for_ms: u64,
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

/// The libp2p keypair of a node key (the same Ed25519 key).
pub fn libp2p_keypair(key: &SigningKey) -> libp2p::identity::Keypair {
    let mut secret = key.to_bytes();
    // The secret is 32 valid bytes, which `ed25519_from_bytes` always takes.
    libp2p::identity::Keypair::ed25519_from_bytes(&mut secret)
        .unwrap_or_else(|_| libp2p::identity::Keypair::generate_ed25519())
}

impl Mesh {
    /// Start the swarm: listen, dial the bootstrap members, advertise.
    pub async fn start(options: MeshOptions) -> anyhow::Result<Mesh> {
        let keypair = libp2p_keypair(&options.key);
        let peer_id = keypair.public().to_peer_id();
        let own_key = options.key.verifying_key().to_bytes();
        let (swarm, unpinned) = swarm::build(&options, keypair)?;
        let state = Arc::new(Mutex::new(State {
            unpinned,
            ..State::default()
        }));
        let changed = Arc::new(Changes::default());
        let (publish, published) = tokio::sync::mpsc::channel(16);
        let task = tokio::spawn(swarm::run(
            swarm,
            IdentTopic::new(ADVERT_TOPIC),
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
                    state.rtt(&m.advert.node_id)
                },
                age_ms: now.saturating_sub(m.received_ms),
                member_for_ms: now.saturating_sub(m.joined_ms),
            })
            .collect()
    }

    /// How each member is reached, as its advert says
    /// (`net::peers::Routes`).
    pub fn routes(&self) -> crate::runtime::net::peers::Routes {
        let state = self.state.clone();
        Arc::new(move |key| {
            let state = lock(&state);
            let advert = &state.members.get(key)?.advert;
            Some(advert.via.as_ref().and_then(|via| {
                Some(PeerAddr {
                    key: via.node_id,
                    addr: via.quic.parse().ok()?,
                })
            }))
        })
    }

    /// Whether a key is a member now (its advert current), for the reach
    /// protocol's handler (`net::reach::Membership`).
    pub fn membership(&self) -> crate::runtime::net::reach::Membership {
        let state = self.state.clone();
        Arc::new(move |key| {
            lock(&state)
                .members
                .get(key)
                .is_some_and(|m| m.advert.expires_ms() > now_ms())
        })
    }

    /// The members this node may ask how it is reached: those not behind a
    /// NAT themselves, the longest-standing first (a bootstrap, usually).
    pub fn rendezvous_candidates(&self) -> impl Fn() -> Vec<PeerAddr> + Send + Sync + 'static {
        let (state, own) = (self.state.clone(), self.key);
        move || {
            let now = now_ms();
            let state = lock(&state);
            let mut public: Vec<_> = state
                .members
                .iter()
                .filter(|m| m.advert.node_id != own && m.advert.via.is_none())
                .filter(|m| m.advert.expires_ms() > now)
                .filter_map(|m| {
                    let addr = m.advert.quic.parse().ok()?;
                    Some((
                        m.joined_ms,
                        PeerAddr {
                            key: m.advert.node_id,
                            addr,
                        },
                    ))
                })
                .collect();
            public.sort_by_key(|(joined, _)| *joined);
            public.into_iter().map(|(_, peer)| peer).collect()
        }
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

/// Handle one swarm event; true when this node should advertise now.
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
