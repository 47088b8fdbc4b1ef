//! TLS 1.3 for QUIC with certificates derived from a node's Ed25519 key.
//! A peer is identified by that key (node id = did:key of it): the client
//! pins the server's key, and the server learns the client's key from its
//! certificate. The handshake signature proves possession; nothing else in
//! the certificate is trusted.

use std::sync::Arc;

use mesh_protocol::SigningKey;
use mesh_protocol::identity::did_key;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

/// DER of an Ed25519 SubjectPublicKeyInfo up to its key: SEQUENCE(42) {
/// SEQUENCE(5) { OID 1.3.101.112 }, BIT STRING(33) { 0 unused bits, key } }.
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Install the process-wide rustls provider (ring) once; later calls are no-ops.
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The Ed25519 key a certificate's SubjectPublicKeyInfo holds, parsed as
/// X.509 by the same parser rustls checks the handshake signature with, so
/// the key named is the key that signed. Anything but exactly an Ed25519
/// SPKI (RFC 8410: algorithm id-Ed25519, no parameters, 32-byte key) is
/// refused; bytes elsewhere in the certificate (names, extensions) are never
/// read as a key.
pub fn certificate_key(cert: &[u8]) -> Option<[u8; 32]> {
    let der = CertificateDer::from(cert);
    let parsed = webpki::EndEntityCert::try_from(&der).ok()?;
    let spki = parsed.subject_public_key_info();
    let key = spki.strip_prefix(&ED25519_SPKI_PREFIX[..])?;
    key.try_into().ok()
}

/// A node's certificate and key for TLS.
#[derive(Debug, Clone)]
pub struct TlsIdentity {
    pub public_key: [u8; 32],
    pub did: String,
    cert: CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl TlsIdentity {
    /// A self-signed certificate for `key`.
    pub fn new(key: &SigningKey) -> anyhow::Result<Self> {
        let der = pkcs8(key);
        let pkcs8 = PrivatePkcs8KeyDer::from(der.clone());
        let key_pair = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)?;
        let params = rcgen::CertificateParams::new(vec!["mesh-node".to_string()])?;
        let cert = params.self_signed(&key_pair)?;
        Self::with_certificate(key, cert.der().to_vec())
    }

    /// Present a certificate made elsewhere for `key` (tests present forged
    /// ones). Its SubjectPublicKeyInfo must be `key`'s.
    pub fn with_certificate(key: &SigningKey, cert: Vec<u8>) -> anyhow::Result<Self> {
        let public_key = key.verifying_key().to_bytes();
        if certificate_key(&cert) != Some(public_key) {
            anyhow::bail!("the certificate's subject public key is not this node's key");
        }
        Ok(Self {
            public_key,
            did: did_key(&public_key),
            cert: CertificateDer::from(cert),
            key_der: pkcs8(key),
        })
    }

    fn chain(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        (
            vec![self.cert.clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone())),
        )
    }
}

/// PKCS#8 v2 (RFC 8410 OneAsymmetricKey) of an Ed25519 key, public key included.
fn pkcs8(key: &SigningKey) -> Vec<u8> {
    let mut der = vec![
        0x30, 0x53, 0x02, 0x01, 0x01, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(&key.to_bytes());
    der.extend_from_slice(&[0xa1, 0x23, 0x03, 0x21, 0x00]);
    der.extend_from_slice(&key.verifying_key().to_bytes());
    der
}

fn algorithms() -> WebPkiSupportedAlgorithms {
    provider().signature_verification_algorithms
}

/// Accepts exactly one server key; with none expected, any server that
/// proves an Ed25519 key (a first contact by HOST:PORT, whose key is then
/// read from the connection and pinned).
#[derive(Debug)]
struct PinnedServer {
    expected: Option<[u8; 32]>,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match (certificate_key(end_entity), self.expected) {
            (Some(key), Some(expected)) if key == expected => Ok(ServerCertVerified::assertion()),
            (Some(_), None) => Ok(ServerCertVerified::assertion()),
            (_, Some(expected)) => Err(rustls::Error::General(format!(
                "peer is not {}",
                did_key(&expected)
            ))),
            (None, None) => Err(rustls::Error::General(
                "the server's certificate carries no Ed25519 key".into(),
            )),
        }
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not accepted".into()))
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &algorithms())
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

/// Accepts any client that proves an Ed25519 key; the application decides
/// what that key may do.
#[derive(Debug)]
struct AnyEd25519Client;

impl ClientCertVerifier for AnyEd25519Client {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        certificate_key(end_entity)
            .map(|_| ClientCertVerified::assertion())
            .ok_or_else(|| {
                rustls::Error::General("client certificate carries no Ed25519 key".into())
            })
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not accepted".into()))
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &algorithms())
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

/// A connection silent this long is lost (its streams fail at once).
pub const CONNECTION_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// Keep-alive interval: several fit in the idle timeout, so a lost packet
/// or two does not end a healthy connection.
pub const KEEP_ALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(400);
/// Streams a peer may have open at once on one connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 64;
/// Bytes a peer may have sent and this node not yet read, per connection.
pub const CONNECTION_RECEIVE_WINDOW: u32 = 16 * 1024 * 1024;

/// The largest UDP payload path MTU discovery tries (a 9,000-byte jumbo
/// frame over IPv6): where the path carries it (loopback, a jumbo-frame
/// LAN), a decode step's frame is one packet. Probes a path drops cost
/// nothing but the probe; quinn's default stops at 1,452.
pub const MAX_DISCOVERED_UDP_PAYLOAD: u16 = 8952;
/// Ack-eliciting packets a peer may receive before it must acknowledge
/// (QUIC's ACK frequency extension; QUIC's own rule is every second). A
/// hop's frame drew an ACK that quinn sends before it wakes the frame's
/// reader, one more send on every hop's path; now ACKs go out by the
/// peer's ACK delay timer or every tenth packet (docs/BENCHMARKS.md, "one
/// packet a hop without an ACK").
pub const ACK_ELICITING_THRESHOLD: u32 = 10;

fn transport() -> Arc<quinn::TransportConfig> {
    let mut transport = quinn::TransportConfig::default();
    // Both ends send keep-alives, so a peer that died or went off the
    // network is noticed by its silence within the idle timeout, whatever
    // any step timeout says.
    transport.max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
        CONNECTION_IDLE_TIMEOUT.as_millis() as u32,
    ))));
    transport.keep_alive_interval(Some(KEEP_ALIVE_INTERVAL));
    transport.max_concurrent_bidi_streams(quinn::VarInt::from_u32(MAX_STREAMS_PER_CONNECTION));
    // Unread data a peer may have in flight on one connection, all streams
    // together (quinn's default is unbounded).
    transport.receive_window(quinn::VarInt::from_u32(CONNECTION_RECEIVE_WINDOW));
    transport.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_DISCOVERED_UDP_PAYLOAD);
    transport.mtu_discovery_config(Some(mtu));
    let mut acks = quinn::AckFrequencyConfig::default();
    acks.ack_eliciting_threshold(quinn::VarInt::from_u32(ACK_ELICITING_THRESHOLD));
    transport.ack_frequency_config(Some(acks));
    Arc::new(transport)
}

/// Server side: every ALPN this node speaks.
pub fn server_config(
    identity: &TlsIdentity,
    alpns: &[&[u8]],
) -> anyhow::Result<quinn::ServerConfig> {
    let (chain, key) = identity.chain();
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(AnyEd25519Client))
        .with_single_cert(chain, key)?;
    tls.alpn_protocols = alpns.iter().map(|a| a.to_vec()).collect();
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport());
    // A connection's address is the one its handshake came from: a client
    // may not move it (a move is unproven until validated, and the reach
    // protocol answers and dials the address it sees).
    config.migration(false);
    Ok(config)
}

/// Client side: one ALPN, one pinned peer (`None`: the first contact with
/// a node known by its address only; its key is read after the handshake).
pub fn client_config(
    identity: &TlsIdentity,
    peer: impl Into<Option<[u8; 32]>>,
    alpn: &[u8],
) -> anyhow::Result<quinn::ClientConfig> {
    let peer = peer.into();
    let (chain, key) = identity.chain();
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedServer { expected: peer }))
        .with_client_auth_cert(chain, key)?;
    tls.alpn_protocols = vec![alpn.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport());
    Ok(config)
}

/// The Ed25519 key the remote end of a connection proved.
pub fn peer_key(connection: &quinn::Connection) -> Option<[u8; 32]> {
    let identity = connection.peer_identity()?;
    let certs = identity.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    certificate_key(certs.first()?)
}
