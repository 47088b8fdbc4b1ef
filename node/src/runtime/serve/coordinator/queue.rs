//! Queue: a request that finds every place at the coordinator taken waits
//! for one (`admit::admit_in_turn`), as llama-server's requests wait for a slot, instead of being
//! refused at once. The queue is bounded (`--max-queued`), each request
//! waits at most until its own deadline, and a request past the bound is
//! refused as busy, saying so. A node shutting down closes its queue:
//! new requests, and those waiting, are refused, saying so.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// The default bound on requests waiting for a place at a coordinator.
pub const DEFAULT_MAX_QUEUED: usize = 32;
/// The most a queue may be asked to hold.
pub const MAX_QUEUED: usize = 4096;
/// A waiting request looks again this often even when no request ended
/// (a cache kept for a resume frees its place without one ending).
pub(crate) const RECHECK: Duration = Duration::from_millis(50);

/// The requests waiting for a place.
pub(crate) struct Queue {
    max_queued: usize,
    waiting: AtomicUsize,
    /// A request let go of its places.
    freed: tokio::sync::Notify,
    /// The node is shutting down: no request joins, and those waiting are
    /// refused.
    closed: AtomicBool,
}

/// A request's place in the queue, given back when it is dropped.
pub(crate) struct Waiting<'a>(&'a Queue);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Queue {
    pub(crate) fn new(max_queued: usize) -> Self {
        Self {
            max_queued: max_queued.min(MAX_QUEUED),
            waiting: AtomicUsize::new(0),
            freed: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
        }
    }

    /// Requests waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// A request ended or let go of its places: the waiting look again.
    pub(crate) fn freed(&self) {
        self.freed.notify_waiters();
    }

    /// Take no new request; wake those waiting, to be refused.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.freed.notify_waiters();
    }

    /// Whether the node is shutting down.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    pub(crate) fn max_queued(&self) -> usize {
        self.max_queued
    }

    /// Wakes when a request lets go of its places.
    pub(crate) fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// A place in the queue, unless `max_queued` requests wait already.
    pub(crate) fn join(&self) -> Option<impl Drop + '_> {
        self.waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_queued).then_some(n + 1)
            })
            .ok()
            .map(|_| Waiting(self))
    }
}

/// Why a request was refused by a node shutting down.
pub(crate) const SHUTTING_DOWN: &str =
    "shutting down: this node takes no new requests; send the request to another node";
