//! The layer-slice engine: a node holding layers `[a, b)` of a model loads
//! only those weights and runs only those layers. No networking lives here:
//! slices talk through [`frame`] encodings that the node carries.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod attention;
pub mod cache;
pub mod device;
pub mod draft;
pub mod error;
pub mod frame;
mod gguf;
pub mod kernels;
pub mod model;
pub mod pipeline;
pub mod precision;
pub mod sampling;
pub mod source;
pub mod spm;
pub mod synthetic;
pub mod text;

use std::ops::Range;
use std::path::{Path, PathBuf};

pub use candle_core::Device;
/// GGUF block types, for callers that write or name them (the synthetic
/// model's copies), so they need not depend on candle themselves.
pub use candle_core::quantized::GgmlDType;
pub use device::{DeviceChoice, bind_opened_devices, device_name, gpu_free_memory};
pub use error::{EngineError, Result};
pub use kernels::pool::compute_threads;
pub use mesh_protocol as protocol;
pub use model::{ExecPolicy, LayerSlice, SliceCache, SliceInput, SliceOutput};
pub use source::{FileDigests, Format, ModelConfig};

/// An opened model: its metadata and file digests, with no weights
/// loaded. Slices are loaded from it on demand, and its tokenizer is built
/// when first asked for: a stage that only runs layers never holds one.
#[derive(Debug)]
pub struct ModelHandle {
    path: PathBuf,
    source: source::Source,
    config: ModelConfig,
    digests: FileDigests,
    codec: std::sync::OnceLock<std::sync::Arc<text::TextCodec>>,
    /// Where every slice loaded from this handle computes.
    device: candle_core::Device,
}

impl ModelHandle {
    /// Open a GGUF file or a safetensors model directory.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(EngineError::Io {
                path: path.display().to_string(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no such file or directory",
                ),
            });
        }
        let (source, config, digests) = source::Source::open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            source,
            config,
            digests,
            codec: std::sync::OnceLock::new(),
            device: candle_core::Device::Cpu,
        })
    }

    /// Compute every slice loaded from now on on `device` (opened once by
    /// the caller: `DeviceChoice::open`).
    pub fn on_device(mut self, device: candle_core::Device) -> Self {
        self.device = device;
        self
    }

    pub fn device(&self) -> &candle_core::Device {
        &self.device
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn format(&self) -> Format {
        self.source.format()
    }
    /// The training corpus the model declares (SPEC §3.7), as written in
    /// its metadata: digest (hex) and authority, each `None` when absent.
    /// The caller checks their form and that both are there.
    pub fn declared_training(&self) -> (Option<&str>, Option<&str>) {
        (
            self.source.metadata_text(source::TRAINING_DIGEST_KEY),
            self.source.metadata_text(source::TRAINING_AUTHORITY_KEY),
        )
    }

    /// The model's tokenizer and chat template, built on the first call
    /// (from the file's metadata, read again, or its `tokenizer.json`);
    /// refused when the model carries none this engine can build, or the
    /// file changed since it was opened.
    pub fn text(&self) -> Result<&std::sync::Arc<text::TextCodec>> {
        if let Some(codec) = self.codec.get() {
            return Ok(codec);
        }
        let codec = std::sync::Arc::new(text::TextCodec::from_source(&self.source)?);
        // Two first callers at once both build one; the first kept serves.
        Ok(self.codec.get_or_init(|| codec))
    }
    /// SHA-256 over the model's files, in name order: the package id.
    pub fn package_id(&self) -> [u8; 32] {
        self.digests.package_sha256
    }
    /// The weights digest of seed 001 §3.6 over the model's files.
    pub fn weights_digest(&self) -> [u8; 32] {
        protocol::mesh1::weights_digest(&self.digests.files)
    }
    /// SHA-256 of the package manifest (`protocol::package`): the
    /// package-wide `manifest_sha256` every stage of this model names. A
    /// GGUF package is its one file, named `model.gguf` in the manifest
    /// whatever it is called on disk: the same bytes under two names are
    /// one package (as the package id says).
    pub fn manifest_sha256(&self) -> [u8; 32] {
        let files: Vec<protocol::package::PackageFile<'_>> = self
            .digests
            .files
            .iter()
            .zip(&self.digests.file_bytes)
            .map(|((name, blake3), bytes)| protocol::package::PackageFile {
                name: match self.format() {
                    Format::Gguf => "model.gguf",
                    Format::Safetensors => name,
                },
                bytes: *bytes,
                blake3: *blake3,
            })
            .collect();
        protocol::package::manifest_sha256(&self.digests.package_sha256, &files)
    }
    pub fn file_digests(&self) -> &FileDigests {
        &self.digests
    }

    /// The precision a pass over the whole model runs at on this handle's
    /// device with frames of `wire` (the default execution policy: block
    /// types run as stored).
    pub fn precision(&self, wire: frame::WireDType) -> precision::Precision {
        let stored = self.source.stored_types();
        precision::Precision {
            file_type: self.source.file_type(),
            products: precision::Precision::products_of(&stored, false),
            stored,
            device: device_name(&self.device),
            wire,
        }
    }

    /// Load the slice of layers `range` with the default execution policy.
    pub fn load_slice(&self, range: Range<u32>) -> Result<LayerSlice> {
        self.load_slice_with(range, model::ExecPolicy::default())
    }

    pub fn load_slice_with(
        &self,
        range: Range<u32>,
        policy: model::ExecPolicy,
    ) -> Result<LayerSlice> {
        LayerSlice::load(&self.source, &self.config, range, policy, &self.device)
    }

    /// Load the slice of layers `range` for a chain: its stages return
    /// hidden states, even the final one, and the coordinator (`holds_head`)
    /// applies the output head apart (`LayerSlice::logits`).
    pub fn load_chain_slice(&self, range: Range<u32>, holds_head: bool) -> Result<LayerSlice> {
        self.load_chain_slice_with(range, holds_head, model::ExecPolicy::default())
    }

    /// `load_chain_slice`, executed as `policy` says.
    pub fn load_chain_slice_with(
        &self,
        range: Range<u32>,
        holds_head: bool,
        policy: model::ExecPolicy,
    ) -> Result<LayerSlice> {
        let head_use = if holds_head {
            model::HeadUse::Apart
        } else {
            model::HeadUse::Without
        };
        LayerSlice::load_with_head(
            &self.source,
            &self.config,
            range,
            policy,
            head_use,
            &self.device,
        )
    }
}

/// The bytes a slice holds for each part of a model: what the first slice
/// adds (the embedding), each layer, and what the last adds (the final norm
/// and the output head, the embedding again when tied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBytes {
    pub embedding: u64,
    pub layers: Vec<u64>,
    pub head: u64,
    /// The bytes of the matrix the embedding and the head share, when the
    /// model ties them (0 when not): a slice holding both holds it once.
    pub tied: u64,
}

impl LayerBytes {
    /// The bytes as a chain holds them: its first slice (the coordinator's)
    /// holds the output head as well as the embedding (a tied matrix once).
    pub fn with_head_on_first(&self) -> Self {
        Self {
            embedding: (self.embedding + self.head).saturating_sub(self.tied),
            layers: self.layers.clone(),
            head: 0,
            tied: 0,
        }
    }
}

impl ModelHandle {
    /// The stored bytes of each part of the model, from its tensor index.
    pub fn layer_bytes(&self) -> LayerBytes {
        let names = self.source.names();
        let sizes = self.source.stored_sizes();
        let size = |name: &str| {
            sizes
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(0, |(_, bytes)| *bytes)
        };
        let output = self.source.head_matrix();
        let mut layers = vec![0u64; self.config.layers as usize];
        for (i, bytes) in layers.iter_mut().enumerate() {
            let prefix = names.block(i as u32, "");
            *bytes = sizes
                .iter()
                .filter(|(name, _)| name.starts_with(&prefix))
                .map(|(_, b)| *b)
                .sum();
        }
        LayerBytes {
            embedding: size(names.embedding),
            layers,
            head: size(names.output_norm) + size(output),
            tied: if output == names.embedding {
                size(names.embedding)
            } else {
                0
            },
        }
    }
}

/// Split the layers into `parts` contiguous ranges whose slices hold about
/// the same bytes (the embedding counted in the first, the head in the
/// last): the largest slice as small as it can be, then the slices as even
/// as they can be. Most of a small model with a large vocabulary is its
/// embedding and head (Gemma 3 270M: 170 MiB each of 410), so counting
/// layers would give the end slices far more than the middle ones.
pub fn split_by_bytes(bytes: &LayerBytes, parts: u32) -> Vec<Range<u32>> {
    let layers = bytes.layers.len();
    let parts = (parts as usize).clamp(1, layers.max(1));
    if layers == 0 {
        return Vec::new();
    }
    // prefix[i] = bytes of layers 0..i
    let mut prefix = vec![0u128; layers + 1];
    for (i, b) in bytes.layers.iter().enumerate() {
        prefix[i + 1] = prefix[i] + u128::from(*b);
    }
    let cost = |start: usize, end: usize| -> u128 {
        let mut c = prefix[end] - prefix[start];
        if start == 0 {
            c += u128::from(bytes.embedding);
        }
        if end == layers {
            c += u128::from(bytes.head);
        }
        c
    };
    // best[k][e]: (largest slice, sum of squares) splitting layers 0..e
    // into k slices; from[k][e] the start of the last of them.
    let none = (u128::MAX, u128::MAX);
    let mut best = vec![vec![none; layers + 1]; parts + 1];
    let mut from = vec![vec![0usize; layers + 1]; parts + 1];
    best[0][0] = (0, 0);
    for k in 1..=parts {
        for end in k..=layers {
            for start in (k - 1)..end {
                let (largest, squares) = best[k - 1][start];
                if largest == u128::MAX {
                    continue;
                }
                let c = cost(start, end);
                let candidate = (largest.max(c), squares.saturating_add(c.saturating_mul(c)));
                if candidate < best[k][end] {
                    best[k][end] = candidate;
                    from[k][end] = start;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(parts);
    let mut end = layers;
    for k in (1..=parts).rev() {
        let start = from[k][end];
        ranges.push(start as u32..end as u32);
        end = start;
    }
    ranges.reverse();
    ranges
}

/// Split `layers` into `parts` contiguous ranges as evenly as possible.
pub fn even_split(layers: u32, parts: u32) -> Vec<Range<u32>> {
    let parts = parts.clamp(1, layers.max(1));
    let base = layers / parts;
    let extra = layers % parts;
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + u32::from(i < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// Parse `a..b,b..c,...` into ranges that must tile `0..layers`.
pub fn parse_split(spec: &str, layers: u32) -> Result<Vec<Range<u32>>> {
    let mut ranges = Vec::new();
    let mut expected = 0;
    for part in spec.split(',') {
        let (a, b) = part
            .trim()
            .split_once("..")
            .ok_or(EngineError::WrongInput("split must look like 0..10,10..20"))?;
        let parse = |t: &str| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| EngineError::WrongInput("split bounds must be layer numbers"))
        };
        let (a, b) = (parse(a)?, parse(b)?);
        if a != expected || b <= a || b > layers {
            return Err(EngineError::BadRange {
                start: a,
                end: b,
                layers,
            });
        }
        ranges.push(a..b);
        expected = b;
    }
    if expected != layers {
        return Err(EngineError::BadRange {
            start: expected,
            end: layers,
            layers,
        });
    }
    Ok(ranges)
}

/// Each value's bits, for tests that assert bit identity.
#[cfg(test)]
pub(crate) fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// `bits` of a tensor's values, in order.
#[cfg(test)]
pub(crate) fn tensor_bits(t: &candle_core::Tensor) -> Vec<u32> {
    bits(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model is opened without its vocabulary, which a stage never needs;
    /// the tokenizer is built from the file at the first call, and refused
    /// when the file changed since the model was opened.
    #[test]
    fn the_tokenizer_is_built_when_first_asked_for_from_the_file_as_opened() {
        let dir = tempfile::tempdir().unwrap();
        let model = synthetic::write_synthetic(
            dir.path(),
            &synthetic::SyntheticSpec::default(),
            &[GgmlDType::Q8_0],
        )
        .unwrap();
        let path = model.gguf(GgmlDType::Q8_0).unwrap().to_path_buf();
        let handle = ModelHandle::open(&path).unwrap();
        let metadata = &handle.source.gguf().unwrap().metadata;
        assert!(metadata.contains_key("general.architecture"));
        assert!(!metadata.contains_key("tokenizer.ggml.tokens"));
        assert!(!metadata.contains_key("tokenizer.ggml.merges"));
        assert!(handle.codec.get().is_none());
        let ids = handle.text().unwrap().encode("hello").unwrap();
        assert!(!ids.is_empty());
        assert!(std::ptr::eq(handle.text().unwrap(), handle.text().unwrap()));

        let changed = ModelHandle::open(&path).unwrap();
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(&mut file, &[0]).unwrap();
        let refused = changed.text().unwrap_err().to_string();
        assert!(refused.contains("changed"), "{refused}");
    }

    #[test]
    fn a_split_by_bytes_weighs_the_embedding_and_the_head() {
        let even = LayerBytes {
            embedding: 0,
            layers: vec![10; 30],
            head: 0,
            tied: 0,
        };
        assert_eq!(split_by_bytes(&even, 3), even_split(30, 3));
        // Gemma 3 270M's shape: ends of 170 MiB, 18 layers of about 4.
        let gemma = LayerBytes {
            embedding: 170,
            layers: vec![4; 18],
            head: 170,
            tied: 0,
        };
        let ranges = split_by_bytes(&gemma, 3);
        assert_eq!(ranges, vec![0..1, 1..17, 17..18]);
        assert_eq!(split_by_bytes(&gemma, 1), vec![0..18]);
        // More parts than layers: one layer each.
        assert_eq!(split_by_bytes(&gemma, 40).len(), 18);
        let two = split_by_bytes(&gemma, 2);
        assert_eq!(two, vec![0..9, 9..18]);
        // Tied, the chain's first slice holds the matrix once, so it takes
        // more layers than when it held two copies.
        let tied = LayerBytes {
            tied: 170,
            ..gemma.clone()
        }
        .with_head_on_first();
        assert_eq!(tied.embedding, 170);
        let untied = gemma.with_head_on_first();
        assert_eq!(untied.embedding, 340);
        assert!(split_by_bytes(&tied, 3)[0].end >= split_by_bytes(&untied, 3)[0].end);
    }

    #[test]
    fn splits() {
        assert_eq!(even_split(30, 3), vec![0..10, 10..20, 20..30]);
        assert_eq!(even_split(7, 3), vec![0..3, 3..5, 5..7]);
        assert_eq!(parse_split("0..4,4..30", 30).unwrap(), vec![0..4, 4..30]);
        assert!(parse_split("0..4,5..30", 30).is_err());
        assert!(parse_split("0..4,4..31", 31 - 1).is_err());
        assert!(parse_split("0..4", 30).is_err());
    }
}
