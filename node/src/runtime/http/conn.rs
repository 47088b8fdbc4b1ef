//! The API's TCP connections: a bounded number of slots, shared fairly
//! between source addresses, and taken back from connections that hold one
//! without asking anything.
//!
//! A connection is *idle* while no request of it is being answered: before
//! its first request, between keep-alive requests, and while a request's
//! head trickles in. A new connection never waits for a slot. When every
//! slot its source may hold is taken, that source's longest-open idle
//! connection is closed for it (none idle: the newcomer is refused). When
//! every slot of the API is taken, slots are shared max-min: the longest-open
//! idle connection of the source holding the most is closed; when none is
//! idle and that source holds at least two more slots than the newcomer's,
//! its youngest busy connection is closed (the request on it ends); else
//! the newcomer is refused. So connections that send nothing cannot lock
//! the API however fast they reconnect, and neither can a few sources'
//! slow requests: a source holding few slots always gets one. A connection
//! closed for a newcomer is dropped at once, not shut down gracefully
//! (which would let a request it started run on, uncounted).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response};
use hyper::body::Incoming;

use super::guard::{Access, Checked};
use crate::runtime::clock::lock;
pub use crate::runtime::limit::Source;

/// Most HTTP connections open at once.
pub const MAX_HTTP_CONNECTIONS: usize = 256;
/// Most of them one source address holds (an IPv6 source is its /64).
pub const MAX_CONNECTIONS_PER_SOURCE: usize = 64;
/// How long a new connection may take to send its first byte.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a client may take to send a request's headers, from their
/// first byte (and how long a keep-alive connection waits for the next).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes of a connection's read buffer: hyper refuses a request head
/// that does not fit (431), though its read-ahead can take a head of up to
/// twice this into the buffer first.
pub const MAX_HTTP_BUFFER: usize = 64 * 1024;
/// Most bytes of a request's head (request line and headers): a longer one
/// is refused (431) before any handler runs.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// One open connection, as the table sees it.
struct Conn {
    source: Source,
    opened: Instant,
    /// Requests of it being answered (their responses not yet sent whole).
    busy: Arc<AtomicUsize>,
    /// Tells the connection's task to close it.
    close: Arc<tokio::sync::Notify>,
}

#[derive(Default)]
struct Table {
    next: u64,
    conns: HashMap<u64, Conn>,
    per_source: HashMap<Source, usize>,
}

/// Why a new connection was not let in.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// Every slot it could take holds a request being answered.
    AllBusy,
}

/// What a connection holds while it is open; gives its slot back when
/// dropped.
pub struct Slot {
    id: u64,
    table: Arc<Mutex<Table>>,
    busy: Arc<AtomicUsize>,
    close: Arc<tokio::sync::Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut table = lock(&self.table);
        table.remove(self.id);
    }
}

impl Table {
    fn remove(&mut self, id: u64) -> Option<Conn> {
        let conn = self.conns.remove(&id)?;
        if let Some(count) = self.per_source.get_mut(&conn.source) {
            *count -= 1;
            if *count == 0 {
                self.per_source.remove(&conn.source);
            }
        }
        Some(conn)
    }

    /// The connection to close for a newcomer from `source` (see the
    /// module's rules).
    fn victim(&self, source: Source, at_share: bool) -> Option<u64> {
        let held = |source: &Source| self.per_source.get(source).copied().unwrap_or(0);
        let idle = |conn: &Conn| conn.busy.load(Ordering::Acquire) == 0;
        if at_share {
            return self
                .conns
                .iter()
                .filter(|(_, conn)| conn.source == source && idle(conn))
                .min_by_key(|(_, conn)| conn.opened)
                .map(|(id, _)| *id);
        }
        let oldest_idle_of_the_heaviest = self
            .conns
            .iter()
            .filter(|(_, conn)| idle(conn))
            .max_by(|(_, a), (_, b)| {
                held(&a.source)
                    .cmp(&held(&b.source))
                    .then(b.opened.cmp(&a.opened))
            })
            .map(|(id, _)| *id);
        oldest_idle_of_the_heaviest.or_else(|| {
            let (heaviest, count) = self
                .per_source
                .iter()
                .max_by_key(|(_, count)| **count)
                .map(|(source, count)| (*source, *count))?;
            if count < held(&source) + 2 {
                return None;
            }
            self.conns
                .iter()
                .filter(|(_, conn)| conn.source == heaviest)
                .max_by_key(|(_, conn)| conn.opened)
                .map(|(id, _)| *id)
        })
    }
}

/// The slots of one API.
#[derive(Clone)]
pub struct Slots {
    table: Arc<Mutex<Table>>,
    max: usize,
    per_source: usize,
}

impl Slots {
    pub fn new(max: usize, per_source: usize) -> Self {
        Self {
            table: Arc::default(),
            max: max.max(1),
            per_source: per_source.clamp(1, max.max(1)),
        }
    }

    /// A slot for a new connection from `source`, closing an idle one when
    /// there is no free slot for it.
    pub fn admit(&self, source: Source) -> Result<Slot, Refused> {
        let mut table = lock(&self.table);
        let held = table.per_source.get(&source).copied().unwrap_or(0);
        let at_share = held >= self.per_source;
        if at_share || table.conns.len() >= self.max {
            let victim = table.victim(source, at_share).ok_or(Refused::AllBusy)?;
            if let Some(conn) = table.remove(victim) {
                conn.close.notify_one();
            }
        }
        let id = table.next;
        table.next += 1;
        let busy = Arc::new(AtomicUsize::new(0));
        let close = Arc::new(tokio::sync::Notify::new());
        table.conns.insert(
            id,
            Conn {
                source,
                opened: Instant::now(),
                busy: busy.clone(),
                close: close.clone(),
            },
        );
        *table.per_source.entry(source).or_default() += 1;
        Ok(Slot {
            id,
            table: self.table.clone(),
            busy,
            close,
        })
    }

    /// Connections open now.
    #[cfg(test)]
    fn open(&self) -> usize {
        lock(&self.table).conns.len()
    }
}

/// Counts a request as being answered until its response is sent whole
/// (or dropped): its connection is not idle meanwhile.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn enter(busy: &Arc<AtomicUsize>) -> Self {
        busy.fetch_add(1, Ordering::AcqRel);
        Self(busy.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The service one connection runs: the router, behind the access checks
/// (`guard.rs`), each request marked busy until its response is sent and
/// tagged with its source.
#[derive(Clone)]
struct Tracked {
    router: Router,
    access: Arc<Access>,
    source: Source,
    busy: Arc<AtomicUsize>,
}

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn call(&self, mut request: Request<Incoming>) -> Self::Future {
        let busy = Busy::enter(&self.busy);
        request.extensions_mut().insert(self.source);
        let head_bytes = request.uri().to_string().len()
            + request
                .headers()
                .iter()
                .map(|(name, value)| name.as_str().len() + value.len() + 4)
                .sum::<usize>();
        let checked = if head_bytes > MAX_HEAD_BYTES {
            Checked::Refused(super::guard::refusal(
                axum::http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!("the request's head is over {MAX_HEAD_BYTES} bytes"),
            ))
        } else {
            self.access.check(&request)
        };
        let router = hyper_util::service::TowerToHyperService::new(self.router.clone());
        Box::pin(async move {
            let response = match checked {
                Checked::Refused(response) | Checked::Preflight(response) => response,
                Checked::Allowed(cors) => {
                    let mut response = router
                        .call(request)
                        .await
                        .unwrap_or_else(|never| match never {});
                    cors.apply(&mut response);
                    response
                }
            };
            // The body holds the request busy until it is sent whole.
            Ok(response.map(|body| {
                Body::from_stream(futures_util::StreamExt::map(
                    body.into_data_stream(),
                    move |chunk| {
                        let _held = &busy;
                        chunk
                    },
                ))
            }))
        })
    }
}

/// Accept connections for `router` until the listener fails for good; each
/// gets a slot (`Slots::admit`), a first-byte deadline, a header deadline
/// and a bounded buffer.
pub async fn accept_loop(listener: tokio::net::TcpListener, router: Router, access: Arc<Access>) {
    let slots = Slots::new(MAX_HTTP_CONNECTIONS, MAX_CONNECTIONS_PER_SOURCE);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors and the like: wait, then go on.
                tracing::warn!(%error, "the HTTP API could not accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let source = Source::of(peer.ip());
        let Ok(slot) = slots.admit(source) else {
            tracing::debug!(%source, "an HTTP connection refused: every slot is answering a request");
            drop(stream);
            continue;
        };
        let service = Tracked {
            router: router.clone(),
            access: access.clone(),
            source,
            busy: slot.busy.clone(),
        };
        tokio::spawn(serve_connection(stream, peer, slot, service));
    }
}

async fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    slot: Slot,
    service: Tracked,
) {
    let close = slot.close.clone();
    // A connection that says nothing is closed soon: it would hold a slot
    // for the whole header timeout otherwise.
    let mut byte = [0u8; 1];
    let first = tokio::select! {
        peeked = tokio::time::timeout(FIRST_BYTE_TIMEOUT, stream.peek(&mut byte)) => {
            matches!(peeked, Ok(Ok(n)) if n > 0)
        }
        () = close.notified() => false,
    };
    if !first {
        tracing::trace!(%peer, "an HTTP connection closed before its first byte");
        return;
    }
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HTTP_BUFFER)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    // Closed for a newcomer: dropped at once, whatever it was doing (a
    // graceful shutdown would let a request it started run on, uncounted).
    tokio::select! {
        _ = connection => {}
        () = close.notified() => {}
    }
    drop(slot);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    fn source(last: u8) -> Source {
        Source::of(IpAddr::from([127, 0, 0, last]))
    }

    #[test]
    fn a_full_table_closes_the_oldest_idle_connection_of_the_heaviest_source() {
        let slots = Slots::new(4, 3);
        let flooder: Vec<Slot> = (0..3).map(|_| slots.admit(source(9)).unwrap()).collect();
        let other = slots.admit(source(2)).unwrap();
        assert_eq!(slots.open(), 4);
        // The flooder's first connection is the oldest of the heaviest source.
        let newcomer = slots.admit(source(3)).unwrap();
        assert_eq!(slots.open(), 4);
        assert!(!lock(&slots.table).conns.contains_key(&flooder[0].id));
        assert!(lock(&slots.table).conns.contains_key(&other.id));
        drop(newcomer);
        assert_eq!(slots.open(), 3);
    }

    #[test]
    fn a_source_at_its_share_gives_up_its_own_idle_connection() {
        let slots = Slots::new(8, 2);
        let first = slots.admit(source(9)).unwrap();
        let _second = slots.admit(source(9)).unwrap();
        let _third = slots.admit(source(9)).unwrap();
        assert_eq!(slots.open(), 2);
        assert!(!lock(&slots.table).conns.contains_key(&first.id));
    }

    #[test]
    fn a_source_with_few_slots_gets_one_from_the_heaviest_even_when_all_are_busy() {
        let slots = Slots::new(4, 4);
        let flooder: Vec<Slot> = (0..3).map(|_| slots.admit(source(9)).unwrap()).collect();
        let other = slots.admit(source(8)).unwrap();
        let _answering: Vec<Busy> = flooder
            .iter()
            .chain([&other])
            .map(|slot| Busy::enter(&slot.busy))
            .collect();
        // Every slot answers a request: the heaviest source gives up its
        // youngest one to a source holding none.
        let newcomer = slots.admit(source(2)).unwrap();
        assert!(!lock(&slots.table).conns.contains_key(&flooder[2].id));
        // Now 9 holds 2, 8 and 2 one each: as even as they can be, so
        // another newcomer of source 8 is refused.
        let _answering_too = Busy::enter(&newcomer.busy);
        assert_eq!(slots.admit(source(8)).err(), Some(Refused::AllBusy));
        assert_eq!(slots.open(), 4);
    }
}
