//! The stage role's state: the slices this node holds for its
//! coordinators, the grant decisions taken ahead of their requests, the
//! caches kept for a resume.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::runtime::clock::lock;
use crate::runtime::serve::shared::HeldTicket;
use crate::runtime::serve::shared::Shared;
use crate::runtime::serve::shared::StageStats;
use crate::runtime::serve::slot::Slot;
use crate::runtime::serve::stage::kept;
use anyhow;
use anyhow::bail;
use mesh_protocol::control::ControlReply;
use mesh_protocol::mesh1::ServeRequest;

/// The stage role: what a node holds for the coordinators it serves.
pub(crate) struct StageRole {
    pub(crate) shared: Arc<Shared>,
    /// Loaded slices, by run id: at most one per coordinator served.
    pub(crate) slots: Mutex<HashMap<String, Arc<Slot>>>,
    /// Grant decisions taken ahead of a request's chain, by request id.
    pub(crate) tickets: Mutex<HashMap<u64, PreDecided>>,
    /// Caches of failed requests a resume may take over.
    pub(crate) kept: kept::KeptCaches,
    /// Each request's figures, for its coordinator's `stats` (the last 256).
    pub(crate) stats: Mutex<VecDeque<(u64, StageStats)>>,
    /// Most slices held at once (one per coordinator).
    pub(crate) max_slices: usize,
    /// A slice no request used for this long is freed.
    pub(crate) slice_idle: Duration,
    /// Refused assignments from strangers logged (one a minute).
    pub(crate) assign_refusals_logged: Mutex<crate::runtime::limit::PerMinute>,
    /// The node is shutting down: it takes no new slice, so coordinators
    /// plan around it, and serves on what it holds.
    pub(crate) draining: std::sync::atomic::AtomicBool,
}

impl StageRole {
    pub(crate) fn new(shared: Arc<Shared>, max_slices: usize, slice_idle: Duration) -> Self {
        Self {
            shared,
            slots: Mutex::new(HashMap::new()),
            tickets: Mutex::new(HashMap::new()),
            kept: kept::KeptCaches::default(),
            stats: Mutex::new(VecDeque::new()),
            max_slices: max_slices.max(1),
            slice_idle,
            assign_refusals_logged: Mutex::new(crate::runtime::limit::PerMinute::new(1)),
            draining: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// A coordinator asks to release the grant decision it asked for (its
    /// request was refused elsewhere before any work ran here): closed with
    /// the (empty) span it metered. Only the coordinator that asked may.
    pub(crate) fn release(&self, peer: [u8; 32], request_id: u64) {
        let held = {
            let mut tickets = lock(&self.tickets);
            match tickets.get(&request_id) {
                Some(decided) if decided.coordinator == peer => tickets.remove(&request_id),
                _ => None,
            }
        };
        // Dropped here, outside the lock: the steward closes it.
        drop(held);
    }

    /// A coordinator no longer uses its slice of `run_id`: freed, with the
    /// caches kept on it. Only the coordinator that assigned it may.
    pub(crate) fn unassign(&self, peer: [u8; 32], run_id: &str) -> ControlReply {
        let freed = {
            let mut slots = lock(&self.slots);
            match slots.get(run_id) {
                Some(slot) if slot.assign.coordinator == peer => slots.remove(run_id),
                _ => None,
            }
        };
        if let Some(slot) = &freed {
            self.kept.evict_parked_on(&slot.slice);
        }
        match freed {
            Some(_) => {
                tracing::info!(run = %run_id, "released a slice its coordinator no longer uses");
                ControlReply::Released
            }
            None => ControlReply::Refused {
                reason: "no slice of that run from this coordinator".into(),
            },
        }
    }

    /// A request's figures here, for its coordinator only.
    pub(crate) fn request_stats(&self, peer: &[u8; 32], request_id: u64) -> ControlReply {
        let found = lock(&self.stats)
            .iter()
            .rev()
            .find(|(id, _)| *id == request_id)
            .filter(|_| self.serves_coordinator(peer))
            .map(|(_, s)| *s);
        let stats = found.unwrap_or_default();
        ControlReply::Stats {
            found: found.is_some(),
            compute_us: stats.compute.as_micros() as u64,
            decode_engine_us: stats.decode_engine.as_micros() as u64,
            fold_us: stats.fold.as_micros() as u64,
            steps: stats.steps.into(),
        }
    }

    /// At shutdown: decisions for requests that will now never arrive are
    /// released, so none stays in the journal as unresolved.
    pub(crate) fn release_all(&self) {
        let waiting: Vec<PreDecided> = lock(&self.tickets).drain().map(|(_, d)| d).collect();
        drop(waiting);
    }
}

/// A stage's grant decision taken ahead of its request's chain.
pub(crate) struct PreDecided {
    pub(crate) ticket: HeldTicket,
    pub(crate) serve: ServeRequest,
    /// The coordinator that asked.
    pub(crate) coordinator: [u8; 32],
    pub(crate) decided: Instant,
}

/// How long a stage holds a grant decision for a request whose chain never
/// reaches it; then the decision is released (and the release journalled).
pub const PRE_DECIDED_TTL: Duration = Duration::from_secs(60);

/// Largest first message of a `mesh-stage/1` stream (OPEN or DIRECT_OPEN),
/// read before the sender is checked.
pub const MAX_STAGE_OPEN: usize = 4096;

/// Slices a stage node holds at once unless configured.
pub const DEFAULT_MAX_SLICES: usize = 2;

/// How long a stage keeps a slice no request uses, unless configured.
pub const DEFAULT_SLICE_IDLE: Duration = Duration::from_secs(15 * 60);

/// What a stage answers for a run whose slice it does not hold (never
/// assigned, replaced, freed as idle, or lost in a restart): the request
/// fails, and the coordinator assigns again before its next one.
pub const NO_SLICE: &str = "no slice loaded for run";

/// Free the slices no request has used for `slice_idle`, and release grant
/// decisions whose requests never came, until the node stops.
pub(crate) async fn release_idle_slices(stage: std::sync::Weak<StageRole>) {
    loop {
        let every = match stage.upgrade() {
            Some(stage) => {
                (stage.slice_idle / 4).clamp(Duration::from_millis(50), PRE_DECIDED_TTL / 4)
            }
            None => return,
        };
        tokio::time::sleep(every).await;
        let Some(stage) = stage.upgrade() else {
            return;
        };
        stage.expire_pre_decided();
        stage.kept.expire();
        let released: Vec<String> = {
            let mut slots = lock(&stage.slots);
            let idle: Vec<String> = slots
                .iter()
                // A request in flight holds a clone of its slot.
                .filter(|(_, slot)| {
                    Arc::strong_count(slot) == 1
                        && lock(&slot.last_used).elapsed() >= stage.slice_idle
                })
                .map(|(run, _)| run.clone())
                .collect();
            for run in &idle {
                if let Some(slot) = slots.remove(run) {
                    stage.kept.evict_parked_on(&slot.slice);
                }
            }
            idle
        };
        for run in released {
            tracing::info!(run, "released an idle slice");
        }
    }
}

impl StageRole {
    /// Refuse a new slice when the slices of other coordinators fill the bound
    /// (the sender's own run is replaced, so it never counts against it).
    pub(crate) fn check_slice_room(
        &self,
        slots: &HashMap<String, Arc<Slot>>,
        coordinator: [u8; 32],
    ) -> anyhow::Result<()> {
        let others = slots
            .values()
            .filter(|s| s.assign.coordinator != coordinator)
            .count();
        if others >= self.max_slices {
            bail!(
                "this node already holds its maximum of {} slices",
                self.max_slices
            );
        }
        Ok(())
    }

    /// Release grant decisions whose requests never arrived.
    pub(crate) fn expire_pre_decided(&self) {
        let stale: Vec<PreDecided> = {
            let mut tickets = lock(&self.tickets);
            let ids: Vec<u64> = tickets
                .iter()
                .filter(|(_, d)| d.decided.elapsed() >= PRE_DECIDED_TTL)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| tickets.remove(id)).collect()
        };
        drop(stale);
    }

    pub(crate) fn record_stats(&self, request_id: u64, stats: StageStats) {
        let mut all = lock(&self.stats);
        all.push_back((request_id, stats));
        while all.len() > 256 {
            all.pop_front();
        }
    }

    /// Whether this node takes assignments from `peer`: a configured
    /// coordinator, or, when none is configured and the node is in a mesh,
    /// any current member of the mesh.
    pub(crate) fn serves_coordinator(&self, peer: &[u8; 32]) -> bool {
        if self.shared.coordinators.is_empty() {
            self.shared.mesh.get().is_some_and(|m| m.is_member(peer))
        } else {
            self.shared.coordinators.contains(peer)
        }
    }
}
