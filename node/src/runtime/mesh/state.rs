//! What the swarm's task and the `Mesh` handle share: the member table,
//! round trips, connections, refusals, and the relays in use.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use libp2p::{Multiaddr, PeerId};
use mesh_protocol::advert::{AdvertRtt, MAX_ADVERT_RTT_US, MAX_ADVERT_RTTS, Members};
use mesh_protocol::identity::parse_peer_id;

#[derive(Default)]
pub(super) struct State {
    pub(super) members: Members,
    pub(super) round_trips: HashMap<[u8; 32], RoundTrips>,
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

/// The last `RTT_SAMPLES` pings to a peer; the link's round trip is the
/// smallest of them.
#[derive(Debug, Default, Clone)]
pub(super) struct RoundTrips {
    samples: VecDeque<Duration>,
}

impl RoundTrips {
    /// Keeps `rtt`, forgetting the oldest ping past `RTT_SAMPLES`.
    pub(super) fn record(&mut self, rtt: Duration) {
        if self.samples.len() == super::settings::RTT_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(rtt);
    }

    /// The smallest recent ping (none before the first).
    pub(super) fn floor(&self) -> Option<Duration> {
        self.samples.iter().min().copied()
    }
}

impl State {
    /// Records a ping to `key`; true when it is the first since the peer
    /// connected.
    pub(super) fn record_rtt(&mut self, key: [u8; 32], rtt: Duration) -> bool {
        let trips = self.round_trips.entry(key).or_default();
        let first = trips.floor().is_none();
        trips.record(rtt);
        first
    }

    /// The round trip to `key`: the smallest of its recent pings.
    pub(super) fn rtt(&self, key: &[u8; 32]) -> Option<Duration> {
        self.round_trips.get(key).and_then(RoundTrips::floor)
    }

    /// The round trips this node's advert names: to its nearest members
    /// (at most `MAX_ADVERT_RTTS`), in node id order, for planners to
    /// weigh hops between members by.
    pub(super) fn advertised_rtts(&self, own: &[u8; 32]) -> Vec<AdvertRtt> {
        let mut nearest: Vec<AdvertRtt> = self
            .round_trips
            .iter()
            .filter(|(key, _)| *key != own && self.members.get(key).is_some())
            .filter_map(|(key, trips)| Some((key, trips.floor()?)))
            .map(|(key, rtt)| AdvertRtt {
                node_id: *key,
                rtt_us: u64::try_from(rtt.as_micros())
                    .unwrap_or(u64::MAX)
                    .clamp(1, MAX_ADVERT_RTT_US),
            })
            .collect();
        nearest.sort_by_key(|r| (r.rtt_us, r.node_id));
        nearest.truncate(MAX_ADVERT_RTTS);
        nearest.sort_by_key(|r| r.node_id);
        nearest
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::SigningKey;
    use mesh_protocol::advert::Advert;

    fn join(state: &mut State, seed: u8) -> [u8; 32] {
        let key = SigningKey::from_bytes(&[seed; 32]);
        let node_id = key.verifying_key().to_bytes();
        let advert = Advert {
            node_id,
            seq: 1,
            issued_ms: 1_000,
            ttl_ms: 5_000,
            quic: "127.0.0.1:7000".into(),
            device: "cpu".into(),
            memory_bytes: 1 << 20,
            load: 0,
            models: Vec::new(),
            via: None,
            rtts: Vec::new(),
        };
        state
            .members
            .offer(&advert.sign(&key), &node_id, 1_000)
            .unwrap();
        node_id
    }

    #[test]
    fn an_advert_names_the_round_trips_to_the_nearest_members_in_key_order() {
        let mut state = State::default();
        let own = join(&mut state, 200);
        state.record_rtt(own, Duration::from_micros(5));
        // Members 1..=30, each i ms away; a peer that is no member, nearest.
        for seed in 1..=30u8 {
            let key = join(&mut state, seed);
            state.record_rtt(key, Duration::from_millis(u64::from(seed)));
        }
        state.record_rtt([7; 32], Duration::from_micros(1));
        let named = state.advertised_rtts(&own);
        assert_eq!(named.len(), MAX_ADVERT_RTTS);
        assert!(named.windows(2).all(|w| w[0].node_id < w[1].node_id));
        let mut rtts: Vec<u64> = named.iter().map(|r| r.rtt_us).collect();
        rtts.sort_unstable();
        let nearest: Vec<u64> = (1..=MAX_ADVERT_RTTS as u64).map(|ms| ms * 1_000).collect();
        assert_eq!(rtts, nearest);
    }

    #[test]
    fn a_round_trip_is_the_smallest_of_the_recent_pings() {
        use super::super::settings::RTT_SAMPLES;
        let mut state = State::default();
        let ms = Duration::from_millis;
        assert_eq!(state.rtt(&[1; 32]), None);
        assert!(state.record_rtt([1; 32], ms(40)));
        assert_eq!(state.rtt(&[1; 32]), Some(ms(40)));
        // A ping that waited behind a busy moment does not move it.
        assert!(!state.record_rtt([1; 32], ms(3)));
        assert!(!state.record_rtt([1; 32], ms(90)));
        assert_eq!(state.rtt(&[1; 32]), Some(ms(3)));
        // A longer path shows once the short pings have aged out.
        for _ in 0..RTT_SAMPLES - 1 {
            state.record_rtt([1; 32], ms(25));
        }
        assert_eq!(state.rtt(&[1; 32]), Some(ms(25)));
        state.round_trips.remove(&[1; 32]);
        assert!(state.record_rtt([1; 32], ms(7)), "first again after a drop");
    }
}
