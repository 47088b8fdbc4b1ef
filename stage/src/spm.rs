//! The SentencePiece tokenizer of GGUF files whose `tokenizer.ggml.model` is
//! `llama` (Gemma, Llama 2, Mistral): tokens with scores, merged pairwise by
//! score, with byte fallback. It follows llama.cpp's SPM tokenizer step for
//! step, because llama.cpp is the reference for GGUF files: the same text
//! must give the same token ids there and here.
//!
//! Encoding: the text is first cut at every special token (control and
//! user-defined tokens, longest first), which become their own ids; each
//! remaining run has its spaces replaced by `▁` (and a leading `▁` when the
//! model asks for it) and is split into UTF-8 characters; the adjacent pair
//! whose concatenation is the best-scored token is merged (leftmost on a
//! tie) until no pair is a token; what is left and is not a token becomes
//! byte tokens `<0xXX>`.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use candle_core::quantized::gguf_file;

use crate::error::{EngineError, Result};

/// GGUF token types (`tokenizer.ggml.token_type`).
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

/// A SentencePiece vocabulary read from GGUF metadata.
#[derive(Debug, Clone)]
pub struct SpmVocabulary {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    ids: HashMap<String, u32>,
    byte_ids: [Option<u32>; 256],
    /// Control, user-defined and unknown tokens, longest text first: the
    /// text is cut at them before merging.
    specials: Vec<u32>,
    add_space_prefix: bool,
    unknown: Option<u32>,
}

fn metadata_error(why: impl Into<String>) -> EngineError {
    EngineError::Tokenizer(why.into())
}

impl SpmVocabulary {
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        use gguf_file::Value;
        let array = |key: &str| match content.metadata.get(key) {
            Some(Value::Array(values)) => Ok(values),
            _ => Err(metadata_error(format!("the GGUF metadata has no {key}"))),
        };
        let tokens: Vec<String> = array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(metadata_error("tokenizer.ggml.tokens holds a non-string")),
            })
            .collect::<Result<_>>()?;
        let scores: Vec<f32> = match content.metadata.get("tokenizer.ggml.scores") {
            Some(Value::Array(values)) => values
                .iter()
                .map(|v| match v {
                    Value::F32(f) => Ok(*f),
                    _ => Err(metadata_error("tokenizer.ggml.scores holds a non-float")),
                })
                .collect::<Result<_>>()?,
            _ => vec![0.0; tokens.len()],
        };
        let types: Vec<i32> = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(values)) => values
                .iter()
                .map(|v| match v {
                    Value::I32(t) => Ok(*t),
                    Value::U32(t) => Ok(*t as i32),
                    _ => Err(metadata_error(
                        "tokenizer.ggml.token_type holds a non-integer",
                    )),
                })
                .collect::<Result<_>>()?,
            _ => vec![NORMAL; tokens.len()],
        };
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(metadata_error(
                "tokenizer.ggml.tokens, scores and token_type differ in length",
            ));
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(metadata_error("more tokens than a u32 can name"));
        }
        let add_space_prefix = !matches!(
            content.metadata.get("tokenizer.ggml.add_space_prefix"),
            Some(Value::Bool(false))
        );
        Ok(Self::new(tokens, scores, types, add_space_prefix))
    }

    fn new(tokens: Vec<String>, scores: Vec<f32>, types: Vec<i32>, add_space_prefix: bool) -> Self {
        let mut ids = HashMap::with_capacity(tokens.len());
        for (id, text) in tokens.iter().enumerate() {
            // The first of duplicate texts wins, as in llama.cpp's map.
            ids.entry(text.clone()).or_insert(id as u32);
        }
        let mut byte_ids = [None; 256];
        for (byte, slot) in byte_ids.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{byte:02X}>")).copied();
        }
        let mut specials: Vec<u32> = (0..tokens.len() as u32)
            .filter(|id| {
                matches!(types[*id as usize], CONTROL | USER_DEFINED | UNKNOWN)
                    && !tokens[*id as usize].is_empty()
            })
            .collect();
        specials.sort_by_key(|id| std::cmp::Reverse(tokens[*id as usize].len()));
        let unknown = types
            .iter()
            .position(|t| *t == UNKNOWN)
            .map(|id| id as u32)
            .or_else(|| ids.get("<unk>").copied());
        Self {
            tokens,
            scores,
            types,
            ids,
            byte_ids,
            specials,
            add_space_prefix,
            unknown,
        }
    }

    /// The first control token whose text `text` holds.
    pub fn control_token_in(&self, text: &str) -> Option<String> {
        self.specials
            .iter()
            .map(|id| *id as usize)
            .filter(|id| self.types[*id] == CONTROL)
            .map(|id| &self.tokens[id])
            .find(|token| text.contains(token.as_str()))
            .cloned()
    }

    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// A token's text, as the vocabulary holds it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokens.get(id as usize).cloned()
    }

    /// The ids of `text`, without a BOS (the caller adds it).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut output = Vec::new();
        let mut previous_special = true;
        for fragment in self.partition(text) {
            match fragment {
                Fragment::Token(id) => {
                    output.push(id);
                    previous_special = true;
                }
                Fragment::Text(raw) => {
                    let mut escaped = String::with_capacity(raw.len() + 3);
                    if self.add_space_prefix && previous_special {
                        escaped.push('▁');
                    }
                    for c in raw.chars() {
                        escaped.push(if c == ' ' { '▁' } else { c });
                    }
                    self.merge(&escaped, &mut output);
                    previous_special = false;
                }
            }
        }
        output
    }

    /// The text cut at every special token, longest first (llama.cpp's
    /// `tokenizer_st_partition`, with special tokens parsed).
    fn partition<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(text)];
        for &id in &self.specials {
            let special = self.tokens[id as usize].as_str();
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(special)))
            {
                continue;
            }
            let mut cut = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    cut.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(special) {
                    if at > 0 {
                        cut.push(Fragment::Text(&rest[..at]));
                    }
                    cut.push(Fragment::Token(id));
                    rest = &rest[at + special.len()..];
                }
                if !rest.is_empty() {
                    cut.push(Fragment::Text(rest));
                }
            }
            fragments = cut;
        }
        fragments
    }

    /// Merge one run of text by score and append its ids.
    fn merge(&self, text: &str, output: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, c) in text.char_indices() {
            let index = symbols.len();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: index.checked_sub(1),
                next: None,
            });
            if let Some(prev) = index.checked_sub(1) {
                symbols[prev].next = Some(index);
            }
        }
        let mut queue = BinaryHeap::new();
        for right in 1..symbols.len() {
            self.push_pair(text, &symbols, right - 1, right, &mut queue);
        }
        while let Some(pair) = queue.pop() {
            let (left, right) = (&symbols[pair.left], &symbols[pair.right]);
            // Stale: one side has merged since the pair was queued.
            if left.len == 0 || right.len == 0 || left.len + right.len != pair.size {
                continue;
            }
            let right_next = right.next;
            let right_len = right.len;
            symbols[pair.left].len += right_len;
            symbols[pair.right].len = 0;
            symbols[pair.left].next = right_next;
            if let Some(next) = right_next {
                symbols[next].prev = Some(pair.left);
            }
            if let Some(prev) = symbols[pair.left].prev {
                self.push_pair(text, &symbols, prev, pair.left, &mut queue);
            }
            if let Some(next) = right_next {
                self.push_pair(text, &symbols, pair.left, next, &mut queue);
            }
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(index) = at {
            let symbol = &symbols[index];
            let piece = &text[symbol.start..symbol.start + symbol.len];
            match self.ids.get(piece) {
                Some(id) => output.push(*id),
                // Every merged symbol is a token, so only a single
                // character outside the vocabulary gets here.
                None => {
                    for byte in piece.bytes() {
                        if let Some(id) = self.byte_ids[byte as usize].or(self.unknown) {
                            output.push(id);
                        }
                    }
                }
            }
            at = symbol.next;
        }
    }

    fn push_pair(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Pair>,
    ) {
        let (l, r) = (&symbols[left], &symbols[right]);
        let joined = &text[l.start..r.start + r.len];
        if let Some(id) = self.ids.get(joined) {
            queue.push(Pair {
                score: self.scores[*id as usize],
                left,
                right,
                size: joined.len(),
            });
        }
    }

    /// The text of `ids`: `▁` back to spaces, byte tokens as their bytes,
    /// user-defined tokens as written; control tokens are left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            let index = id as usize;
            let Some(text) = self.tokens.get(index) else {
                return Err(EngineError::Tokenizer(format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.tokens.len()
                )));
            };
            match self.types[index] {
                NORMAL => bytes.extend_from_slice(text.replace('▁', " ").as_bytes()),
                BYTE => {
                    let value = text
                        .strip_prefix("<0x")
                        .and_then(|t| t.strip_suffix('>'))
                        .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                    if let Some(value) = value {
                        bytes.push(value);
                    }
                }
                USER_DEFINED => bytes.extend_from_slice(text.as_bytes()),
                UNKNOWN => bytes.extend_from_slice("▅".as_bytes()),
                _ => {}
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

#[derive(Debug, Clone, Copy)]
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    /// Bytes; 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge: the best score first, then the leftmost.
#[derive(Debug, Clone, Copy)]
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Pair {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}
impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Pair {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: bytes, a few merges with scores, one control and
    /// one user-defined token.
    fn toy() -> SpmVocabulary {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "<eot>".into()];
        let mut types = vec![UNKNOWN, CONTROL, CONTROL];
        let mut scores = vec![0.0, 0.0, 0.0];
        for byte in 0..=255u8 {
            tokens.push(format!("<0x{byte:02X}>"));
            types.push(BYTE);
            scores.push(0.0);
        }
        for (text, score) in [
            ("▁", -1.0),
            ("a", -1.0),
            ("b", -1.0),
            ("c", -1.0),
            ("ab", -2.0),
            ("bc", -1.5),
            ("▁a", -3.0),
            ("▁ab", -2.5),
        ] {
            tokens.push(text.into());
            types.push(NORMAL);
            scores.push(score);
        }
        tokens.push("\n\n".into());
        types.push(USER_DEFINED);
        scores.push(0.0);
        SpmVocabulary::new(tokens, scores, types, false)
    }

    fn texts(v: &SpmVocabulary, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|id| v.tokens[*id as usize].clone())
            .collect()
    }

    #[test]
    fn merges_the_best_scored_pair_first_and_falls_back_to_bytes() {
        let v = toy();
        // "abc": bc (-1.5) beats ab (-2.0); then a+bc is no token, so the
        // result is a, bc, not abc.
        assert_eq!(texts(&v, &v.encode("abc")), ["a", "bc"]);
        // A space becomes ▁ and merges with what follows.
        assert_eq!(texts(&v, &v.encode(" ab")), ["▁ab"]);
        // A character outside the vocabulary becomes its UTF-8 bytes.
        assert_eq!(texts(&v, &v.encode("é")), ["<0xC3>", "<0xA9>"]);
        // Special tokens are cut out before merging.
        assert_eq!(
            texts(&v, &v.encode("a<eot>b\n\nc")),
            ["a", "<eot>", "b", "\n\n", "c"]
        );
        assert!(v.encode("").is_empty());
    }

    #[test]
    fn decodes_spaces_bytes_and_leaves_control_tokens_out() {
        let v = toy();
        let ids = v.encode(" ab<eot>é\n\n");
        assert_eq!(v.decode(&ids).unwrap(), " abé\n\n");
        assert!(v.decode(&[u32::MAX]).is_err());
    }

    #[test]
    fn a_space_prefix_is_added_when_the_model_asks() {
        let mut v = toy();
        v.add_space_prefix = true;
        assert_eq!(texts(&v, &v.encode("ab")), ["▁ab"]);
    }
}
