//! Queue: a request that finds every place at the coordinator taken waits
//! for one, as llama-server's requests wait for a slot, instead of being
//! refused at once. The queue is bounded (`--max-queued`), each request
//! waits at most until its own deadline, and a request past the bound is
//! refused as busy, saying so.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::runtime::client::GenerateRequest;
use crate::runtime::serve::coordinator::admit::{Admitted, admit};
use crate::runtime::serve::coordinator::role::{CoordinatorRole, is_busy};
use crate::runtime::serve::coordinator::runs::Run;
use crate::runtime::serve::shared::Deadline;

/// The default bound on requests waiting for a place at a coordinator.
pub const DEFAULT_MAX_QUEUED: usize = 32;
/// The most a queue may be asked to hold.
pub const MAX_QUEUED: usize = 4096;
/// A waiting request looks again this often even when no request ended
/// (a cache kept for a resume frees its place without one ending).
const RECHECK: Duration = Duration::from_millis(50);

/// The requests waiting for a place.
pub(crate) struct Queue {
    max_queued: usize,
    waiting: AtomicUsize,
    /// A request let go of its places.
    freed: tokio::sync::Notify,
}

/// A request's place in the queue, given back when it is dropped.
struct Waiting<'a>(&'a Queue);

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

    /// A place in the queue, unless `max_queued` requests wait already.
    fn join(&self) -> Option<Waiting<'_>> {
        self.waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_queued).then_some(n + 1)
            })
            .ok()
            .map(|_| Waiting(self))
    }
}

/// Admit `request`, waiting in the queue while every place is taken: until
/// a place comes free, its deadline passes, or (at once) the queue is full.
pub(crate) async fn admit_in_turn<'a>(
    coordinator: &'a Arc<CoordinatorRole>,
    run: &Arc<Run>,
    request: &GenerateRequest,
    deadline: Deadline,
) -> anyhow::Result<Admitted<'a>> {
    let queue = &coordinator.queue;
    let pool = &run.own.pool;
    let mut place = None;
    let mut busy: Option<anyhow::Error> = None;
    loop {
        // Registered before the attempt, so a place freed between a busy
        // answer and the wait is not missed.
        let freed = queue.freed.notified();
        // A waiting request tries again (its prompt read again) only when
        // the own slice has room.
        if busy.is_none() || pool.open_requests() < pool.max_requests() {
            match admit(coordinator, run, request).await {
                Err(error) if is_busy(&error) => busy = Some(error),
                other => return other,
            }
        }
        if place.is_none() {
            place = queue.join();
            if place.is_none() {
                let error = busy.unwrap_or_else(|| anyhow::anyhow!("busy"));
                return Err(error.context(format!(
                    "{} requests wait for a place already (--max-queued)",
                    queue.max_queued
                )));
            }
        }
        if deadline.is_past() {
            let error = busy.unwrap_or_else(|| anyhow::anyhow!("busy"));
            return Err(error.context("no place came free before the request's deadline"));
        }
        let _ = tokio::time::timeout(deadline.bound(RECHECK), freed).await;
    }
}
