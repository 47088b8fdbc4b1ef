//! Matrices held as groups of sixteen weight rows, so that one SIMD
//! instruction works on eight or sixteen outputs at once (docs/engine.md):
//! Q4_0, Q4_1, Q5_0 and Q8_0 (blocks of 32 weights), and Q4_K, Q5_K and
//! Q6_K (superblocks of 256 weights, eight sub-blocks of 32 with their own
//! scales).
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
//! conversion, scale and add happen once per 32 weights for all of them.
//!
//! A group's block is its sixteen rows' stored blocks rearranged, not
//! widened: a header, then one run of quants per 32-weight sub-block (one
//! for the 32-weight formats, eight for the K-quants).
//!
//! - The header: the sixteen f16 scales `d`; the sixteen f16 minimums
//!   (Q4_1's `m`, Q4_K's and Q5_K's `dmin`); their 6-bit sub-block scales and
//!   minimums unpacked to a byte each (`[sub-block][row]`); Q6_K's signed
//!   scales of each 16 weights (`[sixteenth][row]`).
//! - A sub-block's quants: four 64-byte chunks of nibbles (chunk `c`, byte
//!   `4r + t`: row `r`'s quant `4c + t` in the low nibble, quant
//!   `16 + 4c + t` in the high one); for Q5_0 and Q5_K then 64 bytes of fifth bits
//!   (byte `4r + t`, bit `j`: the fifth bit of row `r`'s quant `4j + t`);
//!   for Q6_K then two 64-byte planes of the two high bits (byte `4r + t`,
//!   bits `2c, 2c + 1`: those of row `r`'s quant `4c + t`, in the first
//!   plane, and of its quant `16 + 4c + t`, in the second). Q8_0's are
//!   eight 64-byte chunks of its signed quants (chunk `j`, byte `4r + t`:
//!   row `r`'s quant `4j + t`).
//!
//! So a chunk's first 32 bytes are rows 0-7 and its last 32 rows 8-15. The
//! block is the stored bytes' size, but for Q4_K's and Q5_K's unpacked
//! sub-block scales (2,368 bytes for sixteen 144-byte Q4_K blocks, 2,880
//! for sixteen 176-byte Q5_K ones). A last group short of
//! sixteen rows is filled with zero blocks (scale 0), which add nothing
//! and are never read out.
//!
//! Each output is, sub-block after sub-block, `acc = (d_w * d_a) * isum +
//! acc`, one fused multiply-add, where `d_w` is the row's scale (times the
//! sub-block's scale for the K-quants, an exact product) and `isum` the
//! exact integer product of the quants as the format means them (where a
//! path takes the quants as unsigned bytes, each sum starts at minus the
//! format's offset times the activation quants' sum, so the unsigned
//! quants give the signed sum; the AVX2 path takes Q8_0's signed bytes by
//! magnitude and sign instead, from 0). Then Q4_1 adds `m_w * s_a` and
//! Q4_K and Q5_K subtract `(dmin * m) * (d_a * sum_a)`, each one fused
//! multiply-add; Q6_K, whose scales change every 16 weights, adds the two
//! halves' products one after the other, each with its own scale.
//! So an output's bits depend on its weight row and activation row alone,
//! not on which rows share a group or a pass, and every path gives the
//! scalar path's bits.

use super::{ActivationBlock, BLOCK_ELEMS, BlockFormat};
use half::f16;

/// Weight rows per group.
pub(super) const GROUP: usize = 16;
/// Bytes of a chunk of a group's quants: four quants of each row.
const CHUNK: usize = 4 * GROUP;
/// How far ahead of the block it reads the first pass over a group asks
/// for weights (bytes): measured on SmolLM2's decode, 4 to 32 KiB all gave
/// the same 10 % over none; a few groups of its widest rows.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 16 * 1024;
/// Where a group's block holds its scales.
const SCALES: usize = 0;
/// Where it holds its minimums (Q4_1, Q4_K).
const MINS: usize = 2 * GROUP;

/// What differs between the grouped formats.
pub(super) trait Grouped {
    const FORMAT: BlockFormat;
    /// How far the quants as unsigned bytes (4-, 5- and 6-bit quants as
    /// stored; Q8_0's with the sign bit flipped) are above the values
    /// meant.
    const OFFSET: i32;
    /// Whether blocks carry a minimum (Q4_1: weight `d * q + m`; Q4_K and
    /// Q5_K: `d * sc * q - dmin * m`).
    const HAS_MIN: bool;
    /// Whether quants have a fifth bit (Q5_0, Q5_K).
    const FIVE_BITS: bool = false;
    /// Whether quants have two high bits (Q6_K).
    const SIX_BITS: bool = false;
    /// Whether quants are whole signed bytes (Q8_0), stored as they are:
    /// the offset (128) is applied on the way in, by the VNNI paths (which
    /// flip each byte's sign bit) and the scalar one.
    const EIGHT_BITS: bool = false;
    /// 32-weight sub-blocks of a stored block: eight for the K-quants'
    /// superblocks, whose sub-blocks have scales of their own.
    const SUB_BLOCKS: usize = 1;
    /// Bytes of one stored block.
    const STORED_BYTES: usize = Self::FORMAT.block_bytes();
    /// Where the sub-block scales start (K-quants).
    const SUB_SCALES: usize = 0;
    /// Where Q4_K's and Q5_K's sub-block minimums start.
    const SUB_MINS: usize = 0;
    /// Bytes of a group's block before its quants.
    const HEADER: usize;
    /// Bytes of a group's quants of one sub-block.
    const SUB_BYTES: usize = CHUNK
        * if Self::EIGHT_BITS {
            8
        } else {
            4 + Self::FIVE_BITS as usize + 2 * Self::SIX_BITS as usize
        };
    /// Bytes of one block of a group.
    const GROUP_BLOCK_BYTES: usize = Self::HEADER + Self::SUB_BLOCKS * Self::SUB_BYTES;
    /// Where the stored block's quant bytes start (the 32-weight formats).
    const STORED_QUANTS: usize = 0;
    /// Chunks whose `maddubs` pairs (both halves', which share a scale)
    /// the AVX2 loop adds as i16 before one `madd` widens them: a pair is
    /// at most 2 · 15 · 127 = 3,810 for 4 bits (eight of them: 30,480)
    /// and 7,874 for 5 bits (four: 31,496), under i16's 32,767. Q6_K's
    /// halves have scales of their own and its pairs reach 16,002, Q8_0's
    /// 32,512: each widened at once (1). Exact integers either way, so
    /// the same bits.
    const PAIR_CHUNKS: usize = if Self::EIGHT_BITS || Self::SIX_BITS {
        1
    } else if Self::FIVE_BITS {
        2
    } else {
        4
    };
}

#[derive(Debug)]
pub(super) struct Q4_0;
#[derive(Debug)]
pub(super) struct Q4_1;
#[derive(Debug)]
pub(super) struct Q5_0;
#[derive(Debug)]
pub(super) struct Q8_0;
#[derive(Debug)]
pub(super) struct Q4K;
#[derive(Debug)]
pub(super) struct Q5K;
#[derive(Debug)]
pub(super) struct Q6K;

impl Grouped for Q4_0 {
    const FORMAT: BlockFormat = BlockFormat::Q4_0;
    const OFFSET: i32 = 8;
    const HAS_MIN: bool = false;
    const HEADER: usize = 2 * GROUP;
    const STORED_QUANTS: usize = 2;
}

impl Grouped for Q4_1 {
    const FORMAT: BlockFormat = BlockFormat::Q4_1;
    const OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    const HEADER: usize = 4 * GROUP;
    const STORED_QUANTS: usize = 4;
}

impl Grouped for Q5_0 {
    const FORMAT: BlockFormat = BlockFormat::Q5_0;
    const OFFSET: i32 = 16;
    const HAS_MIN: bool = false;
    const FIVE_BITS: bool = true;
    const HEADER: usize = 2 * GROUP;
    const STORED_QUANTS: usize = 6;
}

impl Grouped for Q8_0 {
    const FORMAT: BlockFormat = BlockFormat::Q8_0;
    const OFFSET: i32 = 128;
    const HAS_MIN: bool = false;
    const EIGHT_BITS: bool = true;
    const HEADER: usize = 2 * GROUP;
    const STORED_QUANTS: usize = 2;
}

impl Grouped for Q4K {
    const FORMAT: BlockFormat = BlockFormat::Q4K;
    const OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    const SUB_BLOCKS: usize = 8;
    const SUB_SCALES: usize = 4 * GROUP;
    const SUB_MINS: usize = Self::SUB_SCALES + 8 * GROUP;
    const HEADER: usize = Self::SUB_MINS + 8 * GROUP;
}

impl Grouped for Q5K {
    const FORMAT: BlockFormat = BlockFormat::Q5K;
    const OFFSET: i32 = 0;
    const HAS_MIN: bool = true;
    const FIVE_BITS: bool = true;
    const SUB_BLOCKS: usize = 8;
    const SUB_SCALES: usize = 4 * GROUP;
    const SUB_MINS: usize = Self::SUB_SCALES + 8 * GROUP;
    const HEADER: usize = Self::SUB_MINS + 8 * GROUP;
}

impl Grouped for Q6K {
    const FORMAT: BlockFormat = BlockFormat::Q6K;
    const OFFSET: i32 = 32;
    const HAS_MIN: bool = false;
    const SIX_BITS: bool = true;
    const SUB_BLOCKS: usize = 8;
    const SUB_SCALES: usize = 2 * GROUP;
    const HEADER: usize = Self::SUB_SCALES + 16 * GROUP;
}

/// The bytes of one block of a group in format `format`.
pub(super) const fn group_block_bytes(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q4_0 => Q4_0::GROUP_BLOCK_BYTES,
        BlockFormat::Q4_1 => Q4_1::GROUP_BLOCK_BYTES,
        BlockFormat::Q5_0 => Q5_0::GROUP_BLOCK_BYTES,
        BlockFormat::Q8_0 => Q8_0::GROUP_BLOCK_BYTES,
        BlockFormat::Q4K => Q4K::GROUP_BLOCK_BYTES,
        BlockFormat::Q5K => Q5K::GROUP_BLOCK_BYTES,
        BlockFormat::Q6K => Q6K::GROUP_BLOCK_BYTES,
    }
}

/// Weights of a K-quant superblock.
const SUPER_ELEMS: usize = 256;

/// A stored block's quants as unsigned values (Q8_0's as stored), its
/// superblock's in order for the K-quants.
fn stored_quants<F: Grouped>(block: &[u8]) -> [u8; SUPER_ELEMS] {
    let mut quants = [0u8; SUPER_ELEMS];
    match F::FORMAT {
        BlockFormat::Q8_0 => {
            quants[..BLOCK_ELEMS].copy_from_slice(&block[F::STORED_QUANTS..][..BLOCK_ELEMS]);
        }
        BlockFormat::Q4K | BlockFormat::Q5K => {
            // Four 32-byte runs: run c's low nibbles are quants 64c..,
            // its high nibbles quants 64c + 32... Q5_K's 32 bytes of fifth
            // bits come first: byte l's bit 2c is that of quant 64c + l,
            // its bit 2c + 1 that of quant 64c + 32 + l.
            let (high, runs) = if F::FIVE_BITS {
                (&block[16..48], &block[48..176])
            } else {
                (&[0u8; 32][..], &block[16..144])
            };
            for (c, run) in runs.chunks_exact(32).enumerate() {
                for (i, byte) in run.iter().enumerate() {
                    quants[64 * c + i] = (byte & 0x0F) | (((high[i] >> (2 * c)) & 1) << 4);
                    quants[64 * c + 32 + i] = (byte >> 4) | (((high[i] >> (2 * c + 1)) & 1) << 4);
                }
            }
        }
        BlockFormat::Q6K => {
            // ggml's layout: two halves of 128 quants, each from 64 bytes
            // of low nibbles and 32 of high bit pairs.
            for h in 0..2 {
                let (low, high) = (&block[64 * h..][..64], &block[128 + 32 * h..][..32]);
                for l in 0..32 {
                    let q = &mut quants[128 * h..];
                    q[l] = (low[l] & 0x0F) | ((high[l] & 3) << 4);
                    q[l + 32] = (low[l + 32] & 0x0F) | (((high[l] >> 2) & 3) << 4);
                    q[l + 64] = (low[l] >> 4) | (((high[l] >> 4) & 3) << 4);
                    q[l + 96] = (low[l + 32] >> 4) | (((high[l] >> 6) & 3) << 4);
                }
            }
        }
        _ => {
            let high = if F::FIVE_BITS {
                u32::from_le_bytes([block[2], block[3], block[4], block[5]])
            } else {
                0
            };
            for (i, byte) in block[F::STORED_QUANTS..F::STORED_QUANTS + 16]
                .iter()
                .enumerate()
            {
                quants[i] = (byte & 0x0F) | ((((high >> i) & 1) as u8) << 4);
                quants[i + 16] = (byte >> 4) | ((((high >> (i + 16)) & 1) as u8) << 4);
            }
        }
    }
    quants
}

/// ggml's 6-bit scale and minimum of Q4_K sub-block `j` from a
/// superblock's 12 packed bytes.
fn scale_min_k4(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// The 12 packed bytes of eight 6-bit scales and minimums: what
/// `scale_min_k4` reads back.
fn pack_scale_min_k4(scales: [u8; 8], mins: [u8; 8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = (scales[j] & 63) | ((scales[j + 4] >> 4) << 6);
        packed[j + 4] = (mins[j] & 63) | ((mins[j + 4] >> 4) << 6);
        packed[j + 8] = (scales[j + 4] & 0x0F) | ((mins[j + 4] & 0x0F) << 4);
    }
    packed
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
            match F::FORMAT {
                BlockFormat::Q4K | BlockFormat::Q5K => {
                    out[SCALES + 2 * r..][..2].copy_from_slice(&block[..2]);
                    out[MINS + 2 * r..][..2].copy_from_slice(&block[2..4]);
                    for j in 0..8 {
                        let (scale, min) = scale_min_k4(j, &block[4..16]);
                        out[F::SUB_SCALES + j * GROUP + r] = scale;
                        out[F::SUB_MINS + j * GROUP + r] = min;
                    }
                }
                BlockFormat::Q6K => {
                    out[SCALES + 2 * r..][..2].copy_from_slice(&block[208..210]);
                    for (k, scale) in block[192..208].iter().enumerate() {
                        out[F::SUB_SCALES + k * GROUP + r] = *scale;
                    }
                }
                _ => {
                    out[SCALES + 2 * r..][..2].copy_from_slice(&block[..2]);
                    if F::HAS_MIN {
                        out[MINS + 2 * r..][..2].copy_from_slice(&block[2..4]);
                    }
                }
            }
            let quants = stored_quants::<F>(block);
            for s in 0..F::SUB_BLOCKS {
                let sub = &mut out[F::HEADER + s * F::SUB_BYTES..][..F::SUB_BYTES];
                put_quants::<F>(sub, r, &quants[BLOCK_ELEMS * s..][..BLOCK_ELEMS]);
            }
        }
    }
}

/// Row `r`'s 32 quants of a sub-block (unsigned; Q8_0's as stored) into
/// the group's quants of that sub-block.
fn put_quants<F: Grouped>(sub: &mut [u8], r: usize, quants: &[u8]) {
    if F::EIGHT_BITS {
        // Chunk j, byte 4r + t: row r's quant 4j + t, as stored.
        for j in 0..8 {
            sub[CHUNK * j + 4 * r..][..4].copy_from_slice(&quants[4 * j..][..4]);
        }
        return;
    }
    for c in 0..4 {
        for t in 0..4 {
            let (first, second) = (quants[4 * c + t], quants[16 + 4 * c + t]);
            sub[CHUNK * c + 4 * r + t] = (first & 0x0F) | ((second & 0x0F) << 4);
            if F::SIX_BITS {
                sub[4 * CHUNK + 4 * r + t] |= ((first >> 4) & 3) << (2 * c);
                sub[5 * CHUNK + 4 * r + t] |= ((second >> 4) & 3) << (2 * c);
            }
        }
    }
    if F::FIVE_BITS {
        for t in 0..4 {
            sub[4 * CHUNK + 4 * r + t] =
                (0..8).fold(0u8, |bits, j| bits | (((quants[4 * j + t] >> 4) & 1) << j));
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
        let mut quants = [0u8; SUPER_ELEMS];
        for s in 0..F::SUB_BLOCKS {
            quants[BLOCK_ELEMS * s..][..BLOCK_ELEMS].copy_from_slice(&quants_of::<F>(
                &block[F::HEADER + s * F::SUB_BYTES..][..F::SUB_BYTES],
                r,
            ));
        }
        // Room for the widest stored block (Q6_K's).
        let mut stored = [0u8; BlockFormat::Q6K.block_bytes()];
        match F::FORMAT {
            BlockFormat::Q4K | BlockFormat::Q5K => {
                stored[..2].copy_from_slice(&block[SCALES + 2 * r..][..2]);
                stored[2..4].copy_from_slice(&block[MINS + 2 * r..][..2]);
                let scales = std::array::from_fn(|j| block[F::SUB_SCALES + j * GROUP + r]);
                let mins = std::array::from_fn(|j| block[F::SUB_MINS + j * GROUP + r]);
                stored[4..16].copy_from_slice(&pack_scale_min_k4(scales, mins));
                // As `stored_quants` reads them: Q5_K's fifth bits, then
                // the runs of nibbles.
                let runs = if F::FIVE_BITS { 48 } else { 16 };
                for c in 0..4 {
                    for i in 0..32 {
                        let (low, high) = (quants[64 * c + i], quants[64 * c + 32 + i]);
                        stored[runs + 32 * c + i] = (low & 0x0F) | ((high & 0x0F) << 4);
                        if F::FIVE_BITS {
                            stored[16 + i] |=
                                ((low >> 4) << (2 * c)) | ((high >> 4) << (2 * c + 1));
                        }
                    }
                }
            }
            BlockFormat::Q6K => {
                for h in 0..2 {
                    let q = &quants[128 * h..];
                    for l in 0..32 {
                        stored[64 * h + l] = (q[l] & 0x0F) | ((q[l + 64] & 0x0F) << 4);
                        stored[64 * h + l + 32] = (q[l + 32] & 0x0F) | ((q[l + 96] & 0x0F) << 4);
                        stored[128 + 32 * h + l] = (q[l] >> 4)
                            | ((q[l + 32] >> 4) << 2)
                            | ((q[l + 64] >> 4) << 4)
                            | ((q[l + 96] >> 4) << 6);
                    }
                }
                for k in 0..16 {
                    stored[192 + k] = block[F::SUB_SCALES + k * GROUP + r];
                }
                stored[208..210].copy_from_slice(&block[SCALES + 2 * r..][..2]);
            }
            _ => {
                stored[..2].copy_from_slice(&block[SCALES + 2 * r..][..2]);
                if F::HAS_MIN {
                    stored[2..4].copy_from_slice(&block[MINS + 2 * r..][..2]);
                }
                if F::FIVE_BITS {
                    let high = (0..BLOCK_ELEMS)
                        .fold(0u32, |high, i| high | (u32::from(quants[i] >> 4) << i));
                    stored[2..6].copy_from_slice(&high.to_le_bytes());
                }
                if F::EIGHT_BITS {
                    for (stored, quant) in stored[F::STORED_QUANTS..].iter_mut().zip(&quants) {
                        *stored = quant ^ 0x80;
                    }
                } else {
                    for i in 0..16 {
                        stored[F::STORED_QUANTS + i] =
                            (quants[i] & 0x0F) | ((quants[i + 16] & 0x0F) << 4);
                    }
                }
            }
        }
        out.extend_from_slice(&stored[..F::STORED_BYTES]);
    }
}

/// Row `r`'s 32 unsigned quants in a group's quants of one sub-block.
fn quants_of<F: Grouped>(sub: &[u8], r: usize) -> [u8; BLOCK_ELEMS] {
    let mut quants = [0u8; BLOCK_ELEMS];
    if F::EIGHT_BITS {
        for j in 0..8 {
            for t in 0..4 {
                quants[4 * j + t] = sub[CHUNK * j + 4 * r + t] ^ 0x80;
            }
        }
        return quants;
    }
    for c in 0..4 {
        for t in 0..4 {
            let nibbles = sub[CHUNK * c + 4 * r + t];
            quants[4 * c + t] = nibbles & 0x0F;
            quants[16 + 4 * c + t] = nibbles >> 4;
            if F::SIX_BITS {
                quants[4 * c + t] |= ((sub[4 * CHUNK + 4 * r + t] >> (2 * c)) & 3) << 4;
                quants[16 + 4 * c + t] |= ((sub[5 * CHUNK + 4 * r + t] >> (2 * c)) & 3) << 4;
            }
        }
    }
    if F::FIVE_BITS {
        for t in 0..4 {
            let bits = sub[4 * CHUNK + 4 * r + t];
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

/// Row `r`'s weight scale for sub-block `s` of a group's block, for its
/// quants `16 * half..` (the halves differ for Q6_K alone): `d`, times the
/// sub-block's scale for the K-quants (an exact product in f32).
fn scale_of<F: Grouped>(block: &[u8], s: usize, half: usize, r: usize) -> f32 {
    let d = f16_at(block, SCALES + 2 * r);
    match F::FORMAT {
        BlockFormat::Q4K | BlockFormat::Q5K => d * f32::from(block[F::SUB_SCALES + s * GROUP + r]),
        BlockFormat::Q6K => d * f32::from(block[F::SUB_SCALES + (2 * s + half) * GROUP + r] as i8),
        _ => d,
    }
}

/// Row `r`'s minimum for sub-block `s`: Q4_1's `m`, Q4_K's and Q5_K's
/// `dmin * m`.
fn min_of<F: Grouped>(block: &[u8], s: usize, r: usize) -> f32 {
    let m = f16_at(block, MINS + 2 * r);
    if F::SUB_BLOCKS > 1 {
        m * f32::from(block[F::SUB_MINS + s * GROUP + r])
    } else {
        m
    }
}

/// What a sub-block's minimum multiplies: Q4_1's `s_a` (as llama.cpp's
/// `q4_1 x q8_1`), Q4_K's and Q5_K's `d_a * sum_a` (llama.cpp's Q8_K sums
/// are exact).
fn min_activation<F: Grouped>(a: &ActivationBlock) -> f32 {
    if F::SUB_BLOCKS > 1 {
        a.d * a.sum as f32
    } else {
        a.s
    }
}

/// One group's outputs for `N` activation rows: `[row][lane]`, lane `r`
/// for the group's row `r`. `group` is the group's blocks, one per
/// stored block of each row (so `SUB_BLOCKS` activation blocks each).
/// `prefetch` on the first pass over a group (of a matrix read in order)
/// asks for the groups ahead of it.
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
    let blocks = group
        .chunks_exact(F::GROUP_BLOCK_BYTES)
        .flat_map(|block| (0..F::SUB_BLOCKS).map(move |s| (block, s)));
    for ((block, s), a) in blocks.zip(activations) {
        let quants = quants_of::<F>(&block[F::HEADER + s * F::SUB_BYTES..][..F::SUB_BYTES], r);
        let product = |from: usize| {
            quants[from..from + 16]
                .iter()
                .zip(&a.qs[from..from + 16])
                .fold(0i32, |sum, (q, x)| sum + i32::from(*q) * i32::from(*x))
        };
        let (first, second) = (product(0), product(16));
        if F::SIX_BITS {
            let first = first - F::OFFSET * a.half_sum;
            let second = second - F::OFFSET * (a.sum - a.half_sum);
            acc = (scale_of::<F>(block, s, 0, r) * a.d).mul_add(first as f32, acc);
            acc = (scale_of::<F>(block, s, 1, r) * a.d).mul_add(second as f32, acc);
            continue;
        }
        let isum = first + second - F::OFFSET * a.sum;
        acc = (scale_of::<F>(block, s, 0, r) * a.d).mul_add(isum as f32, acc);
        if F::SUB_BLOCKS > 1 && F::HAS_MIN {
            acc = (-min_of::<F>(block, s, r)).mul_add(min_activation::<F>(a), acc);
        } else if F::HAS_MIN {
            acc = min_of::<F>(block, s, r).mul_add(min_activation::<F>(a), acc);
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
    use super::{CHUNK, GROUP, Grouped, MINS, SCALES, min_activation};
    use crate::kernels::ActivationBlock;
    use crate::kernels::BlockFormat;
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
            dots::<F, N, false>(
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
                // `vpdpbusd` adds into the i32 sums itself.
                |sums| sums,
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
        // `maddubs` sums pairs into i16: 4-, 5- and 6-bit weight bytes are
        // at most 63 and activations at most 127 in magnitude (16,002 a
        // pair), so that fits with room; Q8_0's bytes are signed, so it
        // takes their magnitude (at most 128) times the activation with the
        // weight's sign (32,512 at most), and needs no offset.
        let offset = if F::EIGHT_BITS { 0 } else { F::OFFSET };
        halves(|half| {
            dots::<F, N, true>(
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
                    _mm256_add_epi16(sum, pairs)
                },
                |pairs| _mm256_madd_epi16(pairs, ones),
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

    /// Eight bytes as f32, unsigned (`signed` false) or signed.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn eight_bytes(bytes: &[u8], signed: bool) -> __m256 {
        let mut array = [0u8; 16];
        array[..8].copy_from_slice(&bytes[..8]);
        let bytes: __m128i = bytemuck::cast(array);
        _mm256_cvtepi32_ps(if signed {
            _mm256_cvtepi8_epi32(bytes)
        } else {
            _mm256_cvtepu8_epi32(bytes)
        })
    }

    /// Sixteen bytes as f32, unsigned (`signed` false) or signed.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn sixteen_bytes(bytes: &[u8], signed: bool) -> __m512 {
        let mut array = [0u8; 16];
        array.copy_from_slice(&bytes[..16]);
        let bytes: __m128i = bytemuck::cast(array);
        _mm512_cvtepi32_ps(if signed {
            _mm512_cvtepi8_epi32(bytes)
        } else {
            _mm512_cvtepu8_epi32(bytes)
        })
    }

    /// Where a sub-block's two sums start for an activation block: minus
    /// the offset times the sum of the quants each covers (Q6_K's halves
    /// have scales of their own, so each sum covers its own half).
    fn starts<F: Grouped>(offset: i32, a: &ActivationBlock) -> (i32, i32) {
        if F::SIX_BITS {
            (-offset * a.half_sum, -offset * (a.sum - a.half_sum))
        } else {
            (-offset * a.sum, 0)
        }
    }

    /// The loop the 256-bit paths share, over the group's rows
    /// `8 * half..8 * half + 8`: `prepare` turns a register of weight bytes
    /// into what `dot` takes, `dot` adds four weight bytes times four
    /// activation bytes into each i32 lane, and the sums start at
    /// `-offset` times the activation quants' sum (`starts`). With
    /// `PAIRS`, `dot` adds into i16 pairs instead, which `widen` turns
    /// into i32 lanes every [`Grouped::PAIR_CHUNKS`] chunks (above 1: both
    /// halves' pairs in one register).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn dots<F: Grouped, const N: usize, const PAIRS: bool>(
        group: &[u8],
        half: usize,
        activations: [&[ActivationBlock]; N],
        prefetch: bool,
        offset: i32,
        prepare: impl Fn(__m256i) -> __m256i,
        dot: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
        widen: impl Fn(__m256i) -> __m256i,
    ) -> [[f32; GROUP / 2]; N] {
        let low_nibble = _mm256_set1_epi8(0x0F);
        let fifth_bit = _mm256_set1_epi8(0x10);
        let high_pair = _mm256_set1_epi8(0x30);
        // Where this half's rows start in a list of bytes, of f16s, and in
        // a chunk.
        let rows = (GROUP / 2) * half;
        let (values, chunk) = (2 * rows, 4 * rows);
        // Quants 4c.. and 16 + 4c.. share one sum (and one scale) but for
        // Q6_K's halves; Q8_0's pairs are widened one at a time.
        let widen_every = if PAIRS { F::PAIR_CHUNKS } else { 0 };
        let merged = widen_every > 1;
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, block) in group.chunks_exact(F::GROUP_BLOCK_BYTES).enumerate() {
            if prefetch {
                prefetch_ahead(group, b * F::GROUP_BLOCK_BYTES, F::GROUP_BLOCK_BYTES);
            }
            let d = eight_f16(&block[SCALES + values..]);
            let m = if F::HAS_MIN {
                eight_f16(&block[MINS + values..])
            } else {
                _mm256_setzero_ps()
            };
            for s in 0..F::SUB_BLOCKS {
                let sub = &block[F::HEADER + s * F::SUB_BYTES..][..F::SUB_BYTES];
                let index = b * F::SUB_BLOCKS + s;
                let high = if F::FIVE_BITS || F::SIX_BITS {
                    load_32(&sub[4 * CHUNK + chunk..])
                } else {
                    _mm256_setzero_si256()
                };
                let high_second = if F::SIX_BITS {
                    load_32(&sub[5 * CHUNK + chunk..])
                } else {
                    _mm256_setzero_si256()
                };
                let mut firsts: [__m256i; N] = std::array::from_fn(|r| {
                    _mm256_set1_epi32(starts::<F>(offset, &activations[r][index]).0)
                });
                let mut seconds: [__m256i; N] = std::array::from_fn(|r| {
                    _mm256_set1_epi32(starts::<F>(offset, &activations[r][index]).1)
                });
                let words: [[i32; 8]; N] =
                    std::array::from_fn(|r| bytemuck::cast(activations[r][index].qs));
                let mut first_pairs = [_mm256_setzero_si256(); N];
                let mut second_pairs = [_mm256_setzero_si256(); N];
                for c in 0..4 {
                    // The weights of quants 4c..4c+4 and 16+4c..16+4c+4 of
                    // every row.
                    let (mut first, mut second);
                    if F::EIGHT_BITS {
                        first = load_32(&sub[CHUNK * c + chunk..]);
                        second = load_32(&sub[CHUNK * (c + 4) + chunk..]);
                    } else {
                        let nibbles = load_32(&sub[CHUNK * c + chunk..]);
                        first = _mm256_and_si256(nibbles, low_nibble);
                        second = _mm256_and_si256(_mm256_srli_epi16::<4>(nibbles), low_nibble);
                    }
                    if F::FIVE_BITS {
                        // Quants 4c.. take bit c of the high bytes, quants
                        // 16 + 4c.. bit c + 4, each moved to bit 4 of its
                        // byte by a 16-bit shift: nothing crosses into bit
                        // 4 from the neighbouring byte.
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
                    if F::SIX_BITS {
                        // Bits 2c and 2c + 1 of each plane's bytes moved to
                        // bits 4 and 5 (as for Q5_0, within each byte).
                        let to_bit_4 = |planes: __m256i| match c {
                            0 => _mm256_slli_epi16::<4>(planes),
                            1 => _mm256_slli_epi16::<2>(planes),
                            2 => planes,
                            _ => _mm256_srli_epi16::<2>(planes),
                        };
                        first = _mm256_or_si256(first, _mm256_and_si256(to_bit_4(high), high_pair));
                        second = _mm256_or_si256(
                            second,
                            _mm256_and_si256(to_bit_4(high_second), high_pair),
                        );
                    }
                    let (first, second) = (prepare(first), prepare(second));
                    for r in 0..N {
                        let (first_word, second_word) = (
                            _mm256_set1_epi32(words[r][c]),
                            _mm256_set1_epi32(words[r][c + 4]),
                        );
                        if widen_every == 0 {
                            firsts[r] = dot(firsts[r], first, first_word);
                            seconds[r] = dot(seconds[r], second, second_word);
                        } else if merged {
                            let pairs = dot(first_pairs[r], first, first_word);
                            first_pairs[r] = dot(pairs, second, second_word);
                        } else {
                            first_pairs[r] = dot(first_pairs[r], first, first_word);
                            second_pairs[r] = dot(second_pairs[r], second, second_word);
                        }
                    }
                    if widen_every != 0 && (c + 1) % widen_every == 0 {
                        for r in 0..N {
                            firsts[r] = _mm256_add_epi32(firsts[r], widen(first_pairs[r]));
                            first_pairs[r] = _mm256_setzero_si256();
                            if !merged {
                                seconds[r] = _mm256_add_epi32(seconds[r], widen(second_pairs[r]));
                                second_pairs[r] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                // The weight scales of the quants 0..16 and 16..32, and
                // the minimums.
                let (scale_first, scale_second, mins) = match F::FORMAT {
                    BlockFormat::Q4K | BlockFormat::Q5K => {
                        let scale = _mm256_mul_ps(
                            d,
                            eight_bytes(&block[F::SUB_SCALES + s * GROUP + rows..], false),
                        );
                        let min = _mm256_mul_ps(
                            m,
                            eight_bytes(&block[F::SUB_MINS + s * GROUP + rows..], false),
                        );
                        (scale, scale, min)
                    }
                    BlockFormat::Q6K => (
                        _mm256_mul_ps(
                            d,
                            eight_bytes(&block[F::SUB_SCALES + 2 * s * GROUP + rows..], true),
                        ),
                        _mm256_mul_ps(
                            d,
                            eight_bytes(&block[F::SUB_SCALES + (2 * s + 1) * GROUP + rows..], true),
                        ),
                        m,
                    ),
                    _ => (d, d, m),
                };
                for r in 0..N {
                    let a = &activations[r][index];
                    let d_a = _mm256_set1_ps(a.d);
                    if F::SIX_BITS {
                        acc[r] = _mm256_fmadd_ps(
                            _mm256_mul_ps(scale_first, d_a),
                            _mm256_cvtepi32_ps(firsts[r]),
                            acc[r],
                        );
                        acc[r] = _mm256_fmadd_ps(
                            _mm256_mul_ps(scale_second, d_a),
                            _mm256_cvtepi32_ps(seconds[r]),
                            acc[r],
                        );
                        continue;
                    }
                    let isum = _mm256_add_epi32(firsts[r], seconds[r]);
                    acc[r] = _mm256_fmadd_ps(
                        _mm256_mul_ps(scale_first, d_a),
                        _mm256_cvtepi32_ps(isum),
                        acc[r],
                    );
                    if F::HAS_MIN {
                        let times = _mm256_set1_ps(min_activation::<F>(a));
                        acc[r] = if F::SUB_BLOCKS > 1 {
                            _mm256_fnmadd_ps(mins, times, acc[r])
                        } else {
                            _mm256_fmadd_ps(mins, times, acc[r])
                        };
                    }
                }
            }
        }
        acc.map(bytemuck::cast)
    }

    /// The loop of `dots` on 512-bit registers, all sixteen rows at once:
    /// each i32 lane is a row's, and takes four of its quants times the
    /// same four activation quants (broadcast from memory, so no shuffle).
    /// The two sums per input row (quants `4c..` and `16 + 4c..`; Q8_0's
    /// chunks `j < 4` and `j >= 4`) are what the 256-bit loop keeps: each
    /// output gets the exact integer sums of the other paths and the same
    /// float operations after them, so the same bits.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    fn dots_avx512<F: Grouped, const N: usize>(
        group: &[u8],
        activations: [&[ActivationBlock]; N],
        prefetch: bool,
    ) -> [[f32; GROUP]; N] {
        let low_nibble = _mm512_set1_epi8(0x0F);
        let fifth_bit = _mm512_set1_epi8(0x10);
        let high_pair = _mm512_set1_epi8(0x30);
        let sign_bit = _mm512_set1_epi8(0x80u8 as i8);
        let mut acc = [_mm512_setzero_ps(); N];
        for (b, block) in group.chunks_exact(F::GROUP_BLOCK_BYTES).enumerate() {
            if prefetch {
                prefetch_ahead(group, b * F::GROUP_BLOCK_BYTES, F::GROUP_BLOCK_BYTES);
            }
            let d = _mm512_cvtph_ps(load_32(&block[SCALES..]));
            let m = if F::HAS_MIN {
                _mm512_cvtph_ps(load_32(&block[MINS..]))
            } else {
                _mm512_setzero_ps()
            };
            for s in 0..F::SUB_BLOCKS {
                let sub = &block[F::HEADER + s * F::SUB_BYTES..][..F::SUB_BYTES];
                let index = b * F::SUB_BLOCKS + s;
                let high = if F::FIVE_BITS || F::SIX_BITS {
                    load_64(&sub[4 * CHUNK..])
                } else {
                    _mm512_setzero_si512()
                };
                let high_second = if F::SIX_BITS {
                    load_64(&sub[5 * CHUNK..])
                } else {
                    _mm512_setzero_si512()
                };
                let mut firsts: [__m512i; N] = std::array::from_fn(|r| {
                    _mm512_set1_epi32(starts::<F>(F::OFFSET, &activations[r][index]).0)
                });
                let mut seconds: [__m512i; N] = std::array::from_fn(|r| {
                    _mm512_set1_epi32(starts::<F>(F::OFFSET, &activations[r][index]).1)
                });
                let words: [&[i32; 8]; N] =
                    std::array::from_fn(|r| bytemuck::cast_ref(&activations[r][index].qs));
                for c in 0..4 {
                    let (mut first, mut second);
                    if F::EIGHT_BITS {
                        first = _mm512_xor_si512(load_64(&sub[CHUNK * c..]), sign_bit);
                        second = _mm512_xor_si512(load_64(&sub[CHUNK * (c + 4)..]), sign_bit);
                    } else {
                        let nibbles = load_64(&sub[CHUNK * c..]);
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
                    if F::SIX_BITS {
                        // As in `dots`.
                        let to_bit_4 = |planes: __m512i| match c {
                            0 => _mm512_slli_epi16::<4>(planes),
                            1 => _mm512_slli_epi16::<2>(planes),
                            2 => planes,
                            _ => _mm512_srli_epi16::<2>(planes),
                        };
                        first = _mm512_or_si512(first, _mm512_and_si512(to_bit_4(high), high_pair));
                        second = _mm512_or_si512(
                            second,
                            _mm512_and_si512(to_bit_4(high_second), high_pair),
                        );
                    }
                    for r in 0..N {
                        firsts[r] =
                            _mm512_dpbusd_epi32(firsts[r], first, _mm512_set1_epi32(words[r][c]));
                        seconds[r] = _mm512_dpbusd_epi32(
                            seconds[r],
                            second,
                            _mm512_set1_epi32(words[r][c + 4]),
                        );
                    }
                }
                let (scale_first, scale_second, mins) = match F::FORMAT {
                    BlockFormat::Q4K | BlockFormat::Q5K => {
                        let scale = _mm512_mul_ps(
                            d,
                            sixteen_bytes(&block[F::SUB_SCALES + s * GROUP..], false),
                        );
                        let min = _mm512_mul_ps(
                            m,
                            sixteen_bytes(&block[F::SUB_MINS + s * GROUP..], false),
                        );
                        (scale, scale, min)
                    }
                    BlockFormat::Q6K => (
                        _mm512_mul_ps(
                            d,
                            sixteen_bytes(&block[F::SUB_SCALES + 2 * s * GROUP..], true),
                        ),
                        _mm512_mul_ps(
                            d,
                            sixteen_bytes(&block[F::SUB_SCALES + (2 * s + 1) * GROUP..], true),
                        ),
                        m,
                    ),
                    _ => (d, d, m),
                };
                for r in 0..N {
                    let a = &activations[r][index];
                    let d_a = _mm512_set1_ps(a.d);
                    if F::SIX_BITS {
                        acc[r] = _mm512_fmadd_ps(
                            _mm512_mul_ps(scale_first, d_a),
                            _mm512_cvtepi32_ps(firsts[r]),
                            acc[r],
                        );
                        acc[r] = _mm512_fmadd_ps(
                            _mm512_mul_ps(scale_second, d_a),
                            _mm512_cvtepi32_ps(seconds[r]),
                            acc[r],
                        );
                        continue;
                    }
                    let isum = _mm512_add_epi32(firsts[r], seconds[r]);
                    acc[r] = _mm512_fmadd_ps(
                        _mm512_mul_ps(scale_first, d_a),
                        _mm512_cvtepi32_ps(isum),
                        acc[r],
                    );
                    if F::HAS_MIN {
                        let times = _mm512_set1_ps(min_activation::<F>(a));
                        acc[r] = if F::SUB_BLOCKS > 1 {
                            _mm512_fnmadd_ps(mins, times, acc[r])
                        } else {
                            _mm512_fmadd_ps(mins, times, acc[r])
                        };
                    }
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
    use crate::kernels::{quantize_activations, quantize_activations_k};
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

    /// `input` quantized as `F`'s products read it.
    fn quantized<F: Grouped>(input: &[f32]) -> Vec<ActivationBlock> {
        let mut out = Vec::new();
        if F::SUB_BLOCKS > 1 {
            quantize_activations_k(input, &mut out);
        } else {
            quantize_activations(input, &mut out);
        }
        out
    }

    /// `rows` activation rows quantized as a product in format `F` takes
    /// them (for the K-quants one scale a superblock, negative where the
    /// value of largest magnitude is positive).
    fn activations<F: Grouped>(rows: usize, cols: usize) -> Vec<Vec<ActivationBlock>> {
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
                quantized::<F>(&input)
            })
            .collect()
    }

    /// A group's quants, scales and minimums read back as candle
    /// dequantizes the stored blocks.
    #[test]
    fn grouped_blocks_read_as_candle_dequantizes() {
        fn check<F: Grouped>() {
            let (rows, cols) = (19, 512);
            let row_blocks = cols / F::FORMAT.block_elems();
            let q = stored::<F>(rows, cols, 5);
            let dense = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let grouped = grouped_vec::<F>(&q.data().unwrap(), rows, row_blocks);
            for (row, weights) in dense.iter().enumerate() {
                let (group, r) = (row / GROUP, row % GROUP);
                for b in 0..row_blocks {
                    let block = &grouped[(group * row_blocks + b) * F::GROUP_BLOCK_BYTES..]
                        [..F::GROUP_BLOCK_BYTES];
                    for s in 0..F::SUB_BLOCKS {
                        let sub = &block[F::HEADER + s * F::SUB_BYTES..][..F::SUB_BYTES];
                        for (i, q) in quants_of::<F>(sub, r).iter().enumerate() {
                            let scale = scale_of::<F>(block, s, i / 16, r);
                            let weight = match F::FORMAT {
                                BlockFormat::Q4_1 => {
                                    scale * f32::from(*q) + min_of::<F>(block, s, r)
                                }
                                BlockFormat::Q4K | BlockFormat::Q5K => {
                                    scale * f32::from(*q) - min_of::<F>(block, s, r)
                                }
                                _ => scale * (f32::from(*q) - F::OFFSET as f32),
                            };
                            let at = (b * F::SUB_BLOCKS + s) * BLOCK_ELEMS + i;
                            assert_eq!(
                                weight,
                                weights[at],
                                "{:?} row {row} weight {at}",
                                F::FORMAT
                            );
                        }
                    }
                }
            }
        }
        check::<Q4_0>();
        check::<Q4_1>();
        check::<Q5_0>();
        check::<Q8_0>();
        check::<Q4K>();
        check::<Q5K>();
        check::<Q6K>();
    }

    /// Every SIMD path this CPU has and the scalar one give the same bits,
    /// one to four input rows at a time, on a last group short of sixteen
    /// rows too.
    #[test]
    fn simd_and_scalar_paths_agree() {
        fn check<F: Grouped>() {
            let (rows, cols) = (29, 512);
            let q = stored::<F>(rows, cols, 9);
            let row_blocks = cols / F::FORMAT.block_elems();
            let mut grouped = grouped_vec::<F>(&q.data().unwrap(), rows, row_blocks);
            if F::EIGHT_BITS {
                // Row 0's first block at -128, which candle never writes:
                // the AVX2 path takes its magnitude, 128, as an unsigned
                // byte.
                for j in 0..8 {
                    grouped[F::HEADER + CHUNK * j..][..4].fill(0x80);
                }
            }
            let inputs = activations::<F>(4, cols);
            let group_bytes = row_blocks * F::GROUP_BLOCK_BYTES;
            #[cfg(target_arch = "x86_64")]
            let paths = simd::available();
            #[cfg(target_arch = "x86_64")]
            for path in [simd::Path::Avx2, simd::Path::Vnni, simd::Path::Avx512] {
                if !paths.contains(&path) {
                    eprintln!(
                        "SKIP the {path:?} path of simd_and_scalar_paths_agree: this CPU lacks it"
                    );
                }
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
        check::<Q4K>();
        check::<Q5K>();
        check::<Q6K>();
    }

    /// Every weight at its largest quant and every activation at 127 (all
    /// of one sign):
    /// the AVX2 path's i16 pair sums, added over several chunks before
    /// they are widened, stay within i16, so it gives the scalar bits.
    #[test]
    fn the_largest_quants_do_not_overflow_the_pair_sums() {
        fn check<F: Grouped>() {
            let (rows, cols) = (16, 512);
            let q = stored::<F>(rows, cols, 3);
            let row_blocks = cols / F::FORMAT.block_elems();
            let mut grouped = grouped_vec::<F>(&q.data().unwrap(), rows, row_blocks);
            let largest = if F::EIGHT_BITS { 0x7F } else { 0xFF };
            for block in grouped.chunks_exact_mut(F::GROUP_BLOCK_BYTES) {
                block[F::HEADER..].fill(largest);
            }
            let inputs = quantized::<F>(&vec![1.0; cols]);
            assert!(
                inputs
                    .iter()
                    .all(|a| a.qs.iter().all(|&q| q.unsigned_abs() == 127))
            );
            let scalar: [f32; GROUP] =
                std::array::from_fn(|r| dot_scalar::<F>(&grouped, r, &inputs));
            #[cfg(target_arch = "x86_64")]
            for path in simd::available() {
                let [one] = simd::group_dots::<F, 1>(path, &grouped, [&inputs[..]], false);
                assert_eq!(one.map(f32::to_bits), scalar.map(f32::to_bits), "{path:?}");
            }
        }
        check::<Q4_0>();
        check::<Q4_1>();
        check::<Q5_0>();
        check::<Q8_0>();
        check::<Q4K>();
        check::<Q5K>();
        check::<Q6K>();
    }

    /// A group's block is its sixteen stored blocks' bytes, but for Q4_K's
    /// and Q5_K's sub-block scales and minimums, unpacked from 12 bytes to
    /// 16.
    #[test]
    fn group_blocks_hold_the_stored_bytes() {
        for (format, bytes) in [
            (BlockFormat::Q4_0, 16 * 18),
            (BlockFormat::Q4_1, 16 * 20),
            (BlockFormat::Q5_0, 16 * 22),
            (BlockFormat::Q8_0, 16 * 34),
            (BlockFormat::Q4K, 16 * (144 + 4)),
            (BlockFormat::Q5K, 16 * (176 + 4)),
            (BlockFormat::Q6K, 16 * 210),
        ] {
            assert_eq!(group_block_bytes(format), bytes, "{format:?}");
        }
    }

    fn gives_every_row_back<F: Grouped>(rows: usize, row_blocks: usize, seed: u64) {
        let stored: Vec<u8> = (0..rows * row_blocks * F::STORED_BYTES)
            .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).to_le_bytes()[3])
            .collect();
        let grouped = grouped_vec::<F>(&stored, rows, row_blocks);
        assert_eq!(
            grouped.len(),
            rows.div_ceil(GROUP) * row_blocks * F::GROUP_BLOCK_BYTES
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
            gives_every_row_back::<Q4K>(rows, row_blocks, seed);
            gives_every_row_back::<Q5K>(rows, row_blocks, seed);
            gives_every_row_back::<Q6K>(rows, row_blocks, seed);
        }
    }
}
