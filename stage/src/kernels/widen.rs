//! f16 rows widened to f32: the attention reads its f16 KV cache a tile at
//! a time this way. One call per tile, the loop inside the F16C function
//! (`half`'s slice conversion calls its F16C function once per eight
//! values, which cost as much as the arithmetic on them). Widening is
//! exact, so the F16C path and the portable one give the same bits.

use half::f16;

/// `into[i] = rows[i]` as f32, for as many as both hold.
pub fn widen_f16(rows: &[f16], into: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX and F16C, the features `f16c_widen`
        // is compiled for.
        unsafe { f16c_widen(rows, into) };
        return;
    }
    portable_widen(rows, into);
}

fn portable_widen(rows: &[f16], into: &mut [f32]) {
    for (wide, half) in into.iter_mut().zip(rows) {
        *wide = half.to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
fn f16c_widen(rows: &[f16], into: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    let mut halves = rows.chunks_exact(8);
    let mut wides = into.chunks_exact_mut(8);
    for (half, wide) in (&mut halves).zip(&mut wides) {
        // SAFETY: `half` holds eight f16 (the 16 bytes read) and `wide`
        // eight f32 (the 32 bytes written); unaligned loads and stores.
        unsafe {
            let packed = _mm_loadu_si128(half.as_ptr().cast::<__m128i>());
            _mm256_storeu_ps(wide.as_mut_ptr(), _mm256_cvtph_ps(packed));
        }
    }
    portable_widen(halves.remainder(), wides.into_remainder());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widens_every_half_as_half_does() {
        // Every f16 bit pattern but NaNs (whose payloads may be quieted),
        // in a length that leaves a remainder.
        let rows: Vec<f16> = (0..=u16::MAX)
            .map(f16::from_bits)
            .filter(|h| !h.is_nan())
            .collect();
        assert_ne!(rows.len() % 8, 0);
        let mut fast = vec![0f32; rows.len()];
        widen_f16(&rows, &mut fast);
        let mut slow = vec![0f32; rows.len()];
        portable_widen(&rows, &mut slow);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast), bits(&slow));
    }
}
