//! Tokenizers and chat templates, from the model's own metadata.

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::Tokenizer;

use crate::error::{EngineError, Result};
use crate::source::Source;
use crate::spm::SpmVocabulary;

/// A model's tokenizer with what generation needs around it.
#[derive(Debug, Clone)]
pub struct TextCodec {
    tokenizer: Vocabulary,
    eos: Vec<u32>,
    bos: Option<u32>,
    add_bos: bool,
    chat: Option<ChatTemplate>,
    /// Whether the model carries a chat template at all (recognised or not).
    has_template: bool,
}

/// The text of a growing list of token ids, as `TextCodec::decode` gives
/// it for the whole list, worked out at each new id from the last few ids
/// instead of the whole list, whose decoding costs a step more the longer
/// the output grows. Where a new id changes text before the last few (a
/// byte-fallback decoder turns a whole run of byte ids into U+FFFD while
/// its last character is incomplete), the whole list is decoded instead.
#[derive(Debug, Clone, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    text: String,
    /// The ids whose text ends on a whole character, and that text's
    /// length: the start of `text` that the ids after them did not change.
    settled_ids: usize,
    settled_len: usize,
}

/// Ids decoded again before the settled end, so that the new ones are
/// decoded in context: a decoder drops the space of a list's first word,
/// and a character's bytes can be split over several ids.
const STREAM_CONTEXT: usize = 4;

/// Further ids a window reaches back over while they decode to nothing
/// (special tokens skipped), before the whole list is decoded instead.
const STREAM_REACH: usize = 64;

impl TextStream {
    /// Add `id`, and return the whole text so far.
    pub fn push(&mut self, codec: &TextCodec, id: u32) -> Result<&str> {
        self.ids.push(id);
        let mut from = self.settled_ids.saturating_sub(STREAM_CONTEXT);
        let mut settled = codec.decode(&self.ids[from..self.settled_ids])?;
        // The context must hold text for the new ids to be decoded after it.
        let lowest = from.saturating_sub(STREAM_REACH);
        while settled.is_empty() && from > lowest {
            from -= 1;
            settled = codec.decode(&self.ids[from..self.settled_ids])?;
        }
        let now = (!settled.is_empty() || from == 0)
            .then(|| codec.decode(&self.ids[from..]))
            .transpose()?;
        match now
            .as_deref()
            .and_then(|now| now.strip_prefix(settled.as_str()))
        {
            Some(fresh) if !settled.ends_with('\u{FFFD}') => {
                self.text.truncate(self.settled_len);
                self.text.push_str(fresh);
            }
            _ => {
                let whole = codec.decode(&self.ids)?;
                if !whole.starts_with(&self.text[..self.settled_len]) {
                    // What was settled changed: nothing is until the text
                    // ends on a whole character again.
                    self.settled_ids = 0;
                    self.settled_len = 0;
                }
                self.text = whole;
            }
        }
        // A character still missing bytes decodes as U+FFFD for now.
        if !self.text.ends_with('\u{FFFD}') {
            self.settled_ids = self.ids.len();
            self.settled_len = self.text.len();
        }
        Ok(&self.text)
    }

    /// The text so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// The two tokenizer kinds a model can carry.
#[derive(Debug, Clone)]
enum Vocabulary {
    /// Byte-level BPE (GGUF `gpt2`) or a `tokenizer.json`, through the
    /// `tokenizers` crate.
    Hf(Box<Tokenizer>),
    /// SentencePiece by scores (GGUF `llama`: Gemma, Llama 2, Mistral).
    Spm(Box<SpmVocabulary>),
}

impl Vocabulary {
    fn token_to_id(&self, text: &str) -> Option<u32> {
        match self {
            Vocabulary::Hf(t) => t.token_to_id(text),
            Vocabulary::Spm(v) => v.token_to_id(text),
        }
    }
}

/// The chat formats this engine renders (from the model's own template).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\n…<|im_end|>\n`, with the template's default system
    /// message when it has one (SmolLM2, Qwen2).
    ChatMl { default_system: Option<String> },
    /// Llama 3: `<|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>`.
    Llama3,
    /// Llama 2 / Mistral: `[INST] … [/INST]`.
    Inst,
}

impl ChatTemplate {
    /// Recognise a Jinja chat template by its markers.
    pub fn recognise(template: &str) -> Option<Self> {
        if template.contains("<|im_start|>") {
            let default_system = template.find("<|im_start|>system\n").and_then(|start| {
                let rest = &template[start + "<|im_start|>system\n".len()..];
                let end = rest.find("<|im_end|>")?;
                let text = &rest[..end];
                (!text.contains("{{") && !text.contains("message")).then(|| text.to_string())
            });
            Some(ChatTemplate::ChatMl { default_system })
        } else if template.contains("<|start_header_id|>") {
            Some(ChatTemplate::Llama3)
        } else if template.contains("[INST]") {
            Some(ChatTemplate::Inst)
        } else {
            None
        }
    }

    /// A conversation (`role`: system, user or assistant; in order), ready
    /// for the assistant's next answer.
    pub fn render(&self, turns: &[(&str, String)]) -> String {
        match self {
            ChatTemplate::ChatMl { default_system } => {
                let mut out = String::new();
                if turns.first().is_none_or(|(role, _)| *role != "system")
                    && let Some(system) = default_system
                {
                    out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
                }
                for (role, content) in turns {
                    out.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
                }
                out.push_str("<|im_start|>assistant\n");
                out
            }
            ChatTemplate::Llama3 => {
                let mut out = String::from("<|begin_of_text|>");
                for (role, content) in turns {
                    out.push_str(&format!(
                        "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"
                    ));
                }
                out.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
                out
            }
            ChatTemplate::Inst => {
                // System text goes before the first user turn, as the
                // Llama 2 and Mistral templates put it.
                let mut out = String::new();
                let mut system = String::new();
                for (role, content) in turns {
                    match *role {
                        "system" => {
                            system.push_str(content);
                            system.push_str("\n\n");
                        }
                        "assistant" => out.push_str(&format!(" {content}</s>")),
                        _ => {
                            out.push_str(&format!("[INST] {system}{content} [/INST]"));
                            system.clear();
                        }
                    }
                }
                out
            }
        }
    }

    /// One user turn, ready for the assistant's answer.
    pub fn render_user(&self, prompt: &str) -> String {
        match self {
            ChatTemplate::ChatMl { default_system } => {
                let system = default_system
                    .as_ref()
                    .map(|s| format!("<|im_start|>system\n{s}<|im_end|>\n"))
                    .unwrap_or_default();
                format!("{system}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
            }
            ChatTemplate::Llama3 => format!(
                "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            ),
            ChatTemplate::Inst => format!("[INST] {prompt} [/INST]"),
        }
    }
}

/// A GGUF `gpt2` (byte-level BPE) tokenizer, through candle's reader, with
/// its pre-tokenizer set as llama.cpp sets it for the file's
/// `tokenizer.ggml.pre`. candle's default adds a space before the text
/// ("The" becomes "ĠThe"), which neither llama.cpp nor the models' own
/// `tokenizer.json` do; SmolLM's also isolates every digit.
pub(crate) fn byte_level_bpe(content: &gguf_file::Content) -> Result<Tokenizer> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    let mut tokenizer = Tokenizer::from_gguf(content).map_err(tokenizer_error)?;
    let pre = match content.metadata.get("tokenizer.ggml.pre") {
        Some(gguf_file::Value::String(pre)) => pre.as_str(),
        _ => "default",
    };
    let byte_level = ByteLevel::new(false, true, true);
    match pre {
        // candle's own settings for these match the models' tokenizer.json.
        "qwen2" | "smaug-bpe" | "lfm2" | "llama3" => {}
        "smollm" => {
            tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                byte_level.into(),
            ])));
        }
        _ => {
            tokenizer.with_pre_tokenizer(Some(byte_level));
        }
    }
    Ok(tokenizer)
}

fn tokenizer_error(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

impl TextCodec {
    /// The tokenizer in the model's metadata (GGUF) or beside it
    /// (`tokenizer.json`, `tokenizer_config.json` for a safetensors directory).
    pub fn from_source(source: &Source) -> Result<Self> {
        match source {
            Source::Gguf { content, .. } => Self::from_gguf(content),
            Source::Safetensors { dir, .. } => Self::from_dir(dir),
        }
    }

    fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let tokenizer = match content.metadata.get("tokenizer.ggml.model") {
            Some(gguf_file::Value::String(kind)) if kind == "llama" => {
                Vocabulary::Spm(Box::new(SpmVocabulary::from_gguf(content)?))
            }
            _ => Vocabulary::Hf(Box::new(byte_level_bpe(content)?)),
        };
        let id = |key: &str| match content.metadata.get(key) {
            Some(gguf_file::Value::U32(v)) => Some(*v),
            Some(gguf_file::Value::I32(v)) => u32::try_from(*v).ok(),
            _ => None,
        };
        let add_bos = matches!(
            content.metadata.get("tokenizer.ggml.add_bos_token"),
            Some(gguf_file::Value::Bool(true))
        );
        let template = match content.metadata.get("tokenizer.chat_template") {
            Some(gguf_file::Value::String(t)) => Some(t.as_str()),
            _ => None,
        };
        let chat = template.and_then(ChatTemplate::recognise);
        let mut codec = Self {
            tokenizer,
            eos: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
            bos: id("tokenizer.ggml.bos_token_id"),
            add_bos,
            chat,
            has_template: template.is_some(),
        };
        codec.add_turn_end_tokens();
        Ok(codec)
    }

    fn from_dir(dir: &std::path::Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&path)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))?;
        let config: serde_json::Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let token = |key: &str| -> Option<u32> {
            let text = match &config[key] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o.get("content")?.as_str()?.to_string(),
                _ => return None,
            };
            tokenizer.token_to_id(&text)
        };
        let template = config["chat_template"].as_str();
        let chat = template.and_then(ChatTemplate::recognise);
        let mut codec = Self {
            eos: token("eos_token").into_iter().collect(),
            bos: token("bos_token"),
            add_bos: config["add_bos_token"].as_bool().unwrap_or(false),
            chat,
            has_template: template.is_some(),
            tokenizer: Vocabulary::Hf(Box::new(tokenizer)),
        };
        codec.add_turn_end_tokens();
        Ok(codec)
    }

    /// Chat models end a turn with their own marker; stop there too.
    fn add_turn_end_tokens(&mut self) {
        for marker in [
            "<|im_end|>",
            "<|eot_id|>",
            "<|endoftext|>",
            "</s>",
            "<end_of_turn>",
        ] {
            if let Some(id) = self.tokenizer.token_to_id(marker)
                && !self.eos.contains(&id)
            {
                self.eos.push(id);
            }
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos
            && let Some(bos) = self.bos
        {
            ids.push(bos);
        }
        match &self.tokenizer {
            Vocabulary::Hf(t) => {
                let encoding = t.encode(text, false).map_err(tokenizer_error)?;
                ids.extend_from_slice(encoding.get_ids());
            }
            Vocabulary::Spm(v) => ids.extend(v.encode(text)),
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.tokenizer {
            Vocabulary::Hf(t) => t.decode(ids, true).map_err(tokenizer_error),
            Vocabulary::Spm(v) => v.decode(ids),
        }
    }

    /// The first control token (a chat template's markers, BOS, EOS) whose
    /// text `text` holds: such text would be read as the token itself, so a
    /// message that holds one could forge turns of the conversation.
    pub fn control_token_in(&self, text: &str) -> Option<String> {
        match &self.tokenizer {
            Vocabulary::Hf(t) => t
                .get_added_tokens_decoder()
                .values()
                .filter(|added| added.special && !added.content.is_empty())
                .find(|added| text.contains(added.content.as_str()))
                .map(|added| added.content.clone()),
            Vocabulary::Spm(v) => v.control_token_in(text),
        }
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// The prompt wrapped in the model's chat template.
    pub fn chat_prompt(&self, prompt: &str) -> Result<String> {
        match &self.chat {
            Some(template) => Ok(template.render_user(prompt)),
            None if self.has_template => Err(EngineError::ChatTemplate(
                "the model's chat template is none this engine recognises (ChatML, Llama 3, \
                 [INST]); run without --chat"
                    .into(),
            )),
            None => Err(EngineError::ChatTemplate(
                "the model has no chat template (a base model completes text as written); \
                 run without --chat"
                    .into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `tokenizer.json` of Llama 2's kind: byte-fallback ids `<0x00>` to
    /// `<0xFF>` (ids 0-255), words after them, and a decoder that turns a
    /// run of byte ids into U+FFFD while its last character is incomplete.
    fn byte_fallback_codec() -> TextCodec {
        let mut vocab: Vec<String> = (0..=255u8)
            .map(|b| format!("\"<0x{b:02X}>\": {b}"))
            .collect();
        for (i, word) in ["▁The", "▁dragon", "▁flew", "!", "<s>"].iter().enumerate() {
            vocab.push(format!("\"{word}\": {}", 256 + i));
        }
        let json = format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,
            "added_tokens":[{{"id":260,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,
            "decoder":{{"type":"Sequence","decoders":[
                {{"type":"Replace","pattern":{{"String":"▁"}},"content":" "}},
                {{"type":"ByteFallback"}},{{"type":"Fuse"}},
                {{"type":"Strip","content":" ","start":1,"stop":0}}]}},
            "model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
                "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":true,
                "vocab":{{{}}},"merges":[]}}}}"#,
            vocab.join(",")
        );
        TextCodec {
            tokenizer: Vocabulary::Hf(Box::new(json.parse().unwrap())),
            eos: Vec::new(),
            bos: None,
            add_bos: false,
            chat: None,
            has_template: false,
        }
    }

    #[test]
    fn the_text_stream_follows_a_byte_fallback_decoder() {
        let codec = byte_fallback_codec();
        let (the, dragon, flew, bang, special) = (256, 257, 258, 259, 260);
        // é, 東, 🐉 and 😀 in byte ids, two characters' runs back to back,
        // a run longer than the window, and special tokens that decode to
        // nothing between words.
        let mut ids = vec![the, 0xC3, 0xA9, 0xE6, 0x9D, 0xB1, dragon];
        ids.extend([0xF0, 0x9F, 0x90, 0x89, 0xF0, 0x9F, 0x98, 0x80, flew]);
        ids.extend([special; 6]);
        ids.extend([flew, bang, 0xE6, the, 0xA9, dragon]);
        let mut stream = TextStream::default();
        for end in 1..=ids.len() {
            let streamed = stream.push(&codec, ids[end - 1]).unwrap().to_string();
            assert_eq!(
                streamed,
                codec.decode(&ids[..end]).unwrap(),
                "after {end} ids"
            );
        }
        assert!(
            stream.text().starts_with("Theé東 dragon🐉😀 flew flew!"),
            "{}",
            stream.text()
        );
    }

    #[test]
    fn recognises_smollm2s_template_and_its_default_system_message() {
        let template = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let chat = ChatTemplate::recognise(template).unwrap();
        assert_eq!(
            chat.render_user("Hi"),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(ChatTemplate::recognise("{{ bos_token }}"), None);
    }

    #[test]
    fn a_one_turn_conversation_renders_as_one_user_prompt() {
        for template in [
            ChatTemplate::ChatMl {
                default_system: Some("Be brief.".into()),
            },
            ChatTemplate::ChatMl {
                default_system: None,
            },
            ChatTemplate::Llama3,
            ChatTemplate::Inst,
        ] {
            assert_eq!(
                template.render(&[("user", "Hi".into())]),
                template.render_user("Hi"),
                "{template:?}"
            );
        }
        let chatml = ChatTemplate::ChatMl {
            default_system: Some("Be brief.".into()),
        };
        assert_eq!(
            chatml.render(&[
                ("system", "Be kind.".into()),
                ("user", "Hi".into()),
                ("assistant", "Hello".into()),
                ("user", "Bye".into())
            ]),
            "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
