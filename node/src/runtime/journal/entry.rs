//! A journal entry and its deterministic CBOR form: what the steward
//! decided, debited, sealed, logged or was told, one record each.

use mesh_protocol::cbor::Cbor;
use mesh_protocol::grant::Presentation;
use mesh_protocol::mesh1::{ContentId, Energy, Provenance, ServeRequest};

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A grant decision, written before the engine runs.
    Authorised {
        presentation: Box<Presentation>,
        request: ServeRequest,
        model: Option<ContentId>,
        backend: String,
        decided_at_ms: u64,
    },
    /// The metered joules debited against the authorisation at `authorised_seq`.
    Debited {
        authorised_seq: u64,
        energy: Energy,
        breach: Option<String>,
    },
    /// A serve without a grant, written before its engine runs (so a serve
    /// that dies is seen, and a journal that cannot be written refuses the
    /// serve before any work).
    Started {
        request_id: ContentId,
        model: Option<ContentId>,
        backend: String,
        started_at_ms: u64,
    },
    /// The engine of the ungranted serve at `started_seq` returned.
    Ended { started_seq: u64, energy: Energy },
    /// A receipt, recorded before it is handed out. `envelope` is the sealed
    /// envelope itself (absent in journals from before it was kept, and for
    /// an envelope over [`MAX_KEPT_ENVELOPE_BYTES`]), so the chain's last
    /// envelope can be handed back after a restart.
    Sealed {
        sequence: u64,
        envelope_id: ContentId,
        envelope: Option<Vec<u8>>,
    },
    /// The steward stopped honouring grants (a witness showed a receipt this
    /// journal lacks).
    Halted {
        reason: String,
        at_ms: u64,
        /// The sequence of the receipt that proved it (absent in older
        /// journals).
        sequence: Option<u64>,
    },
    /// The journal's tail was lost (`written` was confirmed, the journal
    /// ends at `last`) and an operator chose to go on without it
    /// (`mesh-node journal accept-loss`).
    TailLost {
        last: Option<u64>,
        written: u64,
        at_ms: u64,
    },
    /// An operator made the steward honour grants again after a halt
    /// (`mesh-node steward clear-halt`), saying why.
    HaltCleared {
        reason: String,
        at_ms: u64,
        /// Receipts below this sequence that the journal does not hold are
        /// acknowledged: shown again, they halt nothing.
        through: u64,
    },
    /// An entry of a backend's weights change record (SPEC §6.5): its
    /// envelope, sealed by this steward and checked against the record
    /// before it was written.
    Changed { envelope: Vec<u8> },
    /// A request the router refused (SPEC §4: no backend admissible): its
    /// route table (RFC 8785 JSON, every candidate with its reason; the
    /// justification alone when the table is over `MAX_REFUSAL_TABLE_BYTES`),
    /// and how many refusals before it were counted but not journalled
    /// (at most `MAX_REFUSALS_JOURNALLED` a minute are).
    Refused {
        request_id: ContentId,
        table: String,
        unjournalled: u64,
        at_ms: u64,
    },
    /// A checkpoint this node signed over its transparency log (size and
    /// root), before it leaves: the next names it as `prev`, across a
    /// restart too.
    Checkpointed { size: u64, root: ContentId },
    /// A record this node sealed, appended to its transparency log (an
    /// MMR of record ids, `split-stage.md`), before the record leaves.
    Logged { capsule_id: ContentId },
    /// What this node, as a coordinator, found of another node (its
    /// reputation), before it acts on it.
    Judged(Judged),
}

/// One judgement of a node: an audit of its output passed or failed, or it
/// stalled on a step; left out of plans until `until_ms` (`at_ms` for a
/// pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judged {
    pub node: ContentId,
    pub judgement: Judgement,
    pub at_ms: u64,
    pub until_ms: u64,
}

impl Judged {
    fn to_cbor(self) -> Cbor {
        Cbor::text_map([
            ("kind", Cbor::text("judged")),
            ("node", Cbor::bytes(self.node.to_vec())),
            ("judgement", Cbor::text(self.judgement.as_str())),
            ("at_ms", Cbor::Uint(self.at_ms)),
            ("until_ms", Cbor::Uint(self.until_ms)),
        ])
    }
}

/// What a coordinator found of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    AuditPassed,
    AuditFailed,
    Stalled,
}

impl Judgement {
    pub fn as_str(self) -> &'static str {
        match self {
            Judgement::AuditPassed => "audit_passed",
            Judgement::AuditFailed => "audit_failed",
            Judgement::Stalled => "stalled",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        [Self::AuditPassed, Self::AuditFailed, Self::Stalled]
            .into_iter()
            .find(|j| j.as_str() == text)
    }
}

fn energy_cbor(energy: &Energy) -> Cbor {
    let mut fields = vec![
        ("estimated_uj", Cbor::Uint(energy.estimated_uj())),
        ("provenance", Cbor::text(energy.provenance().as_str())),
    ];
    if let Some(measured) = energy.measured_uj() {
        fields.push(("measured_uj", Cbor::Uint(measured)));
    }
    Cbor::text_map(fields)
}

fn energy_from_cbor(value: &Cbor) -> Result<Energy, String> {
    let energy = value.get("energy").ok_or("`energy`")?;
    let provenance = energy
        .get("provenance")
        .and_then(Cbor::as_text)
        .and_then(Provenance::parse)
        .ok_or("`energy.provenance`")?;
    Energy::from_parts(
        energy.get("measured_uj").and_then(Cbor::as_uint),
        energy
            .get("estimated_uj")
            .and_then(Cbor::as_uint)
            .ok_or("`energy.estimated_uj`")?,
        provenance,
    )
    .map_err(|e| e.to_string())
}

impl Entry {
    pub(super) fn to_cbor(&self) -> Cbor {
        match self {
            Entry::Authorised {
                presentation,
                request,
                model,
                backend,
                decided_at_ms,
            } => {
                let mut fields = vec![
                    ("kind", Cbor::text("authorised")),
                    ("presentation", presentation.to_cbor()),
                    ("request", request.to_cbor()),
                    ("backend", Cbor::text(backend)),
                    ("decided_at_ms", Cbor::Uint(*decided_at_ms)),
                ];
                if let Some(model) = model {
                    fields.push(("model", Cbor::bytes(model.to_vec())));
                }
                Cbor::text_map(fields)
            }
            Entry::Debited {
                authorised_seq,
                energy,
                breach,
            } => {
                let mut fields = vec![
                    ("kind", Cbor::text("debited")),
                    ("authorised_seq", Cbor::Uint(*authorised_seq)),
                    ("energy", energy_cbor(energy)),
                ];
                if let Some(breach) = breach {
                    fields.push(("breach", Cbor::text(breach)));
                }
                Cbor::text_map(fields)
            }
            Entry::Started {
                request_id,
                model,
                backend,
                started_at_ms,
            } => {
                let mut fields = vec![
                    ("kind", Cbor::text("started")),
                    ("request_id", Cbor::bytes(request_id.to_vec())),
                    ("backend", Cbor::text(backend)),
                    ("started_at_ms", Cbor::Uint(*started_at_ms)),
                ];
                if let Some(model) = model {
                    fields.push(("model", Cbor::bytes(model.to_vec())));
                }
                Cbor::text_map(fields)
            }
            Entry::Ended {
                started_seq,
                energy,
            } => Cbor::text_map([
                ("kind", Cbor::text("ended")),
                ("started_seq", Cbor::Uint(*started_seq)),
                ("energy", energy_cbor(energy)),
            ]),
            Entry::Sealed {
                sequence,
                envelope_id,
                envelope,
            } => {
                let mut fields = vec![
                    ("kind", Cbor::text("sealed")),
                    ("sequence", Cbor::Uint(*sequence)),
                    ("envelope_id", Cbor::bytes(envelope_id.to_vec())),
                ];
                if let Some(envelope) = envelope {
                    fields.push(("envelope", Cbor::bytes(envelope.clone())));
                }
                Cbor::text_map(fields)
            }
            Entry::Halted {
                reason,
                at_ms,
                sequence,
            } => {
                let mut fields = vec![
                    ("kind", Cbor::text("halted")),
                    ("reason", Cbor::text(reason)),
                    ("at_ms", Cbor::Uint(*at_ms)),
                ];
                if let Some(sequence) = sequence {
                    fields.push(("sequence", Cbor::Uint(*sequence)));
                }
                Cbor::text_map(fields)
            }
            Entry::TailLost {
                last,
                written,
                at_ms,
            } => {
                let mut fields = vec![
                    ("kind", Cbor::text("tail_lost")),
                    ("written", Cbor::Uint(*written)),
                    ("at_ms", Cbor::Uint(*at_ms)),
                ];
                if let Some(last) = last {
                    fields.push(("last", Cbor::Uint(*last)));
                }
                Cbor::text_map(fields)
            }
            Entry::HaltCleared {
                reason,
                at_ms,
                through,
            } => Cbor::text_map([
                ("kind", Cbor::text("halt_cleared")),
                ("reason", Cbor::text(reason)),
                ("at_ms", Cbor::Uint(*at_ms)),
                ("through", Cbor::Uint(*through)),
            ]),
            Entry::Changed { envelope } => Cbor::text_map([
                ("kind", Cbor::text("changed")),
                ("envelope", Cbor::bytes(envelope.clone())),
            ]),
            Entry::Refused {
                request_id,
                table,
                unjournalled,
                at_ms,
            } => Cbor::text_map([
                ("kind", Cbor::text("refused")),
                ("request_id", Cbor::bytes(request_id.to_vec())),
                ("table", Cbor::text(table)),
                ("unjournalled", Cbor::Uint(*unjournalled)),
                ("at_ms", Cbor::Uint(*at_ms)),
            ]),
            Entry::Checkpointed { size, root } => Cbor::text_map([
                ("kind", Cbor::text("checkpointed")),
                ("size", Cbor::Uint(*size)),
                ("root", Cbor::bytes(root.to_vec())),
            ]),
            Entry::Logged { capsule_id } => Cbor::text_map([
                ("kind", Cbor::text("logged")),
                ("capsule_id", Cbor::bytes(capsule_id.to_vec())),
            ]),
            Entry::Judged(judged) => judged.to_cbor(),
        }
    }

    pub(super) fn from_cbor(value: &Cbor) -> Result<Self, String> {
        let text = |key: &str| {
            value
                .get(key)
                .and_then(Cbor::as_text)
                .ok_or(format!("`{key}`"))
        };
        let uint = |key: &str| {
            value
                .get(key)
                .and_then(Cbor::as_uint)
                .ok_or(format!("`{key}`"))
        };
        let id = |v: &Cbor| -> Result<ContentId, String> {
            v.as_bytes()
                .and_then(|b| b.try_into().ok())
                .ok_or("a 32-byte id".to_string())
        };
        match text("kind")? {
            "authorised" => Ok(Entry::Authorised {
                presentation: Box::new(
                    Presentation::from_cbor(value.get("presentation").ok_or("`presentation`")?)
                        .map_err(|e| e.to_string())?,
                ),
                request: ServeRequest::from_cbor(value.get("request").ok_or("`request`")?)
                    .map_err(|e| e.to_string())?,
                model: value.get("model").map(id).transpose()?,
                backend: text("backend")?.to_string(),
                decided_at_ms: uint("decided_at_ms")?,
            }),
            "debited" => Ok(Entry::Debited {
                authorised_seq: uint("authorised_seq")?,
                energy: energy_from_cbor(value)?,
                breach: value
                    .get("breach")
                    .and_then(Cbor::as_text)
                    .map(str::to_string),
            }),
            "started" => Ok(Entry::Started {
                request_id: id(value.get("request_id").ok_or("`request_id`")?)?,
                model: value.get("model").map(id).transpose()?,
                backend: text("backend")?.to_string(),
                started_at_ms: uint("started_at_ms")?,
            }),
            "ended" => Ok(Entry::Ended {
                started_seq: uint("started_seq")?,
                energy: energy_from_cbor(value)?,
            }),
            "sealed" => {
                let envelope_id = id(value.get("envelope_id").ok_or("`envelope_id`")?)?;
                let envelope = value
                    .get("envelope")
                    .map(|e| e.as_bytes().map(<[u8]>::to_vec).ok_or("`envelope`"))
                    .transpose()?;
                if envelope
                    .as_ref()
                    .is_some_and(|e| <[u8; 32]>::from(blake3::hash(e)) != envelope_id)
                {
                    return Err("`envelope` is not the envelope `envelope_id` names".into());
                }
                Ok(Entry::Sealed {
                    sequence: uint("sequence")?,
                    envelope_id,
                    envelope,
                })
            }
            "halted" => Ok(Entry::Halted {
                reason: text("reason")?.to_string(),
                at_ms: uint("at_ms")?,
                sequence: value
                    .get("sequence")
                    .map(|v| v.as_uint().ok_or("`sequence`"))
                    .transpose()?,
            }),
            "tail_lost" => Ok(Entry::TailLost {
                last: value
                    .get("last")
                    .map(|v| v.as_uint().ok_or("`last`"))
                    .transpose()?,
                written: uint("written")?,
                at_ms: uint("at_ms")?,
            }),
            "halt_cleared" => Ok(Entry::HaltCleared {
                reason: text("reason")?.to_string(),
                at_ms: uint("at_ms")?,
                through: uint("through")?,
            }),
            "refused" => Ok(Entry::Refused {
                request_id: id(value.get("request_id").ok_or("`request_id`")?)?,
                table: text("table")?.to_string(),
                unjournalled: uint("unjournalled")?,
                at_ms: uint("at_ms")?,
            }),
            "checkpointed" => Ok(Entry::Checkpointed {
                size: uint("size")?,
                root: id(value.get("root").ok_or("`root`")?)?,
            }),
            "logged" => Ok(Entry::Logged {
                capsule_id: id(value.get("capsule_id").ok_or("`capsule_id`")?)?,
            }),
            "judged" => Ok(Entry::Judged(Judged {
                node: id(value.get("node").ok_or("`node`")?)?,
                judgement: Judgement::parse(text("judgement")?).ok_or("`judgement`")?,
                at_ms: uint("at_ms")?,
                until_ms: uint("until_ms")?,
            })),
            "changed" => Ok(Entry::Changed {
                envelope: value
                    .get("envelope")
                    .and_then(Cbor::as_bytes)
                    .ok_or("`envelope` missing or not bytes")?
                    .to_vec(),
            }),
            other => Err(format!("unknown entry kind `{other}`")),
        }
    }
}
