//! Requests on `mesh-control/1`, typed: one strict decoder for everything a
//! node is asked, so a member nobody reads, a wrong type or an unknown kind
//! is refused in one place (`docs/wire.md` lists the members). The node
//! turns these into its own types (addresses, keys, sampling settings).

use thiserror::Error;

use crate::cbor::{Cbor, CborError, FieldError, Fields};
use crate::grant::Presentation;
use crate::mesh1::{Fidelity, ServeRequest};

/// Longest text member other than a prompt (ids, addresses, run ids).
pub const MAX_CONTROL_TEXT: usize = 512;
/// Most stop sequences a generation names (as OpenAI's API allows).
pub const MAX_STOP_SEQUENCES: usize = 4;
/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 64;
/// Most options of one typed decision (SPEC §3.6: a choice over 1 to 255).
pub const MAX_DECISION_OPTIONS: usize = 255;
/// Longest option of a typed decision, bytes.
pub const MAX_OPTION_BYTES: usize = 256;
/// Longest question of a typed decision, bytes.
pub const MAX_QUESTION_BYTES: usize = 4096;

/// A typed decision asked instead of a generation (SPEC §3.6): a choice
/// of one of `options` in answer to `question`, about the state the
/// prompt holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionAsk {
    pub question: String,
    pub options: Vec<String>,
}

impl DecisionAsk {
    pub fn to_cbor(&self) -> Cbor {
        Cbor::text_map([
            ("question", Cbor::text(&self.question)),
            (
                "options",
                Cbor::Array(self.options.iter().map(Cbor::text).collect()),
            ),
        ])
    }

    /// Strict: 1 to 255 distinct, non-empty options of at most 256 bytes, a
    /// non-empty question of at most 4096 bytes, no other member.
    pub fn from_cbor(value: &Cbor) -> Result<Self, FieldError> {
        let question = value
            .get("question")
            .and_then(Cbor::as_text)
            .filter(|q| !q.is_empty() && q.len() <= MAX_QUESTION_BYTES)
            .ok_or(FieldError::Invalid("decision.question"))?
            .to_string();
        let options = value
            .get("options")
            .and_then(Cbor::as_array)
            .filter(|list| !list.is_empty() && list.len() <= MAX_DECISION_OPTIONS)
            .ok_or(FieldError::Invalid("decision.options"))?
            .iter()
            .map(|o| {
                o.as_text()
                    .filter(|t| !t.is_empty() && t.len() <= MAX_OPTION_BYTES)
                    .map(str::to_string)
                    .ok_or(FieldError::Invalid("decision.options"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if options
            .iter()
            .enumerate()
            .any(|(i, o)| options[..i].contains(o))
        {
            return Err(FieldError::Invalid("decision.options"));
        }
        match value {
            Cbor::Map(members) if members.len() == 2 => Ok(Self { question, options }),
            _ => Err(FieldError::Invalid("decision")),
        }
    }
}

/// Why a control request is refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ControlError {
    #[error("CBOR: {0}")]
    Cbor(#[from] CborError),
    #[error("{kind}: {error}")]
    Field {
        kind: &'static str,
        error: FieldError,
    },
    #[error("{kind}: `{member}`: {why}")]
    Member {
        kind: &'static str,
        member: &'static str,
        why: String,
    },
    #[error("unknown control message `{0}`")]
    UnknownKind(String),
}

/// A stage's assignment: its slice of a run, and its neighbours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssignRequest {
    pub run_id: String,
    pub package_id: [u8; 32],
    /// The package manifest's SHA-256 (`package`): package-wide, the same
    /// for every stage; a stage whose own package has another refuses.
    pub manifest_sha256: [u8; 32],
    pub layer_start: u32,
    pub layer_end: u32,
    pub stage_index: u32,
    pub stage_count: u32,
    /// did:key of the coordinator.
    pub coordinator: String,
    /// HOST:PORT the stage pushes its records to.
    pub coordinator_addr: String,
    pub topology_hash: String,
    /// did:key of the only node that may open requests on this stage.
    pub upstream: String,
    /// `did@host:port` of the next stage, when there is one.
    pub downstream: Option<String>,
}

/// A request to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequestMessage {
    pub prompt: String,
    pub max_tokens: u64,
    pub chat: bool,
    pub temperature_milli: u64,
    pub top_k: u64,
    pub top_p_milli: u64,
    pub seed: u64,
    pub timeout_ms: Option<u64>,
    /// Texts that end the generation where they first appear (the text
    /// returned stops before them); at most `MAX_STOP_SEQUENCES`, each 1 to
    /// `MAX_STOP_BYTES` bytes. Absent on the wire when empty.
    pub stop: Vec<String>,
    /// On grants: the request as the requester derived it, and one
    /// presentation per stage (empty where none).
    pub grant: Option<(ServeRequest, Vec<Vec<u8>>)>,
    /// The request's bounds (SPEC §3.1) when it rides on no grant (a
    /// grant's `serve_request` carries its own): the least fidelity it
    /// accepts and the most microjoules it may cost. Absent: F0, no
    /// ceiling.
    pub fidelity_floor: Option<Fidelity>,
    pub joule_ceiling_uj: Option<u64>,
    /// A typed decision instead of a generation (the `decide` request):
    /// the prompt is the state it is about.
    pub decision: Option<DecisionAsk>,
}

/// A coordinator asks a stage's steward to decide its grant shard.
#[derive(Debug, Clone, PartialEq)]
pub struct AuthoriseRequest {
    pub run_id: String,
    pub request_id: u64,
    pub serve_request: ServeRequest,
    pub presentation: Presentation,
}

/// Everything a node is asked on `mesh-control/1`.
#[derive(Debug, Clone, PartialEq)]
pub enum ControlRequest {
    Assign(AssignRequest),
    Generate(GenerateRequestMessage),
    Plan,
    Authorise(Box<AuthoriseRequest>),
    Release {
        request_id: u64,
    },
    /// The coordinator no longer uses the run: free its slice.
    Unassign {
        run_id: String,
    },
    Stats {
        request_id: u64,
    },
    NodeStats,
}

impl ControlRequest {
    pub fn kind(&self) -> &'static str {
        match self {
            ControlRequest::Assign(_) => "assign",
            ControlRequest::Generate(_) => "generate",
            ControlRequest::Plan => "plan",
            ControlRequest::Authorise(_) => "authorise",
            ControlRequest::Release { .. } => "release",
            ControlRequest::Unassign { .. } => "unassign",
            ControlRequest::Stats { .. } => "stats",
            ControlRequest::NodeStats => "node_stats",
        }
    }

    pub fn to_cbor(&self) -> Cbor {
        let mut members = vec![("kind", Cbor::text(self.kind()))];
        match self {
            ControlRequest::Assign(a) => {
                members.extend([
                    ("run_id", Cbor::text(&a.run_id)),
                    ("package_id", Cbor::bytes(a.package_id.to_vec())),
                    ("manifest_sha256", Cbor::bytes(a.manifest_sha256.to_vec())),
                    ("layer_start", Cbor::Uint(a.layer_start.into())),
                    ("layer_end", Cbor::Uint(a.layer_end.into())),
                    ("stage_index", Cbor::Uint(a.stage_index.into())),
                    ("stage_count", Cbor::Uint(a.stage_count.into())),
                    ("coordinator", Cbor::text(&a.coordinator)),
                    ("coordinator_addr", Cbor::text(&a.coordinator_addr)),
                    ("topology_hash", Cbor::text(&a.topology_hash)),
                    ("upstream", Cbor::text(&a.upstream)),
                ]);
                if let Some(down) = &a.downstream {
                    members.push(("downstream", Cbor::text(down)));
                }
            }
            ControlRequest::Generate(g) => {
                members.extend([
                    ("prompt", Cbor::text(&g.prompt)),
                    ("max_tokens", Cbor::Uint(g.max_tokens)),
                    ("chat", Cbor::Uint(u64::from(g.chat))),
                    ("temperature_milli", Cbor::Uint(g.temperature_milli)),
                    ("top_k", Cbor::Uint(g.top_k)),
                    ("top_p_milli", Cbor::Uint(g.top_p_milli)),
                    ("seed", Cbor::Uint(g.seed)),
                ]);
                if let Some(ms) = g.timeout_ms {
                    members.push(("timeout_ms", Cbor::Uint(ms)));
                }
                if !g.stop.is_empty() {
                    members.push(("stop", Cbor::Array(g.stop.iter().map(Cbor::text).collect())));
                }
                if let Some(floor) = g.fidelity_floor {
                    members.push(("fidelity_floor", Cbor::Uint(floor.level())));
                }
                if let Some(ceiling) = g.joule_ceiling_uj {
                    members.push(("joule_ceiling_uj", Cbor::Uint(ceiling)));
                }
                if let Some(decision) = &g.decision {
                    members.push(("decision", decision.to_cbor()));
                }
                if let Some((serve, presentations)) = &g.grant {
                    members.push(("serve_request", serve.to_cbor()));
                    members.push((
                        "presentations",
                        Cbor::Array(
                            presentations
                                .iter()
                                .map(|p| Cbor::bytes(p.clone()))
                                .collect(),
                        ),
                    ));
                }
            }
            ControlRequest::Authorise(a) => members.extend([
                ("run_id", Cbor::text(&a.run_id)),
                ("request_id", Cbor::Uint(a.request_id)),
                ("serve_request", a.serve_request.to_cbor()),
                ("presentation", a.presentation.to_cbor()),
            ]),
            ControlRequest::Release { request_id } | ControlRequest::Stats { request_id } => {
                members.push(("request_id", Cbor::Uint(*request_id)));
            }
            ControlRequest::Unassign { run_id } => members.push(("run_id", Cbor::text(run_id))),
            ControlRequest::Plan | ControlRequest::NodeStats => {}
        }
        Cbor::text_map(members)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, ControlError> {
        Self::from_cbor(&Cbor::decode(bytes)?)
    }

    pub fn from_cbor(value: &Cbor) -> Result<Self, ControlError> {
        let mut f = Fields::of(value)
            .map_err(|error| ControlError::Field {
                kind: "control message",
                error,
            })?
            .text_limit(MAX_CONTROL_TEXT);
        let kind = f
            .text("kind")
            .map_err(|error| ControlError::Field {
                kind: "control message",
                error,
            })?
            .to_string();
        let (name, request) = match kind.as_str() {
            "assign" => ("assign", read_assign(&mut f)),
            "generate" => ("generate", read_generate(value, &mut f)),
            "plan" => ("plan", Ok(ControlRequest::Plan)),
            "authorise" => ("authorise", read_authorise(&mut f)),
            "release" => (
                "release",
                f.uint("request_id")
                    .map(|request_id| ControlRequest::Release { request_id })
                    .map_err(|e| field("release", e)),
            ),
            "unassign" => (
                "unassign",
                f.text("run_id")
                    .map(|run_id| ControlRequest::Unassign {
                        run_id: run_id.to_string(),
                    })
                    .map_err(|e| field("unassign", e)),
            ),
            "stats" => (
                "stats",
                f.uint("request_id")
                    .map(|request_id| ControlRequest::Stats { request_id })
                    .map_err(|e| field("stats", e)),
            ),
            "node_stats" => ("node_stats", Ok(ControlRequest::NodeStats)),
            _ => return Err(ControlError::UnknownKind(truncated(&kind))),
        };
        let request = request?;
        f.finish().map_err(|e| field(name, e))?;
        Ok(request)
    }
}

/// Longest reason a refusal or error carries, bytes.
pub const MAX_REASON_BYTES: usize = 8192;
/// Most stewards a `plan` reply names: a chain's stages, as many as a
/// receipt may route.
pub const MAX_PLAN_STEWARDS: usize = crate::receipt::MAX_STAGES;

/// Every answer on `mesh-control/1` but `node_stats`'s (whose figures are
/// the node's own `NodeStats`): one kind each, strictly read (an unknown
/// member or kind is an error, as in requests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlReply {
    /// `assign`: the slice is loaded.
    Ready {
        weights_digest: [u8; 32],
        resident_bytes: u64,
        max_requests: u64,
        slice_idle_ms: u64,
    },
    /// To a node: what it asked is refused, and why.
    Refused { reason: String },
    /// To a requester: its request is refused or failed before it ran.
    Error { reason: String },
    /// `authorise`: the grant decision is taken and held.
    Authorised,
    /// `release` or `unassign`: done.
    Released,
    /// `plan`: the run and its stewards, in stage order.
    Plan {
        run_id: String,
        stewards: Vec<String>,
    },
    /// `stats`: one request's figures at a stage (`found` false: none).
    Stats {
        found: bool,
        compute_us: u64,
        /// The engine's own time on decode steps, the hand-offs to and
        /// from the slice's worker not included.
        decode_engine_us: u64,
        fold_us: u64,
        steps: u64,
    },
    /// `generate`: one token, and the text it adds (streamed).
    Token { id: u64, text: String },
    /// `generate`: the end, `failed` when it ended in error; `details` and
    /// `bundle` are JSON bytes.
    Finished {
        failed: bool,
        text: String,
        terminal_state: String,
        error: String,
        details: Vec<u8>,
        bundle: Vec<u8>,
    },
}

impl ControlReply {
    pub fn kind(&self) -> &'static str {
        match self {
            ControlReply::Ready { .. } => "ready",
            ControlReply::Refused { .. } => "refused",
            ControlReply::Error { .. } => "error",
            ControlReply::Authorised => "authorised",
            ControlReply::Released => "released",
            ControlReply::Plan { .. } => "plan",
            ControlReply::Stats { .. } => "stats",
            ControlReply::Token { .. } => "token",
            ControlReply::Finished { failed: false, .. } => "done",
            ControlReply::Finished { failed: true, .. } => "failed",
        }
    }

    pub fn to_cbor(&self) -> Cbor {
        let mut members = vec![("kind", Cbor::text(self.kind()))];
        match self {
            ControlReply::Ready {
                weights_digest,
                resident_bytes,
                max_requests,
                slice_idle_ms,
            } => members.extend([
                ("weights_digest", Cbor::bytes(weights_digest.to_vec())),
                ("resident_bytes", Cbor::Uint(*resident_bytes)),
                ("max_requests", Cbor::Uint(*max_requests)),
                ("slice_idle_ms", Cbor::Uint(*slice_idle_ms)),
            ]),
            ControlReply::Refused { reason } | ControlReply::Error { reason } => {
                members.push(("reason", Cbor::text(reason)));
            }
            ControlReply::Authorised | ControlReply::Released => {}
            ControlReply::Plan { run_id, stewards } => members.extend([
                ("run_id", Cbor::text(run_id)),
                (
                    "stewards",
                    Cbor::Array(stewards.iter().map(Cbor::text).collect()),
                ),
            ]),
            ControlReply::Stats {
                found,
                compute_us,
                decode_engine_us,
                fold_us,
                steps,
            } => members.extend([
                ("found", Cbor::Uint(u64::from(*found))),
                ("compute_us", Cbor::Uint(*compute_us)),
                ("decode_engine_us", Cbor::Uint(*decode_engine_us)),
                ("fold_us", Cbor::Uint(*fold_us)),
                ("steps", Cbor::Uint(*steps)),
            ]),
            ControlReply::Token { id, text } => {
                members.extend([("id", Cbor::Uint(*id)), ("text", Cbor::text(text))]);
            }
            ControlReply::Finished {
                text,
                terminal_state,
                error,
                details,
                bundle,
                ..
            } => members.extend([
                ("text", Cbor::text(text)),
                ("terminal_state", Cbor::text(terminal_state)),
                ("error", Cbor::text(error)),
                ("details", Cbor::bytes(details.clone())),
                ("bundle", Cbor::bytes(bundle.clone())),
            ]),
        }
        Cbor::text_map(members)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, ControlError> {
        Self::from_cbor(&Cbor::decode(bytes)?)
    }

    /// Strict: the kind's members exactly; reasons at most
    /// `MAX_REASON_BYTES`, names at most `MAX_CONTROL_TEXT`. A generation's
    /// text and JSON members are bounded by the message reader.
    pub fn from_cbor(value: &Cbor) -> Result<Self, ControlError> {
        let reply = |error| field("control reply", error);
        let mut f = Fields::of(value).map_err(reply)?;
        let kind = f.text("kind").map_err(reply)?.to_string();
        let reason = |f: &mut Fields<'_>| -> Result<String, FieldError> {
            let text = f.text("reason")?;
            if text.len() > MAX_REASON_BYTES {
                return Err(FieldError::Invalid("reason"));
            }
            Ok(text.to_string())
        };
        let flag = |f: &mut Fields<'_>, key: &'static str| match f.uint(key)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(FieldError::Invalid(key)),
        };
        let parsed: Result<Self, FieldError> = match kind.as_str() {
            "ready" => (|| {
                Ok(ControlReply::Ready {
                    weights_digest: f.fixed("weights_digest")?,
                    resident_bytes: f.uint("resident_bytes")?,
                    max_requests: f.uint("max_requests")?,
                    slice_idle_ms: f.uint("slice_idle_ms")?,
                })
            })(),
            "refused" => reason(&mut f).map(|reason| ControlReply::Refused { reason }),
            "error" => reason(&mut f).map(|reason| ControlReply::Error { reason }),
            "authorised" => Ok(ControlReply::Authorised),
            "released" => Ok(ControlReply::Released),
            "plan" => (|| {
                let run_id = f.text("run_id")?;
                if run_id.len() > MAX_CONTROL_TEXT {
                    return Err(FieldError::Invalid("run_id"));
                }
                let list = f.array("stewards")?;
                if list.len() > MAX_PLAN_STEWARDS {
                    return Err(FieldError::Invalid("stewards"));
                }
                let stewards = list
                    .iter()
                    .map(|s| {
                        s.as_text()
                            .filter(|t| t.len() <= MAX_CONTROL_TEXT)
                            .map(str::to_string)
                            .ok_or(FieldError::Invalid("stewards"))
                    })
                    .collect::<Result<_, _>>()?;
                Ok(ControlReply::Plan {
                    run_id: run_id.to_string(),
                    stewards,
                })
            })(),
            "stats" => (|| {
                Ok(ControlReply::Stats {
                    found: flag(&mut f, "found")?,
                    compute_us: f.uint("compute_us")?,
                    decode_engine_us: f.uint("decode_engine_us")?,
                    fold_us: f.uint("fold_us")?,
                    steps: f.uint("steps")?,
                })
            })(),
            "token" => (|| {
                Ok(ControlReply::Token {
                    id: f.uint("id")?,
                    text: f.text("text")?.to_string(),
                })
            })(),
            "done" | "failed" => (|| {
                Ok(ControlReply::Finished {
                    failed: kind == "failed",
                    text: f.text("text")?.to_string(),
                    terminal_state: f.text("terminal_state")?.to_string(),
                    error: f.text("error")?.to_string(),
                    details: f.bytes("details")?.to_vec(),
                    bundle: f.bytes("bundle")?.to_vec(),
                })
            })(),
            other => return Err(ControlError::UnknownKind(truncated(other))),
        };
        let parsed = parsed.map_err(reply)?;
        f.finish().map_err(reply)?;
        Ok(parsed)
    }
}

fn field(kind: &'static str, error: FieldError) -> ControlError {
    ControlError::Field { kind, error }
}

/// A name from the wire, short enough to repeat in an error.
fn truncated(text: &str) -> String {
    text.chars().take(64).collect()
}

fn read_assign(f: &mut Fields<'_>) -> Result<ControlRequest, ControlError> {
    let e = |error| field("assign", error);
    Ok(ControlRequest::Assign(AssignRequest {
        run_id: f.text("run_id").map_err(e)?.to_string(),
        package_id: f.fixed("package_id").map_err(e)?,
        manifest_sha256: f.fixed("manifest_sha256").map_err(e)?,
        layer_start: f.u32("layer_start").map_err(e)?,
        layer_end: f.u32("layer_end").map_err(e)?,
        stage_index: f.u32("stage_index").map_err(e)?,
        stage_count: f.u32("stage_count").map_err(e)?,
        coordinator: f.text("coordinator").map_err(e)?.to_string(),
        coordinator_addr: f.text("coordinator_addr").map_err(e)?.to_string(),
        topology_hash: f.text("topology_hash").map_err(e)?.to_string(),
        upstream: f.text("upstream").map_err(e)?.to_string(),
        downstream: f.opt_text("downstream").map_err(e)?.map(str::to_string),
    }))
}

fn read_generate(value: &Cbor, f: &mut Fields<'_>) -> Result<ControlRequest, ControlError> {
    let e = |error| field("generate", error);
    // The prompt is bounded by the message, not by the text limit of ids.
    let prompt = value
        .get("prompt")
        .and_then(Cbor::as_text)
        .ok_or(ControlError::Field {
            kind: "generate",
            error: FieldError::Missing("prompt"),
        })?
        .to_string();
    f.optional("prompt");
    let stop = match f.optional("stop") {
        None => Vec::new(),
        Some(list) => {
            let invalid = || ControlError::Field {
                kind: "generate",
                error: FieldError::Invalid("stop"),
            };
            let list = list.as_array().ok_or_else(invalid)?;
            if list.is_empty() || list.len() > MAX_STOP_SEQUENCES {
                return Err(invalid());
            }
            list.iter()
                .map(|s| {
                    s.as_text()
                        .filter(|t| !t.is_empty() && t.len() <= MAX_STOP_BYTES)
                        .map(str::to_string)
                        .ok_or_else(invalid)
                })
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    let grant = match f.optional("serve_request") {
        None => None,
        Some(serve) => {
            let serve = ServeRequest::from_cbor(serve).map_err(|why| ControlError::Member {
                kind: "generate",
                member: "serve_request",
                why: why.to_string(),
            })?;
            let presentations = f
                .array("presentations")
                .map_err(e)?
                .iter()
                .map(|p| p.as_bytes().map(<[u8]>::to_vec))
                .collect::<Option<Vec<_>>>()
                .ok_or(ControlError::Field {
                    kind: "generate",
                    error: FieldError::Invalid("presentations"),
                })?;
            Some((serve, presentations))
        }
    };
    Ok(ControlRequest::Generate(GenerateRequestMessage {
        prompt,
        max_tokens: f.uint("max_tokens").map_err(e)?,
        chat: match f.uint("chat").map_err(e)? {
            0 => false,
            1 => true,
            _ => return Err(e(FieldError::Invalid("chat"))),
        },
        temperature_milli: f.uint("temperature_milli").map_err(e)?,
        top_k: f.uint("top_k").map_err(e)?,
        top_p_milli: f.uint("top_p_milli").map_err(e)?,
        seed: f.uint("seed").map_err(e)?,
        timeout_ms: f.opt_uint("timeout_ms").map_err(e)?,
        stop,
        grant,
        fidelity_floor: match f.opt_uint("fidelity_floor").map_err(e)? {
            None => None,
            Some(level) => {
                Some(Fidelity::from_level(level).ok_or(e(FieldError::Invalid("fidelity_floor")))?)
            }
        },
        joule_ceiling_uj: f.opt_uint("joule_ceiling_uj").map_err(e)?,
        decision: f
            .optional("decision")
            .map(DecisionAsk::from_cbor)
            .transpose()
            .map_err(e)?,
    }))
}

fn read_authorise(f: &mut Fields<'_>) -> Result<ControlRequest, ControlError> {
    let e = |error| field("authorise", error);
    let run_id = f.text("run_id").map_err(e)?.to_string();
    let request_id = f.uint("request_id").map_err(e)?;
    let serve_request =
        ServeRequest::from_cbor(f.required("serve_request").map_err(e)?).map_err(|why| {
            ControlError::Member {
                kind: "authorise",
                member: "serve_request",
                why: why.to_string(),
            }
        })?;
    let presentation =
        Presentation::from_cbor(f.required("presentation").map_err(e)?).map_err(|why| {
            ControlError::Member {
                kind: "authorise",
                member: "presentation",
                why: why.to_string(),
            }
        })?;
    Ok(ControlRequest::Authorise(Box::new(AuthoriseRequest {
        run_id,
        request_id,
        serve_request,
        presentation,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh1::Fidelity;

    fn serve() -> ServeRequest {
        ServeRequest {
            prompt_hash: [4; 32],
            prompt_tokens: 3,
            max_tokens: 8,
            fidelity_floor: Fidelity::F0,
            joule_ceiling_uj: 1_000,
            decision: None,
        }
    }

    fn every_request() -> Vec<ControlRequest> {
        vec![
            ControlRequest::Assign(AssignRequest {
                run_id: "run".into(),
                package_id: [1; 32],
                manifest_sha256: [2; 32],
                layer_start: 0,
                layer_end: 10,
                stage_index: 1,
                stage_count: 3,
                coordinator: "did:key:z6MkA".into(),
                coordinator_addr: "127.0.0.1:7420".into(),
                topology_hash: "ab".repeat(32),
                upstream: "did:key:z6MkB".into(),
                downstream: Some("did:key:z6MkC@127.0.0.1:7421".into()),
            }),
            ControlRequest::Generate(GenerateRequestMessage {
                prompt: "x".repeat(2 * MAX_CONTROL_TEXT),
                max_tokens: 16,
                chat: true,
                temperature_milli: 700,
                top_k: 40,
                top_p_milli: 950,
                seed: 7,
                timeout_ms: Some(5_000),
                stop: vec!["\n\n".into(), "END".into()],
                grant: Some((serve(), vec![vec![1, 2], Vec::new()])),
                fidelity_floor: Some(Fidelity::F3),
                joule_ceiling_uj: Some(5_000_000),
                decision: Some(DecisionAsk {
                    question: "Is the answer yes?".into(),
                    options: vec!["yes".into(), "no".into()],
                }),
            }),
            ControlRequest::Plan,
            ControlRequest::Release { request_id: 9 },
            ControlRequest::Unassign {
                run_id: "mesh-split-1".into(),
            },
            ControlRequest::Stats { request_id: 9 },
            ControlRequest::NodeStats,
        ]
    }

    #[test]
    fn every_request_round_trips() {
        for request in every_request() {
            let bytes = request.to_cbor().encode();
            assert_eq!(ControlRequest::decode(&bytes), Ok(request));
        }
    }

    #[test]
    fn refuses_unknown_kinds_members_and_long_ids() {
        let unknown = Cbor::text_map([("kind", Cbor::text("reboot"))]);
        assert_eq!(
            ControlRequest::from_cbor(&unknown),
            Err(ControlError::UnknownKind("reboot".into()))
        );
        let extra = Cbor::text_map([
            ("kind", Cbor::text("release")),
            ("request_id", Cbor::Uint(1)),
            ("also", Cbor::Uint(2)),
        ]);
        assert_eq!(
            ControlRequest::from_cbor(&extra),
            Err(ControlError::Field {
                kind: "release",
                error: FieldError::Unknown("also".into())
            })
        );
        let long_id = Cbor::text_map([
            ("kind", Cbor::text("authorise")),
            ("run_id", Cbor::text("r".repeat(MAX_CONTROL_TEXT + 1))),
        ]);
        assert!(matches!(
            ControlRequest::from_cbor(&long_id),
            Err(ControlError::Field {
                error: FieldError::Invalid("run_id"),
                ..
            })
        ));
    }

    fn every_reply() -> Vec<ControlReply> {
        vec![
            ControlReply::Ready {
                weights_digest: [3; 32],
                resident_bytes: 36 << 20,
                max_requests: 8,
                slice_idle_ms: 900_000,
            },
            ControlReply::Refused {
                reason: "not the assigned upstream".into(),
            },
            ControlReply::Error {
                reason: "busy: retry in 1 s".into(),
            },
            ControlReply::Authorised,
            ControlReply::Released,
            ControlReply::Plan {
                run_id: "mesh-split-1".into(),
                stewards: vec!["did:key:z6MkA".into(), "did:key:z6MkB".into()],
            },
            ControlReply::Stats {
                found: true,
                compute_us: 1200,
                decode_engine_us: 900,
                fold_us: 40,
                steps: 9,
            },
            ControlReply::Token {
                id: 504,
                text: " Paris".into(),
            },
            ControlReply::Finished {
                failed: false,
                text: "Paris".into(),
                terminal_state: "completed".into(),
                error: String::new(),
                details: b"{}".to_vec(),
                bundle: b"{}".to_vec(),
            },
            ControlReply::Finished {
                failed: true,
                text: String::new(),
                terminal_state: "timed_out".into(),
                error: "deadline".into(),
                details: b"{}".to_vec(),
                bundle: Vec::new(),
            },
        ]
    }

    #[test]
    fn every_reply_round_trips_and_is_read_strictly() {
        for reply in every_reply() {
            let bytes = reply.to_cbor().encode();
            assert_eq!(ControlReply::decode(&bytes), Ok(reply.clone()), "{reply:?}");
        }
        let unknown = Cbor::text_map([("kind", Cbor::text("maybe"))]);
        assert_eq!(
            ControlReply::from_cbor(&unknown),
            Err(ControlError::UnknownKind("maybe".into()))
        );
        let extra = Cbor::text_map([("kind", Cbor::text("released")), ("also", Cbor::Uint(1))]);
        assert!(matches!(
            ControlReply::from_cbor(&extra),
            Err(ControlError::Field {
                error: FieldError::Unknown(_),
                ..
            })
        ));
        let long = Cbor::text_map([
            ("kind", Cbor::text("refused")),
            ("reason", Cbor::text("r".repeat(MAX_REASON_BYTES + 1))),
        ]);
        assert!(ControlReply::from_cbor(&long).is_err());
        let many = Cbor::text_map([
            ("kind", Cbor::text("plan")),
            ("run_id", Cbor::text("r")),
            (
                "stewards",
                Cbor::Array(vec![Cbor::text("s"); MAX_PLAN_STEWARDS + 1]),
            ),
        ]);
        assert!(ControlReply::from_cbor(&many).is_err());
        let found_two = Cbor::text_map([
            ("kind", Cbor::text("stats")),
            ("found", Cbor::Uint(2)),
            ("compute_us", Cbor::Uint(0)),
            ("decode_engine_us", Cbor::Uint(0)),
            ("fold_us", Cbor::Uint(0)),
            ("steps", Cbor::Uint(0)),
        ]);
        assert!(ControlReply::from_cbor(&found_two).is_err());
        // Every figure is required: a missing one is an error, not a 0.
        let without_decode = Cbor::text_map([
            ("kind", Cbor::text("stats")),
            ("found", Cbor::Uint(1)),
            ("compute_us", Cbor::Uint(7)),
            ("fold_us", Cbor::Uint(1)),
            ("steps", Cbor::Uint(2)),
        ]);
        assert!(ControlReply::from_cbor(&without_decode).is_err());
    }

    proptest::proptest! {
        #[test]
        fn a_reply_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            if let Ok(reply) = ControlReply::decode(&bytes) {
                proptest::prop_assert_eq!(ControlReply::decode(&reply.to_cbor().encode()), Ok(reply));
            }
        }
    }
}
