//! The coordinator role's state: what it runs requests on, what it
//! collects, and how it is configured.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::net::msg;
use crate::runtime::records::Collector;
use crate::runtime::serve::coordinator::draft;
use crate::runtime::serve::coordinator::reputation::Reputation;
use crate::runtime::serve::coordinator::runs::PlanCache;
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::shared::Shared;
use crate::runtime::serve::slot::Slot;
use anyhow::bail;
use mesh_protocol::block::ReturnMode;
use mesh_protocol::control::ControlReply;
use mesh_protocol::mesh1::Fidelity;
use mesh_stage::frame::WireDType;
use tokio::sync::oneshot;

/// The coordinator role: the run requests go on, the records it collects,
/// its route table and drafts.
pub(crate) struct CoordinatorRole {
    pub(crate) shared: Arc<Shared>,
    /// The current run (held while its stages load).
    pub(crate) run: tokio::sync::Mutex<Option<Arc<Run>>>,
    /// The own slice of the current run (for `stats`: the run itself is
    /// behind an async lock held while stages load).
    pub(crate) own_slot: Mutex<Option<Arc<Slot>>>,
    pub(crate) planning: Planning,
    /// Requests waiting for their final stage's direct return.
    pub(crate) directs: Mutex<HashMap<u64, DirectWaiter>>,
    /// Stage records of requests being served, until sealed.
    pub(crate) collector: Mutex<Collector>,
    /// A record came in.
    pub(crate) collected: tokio::sync::Notify,
    /// The coordinator's record chain head.
    pub(crate) chain_head: Mutex<Option<[u8; 32]>>,
    pub(crate) coordinator_term: u64,
    pub(crate) routing: Routing,
    /// A small model it drafts with, held whole.
    pub(crate) draft_model: Option<Arc<draft::DraftModel>>,
    /// The training corpus the model declares (SPEC §3.7), bound on its
    /// receipts.
    pub(crate) training: Option<mesh_protocol::mesh1::TrainingBinding>,
    pub(crate) settings: Settings,
    /// Requests refused or failed, logged (`MAX_UNSERVED_LOGGED` a minute).
    pub(crate) unserved_logged: Mutex<crate::runtime::limit::PerMinute>,
    /// Requests waiting for a place.
    pub(crate) queue: crate::runtime::serve::coordinator::queue::Queue,
}

/// How a coordinator plans over a mesh.
pub(crate) struct Planning {
    /// Pinned stage count (default: the planner decides, at least 2).
    pub(crate) stages: Option<usize>,
    /// Members that refused an assignment, left out of plans until then.
    pub(crate) refused: Mutex<HashMap<[u8; 32], Instant>>,
    /// Refusals recorded since start (a retry after a new one is at once).
    pub(crate) refusals: std::sync::atomic::AtomicU64,
    /// The last plan over the mesh, for the member set (its generation) and
    /// the refused members it was made for.
    pub(crate) cache: Mutex<Option<PlanCache>>,
    /// Each node's standing: one that failed an audit is left out a while.
    pub(crate) reputation: Mutex<Reputation>,
    /// Audits waiting or running (at most `MAX_AUDITS_WAITING` + 1).
    pub(crate) auditing: std::sync::Arc<tokio::sync::Semaphore>,
}

/// What the router (SPEC §4) weighs.
pub(crate) struct Routing {
    /// The fidelity the coordinator rates its model at.
    pub(crate) fidelity: Fidelity,
    /// What serves cost per chain.
    pub(crate) costs: Mutex<crate::runtime::serve::coordinator::route::RouteCosts>,
    /// Router refusals journalled (`MAX_REFUSALS_JOURNALLED` a minute).
    pub(crate) refusal_journal: Mutex<crate::runtime::limit::PerMinute>,
}

/// How a coordinator runs its requests.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) return_mode: ReturnMode,
    /// Prompt positions per prefill step.
    pub(crate) prefill_chunk_tokens: usize,
    /// Tokens drafted after each sampled token (0: off).
    pub(crate) draft_tokens: usize,
    /// Resumes one request may have.
    pub(crate) max_resumes: usize,
    /// Requests that may wait for a place (0: refused at once when busy).
    pub(crate) max_queued: usize,
    pub(crate) wire: WireDType,
    /// How long it waits for the stage records after a request.
    pub(crate) seal_deadline: Duration,
    /// The share of requests audited by running their stages' layers here
    /// (0: none), and how long a node that fails one is left out of plans.
    pub(crate) audit_rate: f64,
    pub(crate) audit_pause: Duration,
    /// Where audited requests' tapes are kept (`--audit-tapes`).
    pub(crate) audit_tapes: Option<std::path::PathBuf>,
}

impl CoordinatorRole {
    pub(crate) fn new(
        shared: Arc<Shared>,
        settings: Settings,
        (stages, fidelity): (Option<usize>, Fidelity),
        draft_model: Option<Arc<draft::DraftModel>>,
        training: Option<mesh_protocol::mesh1::TrainingBinding>,
    ) -> Self {
        // What its journal says it found of others before a restart.
        let reputation = Reputation::from_judged(lock(&shared.steward).judged(), now_ms());
        let max_queued = settings.max_queued;
        Self {
            shared,
            run: tokio::sync::Mutex::new(None),
            own_slot: Mutex::new(None),
            planning: Planning {
                stages,
                refused: Mutex::new(HashMap::new()),
                refusals: std::sync::atomic::AtomicU64::new(0),
                cache: Mutex::new(None),
                reputation: Mutex::new(reputation),
                auditing: std::sync::Arc::new(tokio::sync::Semaphore::new(
                    crate::runtime::serve::coordinator::reputation::MAX_AUDITS_WAITING + 1,
                )),
            },
            directs: Mutex::new(HashMap::new()),
            collector: Mutex::new(Collector::default()),
            collected: tokio::sync::Notify::new(),
            chain_head: Mutex::new(None),
            coordinator_term: now_ms(),
            routing: Routing {
                fidelity,
                costs: Mutex::new(crate::runtime::serve::coordinator::route::RouteCosts::default()),
                refusal_journal: Mutex::new(crate::runtime::limit::PerMinute::new(
                    crate::runtime::journal::MAX_REFUSALS_JOURNALLED,
                )),
            },
            draft_model,
            training,
            settings,
            unserved_logged: Mutex::new(crate::runtime::limit::PerMinute::new(MAX_UNSERVED_LOGGED)),
            queue: crate::runtime::serve::coordinator::queue::Queue::new(max_queued),
        }
    }

    /// The final stage of request `request_id` opened its direct return:
    /// handed to the request waiting for it, when `peer` is the stage it
    /// was routed to.
    pub(crate) fn accept_direct(
        &self,
        peer: [u8; 32],
        request_id: u64,
        stream: DirectStream,
    ) -> anyhow::Result<()> {
        let waiting = {
            let mut directs = lock(&self.directs);
            match directs.get(&request_id) {
                Some((expected, _)) if *expected == peer => directs.remove(&request_id),
                _ => None,
            }
        };
        match waiting {
            Some((_, sender)) => {
                let _ = sender.send(stream);
                Ok(())
            }
            None => bail!(
                "a direct-return stream for request {request_id}, which is not waiting for one from this peer"
            ),
        }
    }
}

pub(crate) type DirectStream = (quinn::SendStream, quinn::RecvStream, Vec<u8>);

/// A coordinator waiting for its final stage's direct return: the key that
/// stage must prove, and where to hand the stream.
pub(crate) type DirectWaiter = ([u8; 32], oneshot::Sender<DirectStream>);

/// Resumes of one request, unless configured.
pub const DEFAULT_MAX_RESUMES: usize = 2;

/// The most resumes one request may have: its receipt lists every segment.
pub const MAX_RESUMES: usize = mesh_protocol::resume::MAX_SEGMENTS - 1;

/// Requests a coordinator refused or that failed, logged a minute (one line
/// each; past this they are counted in the next line).
pub const MAX_UNSERVED_LOGGED: u32 = 120;

pub(crate) async fn send_error(send: &mut quinn::SendStream, reason: &str) -> anyhow::Result<()> {
    msg::write_cbor(
        send,
        &ControlReply::Error {
            reason: bounded_reason(reason),
        }
        .to_cbor(),
    )
    .await
}

/// A reason as a reply carries it: at most `MAX_REASON_BYTES`, cut at a
/// character boundary.
pub(crate) fn bounded_reason(reason: &str) -> String {
    let mut end = reason.len().min(mesh_protocol::control::MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_string()
}

/// Prompt positions per prefill step, unless configured: the engine's own
/// step, so `generate --model` and a coordinator prefill alike.
pub const DEFAULT_PREFILL_CHUNK_TOKENS: usize = mesh_stage::pipeline::PREFILL_STEP_ROWS;

/// The most prompt positions one prefill step may carry: a step's frame
/// and its attention scores grow with it.
pub const MAX_PREFILL_CHUNK_TOKENS: usize = 4096;

/// Tokens drafted after each sampled token, unless configured: none by
/// prompt lookup (a rejected draft costs every stage its positions, and
/// most text does not repeat itself) ...
pub const DEFAULT_DRAFT_TOKENS: usize = 0;

/// ... and four with a draft model.
pub const DRAFT_MODEL_TOKENS: usize = 4;

/// The most tokens one decode step may draft: a decode step carries at
/// most `MAX_DECODE_ROWS` positions, the sampled token among them.
pub const MAX_DRAFT_TOKENS: usize = mesh_protocol::stage_frame::MAX_DECODE_ROWS - 1;

/// One-way hops a decode step crosses in a chain of `stages`: relayed
/// return goes down and back up every link; direct return goes down and
/// then straight home.
pub fn one_way_hops_per_step(stages: usize, return_mode: ReturnMode) -> usize {
    match return_mode {
        ReturnMode::Relayed => 2 * stages.saturating_sub(1),
        ReturnMode::Direct => stages,
    }
}

/// A request no backend could serve within its floor and ceiling
/// (counted when it is refused).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct RouteRefused(pub String);

/// Whether a request was refused by the router.
pub(crate) fn is_route_refusal(error: &anyhow::Error) -> bool {
    error.downcast_ref::<RouteRefused>().is_some()
}

/// Whether a request was refused because a pool was full.
pub(crate) fn is_busy(error: &anyhow::Error) -> bool {
    matches!(
        error.downcast_ref::<mesh_stage::EngineError>(),
        Some(mesh_stage::EngineError::Busy(_))
    )
}
