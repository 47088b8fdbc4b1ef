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

/// DER prefix of an Ed25519 SubjectPublicKeyInfo; the 32-byte key follows.
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

/// The Ed25519 key a certificate carries.
pub fn certificate_key(cert: &[u8]) -> Option<[u8; 32]> {
    let at = cert
        .windows(ED25519_SPKI_PREFIX.len())
        .position(|w| w == ED25519_SPKI_PREFIX)?;
    cert.get(at + ED25519_SPKI_PREFIX.len()..at + ED25519_SPKI_PREFIX.len() + 32)?
        .try_into()
        .ok()
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
    pub fn new(key: &SigningKey) -> anyhow::Result<Self> {
        let public_key = key.verifying_key().to_bytes();
        // PKCS#8 v2 (RFC 8410 OneAsymmetricKey) with the public key included.
        let mut der = vec![
            0x30, 0x53, 0x02, 0x01, 0x01, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(&key.to_bytes());
        der.extend_from_slice(&[0xa1, 0x23, 0x03, 0x21, 0x00]);
        der.extend_from_slice(&public_key);
        let pkcs8 = PrivatePkcs8KeyDer::from(der.clone());
        let key_pair = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)?;
        let did = did_key(&public_key);
        let params = rcgen::CertificateParams::new(vec!["mesh-node".to_string()])?;
        let cert = params.self_signed(&key_pair)?;
        Ok(Self {
            public_key,
            did,
            cert: cert.der().clone(),
            key_der: der,
        })
    }

    fn chain(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        (
            vec![self.cert.clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone())),
        )
    }
}

fn algorithms() -> WebPkiSupportedAlgorithms {
    provider().signature_verification_algorithms
}

/// Accepts exactly one server key.
#[derive(Debug)]
struct PinnedServer {
    expected: [u8; 32],
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
        match certificate_key(end_entity) {
            Some(key) if key == self.expected => Ok(ServerCertVerified::assertion()),
            _ => Err(rustls::Error::General(format!(
                "peer is not {}",
                did_key(&self.expected)
            ))),
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

fn transport() -> Arc<quinn::TransportConfig> {
    let mut transport = quinn::TransportConfig::default();
    transport.max_idle_timeout(Some(
        std::time::Duration::from_secs(30)
            .try_into()
            .unwrap_or(quinn::IdleTimeout::from(quinn::VarInt::from_u32(30_000))),
    ));
    transport.keep_alive_interval(Some(std::time::Duration::from_secs(5)));
    transport.max_concurrent_bidi_streams(quinn::VarInt::from_u32(256));
    transport.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
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
    Ok(config)
}

/// Client side: one ALPN, one pinned peer.
pub fn client_config(
    identity: &TlsIdentity,
    peer: [u8; 32],
    alpn: &[u8],
) -> anyhow::Result<quinn::ClientConfig> {
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
