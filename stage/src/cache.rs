//! KV caches for concurrent requests on one slice, owned outside the model
//! and bounded: at most `max_requests` open at once, each at most
//! `max_tokens` positions. A request's cache is freed when it is released.

use std::collections::HashMap;

use crate::error::{EngineError, Result};
use crate::model::{LayerSlice, SliceCache};

/// The caches of one slice's in-flight requests.
#[derive(Debug)]
pub struct CachePool {
    max_requests: usize,
    max_tokens: usize,
    caches: HashMap<u64, SliceCache>,
}

impl CachePool {
    pub fn new(max_requests: usize, max_tokens: usize) -> Self {
        Self {
            max_requests,
            max_tokens,
            caches: HashMap::new(),
        }
    }

    /// Open a cache for `request` holding up to `tokens` positions.
    pub fn open(&mut self, slice: &LayerSlice, request: u64, tokens: usize) -> Result<()> {
        if tokens > self.max_tokens {
            return Err(EngineError::ContextExceeded {
                tokens,
                max_new: 0,
                context: self.max_tokens,
            });
        }
        if !self.caches.contains_key(&request) && self.caches.len() >= self.max_requests {
            return Err(EngineError::Busy(self.max_requests));
        }
        self.caches.insert(request, slice.new_cache(tokens)?);
        Ok(())
    }

    pub fn get_mut(&mut self, request: u64) -> Result<&mut SliceCache> {
        self.caches
            .get_mut(&request)
            .ok_or(EngineError::UnknownRequest(request))
    }

    /// Free a request's cache; true when it was open.
    pub fn release(&mut self, request: u64) -> bool {
        self.caches.remove(&request).is_some()
    }

    pub fn open_requests(&self) -> usize {
        self.caches.len()
    }
}
