//! A request's progress: what it carries from one segment (chain) to the
//! next, what it generated and what it measured.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mesh_stage::frame::WireDType;
use mesh_stage::sampling::Sampler;
use mesh_stage::text::TextStream;

use crate::runtime::client::GenerateRequest;
use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::role::CoordinatorRole;

/// What a request carries from one segment to the next: what it generated
/// and what it measured, over every chain it ran on.
pub(crate) struct Progress {
    pub(crate) tokens: Vec<u32>,
    /// The text of the tokens but end-of-sequence ones.
    pub(crate) text: TextStream,
    pub(crate) printed: String,
    /// Why a completed generation ended, in OpenAI's words: `stop` for an
    /// end-of-sequence token or a stop sequence, `length` for max_tokens.
    pub(crate) finish_reason: &'static str,
    pub(crate) sampler: Sampler,
    pub(crate) own_compute: Duration,
    /// The engine's own time on decode steps (their slice step and head),
    /// hand-offs to and from the slice's worker not included.
    pub(crate) own_decode_engine: Duration,
    pub(crate) round_trips: Duration,
    /// The round trips of decode steps alone (what a token waits for).
    pub(crate) decode_round_trips: Duration,
    /// The prompt's prefill, on the first chain.
    pub(crate) prefill_time: Option<Duration>,
    /// When the first and the latest token were sampled: the decode rate
    /// is taken between them, so closing the chain (records, sealing)
    /// is not counted as decoding.
    pub(crate) first_token_at: Option<Instant>,
    pub(crate) last_token_at: Option<Instant>,
    pub(crate) started: Instant,
    /// Set when the requester closes its connection or stops reading.
    pub(crate) requester_gone: Arc<std::sync::atomic::AtomicBool>,
    /// Each resume's figures, for the details.
    pub(crate) resumes: Vec<serde_json::Value>,
    /// The own slice's outputs so far (one row per position, in f32), while
    /// they fit in `MAX_KEPT_OUTPUT_BYTES`: what a new stage after it is
    /// replayed from.
    pub(crate) own_outputs: Option<Vec<f32>>,
    /// Whether the serve, as far as it went, repeats bit for bit.
    pub(crate) deterministic: bool,
    /// A decision's probability per option, once scored.
    pub(crate) decided: Option<Vec<f64>>,
    /// Decode steps answered (fewer than tokens when drafts are accepted).
    pub(crate) decode_steps: u64,
    /// Where its drafts come from; kept across segments (its cache on a
    /// draft model is the request's, not a chain's).
    pub(crate) drafter: super::draft::Drafter,
    /// Whether the request drafted (greedy, drafting on, not a decision).
    pub(crate) drafted: bool,
    /// Drafted tokens sent for verification, and those the model chose.
    pub(crate) spec_proposed: u64,
    pub(crate) spec_accepted: u64,
}

impl Progress {
    /// A request's progress before its first segment.
    pub(crate) fn new(
        coordinator: &CoordinatorRole,
        request: &GenerateRequest,
        admitted: &Admitted<'_>,
        requester_gone: Arc<std::sync::atomic::AtomicBool>,
    ) -> Self {
        Self {
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
                && coordinator.settings.wire == WireDType::F32
                && admitted.prompt_ids.len() <= coordinator.settings.prefill_chunk_tokens,
            decided: None,
            decode_steps: 0,
            drafter: super::draft::Drafter::new(
                coordinator.draft_model.as_ref(),
                admitted.request_id,
                admitted.prompt_ids.len() + admitted.max_new,
            ),
            drafted: false,
            spec_proposed: 0,
            spec_accepted: 0,
        }
    }
}
