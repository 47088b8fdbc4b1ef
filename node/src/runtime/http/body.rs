//! A request's body read as OpenAI's: checked, bounded, and turned into
//! a `generate` request (a chat rendered with the model's template, a
//! grant derived or presented).

use axum::body::Bytes;
use axum::http::StatusCode;
use mesh_protocol::control::{MAX_STOP_BYTES, MAX_STOP_SEQUENCES};
use mesh_stage::sampling::SamplingParams;
use mesh_stage::text::TextCodec;
use serde::Deserialize;
use serde_json::Value;

use super::api::{
    Api, ApiError, DEFAULT_CHAT_TOKENS, DEFAULT_COMPLETION_TOKENS, MAX_MESSAGES, ModelCard,
};
use crate::runtime::client::{GenerateRequest, MAX_PROMPT_BYTES_PER_TOKEN};

/// One string or several (OpenAI's `stop` and `prompt`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub(super) fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// What `/v1/completions` and `/v1/chat/completions` share.
#[derive(Debug, Deserialize)]
pub(super) struct Common {
    /// Presentations of grants (seed 001 §2.1), hex: one for the
    /// coordinator's steward, or one per stage in order ("" where none).
    pub(super) jcp_presentation: Option<OneOrMany>,
    #[serde(default)]
    pub(super) metadata: Metadata,
    pub(super) model: String,
    pub(super) max_tokens: Option<u64>,
    pub(super) max_completion_tokens: Option<u64>,
    pub(super) temperature: Option<f64>,
    pub(super) top_p: Option<f64>,
    pub(super) seed: Option<u64>,
    pub(super) stop: Option<OneOrMany>,
    #[serde(default)]
    pub(super) stream: bool,
    pub(super) n: Option<u64>,
    /// Tool calling and structured output are not served: a request that
    /// asks for them is refused rather than answered as if it had not.
    pub(super) tools: Option<serde_json::Value>,
    pub(super) tool_choice: Option<serde_json::Value>,
    pub(super) functions: Option<serde_json::Value>,
    pub(super) response_format: Option<serde_json::Value>,
}

/// OpenAI's `metadata`, with the members a granted request names.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Metadata {
    /// The energy ceiling a granted request is served under (required with
    /// `jcp_presentation`); a number or its decimal text.
    pub(super) joule_ceiling_uj: Option<Value>,
    /// The requester's estimate of the prompt's tokens, as signed for.
    pub(super) prompt_tokens: Option<Value>,
}

/// A number, or its decimal text (OpenAI's `metadata` values are text).
pub(super) fn metadata_number(value: &Option<Value>, name: &str) -> Result<Option<u64>, ApiError> {
    match value {
        None => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| ApiError::bad(format!("`metadata.{name}` must be a whole number"))),
        Some(Value::String(s)) => s
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad(format!("`metadata.{name}` must be a whole number"))),
        Some(_) => Err(ApiError::bad(format!(
            "`metadata.{name}` must be a whole number"
        ))),
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct CompletionBody {
    pub(super) prompt: OneOrMany,
    #[serde(flatten)]
    pub(super) common: Common,
}

#[derive(Debug, Deserialize)]
pub(super) struct ChatBody {
    pub(super) messages: Vec<Message>,
    #[serde(flatten)]
    pub(super) common: Common,
}

#[derive(Debug, Deserialize)]
pub(super) struct Message {
    pub(super) role: String,
    pub(super) content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub(super) struct Part {
    #[serde(rename = "type")]
    pub(super) kind: String,
    pub(super) text: Option<String>,
}

pub(super) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(body_error)
}

pub(super) fn body_error(error: serde_json::Error) -> ApiError {
    ApiError::bad(format!("the request body: {error}"))
}

/// Which endpoint a request came in on: the shapes of its answers differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flavour {
    Completion,
    Chat,
}

/// A request checked and ready for the coordinator.
pub(super) struct Prepared {
    pub(super) flavour: Flavour,
    pub(super) request: GenerateRequest,
    pub(super) stream: bool,
    /// The request named a model this coordinator does not serve, and is
    /// answered by the one it serves (said in `X-Mesh-Model-Fallback`).
    pub(super) fell_back: bool,
}

pub(super) fn check_completion(api: &Api, body: Bytes) -> Result<Prepared, ApiError> {
    let (prompt, common) = completion_prompt(parse(&body)?)?;
    prepare(api, Flavour::Completion, prompt, common)
}

/// A completion's prompt, as served: its one string.
pub(super) fn completion_prompt(body: CompletionBody) -> Result<(String, Common), ApiError> {
    let mut prompts = body.prompt.into_vec();
    match (prompts.pop(), prompts.is_empty()) {
        (Some(prompt), true) => Ok((prompt, body.common)),
        _ => Err(ApiError::bad("`prompt` must be one string")),
    }
}

/// A chat's prompt, as served: its messages in the model's template.
pub(super) fn chat_prompt(api: &Api, body: ChatBody) -> Result<(String, Common), ApiError> {
    Ok((render_chat(&api.card.codec, body.messages)?, body.common))
}

pub(super) fn check_chat(api: &Api, body: Bytes) -> Result<Prepared, ApiError> {
    let (prompt, common) = chat_prompt(api, parse(&body)?)?;
    prepare(api, Flavour::Chat, prompt, common)
}

pub(super) fn render_chat(codec: &TextCodec, messages: Vec<Message>) -> Result<String, ApiError> {
    let template = codec
        .chat_template()
        .map_err(|why| ApiError::bad(format!("{why}: use /v1/completions")))?;
    if messages.is_empty() || messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad(format!(
            "`messages` must hold 1 to {MAX_MESSAGES} messages"
        )));
    }
    let mut turns = Vec::with_capacity(messages.len());
    for message in messages {
        let role = match message.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::bad(format!(
                    "role `{other}` is not supported (system, developer, user, assistant)"
                )));
            }
        };
        let content = match message.content {
            Content::Text(text) => text,
            Content::Parts(parts) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(piece)) => text.push_str(&piece),
                        (kind, _) => {
                            return Err(ApiError::bad(format!(
                                "content part `{kind}` is not supported (text only)"
                            )));
                        }
                    }
                }
                text
            }
        };
        if let Some(token) = codec.control_token_in(&content) {
            return Err(ApiError::bad(format!(
                "a message holds the model's control token `{token}`, which would be read as \
                 a turn marker; remove it"
            )));
        }
        turns.push((role, content));
    }
    // A template may refuse a conversation (roles out of its order): its
    // own words, as a bad request.
    template
        .render(&turns)
        .map_err(|error| ApiError::bad(error.to_string()))
}

pub(super) fn prepare(
    api: &Api,
    flavour: Flavour,
    prompt: String,
    mut common: Common,
) -> Result<Prepared, ApiError> {
    let card = &api.card;
    // A coordinator serves one model: a request naming another (an
    // application's default, `gpt-4o`) is answered by it, as llama-server
    // does, and the answer says so in a header and in its `model`.
    let fell_back = common.model != card.id && common.model != model_package(card);
    if common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("`n` must be 1"));
    }
    unsupported(&common)?;
    let temperature = common.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad("`temperature` must be between 0 and 2"));
    }
    let top_p = common.top_p.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&top_p) || top_p == 0.0 {
        return Err(ApiError::bad("`top_p` must be above 0 and at most 1"));
    }
    let stop = common
        .stop
        .take()
        .map(OneOrMany::into_vec)
        .unwrap_or_default();
    if stop.len() > MAX_STOP_SEQUENCES
        || stop
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::bad(format!(
            "`stop` must be at most {MAX_STOP_SEQUENCES} sequences of 1 to {MAX_STOP_BYTES} bytes"
        )));
    }
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty"));
    }
    if prompt.len() > card.context.saturating_mul(MAX_PROMPT_BYTES_PER_TOKEN) {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "a prompt of {} bytes cannot fit this model's context of {} tokens",
                prompt.len(),
                card.context
            ),
        )
        .code("context_length_exceeded"));
    }
    let prompt_tokens = card
        .codec
        .encode(&prompt)
        .map_err(|e| ApiError::bad(format!("the prompt: {e}")))?
        .len();
    if prompt_tokens >= card.context {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the prompt is {prompt_tokens} tokens; this model's context is {}",
                card.context
            ),
        )
        .code("context_length_exceeded"));
    }
    let room = card.context - prompt_tokens;
    let max_tokens = match common.max_completion_tokens.or(common.max_tokens) {
        Some(0) => return Err(ApiError::bad("`max_tokens` must be at least 1")),
        Some(n) if n as usize > room => {
            return Err(ApiError::bad(format!(
                "{prompt_tokens} prompt tokens and max_tokens {n} are more than this model's context of {}",
                card.context
            ))
            .code("context_length_exceeded"));
        }
        Some(n) => n as usize,
        None => match flavour {
            Flavour::Completion => DEFAULT_COMPLETION_TOKENS.min(room),
            Flavour::Chat => DEFAULT_CHAT_TOKENS.min(room),
        },
    };
    let grant = match &common.jcp_presentation {
        None => None,
        Some(presentations) => Some(granted(&prompt, &common, presentations)?),
    };
    let seed = common.seed.unwrap_or_else(|| {
        let mut bytes = [0u8; 8];
        // A seedless request samples differently each time, as with any
        // OpenAI server; a failing OS source only makes it predictable.
        let _ = getrandom::fill(&mut bytes);
        u64::from_le_bytes(bytes)
    });
    Ok(Prepared {
        flavour,
        fell_back,
        stream: common.stream,
        request: GenerateRequest {
            prompt,
            max_tokens,
            chat: false,
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_k: 0,
                top_p: top_p as f32,
                seed,
            },
            grant,
            timeout: None,
            stop,
            bounds: Default::default(),
            decision: None,
        },
    })
}

/// The `mesh/1` request a granted body is served as, derived from the body
/// alone (seed 001 §2.3), so a client can sign presentations for its id:
/// the prompt as served (a chat rendered with the model's template), the
/// body's own `max_tokens` and `metadata.joule_ceiling_uj`, and its
/// estimate of the prompt's tokens (`metadata.prompt_tokens`, else a
/// quarter of its bytes, rounded up). `POST /v1/mesh/granted_serve_request`
/// returns it for a body.
pub(super) fn derive_granted(
    prompt: &str,
    common: &Common,
) -> Result<mesh_protocol::mesh1::ServeRequest, ApiError> {
    let ceiling = metadata_number(&common.metadata.joule_ceiling_uj, "joule_ceiling_uj")?
        .ok_or_else(|| {
            ApiError::bad("a granted request names its own `metadata.joule_ceiling_uj`")
        })?;
    let max_tokens = common
        .max_completion_tokens
        .or(common.max_tokens)
        .ok_or_else(|| ApiError::bad("a granted request names its own `max_tokens`"))?;
    let estimate = match metadata_number(&common.metadata.prompt_tokens, "prompt_tokens")? {
        Some(n) => n,
        None => prompt.len().div_ceil(4) as u64,
    };
    Ok(crate::runtime::client::GrantedServe::derive(
        prompt,
        max_tokens as usize,
        u32::try_from(estimate).unwrap_or(u32::MAX),
        ceiling,
    ))
}

pub(super) fn granted(
    prompt: &str,
    common: &Common,
    presentations: &OneOrMany,
) -> Result<crate::runtime::client::GrantedServe, ApiError> {
    let serve = derive_granted(prompt, common)?;
    let presentations = match presentations {
        OneOrMany::One(one) => vec![one.clone()],
        OneOrMany::Many(many) => many.clone(),
    };
    if presentations.is_empty() || presentations.len() > mesh_protocol::receipt::MAX_STAGES {
        return Err(ApiError::bad(
            "`jcp_presentation` must hold 1 to 64 presentations",
        ));
    }
    let presentations = presentations
        .iter()
        .enumerate()
        .map(|(k, hex)| {
            let bytes = mesh_protocol::hex::decode(hex)
                .ok_or_else(|| ApiError::bad("`jcp_presentation` holds text that is not hex"))?;
            // "" stands for no presentation at that stage; anything else
            // must be one, or the coordinator would refuse it as its own
            // failure (503) instead of the caller's.
            if !bytes.is_empty() {
                mesh_protocol::grant::Presentation::decode(&bytes).map_err(|error| {
                    ApiError::bad(format!(
                        "`jcp_presentation` {k} is not a grant presentation: {error}"
                    ))
                })?;
            }
            Ok(bytes)
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(crate::runtime::client::GrantedServe {
        serve,
        presentations,
    })
}

pub(super) fn model_package(card: &ModelCard) -> String {
    format!("sha256:{}", mesh_protocol::hex::encode(&card.package_id))
}

/// Refuse what the API does not serve instead of ignoring it: tools (an
/// empty list asks for none) and any `response_format` but plain text.
fn unsupported(common: &Common) -> Result<(), ApiError> {
    let asked = |value: &Option<serde_json::Value>| {
        value.as_ref().is_some_and(|v| match v {
            serde_json::Value::Null => false,
            serde_json::Value::Array(items) => !items.is_empty(),
            _ => true,
        })
    };
    if asked(&common.tools) || asked(&common.functions) {
        return Err(ApiError::bad(
            "`tools` are not served here: this API generates text only",
        ));
    }
    if common
        .tool_choice
        .as_ref()
        .is_some_and(|choice| !matches!(choice.as_str(), None | Some("none")) && !choice.is_null())
    {
        return Err(ApiError::bad("`tool_choice` is not served here: give none"));
    }
    if let Some(format) = common.response_format.as_ref().filter(|f| !f.is_null())
        && format["type"] != "text"
    {
        return Err(ApiError::bad(format!(
            "`response_format` {} is not served here: only {{\"type\": \"text\"}}",
            format["type"]
        )));
    }
    Ok(())
}
