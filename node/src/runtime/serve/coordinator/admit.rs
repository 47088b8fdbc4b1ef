//! Admit: refuse what cannot run before it costs anything, then take the
//! request's places (a cache, a record slot) and every steward's grant
//! decision, held by one guard ([`Held`]).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, anyhow, bail};
use mesh_protocol::block::SplitKey;
use mesh_protocol::control::{AuthoriseRequest, ControlReply, ControlRequest};
use mesh_protocol::mesh1::{Fidelity, ServeRequest, prompt_hash};
use mesh_protocol::session::RequestScope;
use mesh_stage::cache::CacheLease;

use crate::runtime::client::{GenerateRequest, MAX_PROMPT_BYTES_PER_TOKEN};
use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::net::ALPN_CONTROL;
use crate::runtime::net::msg::{self};
use crate::runtime::net::peers::PeerAddr;
use crate::runtime::serve::coordinator::decision;
use crate::runtime::serve::coordinator::keep::KeepPlan;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::role::RouteRefused;
use crate::runtime::serve::coordinator::role::is_busy;
use crate::runtime::serve::coordinator::route::ESTIMATED_US_PER_LAYER;
use crate::runtime::serve::coordinator::route::chain_name;
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::shared::Deadline;
use crate::runtime::serve::shared::HeldTicket;
use crate::runtime::serve::stats;
use mesh_protocol::route::{Backend, CostBasis};
use std::time::Duration;

/// What one request holds at the coordinator, released when it is dropped,
/// so every exit path (refusal, busy, a failed stage, an error sealing)
/// gives back the same things.
pub(crate) struct Held<'a> {
    pub(crate) coordinator: &'a Arc<CoordinatorRole>,
    pub(crate) request_id: u64,
    /// The coordinator's own slice's cache for this request.
    pub(crate) cache: Option<CacheLease>,
    pub(crate) collector: bool,
    pub(crate) direct: bool,
    /// The coordinator's own grant decision, until the serve is debited.
    pub(crate) ticket: Option<HeldTicket>,
    /// Stages that decided a grant for this request: told to release it at
    /// the end (a no-op where the request reached them and was served).
    pub(crate) authorised: Vec<PeerAddr>,
    /// The task that notices the requester going away.
    pub(crate) watcher: Option<tokio::task::JoinHandle<()>>,
}

impl<'a> Held<'a> {
    pub(crate) fn new(coordinator: &'a Arc<CoordinatorRole>, request_id: u64) -> Self {
        Self {
            coordinator,
            request_id,
            cache: None,
            collector: false,
            direct: false,
            ticket: None,
            authorised: Vec::new(),
            watcher: None,
        }
    }

    pub(crate) fn release_cache(&mut self) {
        self.cache = None;
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.release_cache();
        if let Some(watcher) = self.watcher.take() {
            watcher.abort();
        }
        if self.collector {
            lock(&self.coordinator.collector).take(self.request_id);
        }
        if self.direct {
            lock(&self.coordinator.directs).remove(&self.request_id);
        }
        // Its places are given back: a waiting request may take them.
        self.coordinator.queue.freed();
        for peer in std::mem::take(&mut self.authorised) {
            let coordinator = self.coordinator.clone();
            let request_id = self.request_id;
            tokio::spawn(async move {
                if let Err(error) = release_remote(&coordinator, &peer, request_id).await {
                    tracing::warn!(request_id, %peer, "releasing the request's grant decision: {error:#}");
                }
            });
        }
    }
}

/// A request the coordinator took: what the chain runs, and what it holds.
pub(crate) struct Admitted<'a> {
    pub(crate) held: Held<'a>,
    pub(crate) request_id: u64,
    /// Which request on which split: names its lanes and its block.
    pub(crate) scope: RequestScope,
    pub(crate) prompt_ids: Vec<u32>,
    pub(crate) max_new: usize,
    /// The `mesh/1` request: the requester's own on grants.
    pub(crate) serve: ServeRequest,
    /// The requester's grant shards, by node.
    pub(crate) shards: GrantShards,
    /// A resumed segment's caches kept from the interrupted one.
    pub(crate) keep: Option<KeepPlan>,
    /// A resumed segment: the interrupted segment's request id, which its
    /// stages end at once where it still runs.
    pub(crate) resumes: Option<u64>,
    /// How the router chose the backend (SPEC §4), at the request's start.
    pub(crate) route: mesh_protocol::route::Route,
    /// The tokens the requester asked for (before the context cut them;
    /// 0 for a decision).
    pub(crate) asked_tokens: usize,
    /// A typed decision: scored at the prompt's last position, in place of
    /// the first token.
    pub(crate) decision: Option<decision::DecisionPlan>,
}

/// The requester's grant presentations, one per stage of the first chain,
/// and the nodes of that chain: any chain the request runs on presents
/// each node the shard made out for it.
#[derive(Clone)]
pub(crate) struct GrantShards {
    pub(crate) presentations: Vec<Option<mesh_protocol::grant::Presentation>>,
    pub(crate) nodes: Vec<[u8; 32]>,
}

impl GrantShards {
    pub(crate) fn for_node(&self, key: &[u8; 32]) -> Option<mesh_protocol::grant::Presentation> {
        let k = self.nodes.iter().position(|node| node == key)?;
        self.presentations.get(k).cloned().flatten()
    }
}

impl<'a> Held<'a> {
    /// A request's places on one chain, under a new split key: a cache on
    /// the own slice and a record slot, taken before any grant is decided so
    /// a busy coordinator refuses without deciding anything.
    pub(crate) fn take_places(
        coordinator: &'a Arc<CoordinatorRole>,
        run: &Run,
        capacity: usize,
        kept: Option<CacheLease>,
    ) -> anyhow::Result<(Self, SplitKey)> {
        let split_key = SplitKey {
            coordinator_node_id: coordinator.shared.tls.did.clone(),
            run_id: run.assigns[0].run_id.clone(),
            request_id: u64::from_le_bytes(crate::runtime::keys::random_bytes()?),
        };
        let mut held = Held::new(coordinator, split_key.request_id);
        held.cache = Some(match kept {
            Some(mut lease) => {
                lease.rekey(split_key.request_id)?;
                lease
            }
            None => run
                .own
                .pool
                .open(&run.own.slice, split_key.request_id, capacity)?,
        });
        if !lock(&coordinator.collector).open(split_key.clone(), run.keys.clone()) {
            return Err(anyhow::Error::new(mesh_stage::EngineError::Busy(
                crate::runtime::records::MAX_PENDING_SPLITS,
            ))
            .context("too many requests waiting to be sealed"));
        }
        held.collector = true;
        Ok((held, split_key))
    }

    /// Each remote stage of `run` that holds a shard decides it before any
    /// work runs; each that did is told to release it at the end.
    pub(crate) async fn authorise_stages(
        &mut self,
        run: &Run,
        split_key: &SplitKey,
        serve: &ServeRequest,
        shards: &GrantShards,
    ) -> anyhow::Result<()> {
        for (k, peer) in run.peers.iter().enumerate() {
            let Some(presentation) = shards.for_node(&peer.key) else {
                continue;
            };
            authorise_remote(
                self.coordinator,
                peer,
                &split_key.run_id,
                split_key.request_id,
                serve,
                &presentation,
            )
            .await
            .map_err(|error| {
                anyhow!(
                    "grant refused at stage {} ({}): {error:#}",
                    k + 1,
                    peer.did()
                )
            })?;
            self.authorised.push(peer.clone());
        }
        Ok(())
    }
}

/// Admit: refuse what cannot run before it costs anything, then take the
/// request's places (a cache, a record slot) and every steward's grant
/// decision, in that order, so a busy coordinator decides nothing.
pub(crate) async fn admit<'a>(
    coordinator: &'a Arc<CoordinatorRole>,
    run: &Arc<Run>,
    request: &GenerateRequest,
) -> anyhow::Result<Admitted<'a>> {
    let codec = {
        // Built at a mesh node's first request as a coordinator: reading a
        // vocabulary takes a moment the node's stage steps must not wait for.
        let shared = Arc::clone(&coordinator.shared);
        tokio::task::spawn_blocking(move || shared.model.text().map(Arc::clone)).await??
    };
    let codec = codec.as_ref();
    let context = coordinator.shared.context();
    // A prompt that cannot fit is refused before it costs any tokenizing
    // (a decision's prompt holds its question and options too).
    let prompt_bytes = request.prompt.len()
        + request.decision.as_ref().map_or(0, |ask| {
            ask.question.len() + ask.options.iter().map(String::len).sum::<usize>()
        });
    if prompt_bytes > context.saturating_mul(MAX_PROMPT_BYTES_PER_TOKEN) {
        bail!("a prompt of {prompt_bytes} bytes cannot fit the context of {context} tokens");
    }
    if request.decision.is_some() && request.grant.is_some() {
        bail!("a typed decision on grant shards is not served yet: ask it without a grant");
    }
    let (prompt_ids, decision) = tokio::task::block_in_place(|| -> anyhow::Result<_> {
        // A decision runs on its own prompt: the state, the question and
        // its options under letters.
        let decision = request
            .decision
            .as_ref()
            .map(|ask| {
                decision::plan(
                    codec,
                    &request.prompt,
                    ask,
                    request.chat,
                    coordinator.shared.model.config().vocab,
                )
            })
            .transpose()?;
        let prompt_ids = match &decision {
            Some(plan) => plan.prompt_ids.clone(),
            None if request.chat => codec.encode(&codec.chat_prompt(&request.prompt)?)?,
            None => codec.encode(&request.prompt)?,
        };
        Ok((prompt_ids, decision))
    })?;
    if prompt_ids.is_empty() || prompt_ids.len() >= context {
        bail!(
            "a prompt of {} tokens does not fit the context of {context}",
            prompt_ids.len()
        );
    }
    // A decision emits no token: its one step is the prompt's prefill
    // (the cache keeps the one position a step after it would take).
    let max_new = match &decision {
        Some(_) => 1,
        None => request.max_tokens.clamp(1, context - prompt_ids.len()),
    };
    let serve = ServeRequest {
        // A decision's request is its whole prompt (state, question and
        // options), so another question about the same state is another
        // request.
        prompt_hash: prompt_hash(
            decision
                .as_ref()
                .map_or(request.prompt.as_bytes(), |plan| plan.text.as_bytes()),
        ),
        prompt_tokens: u32::try_from(prompt_ids.len()).unwrap_or(u32::MAX),
        max_tokens: match &decision {
            Some(_) => 0,
            None => u32::try_from(max_new).unwrap_or(u32::MAX),
        },
        fidelity_floor: request.bounds.fidelity_floor.unwrap_or(Fidelity::F0),
        joule_ceiling_uj: request.bounds.joule_ceiling_uj.unwrap_or(u64::MAX),
        decision: decision
            .as_ref()
            .map(|plan| mesh_protocol::mesh1::Decision {
                questions: 1,
                options_scored: plan.options.len() as u32,
                schema_tokens: plan.schema_tokens,
            }),
    };
    let (serve, presentations) = granted_request(request, serve, decision.is_some())?;
    let max_new = match &decision {
        Some(_) => max_new,
        None => max_new.min(serve.max_tokens.max(1) as usize),
    };
    let capacity = prompt_ids.len() + max_new;
    let asked_tokens = match (&request.grant, &decision) {
        (_, Some(_)) => 0,
        (None, None) => request.max_tokens.max(1),
        (Some(granted), None) => (granted.serve.max_tokens as usize).max(1),
    };
    // Route (SPEC §4) before anything is held, over the weights every
    // presented grant permits (each steward refuses others).
    let model_in = mesh_protocol::grant::permitted_models(
        presentations
            .iter()
            .flatten()
            .flat_map(|p| p.chain.iter().flat_map(|link| &link.grant.caveats)),
    );
    let route = route_or_refuse(coordinator, run, &serve, model_in.as_deref())?;

    // Everything this request holds is released by `held` on every path.
    let (mut held, split_key) = Held::take_places(coordinator, run, capacity, None)?;
    let shards = GrantShards {
        presentations,
        nodes: run.keys.clone(),
    };
    // Every steward decides its own grant shard before any work runs.
    let own_presentation = shards.for_node(&coordinator.shared.tls.public_key);
    let ticket = lock(&coordinator.shared.steward)
        .authorise(
            own_presentation.as_ref(),
            &serve,
            Some(coordinator.shared.model.weights_digest()),
            run.backend(),
            now_ms(),
        )
        .map_err(|error| match own_presentation {
            Some(_) => anyhow!("grant refused at the coordinator: {error}"),
            None => anyhow!("the coordinator cannot take the request: {error}"),
        })?;
    held.ticket = Some(HeldTicket::new(&coordinator.shared, ticket));
    held.authorise_stages(run, &split_key, &serve, &shards)
        .await?;
    Ok(Admitted {
        request_id: split_key.request_id,
        held,
        scope: request_scope(coordinator, run, split_key),
        prompt_ids,
        max_new,
        serve,
        shards,
        keep: None,
        resumes: None,
        route,
        asked_tokens,
        decision,
    })
}

/// The request as priced: the requester's granted request when it comes
/// with grant shards (checked against the prompt sent and what it asks
/// for), with their presentations, one per stage; else the request as read.
fn granted_request(
    request: &GenerateRequest,
    serve: ServeRequest,
    decision: bool,
) -> anyhow::Result<(
    ServeRequest,
    Vec<Option<mesh_protocol::grant::Presentation>>,
)> {
    Ok(match &request.grant {
        None => (serve, Vec::new()),
        Some(granted) => {
            if granted.serve.prompt_hash != serve.prompt_hash {
                bail!("the granted request's prompt_hash is not BLAKE3 of the prompt sent");
            }
            let presentations = granted
                .presentations
                .iter()
                .map(|p| {
                    if p.is_empty() {
                        Ok(None)
                    } else {
                        mesh_protocol::grant::Presentation::decode(p).map(Some)
                    }
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow!("a presentation does not decode: {e}"))?;
            if granted.serve.decision.is_some() != decision {
                bail!(
                    "the granted request is priced as a {} but asks for a {}",
                    if granted.serve.decision.is_some() {
                        "decision"
                    } else {
                        "generation"
                    },
                    if decision { "decision" } else { "generation" }
                );
            }
            (granted.serve.clone(), presentations)
        }
    })
}

/// Weigh the backends a request on `run` may be served on. A request no
/// backend can serve within its floor and ceiling is refused: journalled
/// with its route table (at most so many a minute), counted, and answered
/// with each backend's reason.
pub(crate) fn route_or_refuse(
    coordinator: &CoordinatorRole,
    run: &Run,
    serve: &ServeRequest,
    model_in: Option<&[[u8; 32]]>,
) -> anyhow::Result<mesh_protocol::route::Route> {
    let route = mesh_protocol::route::route_within(
        &mesh_protocol::route::RouteRequest::from(serve),
        model_in,
        &backends(coordinator, run),
    )?;
    let Some(refusal) = route.refusal() else {
        return Ok(route);
    };
    stats::Counters::bump(&coordinator.shared.counters.requests_refused_route);
    let journalled = lock(&coordinator.routing.refusal_journal).admit(Instant::now());
    if let Some(unjournalled) = journalled
        && let Err(error) = lock(&coordinator.shared.steward).record_refusal(
            serve.request_id(),
            &route,
            unjournalled,
            now_ms(),
        )
    {
        // The refusal stands whether or not the journal took it.
        tracing::warn!("a route refusal was not journalled: {error}");
    }
    Err(RouteRefused(refusal).into())
}

/// Which request on which split a segment serves: names its lanes and
/// its block.
pub(crate) fn request_scope(
    coordinator: &CoordinatorRole,
    run: &Run,
    split: SplitKey,
) -> RequestScope {
    RequestScope {
        split,
        stage_count: run.assigns.len() as u32,
        return_mode: coordinator.settings.return_mode,
    }
}

pub(crate) async fn authorise_remote(
    coordinator: &Arc<CoordinatorRole>,
    peer: &PeerAddr,
    run_id: &str,
    request_id: u64,
    serve: &ServeRequest,
    presentation: &mesh_protocol::grant::Presentation,
) -> anyhow::Result<()> {
    let (mut send, mut recv) = coordinator.shared.net.open(peer, ALPN_CONTROL).await?;
    let message = ControlRequest::Authorise(Box::new(AuthoriseRequest {
        run_id: run_id.to_string(),
        request_id,
        serve_request: serve.clone(),
        presentation: presentation.clone(),
    }))
    .to_cbor();
    let reply = msg::exchange(&mut send, &mut recv, &message, msg::IDLE_TIMEOUT)
        .await?
        .context("no answer to the authorisation")?;
    match ControlReply::from_cbor(&reply)? {
        ControlReply::Authorised => Ok(()),
        ControlReply::Refused { reason } => bail!("{reason}"),
        other => bail!("the stage answered `{}` to authorise", other.kind()),
    }
}

pub(crate) async fn release_remote(
    coordinator: &Arc<CoordinatorRole>,
    peer: &PeerAddr,
    request_id: u64,
) -> anyhow::Result<()> {
    let (mut send, mut recv) = coordinator.shared.net.open(peer, ALPN_CONTROL).await?;
    let request = ControlRequest::Release { request_id }.to_cbor();
    msg::exchange(&mut send, &mut recv, &request, msg::IDLE_TIMEOUT).await?;
    Ok(())
}

/// The backends a request on `run` is weighed over: the model this node
/// serves on the chain the planner (or the configured peers) gave.
pub(crate) fn backends(coordinator: &CoordinatorRole, run: &Run) -> Vec<Backend> {
    let name = chain_name(run);
    let metered = lock(&coordinator.routing.costs).per_token(&name);
    let (uj_per_token, cost_basis) = match metered {
        Some(uj) => (uj, CostBasis::Metered),
        None => {
            let layers = u64::from(coordinator.shared.model.config().layers);
            let us = run
                .projected_us
                .unwrap_or(layers.saturating_mul(ESTIMATED_US_PER_LAYER));
            let estimator = lock(&coordinator.shared.steward).estimator();
            (
                estimator.estimate_uj(Duration::from_micros(us)),
                CostBasis::Estimator,
            )
        }
    };
    vec![Backend {
        name,
        recipe: coordinator.shared.model_id(),
        fidelity: coordinator.routing.fidelity,
        uj_per_token,
        uj_per_option_scored: 0,
        cost_basis,
        weights: Some(coordinator.shared.model.weights_digest()),
    }]
}

/// Admit `request`, waiting in the queue while every place is taken: until
/// a place comes free, its deadline passes, or (at once) the queue is full.
pub(crate) async fn admit_in_turn<'a>(
    coordinator: &'a Arc<CoordinatorRole>,
    run: &Arc<Run>,
    request: &GenerateRequest,
    deadline: Deadline,
) -> anyhow::Result<Admitted<'a>> {
    let queue = &coordinator.queue;
    let pool = &run.own.pool;
    let mut place = None;
    let mut busy: Option<anyhow::Error> = None;
    loop {
        // Registered before the attempt, so a place freed between a busy
        // answer and the wait is not missed.
        let freed = queue.notified();
        if queue.is_closed() {
            return Err(anyhow::anyhow!(
                crate::runtime::serve::coordinator::queue::SHUTTING_DOWN
            ));
        }
        // A waiting request tries again (its prompt read again) only when
        // the own slice has room.
        if busy.is_none() || pool.open_requests() < pool.max_requests() {
            match admit(coordinator, run, request).await {
                Err(error) if is_busy(&error) => busy = Some(error),
                other => return other,
            }
        }
        if place.is_none() {
            place = queue.join();
            if place.is_none() {
                let error = busy.unwrap_or_else(|| anyhow::anyhow!("busy"));
                return Err(error.context(format!(
                    "{} requests wait for a place already (--max-queued)",
                    queue.max_queued()
                )));
            }
        }
        if deadline.is_past() {
            let error = busy.unwrap_or_else(|| anyhow::anyhow!("busy"));
            return Err(error.context("no place came free before the request's deadline"));
        }
        let _ = tokio::time::timeout(
            deadline.bound(crate::runtime::serve::coordinator::queue::RECHECK),
            freed,
        )
        .await;
    }
}
