//! The steward: a node's identity, grant gate, journal, receipt log and
//! meter, wired in the order the SPEC requires — authorise and journal before
//! the engine runs, meter around the engine only, debit, journal the seal
//! before the receipt leaves.

use std::path::Path;

use mesh_protocol::SigningKey;
use mesh_protocol::bundle::MmrLog;
use mesh_protocol::change::ChangeRecord;
use mesh_protocol::grant::{Authorisation, Debit, GrantGate, Presentation, Refusal};
use mesh_protocol::identity::did_key;
use mesh_protocol::mesh1::{
    ContentId, Energy, MeshReceipt, SealedReceipt, ServeRequest, opening_key,
};
use thiserror::Error;

use crate::runtime::energy::{Apportioned, EnergyMeter, Share};
use crate::runtime::journal::{Entry, Journal, JournalError, MAX_KEPT_ENVELOPE_BYTES, Record};

#[derive(Debug, Error)]
pub enum StewardError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("grant refused ({})", .0.label())]
    Refused(#[from] Refusal),
    #[error("the journal is not one this steward produced: record {seq}: {why}")]
    ForeignJournal { seq: u64, why: String },
    #[error("the authorisation could not be journalled, so the serve is refused: {0}")]
    NotJournalled(JournalError),
    #[error("the receipt could not be journalled, so it is not handed out: {0}")]
    SealNotJournalled(JournalError),
    #[error("receipt: {0}")]
    Receipt(#[from] mesh_protocol::mesh1::Mesh1Error),
    #[error("the engine reported weights other than those the grant was decided over")]
    WeightsChanged,
    #[error(
        "backend {backend} has a weights change record, and {found} are not the weights in effect ({in_effect}): record the change first (mesh-node weights record)"
    )]
    NotInEffect {
        backend: String,
        found: String,
        in_effect: String,
    },
    #[error("the steward is not halted: it honours grants already")]
    NotHalted,
    #[error("the change record refuses the entry: {0}")]
    Change(#[from] mesh_protocol::change::ChangeError),
}

/// A serve that started and never finished: in flight when the steward
/// stopped. A granted one was authorised and never debited, and stays
/// debited at its ceiling for an operator to settle; an ungranted one
/// (`granted: false`, no caller, ceiling 0) was started and never ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unresolved {
    /// The record that authorised (or, ungranted, started) the serve.
    pub authorised_seq: u64,
    pub granted: bool,
    pub caller: String,
    pub backend: String,
    pub request_id: ContentId,
    pub ceiling_uj: u64,
    pub decided_at_ms: u64,
}

/// An authorised serve, held while the engine runs.
#[derive(Debug)]
pub struct ServeTicket {
    authorisation: Option<(u64, Authorisation)>,
    /// For a serve without a grant: the seq of its `started` record.
    started: Option<u64>,
    model: Option<ContentId>,
    span: Option<Share>,
    /// The span's energy when the engine last finished a step.
    mark: Option<Energy>,
    /// An ungranted serve's own ceiling (its request's `joule_ceiling_uj`,
    /// SPEC §3.1: a hard budget whether or not a grant backs it).
    ceiling_uj: Option<u64>,
}

impl ServeTicket {
    pub fn grant_id(&self) -> Option<ContentId> {
        self.authorisation.as_ref().map(|(_, a)| a.leaf_id)
    }

    /// What the serve's passes are charged to (the batch worker charges a
    /// pass's energy to the serves in it, by rows); none before the
    /// engine's window opens.
    pub fn bill(&self) -> Option<crate::runtime::energy::Bill> {
        self.span.as_ref().map(Share::bill)
    }

    /// Most energy this serve may use here: the request's ceiling (which
    /// the shard's remaining budget covered and now reserves) or the chain's
    /// least `MaxCostUj`; for an ungranted serve its request's ceiling, if
    /// it has one.
    pub fn limit_uj(&self) -> Option<u64> {
        self.authorisation
            .as_ref()
            .map(|(_, a)| a.ceiling_uj.min(a.max_cost_uj.unwrap_or(u64::MAX)))
            .or(self.ceiling_uj)
    }
}

/// What metering and debiting a serve produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metered {
    pub energy: Energy,
    pub grant_id: Option<ContentId>,
    pub debit: Option<Debit>,
}

/// Nodes of the transparency log held in memory (about 2 MiB) before the
/// log forgets all but the last `LOG_NODES_KEPT` positions and the peaks
/// before them (`MmrLog::forget`): the records of those positions and
/// every later one stay provable, older ones are proven from the journal
/// (`mesh-node log prove`).
pub const MAX_LOG_NODES_HELD: usize = 1 << 16;
/// Positions a forgetting log keeps: about 2,000 records, far more than
/// requests log between sealing a record and proving it.
pub const LOG_NODES_KEPT: usize = 4096;

/// A steward with its journal open.
#[derive(Debug)]
pub struct Steward {
    key: SigningKey,
    did: String,
    gate: GrantGate,
    journal: Journal,
    /// The node's meter, its energy split among the serves open at once.
    meter: Apportioned,
    next_sequence: u64,
    prev_envelope: Option<ContentId>,
    last_envelope: Option<Vec<u8>>,
    sealed: std::collections::BTreeMap<u64, ContentId>,
    unresolved: Vec<Unresolved>,
    /// Each backend's weights change record (SPEC §6.5).
    changes: std::collections::BTreeMap<String, ChangeRecord>,
    /// The transparency log of every record this node sealed.
    log: MmrLog,
    /// The last checkpoint issued (size, root), which the next names.
    last_checkpoint: Option<(u64, [u8; 32])>,
    witnessed: Witnessed,
    /// What it found of other nodes (`Replay::judged`), for the
    /// coordinator's reputation on start.
    judged: std::collections::VecDeque<Judged>,
}

/// What replaying a journal established.
#[derive(Debug, Clone)]
pub struct Replay {
    pub gate: GrantGate,
    pub next_sequence: u64,
    pub prev_envelope: Option<ContentId>,
    /// The last sealed envelope, when the journal kept it.
    pub last_envelope: Option<Vec<u8>>,
    pub sealed: std::collections::BTreeMap<u64, ContentId>,
    pub unresolved: Vec<Unresolved>,
    /// Each backend's change record, every entry checked again.
    pub changes: std::collections::BTreeMap<String, ChangeRecord>,
    /// The transparency log, rebuilt.
    pub log: MmrLog,
    /// The last checkpoint issued over it (size, root).
    pub last_checkpoint: Option<(u64, ContentId)>,
    pub witnessed: Witnessed,
    /// What this node found of others as a coordinator, oldest first (at
    /// most `MAX_JUDGEMENTS_HELD`, the latest).
    pub judged: std::collections::VecDeque<Judged>,
}

pub use crate::runtime::journal::Judged;

/// Judgements a steward holds for its coordinator to rebuild its nodes'
/// standing from on start (the journal keeps them all).
pub const MAX_JUDGEMENTS_HELD: usize = 4096;

/// Hold the latest `MAX_JUDGEMENTS_HELD` judgements.
fn hold_judgement(held: &mut std::collections::VecDeque<Judged>, judged: Judged) {
    if held.len() == MAX_JUDGEMENTS_HELD {
        held.pop_front();
    }
    held.push_back(judged);
}

/// What the witness rule knows beyond the receipts held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Witnessed {
    /// Receipts below this sequence that the journal does not hold were
    /// acknowledged by an operator (a halt cleared, a lost tail accepted):
    /// shown again, they halt nothing.
    pub acknowledged_through: u64,
    /// One past the highest sequence a halt was proven with since.
    pub shown_past: u64,
}

/// What a witness showing decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Witness {
    /// The journal holds this receipt.
    Held,
    /// The journal does not hold it, and the steward halted (now, or
    /// already before).
    Halted,
    /// The journal does not hold it, but an operator acknowledged it (it
    /// is of a fork or loss already dealt with): nothing halts.
    Acknowledged,
}

/// Replay journal records through a fresh gate (§2.2): every authorisation
/// decided again at its recorded time, every debit applied to its serve,
/// receipts in sequence. Anything else means the journal is foreign.
pub fn replay(steward_did: &str, records: &[Record]) -> Result<Replay, StewardError> {
    let mut gate = GrantGate::new(steward_did);
    let mut pending: std::collections::BTreeMap<u64, (Authorisation, String, u64)> =
        Default::default();
    let mut started: std::collections::BTreeMap<u64, (ContentId, String, u64)> = Default::default();
    let mut next_sequence = 0u64;
    let mut prev_envelope = None;
    let mut last_envelope = None;
    let mut sealed = std::collections::BTreeMap::new();
    let mut changes: std::collections::BTreeMap<String, ChangeRecord> = Default::default();
    let mut log = MmrLog::new();
    let mut last_checkpoint = None;
    // Receipts below this that the journal lacks were acknowledged by an
    // operator; the highest shown in a halt, plus one.
    let mut acknowledged_through = 0u64;
    let mut shown_past = 0u64;
    let mut judged = std::collections::VecDeque::new();
    let steward_key = mesh_protocol::identity::parse_did_key(steward_did);
    for record in records {
        let foreign = |why: String| StewardError::ForeignJournal {
            seq: record.seq,
            why,
        };
        match &record.entry {
            Entry::Authorised {
                presentation,
                request,
                model,
                backend,
                decided_at_ms,
            } => {
                let authorisation = gate
                    .decide(presentation, request, model.as_ref(), *decided_at_ms)
                    .map_err(|refusal| {
                        foreign(format!(
                            "the gate refuses the recorded authorisation: {refusal}"
                        ))
                    })?;
                pending.insert(record.seq, (authorisation, backend.clone(), *decided_at_ms));
            }
            Entry::Debited {
                authorised_seq,
                energy,
                ..
            } => {
                let (authorisation, _, _) = pending.remove(authorised_seq).ok_or_else(|| {
                    foreign(format!(
                        "a debit for {authorised_seq}, which is not an open authorisation"
                    ))
                })?;
                gate.debit(&authorisation, energy.uj());
            }
            Entry::Started {
                request_id,
                backend,
                started_at_ms,
                ..
            } => {
                started.insert(record.seq, (*request_id, backend.clone(), *started_at_ms));
            }
            Entry::Ended { started_seq, .. } => {
                started.remove(started_seq).ok_or_else(|| {
                    foreign(format!(
                        "an end for {started_seq}, which is not an open ungranted serve"
                    ))
                })?;
            }
            Entry::Sealed {
                sequence,
                envelope_id,
                envelope,
            } => {
                if *sequence != next_sequence {
                    return Err(foreign(format!(
                        "receipt {sequence} out of sequence (expected {next_sequence})"
                    )));
                }
                sealed.insert(*sequence, *envelope_id);
                prev_envelope = Some(*envelope_id);
                last_envelope = envelope.clone();
                next_sequence += 1;
            }
            Entry::Halted {
                reason, sequence, ..
            } => {
                gate.halt(reason.clone());
                if let Some(sequence) = sequence {
                    shown_past = shown_past.max(sequence.saturating_add(1));
                }
            }
            Entry::HaltCleared { through, .. } => {
                if gate.clear_halt().is_none() {
                    return Err(foreign("a halt cleared while none was in force".into()));
                }
                acknowledged_through = acknowledged_through.max(*through);
            }
            Entry::TailLost { last, written, .. } => {
                // The lost records held at most this many receipts, at the
                // sequences the steward goes on to issue again.
                let lost = written.saturating_sub(last.map_or(0, |l| l + 1)) + 1;
                acknowledged_through = acknowledged_through.max(next_sequence.saturating_add(lost));
            }
            Entry::Refused { .. } => {}
            Entry::Judged(one) => hold_judgement(&mut judged, *one),
            Entry::Logged { capsule_id } => {
                if log.held() > MAX_LOG_NODES_HELD {
                    log.forget(LOG_NODES_KEPT as u64);
                }
                log.append(capsule_id);
            }
            Entry::Checkpointed { size, root } => {
                // A checkpoint names a size the log had reached, and no
                // smaller one than the checkpoint before it.
                if *size > log.size() || last_checkpoint.is_some_and(|(before, _)| *size < before) {
                    return Err(foreign(format!(
                        "a checkpoint at size {size} (the log holds {})",
                        log.size()
                    )));
                }
                last_checkpoint = Some((*size, *root));
            }
            Entry::Changed { envelope } => {
                replay_change(&mut changes, envelope, steward_key, next_sequence)
                    .map_err(foreign)?;
            }
        }
    }
    let unresolved = unresolved_of(&mut gate, pending, started);
    Ok(Replay {
        judged,
        witnessed: Witnessed {
            acknowledged_through,
            shown_past,
        },
        gate,
        next_sequence,
        prev_envelope,
        last_envelope,
        sealed,
        unresolved,
        changes,
        log,
        last_checkpoint,
    })
}

/// The decisions a journal left open: a granted one still holds its
/// ceiling against its grant.
fn unresolved_of(
    gate: &mut GrantGate,
    pending: std::collections::BTreeMap<u64, (Authorisation, String, u64)>,
    started: std::collections::BTreeMap<u64, (ContentId, String, u64)>,
) -> Vec<Unresolved> {
    let mut unresolved = Vec::new();
    for (seq, (authorisation, backend, decided_at_ms)) in pending {
        gate.debit(&authorisation, authorisation.ceiling_uj);
        unresolved.push(Unresolved {
            authorised_seq: seq,
            granted: true,
            caller: authorisation.caller.clone(),
            backend,
            request_id: authorisation.request_id,
            ceiling_uj: authorisation.ceiling_uj,
            decided_at_ms,
        });
    }
    for (seq, (request_id, backend, started_at_ms)) in started {
        unresolved.push(Unresolved {
            authorised_seq: seq,
            granted: false,
            caller: String::new(),
            backend,
            request_id,
            ceiling_uj: 0,
            decided_at_ms: started_at_ms,
        });
    }
    unresolved.sort_by_key(|u| u.authorised_seq);
    unresolved
}

/// A change-record entry of the journal, checked and appended to its
/// backend's record; why it does not belong there.
fn replay_change(
    changes: &mut std::collections::BTreeMap<String, ChangeRecord>,
    envelope: &[u8],
    steward_key: Option<[u8; 32]>,
    next_sequence: u64,
) -> Result<(), String> {
    let change = mesh_protocol::change::SealedChange::verify(envelope)
        .map_err(|e| format!("a change-record entry: {e}"))?;
    // A change is in effect from the next receipt sealed after it.
    if let mesh_protocol::change::ChangeKind::Weights(w) = &change.entry.kind
        && w.effective_from != next_sequence
    {
        return Err(format!(
            "a weights change effective from receipt {}, recorded when the next was {next_sequence}",
            w.effective_from
        ));
    }
    let key = steward_key.ok_or_else(|| "the steward's id".to_string())?;
    changes
        .entry(change.entry.backend.clone())
        .or_insert_with(|| ChangeRecord::new(&change.entry.backend, key))
        .append(change)
        .map_err(|e| format!("a change-record entry: {e}"))
}

impl Steward {
    /// Open the steward's journal in `dir` (exclusively) and replay it.
    pub fn open(
        dir: &Path,
        key: SigningKey,
        meter: Box<dyn EnergyMeter>,
    ) -> Result<Self, StewardError> {
        let did = did_key(&key.verifying_key().to_bytes());
        let (journal, records) = Journal::open(dir, key.clone())?;
        let replayed = replay(&did, &records)?;
        Ok(Self {
            key,
            did,
            gate: replayed.gate,
            journal,
            meter: Apportioned::new(meter),
            next_sequence: replayed.next_sequence,
            prev_envelope: replayed.prev_envelope,
            last_envelope: replayed.last_envelope,
            sealed: replayed.sealed,
            unresolved: replayed.unresolved,
            changes: replayed.changes,
            log: replayed.log,
            last_checkpoint: replayed.last_checkpoint,
            witnessed: replayed.witnessed,
            judged: replayed.judged,
        })
    }

    /// Append records this node sealed to its transparency log: journalled
    /// first, then in the log. Their leaf indices.
    pub fn log_records(&mut self, ids: &[ContentId]) -> Result<Vec<u64>, StewardError> {
        self.journal
            .append_all(
                ids.iter()
                    .map(|capsule_id| Entry::Logged {
                        capsule_id: *capsule_id,
                    })
                    .collect(),
            )
            .map_err(StewardError::NotJournalled)?;
        // Only old positions are forgotten: records logged for requests
        // still on their way stay provable.
        if self.log.held() > MAX_LOG_NODES_HELD {
            self.log.forget(LOG_NODES_KEPT as u64);
        }
        Ok(ids.iter().map(|id| self.log.append(id)).collect())
    }

    /// A signed checkpoint of the log as it is now (`split-stage.md` §3.3),
    /// naming the one issued before it; `None` while the log is empty.
    /// Leaf `leaf`'s inclusion proof at the log's size and a checkpoint of
    /// that size, together (one lock, so they agree); nothing is journalled
    /// or signed when the leaf cannot be proven.
    pub fn prove_and_checkpoint(
        &mut self,
        leaf: u64,
        timestamp: &str,
    ) -> Option<(mesh_protocol::bundle::InclusionProof, serde_json::Value)> {
        let proof = self.log.prove(leaf)?;
        let checkpoint = self.checkpoint(timestamp)?;
        Some((proof, checkpoint))
    }

    pub fn checkpoint(&mut self, timestamp: &str) -> Option<serde_json::Value> {
        let (size, root) = (self.log.size(), self.log.root()?);
        // Journalled before it is signed and leaves, so the next checkpoint
        // names it even after a restart; unjournalled, none is issued.
        if let Err(error) = self.journal.append(Entry::Checkpointed { size, root }) {
            tracing::warn!("no checkpoint: the journal did not take it: {error}");
            return None;
        }
        let value = mesh_protocol::bundle::Checkpoint::sign(
            &self.did,
            size,
            &root,
            self.last_checkpoint.filter(|(before, _)| *before > 0),
            timestamp,
            &self.key,
        );
        self.last_checkpoint = Some((size, root));
        Some(value)
    }

    /// A backend's weights change record, when it has one.
    pub fn change_record(&self, backend: &str) -> Option<&ChangeRecord> {
        self.changes.get(backend)
    }

    /// Every backend's change record.
    pub fn change_records(&self) -> impl Iterator<Item = &ChangeRecord> {
        self.changes.values()
    }

    /// Record an entry of `entry.backend`'s change record: its `seq` and
    /// `prev` are set to the record's next position (and a weights
    /// change's `effective_from` to this steward's next receipt: the first
    /// served on it), it is sealed under this steward's key and checked
    /// against every rule of §6.5, then journalled, and only then in effect.
    pub fn record_change(
        &mut self,
        mut entry: mesh_protocol::change::ChangeEntry,
    ) -> Result<mesh_protocol::change::SealedChange, StewardError> {
        if let mesh_protocol::change::ChangeKind::Weights(w) = &mut entry.kind {
            w.effective_from = self.next_sequence;
        }
        let public = self.key.verifying_key().to_bytes();
        let mut record = self
            .changes
            .get(&entry.backend)
            .cloned()
            .unwrap_or_else(|| ChangeRecord::new(&entry.backend, public));
        (entry.seq, entry.prev) = record.next_position();
        let sealed = entry.seal(&self.key)?;
        record.append(sealed.clone())?;
        self.journal
            .append(Entry::Changed {
                envelope: sealed.envelope.clone(),
            })
            .map_err(StewardError::NotJournalled)?;
        self.changes.insert(entry.backend.clone(), record);
        Ok(sealed)
    }

    /// The gate (§6.5): once `backend` has a change record, only the
    /// weights its last `weights` entry put in effect are served and sealed.
    fn check_in_effect(
        &self,
        backend: &str,
        weights: Option<&ContentId>,
    ) -> Result<(), StewardError> {
        let Some(record) = self.changes.get(backend) else {
            return Ok(());
        };
        match (record.weights_in_effect(), weights) {
            (Some(in_effect), Some(weights)) if in_effect == *weights => Ok(()),
            (in_effect, weights) => Err(StewardError::NotInEffect {
                backend: backend.to_string(),
                found: weights.map_or("no weights".into(), |w| {
                    format!("weights {}", mesh_protocol::hex::encode(w))
                }),
                in_effect: in_effect
                    .map_or("none recorded".into(), |w| mesh_protocol::hex::encode(&w)),
            }),
        }
    }

    pub fn did(&self) -> &str {
        &self.did
    }
    pub fn meter_name(&self) -> &str {
        self.meter.name()
    }

    /// Journal a request the router refused (SPEC §4: the decision records
    /// why), before the refusal is answered: its route table, or its
    /// justification when the table is too large to keep.
    pub fn record_refusal(
        &mut self,
        request_id: ContentId,
        route: &mesh_protocol::route::Route,
        unjournalled: u64,
        now_ms: u64,
    ) -> Result<(), StewardError> {
        let table = String::from_utf8(mesh_protocol::json::canonical_bytes(&route.to_json()))
            .unwrap_or_default();
        let table = if table.len() <= crate::runtime::journal::MAX_REFUSAL_TABLE_BYTES {
            table
        } else {
            route.justification()
        };
        self.journal.append(Entry::Refused {
            request_id,
            table,
            unjournalled,
            at_ms: now_ms,
        })?;
        Ok(())
    }

    /// Journal what this node found of another (before it acts on it).
    pub fn record_judgement(&mut self, judged: Judged) -> Result<(), StewardError> {
        self.journal.append(Entry::Judged(judged))?;
        hold_judgement(&mut self.judged, judged);
        Ok(())
    }

    /// What this node found of others, oldest first.
    pub fn judged(&self) -> &std::collections::VecDeque<Judged> {
        &self.judged
    }

    /// The estimator the meter falls back to.
    pub fn estimator(&self) -> crate::runtime::energy::EstimatorMeter {
        self.meter.estimator()
    }
    pub fn unresolved(&self) -> &[Unresolved] {
        &self.unresolved
    }
    pub fn gate(&self) -> &GrantGate {
        &self.gate
    }
    pub fn next_sequence(&self) -> u64 {
        self.next_sequence
    }
    pub fn prev_envelope(&self) -> Option<ContentId> {
        self.prev_envelope
    }
    /// The last receipt envelope this steward sealed (its bytes), kept in
    /// the journal so it survives a restart: what a bundle shows as the
    /// previous envelope for the chain link. `None` before the first
    /// receipt, or when the journal predates kept envelopes.
    pub fn last_envelope(&self) -> Option<Vec<u8>> {
        self.last_envelope.clone()
    }
    pub fn halted(&self) -> Option<&str> {
        self.gate.halted()
    }

    /// The journal (tests inject storage failures through it).
    #[doc(hidden)]
    pub fn journal_mut(&mut self) -> &mut Journal {
        &mut self.journal
    }

    /// Phase one, before any work: decide the grant (when there is one) and
    /// journal the decision; a serve without a grant is journalled as
    /// started. Either way a journal that cannot take the write refuses the
    /// serve here ([`StewardError::NotJournalled`]), before any work, and a
    /// decision that cannot be journalled is undone.
    pub fn authorise(
        &mut self,
        presentation: Option<&Presentation>,
        request: &ServeRequest,
        model: Option<ContentId>,
        backend: &str,
        now_ms: u64,
    ) -> Result<ServeTicket, StewardError> {
        // Before any grant is decided or anything is journalled.
        self.check_in_effect(backend, model.as_ref())?;
        let Some(presentation) = presentation else {
            let record = self
                .journal
                .append(Entry::Started {
                    request_id: request.request_id(),
                    model,
                    backend: backend.to_string(),
                    started_at_ms: now_ms,
                })
                .map_err(StewardError::NotJournalled)?;
            return Ok(ServeTicket {
                authorisation: None,
                started: Some(record.seq),
                model,
                span: None,
                mark: None,
                ceiling_uj: (request.joule_ceiling_uj != u64::MAX)
                    .then_some(request.joule_ceiling_uj),
            });
        };
        let before = self.gate.clone();
        let authorisation = self
            .gate
            .decide(presentation, request, model.as_ref(), now_ms)?;
        let entry = Entry::Authorised {
            presentation: Box::new(presentation.clone()),
            request: request.clone(),
            model,
            backend: backend.to_string(),
            decided_at_ms: now_ms,
        };
        match self.journal.append(entry) {
            Ok(record) => Ok(ServeTicket {
                authorisation: Some((record.seq, authorisation)),
                started: None,
                model,
                span: None,
                mark: None,
                ceiling_uj: None,
            }),
            Err(error) => {
                self.gate = before;
                Err(StewardError::NotJournalled(error))
            }
        }
    }

    /// Open the energy window immediately before the engine runs.
    pub fn begin_engine(&self, ticket: &mut ServeTicket) {
        ticket.span = Some(self.meter.begin());
    }

    /// The engine finished a step: read the meter (the serve's energy so
    /// far, returned) and remember it as the point billing may stop at.
    pub fn mark_engine(&self, ticket: &mut ServeTicket) -> u64 {
        let Some(span) = &ticket.span else {
            return 0;
        };
        let energy = self.meter.so_far(span);
        let uj = energy.uj();
        ticket.mark = Some(energy);
        uj
    }

    /// Close the window immediately after the engine returns, and debit. The
    /// engine must report the weights the grant was decided over.
    pub fn end_engine(
        &mut self,
        ticket: ServeTicket,
        weights_after: Option<ContentId>,
    ) -> Result<Metered, StewardError> {
        self.end_engine_with(ticket, weights_after, false)
    }

    /// As `end_engine`, billing up to the last step's mark: a serve that
    /// ended waiting for a peer that is gone does not pay for the wait.
    pub fn end_engine_at_mark(
        &mut self,
        ticket: ServeTicket,
        weights_after: Option<ContentId>,
    ) -> Result<Metered, StewardError> {
        self.end_engine_with(ticket, weights_after, true)
    }

    fn end_engine_with(
        &mut self,
        mut ticket: ServeTicket,
        weights_after: Option<ContentId>,
        at_mark: bool,
    ) -> Result<Metered, StewardError> {
        let span = ticket.span.take().unwrap_or_else(|| self.meter.begin());
        let energy = match (ticket.mark.take(), at_mark) {
            (Some(mark), true) => mark,
            // No step finished: the engine did no work worth billing.
            (None, true) => self.meter.end(self.meter.begin()),
            (_, false) => self.meter.end(span),
        };
        let weights_changed = ticket.model.is_some() && ticket.model != weights_after;
        let grant_id = ticket.grant_id();
        let debit = match ticket.authorisation.take() {
            Some((seq, authorisation)) => {
                // The work ran: debit whatever happens next.
                let debit = self.gate.debit(&authorisation, energy.uj());
                self.journal.append(Entry::Debited {
                    authorised_seq: seq,
                    energy,
                    breach: debit.breach.map(str::to_string),
                })?;
                Some(debit)
            }
            None => {
                if let Some(started_seq) = ticket.started.take() {
                    self.journal.append(Entry::Ended {
                        started_seq,
                        energy,
                    })?;
                }
                None
            }
        };
        if weights_changed {
            return Err(StewardError::WeightsChanged);
        }
        Ok(Metered {
            energy,
            grant_id,
            debit,
        })
    }

    /// Stamp the receipt into the log (sequence, prev, steward), seal it,
    /// journal the seal, and only then return it.
    pub fn seal(&mut self, mut receipt: MeshReceipt) -> Result<SealedReceipt, StewardError> {
        self.check_in_effect(
            &receipt.backend,
            receipt.weights.as_ref().map(|w| &w.weights_digest),
        )?;
        receipt.sequence = self.next_sequence;
        receipt.prev = self.prev_envelope;
        receipt.steward = self.did.clone();
        let sealed = receipt.seal(&self.key)?;
        let envelope_id = sealed.envelope_id();
        let kept =
            (sealed.envelope.len() <= MAX_KEPT_ENVELOPE_BYTES).then(|| sealed.envelope.clone());
        self.journal
            .append(Entry::Sealed {
                sequence: receipt.sequence,
                envelope_id,
                envelope: kept.clone(),
            })
            .map_err(StewardError::SealNotJournalled)?;
        self.sealed.insert(receipt.sequence, envelope_id);
        self.next_sequence += 1;
        self.prev_envelope = Some(envelope_id);
        self.last_envelope = kept;
        Ok(sealed)
    }

    /// The opening key of this steward's output commitments.
    pub fn opening_key(&self) -> [u8; 32] {
        opening_key(&self.key.to_bytes())
    }

    /// A party shows a receipt this steward sealed (seed 001 §2.2). A
    /// receipt under this steward's signature that the journal does not
    /// hold is proof that records were cut or forked after it left: a
    /// different receipt at a sequence the journal holds, or one past its
    /// end. The steward then refuses every grant from now on (the halt is
    /// journalled, so it survives a restart) until an operator clears it
    /// ([`Steward::clear_halt`]). A receipt an operator acknowledged (below
    /// a cleared halt's or an accepted loss's `through`) halts nothing, and
    /// a steward halted already journals nothing more. The envelope must be
    /// exactly the bytes the steward sealed (deterministic CBOR, checked by
    /// `SealedReceipt::verify`): the same receipt written another way is
    /// refused as an error and changes nothing.
    /// `Ok(true)` when the journal holds the receipt.
    pub fn witness(&mut self, envelope: &[u8], now_ms: u64) -> Result<bool, StewardError> {
        Ok(self.witness_verified(SealedReceipt::verify(envelope)?, now_ms)? == Witness::Held)
    }

    /// `witness` of an envelope already verified (its signature checked
    /// before the steward is locked, so a flood of them holds no lock):
    /// what it decided.
    pub fn witness_verified(
        &mut self,
        sealed: SealedReceipt,
        now_ms: u64,
    ) -> Result<Witness, StewardError> {
        if sealed.receipt.steward != self.did {
            return Err(StewardError::Receipt(
                mesh_protocol::mesh1::Mesh1Error::StewardMismatch,
            ));
        }
        let sequence = sealed.receipt.sequence;
        let shown = sealed.envelope_id();
        let reason = match self.sealed.get(&sequence) {
            Some(held) if *held == shown => return Ok(Witness::Held),
            _ if sequence < self.witnessed.acknowledged_through => {
                return Ok(Witness::Acknowledged);
            }
            _ if self.gate.halted().is_some() => return Ok(Witness::Halted),
            Some(held) => format!(
                "shown receipt {} at sequence {sequence}, where the journal holds {}: two receipts \
                 signed at one sequence (a forked log); find which copy of the journal sealed it",
                mesh_protocol::hex::encode(&shown),
                mesh_protocol::hex::encode(held),
            ),
            None => format!(
                "shown receipt {} (sequence {sequence}) past the journal's last ({}): records were \
                 cut after it left; restore the journal",
                mesh_protocol::hex::encode(&shown),
                self.next_sequence
                    .checked_sub(1)
                    .map_or("none".to_string(), |last| last.to_string()),
            ),
        };
        self.journal.append(Entry::Halted {
            reason: reason.clone(),
            at_ms: now_ms,
            sequence: Some(sequence),
        })?;
        self.gate.halt(reason);
        self.witnessed.shown_past = self.witnessed.shown_past.max(sequence.saturating_add(1));
        Ok(Witness::Halted)
    }

    /// An operator's way out of a halt (`mesh-node steward clear-halt`):
    /// journalled first, with the operator's reason, then in force. The
    /// reason the steward had halted for; an error when it was not halted.
    pub fn clear_halt(&mut self, reason: &str, now_ms: u64) -> Result<String, StewardError> {
        let Some(halted) = self.gate.halted().map(str::to_string) else {
            return Err(StewardError::NotHalted);
        };
        // The receipts the halt was proven with (and any before them the
        // journal lacks) are dealt with: shown again, they halt nothing.
        let through = self.next_sequence.max(self.witnessed.shown_past);
        self.journal
            .append(Entry::HaltCleared {
                reason: reason.to_string(),
                at_ms: now_ms,
                through,
            })
            .map_err(StewardError::NotJournalled)?;
        self.gate.clear_halt();
        self.witnessed.acknowledged_through = self.witnessed.acknowledged_through.max(through);
        Ok(halted)
    }
}
