//! The resume block: how one request ran as several segments when stages
//! were lost mid-request (`x-mesh-resume-v1`).
//!
//! A coordinator that loses a stage plans a new chain, rebuilds its caches
//! by replaying the prompt and the tokens generated so far, and carries on.
//! Each segment is a split serve of its own (its own run, split key, stage
//! records and lane digests, sealed under its own main record); this block
//! lists them in order and is carried, as RFC 8785 bytes, in the request's
//! `mesh/1` receipt, so the coordinator's signature covers it. A verifier
//! reads every segment and checks that the bundle's segments are exactly
//! the ones listed: a loss is visible, never hidden.

use serde_json::{Value, json};

use crate::hex;
use crate::identity::parse_did_key;
use crate::json::{Members, ShapeError};

/// Segments one request may have: the first, and at most this many less one
/// resumes.
pub const MAX_SEGMENTS: usize = 8;
/// Nodes one segment's chain may hold (the planner's own bound).
pub const MAX_SEGMENT_NODES: usize = 64;

/// One segment of a resumed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The run the segment's chain served under.
    pub run_id: String,
    /// The capsule id of the segment's main record.
    pub main_record: [u8; 32],
    /// The chain, stage 0 (the coordinator) first, as did:keys.
    pub nodes: Vec<String>,
    /// How many generated tokens came before this segment (its first token's
    /// index in the request's output).
    pub first_token: u64,
    /// Positions prefilled at the segment's start: the prompt, plus the
    /// tokens of earlier segments replayed to rebuild the caches.
    pub prefilled: u64,
    /// Tokens this segment generated.
    pub tokens: u64,
    /// How the segment ended (a `TerminalState` name).
    pub terminal_state: String,
    /// Stages the coordinator saw leave during the segment, as did:keys.
    pub lost: Vec<String>,
    /// Nodes of this segment that kept the cache they built in the segment
    /// before (the same layers, not lost) instead of rebuilding it by the
    /// replay, as did:keys; omitted when none did.
    pub kept: Vec<String>,
}

/// The whole block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeBlock {
    pub segments: Vec<Segment>,
}

impl ResumeBlock {
    pub fn to_value(&self) -> Value {
        json!({
            "segments": self.segments.iter().map(|s| {
                let mut entry = json!({
                    "run_id": s.run_id,
                    "main_record": hex::encode(&s.main_record),
                    "nodes": s.nodes,
                    "first_token": s.first_token,
                    "prefilled": s.prefilled,
                    "tokens": s.tokens,
                    "terminal_state": s.terminal_state,
                    "lost": s.lost,
                });
                if !s.kept.is_empty() {
                    entry["kept"] = json!(s.kept);
                }
                entry
            }).collect::<Vec<_>>(),
        })
    }

    /// Read a block, refusing unknown members, more than [`MAX_SEGMENTS`],
    /// a single segment (nothing was resumed), nodes that are not did:keys,
    /// and segments that do not follow one another.
    pub fn from_value(value: &Value) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, "")?;
        let path = m.path("segments");
        let listed = m.array("segments")?;
        m.finish()?;
        if listed.len() < 2 || listed.len() > MAX_SEGMENTS {
            return Err(ShapeError::invalid(
                path,
                format!("a resumed request has 2 to {MAX_SEGMENTS} segments"),
            ));
        }
        let mut segments: Vec<Segment> = Vec::with_capacity(listed.len());
        for (k, entry) in listed.iter().enumerate() {
            let at = format!("{path}/{k}");
            let mut s = Members::of(entry, &at)?;
            let run_id = s.non_empty_string("run_id")?.to_string();
            let main_record = hex::decode_array::<32>(s.string("main_record")?)
                .ok_or_else(|| ShapeError::invalid(s.path("main_record"), "32 bytes of hex"))?;
            let nodes = did_keys(&mut s, "nodes")?;
            if nodes.len() < 2 {
                return Err(ShapeError::invalid(
                    s.path("nodes"),
                    "a split has at least 2 nodes",
                ));
            }
            let lost = did_keys(&mut s, "lost")?;
            if let Some(stranger) = lost.iter().find(|l| !nodes[1..].contains(l)) {
                return Err(ShapeError::invalid(
                    s.path("lost"),
                    format!("{stranger} is not a stage of the segment"),
                ));
            }
            let kept = if s.present("kept") {
                did_keys(&mut s, "kept")?
            } else {
                Vec::new()
            };
            if s.present("kept") && kept.is_empty() {
                return Err(ShapeError::invalid(
                    s.path("kept"),
                    "omitted when no node kept its cache",
                ));
            }
            // A kept cache is one this node built in the segment before.
            let before = segments.last().map_or(&[][..], |p| p.nodes.as_slice());
            if let Some(stranger) = kept
                .iter()
                .find(|node| !nodes.contains(node) || !before.contains(node))
            {
                return Err(ShapeError::invalid(
                    s.path("kept"),
                    format!("{stranger} is not a node of this segment and the one before"),
                ));
            }
            let segment = Segment {
                run_id,
                main_record,
                nodes,
                first_token: s.u64("first_token")?,
                prefilled: s.u64("prefilled")?,
                tokens: s.u64("tokens")?,
                terminal_state: s.non_empty_string("terminal_state")?.to_string(),
                lost,
                kept,
            };
            s.finish()?;
            if let Some(previous) = segments.last() {
                let follows = previous.first_token.checked_add(previous.tokens)
                    == Some(segment.first_token)
                    && previous.terminal_state != "completed";
                if !follows || segment.prefilled < segment.first_token {
                    return Err(ShapeError::invalid(
                        at,
                        "a segment starts where the one before it ended, after a loss",
                    ));
                }
            }
            segments.push(segment);
        }
        Ok(Self { segments })
    }
}

/// A resumed request's claim on the interrupted one, carried in its OPEN
/// through the chain and signed by the coordinator, so a stage ends or
/// hands over a request of its coordinator only on that coordinator's word,
/// never on an upstream stage's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeClaim {
    pub run_id: String,
    /// The resumed request.
    pub request_id: u64,
    /// The interrupted request it carries on.
    pub resume_of: u64,
    /// `kept_from` and `keep_positions`, when caches are kept.
    pub keep: Option<(u64, u64)>,
}

/// What the coordinator signs for a claim:
/// `"mesh-node resume claim v1\0" ‖ len(run_id) u32 LE ‖ run_id ‖
/// request_id u64 LE ‖ resume_of u64 LE ‖ 0x00` or
/// `… ‖ 0x01 ‖ kept_from u64 LE ‖ keep_positions u64 LE`.
pub fn claim_message(claim: &ResumeClaim) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + claim.run_id.len());
    out.extend_from_slice(b"mesh-node resume claim v1\0");
    out.extend_from_slice(&(claim.run_id.len() as u32).to_le_bytes());
    out.extend_from_slice(claim.run_id.as_bytes());
    out.extend_from_slice(&claim.request_id.to_le_bytes());
    out.extend_from_slice(&claim.resume_of.to_le_bytes());
    match claim.keep {
        None => out.push(0),
        Some((kept_from, positions)) => {
            out.push(1);
            out.extend_from_slice(&kept_from.to_le_bytes());
            out.extend_from_slice(&positions.to_le_bytes());
        }
    }
    out
}

/// The coordinator's signature over a claim.
pub fn sign_claim(claim: &ResumeClaim, key: &crate::SigningKey) -> [u8; 64] {
    use ed25519_dalek::Signer;
    key.sign(&claim_message(claim)).to_bytes()
}

/// Whether `signature` is `coordinator`'s over `claim`.
pub fn claim_signed_by(claim: &ResumeClaim, signature: &[u8], coordinator: &[u8; 32]) -> bool {
    let (Ok(key), Ok(signature)) = (
        crate::VerifyingKey::from_bytes(coordinator),
        <[u8; 64]>::try_from(signature),
    ) else {
        return false;
    };
    key.verify_strict(
        &claim_message(claim),
        &ed25519_dalek::Signature::from_bytes(&signature),
    )
    .is_ok()
}

fn did_keys(m: &mut Members<'_>, key: &'static str) -> Result<Vec<String>, ShapeError> {
    m.list(key, MAX_SEGMENT_NODES, "a did:key", |item| {
        item.as_str()
            .filter(|s| parse_did_key(s).is_some())
            .map(str::to_string)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::did_key;
    use proptest::prelude::*;

    fn node(k: u8) -> String {
        did_key(
            &crate::SigningKey::from_bytes(&[k; 32])
                .verifying_key()
                .to_bytes(),
        )
    }

    fn block() -> ResumeBlock {
        ResumeBlock {
            segments: vec![
                Segment {
                    run_id: "run-a".into(),
                    main_record: [1; 32],
                    nodes: vec![node(1), node(2), node(3)],
                    first_token: 0,
                    prefilled: 7,
                    tokens: 10,
                    terminal_state: "transport_error".into(),
                    lost: vec![node(2)],
                    kept: vec![],
                },
                Segment {
                    run_id: "run-b".into(),
                    main_record: [2; 32],
                    nodes: vec![node(1), node(4), node(3)],
                    first_token: 10,
                    prefilled: 17,
                    tokens: 54,
                    terminal_state: "completed".into(),
                    lost: vec![],
                    kept: vec![node(1), node(3)],
                },
            ],
        }
    }

    #[test]
    fn round_trips() {
        let value = block().to_value();
        assert_eq!(ResumeBlock::from_value(&value).unwrap(), block());
    }

    #[test]
    fn refuses_what_does_not_describe_a_resume() {
        let mut one = block();
        one.segments.truncate(1);
        assert!(ResumeBlock::from_value(&one.to_value()).is_err());

        let mut gap = block();
        gap.segments[1].first_token = 11;
        assert!(ResumeBlock::from_value(&gap.to_value()).is_err());

        let mut after_completion = block();
        after_completion.segments[0].terminal_state = "completed".into();
        assert!(ResumeBlock::from_value(&after_completion.to_value()).is_err());

        let mut stranger = block();
        stranger.segments[0].lost = vec![node(9)];
        assert!(ResumeBlock::from_value(&stranger.to_value()).is_err());

        let mut coordinator_lost = block();
        coordinator_lost.segments[0].lost = vec![node(1)];
        assert!(ResumeBlock::from_value(&coordinator_lost.to_value()).is_err());

        let mut kept_first = block();
        kept_first.segments[0].kept = vec![node(1)];
        assert!(ResumeBlock::from_value(&kept_first.to_value()).is_err());

        let mut kept_new = block();
        kept_new.segments[1].kept = vec![node(4)];
        assert!(ResumeBlock::from_value(&kept_new.to_value()).is_err());

        let mut kept_empty = block().to_value();
        kept_empty["segments"][0]["kept"] = json!([]);
        assert!(ResumeBlock::from_value(&kept_empty).is_err());

        let mut extra = block().to_value();
        extra["segments"][0]["hidden"] = json!(1);
        assert!(ResumeBlock::from_value(&extra).is_err());

        let mut many = block();
        while many.segments.len() <= MAX_SEGMENTS {
            let mut next = many.segments[0].clone();
            next.first_token = 10 * many.segments.len() as u64;
            next.prefilled = next.first_token;
            many.segments.insert(many.segments.len() - 1, next);
        }
        assert!(ResumeBlock::from_value(&many.to_value()).is_err());
    }

    #[test]
    fn a_claim_holds_only_under_its_coordinators_key_and_as_signed() {
        let coordinator = crate::SigningKey::from_bytes(&[3; 32]);
        let public = coordinator.verifying_key().to_bytes();
        let claim = ResumeClaim {
            run_id: "mesh-split-2".into(),
            request_id: 9,
            resume_of: 7,
            keep: Some((2, 14)),
        };
        let signature = sign_claim(&claim, &coordinator);
        assert!(claim_signed_by(&claim, &signature, &public));
        let other = crate::SigningKey::from_bytes(&[4; 32]);
        assert!(!claim_signed_by(
            &claim,
            &signature,
            &other.verifying_key().to_bytes()
        ));
        assert!(!claim_signed_by(&claim, &signature[..63], &public));
        let edits: [&dyn Fn(&mut ResumeClaim); 5] = [
            &|c| c.run_id.push('x'),
            &|c| c.request_id += 1,
            &|c| c.resume_of += 1,
            &|c| c.keep = None,
            &|c| c.keep = Some((2, 15)),
        ];
        for edit in edits {
            let mut changed = claim.clone();
            edit(&mut changed);
            assert!(
                !claim_signed_by(&changed, &signature, &public),
                "{changed:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(value) = crate::json::parse_strict(&bytes) {
                let _ = ResumeBlock::from_value(&value);
            }
        }
    }
}
