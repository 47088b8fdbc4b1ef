//! Where a coordinator's drafts come from (speculative decoding, `wire.md`):
//! a small model with the target's tokenizer that it holds whole (`serve
//! --draft-model`), run greedily a token at a time on a cache of its own
//! per request, or, when it holds none, prompt lookup
//! (`mesh_stage::draft`). A draft is only a guess the chain verifies:
//! whatever goes wrong here (the draft pool full, an engine error) costs
//! the request its drafts, never its tokens, and a request's drafting
//! computes on the blocking pool, never on the runtime's threads.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail};
use mesh_stage::cache::{CacheLease, CachePool};
use mesh_stage::draft::Lookup;
use mesh_stage::sampling::argmax;
use mesh_stage::{EngineError, LayerSlice, ModelHandle, SliceInput, SliceOutput};
use tokio::task::JoinHandle;

/// Positions of history a draft cache takes in one forward pass while it
/// catches up (the prompt, a replay): a bound on one pass's attention
/// scores, as the chain's prefill chunks are bounded.
const CATCH_UP_CHUNK: usize = 512;

/// Positions a draft cache may take on the way to a draft: what one decode
/// step adds (its token and an accepted draft). Further behind, it catches
/// up in the background, so no step waits on a prompt's worth of it.
const INLINE_CATCH_UP: usize = mesh_protocol::stage_frame::MAX_DECODE_ROWS;

/// A draft model, whole, with a cache per request it drafts for.
#[derive(Debug)]
pub(crate) struct DraftModel {
    slice: LayerSlice,
    pool: CachePool,
    /// Its longest sequence.
    context: usize,
    /// Token ids it may propose: those of the served model.
    vocab: usize,
    /// Its file name, for the details of a serve.
    name: String,
}

impl DraftModel {
    /// Load the model at `path`, refused unless it reads every token of the
    /// served model's vocabulary (`target`) as that model does: its drafts
    /// are token ids the target verifies. A vocabulary padded at its end
    /// differs only past the ids both hold; the draft never proposes one
    /// the target lacks.
    pub(crate) fn load(
        path: &Path,
        target: &ModelHandle,
        max_requests: usize,
        context: usize,
    ) -> anyhow::Result<Self> {
        let handle = ModelHandle::open(path)
            .with_context(|| format!("the draft model {}", path.display()))?
            .on_device(target.device().clone());
        let (ours, theirs) = (handle.config().vocab, target.config().vocab);
        let shared = ours.min(theirs);
        if shared * 100 < ours.max(theirs) * 95 {
            bail!(
                "the draft model {} has {ours} tokens, the served model {theirs}: give a draft model of the same family (same tokenizer)",
                path.display()
            );
        }
        let (draft_codec, target_codec) = (handle.text()?, target.text()?);
        let differs = (0..shared as u32)
            .find(|id| draft_codec.decode(&[*id]).ok() != target_codec.decode(&[*id]).ok());
        if let Some(id) = differs {
            bail!(
                "the draft model {} reads token {id} otherwise than the served model: give a draft model with the same tokenizer",
                path.display()
            );
        }
        let layers = handle.config().layers;
        let slice = handle
            .load_slice(0..layers)
            .with_context(|| format!("loading the draft model {}", path.display()))?;
        let context = context.min(crate::runtime::serve::shared::engine_context(&handle));
        Ok(Self {
            slice,
            pool: CachePool::new(max_requests, context),
            context,
            vocab: shared,
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        })
    }

    /// Its pool, as a slice of the node's stats: a draft cache a request
    /// failed to give back shows there.
    pub(crate) fn stats(&self) -> crate::runtime::serve::stats::SliceStats {
        crate::runtime::serve::stats::SliceStats {
            role: "draft".into(),
            layer_start: self.slice.range.start,
            layer_end: self.slice.range.end,
            caches_open: self.pool.open_requests() as u64,
            max_requests: self.pool.max_requests() as u64,
            steps: 0,
            passes: 0,
        }
    }
}

/// One request's drafter.
#[derive(Debug)]
pub(crate) enum Drafter {
    Lookup(Lookup),
    Model(ModelDrafter),
}

/// A request's drafts from the draft model: its state, on this task or
/// away on the blocking pool.
#[derive(Debug)]
pub(crate) struct ModelDrafter {
    state: Option<Box<ModelDrafts>>,
    away: Option<JoinHandle<Box<ModelDrafts>>>,
    name: String,
    /// Why it stopped drafting, once it has.
    stopped: Option<String>,
    /// Set when the request has its tokens: a prompt still being taken
    /// stops at its next chunk.
    released: Arc<AtomicBool>,
}

/// A request's place on the draft model: its cache and the tokens in it.
#[derive(Debug)]
struct ModelDrafts {
    model: Arc<DraftModel>,
    request: u64,
    capacity: usize,
    lease: Option<CacheLease>,
    /// The tokens whose positions the cache holds, in order.
    fed: Vec<u32>,
    /// Why the model failed this request: it drafts no more.
    failed: Option<String>,
    released: Arc<AtomicBool>,
}

impl Drafter {
    /// A drafter for request `request` of at most `capacity` positions:
    /// the draft model when there is one, else prompt lookup.
    pub(crate) fn new(model: Option<&Arc<DraftModel>>, request: u64, capacity: usize) -> Self {
        match model {
            Some(model) => {
                let released = Arc::new(AtomicBool::new(false));
                Drafter::Model(ModelDrafter {
                    name: model.name.clone(),
                    state: Some(Box::new(ModelDrafts {
                        model: model.clone(),
                        request,
                        capacity: capacity.min(model.context),
                        lease: None,
                        fed: Vec::new(),
                        failed: None,
                        released: released.clone(),
                    })),
                    away: None,
                    stopped: None,
                    released,
                })
            }
            None => Drafter::Lookup(Lookup::default()),
        }
    }

    /// Where the drafts come from, for the details of a serve.
    pub(crate) fn source(&self) -> String {
        match self {
            Drafter::Lookup(_) => "prompt lookup".into(),
            Drafter::Model(drafter) => match &drafter.stopped {
                None => format!("draft model {}", drafter.name),
                Some(why) => format!("draft model {} (stopped: {why})", drafter.name),
            },
        }
    }

    /// Start taking `history` (the prompt, or a replay) into the draft
    /// model's cache in the background, while the chain prefills it.
    pub(crate) fn prefill(&mut self, history: &[u32]) {
        let Drafter::Model(drafter) = self else {
            return;
        };
        if drafter.away.is_some() {
            return;
        }
        let Some(mut state) = drafter.state.take() else {
            return;
        };
        let history = history.to_vec();
        drafter.away = Some(tokio::task::spawn_blocking(move || {
            let _elsewhere = crate::runtime::serve::batch::elsewhere::Pass::begin();
            state.catch_up(&history);
            state
        }));
    }

    /// Up to `max` tokens to follow `history` (the prompt and every token
    /// so far).
    pub(crate) async fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        let drafter = match self {
            Drafter::Lookup(lookup) => return lookup.propose(history, max),
            Drafter::Model(drafter) => drafter,
        };
        if max == 0 || history.is_empty() {
            return Vec::new();
        }
        // Still taking the prompt: this step goes without a draft rather
        // than keep the chain (and its stages' step timeouts) waiting.
        if drafter
            .away
            .as_ref()
            .is_some_and(|away| !away.is_finished())
        {
            return Vec::new();
        }
        if let Some(away) = drafter.away.take() {
            drafter.state = away.await.ok();
        }
        let Some(mut state) = drafter.state.take() else {
            drafter
                .stopped
                .get_or_insert_with(|| "the draft model's task ended".into());
            return Vec::new();
        };
        // Behind the history by more than the last step gave (its prompt
        // refused by a full pool, a resumed request's replay): it catches
        // up in the background, and this step goes without a draft.
        if history.len() - state.shared_with(history) > INLINE_CATCH_UP {
            drafter.state = Some(state);
            self.prefill(history);
            return Vec::new();
        }
        let history = history.to_vec();
        let done = tokio::task::spawn_blocking(move || {
            let _elsewhere = crate::runtime::serve::batch::elsewhere::Pass::begin();
            let proposed = state.propose(&history, max);
            (state, proposed)
        })
        .await;
        match done {
            Ok((state, proposed)) => {
                if let Some(why) = &state.failed {
                    drafter.stopped.get_or_insert_with(|| why.clone());
                }
                drafter.state = Some(state);
                proposed
            }
            Err(_) => {
                drafter.stopped = Some("the draft model panicked".into());
                Vec::new()
            }
        }
    }

    /// Give the draft cache back (the request has its tokens).
    pub(crate) async fn release(&mut self) {
        if let Drafter::Model(drafter) = self {
            drafter.released.store(true, Ordering::Relaxed);
            if let Some(away) = drafter.away.take() {
                drafter.state = away.await.ok();
            }
            if let Some(state) = drafter.state.as_mut() {
                state.lease = None;
                state.fed.clear();
            }
        }
    }
}

impl ModelDrafts {
    /// Positions of `history` the cache holds (its first ones).
    fn shared_with(&self, history: &[u32]) -> usize {
        self.fed
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Up to `max` drafted tokens; none (and no more for this request
    /// after an engine error) when the model cannot draft now.
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        if self.failed.is_some() {
            return Vec::new();
        }
        match self.try_propose(history, max) {
            Ok(proposed) => proposed,
            // The pool full is for now: the next step tries again.
            Err(Refusal::Busy) => Vec::new(),
            Err(Refusal::Failed(error)) => {
                tracing::warn!(request = self.request, "drafting stopped: {error:#}");
                self.failed = Some(format!("{error:#}"));
                self.lease = None;
                Vec::new()
            }
        }
    }

    /// Take `history` but its last token into the cache.
    fn catch_up(&mut self, history: &[u32]) {
        if self.failed.is_some() || history.len() > self.capacity {
            return;
        }
        let result = self.lease().and_then(|()| {
            self.feed(&history[..history.len().saturating_sub(1)])
                .map_err(Refusal::Failed)
        });
        if let Err(Refusal::Failed(error)) = result {
            tracing::warn!(request = self.request, "drafting stopped: {error:#}");
            self.failed = Some(format!("{error:#}"));
            self.lease = None;
        }
    }

    fn lease(&mut self) -> Result<(), Refusal> {
        if self.lease.is_none() {
            match self
                .model
                .pool
                .open(&self.model.slice, self.request, self.capacity)
            {
                Ok(lease) => self.lease = Some(lease),
                Err(EngineError::Busy(_)) => return Err(Refusal::Busy),
                Err(error) => {
                    return Err(Refusal::Failed(
                        anyhow::Error::new(error).context("a place on the draft model"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Keep the cache's first `positions` positions, and their tokens.
    fn cut_to(&mut self, positions: usize) -> anyhow::Result<()> {
        let lease = self.lease.as_mut().context("the draft cache")?;
        lease.cache().truncate(positions)?;
        self.fed.truncate(positions);
        Ok(())
    }

    /// Make the cache hold exactly `tokens`: cut back to what it shares
    /// with them, then take the rest in bounded passes. The logits of the
    /// last position taken, when any was.
    fn feed(&mut self, tokens: &[u32]) -> anyhow::Result<Option<Vec<f32>>> {
        let common = self.shared_with(tokens);
        self.cut_to(common)?;
        let lease = self.lease.as_mut().context("the draft cache")?;
        let mut logits = None;
        for chunk in tokens[common..].chunks(CATCH_UP_CHUNK) {
            if self.released.load(Ordering::Relaxed) {
                bail!("the request has its tokens");
            }
            let output = self
                .model
                .slice
                .forward(SliceInput::Tokens(chunk), lease.cache())?;
            self.fed.extend_from_slice(chunk);
            let SliceOutput::Logits(last) = output else {
                bail!("the draft model returned no logits");
            };
            logits = Some(last);
        }
        Ok(logits)
    }

    fn try_propose(&mut self, history: &[u32], max: usize) -> Result<Vec<u32>, Refusal> {
        // The draft's last token is never fed: at most `capacity` held.
        let max = max.min((self.capacity + 1).saturating_sub(history.len()));
        if max == 0 {
            return Ok(Vec::new());
        }
        self.lease()?;
        let mut proposed = Vec::with_capacity(max);
        let mut tokens = history.to_vec();
        // Whatever the cache holds past what it shares with the history (a
        // rejected draft's positions) goes, and the last token is fed
        // again if it was held, so the first draft's logits come back.
        let keep = self.shared_with(&tokens).min(tokens.len() - 1);
        self.cut_to(keep).map_err(Refusal::Failed)?;
        while proposed.len() < max {
            let logits = self
                .feed(&tokens)
                .map_err(Refusal::Failed)?
                .context("the draft model took no token")
                .map_err(Refusal::Failed)?;
            let shared = logits.get(..self.model.vocab).unwrap_or(&logits);
            let next = argmax(shared)
                .context("the draft model gave empty logits")
                .map_err(Refusal::Failed)?;
            proposed.push(next);
            tokens.push(next);
        }
        Ok(proposed)
    }
}

/// Why a draft model drafts nothing now.
enum Refusal {
    /// Its pool is full: try again at the next step.
    Busy,
    /// An engine error: no more drafts for this request.
    Failed(anyhow::Error),
}
