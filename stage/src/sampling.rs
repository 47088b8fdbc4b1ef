//! Sampling from logits, apart from the model: the coordinator samples from
//! the logits the last stage returns, so no stage can choose the tokens.

/// How to pick the next token.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: no limit).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1.0: no limit).
    pub top_p: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// SplitMix64: small, seedable and reproducible across platforms (the
/// sampler's stream, and the seeded simulations of benches and tests).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Below `n` (0 when `n` is 0); the modulo bias is negligible for the
    /// small `n` it is used with.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Uniform in [0, 1) with 53 bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A sampler with its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

/// Index of the largest logit (the first, on ties); `None` for no logits.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.and_then(|(i, _)| u32::try_from(i).ok())
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = SplitMix64::new(params.seed);
        Self { params, rng }
    }

    pub fn sample(&mut self, logits: &[f32]) -> Option<u32> {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .filter_map(|(i, v)| Some((u32::try_from(i).ok()?, *v / self.params.temperature)))
            .collect();
        if candidates.is_empty() {
            return None;
        }
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            candidates.truncate(self.params.top_k);
        }
        let max = candidates[0].1;
        let weights: Vec<f64> = candidates
            .iter()
            .map(|(_, v)| f64::from(v - max).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut keep = candidates.len();
        if self.params.top_p < 1.0 {
            let mut cumulative = 0.0;
            for (i, w) in weights.iter().enumerate() {
                cumulative += w / total;
                if cumulative >= f64::from(self.params.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept_total: f64 = weights[..keep].iter().sum();
        let mut target = self.rng.next_f64() * kept_total;
        for (i, w) in weights[..keep].iter().enumerate() {
            if target < *w {
                return Some(candidates[i].0);
            }
            target -= w;
        }
        Some(candidates[keep - 1].0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), Some(1));
        assert_eq!(
            Sampler::new(SamplingParams::greedy()).sample(&[0.1, 0.0, 0.2]),
            Some(2)
        );
        assert_eq!(argmax(&[]), None);
    }

    #[test]
    fn seeded_sampling_repeats_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32).collect();
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            top_p: 0.95,
            seed: 42,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..100).filter_map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..100).filter_map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        // Top-5 of logits with value 6 are the indices ≡ 6 (mod 7).
        assert!(a.iter().all(|t| t % 7 == 6), "{a:?}");
        let c: Vec<u32> = {
            let mut s = Sampler::new(SamplingParams { seed: 43, ..params });
            (0..100).filter_map(|_| s.sample(&logits)).collect()
        };
        assert_ne!(a, c);
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let mut logits = vec![-10.0f32; 10];
        logits[3] = 10.0;
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            seed: 1,
        });
        assert!((0..50).all(|_| s.sample(&logits) == Some(3)));
    }
}
