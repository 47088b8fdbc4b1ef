//! The requester's side of a node: ask a coordinator to generate (token by
//! token, then the summary and the bundle), for its plan, or a node for its
//! stats, over `mesh-control/1`. What the CLI, the HTTP API and the tests
//! use; it holds no state of a node's.

use std::time::Duration;

use anyhow::{Context, bail};
use mesh_protocol::SigningKey;
use mesh_protocol::cbor::Cbor;
use mesh_protocol::control::{ControlReply, ControlRequest, DecisionAsk, GenerateRequestMessage};
use mesh_protocol::mesh1::{Fidelity, ServeRequest, prompt_hash};
use mesh_stage::sampling::SamplingParams;

use crate::runtime::net::ALPN_CONTROL;
use crate::runtime::net::msg;
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::net::tls::{self, TlsIdentity};
use crate::runtime::serve::stats::NodeStats;

/// A token is rarely longer than this many bytes of text.
pub const MAX_PROMPT_BYTES_PER_TOKEN: usize = 16;

/// What a requester asks for.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: String,
    pub max_tokens: usize,
    pub chat: bool,
    pub sampling: SamplingParams,
    /// A request riding on grants: the request as the requester computed it
    /// and one presentation per stage (empty: none for that stage).
    pub grant: Option<GrantedServe>,
    /// How long the request may take, from the moment the coordinator reads
    /// it to its last token; `None`, or more than the coordinator allows,
    /// is the coordinator's `request_timeout`.
    pub timeout: Option<Duration>,
    /// Texts that end the generation where they first appear; the text
    /// returned stops before them (at most `MAX_STOP_SEQUENCES`).
    pub stop: Vec<String>,
    /// The request's bounds without a grant (SPEC §3.1): the least
    /// fidelity it accepts, the most microjoules it may cost (a grant's
    /// request carries its own).
    pub bounds: RequestBounds,
    /// A typed decision (SPEC §3.6) about the state `prompt` holds, in
    /// place of a generation.
    pub decision: Option<DecisionAsk>,
}

/// A request's floor and ceiling; unset: F0 and no ceiling.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestBounds {
    pub fidelity_floor: Option<Fidelity>,
    pub joule_ceiling_uj: Option<u64>,
}

/// A granted request (seed 001 §2.3: served as exactly what the requester
/// derives from its own body, so it can sign presentations for its id).
#[derive(Debug, Clone)]
pub struct GrantedServe {
    pub serve: ServeRequest,
    pub presentations: Vec<Vec<u8>>,
}

impl GrantedServe {
    /// The request a requester derives from its prompt alone.
    pub fn derive(
        prompt: &str,
        max_tokens: usize,
        prompt_tokens: u32,
        ceiling_uj: u64,
    ) -> ServeRequest {
        ServeRequest {
            prompt_hash: prompt_hash(prompt.as_bytes()),
            prompt_tokens,
            max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
            fidelity_floor: Fidelity::F0,
            joule_ceiling_uj: ceiling_uj,
            decision: None,
        }
    }
}

impl GenerateRequest {
    /// A plain greedy completion of `prompt`: no chat template, grant,
    /// deadline of its own or stop sequences.
    pub fn greedy(prompt: impl Into<String>, max_tokens: usize) -> Self {
        Self {
            prompt: prompt.into(),
            max_tokens,
            chat: false,
            sampling: SamplingParams::greedy(),
            grant: None,
            timeout: None,
            stop: Vec::new(),
            bounds: RequestBounds::default(),
            decision: None,
        }
    }

    pub(crate) fn to_message(&self) -> ControlRequest {
        ControlRequest::Generate(GenerateRequestMessage {
            prompt: self.prompt.clone(),
            max_tokens: self.max_tokens as u64,
            chat: self.chat,
            temperature_milli: (self.sampling.temperature.max(0.0) * 1000.0).round() as u64,
            top_k: self.sampling.top_k as u64,
            top_p_milli: (self.sampling.top_p.clamp(0.0, 1.0) * 1000.0).round() as u64,
            seed: self.sampling.seed,
            timeout_ms: self.timeout.map(|t| t.as_millis() as u64),
            stop: self.stop.clone(),
            grant: self
                .grant
                .as_ref()
                .map(|g| (g.serve.clone(), g.presentations.clone())),
            fidelity_floor: self.bounds.fidelity_floor,
            joule_ceiling_uj: self.bounds.joule_ceiling_uj,
            decision: self.decision.clone(),
        })
    }

    pub(crate) fn from_message(message: &GenerateRequestMessage) -> Self {
        Self {
            prompt: message.prompt.clone(),
            max_tokens: message.max_tokens as usize,
            chat: message.chat,
            sampling: SamplingParams {
                temperature: message.temperature_milli as f32 / 1000.0,
                top_k: message.top_k as usize,
                top_p: message.top_p_milli as f32 / 1000.0,
                seed: message.seed,
            },
            timeout: message.timeout_ms.map(Duration::from_millis),
            stop: message.stop.clone(),
            grant: message
                .grant
                .as_ref()
                .map(|(serve, presentations)| GrantedServe {
                    serve: serve.clone(),
                    presentations: presentations.clone(),
                }),
            bounds: RequestBounds {
                fidelity_floor: message.fidelity_floor,
                joule_ceiling_uj: message.joule_ceiling_uj,
            },
            decision: message.decision.clone(),
        }
    }
}

/// What the coordinator reports when a request ends.
#[derive(Debug, Clone)]
pub struct GenerateSummary {
    pub text: String,
    pub terminal_state: String,
    pub error: Option<String>,
    pub details: serde_json::Value,
    pub bundle: Option<serde_json::Value>,
}

/// What a coordinator says while it generates for a requester.
#[derive(Debug)]
pub enum GenerateEvent {
    /// The text a token added (empty while a stop sequence may be forming).
    Token(String),
    /// The request ended: its summary and bundle.
    Finished(Box<GenerateSummary>),
}

/// A request being generated: read it event by event. Dropping it closes
/// the connection, which cancels the request on every stage.
#[derive(Debug)]
pub struct Generating {
    endpoint: quinn::Endpoint,
    connection: quinn::Connection,
    recv: quinn::RecvStream,
    /// The wait for the next message: long for the first (a split may load
    /// first), then the control exchange's.
    wait: Duration,
    done: bool,
}

/// Ask a coordinator to generate; the answer comes as events.
pub async fn generate_events(
    coordinator: &PeerAddr,
    request: &GenerateRequest,
) -> anyhow::Result<Generating> {
    let (endpoint, connection) = connect_as_requester(coordinator).await?;
    let (mut send, recv) = connection.open_bi().await?;
    msg::write_cbor(&mut send, &request.to_message().to_cbor()).await?;
    send.finish()?;
    Ok(Generating {
        endpoint,
        connection,
        recv,
        // Setting up a split loads slices; allow for it on the first message.
        wait: Duration::from_secs(300),
        done: false,
    })
}

impl Generating {
    /// The next event; an error once the request ended without a summary
    /// (a refusal, a lost connection), and after `Finished`.
    pub async fn next(&mut self) -> anyhow::Result<GenerateEvent> {
        if self.done {
            bail!("the request has ended");
        }
        let message = msg::read_cbor(&mut self.recv, msg::MAX_CONTROL_MESSAGE, self.wait)
            .await?
            .context("the coordinator closed without an answer")?;
        self.wait = msg::IDLE_TIMEOUT.max(Duration::from_secs(60));
        match ControlReply::from_cbor(&message)? {
            ControlReply::Token { text, .. } => Ok(GenerateEvent::Token(text)),
            ControlReply::Finished {
                text,
                terminal_state,
                error,
                details,
                bundle,
                ..
            } => {
                self.done = true;
                self.connection.close(0u32.into(), b"done");
                self.endpoint.wait_idle().await;
                Ok(GenerateEvent::Finished(Box::new(GenerateSummary {
                    text,
                    terminal_state,
                    error: Some(error).filter(|e| !e.is_empty()),
                    details: serde_json::from_slice(&details).unwrap_or_default(),
                    bundle: serde_json::from_slice(&bundle).ok(),
                })))
            }
            ControlReply::Error { reason } => {
                self.done = true;
                self.connection.close(0u32.into(), b"error");
                bail!("the coordinator refused: {reason}");
            }
            other => bail!("the coordinator answered `{}` to generate", other.kind()),
        }
    }
}

/// The requester's side: ask a coordinator to generate, printing tokens as
/// they arrive through `on_token`, and return its summary and bundle.
pub async fn generate_remote(
    coordinator: &PeerAddr,
    request: &GenerateRequest,
    on_token: &mut (dyn FnMut(&str) + Send),
) -> anyhow::Result<GenerateSummary> {
    let mut generating = generate_events(coordinator, request).await?;
    loop {
        match generating.next().await? {
            GenerateEvent::Token(text) => on_token(&text),
            GenerateEvent::Finished(summary) => return Ok(*summary),
        }
    }
}

/// Ask a coordinator for its stages' stewards (node ids, stage order).
pub async fn plan_remote(coordinator: &PeerAddr) -> anyhow::Result<Vec<String>> {
    let (endpoint, connection) = connect_as_requester(coordinator).await?;
    let (mut send, mut recv) = connection.open_bi().await?;
    let reply = msg::exchange(
        &mut send,
        &mut recv,
        &ControlRequest::Plan.to_cbor(),
        Duration::from_secs(300),
    )
    .await?
    .context("no plan")?;
    connection.close(0u32.into(), b"done");
    endpoint.wait_idle().await;
    match ControlReply::from_cbor(&reply)? {
        ControlReply::Plan { stewards, .. } => Ok(stewards),
        ControlReply::Error { reason } | ControlReply::Refused { reason } => bail!("{reason}"),
        other => bail!("the coordinator answered `{}` to a plan", other.kind()),
    }
}

/// Ask a node for its stats, proving `key` (the node's own, a peer's or a
/// coordinator's it serves).
pub async fn node_stats_remote(key: &SigningKey, node: &PeerAddr) -> anyhow::Result<NodeStats> {
    let (endpoint, connection) = connect_as(key, node).await?;
    let (mut send, mut recv) = connection.open_bi().await?;
    let request = mesh_protocol::control::ControlRequest::NodeStats.to_cbor();
    let reply = msg::exchange(&mut send, &mut recv, &request, msg::IDLE_TIMEOUT)
        .await?
        .context("no stats")?;
    connection.close(0u32.into(), b"done");
    endpoint.wait_idle().await;
    // The figures are the node's own `NodeStats`; anything else is a
    // reply of the control protocol's, read as strictly.
    if reply.get("kind").and_then(Cbor::as_text) == Some("node_stats") {
        return NodeStats::from_cbor(&reply);
    }
    match mesh_protocol::control::ControlReply::from_cbor(&reply)? {
        mesh_protocol::control::ControlReply::Refused { reason } => bail!("{reason}"),
        other => bail!("the node answered `{}` to node_stats", other.kind()),
    }
}

/// Connect to a coordinator's `mesh-control/1` with a fresh key: a
/// requester needs no identity of its own.
pub async fn connect_as_requester(
    coordinator: &PeerAddr,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    let key = SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?);
    connect_as(&key, coordinator).await
}

/// A node named `NODEID@HOST:PORT`, or by `HOST:PORT` alone: then its node
/// id is learned in a TLS handshake (the node proves its key), said on
/// stderr, and pinned for every connection after.
pub async fn peer_or_learn(text: &str) -> anyhow::Result<PeerAddr> {
    if text.contains('@') {
        return text.parse();
    }
    let addr = std::net::ToSocketAddrs::to_socket_addrs(text)
        .with_context(|| format!("`{text}`: give HOST:PORT or NODEID@HOST:PORT"))?
        .next()
        .with_context(|| format!("`{text}` resolves to no address"))?;
    tls::install_provider();
    let identity = TlsIdentity::new(&SigningKey::from_bytes(
        &crate::runtime::keys::random_bytes()?,
    ))?;
    let mut endpoint = quinn::Endpoint::client((std::net::Ipv4Addr::UNSPECIFIED, 0).into())?;
    endpoint.set_default_client_config(tls::client_config(&identity, None, ALPN_CONTROL)?);
    let connection =
        tokio::time::timeout(msg::CONNECT_TIMEOUT, endpoint.connect(addr, "mesh-node")?)
            .await
            .with_context(|| format!("timed out reaching a node at {text}"))?
            .with_context(|| format!("reaching a node at {text}"))?;
    let key = tls::peer_key(&connection).context("the node proved no Ed25519 key")?;
    connection.close(0u32.into(), b"learned");
    let peer = PeerAddr { key, addr };
    eprintln!("the node at {text} is {} (pinned: {peer})", peer.did());
    Ok(peer)
}

/// Connect to a node's `mesh-control/1` proving `key`.
pub async fn connect_as(
    key: &SigningKey,
    coordinator: &PeerAddr,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    tls::install_provider();
    let identity = TlsIdentity::new(key)?;
    let mut endpoint = quinn::Endpoint::client((std::net::Ipv4Addr::UNSPECIFIED, 0).into())?;
    endpoint.set_default_client_config(tls::client_config(
        &identity,
        coordinator.key,
        ALPN_CONTROL,
    )?);
    let connection = tokio::time::timeout(
        msg::CONNECT_TIMEOUT,
        endpoint.connect(coordinator.addr, "mesh-node")?,
    )
    .await
    .with_context(|| format!("timed out connecting to {coordinator}"))?
    .with_context(|| format!("connecting to {coordinator}"))?;
    Ok((endpoint, connection))
}
