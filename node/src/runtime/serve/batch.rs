//! Continuous batching: one worker per slice runs the forward passes of the
//! slice's requests. Whatever steps are waiting when it finishes one pass go
//! into the next together (requests join and leave between passes), so the
//! weights are read once for all of them. Each request keeps its own cache,
//! positions and frames; the engine gives each the bits it gets alone.
//! On the coordinator the same worker runs the output head over the final
//! hidden states that came back, all waiting requests' rows in one pass.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mesh_protocol::stage_frame::MAX_DECODE_ROWS;
use mesh_stage::cache::CacheLease;
use mesh_stage::frame::Activations;
use mesh_stage::model::MAX_BATCH_ROWS;
use mesh_stage::{EngineError, LayerSlice, SliceInput, SliceOutput};
use tokio::sync::{mpsc, oneshot};

use crate::runtime::energy::Bill;

/// One request's next positions.
#[derive(Debug)]
pub(super) enum StepInput {
    /// Token ids (the first slice).
    Tokens(Vec<u32>),
    /// Hidden states from the previous slice.
    Hidden(Activations),
}

impl StepInput {
    fn as_input(&self) -> SliceInput<'_> {
        match self {
            StepInput::Tokens(ids) => SliceInput::Tokens(ids),
            StepInput::Hidden(activations) => SliceInput::Hidden(activations),
        }
    }
}

/// A step's output, its cache, and how long the engine took over the pass
/// that ran it (a batched step waited for the whole pass; the queue and
/// the hand-offs to and from the worker are not in it).
type Done = Result<(SliceOutput, CacheLease, Duration), EngineError>;

struct Job {
    input: StepInput,
    /// The request's cache travels with its step and comes back with the
    /// output; if the request has gone when the step is done, it is
    /// dropped there, which frees it.
    lease: CacheLease,
    /// A decode step: each of its rows (the token sampled and the draft
    /// after it) gets the bits it gets decoded alone.
    decode: bool,
    /// What the pass is charged to, by this step's rows.
    bill: Option<Bill>,
    reply: oneshot::Sender<Done>,
}

/// One request's final hidden states (a row per position to sample), for
/// the output head.
struct HeadJob {
    hidden: Activations,
    bill: Option<Bill>,
    reply: oneshot::Sender<HeadDone>,
}

/// Each row's logits, and how long the engine took over the pass.
type HeadDone = Result<(Vec<Vec<f32>>, Duration), EngineError>;

enum Work {
    Step(Job),
    Head(HeadJob),
}

/// A slice's batch worker; it ends when its last handle is dropped.
#[derive(Debug)]
pub(crate) struct Batcher {
    jobs: mpsc::Sender<Work>,
    counts: Arc<Counts>,
}

/// Steps run and forward passes they took: their ratio is the mean batch.
#[derive(Debug, Default)]
struct Counts {
    steps: AtomicU64,
    passes: AtomicU64,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("request", &self.lease.request())
            .finish()
    }
}

impl Batcher {
    /// A worker for `slice`. Each request has at most one step or head row
    /// waiting, so the queue needs no more room than the requests the slice
    /// admits.
    pub(super) fn start(slice: Arc<LayerSlice>, max_requests: usize) -> Self {
        let (jobs, queue) = mpsc::channel(max_requests.max(1));
        let counts = Arc::new(Counts::default());
        tokio::spawn(work(slice, queue, counts.clone()));
        Self { jobs, counts }
    }

    /// Steps run so far, and the forward passes they took.
    pub(super) fn steps_and_passes(&self) -> (u64, u64) {
        (
            self.counts.steps.load(Ordering::Relaxed),
            self.counts.passes.load(Ordering::Relaxed),
        )
    }

    /// Run one step of one request, batched with whatever else is waiting;
    /// `decode` for a decode step, whose rows each get the bits they get
    /// decoded alone (a prefill chunk's rows go through the matrices
    /// together). The pass's energy is charged to `bill`, by its rows.
    pub(super) async fn step(
        &self,
        input: StepInput,
        lease: CacheLease,
        decode: bool,
        bill: Option<Bill>,
    ) -> Done {
        let (reply, done) = oneshot::channel();
        let request = lease.request();
        let gone = || EngineError::WrongInput("lost its batch worker");
        self.jobs
            .send(Work::Step(Job {
                input,
                lease,
                decode,
                bill,
                reply,
            }))
            .await
            .map_err(|_| gone())?;
        done.await.map_err(|_| {
            tracing::warn!(request, "a batch step ended without a reply");
            gone()
        })?
    }

    /// The logits of each row of one request's final hidden states,
    /// through the output head the slice holds, batched with the other
    /// requests' rows waiting; each row gets the bits it gets alone. With
    /// them, how long the engine took over the pass.
    pub(super) async fn logits(&self, hidden: Activations, bill: Option<Bill>) -> HeadDone {
        let (reply, done) = oneshot::channel();
        let gone = || EngineError::WrongInput("lost its batch worker");
        self.jobs
            .send(Work::Head(HeadJob {
                hidden,
                bill,
                reply,
            }))
            .await
            .map_err(|_| gone())?;
        done.await.map_err(|_| gone())?
    }
}

/// The longest pass a batch worker runs on its async worker thread. The
/// runtime's other workers take this thread's queued tasks meanwhile; a
/// pass expected to take longer goes through `block_in_place`, which hands
/// this worker's queue to another thread first. That hand-off wakes a
/// thread which then competes with the pass for the cores, and cost a
/// split decode step more than the wait it spares on a small machine
/// (docs/BENCHMARKS.md, "A pass on the thread that received its step").
const PASS_IN_PLACE_LIMIT: Duration = Duration::from_millis(20);

async fn work(slice: Arc<LayerSlice>, mut queue: mpsc::Receiver<Work>, counts: Arc<Counts>) {
    // What a one-row step's row and a head row took in the last pass of
    // each kind (a coordinator's worker runs both, at different costs),
    // from which the next pass's time is expected; none before the first.
    let mut per_step_row: Option<Duration> = None;
    let mut per_head_row: Option<Duration> = None;
    while let Some(first) = queue.recv().await {
        let mut waiting = vec![first];
        while let Ok(work) = queue.try_recv() {
            waiting.push(work);
        }
        let (mut steps, mut heads) = (Vec::new(), Vec::new());
        for work in waiting {
            match work {
                Work::Step(job) => steps.push(job),
                Work::Head(job) => heads.push(job),
            }
        }
        // Steps of one row each (decode steps without a draft) and the
        // head's rows run on the calling thread without candle's pool
        // (`LayerSlice::runs_on_calling_thread`).
        let step_rows = steps.len();
        let head_rows: usize = heads.iter().map(|head| head.hidden.rows).sum();
        let one_row = slice.runs_on_calling_thread(steps.iter().map(Job::rows))
            && slice.runs_on_calling_thread(std::iter::repeat_n(1, head_rows));
        let mut run_all = || {
            let start = Instant::now();
            for batch in batches(&slice, std::mem::take(&mut steps)) {
                counts
                    .steps
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                counts.passes.fetch_add(1, Ordering::Relaxed);
                run(&slice, batch);
            }
            let steps_took = start.elapsed();
            if !heads.is_empty() {
                run_heads(&slice, std::mem::take(&mut heads));
            }
            (steps_took, start.elapsed() - steps_took)
        };
        let expected = |per_row: Option<Duration>, rows: usize| match rows {
            0 => Some(Duration::ZERO),
            _ => per_row
                .map(|per_row| per_row.saturating_mul(u32::try_from(rows).unwrap_or(u32::MAX))),
        };
        let in_place = one_row
            && elsewhere::idle()
            && expected(per_step_row, step_rows)
                .zip(expected(per_head_row, head_rows))
                .is_some_and(|(steps, head)| steps + head <= PASS_IN_PLACE_LIMIT);
        let (steps_took, head_took) = if in_place {
            run_all()
        } else {
            let _elsewhere = elsewhere::Pass::begin();
            tokio::task::block_in_place(run_all)
        };
        if one_row {
            let per_row =
                |took: Duration, rows: usize| took / u32::try_from(rows).unwrap_or(u32::MAX);
            if step_rows > 0 {
                per_step_row = Some(per_row(steps_took, step_rows));
            }
            if head_rows > 0 {
                per_head_row = Some(per_row(head_took, head_rows));
            }
        }
        if in_place {
            // The replies woke their requests' tasks onto this worker,
            // where no other worker takes the first of them: let them run
            // before the next pass.
            tokio::task::yield_now().await;
        }
    }
}

/// Forward passes running off the async workers (through `block_in_place`,
/// or a draft model's on a blocking thread). While one runs, candle's
/// barrier pool (candle's quantized matrices) may be held by it between
/// its products, and a pass in place would wait for that on the async
/// worker, stalling every task behind it; the engine's compute pool would
/// not stall it, but would leave its products to the async worker alone.
/// No pass runs in place meanwhile.
pub(super) mod elsewhere {
    use std::sync::atomic::{AtomicUsize, Ordering};

    static RUNNING: AtomicUsize = AtomicUsize::new(0);

    /// No pass runs off the async workers.
    pub fn idle() -> bool {
        RUNNING.load(Ordering::Acquire) == 0
    }

    /// A pass off the async workers, counted until dropped.
    #[derive(Debug)]
    pub struct Pass(());

    impl Pass {
        /// Also binds the GPU's context here: a blocking thread runs only
        /// the runtime's start hook, perhaps before the GPU was opened.
        pub fn begin() -> Self {
            crate::runtime::bind_gpu_to_this_thread();
            RUNNING.fetch_add(1, Ordering::AcqRel);
            Pass(())
        }
    }

    impl Drop for Pass {
        fn drop(&mut self) {
            RUNNING.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The output head over every waiting row in one pass. A job of the wrong
/// shape gets its error at once; an engine error (or panic) fails the pass.
fn run_heads(slice: &LayerSlice, jobs: Vec<HeadJob>) {
    let hidden = slice.config().hidden;
    let mut rows = Vec::with_capacity(jobs.len());
    for job in jobs {
        let shape = &job.hidden;
        if (1..=MAX_DECODE_ROWS).contains(&shape.rows)
            && shape.cols == hidden
            && shape.values.len() == shape.rows * hidden
        {
            rows.push(job);
        } else {
            let _ = job.reply.send(Err(EngineError::WrongInput(
                "was given final hidden states that are not a decode step's rows (a token and its draft) of the model's width",
            )));
        }
    }
    if rows.is_empty() {
        return;
    }
    let stacked = Activations {
        rows: rows.iter().map(|job| job.hidden.rows).sum(),
        cols: hidden,
        values: rows
            .iter()
            .flat_map(|job| job.hidden.values.iter().copied())
            .collect(),
    };
    let charged: Vec<_> = rows
        .iter()
        .filter_map(|job| Some(job.bill.as_ref()?.computing(job.hidden.rows as u64)))
        .collect();
    let start = Instant::now();
    let outputs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| slice.logits(&stacked)));
    let took = start.elapsed();
    drop(charged);
    match outputs {
        Ok(Ok(logits)) if logits.len() == stacked.rows => {
            let mut logits = logits.into_iter();
            for job in rows {
                let own: Vec<Vec<f32>> = logits.by_ref().take(job.hidden.rows).collect();
                let _ = job.reply.send(Ok((own, took)));
            }
        }
        outcome => {
            let why = match outcome {
                Ok(Err(error)) => error.to_string(),
                Err(_) => "the engine panicked".to_string(),
                Ok(Ok(_)) => "the head returned the wrong number of rows".to_string(),
            };
            tracing::error!(rows = rows.len(), "an output head pass failed: {why}");
            for job in rows {
                let _ = job
                    .reply
                    .send(Err(EngineError::Compute(format!("output head: {why}"))));
            }
        }
    }
}

impl Job {
    fn rows(&self) -> usize {
        self.input.as_input().rows()
    }
}

/// The waiting steps in passes: a step that cannot run (malformed, or past
/// its cache's capacity) gets its error at once and touches no cache; the
/// others share passes of at most `MAX_BATCH_ROWS` rows, and a step longer
/// than that (a prefill chunk) runs alone, so each gets the kernels, and the
/// bits, it gets alone.
fn batches(slice: &LayerSlice, waiting: Vec<Job>) -> Vec<Vec<Job>> {
    let mut passes: Vec<Vec<Job>> = Vec::new();
    let mut shared: Vec<Job> = Vec::new();
    let mut shared_rows = 0;
    for mut job in waiting {
        if let Err(error) = slice.check_step(&job.input.as_input(), job.lease.cache()) {
            let _ = job.reply.send(Err(error));
            continue;
        }
        let rows = job.rows();
        if rows > MAX_BATCH_ROWS {
            passes.push(vec![job]);
            continue;
        }
        if shared_rows + rows > MAX_BATCH_ROWS {
            passes.push(std::mem::take(&mut shared));
            shared_rows = 0;
        }
        shared_rows += rows;
        shared.push(job);
    }
    if !shared.is_empty() {
        passes.push(shared);
    }
    passes
}

/// One pass. Every step was checked, so an error (or a panic) here is the
/// engine's, mid-pass, with caches possibly half advanced: every step of
/// the pass fails, and dropping their leases frees those caches.
fn run(slice: &LayerSlice, mut batch: Vec<Job>) {
    // The pass's energy is charged to its steps' serves by their rows.
    let charged: Vec<_> = batch
        .iter()
        .filter_map(|job| Some(job.bill.as_ref()?.computing(job.rows() as u64)))
        .collect();
    let start = Instant::now();
    let outputs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let decode: Vec<bool> = batch.iter().map(|job| job.decode).collect();
        let mut steps: Vec<(SliceInput<'_>, &mut mesh_stage::SliceCache)> = batch
            .iter_mut()
            .map(|job| (job.input.as_input(), job.lease.cache()))
            .collect();
        slice.forward_batch_rows(&mut steps, &decode)
    }));
    let took = start.elapsed();
    drop(charged);
    match outputs {
        Ok(Ok(outputs)) if outputs.len() == batch.len() => {
            for (job, output) in batch.into_iter().zip(outputs) {
                let _ = job.reply.send(Ok((output, job.lease, took)));
            }
        }
        outcome => {
            let why = match outcome {
                Ok(Err(error)) => error.to_string(),
                Err(_) => "the engine panicked".to_string(),
                Ok(Ok(_)) => "the engine returned the wrong number of outputs".to_string(),
            };
            tracing::error!(steps = batch.len(), "a forward pass failed: {why}");
            for job in batch {
                let _ = job
                    .reply
                    .send(Err(EngineError::Compute(format!("forward pass: {why}"))));
            }
        }
    }
}
