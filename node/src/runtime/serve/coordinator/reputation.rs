//! Each node's standing with this coordinator: what its audits found, and
//! how fast its steps ran against the speed it advertises. A node whose
//! output failed an audit is left out of plans for a while; one whose
//! steps run well below its advertised speed is planned at what it showed,
//! discounted again by how much it over-claimed.

use std::collections::HashMap;
use std::time::Instant;

use mesh_protocol::plan::Candidate;

use crate::runtime::journal::Judgement;
use crate::runtime::steward::Judged;

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
    /// Its decode time per layer per token, as its steps ran (a running
    /// mean over requests, each new one weighing a quarter), and the advert
    /// it was set against.
    pub(crate) measured_us_per_layer: Option<u64>,
    pub(crate) advertised_us_per_layer: Option<u64>,
    /// Requests measured.
    pub(crate) measured_requests: u64,
    /// Steps it stalled on past the step timeout.
    pub(crate) stalls: u64,
    /// Assignments it refused (each leaves it out for a short pause,
    /// `REFUSED_MEMBER_PAUSE`, kept by the planner).
    pub(crate) refusals: u64,
    /// Left out for a stall (not an audit) until then.
    pub(crate) stalled_until: Option<Instant>,
}

/// How many times its advertised decode time a node's measured time may
/// be before it counts as over-claiming (its steps share cores and
/// batches with other work, which its advert's measurement did not), as a
/// ratio of integers: 2/1.
const OVERCLAIM_TOLERANCE: (u64, u64) = (2, 1);

/// Requests measured before a node can count as over-claiming: one slow
/// request is not a lie.
const MEASURED_BEFORE_JUDGED: u64 = 2;

impl Reputation {
    /// The standing a steward's journalled judgements give at `now_ms`
    /// (the coordinator's on start): counts, and the nodes still left out.
    pub(crate) fn from_judged<'a>(
        judged: impl IntoIterator<Item = &'a Judged>,
        now_ms: u64,
    ) -> Self {
        let mut reputation = Self::default();
        let now = Instant::now();
        for j in judged {
            let until = now + std::time::Duration::from_millis(j.until_ms.saturating_sub(now_ms));
            match j.judgement {
                Judgement::AuditPassed => reputation.passed(j.node),
                Judgement::AuditFailed => reputation.failed(j.node, until),
                Judgement::Stalled => reputation.stalled(j.node, until),
            }
        }
        reputation
    }

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

    /// What a request's decode steps took at `node` per layer per token,
    /// against the `advertised` figure its advert gave then.
    pub(crate) fn measured(&mut self, node: [u8; 32], advertised: u64, measured: u64) {
        let standing = self.nodes.entry(node).or_default();
        let mean = standing
            .measured_us_per_layer
            .map_or(measured, |before| before / 4 * 3 + measured / 4);
        standing.measured_us_per_layer = Some(mean.max(1));
        standing.advertised_us_per_layer = Some(advertised.max(1));
        standing.measured_requests += 1;
    }

    /// The decode time per layer each over-claiming node is planned at,
    /// sorted by node: a node whose measured time is past
    /// `OVERCLAIM_TOLERANCE` times its advert is planned at the measured
    /// time, times the ratio it over-claimed by (measured² / advertised),
    /// so a liar is planned below an honest node of the speed it showed.
    /// Others are planned at their advert.
    pub(crate) fn planned_speeds(&self) -> Vec<([u8; 32], u64)> {
        let (over, under) = OVERCLAIM_TOLERANCE;
        let mut planned: Vec<([u8; 32], u64)> = self
            .nodes
            .iter()
            .filter(|(_, s)| s.measured_requests >= MEASURED_BEFORE_JUDGED)
            .filter_map(|(node, s)| {
                let (measured, advertised) = (s.measured_us_per_layer?, s.advertised_us_per_layer?);
                (measured.saturating_mul(under) > advertised.saturating_mul(over))
                    .then(|| (*node, measured.saturating_mul(measured) / advertised.max(1)))
            })
            .collect();
        planned.sort_unstable();
        planned
    }

    /// Plan each over-claimer in `members` at the speed it showed,
    /// discounted (`planned_speeds`, sorted by node).
    pub(crate) fn discount(
        members: &mut [(Candidate, Option<mesh_protocol::plan::LeftOut>)],
        planned_speeds: &[([u8; 32], u64)],
    ) {
        for (candidate, _) in members {
            if let Ok(i) = planned_speeds.binary_search_by(|(node, _)| node.cmp(&candidate.node_id))
            {
                candidate.decode_us_per_layer = planned_speeds[i].1;
            }
        }
    }

    /// The node refused an assignment.
    pub(crate) fn refused(&mut self, node: [u8; 32]) {
        self.nodes.entry(node).or_default().refusals += 1;
    }

    /// The node stalled on a step past the step timeout: left out of plans
    /// until `until`.
    pub(crate) fn stalled(&mut self, node: [u8; 32], until: Instant) {
        let standing = self.nodes.entry(node).or_default();
        standing.stalls += 1;
        standing.stalled_until = Some(standing.stalled_until.map_or(until, |u| u.max(until)));
    }

    /// The nodes left out of plans now for a failed audit, sorted.
    pub(crate) fn left_out(&self, now: Instant) -> Vec<[u8; 32]> {
        self.left_out_by(now, |s| s.out_until)
    }

    /// The nodes left out of plans now for a stall, sorted.
    pub(crate) fn stalled_out(&self, now: Instant) -> Vec<[u8; 32]> {
        self.left_out_by(now, |s| s.stalled_until)
    }

    fn left_out_by(
        &self,
        now: Instant,
        until: impl Fn(&Standing) -> Option<Instant>,
    ) -> Vec<[u8; 32]> {
        let mut out: Vec<[u8; 32]> = self
            .nodes
            .iter()
            .filter(|(_, s)| until(s).is_some_and(|until| now < until))
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

    #[test]
    fn the_journalled_judgements_give_the_same_standing_after_a_restart() {
        let at = |node: u8, judgement, at_ms, until_ms| Judged {
            node: [node; 32],
            judgement,
            at_ms,
            until_ms,
        };
        let journalled = [
            at(1, Judgement::AuditPassed, 1_000, 1_000),
            // Still out at 10 s: failed at 5 s for an hour.
            at(2, Judgement::AuditFailed, 5_000, 3_605_000),
            // Out until 8 s: back in by 10 s.
            at(3, Judgement::Stalled, 2_000, 8_000),
            at(4, Judgement::Stalled, 9_000, 609_000),
        ];
        let reputation = Reputation::from_judged(&journalled, 10_000);
        let now = Instant::now();
        assert_eq!(reputation.left_out(now), vec![[2; 32]]);
        assert_eq!(reputation.stalled_out(now), vec![[4; 32]]);
        assert_eq!(reputation.standing(&[1; 32]).audits_passed, 1);
        assert_eq!(reputation.standing(&[3; 32]).stalls, 1);
    }

    #[test]
    fn an_over_claimer_is_planned_below_an_honest_node_of_the_speed_it_showed() {
        let mut reputation = Reputation::default();
        // Both run at 900 us a layer; one said so, one claimed 300.
        for _ in 0..2 {
            reputation.measured([1; 32], 900, 900);
            reputation.measured([2; 32], 300, 900);
        }
        // Within the tolerance: planned at the advert.
        reputation.measured([3; 32], 500, 700);
        reputation.measured([3; 32], 500, 700);
        assert_eq!(reputation.planned_speeds(), vec![([2; 32], 2700)]);
        // A mean over requests: one slow request does not flag a node.
        reputation.measured([3; 32], 500, 1400);
        assert_eq!(reputation.planned_speeds().len(), 1);
        // One request is not judged.
        reputation.measured([4; 32], 100, 900);
        assert_eq!(reputation.planned_speeds().len(), 1);
    }

    /// Issue 41: two members that run alike, one advertising 3x the speed
    /// it shows. On its advert it gets more layers than the honest one;
    /// once its steps were measured, fewer.
    #[test]
    fn an_over_claimer_gets_fewer_layers_than_an_honest_equal_one() {
        use mesh_protocol::plan::{ModelShape, Stages, plan};
        let node = |id: u8, us: u64| Candidate {
            node_id: [id; 32],
            memory_bytes: 1 << 30,
            decode_us_per_layer: us,
            rtt_us: 1_000,
            kv_scale: 1,
            rtts: Vec::new(),
            relayed_by: None,
        };
        let model = ModelShape {
            layer_bytes: vec![1_000; 30],
            head_bytes: 10_000,
            kv_bytes_per_layer: 100,
        };
        let coordinator = node(0, 900);
        let (honest, liar) = ([1; 32], [2; 32]);
        let mut members = vec![(node(1, 900), None), (node(2, 300), None)];
        let layers_of = |plan: &mesh_protocol::plan::Plan, id: [u8; 32]| {
            plan.stages
                .iter()
                .find(|s| s.node_id == id)
                .map_or(0, |s| s.layers.len())
        };
        let believed = plan(&model, &coordinator, &members, Stages::Pinned(3)).unwrap();
        assert!(layers_of(&believed, liar) > layers_of(&believed, honest));
        let mut reputation = Reputation::default();
        for _ in 0..MEASURED_BEFORE_JUDGED {
            reputation.measured(honest, 900, 950);
            reputation.measured(liar, 300, 900);
        }
        Reputation::discount(&mut members, &reputation.planned_speeds());
        let measured = plan(&model, &coordinator, &members, Stages::Pinned(3)).unwrap();
        assert!(
            layers_of(&measured, liar) < layers_of(&measured, honest),
            "{measured:?}"
        );
    }
}
