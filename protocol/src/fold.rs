//! The lane fold `skippy-stage-frames/v1`: a running SHA-256 over the exact
//! bytes of every frame of one request that crossed one hop on one lane.
//!
//! ```text
//! h_0 = SHA-256( "skippy-stage-frames/v1"
//!              ‖ lp(salt) ‖ lp(coordinator_node_id) ‖ lp(run_id)
//!              ‖ u64be(request_id) ‖ u32be(hop_index) ‖ lp(lane) )
//! h_i = SHA-256( h_{i-1} ‖ SHA-256(frame_i) )
//! lp(x) = u32be(len(x)) ‖ x
//! ```
//!
//! Frames are fed as they are written or read, in pieces of any size; the
//! folder never holds more than one SHA-256 state per open frame.

use std::fmt;

use sha2::{Digest, Sha256};

/// The fold's domain separator; it has no length prefix.
pub const FOLD_DOMAIN: &[u8] = b"skippy-stage-frames/v1";

/// One of the three lanes a hop can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    /// Activations, upstream to downstream.
    Forward,
    /// Replies relayed back up the chain.
    Reply,
    /// Replies from the final stage straight to stage 0.
    DirectReturn,
}

impl Lane {
    pub const ALL: [Lane; 3] = [Lane::Forward, Lane::Reply, Lane::DirectReturn];

    /// The exact ASCII name folded into `h_0` and written in records.
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Forward => "forward",
            Lane::Reply => "reply",
            Lane::DirectReturn => "direct_return",
        }
    }

    pub fn parse(name: &str) -> Option<Lane> {
        Lane::ALL.into_iter().find(|lane| lane.as_str() == name)
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What identifies one lane of one hop of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneContext<'a> {
    /// Per-request salt; empty in v0, and still written as a zero length.
    pub salt: &'a [u8],
    pub coordinator_node_id: &'a str,
    pub run_id: &'a str,
    pub request_id: u64,
    /// The upstream stage's index for `forward`/`reply`; the final stage's
    /// index (`n - 1`) for `direct_return`.
    pub hop_index: u32,
    pub lane: Lane,
}

/// The sealed result of a lane: how many frames, and the final state.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaneDigest {
    pub frames: u64,
    pub digest: [u8; 32],
}

impl LaneDigest {
    /// The record form: `sha256:` followed by 64 lowercase hex digits.
    pub fn digest_string(&self) -> String {
        format!("sha256:{}", crate::hex::encode(&self.digest))
    }
}

impl fmt::Debug for LaneDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} frames {}", self.frames, self.digest_string())
    }
}

fn length_prefixed(hasher: &mut Sha256, bytes: &[u8]) {
    // Every field is far below 4 GiB in practice; a longer one saturates the
    // prefix rather than wrap it, which can only make the digest differ.
    let length = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    hasher.update(length.to_be_bytes());
    hasher.update(bytes);
}

/// The incremental folder for one lane.
///
/// Use [`LaneFold::push_frame`] when the whole frame is at hand, or
/// [`LaneFold::frame_chunk`] for each piece followed by
/// [`LaneFold::end_frame`] when the frame is streamed.
#[derive(Clone)]
pub struct LaneFold {
    state: [u8; 32],
    frames: u64,
    open_frame: Option<Sha256>,
}

impl fmt::Debug for LaneFold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaneFold")
            .field("frames", &self.frames)
            .field("frame_open", &self.open_frame.is_some())
            .finish()
    }
}

impl LaneFold {
    /// Start a lane: computes `h_0`.
    pub fn new(context: &LaneContext<'_>) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(FOLD_DOMAIN);
        length_prefixed(&mut hasher, context.salt);
        length_prefixed(&mut hasher, context.coordinator_node_id.as_bytes());
        length_prefixed(&mut hasher, context.run_id.as_bytes());
        hasher.update(context.request_id.to_be_bytes());
        hasher.update(context.hop_index.to_be_bytes());
        length_prefixed(&mut hasher, context.lane.as_str().as_bytes());
        Self {
            state: hasher.finalize().into(),
            frames: 0,
            open_frame: None,
        }
    }

    /// Feed the next piece of the current frame (opening one if none is).
    pub fn frame_chunk(&mut self, bytes: &[u8]) {
        self.open_frame
            .get_or_insert_with(Sha256::new)
            .update(bytes);
    }

    /// Close the current frame and fold it in. A frame that received no
    /// chunk is the empty frame, and still counts.
    pub fn end_frame(&mut self) {
        let frame_hash: [u8; 32] = self.open_frame.take().unwrap_or_default().finalize().into();
        let mut step = Sha256::new();
        step.update(self.state);
        step.update(frame_hash);
        self.state = step.finalize().into();
        self.frames = self.frames.saturating_add(1);
    }

    /// Fold one whole frame.
    pub fn push_frame(&mut self, frame: &[u8]) {
        self.frame_chunk(frame);
        self.end_frame();
    }

    /// Frames folded so far.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// Whether a frame has been started and not ended.
    pub fn frame_open(&self) -> bool {
        self.open_frame.is_some()
    }

    /// The lane's digest so far. A frame still open is not part of it: only
    /// whole frames that crossed the hop are committed to.
    pub fn digest(&self) -> LaneDigest {
        LaneDigest {
            frames: self.frames,
            digest: self.state,
        }
    }
}

/// Fold a whole lane at once (tests, vectors and offline tools).
pub fn fold_frames<F: AsRef<[u8]>>(context: &LaneContext<'_>, frames: &[F]) -> LaneDigest {
    let mut fold = LaneFold::new(context);
    for frame in frames {
        fold.push_frame(frame.as_ref());
    }
    fold.digest()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn context(lane: Lane, hop_index: u32) -> LaneContext<'static> {
        LaneContext {
            salt: b"",
            coordinator_node_id: "node-coordinator-c",
            run_id: "mesh-split-1790000000000000000-g2",
            request_id: u64::MAX,
            hop_index,
            lane,
        }
    }

    #[test]
    fn empty_lane_is_h0_of_the_worked_example() {
        let digest = fold_frames::<&[u8]>(&context(Lane::Forward, 0), &[]);
        assert_eq!(digest.frames, 0);
        assert_eq!(
            digest.digest_string(),
            "sha256:2d3e82dcb5ae8da132f262d24422fe6df8b4568b738ddc42985de5b890f6c06b"
        );
    }

    #[test]
    fn every_context_field_changes_h0() {
        let base = context(Lane::Forward, 0);
        let h = |c: &LaneContext<'_>| fold_frames::<&[u8]>(c, &[]).digest;
        let reference = h(&base);
        assert_ne!(
            reference,
            h(&LaneContext {
                salt: b"s",
                ..base.clone()
            })
        );
        assert_ne!(
            reference,
            h(&LaneContext {
                coordinator_node_id: "x",
                ..base.clone()
            })
        );
        assert_ne!(
            reference,
            h(&LaneContext {
                run_id: "r",
                ..base.clone()
            })
        );
        assert_ne!(
            reference,
            h(&LaneContext {
                request_id: 1,
                ..base.clone()
            })
        );
        assert_ne!(
            reference,
            h(&LaneContext {
                hop_index: 1,
                ..base.clone()
            })
        );
        assert_ne!(
            reference,
            h(&LaneContext {
                lane: Lane::Reply,
                ..base.clone()
            })
        );
    }

    #[test]
    fn order_and_boundaries_matter() {
        let c = context(Lane::Forward, 0);
        let ab = fold_frames(&c, &[b"a".as_slice(), b"b"]);
        assert_ne!(ab, fold_frames(&c, &[b"b".as_slice(), b"a"]));
        assert_ne!(ab, fold_frames(&c, &[b"ab".as_slice()]));
        assert_ne!(
            fold_frames::<&[u8]>(&c, &[]),
            fold_frames(&c, &[b"".as_slice()])
        );
    }

    #[test]
    fn open_frame_is_not_committed() {
        let c = context(Lane::Reply, 1);
        let mut fold = LaneFold::new(&c);
        fold.push_frame(b"one");
        let before = fold.digest();
        fold.frame_chunk(b"partial");
        assert!(fold.frame_open());
        assert_eq!(fold.digest(), before);
    }

    proptest! {
        #[test]
        fn any_chunking_gives_the_same_digest(
            frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..8),
            cuts in proptest::collection::vec(1usize..64, 1..16),
        ) {
            let c = context(Lane::DirectReturn, 2);
            let whole = fold_frames(&c, &frames);
            let mut streamed = LaneFold::new(&c);
            let mut cut = cuts.iter().cycle();
            for frame in &frames {
                let mut rest = frame.as_slice();
                while !rest.is_empty() {
                    let n = (*cut.next().unwrap()).min(rest.len());
                    streamed.frame_chunk(&rest[..n]);
                    rest = &rest[n..];
                }
                streamed.end_frame();
            }
            prop_assert_eq!(streamed.digest(), whole);
        }
    }
}
