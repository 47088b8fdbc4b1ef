//! The node's one QUIC endpoint: it accepts connections within bounds,
//! learns each peer's key from its handshake, and hands every stream to the
//! handler of the connection's protocol (its ALPN), with that key. The
//! accept loop knows nothing else: what a protocol does is its handler's.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use mesh_protocol::identity::did_key;

use crate::runtime::net::tls;

/// Connections from strangers a node holds open at once; more are closed
/// once their key is known (configured peers and coordinators still get in).
pub const MAX_CONNECTIONS: usize = 512;
/// Handshakes in progress at once; past this, unvalidated source addresses
/// get a stateless retry and validated ones are refused.
pub const MAX_HANDSHAKES: usize = 128;

/// What handling one stream comes to.
pub type Handled = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// One protocol's handler: given each stream of a connection that spoke
/// it, the key the peer proved, and the connection (its address).
pub trait ProtocolHandler: Send + Sync {
    fn accept(
        &self,
        peer: [u8; 32],
        connection: &quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
    ) -> Handled;
}

/// The endpoint's protocols and who always gets in.
pub struct Router {
    endpoint: quinn::Endpoint,
    handlers: Vec<(&'static [u8], Arc<dyn ProtocolHandler>)>,
    /// Keys let in even when strangers hold every connection slot: the
    /// configured coordinators and peers (a mesh member is anyone who
    /// joined, so membership earns nothing here).
    trusted: Vec<[u8; 32]>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let alpns: Vec<_> = self
            .handlers
            .iter()
            .map(|(alpn, _)| String::from_utf8_lossy(alpn))
            .collect();
        f.debug_struct("Router")
            .field("alpns", &alpns)
            .field("trusted", &self.trusted.len())
            .finish_non_exhaustive()
    }
}

impl Router {
    pub fn new(endpoint: quinn::Endpoint, trusted: Vec<[u8; 32]>) -> Self {
        Self {
            endpoint,
            handlers: Vec::new(),
            trusted,
        }
    }

    /// Hand the streams of connections speaking `alpn` to `handler`.
    pub fn accept(mut self, alpn: &'static [u8], handler: Arc<dyn ProtocolHandler>) -> Self {
        self.handlers.push((alpn, handler));
        self
    }

    /// Accept until the endpoint closes.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(accept_loop(Arc::new(self)))
    }

    fn handler(&self, alpn: Option<&[u8]>) -> Option<Arc<dyn ProtocolHandler>> {
        let alpn = alpn?;
        self.handlers
            .iter()
            .find(|(known, _)| *known == alpn)
            .map(|(_, handler)| handler.clone())
    }
}

async fn accept_loop(router: Arc<Router>) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let handshaking = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    while let Some(incoming) = router.endpoint.accept().await {
        let Ok(handshake) = handshaking.clone().try_acquire_owned() else {
            // Under a flood of handshakes, make unproven source addresses
            // prove themselves (a stateless retry) before any work is done.
            if incoming.remote_address_validated() {
                incoming.refuse();
            } else {
                let _ = incoming.retry();
            }
            continue;
        };
        let (router, open) = (router.clone(), open.clone());
        tokio::spawn(async move {
            let connection = incoming.await;
            drop(handshake);
            let Ok(connection) = connection else {
                return;
            };
            let alpn = connection
                .handshake_data()
                .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                .and_then(|d| d.protocol);
            let Some(peer) = tls::peer_key(&connection) else {
                return;
            };
            // Strangers share MAX_CONNECTIONS; a configured coordinator or
            // peer is let in even when strangers hold them all.
            let permit = open.try_acquire_owned().ok();
            if permit.is_none() && !router.trusted.contains(&peer) {
                connection.close(2u32.into(), b"busy: too many connections");
                return;
            }
            let _permit = permit;
            let Some(handler) = router.handler(alpn.as_deref()) else {
                connection.close(1u32.into(), b"unknown protocol");
                return;
            };
            while let Ok((send, recv)) = connection.accept_bi().await {
                let handled = handler.accept(peer, &connection, send, recv);
                tokio::spawn(async move {
                    if let Err(error) = handled.await {
                        tracing::warn!(peer = %did_key(&peer), "stream: {error:#}");
                    }
                });
            }
        });
    }
}
