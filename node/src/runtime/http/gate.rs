//! Requests the API hands to its coordinator, shared fairly between
//! sources.
//!
//! Every request being generated holds a KV cache at the coordinator, and
//! a slice holds only `max_requests` of them. Without a gate the first
//! comers take them all: fifty clients of one stranger flooding the API,
//! or a few streams whose readers stopped reading, and everyone else is
//! answered 429. So each source (`conn::Source`) may have at most a
//! quarter of the caches in flight; a request past its source's quota, or
//! one that finds every cache taken, waits in its source's queue, and a
//! cache given back goes to the next source in turn (round robin), not to
//! whoever asks first. Queues are bounded per source and in all, and a
//! request waits at most `QUEUE_WAIT`: past any bound it is answered 429
//! with `Retry-After`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use super::conn::Source;
use crate::runtime::clock::lock;

/// Requests one source may have waiting for a cache.
pub const MAX_QUEUED_PER_SOURCE: usize = 16;
/// Requests waiting for a cache, all sources together.
pub const MAX_QUEUED: usize = 512;
/// How long a request waits for a cache before it is answered 429.
pub const QUEUE_WAIT: Duration = Duration::from_secs(60);

/// Why a request was not given a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// Its source has `MAX_QUEUED_PER_SOURCE` requests waiting already.
    SourceQueue,
    /// `MAX_QUEUED` requests are waiting already.
    Queue,
    /// It waited `QUEUE_WAIT` without its turn coming.
    Waited,
    /// The node is shutting down: it takes no new requests.
    Closed,
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Full::SourceQueue => write!(
                f,
                "{MAX_QUEUED_PER_SOURCE} requests from your address wait already; retry when one is answered"
            ),
            Full::Queue => write!(f, "{MAX_QUEUED} requests wait already; retry later"),
            Full::Waited => write!(
                f,
                "no cache came free within {} s; retry later",
                QUEUE_WAIT.as_secs()
            ),
            Full::Closed => write!(
                f,
                "this node is shutting down and takes no new requests; send it to another node"
            ),
        }
    }
}

#[derive(Default)]
struct State {
    in_flight: usize,
    per_source: HashMap<Source, usize>,
    /// Each source's waiting requests, oldest first.
    queues: HashMap<Source, VecDeque<oneshot::Sender<Pass>>>,
    /// Sources with waiting requests, in the order their turns come.
    turns: VecDeque<Source>,
    queued: usize,
    /// Shutting down: nothing joins, and nobody waits.
    closed: bool,
}

/// The gate of one API (a clone is the same gate).
#[derive(Clone)]
pub struct Gate {
    state: Arc<Mutex<State>>,
    capacity: usize,
    quota: usize,
}

/// What a request found at the gate.
pub enum Joined {
    /// A cache, at once.
    Admitted(Pass),
    /// A place in the queue.
    Queued(Queued),
}

/// A request waiting for a cache.
pub struct Queued {
    ahead: usize,
    receiver: oneshot::Receiver<Pass>,
}

impl Queued {
    /// Requests that were waiting when this one joined.
    pub fn ahead(&self) -> usize {
        self.ahead
    }

    /// Wait, at most `QUEUE_WAIT`, for the cache.
    pub async fn wait(self) -> Result<Pass, Full> {
        match tokio::time::timeout(QUEUE_WAIT, self.receiver).await {
            Ok(Ok(pass)) => Ok(pass),
            // The gate closed: its sender was dropped unsent.
            Ok(Err(_)) => Err(Full::Closed),
            // A pass sent after the wait ended is dropped with the
            // receiver, which gives its cache back.
            Err(_) => Err(Full::Waited),
        }
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("capacity", &self.capacity)
            .field("quota", &self.quota)
            .finish_non_exhaustive()
    }
}

/// A cache held by one request; given back (to the next source in turn)
/// when dropped.
pub struct Pass {
    state: Arc<Mutex<State>>,
    source: Source,
    capacity: usize,
    quota: usize,
    /// Whether dropping it gives a cache back (not for one that was never
    /// handed over).
    armed: bool,
}

impl State {
    fn take(&mut self, source: Source) {
        self.in_flight += 1;
        *self.per_source.entry(source).or_default() += 1;
    }

    fn may_take(&self, source: Source, capacity: usize, quota: usize) -> bool {
        self.in_flight < capacity && self.per_source.get(&source).copied().unwrap_or(0) < quota
    }

    /// Hand free caches to waiting requests, one source after another,
    /// skipping sources at their quota. Runs under the state's lock: a
    /// pass that cannot be delivered is disarmed, never dropped armed here.
    fn hand_over(&mut self, shared: &Arc<Mutex<State>>, capacity: usize, quota: usize) {
        let mut looked = 0;
        while self.in_flight < capacity && looked < self.turns.len() {
            let Some(source) = self.turns.pop_front() else {
                break;
            };
            if !self.may_take(source, capacity, quota) {
                self.turns.push_back(source);
                looked += 1;
                continue;
            }
            looked = 0;
            while let Some(waiter) = self.queues.get_mut(&source).and_then(VecDeque::pop_front) {
                self.queued -= 1;
                self.take(source);
                let pass = Pass {
                    state: shared.clone(),
                    source,
                    capacity,
                    quota,
                    armed: true,
                };
                match waiter.send(pass) {
                    Ok(()) => break,
                    // It stopped waiting (timed out, or its client left).
                    Err(mut pass) => {
                        pass.armed = false;
                        self.give_back(source);
                    }
                }
            }
            if self.queues.get(&source).is_some_and(|q| !q.is_empty()) {
                self.turns.push_back(source);
            } else {
                self.queues.remove(&source);
            }
        }
    }

    /// Forget the waiters whose request went away (its client left, or it
    /// stopped waiting): they hold no place in the bounds, and are not
    /// counted ahead of anyone.
    fn forget_the_gone(&mut self) {
        let mut forgotten = 0;
        self.queues.retain(|_, queue| {
            let before = queue.len();
            queue.retain(|waiter| !waiter.is_closed());
            forgotten += before - queue.len();
            !queue.is_empty()
        });
        if forgotten > 0 {
            self.queued -= forgotten;
            let queues = &self.queues;
            self.turns.retain(|source| queues.contains_key(source));
        }
    }

    fn give_back(&mut self, source: Source) {
        self.in_flight -= 1;
        if let Some(count) = self.per_source.get_mut(&source) {
            *count -= 1;
            if *count == 0 {
                self.per_source.remove(&source);
            }
        }
    }
}

impl Gate {
    /// A gate over `capacity` caches, each source holding at most a
    /// quarter of them (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            state: Arc::default(),
            capacity,
            quota: (capacity / 4).max(1),
        }
    }

    /// Requests holding a cache now.
    pub(crate) fn in_flight(&self) -> usize {
        lock(&self.state).in_flight
    }

    /// Wait for a cache for a request from `source`, in turn.
    #[cfg(test)]
    pub async fn enter(&self, source: Source) -> Result<Pass, Full> {
        match self.join(source)? {
            Joined::Admitted(pass) => Ok(pass),
            Joined::Queued(queued) => queued.wait().await,
        }
    }

    /// A cache for a request from `source` now, or its place in the queue
    /// (refused when the queues are full).
    pub fn join(&self, source: Source) -> Result<Joined, Full> {
        let mut state = lock(&self.state);
        if state.closed {
            return Err(Full::Closed);
        }
        state.forget_the_gone();
        let queued_here = state.queues.get(&source).map_or(0, VecDeque::len);
        if queued_here == 0 && state.may_take(source, self.capacity, self.quota) {
            state.take(source);
            return Ok(Joined::Admitted(self.pass(source)));
        }
        if queued_here >= MAX_QUEUED_PER_SOURCE {
            return Err(Full::SourceQueue);
        }
        if state.queued >= MAX_QUEUED {
            return Err(Full::Queue);
        }
        let (sender, receiver) = oneshot::channel();
        if queued_here == 0 {
            state.turns.push_back(source);
        }
        state.queues.entry(source).or_default().push_back(sender);
        let ahead = state.queued;
        state.queued += 1;
        Ok(Joined::Queued(Queued { ahead, receiver }))
    }

    /// Take no request from now on; those waiting are answered `Closed`
    /// (those holding a cache run on).
    pub fn close(&self) {
        let mut state = lock(&self.state);
        state.closed = true;
        state.queues.clear();
        state.turns.clear();
        state.queued = 0;
    }

    fn pass(&self, source: Source) -> Pass {
        Pass {
            state: self.state.clone(),
            source,
            capacity: self.capacity,
            quota: self.quota,
            armed: true,
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut state = lock(&self.state);
        state.give_back(self.source);
        state.hand_over(&self.state, self.capacity, self.quota);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    fn source(last: u8) -> Source {
        Source::of(IpAddr::from([127, 0, 0, last]))
    }

    #[tokio::test]
    async fn a_source_holds_at_most_its_quota_and_turns_alternate() {
        let gate = Gate::new(8);
        let flooder = source(9);
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(gate.enter(flooder).await.unwrap());
        }
        // The flooder's third waits, though caches are free.
        let waiting = tokio::time::timeout(Duration::from_millis(50), gate.enter(flooder)).await;
        assert!(waiting.is_err(), "past its quota a source waits");
        // Another source is served at once.
        let other = gate.enter(source(2)).await.unwrap();
        assert_eq!(gate.in_flight(), 3);
        drop(other);
        drop(held);
        assert_eq!(gate.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_freed_cache_goes_to_the_next_source_in_turn() {
        let gate = Arc::new(Gate::new(4));
        // Four sources hold every cache.
        let mut held: Vec<Pass> = Vec::new();
        for s in 10..14 {
            held.push(gate.enter(source(s)).await.unwrap());
        }
        // Source 10 (at its quota of one) queues two more, then source 2
        // queues one.
        let queue = |s| {
            let gate = gate.clone();
            tokio::spawn(async move { gate.enter(source(s)).await.map(|_pass| s) })
        };
        let flood = [queue(10), queue(10)];
        tokio::time::sleep(Duration::from_millis(20)).await;
        let fair = queue(2);
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Source 11 gives back: source 10 is first in line but at its
        // quota, so the cache goes to source 2.
        held.remove(1);
        assert_eq!(fair.await.unwrap(), Ok(2));
        let first = tokio::time::timeout(Duration::from_secs(1), async {
            for task in flood {
                if task.await.unwrap().is_ok() {
                    return true;
                }
            }
            false
        });
        drop(held);
        assert!(first.await.unwrap_or(false));
    }

    #[tokio::test]
    async fn a_waiter_whose_client_left_holds_no_place() {
        let gate = Gate::new(1);
        let held = gate.enter(source(9)).await.unwrap();
        // A source fills its queue, and its clients all leave.
        let mut left = Vec::new();
        for _ in 0..MAX_QUEUED_PER_SOURCE {
            match gate.join(source(9)) {
                Ok(Joined::Queued(queued)) => left.push(queued),
                _ => panic!("the queue had room"),
            }
        }
        assert!(matches!(gate.join(source(9)), Err(Full::SourceQueue)));
        drop(left);
        // Their places are free again, and nobody is counted ahead.
        let Ok(Joined::Queued(next)) = gate.join(source(9)) else {
            panic!("a waiter that left still held its place");
        };
        assert_eq!(next.ahead(), 0);
        drop(held);
        assert!(
            next.wait().await.is_ok(),
            "the cache went to the one still waiting"
        );
    }

    #[tokio::test]
    async fn a_closed_gate_takes_nobody_and_wakes_the_waiting() {
        let gate = Gate::new(1);
        let held = gate.enter(source(9)).await.unwrap();
        let Ok(Joined::Queued(waiting)) = gate.join(source(2)) else {
            panic!("the second request waits");
        };
        gate.close();
        assert_eq!(waiting.wait().await.err(), Some(Full::Closed));
        assert!(matches!(gate.join(source(3)), Err(Full::Closed)));
        // The one holding a cache runs on, and gives it back.
        assert_eq!(gate.in_flight(), 1);
        drop(held);
        assert_eq!(gate.in_flight(), 0);
    }

    #[tokio::test]
    async fn queues_are_bounded() {
        let gate = Arc::new(Gate::new(1));
        let _held = gate.enter(source(9)).await.unwrap();
        let mut waiting = Vec::new();
        for _ in 0..MAX_QUEUED_PER_SOURCE {
            let gate = gate.clone();
            waiting.push(tokio::spawn(
                async move { gate.enter(source(9)).await.is_ok() },
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(gate.enter(source(9)).await.err(), Some(Full::SourceQueue));
        for task in waiting {
            task.abort();
        }
    }
}
