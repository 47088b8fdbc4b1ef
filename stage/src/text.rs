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
    /// The model's chat template, or why there is none to chat with.
    chat: std::result::Result<ChatTemplate, String>,
}

/// Why a model without a chat template is not chatted with.
const NO_CHAT_TEMPLATE: &str =
    "the model has no chat template (a base model completes text as written)";

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

    fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            Vocabulary::Hf(t) => t.id_to_token(id),
            Vocabulary::Spm(v) => v.id_to_token(id),
        }
    }
}

/// Most fuel (minijinja's count of instructions) one rendering of a chat
/// template may burn: a conversation of the API's most messages renders
/// in far less, and a template that loops without end stops here.
const CHAT_TEMPLATE_FUEL: u64 = 2_000_000;

/// A model's own chat template (Jinja), rendered as transformers'
/// `apply_chat_template` renders it: `messages` (`role`, `content`),
/// `add_generation_prompt`, `bos_token`, `eos_token` and
/// `raise_exception`, with Jinja's `trim_blocks` and `lstrip_blocks` and
/// Python's string methods. Compiled once when the model is read, so a
/// template this engine cannot render is said then, not at the first chat.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// The template `source`, with the model's BOS and EOS texts; refused
    /// when it does not compile, or does not render a one-turn chat.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let template = Self {
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        };
        template.render_user("Hi")?;
        Ok(template)
    }

    /// The template's text, as the model carries it.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// A conversation (`role`: system, user or assistant; in order), ready
    /// for the assistant's next answer.
    pub fn render(&self, turns: &[(&str, String)]) -> Result<String> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| chat_template_error(&e))?;
        let messages: Vec<minijinja::Value> = turns
            .iter()
            .map(|(role, content)| {
                minijinja::context! { role => *role, content => content.as_str() }
            })
            .collect();
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| chat_template_error(&e))
    }

    /// One user turn, ready for the assistant's answer.
    pub fn render_user(&self, prompt: &str) -> Result<String> {
        self.render(&[("user", prompt.to_string())])
    }
}

fn chat_template_error(error: &minijinja::Error) -> EngineError {
    let mut why = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(inner) = source {
        why.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    EngineError::ChatTemplate(format!("the model's chat template: {why}"))
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
            Source::Gguf { .. } => Self::from_gguf(&source.metadata_with_vocabulary()?),
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
        let mut codec = Self {
            tokenizer,
            eos: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
            bos: id("tokenizer.ggml.bos_token_id"),
            add_bos,
            chat: Err(NO_CHAT_TEMPLATE.into()),
        };
        codec.read_chat_template(template);
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
        let mut codec = Self {
            eos: token("eos_token").into_iter().collect(),
            bos: token("bos_token"),
            add_bos: config["add_bos_token"].as_bool().unwrap_or(false),
            chat: Err(NO_CHAT_TEMPLATE.into()),
            tokenizer: Vocabulary::Hf(Box::new(tokenizer)),
        };
        codec.read_chat_template(config["chat_template"].as_str());
        codec.add_turn_end_tokens();
        Ok(codec)
    }

    /// The model's own chat template, compiled with its BOS and EOS texts
    /// (before the turn-end markers join the EOS ids: `eos_token` is the
    /// model's declared one).
    fn read_chat_template(&mut self, template: Option<&str>) {
        let text = |id: Option<u32>| {
            id.and_then(|id| self.tokenizer.id_to_token(id))
                .unwrap_or_default()
        };
        self.chat = match template {
            None => Err(NO_CHAT_TEMPLATE.into()),
            Some(source) => {
                ChatTemplate::new(source, &text(self.bos), &text(self.eos.first().copied()))
                    .map_err(|error| format!("{error} (this engine cannot render it)"))
            }
        };
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

    /// The model's chat template, or why there is none to chat with (it
    /// has none, or one this engine cannot render).
    pub fn chat_template(&self) -> std::result::Result<&ChatTemplate, &str> {
        self.chat.as_ref().map_err(String::as_str)
    }

    /// The prompt wrapped in the model's chat template.
    pub fn chat_prompt(&self, prompt: &str) -> Result<String> {
        match &self.chat {
            Ok(template) => template.render_user(prompt),
            Err(why) => Err(EngineError::ChatTemplate(format!(
                "{why}; run without --chat"
            ))),
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
            chat: Err(NO_CHAT_TEMPLATE.into()),
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

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2s_own_template_renders_its_default_system_message_and_turns() {
        let chat = ChatTemplate::new(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>").unwrap();
        assert_eq!(
            chat.render_user("Hi").unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            chat.render(&[
                ("system", "Be kind.".into()),
                ("user", "Hi".into()),
                ("assistant", "Hello".into()),
                ("user", "Bye".into())
            ])
            .unwrap(),
            "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// A template of no family this engine ever named (Gemma's turn
    /// markers, a namespace, Python string methods, whitespace control,
    /// `bos_token`) renders as the model's makers wrote it.
    #[test]
    fn a_template_of_any_family_renders_as_written() {
        let template = "{{ bos_token }}\n{%- set ns = namespace(system='') -%}\n{% for message in messages %}\n  {% if message['role'] == 'system' %}\n    {% set ns.system = message['content'].strip() + '\n\n' %}\n  {% else %}\n    {% set role = 'model' if message['role'] == 'assistant' else message['role'] %}\n{{ '<start_of_turn>' + role + '\n' + (ns.system if loop.index0 == 1 else '') + message['content'] | trim }}<end_of_turn>\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";
        let chat = ChatTemplate::new(template, "<bos>", "<eos>").unwrap();
        assert_eq!(
            chat.render(&[
                ("system", "  Be brief. ".into()),
                ("user", " Hi ".into()),
                ("assistant", "Hello".into()),
            ])
            .unwrap(),
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    /// A template that does not compile, raises, or loops past its fuel is
    /// refused with the template's own words, never a panic or a hang.
    #[test]
    fn templates_that_cannot_render_are_refused() {
        for (template, said) in [
            ("{% for message in messages %}", "chat template"),
            (
                "{{ raise_exception('Only user and assistant roles are supported!') }}",
                "Only user and assistant roles",
            ),
            (
                "{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}",
                "fuel",
            ),
        ] {
            let error = ChatTemplate::new(template, "", "").unwrap_err().to_string();
            assert!(error.contains(said), "{template}: {error}");
        }
    }
}
