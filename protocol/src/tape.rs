//! The audit tape (`mesh-node-tape/1`): what a coordinator wrote to stage
//! 1 of a request's chain and what the final stage returned, every frame
//! whole and exactly as it crossed. With the request's bundle it is all a
//! verifier needs to run each stage's layers again on the inputs that
//! stage was given and name the first stage whose output differs
//! (`mesh-node replay --tape`).
//!
//! ```text
//!  0        17          25        29                          …
//!  +--------+-----------+---------+---------------------------+---------+-----------------+
//!  | magic  | request_id| F       | F x (len u32 LE ‖ frame)  | R       | R x (len ‖ frame)|
//!  | 17 B   | u64 LE    | u32 LE  |  frames to stage 1        | u32 LE  |  final replies   |
//!  +--------+-----------+---------+---------------------------+---------+-----------------+
//!  magic = "mesh-node-tape/1\n"
//! ```
//!
//! Limits: at most [`MAX_TAPE_BYTES`] in all, each frame at most
//! [`MAX_TAPE_FRAME`] bytes and not empty; nothing after the last reply.

/// The file's first bytes.
pub const TAPE_MAGIC: &[u8; 17] = b"mesh-node-tape/1\n";
/// The most a tape file holds.
pub const MAX_TAPE_BYTES: usize = 64 << 20;
/// The longest frame a tape holds (a stage message's bound).
pub const MAX_TAPE_FRAME: usize = 64 << 20;

/// A request's frames to stage 1 and the final stage's replies.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tape {
    pub request_id: u64,
    pub forward: Vec<Vec<u8>>,
    pub replies: Vec<Vec<u8>>,
}

/// Why a tape file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TapeError {
    #[error("over {MAX_TAPE_BYTES} bytes")]
    TooLong,
    #[error("not a mesh-node-tape/1 file")]
    Magic,
    #[error("cut short")]
    Short,
    #[error("a frame of {0} bytes (1 to {MAX_TAPE_FRAME})")]
    FrameLength(u64),
    #[error("{0} bytes after the last reply")]
    Trailing(usize),
}

impl TapeError {
    /// The refusal's name in the vectors (`vectors/mesh/tapes.json`).
    pub fn kind(&self) -> &'static str {
        match self {
            TapeError::TooLong => "too_long",
            TapeError::Magic => "magic",
            TapeError::Short => "short",
            TapeError::FrameLength(_) => "frame_length",
            TapeError::Trailing(_) => "trailing",
        }
    }
}

impl Tape {
    pub fn encode(&self) -> Vec<u8> {
        let frames = self.forward.iter().chain(&self.replies);
        let mut out =
            Vec::with_capacity(TAPE_MAGIC.len() + 16 + frames.map(|f| f.len() + 4).sum::<usize>());
        out.extend_from_slice(TAPE_MAGIC);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        for list in [&self.forward, &self.replies] {
            out.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for frame in list {
                out.extend_from_slice(&(frame.len() as u32).to_le_bytes());
                out.extend_from_slice(frame);
            }
        }
        out
    }

    /// Read a tape, refusing anything past its limits; a count is trusted
    /// only as far as the bytes that follow bear it out.
    pub fn decode(bytes: &[u8]) -> Result<Self, TapeError> {
        if bytes.len() > MAX_TAPE_BYTES {
            return Err(TapeError::TooLong);
        }
        let rest = bytes
            .strip_prefix(TAPE_MAGIC.as_slice())
            .ok_or(TapeError::Magic)?;
        let mut reader = Reader { rest };
        let request_id = u64::from_le_bytes(reader.array::<8>()?);
        let forward = reader.frames()?;
        let replies = reader.frames()?;
        if !reader.rest.is_empty() {
            return Err(TapeError::Trailing(reader.rest.len()));
        }
        Ok(Self {
            request_id,
            forward,
            replies,
        })
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl Reader<'_> {
    fn array<const N: usize>(&mut self) -> Result<[u8; N], TapeError> {
        let (head, rest) = self.rest.split_first_chunk::<N>().ok_or(TapeError::Short)?;
        self.rest = rest;
        Ok(*head)
    }

    fn frames(&mut self) -> Result<Vec<Vec<u8>>, TapeError> {
        let count = u32::from_le_bytes(self.array::<4>()?) as usize;
        // Every frame takes at least 5 bytes: a count past what is left
        // allocates nothing.
        let mut frames = Vec::with_capacity(count.min(self.rest.len() / 5));
        for _ in 0..count {
            let length = u32::from_le_bytes(self.array::<4>()?);
            if length == 0 || length as usize > MAX_TAPE_FRAME {
                return Err(TapeError::FrameLength(u64::from(length)));
            }
            let (frame, rest) = self
                .rest
                .split_at_checked(length as usize)
                .ok_or(TapeError::Short)?;
            frames.push(frame.to_vec());
            self.rest = rest;
        }
        Ok(frames)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference() -> Tape {
        Tape {
            request_id: 7,
            forward: vec![vec![1, 2, 3], vec![4; 9]],
            replies: vec![vec![5; 5]],
        }
    }

    #[test]
    fn a_tape_round_trips_and_every_cut_is_refused() {
        let bytes = reference().encode();
        assert_eq!(Tape::decode(&bytes), Ok(reference()));
        for cut in 0..bytes.len() {
            assert!(Tape::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(Tape::decode(&trailing), Err(TapeError::Trailing(1)));
    }

    /// The repository's vectors (`vectors/mesh/tapes.json`): every case
    /// gets the outcome the file names.
    #[test]
    fn the_tape_vectors_hold() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../vectors/mesh/tapes.json");
        let document: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let cases = document["cases"].as_array().unwrap();
        assert!(cases.len() > 50);
        for case in cases {
            let bytes = crate::hex::decode(case["tape"].as_str().unwrap()).unwrap();
            let got = match Tape::decode(&bytes) {
                Ok(tape) => {
                    assert_eq!(tape.encode(), bytes, "{}", case["name"]);
                    serde_json::json!({ "ok": {
                        "request_id": tape.request_id.to_string(),
                        "forward": tape.forward.len(),
                        "replies": tape.replies.len(),
                    }})
                }
                Err(error) => serde_json::json!({ "refused": error.kind() }),
            };
            assert_eq!(got, case["expect"], "{}", case["name"]);
        }
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Tape::decode(&bytes);
            let mut with_magic = TAPE_MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = Tape::decode(&with_magic);
        }

        #[test]
        fn tapes_round_trip(
            request_id in any::<u64>(),
            forward in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..32), 0..6),
            replies in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..32), 0..6),
        ) {
            let tape = Tape { request_id, forward, replies };
            prop_assert_eq!(Tape::decode(&tape.encode()), Ok(tape));
        }
    }
}
