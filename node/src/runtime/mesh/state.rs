//! What the swarm's task and the `Mesh` handle share: the member table,
//! round trips, connections, refusals, and the relays in use.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use libp2p::{Multiaddr, PeerId};
use mesh_protocol::advert::Members;
use mesh_protocol::identity::parse_peer_id;

#[derive(Default)]
pub(super) struct State {
    pub(super) members: Members,
    pub(super) rtt: HashMap<[u8; 32], Duration>,
    /// Refused adverts by kind.
    pub(super) refused: BTreeMap<&'static str, u64>,
    /// (sender, kind) pairs already logged: each is logged once.
    pub(super) logged: HashSet<([u8; 32], &'static str)>,
    pub(super) addresses: Vec<Multiaddr>,
    pub(super) connected: HashSet<PeerId>,
    /// Peers whose last connection closed, and when, until they connect
    /// again: a process that died (bounded by MAX_MEMBERS).
    pub(super) closed: HashMap<[u8; 32], Instant>,
    /// Why the last dial that failed failed (a bootstrap that is down, a
    /// port closed), for the one line a user sees.
    pub(super) last_dial_error: Option<String>,
    /// Bootstrap addresses given without a peer id, until a handshake
    /// names the node there.
    pub(super) unpinned: Vec<Multiaddr>,
    /// Where this node dialled each peer it holds a direct connection to.
    pub(super) dialed: HashMap<PeerId, Multiaddr>,
    /// Connected members that offer a relay, at the address dialled.
    pub(super) relays: HashMap<PeerId, Multiaddr>,
    /// Relays this node listens through (behind a NAT), by listener.
    pub(super) listening_via: HashMap<libp2p::core::transport::ListenerId, PeerId>,
    /// Unconnected members whose adverts came, and when they were looked
    /// up (once every `LOOKUP_EVERY` each).
    pub(super) looked_up: HashMap<PeerId, Instant>,
}

/// Changes to the member set (a join, a leave, a member's first round trip,
/// a new listen address): counted, and waited on.
#[derive(Debug, Default)]
pub(super) struct Changes {
    pub(super) notify: tokio::sync::Notify,
    pub(super) generation: std::sync::atomic::AtomicU64,
}

impl Changes {
    pub(super) fn bump(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.notify.notify_waiters();
    }
}

/// The node key a PeerId names, when it names an Ed25519 key inline.
pub fn peer_key(peer: &PeerId) -> Option<[u8; 32]> {
    parse_peer_id(&peer.to_base58())
}

/// The cause of a failed dial in a few words (libp2p's error repeats the
/// address and nests its causes).
pub(super) fn dial_cause(said: &str) -> String {
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
