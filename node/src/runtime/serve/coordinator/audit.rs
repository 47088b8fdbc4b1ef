//! Audits by redundant execution. Hop agreement proves that both ends of
//! every hop saw the same bytes, not that a stage computed them honestly.
//! For a sampled request the coordinator keeps what it wrote to stage 1 and
//! what the final stage returned (the [`Tape`]); once the request is sealed
//! it runs every stage's layers itself over the same inputs, stage after
//! stage, and compares: a middle stage's recomputed forward lane with the
//! `downstream.sent` digest its own record sealed, the final stage's
//! recomputed replies with the bytes that came back. The first stage that
//! differs is named; the planner leaves its node out ([`Audits`]).
//!
//! The unit audited is a request, not a step: a decode step's output
//! depends on every position the stage's cache holds, so checking one step
//! costs running its whole prefix again. A request is audited with
//! probability `--audit-rate`; a stage that is always dishonest is caught
//! within `n` requests with probability `1 - (1 - rate)^n` (on average
//! `1 / rate` requests).
//!
//! Exact equality is what the engine gives on one device kind (a split's
//! bits are the unsplit run's; a batched step's are its own alone). A stage
//! whose advert names another device kind is not audited (its rounding
//! differs); neither is a request that was resumed on a new chain or kept
//! caches (its stages saw replays the tape does not hold).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mesh_protocol::audit::{self as protocol_audit, AuditStatement, SignedAudit, StageVerdict};
use mesh_protocol::block::{SplitKey, prefixed_sha256};
use mesh_protocol::capsule::SealedRecord;
use mesh_protocol::cbor::Cbor;
use mesh_protocol::fold::LaneDigest;
use mesh_protocol::identity::did_key;
use mesh_protocol::session::{HopSession, RequestScope, Wire};
use mesh_protocol::stage_frame::Rewind;
use mesh_protocol::tape::Tape as TapeFile;
use mesh_stage::frame::{WireDType, decode_frame, encode_frame};
use mesh_stage::{ModelHandle, SliceInput, SliceOutput};
use sha2::Digest;

use crate::runtime::clock::{lock, now_ms};
use crate::runtime::journal::Judgement;
use crate::runtime::net::msg::{self, kind};
use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::reputation::Reputation;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::steward::Judged;

/// The most a request's tape holds, as its file (`mesh-node-tape/1`: its
/// frames to stage 1 and the final stage's replies); a longer request is
/// not audited.
pub const MAX_TAPE_BYTES: usize = mesh_protocol::tape::MAX_TAPE_BYTES;

/// A tape file's bytes besides its frames: the magic, the request id, the
/// two counts.
const TAPE_FILE_HEADER: usize = mesh_protocol::tape::TAPE_MAGIC.len() + 8 + 4 + 4;

/// How long a node that failed an audit is left out of plans.
pub const DEFAULT_AUDIT_PAUSE: Duration = Duration::from_secs(60 * 60);

/// The default share of requests audited.
pub const DEFAULT_AUDIT_RATE: f64 = 0.02;

/// What a sampled request's chain was given and gave back, at the
/// coordinator: whole frames, exactly as they crossed.
#[derive(Debug)]
pub(crate) struct Tape {
    /// Every frame written to stage 1 and every HIDDEN reply from the
    /// final stage, in order.
    frames: TapeFile,
    /// What its file would take.
    bytes: usize,
    /// Past `MAX_TAPE_BYTES`: nothing more is kept, and it is not audited.
    overflowed: bool,
}

impl Default for Tape {
    fn default() -> Self {
        Self {
            frames: TapeFile::default(),
            bytes: TAPE_FILE_HEADER,
            overflowed: false,
        }
    }
}

impl Tape {
    /// A frame written to stage 1 (`body` as framed on the wire).
    pub(crate) fn forward(&mut self, body: &[u8]) {
        if let Ok(frame) = msg::frame(body)
            && self.room(frame.len())
        {
            self.frames.forward.push(frame);
        }
    }

    /// A reply that came back; only the final stage's hidden states count.
    pub(crate) fn reply(&mut self, frame: &[u8]) {
        let hidden = matches!(msg::parse_stage(frame), Ok((kind::HIDDEN, ..)));
        if hidden && self.room(frame.len()) {
            self.frames.replies.push(frame.to_vec());
        }
    }

    /// Room for a frame of `bytes` (and its length in the file).
    fn room(&mut self, bytes: usize) -> bool {
        self.bytes += bytes + 4;
        self.overflowed |= self.bytes > MAX_TAPE_BYTES;
        !self.overflowed
    }

    /// The tape as its file holds it, unless it overflowed.
    pub(crate) fn into_file(self, request_id: u64) -> Option<TapeFile> {
        (!self.overflowed).then_some(TapeFile {
            request_id,
            ..self.frames
        })
    }
}

/// One remote stage of the audited chain.
#[derive(Debug, Clone)]
pub(crate) struct AuditedStage {
    pub(crate) index: u32,
    pub(crate) node: [u8; 32],
    pub(crate) layers: Range<u32>,
    /// The lane its own record says it sent on (`sent_on`).
    pub(crate) claimed_sent: Option<LaneDigest>,
    /// The forward lane its own record says it received.
    pub(crate) claimed_received: Option<LaneDigest>,
}

/// Everything one audit needs, taken from the sealed request.
#[derive(Debug)]
pub(crate) struct AuditCase {
    pub(crate) scope: RequestScope,
    pub(crate) stages: Vec<AuditedStage>,
    pub(crate) tape: TapeFile,
}

/// What an audit found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every stage's output is what its layers give on its input.
    Passed,
    /// The first stage whose output differs.
    Failed {
        stage: u32,
        node: [u8; 32],
        /// The step whose output differs first, where the bytes are at
        /// hand (the final stage's replies); a middle stage's lane says
        /// only that one of its frames differs.
        step: Option<u32>,
        /// What its layers give, and what it sent.
        expected: String,
        claimed: String,
    },
    /// Nothing could be concluded, and why.
    Unauditable(String),
}

impl Verdict {
    /// One line for the log.
    pub(crate) fn describe(&self, split: &SplitKey) -> String {
        match self {
            Verdict::Passed => format!("audit of request {} passed", split.request_id),
            Verdict::Failed {
                stage,
                node,
                step,
                expected,
                claimed,
            } => format!(
                "audit of request {}: stage {stage} ({}) computed wrongly{}: its layers give {expected}, it sent {claimed}; left out of plans",
                split.request_id,
                did_key(node),
                step.map_or(String::new(), |s| format!(" at step {s}")),
            ),
            Verdict::Unauditable(why) => {
                format!("request {} not audited: {why}", split.request_id)
            }
        }
    }
}

/// The lanes stage `index`'s own record of the request says it sent on
/// and received.
fn claimed_lanes(
    records: &[Vec<SealedRecord>],
    index: u32,
) -> (Option<LaneDigest>, Option<LaneDigest>) {
    let block = records.get(index as usize).and_then(|held| {
        held.iter()
            .filter_map(|record| record.stage_block().ok())
            .find(|block| block.stage_index == index)
    });
    block.map_or((None, None), |block| {
        (sent_on(&block), block.upstream.map(|u| u.received))
    })
}

/// What a stage's block says it sent on: a middle stage's forward lane
/// (`downstream.sent`), the final stage's replies (`direct_return.sent`
/// in direct mode, `upstream.replies_sent` relayed).
pub(crate) fn sent_on(block: &mesh_protocol::block::StageBlock) -> Option<LaneDigest> {
    match (block.downstream, block.direct_return) {
        (Some(downstream), _) => Some(downstream.sent),
        (None, Some(mesh_protocol::block::DirectReturn::Sent(lane))) => Some(lane),
        (None, _) => block.upstream.map(|upstream| upstream.replies_sent),
    }
}

/// Run every audited stage's layers over the inputs the tape holds, in
/// chain order, and compare with what each stage sent. Blocking: minutes
/// of compute for a long request on a large model.
pub(crate) fn audit(model: &ModelHandle, case: &AuditCase) -> Verdict {
    if case.tape.request_id != case.scope.split.request_id {
        return Verdict::Unauditable(format!(
            "the tape is of request {}, not {}",
            case.tape.request_id, case.scope.split.request_id
        ));
    }
    match run_stages(model, case) {
        Ok(verdict) => verdict,
        Err(error) => Verdict::Unauditable(format!("{error:#}")),
    }
}

fn run_stages(model: &ModelHandle, case: &AuditCase) -> anyhow::Result<Verdict> {
    let open = case.tape.forward.first().context("no OPEN on the tape")?;
    let (open_kind, _, _, open_body) = msg::parse_stage(open)?;
    if open_kind != kind::OPEN {
        bail!("the tape does not start with OPEN");
    }
    let open = Cbor::decode(open_body).context("the OPEN it sent")?;
    let field = |name: &str| open.get(name).and_then(Cbor::as_uint);
    let prefill_steps = field("prefill_steps").context("OPEN's prefill_steps")?;
    let capacity = usize::try_from(field("capacity").context("OPEN's capacity")?)?;
    let mut inputs: Vec<Vec<u8>> = case.tape.forward.clone();
    // What stage 1 was sent: hop 0's forward lane, as this node folded it.
    let mut sent_before = sent_lane(&case.scope, 0, &inputs, false)?;
    let last = case.stages.len().checked_sub(1).context("no stage")?;
    for (i, stage) in case.stages.iter().enumerate() {
        // A stage is judged on inputs both ends of its hop agree on: one
        // that says it received other bytes than the stage before says it
        // sent is a disputed hop (the hop check shows it), and an honest
        // stage after a liar is not blamed for the liar's bytes.
        if stage.claimed_received != Some(sent_before) {
            return Ok(Verdict::Unauditable(format!(
                "stage {} says it received other bytes than were sent to it: a disputed hop (the hop check shows it)",
                stage.index
            )));
        }
        let outputs = run_stage(model, stage, &inputs, prefill_steps, capacity, i == last)?;
        let claimed = stage
            .claimed_sent
            .with_context(|| format!("stage {} sealed no lane of what it sent", stage.index))?;
        // Folded as the stage itself folds what it sends on.
        let expected = sent_lane(&case.scope, stage.index, &outputs, i == last)?;
        if i == last {
            let relayed = case.scope.return_mode == mesh_protocol::block::ReturnMode::Relayed;
            return Ok(judge_final(
                stage,
                (expected, claimed),
                (&outputs, &case.tape.replies),
                relayed,
            ));
        }
        if expected != claimed {
            return Ok(Verdict::Failed {
                stage: stage.index,
                node: stage.node,
                step: None,
                expected: lane_words(&expected),
                claimed: lane_words(&claimed),
            });
        }
        sent_before = claimed;
        inputs = outputs;
    }
    bail!("no stage audited")
}

fn lane_words(lane: &LaneDigest) -> String {
    format!(
        "{} frames folding to {}",
        lane.frames,
        prefixed_sha256(&lane.digest)
    )
}

/// What `stage` sends for `inputs` (the frames it was given): a middle
/// stage's forward frames (OPEN, REWIND and STOP passed on as they came,
/// each step's activations computed), or the final stage's replies.
fn run_stage(
    model: &ModelHandle,
    stage: &AuditedStage,
    inputs: &[Vec<u8>],
    prefill_steps: u64,
    capacity: usize,
    last: bool,
) -> anyhow::Result<Vec<Vec<u8>>> {
    room_for(model, stage, capacity)?;
    let slice = model.load_chain_slice(stage.layers.clone(), false)?;
    let mut cache = slice.new_cache(capacity)?;
    let hidden = slice.config().hidden;
    let mut outputs = Vec::with_capacity(inputs.len());
    let mut steps = 0u64;
    for frame in inputs {
        let (message_kind, request_id, step, payload) = msg::parse_stage(frame)?;
        match message_kind {
            kind::ACTIVATIONS => {
                let (activations, wire) = decode_frame(payload, hidden)?;
                // As the stage runs it: a decode step's rows each alone.
                let decode = steps >= prefill_steps;
                steps += 1;
                let mut jobs = [(SliceInput::Hidden(&activations), &mut cache)];
                let output = slice
                    .forward_batch_rows(&mut jobs, &[decode])?
                    .pop()
                    .context("no output")?;
                let SliceOutput::Hidden(a) = output else {
                    bail!("a stage's slice returned logits");
                };
                let body = if last {
                    // The final stage answers every row of a decode step,
                    // a prefill step's last, in f32.
                    let answered = if decode { a.rows } else { 1 };
                    let rows = a
                        .values
                        .get(a.rows.saturating_sub(answered) * a.cols..)
                        .context("no hidden state")?;
                    let payload = encode_frame(rows, answered, a.cols, WireDType::F32)?;
                    msg::stage_body(kind::HIDDEN, request_id, step, &payload)
                } else {
                    let payload = encode_frame(&a.values, a.rows, a.cols, wire)?;
                    msg::stage_body(kind::ACTIVATIONS, request_id, step, &payload)
                };
                outputs.push(msg::frame(&body)?);
            }
            kind::REWIND => {
                let Rewind { positions } = Rewind::parse(payload)?;
                cache.truncate(usize::try_from(positions)?)?;
                if !last {
                    outputs.push(frame.clone());
                }
            }
            _ if !last => outputs.push(frame.clone()),
            _ => {}
        }
    }
    Ok(outputs)
}

/// A stage's layers are loaded here only when this machine has room for
/// them and their cache now, a quarter to spare: a model is split because
/// it does not fit one machine, and an audit must not take a coordinator's
/// memory from under it (the layers are loaded one stage at a time, and let
/// go before the next).
fn room_for(model: &ModelHandle, stage: &AuditedStage, capacity: usize) -> anyhow::Result<()> {
    let layers = model.layer_bytes().layers;
    let (start, end) = (stage.layers.start as usize, stage.layers.end as usize);
    let weights: u64 = layers.get(start..end).map_or(0, |l| l.iter().sum());
    let kv = crate::runtime::planner::kv_bytes_per_position(model)
        .saturating_mul(capacity as u64)
        .saturating_mul(end.saturating_sub(start) as u64);
    let need = weights.saturating_add(kv).saturating_mul(5) / 4;
    match crate::runtime::planner::available_memory() {
        Some(free) if free < need => bail!(
            "this machine has {free} B free; stage {}'s layers and cache need {need} B",
            stage.index
        ),
        _ => Ok(()),
    }
}

/// The lane stage `index` folds what it sends on into: a middle stage's
/// forward lane; the final stage's replies, on the direct return (after
/// its opening) or relayed up.
fn sent_lane(
    scope: &RequestScope,
    index: u32,
    outputs: &[Vec<u8>],
    last: bool,
) -> anyhow::Result<LaneDigest> {
    let mut session = HopSession::new(scope.clone(), index);
    let digests = if !last {
        session.open_downstream();
        for frame in outputs {
            session.fold(Wire::ToDownstream, frame);
        }
        session.digests().downstream.map(|d| d.sent)
    } else if scope.return_mode == mesh_protocol::block::ReturnMode::Direct {
        session.open_direct();
        let opening = msg::stage_body(kind::DIRECT_OPEN, scope.split.request_id, 0, &[]);
        session.fold(Wire::DirectSent, &msg::frame(&opening)?);
        for frame in outputs {
            session.fold(Wire::DirectSent, frame);
        }
        match session.digests().direct_return {
            Some(mesh_protocol::block::DirectReturn::Sent(lane)) => Some(lane),
            _ => None,
        }
    } else {
        for frame in outputs {
            session.fold(Wire::ToUpstream, frame);
        }
        session.digests().upstream.map(|u| u.replies_sent)
    };
    digests.context("the lane it sends on")
}

/// The final stage: held to its own record of the replies it sent; the
/// replies that came back name the step. Relayed, a record that agrees
/// with its layers while the replies that came back do not means they
/// changed on the way (a stage between may have altered them: the hop
/// check shows where), not that the final stage computed wrongly; direct,
/// they came from it alone, on a stream it proved it holds.
fn judge_final(
    stage: &AuditedStage,
    (expected, claimed): (LaneDigest, LaneDigest),
    (outputs, received): (&[Vec<u8>], &[Vec<u8>]),
    relayed: bool,
) -> Verdict {
    let by_bytes = compare_replies(stage, outputs, received);
    if expected != claimed {
        return Verdict::Failed {
            stage: stage.index,
            node: stage.node,
            step: match by_bytes {
                Verdict::Failed { step, .. } => step,
                _ => None,
            },
            expected: lane_words(&expected),
            claimed: lane_words(&claimed),
        };
    }
    match by_bytes {
        Verdict::Failed { .. } if !relayed => by_bytes,
        Verdict::Failed { .. } => Verdict::Unauditable(format!(
            "the final stage's replies changed on their way back, though its own record agrees with its layers (stage {}): the hop check shows where",
            stage.index
        )),
        verdict => verdict,
    }
}

/// The final stage's replies against what its layers give.
fn compare_replies(stage: &AuditedStage, expected: &[Vec<u8>], received: &[Vec<u8>]) -> Verdict {
    let step_of = |frame: &Vec<u8>| msg::parse_stage(frame).ok().map(|(_, _, step, _)| step);
    let words = |frame: &Vec<u8>| {
        format!(
            "a reply hashing to {}",
            prefixed_sha256(&sha2::Sha256::digest(frame).into())
        )
    };
    for (i, want) in expected.iter().enumerate() {
        match received.get(i) {
            Some(got) if got == want => {}
            Some(got) => {
                return Verdict::Failed {
                    stage: stage.index,
                    node: stage.node,
                    step: step_of(want),
                    expected: words(want),
                    claimed: words(got),
                };
            }
            None => {
                return Verdict::Unauditable(format!(
                    "{} replies came back, its inputs give {}",
                    received.len(),
                    expected.len()
                ));
            }
        }
    }
    if received.len() != expected.len() {
        return Verdict::Unauditable(format!(
            "{} replies came back, its inputs give {}",
            received.len(),
            expected.len()
        ));
    }
    Verdict::Passed
}

/// Audit a request that was sampled, once its stages' records are in and
/// before it is sealed: one audit runs at a time, at most
/// `MAX_AUDITS_WAITING` wait, others are let go (counted). The verdict is
/// logged and counted in the nodes' standing (a failed stage's node is left
/// out of the plans that follow), and comes back signed for the bundle;
/// nothing when no conclusion was reached.
pub(crate) async fn audit_request(
    coordinator: &Arc<CoordinatorRole>,
    run: &Run,
    admitted: &Admitted<'_>,
    records: &[Vec<SealedRecord>],
    (tape, deadline): (Option<Tape>, crate::runtime::serve::shared::Deadline),
) -> Option<SignedAudit> {
    let scope = &admitted.scope;
    let request_id = scope.split.request_id;
    let Some(tape) = tape?.into_file(request_id) else {
        lock(&coordinator.planning.reputation).audits.unconcluded += 1;
        tracing::info!(
            request_id,
            "not audited: its frames passed {MAX_TAPE_BYTES} bytes"
        );
        return None;
    };
    let Ok(permit) = coordinator.planning.auditing.clone().try_acquire_owned() else {
        lock(&coordinator.planning.reputation).audits.let_go += 1;
        return None;
    };
    let case = audit_case(coordinator, run, scope.clone(), records, tape)?;
    let auditor = coordinator.clone();
    // The verdict is acted on in the task, whoever waits for it: a request
    // whose deadline comes first is sealed without it.
    let audited = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let _turn = lock(&AUDIT_TURN);
        let verdict = audit(&auditor.shared.model, &case);
        if let Some(dir) = &auditor.settings.audit_tapes {
            keep_tape(dir, &case.tape);
        }
        act_on(&auditor, &case, &verdict);
        let statement = statement(&case, &verdict)?;
        Some(SignedAudit::sign(statement, &auditor.shared.key))
    });
    match tokio::time::timeout(deadline.left(), audited).await {
        Ok(Ok(signed)) => signed,
        _ => {
            tracing::info!(
                request_id,
                "sealed before its audit ended: its deadline came first"
            );
            None
        }
    }
}

/// Log a verdict, journal it, then count it in the nodes' standing (the
/// next plan leaves a failed node out, `plan_now`).
fn act_on(coordinator: &CoordinatorRole, case: &AuditCase, verdict: &Verdict) {
    let line = verdict.describe(&case.scope.split);
    match verdict {
        Verdict::Failed { .. } => tracing::warn!("{line}"),
        _ => tracing::info!("{line}"),
    }
    journal_verdict(coordinator, case, verdict);
    record(
        &mut lock(&coordinator.planning.reputation),
        case,
        verdict,
        coordinator.settings.audit_pause,
    );
}

/// Keep an audited request's tape as `DIR/REQUEST_ID.tape` (`--audit-tapes`),
/// for `replay --tape`; a tape that cannot be written is said, not fatal.
fn keep_tape(dir: &std::path::Path, tape: &TapeFile) {
    let path = dir.join(format!("{}.tape", tape.request_id));
    let written = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, tape.encode()));
    if let Err(error) = written {
        tracing::warn!("could not keep the tape {}: {error}", path.display());
    }
}

/// What an audit needs of the run and the records; none unless this node
/// computes on the CPU and every stage that is a mesh member advertises
/// the CPU: the engine's CPU paths give the same bits on every CPU
/// (docs/engine.md), a GPU's may differ by card, and no advert says which
/// card. Configured peers (`--peer`) are the operator's own: audited
/// (`--audit-rate 0` for peers on GPUs).
fn audit_case(
    coordinator: &CoordinatorRole,
    run: &Run,
    scope: RequestScope,
    records: &[Vec<SealedRecord>],
    tape: TapeFile,
) -> Option<AuditCase> {
    let own_device = mesh_stage::device_name(coordinator.shared.model.device());
    let ours = device_kind(&own_device);
    if ours != "cpu" {
        return None;
    }
    let members = coordinator
        .shared
        .mesh
        .get()
        .map(|mesh| mesh.members())
        .unwrap_or_default();
    let mut stages = Vec::with_capacity(run.assigns.len().saturating_sub(1));
    for (assign, node) in run.assigns.iter().zip(&run.keys).skip(1) {
        let theirs = members
            .iter()
            .find(|m| m.advert.node_id == *node)
            .map(|m| device_kind(&m.advert.device));
        if theirs.is_some_and(|theirs| theirs != "cpu") {
            tracing::debug!(
                request_id = scope.split.request_id,
                "not audited: stage {} computes on another device kind",
                assign.stage_index
            );
            return None;
        }
        let (claimed_sent, claimed_received) = claimed_lanes(records, assign.stage_index);
        stages.push(AuditedStage {
            index: assign.stage_index,
            node: *node,
            layers: assign.layer_start..assign.layer_end,
            claimed_sent,
            claimed_received,
        });
    }
    Some(AuditCase {
        scope,
        stages,
        tape,
    })
}

/// The verdict as the bundle carries it: every stage in order, passed up
/// to the one that failed, not reached after it.
fn statement(case: &AuditCase, verdict: &Verdict) -> Option<AuditStatement> {
    let failed_at = match verdict {
        Verdict::Passed => None,
        Verdict::Failed { stage, .. } => Some(*stage),
        Verdict::Unauditable(_) => return None,
    };
    let stages = case
        .stages
        .iter()
        .map(|stage| {
            let (verdict, step, expected, claimed) = match (failed_at, verdict) {
                (
                    Some(at),
                    Verdict::Failed {
                        step,
                        expected,
                        claimed,
                        ..
                    },
                ) if at == stage.index => (
                    StageVerdict::Failed,
                    *step,
                    Some(expected.clone()),
                    Some(claimed.clone()),
                ),
                (Some(at), _) if stage.index > at => (StageVerdict::NotReached, None, None, None),
                _ => (StageVerdict::Passed, None, None, None),
            };
            protocol_audit::AuditedStage {
                stage_index: stage.index,
                node_id: did_key(&stage.node),
                verdict,
                step,
                expected,
                claimed,
            }
        })
        .collect();
    let split = &case.scope.split;
    Some(AuditStatement {
        coordinator_node_id: split.coordinator_node_id.clone(),
        run_id: split.run_id.clone(),
        request_id: split.request_id,
        stages,
    })
}

/// Count a verdict: every stage of a passed audit passed; a failed one
/// names one stage, left out for `pause` (the stages before it passed).
fn record(reputation: &mut Reputation, case: &AuditCase, verdict: &Verdict, pause: Duration) {
    let tally = &mut reputation.audits;
    match verdict {
        Verdict::Passed => tally.passed += 1,
        Verdict::Failed { .. } => tally.failed += 1,
        Verdict::Unauditable(_) => tally.unconcluded += 1,
    }
    let failed = match verdict {
        Verdict::Failed { stage, node, .. } => Some((*stage, *node)),
        Verdict::Passed => None,
        Verdict::Unauditable(_) => return,
    };
    for stage in &case.stages {
        match failed {
            Some((index, node)) if stage.index == index => {
                reputation.failed(node, Instant::now() + pause);
                return;
            }
            _ => reputation.passed(stage.node),
        }
    }
}

/// Journal what the coordinator found of a node, before it acts on it
/// (the standing is rebuilt from the journal on start): left out for
/// `pause` from now (nothing for a pass).
pub(crate) fn journal_judgement(
    coordinator: &CoordinatorRole,
    node: [u8; 32],
    judgement: Judgement,
    pause: Duration,
) {
    let at_ms = now_ms();
    let until_ms = at_ms.saturating_add(u64::try_from(pause.as_millis()).unwrap_or(u64::MAX));
    let judged = Judged {
        node,
        judgement,
        at_ms,
        until_ms,
    };
    if let Err(error) = lock(&coordinator.shared.steward).record_judgement(judged) {
        // The standing in memory still holds it: the node is left out
        // until this process ends, just not after a restart.
        tracing::warn!(
            "could not journal a judgement of {}: {error}",
            did_key(&node)
        );
    }
}

/// Journal an audit's verdict for every stage it judged.
fn journal_verdict(coordinator: &CoordinatorRole, case: &AuditCase, verdict: &Verdict) {
    let failed = match verdict {
        Verdict::Failed { stage, .. } => Some(*stage),
        Verdict::Passed => None,
        Verdict::Unauditable(_) => return,
    };
    for stage in &case.stages {
        if failed.is_some_and(|at| stage.index > at) {
            break;
        }
        let (judgement, pause) = if failed == Some(stage.index) {
            (Judgement::AuditFailed, coordinator.settings.audit_pause)
        } else {
            (Judgement::AuditPassed, Duration::ZERO)
        };
        journal_judgement(coordinator, stage.node, judgement, pause);
    }
}

/// One audit at a time in a process: each runs a whole model's layers.
static AUDIT_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `cpu`, `cuda`, `metal`: what rounds alike, whichever card.
fn device_kind(name: &str) -> &str {
    name.split(':').next().unwrap_or(name)
}

/// A tape for a request sampled for an audit. Only a request's first and
/// only chain, with no cache kept from another, is audited: its stages
/// saw nothing the tape misses.
pub(crate) fn tape_if_sampled(
    coordinator: &CoordinatorRole,
    run: &Run,
    admitted: &Admitted<'_>,
) -> Option<Tape> {
    let fresh = !run.alone() && admitted.resumes.is_none() && admitted.keep.is_none();
    (fresh && crate::runtime::keys::chance(coordinator.settings.audit_rate)).then(Tape::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case() -> AuditCase {
        let stage = |index: u32, seed: u8| AuditedStage {
            index,
            node: [seed; 32],
            layers: 0..1,
            claimed_sent: None,
            claimed_received: None,
        };
        AuditCase {
            scope: RequestScope {
                split: SplitKey {
                    coordinator_node_id: "did:key:z6Mk".into(),
                    run_id: "run".into(),
                    request_id: 1,
                },
                stage_count: 4,
                return_mode: mesh_protocol::block::ReturnMode::Direct,
            },
            stages: vec![stage(1, 1), stage(2, 2), stage(3, 3)],
            tape: TapeFile::default(),
        }
    }

    #[test]
    fn a_failed_audit_leaves_out_its_stage_only_and_counts_the_ones_before_as_passed() {
        let case = case();
        let mut reputation = Reputation::default();
        let failed = Verdict::Failed {
            stage: 2,
            node: [2; 32],
            step: None,
            expected: String::new(),
            claimed: String::new(),
        };
        record(&mut reputation, &case, &failed, Duration::from_secs(60));
        assert_eq!(reputation.left_out(Instant::now()), vec![[2; 32]]);
        assert_eq!(reputation.standing(&[1; 32]).audits_passed, 1);
        assert_eq!(reputation.standing(&[2; 32]).audits_failed, 1);
        assert_eq!(reputation.standing(&[3; 32]).audits_passed, 0);
        record(
            &mut reputation,
            &case,
            &Verdict::Passed,
            Duration::from_secs(60),
        );
        assert_eq!(reputation.standing(&[3; 32]).audits_passed, 1);
        let unconcluded = Verdict::Unauditable("no record".into());
        record(
            &mut reputation,
            &case,
            &unconcluded,
            Duration::from_secs(60),
        );
        assert_eq!(reputation.standing(&[3; 32]).audits_passed, 1);
        let tally = reputation.audits;
        assert_eq!((tally.passed, tally.failed, tally.unconcluded), (1, 1, 1));
    }

    /// A relayed reply altered by a stage between: the final stage's own
    /// record agrees with its layers, so it is not the one blamed.
    #[test]
    fn the_final_stage_is_held_to_its_own_record_not_to_what_came_back() {
        let stage = AuditedStage {
            index: 3,
            node: [3; 32],
            layers: 4..6,
            claimed_sent: None,
            claimed_received: None,
        };
        let reply = |step: u32, byte: u8| {
            msg::frame(&msg::stage_body(kind::HIDDEN, 1, step, &[byte; 8])).unwrap()
        };
        let computed = vec![reply(0, 1), reply(1, 2)];
        let altered = vec![reply(0, 1), reply(1, 9)];
        let lane = |digest: u8| LaneDigest {
            frames: 2,
            digest: [digest; 32],
        };
        let agreed = judge_final(&stage, (lane(1), lane(1)), (&computed, &altered), true);
        assert!(
            matches!(&agreed, Verdict::Unauditable(why) if why.contains("changed on their way back")),
            "{agreed:?}"
        );
        let lied = judge_final(&stage, (lane(1), lane(2)), (&computed, &altered), true);
        assert!(
            matches!(
                lied,
                Verdict::Failed {
                    stage: 3,
                    step: Some(1),
                    ..
                }
            ),
            "{lied:?}"
        );
        let honest = judge_final(&stage, (lane(1), lane(1)), (&computed, &computed), true);
        assert_eq!(honest, Verdict::Passed);
        // Direct, what came back came from the final stage alone.
        let direct = judge_final(&stage, (lane(1), lane(1)), (&computed, &altered), false);
        assert!(
            matches!(
                direct,
                Verdict::Failed {
                    stage: 3,
                    step: Some(1),
                    ..
                }
            ),
            "{direct:?}"
        );
    }

    #[test]
    fn a_tape_past_its_bound_keeps_nothing_more() {
        let mut tape = Tape::default();
        tape.forward(&[1, 2, 3]);
        assert_eq!(tape.frames.forward.len(), 1);
        tape.forward(&vec![0u8; MAX_TAPE_BYTES]);
        tape.forward(&[1, 2, 3]);
        assert!(tape.overflowed);
        assert_eq!(tape.frames.forward.len(), 1, "nothing kept past the bound");
        assert!(tape.into_file(1).is_none());
        let mut kept = Tape::default();
        kept.forward(&[1, 2, 3]);
        let bytes = kept.bytes;
        let file = kept.into_file(9).unwrap();
        assert_eq!(
            file.encode().len(),
            bytes,
            "what is counted is what its file takes"
        );
    }
}
