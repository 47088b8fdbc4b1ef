//! The engine's compute threads: the calling thread and `threads - 1`
//! workers split a product's pieces through one shared cursor.
//!
//! candle's barrier pool, which this replaces for the engine's own
//! kernels, gives each thread a share of every product and makes the
//! caller spin until each worker signals its share done. Its worker sleeps
//! whenever a chain waits on the network (a step every round trip), and
//! every pass then began by waking it and waiting for it: over a 40 ms
//! link the chain's passes took up to twice their time back to back (three to
//! five times with one async thread; docs/BENCHMARKS.md). Here nobody owns
//! a share: the caller takes pieces until none is left and waits only for
//! workers already inside the product, which are running the piece they
//! took. A worker that wakes late finds the product done and leaves it
//! alone.
//!
//! Idle workers watch for work for [`LINGER`], offering their core to the
//! threads waiting for it every [`YIELD_EVERY`] spins, then sleep: nothing
//! spins while the engine waits for its next step. Holding them watching through
//! a whole pass (woken as it starts) measured slower on a 2-core machine,
//! for decode over a delayed link and for prefill (beside candle's rayon
//! threads, a worker that spins takes a core they need).

use std::any::Any;
use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker watches for the next product before sleeping:
/// longer than the gaps between one pass's products, far shorter than a
/// chain's wait for its next step.
pub const LINGER: Duration = Duration::from_micros(100);

/// Pieces per thread a product is cut into: enough that a thread that
/// arrives late or runs slow leaves little undone at the end, few enough
/// that the shared cursor is not contended.
const PIECES_PER_THREAD: usize = 8;

/// Spins between an idle worker's offers of its core to any thread waiting
/// for one (and its looks at the clock).
const YIELD_EVERY: u32 = 64;

/// Spins waiting for the workers inside a product to leave before the
/// caller yields its core instead (a worker preempted inside a product
/// needs the core to finish its piece).
const SPINS_BEFORE_YIELD: u32 = 1 << 10;

thread_local! {
    /// Set on the pool's workers: a product started on one runs alone
    /// rather than wait on a pool it is part of.
    static IS_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// One product: what runs a range of its items, and the cursor over them.
struct Product {
    /// Calls `data` (the caller's closure) on a range of items.
    run: unsafe fn(*const (), Range<usize>),
    data: *const (),
    items: usize,
    piece: usize,
    cursor: AtomicUsize,
}

impl Product {
    /// Take and run pieces until none is left.
    fn take_pieces(&self) {
        loop {
            let start = self.cursor.fetch_add(self.piece, Ordering::Relaxed);
            if start >= self.items {
                return;
            }
            let end = self.items.min(start + self.piece);
            // SAFETY: `run` is `run_closure::<F>` and `data` points to the
            // `F` that `ComputePool::for_each_piece` borrows for as long as
            // the product is open or any worker is inside it (it returns
            // only after closing it and seeing no worker inside). `F` is
            // `Sync`, so calling it from several threads at once is sound.
            unsafe { (self.run)(self.data, start..end) }
        }
    }
}

/// # Safety
/// `data` must point to a live `F`.
unsafe fn run_closure<F: Fn(Range<usize>) + Sync>(data: *const (), range: Range<usize>) {
    // SAFETY: the caller guarantees `data` is a live `F` (see
    // `Product::take_pieces`).
    let f = unsafe { &*(data as *const F) };
    f(range)
}

/// What the caller and the workers share.
struct Shared {
    /// The open product's generation (counting from 1), 0 when none is.
    open: AtomicU64,
    /// The open product, on the caller's stack; read only by a worker
    /// counted in `inside` that saw `open` unchanged after counting itself.
    product: AtomicPtr<Product>,
    /// Workers inside the open product.
    inside: AtomicUsize,
    /// Workers asleep or about to be: a product wakes them only then
    /// (an unpark of a worker still watching would leave it a token that
    /// cuts its next sleep short).
    sleeping: AtomicUsize,
    /// A worker's panic, rethrown on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    stop: AtomicBool,
}

/// Compute threads shared by every slice of the process ([`pool`]), or by
/// one test.
pub struct ComputePool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes products; holds the last generation used.
    calls: Mutex<u64>,
}

impl std::fmt::Debug for ComputePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputePool")
            .field("threads", &self.threads())
            .finish_non_exhaustive()
    }
}

/// Threads the engine computes on (`CANDLE_NUM_THREADS`, else
/// `RAYON_NUM_THREADS`, else the physical cores).
pub fn compute_threads() -> usize {
    std::env::var("CANDLE_NUM_THREADS")
        .ok()
        .and_then(|threads| threads.parse::<usize>().ok())
        .filter(|&threads| threads > 0)
        .unwrap_or_else(candle_core::utils::get_num_threads)
}

/// The process's compute pool: [`compute_threads`] threads, the
/// caller's among them.
pub fn pool() -> &'static ComputePool {
    static POOL: OnceLock<ComputePool> = OnceLock::new();
    POOL.get_or_init(|| ComputePool::new(compute_threads().saturating_sub(1)))
}

impl ComputePool {
    /// A pool of `workers` threads beside the caller. A worker that cannot
    /// be started is done without: the products still run, on fewer threads.
    pub fn new(workers: usize) -> Self {
        let shared = Arc::new(Shared {
            open: AtomicU64::new(0),
            product: AtomicPtr::new(std::ptr::null_mut()),
            inside: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            panic: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let workers = (0..workers)
            .map_while(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("mesh-compute-{index}"))
                    .spawn(move || work(&shared))
                    .ok()
            })
            .collect();
        Self {
            shared,
            workers,
            calls: Mutex::new(0),
        }
    }

    /// Threads a product runs on: the workers and the caller.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    fn wake(&self) {
        for worker in &self.workers {
            worker.thread().unpark();
        }
    }

    /// Run `f` over `0..items` in pieces, on the calling thread and every
    /// worker that comes for them; returns once every item has run. A
    /// product started while another runs (from another thread) or from
    /// a worker runs on its calling thread alone.
    pub fn for_each_piece<F: Fn(Range<usize>) + Sync>(&self, items: usize, f: F) {
        if items == 0 {
            return;
        }
        if self.workers.is_empty() || items == 1 || IS_WORKER.with(Cell::get) {
            return f(0..items);
        }
        let mut generation = match self.calls.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return f(0..items),
        };
        *generation += 1;
        let product = Product {
            run: run_closure::<F>,
            data: &f as *const F as *const (),
            items,
            piece: items.div_ceil(self.threads() * PIECES_PER_THREAD).max(1),
            cursor: AtomicUsize::new(0),
        };
        self.shared
            .product
            .store(&product as *const Product as *mut Product, Ordering::SeqCst);
        self.shared.open.store(*generation, Ordering::SeqCst);
        // SeqCst both ways: a worker counts itself sleeping and then
        // rereads `open`, so either it sees this product or this load sees
        // it counted.
        if self.shared.sleeping.load(Ordering::SeqCst) != 0 {
            self.wake();
        }
        // Closed on every path out, a panic in `f` included, before
        // `product` and `f` go out of scope.
        let open = Open {
            shared: &self.shared,
            product: &product,
        };
        product.take_pieces();
        drop(open);
        if let Some(payload) = take_panic(&self.shared) {
            std::panic::resume_unwind(payload);
        }
    }
}

impl Drop for ComputePool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.wake();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// The slot a worker's panic waits in (a poisoned lock still gives it).
fn panic_slot(shared: &Shared) -> MutexGuard<'_, Option<Box<dyn Any + Send>>> {
    match shared.panic.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

fn take_panic(shared: &Shared) -> Option<Box<dyn Any + Send>> {
    panic_slot(shared).take()
}

/// An open product: dropping it closes the product and waits until no
/// worker is inside.
struct Open<'a> {
    shared: &'a Shared,
    product: &'a Product,
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        // After a panic on the caller, no worker starts another piece.
        self.product
            .cursor
            .fetch_max(self.product.items, Ordering::Relaxed);
        // Every order here is SeqCst: a worker counts itself in `inside`
        // and then rereads `open`; either that reread sees the product
        // closed, or this load of `inside` sees the worker counted.
        self.shared.open.store(0, Ordering::SeqCst);
        let mut spins = 0u32;
        while self.shared.inside.load(Ordering::SeqCst) != 0 {
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // The caller's own panic is the one that goes on; a worker's from
        // the same product must not surface in a later one.
        if std::thread::panicking() {
            drop(take_panic(self.shared));
        }
    }
}

/// A worker: takes pieces of each product it sees open, watches for the
/// next for [`LINGER`], then sleeps until woken.
fn work(shared: &Shared) {
    IS_WORKER.with(|is| is.set(true));
    let mut seen = 0u64;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        let open = shared.open.load(Ordering::SeqCst);
        if open != 0 && open != seen {
            seen = open;
            shared.inside.fetch_add(1, Ordering::SeqCst);
            if shared.open.load(Ordering::SeqCst) == open {
                // SAFETY: the product `open` names is still open and this
                // worker is counted inside it, so its caller has not
                // returned (it waits for `inside` to reach zero once it
                // closes it) and `product` points to it.
                let product = unsafe { &*shared.product.load(Ordering::SeqCst) };
                let taken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    product.take_pieces()
                }));
                if let Err(payload) = taken {
                    panic_slot(shared).get_or_insert(payload);
                }
            }
            shared.inside.fetch_sub(1, Ordering::SeqCst);
            idle_since = Instant::now();
            spins = 0;
            continue;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(YIELD_EVERY) {
            std::hint::spin_loop();
            continue;
        }
        // A watching worker that never gave up its core held it from
        // threads with work to do whenever the compute threads outnumbered
        // the free cores (several nodes on one machine, candle's rayon
        // threads at prefill): the caller and the workers inside a product
        // waited for cores idle workers spun on (8 threads on 2 cores
        // decoded at 59-89 tok/s, 159-193 yielding). The clock is read as
        // rarely: it costs more than a spin.
        std::thread::yield_now();
        if idle_since.elapsed() < LINGER {
            continue;
        }
        shared.sleeping.fetch_add(1, Ordering::SeqCst);
        let open = shared.open.load(Ordering::SeqCst);
        if open == 0 || open == seen {
            // A wake between the check above and here leaves a token that
            // makes `park` return at once.
            std::thread::park();
        }
        shared.sleeping.fetch_sub(1, Ordering::SeqCst);
        idle_since = Instant::now();
        spins = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sum_of_squares(pool: &ComputePool, items: usize) -> (u64, Vec<u32>) {
        let visits: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
        let total = AtomicU64::new(0);
        pool.for_each_piece(items, |range| {
            for i in range {
                visits[i].fetch_add(1, Ordering::Relaxed);
                total.fetch_add((i as u64) * (i as u64), Ordering::Relaxed);
            }
        });
        (
            total.into_inner(),
            visits.into_iter().map(|v| v.into_inner() as u32).collect(),
        )
    }

    fn expected(items: usize) -> u64 {
        (0..items as u64).map(|i| i * i).sum()
    }

    fn assert_each_item_runs_once(pool: &ComputePool, items: usize, context: &str) {
        let (total, visits) = sum_of_squares(pool, items);
        assert_eq!(total, expected(items), "{context}");
        assert!(visits.iter().all(|&v| v == 1), "{context}");
    }

    /// Over `rounds`, a product of `items` whose `piece` panics fails on
    /// its caller, and the next product runs whole.
    fn assert_panics_reach_the_caller(
        items: usize,
        rounds: usize,
        piece: impl Fn(Range<usize>) + Sync,
    ) {
        let pool = ComputePool::new(2);
        for _ in 0..rounds {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.for_each_piece(items, &piece)
            }));
            assert!(outcome.is_err());
            assert_eq!(sum_of_squares(&pool, 300).0, expected(300));
        }
    }

    #[test]
    fn every_item_runs_exactly_once_on_any_pool() {
        for workers in [0, 1, 3] {
            let pool = ComputePool::new(workers);
            for items in [0, 1, 2, 7, 64, 1000] {
                assert_each_item_runs_once(
                    &pool,
                    items,
                    &format!("{workers} workers, {items} items"),
                );
            }
        }
    }

    #[test]
    fn sleeping_workers_wake_for_products() {
        let pool = ComputePool::new(2);
        for round in 0..20 {
            // Past the linger every other round: the workers have slept.
            if round % 2 == 0 {
                std::thread::sleep(LINGER * 20);
            }
            assert_eq!(sum_of_squares(&pool, 500).0, expected(500));
            assert_eq!(sum_of_squares(&pool, 97).0, expected(97));
        }
    }

    #[test]
    fn a_panic_everywhere_surfaces_once_and_never_in_a_later_product() {
        assert_panics_reach_the_caller(64, 50, |_| {
            std::thread::sleep(Duration::from_micros(20));
            panic!("every piece fails");
        });
    }

    #[test]
    fn callers_on_many_threads_each_get_their_whole_product() {
        let pool = ComputePool::new(2);
        std::thread::scope(|scope| {
            for caller in 0..4 {
                let pool = &pool;
                scope.spawn(move || {
                    for round in 0..300 {
                        let items = 1 + (caller * 37 + round * 11) % 200;
                        assert_each_item_runs_once(pool, items, &format!("caller {caller}"));
                    }
                });
            }
        });
    }

    #[test]
    fn a_panic_in_a_piece_reaches_the_caller_and_the_pool_still_works() {
        assert_panics_reach_the_caller(400, 20, |range| {
            if range.contains(&399) {
                panic!("piece failed");
            }
        });
    }

    #[test]
    fn a_product_started_inside_a_piece_runs_there() {
        let pool = ComputePool::new(2);
        let total = AtomicU64::new(0);
        pool.for_each_piece(16, |outer| {
            for _ in outer {
                pool.for_each_piece(10, |inner| {
                    total.fetch_add(inner.len() as u64, Ordering::Relaxed);
                });
            }
        });
        assert_eq!(total.into_inner(), 160);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn pieces_cover_the_items_once(workers in 0usize..4, items in 0usize..5000) {
            let pool = ComputePool::new(workers);
            let (total, visits) = sum_of_squares(&pool, items);
            prop_assert_eq!(total, expected(items));
            prop_assert!(visits.iter().all(|&v| v == 1));
        }
    }
}
