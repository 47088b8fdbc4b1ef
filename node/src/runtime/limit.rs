//! Events a stranger can cause at will (a refused request, a refused
//! assignment) are recorded at most so many a minute: a flood of them must
//! not grow a journal or a log without bound.

use std::time::{Duration, Instant};

/// Lets at most `limit` events through a minute; the rest are counted, and
/// the next one let through says how many were not.
#[derive(Debug)]
pub struct PerMinute {
    limit: u32,
    window: Option<Instant>,
    in_window: u32,
    skipped: u64,
}

impl PerMinute {
    pub const fn new(limit: u32) -> Self {
        Self {
            limit,
            window: None,
            in_window: 0,
            skipped: 0,
        }
    }

    /// Whether this event is let through; when it is, how many before it
    /// were not.
    pub fn admit(&mut self, now: Instant) -> Option<u64> {
        let fresh = self
            .window
            .is_none_or(|start| now.duration_since(start) >= Duration::from_secs(60));
        if fresh {
            self.window = Some(now);
            self.in_window = 0;
        }
        if self.in_window >= self.limit {
            self.skipped += 1;
            return None;
        }
        self.in_window += 1;
        Some(std::mem::take(&mut self.skipped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_so_many_a_minute_are_let_through_and_the_rest_counted() {
        let mut limit = PerMinute::new(3);
        let start = Instant::now();
        for _ in 0..3 {
            assert_eq!(limit.admit(start), Some(0));
        }
        assert_eq!(limit.admit(start), None);
        assert_eq!(limit.admit(start + Duration::from_secs(59)), None);
        assert_eq!(limit.admit(start + Duration::from_secs(60)), Some(2));
        assert_eq!(limit.admit(start + Duration::from_secs(61)), Some(0));
    }
}
