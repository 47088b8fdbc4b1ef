//! Generation through a chain of slices in one process, each hand-off going
//! through the activation-frame encoding as it would on the wire.

use std::time::{Duration, Instant};

use crate::error::{EngineError, Result};
use crate::frame::{WireDType, decode_frame, encode_frame};
use crate::model::{LayerSlice, SliceCache, SliceInput, SliceOutput};
use crate::sampling::Sampler;

/// Prompt positions per prefill step: the prompt goes through the chain
/// in steps of this many rows, as a serving coordinator sends it by
/// default, so a step's activations stay bounded (one step of SmolLM2's
/// 7,955-position prompt holds about 100 MB of MLP products alone) and
/// `generate --model` measures the time to first token a coordinator
/// gives. The same bits either way: a row's arithmetic does not depend on
/// the rows beside it in its step.
pub const PREFILL_STEP_ROWS: usize = 256;

/// How long each phase took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    pub prefill: Duration,
    pub decode: Duration,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
}

impl Timings {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_tokens as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

/// What a generation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Logits of the last step.
    pub last_logits: Vec<f32>,
    pub timings: Timings,
    /// Bytes of activation frames that crossed slice boundaries.
    pub frame_bytes: usize,
}

/// Slices covering a whole model, in order.
#[derive(Debug)]
pub struct Pipeline {
    slices: Vec<LayerSlice>,
    wire: WireDType,
}

impl Pipeline {
    pub fn new(slices: Vec<LayerSlice>, wire: WireDType) -> Result<Self> {
        let first_ok = slices.first().is_some_and(LayerSlice::is_first);
        let last_ok = slices.last().is_some_and(LayerSlice::is_last);
        let contiguous = slices
            .windows(2)
            .all(|w| w[0].range.end == w[1].range.start);
        if !(first_ok && last_ok && contiguous) {
            return Err(EngineError::WrongInput(
                "pipeline needs contiguous slices from the first layer to the last",
            ));
        }
        Ok(Self { slices, wire })
    }

    pub fn slices(&self) -> &[LayerSlice] {
        &self.slices
    }

    /// One step through every slice: tokens in, logits out.
    fn step(
        &self,
        caches: &mut [SliceCache],
        tokens: &[u32],
        frame_bytes: &mut usize,
    ) -> Result<Vec<f32>> {
        let mut carried: Option<Vec<u8>> = None;
        for (slice, cache) in self.slices.iter().zip(caches.iter_mut()) {
            let output = match &carried {
                None => slice.forward(SliceInput::Tokens(tokens), cache)?,
                Some(frame) => {
                    let (activations, _) = decode_frame(frame, slice.config().hidden)?;
                    slice.forward(SliceInput::Hidden(&activations), cache)?
                }
            };
            match output {
                SliceOutput::Logits(logits) => return Ok(logits),
                SliceOutput::Hidden(a) => {
                    let frame = encode_frame(&a.values, a.rows, a.cols, self.wire)?;
                    *frame_bytes += frame.len();
                    carried = Some(frame);
                }
            }
        }
        Err(EngineError::WrongInput("chain ended without a head"))
    }

    /// Prefill the prompt (in steps of `PREFILL_STEP_ROWS`), then decode until `max_new` tokens or a stop token.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampler: &mut Sampler,
        is_stop: &dyn Fn(u32) -> bool,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation> {
        let context = self.slices.first().map_or(0, |s| {
            s.config().context.min(crate::model::MAX_ENGINE_CONTEXT)
        });
        if prompt.is_empty() {
            return Err(EngineError::WrongInput("was given an empty prompt"));
        }
        if prompt.len() + max_new > context {
            return Err(EngineError::ContextExceeded {
                tokens: prompt.len(),
                max_new,
                context,
            });
        }
        let capacity = prompt.len() + max_new;
        let mut caches = self
            .slices
            .iter()
            .map(|s| s.new_cache(capacity))
            .collect::<Result<Vec<_>>>()?;
        let mut timings = Timings {
            prefill_tokens: prompt.len(),
            ..Timings::default()
        };
        let mut frame_bytes = 0;
        let start = Instant::now();
        let mut logits = Vec::new();
        for rows in prompt.chunks(PREFILL_STEP_ROWS) {
            logits = self.step(&mut caches, rows, &mut frame_bytes)?;
        }
        timings.prefill = start.elapsed();
        let mut tokens = Vec::new();
        let start = Instant::now();
        while tokens.len() < max_new {
            let Some(next) = sampler.sample(&logits) else {
                break;
            };
            tokens.push(next);
            on_token(next);
            if is_stop(next) || tokens.len() == max_new {
                break;
            }
            logits = self.step(&mut caches, &[next], &mut frame_bytes)?;
            timings.decode_tokens += 1;
        }
        timings.decode = start.elapsed();
        Ok(Generation {
            tokens,
            last_logits: logits,
            timings,
            frame_bytes,
        })
    }
}
