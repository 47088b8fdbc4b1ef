//! Reachability on the QUIC data plane (`mesh-reach/1`, docs/mesh.md
//! "Reachability").
//!
//! A node asks a public member (its *rendezvous*) what address it sees
//! the node at, and whether a connection from another of its ports gets
//! through unasked (a dial-back). One that gets through is public. One that
//! does not is behind a NAT that lets in only answers to its own packets:
//! it advertises the seen address and the rendezvous, and keeps its
//! connection to the rendezvous open (keep-alives hold the NAT's mapping).
//! A node that wants to reach it first asks the rendezvous to introduce it;
//! the rendezvous tells the node, over the kept connection, to send a
//! packet to the asker's address as the rendezvous sees it (hole
//! punching), and the asker's connection then arrives as an answer.
//!
//! Every message is one framed body (`msg::write`), at most
//! `MAX_REACH_MESSAGE` bytes, one request and one answer per stream:
//!
//! ```text
//! OBSERVE    01                       -> 00|01 (reachable) ‖ seen address (text)
//! INTRODUCE  02 ‖ node key (32)       -> 00 (introduced) | 01 (not kept here) | 02 (busy)
//! PUNCH      03 ‖ asker key (32) ‖ asker address (text)   (rendezvous to node)
//!                                     -> 00 (sent) | 02 (busy)
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use mesh_protocol::identity::did_key;
use tokio::sync::Semaphore;

use crate::runtime::net::addr::PeerAddr;
use crate::runtime::net::msg;
use crate::runtime::net::tls::{self, TlsIdentity};
use crate::runtime::router::{Handled, ProtocolHandler};

pub const ALPN_REACH: &[u8] = b"mesh-reach/1";

/// Largest reach message (a kind, a key and an address).
pub const MAX_REACH_MESSAGE: usize = 128;
/// Nodes behind NATs one rendezvous keeps connections for.
pub const MAX_BEHIND: usize = 1024;
/// Dial-backs a rendezvous runs at once (each binds a socket).
pub const MAX_DIAL_BACKS: usize = 16;
/// Introductions a rendezvous relays at once.
pub const MAX_INTRODUCTIONS: usize = 64;
/// Punches a node sends at once at its rendezvous's word.
pub const MAX_PUNCHES: usize = 16;
/// How long a dial-back may take before the node counts as unreachable.
pub const DIAL_BACK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a punch's connection attempt lives (its packets open the NAT;
/// whether it completes does not matter).
pub const PUNCH_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a reach request may wait for its answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a public node asks again (it may have moved behind a NAT).
pub const RECHECK_INTERVAL: Duration = Duration::from_secs(60);

const OBSERVE: u8 = 1;
const INTRODUCE: u8 = 2;
const PUNCH: u8 = 3;
const DONE: u8 = 0;
const NOT_KEPT: u8 = 1;
const BUSY: u8 = 2;

/// What a node knows of how others reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reachability {
    /// Not asked yet: no public member was known, or none answered.
    Unknown,
    /// A connection from another port of a member got through unasked.
    Public { seen: SocketAddr },
    /// Behind a NAT: others reach it at `seen` after asking `via`.
    Behind { seen: SocketAddr, via: PeerAddr },
}

impl std::fmt::Display for Reachability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reachability::Unknown => write!(f, "not checked yet (no public member answered)"),
            Reachability::Public { seen } => write!(f, "public: members reach it at {seen}"),
            Reachability::Behind { seen, via } => write!(
                f,
                "behind a NAT: seen at {seen}; members reach it by hole punching, introduced by {via}"
            ),
        }
    }
}

async fn request(
    connection: &quinn::Connection,
    body: &[u8],
    timeout: Duration,
) -> anyhow::Result<Vec<u8>> {
    let (mut send, mut recv) = tokio::time::timeout(timeout, connection.open_bi())
        .await
        .context("timed out opening a reach stream")??;
    msg::write(&mut send, body).await?;
    let _ = send.finish();
    let answer = msg::read(&mut recv, MAX_REACH_MESSAGE, timeout)
        .await?
        .context("the peer closed the reach stream without an answer")?;
    Ok(answer[4..].to_vec())
}

async fn answer(mut send: quinn::SendStream, body: &[u8]) -> anyhow::Result<()> {
    msg::write(&mut send, body).await?;
    let _ = send.finish();
    Ok(())
}

/// The rendezvous side: answers OBSERVE and INTRODUCE from any member.
#[derive(Debug)]
pub struct Rendezvous {
    tls: TlsIdentity,
    /// The kept connections of nodes found behind a NAT, by key.
    behind: Arc<Mutex<HashMap<[u8; 32], quinn::Connection>>>,
    dial_backs: Arc<Semaphore>,
    introductions: Arc<Semaphore>,
}

impl Rendezvous {
    pub fn new(tls: TlsIdentity) -> Self {
        Self {
            tls,
            behind: Arc::default(),
            dial_backs: Arc::new(Semaphore::new(MAX_DIAL_BACKS)),
            introductions: Arc::new(Semaphore::new(MAX_INTRODUCTIONS)),
        }
    }

    /// Nodes behind NATs this rendezvous keeps connections for.
    pub fn kept(&self) -> usize {
        self.behind.lock().map(|b| b.len()).unwrap_or(0)
    }

    /// Whether a connection from a fresh port reaches `node` at `seen`
    /// unasked: nothing in a NAT on the way has seen that port before.
    async fn dial_back(&self, node: [u8; 32], seen: SocketAddr) -> bool {
        let Ok(_permit) = self.dial_backs.clone().try_acquire_owned() else {
            return false;
        };
        let any: std::net::IpAddr = if seen.is_ipv4() {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        };
        let Ok(endpoint) = quinn::Endpoint::client(SocketAddr::new(any, 0)) else {
            return false;
        };
        let Ok(config) = tls::client_config(&self.tls, node, ALPN_REACH) else {
            return false;
        };
        let reached = match endpoint.connect_with(config, seen, "mesh-node") {
            Ok(connecting) => matches!(
                tokio::time::timeout(DIAL_BACK_TIMEOUT, connecting).await,
                Ok(Ok(_))
            ),
            Err(_) => false,
        };
        endpoint.close(0u32.into(), b"dial-back done");
        reached
    }

    /// Keep `connection` for introductions to `node`, until it closes.
    fn keep(&self, node: [u8; 32], connection: &quinn::Connection) -> bool {
        let Ok(mut behind) = self.behind.lock() else {
            return false;
        };
        if behind.len() >= MAX_BEHIND && !behind.contains_key(&node) {
            return false;
        }
        behind.insert(node, connection.clone());
        let (kept, connection, id) = (
            Arc::downgrade(&self.behind),
            connection.clone(),
            connection.stable_id(),
        );
        tokio::spawn(async move {
            connection.closed().await;
            if let Some(kept) = kept.upgrade()
                && let Ok(mut behind) = kept.lock()
                && behind.get(&node).is_some_and(|c| c.stable_id() == id)
            {
                behind.remove(&node);
            }
        });
        true
    }

    async fn observe(
        &self,
        node: [u8; 32],
        connection: &quinn::Connection,
        send: quinn::SendStream,
    ) -> anyhow::Result<()> {
        let seen = connection.remote_address();
        let reachable = self.dial_back(node, seen).await;
        if !reachable && self.keep(node, connection) {
            tracing::info!(node = %did_key(&node), %seen, "keeping a connection for a node behind a NAT");
        }
        let mut body = vec![u8::from(reachable)];
        body.extend_from_slice(seen.to_string().as_bytes());
        answer(send, &body).await
    }

    async fn introduce(
        &self,
        asker: [u8; 32],
        asker_seen: SocketAddr,
        node: [u8; 32],
        send: quinn::SendStream,
    ) -> anyhow::Result<()> {
        let Ok(_permit) = self.introductions.clone().try_acquire_owned() else {
            return answer(send, &[BUSY]).await;
        };
        let kept = self.behind.lock().ok().and_then(|b| b.get(&node).cloned());
        let Some(kept) = kept else {
            return answer(send, &[NOT_KEPT]).await;
        };
        let mut body = vec![PUNCH];
        body.extend_from_slice(&asker);
        body.extend_from_slice(asker_seen.to_string().as_bytes());
        let said = request(&kept, &body, ANSWER_TIMEOUT).await;
        let outcome = match said.as_deref() {
            Ok([DONE]) => DONE,
            Ok(_) => BUSY,
            Err(_) => NOT_KEPT,
        };
        answer(send, &[outcome]).await
    }
}

impl ProtocolHandler for Rendezvous {
    fn accept(
        &self,
        peer: [u8; 32],
        connection: &quinn::Connection,
        send: quinn::SendStream,
        mut recv: quinn::RecvStream,
    ) -> Handled {
        let this = Self {
            tls: self.tls.clone(),
            behind: self.behind.clone(),
            dial_backs: self.dial_backs.clone(),
            introductions: self.introductions.clone(),
        };
        let connection = connection.clone();
        Box::pin(async move {
            let Some(frame) = msg::read(&mut recv, MAX_REACH_MESSAGE, ANSWER_TIMEOUT).await? else {
                return Ok(());
            };
            match &frame[4..] {
                [OBSERVE] => this.observe(peer, &connection, send).await,
                [INTRODUCE, node @ ..] => {
                    let node: [u8; 32] = node.try_into().context("INTRODUCE names one key")?;
                    this.introduce(peer, connection.remote_address(), node, send)
                        .await
                }
                _ => bail!("not a reach request"),
            }
        })
    }
}

/// Ask `rendezvous` how it sees this node; the connection it was asked
/// over, and the answer.
async fn observe(
    endpoint: &quinn::Endpoint,
    tls: &TlsIdentity,
    rendezvous: &PeerAddr,
) -> anyhow::Result<(quinn::Connection, bool, SocketAddr)> {
    let config = tls::client_config(tls, rendezvous.key, ALPN_REACH)?;
    let connection = tokio::time::timeout(
        msg::CONNECT_TIMEOUT,
        endpoint.connect_with(config, rendezvous.addr, "mesh-node")?,
    )
    .await
    .with_context(|| format!("timed out connecting to {rendezvous}"))??;
    let said = request(&connection, &[OBSERVE], DIAL_BACK_TIMEOUT + ANSWER_TIMEOUT).await?;
    let Some((&reachable, seen)) = said.split_first() else {
        bail!("an empty OBSERVE answer");
    };
    let seen = std::str::from_utf8(seen)
        .ok()
        .and_then(|s| s.parse().ok())
        .context("the OBSERVE answer names no address")?;
    Ok((connection, reachable == 1, seen))
}

/// Answer the rendezvous's PUNCH requests on `connection` until it closes.
async fn punch_on_request(
    endpoint: &quinn::Endpoint,
    tls: &TlsIdentity,
    connection: &quinn::Connection,
) {
    let punches = Arc::new(Semaphore::new(MAX_PUNCHES));
    while let Ok((send, mut recv)) = connection.accept_bi().await {
        let (endpoint, tls, punches) = (endpoint.clone(), tls.clone(), punches.clone());
        tokio::spawn(async move {
            let Ok(Some(frame)) = msg::read(&mut recv, MAX_REACH_MESSAGE, ANSWER_TIMEOUT).await
            else {
                return;
            };
            let Some((asker, addr)) = parse_punch(&frame[4..]) else {
                return;
            };
            let Ok(permit) = punches.try_acquire_owned() else {
                let _ = answer(send, &[BUSY]).await;
                return;
            };
            let Ok(config) = tls::client_config(&tls, asker, ALPN_REACH) else {
                return;
            };
            let Ok(connecting) = endpoint.connect_with(config, addr, "mesh-node") else {
                return;
            };
            tracing::debug!(asker = %did_key(&asker), %addr, "punching");
            // The attempt's first packet is out once the endpoint's driver
            // ran; the asker dials on hearing back.
            tokio::time::sleep(Duration::from_millis(10)).await;
            let _ = answer(send, &[DONE]).await;
            if let Ok(Ok(connection)) = tokio::time::timeout(PUNCH_TIMEOUT, connecting).await {
                connection.close(0u32.into(), b"punched");
            }
            drop(permit);
        });
    }
}

fn parse_punch(body: &[u8]) -> Option<([u8; 32], SocketAddr)> {
    let [PUNCH, rest @ ..] = body else {
        return None;
    };
    let (asker, addr) = rest.split_at_checked(32)?;
    let addr = std::str::from_utf8(addr).ok()?.parse().ok()?;
    Some((asker.try_into().ok()?, addr))
}

/// Ask `rendezvous` to have `node` open its NAT to this node; `Ok` once
/// the node says its packet is out.
pub async fn introduce(connection: &quinn::Connection, node: [u8; 32]) -> anyhow::Result<()> {
    let mut body = vec![INTRODUCE];
    body.extend_from_slice(&node);
    match request(connection, &body, ANSWER_TIMEOUT).await?.as_slice() {
        [DONE] => Ok(()),
        [NOT_KEPT] => bail!("the rendezvous keeps no connection for {}", did_key(&node)),
        [BUSY] => bail!("the rendezvous is busy"),
        _ => bail!("an unknown INTRODUCE answer"),
    }
}

/// Learn this node's reachability from the members `candidates` names
/// (oldest first), keep it in `state`, and while behind a NAT keep the
/// rendezvous's connection and punch at its word. Runs until aborted.
pub async fn keep_reachable(
    endpoint: quinn::Endpoint,
    tls: TlsIdentity,
    state: Arc<Mutex<Reachability>>,
    candidates: impl Fn() -> Vec<PeerAddr>,
) {
    loop {
        let mut learned = None;
        for rendezvous in candidates() {
            match observe(&endpoint, &tls, &rendezvous).await {
                Ok(answer) => {
                    learned = Some((rendezvous, answer));
                    break;
                }
                Err(error) => tracing::debug!(%rendezvous, "reachability not learned: {error:#}"),
            }
        }
        let Some((rendezvous, (connection, reachable, seen))) = learned else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let now = if reachable {
            Reachability::Public { seen }
        } else {
            Reachability::Behind {
                seen,
                via: rendezvous,
            }
        };
        if let Ok(mut state) = state.lock()
            && *state != now
        {
            tracing::info!("reachability: {now}");
            *state = now;
        }
        if reachable {
            connection.close(0u32.into(), b"checked");
            tokio::time::sleep(RECHECK_INTERVAL).await;
        } else {
            punch_on_request(&endpoint, &tls, &connection).await;
            tracing::info!("the rendezvous connection closed: asking again");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_punch_request_names_a_key_and_an_address() {
        let mut body = vec![PUNCH];
        body.extend_from_slice(&[7; 32]);
        body.extend_from_slice(b"10.77.0.21:5000");
        assert_eq!(
            parse_punch(&body),
            Some(([7; 32], "10.77.0.21:5000".parse().unwrap()))
        );
        assert_eq!(parse_punch(&body[..20]), None);
        assert_eq!(parse_punch(&body[..33]), None);
        body[0] = INTRODUCE;
        assert_eq!(parse_punch(&body), None);
    }
}
