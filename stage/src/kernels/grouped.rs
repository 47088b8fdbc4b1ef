//! Q4_0, Q4_1, Q5_0 and Q8_0 matrices held as groups of sixteen weight
//! rows, so that one SIMD instruction works on eight or sixteen outputs at
//! once (docs/engine.md).
//!
//! A row-by-row kernel (the engine's until 2026-12-03) spends, per
//! 32-weight block and activation row, about seven instructions on 32
//! products: three to multiply and sum the bytes, then a conversion, a
//! scale and a fused add, all for one output.
//! Here each i32 lane of a register belongs to one of the group's rows: a
//! lane takes four of its row's quants times the same four activation
//! quants (broadcast), so one `vpdpbusd` does 64 products for sixteen
//! outputs on AVX-512, and 32 for eight on AVX-VNNI (`maddubs` and `madd`
//! on AVX2), which take a group as two halves of eight rows; the
//! conversion, scale and add happen once per block for all of them.
//!
//! A group's block is the sixteen stored blocks' bytes rearranged, not
//! widened: the sixteen f16 scales, the sixteen f16 minimums (Q4_1), four
//! 64-byte chunks of nibbles (chunk `c`, byte `4r + t`: row `r`'s quant
//! `4c + t` in the low nibble, quant `16 + 4c + t` in the high one), and
//! for Q5_0 64 bytes of fifth bits (byte `4r + t`, bit `j`: the fifth bit
//! of row `r`'s quant `4j + t`); Q8_0's block is the scales and eight
//! 64-byte chunks of its signed quants (chunk `j`, byte `4r + t`: row `r`'s
//! quant `4j + t`). So a chunk's first 32 bytes are rows 0-7, its last 32
//! rows 8-15. A last group short of sixteen rows is filled with zero
//! blocks (scale 0), which add nothing and are never read out.
//!
//! Each output is, block after block, `acc = (d_w * d_a) * isum + acc`
//! then (Q4_1) `acc = m_w * s_a + acc`, each one fused multiply-add, where
//! `isum` is the block's exact integer product of the quants as the format
//! means them (where a path takes the quants as unsigned bytes, each lane
//! starts at minus the format's offset times the activation quants' sum,
//! so the unsigned quants give the signed sum; the AVX2 path takes Q8_0's
//! signed bytes by magnitude and sign instead, from 0).
//! So an output's bits depend on its weight row and activation row alone,
//! not on which rows share a group or a pass, and every path gives the
//! scalar path's bits.

use super::{ActivationBlock, BLOCK_ELEMS, BlockFormat};
use half::f16;

/// Weight rows per group.
pub(super) const GROUP: usize = 16;
/// Bytes of a chunk of a group's block: four quants of each row.
const CHUNK: usize = 4 * GROUP;
/// How far ahead of the block it reads the first pass over a group asks
/// for weights (bytes): measured on SmolLM2's decode, 4 to 32 KiB all gave
/// the same 10 % over none; a few groups of its widest rows.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 16 * 1024;
/// Where a group's block holds its scales.
const SCALES: usize = 0;

/// What differs between the grouped formats.
pub(super) trait Grouped {
    const FORMAT: BlockFormat;
    /// How far the quants as unsigned bytes (4- and 5-bit quants as
    /// stored; Q8_0's with the sign bit flipped) are above the values
    /// meant.
    const OFFSET: i32;
    /// Whether blocks carry a minimum (weight `d * q + m`).
    const HAS_MIN: bool;
    /// Whether quants have a fifth bit.
    const FIVE_BITS: bool;
    /// Whether quants are whole signed bytes (Q8_0), stored as they are:
    /// the offset (128) is applied on the way in, by the VNNI path (which
    /// flips each byte's sign bit) and the scalar one.
    const EIGHT_BITS: bool = false;
    /// Bytes of one stored block.
    const STORED_BYTES: usize = Self::FORMAT.block_bytes();
    /// Bytes of one block of a group: eight stored blocks' worth.
    const GROUP_BLOCK_BYTES: usize = GROUP * Self::STORED_BYTES;
    const MINS: usize = 2 * GROUP;
    /// Where the quants start: four 32-byte chunks of nibbles, or eight
    /// of bytes.
    const NIBBLES: usize = if Self::HAS_MIN { 4 * GROUP } else { 2 * GROUP };
    const HIGH: usize = Self::NIBBLES + 4 * CHUNK;
    /// Where the stored block's quant bytes start.
    const STORED_QUANTS: usize;
}

#[derive(Debug)]
pub(super) struct Q4_0;
#[derive(Debug)]
pub(super) struct Q4_1;
#[derive(Debug)]
pub(super) struct Q5_0;
#[derive(Debug)]
pub(super) struct Q8_0;

impl Grouped for Q4_0 {
    const FORMAT: BlockFormat = BlockFormat::Q4_0;
    const OFFSET: i32 = 8;
    const HAS_MIN: bool = false;
    const FIVE_BITS: bool = false;
    const STORED_QUANTS: usize = 2;
}

impl Grouped for Q4_1 {
    const FORMAT: BlockFormat = BlockFormat::Q4_1;
    const OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    const FIVE_BITS: bool = false;
    const STORED_QUANTS: usize = 4;
}

impl Grouped for Q5_0 {
    const FORMAT: BlockFormat = BlockFormat::Q5_0;
    const OFFSET: i32 = 16;
    const HAS_MIN: bool = false;
    const FIVE_BITS: bool = true;
    const STORED_QUANTS: usize = 6;
}

impl Grouped for Q8_0 {
    const FORMAT: BlockFormat = BlockFormat::Q8_0;
    const OFFSET: i32 = 128;
    const HAS_MIN: bool = false;
    const FIVE_BITS: bool = false;
    const EIGHT_BITS: bool = true;
    const STORED_QUANTS: usize = 2;
}

/// A stored 4- or 5-bit block's 32 quants as unsigned values.
fn unsigned_quants<F: Grouped>(block: &[u8]) -> [u8; BLOCK_ELEMS] {
    let high = if F::FIVE_BITS {
        u32::from_le_bytes([block[2], block[3], block[4], block[5]])
    } else {
        0
    };
    let mut quants = [0u8; BLOCK_ELEMS];
    for (i, byte) in block[F::STORED_QUANTS..F::STORED_QUANTS + 16]
        .iter()
        .enumerate()
    {
        quants[i] = (byte & 0x0F) | ((((high >> i) & 1) as u8) << 4);
        quants[i + 16] = (byte >> 4) | ((((high >> (i + 16)) & 1) as u8) << 4);
    }
    quants
}

/// `rows` stored rows of `row_blocks` blocks each, as groups, into
/// `grouped` (zeroed, whole groups long).
pub(super) fn group_rows<F: Grouped>(
    stored: &[u8],
    rows: usize,
    row_blocks: usize,
    grouped: &mut [u8],
) {
    if row_blocks == 0 {
        return;
    }
    for (row, stored_row) in stored
        .chunks_exact(row_blocks * F::STORED_BYTES)
        .enumerate()
        .take(rows)
    {
        let (group, r) = (row / GROUP, row % GROUP);
        for (b, block) in stored_row.chunks_exact(F::STORED_BYTES).enumerate() {
            let out = &mut grouped[(group * row_blocks + b) * F::GROUP_BLOCK_BYTES..]
                [..F::GROUP_BLOCK_BYTES];
            out[SCALES + 2 * r..][..2].copy_from_slice(&block[..2]);
            if F::HAS_MIN {
                out[F::MINS + 2 * r..][..2].copy_from_slice(&block[2..4]);
            }
            if F::EIGHT_BITS {
                // Chunk j, byte 4r + t: row r's quant 4j + t, as stored.
                for j in 0..8 {
                    out[F::NIBBLES + CHUNK * j + 4 * r..][..4]
                        .copy_from_slice(&block[F::STORED_QUANTS + 4 * j..][..4]);
                }
                continue;
            }
            let quants = unsigned_quants::<F>(block);
            for c in 0..4 {
                for t in 0..4 {
                    out[F::NIBBLES + CHUNK * c + 4 * r + t] =
                        (quants[4 * c + t] & 0x0F) | ((quants[16 + 4 * c + t] & 0x0F) << 4);
                }
            }
            if F::FIVE_BITS {
                for t in 0..4 {
                    out[F::HIGH + 4 * r + t] =
                        (0..8).fold(0u8, |bits, j| bits | (((quants[4 * j + t] >> 4) & 1) << j));
                }
            }
        }
    }
}

/// Row `row`'s stored blocks, as the file holds them, appended to `out`.
pub(super) fn stored_row<F: Grouped>(
    grouped: &[u8],
    row: usize,
    row_blocks: usize,
    out: &mut Vec<u8>,
) {
    let (group, r) = (row / GROUP, row % GROUP);
    for b in 0..row_blocks {
        let block =
            &grouped[(group * row_blocks + b) * F::GROUP_BLOCK_BYTES..][..F::GROUP_BLOCK_BYTES];
        let quants = quants_of::<F>(block, r);
        // Room for the widest stored block (Q8_0's).
        let mut stored = [0u8; BlockFormat::Q8_0.block_bytes()];
        stored[..2].copy_from_slice(&block[SCALES + 2 * r..][..2]);
        if F::HAS_MIN {
            stored[2..4].copy_from_slice(&block[F::MINS + 2 * r..][..2]);
        }
        if F::FIVE_BITS {
            let high =
                (0..BLOCK_ELEMS).fold(0u32, |high, i| high | (u32::from(quants[i] >> 4) << i));
            stored[2..6].copy_from_slice(&high.to_le_bytes());
        }
        if F::EIGHT_BITS {
            for (stored, quant) in stored[F::STORED_QUANTS..].iter_mut().zip(quants) {
                *stored = quant ^ 0x80;
            }
        } else {
            for i in 0..16 {
                stored[F::STORED_QUANTS + i] = (quants[i] & 0x0F) | ((quants[i + 16] & 0x0F) << 4);
            }
        }
        out.extend_from_slice(&stored[..F::STORED_BYTES]);
    }
}

/// Row `r`'s 32 unsigned quants in a group's block.
fn quants_of<F: Grouped>(block: &[u8], r: usize) -> [u8; BLOCK_ELEMS] {
    let mut quants = [0u8; BLOCK_ELEMS];
    if F::EIGHT_BITS {
        for j in 0..8 {
            for t in 0..4 {
                quants[4 * j + t] = block[F::NIBBLES + CHUNK * j + 4 * r + t] ^ 0x80;
            }
        }
        return quants;
    }
    for c in 0..4 {
        for t in 0..4 {
            let nibbles = block[F::NIBBLES + CHUNK * c + 4 * r + t];
            quants[4 * c + t] = nibbles & 0x0F;
            quants[16 + 4 * c + t] = nibbles >> 4;
        }
    }
    if F::FIVE_BITS {
        for t in 0..4 {
            let bits = block[F::HIGH + 4 * r + t];
            for j in 0..8 {
                quants[4 * j + t] |= ((bits >> j) & 1) << 4;
            }
        }
    }
    quants
}

fn f16_at(block: &[u8], offset: usize) -> f32 {
    f16::from_le_bytes([block[offset], block[offset + 1]]).to_f32()
}

/// One group's outputs for `N` activation rows: `[row][lane]`, lane `r`
/// for the group's row `r`. `group` is the group's blocks, one per
/// activation block of each row. `prefetch` on the first pass over a
/// group (of a matrix read in order) asks for the groups ahead of it.
pub(super) fn group_dots<F: Grouped, const N: usize>(
    group: &[u8],
    activations: [&[ActivationBlock]; N],
    prefetch: bool,
) -> [[f32; GROUP]; N] {
    #[cfg(target_arch = "x86_64")]
    if let Some(path) = simd::detected() {
        return simd::group_dots::<F, N>(path, group, activations, prefetch);
    }
    // A hint the scalar path has no use for.
    let _ = prefetch;
    activations.map(|a| std::array::from_fn(|r| dot_scalar::<F>(group, r, a)))
}

/// The scalar path: row `r` of `group` against one activation row.
fn dot_scalar<F: Grouped>(group: &[u8], r: usize, activations: &[ActivationBlock]) -> f32 {
    let mut acc = 0f32;
    for (block, a) in group.chunks_exact(F::GROUP_BLOCK_BYTES).zip(activations) {
        let d = f16_at(block, SCALES + 2 * r);
        let isum = quants_of::<F>(block, r)
            .iter()
            .zip(a.qs)
            .fold(-F::OFFSET * a.sum, |sum, (q, x)| {
                sum + i32::from(*q) * i32::from(x)
            });
        acc = (d * a.d).mul_add(isum as f32, acc);
        if F::HAS_MIN {
            acc = f16_at(block, F::MINS + 2 * r).mul_add(a.s, acc);
        }
    }
    acc
}

/// The SIMD paths. Safe code but for the calls into `#[target_feature]`
/// functions, each made only once the features it enables were detected
/// on this CPU, the prefetch hint, whose intrinsic takes a raw address,
/// and the AVX-512 path's 64-byte loads from bounds-checked slices: no
/// safe SIMD crate wraps `vpdpbusd` (pulp's tokens stop at AVX-512's base
/// sets), and F16C, which reads a group's scales at once, is not part of
/// pulp's x86-64-v3 token. Issue 12 allows `unsafe` here, with a safety
/// comment and tests of the bits against the scalar path.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) mod simd {
    use super::{CHUNK, GROUP, Grouped, SCALES};
    use crate::kernels::ActivationBlock;
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// Which loop this CPU runs, from the least to the most it asks of it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(in crate::kernels) enum Path {
        /// AVX2, FMA and F16C, on each half of a group in turn.
        Avx2,
        /// And AVX-VNNI.
        Vnni,
        /// AVX2, FMA, F16C and AVX-512 (F, BW, VNNI): a register holds
        /// four quants of each of the group's sixteen rows, so one
        /// `vpdpbusd` does 64 products for sixteen outputs.
        Avx512,
    }

    /// The best path this CPU has, detected once.
    pub(in crate::kernels) fn detected() -> Option<Path> {
        static DETECTED: OnceLock<Option<Path>> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let base = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512 = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni");
            match (base, avx512, is_x86_feature_detected!("avxvnni")) {
                (false, _, _) => None,
                (true, true, _) => Some(Path::Avx512),
                (true, false, true) => Some(Path::Vnni),
                (true, false, false) => Some(Path::Avx2),
            }
        })
    }

    /// Every path this CPU can run, for the tests that hold each to the
    /// scalar path's bits.
    #[cfg(test)]
    pub(in crate::kernels) fn available() -> Vec<Path> {
        let Some(best) = detected() else {
            return Vec::new();
        };
        let mut paths = vec![Path::Avx2];
        // A CPU with AVX-512 VNNI need not have AVX-VNNI (Ice Lake has not).
        if is_x86_feature_detected!("avxvnni") {
            paths.push(Path::Vnni);
        }
        if best == Path::Avx512 {
            paths.push(Path::Avx512);
        }
        paths
    }

    /// `group_dots` on `path` if this CPU has it, else on the best path
    /// below it that it has.
    pub(in crate::kernels) fn group_dots<F: Grouped, const N: usize>(
        path: Path,
        group: &[u8],
        activations: [&[ActivationBlock]; N],
        prefetch: bool,
    ) -> [[f32; GROUP]; N] {
        let available = detected();
        match path {
            // SAFETY: `dots_avx512` enables AVX2, FMA, F16C, AVX-512F,
            // AVX-512BW and AVX-512 VNNI; `detected()` found all six on
            // this CPU (it says `Avx512` only then).
            Path::Avx512 if available == Some(Path::Avx512) => unsafe {
                dots_avx512::<F, N>(group, activations, prefetch)
            },
            // SAFETY: `dots_vnni` enables AVX2, FMA, F16C and AVX-VNNI:
            // `detected()` found the first three (it is `Some` only then)
            // and the fourth is checked here.
            Path::Vnni | Path::Avx512
                if available.is_some() && is_x86_feature_detected!("avxvnni") =>
            unsafe { dots_vnni::<F, N>(group, activations, prefetch) },
            // SAFETY: `dots_avx2` enables AVX2, FMA and F16C; `detected()`
            // found them on this CPU (it is `Some` only then).
            _ if available.is_some() => unsafe { dots_avx2::<F, N>(group, activations, prefetch) },
            _ => activations.map(|a| std::array::from_fn(|r| super::dot_scalar::<F>(group, r, a))),
        }
    }

    /// A group's two halves of eight rows, one after the other.
    fn halves<const N: usize>(
        mut half: impl FnMut(usize) -> [[f32; GROUP / 2]; N],
    ) -> [[f32; GROUP]; N] {
        let (low, high) = (half(0), half(1));
        std::array::from_fn(|r| std::array::from_fn(|i| [low[r], high[r]].as_flattened()[i]))
    }

    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    fn dots_vnni<F: Grouped, const N: usize>(
        group: &[u8],
        activations: [&[ActivationBlock]; N],
        prefetch: bool,
    ) -> [[f32; GROUP]; N] {
        let sign_bit = _mm256_set1_epi8(0x80u8 as i8);
        halves(|half| {
            dots::<F, N>(
                group,
                half,
                activations,
                prefetch && half == 0,
                F::OFFSET,
                // Q8_0's signed bytes plus 128: the sign bit flipped.
                |weights| {
                    if F::EIGHT_BITS {
                        _mm256_xor_si256(weights, sign_bit)
                    } else {
                        weights
                    }
                },
                |sum, weights, activation| _mm256_dpbusd_avx_epi32(sum, weights, activation),
            )
        })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dots_avx2<F: Grouped, const N: usize>(
        group: &[u8],
        activations: [&[ActivationBlock]; N],
        prefetch: bool,
    ) -> [[f32; GROUP]; N] {
        let ones = _mm256_set1_epi16(1);
        // `maddubs` sums pairs into i16: 4- and 5-bit weight bytes are at
        // most 31 and activations at most 127 in magnitude, so that fits
        // with room; Q8_0's bytes are signed, so it takes their magnitude
        // (at most 128) times the activation with the weight's sign
        // (32,512 at most), and needs no offset.
        let offset = if F::EIGHT_BITS { 0 } else { F::OFFSET };
        halves(|half| {
            dots::<F, N>(
                group,
                half,
                activations,
                prefetch && half == 0,
                offset,
                |weights| weights,
                |sum, weights, activation| {
                    let pairs = if F::EIGHT_BITS {
                        _mm256_maddubs_epi16(
                            _mm256_sign_epi8(weights, weights),
                            _mm256_sign_epi8(activation, weights),
                        )
                    } else {
                        _mm256_maddubs_epi16(weights, activation)
                    };
                    _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones))
                },
            )
        })
    }

    /// Asks for the bytes `PREFETCH_AHEAD` past `block` of `group`. A
    /// matrix's groups lie one after another and are read in order, so
    /// those are further along the matrix (a later group's, or this one's
    /// for rows wider than that), which the loop reaches a few
    /// microseconds on: a decode step streams each weight once, and the
    /// hardware's own prefetcher alone left a tenth of its speed on the
    /// table here. The bytes may be another thread's piece, or past the
    /// matrix's end; the program never reads them through this address.
    #[inline]
    fn prefetch_ahead(group: &[u8], block: usize, len: usize) {
        let ahead = group.as_ptr().wrapping_add(block + super::PREFETCH_AHEAD);
        let mut line = 0;
        while line < len {
            // SAFETY: the pointer is never dereferenced by the program: a
            // prefetch is a hint that changes no value it sees, an address
            // outside any mapping does not fault, and SSE, which it needs,
            // is part of every x86-64 CPU.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast::<i8>()) };
            line += 64;
        }
    }

    fn load_32(bytes: &[u8]) -> __m256i {
        let mut array = [0u8; 32];
        array.copy_from_slice(&bytes[..32]);
        bytemuck::cast(array)
    }

    /// The first 64 bytes of `bytes` (which must hold them).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn load_64(bytes: &[u8]) -> __m512i {
        let bytes = &bytes[..64];
        // SAFETY: `bytes` holds 64 bytes (the slice above panics if not),
        // and an unaligned load reads exactly those; AVX-512F is enabled.
        unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
    }

    /// Eight f16 values as f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn eight_f16(bytes: &[u8]) -> __m256 {
        let mut array = [0u8; 16];
        array.copy_from_slice(&bytes[..16]);
        _mm256_cvtph_ps(bytemuck::cast(array))
    }

    /// The loop the 256-bit paths share, over the group's rows
    /// `8 * half..8 * half + 8`: `prepare` turns a register of weight bytes
    /// into what `dot` takes, `dot` adds four weight bytes times four
    /// activation bytes into each i32 lane, and each lane starts at
    /// `-offset` times the activation quants' sum.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn dots<F: Grouped, const N: usize>(
        group: &[u8],
        half: usize,
        activations: [&[ActivationBlock]; N],
        prefetch: bool,
        offset: i32,
        prepare: impl Fn(__m256i) -> __m256i,
        dot: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) -> [[f32; GROUP / 2]; N] {
        let low_nibble = _mm256_set1_epi8(0x0F);
        let fifth_bit = _mm256_set1_epi8(0x10);
        // Where this half's bytes start in a scale or minimum list, and
        // in a chunk.
        let (values, chunk) = (2 * (GROUP / 2) * half, 4 * (GROUP / 2) * half);
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, block) in group.chunks_exact(F::GROUP_BLOCK_BYTES).enumerate() {
            if prefetch {
                prefetch_ahead(group, b * F::GROUP_BLOCK_BYTES, F::GROUP_BLOCK_BYTES);
            }
            let scales = eight_f16(&block[SCALES + values..]);
            let high = if F::FIVE_BITS {
                load_32(&block[F::HIGH + chunk..])
            } else {
                _mm256_setzero_si256()
            };
            let mut sums: [__m256i; N] =
                std::array::from_fn(|r| _mm256_set1_epi32(-offset * activations[r][b].sum));
            let words: [[i32; 8]; N] =
                std::array::from_fn(|r| bytemuck::cast(activations[r][b].qs));
            for c in 0..4 {
                // The weights of quants 4c..4c+4 and 16+4c..16+4c+4 of
                // every row.
                let (mut first, mut second);
                if F::EIGHT_BITS {
                    first = load_32(&block[F::NIBBLES + CHUNK * c + chunk..]);
                    second = load_32(&block[F::NIBBLES + CHUNK * (c + 4) + chunk..]);
                } else {
                    let nibbles = load_32(&block[F::NIBBLES + CHUNK * c + chunk..]);
                    first = _mm256_and_si256(nibbles, low_nibble);
                    second = _mm256_and_si256(_mm256_srli_epi16::<4>(nibbles), low_nibble);
                }
                if F::FIVE_BITS {
                    // Quants 4c.. take bit c of the high bytes, quants 16 +
                    // 4c.. bit c + 4, each moved to bit 4 of its byte by a
                    // 16-bit shift: nothing crosses into bit 4 from the
                    // neighbouring byte.
                    first = _mm256_or_si256(
                        first,
                        _mm256_and_si256(
                            _mm256_sll_epi16(high, _mm_cvtsi32_si128(4 - c as i32)),
                            fifth_bit,
                        ),
                    );
                    second = _mm256_or_si256(
                        second,
                        _mm256_and_si256(
                            _mm256_srl_epi16(high, _mm_cvtsi32_si128(c as i32)),
                            fifth_bit,
                        ),
                    );
                }
                let (first, second) = (prepare(first), prepare(second));
                for r in 0..N {
                    sums[r] = dot(sums[r], first, _mm256_set1_epi32(words[r][c]));
                    sums[r] = dot(sums[r], second, _mm256_set1_epi32(words[r][c + 4]));
                }
            }
            let mins = if F::HAS_MIN {
                eight_f16(&block[F::MINS + values..])
            } else {
                _mm256_setzero_ps()
            };
            for r in 0..N {
                let a = &activations[r][b];
                let scale = _mm256_mul_ps(scales, _mm256_set1_ps(a.d));
                acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums[r]), acc[r]);
                if F::HAS_MIN {
                    acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.s), acc[r]);
                }
            }
        }
        acc.map(bytemuck::cast)
    }

    /// The loop of `dots` on 512-bit registers, all sixteen rows at once:
    /// each i32 lane is a row's, and takes four of its quants times the
    /// same four activation quants (broadcast from memory, so no shuffle).
    /// Two chains of integer sums per input row (quants `4c..` and
    /// `16 + 4c..`; Q8_0's chunks `j < 4` and `j >= 4`) meet at the block's
    /// end: each output gets the exact `isum` of the other paths and the
    /// same float operations after it, so the same bits.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    fn dots_avx512<F: Grouped, const N: usize>(
        group: &[u8],
        activations: [&[ActivationBlock]; N],
        prefetch: bool,
    ) -> [[f32; GROUP]; N] {
        let low_nibble = _mm512_set1_epi8(0x0F);
        let fifth_bit = _mm512_set1_epi8(0x10);
        let sign_bit = _mm512_set1_epi8(0x80u8 as i8);
        let mut acc = [_mm512_setzero_ps(); N];
        for (b, block) in group.chunks_exact(F::GROUP_BLOCK_BYTES).enumerate() {
            if prefetch {
                prefetch_ahead(group, b * F::GROUP_BLOCK_BYTES, F::GROUP_BLOCK_BYTES);
            }
            let high = if F::FIVE_BITS {
                load_64(&block[F::HIGH..])
            } else {
                _mm512_setzero_si512()
            };
            let mut firsts: [__m512i; N] =
                std::array::from_fn(|r| _mm512_set1_epi32(-F::OFFSET * activations[r][b].sum));
            let mut seconds = [_mm512_setzero_si512(); N];
            let words: [&[i32; 8]; N] =
                std::array::from_fn(|r| bytemuck::cast_ref(&activations[r][b].qs));
            for c in 0..4 {
                let (mut first, mut second);
                if F::EIGHT_BITS {
                    first = _mm512_xor_si512(load_64(&block[F::NIBBLES + CHUNK * c..]), sign_bit);
                    second =
                        _mm512_xor_si512(load_64(&block[F::NIBBLES + CHUNK * (c + 4)..]), sign_bit);
                } else {
                    let nibbles = load_64(&block[F::NIBBLES + CHUNK * c..]);
                    first = _mm512_and_si512(nibbles, low_nibble);
                    second = _mm512_and_si512(_mm512_srli_epi16::<4>(nibbles), low_nibble);
                }
                if F::FIVE_BITS {
                    // As in `dots`.
                    first = _mm512_or_si512(
                        first,
                        _mm512_and_si512(
                            _mm512_sll_epi16(high, _mm_cvtsi32_si128(4 - c as i32)),
                            fifth_bit,
                        ),
                    );
                    second = _mm512_or_si512(
                        second,
                        _mm512_and_si512(
                            _mm512_srl_epi16(high, _mm_cvtsi32_si128(c as i32)),
                            fifth_bit,
                        ),
                    );
                }
                for r in 0..N {
                    firsts[r] =
                        _mm512_dpbusd_epi32(firsts[r], first, _mm512_set1_epi32(words[r][c]));
                    seconds[r] =
                        _mm512_dpbusd_epi32(seconds[r], second, _mm512_set1_epi32(words[r][c + 4]));
                }
            }
            let scales = _mm512_cvtph_ps(load_32(&block[SCALES..]));
            let mins = if F::HAS_MIN {
                _mm512_cvtph_ps(load_32(&block[F::MINS..]))
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..N {
                let a = &activations[r][b];
                let isum = _mm512_add_epi32(firsts[r], seconds[r]);
                let scale = _mm512_mul_ps(scales, _mm512_set1_ps(a.d));
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[r]);
                if F::HAS_MIN {
                    acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.s), acc[r]);
                }
            }
        }
        acc.map(|acc| {
            let halves: [[f32; GROUP / 2]; 2] = [
                bytemuck::cast(_mm512_castps512_ps256(acc)),
                bytemuck::cast(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(acc),
                ))),
            ];
            std::array::from_fn(|i| halves.as_flattened()[i])
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quantize_activations;
    use candle_core::Device;
    use candle_core::quantized::QTensor;
    use proptest::prelude::*;

    /// `group_rows` into a buffer of its own.
    fn grouped_vec<F: Grouped>(stored: &[u8], rows: usize, row_blocks: usize) -> Vec<u8> {
        let mut grouped = vec![0u8; rows.div_ceil(GROUP) * row_blocks * F::GROUP_BLOCK_BYTES];
        group_rows::<F>(stored, rows, row_blocks, &mut grouped);
        grouped
    }

    fn stored<F: Grouped>(rows: usize, cols: usize, seed: u64) -> QTensor {
        crate::kernels::tests::quantized(F::FORMAT, rows, cols, seed)
    }

    fn activations(rows: usize, cols: usize) -> Vec<Vec<ActivationBlock>> {
        (0..rows)
            .map(|row| {
                let input: Vec<f32> = (0..cols)
                    .map(|i| match row % 3 {
                        // Every quant at +-127.
                        0 => {
                            if (i + row) % 3 == 0 {
                                -1.0
                            } else {
                                1.0
                            }
                        }
                        _ => ((i * (row + 2)) as f32 * 0.37).sin(),
                    })
                    .collect();
                let mut out = Vec::new();
                quantize_activations(&input, &mut out);
                out
            })
            .collect()
    }

    /// A group's quants, scales and minimums read back as candle
    /// dequantizes the stored blocks.
    #[test]
    fn grouped_blocks_read_as_candle_dequantizes() {
        fn check<F: Grouped>() {
            let (rows, cols) = (11, 96);
            let q = stored::<F>(rows, cols, 5);
            let dense = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let grouped = grouped_vec::<F>(&q.data().unwrap(), rows, cols / BLOCK_ELEMS);
            for (row, weights) in dense.iter().enumerate() {
                let (group, r) = (row / GROUP, row % GROUP);
                for b in 0..cols / BLOCK_ELEMS {
                    let block = &grouped
                        [(group * (cols / BLOCK_ELEMS) + b) * F::GROUP_BLOCK_BYTES..]
                        [..F::GROUP_BLOCK_BYTES];
                    let d = f16_at(block, SCALES + 2 * r);
                    for (i, q) in quants_of::<F>(block, r).iter().enumerate() {
                        let weight = if F::HAS_MIN {
                            d * f32::from(*q) + f16_at(block, F::MINS + 2 * r)
                        } else {
                            d * (f32::from(*q) - F::OFFSET as f32)
                        };
                        assert_eq!(weight, weights[b * 32 + i], "{:?}", F::FORMAT);
                    }
                }
            }
        }
        check::<Q4_0>();
        check::<Q4_1>();
        check::<Q5_0>();
        check::<Q8_0>();
    }

    /// Every SIMD path this CPU has and the scalar one give the same bits,
    /// one to four input rows at a time, on a last group short of eight
    /// rows too.
    #[test]
    fn simd_and_scalar_paths_agree() {
        fn check<F: Grouped>() {
            let (rows, cols) = (29, 160);
            let q = stored::<F>(rows, cols, 9);
            let mut grouped = grouped_vec::<F>(&q.data().unwrap(), rows, cols / BLOCK_ELEMS);
            if F::EIGHT_BITS {
                // Row 0's first block at -128, which candle never writes:
                // the AVX2 path takes its magnitude, 128, as an unsigned
                // byte.
                for j in 0..8 {
                    grouped[F::NIBBLES + CHUNK * j..][..4].fill(0x80);
                }
            }
            let inputs = activations(4, cols);
            let group_bytes = cols / BLOCK_ELEMS * F::GROUP_BLOCK_BYTES;
            #[cfg(target_arch = "x86_64")]
            let paths = simd::available();
            #[cfg(target_arch = "x86_64")]
            if paths.is_empty() {
                eprintln!(
                    "SKIP the SIMD half of simd_and_scalar_paths_agree: no AVX2, FMA and F16C"
                );
            }
            for group in grouped.chunks_exact(group_bytes) {
                let scalar: Vec<[f32; GROUP]> = inputs
                    .iter()
                    .map(|a| std::array::from_fn(|r| dot_scalar::<F>(group, r, a)))
                    .collect();
                #[cfg(target_arch = "x86_64")]
                for &path in &paths {
                    let four = simd::group_dots::<F, 4>(
                        path,
                        group,
                        std::array::from_fn(|i| &inputs[i][..]),
                        true,
                    );
                    for (got, want) in four.iter().zip(&scalar) {
                        assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{path:?}");
                    }
                    let three = simd::group_dots::<F, 3>(
                        path,
                        group,
                        std::array::from_fn(|i| &inputs[i + 1][..]),
                        true,
                    );
                    for (got, want) in three.iter().zip(&scalar[1..]) {
                        assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{path:?}");
                    }
                    let two = simd::group_dots::<F, 2>(
                        path,
                        group,
                        [&inputs[3][..], &inputs[0][..]],
                        true,
                    );
                    assert_eq!(
                        two[0].map(f32::to_bits),
                        scalar[3].map(f32::to_bits),
                        "{path:?}"
                    );
                    assert_eq!(
                        two[1].map(f32::to_bits),
                        scalar[0].map(f32::to_bits),
                        "{path:?}"
                    );
                    let [one] = simd::group_dots::<F, 1>(path, group, [&inputs[2][..]], true);
                    assert_eq!(
                        one.map(f32::to_bits),
                        scalar[2].map(f32::to_bits),
                        "{path:?}"
                    );
                }
            }
        }
        check::<Q4_0>();
        check::<Q4_1>();
        check::<Q5_0>();
        check::<Q8_0>();
    }

    fn gives_every_row_back<F: Grouped>(rows: usize, row_blocks: usize, seed: u64) {
        let stored: Vec<u8> = (0..rows * row_blocks * F::STORED_BYTES)
            .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).to_le_bytes()[3])
            .collect();
        let grouped = grouped_vec::<F>(&stored, rows, row_blocks);
        assert_eq!(
            grouped.len(),
            rows.div_ceil(GROUP) * GROUP * row_blocks * F::STORED_BYTES
        );
        let mut back = Vec::new();
        for row in 0..rows {
            stored_row::<F>(&grouped, row, row_blocks, &mut back);
        }
        assert_eq!(back, stored, "{:?}", F::FORMAT);
    }

    proptest! {
        /// Grouping is a rearrangement: every row's stored blocks come
        /// back as they were.
        #[test]
        fn grouping_gives_every_row_back(
            rows in 1usize..20,
            row_blocks in 1usize..4,
            seed in any::<u64>(),
        ) {
            gives_every_row_back::<Q4_0>(rows, row_blocks, seed);
            gives_every_row_back::<Q4_1>(rows, row_blocks, seed);
            gives_every_row_back::<Q5_0>(rows, row_blocks, seed);
            gives_every_row_back::<Q8_0>(rows, row_blocks, seed);
        }
    }
}
