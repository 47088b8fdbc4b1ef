//! What both roles of a node share: its identity, steward, model, peer
//! connections, counters and mesh membership ([`Shared`]), and the small
//! pieces every request uses (its deadline, the lock helper).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use mesh_protocol::SigningKey;
use mesh_protocol::capsule::format_timestamp;
use mesh_stage::{LayerSlice, ModelHandle};

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::slot::Assign;
use crate::runtime::serve::slot::Slot;
use crate::runtime::serve::stats;
use crate::runtime::steward::{ServeTicket, Steward};

/// What both roles of a node share. The stage role and the coordinator role
/// each hold it, and reach each other only through the protocols.
pub(crate) struct Shared {
    pub(crate) tls: crate::runtime::net::tls::TlsIdentity,
    pub(crate) key: SigningKey,
    /// The node's one QUIC endpoint (the router accepts on it).
    pub(crate) endpoint: quinn::Endpoint,
    /// Connections this node opened to peers, kept for reuse.
    pub(crate) net: crate::runtime::net::peers::Peers,
    /// The address other nodes reach this one at.
    pub(crate) advertise: SocketAddr,
    pub(crate) model: ModelHandle,
    pub(crate) steward: Mutex<Steward>,
    pub(crate) counters: stats::Counters,
    /// Set once at start when the node takes part in a mesh.
    pub(crate) mesh: std::sync::OnceLock<crate::runtime::mesh::Mesh>,
    pub(crate) step_timeout: Duration,
    /// The longest a request may take, and what one that names no timeout
    /// gets.
    pub(crate) request_timeout: Duration,
    /// Requests a slice holds at once.
    pub(crate) max_requests: usize,
    /// Checkpoint this node's log for what it sends: stage pushes as
    /// `record_push_bundle`s, the requester's bundle with the main record's
    /// inclusion proof.
    pub(crate) record_checkpoints: bool,
    /// The configured peers (a coordinator's chain; let in past the
    /// connection bound; may read this node's stats).
    pub(crate) peers: Vec<PeerAddr>,
    /// The configured coordinators this node serves as a stage.
    pub(crate) coordinators: Vec<[u8; 32]>,
}

/// The longest sequence a request may run to on `model` in this engine.
pub(crate) fn engine_context(model: &ModelHandle) -> usize {
    model
        .config()
        .context
        .min(mesh_stage::model::MAX_ENGINE_CONTEXT)
}

/// A wait for a step's message ran out: name it, and the setting that bounds it.
/// One request's deadline: every wait of the request, at every node, ends
/// by it. The coordinator sets it when it reads the request; each stage
/// learns the time left from OPEN.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    pub(crate) at: tokio::time::Instant,
    pub(crate) total: Duration,
}

impl Deadline {
    pub(crate) fn after(total: Duration) -> Self {
        let total = total.min(MAX_REQUEST_TIMEOUT);
        Self {
            at: tokio::time::Instant::now() + total,
            total,
        }
    }
    pub(crate) fn at(&self) -> tokio::time::Instant {
        self.at
    }
    pub(crate) fn left(&self) -> Duration {
        self.at
            .saturating_duration_since(tokio::time::Instant::now())
    }
    pub(crate) fn is_past(&self) -> bool {
        self.left().is_zero()
    }
    /// `wait`, or less when the deadline is nearer.
    pub(crate) fn bound(&self, wait: Duration) -> Duration {
        wait.min(self.left())
    }
    /// Why a request ended at its deadline.
    pub(crate) fn passed(&self, waiting_for: &str) -> String {
        format!(
            "timed out: the request's deadline of {} ms passed while waiting for {waiting_for}",
            self.total.as_millis()
        )
    }
}

/// How long a request may take when neither it nor the configuration says.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// The longest any request may take, whatever is configured or asked.
pub const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

pub(crate) fn step_timed_out(whom: &str, timeout: Duration) -> anyhow::Error {
    anyhow!(
        "timed out: no reply from {whom} within the step timeout of {} ms (serve --step-timeout-ms)",
        timeout.as_millis()
    )
}

/// How long a node keeps reading a peer's stream after a request failed.
pub const DRAIN_WAIT: Duration = Duration::from_secs(1);

/// How a FAILED reply starts when a steward stopped its part of a serve at
/// the request's energy ceiling (the serve's terminal state).
pub const POLICY_DENIED: &str = "policy_denied";

/// Per-request figures a stage keeps for a while (asked for by `stats`).
#[derive(Debug, Clone, Copy, Default)]
pub struct StageStats {
    /// Each step from handing it to the slice's worker to its output back.
    pub compute: Duration,
    /// The engine's own time on decode steps (a prompt's chunks, the queue
    /// and the hand-offs to and from the worker excluded).
    pub decode_engine: Duration,
    pub fold: Duration,
    pub steps: u32,
}

impl Shared {
    /// The model's name in records: its file's name.
    pub(crate) fn model_id(&self) -> String {
        self.model
            .path()
            .file_name()
            .map_or("model".to_string(), |f| f.to_string_lossy().into_owned())
    }

    /// A record's place (leaf `main_leaf`) in this node's log: its
    /// inclusion proof and a checkpoint it is proven under (the requester's
    /// bundle, a stage's push).
    pub(crate) fn log_proof(
        &self,
        main_leaf: u64,
    ) -> Option<(serde_json::Value, serde_json::Value)> {
        let (proof, checkpoint) =
            lock(&self.steward).prove_and_checkpoint(main_leaf, &format_timestamp(now_ms()))?;
        Some((
            serde_json::json!({ "leaf_index": main_leaf, "proof": proof.to_value() }),
            checkpoint,
        ))
    }

    /// The longest sequence a request may run to on this node's model.
    pub(crate) fn context(&self) -> usize {
        engine_context(&self.model)
    }

    /// A loaded slice, ready to serve: its cache pool and batch worker.
    pub(crate) fn slot(&self, slice: LayerSlice, assign: Assign) -> Arc<Slot> {
        Arc::new(Slot::new(slice, self.max_requests, self.context(), assign))
    }

    /// Whether `key`'s mesh connection closed at or after `since`: its
    /// process is gone, and nothing more will come from it.
    pub(crate) fn left_mesh_since(&self, key: &[u8; 32], since: Instant) -> bool {
        self.mesh.get().is_some_and(|m| m.closed_since(key, since))
    }
}

/// A steward's grant decision held for a serve: when dropped before the
/// serve is sealed (refused, failed to start, never arrived, its task
/// ended), the steward closes it with the (empty) span it metered and
/// journals that, so nothing stays open or charged at its ceiling.
pub(crate) struct HeldTicket {
    shared: Arc<Shared>,
    /// Present until [`HeldTicket::into_sealed`] takes it.
    ticket: Option<ServeTicket>,
}

impl HeldTicket {
    pub(crate) fn new(shared: &Arc<Shared>, ticket: ServeTicket) -> Self {
        Self {
            shared: shared.clone(),
            ticket: Some(ticket),
        }
    }

    /// The decision, for the seal to close with what the serve metered.
    pub(crate) fn into_sealed(mut self) -> ServeTicket {
        self.ticket
            .take()
            .expect("a held ticket is present until this consumes it")
    }
}

impl std::ops::Deref for HeldTicket {
    type Target = ServeTicket;
    fn deref(&self) -> &ServeTicket {
        self.ticket
            .as_ref()
            .expect("a held ticket is present until into_sealed consumes it")
    }
}

impl std::ops::DerefMut for HeldTicket {
    fn deref_mut(&mut self) -> &mut ServeTicket {
        self.ticket
            .as_mut()
            .expect("a held ticket is present until into_sealed consumes it")
    }
}

impl Drop for HeldTicket {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let weights = Some(self.shared.model.weights_digest());
        if let Err(error) = lock(&self.shared.steward).end_engine(ticket, weights) {
            tracing::warn!("releasing an unused grant decision: {error}");
        }
    }
}
