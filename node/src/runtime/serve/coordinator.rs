//! The coordinator's side of one request, and the requester's client.

use super::*;

use mesh_protocol::control::{
    AuthoriseRequest, ControlReply, ControlRequest, GenerateRequestMessage,
};
use mesh_protocol::json::canonical_bytes;
use mesh_protocol::session::{HopSession, RequestScope, SliceFacts, Wire};
use mesh_stage::text::TextStream;

use crate::runtime::client::{GenerateRequest, MAX_PROMPT_BYTES_PER_TOKEN};
use serde_json::json;

async fn send_error(send: &mut quinn::SendStream, reason: &str) -> anyhow::Result<()> {
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
pub(super) fn bounded_reason(reason: &str) -> String {
    let mut end = reason.len().min(mesh_protocol::control::MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_string()
}

/// Where the text shown so far ends, and whether a stop sequence ended the
/// generation: before the first stop sequence in `text`; else, unless this
/// is the `last` step, before the longest tail of `text` that could still
/// grow into one (so no part of a stop sequence is ever shown); else all
/// of it.
fn shown_end(text: &str, stop: &[String], last: bool) -> (usize, bool) {
    if let Some(at) = stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        return (at, true);
    }
    if last {
        return (text.len(), false);
    }
    // A character still missing bytes decodes as U+FFFD for now: hold it
    // back until its bytes arrive, or its replacement would be streamed.
    let text = text.trim_end_matches('\u{FFFD}');
    let held = stop
        .iter()
        .filter_map(|s| {
            (1..s.len())
                .rev()
                .find(|k| s.is_char_boundary(*k) && text.ends_with(&s[..*k]))
        })
        .max()
        .unwrap_or(0);
    (text.len() - held, false)
}

/// `plan`: set up the split if needed and name every stage's steward, so a
/// requester can shard a grant over them.
pub(super) async fn handle_plan(
    inner: Arc<Inner>,
    send: &mut quinn::SendStream,
) -> anyhow::Result<()> {
    match inner.ensure_run().await {
        Ok(run) => {
            let plan = ControlReply::Plan {
                run_id: run.assigns[0].run_id.clone(),
                stewards: run.keys.iter().map(did_key).collect(),
            };
            msg::write_cbor(send, &plan.to_cbor()).await
        }
        Err(error) => send_error(send, &format!("cannot set up the split: {error:#}")).await,
    }
}

pub(super) async fn handle_generate(
    inner: Arc<Inner>,
    message: &GenerateRequestMessage,
    send: &mut quinn::SendStream,
) -> anyhow::Result<()> {
    let refused_other = || stats::Counters::bump(&inner.counters.requests_refused_other);
    let request = GenerateRequest::from_message(message);
    // One deadline for the whole request, from here: loading the split,
    // every step at every stage, every wait in between.
    let timeout = request
        .timeout
        .map_or(inner.request_timeout, |t| t.min(inner.request_timeout));
    let deadline = Deadline::after(timeout);
    // Every request that is not served gets a line saying why (at most
    // `MAX_UNSERVED_LOGGED` a minute: strangers can send refusals at will;
    // the next line counts those left out).
    let refuse = |reason: String| {
        if let Some(unlogged) = lock(&inner.unserved_logged).admit(Instant::now()) {
            tracing::warn!(unlogged, "a request refused: {reason}");
        }
        reason
    };
    let run = match run_by(&inner, deadline).await {
        Some(Ok(run)) => run,
        Some(Err(error)) => {
            refused_other();
            let reason = refuse(format!("cannot set up the split: {error:#}"));
            return send_error(send, &reason).await;
        }
        None => {
            refused_other();
            let reason = refuse(deadline.passed("the split to load"));
            return send_error(send, &reason).await;
        }
    };
    match serve_request(&inner, &run, &request, deadline, send).await {
        Ok(()) => Ok(()),
        Err(error) => {
            if stats::is_busy(&error) {
                stats::Counters::bump(&inner.counters.requests_refused_busy);
            } else if !stats::is_route_refusal(&error) {
                refused_other();
            }
            let reason = refuse(format!("{error:#}"));
            send_error(send, &reason).await
        }
    }
}

/// The run a request goes on, planned and assigned within `deadline`
/// (`None` when the deadline passed first). Loading runs on to the end in
/// its own task even then, so the next request finds the split ready.
async fn run_by(inner: &Arc<Inner>, deadline: Deadline) -> Option<anyhow::Result<Arc<Run>>> {
    let loading = {
        let inner = inner.clone();
        tokio::spawn(async move { inner.ensure_run().await })
    };
    match tokio::time::timeout_at(deadline.at(), loading).await {
        Ok(Ok(outcome)) => Some(outcome),
        Ok(Err(error)) => Some(Err(anyhow!("its task ended: {error}"))),
        Err(_) => None,
    }
}

/// What one request holds at the coordinator, released when it is dropped,
/// so every exit path (refusal, busy, a failed stage, an error sealing)
/// gives back the same things.
struct Held<'a> {
    inner: &'a Arc<Inner>,
    request_id: u64,
    /// The coordinator's own slice's cache for this request.
    cache: Option<CacheLease>,
    collector: bool,
    direct: bool,
    /// The coordinator's own grant decision, until the serve is debited.
    ticket: Option<crate::runtime::steward::ServeTicket>,
    /// Stages that decided a grant for this request: told to release it at
    /// the end (a no-op where the request reached them and was served).
    authorised: Vec<PeerAddr>,
    /// The task that notices the requester going away.
    watcher: Option<tokio::task::JoinHandle<()>>,
}

impl<'a> Held<'a> {
    fn new(inner: &'a Arc<Inner>, request_id: u64) -> Self {
        Self {
            inner,
            request_id,
            cache: None,
            collector: false,
            direct: false,
            ticket: None,
            authorised: Vec::new(),
            watcher: None,
        }
    }

    fn release_cache(&mut self) {
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
            lock(&self.inner.collector).take(self.request_id);
        }
        if self.direct {
            lock(&self.inner.directs).remove(&self.request_id);
        }
        if let Some(ticket) = self.ticket.take() {
            self.inner.release_ticket(ticket);
        }
        for peer in std::mem::take(&mut self.authorised) {
            let inner = self.inner.clone();
            let request_id = self.request_id;
            tokio::spawn(async move {
                if let Err(error) = release_remote(&inner, &peer, request_id).await {
                    tracing::warn!(request_id, %peer, "releasing the request's grant decision: {error:#}");
                }
            });
        }
    }
}

/// One request at the coordinator, in phases a reader can follow: admit
/// (the prompt, the request's places, every steward's grant decision),
/// drive (the chain, step by step), collect (the bill and the stages'
/// records), seal (the split's records and the `mesh/1` receipt) and report
/// (to the requester). What the request holds is released by its `Held` on
/// every path out of any phase.
async fn serve_request(
    inner: &Arc<Inner>,
    run: &Arc<Run>,
    request: &GenerateRequest,
    deadline: Deadline,
    requester: &mut quinn::SendStream,
) -> anyhow::Result<()> {
    let mut admitted = admit(inner, run, request).await?;
    // A requester that closes its connection or stops reading (QUIC
    // STOP_SENDING: how a client cancels) ends the request at the next step
    // as `client_cancelled`, on every stage.
    let requester_gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
    admitted.held.watcher = Some({
        let gone = requester_gone.clone();
        let stopped = requester.stopped();
        tokio::spawn(async move {
            let _ = stopped.await;
            gone.store(true, std::sync::atomic::Ordering::Relaxed);
        })
    });
    if let Some(ticket) = admitted.held.ticket.as_mut() {
        lock(&inner.steward).begin_engine(ticket);
    }
    let mut progress = Progress {
        tokens: Vec::new(),
        text: TextStream::default(),
        printed: String::new(),
        finish_reason: "length",
        sampler: Sampler::new(request.sampling.clone()),
        own_compute: Duration::ZERO,
        own_decode_engine: Duration::ZERO,
        round_trips: Duration::ZERO,
        decode_round_trips: Duration::ZERO,
        prefill_time: None,
        first_token_at: None,
        last_token_at: None,
        started: Instant::now(),
        requester_gone,
        resumes: Vec::new(),
        own_outputs: Some(Vec::new()),
        // Its tokens are a function of the request and the prompt payload
        // alone (SPEC §5): greedy, on the f32 wire (bit-identical to the
        // unsplit run), the prompt in one prefill step; a resume, which
        // rebuilds caches in other steps, takes it back.
        deterministic: (request.sampling.temperature <= 0.0 || admitted.decision.is_some())
            && inner.wire == WireDType::F32
            && admitted.prompt_ids.len() <= inner.prefill_chunk_tokens,
        decided: None,
        decode_steps: 0,
        drafter: super::draft::Drafter::new(
            inner.draft_model.as_ref(),
            admitted.request_id,
            admitted.prompt_ids.len() + admitted.max_new,
        ),
        drafted: false,
        spec_proposed: 0,
        spec_accepted: 0,
    };
    let mut run = run.clone();
    let mut interrupted: Vec<Interrupted<'_>> = Vec::new();
    let mut driven = loop {
        let mut driven = drive(
            inner,
            &run,
            request,
            deadline,
            &mut admitted,
            &mut progress,
            requester,
        )
        .await?;
        if let (Some(last), Some(replayed)) = (progress.resumes.last_mut(), driven.replayed_in) {
            last["replay_ms"] = json!(replayed.as_secs_f64() * 1e3);
        }
        if !driven.resumable {
            break driven;
        }
        let lost: Vec<String> = interrupted
            .iter()
            .flat_map(|i| &i.driven.lost)
            .chain(&driven.lost)
            .map(did_key)
            .collect();
        let lost = if lost.is_empty() {
            "no node".to_string()
        } else {
            lost.join(", ")
        };
        let failure = driven.failure.take().unwrap_or_default();
        // A segment that was to keep caches and failed before its first
        // token (a kept stage could not take its cache) is redone without
        // keeping, and that redo is not counted against --max-resumes; the
        // resume block's bound holds all the same.
        let failed_keep = |admitted: &Admitted<'_>, driven: &Driven| {
            admitted.keep.is_some() && driven.tokens == 0
        };
        let counted = interrupted
            .iter()
            .filter(|i| !failed_keep(&i.admitted, &i.driven))
            .count();
        if (!failed_keep(&admitted, &driven) && counted >= inner.max_resumes)
            || interrupted.len() >= MAX_RESUMES
        {
            driven.failure = Some(format!(
                "{failure}; not resumed: {} resumes already (--max-resumes), lost {lost}",
                interrupted.len(),
            ));
            break driven;
        }
        // Re-plan over the members left, then go on from the next token.
        let noticed = Instant::now();
        let noticed_unix_ms = now_ms();
        tracing::info!(
            request_id = admitted.request_id,
            tokens = progress.tokens.len(),
            "resuming on a new chain: {failure}"
        );
        let next = match run_by(inner, deadline).await {
            Some(Ok(next)) => next,
            Some(Err(error)) => {
                driven.failure = Some(format!(
                    "{failure}; could not resume (lost {lost}): {error:#}"
                ));
                break driven;
            }
            None => {
                driven.terminal = TerminalState::TimedOut;
                driven.failure = Some(format!(
                    "{failure}; could not resume (lost {lost}): {}",
                    deadline.passed("a new chain to resume on")
                ));
                break driven;
            }
        };
        let keep = keep_plan(inner, &run, &next, &admitted, &driven, &progress);
        let resumed = match admitted.resume(inner, &next, keep).await {
            Ok(resumed) => resumed,
            Err(error) => {
                driven.failure = Some(format!("{failure}; could not resume: {error:#}"));
                break driven;
            }
        };
        driven.failure = Some(failure);
        progress.resumes.push(json!({
            "at_token": progress.tokens.len(),
            "lost": driven.lost.iter().map(did_key).collect::<Vec<_>>(),
            "kept": resumed.keep.as_ref().map_or(Vec::new(), |keep| keep.nodes.iter().map(did_key).collect()),
            "replayed_positions": resumed.keep.as_ref().map_or(
                admitted.prompt_ids.len() + progress.tokens.len(),
                |keep| if keep.from == 1 { 0 } else { keep.positions },
            ),
            "replan_ms": noticed.elapsed().as_secs_f64() * 1e3,
            "noticed_unix_ms": noticed_unix_ms,
        }));
        // The lost chain's cache at this node is not needed again.
        admitted.held.release_cache();
        interrupted.push(Interrupted {
            run: std::mem::replace(&mut run, next),
            admitted: std::mem::replace(&mut admitted, resumed),
            driven,
        });
    };
    // The tokens are all in: the draft cache goes back before sealing.
    progress.drafter.release().await;
    let earlier = seal_interrupted(inner, interrupted).await?;
    let collected = collect(inner, &mut admitted, &mut driven).await?;
    let sealed = seal(
        inner, &run, &admitted, &driven, &progress, collected, earlier,
    )?;
    report(
        inner, &run, &admitted, &driven, &progress, sealed, requester,
    )
    .await
}

/// A request the coordinator took: what the chain runs, and what it holds.
struct Admitted<'a> {
    held: Held<'a>,
    request_id: u64,
    /// Which request on which split: names its lanes and its block.
    scope: RequestScope,
    prompt_ids: Vec<u32>,
    max_new: usize,
    /// The `mesh/1` request: the requester's own on grants.
    serve: ServeRequest,
    /// The requester's grant shards, by node.
    shards: GrantShards,
    /// A resumed segment's caches kept from the interrupted one.
    keep: Option<KeepPlan>,
    /// A resumed segment: the interrupted segment's request id, which its
    /// stages end at once where it still runs.
    resumes: Option<u64>,
    /// How the router chose the backend (SPEC §4), at the request's start.
    route: mesh_protocol::route::Route,
    /// The tokens the requester asked for (before the context cut them;
    /// 0 for a decision).
    asked_tokens: usize,
    /// A typed decision: scored at the prompt's last position, in place of
    /// the first token.
    decision: Option<decision::DecisionPlan>,
}

/// Which caches a resumed segment keeps from the segment it carries on:
/// the remote stages from `from` on (the same node on the same layers, not
/// lost), and the coordinator's own when its layers stayed. Each holds
/// `positions` (the prompt and every token but the last); the stages
/// before `from` rebuild theirs by a replay of those positions, which the
/// last of them sends no further, and the last token runs as a decode step.
#[derive(Debug, Clone)]
struct KeepPlan {
    from: u32,
    own: bool,
    positions: usize,
    /// The nodes that keep their cache, for the records.
    nodes: Vec<[u8; 32]>,
}

/// Most bytes of its own slice's outputs the coordinator keeps per request,
/// to replay them to a new stage after a loss instead of recomputing its
/// own layers; a longer request recomputes.
pub const MAX_KEPT_OUTPUT_BYTES: usize = 64 << 20;

/// The caches a resume onto `next` can keep, if any: only with the direct
/// return (a relayed chain carries every step's reply back through every
/// stage), and only after a segment that produced a token (its stages then
/// built every position but the last: a segment that failed in its replay,
/// or before its first token, left them short).
fn keep_plan(
    inner: &Inner,
    interrupted: &Run,
    next: &Run,
    admitted: &Admitted<'_>,
    driven: &Driven,
    progress: &Progress,
) -> Option<KeepPlan> {
    if inner.return_mode != ReturnMode::Direct || driven.tokens == 0 {
        return None;
    }
    let positions = admitted.prompt_ids.len() + progress.tokens.len() - 1;
    let chain = |run: &Run| -> Vec<([u8; 32], (u32, u32))> {
        run.keys
            .iter()
            .zip(&run.assigns)
            .map(|(key, a)| (*key, (a.layer_start, a.layer_end)))
            .collect()
    };
    let (before, after) = (chain(interrupted), chain(next));
    let from = kept_from(&before, &after, &driven.lost);
    let own = before.first() == after.first()
        && Arc::ptr_eq(&interrupted.own.slice, &next.own.slice)
        && admitted
            .held
            .cache
            .as_ref()
            .is_some_and(|cache| cache.positions() >= positions)
        && progress
            .own_outputs
            .as_ref()
            .is_some_and(|out| out.len() >= positions * next.own.slice.config().hidden);
    // Every remote stage kept, the coordinator's own not: it would have to
    // rebuild its cache without sending anything. Rebuild everything.
    if (from as usize == next.keys.len() || from == 1) && !own {
        return None;
    }
    let nodes = own
        .then_some(next.keys[0])
        .into_iter()
        .chain(next.keys[from as usize..].iter().copied())
        .collect();
    Some(KeepPlan {
        from,
        own,
        positions,
        nodes,
    })
}

/// The first remote stage of `next` from which on every stage is the same
/// node on the same layers as in `interrupted` and was not lost: those keep
/// their caches. `next.len()` when the final stage changed.
fn kept_from(
    interrupted: &[([u8; 32], (u32, u32))],
    next: &[([u8; 32], (u32, u32))],
    lost: &[[u8; 32]],
) -> u32 {
    let n = next.len();
    let same = |k: usize| {
        interrupted.len() == n && interrupted[k] == next[k] && !lost.contains(&next[k].0)
    };
    (1..n).rev().find(|&k| !same(k)).map_or(1, |k| k + 1) as u32
}

/// The requester's grant presentations, one per stage of the first chain,
/// and the nodes of that chain: any chain the request runs on presents
/// each node the shard made out for it.
#[derive(Clone)]
struct GrantShards {
    presentations: Vec<Option<mesh_protocol::grant::Presentation>>,
    nodes: Vec<[u8; 32]>,
}

impl GrantShards {
    fn for_node(&self, key: &[u8; 32]) -> Option<mesh_protocol::grant::Presentation> {
        let k = self.nodes.iter().position(|node| node == key)?;
        self.presentations.get(k).cloned().flatten()
    }
}

impl<'a> Held<'a> {
    /// A request's places on one chain, under a new split key: a cache on
    /// the own slice and a record slot, taken before any grant is decided so
    /// a busy coordinator refuses without deciding anything.
    fn take_places(
        inner: &'a Arc<Inner>,
        run: &Run,
        capacity: usize,
        kept: Option<CacheLease>,
    ) -> anyhow::Result<(Self, SplitKey)> {
        let split_key = SplitKey {
            coordinator_node_id: inner.tls.did.clone(),
            run_id: run.assigns[0].run_id.clone(),
            request_id: u64::from_le_bytes(crate::runtime::keys::random_bytes()?),
        };
        let mut held = Held::new(inner, split_key.request_id);
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
        if !lock(&inner.collector).open(split_key.clone(), run.keys.clone()) {
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
    async fn authorise_stages(
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
                self.inner,
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

impl<'a> Admitted<'a> {
    /// The same request on a new chain: a new split key (its own lanes and
    /// records), a cache on the new own slice, a record slot, and the grant
    /// decisions of the new chain's nodes that hold a shard. The
    /// coordinator's own grant decision and the requester watch move over.
    async fn resume(
        &mut self,
        inner: &'a Arc<Inner>,
        run: &Arc<Run>,
        keep: Option<KeepPlan>,
    ) -> anyhow::Result<Self> {
        // The new chain is another backend: weighed again, and refused as
        // any request is when it cannot serve within the bounds.
        let route = route_or_refuse(inner, run, &self.serve)?;
        let capacity = self.prompt_ids.len() + self.max_new;
        // The own cache goes on under the new request, cut back to the
        // positions every kept stage holds.
        let kept = match keep.as_ref().filter(|keep| keep.own) {
            Some(keep) => {
                let mut lease = self.held.cache.take().context("the request's cache")?;
                lease.cache().truncate(keep.positions)?;
                Some(lease)
            }
            None => {
                // Its place in the pool (shared with the new run's when the
                // own layers stayed) is given back before a new one is taken.
                self.held.release_cache();
                None
            }
        };
        let (mut held, split_key) = Held::take_places(inner, run, capacity, kept)?;
        held.authorise_stages(run, &split_key, &self.serve, &self.shards)
            .await?;
        held.ticket = self.held.ticket.take();
        held.watcher = self.held.watcher.take();
        Ok(Self {
            request_id: split_key.request_id,
            held,
            scope: request_scope(inner, run, split_key),
            prompt_ids: self.prompt_ids.clone(),
            max_new: self.max_new,
            serve: self.serve.clone(),
            shards: self.shards.clone(),
            keep,
            resumes: Some(self.request_id),
            route,
            asked_tokens: self.asked_tokens,
            decision: self.decision.clone(),
        })
    }
}

/// What a request carries from one segment to the next: what it generated
/// and what it measured, over every chain it ran on.
struct Progress {
    tokens: Vec<u32>,
    /// The text of the tokens but end-of-sequence ones.
    text: TextStream,
    printed: String,
    /// Why a completed generation ended, in OpenAI's words: `stop` for an
    /// end-of-sequence token or a stop sequence, `length` for max_tokens.
    finish_reason: &'static str,
    sampler: Sampler,
    own_compute: Duration,
    /// The engine's own time on decode steps (their slice step and head),
    /// hand-offs to and from the slice's worker not included.
    own_decode_engine: Duration,
    round_trips: Duration,
    /// The round trips of decode steps alone (what a token waits for).
    decode_round_trips: Duration,
    /// The prompt's prefill, on the first chain.
    prefill_time: Option<Duration>,
    /// When the first and the latest token were sampled: the decode rate
    /// is taken between them, so closing the chain (records, sealing)
    /// is not counted as decoding.
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    started: Instant,
    /// Set when the requester closes its connection or stops reading.
    requester_gone: Arc<std::sync::atomic::AtomicBool>,
    /// Each resume's figures, for the details.
    resumes: Vec<serde_json::Value>,
    /// The own slice's outputs so far (one row per position, in f32), while
    /// they fit in `MAX_KEPT_OUTPUT_BYTES`: what a new stage after it is
    /// replayed from.
    own_outputs: Option<Vec<f32>>,
    /// Whether the serve, as far as it went, repeats bit for bit.
    deterministic: bool,
    /// A decision's probability per option, once scored.
    decided: Option<Vec<f64>>,
    /// Decode steps answered (fewer than tokens when drafts are accepted).
    decode_steps: u64,
    /// Where its drafts come from; kept across segments (its cache on a
    /// draft model is the request's, not a chain's).
    drafter: super::draft::Drafter,
    /// Whether the request drafted (greedy, drafting on, not a decision).
    drafted: bool,
    /// Drafted tokens sent for verification, and those the model chose.
    spec_proposed: u64,
    spec_accepted: u64,
}

/// What driving one chain (one segment of the request) gave.
struct Driven {
    terminal: TerminalState,
    failure: Option<String>,
    lanes: SegmentLanes,
    fold_time: Duration,
    started: Instant,
    /// The chain failed in a way a new chain may get past: a stage lost,
    /// a transport error, a step that timed out, with time left.
    resumable: bool,
    /// Stages that left the mesh during the segment.
    lost: Vec<[u8; 32]>,
    /// Tokens generated before this segment.
    first_token: usize,
    /// Tokens this segment generated.
    tokens: usize,
    /// Positions prefilled at its start (the prompt, and any replay).
    prefilled: usize,
    /// How long a resumed segment's replay took to its first token.
    replayed_in: Option<Duration>,
    /// Nodes that kept their caches from the segment before.
    kept: Vec<[u8; 32]>,
    /// Positions this segment's own slice ran in decode steps (drafts
    /// included): its block's `decode`.
    own_decode_rows: u64,
}

/// A segment that lost its chain, kept to be sealed with the rest.
struct Interrupted<'a> {
    run: Arc<Run>,
    admitted: Admitted<'a>,
    driven: Driven,
}

/// The request's bill and the stage records that came in.
struct Collected {
    metered: crate::runtime::steward::Metered,
    records: Vec<Vec<SealedRecord>>,
}

/// The sealed request: its bundle and the `mesh/1` envelope.
struct Sealed {
    bundle: serde_json::Value,
    envelope: mesh_protocol::mesh1::SealedReceipt,
}

/// Admit: refuse what cannot run before it costs anything, then take the
/// request's places (a cache, a record slot) and every steward's grant
/// decision, in that order, so a busy coordinator decides nothing.
async fn admit<'a>(
    inner: &'a Arc<Inner>,
    run: &Arc<Run>,
    request: &GenerateRequest,
) -> anyhow::Result<Admitted<'a>> {
    let codec = inner.model.text();
    let context = inner.context();
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
                    inner.model.config().vocab,
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
    let (serve, presentations) = match &request.grant {
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
            if granted.serve.decision.is_some() != decision.is_some() {
                bail!(
                    "the granted request is priced as a {} but asks for a {}",
                    if granted.serve.decision.is_some() {
                        "decision"
                    } else {
                        "generation"
                    },
                    if decision.is_some() {
                        "decision"
                    } else {
                        "generation"
                    }
                );
            }
            (granted.serve.clone(), presentations)
        }
    };
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
    // Route (SPEC §4) before anything is held.
    let route = route_or_refuse(inner, run, &serve)?;

    // Everything this request holds is released by `held` on every path.
    let (mut held, split_key) = Held::take_places(inner, run, capacity, None)?;
    let shards = GrantShards {
        presentations,
        nodes: run.keys.clone(),
    };
    // Every steward decides its own grant shard before any work runs.
    let own_presentation = shards.for_node(&inner.tls.public_key);
    held.ticket = Some(
        lock(&inner.steward)
            .authorise(
                own_presentation.as_ref(),
                &serve,
                Some(inner.model.weights_digest()),
                "mesh-node/split",
                now_ms(),
            )
            .map_err(|error| match own_presentation {
                Some(_) => anyhow!("grant refused at the coordinator: {error}"),
                None => anyhow!("the coordinator cannot take the request: {error}"),
            })?,
    );
    held.authorise_stages(run, &split_key, &serve, &shards)
        .await?;
    Ok(Admitted {
        request_id: split_key.request_id,
        held,
        scope: request_scope(inner, run, split_key),
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

/// Weigh the backends a request on `run` may be served on. A request no
/// backend can serve within its floor and ceiling is refused: journalled
/// with its route table (at most so many a minute), counted, and answered
/// with each backend's reason.
fn route_or_refuse(
    inner: &Inner,
    run: &Run,
    serve: &ServeRequest,
) -> anyhow::Result<mesh_protocol::route::Route> {
    let route = mesh_protocol::route::route(
        &mesh_protocol::route::RouteRequest::from(serve),
        &route::backends(inner, run),
    )?;
    let Some(refusal) = route.refusal() else {
        return Ok(route);
    };
    stats::Counters::bump(&inner.counters.requests_refused_route);
    let journalled = lock(&inner.refusal_journal).admit(Instant::now());
    if let Some(unjournalled) = journalled
        && let Err(error) =
            lock(&inner.steward).record_refusal(serve.request_id(), &route, unjournalled, now_ms())
    {
        // The refusal stands whether or not the journal took it.
        tracing::warn!("a route refusal was not journalled: {error}");
    }
    Err(stats::RouteRefused(refusal).into())
}

/// Which request on which split a segment serves: names its lanes and
/// its block.
fn request_scope(inner: &Inner, run: &Run, split: SplitKey) -> RequestScope {
    RequestScope {
        split,
        stage_count: run.assigns.len() as u32,
        return_mode: inner.return_mode,
    }
}

/// Drive: open the chain and run it step by step to the last token, the
/// deadline, a cancel, a ceiling or a failure; then STOP (or just finish)
/// and read what the neighbours still send, so every lane is whole.
async fn drive(
    inner: &Arc<Inner>,
    run: &Arc<Run>,
    request: &GenerateRequest,
    deadline: Deadline,
    admitted: &mut Admitted<'_>,
    progress: &mut Progress,
    requester: &mut quinn::SendStream,
) -> anyhow::Result<Driven> {
    let codec = inner.model.text();
    let decision = admitted.decision.clone();
    let held = &mut admitted.held;
    let request_id = admitted.request_id;
    let max_new = admitted.max_new;
    let capacity = admitted.prompt_ids.len() + max_new;
    // A segment after a loss starts from the prompt and every token so far:
    // replayed as a prefill, it rebuilds the new chain's caches.
    let first_token = progress.tokens.len();
    let prefix: Vec<u32> = admitted
        .prompt_ids
        .iter()
        .chain(&progress.tokens)
        .copied()
        .collect();
    let n = run.assigns.len() as u32;
    let run_id = run.assigns[0].run_id.clone();
    let coordinator = inner.tls.did.clone();
    let return_mode = inner.return_mode;
    let mut lanes = Folding::new(HopSession::new(admitted.scope.clone(), 0));
    let mut direct_waiter = if return_mode == ReturnMode::Direct {
        let (sender, receiver) = oneshot::channel();
        lock(&inner.directs).insert(request_id, (run.keys[n as usize - 1], sender));
        held.direct = true;
        Some(receiver)
    } else {
        None
    };
    let Progress {
        tokens,
        text,
        printed,
        finish_reason,
        sampler,
        own_compute,
        own_decode_engine,
        round_trips,
        decode_round_trips,
        prefill_time,
        first_token_at,
        last_token_at,
        requester_gone,
        own_outputs,
        decided,
        decode_steps,
        drafter,
        drafted,
        spec_proposed,
        spec_accepted,
        ..
    } = progress;
    let started = Instant::now();
    let mut replayed_in: Option<Duration> = None;
    let mut budget_stop: Option<String> = None;
    let keep = admitted.keep.clone();
    let hidden_size = run.own.slice.config().hidden;
    // The prompt runs through the chain in chunks, each its own step, so no
    // step of a long prompt outlasts the step timeout. A segment that keeps
    // caches replays every position but the last to the stages that rebuild
    // theirs ("silent" steps: no reply comes back), then runs the last token
    // as a decode step through the whole chain.
    let (prefill, silent): (Vec<&[u32]>, usize) = match &keep {
        Some(keep) => {
            // No replay when every remote stage kept its cache (then the
            // coordinator kept its own too).
            let replayed = if keep.from == 1 { 0 } else { keep.positions };
            let mut steps: Vec<&[u32]> = prefix[..replayed]
                .chunks(inner.prefill_chunk_tokens)
                .collect();
            let silent = steps.len();
            steps.push(&prefix[keep.positions..]);
            (steps, silent)
        }
        None => (prefix.chunks(inner.prefill_chunk_tokens).collect(), 0),
    };
    // Steps that decode, as the stages count them: every step after the
    // prompt's, and a kept chain's first step (the prompt's last position,
    // sent as a decode step through the whole chain).
    let kept = keep.is_some();
    let prefill_steps = prefill.len();
    let decodes = |step: u32| {
        let step = step as usize;
        step >= prefill_steps || (kept && step + 1 == prefill_steps)
    };
    let replay_own = keep.as_ref().is_some_and(|keep| keep.own);
    match &keep {
        // The own cache was kept: so are its outputs, up to the positions kept.
        Some(keep) if keep.own => {
            if let Some(outputs) = own_outputs.as_mut() {
                outputs.truncate(keep.positions * hidden_size);
            }
        }
        // A fresh own cache: its outputs are computed again.
        _ => *own_outputs = Some(Vec::new()),
    }
    let first_peer = run.peers[0].clone();
    let final_stage = run.peers[run.peers.len() - 1].clone();
    // Speculative decoding: after each token sampled, up to `draft_tokens`
    // drafted (by the draft model, else by prompt lookup) go down in the
    // same step; greedy verification keeps those the model itself chooses,
    // so the tokens are those of plain greedy decoding.
    let drafting =
        inner.draft_tokens > 0 && decision.is_none() && request.sampling.temperature <= 0.0;
    let mut history = prefix.clone();
    if drafting {
        *drafted = true;
        // The draft model takes the prompt (or the replay) while the chain
        // prefills it.
        drafter.prefill(&history);
    }
    // The draft riding on the decode step in flight.
    let mut draft: Vec<u32> = Vec::new();
    let mut own_decode_rows: u64 = 0;

    let outcome: anyhow::Result<(anyhow::Result<TerminalState>, Tail)> = async {
        let (mut send, recv) = inner.net.open(&first_peer, ALPN_STAGE).await?;
        let mut open = vec![
            ("run_id", Cbor::text(&run_id)),
            ("coordinator", Cbor::text(&coordinator)),
            ("stage_count", Cbor::Uint(n.into())),
            ("capacity", Cbor::Uint(capacity as u64)),
            ("return_mode", Cbor::text(return_mode.as_str())),
            (
                "prefill_steps",
                Cbor::Uint(if keep.is_some() { silent } else { prefill.len() } as u64),
            ),
            ("deadline_ms", Cbor::Uint(deadline.left().as_millis() as u64)),
        ];
        if let Some(interrupted) = admitted.resumes {
            // Signed: a stage ends or hands over a request of this
            // coordinator only on its word, not on an upstream stage's.
            let claim = mesh_protocol::resume::ResumeClaim {
                run_id: run_id.clone(),
                request_id,
                resume_of: interrupted,
                keep: keep
                    .as_ref()
                    .map(|keep| (u64::from(keep.from), keep.positions as u64)),
            };
            open.extend([
                ("resume_of", Cbor::Uint(interrupted)),
                (
                    "resume_sig",
                    Cbor::bytes(mesh_protocol::resume::sign_claim(&claim, &inner.key).to_vec()),
                ),
            ]);
        }
        if let Some(keep) = &keep {
            open.extend([
                ("kept_from", Cbor::Uint(keep.from.into())),
                ("keep_positions", Cbor::Uint(keep.positions as u64)),
            ]);
        }
        let open = Cbor::text_map(open);
        write_forward(
            &mut send,
            &msg::stage_body(kind::OPEN, request_id, 0, &open.encode()),
            &mut lanes,
            0,
            0,
        )
        .await?;
        // Direct mode: the final stage's return, and stage 1's own stream
        // (which it writes only to say why it stopped), each read whole-frame
        // by a task so a wait on both can be abandoned without losing bytes.
        let mut direct: Option<Frames> = None;
        let mut direct_closed = false;
        let mut stage1: Option<Frames> = None;
        let reply_limit = max_reply(run.own.slice.config().hidden);
        let mut recv = Some(recv);
        if return_mode == ReturnMode::Direct {
            stage1 = recv.take().map(|recv| spawn_frames(recv, reply_limit));
        }
        // Relayed replies once the deadline is nearer than a step timeout.
        let mut relayed: Option<Frames> = None;
        let mut step: u32 = 0;
        let mut input: Vec<u32> = prefill[0].to_vec();
        // Whether a step sent still owes its reply (a deadline that passes
        // while waiting leaves it owed: it is drained after STOP), and how
        // many do.
        let mut reply_owed = false;
        let mut owed: u32 = 0;
        // Direct return: the prompt's chunks go down one after the other
        // without waiting for their replies, so stage k works on chunk i+1
        // while stage k+1 works on chunk i (a relayed stage waits for each
        // reply before it reads the next chunk).
        let pipelined = return_mode == ReturnMode::Direct;
        // Whether `input` (step `step`) is still to be computed and sent.
        let mut to_send = true;
        let mut trip = Instant::now();
        let result: anyhow::Result<TerminalState> = async {
            loop {
                // Between steps the chain is healthy: STOP tells every stage
                // how the request ended.
                if deadline.is_past() {
                    return Ok(TerminalState::TimedOut);
                }
                if requester_gone.load(std::sync::atomic::Ordering::Relaxed) {
                    return Ok(TerminalState::ClientCancelled);
                }
                if to_send {
                    let frame = if replay_own && (step as usize) < silent {
                        // The replay of a kept own cache: the outputs it
                        // sent before, not computed again.
                        let chunk = inner.prefill_chunk_tokens;
                        let rows = (step as usize * chunk)..(keep.as_ref().map_or(0, |k| k.positions)).min((step as usize + 1) * chunk);
                        let kept = own_outputs
                            .as_ref()
                            .and_then(|out| out.get(rows.start * hidden_size..rows.end * hidden_size))
                            .context("the own slice's kept outputs")?;
                        encode_frame(kept, rows.len(), hidden_size, inner.wire)?
                    } else {
                        let compute_start = Instant::now();
                        let lease = held.cache.take().context("the request's cache")?;
                        // The engine runs a prompt's chunk's rows together;
                        // a kept chain's first step is one row, which gets
                        // the same bits either way.
                        let decode = step as usize >= prefill.len();
                        let counted_as_decode = decodes(step);
                        if counted_as_decode {
                            own_decode_rows += input.len() as u64;
                        }
                        let bill = held.ticket.as_ref().and_then(|t| t.bill());
                        let (output, lease, engine) = run
                            .own
                            .batcher
                            .step(batch::StepInput::Tokens(std::mem::take(&mut input)), lease, decode, bill)
                            .await?;
                        held.cache = Some(lease);
                        *own_compute += compute_start.elapsed();
                        if counted_as_decode {
                            *own_decode_engine += engine;
                        }
                        if let Some(stop) = ceiling_reached(inner, held.ticket.as_mut(), tokens.len()) {
                            budget_stop = Some(stop);
                            return Ok(TerminalState::PolicyDenied);
                        }
                        let SliceOutput::Hidden(hidden) = output else {
                            bail!("the coordinator's slice returned logits")
                        };
                        // Kept while they fit, for a replay after a loss.
                        if own_outputs.as_ref().is_some_and(|out| {
                            (out.len() + hidden.values.len()) * 4 > MAX_KEPT_OUTPUT_BYTES
                        }) {
                            *own_outputs = None;
                        }
                        if let Some(out) = own_outputs.as_mut() {
                            out.extend_from_slice(&hidden.values);
                        }
                        encode_frame(&hidden.values, hidden.rows, hidden.cols, inner.wire)?
                    };
                    trip = Instant::now();
                    let body = msg::stage_body(kind::ACTIVATIONS, request_id, step, &frame);
                    send_down(&mut send, &mut recv, &mut lanes, &body, step).await?;
                    // A draft is proposed once the chain has it, whether or
                    // not its reply comes back in this segment.
                    *spec_proposed += draft.len() as u64;
                    if (step as usize) < silent {
                        // A replay step: no reply comes back for it.
                        step += 1;
                        input = prefill[step as usize].to_vec();
                        continue;
                    }
                    reply_owed = true;
                    owed += 1;
                    if pipelined && (step as usize) + 1 < prefill.len() {
                        step += 1;
                        input = prefill[step as usize].to_vec();
                        continue;
                    }
                    to_send = false;
                }
                let wait = deadline.bound(inner.step_timeout);
                let reply = match recv.as_mut() {
                    Some(recv) if wait == inner.step_timeout && run.projected_us.is_none() => {
                        let reply =
                            msg::read_checked(recv, reply_limit, inner.step_timeout)
                                .await
                                .map_err(|e| step_failure(e, "stage 1", inner.step_timeout))?
                                .context("stage 1 closed the request")?;
                        lanes.fold(Wire::FromDownstream, &reply);
                        reply
                    }
                    _ if return_mode == ReturnMode::Relayed => {
                        // Read through a task, so the wait can end without
                        // losing part of a frame: over a mesh, where it also
                        // watches the members (a stage whose process died is
                        // noticed when its mesh connection closes, not at
                        // QUIC's idle timeout), and once the deadline is
                        // nearer than a step timeout.
                        if relayed.is_none() {
                            relayed = recv.take().map(|recv| spawn_frames(recv, reply_limit));
                        }
                        let arrived = tokio::select! {
                            arrived = tokio::time::timeout(wait, next_frame(&mut relayed)) => arrived,
                            gone = stage_left(inner, run, started) => {
                                bail!("stage {} left the mesh", did_key(&gone));
                            }
                        };
                        let Ok(arrived) = arrived else {
                            if deadline.is_past() {
                                return Ok(TerminalState::TimedOut);
                            }
                            return Err(step_timed_out("stage 1", inner.step_timeout));
                        };
                        let reply = arrived.context("stage 1 closed the request")??;
                        lanes.fold(Wire::FromDownstream, &reply);
                        reply
                    }
                    _ => {
                        let mut until = tokio::time::Instant::now() + wait;
                        loop {
                            tokio::select! {
                                opened = wait_direct(&mut direct_waiter), if direct.is_none() => {
                                    direct_waiter = None;
                                    let (_send, stream, opening) =
                                        opened.context("the direct return was never opened")?;
                                    lanes.fold(Wire::DirectReceived, &opening);
                                    direct = Some(spawn_frames(stream, reply_limit));
                                }
                                arrived = next_frame(&mut direct), if !direct_closed => {
                                    let Some(arrived) = arrived else {
                                        // The final stage ends its return after telling
                                        // stage 1 why it stopped (a FAILED relayed up, on
                                        // another connection): wait a moment for that
                                        // reason instead of racing it.
                                        direct_closed = true;
                                        until = until.min(tokio::time::Instant::now() + DRAIN_WAIT);
                                        continue;
                                    };
                                    let reply = arrived.with_context(|| {
                                        format!("the final stage ({}) was lost", final_stage.did())
                                    })?;
                                    lanes.fold(Wire::DirectReceived, &reply);
                                    break reply;
                                }
                                said = next_frame(&mut stage1) => {
                                    let frame = said
                                        .context("stage 1 closed the request")?
                                        .with_context(|| format!("stage 1 ({}) was lost", first_peer.did()))?;
                                    lanes.fold(Wire::FromDownstream, &frame);
                                    // In direct mode stage 1's own stream only
                                    // says why the chain stopped.
                                    if msg::parse_stage(&frame)?.0 != kind::FAILED {
                                        bail!("stage 1 sent a reply on its own stream in direct mode");
                                    }
                                    break frame;
                                }
                                gone = stage_left(inner, run, started) => {
                                    // Its connection in the mesh closed: a
                                    // process gone is known at once, not after
                                    // the QUIC idle timeout.
                                    bail!("stage {} left the mesh", did_key(&gone));
                                }
                                () = tokio::time::sleep_until(until) => {
                                    if deadline.is_past() {
                                        return Ok(TerminalState::TimedOut);
                                    }
                                    if direct_closed {
                                        bail!("the final stage closed the direct return");
                                    }
                                    let whom = if direct.is_none() { "the final stage's direct return" } else { "the final stage" };
                                    return Err(step_timed_out(whom, inner.step_timeout));
                                }
                            }
                        }
                    }
                };
                // Replies come in the order their steps went down.
                let answered = step + 1 - owed;
                owed -= 1;
                reply_owed = owed > 0;
                // A step's round trip, from its send to its reply; the
                // earlier chunks of a pipelined prompt overlap the last one's
                // and are not counted apart.
                if owed == 0 {
                    let round_trip = trip.elapsed();
                    *round_trips += round_trip;
                    if decodes(answered) {
                        *decode_round_trips += round_trip;
                    }
                    inner.counters.round_trips.record(round_trip);
                }
                let (reply_kind, id, reply_step, payload) = msg::parse_stage(&reply)?;
                if id != request_id {
                    bail!("a reply for request {id} on request {request_id}");
                }
                if reply_kind == kind::FAILED {
                    let reason = String::from_utf8_lossy(payload);
                    if reason.starts_with(POLICY_DENIED) {
                        // That stage has ended its part: no STOP follows
                        // into a chain it no longer reads.
                        budget_stop = Some(format!("a stage stopped the serve: {reason}"));
                        bail!("{reason}");
                    }
                    bail!("a stage failed: {reason}");
                }
                if reply_kind != kind::HIDDEN {
                    bail!("a malformed reply (kind {reply_kind})");
                }
                if reply_step != answered {
                    bail!("a reply for step {reply_step} to step {answered}");
                }
                let (hidden, dtype) = decode_frame(payload, run.own.slice.config().hidden)
                    .context("the final stage's hidden state")?;
                // A row per position of a decode step (the token sampled
                // and its draft); one row, the last position, for a
                // prefill step.
                if hidden.rows != 1 + draft.len() || dtype != WireDType::F32 {
                    bail!(
                        "the final stage returned {} rows of {dtype:?}, not {} of F32",
                        hidden.rows,
                        1 + draft.len()
                    );
                }
                if hidden.values.iter().any(|v| !v.is_finite()) {
                    bail!("the final stage returned a hidden state that is not finite");
                }
                // A pipelined prompt's earlier chunks: only the last is sampled.
                if owed > 0 {
                    continue;
                }
                // A prefill chunk's last position is not sampled: the next
                // chunk follows.
                if let Some(chunk) = prefill.get(step as usize + 1) {
                    step += 1;
                    input = chunk.to_vec();
                    to_send = true;
                    continue;
                }
                let head_start = Instant::now();
                let bill = held.ticket.as_ref().and_then(|t| t.bill());
                let (logits, engine) = run.own.batcher.logits(hidden, bill).await?;
                *own_compute += head_start.elapsed();
                if decodes(step) {
                    *own_decode_engine += engine;
                }
                if let Some(stop) = ceiling_reached(inner, held.ticket.as_mut(), tokens.len()) {
                    budget_stop = Some(stop);
                    return Ok(TerminalState::PolicyDenied);
                }
                if step as usize + 1 == prefill.len() {
                    // The first segment's prefill is the prompt's; a later
                    // one's is the replay that rebuilt a new chain.
                    if prefill_time.is_none() {
                        *prefill_time = Some(started.elapsed());
                    } else {
                        replayed_in.get_or_insert(started.elapsed());
                    }
                }
                if let Some(decision) = &decision {
                    // A typed decision is answered here: every option
                    // scored at the prompt's last position, nothing sampled.
                    *decided = Some(decision.score(logits.last().context("no logits")?)?);
                    *finish_reason = "stop";
                    return Ok(TerminalState::Completed);
                }
                if decodes(step) {
                    *decode_steps += 1;
                }
                // Row i is sampled once every drafted token before it was
                // the model's own choice; the first that is not ends the
                // step, and the token chosen in its place goes on.
                let proposed = std::mem::take(&mut draft);
                let mut accepted = 0;
                let mut next = 0;
                // How the request ended, when it did in this step.
                let mut ended = None;
                for (i, row) in logits.iter().enumerate() {
                    next = sampler.sample(row).context("no logits")?;
                    let agreed = proposed.get(i) == Some(&next);
                    accepted += usize::from(agreed);
                    tokens.push(next);
                    let now = Instant::now();
                    first_token_at.get_or_insert(now);
                    *last_token_at = Some(now);
                    history.push(next);
                    let eos = codec.is_eos(next);
                    let last = eos || tokens.len() >= max_new;
                    let decoded = if eos {
                        text.text()
                    } else {
                        text.push(codec, next)?
                    };
                    let (end, stopped) = shown_end(decoded, &request.stop, last);
                    let shown = decoded.get(..end).unwrap_or("");
                    let piece = shown
                        .strip_prefix(printed.as_str())
                        .unwrap_or("")
                        .to_string();
                    *printed = shown.to_string();
                    // Every token but an end-of-sequence one is announced; an
                    // end-of-sequence one only when it releases held-back text.
                    if !eos || !piece.is_empty() {
                        let token = ControlReply::Token {
                            id: next.into(),
                            text: piece,
                        };
                        if msg::write_cbor(requester, &token.to_cbor()).await.is_err() {
                            ended = Some(TerminalState::ClientCancelled);
                            break;
                        }
                    }
                    if eos || stopped {
                        *finish_reason = "stop";
                    }
                    if last || stopped {
                        ended = Some(TerminalState::Completed);
                        break;
                    }
                    if !agreed {
                        break;
                    }
                }
                *spec_accepted += accepted as u64;
                if ended == Some(TerminalState::ClientCancelled) {
                    return Ok(TerminalState::ClientCancelled);
                }
                step += 1;
                if let Some(state) = ended {
                    return Ok(state);
                }
                let rejected = proposed.len() - accepted;
                if rejected > 0 {
                    // The rejected positions leave every cache before the
                    // next step: the own one here, the stages' by REWIND.
                    let lease = held.cache.as_mut().context("the request's cache")?;
                    let positions = lease.positions() - rejected;
                    lease.cache().truncate(positions)?;
                    if let Some(out) = own_outputs.as_mut() {
                        out.truncate(positions * hidden_size);
                    }
                    let rewind = Rewind {
                        positions: positions as u64,
                    };
                    let body = msg::stage_body(kind::REWIND, request_id, step, &rewind.encode());
                    send_down(&mut send, &mut recv, &mut lanes, &body, step).await?;
                }
                if drafting {
                    // All of a draft accepted gives one token more than it
                    // holds: never past max_tokens.
                    let room = max_new.saturating_sub(tokens.len() + 1).min(inner.draft_tokens);
                    // The draft model's passes are this request's alone.
                    let drafting = held
                        .ticket
                        .as_ref()
                        .and_then(|t| t.bill())
                        .map(|bill| bill.computing(1));
                    draft = drafter.propose(&history, room).await;
                    drop(drafting);
                }
                input = std::iter::once(next).chain(draft.iter().copied()).collect();
                to_send = true;
            }
        }
        .await;
        // STOP enters the forward lane only when the chain is healthy. After a
        // failure stage 1 may have stopped reading, and a frame it never read
        // folded here would read as tampering on a healthy hop: the stream is
        // just finished, and each stage records what it saw.
        if let Ok(state) = &result {
            let stop = Cbor::text_map([("terminal_state", Cbor::text(state.as_str()))]);
            write_forward(
                &mut send,
                &msg::stage_body(kind::STOP, request_id, step, &stop.encode()),
                &mut lanes,
                0,
                step,
            )
            .await?;
        }
        let _ = send.finish();
        let tail = Tail {
            // A deadline that passed while a reply was owed: the reply still
            // comes (stage 1 finishes its step, reads STOP and ends its
            // stream; a stage's own deadline is a step timeout later than
            // this one), and is read and folded, so hop 0 still agrees.
            unfinished: result.is_err() || reply_owed,
            reply_owed,
            direct_mode: return_mode == ReturnMode::Direct,
            step_timeout: inner.step_timeout,
            reply_limit,
            relayed,
            stage1,
            direct,
            direct_waiter: direct_waiter.take(),
        };
        Ok((result, tail))
    }
    .await;
    // The stages that left the mesh during this segment: lost, for a chain
    // planned over the mesh.
    let lost: Vec<[u8; 32]> = run.keys[1..]
        .iter()
        .filter(|key| run.projected_us.is_some() && inner.left_mesh_since(key, started))
        .copied()
        .collect();
    let (outcome, tail) = match outcome {
        Ok((result, tail)) => (result, Some(tail)),
        Err(error) => (Err(error), None),
    };
    // A stage that left the mesh has nothing more to say: its streams are
    // not drained (they would end only at the QUIC idle timeout).
    let gone = Gone {
        stage1: lost.contains(&run.keys[1]),
        final_stage: lost.contains(&run.keys[n as usize - 1]),
    };
    let chain_failed = outcome.is_err() && budget_stop.is_none();
    // A failed chain that will be resumed is drained in the background: the
    // survivors' last frames complete this segment's lanes by the time it is
    // sealed, and the request goes on at once.
    let resumable =
        chain_failed && run.projected_us.is_some() && !deadline.is_past() && tokens.len() < max_new;
    // Folding time in the drive itself (a drain after it is not counted).
    let fold_time = lanes.spent;
    let lanes = match tail {
        Some(tail) if resumable => SegmentLanes::Draining(tokio::spawn(async move {
            tail.drain(&mut lanes, gone).await;
            lanes
        })),
        Some(tail) => {
            tail.drain(&mut lanes, gone).await;
            SegmentLanes::Ready(Box::new(lanes))
        }
        None => SegmentLanes::Ready(Box::new(lanes)),
    };
    let (terminal, failure) = match outcome {
        Ok(TerminalState::TimedOut) => (
            TerminalState::TimedOut,
            Some(deadline.passed("the next token")),
        ),
        Ok(TerminalState::ClientCancelled) => (
            TerminalState::ClientCancelled,
            Some(format!(
                "the requester went away after {} tokens",
                tokens.len()
            )),
        ),
        Ok(state) => (state, budget_stop),
        Err(_) if budget_stop.is_some() => (TerminalState::PolicyDenied, budget_stop),
        Err(error) => {
            let state = if error.to_string().contains("timed out") {
                TerminalState::TimedOut
            } else {
                TerminalState::TransportError
            };
            (state, Some(format!("{error:#}")))
        }
    };
    run.own.touch();
    // A chain that failed (not one a requester's deadline or cancel ended)
    // may have lost a stage's slice: assign again before the next request.
    if chain_failed {
        run.stale.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(Driven {
        terminal,
        failure,
        lanes,
        fold_time,
        started,
        resumable,
        lost,
        first_token,
        tokens: tokens.len() - first_token,
        prefilled: keep.as_ref().map_or(prefix.len(), |keep| keep.positions),
        replayed_in,
        // Claimed only once the chain answered: a kept stage that could
        // not take its cache refuses the request.
        kept: keep
            .as_ref()
            .filter(|_| tokens.len() > first_token)
            .map_or(Vec::new(), |keep| keep.nodes.clone()),
        own_decode_rows,
    })
}

/// Write one message down to stage 1 on the forward lane; when the write
/// fails, the reason stage 1 gave for refusing it, if it gave one.
async fn send_down(
    send: &mut quinn::SendStream,
    recv: &mut Option<quinn::RecvStream>,
    lanes: &mut Folding,
    body: &[u8],
    step: u32,
) -> anyhow::Result<()> {
    if let Err(error) = write_forward(send, body, lanes, 0, step).await {
        return Err(match recv.as_mut() {
            Some(recv) => refusal_behind(recv, error, "stage 1", Some(lanes)).await,
            None => error,
        });
    }
    Ok(())
}

/// What a failed segment still has to read from its survivors, after the
/// drive loop: owned, so it can finish in the background while the request
/// goes on over a new chain.
struct Tail {
    unfinished: bool,
    reply_owed: bool,
    direct_mode: bool,
    step_timeout: Duration,
    reply_limit: usize,
    relayed: Option<Frames>,
    stage1: Option<Frames>,
    direct: Option<Frames>,
    direct_waiter: Option<oneshot::Receiver<DirectStream>>,
}

/// Which ends of the chain's own streams left the mesh.
#[derive(Clone, Copy)]
struct Gone {
    stage1: bool,
    final_stage: bool,
}

impl Tail {
    /// Read and fold what the neighbours still send, each wait bounded, so
    /// every lane of a healthy hop is whole; nothing from a stage gone.
    async fn drain(mut self, lanes: &mut Folding, gone: Gone) {
        let drain_bound = if self.reply_owed {
            self.step_timeout + DRAIN_WAIT
        } else {
            DRAIN_WAIT
        };
        if self.unfinished
            && !gone.stage1
            && let Some(relayed) = self.relayed.as_mut()
        {
            drain_for(relayed, lanes, Wire::FromDownstream, drain_bound).await;
        }
        // Stage 1 may have said more after the step that failed (a stage
        // further on closing): read and fold it, so hop 0 still agrees.
        if self.unfinished
            && !gone.stage1
            && let Some(stage1) = self.stage1.as_mut()
        {
            drain_for(stage1, lanes, Wire::FromDownstream, drain_bound).await;
        }
        // Likewise the direct return: the final stage may have opened it (and
        // folded its opening) before the failure reached it, or before a
        // deadline that passed ahead of the first step: its opening is read
        // and folded then too, so nothing it folded as sent is left unread.
        if self.direct_mode && (self.unfinished || self.direct.is_none()) && !gone.final_stage {
            let drain_bound = if self.unfinished {
                drain_bound
            } else {
                DRAIN_WAIT
            };
            if self.direct.is_none()
                && let Ok(Ok((_send, stream, opening))) =
                    tokio::time::timeout(drain_bound, wait_direct(&mut self.direct_waiter)).await
            {
                lanes.fold(Wire::DirectReceived, &opening);
                self.direct = Some(spawn_frames(stream, self.reply_limit));
            }
            if let Some(frames) = self.direct.as_mut() {
                drain_for(frames, lanes, Wire::DirectReceived, drain_bound).await;
            }
        }
    }
}

/// A segment's own lanes: whole, or still being drained from survivors.
enum SegmentLanes {
    Ready(Box<Folding>),
    Draining(tokio::task::JoinHandle<Folding>),
}

impl SegmentLanes {
    /// Wait for a drain still running.
    async fn settle(&mut self) -> anyhow::Result<()> {
        if let SegmentLanes::Draining(task) = self {
            let lanes = task.await?;
            *self = SegmentLanes::Ready(Box::new(lanes));
        }
        Ok(())
    }

    /// The lanes, once settled.
    fn whole(&self) -> anyhow::Result<&Folding> {
        match self {
            SegmentLanes::Ready(lanes) => Ok(lanes),
            SegmentLanes::Draining(_) => bail!("a segment's lanes are still being read"),
        }
    }
}

/// Collect: close the request's bill at its steward (nothing billed for
/// waiting on a peer that failed), then wait, up to the seal deadline, for
/// every stage's record.
async fn collect(
    inner: &Arc<Inner>,
    admitted: &mut Admitted<'_>,
    driven: &mut Driven,
) -> anyhow::Result<Collected> {
    let held = &mut admitted.held;
    let terminal = driven.terminal;
    held.release_cache();
    let ticket = held
        .ticket
        .take()
        .context("the coordinator's grant decision")?;
    let metered = {
        let mut steward = lock(&inner.steward);
        let weights = Some(inner.model.weights_digest());
        if terminal == TerminalState::Completed {
            steward.end_engine(ticket, weights)?
        } else {
            // Waiting for a peer that failed or went away is not billed.
            steward.end_engine_at_mark(ticket, weights)?
        }
    };
    let until = Instant::now() + inner.deadline;
    let records = await_records(inner, admitted, driven, until).await?;
    Ok(Collected { metered, records })
}

/// Wait for the segment's survivors to finish (its lanes whole: a stage
/// seals its record when its part ends), then, until `until`, for every
/// stage record of the segment; in a mesh, not for those of stages that
/// left it during the segment (their records will not come). Takes the
/// segment's record slot.
async fn await_records(
    inner: &Arc<Inner>,
    admitted: &mut Admitted<'_>,
    driven: &mut Driven,
    until: Instant,
) -> anyhow::Result<Vec<Vec<SealedRecord>>> {
    driven.lanes.settle().await?;
    let request_id = admitted.request_id;
    let left_mesh = |key: &[u8; 32]| inner.left_mesh_since(key, driven.started);
    loop {
        let notified = inner.collected.notified();
        if lock(&inner.collector).is_complete_except(request_id, left_mesh) {
            break;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        // A member leaving is not a record arriving: look again now and then.
        let wait = match inner.mesh.get() {
            Some(_) => left.min(Duration::from_millis(100)),
            None => left,
        };
        let _ = tokio::time::timeout(wait, notified).await;
    }
    let pending = lock(&inner.collector).take(request_id);
    admitted.held.collector = false;
    Ok(pending.map(|p| p.records).unwrap_or_default())
}

/// Seal one segment's split: the own block (its lanes and what it
/// prefilled and decoded), the stage-exchange records and the main record,
/// chained after the coordinator's last.
fn seal_segment(
    inner: &Arc<Inner>,
    run: &Run,
    driven: &Driven,
    records: &[Vec<SealedRecord>],
) -> anyhow::Result<(mesh_protocol::split::SealedSplit, u64)> {
    let (terminal, prefilled) = (driven.terminal, driven.prefilled);
    let lanes = driven.lanes.whole()?;
    let n = run.assigns.len() as u32;
    let own_block = lanes.session.block(
        &SliceFacts {
            topology_hash: run.assigns[0].topology_hash.clone(),
            stage_index: 0,
            layer_start: run.own.slice.range.start,
            layer_end: run.own.slice.range.end,
            package_id: inner.model.package_id(),
            manifest_sha256: run.assigns[0].manifest,
            source_model_sha256: inner.model.package_id(),
        },
        Tokens {
            prefill_received: prefilled as u64,
            decode: driven.own_decode_rows,
        },
        terminal,
    );
    let nonces = (0..n)
        .map(|_| crate::runtime::keys::random_bytes())
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Read and advanced under one lock: two requests sealing at once each
    // chain after the other.
    let mut chain_head = lock(&inner.chain_head);
    let sealed = seal_split(
        &SplitSealInput {
            own: &own_block,
            topology: &run.topology,
            manifests: &run.assigns.iter().map(|a| a.manifest).collect::<Vec<_>>(),
            held: records,
            not_requested: &[],
            coordinator_term: inner.coordinator_term,
            stage_seal_deadline_ms: inner.deadline.as_millis() as u64,
            model_id: &model_id(inner),
        },
        &SealEnvironment {
            producer: Producer::mesh_node(),
            timestamp: format_timestamp(now_ms()),
            nonces,
            chain_head: *chain_head,
        },
        &inner.key,
    )?;
    *chain_head = Some(sealed.chain_head());
    drop(chain_head);
    // Every record this node sealed goes into its transparency log before
    // it leaves: the stage-exchange records, then the main record.
    let ids: Vec<[u8; 32]> = sealed
        .stage_exchange_records
        .iter()
        .chain([&sealed.main_record])
        .map(SealedRecord::capsule_id)
        .collect();
    let leaves = lock(&inner.steward).log_records(&ids)?;
    let main_leaf = leaves.last().copied().context("the main record's leaf")?;
    Ok((sealed, main_leaf))
}

pub(super) fn model_id(inner: &Inner) -> String {
    inner
        .model
        .path()
        .file_name()
        .map_or("model".to_string(), |f| f.to_string_lossy().into_owned())
}

/// A segment's bundle: its records, and the node behind each stage.
fn segment_bundle(sealed: &mesh_protocol::split::SealedSplit, run: &Run) -> serde_json::Value {
    let mut bundle = sealed.bundle();
    if let serde_json::Value::Object(map) = &mut bundle {
        map.insert(
            "stewards".into(),
            json!(
                run.keys
                    .iter()
                    .enumerate()
                    .map(|(k, key)| json!({ "stage_index": k, "node_id": did_key(key) }))
                    .collect::<Vec<_>>()
            ),
        );
    }
    bundle
}

/// The resume block's entry for one segment.
fn segment_entry(
    sealed: &mesh_protocol::split::SealedSplit,
    run: &Run,
    driven: &Driven,
) -> mesh_protocol::resume::Segment {
    mesh_protocol::resume::Segment {
        run_id: run.assigns[0].run_id.clone(),
        main_record: sealed.main_record.capsule_id(),
        nodes: run.keys.iter().map(did_key).collect(),
        first_token: driven.first_token as u64,
        prefilled: driven.prefilled as u64,
        tokens: driven.tokens as u64,
        terminal_state: driven.terminal.as_str().to_string(),
        lost: driven.lost.iter().map(did_key).collect(),
        kept: driven.kept.iter().map(did_key).collect(),
    }
}

/// The segments that lost their chain, sealed after the request ends: by
/// then their survivors' records and last frames have come in.
async fn seal_interrupted(
    inner: &Arc<Inner>,
    interrupted: Vec<Interrupted<'_>>,
) -> anyhow::Result<Vec<(serde_json::Value, mesh_protocol::resume::Segment)>> {
    let until = Instant::now() + inner.deadline;
    let mut sealed_segments = Vec::new();
    for mut segment in interrupted {
        let records =
            await_records(inner, &mut segment.admitted, &mut segment.driven, until).await?;
        let (sealed, _) = seal_segment(inner, &segment.run, &segment.driven, &records)?;
        sealed_segments.push((
            segment_bundle(&sealed, &segment.run),
            segment_entry(&sealed, &segment.run, &segment.driven),
        ));
    }
    Ok(sealed_segments)
}

/// Seal: the final segment's split, then the `mesh/1` receipt through the
/// steward (with the resume block of a resumed request), and the bundle a
/// requester checks (with the earlier segments).
fn seal(
    inner: &Arc<Inner>,
    run: &Arc<Run>,
    admitted: &Admitted<'_>,
    driven: &Driven,
    progress: &Progress,
    collected: Collected,
    earlier: Vec<(serde_json::Value, mesh_protocol::resume::Segment)>,
) -> anyhow::Result<Sealed> {
    let codec = inner.model.text();
    let prompt_ids = &admitted.prompt_ids;
    let serve = &admitted.serve;
    let tokens = &progress.tokens;
    let Collected { metered, records } = collected;
    let (sealed, main_leaf) = seal_segment(inner, run, driven, &records)?;
    let model_id = model_id(inner);
    let resumed = (!earlier.is_empty()).then(|| {
        let mut segments: Vec<_> = earlier.iter().map(|(_, entry)| entry.clone()).collect();
        segments.push(segment_entry(&sealed, run, driven));
        canonical_bytes(&mesh_protocol::resume::ResumeBlock { segments }.to_value())
    });

    let visible: Vec<u32> = tokens
        .iter()
        .copied()
        .filter(|t| !codec.is_eos(*t))
        .collect();
    let opening_value = opening(&lock(&inner.steward).opening_key(), &serve.request_id());
    // The level the router admitted it on, and what it delivered (§3.2.1):
    // all of it only when it ran to its own end or to every token asked.
    let chosen = admitted
        .route
        .chosen()
        .context("a request was admitted with no backend chosen")?;
    let advertised = chosen.fidelity;
    let asked = admitted.asked_tokens;
    let ran_to_its_end = driven.terminal == TerminalState::Completed
        && (progress.finish_reason == "stop" || tokens.len() >= asked);
    // What a chain costs is learnt from serves that ran to their end on
    // it alone: a failed or cut-short one (which a stranger can cause) says
    // little about the next.
    // A decision is a prefill alone, far cheaper per token than decoding:
    // it would teach generations a cost they do not have.
    if resumed.is_none()
        && driven.terminal == TerminalState::Completed
        && admitted.decision.is_none()
    {
        lock(&inner.route_costs).record(
            &chosen.backend,
            metered.energy.uj(),
            (prompt_ids.len() + tokens.len()) as u64,
        );
    }
    let receipt = MeshReceipt {
        request_id: serve.request_id(),
        grant_id: metered.grant_id,
        backend: mesh_protocol::replay::SPLIT_BACKEND.into(),
        recipe: model_id.clone(),
        weights: Some(WeightsBinding {
            weights_digest: inner.model.weights_digest(),
            precision: "q8_0/f32".into(),
        }),
        route: admitted.route.justification(),
        tokens_in: prompt_ids.len() as u64,
        tokens_out: tokens.len() as u64,
        tokens_accepted: visible.len() as u64,
        cache_hit_tokens: 0,
        spec_proposed: progress.spec_proposed,
        spec_accepted: progress.spec_accepted,
        fidelity_floor: serve.fidelity_floor,
        fidelity: Some(FidelityReport {
            advertised,
            delivered: mesh_protocol::route::delivered(advertised, ran_to_its_end),
        }),
        fidelity_rating: advertised,
        energy: metered.energy,
        // A decision's figures (§3.6): its unit of work is the question
        // answered, and it commits to no output tokens (it emits none).
        decision: serve.decision.map(|asked| DecisionOutcome {
            questions_answered: u32::from(progress.decided.is_some()),
            // Options count as scored only once they were.
            options_scored: if progress.decided.is_some() {
                asked.options_scored
            } else {
                0
            },
            schema_tokens: asked.schema_tokens,
        }),
        grant_breach: metered
            .debit
            .as_ref()
            .and_then(|d| d.breach)
            .map(str::to_string),
        output_commitment: serve.decision.is_none().then(|| {
            output_commitment(
                &opening_value,
                &serve.request_id(),
                &prompt_payload(prompt_ids),
                tokens,
            )
        }),
        sequence: 0,
        prev: None,
        nonce: crate::runtime::keys::random_bytes()?,
        steward: String::new(),
        split: Some(canonical_bytes(&sealed.receipt.to_value())),
        resumed,
        // The engine's declaration (SPEC §5), under the steward's signature.
        deterministic: Some(progress.deterministic && earlier.is_empty()),
        training: inner.training,
    };
    // The previous envelope is the steward's (kept in its journal, so the
    // chain link survives a restart), read under the same lock as the seal.
    let (previous_envelope, envelope) = {
        let mut steward = lock(&inner.steward);
        let previous = steward.last_envelope();
        (previous, steward.seal(receipt)?)
    };

    let mut bundle = segment_bundle(&sealed, run);
    if let serde_json::Value::Object(map) = &mut bundle {
        map.insert(
            "mesh1_envelope".into(),
            json!(mesh_protocol::hex::encode(&envelope.envelope)),
        );
        // Every backend weighed, bound to the receipt by its `route` line.
        map.insert("route".into(), admitted.route.to_json());
        if let Some(prev) = previous_envelope.filter(|_| envelope.receipt.sequence > 0) {
            map.insert(
                "mesh1_prev_envelope".into(),
                json!(mesh_protocol::hex::encode(&prev)),
            );
        }
        if !earlier.is_empty() {
            map.insert(
                "earlier_segments".into(),
                serde_json::Value::Array(earlier.into_iter().map(|(b, _)| b).collect()),
            );
        }
        if let Some((inclusion, checkpoint)) = inner
            .record_checkpoints
            .then(|| log_proof(inner, main_leaf))
            .flatten()
        {
            map.insert("inclusion".into(), inclusion);
            map.insert("checkpoint".into(), checkpoint);
        }
    }

    Ok(Sealed { bundle, envelope })
}

/// Report: the stages' own figures (best effort), then `done` or `failed`
/// with the details and the bundle; a cancelled request is sealed all the
/// same, with nobody to tell.
async fn report(
    inner: &Arc<Inner>,
    run: &Arc<Run>,
    admitted: &Admitted<'_>,
    driven: &Driven,
    progress: &Progress,
    sealed: Sealed,
    requester: &mut quinn::SendStream,
) -> anyhow::Result<()> {
    let request_id = admitted.request_id;
    let prompt_ids = &admitted.prompt_ids;
    let Driven {
        terminal,
        failure,
        fold_time,
        ..
    } = driven;
    let Progress {
        tokens,
        printed,
        finish_reason,
        own_compute,
        own_decode_engine,
        round_trips,
        decode_round_trips,
        started,
        resumes,
        ..
    } = progress;
    let prefill_time = progress.prefill_time.unwrap_or_default();
    let decode_time = progress
        .last_token_at
        .zip(progress.first_token_at)
        .map_or(Duration::ZERO, |(last, first)| last.duration_since(first));
    let terminal = *terminal;
    let Sealed { bundle, envelope } = sealed;
    let counters = &inner.counters;
    counters
        .tokens_generated
        .fetch_add(tokens.len() as u64, std::sync::atomic::Ordering::Relaxed);
    if terminal == TerminalState::ClientCancelled {
        // Sealed and journalled all the same; there is nobody to tell.
        stats::Counters::bump(&counters.requests_cancelled);
        return Ok(());
    }
    let n = run.assigns.len() as u32;
    let run_id = run.assigns[0].run_id.clone();
    let coordinator = inner.tls.did.clone();
    let return_mode = inner.return_mode;
    // Per-stage compute, as each stage reports it.
    let mut stages = vec![
        json!({ "stage_index": 0, "node_id": coordinator, "layers": [run.own.slice.range.start, run.own.slice.range.end], "compute_ms": own_compute.as_secs_f64() * 1e3, "decode_engine_ms": own_decode_engine.as_secs_f64() * 1e3, "fold_us": fold_time.as_micros() as u64 }),
    ];
    let mut remote_compute = Duration::ZERO;
    let mut decode_engine = *own_decode_engine;
    // Figures are best effort: asked of every stage at once, and a stage that
    // is gone costs the requester at most STATS_WAIT.
    let asked: Vec<_> = run
        .peers
        .iter()
        .map(|peer| {
            let (inner, peer) = (inner.clone(), peer.clone());
            tokio::spawn(async move {
                tokio::time::timeout(STATS_WAIT, query_stats(&inner, &peer, request_id)).await
            })
        })
        .collect();
    for (k, (peer, asked)) in run.peers.iter().zip(asked).enumerate() {
        let stats = match asked.await {
            Ok(Ok(Ok(stats))) => stats,
            _ => StageStats::default(),
        };
        remote_compute += stats.compute;
        decode_engine += stats.decode_engine;
        let a = &run.topology[k + 1];
        stages.push(json!({ "stage_index": k + 1, "node_id": peer.did(), "layers": [a.layer_start, a.layer_end], "compute_ms": stats.compute.as_secs_f64() * 1e3, "decode_engine_ms": stats.decode_engine.as_secs_f64() * 1e3, "fold_us": stats.fold.as_micros() as u64, "steps": stats.steps }));
    }
    let steps = tokens.len().max(1) as f64;
    let hops = one_way_hops_per_step(n as usize, return_mode) as f64;
    let overhead = round_trips.saturating_sub(remote_compute);
    let decision = admitted
        .decision
        .as_ref()
        .zip(progress.decided.as_ref())
        .map(|(plan, probabilities)| plan.to_json(probabilities));
    let mut details = json!({
        "request_id": request_id.to_string(),
        "run_id": run_id,
        "return_mode": return_mode.as_str(),
        "prompt_tokens": prompt_ids.len(),
        "generated_tokens": tokens.len(),
        "finish_reason": finish_reason,
        "token_ids": tokens,
        "prefill_ms": prefill_time.as_secs_f64() * 1e3,
        "decode_tokens_per_s": (tokens.len().saturating_sub(1)) as f64 / decode_time.as_secs_f64().max(1e-9),
        "decode_round_trip_ms": decode_round_trips.as_secs_f64() * 1e3 / progress.decode_steps.max(1) as f64,
        "decode_steps": progress.decode_steps,
        // Every stage's engine time on decode steps, the coordinator's
        // slice and head included: what the decode tokens cost without the
        // chain and without the hand-offs to each slice's worker. Asked of
        // the last chain's stages only: after a resume it leaves out the
        // stages of the chains lost.
        "decode_engine_ms": decode_engine.as_secs_f64() * 1e3,
        "spec_proposed": progress.spec_proposed,
        "spec_accepted": progress.spec_accepted,
        "drafts_from": progress.drafted.then(|| progress.drafter.source()),
        "stages": stages,
        "resumes": resumes,
        "per_hop_overhead_us": overhead.as_secs_f64() * 1e6 / steps / hops.max(1.0),
        "fold_share": fold_time.as_secs_f64() / started.elapsed().as_secs_f64().max(1e-9),
        "receipt": {
            "steward": envelope.receipt.steward,
            "sequence": envelope.receipt.sequence,
            "envelope_id": mesh_protocol::hex::encode(&envelope.envelope_id()),
            "energy_uj": envelope.receipt.energy.uj(),
            "energy_provenance": envelope.receipt.energy.provenance().as_str(),
            "uj_per_accepted_token": envelope.receipt.uj_per_accepted_token(),
            "grant_id": envelope.receipt.grant_id.map(|g| mesh_protocol::hex::encode(&g)),
            "grant_breach": envelope.receipt.grant_breach,
        },
    });
    // A decision's answer is the chosen option; its figures are in the
    // details.
    let text = match &decision {
        Some(answer) => answer["chosen"].as_str().unwrap_or_default().to_string(),
        None => printed.clone(),
    };
    if let (Some(answer), serde_json::Value::Object(map)) = (decision, &mut details) {
        map.insert("decision".into(), answer);
    }
    let done = ControlReply::Finished {
        failed: failure.is_some(),
        text,
        terminal_state: terminal.as_str().to_string(),
        error: failure.clone().unwrap_or_default(),
        details: serde_json::to_vec(&details)?,
        bundle: serde_json::to_vec(&bundle)?,
    }
    .to_cbor();
    stats::Counters::bump(if failure.is_some() {
        &counters.requests_failed
    } else {
        &counters.requests_completed
    });
    if let Some(failure) = &failure
        && let Some(unlogged) = lock(&inner.unserved_logged).admit(Instant::now())
    {
        tracing::warn!(
            request_id,
            terminal_state = terminal.as_str(),
            tokens = tokens.len(),
            unlogged,
            "a request failed: {failure}"
        );
    }
    msg::write_cbor(requester, &done).await?;
    Ok(())
}

/// The coordinator's steward meters its compute so far; past the grant's
/// energy ceiling, why the serve stops there.
fn ceiling_reached(
    inner: &Inner,
    ticket: Option<&mut crate::runtime::steward::ServeTicket>,
    tokens: usize,
) -> Option<String> {
    let ticket = ticket?;
    let metered = lock(&inner.steward).mark_engine(ticket);
    let limit = ticket.limit_uj().filter(|limit| metered >= *limit)?;
    Some(format!(
        "the energy ceiling of {limit} µJ was reached at the coordinator ({metered} µJ metered) after {tokens} tokens"
    ))
}

/// The final stage's direct-return stream, once it opens it.
async fn wait_direct(
    waiter: &mut Option<oneshot::Receiver<DirectStream>>,
) -> anyhow::Result<DirectStream> {
    match waiter {
        Some(waiter) => Ok(waiter.await?),
        None => std::future::pending().await,
    }
}

/// One-way hops a decode step crosses in a chain of `stages`: relayed
/// return goes down and back up every link; direct return goes down and
/// then straight home.
pub fn one_way_hops_per_step(stages: usize, return_mode: ReturnMode) -> usize {
    match return_mode {
        ReturnMode::Relayed => 2 * stages.saturating_sub(1),
        ReturnMode::Direct => stages,
    }
}

/// Prompt positions per prefill step, unless configured.
pub const DEFAULT_PREFILL_CHUNK_TOKENS: usize = 256;
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

/// The first of `stages` whose mesh connection closed (checked on every
/// change, and every 250 ms); never, for a node in no mesh. A member only
/// late with its advert or a ping still counts as there: QUIC's own idle
/// timeout judges it.
async fn stage_left(inner: &Inner, run: &Run, since: Instant) -> [u8; 32] {
    // Only a chain planned over the mesh: a configured peer's mesh
    // connection says nothing of its QUIC one.
    let Some(mesh) = inner.mesh.get().filter(|_| run.projected_us.is_some()) else {
        return std::future::pending().await;
    };
    let stages = &run.keys[1..];
    loop {
        if let Some(gone) = stages.iter().find(|k| inner.left_mesh_since(k, since)) {
            return *gone;
        }
        mesh.changed(Duration::from_millis(250)).await;
    }
}

/// Name the wait that ran out, and the setting that bounds it.
fn step_failure(error: anyhow::Error, whom: &str, timeout: Duration) -> anyhow::Error {
    if error.to_string().contains("timed out") {
        step_timed_out(whom, timeout)
    } else {
        error.context(format!("waiting for {whom}'s reply"))
    }
}

/// How long the coordinator waits for the stages' figures after a request.
const STATS_WAIT: Duration = Duration::from_millis(750);

async fn query_stats(
    inner: &Arc<Inner>,
    peer: &PeerAddr,
    request_id: u64,
) -> anyhow::Result<StageStats> {
    let (mut send, mut recv) = inner.net.open(peer, ALPN_CONTROL).await?;
    let request = ControlRequest::Stats { request_id }.to_cbor();
    let reply = msg::exchange(&mut send, &mut recv, &request, Duration::from_secs(2))
        .await?
        .context("no stats")?;
    match ControlReply::from_cbor(&reply)? {
        ControlReply::Stats {
            compute_us,
            decode_engine_us,
            fold_us,
            steps,
            ..
        } => Ok(StageStats {
            compute: Duration::from_micros(compute_us),
            decode_engine: Duration::from_micros(decode_engine_us),
            fold: Duration::from_micros(fold_us),
            steps: u32::try_from(steps).unwrap_or(u32::MAX),
        }),
        other => bail!("a stage answered `{}` to stats", other.kind()),
    }
}

async fn authorise_remote(
    inner: &Arc<Inner>,
    peer: &PeerAddr,
    run_id: &str,
    request_id: u64,
    serve: &ServeRequest,
    presentation: &mesh_protocol::grant::Presentation,
) -> anyhow::Result<()> {
    let (mut send, mut recv) = inner.net.open(peer, ALPN_CONTROL).await?;
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

async fn release_remote(
    inner: &Arc<Inner>,
    peer: &PeerAddr,
    request_id: u64,
) -> anyhow::Result<()> {
    let (mut send, mut recv) = inner.net.open(peer, ALPN_CONTROL).await?;
    let request = ControlRequest::Release { request_id }.to_cbor();
    msg::exchange(&mut send, &mut recv, &request, msg::IDLE_TIMEOUT).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{kept_from, shown_end};

    #[test]
    fn stages_after_the_last_that_changed_keep_their_caches() {
        let (c, a, b, spare) = ([0; 32], [1; 32], [2; 32], [3; 32]);
        let old = [(c, (0, 2)), (a, (2, 4)), (b, (4, 6))];
        // The middle lost, the spare on its layers: the final stage keeps.
        let next = [(c, (0, 2)), (spare, (2, 4)), (b, (4, 6))];
        assert_eq!(kept_from(&old, &next, &[a]), 2);
        // The final stage lost: nothing remote keeps.
        let next = [(c, (0, 2)), (a, (2, 4)), (spare, (4, 6))];
        assert_eq!(kept_from(&old, &next, &[b]), 3);
        // The same chain after a failure without a loss: every stage keeps.
        assert_eq!(kept_from(&old, &old, &[]), 1);
        // The same node on other layers rebuilds, and so does every stage
        // before it.
        let next = [(c, (0, 2)), (spare, (2, 5)), (b, (5, 6))];
        assert_eq!(kept_from(&old, &next, &[a]), 3);
        // A node that left and came back under its key is not trusted with
        // the cache it had.
        assert_eq!(kept_from(&old, &old, &[b]), 3);
        // Another stage count: nothing remote keeps.
        let next = [(c, (0, 4)), (b, (4, 6))];
        assert_eq!(kept_from(&old, &next, &[a]), 2);
    }

    #[test]
    fn a_stop_sequence_ends_the_text_before_it_and_is_never_shown_in_part() {
        let stop = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(shown_end("one two", &stop, false), (7, false));
        // A tail that may become a stop sequence is held back…
        assert_eq!(shown_end("one\n", &stop, false), (3, false));
        assert_eq!(shown_end("one EN", &stop, false), (4, false));
        // …and shown when it does not, or at the last step.
        assert_eq!(shown_end("one ENd", &stop, false), (7, false));
        assert_eq!(shown_end("one EN", &stop, true), (6, false));
        // The first stop sequence found ends the text.
        assert_eq!(shown_end("a END b\n\n", &stop, false), (2, true));
        assert_eq!(shown_end("a\n\nEND", &stop, true), (1, true));
        assert_eq!(shown_end("anything", &[], false), (8, false));
        // Held-back tails end on character boundaries.
        let stop = vec!["é!".to_string()];
        assert_eq!(shown_end("café", &stop, false), (3, false));
        // A character still missing bytes is held back until it is whole.
        assert_eq!(shown_end("caf\u{FFFD}", &[], false), (3, false));
        assert_eq!(shown_end("caf\u{FFFD}", &[], true), (6, false));
    }
}
