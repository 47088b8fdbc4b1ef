//! Grants: signed, attenuable budgets of joules, presented per request and
//! decided by the steward that holds them (seed SPEC 001 §2, §2.1, §7.1).
//!
//! A grant names its `issuer` and `subject` (did:key), a `budget_uj`,
//! caveats, an expiry and, unless it is a root, its `parent`'s id. A chain
//! runs root first, leaf last; each link is issued by the previous link's
//! subject and never exceeds it. The leaf's subject is the steward that may
//! spend it, and only the leaf's issuer may present it. A holder spreads a
//! budget over several stewards by sharding it into sibling children whose
//! budgets sum to no more than the parent's.

use std::collections::{BTreeMap, BTreeSet};

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use thiserror::Error;

use crate::cbor::{Cbor, FieldError, Fields};
use crate::identity::{did_key, parse_did_key};
use crate::mesh1::{ContentId, ServeRequest, content_id};

/// Longest chain accepted, root to leaf.
pub const MAX_CHAIN_LENGTH: usize = 8;
/// Most caveats on one grant.
pub const MAX_CAVEATS: usize = 16;
/// Most models one `ModelIn` caveat lists.
pub const MAX_MODELS_PER_CAVEAT: usize = 64;
/// The action a serve is decided for.
pub const INFER: &str = "infer";

/// A condition on a grant, checked on every link of a chain.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Caveat {
    /// The serve's weights (content address) must be one of these; a backend
    /// that names no weights is refused.
    ModelIn(Vec<ContentId>),
    /// Cost-dependent: one serve's metered joules may not exceed this. Checked
    /// at debit; a breach is recorded on the receipt.
    MaxCostUj(u64),
    /// The actions allowed (`infer`).
    Actions(Vec<String>),
}

impl Caveat {
    fn to_cbor(&self) -> Cbor {
        match self {
            Caveat::ModelIn(models) => Cbor::text_map([(
                "ModelIn",
                Cbor::Array(models.iter().map(|m| Cbor::bytes(m.to_vec())).collect()),
            )]),
            Caveat::MaxCostUj(limit) => Cbor::text_map([("MaxCostUj", Cbor::Uint(*limit))]),
            Caveat::Actions(actions) => Cbor::text_map([(
                "Actions",
                Cbor::Array(actions.iter().map(Cbor::text).collect()),
            )]),
        }
    }

    fn from_cbor(value: &Cbor) -> Result<Self, GrantError> {
        let Cbor::Map(entries) = value else {
            return Err(GrantError::Malformed("a caveat is a one-member map"));
        };
        let [(name, body)] = entries.as_slice() else {
            return Err(GrantError::Malformed("a caveat is a one-member map"));
        };
        match (name.as_text(), body) {
            (Some("ModelIn"), Cbor::Array(items)) if items.len() <= MAX_MODELS_PER_CAVEAT => {
                Ok(Caveat::ModelIn(
                    items
                        .iter()
                        .map(|i| i.as_bytes().and_then(|b| b.try_into().ok()))
                        .collect::<Option<Vec<ContentId>>>()
                        .ok_or(GrantError::Malformed("ModelIn lists 32-byte content ids"))?,
                ))
            }
            (Some("MaxCostUj"), Cbor::Uint(limit)) => Ok(Caveat::MaxCostUj(*limit)),
            (Some("Actions"), Cbor::Array(items)) if items.len() <= MAX_CAVEATS => {
                Ok(Caveat::Actions(
                    items
                        .iter()
                        .map(|i| i.as_text().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                        .ok_or(GrantError::Malformed("Actions lists text"))?,
                ))
            }
            _ => Err(GrantError::Malformed(
                "unknown caveat, or a caveat of the wrong shape",
            )),
        }
    }
}

/// The signed content of a grant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Grant {
    pub issuer: String,
    pub subject: String,
    pub budget_uj: u64,
    pub caveats: Vec<Caveat>,
    pub parent: Option<ContentId>,
    /// Milliseconds since the Unix epoch; the grant is void from then on.
    pub expiry_ms: u64,
    /// Makes otherwise equal grants distinct.
    pub nonce: [u8; 16],
}

/// A grant with its issuer's signature.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SignedGrant {
    pub grant: Grant,
    pub signature: [u8; 64],
}

/// Why a grant, chain or presentation is not well formed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GrantError {
    #[error("malformed: {0}")]
    Malformed(&'static str),
    #[error("CBOR: {0}")]
    Cbor(#[from] crate::cbor::CborError),
    #[error("the signing key is not the grant's {0}")]
    WrongKey(&'static str),
    #[error("shards total {total} µJ, over the parent's {budget} µJ")]
    Oversharded { total: u64, budget: u64 },
}

impl From<FieldError> for GrantError {
    fn from(error: FieldError) -> Self {
        match error {
            FieldError::NotAMap => GrantError::Malformed("expected a map"),
            FieldError::Missing(key) | FieldError::Invalid(key) => GrantError::Malformed(key),
            FieldError::Unknown(_) => GrantError::Malformed("unknown member"),
        }
    }
}

/// Longest text member (a did:key is about 56 bytes).
const MAX_GRANT_TEXT: usize = 256;

fn fields(value: &Cbor) -> Result<Fields<'_>, GrantError> {
    Ok(Fields::of(value)?.text_limit(MAX_GRANT_TEXT))
}

impl Grant {
    pub fn to_cbor(&self) -> Cbor {
        let mut fields = vec![
            ("v", Cbor::Uint(1)),
            ("issuer", Cbor::text(&self.issuer)),
            ("subject", Cbor::text(&self.subject)),
            ("budget_uj", Cbor::Uint(self.budget_uj)),
            (
                "caveats",
                Cbor::Array(self.caveats.iter().map(Caveat::to_cbor).collect()),
            ),
            ("expiry_ms", Cbor::Uint(self.expiry_ms)),
            ("nonce", Cbor::bytes(self.nonce.to_vec())),
        ];
        if let Some(parent) = &self.parent {
            fields.push(("parent", Cbor::bytes(parent.to_vec())));
        }
        Cbor::text_map(fields)
    }

    pub fn from_cbor(value: &Cbor) -> Result<Self, GrantError> {
        let mut f = fields(value)?;
        if f.uint("v")? != 1 {
            return Err(GrantError::Malformed("v"));
        }
        let issuer = f.text("issuer")?.to_string();
        let subject = f.text("subject")?.to_string();
        if parse_did_key(&issuer).is_none() || parse_did_key(&subject).is_none() {
            return Err(GrantError::Malformed(
                "issuer and subject are Ed25519 did:keys",
            ));
        }
        let caveats = f.array("caveats")?;
        if caveats.len() > MAX_CAVEATS {
            return Err(GrantError::Malformed("caveats"));
        }
        let caveats = caveats
            .iter()
            .map(Caveat::from_cbor)
            .collect::<Result<Vec<_>, _>>()?;
        let grant = Self {
            issuer,
            subject,
            budget_uj: f.uint("budget_uj")?,
            caveats,
            parent: f.opt_fixed("parent")?,
            expiry_ms: f.uint("expiry_ms")?,
            nonce: f.fixed("nonce")?,
        };
        f.finish()?;
        Ok(grant)
    }

    /// The grant id: BLAKE3 content id of the unsigned grant.
    pub fn id(&self) -> ContentId {
        content_id(&self.to_cbor())
    }

    /// Sign as the issuer.
    pub fn sign(self, issuer_key: &SigningKey) -> Result<SignedGrant, GrantError> {
        if self.issuer != did_key(&issuer_key.verifying_key().to_bytes()) {
            return Err(GrantError::WrongKey("issuer"));
        }
        let signature = issuer_key.sign(&self.to_cbor().encode()).to_bytes();
        Ok(SignedGrant {
            grant: self,
            signature,
        })
    }
}

impl SignedGrant {
    pub fn id(&self) -> ContentId {
        self.grant.id()
    }

    pub fn to_cbor(&self) -> Cbor {
        Cbor::text_map([
            ("grant", self.grant.to_cbor()),
            ("signature", Cbor::bytes(self.signature.to_vec())),
        ])
    }

    pub fn from_cbor(value: &Cbor) -> Result<Self, GrantError> {
        let mut f = fields(value)?;
        let signed = Self {
            grant: Grant::from_cbor(f.required("grant")?)?,
            signature: f.fixed("signature")?,
        };
        f.finish()?;
        Ok(signed)
    }

    pub fn encode(&self) -> Vec<u8> {
        self.to_cbor().encode()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, GrantError> {
        Self::from_cbor(&Cbor::decode(bytes)?)
    }

    /// Whether the issuer's signature holds.
    pub fn signature_valid(&self) -> bool {
        let Some(key) =
            parse_did_key(&self.grant.issuer).and_then(|k| VerifyingKey::from_bytes(&k).ok())
        else {
            return false;
        };
        key.verify_strict(
            &self.grant.to_cbor().encode(),
            &Signature::from_bytes(&self.signature),
        )
        .is_ok()
    }

    /// Issue a child of this grant: the holder (this grant's subject) passes
    /// on at most what it holds, with the parent's caveats plus its own.
    pub fn delegate(
        &self,
        holder_key: &SigningKey,
        subject: &str,
        budget_uj: u64,
        extra_caveats: Vec<Caveat>,
        expiry_ms: u64,
        nonce: [u8; 16],
    ) -> Result<SignedGrant, GrantError> {
        if self.grant.subject != did_key(&holder_key.verifying_key().to_bytes()) {
            return Err(GrantError::WrongKey("subject (holder)"));
        }
        if budget_uj > self.grant.budget_uj {
            return Err(GrantError::Oversharded {
                total: budget_uj,
                budget: self.grant.budget_uj,
            });
        }
        let mut caveats = self.grant.caveats.clone();
        caveats.extend(extra_caveats);
        Grant {
            issuer: self.grant.subject.clone(),
            subject: subject.to_string(),
            budget_uj,
            caveats,
            parent: Some(self.id()),
            expiry_ms: expiry_ms.min(self.grant.expiry_ms),
            nonce,
        }
        .sign(holder_key)
    }

    /// Shard this grant over several stewards: one sibling child each, with
    /// budgets summing to no more than this grant's.
    pub fn shard(
        &self,
        holder_key: &SigningKey,
        shares: &[(String, u64)],
        expiry_ms: u64,
        nonce_seed: [u8; 16],
    ) -> Result<Vec<SignedGrant>, GrantError> {
        let total = shares
            .iter()
            .try_fold(0u64, |sum, (_, b)| sum.checked_add(*b));
        let total = total.ok_or(GrantError::Oversharded {
            total: u64::MAX,
            budget: self.grant.budget_uj,
        })?;
        if total > self.grant.budget_uj {
            return Err(GrantError::Oversharded {
                total,
                budget: self.grant.budget_uj,
            });
        }
        shares
            .iter()
            .enumerate()
            .map(|(i, (steward, budget))| {
                let mut nonce = nonce_seed;
                nonce[15] ^= i as u8;
                nonce[14] ^= (i >> 8) as u8;
                self.delegate(holder_key, steward, *budget, Vec::new(), expiry_ms, nonce)
            })
            .collect()
    }
}

/// A grant presented for one request by the leaf's issuer (§2.1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Presentation {
    /// Root first, leaf last.
    pub chain: Vec<SignedGrant>,
    pub caller: String,
    pub nonce: [u8; 16],
    pub signature: [u8; 64],
}

/// The weights every `ModelIn` among `caveats` permits at once; `None`
/// when none restricts models.
pub fn permitted_models<'a>(
    caveats: impl IntoIterator<Item = &'a Caveat>,
) -> Option<Vec<ContentId>> {
    caveats
        .into_iter()
        .filter_map(|caveat| match caveat {
            Caveat::ModelIn(models) => Some(models),
            _ => None,
        })
        .fold(None, |permitted: Option<Vec<ContentId>>, models| {
            Some(match permitted {
                None => models.clone(),
                Some(kept) => kept.into_iter().filter(|m| models.contains(m)).collect(),
            })
        })
}

fn presentation_message(
    request_id: &ContentId,
    grant_id: &ContentId,
    caller: &str,
    nonce: &[u8; 16],
) -> Vec<u8> {
    Cbor::text_map([
        ("request_id", Cbor::bytes(request_id.to_vec())),
        ("grant_id", Cbor::bytes(grant_id.to_vec())),
        ("caller", Cbor::text(caller)),
        ("nonce", Cbor::bytes(nonce.to_vec())),
    ])
    .encode()
}

impl Presentation {
    /// The weights every `ModelIn` caveat of its chain permits at once
    /// (their intersection, in the first one's order); `None` when no
    /// link restricts models. A steward refuses any other weights
    /// (`ModelNotPermitted`), so a router leaves them out first.
    pub fn model_in(&self) -> Option<Vec<ContentId>> {
        permitted_models(self.chain.iter().flat_map(|link| &link.grant.caveats))
    }
    /// Sign a presentation of `chain` for one request as `caller_key`.
    pub fn sign(
        chain: Vec<SignedGrant>,
        request_id: &ContentId,
        caller_key: &SigningKey,
        nonce: [u8; 16],
    ) -> Result<Self, GrantError> {
        let leaf = chain.last().ok_or(GrantError::Malformed("empty chain"))?;
        let caller = did_key(&caller_key.verifying_key().to_bytes());
        let message = presentation_message(request_id, &leaf.id(), &caller, &nonce);
        let signature = caller_key.sign(&message).to_bytes();
        Ok(Self {
            chain,
            caller,
            nonce,
            signature,
        })
    }

    pub fn leaf(&self) -> Option<&SignedGrant> {
        self.chain.last()
    }

    pub fn to_cbor(&self) -> Cbor {
        Cbor::text_map([
            (
                "chain",
                Cbor::Array(self.chain.iter().map(SignedGrant::to_cbor).collect()),
            ),
            ("caller", Cbor::text(&self.caller)),
            ("nonce", Cbor::bytes(self.nonce.to_vec())),
            ("signature", Cbor::bytes(self.signature.to_vec())),
        ])
    }

    pub fn from_cbor(value: &Cbor) -> Result<Self, GrantError> {
        let mut f = fields(value)?;
        let links = f.array("chain")?;
        if links.is_empty() || links.len() > MAX_CHAIN_LENGTH {
            return Err(GrantError::Malformed("a chain has 1 to 8 grants"));
        }
        let presentation = Self {
            chain: links
                .iter()
                .map(SignedGrant::from_cbor)
                .collect::<Result<_, _>>()?,
            caller: f.text("caller")?.to_string(),
            nonce: f.fixed("nonce")?,
            signature: f.fixed("signature")?,
        };
        f.finish()?;
        Ok(presentation)
    }

    pub fn encode(&self) -> Vec<u8> {
        self.to_cbor().encode()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, GrantError> {
        Self::from_cbor(&Cbor::decode(bytes)?)
    }
}

/// Why the steward refuses a serve on a grant. `label()` is what a receipt
/// or an HTTP refusal names.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Refusal {
    #[error("the steward stopped honouring grants: {0}")]
    Halted(String),
    #[error("the presentation's caller is not the leaf grant's issuer")]
    CallerNotIssuer,
    #[error("the presentation is not signed by its caller for this request")]
    PresentationSignature,
    #[error("this presentation (leaf and nonce) was already spent here")]
    Replayed,
    #[error("grant {link} of the chain is not signed by its issuer")]
    GrantSignature { link: usize },
    #[error("grant {link} does not follow its parent: {why}")]
    BrokenChain { link: usize, why: &'static str },
    #[error("grant {link} expired")]
    Expired { link: usize },
    #[error("grant {link} was revoked")]
    Revoked { link: usize },
    #[error("the leaf grant is held by another steward")]
    HeldByAnotherSteward,
    #[error("grant {link} does not permit `infer`")]
    ActionNotPermitted { link: usize },
    #[error("grant {link} does not permit this model")]
    ModelNotPermitted { link: usize },
    #[error("{remaining_uj} µJ left on the chain, below the request's ceiling of {ceiling_uj} µJ")]
    InsufficientBudget { remaining_uj: u64, ceiling_uj: u64 },
}

impl Refusal {
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::Halted(_) => "steward-halted",
            Refusal::CallerNotIssuer => "caller-not-issuer",
            Refusal::PresentationSignature => "presentation-signature",
            Refusal::Replayed => "presentation-replayed",
            Refusal::GrantSignature { .. } => "bad-signature",
            Refusal::BrokenChain { .. } => "attenuation-violated",
            Refusal::Expired { .. } => "expired",
            Refusal::Revoked { .. } => "revoked",
            Refusal::HeldByAnotherSteward => "wrong-holder",
            Refusal::ActionNotPermitted { .. } | Refusal::ModelNotPermitted { .. } => {
                "caveat-unsatisfied"
            }
            Refusal::InsufficientBudget { .. } => "budget-exhausted",
        }
    }
}

/// A decided serve, to be debited once its work has run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorisation {
    pub request_id: ContentId,
    pub leaf_id: ContentId,
    /// Every link's id, root first.
    pub chain_ids: Vec<ContentId>,
    /// Every link's budget, root first.
    pub budgets_uj: Vec<u64>,
    pub caller: String,
    pub nonce: [u8; 16],
    pub ceiling_uj: u64,
    /// The least `MaxCostUj` on the chain, if any.
    pub max_cost_uj: Option<u64>,
}

/// What a debit did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Debit {
    pub debited_uj: u64,
    /// The denial label when the debit breached the grant (the work ran, so
    /// the joules are debited anyway).
    pub breach: Option<&'static str>,
}

/// The steward's enforcement point: verifies presentations, decides chains,
/// and keeps each link's spend. Sans-IO: the journal that makes its state
/// durable lives in the node.
#[derive(Debug, Clone)]
pub struct GrantGate {
    steward: String,
    spent: BTreeMap<ContentId, u64>,
    reserved: BTreeMap<ContentId, u64>,
    presentations: BTreeSet<(ContentId, [u8; 16])>,
    revoked: BTreeSet<ContentId>,
    halted: Option<String>,
}

impl GrantGate {
    /// A gate for the steward whose did:key is `steward`.
    pub fn new(steward: &str) -> Self {
        Self {
            steward: steward.to_string(),
            spent: BTreeMap::new(),
            reserved: BTreeMap::new(),
            presentations: BTreeSet::new(),
            revoked: BTreeSet::new(),
            halted: None,
        }
    }

    pub fn steward(&self) -> &str {
        &self.steward
    }

    pub fn revoke(&mut self, grant_id: ContentId) {
        self.revoked.insert(grant_id);
    }

    /// Stop honouring grants (a witness showed a receipt the journal lacks).
    pub fn halt(&mut self, why: String) {
        self.halted = Some(why);
    }

    pub fn halted(&self) -> Option<&str> {
        self.halted.as_deref()
    }

    /// Honour grants again (an operator's recorded decision, after the
    /// cause of a halt was dealt with); the reason the gate was halted for.
    pub fn clear_halt(&mut self) -> Option<String> {
        self.halted.take()
    }

    /// Joules debited so far against a grant at this steward.
    pub fn spent(&self, grant_id: &ContentId) -> u64 {
        self.spent.get(grant_id).copied().unwrap_or(0)
    }

    fn remaining(&self, link: &SignedGrant) -> u64 {
        let id = link.id();
        let used = self
            .spent(&id)
            .saturating_add(self.reserved.get(&id).copied().unwrap_or(0));
        link.grant.budget_uj.saturating_sub(used)
    }

    /// Least remaining budget over a chain.
    pub fn chain_remaining(&self, chain: &[SignedGrant]) -> u64 {
        chain
            .iter()
            .map(|link| self.remaining(link))
            .min()
            .unwrap_or(0)
    }

    /// Phase one: decide a serve before any work runs. On success the
    /// request's ceiling is reserved on every link until the debit.
    pub fn decide(
        &mut self,
        presentation: &Presentation,
        request: &ServeRequest,
        model: Option<&ContentId>,
        now_ms: u64,
    ) -> Result<Authorisation, Refusal> {
        if let Some(why) = &self.halted {
            return Err(Refusal::Halted(why.clone()));
        }
        let chain = &presentation.chain;
        let leaf = chain.last().ok_or(Refusal::BrokenChain {
            link: 0,
            why: "empty chain",
        })?;
        let request_id = request.request_id();
        let leaf_id = leaf.id();
        if presentation.caller != leaf.grant.issuer {
            return Err(Refusal::CallerNotIssuer);
        }
        let caller_key = parse_did_key(&presentation.caller)
            .and_then(|k| VerifyingKey::from_bytes(&k).ok())
            .ok_or(Refusal::PresentationSignature)?;
        let message = presentation_message(
            &request_id,
            &leaf_id,
            &presentation.caller,
            &presentation.nonce,
        );
        caller_key
            .verify_strict(&message, &Signature::from_bytes(&presentation.signature))
            .map_err(|_| Refusal::PresentationSignature)?;
        if self.presentations.contains(&(leaf_id, presentation.nonce)) {
            return Err(Refusal::Replayed);
        }
        if chain.len() > MAX_CHAIN_LENGTH {
            return Err(Refusal::BrokenChain {
                link: MAX_CHAIN_LENGTH,
                why: "chain too long",
            });
        }
        let mut max_cost_uj: Option<u64> = None;
        for (link, signed) in chain.iter().enumerate() {
            let grant = &signed.grant;
            if !signed.signature_valid() {
                return Err(Refusal::GrantSignature { link });
            }
            match (link, chain.get(link.wrapping_sub(1))) {
                (0, _) if grant.parent.is_some() => {
                    return Err(Refusal::BrokenChain {
                        link,
                        why: "the root names a parent",
                    });
                }
                (_, Some(parent)) => {
                    if grant.parent != Some(parent.id()) {
                        return Err(Refusal::BrokenChain {
                            link,
                            why: "parent is not the previous grant",
                        });
                    }
                    if grant.issuer != parent.grant.subject {
                        return Err(Refusal::BrokenChain {
                            link,
                            why: "issued by someone other than the parent's subject",
                        });
                    }
                    if grant.budget_uj > parent.grant.budget_uj {
                        return Err(Refusal::BrokenChain {
                            link,
                            why: "budget above the parent's",
                        });
                    }
                    if grant.expiry_ms > parent.grant.expiry_ms {
                        return Err(Refusal::BrokenChain {
                            link,
                            why: "expires after the parent",
                        });
                    }
                }
                _ => {}
            }
            if now_ms >= grant.expiry_ms {
                return Err(Refusal::Expired { link });
            }
            if self.revoked.contains(&signed.id()) {
                return Err(Refusal::Revoked { link });
            }
            for caveat in &grant.caveats {
                match caveat {
                    Caveat::Actions(actions) if !actions.iter().any(|a| a == INFER) => {
                        return Err(Refusal::ActionNotPermitted { link });
                    }
                    Caveat::ModelIn(models) if !model.is_some_and(|m| models.contains(m)) => {
                        return Err(Refusal::ModelNotPermitted { link });
                    }
                    Caveat::MaxCostUj(limit) => {
                        max_cost_uj = Some(max_cost_uj.map_or(*limit, |m| m.min(*limit)));
                    }
                    _ => {}
                }
            }
        }
        if leaf.grant.subject != self.steward {
            return Err(Refusal::HeldByAnotherSteward);
        }
        let remaining_uj = self.chain_remaining(chain);
        if remaining_uj < request.joule_ceiling_uj {
            return Err(Refusal::InsufficientBudget {
                remaining_uj,
                ceiling_uj: request.joule_ceiling_uj,
            });
        }
        let chain_ids: Vec<ContentId> = chain.iter().map(SignedGrant::id).collect();
        for id in &chain_ids {
            let reserved = self.reserved.entry(*id).or_insert(0);
            *reserved = reserved.saturating_add(request.joule_ceiling_uj);
        }
        self.presentations.insert((leaf_id, presentation.nonce));
        Ok(Authorisation {
            request_id,
            leaf_id,
            chain_ids,
            budgets_uj: chain.iter().map(|link| link.grant.budget_uj).collect(),
            caller: presentation.caller.clone(),
            nonce: presentation.nonce,
            ceiling_uj: request.joule_ceiling_uj,
            max_cost_uj,
        })
    }

    /// Phase two: debit the metered joules on every link, releasing the
    /// reservation. The work ran, so a breach is debited and reported.
    pub fn debit(&mut self, authorisation: &Authorisation, metered_uj: u64) -> Debit {
        let mut breach = None;
        if authorisation
            .max_cost_uj
            .is_some_and(|limit| metered_uj > limit)
        {
            breach = Some("caveat-unsatisfied");
        }
        for (index, id) in authorisation.chain_ids.iter().enumerate() {
            let reserved = self.reserved.entry(*id).or_insert(0);
            *reserved = reserved.saturating_sub(authorisation.ceiling_uj);
            let spent = self.spent.entry(*id).or_insert(0);
            *spent = spent.saturating_add(metered_uj);
            if authorisation
                .budgets_uj
                .get(index)
                .is_some_and(|budget| *spent > *budget)
                && breach.is_none()
            {
                breach = Some("budget-exceeded");
            }
        }
        Debit {
            debited_uj: metered_uj,
            breach,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_permitted_models_are_every_model_in_at_once() {
        let (a, b, c) = ([1; 32], [2; 32], [3; 32]);
        assert_eq!(permitted_models(&[Caveat::MaxCostUj(5)]), None);
        assert_eq!(
            permitted_models(&[
                Caveat::ModelIn(vec![a, b, c]),
                Caveat::MaxCostUj(5),
                Caveat::ModelIn(vec![c, a]),
            ]),
            Some(vec![a, c])
        );
        // Disjoint lists permit nothing, not anything.
        assert_eq!(
            permitted_models(&[Caveat::ModelIn(vec![a]), Caveat::ModelIn(vec![b])]),
            Some(vec![])
        );
    }
    use crate::mesh1::{Fidelity, prompt_hash};

    pub(crate) fn key(n: u8) -> SigningKey {
        SigningKey::from_bytes(&[n; 32])
    }
    pub(crate) fn did(k: &SigningKey) -> String {
        did_key(&k.verifying_key().to_bytes())
    }

    fn request(ceiling: u64, n: u8) -> ServeRequest {
        ServeRequest {
            prompt_hash: prompt_hash(&[n]),
            prompt_tokens: 4,
            max_tokens: 8,
            fidelity_floor: Fidelity::F0,
            joule_ceiling_uj: ceiling,
            decision: None,
        }
    }

    const NOW: u64 = 1_800_000_000_000;

    /// owner -> requester (root), requester -> steward (leaf).
    fn chain(budget: u64, caveats: Vec<Caveat>) -> (Vec<SignedGrant>, SigningKey, SigningKey) {
        let (owner, requester, steward) = (key(1), key(2), key(3));
        let root = Grant {
            issuer: did(&owner),
            subject: did(&requester),
            budget_uj: budget,
            caveats,
            parent: None,
            expiry_ms: NOW + 3_600_000,
            nonce: [0; 16],
        }
        .sign(&owner)
        .unwrap();
        let leaf = root
            .delegate(
                &requester,
                &did(&steward),
                budget,
                vec![],
                NOW + 3_600_000,
                [1; 16],
            )
            .unwrap();
        (vec![root, leaf], requester, steward)
    }

    #[test]
    fn decide_then_debit() {
        let (chain, requester, steward) = chain(1_000, vec![]);
        let mut gate = GrantGate::new(&did(&steward));
        let req = request(400, 1);
        let p = Presentation::sign(chain.clone(), &req.request_id(), &requester, [7; 16]).unwrap();
        let auth = gate.decide(&p, &req, None, NOW).unwrap();
        assert_eq!(gate.chain_remaining(&chain), 600, "the ceiling is reserved");
        let debit = gate.debit(&auth, 250);
        assert_eq!(debit.breach, None);
        assert_eq!(gate.chain_remaining(&chain), 750);
        assert_eq!(gate.decide(&p, &req, None, NOW), Err(Refusal::Replayed));
    }

    #[test]
    fn refusals() {
        let (chain, requester, steward) = chain(
            1_000,
            vec![Caveat::ModelIn(vec![[5; 32]]), Caveat::MaxCostUj(300)],
        );
        let req = request(400, 1);
        let id = req.request_id();
        let model = Some(&[5u8; 32]);
        let fresh = || GrantGate::new(&did(&steward));
        let sign = |chain: Vec<SignedGrant>, k: &SigningKey, n: u8| {
            Presentation::sign(chain, &id, k, [n; 16]).unwrap()
        };

        // Not the leaf's issuer.
        assert_eq!(
            fresh().decide(&sign(chain.clone(), &key(9), 1), &req, model, NOW),
            Err(Refusal::CallerNotIssuer)
        );
        // Signed for another request.
        let other = Presentation::sign(
            chain.clone(),
            &request(400, 2).request_id(),
            &requester,
            [1; 16],
        )
        .unwrap();
        assert_eq!(
            fresh().decide(&other, &req, model, NOW),
            Err(Refusal::PresentationSignature)
        );
        // Held by another steward.
        assert_eq!(
            GrantGate::new(&did(&key(8))).decide(
                &sign(chain.clone(), &requester, 1),
                &req,
                model,
                NOW
            ),
            Err(Refusal::HeldByAnotherSteward)
        );
        // Expired, revoked, wrong model, no model.
        assert_eq!(
            fresh().decide(
                &sign(chain.clone(), &requester, 1),
                &req,
                model,
                NOW + 3_600_000
            ),
            Err(Refusal::Expired { link: 0 })
        );
        let mut revoked = fresh();
        revoked.revoke(chain[1].id());
        assert_eq!(
            revoked.decide(&sign(chain.clone(), &requester, 1), &req, model, NOW),
            Err(Refusal::Revoked { link: 1 })
        );
        assert_eq!(
            fresh().decide(
                &sign(chain.clone(), &requester, 1),
                &req,
                Some(&[6; 32]),
                NOW
            ),
            Err(Refusal::ModelNotPermitted { link: 0 })
        );
        assert_eq!(
            fresh().decide(&sign(chain.clone(), &requester, 1), &req, None, NOW),
            Err(Refusal::ModelNotPermitted { link: 0 })
        );
        // Ceiling above what is left.
        let greedy_request = request(1_001, 1);
        let p = Presentation::sign(
            chain.clone(),
            &greedy_request.request_id(),
            &requester,
            [1; 16],
        )
        .unwrap();
        assert_eq!(
            fresh().decide(&p, &greedy_request, model, NOW),
            Err(Refusal::InsufficientBudget {
                remaining_uj: 1_000,
                ceiling_uj: 1_001
            })
        );
        // A forged link: budget raised after signing.
        let mut forged = chain.clone();
        forged[1].grant.budget_uj = 2_000;
        assert_eq!(
            fresh().decide(&sign(forged, &requester, 1), &req, model, NOW),
            Err(Refusal::GrantSignature { link: 1 })
        );
        // A child that exceeds its parent (validly signed by the requester).
        let greedy = Grant {
            budget_uj: 5_000,
            ..chain[1].grant.clone()
        }
        .sign(&requester)
        .unwrap();
        assert!(matches!(
            fresh().decide(
                &sign(vec![chain[0].clone(), greedy], &requester, 1),
                &req,
                model,
                NOW
            ),
            Err(Refusal::BrokenChain { link: 1, .. })
        ));
        // Breach at debit: MaxCostUj is cost-dependent.
        let mut gate = fresh();
        let auth = gate
            .decide(&sign(chain.clone(), &requester, 1), &req, model, NOW)
            .unwrap();
        assert_eq!(gate.debit(&auth, 350).breach, Some("caveat-unsatisfied"));
        assert_eq!(
            gate.spent(&chain[1].id()),
            350,
            "debited even when breached"
        );
    }

    #[test]
    fn actions_caveat() {
        let (chain, requester, steward) = chain(1_000, vec![Caveat::Actions(vec!["embed".into()])]);
        let req = request(1, 1);
        let p = Presentation::sign(chain, &req.request_id(), &requester, [1; 16]).unwrap();
        assert_eq!(
            GrantGate::new(&did(&steward)).decide(&p, &req, None, NOW),
            Err(Refusal::ActionNotPermitted { link: 0 })
        );
    }

    #[test]
    fn sharded_over_three_stewards_cannot_be_overspent() {
        let (owner, requester) = (key(1), key(2));
        let stewards = [key(11), key(12), key(13)];
        let root = Grant {
            issuer: did(&owner),
            subject: did(&requester),
            budget_uj: 9_000,
            caveats: vec![],
            parent: None,
            expiry_ms: NOW + 1,
            nonce: [0; 16],
        }
        .sign(&owner)
        .unwrap();
        let shares: Vec<(String, u64)> = stewards.iter().map(|s| (did(s), 3_000)).collect();
        assert!(
            root.shard(&requester, &[(did(&stewards[0]), 9_001)], NOW + 1, [0; 16])
                .is_err()
        );
        let shards = root.shard(&requester, &shares, NOW + 1, [4; 16]).unwrap();
        let mut total = 0u64;
        for (steward, shard) in stewards.iter().zip(&shards) {
            let mut gate = GrantGate::new(&did(steward));
            let chain = vec![root.clone(), shard.clone()];
            // Another steward's shard is refused here.
            let foreign = vec![
                root.clone(),
                shards[(shards.iter().position(|s| s == shard).unwrap() + 1) % 3].clone(),
            ];
            let req = request(1_000, 0);
            let p = Presentation::sign(foreign, &req.request_id(), &requester, [0; 16]).unwrap();
            assert_eq!(
                gate.decide(&p, &req, None, NOW),
                Err(Refusal::HeldByAnotherSteward)
            );
            let mut n = 0u8;
            loop {
                n += 1;
                let req = request(1_000, n);
                let p = Presentation::sign(chain.clone(), &req.request_id(), &requester, [n; 16])
                    .unwrap();
                match gate.decide(&p, &req, None, NOW) {
                    Ok(auth) => total += gate.debit(&auth, 1_000).debited_uj,
                    Err(refusal) => {
                        assert!(matches!(refusal, Refusal::InsufficientBudget { .. }));
                        break;
                    }
                }
            }
        }
        assert_eq!(
            total, 9_000,
            "every steward was driven to refusal at exactly its share"
        );
    }

    #[test]
    fn every_bit_of_a_signed_grant_is_covered() {
        let (chain, _, _) = chain(
            1_000,
            vec![Caveat::MaxCostUj(5), Caveat::ModelIn(vec![[1; 32]])],
        );
        for grant in &chain {
            let bytes = grant.encode();
            assert!(SignedGrant::decode(&bytes).unwrap().signature_valid());
            for index in 0..bytes.len() {
                for bit in 0..8 {
                    let mut tampered = bytes.clone();
                    tampered[index] ^= 1 << bit;
                    if let Ok(decoded) = SignedGrant::decode(&tampered) {
                        assert!(
                            !decoded.signature_valid(),
                            "byte {index} bit {bit} flipped and the grant still verifies"
                        );
                    }
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn grants_round_trip(
            budget in proptest::prelude::any::<u64>(), expiry in proptest::prelude::any::<u64>(),
            nonce in proptest::prelude::any::<[u8; 16]>(), limit in proptest::option::of(proptest::prelude::any::<u64>()),
            models in proptest::collection::vec(proptest::prelude::any::<[u8; 32]>(), 0..4),
            parent in proptest::option::of(proptest::prelude::any::<[u8; 32]>()),
        ) {
            let mut caveats = vec![Caveat::ModelIn(models), Caveat::Actions(vec![INFER.into()])];
            if let Some(limit) = limit {
                caveats.push(Caveat::MaxCostUj(limit));
            }
            let issuer = key(1);
            let grant = Grant { issuer: did(&issuer), subject: did(&key(2)), budget_uj: budget, caveats, parent, expiry_ms: expiry, nonce }
                .sign(&issuer)
                .unwrap();
            let decoded = SignedGrant::decode(&grant.encode()).unwrap();
            proptest::prop_assert!(decoded.signature_valid());
            proptest::prop_assert_eq!(decoded, grant);
        }

        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let _ = SignedGrant::decode(&bytes);
            let _ = Presentation::decode(&bytes);
        }
    }

    #[test]
    fn wire_round_trip_and_tampering() {
        let (chain, requester, steward) = chain(
            1_000,
            vec![Caveat::MaxCostUj(5), Caveat::ModelIn(vec![[1; 32]])],
        );
        let req = request(10, 1);
        let p = Presentation::sign(chain, &req.request_id(), &requester, [3; 16]).unwrap();
        let bytes = p.encode();
        assert_eq!(Presentation::decode(&bytes), Ok(p.clone()));
        assert!(
            GrantGate::new(&did(&steward))
                .decide(&p, &req, Some(&[1; 32]), NOW)
                .is_ok()
        );
        for index in 0..bytes.len() {
            for bit in [0x01u8, 0x80] {
                let mut tampered = bytes.clone();
                tampered[index] ^= bit;
                if let Ok(decoded) = Presentation::decode(&tampered) {
                    let outcome =
                        GrantGate::new(&did(&steward)).decide(&decoded, &req, Some(&[1; 32]), NOW);
                    assert!(
                        outcome.is_err(),
                        "byte {index} bit {bit:#x} flipped and still accepted"
                    );
                }
            }
        }
    }
}
