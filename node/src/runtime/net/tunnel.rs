//! The data plane through a relay (docs/mesh.md "Reachability"): when no
//! hole can be punched (a symmetric NAT maps every destination to a new
//! port), a node's QUIC packets to a peer ride, as they are, on a stream
//! of its reach connection to a relay, which writes them on the peer's
//! stream. The QUIC connection inside stays end to end (TLS with both keys
//! pinned): the relay sees sizes and timing, never the bytes.
//!
//! The endpoint's socket sends a packet for a *virtual address* (240.109.x.y,
//! reserved address space, never routed) to this module instead of the
//! network; one virtual address names one (relay, peer). Frames on a relay
//! stream: `peer key (32) ‖ u16 LE length ‖ packet`; the key is the
//! destination on the way to the relay, the source on the way back.

use std::collections::{HashMap, HashSet};
use std::io::IoSliceMut;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use mesh_protocol::reach::{RELAY_FRAME_HEAD, relay_frame, relay_frame_head};
use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;

use crate::runtime::net::addr::PeerAddr;

/// The first two bytes of every virtual address.
const VIRTUAL_PREFIX: [u8; 2] = [240, 109];
/// Peers reached through relays at once (one virtual address each).
pub const MAX_RELAYED_PEERS: usize = 4096;
/// Peers reached through any one relay at once: a relay that writes frames
/// under made-up keys takes at most this share of the table.
pub const MAX_PEERS_PER_RELAY: usize = 1024;
/// With the table full and every address in use, the next look for an idle
/// one waits this long (a look scans the whole table).
const FULL_TABLE_LOOK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// A virtual address unused this long goes to another peer when the table
/// is full: far past any connection's idle timeout, so no connection
/// still sends to it.
pub const VIRTUAL_IDLE: std::time::Duration = std::time::Duration::from_secs(600);
/// Largest packet a relay stream carries. A larger one (a path MTU probe:
/// QUIC tries up to `tls::MAX_DISCOVERED_UDP_PAYLOAD`) is dropped before the
/// relay, so QUIC settles on this much over a relayed path.
pub use mesh_protocol::reach::MAX_RELAYED_PACKET;
/// Packets queued to or from relays; past these, packets are dropped, as a
/// full network queue drops them (QUIC resends).
pub const RELAY_QUEUE: usize = 1024;

/// Whether `addr` is a virtual address (a peer through a relay).
pub fn is_virtual(addr: &SocketAddr) -> bool {
    match unmapped(addr) {
        SocketAddr::V4(v4) => v4.ip().octets()[..2] == VIRTUAL_PREFIX,
        SocketAddr::V6(_) => false,
    }
}

/// `addr` with an IPv4-mapped IPv6 address (a dual-stack socket's view)
/// as the IPv4 address it maps.
fn unmapped(addr: &SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => *addr,
        },
        SocketAddr::V4(_) => *addr,
    }
}

/// A packet and the virtual address it goes to or came from.
pub type Packet = (SocketAddr, Vec<u8>);

/// The endpoint's socket: the real one, and packets for virtual addresses
/// handed to the tunnel (and theirs handed back).
#[derive(Debug)]
struct TunnelSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    out: mpsc::Sender<Packet>,
    inbound: Mutex<mpsc::Receiver<Packet>>,
    ipv6: bool,
}

impl AsyncUdpSocket for TunnelSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> std::io::Result<()> {
        if !is_virtual(&transmit.destination) {
            return self.inner.try_send(transmit);
        }
        let size = transmit
            .segment_size
            .unwrap_or(transmit.contents.len())
            .max(1);
        for packet in transmit.contents.chunks(size) {
            // A full queue drops the packet, as a full network queue would.
            let _ = self.out.try_send((transmit.destination, packet.to_vec()));
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<std::io::Result<usize>> {
        if let (Some(buf), Some(slot)) = (bufs.first_mut(), meta.first_mut())
            && let Ok(mut inbound) = self.inbound.lock()
            && let Poll::Ready(Some((from, packet))) = inbound.poll_recv(cx)
        {
            let len = packet.len().min(buf.len());
            buf[..len].copy_from_slice(&packet[..len]);
            let addr = match (self.ipv6, from) {
                (true, SocketAddr::V4(v4)) => {
                    SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
                }
                _ => from,
            };
            *slot = RecvMeta {
                addr,
                len,
                stride: len,
                ecn: None,
                dst_ip: None,
            };
            return Poll::Ready(Ok(1));
        }
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// How long a relay whose stream ended (or could not be opened) is taken
/// for gone: peers behind it are said unreachable at once meanwhile.
pub const RELAY_GONE_FOR: std::time::Duration = std::time::Duration::from_secs(10);

/// A peer is reached only through a relay that went away.
#[derive(Debug, thiserror::Error)]
#[error("the relay at {0} went away {1} ms ago: no path to the peer behind it")]
pub struct RelayGone(pub PeerAddr, pub u128);

/// Which (relay, peer) each virtual address names, both ways, and when a
/// packet last went to or came from it.
#[derive(Debug, Default)]
struct Virtuals {
    by_addr: HashMap<SocketAddr, (PeerAddr, [u8; 32], Instant)>,
    by_peer: HashMap<([u8; 32], [u8; 32]), SocketAddr>,
    /// Addresses held per relay.
    per_relay: HashMap<[u8; 32], usize>,
    /// When a look for an idle address last found none.
    found_none_at: Option<Instant>,
}

impl Virtuals {
    /// `peer`'s address through `relay`: the one it has, a new one, or,
    /// with the table full, the one unused longest once it is idle past
    /// `VIRTUAL_IDLE`; `None` when every address is in use, or `relay`
    /// holds `MAX_PEERS_PER_RELAY` already.
    fn address(&mut self, relay: &PeerAddr, peer: [u8; 32], now: Instant) -> Option<SocketAddr> {
        if let Some(addr) = self.by_peer.get(&(relay.key, peer)) {
            if let Some(named) = self.by_addr.get_mut(addr) {
                named.2 = now;
            }
            return Some(*addr);
        }
        if self.per_relay.get(&relay.key).copied().unwrap_or(0) >= MAX_PEERS_PER_RELAY {
            return None;
        }
        let addr = if self.by_addr.len() < MAX_RELAYED_PEERS {
            let [hi, lo] = u16::try_from(self.by_addr.len()).ok()?.to_be_bytes();
            let [a, b] = VIRTUAL_PREFIX;
            SocketAddr::new(IpAddr::V4(Ipv4Addr::new(a, b, hi, lo)), 443)
        } else {
            if self
                .found_none_at
                .is_some_and(|at| now.saturating_duration_since(at) < FULL_TABLE_LOOK_EVERY)
            {
                return None;
            }
            let idle = self
                .by_addr
                .iter()
                .filter(|(_, (_, _, used))| now.saturating_duration_since(*used) >= VIRTUAL_IDLE)
                .min_by_key(|(_, (_, _, used))| *used)
                .map(|(addr, (old_relay, old_peer, _))| (*addr, old_relay.key, *old_peer));
            let Some((addr, old_relay, old_peer)) = idle else {
                self.found_none_at = Some(now);
                return None;
            };
            self.by_peer.remove(&(old_relay, old_peer));
            // A relay's count goes with its last address, so the map holds
            // only relays that have one (not every relay ever used).
            if let Some(held) = self.per_relay.get_mut(&old_relay) {
                *held = held.saturating_sub(1);
                if *held == 0 {
                    self.per_relay.remove(&old_relay);
                }
            }
            addr
        };
        self.by_addr.insert(addr, (relay.clone(), peer, now));
        self.by_peer.insert((relay.key, peer), addr);
        *self.per_relay.entry(relay.key).or_default() += 1;
        Some(addr)
    }

    fn named(&mut self, addr: &SocketAddr, now: Instant) -> Option<(PeerAddr, [u8; 32])> {
        let (relay, peer, used) = self.by_addr.get_mut(addr)?;
        *used = now;
        Some((relay.clone(), *peer))
    }
}

/// A relay stream in use: its number, its frames to write, its connection.
#[derive(Debug)]
struct Attached {
    number: u64,
    frames: mpsc::Sender<Vec<u8>>,
    connection: quinn::Connection,
}

/// The node's side of relayed traffic: virtual addresses, and the streams
/// to relays that carry their packets.
#[derive(Debug)]
pub struct Tunnel {
    virtuals: Mutex<Virtuals>,
    /// Frames to write on each relay's stream, by relay key, with the
    /// stream's number and connection.
    relays: Mutex<HashMap<[u8; 32], Attached>>,
    /// Numbers the streams attached, so an ended one removes only itself.
    attached: std::sync::atomic::AtomicU64,
    /// One relay stream opened at a time.
    open_one: tokio::sync::Mutex<()>,
    /// Relays a stream is being opened to.
    opening: Mutex<HashSet<[u8; 32]>>,
    /// Relays whose stream ended or could not be opened, and when.
    gone: Mutex<HashMap<[u8; 32], Instant>>,
    /// Packets from relays, to the endpoint's socket.
    inbound: mpsc::Sender<Packet>,
}

/// The endpoint's socket on `listen`, wrapped so virtual addresses go
/// through relays; the tunnel, and the socket's outgoing relayed packets
/// (for `Tunnel::carry`).
pub fn endpoint(
    server: quinn::ServerConfig,
    listen: SocketAddr,
) -> std::io::Result<(quinn::Endpoint, Arc<Tunnel>, mpsc::Receiver<Packet>)> {
    let socket = std::net::UdpSocket::bind(listen)?;
    let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
    let inner = runtime.wrap_udp_socket(socket)?;
    let ipv6 = inner.local_addr()?.is_ipv6();
    let (out, outgoing) = mpsc::channel(RELAY_QUEUE);
    let (inbound, incoming) = mpsc::channel(RELAY_QUEUE);
    let socket = Arc::new(TunnelSocket {
        inner,
        out,
        inbound: Mutex::new(incoming),
        ipv6,
    });
    let endpoint = quinn::Endpoint::new_with_abstract_socket(
        quinn::EndpointConfig::default(),
        Some(server),
        socket,
        runtime,
    )?;
    let tunnel = Arc::new(Tunnel {
        virtuals: Mutex::default(),
        relays: Mutex::default(),
        opening: Mutex::default(),
        attached: std::sync::atomic::AtomicU64::new(0),
        open_one: tokio::sync::Mutex::new(()),
        gone: Mutex::default(),
        inbound,
    });
    Ok((endpoint, tunnel, outgoing))
}

impl Tunnel {
    /// The virtual address of `peer` through `relay` (`None`: the table
    /// is full and every address in it in use).
    pub fn address(&self, relay: &PeerAddr, peer: [u8; 32]) -> Option<SocketAddr> {
        self.virtuals
            .lock()
            .ok()?
            .address(relay, peer, Instant::now())
    }

    /// The (relay, peer) a virtual address names.
    pub fn named(&self, addr: &SocketAddr) -> Option<(PeerAddr, [u8; 32])> {
        self.virtuals
            .lock()
            .ok()?
            .named(&unmapped(addr), Instant::now())
    }

    /// The relay went away (its stream ended, or none could be opened):
    /// forget its stream (only stream `number`, when given, so an ended
    /// stream does not remove a newer one) and take it for gone a while.
    pub fn gone(&self, relay: &PeerAddr, number: Option<u64>) {
        if let Ok(mut relays) = self.relays.lock() {
            if number.is_some_and(|n| relays.get(&relay.key).is_some_and(|a| a.number != n)) {
                return;
            }
            relays.remove(&relay.key);
        }
        if let Ok(mut gone) = self.gone.lock() {
            gone.retain(|_, at| at.elapsed() < RELAY_GONE_FOR);
            if gone.len() < MAX_RELAYED_PEERS {
                gone.insert(relay.key, std::time::Instant::now());
            }
        }
    }

    /// `Err` while `relay` is taken for gone.
    pub fn check_relay(&self, relay: &PeerAddr) -> Result<(), RelayGone> {
        let since = self
            .gone
            .lock()
            .ok()
            .and_then(|gone| gone.get(&relay.key).map(|at| at.elapsed()));
        match since {
            Some(since) if since < RELAY_GONE_FOR => {
                Err(RelayGone(relay.clone(), since.as_millis()))
            }
            _ => Ok(()),
        }
    }

    /// Whether this node holds an open stream to `relay`.
    pub fn relays_through(&self, relay: &[u8; 32]) -> bool {
        self.relays
            .lock()
            .map(|r| r.get(relay).is_some_and(|a| !a.frames.is_closed()))
            .unwrap_or(false)
    }

    /// Hold while opening a stream to a relay (and look again whether one
    /// is open once held): one is opened at a time.
    pub async fn opening_one(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.open_one.lock().await
    }

    /// Carry packets over the stream to `relay` (already accepted by it,
    /// on `connection`) until either side closes it. A stream it replaces
    /// is closed with its connection.
    pub fn attach(
        self: &Arc<Self>,
        relay: PeerAddr,
        connection: quinn::Connection,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
    ) {
        let (frames, mut to_write) = mpsc::channel::<Vec<u8>>(RELAY_QUEUE);
        let number = self
            .attached
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let replaced = self.relays.lock().ok().and_then(|mut relays| {
            relays.insert(
                relay.key,
                Attached {
                    number,
                    frames,
                    connection,
                },
            )
        });
        if let Some(old) = replaced {
            old.connection.close(0u32.into(), b"replaced");
        }
        if let Ok(mut gone) = self.gone.lock() {
            gone.remove(&relay.key);
        }
        tokio::spawn(async move {
            while let Some(frame) = to_write.recv().await {
                if send.write_all(&frame).await.is_err() {
                    break;
                }
            }
        });
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Ok((peer, packet)) = read_frame(&mut recv).await {
                let Some(tunnel) = this.upgrade() else {
                    return;
                };
                if let Some(from) = tunnel.address(&relay, peer) {
                    let _ = tunnel.inbound.try_send((from, packet));
                }
            }
            // The stream ended: its connection closed (the relay went away,
            // or its 2 s idle timeout passed).
            if let Some(tunnel) = this.upgrade() {
                tunnel.gone(&relay, Some(number));
            }
        });
    }

    /// Send each relayed packet the socket gives on its relay's stream;
    /// `open` is asked (once at a time per relay) for a stream to a relay
    /// this node has none to, and the packets meanwhile are dropped (QUIC
    /// resends them).
    pub async fn carry<F, Fut>(self: Arc<Self>, mut outgoing: mpsc::Receiver<Packet>, open: F)
    where
        F: Fn(PeerAddr) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        while let Some((to, packet)) = outgoing.recv().await {
            let Some((relay, peer)) = self.named(&to) else {
                continue;
            };
            let sender = self
                .relays
                .lock()
                .ok()
                .and_then(|r| r.get(&relay.key).map(|a| a.frames.clone()))
                .filter(|sender| !sender.is_closed());
            match sender {
                Some(sender) => {
                    // A packet over the relay's limit is dropped, as a
                    // network drops one over its MTU.
                    if let Ok(frame) = relay_frame(&peer, &packet) {
                        let _ = sender.try_send(frame);
                    }
                }
                None => {
                    let first = self
                        .opening
                        .lock()
                        .map(|mut opening| opening.insert(relay.key))
                        .unwrap_or(false);
                    if first {
                        let (this, key) = (self.clone(), relay.key);
                        let opened = open(relay);
                        tokio::spawn(async move {
                            opened.await;
                            if let Ok(mut opening) = this.opening.lock() {
                                opening.remove(&key);
                            }
                        });
                    }
                }
            }
        }
    }
}

/// Read one relay-stream frame (`mesh_protocol::reach::relay_frame`); an
/// error when the stream ends or its length is over `MAX_RELAYED_PACKET`
/// (before the packet is read).
pub async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    recv: &mut R,
) -> std::io::Result<([u8; 32], Vec<u8>)> {
    let mut head = [0u8; RELAY_FRAME_HEAD];
    recv.read_exact(&mut head).await?;
    let (key, len) = relay_frame_head(&head)
        .map_err(|error| std::io::Error::new(std::io::ErrorKind::InvalidData, error))?;
    let mut packet = vec![0u8; len];
    recv.read_exact(&mut packet).await?;
    Ok((key, packet))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn relay(seed: u8) -> PeerAddr {
        PeerAddr {
            key: [seed; 32],
            addr: "10.77.0.11:7000".parse().unwrap(),
        }
    }

    #[test]
    fn virtual_addresses_are_reserved_space_one_per_relay_and_peer_and_reused_once_idle() {
        let mut virtuals = Virtuals::default();
        let now = Instant::now();
        let a = virtuals.address(&relay(1), [7; 32], now).unwrap();
        assert!(is_virtual(&a));
        assert_eq!(virtuals.address(&relay(1), [7; 32], now), Some(a));
        let b = virtuals.address(&relay(2), [7; 32], now).unwrap();
        assert_ne!(a, b);
        assert_eq!(virtuals.named(&b, now), Some((relay(2), [7; 32])));
        assert!(!is_virtual(&"10.77.0.11:7000".parse().unwrap()));
        assert!(!is_virtual(&"[::1]:7000".parse().unwrap()));
        assert!(is_virtual(&"[::ffff:240.109.0.1]:443".parse().unwrap()));
        // One relay holds at most its share.
        for peer in 1..MAX_PEERS_PER_RELAY {
            let mut key = [0u8; 32];
            key[..8].copy_from_slice(&(peer as u64).to_le_bytes());
            assert!(virtuals.address(&relay(1), key, now).is_some());
        }
        assert_eq!(virtuals.address(&relay(1), [0xee; 32], now), None);
        for peer in 0..MAX_RELAYED_PEERS - MAX_PEERS_PER_RELAY - 1 {
            let mut key = [0u8; 32];
            key[..8].copy_from_slice(&(peer as u64).to_le_bytes());
            let by = relay(10 + (peer / MAX_PEERS_PER_RELAY) as u8);
            assert!(virtuals.address(&by, key, now).is_some());
        }
        // Full, and every address in use: none for a new peer, and no new
        // look at the table for a second.
        assert_eq!(virtuals.address(&relay(3), [9; 32], now), None);
        assert_eq!(virtuals.found_none_at, Some(now));
        // Once idle long enough, the one unused longest goes to the new
        // peer; the others stay, and the one used since stays.
        let later = now + VIRTUAL_IDLE;
        assert_eq!(
            virtuals.named(&a, now + VIRTUAL_IDLE / 2),
            Some((relay(1), [7; 32]))
        );
        let c = virtuals.address(&relay(3), [9; 32], later).unwrap();
        assert_ne!(c, a);
        assert_eq!(virtuals.named(&c, later), Some((relay(3), [9; 32])));
        assert_eq!(virtuals.address(&relay(1), [7; 32], later), Some(a));
        assert_eq!(virtuals.by_addr.len(), MAX_RELAYED_PEERS);
        assert_eq!(virtuals.by_peer.len(), MAX_RELAYED_PEERS);
    }

    #[test]
    fn a_relay_whose_last_address_is_reused_is_no_longer_counted() {
        let mut virtuals = Virtuals::default();
        let now = Instant::now();
        let first = virtuals.address(&relay(1), [7; 32], now).unwrap();
        let then = now + std::time::Duration::from_secs(1);
        for peer in 0..MAX_RELAYED_PEERS - 1 {
            let mut key = [0u8; 32];
            key[..8].copy_from_slice(&(peer as u64).to_le_bytes());
            let by = relay(10 + (peer / MAX_PEERS_PER_RELAY) as u8);
            assert!(virtuals.address(&by, key, then).is_some());
        }
        assert_eq!(virtuals.per_relay.get(&[1; 32]), Some(&1));
        let reused = virtuals
            .address(&relay(3), [9; 32], then + VIRTUAL_IDLE)
            .unwrap();
        assert_eq!(reused, first);
        assert_eq!(virtuals.per_relay.get(&[1; 32]), None);
        assert_eq!(virtuals.per_relay.get(&[3; 32]), Some(&1));
    }

    #[tokio::test]
    async fn a_frame_reads_back_and_an_oversized_one_is_refused() {
        let frame = relay_frame(&[3; 32], b"a quic packet").unwrap();
        let (key, packet) = read_frame(&mut frame.as_slice()).await.unwrap();
        assert_eq!((key, packet.as_slice()), ([3; 32], &b"a quic packet"[..]));
        let mut oversized = vec![0u8; 32];
        oversized.extend_from_slice(&((MAX_RELAYED_PACKET + 1) as u16).to_le_bytes());
        oversized.resize(32 + 2 + MAX_RELAYED_PACKET + 1, 0);
        assert!(read_frame(&mut oversized.as_slice()).await.is_err());
        assert!(read_frame(&mut &frame[..20]).await.is_err());
    }

    proptest! {
        #[test]
        fn frames_round_trip_and_garbage_never_panics(
            key in any::<[u8; 32]>(),
            packet in proptest::collection::vec(any::<u8>(), 0..MAX_RELAYED_PACKET),
            garbage in proptest::collection::vec(any::<u8>(), 0..2000),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let framed = relay_frame(&key, &packet).unwrap();
            let read = runtime.block_on(read_frame(&mut framed.as_slice())).unwrap();
            prop_assert_eq!(read, (key, packet));
            let _ = runtime.block_on(read_frame(&mut garbage.as_slice()));
        }
    }
}
