//! A vector file as the generator writes it.

use serde_json::Value;

/// One generated file: path under `vectors/` and its bytes.
pub type VectorFile = (String, String);

pub(crate) fn pretty(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    text
}
