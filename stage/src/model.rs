//! A layer slice `[a, b)` of a decoder (the Llama family, and Gemma 3 with
//! its extra norms and interleaved local and global attention), and its
//! forward pass. The first slice also holds the token embedding; the last
//! holds the final norm and the output head (the embedding again when tied).

use std::ops::Range;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::attention;
use crate::error::{EngineError, Result};
use crate::frame::Activations;
use crate::kernels::{BlockFormat, BlockMatrix, GROUP_ROWS, KernelError, WeightPages};
use crate::source::{BlockStyle, ModelConfig, RawTensor, RopeLayout, Source};

/// Longest context a slice serves (positions it rotates).
pub const MAX_ENGINE_CONTEXT: usize = 8192;
/// Most rows several requests share one matrix product with: from 32 rows
/// candle may switch to another kernel (AMX for Q4_K), whose bits differ
/// from the kernel one request alone gets.
pub const MAX_BATCH_ROWS: usize = 31;

/// `gelu(gate) * up` with GELU's tanh approximation (Gemma's reference),
/// computed as llama.cpp does: GELU read from a table of every f16 input
/// (the gate rounded to f16), 0 below -10 and the identity above 10. One
/// lookup instead of a libm `tanhf` per value (9 % of Gemma 3's prefill),
/// and the same values as llama.cpp's `ggml_vec_geglu_f32`.
fn gelu_gated(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| {
                let x = half::f16::from_bits(bits).to_f32();
                // llama.cpp's constant and order of operations.
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                let inner = SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x);
                half::f16::from_f32(0.5 * x * (1.0 + inner.tanh())).to_f32()
            })
            .collect()
    });
    let dims = gate.dims().to_vec();
    let gates = gate.flatten_all()?.to_vec1::<f32>()?;
    let ups = up.flatten_all()?.to_vec1::<f32>()?;
    let values: Vec<f32> = gates
        .iter()
        .zip(&ups)
        .map(|(&g, &u)| {
            if g <= -10.0 {
                0.0
            } else if g >= 10.0 {
                g * u
            } else {
                table[usize::from(half::f16::from_f32(g).to_bits())] * u
            }
        })
        .collect();
    Ok(Tensor::from_vec(values, dims, &Device::Cpu)?)
}

/// `x` (rows of `matrix.cols()` values, the steps' rows one after the
/// other) through one of the engine's own block kernels.
fn blocks_forward(matrix: &BlockMatrix, x: &Tensor, steps: &[usize]) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    if dims.last() != Some(&matrix.cols()) {
        return Err(EngineError::Compute(format!(
            "an input of shape {dims:?} for a matrix of {} columns",
            matrix.cols()
        )));
    }
    let input = x.flatten_all()?.to_vec1::<f32>()?;
    let out = matrix
        .matmul_steps(&input, steps)
        .map_err(|e| EngineError::Compute(e.to_string()))?;
    if let Some(last) = dims.last_mut() {
        *last = matrix.rows();
    }
    Ok(Tensor::from_vec(out, dims, &Device::Cpu)?)
}

/// The block formats the engine runs on its own kernels (`kernels`)
/// rather than candle's, for a matrix of `rows` rows: every block format
/// but Q5_1, Q2_K, Q3_K and Q8_K. candle would hold Q4_K and Q6_K, and Q8_0 where it can
/// tile it, twice once run (its tiles beside the stored blocks); its Q4_1,
/// Q5_0 and Q5_K products are one row's dot products, 2-7x slower than
/// the grouped ones (`mesh-node bench kernels`, docs/BENCHMARKS.md).
fn own_kernel(dtype: GgmlDType, rows: usize) -> Option<BlockFormat> {
    if rows < GROUP_ROWS {
        // Padded to a whole group it would hold up to sixteen times its
        // bytes (no real model's matrix is this small).
        return None;
    }
    match dtype {
        GgmlDType::Q4_0 => Some(BlockFormat::Q4_0),
        GgmlDType::Q4_1 => Some(BlockFormat::Q4_1),
        GgmlDType::Q5_0 => Some(BlockFormat::Q5_0),
        GgmlDType::Q4K => Some(BlockFormat::Q4K),
        GgmlDType::Q5K => Some(BlockFormat::Q5K),
        GgmlDType::Q6K => Some(BlockFormat::Q6K),
        GgmlDType::Q8_0 => Some(BlockFormat::Q8_0),
        _ => None,
    }
}

#[derive(Debug)]
enum Linear {
    Quantized(QMatMul),
    /// Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K in their stored blocks
    /// (grouped sixteen rows at a time), on the engine's own kernels.
    Blocks(BlockMatrix),
    Dense(candle_nn::Linear),
}

/// How stored weights are executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExecPolicy {
    /// Run every matrix dense in f32 (dequantized at load): exact but 4-6x
    /// the memory of a 4-bit file; for comparison and for debugging.
    pub dense_f32: bool,
    /// Run every operation on candle's kernels, the engine's own CPU paths
    /// (block kernels, attention, GELU table) off: the route a GPU takes,
    /// so a CPU can check it (a GPU slice takes it whatever this says).
    pub candle_only: bool,
}

impl Linear {
    /// Build the executable form on `device`, its blocks in `held`'s
    /// pages where it runs on the engine's own kernels; `held.resident`
    /// grows by the bytes it holds. The engine's own kernels run on the
    /// CPU only: a slice off the CPU loads with `candle_only` set.
    fn from_raw(
        raw: RawTensor,
        policy: ExecPolicy,
        held: &mut Held,
        device: &Device,
    ) -> Result<Self> {
        let resident = &mut held.resident;
        Ok(match raw {
            RawTensor::Quantized(q) if policy.dense_f32 => {
                let dense = q.dequantize(device)?;
                *resident += dense.elem_count() * 4;
                Linear::Dense(candle_nn::Linear::new(dense, None))
            }
            RawTensor::Quantized(q) => match q.shape().dims2().ok().and_then(|(rows, cols)| {
                own_kernel(q.dtype(), rows)
                    .filter(|_| !policy.candle_only)
                    .map(|format| (format, rows, cols))
            }) {
                Some((format, rows, cols)) => {
                    let matrix =
                        BlockMatrix::new_in(format, rows, cols, &q.data()?, &mut held.pages)
                            .map_err(|e| EngineError::Compute(e.to_string()))?;
                    *resident += matrix.storage_bytes();
                    if matrix.in_pages() {
                        held.paged += matrix.storage_bytes();
                    }
                    Linear::Blocks(matrix)
                }
                None => {
                    // F32/F16 GGUF matrices are held dequantized by candle.
                    *resident += match q.dtype() {
                        GgmlDType::F32 | GgmlDType::F16 => q.shape().elem_count() * 4,
                        _ => q.storage_size_in_bytes(),
                    };
                    Linear::Quantized(QMatMul::from_qtensor(onto(q, device)?)?)
                }
            },
            RawTensor::Dense(t) => {
                *resident += t.elem_count() * 4;
                Linear::Dense(candle_nn::Linear::new(t.to_device(device)?, None))
            }
        })
    }
    /// Whether its product splits its work over candle's barrier pool
    /// (the engine's kernels and candle's block kernels), not rayon.
    fn pool_free(&self) -> bool {
        matches!(
            self,
            Linear::Blocks(_) | Linear::Quantized(QMatMul::QTensor(_))
        )
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Linear::Quantized(q) => q.forward(x)?,
            Linear::Blocks(matrix) => {
                let rows = x.elem_count() / matrix.cols().max(1);
                blocks_forward(matrix, x, &[rows])?
            }
            Linear::Dense(l) => l.forward(x)?,
        })
    }

    /// Whether candle's CPU kernel for this matrix computes each output row
    /// the same way whatever the number of rows, up to `MAX_BATCH_ROWS`
    /// (checked by `a_batch_of_requests_gives_each_the_bits_it_gets_alone`
    /// for every supported type). On x86-64 candle's block-quantized
    /// kernels are one row's dot products (Q4_0, Q8_0 unpacked; Q4_K,
    /// Q5_K and Q8_0 repacked into tiles), except Q6_K, whose one-row kernel
    /// is not its tiled one, and Q4_K from 32 rows with AMX; the engine's own
    /// kernels are row-independent everywhere. Dense products go through
    /// a blocked multiply whose summation order follows the row count; on
    /// other architectures the packed kernels change with the row count.
    fn rows_independent(&self) -> bool {
        match self {
            // On a GPU candle picks its kernel by the row count.
            Linear::Quantized(QMatMul::QTensor(q)) => {
                q.device().is_cpu() && cfg!(target_arch = "x86_64") && q.dtype() != GgmlDType::Q6K
            }
            Linear::Blocks(_) => true,
            _ => false,
        }
    }

    /// The rows of several requests (`spans`: first row, row count). Where
    /// the kernel is row-independent all rows go in one call, so the
    /// weights are read once; otherwise each request's rows go alone and
    /// get the bits they get alone.
    fn forward_rows(&self, x: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor> {
        if let Linear::Blocks(matrix) = self {
            let steps: Vec<usize> = spans.iter().map(|(_, rows)| *rows).collect();
            return blocks_forward(matrix, x, &steps);
        }
        if spans.len() == 1 || (self.rows_independent() && x.dim(0)? <= MAX_BATCH_ROWS) {
            return self.forward(x);
        }
        let parts = spans
            .iter()
            .map(|(offset, rows)| self.forward(&x.narrow(0, *offset, *rows)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }
}

/// Several projections of the same input, run as one matrix when they can be
/// stacked (one activation quantization and one kernel dispatch instead of
/// several), or one by one when their stored types differ.
#[derive(Debug)]
enum Projections {
    Stacked { linear: Linear, widths: Vec<usize> },
    Separate(Vec<Linear>),
}

impl Projections {
    fn pool_free(&self) -> bool {
        match self {
            Projections::Stacked { linear, .. } => linear.pool_free(),
            Projections::Separate(linears) => linears.iter().all(Linear::pool_free),
        }
    }

    fn from_raw(
        raws: Vec<RawTensor>,
        policy: ExecPolicy,
        held: &mut Held,
        device: &Device,
    ) -> Result<Self> {
        let widths: Vec<usize> = raws
            .iter()
            .map(|r| match r {
                RawTensor::Quantized(q) => q.shape().dims().first().copied().unwrap_or(0),
                RawTensor::Dense(t) => t.dims().first().copied().unwrap_or(0),
            })
            .collect();
        let dtypes: Vec<Option<GgmlDType>> = raws
            .iter()
            .map(|r| match r {
                RawTensor::Quantized(q) => Some(q.dtype()),
                RawTensor::Dense(_) => None,
            })
            .collect();
        let columns: Vec<Option<usize>> = raws
            .iter()
            .map(|r| match r {
                RawTensor::Quantized(q) => q.shape().dims().get(1).copied(),
                RawTensor::Dense(t) => t.dims().get(1).copied(),
            })
            .collect();
        let same = stack_into_one(&dtypes, &columns);
        let Some(first) = dtypes.first().copied() else {
            return Ok(Projections::Separate(Vec::new()));
        };
        if !same {
            return Ok(Projections::Separate(
                raws.into_iter()
                    .map(|r| Linear::from_raw(r, policy, held, device))
                    .collect::<Result<_>>()?,
            ));
        }
        let dequantize_all =
            policy.dense_f32 || matches!(first, None | Some(GgmlDType::F32) | Some(GgmlDType::F16));
        let stacked = if dequantize_all {
            let dense = raws
                .into_iter()
                .map(|r| match r {
                    RawTensor::Quantized(q) => q.dequantize(&Device::Cpu),
                    RawTensor::Dense(t) => Ok(t),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            RawTensor::Dense(Tensor::cat(&dense, 0)?)
        } else {
            // Same block type, rows of whole blocks: the stored bytes stack.
            let cols = columns.first().copied().flatten().unwrap_or(0);
            let mut bytes = Vec::new();
            for raw in &raws {
                if let RawTensor::Quantized(q) = raw {
                    bytes.extend_from_slice(&q.data()?);
                }
            }
            let dtype = first.unwrap_or(GgmlDType::F32);
            let storage = candle_core::quantized::QStorage::from_data(
                std::borrow::Cow::Owned(bytes),
                &Device::Cpu,
                dtype,
            )?;
            RawTensor::Quantized(QTensor::new(storage, (widths.iter().sum::<usize>(), cols))?)
        };
        Ok(Projections::Stacked {
            linear: Linear::from_raw(stacked, policy, held, device)?,
            widths,
        })
    }

    fn forward(&self, x: &Tensor, spans: &[(usize, usize)]) -> Result<Vec<Tensor>> {
        match self {
            Projections::Separate(parts) => {
                parts.iter().map(|l| l.forward_rows(x, spans)).collect()
            }
            Projections::Stacked { linear, widths } => {
                let all = linear.forward_rows(x, spans)?;
                let mut start = 0;
                widths
                    .iter()
                    .map(|w| {
                        let part = all.narrow(1, start, *w)?.contiguous()?;
                        start += w;
                        Ok(part)
                    })
                    .collect()
            }
        }
    }
}

// With the `cuda` feature candle's `QTensor` holds its GPU storage inline;
// a slice has one embedding, so its size costs nothing.
#[cfg_attr(feature = "cuda", allow(clippy::large_enum_variant))]
#[derive(Debug)]
enum Embedding {
    Quantized(QTensor),
    Dense(Tensor),
    /// Tied to the output head this slice also holds: its rows are read
    /// from the head's matrix, which is held once.
    Head,
}

#[derive(Debug)]
struct Block {
    attn_norm: Tensor,
    /// q, k, v
    qkv: Projections,
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    v_bias: Option<Tensor>,
    o: Linear,
    ffn_norm: Tensor,
    /// gate, up
    gate_up: Projections,
    down: Linear,
    /// Gemma 3's norms: each head's query and key, and the outputs of the
    /// attention and of the feed-forward before they join the residual.
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    post_attention_norm: Option<Tensor>,
    post_ffn_norm: Option<Tensor>,
    /// Attends through the sliding window, with the local RoPE base.
    local: bool,
}

impl Block {
    fn pool_free(&self) -> bool {
        self.qkv.pool_free()
            && self.o.pool_free()
            && self.gate_up.pool_free()
            && self.down.pool_free()
    }
}

#[derive(Debug)]
struct Head {
    norm: Tensor,
    output: Linear,
}

/// Where a slice's output head (final norm and output matrix) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadUse {
    /// In `forward`, when the slice ends the model: an in-process pipeline's
    /// last slice returns logits.
    InForward,
    /// Held by the slice but applied only by `logits`: a chain's
    /// coordinator, which samples from the final stage's hidden state.
    Apart,
    /// Not held: a chain's stages, whose final one returns its hidden state.
    Without,
}

/// What a slice takes in.
#[derive(Debug)]
pub enum SliceInput<'a> {
    /// Token ids: only the first slice (it holds the embedding).
    Tokens(&'a [u32]),
    /// Hidden states from the previous slice.
    Hidden(&'a Activations),
}

impl SliceInput<'_> {
    /// The positions this input brings.
    pub fn rows(&self) -> usize {
        match self {
            SliceInput::Tokens(ids) => ids.len(),
            SliceInput::Hidden(activations) => activations.rows,
        }
    }
}

/// What a slice gives back.
#[derive(Debug, Clone, PartialEq)]
pub enum SliceOutput {
    /// Hidden states for the next slice, one row per input position.
    Hidden(Activations),
    /// The last slice: logits of the last position.
    Logits(Vec<f32>),
}

/// Per-request state of one slice: a bounded KV cache per layer.
#[derive(Debug)]
pub struct SliceCache {
    layers: Vec<KvRows>,
    position: usize,
    capacity: usize,
}

impl SliceCache {
    /// Tokens seen so far.
    pub fn position(&self) -> usize {
        self.position
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keep the first `positions` positions and forget the rest: a kept
    /// cache is cut back to the positions every stage of a resumed chain
    /// holds, and a verified draft's rejected positions are dropped. Asking
    /// for more than it holds is refused and changes nothing. Nothing is
    /// copied: the positions past the cut are written over by the next step.
    pub fn truncate(&mut self, positions: usize) -> Result<()> {
        if positions > self.position {
            return Err(EngineError::WrongInput(
                "a cache cannot keep more positions than it holds",
            ));
        }
        for kv in &mut self.layers {
            kv.len = positions;
        }
        self.position = positions;
        Ok(())
    }
}

/// One layer's keys and values for one request: two `(1, kv_heads,
/// capacity, head_dim)` buffers, allocated at the first step and filled up
/// to `len`. Unlike candle's `KvCache` it can be cut back without a copy.
#[derive(Debug)]
struct KvRows {
    buffers: Option<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
    /// What the buffers hold: f16 on the engine's own route (the
    /// attention reads half the bytes, as llama.cpp's f16 cache does),
    /// else the step's own type (candle's route, which multiplies the
    /// cache with the queries as it is).
    stored: Option<DType>,
}

impl KvRows {
    fn new(capacity: usize, stored: Option<DType>) -> Self {
        Self {
            buffers: None,
            len: 0,
            capacity,
            stored,
        }
    }

    /// Write a step's `k`, `v` (`(1, kv_heads, seq, head_dim)`) after the
    /// positions held; every position held so far and the step's, as views
    /// of the buffers.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        const AXIS: usize = 2;
        let seq = k.dim(AXIS)?;
        if self.len + seq > self.capacity {
            return Err(EngineError::WrongInput(
                "was given a step past its cache's capacity",
            ));
        }
        let stored = self.stored.unwrap_or(k.dtype());
        let (keys, values) = match &self.buffers {
            Some(buffers) => buffers,
            None => {
                let mut shape = k.dims().to_vec();
                shape[AXIS] = self.capacity;
                let zeros = || Tensor::zeros(shape.as_slice(), stored, k.device());
                self.buffers.insert((zeros()?, zeros()?))
            }
        };
        keys.slice_set(&k.to_dtype(stored)?.contiguous()?, AXIS, self.len)?;
        values.slice_set(&v.to_dtype(stored)?.contiguous()?, AXIS, self.len)?;
        self.len += seq;
        Ok((
            keys.narrow(AXIS, 0, self.len)?,
            values.narrow(AXIS, 0, self.len)?,
        ))
    }
}

/// A loaded slice.
#[derive(Debug)]
pub struct LayerSlice {
    pub range: Range<u32>,
    config: ModelConfig,
    embedding: Option<Embedding>,
    blocks: Vec<Block>,
    head: Option<Head>,
    head_use: HeadUse,
    /// RoPE of the global layers (all layers of most models).
    rope: Rope,
    /// RoPE of the local (sliding-window) layers, when they have their own base.
    local_rope: Option<Rope>,
    weights_digest: [u8; 32],
    stored_bytes: usize,
    resident_bytes: usize,
    /// Of which grouped into the slice's weight pages (`kernels::WeightPages`).
    paged_bytes: usize,
    /// Where its weights, caches and arithmetic live.
    device: Device,
    /// The file's declared quantization, the stored types of the tensors
    /// it holds, and how its products are formed.
    file_type: Option<&'static str>,
    stored_types: std::collections::BTreeSet<&'static str>,
    dense_f32: bool,
    /// Every operation on candle's kernels: on a GPU, or when asked
    /// (`ExecPolicy::candle_only`).
    candle_only: bool,
    /// Every matrix (and the head's) on the engine's own kernels or
    /// candle's block kernels, which split their work over candle's
    /// barrier pool from whatever thread calls them: a one-row step then
    /// needs nothing of candle's rayon pool (see `forward_batch_rows`).
    pool_free_rows: bool,
}

fn raw_size(raw: &RawTensor) -> usize {
    match raw {
        RawTensor::Quantized(q) => q.storage_size_in_bytes(),
        RawTensor::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
    }
}

/// What a loading slice holds so far: the bytes, and the pages its
/// matrices on the engine's own kernels are grouped into.
#[derive(Debug)]
struct Held {
    resident: usize,
    /// Of which in `pages`.
    paged: usize,
    pages: WeightPages,
}

/// The most rows candle's RMS norm (0.11) takes one by one, without rayon.
const MAX_CALLING_THREAD_ROWS: usize = 32;

/// Whether projections of these stored types and input widths stack into
/// one matrix: only parts of one type and one input width do.
fn stack_into_one<T: PartialEq, W: PartialEq>(types: &[T], widths: &[W]) -> bool {
    types.windows(2).all(|w| w[0] == w[1]) && widths.windows(2).all(|w| w[0] == w[1])
}

/// The projections of a block, in the order it reads them, as
/// `Projections::from_raw` takes them (GGUF part names).
const QKV: [&str; 3] = ["attn_q.weight", "attn_k.weight", "attn_v.weight"];
const ATTENTION_OUTPUT: &str = "attn_output.weight";
const GATE_UP: [&str; 2] = ["ffn_gate.weight", "ffn_up.weight"];
const FFN_DOWN: &str = "ffn_down.weight";

/// What a slice's weight pages need: the matrices among `projections`
/// (each a set `Projections::from_raw` stacks into one matrix when its
/// parts share a stored type and width (`stack_into_one`), as q, k and v
/// do, or gate and up; a single matrix is a set of one) that the engine's
/// own kernels will run (`own_kernel`), grouped. Were it short, a matrix
/// past it would be held on the heap.
fn pages_bound(source: &Source, projections: &[Vec<String>]) -> usize {
    let Some(content) = source.gguf() else {
        return 0;
    };
    let room = |dtype: GgmlDType, rows: usize, cols: usize| {
        own_kernel(dtype, rows)
            .map(|format| WeightPages::room_for(BlockMatrix::grouped_bytes(format, rows, cols)))
            .unwrap_or(0)
    };
    let mut total = 0usize;
    for set in projections {
        let parts: Vec<(GgmlDType, usize, usize)> = set
            .iter()
            .filter_map(|name| {
                let info = content.tensor_infos.get(name)?;
                let (rows, cols) = info.shape.dims2().ok()?;
                Some((info.ggml_dtype, rows, cols))
            })
            .collect();
        let types: Vec<GgmlDType> = parts.iter().map(|p| p.0).collect();
        let widths: Vec<usize> = parts.iter().map(|p| p.2).collect();
        let stacked = parts.len() > 1 && stack_into_one(&types, &widths);
        let need = match parts.first() {
            Some(&(dtype, _, cols)) if stacked => {
                let rows = parts.iter().map(|p| p.1).fold(0, usize::saturating_add);
                room(dtype, rows, cols)
            }
            _ => parts
                .iter()
                .map(|&(dtype, rows, cols)| room(dtype, rows, cols))
                .fold(0, usize::saturating_add),
        };
        total = total.saturating_add(need);
    }
    total
}

fn dense(raw: RawTensor, resident: &mut usize, device: &Device) -> Result<Tensor> {
    let t = match raw {
        RawTensor::Quantized(q) => q.dequantize(device)?,
        RawTensor::Dense(t) => t.to_device(device)?,
    };
    *resident += t.elem_count() * 4;
    Ok(t)
}

/// A stored matrix (read onto the CPU) moved onto `device` in its own
/// block format: the GPU's quantized kernels read the blocks as stored.
fn onto(q: QTensor, device: &Device) -> Result<QTensor> {
    if device.is_cpu() {
        return Ok(q);
    }
    let storage = candle_core::quantized::QStorage::from_data(q.data()?, device, q.dtype())?;
    Ok(QTensor::new(storage, q.shape().clone())?)
}

/// Rotary embeddings: the frequencies, and how many positions a slice
/// serves. The cosines and sines of a step's positions are computed when it
/// runs (`Rope::rows`), once for all the slice's layers: a table for every
/// position was context x head_dim floats per slice (16 MiB for Gemma 3's
/// two, three quarters of the weights of the 270M model's middle third).
#[derive(Debug)]
struct Rope {
    /// Each frequency pair's angle per position.
    inv_freq: Vec<f32>,
    positions: usize,
}

/// The cosines and sines of one step's positions, `(rows, head_dim / 2)`.
#[derive(Debug)]
struct RopeRows {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Base `theta`, positions divided by `scale` (linear scaling), up to
    /// the slice's context.
    fn new(head_dim: usize, context: usize, theta: f32, scale: f32) -> Self {
        Self {
            inv_freq: (0..head_dim / 2)
                .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32) / scale)
                .collect(),
            positions: context.clamp(1, MAX_ENGINE_CONTEXT),
        }
    }

    /// Positions `position..position + rows`. Each angle is the position
    /// times the frequency, rounded once, as the table (an `(n, 1) x (1,
    /// half)` product) held it, so the bits are the table's.
    fn rows(&self, position: usize, rows: usize, device: &Device) -> Result<RopeRows> {
        if position + rows > self.positions {
            return Err(EngineError::ContextExceeded {
                tokens: position + rows,
                max_new: 0,
                context: self.positions,
            });
        }
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (
            Vec::with_capacity(rows * half),
            Vec::with_capacity(rows * half),
        );
        for p in position..position + rows {
            for f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok(RopeRows {
            cos: Tensor::from_vec(cos, (rows, half), device)?,
            sin: Tensor::from_vec(sin, (rows, half), device)?,
        })
    }
}

impl RopeRows {
    /// Rotate `x` (1, heads, seq, head_dim): these rows' positions.
    fn apply(&self, x: &Tensor, layout: RopeLayout) -> Result<Tensor> {
        Ok(match layout {
            RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(x, &self.cos, &self.sin)?,
            RopeLayout::Halves => candle_nn::rotary_emb::rope(x, &self.cos, &self.sin)?,
        })
    }
}

/// One step's rotations: the global layers', and the local (sliding
/// window) layers' where they have their own base.
#[derive(Debug)]
struct StepRope {
    global: RopeRows,
    local: Option<RopeRows>,
}

/// How a batch's rows are laid out: each step's first row and row count
/// (`spans`), the steps as the matrices see them (`matrix_spans`: a step
/// whose rows go alone is one step per row), and which steps those are.
struct BatchRows<'a> {
    spans: &'a [(usize, usize)],
    matrix_spans: &'a [(usize, usize)],
    rows_alone: &'a [bool],
    /// Each step's rotations, for every layer.
    ropes: &'a [StepRope],
}

impl LayerSlice {
    /// Load layers `range` (and the embedding / head at the ends) from `source`.
    pub fn load(
        source: &Source,
        config: &ModelConfig,
        range: Range<u32>,
        policy: ExecPolicy,
        device: &Device,
    ) -> Result<Self> {
        let head_use = if range.end == config.layers {
            HeadUse::InForward
        } else {
            HeadUse::Without
        };
        Self::load_with_head(source, config, range, policy, head_use, device)
    }

    /// `load`, with the output head where `head_use` says (`InForward` holds
    /// it only when the slice ends the model).
    pub fn load_with_head(
        source: &Source,
        config: &ModelConfig,
        range: Range<u32>,
        policy: ExecPolicy,
        head_use: HeadUse,
        device: &Device,
    ) -> Result<Self> {
        // The engine's own kernels and attention read CPU memory: anywhere
        // else every operation runs on candle's.
        let policy = ExecPolicy {
            candle_only: policy.candle_only || !device.is_cpu(),
            ..policy
        };
        if range.start >= range.end || range.end > config.layers {
            return Err(EngineError::BadRange {
                start: range.start,
                end: range.end,
                layers: config.layers,
            });
        }
        let names = source.names();
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"mesh-node slice weights v1");
        let mut stored_bytes = 0usize;
        let first = range.start == 0;
        let last = range.end == config.layers;
        let holds_head = match head_use {
            HeadUse::InForward => last,
            HeadUse::Apart => true,
            HeadUse::Without => false,
        };
        // A model without an output matrix ties its head to the embedding:
        // a slice holding both holds that matrix once.
        let head_matrix = source.head_matrix();
        let pages = if policy.candle_only || policy.dense_f32 {
            WeightPages::none()
        } else {
            const PROJECTIONS: [&[&str]; 4] = [&QKV, &[ATTENTION_OUTPUT], &GATE_UP, &[FFN_DOWN]];
            let mut projections: Vec<Vec<String>> = range
                .clone()
                .flat_map(|i| {
                    PROJECTIONS.map(|set| set.iter().map(|part| names.block(i, part)).collect())
                })
                .collect();
            if holds_head {
                projections.push(vec![head_matrix.to_string()]);
            }
            WeightPages::reserve(pages_bound(source, &projections))
        };
        let mut held = Held {
            resident: 0,
            paged: 0,
            pages,
        };
        let mut stored_types = std::collections::BTreeSet::new();
        let mut read = |name: &str| -> Result<RawTensor> {
            let raw = source.read(name, &mut hasher)?;
            stored_bytes += raw_size(&raw);
            stored_types.insert(match &raw {
                RawTensor::Quantized(q) => crate::precision::type_name(q.dtype()),
                RawTensor::Dense(t) => crate::precision::dense_name(t.dtype()),
            });
            Ok(raw)
        };
        let tied = head_matrix == names.embedding;
        let embedding = if first && holds_head && tied {
            Some(Embedding::Head)
        } else if first {
            let raw = read(names.embedding)?;
            held.resident += raw_size(&raw);
            Some(match raw {
                RawTensor::Quantized(q) => Embedding::Quantized(onto(q, device)?),
                RawTensor::Dense(t) => Embedding::Dense(t.to_device(device)?),
            })
        } else {
            None
        };
        let gemma = config.block_style == BlockStyle::Gemma3;
        let mut blocks = Vec::with_capacity((range.end - range.start) as usize);
        for i in range.clone() {
            let mut part = |p: &str| read(&names.block(i, p));
            let attn_norm = dense(part("attn_norm.weight")?, &mut held.resident, device)?;
            let qkv = QKV.iter().map(|p| part(p)).collect::<Result<Vec<_>>>()?;
            let qkv = Projections::from_raw(qkv, policy, &mut held, device)?;
            let (q_bias, k_bias, v_bias) = if config.qkv_bias {
                (
                    Some(dense(part("attn_q.bias")?, &mut held.resident, device)?),
                    Some(dense(part("attn_k.bias")?, &mut held.resident, device)?),
                    Some(dense(part("attn_v.bias")?, &mut held.resident, device)?),
                )
            } else {
                (None, None, None)
            };
            let o = Linear::from_raw(part(ATTENTION_OUTPUT)?, policy, &mut held, device)?;
            let ffn_norm = dense(part("ffn_norm.weight")?, &mut held.resident, device)?;
            let gate_up = GATE_UP
                .iter()
                .map(|p| part(p))
                .collect::<Result<Vec<_>>>()?;
            let gate_up = Projections::from_raw(gate_up, policy, &mut held, device)?;
            let down = Linear::from_raw(part(FFN_DOWN)?, policy, &mut held, device)?;
            let mut gemma_norm = |p: &str| -> Result<Option<Tensor>> {
                if gemma {
                    Ok(Some(dense(part(p)?, &mut held.resident, device)?))
                } else {
                    Ok(None)
                }
            };
            let q_norm = gemma_norm("attn_q_norm.weight")?;
            let k_norm = gemma_norm("attn_k_norm.weight")?;
            let post_attention_norm = gemma_norm("post_attention_norm.weight")?;
            let post_ffn_norm = gemma_norm("post_ffw_norm.weight")?;
            blocks.push(Block {
                attn_norm,
                qkv,
                q_bias,
                k_bias,
                v_bias,
                o,
                ffn_norm,
                gate_up,
                down,
                q_norm,
                k_norm,
                post_attention_norm,
                post_ffn_norm,
                local: config.is_local(i),
            });
        }
        let head = if holds_head {
            let norm = dense(read(names.output_norm)?, &mut held.resident, device)?;
            Some(Head {
                norm,
                output: Linear::from_raw(read(head_matrix)?, policy, &mut held, device)?,
            })
        } else {
            None
        };
        let rope = Rope::new(
            config.head_dim,
            config.context,
            config.rope_theta,
            config.rope_scale,
        );
        let local_rope = match config.sliding_window {
            Some(window) if blocks.iter().any(|b| b.local) => Some(Rope::new(
                config.head_dim,
                config.context,
                window.rope_theta,
                1.0,
            )),
            _ => None,
        };
        held.pages.seal();
        // Each tensor's bytes as read are freed once grouped into the pages.
        crate::kernels::return_freed_memory();
        let pool_free_rows = device.is_cpu()
            && !policy.candle_only
            && blocks.iter().all(Block::pool_free)
            && head.as_ref().is_none_or(|head| head.output.pool_free());
        Ok(Self {
            range,
            config: config.clone(),
            embedding,
            blocks,
            head,
            head_use,
            rope,
            local_rope,
            weights_digest: *hasher.finalize().as_bytes(),
            stored_bytes,
            resident_bytes: held.resident,
            paged_bytes: held.paged,
            device: device.clone(),
            file_type: source.file_type(),
            stored_types,
            dense_f32: policy.dense_f32,
            candle_only: policy.candle_only,
            pool_free_rows,
        })
    }

    /// The precision this slice's passes run at with frames of `wire`.
    pub fn precision(&self, wire: crate::frame::WireDType) -> crate::precision::Precision {
        crate::precision::Precision {
            file_type: self.file_type,
            products: crate::precision::Precision::products_of(&self.stored_types, self.dense_f32),
            stored: self.stored_types.clone(),
            device: crate::device::device_name(&self.device),
            wire,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn is_first(&self) -> bool {
        self.embedding.is_some()
    }
    /// Whether `forward` returns logits: the slice ends the model and runs
    /// the head itself.
    pub fn is_last(&self) -> bool {
        self.head.is_some() && self.head_use == HeadUse::InForward
    }
    /// Whether the slice holds the output head (`logits` can run).
    pub fn holds_head(&self) -> bool {
        self.head.is_some()
    }
    /// BLAKE3 over every tensor this slice read (name, length, stored bytes),
    /// in load order.
    pub fn weights_digest(&self) -> [u8; 32] {
        self.weights_digest
    }
    /// Bytes of weights this slice holds in memory, as executed.
    pub fn weight_bytes(&self) -> usize {
        self.resident_bytes
    }
    /// Of `weight_bytes`, those in the slice's weight pages, one mapping
    /// advised for huge pages (`kernels::WeightPages`).
    pub fn paged_weight_bytes(&self) -> usize {
        self.paged_bytes
    }
    /// Bytes of weights this slice read from the model file(s).
    pub fn stored_bytes(&self) -> usize {
        self.stored_bytes
    }

    /// What this slice's KV caches hold: f16 where the engine's own
    /// attention reads them, the step's own type on candle's route.
    ///
    /// f16 as llama.cpp keeps them:
    /// half the bytes a decode step deep in a long context reads, and half the
    /// memory. The queries are then rounded to f16 too (as llama.cpp rounds
    /// them for its f16 dot products): without that, one of the llama.cpp
    /// agreement test's prompts fell outside its tolerance (SmolLM2, "The
    /// capital of France is": step 5, gap 0.361 nats against 0.35); with it,
    /// every prompt agrees as with f32 caches.
    fn kv_stored(&self) -> Option<DType> {
        (!self.candle_only).then_some(DType::F16)
    }

    /// A fresh cache for one request of at most `max_tokens` positions.
    pub fn new_cache(&self, max_tokens: usize) -> Result<SliceCache> {
        let limit = self.rope.positions;
        if max_tokens > limit {
            return Err(EngineError::ContextExceeded {
                tokens: max_tokens,
                max_new: 0,
                context: limit,
            });
        }
        Ok(SliceCache {
            layers: self
                .blocks
                .iter()
                .map(|_| KvRows::new(max_tokens.max(1), self.kv_stored()))
                .collect(),
            position: 0,
            capacity: max_tokens,
        })
    }

    /// Run this slice over the next positions of one request.
    pub fn forward(&self, input: SliceInput<'_>, cache: &mut SliceCache) -> Result<SliceOutput> {
        let mut outputs = self.forward_batch(&mut [(input, cache)])?;
        outputs
            .pop()
            .ok_or(EngineError::WrongInput("returned no output"))
    }

    /// Run this slice over the next positions of several requests at once,
    /// each with its own cache and positions: their rows are stacked for
    /// every projection and feed-forward, so the weights are read once for
    /// all of them, and each request attends only to its own cache. Every
    /// output row depends only on its own input row and cache (norms are
    /// per row, each matrix product element is one row's dot product), so a
    /// request's outputs are those it gets when run alone.
    pub fn forward_batch(
        &self,
        jobs: &mut [(SliceInput<'_>, &mut SliceCache)],
    ) -> Result<Vec<SliceOutput>> {
        self.forward_batch_rows(jobs, &[])
    }

    /// `forward_batch`, where a step marked in `rows_alone` (a draft being
    /// verified: several positions of one request) has each of its rows go
    /// through every matrix as if it were a one-row decode step, so each
    /// row gets the bits it gets decoded alone, whatever the kernel. Its
    /// rows still attend causally to each other through its cache.
    pub fn forward_batch_rows(
        &self,
        jobs: &mut [(SliceInput<'_>, &mut SliceCache)],
        rows_alone: &[bool],
    ) -> Result<Vec<SliceOutput>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        if !rows_alone.is_empty() && rows_alone.len() != jobs.len() {
            return Err(EngineError::WrongInput(
                "was told how to run the rows of another number of steps",
            ));
        }
        // Every step is checked before any cache changes.
        for (input, cache) in jobs.iter() {
            self.check_step(input, cache)?;
        }
        // On candle's own thread pool: its norm, RoPE and softmax kernels
        // split their work with rayon, and called from outside the pool
        // each of them (five per layer) hands its work to a pool thread and
        // sleeps until it is done, two context switches apiece. Steps of
        // one row each, up to the rows candle's norm takes one by one, need
        // none of those: their matrices and attention split their work over
        // candle's barrier pool from the calling thread, so they run here
        // and spare the hand-off to the pool and back (two thread wake-ups
        // a pass).
        if self.runs_on_calling_thread(jobs.iter().map(|(input, _)| input.rows())) {
            return self.forward_checked(jobs, rows_alone);
        }
        self.device
            .with_context(|| self.forward_checked(jobs, rows_alone))
    }

    /// Whether a pass over steps of these row counts runs on the calling
    /// thread, needing nothing of candle's rayon pool: steps of one row
    /// each, at most as many as candle's norm takes one by one, through
    /// matrices that split their work over the barrier pool. The head's
    /// rows count as one-row steps.
    pub fn runs_on_calling_thread(&self, rows: impl IntoIterator<Item = usize>) -> bool {
        let mut steps = 0;
        self.pool_free_rows
            && rows.into_iter().all(|rows| {
                steps += 1;
                rows == 1 && steps <= MAX_CALLING_THREAD_ROWS
            })
    }

    /// The logits of each row of `hidden` (final hidden states, as a chain's
    /// final stage returns them), through the head this slice holds apart.
    /// A row gets the bits the model's last slice gives it in `forward`.
    pub fn logits(&self, hidden: &Activations) -> Result<Vec<Vec<f32>>> {
        let head = self
            .head
            .as_ref()
            .ok_or(EngineError::WrongInput("holds no output head"))?;
        if hidden.cols != self.config.hidden
            || hidden.rows == 0
            || hidden.values.len() != hidden.rows * hidden.cols
        {
            return Err(EngineError::WrongInput(
                "was given hidden states of the wrong shape for the head",
            ));
        }
        let rows = Tensor::from_slice(&hidden.values, (hidden.rows, hidden.cols), &self.device)?;
        if self.runs_on_calling_thread(std::iter::repeat_n(1, hidden.rows)) {
            return self.apply_head(head, &rows);
        }
        self.device.with_context(|| self.apply_head(head, &rows))
    }

    /// Final norm and output matrix over `rows`, each row its own step.
    fn apply_head(&self, head: &Head, rows: &Tensor) -> Result<Vec<Vec<f32>>> {
        let normed = candle_nn::ops::rms_norm(rows, &head.norm, self.config.rms_eps as f32)?;
        let count = rows.dim(0)?;
        let one_row_each: Vec<(usize, usize)> = (0..count).map(|i| (i, 1)).collect();
        let logits = head.output.forward_rows(&normed, &one_row_each)?;
        (0..count)
            .map(|row| Ok(logits.get(row)?.to_vec1::<f32>()?))
            .collect()
    }

    fn forward_checked(
        &self,
        jobs: &mut [(SliceInput<'_>, &mut SliceCache)],
        rows_alone: &[bool],
    ) -> Result<Vec<SliceOutput>> {
        let mut inputs = Vec::with_capacity(jobs.len());
        for (input, _) in jobs.iter() {
            inputs.push(self.input_rows(input)?);
        }
        let spans: Vec<(usize, usize)> = {
            let mut offset = 0;
            inputs
                .iter()
                .map(|x| {
                    let seq = x.dim(0).unwrap_or(0);
                    let span = (offset, seq);
                    offset += seq;
                    span
                })
                .collect()
        };
        // What the matrices see as steps: a step whose rows go alone is one
        // step per row.
        let matrix_spans: Vec<(usize, usize)> = spans
            .iter()
            .enumerate()
            .flat_map(|(i, &(offset, seq))| {
                if rows_alone.get(i).copied().unwrap_or(false) {
                    (0..seq).map(|row| (offset + row, 1)).collect::<Vec<_>>()
                } else {
                    vec![(offset, seq)]
                }
            })
            .collect();
        let mut x = if inputs.len() == 1 {
            inputs
                .pop()
                .ok_or(EngineError::WrongInput("was given no input"))?
        } else {
            Tensor::cat(&inputs, 0)?
        };
        let ropes = jobs
            .iter()
            .zip(&spans)
            .map(|((_, cache), (_, seq))| {
                Ok(StepRope {
                    global: self.rope.rows(cache.position, *seq, &self.device)?,
                    local: match &self.local_rope {
                        Some(local) => Some(local.rows(cache.position, *seq, &self.device)?),
                        None => None,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let rows = BatchRows {
            spans: &spans,
            matrix_spans: &matrix_spans,
            rows_alone,
            ropes: &ropes,
        };
        for (layer, block) in self.blocks.iter().enumerate() {
            x = self.block_forward(block, &x, &rows, jobs, layer)?;
        }
        for ((_, cache), (_, seq)) in jobs.iter_mut().zip(&spans) {
            cache.position += seq;
        }
        match &self.head {
            Some(head) if self.head_use == HeadUse::InForward => {
                // Only each request's last position is sampled.
                let last: Vec<Tensor> = spans
                    .iter()
                    .map(|(offset, seq)| x.narrow(0, offset + seq - 1, 1))
                    .collect::<candle_core::Result<_>>()?;
                let last = Tensor::cat(&last, 0)?;
                Ok(self
                    .apply_head(head, &last)?
                    .into_iter()
                    .map(SliceOutput::Logits)
                    .collect())
            }
            _ => spans
                .iter()
                .map(|(offset, seq)| {
                    Ok(SliceOutput::Hidden(Activations {
                        rows: *seq,
                        cols: self.config.hidden,
                        values: x
                            .narrow(0, *offset, *seq)?
                            .flatten_all()?
                            .to_vec1::<f32>()?,
                    }))
                })
                .collect(),
        }
    }

    /// Whether one request's next step can run on this slice: the right
    /// kind of input, well formed, and room in its cache. A batch checks
    /// every step this way before any cache changes.
    pub fn check_step(&self, input: &SliceInput<'_>, cache: &SliceCache) -> Result<()> {
        let rows = self.input_len(input)?;
        if cache.position + rows > cache.capacity {
            return Err(EngineError::ContextExceeded {
                tokens: cache.position + rows,
                max_new: 0,
                context: cache.capacity,
            });
        }
        if cache.layers.len() != self.blocks.len() {
            return Err(EngineError::WrongInput(
                "was given a cache of another slice",
            ));
        }
        Ok(())
    }

    /// Check one request's input without touching it: the right kind for
    /// this slice, well formed; its number of rows.
    fn input_len(&self, input: &SliceInput<'_>) -> Result<usize> {
        match (input, &self.embedding) {
            (SliceInput::Tokens(ids), Some(_)) => {
                if ids.is_empty() {
                    return Err(EngineError::WrongInput("was given no tokens"));
                }
                if let Some(bad) = ids.iter().find(|id| **id as usize >= self.config.vocab) {
                    return Err(EngineError::Tokenizer(format!(
                        "token id {bad} is outside the vocabulary of {}",
                        self.config.vocab
                    )));
                }
                Ok(ids.len())
            }
            (SliceInput::Tokens(_), None) => Err(EngineError::WrongInput(
                "holds no embedding: send it hidden states",
            )),
            (SliceInput::Hidden(_), Some(_)) => Err(EngineError::WrongInput(
                "is the first slice: send it tokens",
            )),
            (SliceInput::Hidden(a), None) => {
                if a.cols != self.config.hidden || a.rows == 0 || a.values.len() != a.rows * a.cols
                {
                    return Err(EngineError::Frame(format!(
                        "{}×{} hidden states for a model of width {}",
                        a.rows, a.cols, self.config.hidden
                    )));
                }
                Ok(a.rows)
            }
        }
    }

    /// A tied embedding's rows for `ids`, from the output head's matrix,
    /// dequantized as candle dequantizes the embedding it would otherwise
    /// hold (the same blocks, the same arithmetic).
    fn tied_rows(&self, ids: Tensor) -> Result<Tensor> {
        let head = self
            .head
            .as_ref()
            .ok_or(EngineError::WrongInput("a tied embedding without its head"))?;
        Ok(match &head.output {
            // In f32 whatever candle holds a dense matrix in.
            Linear::Quantized(q) => q.embedding(&ids)?.to_dtype(DType::F32)?,
            Linear::Dense(l) => l.weight().index_select(&ids, 0)?,
            Linear::Blocks(matrix) => {
                let rows: Vec<usize> = ids.to_vec1::<u32>()?.iter().map(|i| *i as usize).collect();
                let blocks = matrix.rows_blocks(&rows).map_err(|e| match e {
                    KernelError::RowPastEnd { .. } => {
                        EngineError::WrongInput("a token past the vocabulary")
                    }
                    other => EngineError::Compute(other.to_string()),
                })?;
                candle_core::quantized::ggml_file::qtensor_from_ggml(
                    matrix.ggml_dtype(),
                    &blocks,
                    vec![rows.len(), matrix.cols()],
                    &Device::Cpu,
                )?
                .dequantize(&Device::Cpu)?
            }
        })
    }

    /// One request's input as rows of hidden states; `check_step` has
    /// checked it.
    fn input_rows(&self, input: &SliceInput<'_>) -> Result<Tensor> {
        Ok(match (input, &self.embedding) {
            (SliceInput::Tokens(ids), Some(embedding)) => {
                let ids = Tensor::new(*ids, &self.device)?;
                let rows = match embedding {
                    Embedding::Quantized(q) => q.embedding(&ids)?,
                    Embedding::Dense(t) => t.index_select(&ids, 0)?,
                    Embedding::Head => self.tied_rows(ids)?,
                };
                match self.config.block_style {
                    BlockStyle::Llama => rows,
                    BlockStyle::Gemma3 => (rows * (self.config.hidden as f64).sqrt())?,
                }
            }
            (SliceInput::Hidden(a), None) => {
                Tensor::from_slice(&a.values, (a.rows, a.cols), &self.device)?
            }
            _ => return Err(EngineError::WrongInput("was given the wrong kind of input")),
        })
    }

    /// One block over the stacked rows of every request in the batch
    /// (`spans`: each request's first row and row count; `matrix_spans`:
    /// the steps as the matrices see them, a decode step one per row).
    fn block_forward(
        &self,
        b: &Block,
        x: &Tensor,
        rows: &BatchRows<'_>,
        jobs: &mut [(SliceInput<'_>, &mut SliceCache)],
        layer: usize,
    ) -> Result<Tensor> {
        let (spans, matrix_spans) = (rows.spans, rows.matrix_spans);
        let c = &self.config;
        let eps = c.rms_eps as f32;
        let h = candle_nn::ops::rms_norm(x, &b.attn_norm, eps)?;
        let with_bias = |t: Tensor, bias: &Option<Tensor>| -> Result<Tensor> {
            Ok(match bias {
                Some(bias) => t.broadcast_add(bias)?,
                None => t,
            })
        };
        let [q, k, v]: [Tensor; 3] = b
            .qkv
            .forward(&h, matrix_spans)?
            .try_into()
            .map_err(|_| EngineError::WrongInput("has a malformed attention projection"))?;
        let q = with_bias(q, &b.q_bias)?;
        let k = with_bias(k, &b.k_bias)?;
        let v = with_bias(v, &b.v_bias)?;
        let mut attended = Vec::with_capacity(spans.len());
        for (step, ((offset, seq), (_, cache))) in spans.iter().zip(jobs.iter_mut()).enumerate() {
            let position = cache.position;
            let kv = cache.layers.get_mut(layer).ok_or(EngineError::WrongInput(
                "was given a cache of another slice",
            ))?;
            attended.push(
                self.attend(
                    b,
                    &q.narrow(0, *offset, *seq)?,
                    &k.narrow(0, *offset, *seq)?,
                    &v.narrow(0, *offset, *seq)?,
                    kv,
                    position,
                    rows.ropes
                        .get(step)
                        .ok_or(EngineError::WrongInput("has no rotation for a step"))?,
                    rows.rows_alone.get(step).copied().unwrap_or(false),
                )?,
            );
        }
        let attended = if attended.len() == 1 {
            attended
                .pop()
                .ok_or(EngineError::WrongInput("attended to nothing"))?
        } else {
            Tensor::cat(&attended, 0)?
        };
        let post_norm = |t: Tensor, norm: &Option<Tensor>| -> Result<Tensor> {
            Ok(match norm {
                Some(norm) => candle_nn::ops::rms_norm(&t, norm, eps)?,
                None => t,
            })
        };
        let attention_out = post_norm(
            b.o.forward_rows(&attended, matrix_spans)?,
            &b.post_attention_norm,
        )?;
        let x = (x + attention_out)?;
        let h = candle_nn::ops::rms_norm(&x, &b.ffn_norm, eps)?;
        let [gate, up]: [Tensor; 2] = b
            .gate_up
            .forward(&h, matrix_spans)?
            .try_into()
            .map_err(|_| EngineError::WrongInput("has a malformed feed-forward projection"))?;
        let gated = match c.block_style {
            BlockStyle::Llama => (candle_nn::ops::silu(&gate)? * up)?,
            // On a GPU the table would cost two copies to the host per
            // layer: candle's kernel computes the same tanh approximation
            // there, in f32.
            BlockStyle::Gemma3 if self.candle_only => (gate.gelu()? * up)?,
            BlockStyle::Gemma3 => gelu_gated(&gate, &up)?,
        };
        let ffn_out = post_norm(b.down.forward_rows(&gated, matrix_spans)?, &b.post_ffn_norm)?;
        Ok((x + ffn_out)?)
    }
    /// One request's attention over its own cache: `q`, `k`, `v` are its
    /// rows of the projections, at positions `position..`; with
    /// `rows_alone` each row attends as the one-row decode step it would be
    /// (the engine's own attention always does).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        b: &Block,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        kv: &mut KvRows,
        position: usize,
        rope: &StepRope,
        rows_alone: bool,
    ) -> Result<Tensor> {
        let c = &self.config;
        let eps = c.rms_eps as f32;
        let seq = q.dim(0)?;
        let heads = |t: &Tensor, n: usize, norm: &Option<Tensor>| -> Result<Tensor> {
            let t = t.reshape((1, seq, n, c.head_dim))?;
            let t = match norm {
                Some(norm) => candle_nn::ops::rms_norm(&t.contiguous()?, norm, eps)?,
                None => t,
            };
            Ok(t.transpose(1, 2)?.contiguous()?)
        };
        let q = heads(q, c.heads, &b.q_norm)?;
        let k = heads(k, c.kv_heads, &b.k_norm)?;
        let v = heads(v, c.kv_heads, &None)?;
        let rope = match (&rope.local, b.local) {
            (Some(local), true) => local,
            _ => &rope.global,
        };
        let q = rope.apply(&q, c.rope_layout)?;
        let k = rope.apply(&k, c.rope_layout)?;
        let (k_all, v_all) = kv.append(&k, &v)?;
        // Against an f16 cache the queries are rounded to f16 too, as
        // llama.cpp rounds them for its f16 dot products.
        let q = if kv.stored == Some(DType::F16) {
            q.to_dtype(DType::F16)?.to_dtype(DType::F32)?
        } else {
            q
        };
        // A local layer's query sees the last `window` positions only.
        let window = match c.sliding_window {
            Some(w) if b.local => w.window,
            _ => usize::MAX,
        };
        let span = attention::Span { position, window };
        if !self.candle_only
            && let Some(attended) =
                attention::attend(&q, &k_all, &v_all, c.query_scale as f32, span)?
        {
            return Ok(attended);
        }
        if rows_alone && seq > 1 {
            // Row i sees the keys up to its own position, as when decoded.
            let rows = (0..seq)
                .map(|i| {
                    let known = position + i + 1;
                    self.candle_attention(
                        &q.narrow(2, i, 1)?,
                        &k_all.narrow(2, 0, known)?,
                        &v_all.narrow(2, 0, known)?,
                        position + i,
                        window,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(Tensor::cat(&rows, 0)?);
        }
        self.candle_attention(&q, &k_all, &v_all, position, window)
    }

    /// candle's route (the one a GPU takes): `q` `(1, heads, seq,
    /// head_dim)` at positions `position..` over every key held, through a
    /// matmul for the scores, a mask for a prompt, softmax and a matmul for
    /// the values; `(seq, attention_width)` out.
    fn candle_attention(
        &self,
        q: &Tensor,
        k_all: &Tensor,
        v_all: &Tensor,
        position: usize,
        window: usize,
    ) -> Result<Tensor> {
        let c = &self.config;
        let seq = q.dim(2)?;
        let (k_all, v_all, first_key) = {
            let total = k_all.dim(2)?;
            let first_key = (position + 1).saturating_sub(window).min(total);
            if seq == 1 && first_key > 0 {
                (
                    k_all.narrow(2, first_key, total - first_key)?,
                    v_all.narrow(2, first_key, total - first_key)?,
                    first_key,
                )
            } else {
                (k_all.clone(), v_all.clone(), 0)
            }
        };
        // A cache held in another type than the step (never on this route's
        // own caches) is widened first.
        let (k_all, v_all) = (k_all.to_dtype(q.dtype())?, v_all.to_dtype(q.dtype())?);
        let total = k_all.dim(2)?;
        // Grouped-query attention without copying K/V: the query heads that
        // share a KV head are stacked along the sequence axis.
        let group = c.heads / c.kv_heads;
        let q = q.reshape((1, c.kv_heads, group * seq, c.head_dim))?;
        let scores = (q.matmul(&k_all.t()?)? * c.query_scale)?;
        let scores = if seq > 1 {
            // Built where the scores are from each row's and each key's
            // position: a GPU is sent rows + 2 x keys positions per layer,
            // not the whole (rows x keys) mask.
            let device = q.device();
            let position_of = |p: usize| u32::try_from(p).unwrap_or(u32::MAX);
            let queries: Vec<u32> = (0..group * seq)
                .map(|row| position_of(position + row % seq))
                .collect();
            let keys: Vec<u32> = (first_key..first_key + total).map(position_of).collect();
            // A key is seen while `query - key < window`: `key + window > query`.
            let key_ends: Vec<u32> = (first_key..first_key + total)
                .map(|key| position_of(key.saturating_add(window)))
                .collect();
            let queries = Tensor::from_vec(queries, (group * seq, 1), device)?;
            let keys = Tensor::from_vec(keys, (1, total), device)?;
            let key_ends = Tensor::from_vec(key_ends, (1, total), device)?;
            let seen = (keys.broadcast_le(&queries)? * key_ends.broadcast_gt(&queries)?)?;
            let shape = (group * seq, total);
            let mask = seen.where_cond(
                &Tensor::zeros(shape, DType::F32, device)?,
                &Tensor::full(f32::NEG_INFINITY, shape, device)?,
            )?;
            scores.broadcast_add(&mask)?
        } else {
            scores
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let attended = probs.matmul(&v_all.contiguous()?)?;
        let attended = attended
            .reshape((1, c.heads, seq, c.head_dim))?
            .transpose(1, 2)?
            .reshape((seq, c.attention_width()))?;
        Ok(attended)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's rotations are the bits of the whole-context table the
    /// engine held before (positions as f32 times the frequencies through
    /// candle's matmul, then candle's cos and sin), at every position.
    #[test]
    fn step_rotations_are_the_tables_bits() {
        for (head_dim, theta, scale) in [
            (64, 100_000.0, 1.0),
            (256, 1_000_000.0, 1.0),
            (256, 10_000.0, 1.0),
            (128, 500_000.0, 8.0),
        ] {
            let rope = Rope::new(head_dim, MAX_ENGINE_CONTEXT, theta, scale);
            let half = head_dim / 2;
            let inv_freq =
                Tensor::from_vec(rope.inv_freq.clone(), (1, half), &Device::Cpu).unwrap();
            let t = Tensor::arange(0u32, MAX_ENGINE_CONTEXT as u32, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .reshape((MAX_ENGINE_CONTEXT, 1))
                .unwrap();
            let freqs = t.matmul(&inv_freq).unwrap();
            let bits = crate::tensor_bits;
            let (cos, sin) = (freqs.cos().unwrap(), freqs.sin().unwrap());
            let whole = rope.rows(0, MAX_ENGINE_CONTEXT, &Device::Cpu).unwrap();
            assert_eq!(bits(&whole.cos), bits(&cos), "{head_dim} {theta}");
            assert_eq!(bits(&whole.sin), bits(&sin), "{head_dim} {theta}");
            let step = rope.rows(4000, 3, &Device::Cpu).unwrap();
            assert_eq!(bits(&step.cos), bits(&cos.narrow(0, 4000, 3).unwrap()));
            assert!(matches!(
                rope.rows(MAX_ENGINE_CONTEXT - 1, 2, &Device::Cpu),
                Err(EngineError::ContextExceeded { .. })
            ));
        }
    }
}
