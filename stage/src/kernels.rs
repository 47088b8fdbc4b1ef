//! Block formats candle runs only on a scalar path, run as the file stores
//! them on the engine's own kernels, never widened at load:
//!
//! - Q4_0: 18-byte blocks of 32 weights (an f16 scale `d`, 16 bytes of
//!   4-bit quants); the weight is `d * (q - 8)`. candle has a SIMD kernel
//!   for it, with one accumulator chain.
//! - Q4_1: 20-byte blocks of 32 weights (an f16 scale `d`, an f16 minimum
//!   `m`, 16 bytes of 4-bit quants); the weight is `d * q + m`.
//! - Q5_0: 22-byte blocks (an f16 scale `d`, 32 high bits, 16 bytes of low
//!   nibbles); the weight is `d * (q - 16)` with 5-bit `q`.
//! - Q8_0: 34-byte blocks (an f16 scale `d`, 32 signed bytes). candle has
//!   a SIMD kernel for it, but with one accumulator chain; here it gets the
//!   same chains as the others (it holds the embedding and output head of
//!   SmolLM2 and Gemma 3: 45 % of Gemma 3's decode).
//!
//! candle's dot products for these are scalar, 5x slower than its Q8_0
//! one, which is why the engine used to requantize Q4_1 to Q8_0: 1.7x the
//! bytes per token and a different model from the file's, so greedy text
//! departed from llama.cpp's. Gemma 3's Q4_K_M files hold their attention
//! and gate/up projections in Q5_0.
//!
//! The arithmetic per block is llama.cpp's (`quantize_row_q8_1`,
//! `ggml_vec_dot_q4_0_q8_0`, `ggml_vec_dot_q4_1_q8_1`,
//! `ggml_vec_dot_q5_0_q8_0` and `ggml_vec_dot_q8_0_q8_0`, AVX2 path): each
//! activation row is quantized to 8-bit blocks (an f16 scale, the f16 of
//! scale times the quants' sum, 32 signed bytes, rounded half to even),
//! then each weight row's dot product sums `d_w * d_a * (quant products)`
//! in eight f32 lanes, in several accumulator chains (`RowPlan`), plus
//! `m_w * s_a` for Q4_1. Each output depends only on its weight row, its
//! activation row and whether its step has one row or many, so a batch of
//! requests gets the bits each gets alone.
//!
//! The SIMD path is safe Rust: `pulp`'s x86-64-v3 token (a run-time CPU
//! check, cached after the first) makes the AVX2 and FMA intrinsics safe to call, and the byte
//! loads are `bytemuck` casts of fixed-size arrays. A CPU without them
//! takes the scalar path, which gives the same bits.

use std::sync::Mutex;

use half::f16;

/// Weights per block, in every format here.
pub const BLOCK_ELEMS: usize = 32;
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
}

impl BlockFormat {
    /// Bytes of one stored block.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q5_0 => 22,
            BlockFormat::Q8_0 => 34,
        }
    }
}

/// Why a matrix could not be built from stored bytes, or run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("a {format:?} row of {cols} weights is not a whole number of 32-weight blocks")]
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
}

/// A `rows x cols` weight matrix (`rows` outputs, each the dot product of
/// one stored row with an input row of `cols` values).
#[derive(Debug)]
pub struct BlockMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    blocks: Vec<u8>,
}

/// One activation block, quantized as llama.cpp's `quantize_row_q8_1` does
/// (its `quantize_row_q8_0` gives the same `d` and quants, without `s`).
/// `d` and `s` are held as the f32 values of their f16 roundings.
#[derive(Debug, Clone, Copy)]
struct ActivationBlock {
    d: f32,
    s: f32,
    qs: [i8; BLOCK_ELEMS],
}

impl BlockMatrix {
    /// Take a matrix's stored blocks, row after row, as the file holds them.
    pub fn new(
        format: BlockFormat,
        rows: usize,
        cols: usize,
        blocks: Vec<u8>,
    ) -> Result<Self, KernelError> {
        if !cols.is_multiple_of(BLOCK_ELEMS) {
            return Err(KernelError::RaggedRow { format, cols });
        }
        let expected = rows
            .checked_mul(cols / BLOCK_ELEMS)
            .and_then(|blocks| blocks.checked_mul(format.block_bytes()));
        if expected != Some(blocks.len()) {
            let expected = expected.unwrap_or(usize::MAX);
            return Err(KernelError::WrongSize {
                format,
                rows,
                cols,
                expected,
                actual: blocks.len(),
            });
        }
        Ok(Self {
            format,
            rows,
            cols,
            blocks,
        })
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

    /// Bytes the matrix holds: exactly the file's.
    pub fn storage_bytes(&self) -> usize {
        self.blocks.len()
    }

    /// The stored blocks of rows `rows`, in order (`None` past the end):
    /// what a tied embedding reads a token's row from.
    pub fn rows_blocks(&self, rows: &[usize]) -> Option<Vec<u8>> {
        let row_bytes = self.cols / BLOCK_ELEMS * self.format.block_bytes();
        let mut out = Vec::with_capacity(rows.len() * row_bytes);
        for row in rows {
            let start = row.checked_mul(row_bytes)?;
            out.extend_from_slice(self.blocks.get(start..start.checked_add(row_bytes)?)?);
        }
        Some(out)
    }

    /// The matching candle type, for dequantizing blocks as candle does.
    pub fn ggml_dtype(&self) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType;
        match self.format {
            BlockFormat::Q4_0 => GgmlDType::Q4_0,
            BlockFormat::Q4_1 => GgmlDType::Q4_1,
            BlockFormat::Q5_0 => GgmlDType::Q5_0,
            BlockFormat::Q8_0 => GgmlDType::Q8_0,
        }
    }

    /// `input` is `m` rows of `cols` values, all of one step; the result
    /// is `m` rows of `rows` values, computed on candle's thread pool.
    pub fn matmul(&self, input: &[f32]) -> Result<Vec<f32>, KernelError> {
        let m = input.len().checked_div(self.cols).unwrap_or(0);
        self.matmul_steps(input, &[m])
    }

    /// The rows of several requests' steps at once: `steps` are the row
    /// counts of consecutive steps (a decode step is one row, a prompt's
    /// prefill many). A row's bits depend only on its weights, its input
    /// and whether its step has one row or several, never on the other
    /// steps it is batched with.
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
        match self.format {
            BlockFormat::Q4_0 => self.matmul_as::<Q4_0>(input, steps),
            BlockFormat::Q4_1 => self.matmul_as::<Q4_1>(input, steps),
            BlockFormat::Q5_0 => self.matmul_as::<Q5_0>(input, steps),
            BlockFormat::Q8_0 => self.matmul_as::<Q8_0>(input, steps),
        }
    }

    fn matmul_as<F: Format>(
        &self,
        input: &[f32],
        steps: &[usize],
    ) -> Result<Vec<f32>, KernelError> {
        let m = input.len() / self.cols;
        if m == 0 {
            return Ok(Vec::new());
        }
        let plan = if m == 1 {
            RowPlan::default()
        } else {
            RowPlan::new(steps)
        };
        let row_blocks = self.cols / BLOCK_ELEMS;
        let mut activations = Vec::with_capacity(m * row_blocks);
        for row in input.chunks_exact(self.cols) {
            quantize_activations(row, &mut activations);
        }
        let row_bytes = row_blocks * F::BYTES;

        // Outputs are computed weight row major (`rows x m`), so that each
        // piece of work owns one contiguous run of them, then transposed.
        let mut by_weight_row = vec![0f32; self.rows * m];
        {
            let pieces: Vec<Mutex<(usize, &mut [f32])>> = by_weight_row
                .chunks_mut(PIECE_ROWS * m)
                .enumerate()
                .map(|(index, out)| Mutex::new((index * PIECE_ROWS, out)))
                .collect();
            let run = |range: std::ops::Range<usize>| {
                for piece in &pieces[range] {
                    let mut guard = match piece.lock() {
                        Ok(guard) => guard,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    let (first_row, out) = &mut *guard;
                    let weights =
                        &self.blocks[*first_row * row_bytes..][..out.len() / m * row_bytes];
                    if m == 1 {
                        // One decode step: no plan to walk per weight row.
                        let activation = &activations[..row_blocks];
                        for (weight_row, value) in
                            weights.chunks_exact(row_bytes).zip(out.iter_mut())
                        {
                            *value = dot_rows::<F, 1, NARROW_CHAINS>(weight_row, [activation])[0];
                        }
                        continue;
                    }
                    for (weight_row, out_row) in
                        weights.chunks_exact(row_bytes).zip(out.chunks_exact_mut(m))
                    {
                        let activation_row =
                            |row: usize| &activations[row * row_blocks..][..row_blocks];
                        plan.run(
                            out_row,
                            |rows: [usize; WIDE_GROUP]| {
                                dot_rows::<F, WIDE_GROUP, WIDE_CHAINS>(
                                    weight_row,
                                    rows.map(activation_row),
                                )
                            },
                            |row| {
                                dot_rows::<F, 1, WIDE_CHAINS>(weight_row, [activation_row(row)])[0]
                            },
                            |rows: [usize; NARROW_GROUP]| {
                                dot_rows::<F, NARROW_GROUP, NARROW_CHAINS>(
                                    weight_row,
                                    rows.map(activation_row),
                                )
                            },
                            |row| {
                                dot_rows::<F, 1, NARROW_CHAINS>(weight_row, [activation_row(row)])
                                    [0]
                            },
                        );
                    }
                }
            };
            candle_core::utils::barrier_pool().execute_chunked(pieces.len(), run);
        }
        if m == 1 {
            return Ok(by_weight_row);
        }
        // Transposed in bands of weight rows, so that both the reads and
        // the writes of a band stay in L1.
        const BAND: usize = 64;
        let mut out = vec![0f32; self.rows * m];
        for band in (0..self.rows).step_by(BAND) {
            let band_end = self.rows.min(band + BAND);
            for (row, out_row) in out.chunks_exact_mut(self.rows).enumerate() {
                for (weight_row, value) in out_row[band..band_end].iter_mut().enumerate() {
                    *value = by_weight_row[(band + weight_row) * m + row];
                }
            }
        }
        Ok(out)
    }
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
) -> crate::Result<(f64, f64)> {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    let dtype = match format {
        BlockFormat::Q4_0 => GgmlDType::Q4_0,
        BlockFormat::Q4_1 => GgmlDType::Q4_1,
        BlockFormat::Q5_0 => GgmlDType::Q5_0,
        BlockFormat::Q8_0 => GgmlDType::Q8_0,
    };
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / 16_777_216.0 - 0.5)
        .collect();
    let weights = QTensor::quantize(
        &Tensor::from_vec(values, (rows, cols), &Device::Cpu)?,
        dtype,
    )?;
    let ours = BlockMatrix::new(format, rows, cols, weights.data()?.into_owned())
        .map_err(|e| crate::EngineError::Compute(e.to_string()))?;
    let theirs = QMatMul::from_qtensor(weights)?;
    let m: usize = steps.iter().sum();
    let input: Vec<f32> = (0..m * cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let tensor = Tensor::from_vec(input.clone(), (m, cols), &Device::Cpu)?;
    let run_ours = || {
        ours.matmul_steps(&input, steps)
            .map(|_| ())
            .map_err(|e| crate::EngineError::Compute(e.to_string()))
    };
    let run_theirs = || -> crate::Result<()> {
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
        let mut sum = 0i32;
        for (q, v) in qs.iter_mut().zip(values) {
            // |v| <= max, so |v * 127 / max| rounds to at most 127 and
            // the casts never saturate.
            let rounded = (v * inverse).round_ties_even() as i32;
            *q = rounded as i8;
            sum += rounded;
        }
        out.push(ActivationBlock {
            d: f16::from_f32(d).to_f32(),
            s: f16::from_f32(d * sum as f32).to_f32(),
            qs,
        });
    }
}

fn f16_at(block: &[u8], offset: usize) -> f32 {
    f16::from_le_bytes([block[offset], block[offset + 1]]).to_f32()
}

/// What differs between the formats: how a block's scale, minimum and 32
/// quants are read, on the SIMD path and on the scalar one.
trait Format {
    const BYTES: usize;
    /// Whether blocks carry a minimum (`m_w * s_a` joins the sum).
    const HAS_MIN: bool;
    fn scales(block: &[u8]) -> (f32, f32);
    /// The 32 quants in weight order, as the values the dot product uses.
    fn quants(block: &[u8]) -> [i8; BLOCK_ELEMS];
    /// The eight lanes' integer sums of quant times activation (lane `j`:
    /// weights `4j..4j+4`).
    #[cfg(target_arch = "x86_64")]
    fn lane_sums(
        simd: pulp::x86::V3,
        block: &[u8],
    ) -> impl Fn(std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i;
}

/// The 16 quant bytes of a block as a register: low nibbles in bytes
/// 0..16 (weights 0..16), high nibbles in bytes 16..32 (weights 16..32).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn nibbles(simd: pulp::x86::V3, bytes: &[u8]) -> std::arch::x86_64::__m256i {
    let mut packed = [0u8; 16];
    packed.copy_from_slice(bytes);
    let packed: std::arch::x86_64::__m128i = bytemuck::cast(packed);
    simd.avx2._mm256_and_si256(
        simd.avx._mm256_set1_epi8(0x0F),
        simd.avx
            ._mm256_set_m128i(simd.sse2._mm_srli_epi16::<4>(packed), packed),
    )
}

/// Sums of adjacent byte products, four to an i32 lane: `unsigned` bytes
/// (0..=31) times signed activation bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lane_sums_unsigned(
    simd: pulp::x86::V3,
    unsigned: std::arch::x86_64::__m256i,
    activation: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    let pairs = simd.avx2._mm256_maddubs_epi16(unsigned, activation);
    simd.avx2
        ._mm256_madd_epi16(simd.avx._mm256_set1_epi16(1), pairs)
}

/// Lane sums for signed weight quants (Q4_0, Q5_0, Q8_0), signed times
/// signed as maddubs needs it: |q| times the activation with q's sign.
/// Activations are never -128, so negating them cannot wrap.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn signed_lane_sums(
    simd: pulp::x86::V3,
    quants: std::arch::x86_64::__m256i,
) -> impl Fn(std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
    let avx2 = simd.avx2;
    let magnitude = avx2._mm256_sign_epi8(quants, quants);
    move |activation| lane_sums_unsigned(simd, magnitude, avx2._mm256_sign_epi8(activation, quants))
}

#[derive(Debug)]
struct Q4_0;

impl Format for Q4_0 {
    const BYTES: usize = BlockFormat::Q4_0.block_bytes();
    const HAS_MIN: bool = false;

    fn scales(block: &[u8]) -> (f32, f32) {
        (f16_at(block, 0), 0.0)
    }

    fn quants(block: &[u8]) -> [i8; BLOCK_ELEMS] {
        let mut quants = [0i8; BLOCK_ELEMS];
        for (i, byte) in block[2..18].iter().enumerate() {
            quants[i] = (byte & 0x0F) as i8 - 8;
            quants[i + 16] = (byte >> 4) as i8 - 8;
        }
        quants
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn lane_sums(
        simd: pulp::x86::V3,
        block: &[u8],
    ) -> impl Fn(std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
        let avx2 = simd.avx2;
        let quants =
            avx2._mm256_sub_epi8(nibbles(simd, &block[2..18]), simd.avx._mm256_set1_epi8(8));
        signed_lane_sums(simd, quants)
    }
}

#[derive(Debug)]
struct Q4_1;

impl Format for Q4_1 {
    const BYTES: usize = BlockFormat::Q4_1.block_bytes();
    const HAS_MIN: bool = true;

    fn scales(block: &[u8]) -> (f32, f32) {
        (f16_at(block, 0), f16_at(block, 2))
    }

    fn quants(block: &[u8]) -> [i8; BLOCK_ELEMS] {
        let mut quants = [0i8; BLOCK_ELEMS];
        for (i, byte) in block[4..20].iter().enumerate() {
            quants[i] = (byte & 0x0F) as i8;
            quants[i + 16] = (byte >> 4) as i8;
        }
        quants
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn lane_sums(
        simd: pulp::x86::V3,
        block: &[u8],
    ) -> impl Fn(std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
        let quants = nibbles(simd, &block[4..20]);
        move |activation| lane_sums_unsigned(simd, quants, activation)
    }
}

#[derive(Debug)]
struct Q5_0;

impl Format for Q5_0 {
    const BYTES: usize = BlockFormat::Q5_0.block_bytes();
    const HAS_MIN: bool = false;

    fn scales(block: &[u8]) -> (f32, f32) {
        (f16_at(block, 0), 0.0)
    }

    fn quants(block: &[u8]) -> [i8; BLOCK_ELEMS] {
        let high = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        let mut quants = [0i8; BLOCK_ELEMS];
        for (i, byte) in block[6..22].iter().enumerate() {
            let low = (byte & 0x0F) | ((((high >> i) & 1) as u8) << 4);
            let up = (byte >> 4) | ((((high >> (i + 16)) & 1) as u8) << 4);
            quants[i] = low as i8 - 16;
            quants[i + 16] = up as i8 - 16;
        }
        quants
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn lane_sums(
        simd: pulp::x86::V3,
        block: &[u8],
    ) -> impl Fn(std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
        let (avx, avx2) = (simd.avx, simd.avx2);
        let high = i32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        // Byte j becomes 0xFF where bit j of `high` is set (llama.cpp's
        // bytes_from_bits_32), then 0xF0 where it is not: OR'ed onto the
        // nibble that is `q - 16` as a signed byte.
        let spread = avx2._mm256_shuffle_epi8(
            avx._mm256_set1_epi32(high),
            avx._mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        let set = avx2._mm256_cmpeq_epi8(
            avx2._mm256_or_si256(spread, avx._mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe)),
            avx._mm256_set1_epi64x(-1),
        );
        let quants = avx2._mm256_or_si256(
            nibbles(simd, &block[6..22]),
            avx2._mm256_andnot_si256(set, avx._mm256_set1_epi8(0xF0u8 as i8)),
        );
        signed_lane_sums(simd, quants)
    }
}

#[derive(Debug)]
struct Q8_0;

impl Format for Q8_0 {
    const BYTES: usize = BlockFormat::Q8_0.block_bytes();
    const HAS_MIN: bool = false;

    fn scales(block: &[u8]) -> (f32, f32) {
        (f16_at(block, 0), 0.0)
    }

    fn quants(block: &[u8]) -> [i8; BLOCK_ELEMS] {
        let mut quants = [0i8; BLOCK_ELEMS];
        for (quant, byte) in quants.iter_mut().zip(&block[2..34]) {
            *quant = *byte as i8;
        }
        quants
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn lane_sums(
        simd: pulp::x86::V3,
        block: &[u8],
    ) -> impl Fn(std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(&block[2..34]);
        let quants: std::arch::x86_64::__m256i = bytemuck::cast(bytes);
        signed_lane_sums(simd, quants)
    }
}

/// How a step's rows are computed. Independent accumulators per dot
/// product ("chains": block `i` goes to chain `i % chains`) hide the fused
/// multiply-add's latency, which one chain (llama.cpp's loop) waits on at
/// every block; rows computed together share each weight block's unpacking.
/// Both fill the 16 AVX2 registers, so they trade against each other:
/// - a one-row step (decode): four chains, two such rows at a time;
/// - a many-row step (prefill): two chains, four rows at a time (prefill
///   +14-21 %, where four chains there would cost decode 7-17 %).
///
/// The chain count fixes a row's bits, so it follows the step, never the
/// batch: a request gets the same bits batched or alone.
const NARROW_CHAINS: usize = 4;
const NARROW_GROUP: usize = 2;
const WIDE_CHAINS: usize = 2;
const WIDE_GROUP: usize = 4;

/// The rows of a batch sorted by how they are computed.
#[derive(Debug, Default)]
struct RowPlan {
    wide_groups: Vec<[usize; WIDE_GROUP]>,
    wide_rest: Vec<usize>,
    narrow_groups: Vec<[usize; NARROW_GROUP]>,
    narrow_rest: Vec<usize>,
}

impl RowPlan {
    fn new(steps: &[usize]) -> Self {
        let mut plan = RowPlan::default();
        let mut narrow = Vec::new();
        let mut first = 0;
        for &rows in steps {
            if rows == 1 {
                narrow.push(first);
            } else {
                let step: Vec<usize> = (first..first + rows).collect();
                let mut groups = step.chunks_exact(WIDE_GROUP);
                for group in &mut groups {
                    plan.wide_groups.push(std::array::from_fn(|i| group[i]));
                }
                plan.wide_rest.extend_from_slice(groups.remainder());
            }
            first += rows;
        }
        let mut groups = narrow.chunks_exact(NARROW_GROUP);
        for group in &mut groups {
            plan.narrow_groups.push(std::array::from_fn(|i| group[i]));
        }
        plan.narrow_rest.extend_from_slice(groups.remainder());
        plan
    }

    /// Fill one weight row's outputs (`out[row]` for every row).
    fn run(
        &self,
        out: &mut [f32],
        wide: impl Fn([usize; WIDE_GROUP]) -> [f32; WIDE_GROUP],
        wide_one: impl Fn(usize) -> f32,
        narrow: impl Fn([usize; NARROW_GROUP]) -> [f32; NARROW_GROUP],
        narrow_one: impl Fn(usize) -> f32,
    ) {
        for rows in &self.wide_groups {
            for (row, value) in rows.iter().zip(wide(*rows)) {
                out[*row] = value;
            }
        }
        for &row in &self.wide_rest {
            out[row] = wide_one(row);
        }
        for rows in &self.narrow_groups {
            for (row, value) in rows.iter().zip(narrow(*rows)) {
                out[*row] = value;
            }
        }
        for &row in &self.narrow_rest {
            out[row] = narrow_one(row);
        }
    }
}

/// The chains' sums added pairwise, in a fixed order: `(c0 + c1) + (c2 +
/// c3)` for four. `C` is a power of two.
fn chain_sum<T: Copy, const C: usize>(mut values: [T; C], add: impl Fn(T, T) -> T) -> T {
    let mut len = C;
    while len > 1 {
        for i in 0..len / 2 {
            values[i] = add(values[2 * i], values[2 * i + 1]);
        }
        len /= 2;
    }
    values[0]
}

/// One stored row against `N` activation rows (each `len()` blocks of the
/// weight row), in `C` chains. Each result has the bits of that pair's own
/// dot product in `C` chains.
/// Kept out of line: inlined into the piece loop, the compiler spilled
/// the accumulators of the two-row form to the stack (prefill 230 -> 155
/// tok/s).
#[inline(never)]
fn dot_rows<F: Format, const N: usize, const C: usize>(
    weights: &[u8],
    activations: [&[ActivationBlock]; N],
) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(|| dot_rows_avx2::<F, N, C>(simd, weights, activations));
    }
    activations.map(|a| dot_scalar::<F, C>(weights, a))
}

/// The AVX2 loop (llama.cpp's per block, in `C` chains) for one
/// weight row and `N` activation rows, through pulp's tokens (each
/// intrinsic is safe to call once the token proves the CPU has the
/// feature).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dot_rows_avx2<F: Format, const N: usize, const C: usize>(
    simd: pulp::x86::V3,
    weights: &[u8],
    activations: [&[ActivationBlock]; N],
) -> [f32; N] {
    use std::arch::x86_64::__m256i;
    let (avx, sse) = (simd.avx, simd.sse);
    let mut acc = [[avx._mm256_setzero_ps(); C]; N];
    let mut summs = [[0f32; C]; N];
    // One block into chain `chain` of every activation row.
    let mut step = |chain: usize, index: usize, block: &[u8]| {
        let (d, m) = F::scales(block);
        let lane_sums = F::lane_sums(simd, block);
        for r in 0..N {
            let Some(a) = activations[r].get(index) else {
                continue;
            };
            if F::HAS_MIN {
                summs[r][chain] = m.mul_add(a.s, summs[r][chain]);
            }
            let scale = avx._mm256_set1_ps(d * a.d);
            let activation: __m256i = bytemuck::cast(a.qs);
            let sums = avx._mm256_cvtepi32_ps(lane_sums(activation));
            acc[r][chain] = simd.fma._mm256_fmadd_ps(scale, sums, acc[r][chain]);
        }
    };
    // Blocks go in rounds of `C`, chain `c` taking the round's block `c`:
    // constant indices, so the accumulators stay in registers.
    let mut rounds = weights.chunks_exact(C * F::BYTES);
    for (round, blocks) in (&mut rounds).enumerate() {
        for chain in 0..C {
            step(
                chain,
                round * C + chain,
                &blocks[chain * F::BYTES..][..F::BYTES],
            );
        }
    }
    let first = (weights.len() / (C * F::BYTES)) * C;
    for (chain, block) in rounds.remainder().chunks_exact(F::BYTES).enumerate() {
        step(chain, first + chain, block);
    }
    let mut out = [0f32; N];
    for r in 0..N {
        let all = chain_sum(acc[r], |a, b| avx._mm256_add_ps(a, b));
        let half = sse._mm_add_ps(
            avx._mm256_extractf128_ps::<1>(all),
            avx._mm256_castps256_ps128(all),
        );
        let quarter = sse._mm_add_ps(half, sse._mm_movehl_ps(half, half));
        let total = sse._mm_add_ss(quarter, simd.sse3._mm_movehdup_ps(quarter));
        out[r] = sse._mm_cvtss_f32(total) + chain_sum(summs[r], |a, b| a + b);
    }
    out
}

/// The same sums without SIMD, in the SIMD path's chains, eight lanes
/// (lane `j` holds weights `4j..4j+4` of a block) and order, so both give
/// the same bits.
fn dot_scalar<F: Format, const C: usize>(weights: &[u8], activations: &[ActivationBlock]) -> f32 {
    let mut acc = [[0f32; 8]; C];
    let mut summs = [0f32; C];
    for (index, (block, a)) in weights.chunks_exact(F::BYTES).zip(activations).enumerate() {
        let chain = index % C;
        let (d, m) = F::scales(block);
        if F::HAS_MIN {
            summs[chain] = m.mul_add(a.s, summs[chain]);
        }
        let scale = d * a.d;
        let quants = F::quants(block);
        for (lane, acc) in acc[chain].iter_mut().enumerate() {
            let sum: i32 = (lane * 4..lane * 4 + 4)
                .map(|i| i32::from(quants[i]) * i32::from(a.qs[i]))
                .sum();
            *acc = scale.mul_add(sum as f32, *acc);
        }
    }
    let all: [f32; 8] = chain_sum(acc, |a, b| std::array::from_fn(|j| a[j] + b[j]));
    let half = [
        all[0] + all[4],
        all[1] + all[5],
        all[2] + all[6],
        all[3] + all[7],
    ];
    let quarter = [half[0] + half[2], half[1] + half[3]];
    (quarter[0] + quarter[1]) + chain_sum(summs, |a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use proptest::prelude::*;

    const FORMATS: [(BlockFormat, GgmlDType); 4] = [
        (BlockFormat::Q4_0, GgmlDType::Q4_0),
        (BlockFormat::Q4_1, GgmlDType::Q4_1),
        (BlockFormat::Q5_0, GgmlDType::Q5_0),
        (BlockFormat::Q8_0, GgmlDType::Q8_0),
    ];

    fn stored(format: BlockFormat, rows: usize, cols: usize, seed: u64) -> (QTensor, BlockMatrix) {
        let dtype = FORMATS.iter().find(|(f, _)| *f == format).unwrap().1;
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect();
        let dense = Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&dense, dtype).unwrap();
        let bytes = q.data().unwrap().to_vec();
        (q, BlockMatrix::new(format, rows, cols, bytes).unwrap())
    }

    /// Against candle's reference dequantization and an f64 product: the
    /// only error is the activations' 8-bit quantization.
    #[test]
    fn agrees_with_dequantized_weights() {
        for (format, _) in FORMATS {
            let (rows, cols, m) = (40, 96, 3);
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

    /// Each format's quants read back as candle dequantizes them.
    #[test]
    fn quants_read_as_candle_dequantizes() {
        fn check<F: Format>(format: BlockFormat) {
            let (q, matrix) = stored(format, 1, 64, 3);
            let dense = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            for (b, block) in matrix.blocks.chunks_exact(F::BYTES).enumerate() {
                let (d, m) = F::scales(block);
                for (i, quant) in F::quants(block).iter().enumerate() {
                    let weight = if F::HAS_MIN {
                        d * f32::from(*quant) + m
                    } else {
                        d * f32::from(*quant)
                    };
                    assert_eq!(weight, dense[0][b * 32 + i], "{format:?}");
                }
            }
        }
        check::<Q4_0>(BlockFormat::Q4_0);
        check::<Q4_1>(BlockFormat::Q4_1);
        check::<Q5_0>(BlockFormat::Q5_0);
        check::<Q8_0>(BlockFormat::Q8_0);
    }

    /// The SIMD path and the scalar one give the same bits.
    #[test]
    fn simd_and_scalar_paths_agree() {
        fn check<F: Format>(matrix: &BlockMatrix, activations: &[ActivationBlock]) {
            let row_bytes = matrix.cols / BLOCK_ELEMS * F::BYTES;
            for weights in matrix.blocks.chunks_exact(row_bytes) {
                assert_eq!(
                    dot_rows::<F, 1, NARROW_CHAINS>(weights, [activations])[0].to_bits(),
                    dot_scalar::<F, NARROW_CHAINS>(weights, activations).to_bits()
                );
                assert_eq!(
                    dot_rows::<F, 1, WIDE_CHAINS>(weights, [activations])[0].to_bits(),
                    dot_scalar::<F, WIDE_CHAINS>(weights, activations).to_bits()
                );
            }
        }
        let cols = 160;
        let input: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut activations = Vec::new();
        quantize_activations(&input, &mut activations);
        check::<Q4_1>(&stored(BlockFormat::Q4_1, 5, cols, 11).1, &activations);
        check::<Q5_0>(&stored(BlockFormat::Q5_0, 5, cols, 11).1, &activations);
        check::<Q8_0>(&stored(BlockFormat::Q8_0, 5, cols, 11).1, &activations);
        check::<Q4_0>(&stored(BlockFormat::Q4_0, 5, cols, 11).1, &activations);
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
            which in 0usize..4,
        ) {
            let format = FORMATS[which].0;
            let (rows, cols) = (37, 64);
            let (_, matrix) = stored(format, rows, cols, seed);
            let m: usize = steps.iter().sum();
            let input: Vec<f32> = (0..m * cols)
                .map(|i| (((i as u64).wrapping_mul(seed | 1) >> 7) % 1000) as f32 / 250.0 - 2.0)
                .collect();
            let all = matrix.matmul_steps(&input, &steps).unwrap();
            let mut first = 0;
            for &step in &steps {
                let alone = matrix.matmul(&input[first * cols..][..step * cols]).unwrap();
                let batched: Vec<u32> =
                    all[first * rows..][..step * rows].iter().map(|v| v.to_bits()).collect();
                let alone: Vec<u32> = alone.iter().map(|v| v.to_bits()).collect();
                prop_assert_eq!(batched, alone);
                first += step;
            }
        }

        /// Any stored bytes and any input, including zeros and extremes,
        /// give an answer of the right length and no panic.
        #[test]
        fn never_panics(
            blocks in proptest::collection::vec(any::<u8>(), 3 * 2 * 34),
            input in proptest::collection::vec(-1e30f32..1e30, 64),
            which in 0usize..4,
        ) {
            let format = FORMATS[which].0;
            let bytes = blocks[..3 * 2 * format.block_bytes()].to_vec();
            let matrix = BlockMatrix::new(format, 3, 64, bytes).unwrap();
            let out = matrix.matmul(&input).unwrap();
            prop_assert_eq!(out.len(), 3);
        }
    }
}
