use thiserror::Error;

/// Why the engine could not do what was asked. Every variant says what to do
/// next where there is something to do.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a usable model: {why}")]
    BadModel { path: String, why: String },
    #[error("unsupported architecture `{0}` (supported: llama, mistral, qwen2)")]
    UnsupportedArchitecture(String),
    #[error(
        "tensor `{name}` has unsupported type {dtype} (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q8_K)"
    )]
    UnsupportedType { name: String, dtype: String },
    #[error("layer range {start}..{end} is not inside the model's 0..{layers}")]
    BadRange { start: u32, end: u32, layers: u32 },
    #[error("a prompt of {tokens} tokens plus {max_new} new ones exceeds the context of {context}")]
    ContextExceeded {
        tokens: usize,
        max_new: usize,
        context: usize,
    },
    #[error("too many concurrent requests (limit {0}); retry when one finishes")]
    Busy(usize),
    #[error("unknown request {0}: it was never opened or was already released")]
    UnknownRequest(u64),
    #[error("activation frame: {0}")]
    Frame(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("this slice {0}")]
    WrongInput(&'static str),
    #[error("tensor computation: {0}")]
    Compute(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, EngineError>;
