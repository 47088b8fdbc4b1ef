//! Q4_1 matrices run as the file stores them: 20-byte blocks of 32 weights
//! (an f16 scale `d`, an f16 minimum `m`, 16 bytes of 4-bit quants), never
//! widened at load. candle has no SIMD kernel for this type (its Q4_1 dot
//! product is scalar, 5x slower than its Q8_0 one), which is why the engine
//! used to requantize Q4_1 to Q8_0: 1.7x the bytes per token and a different
//! model from the file's, so greedy text departed from llama.cpp's.
//!
//! The arithmetic is llama.cpp's (`quantize_row_q8_1` and
//! `ggml_vec_dot_q4_1_q8_1`, AVX2 path): each activation row is quantized
//! to Q8_1 blocks (an f16 scale, the f16 of scale times the quants' sum, 32
//! signed bytes, rounded half to even), then each weight row's dot product
//! sums `d_w * d_a * (quant products)` in eight f32 lanes plus `m_w * s_a`.
//! Each output depends only on its weight row and its activation row, so a
//! batch of requests gets the bits each gets alone.
//!
//! The SIMD path is safe Rust: `pulp`'s x86-64-v3 token (checked once at
//! run time) makes the AVX2 and FMA intrinsics safe to call, and the byte
//! loads are `bytemuck` casts of fixed-size arrays. A CPU without them
//! takes the scalar path, which gives the same bits.

use std::sync::Mutex;

use half::f16;

/// Weights per block, in both block types.
pub const BLOCK_ELEMS: usize = 32;
/// Bytes of one stored Q4_1 block: `d`, `m` (f16 each), 16 quant bytes.
pub const BLOCK_BYTES: usize = 20;
/// Weight rows per unit of work handed to a thread: small enough that two
/// threads share a 576-row matrix evenly, large enough that a unit is not
/// all dispatch.
const PIECE_ROWS: usize = 16;

/// Why a Q4_1 matrix could not be built from stored bytes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Q4_1Error {
    #[error("a Q4_1 row of {0} weights is not a whole number of 32-weight blocks")]
    RaggedRow(usize),
    #[error("a {rows}x{cols} Q4_1 matrix holds {expected} bytes, not {actual}")]
    WrongSize {
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
pub struct Q4_1Matrix {
    rows: usize,
    cols: usize,
    blocks: Vec<u8>,
}

/// One activation block, quantized as llama.cpp's `quantize_row_q8_1` does.
/// `d` and `s` are held as the f32 values of their f16 roundings.
#[derive(Debug, Clone, Copy)]
struct Q8_1Block {
    d: f32,
    s: f32,
    qs: [i8; BLOCK_ELEMS],
}

impl Q4_1Matrix {
    /// Take a matrix's stored blocks, row after row, as the file holds them.
    pub fn new(rows: usize, cols: usize, blocks: Vec<u8>) -> Result<Self, Q4_1Error> {
        if !cols.is_multiple_of(BLOCK_ELEMS) {
            return Err(Q4_1Error::RaggedRow(cols));
        }
        let expected = rows * (cols / BLOCK_ELEMS) * BLOCK_BYTES;
        if blocks.len() != expected {
            return Err(Q4_1Error::WrongSize {
                rows,
                cols,
                expected,
                actual: blocks.len(),
            });
        }
        Ok(Self { rows, cols, blocks })
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

    /// `input` is `m` rows of `cols` values; the result is `m` rows of
    /// `rows` values, computed on candle's thread pool.
    pub fn matmul(&self, input: &[f32]) -> Result<Vec<f32>, Q4_1Error> {
        if self.cols == 0 || !input.len().is_multiple_of(self.cols) {
            return Err(Q4_1Error::WrongInput {
                len: input.len(),
                cols: self.cols,
            });
        }
        let m = input.len() / self.cols;
        if m == 0 {
            return Ok(Vec::new());
        }
        let row_blocks = self.cols / BLOCK_ELEMS;
        let mut activations = Vec::with_capacity(m * row_blocks);
        for row in input.chunks_exact(self.cols) {
            quantize_row_q8_1(row, &mut activations);
        }
        let row_bytes = row_blocks * BLOCK_BYTES;

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
                    for (weight_row, out_row) in
                        weights.chunks_exact(row_bytes).zip(out.chunks_exact_mut(m))
                    {
                        let activation_row =
                            |row: usize| &activations[row * row_blocks..][..row_blocks];
                        let mut groups = out_row.chunks_exact_mut(ROW_GROUP);
                        for (group, values) in (&mut groups).enumerate() {
                            let rows =
                                std::array::from_fn(|r| activation_row(group * ROW_GROUP + r));
                            values.copy_from_slice(&dot_rows::<ROW_GROUP>(weight_row, rows));
                        }
                        let done = m - groups.into_remainder().len();
                        for (row, value) in out_row.iter_mut().enumerate().skip(done) {
                            *value = dot_rows::<1>(weight_row, [activation_row(row)])[0];
                        }
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

/// Append one row's Q8_1 blocks (`row.len()` a multiple of 32).
fn quantize_row_q8_1(row: &[f32], out: &mut Vec<Q8_1Block>) {
    for values in row.chunks_exact(BLOCK_ELEMS) {
        let max = values.iter().fold(0f32, |max, v| max.max(v.abs()));
        let d = max / 127.0;
        let inverse = if max != 0.0 { 127.0 / max } else { 0.0 };
        let mut qs = [0i8; BLOCK_ELEMS];
        let mut sum = 0i32;
        for (q, v) in qs.iter_mut().zip(values) {
            // |v * 127 / max| <= 127, so the cast never saturates.
            let rounded = (v * inverse).round_ties_even() as i32;
            *q = rounded as i8;
            sum += rounded;
        }
        out.push(Q8_1Block {
            d: f16::from_f32(d).to_f32(),
            s: f16::from_f32(d * sum as f32).to_f32(),
            qs,
        });
    }
}

fn block_scales(block: &[u8]) -> (f32, f32) {
    (
        f16::from_le_bytes([block[0], block[1]]).to_f32(),
        f16::from_le_bytes([block[2], block[3]]).to_f32(),
    )
}

/// Activation rows one weight row is applied to at once (prefill): the
/// weight row is unpacked once for all of them. Weight rows are still read
/// in order, which keeps the hardware prefetcher streaming them.
const ROW_GROUP: usize = 2;
/// Independent accumulators per dot product: block `i` goes to chain
/// `i % CHAINS`. One chain (llama.cpp's loop) waits on the fused
/// multiply-add's latency at every block; four let the CPU overlap them.
/// The chains are summed in a fixed order, so a row's bits depend only on
/// its weights and its input.
const CHAINS: usize = 4;

/// One stored row against `N` activation rows (each `len()` blocks of the
/// weight row). Each result has the bits of that pair's own dot product.
fn dot_rows<const N: usize>(weights: &[u8], activations: [&[Q8_1Block]; N]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(|| dot_rows_avx2(simd, weights, activations));
    }
    activations.map(|a| dot_scalar(weights, a))
}

/// The AVX2 loop (llama.cpp's per block, in `CHAINS` chains) for one
/// weight row and `N` activation rows, through pulp's tokens (each
/// intrinsic is safe to call once the token proves the CPU has the
/// feature).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dot_rows_avx2<const N: usize>(
    simd: pulp::x86::V3,
    weights: &[u8],
    activations: [&[Q8_1Block]; N],
) -> [f32; N] {
    use std::arch::x86_64::{__m128i, __m256i};
    let (avx, avx2, sse) = (simd.avx, simd.avx2, simd.sse);
    let low_nibbles = avx._mm256_set1_epi8(0x0F);
    let ones = avx._mm256_set1_epi16(1);
    let mut acc = [[avx._mm256_setzero_ps(); CHAINS]; N];
    let mut summs = [[0f32; CHAINS]; N];
    // One block into chain `chain` of every activation row.
    let mut step = |chain: usize, index: usize, block: &[u8]| {
        let (d, m) = block_scales(block);
        let mut packed = [0u8; 16];
        packed.copy_from_slice(&block[4..BLOCK_BYTES]);
        let packed: __m128i = bytemuck::cast(packed);
        // Low nibbles are weights 0..16, high nibbles 16..32.
        let quants = avx2._mm256_and_si256(
            low_nibbles,
            avx._mm256_set_m128i(simd.sse2._mm_srli_epi16::<4>(packed), packed),
        );
        for r in 0..N {
            let Some(a) = activations[r].get(index) else {
                continue;
            };
            summs[r][chain] = m.mul_add(a.s, summs[r][chain]);
            let scale = avx._mm256_set1_ps(d * a.d);
            let activation: __m256i = bytemuck::cast(a.qs);
            let pairs = avx2._mm256_maddubs_epi16(quants, activation);
            let sums = avx._mm256_cvtepi32_ps(avx2._mm256_madd_epi16(ones, pairs));
            acc[r][chain] = simd.fma._mm256_fmadd_ps(scale, sums, acc[r][chain]);
        }
    };
    // Blocks go in rounds of `CHAINS`, chain `c` taking the round's block
    // `c`: constant indices, so the accumulators stay in registers.
    let mut rounds = weights.chunks_exact(CHAINS * BLOCK_BYTES);
    for (round, blocks) in (&mut rounds).enumerate() {
        for chain in 0..CHAINS {
            step(
                chain,
                round * CHAINS + chain,
                &blocks[chain * BLOCK_BYTES..][..BLOCK_BYTES],
            );
        }
    }
    let first = (weights.len() / (CHAINS * BLOCK_BYTES)) * CHAINS;
    for (chain, block) in rounds.remainder().chunks_exact(BLOCK_BYTES).enumerate() {
        step(chain, first + chain, block);
    }
    let mut out = [0f32; N];
    for r in 0..N {
        let [a0, a1, a2, a3] = acc[r];
        let all = avx._mm256_add_ps(avx._mm256_add_ps(a0, a1), avx._mm256_add_ps(a2, a3));
        let half = sse._mm_add_ps(
            avx._mm256_extractf128_ps::<1>(all),
            avx._mm256_castps256_ps128(all),
        );
        let quarter = sse._mm_add_ps(half, sse._mm_movehl_ps(half, half));
        let total = sse._mm_add_ss(quarter, simd.sse3._mm_movehdup_ps(quarter));
        let [s0, s1, s2, s3] = summs[r];
        out[r] = sse._mm_cvtss_f32(total) + ((s0 + s1) + (s2 + s3));
    }
    out
}

/// The same sums without SIMD, in the SIMD path's chains, eight lanes
/// (lane `j` holds weights `4j..4j+4` of a block) and order, so both give
/// the same bits.
fn dot_scalar(weights: &[u8], activations: &[Q8_1Block]) -> f32 {
    let mut acc = [[0f32; 8]; CHAINS];
    let mut summs = [0f32; CHAINS];
    for (index, (block, a)) in weights
        .chunks_exact(BLOCK_BYTES)
        .zip(activations)
        .enumerate()
    {
        let chain = index % CHAINS;
        let (d, m) = block_scales(block);
        summs[chain] = m.mul_add(a.s, summs[chain]);
        let scale = d * a.d;
        let quants = unpack(block);
        for (lane, acc) in acc[chain].iter_mut().enumerate() {
            let sum: i32 = (lane * 4..lane * 4 + 4)
                .map(|i| i32::from(quants[i]) * i32::from(a.qs[i]))
                .sum();
            *acc = scale.mul_add(sum as f32, *acc);
        }
    }
    let all: [f32; 8] = std::array::from_fn(|j| (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]));
    let half = [
        all[0] + all[4],
        all[1] + all[5],
        all[2] + all[6],
        all[3] + all[7],
    ];
    let quarter = [half[0] + half[2], half[1] + half[3]];
    (quarter[0] + quarter[1]) + ((summs[0] + summs[1]) + (summs[2] + summs[3]))
}

/// A block's 32 quants in weight order.
fn unpack(block: &[u8]) -> [u8; BLOCK_ELEMS] {
    let mut quants = [0u8; BLOCK_ELEMS];
    for (i, byte) in block[4..BLOCK_BYTES].iter().enumerate() {
        quants[i] = byte & 0x0F;
        quants[i + 16] = byte >> 4;
    }
    quants
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use proptest::prelude::*;

    fn stored(rows: usize, cols: usize, seed: u64) -> (QTensor, Q4_1Matrix) {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect();
        let dense = Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&dense, GgmlDType::Q4_1).unwrap();
        let bytes = q.data().unwrap().to_vec();
        (q, Q4_1Matrix::new(rows, cols, bytes).unwrap())
    }

    /// Against candle's reference dequantization and an f64 product: the
    /// only error is the activations' 8-bit quantization.
    #[test]
    fn agrees_with_dequantized_weights() {
        let (rows, cols, m) = (40, 96, 3);
        let (q, matrix) = stored(rows, cols, 7);
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
                    "row {row} col {col}: {got} vs {exact}"
                );
            }
        }
    }

    /// The SIMD path and the scalar one give the same bits.
    #[test]
    fn simd_and_scalar_paths_agree() {
        let (rows, cols) = (5, 128);
        let (_, matrix) = stored(rows, cols, 11);
        let input: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut activations = Vec::new();
        quantize_row_q8_1(&input, &mut activations);
        for weights in matrix.blocks.chunks_exact(cols / BLOCK_ELEMS * BLOCK_BYTES) {
            assert_eq!(
                dot_rows::<1>(weights, [&activations])[0].to_bits(),
                dot_scalar(weights, &activations).to_bits()
            );
        }
    }

    #[test]
    fn refuses_bytes_that_are_not_the_shape() {
        assert_eq!(
            Q4_1Matrix::new(2, 48, vec![0; 60]).unwrap_err(),
            Q4_1Error::RaggedRow(48)
        );
        assert!(matches!(
            Q4_1Matrix::new(2, 64, vec![0; 79]),
            Err(Q4_1Error::WrongSize { expected: 80, .. })
        ));
        let matrix = Q4_1Matrix::new(2, 64, vec![0; 80]).unwrap();
        assert!(matches!(
            matrix.matmul(&[0.0; 65]),
            Err(Q4_1Error::WrongInput { .. })
        ));
    }

    proptest! {
        /// A row's outputs do not depend on the other rows it is batched with.
        #[test]
        fn rows_are_independent(m in 1usize..40, seed in any::<u64>()) {
            let (rows, cols) = (37, 64);
            let (_, matrix) = stored(rows, cols, seed);
            let input: Vec<f32> = (0..m * cols)
                .map(|i| (((i as u64).wrapping_mul(seed | 1) >> 7) % 1000) as f32 / 250.0 - 2.0)
                .collect();
            let all = matrix.matmul(&input).unwrap();
            for row in 0..m {
                let alone = matrix.matmul(&input[row * cols..][..cols]).unwrap();
                let batched: Vec<u32> = all[row * rows..][..rows].iter().map(|v| v.to_bits()).collect();
                let alone: Vec<u32> = alone.iter().map(|v| v.to_bits()).collect();
                prop_assert_eq!(batched, alone);
            }
        }

        /// Any finite input, including zeros and extremes, gives finite
        /// outputs and no panic.
        #[test]
        fn never_panics(input in proptest::collection::vec(-1e30f32..1e30, 64)) {
            let (_, matrix) = stored(3, 64, 1);
            let out = matrix.matmul(&input).unwrap();
            prop_assert_eq!(out.len(), 3);
        }
    }
}
