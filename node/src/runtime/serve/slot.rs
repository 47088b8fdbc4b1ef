//! A loaded slice and the assignment it serves: its cache pool and batch
//! worker. A stage holds one per served coordinator; a coordinator holds
//! its own.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use mesh_protocol::cbor::Cbor;
use mesh_protocol::control::{AssignRequest, ControlRequest};
use mesh_protocol::identity::{did_key, parse_did_key};
use mesh_stage::LayerSlice;
use mesh_stage::cache::CachePool;

use crate::runtime::clock::lock;
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::batch;

#[derive(Debug, Clone)]
pub(crate) struct Assign {
    pub(crate) run_id: String,
    pub(crate) package_id: [u8; 32],
    pub(crate) layer_start: u32,
    pub(crate) layer_end: u32,
    pub(crate) stage_index: u32,
    pub(crate) stage_count: u32,
    pub(crate) coordinator: [u8; 32],
    pub(crate) coordinator_addr: SocketAddr,
    /// The only node that may open requests on this stage: the previous one.
    pub(crate) upstream: [u8; 32],
    pub(crate) downstream: Option<PeerAddr>,
    pub(crate) topology_hash: String,
    pub(crate) manifest: [u8; 32],
}

impl Assign {
    pub(crate) fn to_cbor(&self) -> Cbor {
        ControlRequest::Assign(AssignRequest {
            run_id: self.run_id.clone(),
            package_id: self.package_id,
            manifest_sha256: self.manifest,
            layer_start: self.layer_start,
            layer_end: self.layer_end,
            stage_index: self.stage_index,
            stage_count: self.stage_count,
            coordinator: did_key(&self.coordinator),
            coordinator_addr: self.coordinator_addr.to_string(),
            topology_hash: self.topology_hash.clone(),
            upstream: did_key(&self.upstream),
            downstream: self.downstream.as_ref().map(PeerAddr::to_string),
        })
        .to_cbor()
    }

    /// The node's own form of an assignment.
    pub(crate) fn from_request(a: &AssignRequest) -> anyhow::Result<Self> {
        Ok(Self {
            run_id: a.run_id.clone(),
            package_id: a.package_id,
            layer_start: a.layer_start,
            layer_end: a.layer_end,
            stage_index: a.stage_index,
            stage_count: a.stage_count,
            coordinator: parse_did_key(&a.coordinator)
                .context("assign: coordinator is not a did:key")?,
            coordinator_addr: a
                .coordinator_addr
                .parse()
                .context("assign: coordinator_addr")?,
            upstream: parse_did_key(&a.upstream).context("assign: upstream is not a did:key")?,
            downstream: a
                .downstream
                .as_deref()
                .map(str::parse::<PeerAddr>)
                .transpose()?,
            topology_hash: a.topology_hash.clone(),
            manifest: a.manifest_sha256,
        })
    }
}

pub(crate) struct Slot {
    pub(crate) slice: Arc<LayerSlice>,
    /// Shared with the slot of a later run on the same layers, so a cache
    /// kept across a resume stays counted once, in one pool.
    pub(crate) pool: Arc<CachePool>,
    /// Runs every step on this slice, batching concurrent requests.
    pub(crate) batcher: Arc<batch::Batcher>,
    pub(crate) assign: Assign,
    /// When a request last opened or ended on this slice.
    pub(crate) last_used: Mutex<Instant>,
}

impl Slot {
    pub(crate) fn new(
        slice: LayerSlice,
        max_requests: usize,
        context: usize,
        assign: Assign,
    ) -> Self {
        let slice = Arc::new(slice);
        Self {
            batcher: Arc::new(batch::Batcher::start(slice.clone(), max_requests)),
            slice,
            pool: Arc::new(CachePool::new(max_requests, context)),
            assign,
            last_used: Mutex::new(Instant::now()),
        }
    }

    /// The same loaded layers under a new run's assignment: nothing is
    /// loaded again, and the caches of requests on the old run (a kept
    /// cache among them) stay valid on the new one.
    pub(crate) fn reassigned(&self, assign: Assign) -> Self {
        Self {
            slice: self.slice.clone(),
            pool: self.pool.clone(),
            batcher: self.batcher.clone(),
            assign,
            last_used: Mutex::new(Instant::now()),
        }
    }

    /// Whether this slot holds the layers `assign` names, of the same
    /// coordinator: a new run may take it over.
    pub(crate) fn holds_layers_of(&self, assign: &Assign) -> bool {
        self.assign.coordinator == assign.coordinator
            && self.assign.package_id == assign.package_id
            && self.assign.layer_start == assign.layer_start
            && self.assign.layer_end == assign.layer_end
    }

    pub(crate) fn touch(&self) {
        *lock(&self.last_used) = Instant::now();
    }
}
