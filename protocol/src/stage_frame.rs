//! The header of every `mesh-stage/1` message body:
//!
//! ```text
//! kind u8 ‖ request_id u64 LE ‖ step u32 LE ‖ payload
//! ```
//!
//! (the body rides in a `u32 LE` length-prefixed frame; `docs/wire.md`).
//! Parsing refuses a body shorter than its header and a kind this version
//! does not know, so nothing downstream sees either.

use thiserror::Error;

/// Message kinds.
pub mod kind {
    /// Upstream opens a request on a hop (payload: det-CBOR request header).
    pub const OPEN: u8 = 1;
    /// Activations for the next positions (payload: an activation frame).
    pub const ACTIVATIONS: u8 = 2;
    /// The request ended (payload: det-CBOR `{terminal_state}`).
    pub const STOP: u8 = 3;
    /// The final stage opens its direct-return stream to stage 0.
    pub const DIRECT_OPEN: u8 = 4;
    /// Reply: the stage failed (payload: UTF-8 reason).
    pub const FAILED: u8 = 17;
    /// Reply: the final stage's hidden state at the step's last position
    /// (payload: an activation frame of one row), from which the coordinator
    /// computes the logits with the output head it holds. Kind 16, the
    /// full logits an earlier version returned, is retired.
    pub const HIDDEN: u8 = 18;
    /// Every kind this version speaks.
    pub const ALL: [u8; 6] = [OPEN, ACTIVATIONS, STOP, DIRECT_OPEN, FAILED, HIDDEN];
}

/// Bytes of the header.
pub const STAGE_HEADER: usize = 13;

/// Why a message body is not a stage message.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StageFrameError {
    #[error("stage message of {0} bytes is shorter than its {STAGE_HEADER}-byte header")]
    Short(usize),
    #[error("unknown stage message kind {0}")]
    UnknownKind(u8),
}

/// A stage message's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageHeader {
    pub kind: u8,
    pub request_id: u64,
    pub step: u32,
}

impl StageHeader {
    /// The body: this header, then `payload`.
    pub fn encode(&self, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(STAGE_HEADER + payload.len());
        out.push(self.kind);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// Split a body into its header and payload.
    pub fn parse(body: &[u8]) -> Result<(StageHeader, &[u8]), StageFrameError> {
        let (Some(&kind), Some(request_id), Some(step), Some(payload)) = (
            body.first(),
            body.get(1..9).and_then(|b| <[u8; 8]>::try_from(b).ok()),
            body.get(9..13).and_then(|b| <[u8; 4]>::try_from(b).ok()),
            body.get(STAGE_HEADER..),
        ) else {
            return Err(StageFrameError::Short(body.len()));
        };
        if !kind::ALL.contains(&kind) {
            return Err(StageFrameError::UnknownKind(kind));
        }
        Ok((
            StageHeader {
                kind,
                request_id: u64::from_le_bytes(request_id),
                step: u32::from_le_bytes(step),
            },
            payload,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refuses_short_bodies_and_unknown_kinds() {
        assert_eq!(
            StageHeader::parse(&[kind::STOP; 12]),
            Err(StageFrameError::Short(12))
        );
        let mut body = StageHeader {
            kind: kind::FAILED,
            request_id: 9,
            step: 2,
        }
        .encode(b"why");
        body[0] = 5;
        assert_eq!(
            StageHeader::parse(&body),
            Err(StageFrameError::UnknownKind(5))
        );
    }

    proptest! {
        #[test]
        fn round_trips(kind in proptest::sample::select(kind::ALL.to_vec()), request_id in any::<u64>(), step in any::<u32>(), payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let header = StageHeader { kind, request_id, step };
            let body = header.encode(&payload);
            prop_assert_eq!(StageHeader::parse(&body), Ok((header, payload.as_slice())));
        }

        #[test]
        fn never_panics(body in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok((header, payload)) = StageHeader::parse(&body) {
                prop_assert_eq!(header.encode(payload), body);
            }
        }
    }
}
