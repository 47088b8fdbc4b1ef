//! Model files on disk: GGUF, or a Hugging Face safetensors directory. Opens
//! read metadata only; tensors are read one by one, as a slice asks for them,
//! and hashed as they are read.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use candle_core::quantized::{QTensor, gguf_file};
use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorView};
use sha2::{Digest, Sha256};

use crate::error::{EngineError, Result, candle_message};

/// How the model's weights are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Gguf,
    Safetensors,
}

/// Rotary embedding layout: llama.cpp permutes Llama's Q/K rows so pairs are
/// adjacent (interleaved); Hugging Face and Qwen2 GGUF rotate halves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    Interleaved,
    Halves,
}

/// A model's hyper-parameters, read from its own metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub layers: u32,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub rms_eps: f64,
    pub context: usize,
    pub rope_layout: RopeLayout,
    pub qkv_bias: bool,
    /// What the query is multiplied by before its dot products with the
    /// keys (1/sqrt(head_dim) for most models).
    pub query_scale: f64,
    /// How a block is built around its attention and feed-forward.
    pub block_style: BlockStyle,
    /// Local attention layers, when the model interleaves them with global
    /// ones.
    pub sliding_window: Option<SlidingWindow>,
    /// Linear RoPE scaling of the global layers (positions divided by it).
    pub rope_scale: f32,
}

/// The shape of a decoder block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStyle {
    /// Llama, Mistral, Qwen2: pre-norms, SiLU-gated feed-forward.
    Llama,
    /// Gemma 3: the embedding scaled by sqrt(width), RMS norms on each
    /// head's query and key, norms after attention and after the
    /// feed-forward too, a GELU-gated (tanh approximation) feed-forward.
    /// GGUF stores Gemma's norm weights with the 1 of its `(1 + w)` already
    /// added, so every norm is a plain RMS norm here.
    Gemma3,
}

/// Interleaved local (sliding-window) and global attention layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    /// A query at position p sees keys at positions p - window + 1 ..= p.
    pub window: usize,
    /// Every `pattern`-th layer (layers pattern - 1, 2 * pattern - 1, …)
    /// is global; the others are local.
    pub pattern: u32,
    /// RoPE base of the local layers (the global ones use `rope_theta`).
    pub rope_theta: f32,
}

impl ModelConfig {
    /// Whether layer `layer` attends through the sliding window.
    pub fn is_local(&self, layer: u32) -> bool {
        self.sliding_window
            .is_some_and(|w| w.pattern == 0 || layer % w.pattern < w.pattern - 1)
    }
    /// Width of the attention's concatenated heads (the hidden width for
    /// most models; Gemma 3's heads are wider).
    pub fn attention_width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// A tensor as read from disk: quantized (GGUF) or dense.
// With the `cuda` feature candle's `QTensor` holds its GPU storage inline;
// one per tensor read, so its size costs nothing.
#[cfg_attr(feature = "cuda", allow(clippy::large_enum_variant))]
#[derive(Debug)]
pub enum RawTensor {
    Quantized(QTensor),
    Dense(Tensor),
}

/// Where tensors come from.
#[derive(Debug)]
pub enum Source {
    Gguf {
        path: PathBuf,
        /// The metadata without the tokenizer's arrays (`VOCABULARY_KEYS`).
        content: Box<gguf_file::Content>,
        /// The file as it was opened, to tell that the vocabulary read
        /// again later is the one digested.
        stamp: FileStamp,
        /// BLAKE3 of each tensor's stored bytes when the file was opened.
        stored: BTreeMap<String, [u8; 32]>,
    },
    Safetensors {
        dir: PathBuf,
        files: BTreeMap<String, PathBuf>,
        tensors: BTreeMap<String, StEntry>,
        /// BLAKE3 of each tensor's stored bytes when the files were opened.
        stored: BTreeMap<String, [u8; 32]>,
    },
}

/// One tensor's bytes in a file: its name and absolute byte range.
type Region = (String, u64, u64);

/// Largest safetensors JSON header accepted.
pub const MAX_SAFETENSORS_HEADER: u64 = 64 * 1024 * 1024;

/// Where one tensor lives in a safetensors file.
#[derive(Debug, Clone)]
pub struct StEntry {
    path: PathBuf,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    start: u64,
    end: u64,
}

/// Read a safetensors header; the tensor data itself is read later, tensor
/// by tensor, with ranged reads. The `safetensors` crate parses the header
/// and checks it (dtypes, offsets contiguous from zero, each range the size
/// its shape and dtype need); its own loaders want the whole file in memory
/// (a buffer or a map), which a slice that needs a few of the tensors must
/// not pay for, so the bounded read of the header and the ranged reads stay
/// here.
fn read_safetensors_header(path: &Path, into: &mut BTreeMap<String, StEntry>) -> Result<()> {
    let mut file = File::open(path).map_err(|e| io_error(path, e))?;
    let file_len = file.metadata().map_err(|e| io_error(path, e))?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|e| io_error(path, e))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_SAFETENSORS_HEADER || header_len + 8 > file_len {
        return Err(bad(
            path,
            format!("header of {header_len} bytes does not fit the file (truncated?)"),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| io_error(path, e))?;
    let metadata: Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(path, format!("header: {e}")))?;
    let data_start = 8 + header_len;
    let data_len = metadata.data_len() as u64;
    if data_start + data_len != file_len {
        return Err(bad(
            path,
            format!(
                "the header describes {data_len} bytes of tensors, the file holds {} \
                 (truncated or altered?)",
                file_len - data_start
            ),
        ));
    }
    for (name, info) in metadata.tensors() {
        let (begin, end) = info.data_offsets;
        into.insert(
            name,
            StEntry {
                path: path.to_path_buf(),
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + begin as u64,
                end: data_start + end as u64,
            },
        );
    }
    Ok(())
}

/// Read one tensor's bytes (its size was checked against its shape and dtype
/// when the header was read) and widen it to f32.
fn read_safetensor(
    name: &str,
    entry: &StEntry,
    hasher: &mut blake3::Hasher,
    stored: &BTreeMap<String, [u8; 32]>,
) -> Result<Tensor> {
    use std::io::{Seek, SeekFrom};
    if !matches!(entry.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        return Err(EngineError::UnsupportedType {
            name: name.into(),
            dtype: entry.dtype.to_string(),
        });
    }
    let path = &entry.path;
    let length = entry.end - entry.start;
    let mut file = File::open(path).map_err(|e| io_error(path, e))?;
    file.seek(SeekFrom::Start(entry.start))
        .map_err(|e| io_error(path, e))?;
    let mut bytes = vec![0u8; length as usize];
    file.read_exact(&mut bytes).map_err(|e| io_error(path, e))?;
    check_stored(stored, path, name, &bytes)?;
    hasher.update(&length.to_le_bytes());
    hasher.update(&bytes);
    let view = TensorView::new(entry.dtype, entry.shape.clone(), &bytes)
        .map_err(|e| bad(path, format!("`{name}`: {e}")))?;
    Ok(view.load(&Device::Cpu)?.to_dtype(DType::F32)?)
}

fn io_error(path: &Path, source: std::io::Error) -> EngineError {
    EngineError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn bad(path: &Path, why: impl Into<String>) -> EngineError {
    EngineError::BadModel {
        path: path.display().to_string(),
        why: why.into(),
    }
}

/// Whole-file digests: SHA-256 for the package id, BLAKE3 per file for the
/// weights digest (seed 001 §3.6). Files are streamed, never held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDigests {
    pub package_sha256: [u8; 32],
    pub files: Vec<(String, [u8; 32])>,
    /// Each file's length, in the order of `files`.
    pub file_bytes: Vec<u64>,
}

/// Stream `files` once: their digests, and BLAKE3 of the bytes of each
/// tensor region of each file (`regions`, one list per file), so a slice
/// loaded later can tell whether it read the bytes the digests name.
fn digest_files(
    files: &[(String, PathBuf)],
    regions: &[Vec<Region>],
) -> Result<(FileDigests, BTreeMap<String, [u8; 32]>)> {
    let mut package = Sha256::new();
    let mut per_file = Vec::new();
    let mut file_bytes = Vec::new();
    let mut stored = BTreeMap::new();
    // Small enough that freeing it leaves glibc's trim threshold low (the
    // gguf module says why that matters).
    let mut buffer = vec![0u8; 256 << 10];
    for (k, (name, path)) in files.iter().enumerate() {
        let mut reader = BufReader::new(File::open(path).map_err(|e| io_error(path, e))?);
        let mut blake = blake3::Hasher::new();
        let mut length = 0u64;
        let mut regions: Vec<&Region> = regions.get(k).map_or(Vec::new(), |r| r.iter().collect());
        regions.sort_by_key(|(_, start, _)| *start);
        let mut open: Vec<(&Region, blake3::Hasher)> = Vec::new();
        let mut next = 0;
        loop {
            let n = reader.read(&mut buffer).map_err(|e| io_error(path, e))?;
            if n == 0 {
                break;
            }
            let chunk = &buffer[..n];
            package.update(chunk);
            blake.update(chunk);
            let (from, to) = (length, length + n as u64);
            while let Some(region) = regions.get(next).filter(|(_, start, _)| *start < to) {
                open.push((region, blake3::Hasher::new()));
                next += 1;
            }
            for ((_, start, end), hasher) in &mut open {
                let (a, b) = ((*start).max(from), (*end).min(to));
                if a < b {
                    hasher.update(&chunk[(a - from) as usize..(b - from) as usize]);
                }
            }
            open.retain(|((name, _, end), hasher)| {
                let done = *end <= to;
                if done {
                    stored.insert(name.clone(), *hasher.finalize().as_bytes());
                }
                !done
            });
            length = to;
        }
        // Regions the file ended in or before (a truncated file, an empty
        // tensor at its very end): what they got.
        for ((name, _, _), hasher) in open {
            stored.insert(name.clone(), *hasher.finalize().as_bytes());
        }
        for (name, _, _) in &regions[next..] {
            stored.insert(name.clone(), *blake3::hash(&[]).as_bytes());
        }
        per_file.push((name.clone(), *blake.finalize().as_bytes()));
        file_bytes.push(length);
    }
    Ok((
        FileDigests {
            package_sha256: package.finalize().into(),
            files: per_file,
            file_bytes,
        },
        stored,
    ))
}

/// A file's length and last modification, to tell whether it changed
/// between reading its metadata and digesting its bytes.
type FileStamp = (u64, Option<std::time::SystemTime>);

fn file_stamp(path: &Path) -> Result<FileStamp> {
    let metadata = std::fs::metadata(path).map_err(|e| io_error(path, e))?;
    Ok((metadata.len(), metadata.modified().ok()))
}

/// The metadata a model was read with and the bytes digested must be of
/// one file: refused when the file changed in between.
fn unchanged_since(path: &Path, before: FileStamp) -> Result<()> {
    if file_stamp(path)? == before {
        return Ok(());
    }
    Err(bad(
        path,
        "the file changed while it was being opened (its metadata and its digest would \
         describe two files); open it again once it is written",
    ))
}

/// The tensor `name` as read now must be the bytes digested at open.
fn check_stored(
    stored: &BTreeMap<String, [u8; 32]>,
    path: &Path,
    name: &str,
    bytes: &[u8],
) -> Result<()> {
    if stored.get(name) == Some(blake3::hash(bytes).as_bytes()) {
        return Ok(());
    }
    Err(EngineError::ChangedOnDisk {
        path: path.display().to_string(),
        tensor: name.to_string(),
    })
}

/// The GGUF metadata arrays a tokenizer is built from: stepped over when a
/// model is opened (`gguf::read_lean`), and read from the file when a
/// tokenizer is first asked for (`Source::metadata_with_vocabulary`).
pub(crate) const VOCABULARY_KEYS: [&str; 4] = [
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
];

/// The GGUF metadata keys a model declares its training corpus under
/// (seed SPEC 001 §3.7): the corpus digest as 64 hex, and what a verifier
/// can do with it (`signed`, `logged` or `opaque`).
pub const TRAINING_DIGEST_KEY: &str = "mesh.training_digest";
pub const TRAINING_AUTHORITY_KEY: &str = "mesh.training_authority";

fn gguf_u64(content: &gguf_file::Content, key: &str) -> Option<u64> {
    use gguf_file::Value::*;
    match content.metadata.get(key)? {
        U8(v) => Some(u64::from(*v)),
        U16(v) => Some(u64::from(*v)),
        U32(v) => Some(u64::from(*v)),
        U64(v) => Some(*v),
        I32(v) => u64::try_from(*v).ok(),
        I64(v) => u64::try_from(*v).ok(),
        _ => None,
    }
}

fn gguf_f64(content: &gguf_file::Content, key: &str) -> Option<f64> {
    use gguf_file::Value::*;
    match content.metadata.get(key)? {
        F32(v) => Some(f64::from(*v)),
        F64(v) => Some(*v),
        _ => None,
    }
}

/// What an architecture name means to this engine: its RoPE layout, whether
/// its attention projections carry biases, and its block style.
fn architecture_supported(arch: &str) -> Result<(RopeLayout, bool, BlockStyle)> {
    match arch {
        "llama" | "mistral" => Ok((RopeLayout::Interleaved, false, BlockStyle::Llama)),
        "qwen2" => Ok((RopeLayout::Halves, true, BlockStyle::Llama)),
        "gemma3" => Ok((RopeLayout::Halves, false, BlockStyle::Gemma3)),
        other => Err(EngineError::UnsupportedArchitecture(other.to_string())),
    }
}

/// What a GGUF file says it is, read from its header alone (no tensor is
/// read, nothing hashed): for listing a model cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufSummary {
    pub architecture: String,
    /// Its declared quantization (`general.file_type`), by llama.cpp's name.
    pub file_type: Option<&'static str>,
    pub name: Option<String>,
}

/// [`GgufSummary`] of the file at `path`.
pub fn gguf_summary(path: &Path) -> Result<GgufSummary> {
    let (content, _) = read_gguf_lean(path)?;
    let text = |key: &str| match content.metadata.get(key) {
        Some(gguf_file::Value::String(text)) => Some(text.clone()),
        _ => None,
    };
    Ok(GgufSummary {
        architecture: text("general.architecture").unwrap_or_else(|| "unknown".into()),
        file_type: declared_file_type(&content),
        name: text("general.name"),
    })
}

/// A GGUF file's header, metadata and tensor table without the tokenizer's
/// arrays (`VOCABULARY_KEYS`), and those arrays' lengths.
fn read_gguf_lean(path: &Path) -> Result<(gguf_file::Content, HashMap<String, u64>)> {
    let file = File::open(path).map_err(|e| io_error(path, e))?;
    let lean = crate::gguf::read_lean(BufReader::new(file), &VOCABULARY_KEYS)
        .map_err(|why| bad(path, format!("not a readable GGUF file: {why}")))?;
    Ok((lean.content, lean.skipped))
}

/// A GGUF file's header and metadata (no tensor read).
fn read_gguf(path: &Path) -> Result<gguf_file::Content> {
    let mut file = File::open(path).map_err(|e| io_error(path, e))?;
    gguf_file::Content::read(&mut file).map_err(|e| {
        bad(
            path,
            format!("not a readable GGUF file: {}", candle_message(&e)),
        )
    })
}

/// The quantization a GGUF declares (`general.file_type`), by llama.cpp's
/// name.
fn declared_file_type(content: &gguf_file::Content) -> Option<&'static str> {
    let code = match content.metadata.get("general.file_type")? {
        gguf_file::Value::U32(code) => *code,
        gguf_file::Value::I32(code) => u32::try_from(*code).ok()?,
        _ => return None,
    };
    crate::precision::file_type_name(code)
}

impl Source {
    /// A text member of the model's metadata (GGUF only; a safetensors
    /// directory declares none).
    pub fn metadata_text(&self, key: &str) -> Option<&str> {
        match self {
            Source::Gguf { content, .. } => match content.metadata.get(key)? {
                gguf_file::Value::String(text) => Some(text.as_str()),
                _ => None,
            },
            Source::Safetensors { .. } => None,
        }
    }

    /// Open a GGUF file or a safetensors directory, reading metadata only,
    /// and stream its files once for their digests.
    pub fn open(path: &Path) -> Result<(Self, ModelConfig, FileDigests)> {
        if path.is_dir() {
            Self::open_safetensors(path)
        } else {
            Self::open_gguf(path)
        }
    }

    fn open_gguf(path: &Path) -> Result<(Self, ModelConfig, FileDigests)> {
        let stamp = file_stamp(path)?;
        let (content, skipped) = read_gguf_lean(path)?;
        // The tokenizer is built at its first use; a model with no
        // vocabulary at all is refused now, as when it was built at open.
        if skipped.get("tokenizer.ggml.tokens").is_none_or(|n| *n == 0) {
            return Err(EngineError::Tokenizer(format!(
                "{}: no tokenizer.ggml.tokens in the GGUF metadata (a model without its \
                 tokenizer cannot be served)",
                path.display()
            )));
        }
        let arch = match content.metadata.get("general.architecture") {
            Some(gguf_file::Value::String(arch)) => arch.clone(),
            _ => return Err(bad(path, "no general.architecture in the GGUF metadata")),
        };
        let (rope_layout, qkv_bias, block_style) = architecture_supported(&arch)?;
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| {
            gguf_u64(&content, &key(k)).ok_or_else(|| bad(path, format!("missing {}", key(k))))
        };
        let hidden = need("embedding_length")? as usize;
        let heads = need("attention.head_count")? as usize;
        let key_length = gguf_u64(&content, &key("attention.key_length")).map(|v| v as usize);
        let value_length = gguf_u64(&content, &key("attention.value_length")).map(|v| v as usize);
        if key_length != value_length {
            return Err(bad(
                path,
                format!(
                    "attention.key_length {key_length:?} differs from attention.value_length \
                     {value_length:?}; this engine needs them equal"
                ),
            ));
        }
        if heads == 0 || (key_length.is_none() && !hidden.is_multiple_of(heads)) {
            return Err(bad(
                path,
                "embedding_length is not a multiple of head_count",
            ));
        }
        let head_dim = key_length.unwrap_or(hidden / heads);
        let layers =
            u32::try_from(need("block_count")?).map_err(|_| bad(path, "block_count too large"))?;
        let (query_scale, sliding_window) = match block_style {
            BlockStyle::Llama => (1.0 / (head_dim as f64).sqrt(), None),
            BlockStyle::Gemma3 => {
                // As llama.cpp and gemma_pytorch do: the 27B model (62
                // layers) scales by its width per head, the others by the
                // head dimension.
                let per_head = if layers == 62 {
                    hidden / heads
                } else {
                    head_dim
                };
                let window = gguf_u64(&content, &key("attention.sliding_window"))
                    .filter(|w| *w > 0)
                    .map(|w| SlidingWindow {
                        window: w as usize,
                        pattern: gguf_u64(&content, &key("attention.sliding_window_pattern"))
                            .map_or(6, |p| p as u32),
                        rope_theta: gguf_f64(&content, &key("rope.freq_base_swa"))
                            .unwrap_or(10_000.0) as f32,
                    });
                (1.0 / (per_head as f64).sqrt(), window)
            }
        };
        let rope_scale = match content.metadata.get(&key("rope.scaling.type")) {
            None => 1.0,
            Some(gguf_file::Value::String(kind)) if kind == "none" => 1.0,
            Some(gguf_file::Value::String(kind)) if kind == "linear" => {
                gguf_f64(&content, &key("rope.scaling.factor")).unwrap_or(1.0) as f32
            }
            Some(other) => {
                return Err(bad(
                    path,
                    format!("RoPE scaling {other:?} is not supported (only linear)"),
                ));
            }
        };
        let kv_heads =
            gguf_u64(&content, &key("attention.head_count_kv")).unwrap_or(heads as u64) as usize;
        let vocab = match skipped.get("tokenizer.ggml.tokens") {
            Some(tokens) => *tokens as usize,
            None => gguf_u64(&content, &key("vocab_size"))
                .ok_or_else(|| bad(path, "no vocabulary size"))? as usize,
        };
        let config = ModelConfig {
            architecture: arch.clone(),
            layers,
            hidden,
            ffn: need("feed_forward_length")? as usize,
            heads,
            kv_heads,
            head_dim,
            vocab,
            rope_theta: gguf_f64(&content, &key("rope.freq_base")).unwrap_or(10_000.0) as f32,
            rms_eps: gguf_f64(&content, &key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            context: gguf_u64(&content, &key("context_length")).unwrap_or(2048) as usize,
            rope_layout,
            qkv_bias,
            query_scale,
            block_style,
            sliding_window,
            rope_scale,
        };
        check_config(path, &config)?;
        let name = path.file_name().map_or("model.gguf".to_string(), |n| {
            n.to_string_lossy().into_owned()
        });
        let regions: Vec<Region> = content
            .tensor_infos
            .iter()
            .map(|(name, info)| {
                let dtype = info.ggml_dtype;
                let bytes = info.shape.elem_count() / dtype.block_size() * dtype.type_size();
                let start = content.tensor_data_offset.saturating_add(info.offset);
                (name.clone(), start, start.saturating_add(bytes as u64))
            })
            .collect();
        let (digests, stored) = digest_files(&[(name, path.to_path_buf())], &[regions])?;
        unchanged_since(path, stamp)?;
        Ok((
            Source::Gguf {
                path: path.to_path_buf(),
                content: Box::new(content),
                stamp,
                stored,
            },
            config,
            digests,
        ))
    }

    fn open_safetensors(dir: &Path) -> Result<(Self, ModelConfig, FileDigests)> {
        let tokenizer = dir.join("tokenizer.json");
        if !tokenizer.is_file() {
            return Err(EngineError::Tokenizer(format!(
                "{}: no such file (a model without its tokenizer cannot be served)",
                tokenizer.display()
            )));
        }
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| io_error(&config_path, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(&config_path, e.to_string()))?;
        let model_type = json["model_type"].as_str().unwrap_or("llama").to_string();
        let (_, qkv_bias, block_style) = architecture_supported(&model_type)?;
        if block_style != BlockStyle::Llama {
            return Err(bad(
                &config_path,
                format!(
                    "`{model_type}` is supported from GGUF files only (its safetensors norms \
                     are stored without their offset); convert it with llama.cpp's \
                     convert_hf_to_gguf.py"
                ),
            ));
        }
        let num = |k: &str| {
            json[k]
                .as_u64()
                .ok_or_else(|| bad(&config_path, format!("missing `{k}`")))
        };
        let hidden = num("hidden_size")? as usize;
        let heads = num("num_attention_heads")? as usize;
        if heads == 0 || !hidden.is_multiple_of(heads) {
            return Err(bad(
                &config_path,
                "hidden_size is not a multiple of num_attention_heads",
            ));
        }
        let config = ModelConfig {
            architecture: model_type,
            layers: u32::try_from(num("num_hidden_layers")?)
                .map_err(|_| bad(&config_path, "too many layers"))?,
            hidden,
            ffn: num("intermediate_size")? as usize,
            heads,
            kv_heads: json["num_key_value_heads"].as_u64().unwrap_or(heads as u64) as usize,
            head_dim: hidden / heads,
            vocab: num("vocab_size")? as usize,
            rope_theta: json["rope_theta"].as_f64().unwrap_or(10_000.0) as f32,
            rms_eps: json["rms_norm_eps"].as_f64().unwrap_or(1e-5),
            context: json["max_position_embeddings"].as_u64().unwrap_or(2048) as usize,
            rope_layout: RopeLayout::Halves,
            qkv_bias,
            query_scale: 1.0 / ((hidden / heads) as f64).sqrt(),
            block_style,
            sliding_window: None,
            rope_scale: 1.0,
        };
        check_config(&config_path, &config)?;
        let index = dir.join("model.safetensors.index.json");
        let mut shards: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io_error(&index, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| bad(&index, e.to_string()))?;
            let map = json["weight_map"]
                .as_object()
                .ok_or_else(|| bad(&index, "no weight_map"))?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec!["model.safetensors".to_string()]
        };
        shards.sort();
        let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
        files.insert("config.json".into(), config_path.clone());
        for shard in &shards {
            let path = dir.join(shard);
            if !path.is_file() {
                return Err(bad(&path, "the shard named by the model is missing"));
            }
            files.insert(shard.clone(), path);
        }
        let stamps = files
            .values()
            .map(|path| file_stamp(path).map(|stamp| (path.clone(), stamp)))
            .collect::<Result<Vec<_>>>()?;
        let mut tensors = BTreeMap::new();
        for shard in &shards {
            read_safetensors_header(&dir.join(shard), &mut tensors)?;
        }
        let ordered: Vec<(String, PathBuf)> =
            files.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let regions: Vec<Vec<Region>> = ordered
            .iter()
            .map(|(_, path)| {
                tensors
                    .iter()
                    .filter(|(_, entry)| entry.path == *path)
                    .map(|(name, entry)| (name.clone(), entry.start, entry.end))
                    .collect()
            })
            .collect();
        let (digests, stored) = digest_files(&ordered, &regions)?;
        for (path, stamp) in stamps {
            unchanged_since(&path, stamp)?;
        }
        Ok((
            Source::Safetensors {
                dir: dir.to_path_buf(),
                files,
                tensors,
                stored,
            },
            config,
            digests,
        ))
    }

    pub fn format(&self) -> Format {
        match self {
            Source::Gguf { .. } => Format::Gguf,
            Source::Safetensors { .. } => Format::Safetensors,
        }
    }

    /// Whether a tensor exists (for tied output heads and optional biases).
    pub fn has(&self, name: &str) -> bool {
        match self {
            Source::Gguf { content, .. } => content.tensor_infos.contains_key(name),
            Source::Safetensors { tensors, .. } => tensors.contains_key(name),
        }
    }

    /// Read one tensor, hashing its stored bytes into `hasher` (name, then
    /// bytes) as it is read.
    pub fn read(&self, name: &str, hasher: &mut blake3::Hasher) -> Result<RawTensor> {
        hasher.update(&(name.len() as u64).to_le_bytes());
        hasher.update(name.as_bytes());
        match self {
            Source::Gguf {
                path,
                content,
                stored,
                ..
            } => {
                let mut file = File::open(path).map_err(|e| io_error(path, e))?;
                let tensor = content.tensor(&mut file, name, &Device::Cpu).map_err(|e| {
                    let message = candle_message(&e);
                    if message.contains("unknown dtype") || message.contains("unsupported") {
                        EngineError::UnsupportedType {
                            name: name.into(),
                            dtype: message,
                        }
                    } else {
                        bad(path, format!("tensor `{name}`: {message}"))
                    }
                })?;
                let bytes = tensor.data()?;
                check_stored(stored, path, name, &bytes)?;
                hasher.update(&(bytes.len() as u64).to_le_bytes());
                hasher.update(&bytes);
                drop(bytes);
                Ok(RawTensor::Quantized(tensor))
            }
            Source::Safetensors {
                dir,
                tensors,
                stored,
                ..
            } => {
                let entry = tensors
                    .get(name)
                    .ok_or_else(|| bad(dir, format!("no tensor `{name}`")))?;
                Ok(RawTensor::Dense(read_safetensor(
                    name, entry, hasher, stored,
                )?))
            }
        }
    }

    /// The stored type of every tensor in the model, by ggml's names.
    pub fn stored_types(&self) -> std::collections::BTreeSet<&'static str> {
        match self {
            Source::Gguf { content, .. } => content
                .tensor_infos
                .values()
                .map(|info| crate::precision::type_name(info.ggml_dtype))
                .collect(),
            Source::Safetensors { tensors, .. } => tensors
                .values()
                .map(|entry| dense_type_name(entry.dtype))
                .collect(),
        }
    }

    /// The file's declared quantization (GGUF `general.file_type`), by
    /// llama.cpp's name; `None` when it declares none this engine knows.
    pub fn file_type(&self) -> Option<&'static str> {
        declared_file_type(self.gguf()?)
    }

    /// Every tensor's name and the bytes it takes in the file.
    pub fn stored_sizes(&self) -> Vec<(&str, u64)> {
        match self {
            Source::Gguf { content, .. } => content
                .tensor_infos
                .iter()
                .map(|(name, info)| {
                    let dtype = info.ggml_dtype;
                    let bytes = info.shape.elem_count() / dtype.block_size() * dtype.type_size();
                    (name.as_str(), bytes as u64)
                })
                .collect(),
            Source::Safetensors { tensors, .. } => tensors
                .iter()
                .map(|(name, entry)| (name.as_str(), entry.end - entry.start))
                .collect(),
        }
    }

    /// The matrix the output head reads: its own, or the embedding when
    /// the model ties the two (no output matrix of its own).
    pub fn head_matrix(&self) -> &'static str {
        let names = self.names();
        if self.has(names.output) {
            names.output
        } else {
            names.embedding
        }
    }

    /// Tensor names of the standard Llama layout, per format.
    pub fn names(&self) -> TensorNames {
        match self {
            Source::Gguf { .. } => TensorNames::gguf(),
            Source::Safetensors { .. } => TensorNames::hf(),
        }
    }

    /// The whole GGUF metadata, the tokenizer's arrays included, read
    /// again from the file: refused when the file changed since it was
    /// opened, as its vocabulary would not be the one digested.
    pub fn metadata_with_vocabulary(&self) -> Result<gguf_file::Content> {
        match self {
            Source::Gguf { path, stamp, .. } => {
                let content = read_gguf(path)?;
                if file_stamp(path)? != *stamp {
                    return Err(bad(
                        path,
                        "the file changed since the model was opened, so its vocabulary \
                         may not be the one digested; restart the node (or command) to \
                         open it again",
                    ));
                }
                Ok(content)
            }
            Source::Safetensors { dir, .. } => Err(bad(
                dir,
                "a safetensors directory has no GGUF metadata (its tokenizer is tokenizer.json)",
            )),
        }
    }

    /// The GGUF metadata without the tokenizer's arrays, when the model is
    /// a GGUF file.
    pub fn gguf(&self) -> Option<&gguf_file::Content> {
        match self {
            Source::Gguf { content, .. } => Some(content),
            Source::Safetensors { .. } => None,
        }
    }

    pub fn dir(&self) -> Option<&Path> {
        match self {
            Source::Safetensors { dir, .. } => Some(dir),
            Source::Gguf { .. } => None,
        }
    }
}

fn check_config(path: &Path, c: &ModelConfig) -> Result<()> {
    let sane = c.layers > 0
        && c.hidden > 0
        && c.kv_heads > 0
        && c.heads.is_multiple_of(c.kv_heads)
        && c.head_dim.is_multiple_of(2)
        && c.vocab > 0
        && c.ffn > 0
        && c.rope_scale > 0.0
        && c.sliding_window
            .is_none_or(|w| w.window > 0 && w.pattern > 0);
    if sane {
        Ok(())
    } else {
        Err(bad(path, format!("inconsistent hyper-parameters: {c:?}")))
    }
}

/// Names of the tensors a Llama-family slice reads.
#[derive(Debug, Clone)]
pub struct TensorNames {
    pub embedding: &'static str,
    pub output_norm: &'static str,
    pub output: &'static str,
    block: fn(u32, &str) -> String,
}

impl TensorNames {
    fn gguf() -> Self {
        Self {
            embedding: "token_embd.weight",
            output_norm: "output_norm.weight",
            output: "output.weight",
            block: |i, part| format!("blk.{i}.{part}"),
        }
    }
    fn hf() -> Self {
        Self {
            embedding: "model.embed_tokens.weight",
            output_norm: "model.norm.weight",
            output: "lm_head.weight",
            block: |i, part| {
                let hf = match part {
                    "attn_norm.weight" => "input_layernorm.weight",
                    "ffn_norm.weight" => "post_attention_layernorm.weight",
                    "attn_q.weight" => "self_attn.q_proj.weight",
                    "attn_k.weight" => "self_attn.k_proj.weight",
                    "attn_v.weight" => "self_attn.v_proj.weight",
                    "attn_q.bias" => "self_attn.q_proj.bias",
                    "attn_k.bias" => "self_attn.k_proj.bias",
                    "attn_v.bias" => "self_attn.v_proj.bias",
                    "attn_output.weight" => "self_attn.o_proj.weight",
                    "ffn_gate.weight" => "mlp.gate_proj.weight",
                    "ffn_up.weight" => "mlp.up_proj.weight",
                    "ffn_down.weight" => "mlp.down_proj.weight",
                    other => other,
                };
                format!("model.layers.{i}.{hf}")
            },
        }
    }
    /// The name of `part` (GGUF spelling, e.g. `attn_q.weight`) in block `i`.
    pub fn block(&self, i: u32, part: &str) -> String {
        (self.block)(i, part)
    }
}

/// ggml's name of a safetensors type this engine reads (F32, F16, BF16;
/// `read` refuses any other before it could run).
fn dense_type_name(dtype: Dtype) -> &'static str {
    crate::precision::dense_name(match dtype {
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        _ => DType::F32,
    })
}
