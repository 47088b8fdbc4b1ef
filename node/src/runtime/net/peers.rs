//! The node's peers on the QUIC data plane: who a peer is (its key and
//! address), and the connections this node opened to peers, kept for
//! reuse per peer and protocol.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::str::FromStr;

use anyhow::Context;
use mesh_protocol::identity::{did_key, parse_did_key};

use crate::runtime::net::msg;
use crate::runtime::net::tls::{self, TlsIdentity};

/// A peer: its node id (did:key) and address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAddr {
    pub key: [u8; 32],
    pub addr: SocketAddr,
}

impl PeerAddr {
    pub fn did(&self) -> String {
        did_key(&self.key)
    }
}

impl FromStr for PeerAddr {
    type Err = anyhow::Error;
    /// `NODEID@HOST:PORT`, NODEID being a did:key.
    fn from_str(text: &str) -> anyhow::Result<Self> {
        let (id, addr) = text
            .rsplit_once('@')
            .context("a peer is NODEID@HOST:PORT")?;
        let key = parse_did_key(id)
            .with_context(|| format!("`{id}` is not an Ed25519 did:key node id"))?;
        let addr = std::net::ToSocketAddrs::to_socket_addrs(addr)
            .with_context(|| format!("cannot resolve `{addr}`"))?
            .next()
            .with_context(|| format!("`{addr}` resolves to no address"))?;
        Ok(Self { key, addr })
    }
}

impl std::fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.did(), self.addr)
    }
}

/// A kept connection's key: the peer's key and the ALPN it speaks.
type ConnectionKey = ([u8; 32], &'static [u8]);

/// Connections this node opened, by peer key and ALPN, on its one endpoint.
#[derive(Debug)]
pub struct Peers {
    endpoint: quinn::Endpoint,
    tls: TlsIdentity,
    cache: tokio::sync::Mutex<HashMap<ConnectionKey, quinn::Connection>>,
}

impl Peers {
    pub fn new(endpoint: quinn::Endpoint, tls: TlsIdentity) -> Self {
        Self {
            endpoint,
            tls,
            cache: tokio::sync::Mutex::new(HashMap::new()),
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
