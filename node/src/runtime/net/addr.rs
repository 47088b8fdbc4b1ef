//! A peer on the data plane: its node id (did:key) and address, as a
//! user writes it (`NODEID@HOST:PORT`).

use std::net::SocketAddr;
use std::str::FromStr;

use anyhow::Context;
use mesh_protocol::identity::{did_key, parse_did_key};

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
