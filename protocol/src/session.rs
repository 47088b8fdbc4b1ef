//! One node's part of one request on a split, sans I/O: the lanes it folds
//! and the stage block it seals at the end. The serving code (real frames
//! off QUIC streams) and the vector generator's simulated run (generated
//! frames) both fold through a [`HopSession`] and build their blocks here,
//! so the two cannot drift, and no other code folds lane bytes: the async
//! code only moves bytes in and out, and hands each frame to the session
//! with the way it travelled ([`Wire`]).

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

/// How a frame travelled, as the node folding it sees it: each is one lane
/// of one hop of the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// Read from the stage before: that hop's `forward` lane.
    FromUpstream,
    /// Written to the stage before: that hop's `reply` lane.
    ToUpstream,
    /// Written to the next stage: this node's hop's `forward` lane.
    ToDownstream,
    /// Read from the next stage: this node's hop's `reply` lane.
    FromDownstream,
    /// Written by the final stage on its direct return to the coordinator.
    DirectSent,
    /// Read by the coordinator on the final stage's direct return.
    DirectReceived,
}

/// One node's lanes of one request (stage `stage_index` of the split
/// `scope` names): every frame the node writes or reads on the request's
/// streams is folded here, in the order it crossed, on the lane its
/// [`Wire`] names, and nowhere else. A lane of a hop the node never opened
/// (the next stage, the direct return) has no fold until it is opened, and
/// a frame on it then is not folded: what a node never opened it never saw.
#[derive(Debug, Clone)]
pub struct HopSession {
    scope: RequestScope,
    stage_index: u32,
    /// The hop from the stage before: its forward lane read, its reply
    /// lane written (every stage but the coordinator).
    upstream: Option<(LaneFold, LaneFold)>,
    /// The hop to the next stage: its forward lane written, its reply lane
    /// read (once the node opened it).
    downstream: Option<(LaneFold, LaneFold)>,
    /// The direct return: written by the final stage once it opened it,
    /// read by the coordinator (with the direct return mode).
    direct: Option<LaneFold>,
}

impl HopSession {
    /// Stage `stage_index`'s lanes of the request `scope` names: the
    /// coordinator's downstream hop and direct return are open from the
    /// start (it opens the chain), a stage's upstream hop (it was opened to
    /// it).
    pub fn new(scope: RequestScope, stage_index: u32) -> Self {
        let mut session = Self {
            upstream: None,
            downstream: None,
            direct: None,
            stage_index,
            scope,
        };
        if stage_index == 0 {
            session.open_downstream();
            if session.scope.return_mode == ReturnMode::Direct {
                session.direct = Some(
                    session
                        .scope
                        .lane(session.scope.final_stage(), Lane::DirectReturn),
                );
            }
        } else {
            session.upstream = Some((
                session.scope.lane(stage_index - 1, Lane::Forward),
                session.scope.lane(stage_index - 1, Lane::Reply),
            ));
        }
        session
    }

    pub fn scope(&self) -> &RequestScope {
        &self.scope
    }

    /// The node opened its hop to the next stage.
    pub fn open_downstream(&mut self) {
        let hop = self.stage_index;
        self.downstream.get_or_insert_with(|| {
            (
                self.scope.lane(hop, Lane::Forward),
                self.scope.lane(hop, Lane::Reply),
            )
        });
    }

    /// The final stage opened its direct return to the coordinator.
    pub fn open_direct(&mut self) {
        let hop = self.scope.final_stage();
        self.direct
            .get_or_insert_with(|| self.scope.lane(hop, Lane::DirectReturn));
    }

    /// Whether the lane a frame on `wire` folds into is open.
    pub fn is_open(&self, wire: Wire) -> bool {
        self.fold_of(wire).is_some()
    }

    fn fold_of(&self, wire: Wire) -> Option<&LaneFold> {
        match wire {
            Wire::FromUpstream => self.upstream.as_ref().map(|(forward, _)| forward),
            Wire::ToUpstream => self.upstream.as_ref().map(|(_, reply)| reply),
            Wire::ToDownstream => self.downstream.as_ref().map(|(forward, _)| forward),
            Wire::FromDownstream => self.downstream.as_ref().map(|(_, reply)| reply),
            Wire::DirectSent | Wire::DirectReceived => self.direct.as_ref(),
        }
    }

    fn fold_mut(&mut self, wire: Wire) -> Option<&mut LaneFold> {
        match wire {
            Wire::FromUpstream => self.upstream.as_mut().map(|(forward, _)| forward),
            Wire::ToUpstream => self.upstream.as_mut().map(|(_, reply)| reply),
            Wire::ToDownstream => self.downstream.as_mut().map(|(forward, _)| forward),
            Wire::FromDownstream => self.downstream.as_mut().map(|(_, reply)| reply),
            Wire::DirectSent | Wire::DirectReceived => self.direct.as_mut(),
        }
    }

    /// Fold one whole frame (its length prefix included, exactly as it
    /// crossed) on the lane `wire` names; false when that lane is not open.
    pub fn fold(&mut self, wire: Wire, frame: &[u8]) -> bool {
        match self.fold_mut(wire) {
            Some(fold) => {
                fold.push_frame(frame);
                true
            }
            None => false,
        }
    }

    /// Fold the next piece of a frame as it streams in; `end_frame` closes it.
    pub fn fold_chunk(&mut self, wire: Wire, bytes: &[u8]) {
        if let Some(fold) = self.fold_mut(wire) {
            fold.frame_chunk(bytes);
        }
    }

    /// Close the frame being folded on `wire`.
    pub fn end_frame(&mut self, wire: Wire) {
        if let Some(fold) = self.fold_mut(wire) {
            fold.end_frame();
        }
    }

    /// Frames folded on `wire`'s lane so far (0 for a lane not open).
    pub fn frames(&self, wire: Wire) -> u64 {
        self.fold_of(wire).map_or(0, LaneFold::frames)
    }

    /// The node's lanes as its stage block carries them: the upstream hop
    /// for a stage, the downstream hop once opened, and the direct return
    /// where the return mode is direct (the coordinator's as received, the
    /// final stage's as sent: an empty lane when it never opened it).
    pub fn digests(&self) -> HopDigests {
        let direct_return = if self.scope.return_mode != ReturnMode::Direct {
            None
        } else if self.stage_index == 0 {
            self.direct
                .as_ref()
                .map(|f| DirectReturn::Received(f.digest()))
        } else if self.stage_index == self.scope.final_stage() {
            Some(DirectReturn::Sent(self.direct.as_ref().map_or_else(
                || {
                    self.scope
                        .lane(self.scope.final_stage(), Lane::DirectReturn)
                        .digest()
                },
                LaneFold::digest,
            )))
        } else {
            None
        };
        HopDigests {
            upstream: self
                .upstream
                .as_ref()
                .map(|(received, replies_sent)| Upstream {
                    received: received.digest(),
                    replies_sent: replies_sent.digest(),
                }),
            downstream: self
                .downstream
                .as_ref()
                .map(|(sent, replies_received)| Downstream {
                    sent: sent.digest(),
                    replies_received: replies_received.digest(),
                }),
            direct_return,
        }
    }

    /// This node's stage block: its lanes as folded, its tokens and how
    /// the request ended as it saw it.
    pub fn block(
        &self,
        slice: &SliceFacts,
        tokens: Tokens,
        terminal_state: TerminalState,
    ) -> StageBlock {
        self.scope
            .block(slice, self.digests(), tokens, terminal_state)
    }
}

impl RequestScope {
    /// A fresh fold of one lane of this request: `hop` is the upstream
    /// node's stage index for `forward`/`reply`, the final stage's for
    /// `direct_return`.
    fn lane(&self, hop: u32, lane: Lane) -> LaneFold {
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
    fn a_session_folds_each_wire_on_its_own_lane_and_only_lanes_it_opened() {
        let scope = scope();
        // The middle stage: upstream hop 0, downstream hop 1 once opened.
        let mut stage = HopSession::new(scope.clone(), 1);
        assert!(stage.fold(Wire::FromUpstream, b"open"));
        assert!(!stage.fold(Wire::ToDownstream, b"not yet"));
        stage.open_downstream();
        assert!(stage.fold(Wire::ToDownstream, b"open"));
        assert!(!stage.fold(Wire::DirectSent, b"not the final stage's to send"));
        stage.fold_chunk(Wire::FromDownstream, b"rep");
        stage.fold_chunk(Wire::FromDownstream, b"ly");
        stage.end_frame(Wire::FromDownstream);
        // The coordinator folds what it sent on hop 0 as stage 1 read it.
        let mut coordinator = HopSession::new(scope.clone(), 0);
        coordinator.fold(Wire::ToDownstream, b"open");
        let mut downstream = HopSession::new(scope.clone(), 2);
        downstream.fold(Wire::ToUpstream, b"reply");
        let (own, middle, last) = (coordinator.digests(), stage.digests(), downstream.digests());
        assert_eq!(
            own.downstream.unwrap().sent,
            middle.upstream.unwrap().received
        );
        assert_eq!(
            middle.downstream.as_ref().unwrap().replies_received,
            last.upstream.unwrap().replies_sent
        );
        assert_eq!(stage.frames(Wire::FromDownstream), 1);
        // Direct mode: the coordinator's direct lane is open from the
        // start, the final stage's only once it opened it, and a final stage
        // that never did shows the empty lane.
        assert!(matches!(own.direct_return, Some(DirectReturn::Received(_))));
        assert!(middle.direct_return.is_none());
        let empty = scope.lane(2, Lane::DirectReturn).digest();
        assert_eq!(last.direct_return, Some(DirectReturn::Sent(empty)));
        assert!(!downstream.fold(Wire::DirectSent, b"hidden"));
        downstream.open_direct();
        assert!(downstream.fold(Wire::DirectSent, b"hidden"));
        coordinator.fold(Wire::DirectReceived, b"hidden");
        let (Some(DirectReturn::Sent(sent)), Some(DirectReturn::Received(received))) = (
            downstream.digests().direct_return,
            coordinator.digests().direct_return,
        ) else {
            panic!("direct lanes on both ends");
        };
        assert_eq!(sent, received);
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
