//! KV caches for concurrent requests on one slice, bounded: at most
//! `max_requests` open at once, each at most `max_tokens` positions.
//!
//! The pool only admits. Each request owns its cache through a
//! [`CacheLease`], so requests on one slice run their forward passes at the
//! same time (the slice's weights are shared and read-only), and a cache is
//! freed, and its place in the pool given back, when its lease is dropped:
//! on every path out of a request, an error, a panic or a cancelled task
//! included.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{EngineError, Result};
use crate::model::{LayerSlice, SliceCache};

/// Admission for one slice's in-flight requests.
#[derive(Debug)]
pub struct CachePool {
    max_requests: usize,
    max_tokens: usize,
    open: Arc<Mutex<HashSet<u64>>>,
}

/// One request's cache, and its place in the pool until dropped.
#[derive(Debug)]
pub struct CacheLease {
    request: u64,
    cache: SliceCache,
    open: Arc<Mutex<HashSet<u64>>>,
}

fn lock(open: &Mutex<HashSet<u64>>) -> MutexGuard<'_, HashSet<u64>> {
    // The set stays consistent whatever panicked while it was held: every
    // change to it is a single insert or remove.
    open.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl CachePool {
    pub fn new(max_requests: usize, max_tokens: usize) -> Self {
        Self {
            max_requests,
            max_tokens,
            open: Arc::new(Mutex::new(HashSet::new())),
        }
    }

    /// Open a cache for `request` holding up to `tokens` positions. A
    /// request id already open on this slice is refused: one request, one
    /// cache.
    pub fn open(&self, slice: &LayerSlice, request: u64, tokens: usize) -> Result<CacheLease> {
        if tokens > self.max_tokens {
            return Err(EngineError::ContextExceeded {
                tokens,
                max_new: 0,
                context: self.max_tokens,
            });
        }
        {
            let mut open = lock(&self.open);
            if open.contains(&request) {
                return Err(EngineError::AlreadyOpen(request));
            }
            if open.len() >= self.max_requests {
                return Err(EngineError::Busy(self.max_requests));
            }
            open.insert(request);
        }
        // The place is taken before the cache is built, so two requests
        // cannot both pass the bound; a failed build gives it back.
        match slice.new_cache(tokens) {
            Ok(cache) => Ok(CacheLease {
                request,
                cache,
                open: self.open.clone(),
            }),
            Err(error) => {
                lock(&self.open).remove(&request);
                Err(error)
            }
        }
    }

    /// Requests holding a cache on this slice now.
    pub fn open_requests(&self) -> usize {
        lock(&self.open).len()
    }

    pub fn max_requests(&self) -> usize {
        self.max_requests
    }
}

impl CacheLease {
    pub fn request(&self) -> u64 {
        self.request
    }

    pub fn cache(&mut self) -> &mut SliceCache {
        &mut self.cache
    }

    /// Positions the cache holds.
    pub fn positions(&self) -> usize {
        self.cache.position()
    }

    /// Hand the cache to another request of the same pool (a resumed
    /// request carries on from the positions its earlier segment built):
    /// the pool counts it once, under the new id. An id already open is
    /// refused and the lease is left as it was.
    pub fn rekey(&mut self, request: u64) -> Result<()> {
        let mut open = lock(&self.open);
        if request != self.request {
            if open.contains(&request) {
                return Err(EngineError::AlreadyOpen(request));
            }
            open.remove(&self.request);
            open.insert(request);
            self.request = request;
        }
        Ok(())
    }
}

impl Drop for CacheLease {
    fn drop(&mut self) {
        lock(&self.open).remove(&self.request);
    }
}
