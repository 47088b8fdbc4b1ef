//! A userspace UDP delay proxy: what `tc netem` would do, for a machine
//! whose kernel has none. It sits in front of one node on 127.0.0.1; every
//! datagram through it, either way, is held for a one-way delay (plus
//! uniform jitter) and may be dropped with a given probability. QUIC runs
//! over it unchanged, so a bench sees what a wide-area link costs.
//!
//! Datagrams leave in the order they came (a later one never overtakes an
//! earlier one: jitter stretches the queue instead of reordering it), and
//! the proxy counts how late it sent each one against its due time, so a
//! report can say how close the delay it added was to the delay asked for.
//! It uses blocking sockets on its own threads: tokio's timer rounds every
//! sleep up to the next millisecond, which is the size of the effect being
//! measured.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The largest datagram read.
const MAX_DATAGRAM: usize = 65_535;
/// The largest UDP payload the link carries: a 1,500-byte IPv4 packet, the
/// MTU of the Ethernet and home links a wide-area path crosses. A larger
/// datagram is dropped, as a router drops a packet that may not be
/// fragmented, so QUIC's path MTU discovery finds the MTU a real path has
/// (loopback's is 64 KiB).
pub const LINK_MAX_DATAGRAM: usize = 1_472;
/// Datagrams waiting in one direction; more are dropped, like a full
/// router queue.
const MAX_QUEUED: usize = 16_384;
/// Distinct clients one proxy serves.
const MAX_CLIENTS: usize = 64;
/// How long before a datagram's due time its sender stops sleeping and
/// watches the clock instead.
const SPIN_AHEAD: Duration = Duration::from_micros(200);

/// How often the blocking threads look at the stop flag.
const POLL: Duration = Duration::from_millis(20);

/// What the link does to each datagram.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkShape {
    /// Held this long, each way.
    pub one_way: Duration,
    /// Plus a uniform extra delay in `0..=jitter`.
    pub jitter: Duration,
    /// Dropped with this probability (0.0..=1.0).
    pub loss: f64,
}

/// What a proxy did, for the report.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProxyCounts {
    pub relayed: u64,
    pub dropped: u64,
    /// Mean time a datagram left after its due time.
    pub mean_late_us: f64,
    pub max_late_us: u64,
    /// Datagrams over the link's MTU (`LINK_MAX_DATAGRAM`), dropped: path
    /// MTU discovery's probes.
    pub over_mtu: u64,
    /// Mean time from a datagram's arrival at the proxy's socket to its
    /// queueing for delivery (its thread's wake-up and read, mostly; its
    /// delay runs from its arrival, so this is not lateness). About 0
    /// where the kernel gives no arrival stamps.
    pub mean_read_wait_us: f64,
    /// Every one of its threads runs at raised priority (see `as_a_link`).
    pub priority_raised: bool,
}

#[derive(Default)]
struct Counters {
    relayed: AtomicU64,
    dropped: AtomicU64,
    over_mtu: AtomicU64,
    late_us_total: AtomicU64,
    late_us_max: AtomicU64,
    received: AtomicU64,
    read_wait_us_total: AtomicU64,
    /// Threads that could not raise their priority.
    unraised: AtomicU64,
}

/// Where a delayed datagram goes.
enum Destination {
    /// To the node behind the proxy, from this client's own socket.
    Upstream(Arc<UdpSocket>),
    /// Back to a client, from the proxy's front socket.
    Client(SocketAddr),
}

struct Held {
    due: Instant,
    bytes: Vec<u8>,
    to: Destination,
}

/// The queue of one direction: scheduling and its random draws.
struct DelayLine {
    queue: SyncSender<Held>,
    shape: LinkShape,
    /// splitmix64 state, so a run with the same seed drops the same
    /// datagrams.
    random: u64,
    last_due: Option<Instant>,
    counters: Arc<Counters>,
}

impl DelayLine {
    fn next_unit(&mut self) -> f64 {
        self.random = self.random.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.random;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Queue a datagram that reached the proxy's socket at `arrived`.
    fn hold(&mut self, bytes: Vec<u8>, to: Destination, arrived: Instant) {
        self.counters.received.fetch_add(1, Ordering::Relaxed);
        self.counters
            .read_wait_us_total
            .fetch_add(arrived.elapsed().as_micros() as u64, Ordering::Relaxed);
        if bytes.len() > LINK_MAX_DATAGRAM {
            self.counters.over_mtu.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self.shape.loss > 0.0 && self.next_unit() < self.shape.loss {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let extra = self.shape.jitter.mul_f64(self.next_unit());
        let mut due = arrived + self.shape.one_way + extra;
        if let Some(last) = self.last_due {
            due = due.max(last);
        }
        self.last_due = Some(due);
        match self.queue.try_send(Held { due, bytes, to }) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// One proxy in front of one node.
pub struct DelayProxy {
    addr: SocketAddr,
    target: Arc<OnceLock<SocketAddr>>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for DelayProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DelayProxy")
            .field("addr", &self.addr)
            .field("target", &self.target.get())
            .finish_non_exhaustive()
    }
}

impl DelayProxy {
    /// Listen on 127.0.0.1 with `shape`; datagrams are dropped until
    /// [`DelayProxy::forward_to`] names the node behind it (so a node can
    /// be told the proxy's address before it is bound itself).
    pub fn bind(shape: LinkShape, seed: u64) -> std::io::Result<Self> {
        let front = Arc::new(UdpSocket::bind(("127.0.0.1", 0))?);
        front.set_read_timeout(Some(POLL))?;
        stamp_arrivals(&front);
        let addr = front.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let target = Arc::new(OnceLock::new());

        let (toward_node, toward_node_rx) = std::sync::mpsc::sync_channel(MAX_QUEUED);
        let (toward_client, toward_client_rx) = std::sync::mpsc::sync_channel(MAX_QUEUED);
        let mut threads = vec![
            spawn_sender(
                toward_node_rx,
                front.clone(),
                counters.clone(),
                stop.clone(),
            ),
            spawn_sender(
                toward_client_rx,
                front.clone(),
                counters.clone(),
                stop.clone(),
            ),
        ];
        let toward_client = Arc::new(Mutex::new(DelayLine {
            queue: toward_client,
            shape,
            random: seed ^ 0x5EED_0000_0000_0001,
            last_due: None,
            counters: counters.clone(),
        }));
        let mut toward_node = DelayLine {
            queue: toward_node,
            shape,
            random: seed,
            last_due: None,
            counters: counters.clone(),
        };
        let front_thread = {
            let stop = stop.clone();
            let target = target.clone();
            std::thread::Builder::new()
                .name("delay-proxy-front".into())
                .spawn(move || {
                    as_a_link(&toward_node.counters);
                    let mut upstreams: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
                    let mut readers = Vec::new();
                    let mut buffer = vec![0u8; MAX_DATAGRAM];
                    while !stop.load(Ordering::Relaxed) {
                        let Ok((n, client, arrived)) = recv_stamped(&front, &mut buffer) else {
                            continue;
                        };
                        let Some(node) = target.get().copied() else {
                            toward_node.counters.dropped.fetch_add(1, Ordering::Relaxed);
                            continue;
                        };
                        let upstream = match upstreams.get(&client) {
                            Some(socket) => socket.clone(),
                            None if upstreams.len() < MAX_CLIENTS => {
                                let Ok(socket) = open_upstream(node) else {
                                    toward_node.counters.dropped.fetch_add(1, Ordering::Relaxed);
                                    continue;
                                };
                                readers.push(spawn_reader(
                                    socket.clone(),
                                    client,
                                    toward_client.clone(),
                                    stop.clone(),
                                    toward_node.counters.clone(),
                                ));
                                upstreams.insert(client, socket.clone());
                                socket
                            }
                            None => {
                                toward_node.counters.dropped.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                        };
                        toward_node.hold(
                            buffer[..n].to_vec(),
                            Destination::Upstream(upstream),
                            arrived,
                        );
                    }
                    for reader in readers {
                        let _ = reader.join();
                    }
                })?
        };
        threads.push(front_thread);
        Ok(Self {
            addr,
            target,
            stop,
            counters,
            threads,
        })
    }

    /// Where clients send to reach the node behind it.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Name the node behind the proxy (once; later calls change nothing).
    pub fn forward_to(&self, node: SocketAddr) {
        let _ = self.target.set(node);
    }

    pub fn counts(&self) -> ProxyCounts {
        let relayed = self.counters.relayed.load(Ordering::Relaxed);
        ProxyCounts {
            relayed,
            dropped: self.counters.dropped.load(Ordering::Relaxed),
            mean_late_us: self.counters.late_us_total.load(Ordering::Relaxed) as f64
                / relayed.max(1) as f64,
            max_late_us: self.counters.late_us_max.load(Ordering::Relaxed),
            over_mtu: self.counters.over_mtu.load(Ordering::Relaxed),
            mean_read_wait_us: self.counters.read_wait_us_total.load(Ordering::Relaxed) as f64
                / self.counters.received.load(Ordering::Relaxed).max(1) as f64,
            priority_raised: self.counters.unraised.load(Ordering::Relaxed) == 0,
        }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // The front thread owns one end of each queue; once it and the
        // readers are gone the senders see their channels close.
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A link delivers a datagram whatever the machines at its ends are doing,
/// but the proxy's threads share this machine's cores with the nodes: on
/// two cores a datagram left up to 9 ms late (mean 60-300 µs), lateness
/// the bench would charge to the mesh. The proxy's threads ask for the
/// highest priority, which only helps where they waited for a core (not
/// where the whole VM was descheduled); where it is refused (no
/// CAP_SYS_NICE) the proxy says so in its counts, and the lateness is
/// measured and reported either way.
fn as_a_link(counters: &Counters) {
    #[cfg(target_os = "linux")]
    {
        // On Linux a priority set with PRIO_PROCESS and no pid is the
        // calling thread's alone.
        if rustix::process::setpriority_process(None, -20).is_err() {
            counters.unraised.fetch_add(1, Ordering::Relaxed);
        }
    }
    #[cfg(not(target_os = "linux"))]
    counters.unraised.fetch_add(1, Ordering::Relaxed);
}

/// Have the kernel stamp each datagram `socket` receives with the time it
/// arrived: a link's delay runs from then, not from whenever the proxy's
/// thread woke to read it (100 µs and more later on a busy 2-core VM,
/// which the bench would charge to the mesh unseen). Best effort: where
/// the kernel refuses, or a datagram comes unstamped, its delay runs from
/// its read.
fn stamp_arrivals(socket: &UdpSocket) {
    #[cfg(target_os = "linux")]
    let _ =
        nix::sys::socket::setsockopt(socket, nix::sys::socket::sockopt::ReceiveTimestampns, &true);
    #[cfg(not(target_os = "linux"))]
    let _ = socket;
}

/// Receive one datagram: its length, sender, and when it reached the
/// socket (the kernel's stamp; where there is none, now).
#[cfg(target_os = "linux")]
fn recv_stamped(
    socket: &UdpSocket,
    buffer: &mut [u8],
) -> std::io::Result<(usize, SocketAddr, Instant)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrStorage};
    use std::os::fd::AsRawFd;
    let mut space = nix::cmsg_space!(nix::sys::time::TimeSpec);
    let mut slices = [std::io::IoSliceMut::new(buffer)];
    let message = nix::sys::socket::recvmsg::<SockaddrStorage>(
        socket.as_raw_fd(),
        &mut slices,
        Some(&mut space),
        MsgFlags::empty(),
    )
    .map_err(std::io::Error::from)?;
    let now = Instant::now();
    let read_at = std::time::SystemTime::now();
    let mut arrived = now;
    if let Ok(messages) = message.cmsgs() {
        for control in messages {
            if let ControlMessageOwned::ScmTimestampns(stamp) = control {
                let stamped = std::time::UNIX_EPOCH
                    + Duration::new(stamp.tv_sec().max(0) as u64, stamp.tv_nsec().max(0) as u32);
                // How long it waited in the socket, on the clock the kernel
                // stamps with: never a time after now, and at most one
                // poll of the reader, so a stepped clock cannot put it far
                // back.
                if let Ok(waited) = read_at.duration_since(stamped) {
                    arrived = now.checked_sub(waited.min(POLL)).unwrap_or(now);
                }
            }
        }
    }
    let sender = message
        .address
        .and_then(|address| {
            address
                .as_sockaddr_in()
                .map(|v4| SocketAddr::from((v4.ip(), v4.port())))
                .or_else(|| {
                    address
                        .as_sockaddr_in6()
                        .map(|v6| SocketAddr::from((v6.ip(), v6.port())))
                })
        })
        .or_else(|| socket.peer_addr().ok())
        .ok_or_else(|| std::io::Error::other("a datagram without a sender"))?;
    Ok((message.bytes, sender, arrived))
}

#[cfg(not(target_os = "linux"))]
fn recv_stamped(
    socket: &UdpSocket,
    buffer: &mut [u8],
) -> std::io::Result<(usize, SocketAddr, Instant)> {
    let (n, sender) = socket.recv_from(buffer)?;
    Ok((n, sender, Instant::now()))
}

fn open_upstream(node: SocketAddr) -> std::io::Result<Arc<UdpSocket>> {
    let socket = UdpSocket::bind(("127.0.0.1", 0))?;
    socket.connect(node)?;
    socket.set_read_timeout(Some(POLL))?;
    stamp_arrivals(&socket);
    Ok(Arc::new(socket))
}

/// Datagrams the node sends back to one client.
fn spawn_reader(
    upstream: Arc<UdpSocket>,
    client: SocketAddr,
    line: Arc<Mutex<DelayLine>>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        as_a_link(&counters);
        let mut buffer = vec![0u8; MAX_DATAGRAM];
        while !stop.load(Ordering::Relaxed) {
            if let Ok((n, _, arrived)) = recv_stamped(&upstream, &mut buffer)
                && let Ok(mut line) = line.lock()
            {
                line.hold(buffer[..n].to_vec(), Destination::Client(client), arrived);
            }
        }
    })
}

/// Send each held datagram at its due time.
fn spawn_sender(
    queue: Receiver<Held>,
    front: Arc<UdpSocket>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        // The kernel may stretch a sleep by the thread's timer slack (50 µs
        // by default): ask for none, so the delay added is the one asked for.
        #[cfg(target_os = "linux")]
        let _ = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1));
        as_a_link(&counters);
        while let Ok(held) = queue.recv() {
            // Once stopped, what is still queued is dropped, not waited for.
            if stop.load(Ordering::Relaxed) {
                continue;
            }
            // Asleep until shortly before the due time, then watching the
            // clock: a sleeping thread on this VM wakes 100 µs or more
            // after its timer, lateness a link would not add.
            let now = Instant::now();
            if held.due > now + SPIN_AHEAD {
                std::thread::sleep(held.due - now - SPIN_AHEAD);
            }
            while Instant::now() < held.due {
                std::hint::spin_loop();
            }
            let late = Instant::now().saturating_duration_since(held.due);
            let sent = match &held.to {
                Destination::Upstream(socket) => socket.send(&held.bytes),
                Destination::Client(client) => front.send_to(&held.bytes, client),
            };
            if sent.is_ok() {
                let late_us = late.as_micros() as u64;
                counters.relayed.fetch_add(1, Ordering::Relaxed);
                counters.late_us_total.fetch_add(late_us, Ordering::Relaxed);
                counters.late_us_max.fetch_max(late_us, Ordering::Relaxed);
            } else {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo() -> (UdpSocket, SocketAddr) {
        let socket = UdpSocket::bind(("127.0.0.1", 0)).unwrap();
        let addr = socket.local_addr().unwrap();
        let server = socket.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut buffer = [0u8; 2048];
            while let Ok((n, from)) = server.recv_from(&mut buffer) {
                let _ = server.send_to(&buffer[..n], from);
            }
        });
        (socket, addr)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_datagram_is_stamped_when_it_reached_the_socket_not_when_it_was_read() {
        let socket = UdpSocket::bind(("127.0.0.1", 0)).unwrap();
        stamp_arrivals(&socket);
        let sender = UdpSocket::bind(("127.0.0.1", 0)).unwrap();
        let mut buffer = [0u8; 16];
        // The host's first stamping socket turns stamping on a moment
        // later (the kernel defers it): a datagram before that is
        // stamped at its read. Later ones are stamped on arrival.
        let stamped_on_arrival = (0..20).any(|_| {
            sender
                .send_to(b"hop", socket.local_addr().unwrap())
                .unwrap();
            // Read well after it arrived (loopback delivers within the send).
            std::thread::sleep(POLL * 3);
            let (n, from, arrived) = recv_stamped(&socket, &mut buffer).unwrap();
            assert_eq!(&buffer[..n], b"hop");
            assert_eq!(from, sender.local_addr().unwrap());
            // Its wait counts, up to one poll of the reader.
            arrived.elapsed() >= POLL
        });
        assert!(stamped_on_arrival, "no datagram carried its arrival stamp");
    }

    #[test]
    fn a_round_trip_through_the_proxy_takes_at_least_two_delays_and_keeps_order() {
        let (_server, addr) = echo();
        let proxy = DelayProxy::bind(
            LinkShape {
                one_way: Duration::from_millis(15),
                jitter: Duration::from_millis(5),
                loss: 0.0,
            },
            7,
        )
        .unwrap();
        proxy.forward_to(addr);
        let client = UdpSocket::bind(("127.0.0.1", 0)).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let start = Instant::now();
        for i in 0u8..20 {
            client.send_to(&[i; 100], proxy.addr()).unwrap();
        }
        let mut buffer = [0u8; 2048];
        for i in 0u8..20 {
            let n = client.recv(&mut buffer).unwrap();
            assert_eq!(&buffer[..n], &[i; 100], "datagram {i} out of order");
        }
        assert!(start.elapsed() >= Duration::from_millis(30));
        // The sender counts a datagram after handing it to the socket, so
        // the last count can land just after the client has read it.
        let counted = Instant::now() + Duration::from_secs(5);
        while proxy.counts().relayed < 40 && Instant::now() < counted {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(proxy.counts().relayed, 40);
        assert_eq!(proxy.counts().dropped, 0);
    }

    #[test]
    fn a_datagram_over_the_links_mtu_is_dropped_and_one_at_it_passes() {
        let (_server, addr) = echo();
        let proxy = DelayProxy::bind(
            LinkShape {
                one_way: Duration::ZERO,
                jitter: Duration::ZERO,
                loss: 0.0,
            },
            1,
        )
        .unwrap();
        proxy.forward_to(addr);
        let client = UdpSocket::bind(("127.0.0.1", 0)).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        client
            .send_to(&[1; LINK_MAX_DATAGRAM + 1], proxy.addr())
            .unwrap();
        client
            .send_to(&[2; LINK_MAX_DATAGRAM], proxy.addr())
            .unwrap();
        let mut buffer = [0u8; 2048];
        let n = client.recv(&mut buffer).unwrap();
        assert_eq!(&buffer[..n], &[2; LINK_MAX_DATAGRAM][..]);
        assert_eq!(proxy.counts().over_mtu, 1);
        assert_eq!(proxy.counts().dropped, 0);
    }

    #[test]
    fn a_lossy_link_drops_about_the_share_asked_for_and_the_same_ones_per_seed() {
        let (_server, addr) = echo();
        let run = |seed| {
            let proxy = DelayProxy::bind(
                LinkShape {
                    one_way: Duration::ZERO,
                    jitter: Duration::ZERO,
                    loss: 0.25,
                },
                seed,
            )
            .unwrap();
            proxy.forward_to(addr);
            let client = UdpSocket::bind(("127.0.0.1", 0)).unwrap();
            client
                .set_read_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            let mut received = Vec::new();
            for i in 0u16..100 {
                client.send_to(&i.to_le_bytes(), proxy.addr()).unwrap();
                let mut buffer = [0u8; 16];
                if let Ok(2) = client.recv(&mut buffer) {
                    received.push(u16::from_le_bytes([buffer[0], buffer[1]]));
                }
            }
            received
        };
        let first = run(11);
        // Two independent 25 % draws per round trip: about 56 % get back.
        assert!((35..=75).contains(&first.len()), "{}", first.len());
        assert_eq!(first, run(11));
    }
}
