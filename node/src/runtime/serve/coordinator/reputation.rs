//! Each node's standing with this coordinator: what its audits found. A
//! node whose output failed an audit is left out of plans for a while.

use std::collections::HashMap;
use std::time::Instant;

/// Audits waiting for the one that runs: more sampled requests than that
/// are let go unaudited (counted), so audits never queue up behind load.
pub const MAX_AUDITS_WAITING: usize = 2;

/// What a coordinator has seen of each node.
#[derive(Debug, Default)]
pub(crate) struct Reputation {
    nodes: HashMap<[u8; 32], Standing>,
    pub(crate) audits: Tally,
}

/// Audits so far, by verdict.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tally {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
    pub(crate) unconcluded: u64,
    /// Sampled requests let go unaudited because audits were queued up.
    pub(crate) let_go: u64,
}

/// One node's record.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Standing {
    pub(crate) audits_passed: u64,
    pub(crate) audits_failed: u64,
    /// Left out of plans until then.
    pub(crate) out_until: Option<Instant>,
}

impl Reputation {
    /// The node's output passed an audit.
    pub(crate) fn passed(&mut self, node: [u8; 32]) {
        self.nodes.entry(node).or_default().audits_passed += 1;
    }

    /// The node's output failed an audit: left out of plans until `until`.
    pub(crate) fn failed(&mut self, node: [u8; 32], until: Instant) {
        let standing = self.nodes.entry(node).or_default();
        standing.audits_failed += 1;
        standing.out_until = Some(standing.out_until.map_or(until, |u| u.max(until)));
    }

    /// The nodes left out of plans now, sorted.
    pub(crate) fn left_out(&self, now: Instant) -> Vec<[u8; 32]> {
        let mut out: Vec<[u8; 32]> = self
            .nodes
            .iter()
            .filter(|(_, s)| s.out_until.is_some_and(|until| now < until))
            .map(|(key, _)| *key)
            .collect();
        out.sort_unstable();
        out
    }

    pub(crate) fn standing(&self, node: &[u8; 32]) -> Standing {
        self.nodes.get(node).copied().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_failed_node_is_left_out_until_its_pause_runs_out() {
        let mut reputation = Reputation::default();
        let now = Instant::now();
        reputation.passed([1; 32]);
        reputation.failed([2; 32], now + Duration::from_secs(60));
        assert_eq!(reputation.left_out(now), vec![[2; 32]]);
        assert_eq!(reputation.standing(&[1; 32]).audits_passed, 1);
        assert_eq!(reputation.standing(&[2; 32]).audits_failed, 1);
        assert_eq!(reputation.standing(&[3; 32]), Standing::default());
        assert!(
            reputation
                .left_out(now + Duration::from_secs(61))
                .is_empty()
        );
        // A second failure never shortens the pause.
        reputation.failed([2; 32], now + Duration::from_secs(1));
        assert_eq!(
            reputation.left_out(now + Duration::from_secs(30)),
            vec![[2; 32]]
        );
    }
}
