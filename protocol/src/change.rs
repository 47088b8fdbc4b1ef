//! The weights change record (SPEC §6.5): a backend's hash-chained entries,
//! each a JCR-1 envelope under the steward key that seals its receipts
//! (profile tag `mesh_change: "mesh/1"`), saying when its weights changed,
//! from what, to what, and under which plan; every refusal rule of §6.5;
//! which weights are in effect; and whether a receipt is covered.
//!
//! Sans-IO: the steward persists the envelopes, and the caller gives the
//! times.
//!
//! Core (det-CBOR map, text keys; digests as hex text; optional members
//! omitted when absent):
//!
//! ```text
//! mesh_change "mesh/1", backend, recipe, seq, prev?, made_at, kind,
//!   kind "plan":    precisions [text], fidelity_floor, validation, foresees, risk_assessment?
//!   kind "weights": from?, to, precision?, fidelity, plan?, validation_result?, effective_from, reason
//! ```

use ed25519_dalek::SigningKey;
use thiserror::Error;

use crate::cbor::{Cbor, Fields};
use crate::hex;
use crate::identity::did_key;
use crate::mesh1::{
    ContentId, Fidelity, MAX_RECEIPT_TEXT, Mesh1Error, MeshReceipt, open_sign1, sign1,
};

/// The profile tag's only value.
pub const MESH_CHANGE_VERSION: &str = "mesh/1";
/// Most precisions a plan lists.
pub const MAX_PLAN_PRECISIONS: usize = 64;
/// Most entries a record holds (a backend changes its weights rarely).
pub const MAX_CHANGE_ENTRIES: usize = 65_536;

/// A plan: the changes the steward foresees for the backend, before them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The precisions a change under it may run at; empty: any, as long as
    /// the change names one.
    pub precisions: Vec<String>,
    pub fidelity_floor: Fidelity,
    /// How a change under it is validated.
    pub validation: String,
    /// What it foresees.
    pub foresees: String,
    pub risk_assessment: Option<String>,
}

/// One change of the backend's weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsChange {
    /// The weights before; absent for the backend's first weights entry.
    pub from: Option<ContentId>,
    pub to: ContentId,
    pub precision: Option<String>,
    pub fidelity: Fidelity,
    /// The content id of the plan entry it falls under; absent when no
    /// plan foresaw it.
    pub plan: Option<ContentId>,
    pub validation_result: Option<String>,
    /// The first sequence of the steward's receipt log served on `to`.
    pub effective_from: u64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeKind {
    Plan(Plan),
    Weights(WeightsChange),
}

/// One entry of a change record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeEntry {
    pub backend: String,
    pub recipe: String,
    pub seq: u64,
    pub prev: Option<ContentId>,
    /// Unix seconds, the steward's statement of the time.
    pub made_at: u64,
    pub kind: ChangeKind,
}

/// How a change falls outside the plan it names.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum PlanBreach {
    #[error("another recipe")]
    Recipe,
    #[error("no precision")]
    NoPrecision,
    #[error("a precision the plan does not list")]
    Precision,
    #[error("a fidelity below the plan's floor")]
    Fidelity,
    #[error("no validation result")]
    NoValidationResult,
}

/// Why an entry, or a record, does not hold.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ChangeError {
    #[error("envelope: {0}")]
    Envelope(#[from] Mesh1Error),
    #[error("not a change-record entry: `mesh_change` is not \"mesh/1\"")]
    NotAnEntry,
    #[error("the entry is for backend {0:?}, not this record's")]
    OtherBackend(String),
    #[error("sealed by another key than the record's steward")]
    OtherSteward,
    #[error("`seq` {found} is not the next ({expected})")]
    NotNext { expected: u64, found: u64 },
    #[error("`prev` is not the content id of the envelope before it")]
    PrevMismatch,
    #[error("`made_at` is earlier than the entry before it")]
    EarlierThanBefore,
    #[error("`from` is not the `to` of the last weights entry before it")]
    FromMismatch,
    #[error("`to` equals `from`: nothing changed")]
    NoChange,
    #[error("`effective_from` is earlier than the last change's")]
    EffectiveEarlier,
    #[error("`plan` names no plan entry earlier in this record")]
    UnknownPlan,
    #[error("the change is outside its plan: {0}")]
    OutsidePlan(PlanBreach),
    #[error("the record holds {MAX_CHANGE_ENTRIES} entries already")]
    Full,
}

impl ChangeError {
    /// A stable name, for vectors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Envelope(_) => "envelope",
            Self::NotAnEntry => "not_an_entry",
            Self::OtherBackend(_) => "other_backend",
            Self::OtherSteward => "other_steward",
            Self::NotNext { .. } => "seq_not_next",
            Self::PrevMismatch => "prev_mismatch",
            Self::EarlierThanBefore => "made_at_earlier",
            Self::FromMismatch => "from_mismatch",
            Self::NoChange => "to_equals_from",
            Self::EffectiveEarlier => "effective_from_earlier",
            Self::UnknownPlan => "unknown_plan",
            Self::OutsidePlan(PlanBreach::Recipe) => "outside_plan_recipe",
            Self::OutsidePlan(PlanBreach::NoPrecision) => "outside_plan_no_precision",
            Self::OutsidePlan(PlanBreach::Precision) => "outside_plan_precision",
            Self::OutsidePlan(PlanBreach::Fidelity) => "outside_plan_fidelity",
            Self::OutsidePlan(PlanBreach::NoValidationResult) => {
                "outside_plan_no_validation_result"
            }
            Self::Full => "full",
        }
    }
}

impl ChangeEntry {
    pub fn to_cbor(&self) -> Cbor {
        let mut fields = vec![
            ("mesh_change", Cbor::text(MESH_CHANGE_VERSION)),
            ("backend", Cbor::text(&self.backend)),
            ("recipe", Cbor::text(&self.recipe)),
            ("seq", Cbor::Uint(self.seq)),
            ("made_at", Cbor::Uint(self.made_at)),
        ];
        if let Some(prev) = &self.prev {
            fields.push(("prev", Cbor::text(hex::encode(prev))));
        }
        match &self.kind {
            ChangeKind::Plan(plan) => {
                fields.extend([
                    ("kind", Cbor::text("plan")),
                    (
                        "precisions",
                        Cbor::Array(plan.precisions.iter().map(Cbor::text).collect()),
                    ),
                    ("fidelity_floor", Cbor::Uint(plan.fidelity_floor.level())),
                    ("validation", Cbor::text(&plan.validation)),
                    ("foresees", Cbor::text(&plan.foresees)),
                ]);
                if let Some(risk) = &plan.risk_assessment {
                    fields.push(("risk_assessment", Cbor::text(risk)));
                }
            }
            ChangeKind::Weights(change) => {
                fields.extend([
                    ("kind", Cbor::text("weights")),
                    ("to", Cbor::text(hex::encode(&change.to))),
                    ("fidelity", Cbor::Uint(change.fidelity.level())),
                    ("effective_from", Cbor::Uint(change.effective_from)),
                    ("reason", Cbor::text(&change.reason)),
                ]);
                if let Some(from) = &change.from {
                    fields.push(("from", Cbor::text(hex::encode(from))));
                }
                if let Some(precision) = &change.precision {
                    fields.push(("precision", Cbor::text(precision)));
                }
                if let Some(plan) = &change.plan {
                    fields.push(("plan", Cbor::text(hex::encode(plan))));
                }
                if let Some(result) = &change.validation_result {
                    fields.push(("validation_result", Cbor::text(result)));
                }
            }
        }
        Cbor::text_map(fields)
    }

    /// Read a core strictly: unknown members, a missing one, a member of
    /// the other kind, and over-long text are refused.
    pub fn from_cbor(value: &Cbor) -> Result<Self, ChangeError> {
        let mut f = Fields::of(value)
            .map_err(Mesh1Error::from)?
            .text_limit(MAX_RECEIPT_TEXT);
        let field = |e| ChangeError::Envelope(Mesh1Error::from(e));
        if f.text("mesh_change").map_err(field)? != MESH_CHANGE_VERSION {
            return Err(ChangeError::NotAnEntry);
        }
        let backend = f.text("backend").map_err(field)?.to_string();
        let recipe = f.text("recipe").map_err(field)?.to_string();
        let seq = f.uint("seq").map_err(field)?;
        let prev = f.opt_hex32("prev").map_err(field)?;
        let made_at = f.uint("made_at").map_err(field)?;
        let fidelity = |level: u64, key: &'static str| {
            Fidelity::from_level(level).ok_or(ChangeError::Envelope(Mesh1Error::Invalid(key)))
        };
        let kind = match f.text("kind").map_err(field)? {
            "plan" => {
                let listed = f.array("precisions").map_err(field)?;
                if listed.len() > MAX_PLAN_PRECISIONS {
                    return Err(ChangeError::Envelope(Mesh1Error::Invalid("precisions")));
                }
                let precisions = listed
                    .iter()
                    .map(|p| {
                        p.as_text()
                            .filter(|t| t.len() <= MAX_RECEIPT_TEXT)
                            .map(str::to_string)
                            .ok_or(ChangeError::Envelope(Mesh1Error::Invalid("precisions")))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                ChangeKind::Plan(Plan {
                    precisions,
                    fidelity_floor: fidelity(
                        f.uint("fidelity_floor").map_err(field)?,
                        "fidelity_floor",
                    )?,
                    validation: f.text("validation").map_err(field)?.to_string(),
                    foresees: f.text("foresees").map_err(field)?.to_string(),
                    risk_assessment: f
                        .opt_text("risk_assessment")
                        .map_err(field)?
                        .map(str::to_string),
                })
            }
            "weights" => ChangeKind::Weights(WeightsChange {
                from: f.opt_hex32("from").map_err(field)?,
                to: f.hex32("to").map_err(field)?,
                precision: f.opt_text("precision").map_err(field)?.map(str::to_string),
                fidelity: fidelity(f.uint("fidelity").map_err(field)?, "fidelity")?,
                plan: f.opt_hex32("plan").map_err(field)?,
                validation_result: f
                    .opt_text("validation_result")
                    .map_err(field)?
                    .map(str::to_string),
                effective_from: f.uint("effective_from").map_err(field)?,
                reason: f.text("reason").map_err(field)?.to_string(),
            }),
            _ => return Err(ChangeError::Envelope(Mesh1Error::Invalid("kind"))),
        };
        f.finish().map_err(field)?;
        Ok(Self {
            backend,
            recipe,
            seq,
            prev,
            made_at,
            kind,
        })
    }

    /// Seal under the steward's key. What a reader would refuse (over-long
    /// text, too many precisions) is never signed.
    pub fn seal(&self, key: &SigningKey) -> Result<SealedChange, ChangeError> {
        let core = self.to_cbor().encode();
        ChangeEntry::from_cbor(&Cbor::decode(&core).map_err(Mesh1Error::from)?)?;
        let envelope = sign1(core, key)?;
        Ok(SealedChange {
            entry: self.clone(),
            steward: key.verifying_key().to_bytes(),
            envelope,
        })
    }
}

/// An entry with its envelope, its signature checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedChange {
    pub entry: ChangeEntry,
    /// The key that sealed it.
    pub steward: [u8; 32],
    pub envelope: Vec<u8>,
}

impl SealedChange {
    /// Check an envelope: structure, header, signature, and a canonical,
    /// strictly read core.
    pub fn verify(envelope: &[u8]) -> Result<Self, ChangeError> {
        let (steward, core) = open_sign1(envelope)?;
        let entry = ChangeEntry::from_cbor(&Cbor::decode(&core).map_err(Mesh1Error::from)?)?;
        Ok(Self {
            entry,
            steward,
            envelope: envelope.to_vec(),
        })
    }

    /// The content id of the envelope: what the next entry's `prev`, and a
    /// change's `plan`, name.
    pub fn id(&self) -> ContentId {
        blake3::hash(&self.envelope).into()
    }

    fn weights(&self) -> Option<&WeightsChange> {
        match &self.entry.kind {
            ChangeKind::Weights(change) => Some(change),
            ChangeKind::Plan(_) => None,
        }
    }
}

/// Whether a receipt is covered by the record (SPEC §6.5, Coverage).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Coverage<'a> {
    /// The weights entry in effect at the receipt's sequence put its
    /// weights in effect.
    Covered(&'a SealedChange),
    NotCovered(String),
}

/// A backend's change record, every entry checked as it was appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeRecord {
    backend: String,
    steward: [u8; 32],
    entries: Vec<SealedChange>,
}

impl ChangeRecord {
    /// An empty record for `backend`, under `steward`'s key.
    pub fn new(backend: &str, steward: [u8; 32]) -> Self {
        Self {
            backend: backend.to_string(),
            steward,
            entries: Vec::new(),
        }
    }

    /// A record read back: every envelope verified and appended in order.
    pub fn from_envelopes<'e>(
        backend: &str,
        steward: [u8; 32],
        envelopes: impl IntoIterator<Item = &'e [u8]>,
    ) -> Result<Self, (usize, ChangeError)> {
        let mut record = Self::new(backend, steward);
        for (k, envelope) in envelopes.into_iter().enumerate() {
            let sealed = SealedChange::verify(envelope).map_err(|e| (k, e))?;
            record.append(sealed).map_err(|e| (k, e))?;
        }
        Ok(record)
    }

    pub fn backend(&self) -> &str {
        &self.backend
    }

    pub fn entries(&self) -> &[SealedChange] {
        &self.entries
    }

    /// What the next entry's `seq` and `prev` must be.
    pub fn next_position(&self) -> (u64, Option<ContentId>) {
        (
            self.entries.len() as u64,
            self.entries.last().map(SealedChange::id),
        )
    }

    /// The last weights entry: the weights in effect now.
    pub fn in_effect(&self) -> Option<&SealedChange> {
        self.entries.iter().rev().find(|e| e.weights().is_some())
    }

    /// The weights in effect now (the last weights entry's `to`); `None`
    /// before any weights entry.
    pub fn weights_in_effect(&self) -> Option<ContentId> {
        self.in_effect()
            .and_then(SealedChange::weights)
            .map(|w| w.to)
    }

    /// Check `sealed` against every rule of §6.5, and append it; refused,
    /// the record is unchanged.
    pub fn append(&mut self, sealed: SealedChange) -> Result<(), ChangeError> {
        self.check(&sealed)?;
        self.entries.push(sealed);
        Ok(())
    }

    fn check(&self, sealed: &SealedChange) -> Result<(), ChangeError> {
        let entry = &sealed.entry;
        if self.entries.len() >= MAX_CHANGE_ENTRIES {
            return Err(ChangeError::Full);
        }
        if entry.backend != self.backend {
            return Err(ChangeError::OtherBackend(entry.backend.clone()));
        }
        if sealed.steward != self.steward {
            return Err(ChangeError::OtherSteward);
        }
        let (seq, prev) = self.next_position();
        if entry.seq != seq {
            return Err(ChangeError::NotNext {
                expected: seq,
                found: entry.seq,
            });
        }
        if entry.prev != prev {
            return Err(ChangeError::PrevMismatch);
        }
        if self
            .entries
            .last()
            .is_some_and(|last| entry.made_at < last.entry.made_at)
        {
            return Err(ChangeError::EarlierThanBefore);
        }
        let ChangeKind::Weights(change) = &entry.kind else {
            return Ok(());
        };
        let last = self.in_effect().and_then(SealedChange::weights);
        if change.from != last.map(|l| l.to) {
            return Err(ChangeError::FromMismatch);
        }
        if change.from == Some(change.to) {
            return Err(ChangeError::NoChange);
        }
        if last.is_some_and(|l| change.effective_from < l.effective_from) {
            return Err(ChangeError::EffectiveEarlier);
        }
        if let Some(plan_id) = &change.plan {
            let plan = self
                .entries
                .iter()
                .find(|e| e.id() == *plan_id)
                .and_then(|e| match &e.entry.kind {
                    ChangeKind::Plan(plan) => Some((e, plan)),
                    ChangeKind::Weights(_) => None,
                })
                .ok_or(ChangeError::UnknownPlan)?;
            let (plan_entry, plan) = plan;
            if plan_entry.entry.recipe != entry.recipe {
                return Err(ChangeError::OutsidePlan(PlanBreach::Recipe));
            }
            match &change.precision {
                None => return Err(ChangeError::OutsidePlan(PlanBreach::NoPrecision)),
                Some(p) if !plan.precisions.is_empty() && !plan.precisions.contains(p) => {
                    return Err(ChangeError::OutsidePlan(PlanBreach::Precision));
                }
                Some(_) => {}
            }
            if change.fidelity < plan.fidelity_floor {
                return Err(ChangeError::OutsidePlan(PlanBreach::Fidelity));
            }
            if change.validation_result.is_none() {
                return Err(ChangeError::OutsidePlan(PlanBreach::NoValidationResult));
            }
        }
        Ok(())
    }

    /// The weights entry in effect at receipt-log position `sequence`: the
    /// last whose `effective_from` is at or before it.
    pub fn in_effect_at(&self, sequence: u64) -> Option<&SealedChange> {
        self.entries
            .iter()
            .rev()
            .find(|e| e.weights().is_some_and(|w| w.effective_from <= sequence))
    }

    /// Whether `receipt` is covered: sealed by this record's steward, and
    /// the weights entry in effect at its sequence is for its backend and
    /// recipe, its `to` is the receipt's weights digest and, where both
    /// name one, its precision is the receipt's.
    pub fn covers(&self, receipt: &MeshReceipt) -> Coverage<'_> {
        let not = |why: String| Coverage::NotCovered(why);
        if receipt.steward != did_key(&self.steward) {
            return not("the receipt was sealed by another steward".into());
        }
        let Some(entry) = self.in_effect_at(receipt.sequence) else {
            return not(format!(
                "no weights entry is in effect at sequence {}",
                receipt.sequence
            ));
        };
        let Some(change) = entry.weights() else {
            return not("no weights entry is in effect".into());
        };
        if entry.entry.backend != receipt.backend || entry.entry.recipe != receipt.recipe {
            return not("the entry in effect is for another backend or recipe".into());
        }
        let Some(weights) = &receipt.weights else {
            return not("the receipt names no weights".into());
        };
        if weights.weights_digest != change.to {
            return not("the receipt's weights are not the ones in effect".into());
        }
        if change
            .precision
            .as_ref()
            .is_some_and(|p| *p != weights.precision)
        {
            return not("the receipt's precision is not the change's".into());
        }
        Coverage::Covered(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BACKEND: &str = "mesh-node/split";
    const RECIPE: &str = "model.gguf";

    fn steward() -> SigningKey {
        SigningKey::from_bytes(&[7; 32])
    }

    fn plan_entry(seq: u64, prev: Option<ContentId>, made_at: u64) -> ChangeEntry {
        ChangeEntry {
            backend: BACKEND.into(),
            recipe: RECIPE.into(),
            seq,
            prev,
            made_at,
            kind: ChangeKind::Plan(Plan {
                precisions: vec!["q8_0/f32".into()],
                fidelity_floor: Fidelity::F2,
                validation: "greedy agreement with llama.cpp on 64 prompts".into(),
                foresees: "requantized builds of the same model".into(),
                risk_assessment: None,
            }),
        }
    }

    fn weights_entry(
        seq: u64,
        prev: Option<ContentId>,
        from: Option<ContentId>,
        to: ContentId,
        plan: Option<ContentId>,
        effective_from: u64,
    ) -> ChangeEntry {
        ChangeEntry {
            backend: BACKEND.into(),
            recipe: RECIPE.into(),
            seq,
            prev,
            made_at: 100 + seq,
            kind: ChangeKind::Weights(WeightsChange {
                from,
                to,
                precision: Some("q8_0/f32".into()),
                fidelity: Fidelity::F2,
                plan,
                validation_result: Some("64 of 64 agree".into()),
                effective_from,
                reason: "requantized".into(),
            }),
        }
    }

    /// A plan, the first weights (no plan), then a change under the plan.
    fn record() -> ChangeRecord {
        let key = steward();
        let mut record = ChangeRecord::new(BACKEND, key.verifying_key().to_bytes());
        let plan = plan_entry(0, None, 100).seal(&key).unwrap();
        let plan_id = plan.id();
        record.append(plan).unwrap();
        let first = weights_entry(
            1,
            Some(record.next_position().1.unwrap()),
            None,
            [1; 32],
            None,
            0,
        )
        .seal(&key)
        .unwrap();
        record.append(first).unwrap();
        let (seq, prev) = record.next_position();
        let second = weights_entry(seq, prev, Some([1; 32]), [2; 32], Some(plan_id), 10)
            .seal(&key)
            .unwrap();
        record.append(second).unwrap();
        record
    }

    #[test]
    fn a_record_reads_back_and_says_which_weights_were_in_effect() {
        let record = record();
        let envelopes: Vec<&[u8]> = record
            .entries()
            .iter()
            .map(|e| e.envelope.as_slice())
            .collect();
        let again =
            ChangeRecord::from_envelopes(BACKEND, steward().verifying_key().to_bytes(), envelopes)
                .unwrap();
        assert_eq!(again, record);
        assert_eq!(
            record
                .in_effect_at(3)
                .and_then(SealedChange::weights)
                .map(|w| w.to),
            Some([1; 32])
        );
        assert_eq!(
            record
                .in_effect_at(10)
                .and_then(SealedChange::weights)
                .map(|w| w.to),
            Some([2; 32])
        );
        assert_eq!(
            record
                .in_effect()
                .and_then(SealedChange::weights)
                .map(|w| w.to),
            Some([2; 32])
        );
    }

    #[test]
    fn every_refusal_rule_refuses_and_changes_nothing() {
        let key = steward();
        let base = record();
        let (seq, prev) = base.next_position();
        let plan_id = base.entries()[0].id();
        let valid = weights_entry(seq, prev, Some([2; 32]), [3; 32], Some(plan_id), 20);
        let mut accepted = base.clone();
        accepted.append(valid.seal(&key).unwrap()).unwrap();
        type Edit = fn(&mut ChangeEntry);
        let cases: Vec<(Edit, ChangeError)> = vec![
            (
                |e| e.backend = "another".into(),
                ChangeError::OtherBackend("another".into()),
            ),
            (
                |e| e.seq += 1,
                ChangeError::NotNext {
                    expected: 3,
                    found: 4,
                },
            ),
            (|e| e.prev = Some([0; 32]), ChangeError::PrevMismatch),
            (|e| e.made_at = 1, ChangeError::EarlierThanBefore),
            (
                |e| {
                    if let ChangeKind::Weights(w) = &mut e.kind {
                        w.from = Some([9; 32])
                    }
                },
                ChangeError::FromMismatch,
            ),
            (
                |e| {
                    if let ChangeKind::Weights(w) = &mut e.kind {
                        w.to = [2; 32]
                    }
                },
                ChangeError::NoChange,
            ),
            (
                |e| {
                    if let ChangeKind::Weights(w) = &mut e.kind {
                        w.effective_from = 9
                    }
                },
                ChangeError::EffectiveEarlier,
            ),
            (
                |e| {
                    if let ChangeKind::Weights(w) = &mut e.kind {
                        w.plan = Some([5; 32])
                    }
                },
                ChangeError::UnknownPlan,
            ),
            (
                |e| e.recipe = "other.gguf".into(),
                ChangeError::OutsidePlan(PlanBreach::Recipe),
            ),
            (
                |e| {
                    if let ChangeKind::Weights(w) = &mut e.kind {
                        w.precision = Some("f16".into())
                    }
                },
                ChangeError::OutsidePlan(PlanBreach::Precision),
            ),
            (
                |e| {
                    if let ChangeKind::Weights(w) = &mut e.kind {
                        w.precision = None
                    }
                },
                ChangeError::OutsidePlan(PlanBreach::NoPrecision),
            ),
            (
                |e| {
                    if let ChangeKind::Weights(w) = &mut e.kind {
                        w.fidelity = Fidelity::F1
                    }
                },
                ChangeError::OutsidePlan(PlanBreach::Fidelity),
            ),
            (
                |e| {
                    if let ChangeKind::Weights(w) = &mut e.kind {
                        w.validation_result = None
                    }
                },
                ChangeError::OutsidePlan(PlanBreach::NoValidationResult),
            ),
        ];
        for (edit, refusal) in cases {
            let mut entry = valid.clone();
            edit(&mut entry);
            let mut record = base.clone();
            assert_eq!(record.append(entry.seal(&key).unwrap()), Err(refusal));
            assert_eq!(record, base);
        }
        // A plan naming a weights entry is no plan; another key's entry is refused.
        let mut entry = valid.clone();
        if let ChangeKind::Weights(w) = &mut entry.kind {
            w.plan = Some(base.entries()[1].id());
        }
        assert_eq!(
            base.clone().append(entry.seal(&key).unwrap()),
            Err(ChangeError::UnknownPlan)
        );
        let other = SigningKey::from_bytes(&[8; 32]);
        assert_eq!(
            base.clone().append(valid.seal(&other).unwrap()),
            Err(ChangeError::OtherSteward)
        );
        // The first weights entry has no `from`; a later one must.
        let mut fresh = ChangeRecord::new(BACKEND, key.verifying_key().to_bytes());
        let with_from = weights_entry(0, None, Some([1; 32]), [2; 32], None, 0);
        assert_eq!(
            fresh.append(with_from.seal(&key).unwrap()),
            Err(ChangeError::FromMismatch)
        );
        let mut no_from = valid.clone();
        if let ChangeKind::Weights(w) = &mut no_from.kind {
            w.from = None;
        }
        assert_eq!(
            base.clone().append(no_from.seal(&key).unwrap()),
            Err(ChangeError::FromMismatch)
        );
        // A change no plan foresaw is recorded too.
        let mut unplanned = valid;
        if let ChangeKind::Weights(w) = &mut unplanned.kind {
            w.plan = None;
            w.precision = None;
            w.validation_result = None;
        }
        assert!(base.clone().append(unplanned.seal(&key).unwrap()).is_ok());
    }

    #[test]
    fn what_a_reader_would_refuse_is_never_sealed() {
        let mut entry = weights_entry(0, None, None, [1; 32], None, 0);
        if let ChangeKind::Weights(w) = &mut entry.kind {
            w.reason = "x".repeat(MAX_RECEIPT_TEXT + 1);
        }
        assert!(entry.seal(&steward()).is_err());
        let mut plan = plan_entry(0, None, 1);
        if let ChangeKind::Plan(p) = &mut plan.kind {
            p.precisions = vec!["fp32".into(); MAX_PLAN_PRECISIONS + 1];
        }
        assert!(plan.seal(&steward()).is_err());
    }

    #[test]
    fn coverage_reads_the_entry_in_effect_at_the_receipts_sequence() {
        let record = record();
        let key = steward();
        let mut receipt = MeshReceipt::blank(
            [4; 32],
            BACKEND,
            RECIPE,
            "route",
            crate::mesh1::Energy::estimator(1),
            [0; 16],
        );
        receipt.steward = did_key(&key.verifying_key().to_bytes());
        receipt.weights = Some(crate::mesh1::WeightsBinding {
            weights_digest: [1; 32],
            precision: "q8_0/f32".into(),
        });
        receipt.sequence = 9;
        assert!(matches!(record.covers(&receipt), Coverage::Covered(_)));
        // At 10 the second change is in effect: other weights.
        receipt.sequence = 10;
        assert!(matches!(record.covers(&receipt), Coverage::NotCovered(_)));
        receipt.weights = Some(crate::mesh1::WeightsBinding {
            weights_digest: [2; 32],
            precision: "q8_0/f32".into(),
        });
        assert!(matches!(record.covers(&receipt), Coverage::Covered(_)));
        let mut other = receipt.clone();
        other.recipe = "other.gguf".into();
        assert!(matches!(record.covers(&other), Coverage::NotCovered(_)));
        let mut other = receipt.clone();
        other.weights = Some(crate::mesh1::WeightsBinding {
            weights_digest: [2; 32],
            precision: "f16".into(),
        });
        assert!(matches!(record.covers(&other), Coverage::NotCovered(_)));
        let mut other = receipt;
        other.steward = did_key(&[3; 32]);
        assert!(matches!(record.covers(&other), Coverage::NotCovered(_)));
    }

    /// The repository's change-record vectors (`vectors/mesh1/changes.json`,
    /// written by `mesh-node vectors write`) hold: the record reads back,
    /// each case gets its refusal, each receipt its coverage.
    #[test]
    fn the_change_record_vectors_hold() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../vectors/mesh1/changes.json");
        let document: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let bytes = |v: &serde_json::Value| hex::decode(v.as_str().unwrap()).unwrap();
        let envelopes: Vec<Vec<u8>> = document["record"]
            .as_array()
            .unwrap()
            .iter()
            .map(bytes)
            .collect();
        let steward =
            crate::identity::parse_did_key(document["steward_did"].as_str().unwrap()).unwrap();
        let backend = document["backend"].as_str().unwrap();
        let record =
            ChangeRecord::from_envelopes(backend, steward, envelopes.iter().map(Vec::as_slice))
                .unwrap();
        assert_eq!(record.entries().len(), 3);
        let base = ChangeRecord::from_envelopes(
            backend,
            steward,
            envelopes[..2].iter().map(Vec::as_slice),
        )
        .unwrap();
        let first = &document["first_weights_entry_with_from"];
        let plan_only = ChangeRecord::from_envelopes(
            backend,
            steward,
            envelopes[..1].iter().map(Vec::as_slice),
        )
        .unwrap();
        let sealed = SealedChange::verify(&bytes(&first["entry_hex"])).unwrap();
        assert_eq!(
            plan_only.clone().append(sealed).err().map(|e| e.kind()),
            first["refused"].as_str()
        );
        let cases = document["cases"].as_array().unwrap();
        assert!(cases.len() >= 15);
        for case in cases {
            let sealed = SealedChange::verify(&bytes(&case["entry_hex"])).unwrap();
            let got = base.clone().append(sealed).err().map(|e| e.kind());
            assert_eq!(got, case["refused"].as_str(), "{}", case["name"]);
        }
        let reference = crate::mesh1::SealedReceipt::verify(
            &hex::decode(
                std::fs::read_to_string(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../vectors/mesh1/reference/envelope.hex"
                ))
                .unwrap()
                .trim(),
            )
            .unwrap(),
        )
        .unwrap();
        for case in document["coverage"].as_array().unwrap() {
            let mut receipt = reference.receipt.clone();
            receipt.sequence = case["receipt_sequence"].as_u64().unwrap();
            receipt.weights = Some(crate::mesh1::WeightsBinding {
                weights_digest: hex::decode_array(case["receipt_weights_digest"].as_str().unwrap())
                    .unwrap(),
                precision: case["receipt_precision"].as_str().unwrap().to_string(),
            });
            let covered = match record.covers(&receipt) {
                Coverage::Covered(entry) => Some(entry.entry.seq),
                Coverage::NotCovered(_) => None,
            };
            assert_eq!(covered, case["covered_by_entry"].as_u64(), "{case}");
        }
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = SealedChange::verify(&bytes);
            if let Ok(value) = Cbor::decode(&bytes) {
                let _ = ChangeEntry::from_cbor(&value);
            }
        }

        #[test]
        fn entries_round_trip(seq in 0u64..1000, made_at in any::<u64>(), to in any::<[u8; 32]>(), effective_from in any::<u64>()) {
            let entry = weights_entry(seq, Some([3; 32]), Some([4; 32]), to, None, effective_from);
            let entry = ChangeEntry { made_at, ..entry };
            let sealed = entry.seal(&steward()).unwrap();
            prop_assert_eq!(SealedChange::verify(&sealed.envelope).unwrap(), sealed);
        }
    }
}
