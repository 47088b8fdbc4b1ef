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
    #[error("unsupported architecture `{0}` (supported: llama, mistral, qwen2, gemma3)")]
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
    #[error("request {0} already holds a cache on this slice")]
    AlreadyOpen(u64),
    #[error("activation frame: {0}")]
    Frame(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("this slice {0}")]
    WrongInput(&'static str),
    #[error("tensor computation: {0}")]
    Compute(String),
    #[error("{0}")]
    Device(String),
    #[error(
        "the model file {path} changed since this node opened it (tensor `{tensor}` reads other bytes now): restart the node to serve it, so its receipts name the weights it serves"
    )]
    ChangedOnDisk { path: String, tensor: String },
}

impl From<candle_core::Error> for EngineError {
    fn from(error: candle_core::Error) -> Self {
        EngineError::Compute(candle_message(&error))
    }
}

/// A candle error as one short message: candle appends a captured
/// backtrace (dozens of lines) when `RUST_BACKTRACE` is set, which is for
/// candle's developers, not for someone whose model file is broken.
pub fn candle_message(error: &candle_core::Error) -> String {
    match error {
        candle_core::Error::WithBacktrace { inner, .. } => candle_message(inner),
        candle_core::Error::Context { inner, context } => {
            format!("{context}: {}", candle_message(inner))
        }
        other => other.to_string(),
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;
