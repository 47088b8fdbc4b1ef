//! Strict JSON: the reading and canonical writing every record goes through.
//!
//! Records are compared by digest, so the reader refuses what a lenient parser
//! would quietly resolve: duplicate members (two readers could keep different
//! ones), trailing bytes, inputs over a size bound, and nesting past a depth
//! bound. Canonical bytes are RFC 8785 (JCS).

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use thiserror::Error;

/// Largest JSON document [`parse_strict`] reads. A `record-push/1` body is at
/// most 1 MiB; a requester's bundle may carry 64 records plus a receipt.
pub const MAX_JSON_BYTES: usize = 16 * 1024 * 1024;

/// Deepest nesting of arrays and objects [`parse_strict`] accepts. The
/// deepest record of this family nests 7 levels.
pub const MAX_JSON_DEPTH: usize = 64;

/// Why a JSON document could not be read.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum JsonError {
    #[error("document is {size} bytes, over the {max}-byte limit")]
    TooLarge { size: usize, max: usize },
    #[error("line {line}, column {column}: {message}")]
    Syntax {
        line: usize,
        column: usize,
        message: String,
    },
}

/// Parse one JSON document strictly (see the module documentation).
pub fn parse_strict(bytes: &[u8]) -> Result<Value, JsonError> {
    if bytes.len() > MAX_JSON_BYTES {
        return Err(JsonError::TooLarge {
            size: bytes.len(),
            max: MAX_JSON_BYTES,
        });
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = StrictSeed { depth: 0 }
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value))
        .map_err(|error| JsonError::Syntax {
            line: error.line(),
            column: error.column(),
            message: strip_position(&error.to_string()),
        })?;
    Ok(value)
}

/// serde_json appends " at line L column C"; the error carries them apart.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(index) => message[..index].to_string(),
        None => message.to_string(),
    }
}

/// RFC 8785 canonical bytes of a JSON value.
pub fn canonical_bytes(value: &Value) -> Vec<u8> {
    // serde_jcs only fails on values a `Value` cannot hold (non-string keys,
    // non-finite floats); fall back to compact output rather than panic.
    serde_jcs::to_vec(value).unwrap_or_else(|_| value.to_string().into_bytes())
}

struct StrictSeed {
    depth: usize,
}

impl StrictSeed {
    fn nested<E: de::Error>(&self) -> Result<StrictSeed, E> {
        if self.depth >= MAX_JSON_DEPTH {
            return Err(E::custom(format_args!(
                "nesting deeper than {MAX_JSON_DEPTH} levels"
            )));
        }
        Ok(StrictSeed {
            depth: self.depth + 1,
        })
    }
}

impl<'de> DeserializeSeed<'de> for StrictSeed {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictSeed {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("non-finite number"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self.nested()?)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if members.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate member `{key}`")));
            }
            let value = map.next_value_seed(self.nested()?)?;
            members.insert(key, value);
        }
        Ok(Value::Object(members))
    }
}

/// Why a parsed JSON value does not have the shape a record requires.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{path}: {problem}")]
pub struct ShapeError {
    /// Where, as a JSON-pointer-like path (`/upstream/received/digest`).
    pub path: String,
    pub problem: Problem,
}

/// What is wrong at [`ShapeError::path`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Problem {
    #[error("required member is missing")]
    Missing,
    #[error("unknown member")]
    Unknown,
    #[error("expected {0}")]
    WrongType(&'static str),
    #[error("{0}")]
    Invalid(String),
}

impl ShapeError {
    pub fn new(path: impl Into<String>, problem: Problem) -> Self {
        Self {
            path: path.into(),
            problem,
        }
    }
    pub fn invalid(path: impl Into<String>, why: impl Into<String>) -> Self {
        Self::new(path, Problem::Invalid(why.into()))
    }
}

/// Reads the members of one JSON object, refusing unknown ones at the end.
pub(crate) struct Members<'a> {
    map: &'a Map<String, Value>,
    path: String,
    known: Vec<&'static str>,
}

impl<'a> Members<'a> {
    pub(crate) fn of(value: &'a Value, path: &str) -> Result<Self, ShapeError> {
        match value {
            Value::Object(map) => Ok(Self {
                map,
                path: path.to_string(),
                known: Vec::new(),
            }),
            _ => Err(ShapeError::new(
                path_or_root(path),
                Problem::WrongType("an object"),
            )),
        }
    }

    pub(crate) fn path(&self, key: &str) -> String {
        format!("{}/{key}", self.path)
    }

    /// A member that may be absent; `null` reads as absent, as serde's
    /// `Option` writes it.
    pub(crate) fn optional(&mut self, key: &'static str) -> Option<&'a Value> {
        self.known.push(key);
        self.map.get(key).filter(|value| !value.is_null())
    }

    /// Whether the member is present at all, `null` included.
    pub(crate) fn present(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    pub(crate) fn required(&mut self, key: &'static str) -> Result<&'a Value, ShapeError> {
        self.optional(key)
            .ok_or_else(|| ShapeError::new(self.path(key), Problem::Missing))
    }

    pub(crate) fn string(&mut self, key: &'static str) -> Result<&'a str, ShapeError> {
        let path = self.path(key);
        as_str(self.required(key)?, &path)
    }

    pub(crate) fn non_empty_string(&mut self, key: &'static str) -> Result<&'a str, ShapeError> {
        let path = self.path(key);
        let text = self.string(key)?;
        if text.is_empty() {
            return Err(ShapeError::invalid(path, "must not be empty"));
        }
        Ok(text)
    }

    pub(crate) fn u64(&mut self, key: &'static str) -> Result<u64, ShapeError> {
        let path = self.path(key);
        as_u64(self.required(key)?, &path)
    }

    pub(crate) fn u32(&mut self, key: &'static str) -> Result<u32, ShapeError> {
        let path = self.path(key);
        let value = self.u64(key)?;
        u32::try_from(value).map_err(|_| ShapeError::invalid(path, "above the u32 range"))
    }

    pub(crate) fn array(&mut self, key: &'static str) -> Result<&'a Vec<Value>, ShapeError> {
        let path = self.path(key);
        self.required(key)?
            .as_array()
            .ok_or_else(|| ShapeError::new(path, Problem::WrongType("an array")))
    }

    /// An array of at most `max` items, each read by `item`; an item it
    /// refuses is invalid, and `must` says what it must be.
    pub(crate) fn list<T>(
        &mut self,
        key: &'static str,
        max: usize,
        must: &str,
        item: impl Fn(&Value) -> Option<T>,
    ) -> Result<Vec<T>, ShapeError> {
        let path = self.path(key);
        let items = self.array(key)?;
        if items.len() > max {
            return Err(ShapeError::invalid(
                path,
                format!("more than {max} entries"),
            ));
        }
        items
            .iter()
            .enumerate()
            .map(|(i, value)| {
                item(value).ok_or_else(|| ShapeError::invalid(format!("{path}/{i}"), must))
            })
            .collect()
    }

    /// Refuse any member not read through this reader.
    pub(crate) fn finish(self) -> Result<(), ShapeError> {
        match self
            .map
            .keys()
            .find(|key| !self.known.contains(&key.as_str()))
        {
            Some(key) => Err(ShapeError::new(self.path(key), Problem::Unknown)),
            None => Ok(()),
        }
    }
}

fn path_or_root(path: &str) -> &str {
    if path.is_empty() { "/" } else { path }
}

pub(crate) fn as_str<'a>(value: &'a Value, path: &str) -> Result<&'a str, ShapeError> {
    value
        .as_str()
        .ok_or_else(|| ShapeError::new(path, Problem::WrongType("a string")))
}

pub(crate) fn as_u64(value: &Value, path: &str) -> Result<u64, ShapeError> {
    value
        .as_u64()
        .ok_or_else(|| ShapeError::new(path, Problem::WrongType("a non-negative integer")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refuses_duplicate_members_and_trailing_bytes() {
        let error = parse_strict(br#"{"a":1,"a":2}"#).unwrap_err();
        assert!(
            error.to_string().contains("duplicate member `a`"),
            "{error}"
        );
        assert!(parse_strict(br#"{"a":1} x"#).is_err());
        assert!(parse_strict(br#"{"a":{"a":1},"b":[{"a":1}]}"#).is_ok());
    }

    #[test]
    fn reports_line_and_column() {
        let error = parse_strict(b"{\n  \"a\": x,\n}").unwrap_err();
        match error {
            JsonError::Syntax { line, .. } => assert_eq!(line, 2),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn bounds_depth() {
        let deep = "[".repeat(MAX_JSON_DEPTH + 2) + &"]".repeat(MAX_JSON_DEPTH + 2);
        assert!(parse_strict(deep.as_bytes()).is_err());
        let fine = "[".repeat(MAX_JSON_DEPTH) + &"]".repeat(MAX_JSON_DEPTH);
        assert!(parse_strict(fine.as_bytes()).is_ok());
    }

    #[test]
    fn canonical_form_sorts_and_compacts() {
        let value = parse_strict(br#"{ "b": [1, "\u00e9"], "a": null }"#).unwrap();
        assert_eq!(
            canonical_bytes(&value),
            "{\"a\":null,\"b\":[1,\"é\"]}".as_bytes()
        );
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_strict(&bytes);
        }
    }
}
