//! Cheapest-sufficient routing (seed SPEC 001 §4) and delivered fidelity
//! (§3.2.1). Sans-IO: the caller passes the backends it can serve on, each
//! with the per-token cost its meters measured (or its estimator's, and
//! says which), and gets back every candidate weighed, the choice and the
//! one-line justification the receipt's `route` member carries.
//!
//! A route table travels beside the receipt (the requester's bundle) as
//! JSON, with the inputs (the request's figures and the backends) and what
//! was derived from them (candidates, choice, justification). The
//! justification ends with the BLAKE3 of the inputs, so the signed `route`
//! member binds the unsigned table: [`check_table`] recomputes the route
//! from the inputs and refuses a table that does not give the same answer.

use serde_json::{Value, json};
use thiserror::Error;

use crate::hex;
use crate::json::{Members, ShapeError, canonical_bytes};
use crate::mesh1::{Fidelity, MAX_RECEIPT_TEXT, ServeRequest};

/// The most backends one route weighs.
pub const MAX_ROUTE_BACKENDS: usize = 64;
/// Longest backend or recipe name in a route table.
pub const MAX_BACKEND_NAME: usize = 1024;
/// Most weights a request's `ModelIn` restriction lists in a route table
/// (as many as one grant caveat may).
pub const MAX_ROUTE_MODELS: usize = crate::grant::MAX_MODELS_PER_CAVEAT;

/// The largest integer a route table holds: 2^53 − 1, the largest every
/// RFC 8785 writer (which writes numbers as IEEE doubles) writes exactly.
/// Above it two figures could hash alike in one checker and apart in
/// another. Per-backend costs above it are refused; estimates saturate at
/// it; a ceiling at or above it can never be exceeded, so it is no ceiling
/// and the table leaves `joule_ceiling_uj` out.
pub const MAX_TABLE_INTEGER: u64 = (1 << 53) - 1;

/// A request's `joule_ceiling_uj` when it names none (as in `mesh/1`).
pub const NO_CEILING: u64 = u64::MAX;

/// Where a backend's per-token cost came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CostBasis {
    /// From the energy its meters recorded over earlier serves (whatever
    /// provenance those meters have: see each receipt's own).
    Metered,
    /// Nothing was metered on it yet: the estimator's figure.
    Estimator,
}

impl CostBasis {
    pub fn as_str(self) -> &'static str {
        match self {
            CostBasis::Metered => "metered",
            CostBasis::Estimator => "estimator",
        }
    }
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "metered" => Some(CostBasis::Metered),
            "estimator" => Some(CostBasis::Estimator),
            _ => None,
        }
    }
}

/// A backend as the router weighs it: a recipe on a way of serving it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Backend {
    /// Unique within one route.
    pub name: String,
    pub recipe: String,
    /// The advertised level (configuration).
    pub fidelity: Fidelity,
    pub uj_per_token: u64,
    /// Declared cost per scored option of a typed decision (§3.6, 2.);
    /// 0 declares none, which is the token-only model exactly.
    pub uj_per_option_scored: u64,
    pub cost_basis: CostBasis,
    /// The weights digest it serves (seed 001 §3.6), weighed against a
    /// grant's `ModelIn`; `None` when it declares none (a grant that
    /// restricts models then leaves it out).
    pub weights: Option<[u8; 32]>,
}

/// The figures of a request the router reads (§3.1, §3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RouteRequest {
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub fidelity_floor: Fidelity,
    pub joule_ceiling_uj: u64,
    /// Present for a typed decision: its options scored.
    pub options_scored: Option<u32>,
}

impl From<&ServeRequest> for RouteRequest {
    fn from(request: &ServeRequest) -> Self {
        Self {
            prompt_tokens: request.prompt_tokens,
            max_tokens: request.max_tokens,
            fidelity_floor: request.fidelity_floor,
            joule_ceiling_uj: request.joule_ceiling_uj,
            options_scored: request.decision.map(|d| d.options_scored),
        }
    }
}

/// `est_total_uj` (§4): per token over prompt and output for a generation;
/// for a decision, the prompt and the options scored, never `max_tokens`
/// (§3.6, 1.: it emits no tokens). Saturating at [`MAX_TABLE_INTEGER`]:
/// an estimate there is over every ceiling a table can hold.
pub fn estimate_uj(backend: &Backend, request: &RouteRequest) -> u64 {
    let estimate = match request.options_scored {
        None => backend
            .uj_per_token
            .saturating_mul(u64::from(request.prompt_tokens) + u64::from(request.max_tokens)),
        Some(options) => backend
            .uj_per_token
            .saturating_mul(request.prompt_tokens.into())
            .saturating_add(backend.uj_per_option_scored.saturating_mul(options.into())),
    };
    estimate.min(MAX_TABLE_INTEGER)
}

impl RouteRequest {
    /// The ceiling as the table holds it: `None` when there is none, or
    /// when it is so high (at or above [`MAX_TABLE_INTEGER`]) that no
    /// estimate can pass it, which is the same route.
    pub fn ceiling(&self) -> Option<u64> {
        (self.joule_ceiling_uj < MAX_TABLE_INTEGER).then_some(self.joule_ceiling_uj)
    }
}

/// One backend weighed (§4's `RouteCandidate`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteCandidate {
    pub backend: String,
    pub recipe: String,
    pub fidelity: Fidelity,
    pub est_total_uj: u64,
    pub cost_basis: CostBasis,
    pub below_floor: bool,
    pub over_ceiling: bool,
    /// Its weights are not among those the request's grant permits
    /// (`ModelIn`).
    pub model_not_permitted: bool,
}

impl RouteCandidate {
    pub fn admissible(&self) -> bool {
        !self.below_floor && !self.over_ceiling && !self.model_not_permitted
    }

    /// Why it is inadmissible, for a human; `None` when admissible.
    pub fn reason(&self, request: &RouteRequest) -> Option<String> {
        let below = self.below_floor.then(|| {
            format!(
                "below floor (F{} < F{})",
                self.fidelity.level(),
                request.fidelity_floor.level()
            )
        });
        let over = self.over_ceiling.then(|| {
            format!(
                "over ceiling ({} uJ > {} uJ)",
                self.est_total_uj, request.joule_ceiling_uj
            )
        });
        let model = self
            .model_not_permitted
            .then(|| "weights not in the grant's ModelIn".to_string());
        let reasons: Vec<String> = [below, over, model].into_iter().flatten().collect();
        (!reasons.is_empty()).then(|| reasons.join(" and "))
    }
}

/// A route: every candidate in registration order, and the choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub request: RouteRequest,
    /// The weights the request's grant permits (every `ModelIn` of its
    /// chains at once); `None`: no restriction.
    pub model_in: Option<Vec<[u8; 32]>>,
    pub backends: Vec<Backend>,
    pub candidates: Vec<RouteCandidate>,
    /// Index of the chosen backend; `None` when none is admissible.
    pub chosen: Option<usize>,
}

/// Why there is no route table at all (as opposed to a refusal, which is
/// a route with nothing chosen).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RouteError {
    #[error("no backend to route over")]
    NoBackends,
    #[error("{0} backends, more than {MAX_ROUTE_BACKENDS}")]
    TooMany(usize),
    #[error("two backends are named `{0}`")]
    DuplicateName(String),
    #[error("a backend or recipe name is empty or longer than {MAX_BACKEND_NAME} bytes")]
    Name,
    #[error("a ModelIn of {0} weights, more than {MAX_ROUTE_MODELS}")]
    TooManyModels(usize),
    #[error(
        "backend `{backend}`: {member} {value} is above {MAX_TABLE_INTEGER}, which RFC 8785 cannot write exactly"
    )]
    Inexact {
        backend: String,
        member: &'static str,
        value: u64,
    },
}

/// Weigh every backend and choose the admissible one with the lowest
/// estimate, ties going to the one registered first (§4).
pub fn route(request: &RouteRequest, backends: &[Backend]) -> Result<Route, RouteError> {
    route_within(request, None, backends)
}

/// [`route`] for a request whose grant permits only the weights
/// `model_in` (`None`: any): a backend serving other weights, or naming
/// none, is inadmissible, with the rule as its reason, so a request its
/// grant would refuse is refused here, before anything is held.
pub fn route_within(
    request: &RouteRequest,
    model_in: Option<&[[u8; 32]]>,
    backends: &[Backend],
) -> Result<Route, RouteError> {
    if let Some(models) = model_in.filter(|m| m.len() > MAX_ROUTE_MODELS) {
        return Err(RouteError::TooManyModels(models.len()));
    }
    if backends.is_empty() {
        return Err(RouteError::NoBackends);
    }
    if backends.len() > MAX_ROUTE_BACKENDS {
        return Err(RouteError::TooMany(backends.len()));
    }
    for (i, backend) in backends.iter().enumerate() {
        for name in [&backend.name, &backend.recipe] {
            if name.is_empty() || name.len() > MAX_BACKEND_NAME {
                return Err(RouteError::Name);
            }
        }
        if backends[..i].iter().any(|b| b.name == backend.name) {
            return Err(RouteError::DuplicateName(backend.name.clone()));
        }
        for (member, value) in [
            ("uj_per_token", backend.uj_per_token),
            ("uj_per_option_scored", backend.uj_per_option_scored),
        ] {
            if value > MAX_TABLE_INTEGER {
                return Err(RouteError::Inexact {
                    backend: backend.name.clone(),
                    member,
                    value,
                });
            }
        }
    }
    let request = RouteRequest {
        joule_ceiling_uj: request.ceiling().unwrap_or(NO_CEILING),
        ..*request
    };
    let candidates: Vec<RouteCandidate> = backends
        .iter()
        .map(|backend| {
            let est_total_uj = estimate_uj(backend, &request);
            RouteCandidate {
                backend: backend.name.clone(),
                recipe: backend.recipe.clone(),
                fidelity: backend.fidelity,
                est_total_uj,
                cost_basis: backend.cost_basis,
                below_floor: backend.fidelity < request.fidelity_floor,
                over_ceiling: request
                    .ceiling()
                    .is_some_and(|ceiling| est_total_uj > ceiling),
                model_not_permitted: model_in.is_some_and(|permitted| {
                    !backend.weights.is_some_and(|w| permitted.contains(&w))
                }),
            }
        })
        .collect();
    // `min_by_key` keeps the first of equal keys: registration order.
    let chosen = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.admissible())
        .min_by_key(|(_, c)| c.est_total_uj)
        .map(|(i, _)| i);
    Ok(Route {
        request,
        model_in: model_in.map(<[_]>::to_vec),
        backends: backends.to_vec(),
        candidates,
        chosen,
    })
}

impl Route {
    pub fn chosen(&self) -> Option<&RouteCandidate> {
        self.chosen.and_then(|i| self.candidates.get(i))
    }

    /// BLAKE3 over the RFC 8785 bytes of the route's inputs.
    pub fn inputs_digest(&self) -> [u8; 32] {
        blake3::hash(&canonical_bytes(&self.inputs_json())).into()
    }

    /// The one line the receipt's `route` member carries: the choice (or
    /// the refusal), the bounds it was weighed against, and the digest of
    /// the inputs that bind the full table to the signed receipt.
    pub fn justification(&self) -> String {
        let bounds = format!(
            "floor F{}, ceiling {}",
            self.request.fidelity_floor.level(),
            ceiling_text(self.request.ceiling())
        );
        let weighed = self.candidates.len();
        let inadmissible = weighed - self.candidates.iter().filter(|c| c.admissible()).count();
        let table = hex::encode(&self.inputs_digest());
        let line = match self.chosen() {
            Some(chosen) => format!(
                "{} ({}) at F{}: {} uJ estimated ({}), the cheapest admissible of {weighed} weighed \
                 ({inadmissible} inadmissible) against {bounds}; table {table}",
                chosen.backend,
                chosen.recipe,
                chosen.fidelity.level(),
                chosen.est_total_uj,
                chosen.cost_basis.as_str(),
            ),
            None => format!(
                "refused: none of {weighed} backends admissible against {bounds}; table {table}"
            ),
        };
        // Names are bounded, so the line is too; the guard keeps the
        // receipt's own text limit whatever those bounds become.
        truncate_at_char(line, MAX_RECEIPT_TEXT)
    }

    /// Why nothing was chosen, naming each backend's reason: whole
    /// reasons only, as many as fit the receipt text limit, then how many
    /// more there were.
    pub fn refusal(&self) -> Option<String> {
        if self.chosen.is_some() {
            return None;
        }
        let mut line = format!(
            "no backend can serve this request within its bounds (floor F{}, ceiling {}):",
            self.request.fidelity_floor.level(),
            ceiling_text(self.request.ceiling()),
        );
        // Room kept for the "+k more" tail.
        let room = MAX_RECEIPT_TEXT - 32;
        for (i, c) in self.candidates.iter().enumerate() {
            let reason = format!(
                "{} {}: {}",
                if i == 0 { "" } else { ";" },
                c.backend,
                c.reason(&self.request).unwrap_or_default()
            );
            if line.len() + reason.len() > room {
                line.push_str(&format!("; +{} more", self.candidates.len() - i));
                break;
            }
            line.push_str(&reason);
        }
        Some(line)
    }

    fn inputs_json(&self) -> Value {
        let mut request = json!({
            "prompt_tokens": self.request.prompt_tokens,
            "max_tokens": self.request.max_tokens,
            "fidelity_floor": self.request.fidelity_floor.level(),
        });
        if let Value::Object(map) = &mut request {
            // No ceiling is no member: never a number past what JCS writes.
            if let Some(ceiling) = self.request.ceiling() {
                map.insert("joule_ceiling_uj".into(), json!(ceiling));
            }
            if let Some(options) = self.request.options_scored {
                map.insert("options_scored".into(), json!(options));
            }
            if let Some(models) = &self.model_in {
                map.insert(
                    "model_in".into(),
                    models.iter().map(|m| json!(hex::encode(m))).collect(),
                );
            }
        }
        json!({
            "request": request,
            "backends": self.backends.iter().map(|b| {
                let mut backend = json!({
                    "name": b.name,
                    "recipe": b.recipe,
                    "fidelity": b.fidelity.level(),
                    "uj_per_token": b.uj_per_token,
                    "uj_per_option_scored": b.uj_per_option_scored,
                    "cost_basis": b.cost_basis.as_str(),
                });
                if let (Some(weights), Value::Object(map)) = (b.weights, &mut backend) {
                    map.insert("weights".into(), json!(hex::encode(&weights)));
                }
                backend
            }).collect::<Vec<_>>(),
        })
    }

    /// The route table as it travels in a bundle: the inputs, every
    /// candidate (with its reason when inadmissible), the choice and the
    /// justification.
    pub fn to_json(&self) -> Value {
        let mut table = self.inputs_json();
        if let Value::Object(map) = &mut table {
            map.insert(
                "candidates".into(),
                Value::Array(
                    self.candidates
                        .iter()
                        .map(|c| {
                            let mut v = json!({
                                "backend": c.backend,
                                "fidelity": c.fidelity.level(),
                                "est_total_uj": c.est_total_uj,
                                "cost_basis": c.cost_basis.as_str(),
                                "admissible": c.admissible(),
                            });
                            if let (Some(reason), Value::Object(m)) =
                                (c.reason(&self.request), &mut v)
                            {
                                m.insert("reason".into(), json!(reason));
                            }
                            v
                        })
                        .collect(),
                ),
            );
            map.insert(
                "chosen".into(),
                self.chosen().map_or(Value::Null, |c| json!(c.backend)),
            );
            map.insert("justification".into(), json!(self.justification()));
        }
        table
    }

    /// Read a route table's inputs and recompute the route from them.
    /// The derived members must be exactly what the inputs give.
    pub fn from_json(value: &Value) -> Result<Self, TableError> {
        let mut m = Members::of(value, "")?;
        let request = {
            let path = m.path("request");
            let mut r = Members::of(m.required("request")?, &path)?;
            let floor_path = r.path("fidelity_floor");
            let ceiling_path = r.path("joule_ceiling_uj");
            let request = RouteRequest {
                prompt_tokens: r.u32("prompt_tokens")?,
                max_tokens: r.u32("max_tokens")?,
                fidelity_floor: Fidelity::from_level(r.u64("fidelity_floor")?)
                    .ok_or_else(|| ShapeError::invalid(floor_path, "a level 0..=4"))?,
                joule_ceiling_uj: match r.optional("joule_ceiling_uj") {
                    None => NO_CEILING,
                    Some(_) => match r.u64("joule_ceiling_uj")? {
                        ceiling if ceiling < MAX_TABLE_INTEGER => ceiling,
                        _ => {
                            return Err(ShapeError::invalid(
                                ceiling_path,
                                "below 2^53 - 1 (no ceiling is no member)",
                            )
                            .into());
                        }
                    },
                },
                options_scored: match r.optional("options_scored") {
                    None => None,
                    Some(_) => Some(r.u32("options_scored")?),
                },
            };
            let models_path = r.path("model_in");
            let model_in = match r.optional("model_in") {
                None => None,
                Some(Value::Array(items)) if items.len() <= MAX_ROUTE_MODELS => Some(
                    items
                        .iter()
                        .map(|item| {
                            item.as_str()
                                .and_then(hex::decode_array::<32>)
                                .ok_or_else(|| {
                                    ShapeError::invalid(
                                        models_path.clone(),
                                        "32-byte lowercase hex ids",
                                    )
                                })
                        })
                        .collect::<Result<Vec<_>, ShapeError>>()?,
                ),
                Some(_) => {
                    return Err(ShapeError::invalid(
                        models_path,
                        format!("an array of at most {MAX_ROUTE_MODELS} weights ids"),
                    )
                    .into());
                }
            };
            r.finish()?;
            (request, model_in)
        };
        let (request, model_in) = request;
        let backends_path = m.path("backends");
        let items = m.array("backends")?;
        if items.len() > MAX_ROUTE_BACKENDS {
            return Err(RouteError::TooMany(items.len()).into());
        }
        let mut backends = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let mut b = Members::of(item, &format!("{backends_path}/{i}"))?;
            let fidelity_path = b.path("fidelity");
            let basis_path = b.path("cost_basis");
            let weights_path = b.path("weights");
            backends.push(Backend {
                name: b.non_empty_string("name")?.to_string(),
                recipe: b.non_empty_string("recipe")?.to_string(),
                fidelity: Fidelity::from_level(b.u64("fidelity")?)
                    .ok_or_else(|| ShapeError::invalid(fidelity_path, "a level 0..=4"))?,
                uj_per_token: b.u64("uj_per_token")?,
                uj_per_option_scored: b.u64("uj_per_option_scored")?,
                cost_basis: CostBasis::parse(b.string("cost_basis")?)
                    .ok_or_else(|| ShapeError::invalid(basis_path, "`metered` or `estimator`"))?,
                weights: match b.optional("weights") {
                    None => None,
                    Some(_) => Some(hex::decode_array::<32>(b.string("weights")?).ok_or_else(
                        || ShapeError::invalid(weights_path, "32-byte lowercase hex"),
                    )?),
                },
            });
            b.finish()?;
        }
        let route = route_within(&request, model_in.as_deref(), &backends)?;
        // The derived members, exactly as the inputs give them.
        let derived = route.to_json();
        for key in ["candidates", "chosen", "justification"] {
            if m.optional(key) != derived.get(key).filter(|v| !v.is_null()) {
                return Err(TableError::Derived(key));
            }
        }
        m.finish()?;
        Ok(route)
    }
}

/// Why a route table is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TableError {
    #[error("route table: {0}")]
    Shape(#[from] ShapeError),
    #[error("route table: {0}")]
    Route(#[from] RouteError),
    #[error("route table: `{0}` is not what its request and backends give")]
    Derived(&'static str),
    #[error("route table: the receipt's route is not this table's justification")]
    NotTheReceipts,
    #[error("route table: the receipt's {0} is not the table's")]
    Receipt(&'static str),
}

/// Check a route table against the receipt it travels with: the table
/// recomputes (the choice is the cheapest admissible), its justification
/// is the receipt's signed `route`, and the receipt's floor, recipe and
/// advertised fidelity are the table's.
pub fn check_table(
    table: &Value,
    receipt: &crate::mesh1::MeshReceipt,
) -> Result<Route, TableError> {
    let route = Route::from_json(table)?;
    if route.justification() != receipt.route {
        return Err(TableError::NotTheReceipts);
    }
    if route.request.fidelity_floor != receipt.fidelity_floor {
        return Err(TableError::Receipt("fidelity_floor"));
    }
    // A decision is priced on its options, a generation on its tokens: the
    // table must have priced the kind of serve the receipt is.
    if route.request.options_scored != receipt.decision.map(|d| d.options_scored) {
        return Err(TableError::Receipt("options_scored"));
    }
    let chosen = route.chosen().ok_or(TableError::Receipt(
        "route (a sealed serve under a refusal)",
    ))?;
    if chosen.recipe != receipt.recipe {
        return Err(TableError::Receipt("recipe"));
    }
    if receipt
        .fidelity
        .is_some_and(|f| f.advertised != chosen.fidelity)
    {
        return Err(TableError::Receipt("fidelity_advertised"));
    }
    Ok(route)
}

/// The level a serve delivered (§3.2.1): the advertised one when it ran to
/// its end (an end of text, a stop sequence, or every token the request
/// asked for), F0 when it was cut short (out of context, timed out,
/// cancelled or failed), since a truncated answer is not the answer the
/// rating describes. Never above the advertisement.
pub fn delivered(advertised: Fidelity, ran_to_its_end: bool) -> Fidelity {
    if ran_to_its_end {
        advertised
    } else {
        Fidelity::F0
    }
}

fn ceiling_text(ceiling: Option<u64>) -> String {
    match ceiling {
        None => "none".into(),
        Some(ceiling) => format!("{ceiling} uJ"),
    }
}

fn truncate_at_char(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn backend(name: &str, fidelity: Fidelity, uj_per_token: u64) -> Backend {
        Backend {
            name: name.into(),
            recipe: format!("{name}-recipe"),
            fidelity,
            uj_per_token,
            uj_per_option_scored: 0,
            cost_basis: CostBasis::Metered,
            weights: None,
        }
    }

    fn request(floor: Fidelity, ceiling: u64) -> RouteRequest {
        RouteRequest {
            prompt_tokens: 10,
            max_tokens: 90,
            fidelity_floor: floor,
            joule_ceiling_uj: ceiling,
            options_scored: None,
        }
    }

    /// The SPEC's table: the cheapest is below the floor, the next over
    /// the ceiling, the third is chosen over a dearer fourth.
    fn four() -> Vec<Backend> {
        vec![
            backend("tiny", Fidelity::F0, 10),
            backend("frontier", Fidelity::F4, 1000),
            backend("mid", Fidelity::F2, 40),
            backend("mid-dear", Fidelity::F3, 60),
        ]
    }

    #[test]
    fn the_cheapest_admissible_is_chosen_and_every_candidate_is_recorded() {
        let route = route(&request(Fidelity::F2, 50_000), &four()).unwrap();
        let chosen = route.chosen().unwrap();
        assert_eq!(chosen.backend, "mid");
        assert_eq!(chosen.est_total_uj, 4000);
        assert_eq!(route.candidates.len(), 4);
        let reasons: Vec<Option<String>> = route
            .candidates
            .iter()
            .map(|c| c.reason(&route.request))
            .collect();
        assert_eq!(reasons[0].as_deref(), Some("below floor (F0 < F2)"));
        assert_eq!(
            reasons[1].as_deref(),
            Some("over ceiling (100000 uJ > 50000 uJ)")
        );
        assert_eq!(reasons[2], None);
        assert_eq!(reasons[3], None);
        assert!(route.justification().starts_with(
            "mid (mid-recipe) at F2: 4000 uJ estimated (metered), the cheapest admissible of 4 weighed (2 inadmissible)"
        ));
    }

    #[test]
    fn ties_go_to_the_backend_registered_first() {
        let backends = vec![
            backend("b", Fidelity::F2, 40),
            backend("a", Fidelity::F2, 40),
        ];
        let route = route(&request(Fidelity::F0, u64::MAX), &backends).unwrap();
        assert_eq!(route.chosen().unwrap().backend, "b");
    }

    #[test]
    fn nothing_admissible_is_a_refusal_naming_each_reason() {
        let route = route(&request(Fidelity::F4, 1000), &four()).unwrap();
        assert_eq!(route.chosen, None);
        let refusal = route.refusal().unwrap();
        assert!(refusal.contains("tiny: below floor (F0 < F4)"), "{refusal}");
        assert!(
            refusal.contains("frontier: over ceiling (100000 uJ > 1000 uJ)"),
            "{refusal}"
        );
        assert!(
            refusal.contains("mid: below floor (F2 < F4) and over ceiling"),
            "{refusal}"
        );
        // Many long names: whole reasons only, and how many more.
        let many: Vec<Backend> = (0..MAX_ROUTE_BACKENDS)
            .map(|i| backend(&format!("{i:0>1000}"), Fidelity::F0, 1))
            .collect();
        let refusal = super::route(&request(Fidelity::F4, 1000), &many)
            .unwrap()
            .refusal()
            .unwrap();
        assert!(refusal.len() <= MAX_RECEIPT_TEXT, "{}", refusal.len());
        assert!(refusal.ends_with("more"), "{refusal}");
        assert!(refusal.contains("below floor (F0 < F4); +"), "{refusal}");
        assert!(route.justification().starts_with("refused: none of 4"));
    }

    #[test]
    fn a_decision_is_priced_per_option_never_for_max_tokens() {
        let mut b = backend("decider", Fidelity::F1, 5);
        b.uj_per_option_scored = 100;
        let mut r = request(Fidelity::F0, 1000);
        r.max_tokens = 1_000_000;
        r.options_scored = Some(3);
        assert_eq!(estimate_uj(&b, &r), 5 * 10 + 100 * 3);
        assert!(route(&r, &[b.clone()]).unwrap().chosen.is_some());
        // The same figures as a generation would price the max_tokens.
        r.options_scored = None;
        assert_eq!(estimate_uj(&b, &r), 5 * 1_000_010);
    }

    #[test]
    fn a_table_recomputes_and_binds_to_its_justification() {
        let route = route(&request(Fidelity::F2, 50_000), &four()).unwrap();
        let table = route.to_json();
        assert_eq!(Route::from_json(&table).unwrap(), route);
        // A derived member changed is refused.
        let mut changed = table.clone();
        changed["candidates"][2]["est_total_uj"] = json!(1);
        assert_eq!(
            Route::from_json(&changed),
            Err(TableError::Derived("candidates"))
        );
        let mut changed = table.clone();
        changed["chosen"] = json!("mid-dear");
        assert_eq!(
            Route::from_json(&changed),
            Err(TableError::Derived("chosen"))
        );
        // An input changed recomputes another justification (its digest).
        let mut changed = table.clone();
        changed["backends"][3]["uj_per_token"] = json!(61);
        changed["candidates"][3]["est_total_uj"] = json!(6100);
        assert_eq!(
            Route::from_json(&changed),
            Err(TableError::Derived("justification"))
        );
        let mut changed = table;
        changed["extra"] = json!(1);
        assert!(matches!(
            Route::from_json(&changed),
            Err(TableError::Shape(_))
        ));
    }

    #[test]
    fn a_grant_model_restriction_leaves_out_other_weights_naming_the_rule() {
        let mut backends = four();
        backends[2].weights = Some([1; 32]);
        backends[3].weights = Some([2; 32]);
        let restricted =
            route_within(&request(Fidelity::F2, 50_000), Some(&[[2; 32]]), &backends).unwrap();
        assert_eq!(restricted.chosen().unwrap().backend, "mid-dear");
        assert_eq!(
            restricted.candidates[2]
                .reason(&restricted.request)
                .as_deref(),
            Some("weights not in the grant's ModelIn")
        );
        // A backend naming no weights is left out too.
        assert!(restricted.candidates[0].model_not_permitted);
        assert_eq!(Route::from_json(&restricted.to_json()).unwrap(), restricted);
        let refused =
            route_within(&request(Fidelity::F2, 50_000), Some(&[[9; 32]]), &backends).unwrap();
        assert!(
            refused
                .refusal()
                .unwrap()
                .contains("mid: weights not in the grant's ModelIn")
        );
        // Without a restriction, weights change nothing.
        assert_eq!(
            route(&request(Fidelity::F2, 50_000), &backends)
                .unwrap()
                .chosen()
                .unwrap()
                .backend,
            "mid"
        );
    }

    /// RFC 8785 writes numbers as doubles: a table never holds an integer
    /// past 2^53 - 1, so no two ceilings (or costs) hash alike in one
    /// checker and apart in another.
    #[test]
    fn no_ceiling_is_no_member_and_no_figure_passes_what_jcs_writes_exactly() {
        let none = route(&request(Fidelity::F0, NO_CEILING), &four()).unwrap();
        assert!(none.to_json()["request"].get("joule_ceiling_uj").is_none());
        assert!(none.justification().contains("ceiling none;"));
        // A ceiling no estimate can pass is the same route, hashed alike.
        for unreachable in [MAX_TABLE_INTEGER, 1 << 53, (1 << 60) + 1, u64::MAX - 1] {
            let high = route(&request(Fidelity::F0, unreachable), &four()).unwrap();
            assert_eq!(high, none, "{unreachable}");
            assert_eq!(high.inputs_digest(), none.inputs_digest());
        }
        let highest = route(&request(Fidelity::F0, MAX_TABLE_INTEGER - 1), &four()).unwrap();
        assert_eq!(
            highest.to_json()["request"]["joule_ceiling_uj"],
            json!(MAX_TABLE_INTEGER - 1)
        );
        assert_eq!(Route::from_json(&highest.to_json()).unwrap(), highest);
        // A table that writes a ceiling past it is refused, not read as one.
        let mut table = none.to_json();
        table["request"]["joule_ceiling_uj"] = json!(u64::MAX);
        assert!(matches!(
            Route::from_json(&table),
            Err(TableError::Shape(_))
        ));
        // Costs past it are refused; estimates saturate at it.
        let mut dear = four();
        dear[1].uj_per_token = MAX_TABLE_INTEGER + 1;
        assert!(matches!(
            route(&request(Fidelity::F0, NO_CEILING), &dear),
            Err(RouteError::Inexact {
                member: "uj_per_token",
                ..
            })
        ));
        dear[1].uj_per_token = MAX_TABLE_INTEGER;
        let saturated = route(&request(Fidelity::F0, 1000), &dear).unwrap();
        assert_eq!(saturated.candidates[1].est_total_uj, MAX_TABLE_INTEGER);
        assert!(saturated.candidates[1].over_ceiling);
    }

    /// The repository's vectors (`vectors/mesh1/routes.json`, `mesh-node
    /// vectors write`): every table recomputes to its named choice, and
    /// every derived table is refused as the member it names.
    #[test]
    fn the_route_vectors_hold() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../vectors/mesh1/routes.json");
        let document: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let routes = document["routes"].as_array().unwrap();
        assert!(routes.len() >= 6);
        for case in routes {
            let route = Route::from_json(&case["table"]).unwrap();
            assert_eq!(
                route.chosen().map(|c| c.backend.as_str()),
                case["chosen"].as_str(),
                "{}",
                case["name"]
            );
        }
        let four = &routes[0]["table"]["candidates"];
        assert_eq!(four.as_array().unwrap().len(), 4);
        assert_eq!(four[0]["admissible"], false);
        assert_eq!(four[1]["admissible"], false);
        for refusal in document["refusals"].as_array().unwrap() {
            let kind = match Route::from_json(&refusal["table"]) {
                Ok(_) => "accepted",
                Err(TableError::Derived(member)) => member,
                Err(TableError::Shape(_)) => "shape",
                Err(TableError::Route(_)) => "route",
                Err(_) => "other",
            };
            assert_eq!(refusal["refused_as"], kind, "{}", refusal["name"]);
        }
    }

    #[test]
    fn a_table_is_checked_against_the_receipt_it_travels_with() {
        use crate::mesh1::{Energy, FidelityReport, MeshReceipt};
        let route = route(&request(Fidelity::F2, 50_000), &four()).unwrap();
        let table = route.to_json();
        let mut receipt = MeshReceipt::blank(
            [7; 32],
            "mesh-node/split",
            "mid-recipe",
            &route.justification(),
            Energy::estimator(10),
            [0; 16],
        );
        receipt.fidelity_floor = Fidelity::F2;
        receipt.fidelity = Some(FidelityReport {
            advertised: Fidelity::F2,
            delivered: Fidelity::F2,
        });
        assert_eq!(check_table(&table, &receipt), Ok(route.clone()));
        let mut other = receipt.clone();
        other.route = format!("{}.", other.route);
        assert_eq!(check_table(&table, &other), Err(TableError::NotTheReceipts));
        let mut other = receipt.clone();
        other.fidelity_floor = Fidelity::F1;
        assert_eq!(
            check_table(&table, &other),
            Err(TableError::Receipt("fidelity_floor"))
        );
        let mut other = receipt.clone();
        other.recipe = "another".into();
        assert_eq!(
            check_table(&table, &other),
            Err(TableError::Receipt("recipe"))
        );
        let mut other = receipt;
        other.fidelity = Some(FidelityReport {
            advertised: Fidelity::F3,
            delivered: Fidelity::F2,
        });
        assert_eq!(
            check_table(&table, &other),
            Err(TableError::Receipt("fidelity_advertised"))
        );
    }

    #[test]
    fn delivered_is_never_above_the_advertisement() {
        for level in Fidelity::ALL {
            assert_eq!(delivered(level, true), level);
            assert_eq!(delivered(level, false), Fidelity::F0);
        }
    }

    proptest! {
        #[test]
        fn the_choice_is_admissible_and_no_admissible_one_is_cheaper(
            costs in proptest::collection::vec((0u8..5, 0u64..1000), 1..12),
            floor in 0u64..5,
            ceiling in 0u64..100_000,
        ) {
            let backends: Vec<Backend> = costs
                .iter()
                .enumerate()
                .map(|(i, (level, cost))| backend(
                    &format!("b{i}"),
                    Fidelity::from_level((*level).into()).unwrap(),
                    *cost,
                ))
                .collect();
            let r = request(Fidelity::from_level(floor).unwrap(), ceiling);
            let route = route(&r, &backends).unwrap();
            match route.chosen {
                Some(i) => {
                    let chosen = &route.candidates[i];
                    prop_assert!(chosen.admissible());
                    for (j, c) in route.candidates.iter().enumerate() {
                        if c.admissible() {
                            prop_assert!(c.est_total_uj > chosen.est_total_uj
                                || (c.est_total_uj == chosen.est_total_uj && j >= i));
                        }
                    }
                }
                None => prop_assert!(route.candidates.iter().all(|c| !c.admissible())),
            }
            prop_assert_eq!(Route::from_json(&route.to_json()).unwrap(), route);
        }

        #[test]
        fn a_table_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(value) = crate::json::parse_strict(&bytes) {
                let _ = Route::from_json(&value);
            }
        }
    }
}
