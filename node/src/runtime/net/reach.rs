//! Reachability on the QUIC data plane (`mesh-reach/1`, docs/mesh.md
//! "Reachability").
//!
//! A node asks a public member (its *rendezvous*) what address it sees
//! the node at, and whether a connection from another member's address
//! (DIAL_BACK), or with none to ask from another of its own ports, gets
//! through unasked (a dial-back). One that gets through is public. One that
//! does not is behind a NAT that lets in only answers to its own packets:
//! it advertises the seen address and the rendezvous, and keeps its
//! connection to the rendezvous open (keep-alives hold the NAT's mapping).
//! A node that wants to reach it first asks the rendezvous to introduce it;
//! the rendezvous tells the node, over the kept connection, to send a
//! packet to the asker's address as the rendezvous sees it (hole
//! punching), and the asker's connection then arrives as an answer.
//!
//! Every message is one framed body (`msg::write`), one request and one
//! answer per stream; their bytes and limits are `mesh_protocol::reach`'s
//! (docs/mesh.md has the diagram, `vectors/mesh/reach.json` the vectors).
//! A request from a key that is not a member of this node's mesh is
//! answered NOT_MEMBER.
//!
//! Where no hole can be punched (a symmetric NAT), QUIC packets go through
//! a member that offers a relay (`--relay`): each side holds a RELAY stream
//! to it, and it copies each frame to the stream of the member the frame
//! names, within `RelayBounds`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use mesh_protocol::identity::did_key;
use mesh_protocol::reach::{ReachAnswer, ReachRequest, relay_frame};
use tokio::sync::Semaphore;

use crate::runtime::net::addr::PeerAddr;
use crate::runtime::net::circuits::{CircuitRefusal, Circuits, RelayBounds};
use crate::runtime::net::msg;
use crate::runtime::net::tls::{self, TlsIdentity};
use crate::runtime::net::tunnel::{self, Tunnel};
use crate::runtime::router::{Handled, ProtocolHandler};

pub const ALPN_REACH: &[u8] = b"mesh-reach/1";

/// Largest reach message (a kind, a key and an address).
pub use mesh_protocol::reach::MAX_REACH_MESSAGE;
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
/// How long a connection to a rendezvous or a relay may take: a public
/// member answers within a round trip, and a request that needs one that
/// went away learns so early.
pub const REACH_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a reach request may wait for its answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a node behind a NAT that no member relays for asks again.
pub const RELAYLESS_RECHECK: Duration = Duration::from_secs(30);
/// How often a public node asks again (it may have moved behind a NAT).
pub const RECHECK_INTERVAL: Duration = Duration::from_secs(60);

/// Whether a key is a member of this node's mesh now (its advert current).
pub type Membership = Arc<dyn Fn(&[u8; 32]) -> bool + Send + Sync>;
/// The members that advertise no NAT (no `via`), oldest first.
pub type PublicMembers = Arc<dyn Fn() -> Vec<PeerAddr> + Send + Sync>;
/// Other members a rendezvous asks to dial a node back, one after the
/// other while each says the connection did not get in.
pub const HELPERS_ASKED: usize = 2;
/// How long a node waits for OBSERVED: the rendezvous's own dial-back,
/// then up to `HELPERS_ASKED` others (a connection, then a dial-back and a
/// second more each).
pub const OBSERVE_TIMEOUT: Duration = Duration::from_secs(
    DIAL_BACK_TIMEOUT.as_secs()
        + HELPERS_ASKED as u64
            * (REACH_CONNECT_TIMEOUT.as_secs() + DIAL_BACK_TIMEOUT.as_secs() + 1)
        + ANSWER_TIMEOUT.as_secs(),
);

/// What a node knows of how others reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reachability {
    /// Not asked yet: no public member was known, or none answered.
    Unknown,
    /// A connection from another member's address (or, with none to ask,
    /// another port of the rendezvous) got through unasked.
    Public { seen: SocketAddr },
    /// Behind a NAT: others reach it at `seen` after asking `via`; behind
    /// a symmetric one (two members saw two ports), only through `via`'s
    /// relay.
    Behind {
        seen: SocketAddr,
        via: PeerAddr,
        symmetric: bool,
    },
}

impl std::fmt::Display for Reachability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reachability::Unknown => write!(f, "not checked yet (no public member answered)"),
            Reachability::Public { seen } => write!(f, "public: members reach it at {seen}"),
            Reachability::Behind {
                seen,
                via,
                symmetric: false,
            } => write!(
                f,
                "behind a NAT: seen at {seen}; members reach it by hole punching, introduced by {via}"
            ),
            Reachability::Behind {
                seen,
                via,
                symmetric: true,
            } => write!(
                f,
                "behind a symmetric NAT (a new port for every destination; seen at {seen}): members reach it relayed by {via}"
            ),
        }
    }
}

/// Ask `request` on a new stream of `connection`; its answer, and the
/// stream (a RELAY stream carries relay frames after its answer).
async fn ask(
    connection: &quinn::Connection,
    request: &ReachRequest,
    timeout: Duration,
) -> anyhow::Result<(ReachAnswer, quinn::SendStream, quinn::RecvStream)> {
    // One deadline for the whole exchange: opening, asking, answering.
    let exchange = async {
        let (mut send, mut recv) = connection.open_bi().await?;
        msg::write(&mut send, &request.encode()).await?;
        let said = msg::read(&mut recv, MAX_REACH_MESSAGE, timeout)
            .await?
            .context("the peer closed the reach stream without an answer")?;
        anyhow::Ok((ReachAnswer::decode(request, &said[4..])?, send, recv))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .with_context(|| format!("no answer to {} within {timeout:?}", request.name()))?
}

/// `ask`, for a request whose stream ends with its answer.
async fn request(
    connection: &quinn::Connection,
    request: &ReachRequest,
    timeout: Duration,
) -> anyhow::Result<ReachAnswer> {
    let (answer, mut send, _) = ask(connection, request, timeout).await?;
    let _ = send.finish();
    Ok(answer)
}

async fn answer(mut send: quinn::SendStream, answer: ReachAnswer) -> anyhow::Result<()> {
    msg::write(&mut send, &answer.encode()).await?;
    let _ = send.finish();
    Ok(())
}

/// The rendezvous side: answers OBSERVE, INTRODUCE and RELAY from the
/// members of this node's mesh.
#[derive(Clone)]
pub struct Rendezvous {
    tls: TlsIdentity,
    /// The kept connections of the nodes that asked OBSERVE, by key,
    /// until each closes (a node behind a NAT keeps its rendezvous's).
    behind: Arc<Mutex<HashMap<[u8; 32], quinn::Connection>>>,
    dial_backs: Arc<Semaphore>,
    introductions: Arc<Semaphore>,
    /// The relay this node offers (`--relay`), if it does.
    relay: Option<Arc<Relay>>,
    /// Who may ask: members of this node's mesh only (none off a mesh).
    members: Option<Membership>,
    /// Who may dial a node back from an address other than this one's.
    public: Option<PublicMembers>,
    /// The address this node advertises (behind a 1:1 NAT or a cloud's
    /// private network, not the one packets arrive at).
    advertised: Option<std::net::IpAddr>,
}

/// A refused circuit as logged: its two members and the refusal.
type RefusalSeen = ([u8; 32], [u8; 32], u8);

/// A relay's members (their streams' frames to write) and circuits.
#[derive(Debug)]
struct Relay {
    bounds: RelayBounds,
    members: Mutex<HashMap<[u8; 32], tokio::sync::mpsc::Sender<Vec<u8>>>>,
    circuits: Mutex<Circuits>,
    /// Refusals logged, each (pair, kind) once.
    logged: Mutex<std::collections::HashSet<RefusalSeen>>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("kept", &self.kept())
            .field("relay", &self.relay.as_ref().map(|r| r.bounds))
            .field("in_a_mesh", &self.members.is_some())
            .finish()
    }
}

impl Rendezvous {
    pub fn new(
        tls: TlsIdentity,
        relay: Option<RelayBounds>,
        members: Option<Membership>,
        public: Option<PublicMembers>,
        advertised: Option<std::net::IpAddr>,
    ) -> Self {
        Self {
            members,
            public,
            advertised,
            tls,
            behind: Arc::default(),
            dial_backs: Arc::new(Semaphore::new(MAX_DIAL_BACKS)),
            introductions: Arc::new(Semaphore::new(MAX_INTRODUCTIONS)),
            relay: relay.map(|bounds| {
                Arc::new(Relay {
                    bounds,
                    members: Mutex::default(),
                    circuits: Mutex::new(Circuits::new(bounds)),
                    logged: Mutex::default(),
                })
            }),
        }
    }

    /// Whether `key` is a member of this node's mesh now (none is, off a
    /// mesh).
    fn is_member(&self, key: &[u8; 32]) -> bool {
        self.members
            .as_ref()
            .is_some_and(|is_member| is_member(key))
    }

    /// Nodes this rendezvous keeps connections for.
    pub fn kept(&self) -> usize {
        self.behind.lock().map(|b| b.len()).unwrap_or(0)
    }

    /// Whether a connection from a fresh port reaches `node` at `seen`
    /// unasked: nothing in a NAT on the way has seen that port before.
    /// `None` when every dial-back slot is taken (the asker is told BUSY,
    /// never "unreachable").
    async fn dial_back(&self, node: [u8; 32], seen: SocketAddr) -> Option<bool> {
        let _permit = self.dial_backs.clone().try_acquire_owned().ok()?;
        let Ok(endpoint) = quinn::Endpoint::client(SocketAddr::new(unspecified(seen), 0)) else {
            return Some(false);
        };
        let Ok(config) = tls::client_config(&self.tls, node, ALPN_REACH) else {
            return Some(false);
        };
        let reached = match endpoint.connect_with(config, seen, "mesh-node") {
            Ok(connecting) => matches!(
                tokio::time::timeout(DIAL_BACK_TIMEOUT, connecting).await,
                Ok(Ok(_))
            ),
            Err(_) => false,
        };
        endpoint.close(0u32.into(), b"dial-back done");
        Some(reached)
    }

    /// Keep `connection` for introductions to `node`, until it closes.
    fn keep(&self, node: [u8; 32], connection: &quinn::Connection) -> bool {
        let Ok(mut behind) = self.behind.lock() else {
            return false;
        };
        if behind.len() >= MAX_BEHIND && !behind.contains_key(&node) {
            return false;
        }
        let id = connection.stable_id();
        // Asked again on the same connection: it is watched already.
        if behind.get(&node).is_some_and(|kept| kept.stable_id() == id) {
            return true;
        }
        behind.insert(node, connection.clone());
        let (kept, connection) = (Arc::downgrade(&self.behind), connection.clone());
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

    /// Whether a connection from another member, at an address that is
    /// neither this node's nor `node`'s, reaches `node` at `seen`: a NAT
    /// that filters by address only lets in this node's own dial-back
    /// (from any of its ports), not that one. Up to `HELPERS_ASKED`
    /// members are asked while they say it did not get in (one that cannot
    /// dial out does not decide alone); `None` when none of them answered.
    async fn dial_back_elsewhere(
        &self,
        node: [u8; 32],
        seen: SocketAddr,
        own: Option<std::net::IpAddr>,
    ) -> Option<bool> {
        let own_ips: Vec<std::net::IpAddr> = own.into_iter().chain(self.advertised).collect();
        let helpers = helpers(
            (self.public.as_ref()?)(),
            (&node, &self.tls.public_key),
            seen,
            &own_ips,
        );
        let mut answered = None;
        for helper in helpers {
            match self.ask_to_dial_back(&helper, node, seen).await {
                Ok(true) => return Some(true),
                Ok(false) => answered = Some(false),
                Err(error) => {
                    tracing::info!(%helper, "no dial-back from another member: {error:#}");
                }
            }
        }
        answered
    }

    /// DIAL_BACK to `helper`: its connection within `REACH_CONNECT_TIMEOUT`,
    /// its answer within its dial-back's time and a second more.
    async fn ask_to_dial_back(
        &self,
        helper: &PeerAddr,
        node: [u8; 32],
        seen: SocketAddr,
    ) -> anyhow::Result<bool> {
        let _permit = self
            .dial_backs
            .clone()
            .try_acquire_owned()
            .context("every dial-back slot is taken")?;
        let endpoint = quinn::Endpoint::client(SocketAddr::new(unspecified(seen), 0))?;
        let asked = async {
            let connection = connect(&endpoint, &self.tls, helper).await?;
            let said = request(
                &connection,
                &ReachRequest::DialBack { node, at: seen },
                DIAL_BACK_TIMEOUT + Duration::from_secs(1),
            )
            .await;
            connection.close(0u32.into(), b"asked");
            match said? {
                ReachAnswer::Observed { reachable, .. } => anyhow::Ok(reachable),
                other => bail!("it answered {}", other.name()),
            }
        }
        .await;
        endpoint.close(0u32.into(), b"asked");
        asked
    }

    async fn observe(
        &self,
        node: [u8; 32],
        connection: &quinn::Connection,
        send: quinn::SendStream,
    ) -> anyhow::Result<()> {
        let remote = connection.remote_address();
        let seen = SocketAddr::new(remote.ip().to_canonical(), remote.port());
        // This node's own dial-back first: what it keeps out, no NAT lets
        // in from elsewhere. What it lets in, another member's tells apart
        // from a NAT that filters by address only.
        let Some(mut reachable) = self.dial_back(node, remote).await else {
            return answer(send, ReachAnswer::Busy).await;
        };
        if reachable
            && let Some(elsewhere) = self
                .dial_back_elsewhere(node, seen, connection.local_ip())
                .await
        {
            reachable = elsewhere;
        }
        // Kept whatever the dial-backs said: a node asked by a second
        // member takes that member's "reachable" for a view of its port
        // only (it has sent to the first member since, and a NAT that
        // filters by address only lets that member in), and may stay behind
        // its NAT with this node as its rendezvous. A node that needs no
        // rendezvous closes the connection, and the watch forgets it. With
        // every place taken, a node behind a NAT is told BUSY: it would
        // count on a rendezvous that cannot introduce it.
        let kept = self.keep(node, connection);
        if !reachable {
            if !kept {
                return answer(send, ReachAnswer::Busy).await;
            }
            tracing::info!(node = %did_key(&node), %seen, "keeping a connection for a node behind a NAT");
        }
        answer(
            send,
            ReachAnswer::Observed {
                reachable,
                seen: remote,
            },
        )
        .await
    }

    /// DIAL_BACK, from another member's rendezvous: dial `node` at `at`
    /// from a fresh port. Only a member is dialled (its key pins the
    /// connection, so reaching anyone else counts for nothing), within the
    /// same slots as this node's own dial-backs.
    async fn dial_back_for(
        &self,
        asker: [u8; 32],
        node: [u8; 32],
        at: SocketAddr,
        send: quinn::SendStream,
    ) -> anyhow::Result<()> {
        if !self.is_member(&node) {
            return answer(send, ReachAnswer::NotMember).await;
        }
        // Only a rendezvous asks (a member that advertises no NAT), and only
        // for an address a node on a network could have: not this machine,
        // nobody, or everybody.
        let asker_public = self
            .public
            .as_ref()
            .is_some_and(|public| public().iter().any(|m| m.key == asker));
        let ip = at.ip().to_canonical();
        let dialable = !(ip.is_loopback()
            || ip.is_unspecified()
            || ip.is_multicast()
            || at.port() == 0
            || matches!(ip, std::net::IpAddr::V4(v4) if v4.is_broadcast() || v4.is_link_local()));
        if !asker_public || !dialable {
            return answer(send, ReachAnswer::Busy).await;
        }
        let outcome = match self.dial_back(node, at).await {
            Some(reachable) => ReachAnswer::Observed {
                reachable,
                seen: at,
            },
            None => ReachAnswer::Busy,
        };
        answer(send, outcome).await
    }

    async fn introduce(
        &self,
        asker: [u8; 32],
        asker_seen: SocketAddr,
        node: [u8; 32],
        send: quinn::SendStream,
    ) -> anyhow::Result<()> {
        let Ok(_permit) = self.introductions.clone().try_acquire_owned() else {
            return answer(send, ReachAnswer::Busy).await;
        };
        let kept = self.behind.lock().ok().and_then(|b| b.get(&node).cloned());
        let Some(kept) = kept else {
            return answer(send, ReachAnswer::NotKept).await;
        };
        let punch = ReachRequest::Punch {
            asker,
            at: asker_seen,
        };
        let outcome = match request(&kept, &punch, ANSWER_TIMEOUT).await {
            Ok(said @ (ReachAnswer::Done | ReachAnswer::Symmetric)) => said,
            Ok(_) => ReachAnswer::Busy,
            Err(_) => ReachAnswer::NotKept,
        };
        answer(send, outcome).await
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
        let this = self.clone();
        let connection = connection.clone();
        Box::pin(async move {
            let Some(frame) = msg::read(&mut recv, MAX_REACH_MESSAGE, ANSWER_TIMEOUT).await? else {
                return Ok(());
            };
            // A stranger makes this node dial, punch or relay nothing.
            if !this.is_member(&peer) {
                return answer(send, ReachAnswer::NotMember).await;
            }
            match ReachRequest::decode(&frame[4..])? {
                ReachRequest::Observe => this.observe(peer, &connection, send).await,
                ReachRequest::Introduce { node } => {
                    this.introduce(peer, connection.remote_address(), node, send)
                        .await
                }
                ReachRequest::Relay => match &this.relay {
                    Some(relay) => relay.clone().serve(peer, send, recv).await,
                    None => answer(send, ReachAnswer::NoRelay).await,
                },
                ReachRequest::DialBack { node, at } => {
                    this.dial_back_for(peer, node, at, send).await
                }
                ReachRequest::Punch { .. } => bail!("PUNCH goes from a rendezvous to its node"),
            }
        })
    }
}

/// A member's place at the relay, given up when its stream ends (unless a
/// newer stream of the same member took it).
struct MemberSlot {
    relay: Arc<Relay>,
    member: [u8; 32],
    frames: tokio::sync::mpsc::Sender<Vec<u8>>,
}

impl Drop for MemberSlot {
    fn drop(&mut self) {
        if let Ok(mut members) = self.relay.members.lock()
            && members
                .get(&self.member)
                .is_some_and(|m| m.same_channel(&self.frames))
        {
            members.remove(&self.member);
        }
    }
}

impl Relay {
    /// Take `member`'s relay stream: copy each frame it sends to the
    /// stream of the member the frame names, within the bounds.
    async fn serve(
        self: Arc<Self>,
        member: [u8; 32],
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
    ) -> anyhow::Result<()> {
        let room = self
            .members
            .lock()
            .map(|m| m.len() < self.bounds.members || m.contains_key(&member))
            .unwrap_or(false);
        if !room {
            return answer(send, ReachAnswer::Busy).await;
        }
        msg::write(&mut send, &ReachAnswer::Done.encode()).await?;
        // The member's place is taken once it heard DONE, and given up on
        // every way out of here.
        let (frames, mut to_write) = tokio::sync::mpsc::channel::<Vec<u8>>(tunnel::RELAY_QUEUE);
        let _slot = match self.members.lock() {
            Ok(mut members)
                if members.len() < self.bounds.members || members.contains_key(&member) =>
            {
                members.insert(member, frames.clone());
                MemberSlot {
                    relay: self.clone(),
                    member,
                    frames,
                }
            }
            _ => return Ok(()),
        };
        tracing::info!(member = %did_key(&member), "relaying QUIC packets for a member");
        tokio::spawn(async move {
            while let Some(frame) = to_write.recv().await {
                if send.write_all(&frame).await.is_err() {
                    break;
                }
            }
        });
        while let Ok((to, packet)) = tunnel::read_frame(&mut recv).await {
            // Only between members: a frame to a made-up key opens nothing.
            let target = self.members.lock().ok().and_then(|m| m.get(&to).cloned());
            let Some(target) = target else {
                continue;
            };
            let admitted = self
                .circuits
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .admit(member, to, packet.len(), std::time::Instant::now());
            if let Err(refusal) = admitted {
                self.refused(member, to, refusal);
                continue;
            }
            if let Ok(frame) = relay_frame(&member, &packet) {
                let _ = target.try_send(frame);
            }
        }
        Ok(())
    }

    fn refused(&self, from: [u8; 32], to: [u8; 32], refusal: CircuitRefusal) {
        let first = self
            .logged
            .lock()
            .map(|mut logged| logged.len() < 4096 && logged.insert((from, to, refusal as u8)))
            .unwrap_or(false);
        if first {
            tracing::warn!(
                from = %did_key(&from),
                to = %did_key(&to),
                "the relay refused a circuit: {refusal:?} (limits: {:?})",
                self.bounds
            );
        }
    }
}

/// Open a relay stream on `connection` (to a member that offers a relay)
/// and hand it to the tunnel.
pub async fn open_relay(
    connection: &quinn::Connection,
    relay: PeerAddr,
    tunnel: &Arc<Tunnel>,
) -> anyhow::Result<()> {
    let (said, send, recv) = ask(connection, &ReachRequest::Relay, ANSWER_TIMEOUT)
        .await
        .context("asking for a relay stream")?;
    match said {
        ReachAnswer::Done => {
            tunnel.attach(relay, connection.clone(), send, recv);
            Ok(())
        }
        ReachAnswer::NoRelay => bail!("{relay} offers no relay"),
        ReachAnswer::Busy => bail!("{relay}'s relay is full"),
        _ => bail!("{relay} does not count this node a member (yet)"),
    }
}

/// A `mesh-reach/1` connection to `member` from this node's endpoint,
/// within `REACH_CONNECT_TIMEOUT`.
async fn connect(
    endpoint: &quinn::Endpoint,
    tls: &TlsIdentity,
    member: &PeerAddr,
) -> anyhow::Result<quinn::Connection> {
    let config = tls::client_config(tls, member.key, ALPN_REACH)?;
    Ok(tokio::time::timeout(
        REACH_CONNECT_TIMEOUT,
        endpoint.connect_with(config, member.addr, "mesh-node")?,
    )
    .await
    .with_context(|| format!("timed out connecting to {member}"))??)
}

/// Connect to `relay` and open a relay stream to it for the tunnel.
pub async fn connect_relay(
    endpoint: &quinn::Endpoint,
    tls: &TlsIdentity,
    relay: &PeerAddr,
    tunnel: &Arc<Tunnel>,
) -> anyhow::Result<()> {
    let _one = tunnel.opening_one().await;
    if tunnel.relays_through(&relay.key) {
        return Ok(());
    }
    let connection = connect(endpoint, tls, relay).await?;
    open_relay(&connection, relay.clone(), tunnel).await
}

/// The members a rendezvous may ask to dial back `node` (at `seen`), at
/// most `HELPERS_ASKED`, in the order given: not the node, not this one
/// (`own_key`), at an address of `seen`'s family that is neither the
/// node's nor one of this node's (`own_ips`), IPv4-mapped IPv6 addresses
/// read as IPv4. A dial-back from an address the node sent to proves
/// nothing of a NAT that filters by address only.
fn helpers(
    public: Vec<PeerAddr>,
    (node, own_key): (&[u8; 32], &[u8; 32]),
    seen: SocketAddr,
    own_ips: &[std::net::IpAddr],
) -> Vec<PeerAddr> {
    let seen = seen.ip().to_canonical();
    public
        .into_iter()
        .filter(|m| {
            let ip = m.addr.ip().to_canonical();
            m.key != *node
                && m.key != *own_key
                && ip != seen
                && !own_ips.iter().any(|own| own.to_canonical() == ip)
                && ip.is_ipv4() == seen.is_ipv4()
        })
        .take(HELPERS_ASKED)
        .collect()
}

/// The unspecified address of `addr`'s family, to bind a fresh port on.
fn unspecified(addr: SocketAddr) -> std::net::IpAddr {
    if addr.is_ipv4() {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    }
}

/// Ask `rendezvous` how it sees this node; the connection it was asked
/// over, and the answer.
async fn observe(
    endpoint: &quinn::Endpoint,
    tls: &TlsIdentity,
    rendezvous: &PeerAddr,
) -> anyhow::Result<(quinn::Connection, bool, SocketAddr)> {
    let connection = connect(endpoint, tls, rendezvous).await?;
    let said = request(&connection, &ReachRequest::Observe, OBSERVE_TIMEOUT).await?;
    match said {
        ReachAnswer::Observed { reachable, seen } => Ok((connection, reachable, seen)),
        ReachAnswer::Busy => bail!("{rendezvous} is busy"),
        _ => bail!("{rendezvous} does not count this node a member (yet)"),
    }
}

/// Answer the rendezvous's PUNCH requests on `connection` until it closes.
async fn punch_on_request(
    endpoint: &quinn::Endpoint,
    tls: &TlsIdentity,
    connection: &quinn::Connection,
    symmetric: bool,
) {
    let punches = Arc::new(Semaphore::new(MAX_PUNCHES));
    while let Ok((send, mut recv)) = connection.accept_bi().await {
        if symmetric {
            // No hole a punch opens would be the one the asker dials.
            tokio::spawn(async move {
                let _ = msg::read(&mut recv, MAX_REACH_MESSAGE, ANSWER_TIMEOUT).await;
                let _ = answer(send, ReachAnswer::Symmetric).await;
            });
            continue;
        }
        let (endpoint, tls, punches) = (endpoint.clone(), tls.clone(), punches.clone());
        tokio::spawn(async move {
            let Ok(Some(frame)) = msg::read(&mut recv, MAX_REACH_MESSAGE, ANSWER_TIMEOUT).await
            else {
                return;
            };
            let Ok(ReachRequest::Punch { asker, at: addr }) = ReachRequest::decode(&frame[4..])
            else {
                return;
            };
            let Ok(permit) = punches.try_acquire_owned() else {
                let _ = answer(send, ReachAnswer::Busy).await;
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
            let _ = answer(send, ReachAnswer::Done).await;
            if let Ok(Ok(connection)) = tokio::time::timeout(PUNCH_TIMEOUT, connecting).await {
                connection.close(0u32.into(), b"punched");
            }
            drop(permit);
        });
    }
}

/// What an introduction came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Introduced {
    /// The node's packet to this node is out: dial it now.
    Punched,
    /// The node is behind a symmetric NAT: reach it through the relay.
    Symmetric,
}

/// Ask `rendezvous` to have `node` open its NAT to this node; `Ok` once
/// the node says its packet is out, or that it cannot be punched to.
pub async fn introduce(
    connection: &quinn::Connection,
    node: [u8; 32],
) -> anyhow::Result<Introduced> {
    match request(
        connection,
        &ReachRequest::Introduce { node },
        ANSWER_TIMEOUT,
    )
    .await?
    {
        ReachAnswer::Done => Ok(Introduced::Punched),
        ReachAnswer::Symmetric => Ok(Introduced::Symmetric),
        ReachAnswer::NotKept => bail!("the rendezvous keeps no connection for {}", did_key(&node)),
        ReachAnswer::Busy => bail!("the rendezvous is busy"),
        _ => bail!("the rendezvous does not count this node a member (yet)"),
    }
}

/// Candidates asked at most, each time this node asks again.
pub const MAX_CANDIDATES_ASKED: usize = 4;

/// What asking the candidates came to: the rendezvous, the connection
/// asked over, whether the node is public, the address seen, and whether
/// two members saw two ports (a symmetric NAT).
struct Learned {
    rendezvous: PeerAddr,
    connection: quinn::Connection,
    public: bool,
    seen: SocketAddr,
    symmetric: bool,
}

/// The first candidate that answers: public, or behind a NAT; behind one,
/// the first that also relays this node's packets (a symmetric NAT leaves
/// no other way), else the first that answered; and a second candidate's
/// view, where there is one, to tell a symmetric NAT.
async fn find_rendezvous(
    endpoint: &quinn::Endpoint,
    tls: &TlsIdentity,
    tunnel: &Arc<Tunnel>,
    candidates: Vec<PeerAddr>,
) -> Option<Learned> {
    let mut chosen: Option<(Learned, bool)> = None;
    let mut views: Vec<SocketAddr> = Vec::new();
    for (tried, candidate) in candidates
        .into_iter()
        .take(MAX_CANDIDATES_ASKED)
        .enumerate()
    {
        if chosen.as_ref().is_some_and(|(_, relays)| *relays) && views.len() >= 2 {
            break;
        }
        let (connection, public, seen) = match observe(endpoint, tls, &candidate).await {
            Ok(answer) => answer,
            Err(error) => {
                tracing::debug!(%candidate, "reachability not learned: {error:#}");
                continue;
            }
        };
        // Only the first member tried may say public: by a second one, the
        // node has sent to the first (if only its attempt to connect), and
        // a NAT that filters by address only lets a dial-back from that
        // member's address in. Wrongly behind costs an introduction;
        // wrongly public, members that cannot reach it.
        if public && tried == 0 {
            return Some(Learned {
                rendezvous: candidate,
                connection,
                public,
                seen,
                symmetric: false,
            });
        }
        views.push(seen);
        let relays = match &chosen {
            Some((_, true)) => false,
            _ => match open_relay(&connection, candidate.clone(), tunnel).await {
                Ok(()) => true,
                Err(error) => {
                    tracing::info!(%candidate, "no relay for this node's QUIC packets: {error:#}");
                    false
                }
            },
        };
        let better = match &chosen {
            None => true,
            Some((_, chosen_relays)) => relays && !chosen_relays,
        };
        if better {
            let learned = Learned {
                rendezvous: candidate,
                connection,
                public: false,
                seen,
                symmetric: false,
            };
            if let Some((old, _)) = chosen.replace((learned, relays)) {
                old.connection.close(0u32.into(), b"another relays");
            }
        } else {
            connection.close(0u32.into(), b"not needed");
        }
    }
    let (mut learned, _) = chosen?;
    // One public address with two ports: a mapping per destination. (Two
    // addresses say nothing: a member on the node's own network, or over
    // IPv6, sees another one.)
    learned.symmetric = views.iter().enumerate().any(|(i, a)| {
        views[i + 1..]
            .iter()
            .any(|b| a.ip() == b.ip() && a.port() != b.port())
    });
    Some(learned)
}

/// Learn this node's reachability from the members `candidates` names
/// (oldest first), keep it in `state`, and while behind a NAT keep the
/// rendezvous's connection and punch at its word. Runs until aborted.
pub async fn keep_reachable(
    endpoint: quinn::Endpoint,
    tls: TlsIdentity,
    state: Arc<Mutex<Reachability>>,
    tunnel: Arc<Tunnel>,
    candidates: impl Fn() -> Vec<PeerAddr>,
) {
    loop {
        let learned = find_rendezvous(&endpoint, &tls, &tunnel, candidates()).await;
        let Some(Learned {
            rendezvous,
            connection,
            public: reachable,
            seen,
            symmetric,
        }) = learned
        else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        // Found behind a NAT at this address before, it stays so: since,
        // it has sent to the members it asked and served with, and a NAT
        // that filters by address only lets any of them in.
        let was_behind = state.lock().is_ok_and(
            |state| matches!(&*state, Reachability::Behind { seen: before, .. } if *before == seen),
        );
        let reachable = reachable && !was_behind;
        let now = if reachable {
            Reachability::Public { seen }
        } else {
            Reachability::Behind {
                seen,
                via: rendezvous.clone(),
                symmetric,
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
        } else if tunnel.relays_through(&rendezvous.key) {
            punch_on_request(&endpoint, &tls, &connection, symmetric).await;
            tracing::info!("the rendezvous connection closed: asking again");
            tokio::time::sleep(Duration::from_secs(1)).await;
        } else {
            // No member relayed this node's packets: a member that does may
            // join later, so ask again after a while.
            let _ = tokio::time::timeout(
                RELAYLESS_RECHECK,
                punch_on_request(&endpoint, &tls, &connection, symmetric),
            )
            .await;
            connection.close(0u32.into(), b"asking again");
        }
    }
}

#[cfg(test)]
#[path = "reach_tests.rs"]
mod tests;
