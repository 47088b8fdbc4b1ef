//! Block formats candle runs only on a scalar path, or with one
//! accumulator chain, run in the file's own blocks on the engine's own
//! kernels (rearranged at load, never widened):
//!
//! - Q4_0: 18-byte blocks of 32 weights (an f16 scale `d`, 16 bytes of
//!   4-bit quants); the weight is `d * (q - 8)`.
//! - Q4_1: 20-byte blocks of 32 weights (an f16 scale `d`, an f16 minimum
//!   `m`, 16 bytes of 4-bit quants); the weight is `d * q + m`.
//! - Q5_0: 22-byte blocks (an f16 scale `d`, 32 high bits, 16 bytes of low
//!   nibbles); the weight is `d * (q - 16)` with 5-bit `q`.
//! - Q8_0: 34-byte blocks (an f16 scale `d`, 32 signed bytes). It holds
//!   the embedding and output head of SmolLM2 and Gemma 3 (45 % of Gemma
//!   3's decode).
//! - Q4_K: 144-byte superblocks of 256 weights (f16 `d` and `dmin`, eight
//!   6-bit scales and minimums packed in 12 bytes, 128 bytes of 4-bit
//!   quants); the weight is `d * sc * q - dmin * m`, `sc` and `m` those of
//!   its 32-weight sub-block.
//! - Q5_K: 176-byte superblocks of 256 weights, Q4_K's with 32 bytes of
//!   fifth bits; the weight is `d * sc * q - dmin * m` with 5-bit `q`.
//! - Q6_K: 210-byte superblocks of 256 weights (128 bytes of low nibbles,
//!   64 of high bit pairs, sixteen signed 8-bit scales, an f16 `d`); the
//!   weight is `d * sc * (q - 32)`, `sc` that of its 16 weights.
//!
//! candle repacks Q4_K and Q6_K into tiles of its own on first use and
//! keeps the stored blocks too, so a Q4_K_M stage held its K-quants 2.3-2.5
//! times (Gemma 3's middle third at 1.88x its weights once run); its Q5_K
//! product is one row's dot products, 2-3x slower than the grouped one.
//!
//! candle's dot products for Q4_1 and Q5_0 are scalar, 5x slower than its
//! Q8_0 one, which is why the engine used to requantize Q4_1 to Q8_0: 1.7x
//! the bytes per token and a different model from the file's, so greedy
//! text departed from llama.cpp's. Gemma 3's Q4_K_M files hold their
//! attention and gate/up projections in Q5_0.
//!
//! Every activation row is quantized to 8-bit blocks as llama.cpp's
//! `quantize_row_q8_1` does (an f16 scale, the f16 of scale times the
//! quants' sum, 32 signed bytes, rounded half to even), and for the
//! K-quants as its `quantize_row_q8_K` does (one f32 scale per 256
//! values, as llama.cpp's K-quant dot products take them). The weights are
//! held as groups of sixteen rows (module `grouped`: the file's bytes
//! rearranged once at load), so that one instruction multiplies four
//! quants of each of sixteen rows (eight without AVX-512) by four
//! activation quants. Each output
//! sums `(d_w * d_a) * isum` block by block (plus `m_w * s_a` for Q4_1,
//! minus `(dmin * m) * (d_a * sum_a)` for Q4_K and Q5_K; Q6_K's two halves
//! of 16 each with its scale), `isum` the block's exact integer product,
//! so its bits depend on its
//! weight and input rows alone: a batch of requests gets the bits each
//! gets alone, and a split the bits of the whole model.
//!
//! The SIMD loops are three `#[target_feature]` functions (AVX-512 VNNI,
//! AVX-VNNI, and AVX2 with FMA and F16C), entered through `unsafe` blocks
//! once their features are detected (`grouped::simd`,
//! which also holds the prefetch hint, baseline SSE, and the AVX-512 loop's
//! 64-byte loads). A CPU without them takes the scalar path, which gives
//! the same bits.
//!
//! A product's rows are cut into pieces that the calling thread and the
//! engine's compute workers take from one cursor (`pool`, the engine's
//! other `unsafe`: the workers read the caller's closure in place).
//! `widen` widens the KV cache's f16 rows with F16C (its one `unsafe`
//! block, once the CPU is seen to have it). `pages` calls glibc's
//! `malloc_trim` and `mallopt` (one `unsafe` block each).

use std::sync::Mutex;

use half::f16;

mod grouped;
mod pages;
// Its only `unsafe`: the F16C conversion, once the CPU is seen to have it.
#[allow(unsafe_code)]
mod widen;
// The pool's only `unsafe`: a product's closure, borrowed from the
// caller's stack, read by the workers while the caller waits for them.
#[allow(unsafe_code)]
pub mod pool;

pub use pages::{WeightPages, return_freed_memory, share_one_heap_arena};
pub use widen::widen_f16;

/// Weights per block of activations, and of the 32-weight formats.
pub const BLOCK_ELEMS: usize = 32;
/// Weight rows per group: a matrix of fewer rows would be held padded to
/// this many.
pub const GROUP_ROWS: usize = grouped::GROUP;
/// Weight rows per unit of work handed to a thread: small enough that two
/// threads share a 576-row matrix evenly, large enough that a unit is not
/// all dispatch.
const PIECE_ROWS: usize = 16;

/// The stored block formats these kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl BlockFormat {
    /// The matching candle type, for quantizing and dequantizing blocks as
    /// candle does.
    pub const fn ggml_dtype(self) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType;
        match self {
            BlockFormat::Q4_0 => GgmlDType::Q4_0,
            BlockFormat::Q4_1 => GgmlDType::Q4_1,
            BlockFormat::Q5_0 => GgmlDType::Q5_0,
            BlockFormat::Q8_0 => GgmlDType::Q8_0,
            BlockFormat::Q4K => GgmlDType::Q4K,
            BlockFormat::Q5K => GgmlDType::Q5K,
            BlockFormat::Q6K => GgmlDType::Q6K,
        }
    }

    /// Bytes of one stored block.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q5_0 => 22,
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4K => 144,
            BlockFormat::Q5K => 176,
            BlockFormat::Q6K => 210,
        }
    }

    /// Weights of one stored block.
    pub const fn block_elems(self) -> usize {
        match self {
            BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K => 256,
            _ => BLOCK_ELEMS,
        }
    }
}

/// Why a matrix could not be built from stored bytes, or run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("a {format:?} row of {cols} weights is not a whole number of its blocks")]
    RaggedRow { format: BlockFormat, cols: usize },
    #[error("a {rows}x{cols} {format:?} matrix holds {expected} bytes, not {actual}")]
    WrongSize {
        format: BlockFormat,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    #[error("an input of {len} values is not rows of {cols}")]
    WrongInput { len: usize, cols: usize },
    #[error("row {row} asked of a matrix of {rows} rows")]
    RowPastEnd { row: usize, rows: usize },
    #[error("the matrix's weight pages were never sealed (its slice did not finish loading)")]
    Unsealed,
}

/// A `rows x cols` weight matrix (`rows` outputs, each the dot product of
/// one stored row with an input row of `cols` values).
#[derive(Debug)]
pub struct BlockMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    blocks: Storage,
}

/// Where a matrix's grouped blocks are held.
#[derive(Debug)]
enum Storage {
    Heap(Vec<u8>),
    /// In its slice's weight pages (huge pages where the kernel gives them).
    Pages(pages::Placed),
}

/// One activation block, quantized as llama.cpp's `quantize_row_q8_1` does
/// (its `quantize_row_q8_0` gives the same `d` and quants, without `s`):
/// `d` and `s` are held as the f32 values of their f16 roundings. For the
/// K-quants, as its `quantize_row_q8_K` does (`quantize_activations_k`):
/// `d` an f32 shared by a superblock's eight blocks.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct ActivationBlock {
    d: f32,
    s: f32,
    qs: [i8; BLOCK_ELEMS],
    /// The quants' sum.
    sum: i32,
    /// The sum of the first 16 quants (Q6_K's scales change every 16).
    half_sum: i32,
}

impl BlockMatrix {
    /// Take a matrix's stored blocks, row after row, as the file holds them.
    pub fn new(
        format: BlockFormat,
        rows: usize,
        cols: usize,
        blocks: Vec<u8>,
    ) -> Result<Self, KernelError> {
        Self::new_in(format, rows, cols, &blocks, &mut WeightPages::none())
    }

    /// `new`, grouped straight into `pages` where they have room (on the
    /// heap where not). The matrix runs once `pages` are sealed.
    pub fn new_in(
        format: BlockFormat,
        rows: usize,
        cols: usize,
        stored: &[u8],
        pages: &mut WeightPages,
    ) -> Result<Self, KernelError> {
        let len = grouped_len(format, rows, cols, stored.len())?;
        let blocks = match pages.take(len) {
            Some((placed, bytes)) => {
                group_rows(format, stored, rows, cols, bytes);
                Storage::Pages(placed)
            }
            None => {
                let mut grouped = vec![0u8; len];
                group_rows(format, stored, rows, cols, &mut grouped);
                Storage::Heap(grouped)
            }
        };
        Ok(Self {
            format,
            rows,
            cols,
            blocks,
        })
    }

    /// The grouped blocks; `None` while in unsealed pages.
    fn blocks(&self) -> Option<&[u8]> {
        match &self.blocks {
            Storage::Heap(bytes) => Some(bytes),
            Storage::Pages(placed) => placed.bytes(),
        }
    }

    /// The bytes a `rows x cols` matrix in `format` takes grouped: what it
    /// needs of weight pages (`WeightPages::room_for`).
    pub fn grouped_bytes(format: BlockFormat, rows: usize, cols: usize) -> usize {
        // The shape may come from an untrusted file's index.
        let row_blocks = cols / format.block_elems();
        rows.div_ceil(grouped::GROUP)
            .saturating_mul(row_blocks)
            .saturating_mul(grouped::group_block_bytes(format))
    }

    /// Whether the blocks are held in weight pages rather than the heap.
    pub fn in_pages(&self) -> bool {
        matches!(self.blocks, Storage::Pages(_))
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the matrix holds: the file's (Q4_K's and Q5_K's a little more,
    /// their sub-block scales unpacked), and up to fifteen rows of zero
    /// blocks filling the last group.
    pub fn storage_bytes(&self) -> usize {
        match &self.blocks {
            Storage::Heap(bytes) => bytes.len(),
            Storage::Pages(placed) => placed.len(),
        }
    }

    /// The stored blocks of rows `rows`, in order: what a tied embedding
    /// reads a token's row from.
    pub fn rows_blocks(&self, rows: &[usize]) -> Result<Vec<u8>, KernelError> {
        let blocks = self.blocks().ok_or(KernelError::Unsealed)?;
        let row_blocks = self.cols / self.format.block_elems();
        let mut out = Vec::with_capacity(rows.len() * row_blocks * self.format.block_bytes());
        let stored_row = match self.format {
            BlockFormat::Q4_0 => grouped::stored_row::<grouped::Q4_0>,
            BlockFormat::Q4_1 => grouped::stored_row::<grouped::Q4_1>,
            BlockFormat::Q5_0 => grouped::stored_row::<grouped::Q5_0>,
            BlockFormat::Q8_0 => grouped::stored_row::<grouped::Q8_0>,
            BlockFormat::Q4K => grouped::stored_row::<grouped::Q4K>,
            BlockFormat::Q5K => grouped::stored_row::<grouped::Q5K>,
            BlockFormat::Q6K => grouped::stored_row::<grouped::Q6K>,
        };
        for &row in rows {
            if row >= self.rows {
                return Err(KernelError::RowPastEnd {
                    row,
                    rows: self.rows,
                });
            }
            stored_row(blocks, row, row_blocks, &mut out);
        }
        Ok(out)
    }

    /// The matching candle type, for dequantizing blocks as candle does.
    pub fn ggml_dtype(&self) -> candle_core::quantized::GgmlDType {
        self.format.ggml_dtype()
    }

    /// `input` is `m` rows of `cols` values, all of one step; the result
    /// is `m` rows of `rows` values, computed on candle's thread pool.
    pub fn matmul(&self, input: &[f32]) -> Result<Vec<f32>, KernelError> {
        let m = input.len().checked_div(self.cols).unwrap_or(0);
        self.matmul_steps(input, &[m])
    }

    /// The rows of several requests' steps at once: `steps` are the row
    /// counts of consecutive steps (a decode step is one row, a prompt's
    /// prefill many). A row's bits depend only on its weights and its
    /// input, never on its step or the other steps it is batched with.
    pub fn matmul_steps(&self, input: &[f32], steps: &[usize]) -> Result<Vec<f32>, KernelError> {
        if self.cols == 0
            || !input.len().is_multiple_of(self.cols)
            || steps.iter().sum::<usize>() != input.len() / self.cols
        {
            return Err(KernelError::WrongInput {
                len: input.len(),
                cols: self.cols,
            });
        }
        let blocks = self.blocks().ok_or(KernelError::Unsealed)?;
        Ok(match self.format {
            BlockFormat::Q4_0 => self.matmul_grouped::<grouped::Q4_0>(blocks, input),
            BlockFormat::Q4_1 => self.matmul_grouped::<grouped::Q4_1>(blocks, input),
            BlockFormat::Q5_0 => self.matmul_grouped::<grouped::Q5_0>(blocks, input),
            BlockFormat::Q8_0 => self.matmul_grouped::<grouped::Q8_0>(blocks, input),
            BlockFormat::Q4K => self.matmul_grouped::<grouped::Q4K>(blocks, input),
            BlockFormat::Q5K => self.matmul_grouped::<grouped::Q5K>(blocks, input),
            BlockFormat::Q6K => self.matmul_grouped::<grouped::Q6K>(blocks, input),
        })
    }

    /// A product on row groups. Each output's bits depend only on its
    /// weight row and activation row, so the steps need no plan.
    fn matmul_grouped<F: grouped::Grouped>(&self, blocks: &[u8], input: &[f32]) -> Vec<f32> {
        let m = input.len() / self.cols;
        if m == 0 || self.rows == 0 {
            return Vec::new();
        }
        let row_blocks = self.cols / BLOCK_ELEMS;
        let mut activations = Vec::with_capacity(m * row_blocks);
        for row in input.chunks_exact(self.cols) {
            if F::SUB_BLOCKS > 1 {
                quantize_activations_k(row, &mut activations);
            } else {
                quantize_activations(row, &mut activations);
            }
        }
        let group_bytes = self.cols / F::FORMAT.block_elems() * F::GROUP_BLOCK_BYTES;
        let groups = self.rows.div_ceil(grouped::GROUP);
        // Outputs group major (`[group][input row][lane]`), so that each
        // piece of work owns one contiguous run of them, then laid out.
        const PIECE_GROUPS: usize = PIECE_ROWS / grouped::GROUP;
        let mut by_group = vec![0f32; groups * m * grouped::GROUP];
        {
            let pieces: Vec<Mutex<(usize, &mut [f32])>> = by_group
                .chunks_mut(PIECE_GROUPS * m * grouped::GROUP)
                .enumerate()
                .map(|(index, out)| Mutex::new((index * PIECE_GROUPS, out)))
                .collect();
            let activation_row = |row: usize| &activations[row * row_blocks..][..row_blocks];
            let run = |range: std::ops::Range<usize>| {
                for piece in &pieces[range] {
                    let mut guard = match piece.lock() {
                        Ok(guard) => guard,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    let (first_group, out) = &mut *guard;
                    for (index, out) in out.chunks_exact_mut(m * grouped::GROUP).enumerate() {
                        let group = &blocks[(*first_group + index) * group_bytes..][..group_bytes];
                        // Up to four input rows at a time share each
                        // weight block's unpacking (a batch of two or
                        // three decode steps unpacks once, not per step).
                        let mut first = 0;
                        while first < m {
                            let take = (m - first).min(4);
                            let out = &mut out[first * grouped::GROUP..][..take * grouped::GROUP];
                            let rows = |i: usize| activation_row(first + i);
                            // The group's first pass asks for what follows it.
                            let ahead = first == 0;
                            match take {
                                4 => {
                                    dots_into::<F, 4>(group, std::array::from_fn(rows), ahead, out)
                                }
                                3 => {
                                    dots_into::<F, 3>(group, std::array::from_fn(rows), ahead, out)
                                }
                                2 => {
                                    dots_into::<F, 2>(group, std::array::from_fn(rows), ahead, out)
                                }
                                _ => dots_into::<F, 1>(group, [rows(0)], ahead, out),
                            }
                            first += take;
                        }
                    }
                }
            };
            pool::pool().for_each_piece(pieces.len(), run);
        }
        let mut out = vec![0f32; self.rows * m];
        for (row, out_row) in out.chunks_exact_mut(self.rows).enumerate() {
            for (group, values) in out_row.chunks_mut(grouped::GROUP).enumerate() {
                let start = (group * m + row) * grouped::GROUP;
                values.copy_from_slice(&by_group[start..start + values.len()]);
            }
        }
        out
    }
}

/// The bytes a `rows x cols` matrix's blocks take grouped (every format
/// runs as groups of sixteen rows, `grouped`: the stored bytes rearranged,
/// Q4_K's and Q5_K's sub-block scales unpacked, the last group filled with
/// zero rows), once `stored_len` is checked to be the matrix's stored
/// size.
fn grouped_len(
    format: BlockFormat,
    rows: usize,
    cols: usize,
    stored_len: usize,
) -> Result<usize, KernelError> {
    if !cols.is_multiple_of(format.block_elems()) {
        return Err(KernelError::RaggedRow { format, cols });
    }
    let row_blocks = cols / format.block_elems();
    let expected = row_blocks
        .checked_mul(format.block_bytes())
        .and_then(|row_bytes| rows.checked_mul(row_bytes));
    let grouped = rows
        .div_ceil(grouped::GROUP)
        .checked_mul(row_blocks)
        .and_then(|blocks| blocks.checked_mul(grouped::group_block_bytes(format)));
    match (expected, grouped) {
        (Some(expected), Some(grouped)) if expected == stored_len => Ok(grouped),
        _ => Err(KernelError::WrongSize {
            format,
            rows,
            cols,
            expected: expected.unwrap_or(usize::MAX),
            actual: stored_len,
        }),
    }
}

/// Group checked stored blocks into `out` (zeroed, `grouped_len` bytes).
fn group_rows(format: BlockFormat, stored: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    let row_blocks = cols / format.block_elems();
    match format {
        BlockFormat::Q4_0 => grouped::group_rows::<grouped::Q4_0>(stored, rows, row_blocks, out),
        BlockFormat::Q4_1 => grouped::group_rows::<grouped::Q4_1>(stored, rows, row_blocks, out),
        BlockFormat::Q5_0 => grouped::group_rows::<grouped::Q5_0>(stored, rows, row_blocks, out),
        BlockFormat::Q8_0 => grouped::group_rows::<grouped::Q8_0>(stored, rows, row_blocks, out),
        BlockFormat::Q4K => grouped::group_rows::<grouped::Q4K>(stored, rows, row_blocks, out),
        BlockFormat::Q5K => grouped::group_rows::<grouped::Q5K>(stored, rows, row_blocks, out),
        BlockFormat::Q6K => grouped::group_rows::<grouped::Q6K>(stored, rows, row_blocks, out),
    }
}

/// One group against `N` input rows, into `out` (`[row][lane]`).
fn dots_into<F: grouped::Grouped, const N: usize>(
    group: &[u8],
    rows: [&[ActivationBlock]; N],
    prefetch: bool,
    out: &mut [f32],
) {
    out.copy_from_slice(grouped::group_dots::<F, N>(group, rows, prefetch).as_flattened());
}

/// One matrix product timed on this engine's kernel and on candle's, side
/// by side, for `mesh-node bench kernels`: the same stored blocks (random
/// weights quantized by candle), `steps` of rows, `rounds` alternating
/// calls each after one warm-up. Returns seconds per call (ours, candle's).
pub fn time_against_candle(
    format: BlockFormat,
    (rows, cols): (usize, usize),
    steps: &[usize],
    rounds: usize,
) -> crate::error::Result<(f64, f64)> {
    use candle_core::quantized::{QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    let dtype = format.ggml_dtype();
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / 16_777_216.0 - 0.5)
        .collect();
    let weights = QTensor::quantize(
        &Tensor::from_vec(values, (rows, cols), &Device::Cpu)?,
        dtype,
    )?;
    let ours = BlockMatrix::new(format, rows, cols, weights.data()?.into_owned())
        .map_err(|e| crate::error::EngineError::Compute(e.to_string()))?;
    let theirs = QMatMul::from_qtensor(weights)?;
    let m: usize = steps.iter().sum();
    let input: Vec<f32> = (0..m * cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let tensor = Tensor::from_vec(input.clone(), (m, cols), &Device::Cpu)?;
    let run_ours = || {
        ours.matmul_steps(&input, steps)
            .map(|_| ())
            .map_err(|e| crate::error::EngineError::Compute(e.to_string()))
    };
    let run_theirs = || -> crate::error::Result<()> {
        theirs.forward(&tensor)?;
        Ok(())
    };
    run_ours()?;
    run_theirs()?;
    let (mut ours_s, mut theirs_s) = (0f64, 0f64);
    for _ in 0..rounds {
        let start = std::time::Instant::now();
        run_ours()?;
        ours_s += start.elapsed().as_secs_f64();
        let start = std::time::Instant::now();
        run_theirs()?;
        theirs_s += start.elapsed().as_secs_f64();
    }
    let rounds = rounds.max(1) as f64;
    Ok((ours_s / rounds, theirs_s / rounds))
}

/// Append one row's activation blocks (`row.len()` a multiple of 32).
fn quantize_activations(row: &[f32], out: &mut Vec<ActivationBlock>) {
    for values in row.chunks_exact(BLOCK_ELEMS) {
        let max = values.iter().fold(0f32, |max, v| max.max(v.abs()));
        let d = max / 127.0;
        // Below about 3.7e-37 the inverse overflows; such a block's scale
        // is 0 in f16 anyway, so it contributes 0, as in llama.cpp.
        let inverse = match 127.0 / max {
            inverse if max != 0.0 && inverse.is_finite() => inverse,
            _ => 0.0,
        };
        let mut qs = [0i8; BLOCK_ELEMS];
        for (q, v) in qs.iter_mut().zip(values) {
            // |v| <= max, so |v * 127 / max| rounds to at most 127 and
            // the cast never saturates.
            *q = (v * inverse).round_ties_even() as i8;
        }
        let (sum, half_sum) = quant_sums(&qs);
        out.push(ActivationBlock {
            d: f16::from_f32(d).to_f32(),
            s: f16::from_f32(d * sum as f32).to_f32(),
            qs,
            sum,
            half_sum,
        });
    }
}

/// A block's quant sum, and that of its first 16 quants.
fn quant_sums(qs: &[i8; BLOCK_ELEMS]) -> (i32, i32) {
    let sum = |qs: &[i8]| qs.iter().map(|q| i32::from(*q)).sum::<i32>();
    (sum(qs), sum(&qs[..BLOCK_ELEMS / 2]))
}

// The SIMD loops read the quants as four-byte words in place.
const _: () = assert!(std::mem::offset_of!(ActivationBlock, qs) % 4 == 0);

/// Append one row's activation blocks (`row.len()` a multiple of 256) as
/// llama.cpp quantizes them for the K-quants' dot products
/// (`quantize_row_q8_K`): one f32 scale for each 256 values, the value of
/// largest magnitude over -127 (so it may be negative), shared by their
/// eight blocks, and quants rounded half to even. A run whose inverse
/// scale is not finite (all zeros, or its largest magnitude below about
/// 3.7e-37) adds 0; one holding an infinity gives NaN, as the other
/// formats' quantization does.
fn quantize_activations_k(row: &[f32], out: &mut Vec<ActivationBlock>) {
    const SUPER: usize = 256;
    for values in row.chunks_exact(SUPER) {
        let max = values
            .iter()
            .fold(0f32, |max, v| if v.abs() > max.abs() { *v } else { max });
        let inverse = match -127.0 / max {
            inverse if max != 0.0 && inverse.is_finite() => inverse,
            _ => 0.0,
        };
        let d = if max.is_infinite() {
            f32::NAN
        } else if inverse == 0.0 {
            0.0
        } else {
            1.0 / inverse
        };
        for values in values.chunks_exact(BLOCK_ELEMS) {
            let mut qs = [0i8; BLOCK_ELEMS];
            for (q, v) in qs.iter_mut().zip(values) {
                // |v| <= |max|, so |v * inverse| rounds to at most 127.
                *q = (v * inverse).round_ties_even().clamp(-127.0, 127.0) as i8;
            }
            let (sum, half_sum) = quant_sums(&qs);
            out.push(ActivationBlock {
                d,
                s: d * sum as f32,
                qs,
                sum,
                half_sum,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    use proptest::prelude::*;

    const FORMATS: [BlockFormat; 7] = [
        BlockFormat::Q4_0,
        BlockFormat::Q4_1,
        BlockFormat::Q5_0,
        BlockFormat::Q8_0,
        BlockFormat::Q4K,
        BlockFormat::Q5K,
        BlockFormat::Q6K,
    ];

    /// A row width of three blocks of `format`.
    fn three_blocks(format: BlockFormat) -> usize {
        3 * format.block_elems()
    }

    /// `rows x cols` seeded weights, quantized to `format` by candle.
    pub(super) fn quantized(format: BlockFormat, rows: usize, cols: usize, seed: u64) -> QTensor {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect();
        let dense = Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&dense, format.ggml_dtype()).unwrap()
    }

    fn stored(format: BlockFormat, rows: usize, cols: usize, seed: u64) -> (QTensor, BlockMatrix) {
        let q = quantized(format, rows, cols, seed);
        let bytes = q.data().unwrap().to_vec();
        (q, BlockMatrix::new(format, rows, cols, bytes).unwrap())
    }

    /// Against candle's reference dequantization and an f64 product: the
    /// only error is the activations' 8-bit quantization.
    #[test]
    fn agrees_with_dequantized_weights() {
        for format in FORMATS {
            // A last group of five rows; five input rows, four of them
            // through the four-row path.
            let (rows, cols, m) = (37, three_blocks(format), 5);
            let (q, matrix) = stored(format, rows, cols, 7);
            let dense = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let input: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                .collect();
            let out = matrix.matmul(&input).unwrap();
            for row in 0..m {
                let x = &input[row * cols..][..cols];
                let scale = x.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                for (col, w) in dense.iter().enumerate() {
                    let exact: f64 = w
                        .iter()
                        .zip(x)
                        .map(|(w, x)| f64::from(*w) * f64::from(*x))
                        .sum();
                    let bound: f64 =
                        w.iter().map(|w| f64::from(w.abs())).sum::<f64>() * f64::from(scale) * 0.51
                            + 1e-3;
                    let got = f64::from(out[row * rows + col]);
                    assert!(
                        (got - exact).abs() <= bound,
                        "{format:?} row {row} col {col}: {got} vs {exact}"
                    );
                }
            }
        }
    }

    /// A matrix grouped into weight pages gives the bits of the same
    /// matrix on the heap, and runs only once its pages are sealed; two
    /// matrices share one set of pages, and one that does not fit goes on
    /// the heap.
    #[test]
    fn paged_matrices_give_the_heap_bits_once_sealed() {
        for format in FORMATS {
            let (rows, cols) = (37, three_blocks(format));
            let (q, heap) = stored(format, rows, cols, 11);
            let (q2, heap2) = stored(format, rows, cols, 12);
            let room = WeightPages::room_for(BlockMatrix::grouped_bytes(format, rows, cols));
            let mut pages = WeightPages::reserve(2 * room);
            let paged =
                BlockMatrix::new_in(format, rows, cols, &q.data().unwrap(), &mut pages).unwrap();
            let paged2 =
                BlockMatrix::new_in(format, rows, cols, &q2.data().unwrap(), &mut pages).unwrap();
            assert!(paged.in_pages() && paged2.in_pages(), "{format:?}");
            assert_eq!(paged.storage_bytes(), heap.storage_bytes());
            let input: Vec<f32> = (0..3 * cols).map(|i| (i % 13) as f32 - 6.0).collect();
            assert_eq!(paged.matmul(&input), Err(KernelError::Unsealed));
            assert_eq!(paged.rows_blocks(&[0]), Err(KernelError::Unsealed));
            pages.seal();
            let bits = |out: Vec<f32>| crate::bits(&out);
            assert_eq!(
                bits(paged.matmul(&input).unwrap()),
                bits(heap.matmul(&input).unwrap()),
                "{format:?}"
            );
            assert_eq!(
                bits(paged2.matmul(&input).unwrap()),
                bits(heap2.matmul(&input).unwrap()),
                "{format:?}"
            );
            assert_eq!(paged.rows_blocks(&[0, 36]), heap.rows_blocks(&[0, 36]));
            let mut full = WeightPages::reserve(0);
            let spilled =
                BlockMatrix::new_in(format, rows, cols, &q.data().unwrap(), &mut full).unwrap();
            assert!(!spilled.in_pages());
            assert_eq!(
                bits(spilled.matmul(&input).unwrap()),
                bits(heap.matmul(&input).unwrap())
            );
        }
    }

    /// A block of activations too small for its inverse scale to be finite
    /// adds 0, as in llama.cpp, and does not overflow the quant sum.
    #[test]
    fn vanishing_activations_add_nothing() {
        let (_, matrix) = stored(BlockFormat::Q4_1, 2, 64, 5);
        let mut input = vec![1e-38f32; 64];
        input[32..].fill(0.5);
        let tiny = matrix.matmul(&input).unwrap();
        input[..32].fill(0.0);
        let zero = matrix.matmul(&input).unwrap();
        assert_eq!(tiny, zero);
    }

    /// The K-quants' activations are llama.cpp's `quantize_row_q8_K`:
    /// candle's `BlockQ8K` is the same but for rounding ties away from zero,
    /// which these inputs never reach; one scale a superblock, negative
    /// where the value of largest magnitude is positive.
    #[test]
    fn k_quant_activations_are_q8_k() {
        let mut input: Vec<f32> = (0..1024)
            .map(|i| {
                let scale = [1.0, -3.0, 1e-3, 0.0][i / 256];
                ((i * 7 % 251) as f32 * 0.731 + 0.1).sin() * scale
            })
            .collect();
        input[0] = 2.0;
        input[300] = -9.0;
        let mut ours = Vec::new();
        quantize_activations_k(&input, &mut ours);
        let theirs = QTensor::quantize(
            &Tensor::from_vec(input.clone(), (4, 256), &Device::Cpu).unwrap(),
            candle_core::quantized::GgmlDType::Q8K,
        )
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        assert_eq!(ours.len(), 32);
        for (b, block) in ours.iter().enumerate() {
            assert_eq!(block.d, ours[b / 8 * 8].d, "one scale a superblock");
            let sum = |qs: &[i8]| qs.iter().map(|q| i32::from(*q)).sum::<i32>();
            assert_eq!(block.sum, sum(&block.qs));
            assert_eq!(block.half_sum, sum(&block.qs[..16]));
            for (i, q) in block.qs.iter().enumerate() {
                let at = b * BLOCK_ELEMS + i;
                assert_eq!(block.d * f32::from(*q), theirs[at], "value {at}");
            }
        }
        assert!(
            ours[0].d < 0.0 && ours[8].d > 0.0,
            "{} {}",
            ours[0].d,
            ours[8].d
        );
        assert_eq!(ours[24].d, 0.0);
    }

    /// An infinite activation gives NaN in every format, never a silent 0.
    #[test]
    fn an_infinite_activation_gives_nan() {
        for format in FORMATS {
            let cols = format.block_elems();
            let (_, matrix) = stored(format, 16, cols, 3);
            let mut input = vec![0.5f32; cols];
            input[1] = f32::INFINITY;
            let out = matrix.matmul(&input).unwrap();
            assert!(out.iter().all(|v| v.is_nan()), "{format:?}: {out:?}");
        }
    }

    /// A matrix of no rows or no columns is taken and runs without a
    /// panic: no outputs, or a refused input.
    #[test]
    fn empty_shapes_run() {
        for format in FORMATS {
            let cols = format.block_elems();
            let no_rows = BlockMatrix::new(format, 0, cols, Vec::new()).unwrap();
            assert_eq!(
                no_rows.matmul(&vec![0.5; 2 * cols]).unwrap(),
                Vec::<f32>::new()
            );
            let no_cols = BlockMatrix::new(format, 3, 0, Vec::new()).unwrap();
            assert!(no_cols.matmul(&[0.5; 4]).is_err());
            assert_eq!(no_cols.rows_blocks(&[2]), Ok(Vec::new()));
        }
    }

    #[test]
    fn refuses_bytes_that_are_not_the_shape() {
        assert_eq!(
            BlockMatrix::new(BlockFormat::Q4_1, 2, 48, vec![0; 60]).unwrap_err(),
            KernelError::RaggedRow {
                format: BlockFormat::Q4_1,
                cols: 48
            }
        );
        assert!(matches!(
            BlockMatrix::new(BlockFormat::Q4_1, 2, 64, vec![0; 79]),
            Err(KernelError::WrongSize { expected: 80, .. })
        ));
        assert!(matches!(
            BlockMatrix::new(BlockFormat::Q5_0, 2, 64, vec![0; 80]),
            Err(KernelError::WrongSize { expected: 88, .. })
        ));
        assert!(matches!(
            BlockMatrix::new(BlockFormat::Q4_1, usize::MAX / 4, 64, Vec::new()),
            Err(KernelError::WrongSize { .. })
        ));
        let matrix = BlockMatrix::new(BlockFormat::Q4_1, 2, 64, vec![0; 80]).unwrap();
        assert!(matches!(
            matrix.matmul(&[0.0; 65]),
            Err(KernelError::WrongInput { .. })
        ));
        assert_eq!(matrix.matmul(&[]).unwrap(), Vec::<f32>::new());
    }

    proptest! {
        /// A step's outputs do not depend on the other steps it is batched
        /// with, whatever their mix of one-row and many-row steps.
        #[test]
        fn steps_are_independent(
            steps in proptest::collection::vec(prop_oneof![Just(1usize), 1usize..12], 1..8),
            seed in any::<u64>(),
            which in 0usize..7,
        ) {
            let format = FORMATS[which];
            let (rows, cols) = (37, 2 * format.block_elems());
            let (_, matrix) = stored(format, rows, cols, seed);
            let m: usize = steps.iter().sum();
            let input: Vec<f32> = (0..m * cols)
                .map(|i| (((i as u64).wrapping_mul(seed | 1) >> 7) % 1000) as f32 / 250.0 - 2.0)
                .collect();
            let all = matrix.matmul_steps(&input, &steps).unwrap();
            let mut first = 0;
            for &step in &steps {
                let alone = matrix.matmul(&input[first * cols..][..step * cols]).unwrap();
                prop_assert_eq!(crate::bits(&all[first * rows..][..step * rows]), crate::bits(&alone));
                first += step;
            }
        }

        /// Any stored bytes and any input, including zeros and extremes,
        /// give an answer of the right length and no panic.
        #[test]
        fn never_panics(
            blocks in proptest::collection::vec(any::<u8>(), 3 * 210),
            input in proptest::collection::vec(-1e30f32..1e30, 256),
            which in 0usize..7,
        ) {
            let format = FORMATS[which];
            let cols = format.block_elems().max(64);
            let bytes = blocks[..3 * cols / format.block_elems() * format.block_bytes()].to_vec();
            let matrix = BlockMatrix::new(format, 3, cols, bytes).unwrap();
            let out = matrix.matmul(&input[..cols]).unwrap();
            prop_assert_eq!(out.len(), 3);
        }
    }
}
