//! Bounds on what strangers can cause at will: events (a refused request,
//! a refused assignment) recorded at most so many a minute, so a flood of
//! them cannot grow a journal or a log without bound; and the source
//! address per-source bounds count by.

use std::net::IpAddr;
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

/// Where a connection comes from, as per-source bounds count it (the HTTP
/// API's slots and shares, the mesh's handshakes): an IPv4 address, or an
/// IPv6 address's /64 (what one host is usually given).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source(IpAddr);

impl Source {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Source(IpAddr::V4(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source(IpAddr::V4(v4)),
                None => {
                    let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                    Source(IpAddr::V6(prefix.into()))
                }
            },
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IpAddr::V6(v6) => write!(f, "{v6}/64"),
            ip => write!(f, "{ip}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_source_is_its_64() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::of(a), Source::of(b));
        assert_ne!(Source::of(a), Source::of(c));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(Source::of(mapped), Source::of(IpAddr::from([10, 0, 0, 1])));
    }

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
