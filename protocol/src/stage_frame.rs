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

use crate::cbor::Cbor;

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
    /// Keep only the first positions of the request's caches (payload:
    /// det-CBOR `{positions}`): a verified draft's rejected positions are
    /// dropped before the next step.
    pub const REWIND: u8 = 5;
    /// Reply: the stage failed (payload: UTF-8 reason).
    pub const FAILED: u8 = 17;
    /// Reply: the final stage's hidden state (payload: an f32 activation
    /// frame), from which the coordinator computes the logits with the
    /// output head it holds: one row, the step's last position, for a
    /// prefill step; every row of a decode step (the token sampled and the
    /// draft after it). Kind 16, the full logits an earlier version
    /// returned, is retired.
    pub const HIDDEN: u8 = 18;
    /// Every kind this version speaks.
    pub const ALL: [u8; 7] = [OPEN, ACTIVATIONS, STOP, DIRECT_OPEN, REWIND, FAILED, HIDDEN];
}

/// Most positions one decode step carries: the token sampled and up to 15
/// drafted after it, verified together (speculative decoding). The final
/// stage answers a decode step with a hidden row per position.
pub const MAX_DECODE_ROWS: usize = 16;

/// Bytes of a REWIND payload at most (a det-CBOR map of one uint).
pub const MAX_REWIND_PAYLOAD: usize = 32;

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

/// A REWIND's payload: how many positions of its cache a stage keeps.
/// A stage accepts it only right after a decode step that carried a draft,
/// to drop at least one position and at most that draft (its rows less
/// one, so at most `MAX_DECODE_ROWS - 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rewind {
    pub positions: u64,
}

/// Why a REWIND payload is refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RewindError {
    #[error("a REWIND payload of {0} bytes is over its limit of {MAX_REWIND_PAYLOAD}")]
    TooLong(usize),
    #[error("a REWIND payload is not det-CBOR: {0}")]
    Cbor(#[from] crate::cbor::CborError),
    #[error("a REWIND payload: {0}")]
    Field(#[from] crate::cbor::FieldError),
}

impl RewindError {
    /// The refusal's name in the vectors (`vectors/mesh/stage-messages.json`).
    pub fn kind(&self) -> &'static str {
        match self {
            RewindError::TooLong(_) => "too_long",
            RewindError::Cbor(_) => "not_det_cbor",
            RewindError::Field(_) => "wrong_members",
        }
    }
}

impl StageFrameError {
    /// The refusal's name in the vectors (`vectors/mesh/stage-messages.json`).
    pub fn kind(&self) -> &'static str {
        match self {
            StageFrameError::Short(_) => "short",
            StageFrameError::UnknownKind(_) => "unknown_kind",
        }
    }
}

impl Rewind {
    pub fn encode(&self) -> Vec<u8> {
        Cbor::text_map([("positions", Cbor::Uint(self.positions))]).encode()
    }

    /// Strict: exactly `{positions: uint}` in deterministic CBOR.
    pub fn parse(payload: &[u8]) -> Result<Self, RewindError> {
        if payload.len() > MAX_REWIND_PAYLOAD {
            return Err(RewindError::TooLong(payload.len()));
        }
        let value = Cbor::decode(payload)?;
        let mut fields = crate::cbor::Fields::of(&value)?;
        let positions = fields.uint("positions")?;
        fields.finish()?;
        Ok(Self { positions })
    }
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
        body[0] = 6;
        assert_eq!(
            StageHeader::parse(&body),
            Err(StageFrameError::UnknownKind(6))
        );
    }

    /// The repository's vectors (`vectors/mesh/stage-messages.json`,
    /// `mesh-node vectors write`): every body and REWIND payload gets the
    /// outcome the file names.
    #[test]
    fn the_stage_message_vectors_hold() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../vectors/mesh/stage-messages.json"
        );
        let document: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let bytes = |case: &serde_json::Value, member: &str| {
            crate::hex::decode(case[member].as_str().unwrap()).unwrap()
        };
        let messages = document["messages"].as_array().unwrap();
        assert_eq!(messages.len(), kind::ALL.len());
        for case in messages
            .iter()
            .chain(document["headers"].as_array().unwrap())
        {
            let body = bytes(case, "body");
            match StageHeader::parse(&body) {
                Ok((header, payload)) => {
                    let ok = &case["expect"]["ok"];
                    assert_eq!(ok["kind"], header.kind, "{}", case["name"]);
                    assert_eq!(ok["request_id"], header.request_id.to_string());
                    assert_eq!(ok["step"], header.step);
                    assert_eq!(ok["payload"], crate::hex::encode(payload));
                    assert_eq!(header.encode(payload), body);
                }
                Err(error) => {
                    assert_eq!(case["expect"]["refused"], error.kind(), "{}", case["name"])
                }
            }
        }
        let rewinds = document["rewinds"].as_array().unwrap();
        assert!(rewinds.len() > 100);
        for case in rewinds {
            let payload = bytes(case, "payload");
            match Rewind::parse(&payload) {
                Ok(rewind) => {
                    assert_eq!(case["expect"]["ok"], rewind.positions, "{}", case["name"]);
                    assert_eq!(rewind.encode(), payload);
                }
                Err(error) => {
                    assert_eq!(case["expect"]["refused"], error.kind(), "{}", case["name"])
                }
            }
        }
    }

    #[test]
    fn a_rewind_is_exactly_one_uint() {
        let rewind = Rewind { positions: 300 };
        assert_eq!(Rewind::parse(&rewind.encode()), Ok(rewind));
        let extra = Cbor::text_map([("positions", Cbor::Uint(3)), ("x", Cbor::Uint(1))]).encode();
        assert!(matches!(Rewind::parse(&extra), Err(RewindError::Field(_))));
        let text = Cbor::text_map([("positions", Cbor::text("3"))]).encode();
        assert!(matches!(Rewind::parse(&text), Err(RewindError::Field(_))));
        let mut trailing = rewind.encode();
        trailing.push(0);
        assert!(matches!(
            Rewind::parse(&trailing),
            Err(RewindError::Cbor(_))
        ));
        assert!(matches!(
            Rewind::parse(&[0; 40]),
            Err(RewindError::TooLong(40))
        ));
        assert!(Rewind::parse(&[]).is_err());
    }

    proptest! {
        #[test]
        fn rewinds_round_trip_and_never_panic(positions in any::<u64>(), bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let rewind = Rewind { positions };
            prop_assert_eq!(Rewind::parse(&rewind.encode()), Ok(rewind));
            if let Ok(parsed) = Rewind::parse(&bytes) {
                prop_assert_eq!(parsed.encode(), bytes);
            }
        }

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
