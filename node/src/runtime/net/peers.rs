//! The node's peers on the QUIC data plane: who a peer is (its key and
//! address), and the connections this node opened to peers, kept for
//! reuse per peer and protocol.

use std::collections::HashMap;

use anyhow::Context;

use std::sync::{Arc, Mutex, OnceLock};

use crate::runtime::net::msg;
use crate::runtime::net::reach::{self, ALPN_REACH, Reachability};
use crate::runtime::net::tls::{self, TlsIdentity};
use crate::runtime::net::tunnel::{self, Tunnel};

pub use crate::runtime::net::addr::PeerAddr;

/// A kept connection's key: the peer's key and the ALPN it speaks.
type ConnectionKey = ([u8; 32], &'static [u8]);

/// How a member is reached, by its key, as the mesh's adverts say: `None`
/// for a node not (yet) known, `Some(None)` for a public one, and
/// `Some(Some(via))` for one behind a NAT, introduced through `via`.
pub type Routes = Arc<dyn Fn(&[u8; 32]) -> Option<Option<PeerAddr>> + Send + Sync>;

/// Connections this node opened, by peer key and ALPN, on its one
/// endpoint; how peers behind NATs are reached, and how this node is.
pub struct Peers {
    endpoint: quinn::Endpoint,
    tls: TlsIdentity,
    cache: tokio::sync::Mutex<HashMap<ConnectionKey, quinn::Connection>>,
    /// One connection attempt at a time per peer and protocol; others to
    /// the same peer wait for it, no one else does.
    attempts: Attempts,
    routes: OnceLock<Routes>,
    reach: Arc<Mutex<Reachability>>,
    tunnel: Arc<Tunnel>,
    /// Peers no hole could be punched to, and when that was found: reached
    /// through a relay at once until `RELAYED_FOR` has passed.
    relayed: std::sync::Mutex<HashMap<[u8; 32], std::time::Instant>>,
}

/// Attempts to reach one peer with one protocol, entered: the gate they
/// take turns at, removed from the map by the last one out, on every way
/// out (a cancelled attempt included).
struct Gate<'a> {
    attempts: &'a Attempts,
    key: ConnectionKey,
    gate: Arc<tokio::sync::Mutex<()>>,
}

type Attempts = std::sync::Mutex<HashMap<ConnectionKey, Arc<tokio::sync::Mutex<()>>>>;

impl<'a> Gate<'a> {
    fn enter(attempts: &'a Attempts, key: ConnectionKey) -> Self {
        let gate = attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(key)
            .or_default()
            .clone();
        Gate {
            attempts,
            key,
            gate,
        }
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        let mut attempts = self
            .attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The map's and this one are the only holders left.
        if attempts
            .get(&self.key)
            .is_some_and(|gate| Arc::strong_count(gate) <= 2)
        {
            attempts.remove(&self.key);
        }
    }
}

/// How long a direct connection may take after an introduction before the
/// peer is reached through a relay instead.
pub const PUNCH_WAIT: std::time::Duration = std::time::Duration::from_secs(3);
/// How long a peer no hole could be punched to is reached through a relay
/// without trying again.
pub const RELAYED_FOR: std::time::Duration = std::time::Duration::from_secs(600);

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("endpoint", &self.endpoint.local_addr().ok())
            .field("reach", &self.reachability())
            .finish_non_exhaustive()
    }
}

impl Peers {
    /// Peers on `endpoint`, whose relayed packets (`tunnel::endpoint`)
    /// are carried from now on.
    pub fn new(
        endpoint: quinn::Endpoint,
        tls: TlsIdentity,
        tunnel: Arc<Tunnel>,
        relayed_packets: tokio::sync::mpsc::Receiver<tunnel::Packet>,
    ) -> Self {
        let open = {
            let (endpoint, tls, tunnel) = (endpoint.clone(), tls.clone(), tunnel.clone());
            move |relay: PeerAddr| {
                let (endpoint, tls, tunnel) = (endpoint.clone(), tls.clone(), tunnel.clone());
                async move {
                    if let Err(error) = reach::connect_relay(&endpoint, &tls, &relay, &tunnel).await
                    {
                        tracing::warn!(%relay, "no relay stream: {error:#}");
                        tunnel.gone(&relay, None);
                    }
                }
            }
        };
        tokio::spawn(tunnel.clone().carry(relayed_packets, open));
        Self {
            endpoint,
            tls,
            cache: tokio::sync::Mutex::new(HashMap::new()),
            attempts: std::sync::Mutex::default(),
            routes: OnceLock::new(),
            reach: Arc::new(Mutex::new(Reachability::Unknown)),
            tunnel,
            relayed: std::sync::Mutex::default(),
        }
    }

    /// Where peers behind NATs are introduced through (set once, when the
    /// node joins a mesh).
    pub fn route_through(&self, routes: Routes) {
        let _ = self.routes.set(routes);
    }

    /// How others reach this node, as last learned.
    pub fn reachability(&self) -> Reachability {
        self.reach
            .lock()
            .map(|r| r.clone())
            .unwrap_or(Reachability::Unknown)
    }

    /// The reachability as kept (read when the node signs its advert).
    pub fn reach_state(&self) -> Arc<Mutex<Reachability>> {
        self.reach.clone()
    }

    /// Learn and keep this node's reachability from the members
    /// `candidates` names, until aborted (`reach::keep_reachable`).
    pub fn keep_reachable(
        &self,
        candidates: impl Fn() -> Vec<PeerAddr> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(reach::keep_reachable(
            self.endpoint.clone(),
            self.tls.clone(),
            self.reach.clone(),
            self.tunnel.clone(),
            candidates,
        ))
    }

    /// The member a peer behind a NAT is introduced (and relayed) through:
    /// its advert's, else this node's own rendezvous (a peer whose advert
    /// has not come yet may keep its connection there, as in a mesh of one
    /// bootstrap); none for a public peer, or when that member is this node
    /// (its kept connection already lets this node's packets in).
    fn way_to(&self, peer: &PeerAddr) -> Option<PeerAddr> {
        let known = self.routes.get().and_then(|routes| routes(&peer.key));
        let via = match known {
            Some(route) => route,
            None => match self.reachability() {
                Reachability::Behind { via, .. } => Some(via),
                _ => None,
            },
        };
        via.filter(|via| via.key != self.tls.public_key && via.key != peer.key)
    }

    /// Have `peer` open its NAT to this node, at `via`'s word; what the
    /// peer said (a peer that could not be asked is tried directly).
    async fn introduce(&self, peer: &PeerAddr, via: &PeerAddr) -> reach::Introduced {
        let introduced = async {
            let connection = self
                .connect_direct(via, ALPN_REACH, reach::REACH_CONNECT_TIMEOUT)
                .await?;
            reach::introduce(&connection, peer.key).await
        };
        introduced.await.unwrap_or_else(|error| {
            tracing::warn!(%peer, %via, "not introduced: {error:#}");
            reach::Introduced::Punched
        })
    }

    fn relayed_recently(&self, key: &[u8; 32]) -> bool {
        self.relayed
            .lock()
            .map(|r| r.get(key).is_some_and(|at| at.elapsed() < RELAYED_FOR))
            .unwrap_or(false)
    }

    /// A connection to `peer` through the relay at `via`.
    async fn connect_relayed(
        &self,
        peer: &PeerAddr,
        via: &PeerAddr,
        alpn: &'static [u8],
    ) -> anyhow::Result<quinn::Connection> {
        // A relay that does not answer, or offers none, is said at once,
        // not after a connection attempt's timeout.
        self.tunnel.check_relay(via)?;
        if !self.tunnel.relays_through(&via.key)
            && let Err(error) =
                reach::connect_relay(&self.endpoint, &self.tls, via, &self.tunnel).await
        {
            self.tunnel.gone(via, None);
            return Err(error);
        }
        let addr = self
            .tunnel
            .address(via, peer.key)
            .context("too many peers reached through relays")?;
        let through = PeerAddr {
            key: peer.key,
            addr,
        };
        // The relay answered just now: a peer behind it answers within a
        // few of its round trips, or is gone.
        let connection = self
            .connect_direct(&through, alpn, PUNCH_WAIT)
            .await
            .with_context(|| format!("through the relay at {via}"))?;
        Ok(connection)
    }

    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    /// Connections kept for reuse.
    pub async fn kept(&self) -> usize {
        self.cache.lock().await.len()
    }

    pub async fn connect(
        &self,
        peer: &PeerAddr,
        alpn: &'static [u8],
    ) -> anyhow::Result<quinn::Connection> {
        if self.live(peer, alpn).await.is_some() {
            return self.connect_direct(peer, alpn, msg::CONNECT_TIMEOUT).await;
        }
        let Some(via) = self.way_to(peer) else {
            return self.connect_direct(peer, alpn, msg::CONNECT_TIMEOUT).await;
        };
        // Behind a NAT: a punched hole, else through the relay. Behind a
        // symmetric NAT this node's own packets to the peer leave by a port
        // no introduction told it of: through the relay at once.
        let own_symmetric = matches!(
            self.reachability(),
            Reachability::Behind {
                symmetric: true,
                ..
            }
        );
        if !own_symmetric && !self.relayed_recently(&peer.key) {
            match self.introduce(peer, &via).await {
                reach::Introduced::Punched => {
                    match self.connect_direct(peer, alpn, PUNCH_WAIT).await {
                        Ok(connection) => {
                            tracing::info!(%peer, %via, "reached by hole punching");
                            return Ok(connection);
                        }
                        Err(error) => {
                            tracing::info!(%peer, "no hole punched ({error:#}): through the relay")
                        }
                    }
                }
                reach::Introduced::Symmetric => {
                    tracing::info!(%peer, "behind a symmetric NAT: through the relay")
                }
            }
        }
        let connection = self.connect_relayed(peer, &via, alpn).await?;
        tracing::info!(%peer, %via, "reached through a relay");
        // Through the relay from now on, for a while: remembered only once
        // the relay served (a peer that was restarting is punched to again
        // when the relay fails).
        if let Ok(mut relayed) = self.relayed.lock() {
            relayed.retain(|_, at| at.elapsed() < RELAYED_FOR);
            if relayed.len() < tunnel::MAX_RELAYED_PEERS {
                relayed.insert(peer.key, std::time::Instant::now());
            }
        }
        Ok(connection)
    }

    /// A kept connection to `peer`, or a new one without an introduction.
    async fn connect_direct(
        &self,
        peer: &PeerAddr,
        alpn: &'static [u8],
        within: std::time::Duration,
    ) -> anyhow::Result<quinn::Connection> {
        if let Some(existing) = self.live(peer, alpn).await {
            return Ok(existing);
        }
        let key = (peer.key, alpn);
        let gate = Gate::enter(&self.attempts, key);
        // Another attempt to the same peer is waited for within this one's
        // own time, not beyond.
        let attempt = tokio::time::timeout(within, gate.gate.lock())
            .await
            .with_context(|| format!("timed out waiting for another attempt to reach {peer}"))?;
        // Another caller's attempt may have connected meanwhile.
        let connected = async {
            if let Some(existing) = self.live(peer, alpn).await {
                return Ok(existing);
            }
            let config = tls::client_config(&self.tls, peer.key, alpn)?;
            let connecting = self.endpoint.connect_with(config, peer.addr, "mesh-node")?;
            tokio::time::timeout(within, connecting)
                .await
                .with_context(|| format!("timed out connecting to {peer}"))?
                .with_context(|| format!("connecting to {peer}"))
        }
        .await;
        if let Ok(connection) = &connected {
            self.cache.lock().await.insert(key, connection.clone());
        }
        drop(attempt);
        connected
    }

    async fn live(&self, peer: &PeerAddr, alpn: &'static [u8]) -> Option<quinn::Connection> {
        self.cache
            .lock()
            .await
            .get(&(peer.key, alpn))
            .filter(|c| self.still_good(c, peer))
            .cloned()
    }

    /// Whether a kept connection still serves `peer`: open, and at its
    /// address or through a relay to it (a node that restarted elsewhere,
    /// a new port, is the same key at another address: not reused).
    fn still_good(&self, connection: &quinn::Connection, peer: &PeerAddr) -> bool {
        let remote = connection.remote_address();
        connection.close_reason().is_none()
            && (remote == peer.addr
                || self
                    .tunnel
                    .named(&remote)
                    .is_some_and(|(_, key)| key == peer.key))
    }

    pub async fn open(
        &self,
        peer: &PeerAddr,
        alpn: &'static [u8],
    ) -> anyhow::Result<(quinn::SendStream, quinn::RecvStream)> {
        let connection = self.connect(peer, alpn).await?;
        // A peer that grants no stream credit must not hold a request forever.
        let open = |connection: quinn::Connection| async move {
            tokio::time::timeout(msg::CONNECT_TIMEOUT, connection.open_bi())
                .await
                .with_context(|| format!("timed out opening a stream to {peer}"))?
                .map_err(anyhow::Error::from)
        };
        let stale = connection.stable_id();
        match open(connection).await {
            Ok(streams) => Ok(streams),
            Err(_) => {
                // A stale cached connection: drop it (not a newer one
                // another caller made meanwhile) and try once more.
                let mut cache = self.cache.lock().await;
                if cache
                    .get(&(peer.key, alpn))
                    .is_some_and(|kept| kept.stable_id() == stale)
                {
                    cache.remove(&(peer.key, alpn));
                }
                drop(cache);
                let connection = self.connect(peer, alpn).await?;
                open(connection).await
            }
        }
    }
}
