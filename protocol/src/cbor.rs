//! Deterministic CBOR (RFC 8949 §4.2.1) for signed cores, grants and journal
//! records: shortest-form heads, definite lengths, map keys in bytewise order
//! of their encodings. The value model has no floats, booleans, nulls or
//! negative numbers, because the records signed with it forbid them
//! (booleans are written as `0|1`, absent options are dropped).
//!
//! The decoder is strict and bounded: it accepts only canonical encodings (a
//! decoded value re-encodes to the same bytes), at most `MAX_CBOR_DEPTH`
//! nesting, at most `MAX_CBOR_ITEMS` items, and refuses trailing bytes.

use std::collections::BTreeMap;

use thiserror::Error;

/// Deepest nesting the decoder accepts.
pub const MAX_CBOR_DEPTH: usize = 16;
/// Most data items (of any kind) one document may hold.
pub const MAX_CBOR_ITEMS: usize = 65_536;
/// Items reserved ahead for an array or map, whatever length it declares.
const RESERVE_ITEMS: usize = 64;

/// A deterministic-CBOR value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cbor {
    Uint(u64),
    Bytes(Vec<u8>),
    Text(String),
    Array(Vec<Cbor>),
    /// Keys are kept in canonical order: bytewise order of their encodings.
    Map(Vec<(Cbor, Cbor)>),
}

/// Why bytes are not one canonical CBOR value of this model.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CborError {
    #[error("ends early at byte {0}")]
    Truncated(usize),
    #[error("{0} trailing bytes after the value")]
    Trailing(usize),
    #[error(
        "byte {offset}: major type {major} (additional {info}) is outside the deterministic profile"
    )]
    Unsupported { offset: usize, major: u8, info: u8 },
    #[error("byte {0}: integer or length not in shortest form")]
    NotShortest(usize),
    #[error("byte {0}: map keys not in canonical order, or repeated")]
    KeyOrder(usize),
    #[error("byte {0}: text is not UTF-8")]
    Utf8(usize),
    #[error("nesting deeper than {MAX_CBOR_DEPTH}")]
    TooDeep,
    #[error("more than {MAX_CBOR_ITEMS} items")]
    TooMany,
}

fn head(out: &mut Vec<u8>, major: u8, value: u64) {
    let major = major << 5;
    match value {
        0..=23 => out.push(major | value as u8),
        24..=0xff => out.extend_from_slice(&[major | 24, value as u8]),
        0x100..=0xffff => {
            out.push(major | 25);
            out.extend_from_slice(&(value as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(major | 26);
            out.extend_from_slice(&(value as u32).to_be_bytes());
        }
        _ => {
            out.push(major | 27);
            out.extend_from_slice(&value.to_be_bytes());
        }
    }
}

impl Cbor {
    pub fn text(text: impl Into<String>) -> Self {
        Cbor::Text(text.into())
    }

    pub fn bytes(bytes: impl Into<Vec<u8>>) -> Self {
        Cbor::Bytes(bytes.into())
    }

    /// A map from `(key, value)` pairs in any order; sorted canonically.
    /// A repeated key keeps its last value.
    pub fn map(entries: impl IntoIterator<Item = (Cbor, Cbor)>) -> Self {
        let mut sorted: BTreeMap<Vec<u8>, (Cbor, Cbor)> = BTreeMap::new();
        for (key, value) in entries {
            sorted.insert(key.encode(), (key, value));
        }
        Cbor::Map(sorted.into_values().collect())
    }

    /// A map with text keys, the form every record here uses.
    pub fn text_map<'a>(entries: impl IntoIterator<Item = (&'a str, Cbor)>) -> Self {
        Cbor::map(entries.into_iter().map(|(k, v)| (Cbor::text(k), v)))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Cbor::Uint(value) => head(out, 0, *value),
            Cbor::Bytes(bytes) => {
                head(out, 2, bytes.len() as u64);
                out.extend_from_slice(bytes);
            }
            Cbor::Text(text) => {
                head(out, 3, text.len() as u64);
                out.extend_from_slice(text.as_bytes());
            }
            Cbor::Array(items) => {
                head(out, 4, items.len() as u64);
                for item in items {
                    item.encode_into(out);
                }
            }
            Cbor::Map(entries) => {
                // Re-sort defensively: a map built by hand must still encode
                // canonically.
                let mut encoded: Vec<(Vec<u8>, &Cbor)> =
                    entries.iter().map(|(k, v)| (k.encode(), v)).collect();
                encoded.sort_by(|a, b| a.0.cmp(&b.0));
                encoded.dedup_by(|a, b| a.0 == b.0);
                head(out, 5, encoded.len() as u64);
                for (key, value) in encoded {
                    out.extend_from_slice(&key);
                    value.encode_into(out);
                }
            }
        }
    }

    /// Decode one canonical value that spans all of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Cbor, CborError> {
        let mut decoder = Decoder {
            bytes,
            pos: 0,
            items: 0,
        };
        let value = decoder.value(0)?;
        if decoder.pos != bytes.len() {
            return Err(CborError::Trailing(bytes.len() - decoder.pos));
        }
        Ok(value)
    }

    /// Look up a text key in a map.
    pub fn get(&self, key: &str) -> Option<&Cbor> {
        match self {
            Cbor::Map(entries) => entries
                .iter()
                .find(|(k, _)| matches!(k, Cbor::Text(t) if t == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_uint(&self) -> Option<u64> {
        match self {
            Cbor::Uint(v) => Some(*v),
            _ => None,
        }
    }
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Cbor::Bytes(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Cbor::Text(t) => Some(t),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Cbor]> {
        match self {
            Cbor::Array(items) => Some(items),
            _ => None,
        }
    }
}

struct Decoder<'a> {
    bytes: &'a [u8],
    pos: usize,
    items: usize,
}

impl Decoder<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], CborError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len());
        let end = end.ok_or(CborError::Truncated(self.pos))?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn head(&mut self) -> Result<(u8, u64, usize), CborError> {
        let offset = self.pos;
        let first = self.take(1)?[0];
        let (major, info) = (first >> 5, first & 0x1f);
        if !matches!(major, 0 | 2 | 3 | 4 | 5) {
            return Err(CborError::Unsupported {
                offset,
                major,
                info,
            });
        }
        let value = match info {
            0..=23 => u64::from(info),
            24 => {
                let v = u64::from(self.take(1)?[0]);
                if v < 24 {
                    return Err(CborError::NotShortest(offset));
                }
                v
            }
            25 => {
                let v = u64::from(u16::from_be_bytes([self.take(1)?[0], self.take(1)?[0]]));
                if v <= 0xff {
                    return Err(CborError::NotShortest(offset));
                }
                v
            }
            26 => {
                let raw = self.take(4)?;
                let v = u64::from(u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]));
                if v <= 0xffff {
                    return Err(CborError::NotShortest(offset));
                }
                v
            }
            27 => {
                let raw = self.take(8)?;
                let mut buf = [0u8; 8];
                buf.copy_from_slice(raw);
                let v = u64::from_be_bytes(buf);
                if v <= 0xffff_ffff {
                    return Err(CborError::NotShortest(offset));
                }
                v
            }
            _ => {
                return Err(CborError::Unsupported {
                    offset,
                    major,
                    info,
                });
            }
        };
        Ok((major, value, offset))
    }

    fn length(&self, value: u64) -> Result<usize, CborError> {
        usize::try_from(value)
            .ok()
            .filter(|len| *len <= self.bytes.len() - self.pos)
            .ok_or(CborError::Truncated(self.pos))
    }

    fn value(&mut self, depth: usize) -> Result<Cbor, CborError> {
        if depth > MAX_CBOR_DEPTH {
            return Err(CborError::TooDeep);
        }
        self.items += 1;
        if self.items > MAX_CBOR_ITEMS {
            return Err(CborError::TooMany);
        }
        let (major, value, offset) = self.head()?;
        match major {
            0 => Ok(Cbor::Uint(value)),
            2 => {
                let len = self.length(value)?;
                Ok(Cbor::Bytes(self.take(len)?.to_vec()))
            }
            3 => {
                let len = self.length(value)?;
                let raw = self.take(len)?;
                let text = std::str::from_utf8(raw).map_err(|_| CborError::Utf8(offset))?;
                Ok(Cbor::Text(text.to_string()))
            }
            4 => {
                // Each item takes at least one byte, but a declared length is
                // not trusted for memory: reserve a little, grow as items decode.
                let len = self.length(value)?;
                let mut items = Vec::with_capacity(len.min(RESERVE_ITEMS));
                for _ in 0..len {
                    items.push(self.value(depth + 1)?);
                }
                Ok(Cbor::Array(items))
            }
            5 => {
                let len = self.length(value.saturating_mul(2))? / 2;
                let mut entries = Vec::with_capacity(len.min(RESERVE_ITEMS));
                let mut previous_key: Option<Vec<u8>> = None;
                for _ in 0..len {
                    let key_start = self.pos;
                    let key = self.value(depth + 1)?;
                    let key_bytes = self.bytes[key_start..self.pos].to_vec();
                    if previous_key.as_ref().is_some_and(|p| *p >= key_bytes) {
                        return Err(CborError::KeyOrder(key_start));
                    }
                    previous_key = Some(key_bytes);
                    let value = self.value(depth + 1)?;
                    entries.push((key, value));
                }
                Ok(Cbor::Map(entries))
            }
            _ => Err(CborError::Unsupported {
                offset,
                major,
                info: self.bytes[offset] & 0x1f,
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rfc8949_examples() {
        let hex = |c: &Cbor| crate::hex::encode(&c.encode());
        assert_eq!(hex(&Cbor::Uint(0)), "00");
        assert_eq!(hex(&Cbor::Uint(23)), "17");
        assert_eq!(hex(&Cbor::Uint(24)), "1818");
        assert_eq!(hex(&Cbor::Uint(1000)), "1903e8");
        assert_eq!(hex(&Cbor::Uint(1_000_000)), "1a000f4240");
        assert_eq!(hex(&Cbor::Uint(1_000_000_000_000)), "1b000000e8d4a51000");
        assert_eq!(hex(&Cbor::text("IETF")), "6449455446");
        assert_eq!(hex(&Cbor::bytes(vec![1, 2, 3, 4])), "4401020304");
        // Keys sort by encoded bytes: shorter text first, then bytewise.
        let map = Cbor::text_map([
            ("aa", Cbor::Uint(2)),
            ("b", Cbor::Uint(1)),
            ("a", Cbor::Uint(0)),
        ]);
        assert_eq!(hex(&map), "a3616100616201626161".replace(' ', "") + "02");
    }

    #[test]
    fn refuses_non_canonical() {
        assert_eq!(Cbor::decode(&[0x18, 0x05]), Err(CborError::NotShortest(0)));
        assert_eq!(
            Cbor::decode(&[0x19, 0x00, 0x10]),
            Err(CborError::NotShortest(0))
        );
        // {"b":1,"a":0}: keys out of order.
        assert_eq!(
            Cbor::decode(&[0xa2, 0x61, 0x62, 0x01, 0x61, 0x61, 0x00]),
            Err(CborError::KeyOrder(4))
        );
        // Repeated key.
        assert_eq!(
            Cbor::decode(&[0xa2, 0x61, 0x61, 0x01, 0x61, 0x61, 0x00]),
            Err(CborError::KeyOrder(4))
        );
        // Indefinite length, float, negative, bool, tag.
        for bytes in [
            &[0x9f, 0xff][..],
            &[0xf9, 0, 0],
            &[0x20],
            &[0xf5],
            &[0xc0, 0x00],
        ] {
            assert!(
                matches!(Cbor::decode(bytes), Err(CborError::Unsupported { .. })),
                "{bytes:?}"
            );
        }
        assert_eq!(Cbor::decode(&[0x01, 0x00]), Err(CborError::Trailing(1)));
        assert_eq!(
            Cbor::decode(&[0x5a, 0xff, 0xff, 0xff, 0xff]),
            Err(CborError::Truncated(5))
        );
    }

    pub(crate) fn any_cbor() -> impl Strategy<Value = Cbor> {
        let leaf = prop_oneof![
            any::<u64>().prop_map(Cbor::Uint),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(Cbor::Bytes),
            ".{0,20}".prop_map(Cbor::Text),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Cbor::Array),
                proptest::collection::vec((inner.clone(), inner), 0..8).prop_map(Cbor::map),
            ]
        })
    }

    proptest! {
        #[test]
        fn round_trips(value in any_cbor()) {
            let bytes = value.encode();
            prop_assert_eq!(Cbor::decode(&bytes), Ok(value));
        }

        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(value) = Cbor::decode(&bytes) {
                // Whatever decodes is canonical: it re-encodes to itself.
                prop_assert_eq!(value.encode(), bytes);
            }
        }
    }
}
