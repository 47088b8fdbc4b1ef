//! Activation frames: hidden states on the wire between slices
//! (`docs/wire.md`). Little-endian throughout, bounded on decode.
//!
//! ```text
//! 0      4    5      6         8          12         16
//! +------+----+------+---------+----------+----------+--------------------+
//! | MSAF | v1 | type | 0x0000  | rows u32 | cols u32 | rows*cols elements |
//! +------+----+------+---------+----------+----------+--------------------+
//! ```

use half::{bf16, f16};

use crate::error::{EngineError, Result};

pub const FRAME_MAGIC: &[u8; 4] = b"MSAF";
pub const FRAME_VERSION: u8 = 1;
pub const FRAME_HEADER_BYTES: usize = 16;
/// Most rows (token positions) one frame carries.
pub const MAX_FRAME_ROWS: u32 = 32_768;
/// Widest hidden state accepted.
pub const MAX_FRAME_COLS: u32 = 65_536;
/// Largest payload accepted, whatever the shape says.
pub const MAX_FRAME_PAYLOAD: usize = 256 * 1024 * 1024;

/// Element type of a frame's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireDType {
    /// Exact: a split run is bit-identical to an unsplit one.
    F32,
    /// Half the bytes, rounded to nearest even.
    F16,
    Bf16,
}

impl WireDType {
    pub fn code(self) -> u8 {
        match self {
            WireDType::F32 => 0,
            WireDType::F16 => 1,
            WireDType::Bf16 => 2,
        }
    }
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(WireDType::F32),
            1 => Some(WireDType::F16),
            2 => Some(WireDType::Bf16),
            _ => None,
        }
    }
    pub fn size(self) -> usize {
        match self {
            WireDType::F32 => 4,
            WireDType::F16 | WireDType::Bf16 => 2,
        }
    }
    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            WireDType::F32 => "f32",
            WireDType::F16 => "f16",
            WireDType::Bf16 => "bf16",
        }
    }
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "f32" => Some(WireDType::F32),
            "f16" => Some(WireDType::F16),
            "bf16" => Some(WireDType::Bf16),
            _ => None,
        }
    }
}

/// A decoded frame: row-major f32 values.
#[derive(Debug, Clone, PartialEq)]
pub struct Activations {
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<f32>,
}

/// Encode `rows × cols` values.
pub fn encode_frame(values: &[f32], rows: usize, cols: usize, dtype: WireDType) -> Result<Vec<u8>> {
    if values.len() != rows * cols {
        return Err(EngineError::Frame(format!(
            "{} values for a {rows}×{cols} frame",
            values.len()
        )));
    }
    let rows32 = u32::try_from(rows).ok().filter(|r| *r <= MAX_FRAME_ROWS);
    let cols32 = u32::try_from(cols).ok().filter(|c| *c <= MAX_FRAME_COLS);
    let (Some(rows32), Some(cols32)) = (rows32, cols32) else {
        return Err(EngineError::Frame(format!(
            "shape {rows}×{cols} is over the frame limits"
        )));
    };
    let mut out = Vec::with_capacity(FRAME_HEADER_BYTES + values.len() * dtype.size());
    out.extend_from_slice(FRAME_MAGIC);
    out.push(FRAME_VERSION);
    out.push(dtype.code());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&rows32.to_le_bytes());
    out.extend_from_slice(&cols32.to_le_bytes());
    match dtype {
        WireDType::F32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        WireDType::F16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        WireDType::Bf16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
    }
    Ok(out)
}

/// Decode a frame, checking every bound; `expected_cols` is the receiving
/// slice's hidden size.
pub fn decode_frame(bytes: &[u8], expected_cols: usize) -> Result<(Activations, WireDType)> {
    let bad = |why: String| EngineError::Frame(why);
    if bytes.len() < FRAME_HEADER_BYTES {
        return Err(bad(format!(
            "{} bytes is shorter than the 16-byte header",
            bytes.len()
        )));
    }
    if &bytes[..4] != FRAME_MAGIC {
        return Err(bad("not an activation frame (magic is not MSAF)".into()));
    }
    if bytes[4] != FRAME_VERSION {
        return Err(bad(format!(
            "frame version {} is not supported (this node speaks 1)",
            bytes[4]
        )));
    }
    let dtype = WireDType::from_code(bytes[5])
        .ok_or_else(|| bad(format!("unknown element type {}", bytes[5])))?;
    if bytes[6..8] != [0, 0] {
        return Err(bad("reserved bytes are not zero".into()));
    }
    let word =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let (rows, cols) = (word(8), word(12));
    if rows == 0 || rows > MAX_FRAME_ROWS || cols == 0 || cols > MAX_FRAME_COLS {
        return Err(bad(format!(
            "shape {rows}×{cols} is outside the frame limits"
        )));
    }
    let (rows, cols) = (rows as usize, cols as usize);
    if cols != expected_cols {
        return Err(bad(format!(
            "hidden size {cols}, but this slice expects {expected_cols}"
        )));
    }
    let payload = rows * cols * dtype.size();
    if payload > MAX_FRAME_PAYLOAD {
        return Err(bad(format!(
            "payload of {payload} bytes is over {MAX_FRAME_PAYLOAD}"
        )));
    }
    if bytes.len() != FRAME_HEADER_BYTES + payload {
        return Err(bad(format!(
            "{} payload bytes for a {rows}×{cols} {dtype:?} frame that needs {payload}",
            bytes.len() - FRAME_HEADER_BYTES
        )));
    }
    let body = &bytes[FRAME_HEADER_BYTES..];
    let values: Vec<f32> = match dtype {
        WireDType::F32 => body
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        WireDType::F16 => body
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        WireDType::Bf16 => body
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    };
    Ok((Activations { rows, cols, values }, dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refuses_wrong_shapes_and_types() {
        let frame = encode_frame(&[1.0, 2.0, 3.0, 4.0], 2, 2, WireDType::F32).unwrap();
        assert!(decode_frame(&frame, 3).is_err(), "wrong hidden size");
        assert!(
            decode_frame(&frame[..frame.len() - 1], 2).is_err(),
            "truncated"
        );
        let mut trailing = frame.clone();
        trailing.push(0);
        assert!(decode_frame(&trailing, 2).is_err(), "trailing byte");
        let mut dtype = frame.clone();
        dtype[5] = 9;
        assert!(decode_frame(&dtype, 2).is_err(), "unknown dtype");
        let mut f16_claim = frame.clone();
        f16_claim[5] = 1;
        assert!(
            decode_frame(&f16_claim, 2).is_err(),
            "payload length does not match the dtype"
        );
        let mut huge = frame.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_frame(&huge, 2).is_err());
    }

    proptest! {
        #[test]
        fn f32_is_exact(values in proptest::collection::vec(any::<f32>().prop_filter("finite", |v| v.is_finite()), 1..64), cols in 1usize..8) {
            let rows = values.len() / cols;
            prop_assume!(rows > 0);
            let values = &values[..rows * cols];
            let frame = encode_frame(values, rows, cols, WireDType::F32).unwrap();
            let (decoded, dtype) = decode_frame(&frame, cols).unwrap();
            prop_assert_eq!(dtype, WireDType::F32);
            prop_assert_eq!(crate::bits(&decoded.values), crate::bits(values));
        }

        #[test]
        fn f16_halves_the_bytes_and_rounds(values in proptest::collection::vec(-1000.0f32..1000.0, 4..64)) {
            let frame = encode_frame(&values, values.len(), 1, WireDType::F16).unwrap();
            prop_assert_eq!(frame.len(), FRAME_HEADER_BYTES + values.len() * 2);
            let (decoded, _) = decode_frame(&frame, 1).unwrap();
            for (a, b) in decoded.values.iter().zip(&values) {
                prop_assert!((a - b).abs() <= b.abs() / 1000.0 + 1e-3);
            }
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128), cols in 1usize..8) {
            let _ = decode_frame(&bytes, cols);
        }
    }
}
