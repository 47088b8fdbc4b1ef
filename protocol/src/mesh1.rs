//! `mesh/1`: the request, its energy record, and the steward's signed
//! receipt (seed SPEC 001 §3, §6). The signed core is deterministic CBOR
//! (`cbor`), sealed in a COSE_Sign1 envelope (EdDSA, `alg = -8`, `kid` = the
//! steward's raw Ed25519 public key). Ids are BLAKE3 content ids.

use coset::{CoseSign1, CoseSign1Builder, HeaderBuilder, TaggedCborSerializable, iana};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use thiserror::Error;

use crate::cbor::{Cbor, CborError, FieldError, Fields};
use crate::hex;
use crate::identity::{did_key, parse_did_key};

/// A BLAKE3 content id: the hash of a value's deterministic-CBOR encoding.
pub type ContentId = [u8; 32];

/// The `mesh_receipt` member's only value.
pub const MESH_RECEIPT_VERSION: &str = "mesh/1";
/// Largest envelope a verifier reads; a receipt with a 64-stage split block
/// stays far below it.
pub const MAX_ENVELOPE_BYTES: usize = 256 * 1024;
/// Longest text member of a receipt (backend, recipe, route, ...).
pub const MAX_RECEIPT_TEXT: usize = 4096;

pub fn content_id(value: &Cbor) -> ContentId {
    blake3::hash(&value.encode()).into()
}

/// Content address of prompt bytes (never the prompt text itself on a receipt).
pub fn prompt_hash(prompt: &[u8]) -> ContentId {
    blake3::hash(prompt).into()
}

/// Why a `mesh/1` object does not hold.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Mesh1Error {
    #[error("CBOR: {0}")]
    Cbor(#[from] CborError),
    #[error("`{0}`: required member is missing")]
    Missing(&'static str),
    #[error("`{0}`: wrong type or out of range")]
    Invalid(&'static str),
    #[error("unknown member `{0}`")]
    Unknown(String),
    #[error("energy coupling broken: {0}")]
    Coupling(&'static str),
    #[error("`{0}` disagrees with the figures it is derived from")]
    Derived(&'static str),
    #[error("`{0}` and `{1}` must be present together or not at all")]
    Unpaired(&'static str, &'static str),
    #[error("envelope is {0} bytes, over the {MAX_ENVELOPE_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("not a tagged COSE_Sign1: {0}")]
    Envelope(String),
    #[error("protected header must be exactly {{alg: EdDSA, kid: 32-byte Ed25519 key}}")]
    Header,
    #[error("envelope has no attached payload")]
    NoPayload,
    #[error(
        "the envelope is not in deterministic CBOR: a head is written in a longer form than it needs, so its bytes are not the ones its steward sealed"
    )]
    NotCanonical,
    #[error("the core's `steward` is not the did:key of the envelope's kid")]
    StewardMismatch,
    #[error("Ed25519 signature does not verify under the steward's key")]
    BadSignature,
    #[error("chain: {0}")]
    Chain(String),
}

impl From<FieldError> for Mesh1Error {
    fn from(error: FieldError) -> Self {
        match error {
            FieldError::NotAMap => Mesh1Error::Invalid("(top level map)"),
            FieldError::Missing(key) => Mesh1Error::Missing(key),
            FieldError::Invalid(key) => Mesh1Error::Invalid(key),
            FieldError::Unknown(key) => Mesh1Error::Unknown(key),
        }
    }
}

/// A record's members: text bounded as receipt text.
fn fields(value: &Cbor) -> Result<Fields<'_>, Mesh1Error> {
    Ok(Fields::of(value)?.text_limit(MAX_RECEIPT_TEXT))
}

/// The ordered fidelity scale: F0 coarsest sufficient, F4 frontier grade.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fidelity {
    F0,
    F1,
    F2,
    F3,
    F4,
}

impl Fidelity {
    pub const ALL: [Fidelity; 5] = [
        Fidelity::F0,
        Fidelity::F1,
        Fidelity::F2,
        Fidelity::F3,
        Fidelity::F4,
    ];
    pub fn level(self) -> u64 {
        self as u64
    }
    pub fn from_level(level: u64) -> Option<Self> {
        usize::try_from(level)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }
    /// `F0`..`F4` (or `f2`, or the bare level `2`), as an operator writes it.
    pub fn parse(text: &str) -> Option<Self> {
        let level = text.strip_prefix(['F', 'f']).unwrap_or(text);
        level.parse().ok().and_then(Self::from_level)
    }
}

/// What makes a request a typed decision rather than a generation (§3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decision {
    pub questions: u32,
    pub options_scored: u32,
    /// How many of `prompt_tokens` are question schema, not state.
    pub schema_tokens: u32,
}

/// A content-addressed request (§3.1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServeRequest {
    pub prompt_hash: ContentId,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub fidelity_floor: Fidelity,
    pub joule_ceiling_uj: u64,
    pub decision: Option<Decision>,
}

impl ServeRequest {
    /// The canonical form; `decision` is omitted when absent so that the ids
    /// of requests written before it existed never change.
    pub fn to_cbor(&self) -> Cbor {
        let mut fields = vec![
            ("prompt_hash", Cbor::bytes(self.prompt_hash.to_vec())),
            ("prompt_tokens", Cbor::Uint(self.prompt_tokens.into())),
            ("max_tokens", Cbor::Uint(self.max_tokens.into())),
            ("fidelity_floor", Cbor::Uint(self.fidelity_floor.level())),
            ("joule_ceiling_uj", Cbor::Uint(self.joule_ceiling_uj)),
        ];
        if let Some(decision) = &self.decision {
            fields.push((
                "decision",
                Cbor::text_map([
                    ("questions", Cbor::Uint(decision.questions.into())),
                    ("options_scored", Cbor::Uint(decision.options_scored.into())),
                    ("schema_tokens", Cbor::Uint(decision.schema_tokens.into())),
                ]),
            ));
        }
        Cbor::text_map(fields)
    }

    pub fn from_cbor(value: &Cbor) -> Result<Self, Mesh1Error> {
        let mut f = fields(value)?;
        let prompt_hash = f.fixed::<32>("prompt_hash")?;
        let prompt_tokens = f.u32("prompt_tokens")?;
        let max_tokens = f.u32("max_tokens")?;
        let fidelity_floor = Fidelity::from_level(f.uint("fidelity_floor")?)
            .ok_or(Mesh1Error::Invalid("fidelity_floor"))?;
        let joule_ceiling_uj = f.uint("joule_ceiling_uj")?;
        let decision = match f.optional("decision") {
            None => None,
            Some(inner) => {
                let mut d = fields(inner)?;
                let decision = Decision {
                    questions: d.u32("questions")?,
                    options_scored: d.u32("options_scored")?,
                    schema_tokens: d.u32("schema_tokens")?,
                };
                d.finish()?;
                Some(decision)
            }
        };
        f.finish()?;
        Ok(Self {
            prompt_hash,
            prompt_tokens,
            max_tokens,
            fidelity_floor,
            joule_ceiling_uj,
            decision,
        })
    }

    /// `request_id = ContentId.of(request)`.
    pub fn request_id(&self) -> ContentId {
        content_id(&self.to_cbor())
    }
}

/// Where an energy figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Provenance {
    /// A hardware reading: a shunt, or a vendor counter shown live (RAPL, NVML).
    HwShunt,
    /// A model of the hardware's draw.
    ModelBased,
    /// An estimate; no measurement is implied.
    Estimator,
}

impl Provenance {
    pub fn as_str(self) -> &'static str {
        match self {
            Provenance::HwShunt => "HwShunt",
            Provenance::ModelBased => "ModelBased",
            Provenance::Estimator => "Estimator",
        }
    }
    pub fn parse(text: &str) -> Option<Self> {
        [
            Provenance::HwShunt,
            Provenance::ModelBased,
            Provenance::Estimator,
        ]
        .into_iter()
        .find(|p| p.as_str() == text)
    }
}

/// Microjoules with their provenance. The coupling of §3.3 holds by
/// construction: a `HwShunt` figure has a measurement, an `Estimator` one has
/// none, and there is no other way to build one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Energy {
    measured_uj: Option<u64>,
    estimated_uj: u64,
    provenance: Provenance,
}

impl Energy {
    pub fn hw_shunt(measured_uj: u64, estimated_uj: u64) -> Self {
        Self {
            measured_uj: Some(measured_uj),
            estimated_uj,
            provenance: Provenance::HwShunt,
        }
    }
    pub fn model_based(estimated_uj: u64) -> Self {
        Self {
            measured_uj: None,
            estimated_uj,
            provenance: Provenance::ModelBased,
        }
    }
    pub fn estimator(estimated_uj: u64) -> Self {
        Self {
            measured_uj: None,
            estimated_uj,
            provenance: Provenance::Estimator,
        }
    }

    /// Rebuild from wire parts, refusing a broken coupling.
    pub fn from_parts(
        measured_uj: Option<u64>,
        estimated_uj: u64,
        provenance: Provenance,
    ) -> Result<Self, Mesh1Error> {
        match (provenance, measured_uj) {
            (Provenance::HwShunt, None) => {
                Err(Mesh1Error::Coupling("HwShunt requires measured_uj"))
            }
            (Provenance::Estimator | Provenance::ModelBased, Some(_)) => Err(Mesh1Error::Coupling(
                "measured_uj is present only for HwShunt",
            )),
            _ => Ok(Self {
                measured_uj,
                estimated_uj,
                provenance,
            }),
        }
    }

    pub fn measured_uj(&self) -> Option<u64> {
        self.measured_uj
    }
    pub fn estimated_uj(&self) -> u64 {
        self.estimated_uj
    }
    pub fn provenance(&self) -> Provenance {
        self.provenance
    }
    /// The figure billed: the measurement if there is one, else the estimate.
    pub fn uj(&self) -> u64 {
        self.measured_uj.unwrap_or(self.estimated_uj)
    }
}

/// What a decision receipt reports in place of token efficiency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecisionOutcome {
    pub questions_answered: u32,
    pub options_scored: u32,
    pub schema_tokens: u32,
}

/// The weights that answered, with the precision the forward pass ran at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsBinding {
    pub weights_digest: ContentId,
    pub precision: String,
}

/// Advertised and delivered fidelity, carried together (§3.2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FidelityReport {
    pub advertised: Fidelity,
    pub delivered: Fidelity,
}

/// The receipt's fields (§6.1). `sequence` and `prev` are stamped by the
/// steward's log; derived figures (`fidelity_met`, `uj_per_*`) are computed
/// when encoding and checked when decoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshReceipt {
    pub request_id: ContentId,
    pub grant_id: Option<ContentId>,
    pub backend: String,
    pub recipe: String,
    pub weights: Option<WeightsBinding>,
    pub route: String,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub tokens_accepted: u64,
    pub cache_hit_tokens: u64,
    pub spec_proposed: u64,
    pub spec_accepted: u64,
    pub fidelity_floor: Fidelity,
    pub fidelity: Option<FidelityReport>,
    /// The level the route table rated the backend, used for `fidelity_met`
    /// when the backend reports no delivered level.
    pub fidelity_rating: Fidelity,
    pub energy: Energy,
    pub decision: Option<DecisionOutcome>,
    pub grant_breach: Option<String>,
    pub output_commitment: Option<ContentId>,
    pub sequence: u64,
    pub prev: Option<ContentId>,
    pub nonce: [u8; 16],
    /// did:key of the sealing steward.
    pub steward: String,
    /// RFC 8785 bytes of the coordinator receipt block of a split serve
    /// (`x-mesh-coordinator-receipt-v1`), carried as a byte string.
    pub split: Option<Vec<u8>>,
    /// RFC 8785 bytes of the resume block (`x-mesh-resume-v1`) of a request
    /// that lost a stage and went on over a new chain: its segments, in
    /// order. Absent when the request ran on one chain.
    pub resumed: Option<Vec<u8>>,
    /// The engine's declaration (§5): whether serving the same request and
    /// prompt payload again yields the same tokens, so the serve can be
    /// replayed (§6.4). `deterministic` on the wire, `0|1`; absent: not
    /// declared, which is the same as 0.
    pub deterministic: Option<bool>,
    /// Where the weights' disposition came from (§3.7): the corpus they
    /// were fitted to and what a verifier can do with it, when the model
    /// declares them (`training_digest` and `training_authority`, together
    /// or neither).
    pub training: Option<TrainingBinding>,
}

/// What a verifier can do with a model's training corpus (§3.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrainingAuthority {
    /// Every record signed by the principal that produced it.
    Signed,
    /// Records in an append-only log whose head is attested.
    Logged,
    /// Bytes with a digest, nothing more.
    Opaque,
}

impl TrainingAuthority {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Signed => "signed",
            Self::Logged => "logged",
            Self::Opaque => "opaque",
        }
    }
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "signed" => Some(Self::Signed),
            "logged" => Some(Self::Logged),
            "opaque" => Some(Self::Opaque),
            _ => None,
        }
    }
}

/// The corpus a model was fitted to (§3.7): BLAKE3 over the canonical
/// encoding of its records' content ids in the order the fit consumed them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TrainingBinding {
    pub training_digest: ContentId,
    pub authority: TrainingAuthority,
}

impl MeshReceipt {
    /// A receipt for `request_id` with every counter at zero, no grant, no
    /// weights, F0, and no split: callers set what their serve filled.
    /// `sequence`, `prev` and `steward` are stamped by the steward's log.
    pub fn blank(
        request_id: ContentId,
        backend: &str,
        recipe: &str,
        route: &str,
        energy: Energy,
        nonce: [u8; 16],
    ) -> Self {
        Self {
            request_id,
            grant_id: None,
            backend: backend.to_string(),
            recipe: recipe.to_string(),
            weights: None,
            route: route.to_string(),
            tokens_in: 0,
            tokens_out: 0,
            tokens_accepted: 0,
            cache_hit_tokens: 0,
            spec_proposed: 0,
            spec_accepted: 0,
            fidelity_floor: Fidelity::F0,
            fidelity: None,
            fidelity_rating: Fidelity::F0,
            energy,
            decision: None,
            grant_breach: None,
            output_commitment: None,
            sequence: 0,
            prev: None,
            nonce,
            steward: String::new(),
            split: None,
            training: None,
            resumed: None,
            deterministic: None,
        }
    }

    /// Whether the floor was met, on the delivered level where there is one.
    pub fn fidelity_met(&self) -> bool {
        let basis = self.fidelity.map_or(self.fidelity_rating, |f| f.delivered);
        basis >= self.fidelity_floor
    }

    /// `energy.uj() / tokens_accepted`; absent when none were accepted.
    pub fn uj_per_accepted_token(&self) -> Option<u64> {
        (self.decision.is_none() && self.tokens_accepted > 0)
            .then(|| self.energy.uj() / self.tokens_accepted)
    }

    /// The signed core as deterministic CBOR.
    pub fn signed_core(&self) -> Cbor {
        let mut fields: Vec<(&str, Cbor)> = vec![
            ("mesh_receipt", Cbor::text(MESH_RECEIPT_VERSION)),
            ("request_id", Cbor::text(hex::encode(&self.request_id))),
            ("backend", Cbor::text(&self.backend)),
            ("recipe", Cbor::text(&self.recipe)),
            ("route", Cbor::text(&self.route)),
            ("tokens_in", Cbor::Uint(self.tokens_in)),
            ("tokens_out", Cbor::Uint(self.tokens_out)),
            ("tokens_accepted", Cbor::Uint(self.tokens_accepted)),
            ("cache_hit_tokens", Cbor::Uint(self.cache_hit_tokens)),
            ("spec_proposed", Cbor::Uint(self.spec_proposed)),
            ("spec_accepted", Cbor::Uint(self.spec_accepted)),
            ("fidelity_floor", Cbor::Uint(self.fidelity_floor.level())),
            ("fidelity_met", Cbor::Uint(u64::from(self.fidelity_met()))),
            ("estimated_uj", Cbor::Uint(self.energy.estimated_uj())),
            (
                "energy_provenance",
                Cbor::text(self.energy.provenance().as_str()),
            ),
            ("sequence", Cbor::Uint(self.sequence)),
            ("nonce", Cbor::bytes(self.nonce.to_vec())),
            ("steward", Cbor::text(&self.steward)),
        ];
        if let Some(id) = &self.grant_id {
            fields.push(("grant_id", Cbor::text(hex::encode(id))));
        }
        if let Some(weights) = &self.weights {
            fields.push((
                "weights_digest",
                Cbor::text(hex::encode(&weights.weights_digest)),
            ));
            fields.push(("precision", Cbor::text(&weights.precision)));
        }
        if let Some(training) = &self.training {
            fields.push((
                "training_digest",
                Cbor::text(hex::encode(&training.training_digest)),
            ));
            fields.push((
                "training_authority",
                Cbor::text(training.authority.as_str()),
            ));
        }
        if let Some(report) = &self.fidelity {
            fields.push(("fidelity_advertised", Cbor::Uint(report.advertised.level())));
            fields.push(("fidelity_delivered", Cbor::Uint(report.delivered.level())));
        }
        if let Some(measured) = self.energy.measured_uj() {
            fields.push(("measured_uj", Cbor::Uint(measured)));
        }
        if let Some(per_token) = self.uj_per_accepted_token() {
            fields.push(("uj_per_accepted_token", Cbor::Uint(per_token)));
        }
        if let Some(decision) = &self.decision {
            fields.push((
                "questions_answered",
                Cbor::Uint(decision.questions_answered.into()),
            ));
            fields.push(("options_scored", Cbor::Uint(decision.options_scored.into())));
            fields.push(("schema_tokens", Cbor::Uint(decision.schema_tokens.into())));
            if decision.questions_answered > 0 {
                fields.push((
                    "uj_per_decision",
                    Cbor::Uint(self.energy.uj() / u64::from(decision.questions_answered)),
                ));
            }
            if decision.options_scored > 0 {
                fields.push((
                    "uj_per_option_scored",
                    Cbor::Uint(self.energy.uj() / u64::from(decision.options_scored)),
                ));
            }
        }
        if let Some(breach) = &self.grant_breach {
            fields.push(("grant_breach", Cbor::text(breach)));
        }
        if let Some(commitment) = &self.output_commitment {
            fields.push(("output_commitment", Cbor::text(hex::encode(commitment))));
        }
        if let Some(prev) = &self.prev {
            fields.push(("prev", Cbor::text(hex::encode(prev))));
        }
        if let Some(split) = &self.split {
            fields.push(("split", Cbor::bytes(split.clone())));
        }
        if let Some(deterministic) = self.deterministic {
            fields.push(("deterministic", Cbor::Uint(u64::from(deterministic))));
        }
        if let Some(resumed) = &self.resumed {
            fields.push(("resumed", Cbor::bytes(resumed.clone())));
        }
        Cbor::text_map(fields)
    }

    /// Parse a signed core, checking every rule a receipt must satisfy.
    pub fn from_core(core: &Cbor) -> Result<Self, Mesh1Error> {
        let mut f = fields(core)?;
        if f.text("mesh_receipt")? != MESH_RECEIPT_VERSION {
            return Err(Mesh1Error::Invalid("mesh_receipt"));
        }
        let request_id = f.hex32("request_id")?;
        let grant_id = f.opt_hex32("grant_id")?;
        let backend = f.text("backend")?.to_string();
        let recipe = f.text("recipe")?.to_string();
        let weights = match (f.opt_hex32("weights_digest")?, f.opt_text("precision")?) {
            (Some(weights_digest), Some(precision)) => Some(WeightsBinding {
                weights_digest,
                precision: precision.to_string(),
            }),
            (None, None) => None,
            _ => return Err(Mesh1Error::Unpaired("weights_digest", "precision")),
        };
        let route = f.text("route")?.to_string();
        let tokens_in = f.uint("tokens_in")?;
        let tokens_out = f.uint("tokens_out")?;
        let tokens_accepted = f.uint("tokens_accepted")?;
        let cache_hit_tokens = f.uint("cache_hit_tokens")?;
        let spec_proposed = f.uint("spec_proposed")?;
        let spec_accepted = f.uint("spec_accepted")?;
        // Accepted drafts are drafts proposed (§5).
        if spec_accepted > spec_proposed {
            return Err(Mesh1Error::Derived(
                "spec_accepted (more than spec_proposed)",
            ));
        }
        let level = |f: &mut Fields<'_>, key| -> Result<Option<Fidelity>, Mesh1Error> {
            f.opt_uint(key)?
                .map(|l| Fidelity::from_level(l).ok_or(Mesh1Error::Invalid(key)))
                .transpose()
        };
        let fidelity_floor =
            level(&mut f, "fidelity_floor")?.ok_or(Mesh1Error::Missing("fidelity_floor"))?;
        let fidelity = match (
            level(&mut f, "fidelity_advertised")?,
            level(&mut f, "fidelity_delivered")?,
        ) {
            (Some(advertised), Some(delivered)) => {
                if delivered > advertised {
                    return Err(Mesh1Error::Derived(
                        "fidelity_delivered (above the advertised level)",
                    ));
                }
                Some(FidelityReport {
                    advertised,
                    delivered,
                })
            }
            (None, None) => None,
            _ => {
                return Err(Mesh1Error::Unpaired(
                    "fidelity_advertised",
                    "fidelity_delivered",
                ));
            }
        };
        let fidelity_met = match f.uint("fidelity_met")? {
            0 => false,
            1 => true,
            _ => return Err(Mesh1Error::Invalid("fidelity_met")),
        };
        let provenance = Provenance::parse(f.text("energy_provenance")?)
            .ok_or(Mesh1Error::Invalid("energy_provenance"))?;
        let energy = Energy::from_parts(
            f.opt_uint("measured_uj")?,
            f.uint("estimated_uj")?,
            provenance,
        )?;
        let per_token = f.opt_uint("uj_per_accepted_token")?;
        let questions_answered = f.opt_uint("questions_answered")?;
        let options_scored = f.opt_uint("options_scored")?;
        let schema_tokens = f.opt_uint("schema_tokens")?;
        let per_decision = f.opt_uint("uj_per_decision")?;
        let per_option = f.opt_uint("uj_per_option_scored")?;
        let decision = match (questions_answered, options_scored, schema_tokens) {
            (Some(q), Some(o), Some(s)) => Some(DecisionOutcome {
                questions_answered: u32::try_from(q)
                    .map_err(|_| Mesh1Error::Invalid("questions_answered"))?,
                options_scored: u32::try_from(o)
                    .map_err(|_| Mesh1Error::Invalid("options_scored"))?,
                schema_tokens: u32::try_from(s)
                    .map_err(|_| Mesh1Error::Invalid("schema_tokens"))?,
            }),
            (None, None, None) => None,
            _ => {
                return Err(Mesh1Error::Unpaired(
                    "questions_answered",
                    "options_scored/schema_tokens",
                ));
            }
        };
        let grant_breach = f.opt_text("grant_breach")?.map(str::to_string);
        let output_commitment = f.opt_hex32("output_commitment")?;
        let sequence = f.uint("sequence")?;
        let prev = f.opt_hex32("prev")?;
        let nonce: [u8; 16] = f
            .required("nonce")?
            .as_bytes()
            .and_then(|b| b.try_into().ok())
            .ok_or(Mesh1Error::Invalid("nonce"))?;
        let steward = f.text("steward")?.to_string();
        if parse_did_key(&steward).is_none() {
            return Err(Mesh1Error::Invalid("steward"));
        }
        let split = f.opt_bytes("split")?.map(<[u8]>::to_vec);
        let resumed = f.opt_bytes("resumed")?.map(<[u8]>::to_vec);
        let deterministic = match f.opt_uint("deterministic")? {
            None => None,
            Some(0) => Some(false),
            Some(1) => Some(true),
            Some(_) => return Err(Mesh1Error::Invalid("deterministic")),
        };
        let training = match (
            f.opt_hex32("training_digest")?,
            f.opt_text("training_authority")?,
        ) {
            (Some(training_digest), Some(authority)) => Some(TrainingBinding {
                training_digest,
                authority: TrainingAuthority::parse(authority)
                    .ok_or(Mesh1Error::Invalid("training_authority"))?,
            }),
            (None, None) => None,
            _ => {
                return Err(Mesh1Error::Unpaired(
                    "training_digest",
                    "training_authority",
                ));
            }
        };
        f.finish()?;
        if let Some(bytes) = &resumed {
            let value =
                crate::json::parse_strict(bytes).map_err(|_| Mesh1Error::Invalid("resumed"))?;
            crate::resume::ResumeBlock::from_value(&value)
                .map_err(|_| Mesh1Error::Invalid("resumed"))?;
            if crate::json::canonical_bytes(&value) != *bytes {
                return Err(Mesh1Error::Invalid("resumed (not in RFC 8785 form)"));
            }
            if split.is_none() {
                return Err(Mesh1Error::Invalid("resumed (only a split serve resumes)"));
            }
        }
        if let Some(bytes) = &split {
            let value =
                crate::json::parse_strict(bytes).map_err(|_| Mesh1Error::Invalid("split"))?;
            crate::receipt::CoordinatorReceipt::from_value(&value)
                .map_err(|_| Mesh1Error::Invalid("split"))?;
            if crate::json::canonical_bytes(&value) != *bytes {
                return Err(Mesh1Error::Invalid("split (not in RFC 8785 form)"));
            }
            if !value["request_id"].is_string() {
                return Err(Mesh1Error::Invalid("split"));
            }
        }
        if (sequence == 0) != prev.is_none() {
            return Err(Mesh1Error::Chain(
                "`prev` is absent exactly at sequence 0".into(),
            ));
        }
        let receipt = Self {
            request_id,
            grant_id,
            backend,
            recipe,
            weights,
            route,
            tokens_in,
            tokens_out,
            tokens_accepted,
            cache_hit_tokens,
            spec_proposed,
            spec_accepted,
            fidelity_floor,
            fidelity,
            // Without a delivered level the rating is not on the wire; the
            // recorded `fidelity_met` stands for it.
            fidelity_rating: if fidelity_met {
                fidelity_floor
            } else {
                Fidelity::F0
            },
            energy,
            decision,
            grant_breach,
            output_commitment,
            sequence,
            prev,
            nonce,
            steward,
            split,
            resumed,
            deterministic,
            training,
        };
        if fidelity.is_some() && receipt.fidelity_met() != fidelity_met {
            return Err(Mesh1Error::Derived("fidelity_met"));
        }
        if !fidelity_met && fidelity.is_none() && fidelity_floor == Fidelity::F0 {
            return Err(Mesh1Error::Derived("fidelity_met (every level meets F0)"));
        }
        if receipt.uj_per_accepted_token() != per_token {
            return Err(Mesh1Error::Derived("uj_per_accepted_token"));
        }
        let expected_per_decision = decision
            .filter(|d| d.questions_answered > 0)
            .map(|d| energy.uj() / u64::from(d.questions_answered));
        if expected_per_decision != per_decision {
            return Err(Mesh1Error::Derived("uj_per_decision"));
        }
        let expected_per_option = decision
            .filter(|d| d.options_scored > 0)
            .map(|d| energy.uj() / u64::from(d.options_scored));
        if expected_per_option != per_option {
            return Err(Mesh1Error::Derived("uj_per_option_scored"));
        }
        Ok(receipt)
    }

    /// Seal: sign the core as a tagged COSE_Sign1 with the steward's key.
    pub fn seal(&self, key: &SigningKey) -> Result<SealedReceipt, Mesh1Error> {
        if self.steward != did_key(&key.verifying_key().to_bytes()) {
            return Err(Mesh1Error::StewardMismatch);
        }
        let core = self.signed_core().encode();
        // Never sign what a verifier would refuse (a delivered fidelity above
        // the advertised one, a broken chain position, over-long text, ...).
        MeshReceipt::from_core(&Cbor::decode(&core)?)?;
        let envelope = sign1(core.clone(), key)?;
        Ok(SealedReceipt {
            receipt: self.clone(),
            core,
            envelope,
        })
    }
}

/// Sign core bytes as a JCR-1 envelope: a tagged COSE_Sign1, protected
/// header exactly {alg: EdDSA, kid: the raw Ed25519 public key}, the core
/// attached. Every JCR-1 envelope of this crate (receipts, change-record
/// entries) is made here.
pub(crate) fn sign1(core: Vec<u8>, key: &SigningKey) -> Result<Vec<u8>, Mesh1Error> {
    let protected = HeaderBuilder::new()
        .algorithm(iana::Algorithm::EdDSA)
        .key_id(key.verifying_key().to_bytes().to_vec())
        .build();
    CoseSign1Builder::new()
        .protected(protected)
        .payload(core)
        .create_signature(b"", |tbs| key.sign(tbs).to_bytes().to_vec())
        .build()
        .to_tagged_vec()
        .map_err(|e| Mesh1Error::Envelope(e.to_string()))
}

/// Open a JCR-1 envelope made by [`sign1`]: its size, structure, exact
/// header and signature checked; the signer's key and the attached core.
pub(crate) fn open_sign1(envelope: &[u8]) -> Result<([u8; 32], Vec<u8>), Mesh1Error> {
    if envelope.len() > MAX_ENVELOPE_BYTES {
        return Err(Mesh1Error::TooLarge(envelope.len()));
    }
    let sign1 =
        CoseSign1::from_tagged_slice(envelope).map_err(|e| Mesh1Error::Envelope(e.to_string()))?;
    let header = &sign1.protected.header;
    let kid: [u8; 32] = header
        .key_id
        .as_slice()
        .try_into()
        .map_err(|_| Mesh1Error::Header)?;
    let expected = HeaderBuilder::new()
        .algorithm(iana::Algorithm::EdDSA)
        .key_id(kid.to_vec())
        .build();
    if *header != expected || !sign1.unprotected.is_empty() {
        return Err(Mesh1Error::Header);
    }
    let key = VerifyingKey::from_bytes(&kid).map_err(|_| Mesh1Error::Header)?;
    sign1.verify_signature(b"", |signature, signed| {
        let signature: [u8; 64] = signature.try_into().map_err(|_| Mesh1Error::BadSignature)?;
        key.verify_strict(signed, &Signature::from_bytes(&signature))
            .map_err(|_| Mesh1Error::BadSignature)
    })?;
    let core = sign1.payload.ok_or(Mesh1Error::NoPayload)?;
    // One content, one envelope: the bytes must be exactly those `sign1`
    // writes for this key, core and signature. CBOR lets a head be written
    // longer than it needs (tag 18 as `d8 12`, a length in more bytes),
    // which changes the envelope's content id but not what is signed; a
    // verifier that took such bytes would hold two ids for one receipt.
    let canonical = CoseSign1Builder::new()
        .protected(expected)
        .payload(core.clone())
        .signature(sign1.signature)
        .build()
        .to_tagged_vec()
        .map_err(|e| Mesh1Error::Envelope(e.to_string()))?;
    if canonical != envelope {
        return Err(Mesh1Error::NotCanonical);
    }
    Ok((kid, core))
}

/// Sign arbitrary core bytes as a receipt envelope, without checking them.
/// Only for building negative conformance vectors (a validly signed core
/// that breaks a receipt rule); stewards use [`MeshReceipt::seal`].
#[doc(hidden)]
pub fn sign_core_unchecked(core: Vec<u8>, key: &SigningKey) -> Vec<u8> {
    sign1(core, key).unwrap_or_default()
}

/// A receipt with its exact signed core and envelope bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedReceipt {
    pub receipt: MeshReceipt,
    pub core: Vec<u8>,
    pub envelope: Vec<u8>,
}

impl SealedReceipt {
    /// The envelope's content id: what the next receipt's `prev` names.
    pub fn envelope_id(&self) -> ContentId {
        blake3::hash(&self.envelope).into()
    }

    /// Verify an envelope: COSE structure, the steward named by the core is
    /// the kid, the Ed25519 signature, canonical CBOR, and every receipt rule.
    pub fn verify(envelope: &[u8]) -> Result<Self, Mesh1Error> {
        let (kid, core) = open_sign1(envelope)?;
        let receipt = MeshReceipt::from_core(&Cbor::decode(&core)?)?;
        if receipt.steward != did_key(&kid) {
            return Err(Mesh1Error::StewardMismatch);
        }
        Ok(Self {
            receipt,
            core,
            envelope: envelope.to_vec(),
        })
    }

    /// Check that `self` is the receipt that follows `previous` in one log.
    pub fn check_follows(&self, previous: &SealedReceipt) -> Result<(), Mesh1Error> {
        if self.receipt.steward != previous.receipt.steward {
            return Err(Mesh1Error::Chain("sealed by another steward".into()));
        }
        if Some(self.receipt.sequence) != previous.receipt.sequence.checked_add(1) {
            return Err(Mesh1Error::Chain(format!(
                "sequence {} does not follow {}",
                self.receipt.sequence, previous.receipt.sequence
            )));
        }
        if self.receipt.prev != Some(previous.envelope_id()) {
            return Err(Mesh1Error::Chain(
                "`prev` is not the previous envelope's content id".into(),
            ));
        }
        Ok(())
    }
}

/// The steward's per-request opening key, derived from its signing key so a
/// restarted steward can disclose any opening without having stored it.
pub fn opening_key(signing_seed: &[u8; 32]) -> [u8; 32] {
    blake3::derive_key(
        "mesh-node 2026-11 mesh/1 output commitment opening key",
        signing_seed,
    )
}

/// The 32-byte opening for one request.
pub fn opening(opening_key: &[u8; 32], request_id: &ContentId) -> [u8; 32] {
    blake3::keyed_hash(opening_key, request_id).into()
}

fn token_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// `BLAKE3("mesh/1 prompt payload\0" ‖ prompt)`, the prompt being the token
/// ids the engine was handed, each a little-endian u32.
pub fn prompt_payload(prompt_tokens: &[u32]) -> ContentId {
    let mut h = blake3::Hasher::new();
    h.update(b"mesh/1 prompt payload\0");
    h.update(&token_bytes(prompt_tokens));
    h.finalize().into()
}

/// `BLAKE3("mesh/1 output commitment\0" ‖ opening ‖ request_id ‖ payload ‖ tokens)`.
pub fn output_commitment(
    opening: &[u8; 32],
    request_id: &ContentId,
    payload: &ContentId,
    output_tokens: &[u32],
) -> ContentId {
    let mut h = blake3::Hasher::new();
    h.update(b"mesh/1 output commitment\0");
    h.update(opening);
    h.update(request_id);
    h.update(payload);
    h.update(&token_bytes(output_tokens));
    h.finalize().into()
}

/// Content address of weights loaded from files (§3.6): BLAKE3 over the
/// canonical CBOR array of `[relative path, BLAKE3(file bytes)]`, in path order.
pub fn weights_digest(files: &[(String, ContentId)]) -> ContentId {
    let mut sorted: Vec<&(String, ContentId)> = files.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    content_id(&Cbor::Array(
        sorted
            .into_iter()
            .map(|(path, digest)| Cbor::Array(vec![Cbor::text(path), Cbor::bytes(digest.to_vec())]))
            .collect(),
    ))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn sample_request() -> ServeRequest {
        ServeRequest {
            prompt_hash: prompt_hash(b"What is the capital of France?"),
            prompt_tokens: 9,
            max_tokens: 16,
            fidelity_floor: Fidelity::F1,
            joule_ceiling_uj: 5_000_000,
            decision: None,
        }
    }

    pub(crate) fn sample_receipt(key: &SigningKey) -> MeshReceipt {
        MeshReceipt {
            request_id: sample_request().request_id(),
            grant_id: None,
            backend: "mesh-node/split".into(),
            recipe: "smollm2-135m-instruct".into(),
            weights: Some(WeightsBinding {
                weights_digest: [9; 32],
                precision: "fp32".into(),
            }),
            route: "static split over 3 nodes".into(),
            tokens_in: 9,
            tokens_out: 7,
            tokens_accepted: 7,
            cache_hit_tokens: 0,
            spec_proposed: 0,
            spec_accepted: 0,
            fidelity_floor: Fidelity::F1,
            fidelity: None,
            fidelity_rating: Fidelity::F2,
            energy: Energy::estimator(1_400_000),
            decision: None,
            grant_breach: None,
            output_commitment: Some([3; 32]),
            sequence: 0,
            prev: None,
            nonce: [5; 16],
            steward: did_key(&key.verifying_key().to_bytes()),
            split: None,
            resumed: None,
            deterministic: None,
            training: None,
        }
    }

    #[test]
    fn decision_is_omitted_so_old_ids_hold() {
        let request = sample_request();
        let keys: Vec<&str> = match request.to_cbor() {
            Cbor::Map(entries) => entries
                .iter()
                .filter_map(|(k, _)| k.as_text().map(|_| ""))
                .collect(),
            _ => vec![],
        };
        assert_eq!(keys.len(), 5);
        let with = ServeRequest {
            decision: Some(Decision {
                questions: 1,
                options_scored: 2,
                schema_tokens: 3,
            }),
            ..request.clone()
        };
        assert_ne!(with.request_id(), request.request_id());
        assert_eq!(ServeRequest::from_cbor(&with.to_cbor()), Ok(with));
    }

    #[test]
    fn coupling_is_enforced_on_the_wire() {
        assert!(Energy::from_parts(None, 1, Provenance::HwShunt).is_err());
        assert!(Energy::from_parts(Some(1), 1, Provenance::Estimator).is_err());
        assert!(Energy::from_parts(Some(1), 1, Provenance::ModelBased).is_err());
        assert_eq!(
            Energy::from_parts(Some(7), 1, Provenance::HwShunt).map(|e| e.uj()),
            Ok(7)
        );
        let key = SigningKey::from_bytes(&[1; 32]);
        let mut core = sample_receipt(&key).signed_core();
        if let Cbor::Map(entries) = &mut core {
            entries.push((Cbor::text("measured_uj"), Cbor::Uint(5)));
        }
        assert_eq!(
            MeshReceipt::from_core(&Cbor::decode(&core.encode()).unwrap()),
            Err(Mesh1Error::Coupling(
                "measured_uj is present only for HwShunt"
            ))
        );
    }

    #[test]
    fn seal_verify_and_chain() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let first = sample_receipt(&key).seal(&key).unwrap();
        let verified = SealedReceipt::verify(&first.envelope).unwrap();
        assert_eq!(verified.receipt.signed_core(), first.receipt.signed_core());
        let second = MeshReceipt {
            sequence: 1,
            prev: Some(first.envelope_id()),
            ..sample_receipt(&key)
        }
        .seal(&key)
        .unwrap();
        assert_eq!(second.check_follows(&first), Ok(()));
        assert!(first.check_follows(&second).is_err());
        let other = SigningKey::from_bytes(&[2; 32]);
        assert_eq!(
            sample_receipt(&key).seal(&other),
            Err(Mesh1Error::StewardMismatch)
        );
    }

    #[test]
    fn every_byte_of_an_envelope_is_covered() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let sealed = sample_receipt(&key).seal(&key).unwrap();
        for index in 0..sealed.envelope.len() {
            for bit in [0x01u8, 0x80] {
                let mut tampered = sealed.envelope.clone();
                tampered[index] ^= bit;
                assert!(
                    SealedReceipt::verify(&tampered).is_err(),
                    "byte {index} bit {bit:#x}"
                );
            }
        }
        let mut trailing = sealed.envelope.clone();
        trailing.push(0);
        assert!(SealedReceipt::verify(&trailing).is_err());
        for cut in 0..sealed.envelope.len() {
            assert!(
                SealedReceipt::verify(&sealed.envelope[..cut]).is_err(),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn derived_figures() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let receipt = sample_receipt(&key);
        assert_eq!(receipt.uj_per_accepted_token(), Some(200_000));
        assert!(receipt.fidelity_met());
        let delivered_low = MeshReceipt {
            fidelity: Some(FidelityReport {
                advertised: Fidelity::F2,
                delivered: Fidelity::F0,
            }),
            ..receipt.clone()
        };
        assert!(
            !delivered_low.fidelity_met(),
            "delivered, not advertised, decides"
        );
        let none = MeshReceipt {
            tokens_accepted: 0,
            ..receipt
        };
        assert_eq!(none.uj_per_accepted_token(), None);
    }

    #[test]
    fn delivered_above_advertised_is_refused_not_clamped() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let dishonest = MeshReceipt {
            fidelity: Some(FidelityReport {
                advertised: Fidelity::F1,
                delivered: Fidelity::F3,
            }),
            ..sample_receipt(&key)
        };
        assert!(matches!(dishonest.seal(&key), Err(Mesh1Error::Derived(_))));
    }

    #[test]
    fn more_drafts_accepted_than_proposed_is_refused() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let honest = MeshReceipt {
            spec_proposed: 12,
            spec_accepted: 12,
            ..sample_receipt(&key)
        };
        assert!(honest.seal(&key).is_ok());
        let dishonest = MeshReceipt {
            spec_proposed: 12,
            spec_accepted: 13,
            ..sample_receipt(&key)
        };
        assert!(matches!(dishonest.seal(&key), Err(Mesh1Error::Derived(_))));
    }

    #[test]
    fn decision_receipts_carry_per_decision_figures() {
        let key = SigningKey::from_bytes(&[1; 32]);
        let receipt = MeshReceipt {
            tokens_out: 0,
            tokens_accepted: 0,
            decision: Some(DecisionOutcome {
                questions_answered: 4,
                options_scored: 10,
                schema_tokens: 121,
            }),
            ..sample_receipt(&key)
        };
        let core = receipt.signed_core();
        assert_eq!(
            core.get("uj_per_decision").and_then(Cbor::as_uint),
            Some(1_400_000 / 4)
        );
        assert_eq!(
            core.get("uj_per_option_scored").and_then(Cbor::as_uint),
            Some(1_400_000 / 10)
        );
        assert_eq!(
            core.get("uj_per_accepted_token"),
            None,
            "undefined without accepted tokens"
        );
        let sealed = receipt.seal(&key).unwrap();
        assert_eq!(
            SealedReceipt::verify(&sealed.envelope)
                .unwrap()
                .receipt
                .decision,
            receipt.decision
        );
    }

    #[test]
    fn output_commitment_binds_everything() {
        let key = opening_key(&[1; 32]);
        let request = [2; 32];
        let open = opening(&key, &request);
        let payload = prompt_payload(&[1, 2, 3]);
        let c = output_commitment(&open, &request, &payload, &[10, 11]);
        assert_ne!(c, output_commitment(&open, &request, &payload, &[10, 12]));
        assert_ne!(c, output_commitment(&open, &[3; 32], &payload, &[10, 11]));
        assert_ne!(
            c,
            output_commitment(&open, &request, &prompt_payload(&[1, 2]), &[10, 11])
        );
        assert_ne!(
            c,
            output_commitment(&opening(&key, &[3; 32]), &request, &payload, &[10, 11])
        );
        assert_eq!(
            opening(&opening_key(&[1; 32]), &request),
            open,
            "derivable after restart"
        );
    }

    #[test]
    fn weights_digest_is_order_independent_and_name_bound() {
        let a = ("config.json".to_string(), [1; 32]);
        let b = ("model.safetensors".to_string(), [2; 32]);
        assert_eq!(
            weights_digest(&[a.clone(), b.clone()]),
            weights_digest(&[b.clone(), a.clone()])
        );
        let renamed = ("model-2.safetensors".to_string(), [2; 32]);
        assert_ne!(
            weights_digest(&[a.clone(), b]),
            weights_digest(&[a, renamed])
        );
    }

    proptest! {
        #[test]
        fn receipts_round_trip(
            tokens in 0u64..10_000, accepted in 0u64..10_000, estimated in any::<u64>(),
            measured in proptest::option::of(any::<u64>()), sequence in 1u64..1_000_000,
            floor in 0u64..5, grant in proptest::option::of(any::<[u8; 32]>()),
        ) {
            let key = SigningKey::from_bytes(&[4; 32]);
            let receipt = MeshReceipt {
                tokens_out: tokens,
                tokens_accepted: accepted,
                energy: measured.map_or(Energy::estimator(estimated), |m| Energy::hw_shunt(m, estimated)),
                sequence,
                prev: Some([8; 32]),
                fidelity_floor: Fidelity::from_level(floor).unwrap(),
                fidelity_rating: Fidelity::F4,
                grant_id: grant,
                ..sample_receipt(&key)
            };
            let sealed = receipt.seal(&key).unwrap();
            let verified = SealedReceipt::verify(&sealed.envelope).unwrap();
            prop_assert_eq!(verified.core, sealed.core);
            prop_assert_eq!(verified.receipt.energy, receipt.energy);
        }

        #[test]
        fn verify_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = SealedReceipt::verify(&bytes);
        }
    }
}
