//! One node's part of one request on a split, sans I/O: the lanes it folds
//! and the stage block it seals at the end. The serving code (real frames
//! off QUIC streams) and the vector generator's simulated run (generated
//! frames) both build their lanes and blocks here, so the two cannot drift.

use crate::block::{
    DirectReturn, Downstream, ReturnMode, Side, SplitKey, StageBlock, TerminalState, Tokens,
    Upstream,
};
use crate::fold::{Lane, LaneContext, LaneFold};

/// Which request, on which split: what every lane and block of it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestScope {
    pub split: SplitKey,
    pub stage_count: u32,
    pub return_mode: ReturnMode,
}

/// What a stage block says about the node's slice: its assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceFacts {
    pub topology_hash: String,
    pub stage_index: u32,
    pub layer_start: u32,
    /// Exclusive.
    pub layer_end: u32,
    pub package_id: [u8; 32],
    pub manifest_sha256: [u8; 32],
    pub source_model_sha256: [u8; 32],
}

/// The lanes a node folded, as digests: `upstream` for every stage but the
/// coordinator, `downstream` for every node that opened the next hop, and
/// the direct return where the return mode is direct.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HopDigests {
    pub upstream: Option<Upstream>,
    pub downstream: Option<Downstream>,
    pub direct_return: Option<DirectReturn>,
}

impl RequestScope {
    /// A fresh fold of one lane of this request: `hop` is the upstream
    /// node's stage index for `forward`/`reply`, the final stage's for
    /// `direct_return`.
    pub fn lane(&self, hop: u32, lane: Lane) -> LaneFold {
        LaneFold::new(&LaneContext {
            salt: b"",
            coordinator_node_id: &self.split.coordinator_node_id,
            run_id: &self.split.run_id,
            request_id: self.split.request_id,
            hop_index: hop,
            lane,
        })
    }

    /// The final stage's index: the hop of the direct-return lane.
    pub fn final_stage(&self) -> u32 {
        self.stage_count.saturating_sub(1)
    }

    /// This node's stage block: the coordinator's (stage 0) or a stage's,
    /// with what it folded, how many tokens it handled and how the request
    /// ended as it saw it.
    pub fn block(
        &self,
        slice: &SliceFacts,
        lanes: HopDigests,
        tokens: Tokens,
        terminal_state: TerminalState,
    ) -> StageBlock {
        StageBlock {
            side: if slice.stage_index == 0 {
                Side::Coordinator
            } else {
                Side::Stage
            },
            coordinator_node_id: self.split.coordinator_node_id.clone(),
            run_id: self.split.run_id.clone(),
            request_id: self.split.request_id,
            topology_hash: slice.topology_hash.clone(),
            stage_index: slice.stage_index,
            stage_count: self.stage_count,
            layer_start: slice.layer_start,
            layer_end: slice.layer_end,
            package_id: slice.package_id,
            manifest_sha256: slice.manifest_sha256,
            source_model_sha256: slice.source_model_sha256,
            return_mode: self.return_mode,
            upstream: lanes.upstream,
            downstream: lanes.downstream,
            direct_return: lanes.direct_return,
            tokens: Some(tokens),
            terminal_state,
            coordinator_term: None,
            data_path_observed: None,
            coordinator_observed: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope() -> RequestScope {
        RequestScope {
            split: SplitKey {
                coordinator_node_id: "did:key:z6MkCoordinator".into(),
                run_id: "run".into(),
                request_id: 7,
            },
            stage_count: 3,
            return_mode: ReturnMode::Direct,
        }
    }

    fn facts(stage_index: u32) -> SliceFacts {
        SliceFacts {
            topology_hash: "ab".repeat(32),
            stage_index,
            layer_start: stage_index * 2,
            layer_end: stage_index * 2 + 2,
            package_id: [1; 32],
            manifest_sha256: [2; 32],
            source_model_sha256: [3; 32],
        }
    }

    #[test]
    fn a_lane_names_its_request_and_hop() {
        let scope = scope();
        let context = |hop, lane| LaneContext {
            salt: b"",
            coordinator_node_id: "did:key:z6MkCoordinator",
            run_id: "run",
            request_id: 7,
            hop_index: hop,
            lane,
        };
        for (hop, lane) in [
            (0, Lane::Forward),
            (1, Lane::Reply),
            (2, Lane::DirectReturn),
        ] {
            let mut ours = scope.lane(hop, lane);
            let mut theirs = LaneFold::new(&context(hop, lane));
            ours.push_frame(b"frame");
            theirs.push_frame(b"frame");
            assert_eq!(ours.digest(), theirs.digest());
        }
        // Another hop is another lane.
        assert_ne!(
            scope.lane(0, Lane::Forward).digest(),
            scope.lane(1, Lane::Forward).digest()
        );
        assert_eq!(scope.final_stage(), 2);
    }

    #[test]
    fn the_coordinators_block_and_a_stages_differ_only_where_they_should() {
        let scope = scope();
        let tokens = Tokens {
            prefill_received: 5,
            decode: 3,
        };
        let own = scope.block(
            &facts(0),
            HopDigests::default(),
            tokens,
            TerminalState::Completed,
        );
        let stage = scope.block(
            &facts(2),
            HopDigests::default(),
            tokens,
            TerminalState::TimedOut,
        );
        assert_eq!((own.side, stage.side), (Side::Coordinator, Side::Stage));
        assert_eq!((stage.stage_index, stage.layer_start), (2, 4));
        assert_eq!(stage.terminal_state, TerminalState::TimedOut);
        assert_eq!(own.split_key(), stage.split_key());
        assert_eq!(own.stage_count, 3);
        assert_eq!(own.return_mode, ReturnMode::Direct);
    }
}
