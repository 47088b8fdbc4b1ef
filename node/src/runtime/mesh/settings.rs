//! How a node takes part in the mesh: the limits and intervals, the
//! options it starts with, and the relay it may offer.

use std::sync::Arc;
use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;
use mesh_protocol::SigningKey;
use mesh_protocol::advert::Advert;

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
/// A member's round trip is the smallest of its last this many pings (eight
/// seconds): a ping that waited behind a busy scheduler or a full queue
/// tells how loaded that moment was, not how far the member is, and a
/// longer path shows once the pings before it have aged out.
pub const RTT_SAMPLES: usize = 8;
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
/// Relays a node behind a NAT listens through at once.
pub const MAX_RELAYS_USED: usize = 2;
/// How often an unconnected member whose adverts arrive is looked up.
pub const LOOKUP_EVERY: Duration = Duration::from_secs(10);
/// Look-ups of unconnected members in any `LOOKUP_EVERY`, all together.
pub const MAX_LOOKUPS: usize = 32;
pub(super) const IDENTIFY_PROTOCOL: &str = "/mesh-node/1.0.0";
pub(super) const KAD_PROTOCOL: &str = "/mesh-node/kad/1.0.0";

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
    /// Offer a relay to members behind NATs, within these limits.
    pub relay: Option<RelayLimits>,
}

/// What a member offering a relay (`--relay`) lets through it: enough for
/// members behind NATs to hold their mesh connections (adverts, pings)
/// for long, never a data plane's bytes (those go over QUIC, docs/mesh.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayLimits {
    /// Members that may listen through it at once.
    pub reservations: usize,
    /// Circuits at once, in all and per member.
    pub circuits: usize,
    pub circuits_per_peer: usize,
    /// How long one circuit lives, and how many bytes it carries each way.
    pub circuit_duration: Duration,
    pub circuit_bytes: u64,
}

impl Default for RelayLimits {
    fn default() -> Self {
        Self {
            reservations: 128,
            circuits: 64,
            circuits_per_peer: 8,
            circuit_duration: Duration::from_secs(60 * 60),
            // A member's adverts (under 4 KiB a second to each peer) for an
            // hour, with room for pings and Kademlia.
            circuit_bytes: 64 << 20,
        }
    }
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
            relay: None,
        }
    }
}

pub fn default_listen() -> Multiaddr {
    Multiaddr::empty()
        .with(Protocol::Ip4(std::net::Ipv4Addr::UNSPECIFIED))
        .with(Protocol::Tcp(0))
}

pub(super) fn tcp_address(ip: std::net::IpAddr, port: u16) -> Multiaddr {
    let ip = match ip {
        std::net::IpAddr::V4(v4) => Protocol::Ip4(v4),
        std::net::IpAddr::V6(v6) => Protocol::Ip6(v6),
    };
    Multiaddr::empty().with(ip).with(Protocol::Tcp(port))
}
