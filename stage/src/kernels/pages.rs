//! A slice's weight pages. A decode step streams every weight of a slice
//! once, and in 4 KiB pages that is one TLB entry per 4 KiB: SmolLM2's
//! 97 MB is 24,000 pages a token, far more than the TLB holds, so each
//! step pays a page walk every few kilobytes. The grouped blocks of every
//! matrix a slice runs on the engine's own kernels go instead into one
//! anonymous mapping advised for transparent huge pages (2 MiB each),
//! reserved from the file's sizes before the slice loads. Each matrix is
//! grouped straight into its place, so no load-time copy stays behind.
//!
//! Where the kernel gives no huge pages (transparent huge pages `never`),
//! the mapping is ordinary pages; where it cannot map at all, or a matrix
//! does not fit the reservation, that matrix is held on the heap as
//! before. Pages reserved and never written take no memory.

use std::sync::{Arc, OnceLock};

use memmap2::{MmapMut, MmapOptions};

/// Hand the heap's free pages back to the system. glibc keeps what a
/// program frees for its next allocations; a slice loading frees each
/// tensor's bytes as read once they are grouped into their pages,
/// megabytes a stage would otherwise carry for good. Elsewhere a no-op.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it takes the arenas' locks
    // itself and only releases pages no allocation holds.
    #[allow(unsafe_code)]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Have every thread allocate from glibc's one main arena, called first
/// thing in a process. By default each thread that allocates gets an arena
/// of its own, and `malloc_trim` cannot shorten those: a stage's loading
/// thread and compute threads each kept some 4 MB of freed memory for the
/// process's life (SmolLM2's middle stage, docs/BENCHMARKS.md "A stage's
/// memory"). The engine allocates per operation, not per row, so sharing
/// one arena's lock cost nothing measurable (`bench engine`, 2 threads;
/// not measured on many cores). An operator's own
/// `GLIBC_TUNABLES=glibc.malloc.arena_max=N` is left to rule. Elsewhere a
/// no-op.
pub fn share_one_heap_arena() {
    if std::env::var("GLIBC_TUNABLES").is_ok_and(|tunables| tunables.contains("arena_max")) {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt has no preconditions; an option glibc does not know
    // is refused with a return value, which changes nothing.
    #[allow(unsafe_code)]
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// A transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;
/// Each matrix starts on its own cache line.
const MATRIX_ALIGN: usize = 64;

/// Pages being filled while a slice loads. Each matrix takes the next free
/// bytes; all of them become readable together once the slice has loaded
/// (`seal`).
#[derive(Debug)]
pub struct WeightPages {
    map: Option<MmapMut>,
    used: usize,
    sealed: Arc<OnceLock<MmapMut>>,
}

/// Where a matrix's grouped blocks lie in sealed pages.
#[derive(Debug)]
pub(super) struct Placed {
    pages: Arc<OnceLock<MmapMut>>,
    start: usize,
    len: usize,
}

impl Placed {
    /// The matrix's bytes; `None` until its pages are sealed.
    pub(super) fn bytes(&self) -> Option<&[u8]> {
        self.pages.get()?.get(self.start..self.start + self.len)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl WeightPages {
    /// Room for at most `bytes` of grouped blocks, matrix alignment
    /// included (`room_for`): an upper bound, since what is never written
    /// takes no memory.
    pub fn reserve(bytes: usize) -> Self {
        let map = bytes
            .checked_next_multiple_of(HUGE_PAGE)
            .filter(|len| *len > 0)
            // Not charged against the commit limit: the room past the last
            // matrix, up to a whole huge page, is never written.
            .and_then(|len| {
                MmapOptions::new()
                    .len(len)
                    .no_reserve_swap()
                    .map_anon()
                    .ok()
            });
        // A kernel without transparent huge pages refuses the advice, and
        // other systems have none to give: the mapping then holds ordinary
        // pages.
        #[cfg(target_os = "linux")]
        if let Some(map) = &map {
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Self {
            map,
            ..Self::none()
        }
    }

    /// No pages: every matrix is held on the heap (a slice whose matrices
    /// all run on candle's kernels).
    pub fn none() -> Self {
        Self {
            map: None,
            used: 0,
            sealed: Arc::new(OnceLock::new()),
        }
    }

    /// What one matrix of `len` grouped bytes needs of a reservation.
    pub fn room_for(len: usize) -> usize {
        len.saturating_add(MATRIX_ALIGN)
    }

    /// The next `len` bytes (zeroed), or `None` where the reservation has
    /// no room (the matrix then goes on the heap).
    pub(super) fn take(&mut self, len: usize) -> Option<(Placed, &mut [u8])> {
        let map = self.map.as_mut()?;
        let start = self.used.checked_next_multiple_of(MATRIX_ALIGN)?;
        let end = start.checked_add(len)?;
        let bytes = map.get_mut(start..end)?;
        self.used = end;
        let placed = Placed {
            pages: self.sealed.clone(),
            start,
            len,
        };
        Some((placed, bytes))
    }

    /// Every matrix placed in these pages becomes readable.
    pub fn seal(self) {
        if let Some(map) = self.map {
            // The cell is only ever set here, once, by its one builder.
            let _ = self.sealed.set(map);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placed_bytes_read_back_once_sealed() {
        let mut pages = WeightPages::reserve(WeightPages::room_for(100) * 2);
        let (first, bytes) = pages.take(100).unwrap();
        bytes.fill(7);
        let (second, bytes) = pages.take(100).unwrap();
        bytes[99] = 9;
        assert!(first.bytes().is_none(), "readable before sealing");
        assert_eq!(second.start % MATRIX_ALIGN, 0);
        pages.seal();
        assert_eq!(first.bytes().unwrap(), &[7u8; 100][..]);
        let second = second.bytes().unwrap();
        assert_eq!(second.len(), 100);
        assert!(second[..99].iter().all(|b| *b == 0));
        assert_eq!(second[99], 9);
    }

    #[test]
    fn a_full_reservation_refuses_and_none_holds_nothing() {
        let mut pages = WeightPages::reserve(10);
        // The reservation is whole huge pages.
        assert!(pages.take(HUGE_PAGE).is_some());
        assert!(pages.take(1).is_none());
        assert!(WeightPages::none().take(1).is_none());
        assert!(WeightPages::reserve(0).take(1).is_none());
    }
}
