//! Caches a resume can keep. When a coordinator loses a stage mid-request
//! and plans a new chain, a surviving stage that holds the same layers in
//! the new chain need not rebuild its cache: the resumed request takes over
//! the cache the interrupted one built. Each request a stage admits is
//! registered here; a request that ends in a failure parks its cache for
//! [`PARK_TTL`]; a resumed request of the same coordinator on the same
//! loaded slice supersedes the interrupted one (which then ends at once,
//! even while its dead upstream still looks open) and takes the cache.
//!
//! Bounds: one entry per request the stage's pools admit; a parked cache
//! keeps its place in its pool, and is given back at the TTL (swept with
//! the node's idle-slice check), when a new request would otherwise be
//! refused as busy (the oldest first), when its slice is released or
//! replaced, or when taken. An entry does not keep its slice loaded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::runtime::clock::lock;
use anyhow::{Context, bail};
use mesh_stage::LayerSlice;
use mesh_stage::cache::CacheLease;
use tokio::sync::{Notify, oneshot};

/// How long a failed request's cache waits for a resume to take it.
pub const PARK_TTL: Duration = Duration::from_secs(30);

/// What a request running on a stage holds of its entry. Dropped without
/// parking (a request that completed, was refused, or whose task ended),
/// it takes the entry away.
pub(crate) struct KeepHandle {
    /// Told when a resumed request takes the cache over.
    pub superseded: Arc<Notify>,
    park: Option<oneshot::Sender<CacheLease>>,
    key: ([u8; 32], u64),
    entries: Entries,
}

impl KeepHandle {
    /// The request ended. A failed one with positions in its cache parks
    /// it for a resume (or hands it to the resume that already claimed
    /// it); otherwise the cache is freed here.
    pub fn release(mut self, cache: Option<CacheLease>, failed: bool) {
        let Some(cache) = cache.filter(|cache| failed && cache.positions() > 0) else {
            return;
        };
        let mut entries = lock(&self.entries);
        if let Some(park) = self.park.take() {
            // To the claimer's receiver, or into the entry's own: held
            // there, or freed when the entry goes.
            let _ = park.send(cache);
        }
        if let Some(entry) = entries
            .get_mut(&self.key)
            .filter(|entry| Arc::ptr_eq(&entry.superseded, &self.superseded))
        {
            entry.expires = Some(Instant::now() + PARK_TTL);
        }
    }
}

impl Drop for KeepHandle {
    fn drop(&mut self) {
        if self.park.is_some() {
            let mut entries = lock(&self.entries);
            // Only this request's own entry, not one registered since
            // under the same id.
            if entries.get(&self.key).is_some_and(|entry| {
                entry.expires.is_none() && Arc::ptr_eq(&entry.superseded, &self.superseded)
            }) {
                entries.remove(&self.key);
            }
        }
    }
}

/// Entries by coordinator and request id.
type Entries = Arc<Mutex<HashMap<([u8; 32], u64), Entry>>>;

struct Entry {
    /// The slice the cache is on: compared, never kept loaded.
    slice: Weak<LayerSlice>,
    superseded: Arc<Notify>,
    /// Where the cache arrives once the request lets it go; taken by the
    /// resume that claims it.
    parked: Option<oneshot::Receiver<CacheLease>>,
    /// When a parked cache is given back.
    expires: Option<Instant>,
}

/// Every admitted request's entry, by coordinator and request id.
#[derive(Default)]
pub(crate) struct KeptCaches {
    entries: Entries,
}

impl KeptCaches {
    /// Register a request just admitted on `slice`.
    pub fn register(
        &self,
        coordinator: [u8; 32],
        request_id: u64,
        slice: &Arc<LayerSlice>,
    ) -> KeepHandle {
        let superseded = Arc::new(Notify::new());
        let (park, parked) = oneshot::channel();
        let key = (coordinator, request_id);
        lock(&self.entries).insert(
            key,
            Entry {
                slice: Arc::downgrade(slice),
                superseded: superseded.clone(),
                parked: Some(parked),
                expires: None,
            },
        );
        KeepHandle {
            superseded,
            park: Some(park),
            key,
            entries: self.entries.clone(),
        }
    }

    /// Take the cache of `coordinator`'s request `request_id` on `slice`:
    /// the request, if it still runs, is told to end, and its cache is
    /// awaited for up to `wait`.
    pub async fn take(
        &self,
        coordinator: [u8; 32],
        request_id: u64,
        slice: &Arc<LayerSlice>,
        wait: Duration,
    ) -> anyhow::Result<CacheLease> {
        let parked = {
            let mut entries = lock(&self.entries);
            let key = (coordinator, request_id);
            let Some(entry) = entries.get_mut(&key) else {
                bail!("no cache of request {request_id} is kept here");
            };
            if !std::ptr::eq(entry.slice.as_ptr(), Arc::as_ptr(slice)) {
                bail!("the cache of request {request_id} is on other layers");
            }
            let parked = entry
                .parked
                .take()
                .with_context(|| format!("the cache of request {request_id} was taken already"))?;
            entry.superseded.notify_one();
            entries.remove(&key);
            parked
        };
        match tokio::time::timeout(wait, parked).await {
            Ok(Ok(cache)) => Ok(cache),
            Ok(Err(_)) => bail!("request {request_id} ended without keeping its cache"),
            Err(_) => bail!(
                "request {request_id} did not let its cache go within {} ms",
                wait.as_millis()
            ),
        }
    }

    /// End `coordinator`'s request `request_id` if it still runs here, and
    /// free its cache, waiting up to `wait` for the request to let it go
    /// (so its place in the pool is free when this returns): a resumed
    /// request that does not keep it says the interrupted one is over.
    pub async fn end(&self, coordinator: [u8; 32], request_id: u64, wait: Duration) {
        let parked = {
            let mut entries = lock(&self.entries);
            let Some(mut entry) = entries.remove(&(coordinator, request_id)) else {
                return;
            };
            entry.superseded.notify_one();
            entry.parked.take()
        };
        if let Some(parked) = parked {
            // The cache, if it comes, is dropped here: freed.
            let _ = tokio::time::timeout(wait, parked).await;
        }
    }

    /// Give back every parked cache past its time.
    pub fn expire(&self) {
        let now = Instant::now();
        let gone: Vec<Entry> = {
            let mut entries = lock(&self.entries);
            let keys: Vec<_> = entries
                .iter()
                .filter(|(_, entry)| entry.expires.is_some_and(|at| at <= now))
                .map(|(key, _)| *key)
                .collect();
            keys.iter().filter_map(|key| entries.remove(key)).collect()
        };
        drop(gone);
    }

    /// Give back every parked cache on `slice` (released or replaced).
    /// How many went.
    pub fn evict_parked_on(&self, slice: &Arc<LayerSlice>) -> usize {
        let gone: Vec<Entry> = {
            let mut entries = lock(&self.entries);
            let keys: Vec<_> = entries
                .iter()
                .filter(|(_, entry)| {
                    entry.expires.is_some()
                        && std::ptr::eq(entry.slice.as_ptr(), Arc::as_ptr(slice))
                })
                .map(|(key, _)| *key)
                .collect();
            keys.iter().filter_map(|key| entries.remove(key)).collect()
        };
        gone.len()
    }

    /// Give back the parked cache on `slice` that has waited longest, so a
    /// new request is not refused for room a resume may never claim.
    /// Whether there was one.
    pub fn evict_oldest_on(&self, slice: &Arc<LayerSlice>) -> bool {
        let gone = {
            let mut entries = lock(&self.entries);
            let oldest = entries
                .iter()
                .filter(|(_, entry)| std::ptr::eq(entry.slice.as_ptr(), Arc::as_ptr(slice)))
                .filter_map(|(key, entry)| Some((entry.expires?, *key)))
                .min()
                .map(|(_, key)| key);
            oldest.and_then(|key| entries.remove(&key))
        };
        gone.is_some()
    }

    /// Caches parked now, waiting for a resume.
    pub fn parked(&self) -> usize {
        lock(&self.entries)
            .values()
            .filter(|entry| entry.expires.is_some())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_stage::cache::CachePool;
    use mesh_stage::{ModelHandle, SliceInput};

    const COORDINATOR: [u8; 32] = [7; 32];

    fn slice(dir: &std::path::Path) -> Arc<LayerSlice> {
        let model = mesh_stage::synthetic::write_synthetic(
            dir,
            &mesh_stage::synthetic::SyntheticSpec::default(),
            &[candle_core::quantized::GgmlDType::F32],
        )
        .unwrap();
        let handle =
            ModelHandle::open(model.gguf(candle_core::quantized::GgmlDType::F32).unwrap()).unwrap();
        Arc::new(handle.load_slice(0..2).unwrap())
    }

    fn lease(pool: &CachePool, slice: &LayerSlice, request: u64, positions: usize) -> CacheLease {
        let mut lease = pool.open(slice, request, 32).unwrap();
        let ids: Vec<u32> = (1..=positions as u32).collect();
        slice
            .forward(SliceInput::Tokens(&ids), lease.cache())
            .unwrap();
        lease
    }

    #[tokio::test]
    async fn a_failed_requests_cache_waits_for_its_resume_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let slice = slice(dir.path());
        let other_slice = self::slice(&dir.path().join("other"));
        let pool = CachePool::new(4, 64);
        let kept = KeptCaches::default();
        let wait = Duration::from_millis(200);

        // Failed with positions: parked, and taken once, by its coordinator
        // on its slice.
        let handle = kept.register(COORDINATOR, 1, &slice);
        handle.release(Some(lease(&pool, &slice, 1, 5)), true);
        assert_eq!(kept.parked(), 1);
        assert_eq!(pool.open_requests(), 1);
        assert!(kept.take([8; 32], 1, &slice, wait).await.is_err());
        assert!(kept.take(COORDINATOR, 1, &other_slice, wait).await.is_err());
        let taken = kept.take(COORDINATOR, 1, &slice, wait).await.unwrap();
        assert_eq!(taken.positions(), 5);
        assert_eq!(kept.parked(), 0);
        assert!(kept.take(COORDINATOR, 1, &slice, wait).await.is_err());
        drop(taken);
        assert_eq!(pool.open_requests(), 0);

        // Completed: nothing kept, the entry gone.
        let handle = kept.register(COORDINATOR, 2, &slice);
        handle.release(Some(lease(&pool, &slice, 2, 3)), false);
        assert_eq!(pool.open_requests(), 0);
        assert!(kept.take(COORDINATOR, 2, &slice, wait).await.is_err());

        // A request whose task ended without releasing leaves nothing.
        drop(kept.register(COORDINATOR, 3, &slice));
        assert!(kept.take(COORDINATOR, 3, &slice, wait).await.is_err());

        // Parked caches give their places back to a new request.
        for request in 10..12 {
            kept.register(COORDINATOR, request, &slice)
                .release(Some(lease(&pool, &slice, request, 2)), true);
        }
        assert_eq!(kept.evict_parked_on(&other_slice), 0);
        assert!(kept.evict_oldest_on(&slice));
        assert_eq!(kept.parked(), 1);
        assert_eq!(pool.open_requests(), 1);
        assert_eq!(kept.evict_parked_on(&slice), 1);
        assert!(!kept.evict_oldest_on(&slice));
        assert_eq!(pool.open_requests(), 0);
        assert_eq!(kept.parked(), 0);
    }

    #[tokio::test]
    async fn a_resume_ends_the_request_that_still_holds_the_cache_and_takes_it() {
        let dir = tempfile::tempdir().unwrap();
        let slice = slice(dir.path());
        let pool = CachePool::new(4, 64);
        let kept = Arc::new(KeptCaches::default());
        // The interrupted request still runs: told it is superseded, it lets
        // its cache go as a failure.
        let handle = kept.register(COORDINATOR, 1, &slice);
        let cache = lease(&pool, &slice, 1, 4);
        let running = tokio::spawn(async move {
            handle.superseded.notified().await;
            handle.release(Some(cache), true);
        });
        let taken = kept
            .take(COORDINATOR, 1, &slice, Duration::from_secs(5))
            .await
            .unwrap();
        running.await.unwrap();
        assert_eq!(taken.positions(), 4);
        assert_eq!(kept.parked(), 0);

        // Ended by a resume that keeps nothing: the cache is freed.
        let handle = kept.register(COORDINATOR, 2, &slice);
        let cache = lease(&pool, &slice, 2, 4);
        let running = tokio::spawn(async move {
            handle.superseded.notified().await;
            handle.release(Some(cache), true);
        });
        kept.end(COORDINATOR, 2, Duration::from_secs(5)).await;
        // Its place is free once `end` returns.
        assert_eq!(pool.open_requests(), 1);
        running.await.unwrap();
        assert_eq!(kept.parked(), 0);
        drop(taken);
        assert_eq!(pool.open_requests(), 0);
    }

    #[tokio::test]
    async fn a_parked_cache_is_given_back_at_its_time() {
        let dir = tempfile::tempdir().unwrap();
        let slice = slice(dir.path());
        let pool = CachePool::new(4, 64);
        let kept = KeptCaches::default();
        kept.register(COORDINATOR, 1, &slice)
            .release(Some(lease(&pool, &slice, 1, 2)), true);
        kept.expire();
        assert_eq!(kept.parked(), 1);
        if let Some(entry) = lock(&kept.entries).get_mut(&(COORDINATOR, 1)) {
            entry.expires = Some(Instant::now());
        }
        kept.expire();
        assert_eq!(kept.parked(), 0);
        assert_eq!(pool.open_requests(), 0);
    }
}
