//! The node's peers on the QUIC data plane: who a peer is (its key and
//! address), and the connections this node opened to peers, kept for
//! reuse per peer and protocol.

use std::collections::HashMap;

use anyhow::Context;

use std::sync::{Arc, Mutex, OnceLock};

use crate::runtime::net::msg;
use crate::runtime::net::reach::{self, ALPN_REACH, Reachability};
use crate::runtime::net::tls::{self, TlsIdentity};

pub use crate::runtime::net::addr::PeerAddr;

/// A kept connection's key: the peer's key and the ALPN it speaks.
type ConnectionKey = ([u8; 32], &'static [u8]);

/// The member a node behind a NAT is introduced through, by its key
/// (the mesh's adverts say).
pub type Routes = Arc<dyn Fn(&[u8; 32]) -> Option<PeerAddr> + Send + Sync>;

/// Connections this node opened, by peer key and ALPN, on its one
/// endpoint; how peers behind NATs are reached, and how this node is.
pub struct Peers {
    endpoint: quinn::Endpoint,
    tls: TlsIdentity,
    cache: tokio::sync::Mutex<HashMap<ConnectionKey, quinn::Connection>>,
    routes: OnceLock<Routes>,
    reach: Arc<Mutex<Reachability>>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("endpoint", &self.endpoint.local_addr().ok())
            .field("reach", &self.reachability())
            .finish_non_exhaustive()
    }
}

impl Peers {
    pub fn new(endpoint: quinn::Endpoint, tls: TlsIdentity) -> Self {
        Self {
            endpoint,
            tls,
            cache: tokio::sync::Mutex::new(HashMap::new()),
            routes: OnceLock::new(),
            reach: Arc::new(Mutex::new(Reachability::Unknown)),
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
            candidates,
        ))
    }

    /// A peer behind a NAT first opens it to this node, at the word of the
    /// member it keeps a connection with (unless that is this node: its
    /// kept connection already lets this node's packets in).
    async fn open_the_way(&self, peer: &PeerAddr) {
        // A peer whose advert has not come yet may keep its connection with
        // this node's own rendezvous (a mesh of one bootstrap): ask it.
        let own = match self.reachability() {
            Reachability::Behind { via, .. } => Some(via),
            _ => None,
        };
        let Some(via) = self
            .routes
            .get()
            .and_then(|routes| routes(&peer.key))
            .or(own)
        else {
            return;
        };
        if via.key == self.tls.public_key {
            return;
        }
        let introduced = async {
            let connection = self.connect_direct(&via, ALPN_REACH).await?;
            reach::introduce(&connection, peer.key).await
        };
        match introduced.await {
            Ok(()) => tracing::debug!(%peer, %via, "introduced"),
            Err(error) => tracing::warn!(%peer, %via, "not introduced: {error:#}"),
        }
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
        if self.live(peer, alpn).await.is_none() {
            self.open_the_way(peer).await;
        }
        self.connect_direct(peer, alpn).await
    }

    /// A kept connection to `peer`, or a new one without an introduction.
    async fn connect_direct(
        &self,
        peer: &PeerAddr,
        alpn: &'static [u8],
    ) -> anyhow::Result<quinn::Connection> {
        let mut connections = self.cache.lock().await;
        // A node that restarted elsewhere (a new port) is the same key at
        // another address: the old connection is not reused.
        if let Some(existing) = connections.get(&(peer.key, alpn))
            && existing.close_reason().is_none()
            && existing.remote_address() == peer.addr
        {
            return Ok(existing.clone());
        }
        let config = tls::client_config(&self.tls, peer.key, alpn)?;
        let connecting = self.endpoint.connect_with(config, peer.addr, "mesh-node")?;
        let connection = tokio::time::timeout(msg::CONNECT_TIMEOUT, connecting)
            .await
            .with_context(|| format!("timed out connecting to {peer}"))?
            .with_context(|| format!("connecting to {peer}"))?;
        connections.insert((peer.key, alpn), connection.clone());
        Ok(connection)
    }

    async fn live(&self, peer: &PeerAddr, alpn: &'static [u8]) -> Option<quinn::Connection> {
        self.cache
            .lock()
            .await
            .get(&(peer.key, alpn))
            .filter(|c| c.close_reason().is_none() && c.remote_address() == peer.addr)
            .cloned()
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
        match open(connection).await {
            Ok(streams) => Ok(streams),
            Err(_) => {
                // A stale cached connection: drop it and try once more.
                self.cache.lock().await.remove(&(peer.key, alpn));
                let connection = self.connect(peer, alpn).await?;
                open(connection).await
            }
        }
    }
}
