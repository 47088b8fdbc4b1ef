//! Deterministic CBOR (RFC 8949 §4.2.1) for signed cores, grants and journal
//! records: shortest-form heads, definite lengths, map keys in bytewise order
//! of their encodings. The value model has no floats, booleans, nulls or
//! negative numbers, because the records signed with it forbid them
//! (booleans are written as `0|1`, absent options are dropped).
//!
//! `ciborium` does the generic work: it writes every head (always in
//! shortest form, always with definite lengths) and parses every document.
//! What it cannot do is kept here, on top of it:
//!
//! - map keys in RFC 8949 *bytewise* order: ciborium's canonical ordering
//!   is RFC 7049's length-first one, which orders mixed key types
//!   differently, so maps are sorted here before they are written;
//! - refusing what is not canonical: ciborium accepts long-form heads,
//!   indefinite lengths, unsorted or repeated keys, tags, floats and simple
//!   values, and its value model forgets how a head was written. So after
//!   ciborium has parsed a document, [`Canonical`] walks the parsed value and
//!   the input side by side and refuses, with the byte offset, the first head
//!   that is not shortest, the first value outside the model and the first
//!   map key out of order;
//! - bounds: at most `MAX_CBOR_DEPTH` nesting (also passed to ciborium as
//!   its recursion limit, so a deep document is refused while it is parsed),
//!   at most `MAX_CBOR_ITEMS` items, no trailing bytes. ciborium grows byte
//!   and text strings chunk by chunk as their bytes arrive, never by a
//!   declared length, so what it allocates is bounded by the input's length.

use std::collections::BTreeMap;

use thiserror::Error;

/// Deepest nesting the decoder accepts.
pub const MAX_CBOR_DEPTH: usize = 16;
/// Most data items (of any kind) one document may hold.
pub const MAX_CBOR_ITEMS: usize = 65_536;

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
    #[error("byte {0}: malformed CBOR")]
    Malformed(usize),
    #[error("nesting deeper than {MAX_CBOR_DEPTH}")]
    TooDeep,
    #[error("more than {MAX_CBOR_ITEMS} items")]
    TooMany,
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
        // Writing into a Vec cannot fail, and every value of this model is
        // representable, so there is no error to report.
        let _ = ciborium::into_writer(self, &mut out);
        out
    }

    /// Decode one canonical value that spans all of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Cbor, CborError> {
        let parsed: ciborium::Value =
            ciborium::de::from_reader_with_recursion_limit(bytes, MAX_CBOR_DEPTH + 1)
                .map_err(|error| parse_error(bytes, error))?;
        let mut canonical = Canonical {
            input: bytes,
            pos: 0,
            items: 0,
        };
        let value = canonical.value(parsed, 0)?;
        if canonical.pos != bytes.len() {
            return Err(CborError::Trailing(bytes.len() - canonical.pos));
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

/// ciborium writes the heads; map entries go out in bytewise order of their
/// encoded keys, whatever order a hand-built `Cbor::Map` holds them in, and a
/// repeated key is written once.
impl serde::Serialize for Cbor {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self {
            Cbor::Uint(value) => serializer.serialize_u64(*value),
            Cbor::Bytes(bytes) => serializer.serialize_bytes(bytes),
            Cbor::Text(text) => serializer.serialize_str(text),
            Cbor::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Cbor::Map(entries) => {
                let mut sorted: Vec<(Vec<u8>, &Cbor, &Cbor)> =
                    entries.iter().map(|(k, v)| (k.encode(), k, v)).collect();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                sorted.dedup_by(|a, b| a.0 == b.0);
                let mut map = serializer.serialize_map(Some(sorted.len()))?;
                for (_, key, value) in sorted {
                    map.serialize_entry(key, value)?;
                }
                map.end()
            }
        }
    }
}

/// Why a map's members are not what a record or message needs.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FieldError {
    #[error("expected a map with text keys")]
    NotAMap,
    #[error("missing member `{0}`")]
    Missing(&'static str),
    #[error("member `{0}` has the wrong type, size or form")]
    Invalid(&'static str),
    #[error("unknown member `{0}`")]
    Unknown(String),
}

/// The one strict reader of a CBOR map with text keys that every decoder
/// here uses: members are read by name and type, text is bounded, and
/// `finish` refuses any member nobody asked for, so a field a sender adds
/// is an error rather than something silently ignored.
#[derive(Debug)]
pub struct Fields<'a> {
    entries: &'a [(Cbor, Cbor)],
    known: Vec<&'static str>,
    max_text: usize,
}

impl<'a> Fields<'a> {
    /// Read the members of `value`; text members are unbounded here (the
    /// whole message is bounded by its reader) until `text_limit` says so.
    pub fn of(value: &'a Cbor) -> Result<Self, FieldError> {
        match value {
            Cbor::Map(entries) => Ok(Self {
                entries,
                known: Vec::new(),
                max_text: usize::MAX,
            }),
            _ => Err(FieldError::NotAMap),
        }
    }
    /// Refuse text members longer than `max` bytes.
    pub fn text_limit(mut self, max: usize) -> Self {
        self.max_text = max;
        self
    }
    pub fn optional(&mut self, key: &'static str) -> Option<&'a Cbor> {
        self.known.push(key);
        self.entries
            .iter()
            .find(|(k, _)| k.as_text() == Some(key))
            .map(|(_, v)| v)
    }
    pub fn required(&mut self, key: &'static str) -> Result<&'a Cbor, FieldError> {
        self.optional(key).ok_or(FieldError::Missing(key))
    }
    pub fn uint(&mut self, key: &'static str) -> Result<u64, FieldError> {
        self.required(key)?
            .as_uint()
            .ok_or(FieldError::Invalid(key))
    }
    pub fn opt_uint(&mut self, key: &'static str) -> Result<Option<u64>, FieldError> {
        self.optional(key)
            .map(|v| v.as_uint().ok_or(FieldError::Invalid(key)))
            .transpose()
    }
    pub fn u32(&mut self, key: &'static str) -> Result<u32, FieldError> {
        u32::try_from(self.uint(key)?).map_err(|_| FieldError::Invalid(key))
    }
    pub fn text(&mut self, key: &'static str) -> Result<&'a str, FieldError> {
        let max = self.max_text;
        self.required(key)?
            .as_text()
            .filter(|t| t.len() <= max)
            .ok_or(FieldError::Invalid(key))
    }
    pub fn opt_text(&mut self, key: &'static str) -> Result<Option<&'a str>, FieldError> {
        let max = self.max_text;
        self.optional(key)
            .map(|v| {
                v.as_text()
                    .filter(|t| t.len() <= max)
                    .ok_or(FieldError::Invalid(key))
            })
            .transpose()
    }
    pub fn bytes(&mut self, key: &'static str) -> Result<&'a [u8], FieldError> {
        self.required(key)?
            .as_bytes()
            .ok_or(FieldError::Invalid(key))
    }
    pub fn opt_bytes(&mut self, key: &'static str) -> Result<Option<&'a [u8]>, FieldError> {
        self.optional(key)
            .map(|v| v.as_bytes().ok_or(FieldError::Invalid(key)))
            .transpose()
    }
    /// A byte string of exactly `N` bytes.
    pub fn fixed<const N: usize>(&mut self, key: &'static str) -> Result<[u8; N], FieldError> {
        self.bytes(key)?
            .try_into()
            .map_err(|_| FieldError::Invalid(key))
    }
    pub fn opt_fixed<const N: usize>(
        &mut self,
        key: &'static str,
    ) -> Result<Option<[u8; N]>, FieldError> {
        self.optional(key)
            .map(|v| {
                v.as_bytes()
                    .and_then(|b| b.try_into().ok())
                    .ok_or(FieldError::Invalid(key))
            })
            .transpose()
    }
    pub fn array(&mut self, key: &'static str) -> Result<&'a [Cbor], FieldError> {
        self.required(key)?
            .as_array()
            .ok_or(FieldError::Invalid(key))
    }
    /// Lower-case hex of 32 bytes, as text.
    pub fn hex32(&mut self, key: &'static str) -> Result<[u8; 32], FieldError> {
        crate::hex::decode_array(self.text(key)?).ok_or(FieldError::Invalid(key))
    }
    pub fn opt_hex32(&mut self, key: &'static str) -> Result<Option<[u8; 32]>, FieldError> {
        self.opt_text(key)?
            .map(|t| crate::hex::decode_array(t).ok_or(FieldError::Invalid(key)))
            .transpose()
    }
    /// Every member was asked for, or the map is refused.
    pub fn finish(self) -> Result<(), FieldError> {
        for (key, _) in self.entries {
            match key.as_text() {
                Some(name) if self.known.contains(&name) => {}
                Some(name) => return Err(FieldError::Unknown(name.to_string())),
                None => return Err(FieldError::Unknown("(a key that is not text)".into())),
            }
        }
        Ok(())
    }
}

/// The major type and additional information of the head at `offset`.
fn head_at(input: &[u8], offset: usize) -> Option<(u8, u8)> {
    input.get(offset).map(|first| (first >> 5, first & 0x1f))
}

/// ciborium's parse errors, in this module's terms.
fn parse_error(input: &[u8], error: ciborium::de::Error<std::io::Error>) -> CborError {
    use ciborium::de::Error;
    let offset = match error {
        Error::Io(_) => return CborError::Truncated(input.len()),
        Error::RecursionLimitExceeded => return CborError::TooDeep,
        Error::Syntax(offset) | Error::Semantic(Some(offset), _) => offset,
        Error::Semantic(None, _) => return CborError::Malformed(0),
    };
    match head_at(input, offset) {
        Some((3, _)) => CborError::Utf8(offset),
        Some((major, info)) if !matches!(major, 0 | 2 | 4 | 5) || info > 27 => {
            CborError::Unsupported {
                offset,
                major,
                info,
            }
        }
        _ => CborError::Malformed(offset),
    }
}

/// Walks a value ciborium parsed alongside the bytes it came from, refusing
/// whatever the deterministic profile does not allow.
struct Canonical<'a> {
    input: &'a [u8],
    /// Offset of the next head in `input`.
    pos: usize,
    items: usize,
}

impl Canonical<'_> {
    fn value(&mut self, parsed: ciborium::Value, depth: usize) -> Result<Cbor, CborError> {
        use ciborium::Value;
        if depth > MAX_CBOR_DEPTH {
            return Err(CborError::TooDeep);
        }
        self.items += 1;
        if self.items > MAX_CBOR_ITEMS {
            return Err(CborError::TooMany);
        }
        let offset = self.pos;
        let (major, info) = head_at(self.input, offset).ok_or(CborError::Truncated(offset))?;
        // The input byte, not the parsed value, decides: ciborium turns a
        // bignum tag into an integer and an indefinite string into a
        // definite one.
        if !matches!(major, 0 | 2 | 3 | 4 | 5) || info > 27 {
            return Err(CborError::Unsupported {
                offset,
                major,
                info,
            });
        }
        let argument = match &parsed {
            Value::Integer(integer) => u64::try_from(*integer).ok(),
            Value::Bytes(bytes) => Some(bytes.len() as u64),
            Value::Text(text) => Some(text.len() as u64),
            Value::Array(items) => Some(items.len() as u64),
            Value::Map(entries) => Some(entries.len() as u64),
            _ => None,
        };
        let argument = argument.ok_or(CborError::Unsupported {
            offset,
            major,
            info,
        })?;
        let written = match info {
            0..=23 => 1,
            24 => 2,
            25 => 3,
            26 => 5,
            _ => 9,
        };
        let shortest = match argument {
            0..=23 => 1,
            24..=0xff => 2,
            0x100..=0xffff => 3,
            0x1_0000..=0xffff_ffff => 5,
            _ => 9,
        };
        if written != shortest {
            return Err(CborError::NotShortest(offset));
        }
        self.pos += written;
        Ok(match parsed {
            Value::Integer(_) => Cbor::Uint(argument),
            Value::Bytes(bytes) => {
                self.pos += bytes.len();
                Cbor::Bytes(bytes)
            }
            Value::Text(text) => {
                self.pos += text.len();
                Cbor::Text(text)
            }
            Value::Array(items) => Cbor::Array(
                items
                    .into_iter()
                    .map(|item| self.value(item, depth + 1))
                    .collect::<Result<_, _>>()?,
            ),
            Value::Map(entries) => {
                let mut map = Vec::with_capacity(entries.len());
                let mut previous_key: Option<&[u8]> = None;
                for (key, value) in entries {
                    let key_start = self.pos;
                    let key = self.value(key, depth + 1)?;
                    let input = self.input;
                    let key_bytes = input
                        .get(key_start..self.pos)
                        .ok_or(CborError::Truncated(key_start))?;
                    if previous_key.is_some_and(|previous| previous >= key_bytes) {
                        return Err(CborError::KeyOrder(key_start));
                    }
                    previous_key = Some(key_bytes);
                    map.push((key, self.value(value, depth + 1)?));
                }
                Cbor::Map(map)
            }
            _ => {
                return Err(CborError::Unsupported {
                    offset,
                    major,
                    info,
                });
            }
        })
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

    #[test]
    fn refuses_what_ciborium_accepts_but_the_profile_does_not() {
        // Indefinite-length text ("a" in one chunk), bignum 1, undefined,
        // a tagged uint, -1 as a map key.
        for (bytes, offset) in [
            (&[0x7f, 0x61, 0x61, 0xff][..], 0),
            (&[0xc2, 0x41, 0x01], 0),
            (&[0xf7], 0),
            (&[0x81, 0xd8, 0x20, 0x01], 1),
            (&[0xa1, 0x20, 0x00], 1),
        ] {
            assert!(
                matches!(Cbor::decode(bytes), Err(CborError::Unsupported { offset: o, .. }) if o == offset),
                "{bytes:02x?}: {:?}",
                Cbor::decode(bytes)
            );
        }
        // A long-form length inside an array, at its own offset.
        assert_eq!(
            Cbor::decode(&[0x82, 0x00, 0x58, 0x01, 0x07]),
            Err(CborError::NotShortest(2))
        );
        // Text that is not UTF-8.
        assert_eq!(Cbor::decode(&[0x62, 0xc3, 0x28]), Err(CborError::Utf8(0)));
    }

    #[test]
    fn bounds_depth_and_items() {
        let nested = |depth: usize| {
            let mut value = Cbor::Uint(0);
            for _ in 0..depth {
                value = Cbor::Array(vec![value]);
            }
            value.encode()
        };
        // The innermost value sits at depth `depth`.
        assert!(Cbor::decode(&nested(MAX_CBOR_DEPTH)).is_ok());
        assert_eq!(
            Cbor::decode(&nested(MAX_CBOR_DEPTH + 1)),
            Err(CborError::TooDeep)
        );
        // Refused while ciborium parses, long before the stack runs out.
        let deep: Vec<u8> = [0x81; 100_000].into_iter().chain([0x00]).collect();
        assert_eq!(Cbor::decode(&deep), Err(CborError::TooDeep));
        let many = |n: usize| Cbor::Array(vec![Cbor::Uint(0); n]).encode();
        assert!(Cbor::decode(&many(MAX_CBOR_ITEMS - 1)).is_ok());
        assert_eq!(Cbor::decode(&many(MAX_CBOR_ITEMS)), Err(CborError::TooMany));
    }

    #[test]
    fn a_hand_built_map_still_encodes_canonically() {
        let unsorted = Cbor::Map(vec![
            (Cbor::text("b"), Cbor::Uint(1)),
            (Cbor::Uint(1000), Cbor::Uint(2)),
            (Cbor::text("b"), Cbor::Uint(3)),
            (Cbor::text("a"), Cbor::Uint(0)),
        ]);
        // Bytewise order of the encoded keys puts the uint first (major 0),
        // which ciborium's length-first ordering would not.
        assert_eq!(
            crate::hex::encode(&unsorted.encode()),
            "a31903e8026161006162".to_string() + "01"
        );
    }

    #[test]
    fn fields_read_by_name_and_refuse_what_nobody_asked_for() {
        let map = Cbor::text_map([
            ("n", Cbor::Uint(7)),
            ("t", Cbor::text("abc")),
            ("b", Cbor::bytes(vec![1, 2])),
        ]);
        let mut fields = Fields::of(&map).unwrap().text_limit(3);
        assert_eq!(fields.uint("n"), Ok(7));
        assert_eq!(fields.text("t"), Ok("abc"));
        assert_eq!(fields.fixed::<2>("b"), Ok([1, 2]));
        assert_eq!(fields.opt_uint("absent"), Ok(None));
        assert_eq!(fields.finish(), Ok(()));

        let mut fields = Fields::of(&map).unwrap().text_limit(2);
        assert_eq!(fields.text("t"), Err(FieldError::Invalid("t")));
        assert_eq!(fields.fixed::<3>("b"), Err(FieldError::Invalid("b")));
        assert_eq!(fields.uint("missing"), Err(FieldError::Missing("missing")));
        assert_eq!(fields.finish(), Err(FieldError::Unknown("n".into())));
        assert_eq!(
            Fields::of(&Cbor::Uint(1)).map(|_| ()),
            Err(FieldError::NotAMap)
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
