//! Plan: the chain requests run on, planned over the mesh's members and
//! assigned to them, and planned again when a member is lost or a better
//! chain appears.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use mesh_protocol::cbor::Cbor;
use mesh_protocol::control::{ControlReply, ControlRequest};
use mesh_protocol::identity::did_key;
use mesh_protocol::receipt::Assignment;

use crate::runtime::clock::lock;
use crate::runtime::net::ALPN_CONTROL;
use crate::runtime::net::msg::{self};
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::coordinator::reputation::Reputation;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::runs::Candidates;
use crate::runtime::serve::coordinator::runs::Chain;
use crate::runtime::serve::coordinator::runs::MIN_REPLAN_GAIN;
use crate::runtime::serve::coordinator::runs::PlanCache;
use crate::runtime::serve::coordinator::runs::REFUSED_MEMBER_PAUSE;
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::coordinator::runs::Usable;
use crate::runtime::serve::coordinator::runs::{ANY_CHAIN, MESH_SETTLE_WAIT, RESUME_SETTLE_WAIT};
use crate::runtime::serve::slot::Assign;
use crate::runtime::serve::stage::role::DEFAULT_SLICE_IDLE;

impl CoordinatorRole {
    /// The chain the next run uses: the configured peers split by bytes, or
    /// the planner's choice over the mesh's current members. Over a mesh the
    /// current run is kept while every stage of it is still a usable member
    /// and the new plan is not `MIN_REPLAN_GAIN` faster: round trips jitter,
    /// and each new run costs every stage a new assignment.
    pub(crate) fn chain(&self, current: Option<&Run>, at_least: usize) -> anyhow::Result<Chain> {
        let layers = self.shared.model.config().layers;
        if !self.shared.peers.is_empty() {
            let stages = self.shared.peers.len() as u32 + 1;
            if stages > layers {
                bail!("{stages} stages for a model of {layers} layers");
            }
            if stages as usize > mesh_protocol::receipt::MAX_STAGES {
                bail!(
                    "{stages} stages: a split's receipt routes at most {}",
                    mesh_protocol::receipt::MAX_STAGES
                );
            }
            // By bytes, not layer counts: the first slice (this node's) also
            // holds the embedding and the output head.
            let ranges = mesh_stage::split_by_bytes(
                &self.shared.model.layer_bytes().with_head_on_first(),
                stages,
            );
            return Ok((self.shared.peers.clone(), ranges, None));
        }
        // No peers and no mesh: a node started as a stage of the
        // coordinators it names (`--coordinator`), which does not take
        // requests of its own. (A node alone on a machine is in a mesh of
        // one, and plans as any coordinator does.)
        let Some(mesh) = self.shared.mesh.get() else {
            bail!(
                "this node serves as a stage of its --coordinator(s) and coordinates no requests; \
                 start it with --peer HOST:PORT to coordinate over peers, or without \
                 --coordinator to serve alone or over a mesh"
            );
        };
        let (mut plan, usable, (own, others)) = self.plan_now(mesh, at_least)?;
        // A chain that lost a stage keeps its survivors where they were
        // (their loaded layers, and the caches a resumed request keeps)
        // when that costs little more than the best plan.
        if let Some(run) = current
            && run.projected_us.is_some()
            && !run.peers.iter().all(|p| usable.contains(&(p.key, p.addr)))
        {
            let interrupted: Vec<([u8; 32], std::ops::Range<u32>)> = run
                .keys
                .iter()
                .zip(&run.assigns)
                .map(|(key, a)| (*key, a.layer_start..a.layer_end))
                .collect();
            if let Some(kept) = mesh_protocol::plan::keep_in_place(
                &crate::runtime::planner::model_shape(&self.shared.model),
                &own,
                &others,
                &interrupted,
                &plan,
                MIN_REPLAN_GAIN,
            ) {
                plan = kept;
            }
        }
        if let Some(run) = current
            && let Some(before) = run.projected_us
            && run.assigns.len() >= at_least
            && run.peers.iter().all(|p| usable.contains(&(p.key, p.addr)))
            && plan
                .projected_us_per_token
                .saturating_mul(MIN_REPLAN_GAIN.1)
                > before.saturating_mul(MIN_REPLAN_GAIN.0)
        {
            let ranges = run
                .assigns
                .iter()
                .map(|a| a.layer_start..a.layer_end)
                .collect();
            return Ok((run.peers.clone(), ranges, Some(before)));
        }
        for (node, why) in &plan.left_out {
            tracing::info!(
                "planned without {}: {}",
                mesh_protocol::identity::did_key(node),
                why.describe()
            );
        }
        let members = mesh.members();
        let mut peers = Vec::new();
        for stage in &plan.stages[1..] {
            let advert = members
                .iter()
                .find(|m| m.advert.node_id == stage.node_id)
                .map(|m| &m.advert)
                .context("a planned member left while planning")?;
            peers.push(PeerAddr {
                key: stage.node_id,
                addr: advert.quic.parse().context("a member's data address")?,
            });
        }
        let ranges = plan.stages.iter().map(|s| s.layers.clone()).collect();
        Ok((peers, ranges, Some(plan.projected_us_per_token)))
    }

    /// The planner's plan over the mesh as it is now, and the members it
    /// could have used (key and data address).
    pub(crate) fn plan_now(
        &self,
        mesh: &crate::runtime::mesh::Mesh,
        at_least: usize,
    ) -> anyhow::Result<(mesh_protocol::plan::Plan, Vec<Usable>, Candidates)> {
        use mesh_protocol::plan::{LeftOut, Stages};
        // Planning weighs every member (milliseconds for a large model and
        // mesh): the same member set and refusals give the plan made last.
        // The generation first: a change after it makes the next call plan
        // again, never a plan cached under a generation it did not see.
        let generation = mesh.generation();
        let members = mesh.members();
        let addresses: Vec<([u8; 32], String)> = members
            .iter()
            .map(|m| (m.advert.node_id, m.advert.quic.clone()))
            .collect();
        let refused_now: Vec<[u8; 32]> = {
            let mut refused = lock(&self.planning.refused);
            // A pause ends when it runs out, or when the member left and
            // came back since (a restarted node is not the one that refused).
            let member_for: HashMap<[u8; 32], Duration> = members
                .iter()
                .map(|m| (m.advert.node_id, Duration::from_millis(m.member_for_ms)))
                .collect();
            let now = Instant::now();
            refused.retain(|key, until| {
                let refused_ago =
                    REFUSED_MEMBER_PAUSE.saturating_sub(until.saturating_duration_since(now));
                now < *until && member_for.get(key).is_none_or(|stay| *stay >= refused_ago)
            });
            let mut keys: Vec<[u8; 32]> = refused.keys().copied().collect();
            keys.sort_unstable();
            keys
        };
        let (failed_audit, stalled, planned_speeds) = {
            let reputation = lock(&self.planning.reputation);
            let now = Instant::now();
            (
                reputation.left_out(now),
                reputation.stalled_out(now),
                reputation.planned_speeds(),
            )
        };
        if let Some(cached) = lock(&self.planning.cache).as_ref()
            && cached.generation == generation
            && cached.at_least == at_least
            && cached.refused == refused_now
            && cached.failed_audit == failed_audit
            && cached.stalled == stalled
            && cached.planned_speeds == planned_speeds
            && cached.addresses == addresses
        {
            return Ok((
                cached.plan.clone(),
                cached.usable.clone(),
                cached.candidates.clone(),
            ));
        }
        let (own, mut others) = crate::runtime::planner::candidates(
            &self.shared.model.package_id(),
            &self.shared.tls.public_key,
            &members,
        )?;
        // The refusals the plan is cached under are the ones it weighs.
        for (candidate, reason) in &mut others {
            if reason.is_none() && refused_now.binary_search(&candidate.node_id).is_ok() {
                *reason = Some(LeftOut::Refused);
            }
            if reason.is_none() && failed_audit.binary_search(&candidate.node_id).is_ok() {
                *reason = Some(LeftOut::FailedAudit);
            }
            if reason.is_none() && stalled.binary_search(&candidate.node_id).is_ok() {
                *reason = Some(LeftOut::Stalled);
            }
        }
        // An over-claimer is planned at the speed it showed, discounted.
        Reputation::discount(&mut others, &planned_speeds);
        // One stage is this node alone: a split is planned only where it
        // is faster, or where the model does not fit this node.
        let stages = match self.planning.stages {
            Some(0) => bail!("--stages 0: give at least 1"),
            Some(n) if n < at_least => {
                bail!("--stages {n}: a resumed request needs a split of at least {at_least}")
            }
            Some(n) => Stages::Pinned(n),
            None => Stages::AtLeast(at_least),
        };
        let usable: Vec<Usable> = others
            .iter()
            .filter(|(_, reason)| reason.is_none())
            .filter_map(|(candidate, _)| {
                let advert = &members
                    .iter()
                    .find(|m| m.advert.node_id == candidate.node_id)?
                    .advert;
                Some((candidate.node_id, advert.quic.parse().ok()?))
            })
            .collect();
        let plan = crate::runtime::planner::plan_relayed_last(
            &crate::runtime::planner::model_shape(&self.shared.model),
            &own,
            &others,
            stages,
        )
        .map_err(|error| {
            anyhow!(
                "no plan over the mesh's {} member(s): {error}",
                members.len()
            )
        })?;
        *lock(&self.planning.cache) = Some(PlanCache {
            generation,
            at_least,
            addresses,
            refused: refused_now,
            failed_audit,
            stalled,
            planned_speeds,
            plan: plan.clone(),
            usable: usable.clone(),
            candidates: (own.clone(), others.clone()),
        });
        Ok((plan, usable, (own, others)))
    }

    /// Tell a stage its slice of `run_id` is no longer used (best effort,
    /// bounded: a stage that is gone or slow frees it by its idle timer).
    pub(crate) async fn unassign_remote(
        self: &Arc<Self>,
        peer: &PeerAddr,
        run_id: &str,
    ) -> anyhow::Result<()> {
        let message = ControlRequest::Unassign {
            run_id: run_id.to_string(),
        }
        .to_cbor();
        let exchange = async {
            let (mut send, mut recv) = self.shared.net.open(peer, ALPN_CONTROL).await?;
            msg::exchange(&mut send, &mut recv, &message, Duration::from_secs(5)).await
        };
        match tokio::time::timeout(Duration::from_secs(10), exchange).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(error),
            Err(_) => bail!("no answer within 10 s"),
        }
    }

    /// Send every remote stage its assignment at once and wait for all to be
    /// ready; the time after which they are to be sent again.
    pub(crate) async fn assign_remote(
        self: &Arc<Self>,
        peers: &[PeerAddr],
        assigns: &[Assign],
    ) -> anyhow::Result<Duration> {
        let mut waits = Vec::new();
        for (peer, assign) in peers.iter().zip(assigns.iter().skip(1)) {
            let coordinator = self.clone();
            let peer = peer.clone();
            let message = assign.to_cbor();
            waits.push(tokio::spawn(async move {
                let (mut send, mut recv) = coordinator.shared.net.open(&peer, ALPN_CONTROL).await?;
                let reply = msg::exchange(&mut send, &mut recv, &message, Duration::from_secs(300))
                    .await?
                    .context("no answer to the assignment")?;
                match ControlReply::from_cbor(&reply)? {
                    ControlReply::Ready { slice_idle_ms, .. } => {
                        Ok::<Duration, anyhow::Error>(Duration::from_millis(slice_idle_ms))
                    }
                    ControlReply::Refused { reason } => bail!("{peer} refused its slice: {reason}"),
                    other => bail!("{peer} answered `{}` to its assignment", other.kind()),
                }
            }));
        }
        let mut shortest = DEFAULT_SLICE_IDLE;
        let mut failed = None;
        for (peer, wait) in peers.iter().zip(waits) {
            match wait.await.map_err(|e| anyhow!("assignment task: {e}")) {
                Ok(Ok(idle)) => shortest = shortest.min(idle),
                Ok(Err(error)) | Err(error) => {
                    if self.shared.mesh.get().is_some() {
                        // The next plan goes around it for a while.
                        lock(&self.planning.refused)
                            .insert(peer.key, Instant::now() + REFUSED_MEMBER_PAUSE);
                        self.planning
                            .refusals
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        lock(&self.planning.reputation).refused(peer.key);
                    }
                    failed.get_or_insert(error);
                }
            }
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(shortest / 2),
        }
    }

    /// The run for the next request: the current one while its chain is
    /// still the one to use (re-sending its assignments when a stage may
    /// have lost its slice), or a new run (a new `run_id`) over the chain
    /// the configured peers or the mesh's members give now. Requests in
    /// flight keep the run they started on. Over a mesh, a chain whose
    /// assignment is refused is planned again around the refusing member.
    pub(crate) async fn ensure_run(self: &Arc<Self>, at_least: usize) -> anyhow::Result<Arc<Run>> {
        let settle = if at_least > ANY_CHAIN {
            RESUME_SETTLE_WAIT
        } else {
            MESH_SETTLE_WAIT
        };
        let until = Instant::now() + settle;
        // Said once per reason, not at every look.
        let mut said = String::new();
        loop {
            let refused_before = self
                .planning
                .refusals
                .load(std::sync::atomic::Ordering::Relaxed);
            match self.ensure_run_once(at_least).await {
                Err(error) if self.shared.mesh.get().is_some() && Instant::now() < until => {
                    let why = format!("{error:#}");
                    if why != said {
                        tracing::info!("planning again: {why}");
                        said = why;
                    }
                    let refused_now = self
                        .planning
                        .refusals
                        .load(std::sync::atomic::Ordering::Relaxed)
                        > refused_before;
                    if let Some(mesh) = self.shared.mesh.get().filter(|_| !refused_now) {
                        // Members may still be joining (a node just
                        // started, or this one restarted and they are
                        // reconnecting): wait for the mesh to change. A
                        // member that refused is planned around at once.
                        let left = until.saturating_duration_since(Instant::now());
                        mesh.changed(left.min(Duration::from_secs(2))).await;
                    }
                }
                outcome => return outcome,
            }
        }
    }

    pub(crate) async fn ensure_run_once(
        self: &Arc<Self>,
        at_least: usize,
    ) -> anyhow::Result<Arc<Run>> {
        let mut guard = self.run.lock().await;
        let (peers, ranges, projected_us) = self.chain(guard.as_deref(), at_least)?;
        if let Some(run) = guard.as_ref().filter(|run| {
            run.peers == peers
                && run
                    .assigns
                    .iter()
                    .map(|a| a.layer_start..a.layer_end)
                    .eq(ranges.iter().cloned())
        }) {
            let stale = run.stale.swap(false, std::sync::atomic::Ordering::Relaxed);
            if stale || lock(&run.own.last_used).elapsed() >= run.refresh_after {
                // A stage may have freed its slice as idle, or restarted:
                // assigning again keeps the slice it holds, or loads it anew.
                if let Err(error) = self.assign_remote(&run.peers, &run.assigns).await {
                    run.stale.store(true, std::sync::atomic::Ordering::Relaxed);
                    return Err(error);
                }
                run.own.touch();
            }
            return Ok(run.clone());
        }
        let stages = ranges.len() as u32;
        let run_id = format!(
            "mesh-split-{}",
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        let mut keys = vec![self.shared.tls.public_key];
        keys.extend(peers.iter().map(|p| p.key));
        let topology: Vec<Assignment> = ranges
            .iter()
            .zip(&keys)
            .map(|(r, key)| Assignment {
                node_id: did_key(key),
                layer_start: r.start,
                layer_end: r.end,
                package_id: self.shared.model.package_id(),
            })
            .collect();
        let topology_hash = topology_hash(&topology);
        let mut assigns = Vec::new();
        for (k, range) in ranges.iter().enumerate() {
            let assign = Assign {
                run_id: run_id.clone(),
                package_id: self.shared.model.package_id(),
                layer_start: range.start,
                layer_end: range.end,
                stage_index: k as u32,
                stage_count: stages,
                coordinator: self.shared.tls.public_key,
                coordinator_addr: self.shared.advertise,
                upstream: keys[k.saturating_sub(1)],
                downstream: peers.get(k).cloned(),
                topology_hash: topology_hash.clone(),
                manifest: self.shared.model.manifest_sha256(),
            };
            assigns.push(assign);
        }
        // Remote stages load in parallel with the own slice.
        let remote = {
            let coordinator = self.clone();
            let (peers, assigns) = (peers.clone(), assigns.clone());
            tokio::spawn(async move { coordinator.assign_remote(&peers, &assigns).await })
        };
        let own_range = ranges[0].clone();
        // The coordinator holds the output head: the final stage returns its
        // hidden state, and the logits are computed (and sampled) here. A
        // new run on the same own layers keeps the loaded slice (and the
        // caches of requests resumed onto it).
        let kept_own = guard
            .as_ref()
            .filter(|old| old.own.holds_layers_of(&assigns[0]))
            .map(|old| Arc::new(old.own.reassigned(assigns[0].clone())));
        let own = match kept_own {
            Some(own) => own,
            None => {
                let own_slice = tokio::task::block_in_place(|| {
                    self.shared.model.load_chain_slice(own_range, true)
                })?;
                self.shared.slot(own_slice, assigns[0].clone())
            }
        };
        let refresh_after = remote
            .await
            .map_err(|e| anyhow!("assignment task: {e}"))??;
        tracing::info!(
            run_id,
            stages,
            ranges = ?ranges,
            "a new run: assigned every stage"
        );
        let run = Arc::new(Run {
            peers,
            projected_us,
            assigns,
            topology,
            keys,
            own,
            refresh_after,
            stale: std::sync::atomic::AtomicBool::new(false),
        });
        *lock(&self.own_slot) = Some(run.own.clone());
        if let Some(old) = guard.replace(run.clone()) {
            // Stages the new plan left out free their slices now rather
            // than when their idle timer runs out; not while a request still
            // runs on the old run (its OPEN may not have reached them yet).
            let dropped: Vec<PeerAddr> = old
                .peers
                .iter()
                .filter(|p| !run.peers.contains(p))
                .cloned()
                .collect();
            if !dropped.is_empty() {
                let coordinator = self.clone();
                tokio::spawn(async move {
                    let run_id = old.assigns[0].run_id.clone();
                    let waited = Instant::now();
                    // This task holds the last reference but for requests.
                    while Arc::strong_count(&old) > 1
                        && waited.elapsed() < coordinator.shared.request_timeout
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    drop(old);
                    for peer in dropped {
                        if let Err(error) = coordinator.unassign_remote(&peer, &run_id).await {
                            tracing::debug!(peer = %peer.did(), "unassign: {error:#}");
                        }
                    }
                });
            }
        }
        Ok(run)
    }
}

/// The hash that binds a run's records to its topology: BLAKE3 of each
/// stage's node and layers, in CBOR.
fn topology_hash(topology: &[Assignment]) -> String {
    let cbor = Cbor::Array(
        topology
            .iter()
            .map(|a| {
                Cbor::text_map([
                    ("node_id", Cbor::text(&a.node_id)),
                    ("layer_start", Cbor::Uint(a.layer_start.into())),
                    ("layer_end", Cbor::Uint(a.layer_end.into())),
                ])
            })
            .collect(),
    );
    mesh_protocol::hex::encode(blake3::hash(&cbor.encode()).as_bytes())
}
