//! Scaled dot-product attention of one request over its KV cache, on the
//! CPU, read straight from the cache's storage.
//!
//! candle's route (a matmul for the scores, softmax, a matmul for the
//! values) costs more than the arithmetic at decode: each CPU matmul asks
//! `get_num_threads`, which re-reads `/proc/cpuinfo` unless
//! `RAYON_NUM_THREADS` is set (about 30 µs a call, two calls per layer per
//! request: 20 % of a batch of eight requests' decode on one thread), and
//! the values are copied out of the cache to make them contiguous. Here
//! each query row is computed alone, in a fixed order, so its bits do not
//! depend on how many rows the step has, on the batch, or on the threads.

use candle_core::{DType, Device, Storage, Tensor};

use crate::error::{EngineError, Result};

/// Which keys a query at absolute position `p` sees: `p - window < key <= p`.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    /// Position of the step's first query row.
    pub position: usize,
    /// How far back a query sees (`usize::MAX` for a global layer).
    pub window: usize,
}

/// A rank-4 `(1, heads, positions, head_dim)` f32 tensor's values and the
/// strides of its head and position axes (its last axis is contiguous).
struct View<'a> {
    values: &'a [f32],
    start: usize,
    head_stride: usize,
    position_stride: usize,
    positions: usize,
}

impl<'a> View<'a> {
    #[inline(always)]
    fn row(&self, head: usize, position: usize, width: usize) -> Option<&'a [f32]> {
        let at = self.start + head * self.head_stride + position * self.position_stride;
        self.values.get(at..at + width)
    }
}

fn view<'a>(storage: &'a Storage, layout: &candle_core::Layout) -> Option<View<'a>> {
    let Storage::Cpu(cpu) = storage else {
        return None;
    };
    let values = cpu.as_slice::<f32>().ok()?;
    match (layout.dims(), layout.stride()) {
        ([1, _, positions, _], [_, head_stride, position_stride, 1]) => Some(View {
            values,
            start: layout.start_offset(),
            head_stride: *head_stride,
            position_stride: *position_stride,
            positions: *positions,
        }),
        _ => None,
    }
}

/// `softmax(q kᵀ · scale, causal within the window) v` for `q` of shape
/// `(1, heads, seq, head_dim)` against the cache's `k`, `v` of shape
/// `(1, kv_heads, cached, head_dim)` (query head `h` reads KV head
/// `h / (heads / kv_heads)`), as `(seq, heads * head_dim)`. `None` when the
/// tensors are not f32 on the CPU: the caller takes candle's route.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    span: Span,
) -> Result<Option<Tensor>> {
    if !matches!(q.device(), Device::Cpu) || [q.dtype(), k.dtype(), v.dtype()] != [DType::F32; 3] {
        return Ok(None);
    }
    let (_, heads, seq, width) = q.dims4()?;
    let kv_heads = k.dim(1)?;
    if heads == 0
        || width == 0
        || kv_heads == 0
        || heads % kv_heads != 0
        || v.dims() != k.dims()
        || k.dim(3)? != width
    {
        return Err(EngineError::WrongInput(
            "has attention shapes that do not fit",
        ));
    }
    let group = heads / kv_heads;
    let q = q.contiguous()?;
    let (q_storage, q_layout) = q.storage_and_layout();
    let (k_storage, k_layout) = k.storage_and_layout();
    let (v_storage, v_layout) = v.storage_and_layout();
    let (Some(queries), Some(keys), Some(values)) = (
        view(&q_storage, q_layout),
        view(&k_storage, k_layout),
        view(&v_storage, v_layout),
    ) else {
        return Ok(None);
    };
    let cached = keys.positions;
    // The cache holds exactly the positions before this step and the step's.
    if span.position + seq != cached {
        return Err(EngineError::WrongInput(
            "attends over a cache that does not end at its step",
        ));
    }
    let mut out = vec![0f32; seq * heads * width];
    let inputs = Inputs {
        queries: &queries,
        keys: &keys,
        values: &values,
        group,
        kv_heads,
        width,
        scale,
        span,
    };
    // A piece is one query position's heads that share one KV head. A long
    // prompt's pieces go to the compute threads; each piece's bits are the
    // same wherever it runs.
    let pieces: Vec<std::sync::Mutex<&mut [f32]>> = out
        .chunks_exact_mut(group * width)
        .map(std::sync::Mutex::new)
        .collect();
    let failure: std::sync::Mutex<Option<EngineError>> = std::sync::Mutex::new(None);
    let run = |range: std::ops::Range<usize>| {
        let mut scratch = Scratch::new(group, cached);
        for index in range {
            let Some(piece) = pieces.get(index) else {
                continue;
            };
            let mut results = match piece.lock() {
                Ok(guard) => guard,
                Err(poisoned) => poisoned.into_inner(),
            };
            if let Err(error) = compute_piece(&inputs, index, &mut results, &mut scratch)
                && let Ok(mut failure) = failure.lock()
            {
                *failure = Some(error);
            }
        }
    };
    if seq * cached >= PARALLEL_WORK {
        crate::kernels::pool::pool().for_each_piece(pieces.len(), run);
    } else {
        run(0..pieces.len());
    }
    drop(pieces);
    if let Some(error) = failure.into_inner().ok().flatten() {
        return Err(error);
    }
    Ok(Some(Tensor::from_vec(
        out,
        (seq, heads * width),
        &Device::Cpu,
    )?))
}

/// Query positions times cached positions from which a step's pieces are
/// spread over the compute threads (a prompt chunk, not a decode step).
const PARALLEL_WORK: usize = 4096;

struct Inputs<'a> {
    queries: &'a View<'a>,
    keys: &'a View<'a>,
    values: &'a View<'a>,
    group: usize,
    kv_heads: usize,
    width: usize,
    scale: f32,
    span: Span,
}

/// One piece's scores, reused from piece to piece.
struct Scratch {
    scores: Vec<Vec<f32>>,
    maxima: Vec<f32>,
    totals: Vec<f32>,
}

impl Scratch {
    fn new(group: usize, cached: usize) -> Self {
        Self {
            scores: vec![Vec::with_capacity(cached); group],
            maxima: vec![f32::NEG_INFINITY; group],
            totals: vec![0f32; group],
        }
    }
}

/// Piece `index` (query position `index / kv_heads`, KV head `index %
/// kv_heads`), into `results`: the query heads that share the KV head are
/// computed together, so each cached key and value row is read once for
/// all of them (at a 1,000-token context the cache is a third of what a
/// decode step reads). With AVX2 when the CPU has it: no fused
/// multiply-add either way, so both give the same bits.
fn compute_piece(
    inputs: &Inputs<'_>,
    index: usize,
    results: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(|| rows_of_width(inputs, index, results, scratch));
    }
    rows_of_width(inputs, index, results, scratch)
}

/// The piece's rows by the loops for its head width: the common widths
/// with each row's query and accumulator a fixed-size array the compiler
/// keeps in registers, any other width by the general loops. Both compute
/// every row with the same operations in the same order (each score, its
/// maximum, the exponentials and their total, then each value added in
/// key order), so they give the same bits
/// (`the_fixed_width_loops_give_the_general_loops_bits`).
#[inline(always)]
fn rows_of_width(
    inputs: &Inputs<'_>,
    index: usize,
    results: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    match inputs.width {
        64 => piece_rows_fixed::<64>(inputs, index, results, scratch),
        128 => piece_rows_fixed::<128>(inputs, index, results, scratch),
        256 => piece_rows_fixed::<256>(inputs, index, results, scratch),
        _ => piece_rows(inputs, index, results, scratch),
    }
}

/// [`piece_rows`] for heads `W` wide, a query head at a time: its query
/// row and its output row stay in registers while the keys and values
/// stream past.
#[inline(always)]
fn piece_rows_fixed<const W: usize>(
    inputs: &Inputs<'_>,
    index: usize,
    results: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    let Inputs {
        queries,
        keys,
        values,
        group,
        kv_heads,
        scale,
        span,
        ..
    } = *inputs;
    let (s, kv_head) = (index / kv_heads, index % kv_heads);
    let query_position = span.position + s;
    let first = (query_position + 1).saturating_sub(span.window);
    for (g, result) in results.chunks_exact_mut(W).enumerate().take(group) {
        let query = *fixed_row::<W>(
            queries,
            kv_head * group + g,
            s,
            "has a query outside its tensor",
        )?;
        let scores = &mut scratch.scores[g];
        scores.clear();
        let mut maximum = f32::NEG_INFINITY;
        for key in first..=query_position {
            let key_row = fixed_row::<W>(keys, kv_head, key, "has a key outside its cache")?;
            let score = dot(&query, key_row) * scale;
            maximum = maximum.max(score);
            scores.push(score);
        }
        let mut total = 0f32;
        for score in scores.iter_mut() {
            *score = (*score - maximum).exp();
            total += *score;
        }
        let mut sum = [0f32; W];
        for (j, key) in (first..=query_position).enumerate() {
            let value_row = fixed_row::<W>(values, kv_head, key, "has a value outside its cache")?;
            let weight = scores[j] / total;
            for (o, v) in sum.iter_mut().zip(value_row) {
                *o += weight * v;
            }
        }
        result.copy_from_slice(&sum);
    }
    Ok(())
}

#[inline(always)]
fn piece_rows(
    inputs: &Inputs<'_>,
    index: usize,
    results: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    let Inputs {
        queries,
        keys,
        values,
        group,
        kv_heads,
        width,
        scale,
        span,
    } = *inputs;
    let Scratch {
        scores,
        maxima,
        totals,
    } = scratch;
    let (s, kv_head) = (index / kv_heads, index % kv_heads);
    let query_position = span.position + s;
    let first = (query_position + 1).saturating_sub(span.window);
    let query = |g: usize| {
        queries
            .row(kv_head * group + g, s, width)
            .ok_or(EngineError::WrongInput("has a query outside its tensor"))
    };
    for g in 0..group {
        scores[g].clear();
        maxima[g] = f32::NEG_INFINITY;
    }
    for key in first..=query_position {
        let key_row = keys
            .row(kv_head, key, width)
            .ok_or(EngineError::WrongInput("has a key outside its cache"))?;
        for g in 0..group {
            let score = dot(query(g)?, key_row) * scale;
            maxima[g] = maxima[g].max(score);
            scores[g].push(score);
        }
    }
    for g in 0..group {
        let mut total = 0f32;
        for score in scores[g].iter_mut() {
            *score = (*score - maxima[g]).exp();
            total += *score;
        }
        totals[g] = total;
    }
    for (j, key) in (first..=query_position).enumerate() {
        let value_row = values
            .row(kv_head, key, width)
            .ok_or(EngineError::WrongInput("has a value outside its cache"))?;
        for (g, result) in results.chunks_exact_mut(width).enumerate() {
            let weight = scores[g][j] / totals[g];
            for (o, v) in result.iter_mut().zip(value_row) {
                *o += weight * v;
            }
        }
    }
    Ok(())
}

/// A row `W` wide of a view, as an array.
#[inline(always)]
fn fixed_row<'a, const W: usize>(
    view: &View<'a>,
    head: usize,
    position: usize,
    what: &'static str,
) -> Result<&'a [f32; W]> {
    view.row(head, position, W)
        .and_then(|row| <&[f32; W]>::try_from(row).ok())
        .ok_or(EngineError::WrongInput(what))
}

/// A dot product in eight lanes added in a fixed order (no fused
/// multiply-add, so every build gives the same bits).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut a8 = a.chunks_exact(8);
    let mut b8 = b.chunks_exact(8);
    for (x, y) in (&mut a8).zip(&mut b8) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane];
        }
    }
    let mut tail = 0f32;
    for (x, y) in a8.remainder().iter().zip(b8.remainder()) {
        tail += x * y;
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
        + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn random(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
        let count = shape.0 * shape.1 * shape.2 * shape.3;
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let values: Vec<f32> = (0..count)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    /// candle's route, as the engine took it before: scores by matmul,
    /// an additive mask, softmax, values by matmul.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, span: Span) -> Tensor {
        let (_, heads, seq, width) = q.dims4().unwrap();
        let kv_heads = k.dim(1).unwrap();
        let group = heads / kv_heads;
        let cached = k.dim(2).unwrap();
        let q = q.reshape((1, kv_heads, group * seq, width)).unwrap();
        let scores = (q.matmul(&k.t().unwrap()).unwrap() * f64::from(scale)).unwrap();
        let mask: Vec<f32> = (0..group * seq)
            .flat_map(|row| {
                let query = span.position + row % seq;
                (0..cached).map(move |key| {
                    if key <= query && query - key < span.window {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (group * seq, cached), &Device::Cpu).unwrap();
        let probs =
            candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask).unwrap()).unwrap();
        probs
            .matmul(&v.contiguous().unwrap())
            .unwrap()
            .reshape((1, heads, seq, width))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((seq, heads * width))
            .unwrap()
    }

    fn close(a: &Tensor, b: &Tensor) {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn agrees_with_candles_route_for_grouped_heads_windows_and_prompts() {
        // (heads, kv_heads, seq, cached, width, window)
        for (heads, kv_heads, seq, cached, width, window) in [
            (9, 3, 1, 17, 64, usize::MAX),
            (9, 3, 5, 12, 64, usize::MAX),
            (4, 1, 7, 20, 256, 6),
            (4, 1, 1, 20, 256, 6),
            (2, 2, 3, 3, 13, usize::MAX),
            // Spread over the compute threads.
            (4, 2, 70, 80, 16, usize::MAX),
            (4, 1, 70, 80, 32, 24),
        ] {
            let q = random((1, heads, seq, width), 1);
            let k = random((1, kv_heads, cached, width), 2);
            let v = random((1, kv_heads, cached, width), 3);
            let span = Span {
                position: cached - seq,
                window,
            };
            let ours = attend(&q, &k, &v, 0.125, span).unwrap().unwrap();
            close(&ours, &reference(&q, &k, &v, 0.125, span));
        }
    }

    #[test]
    fn reads_a_cache_that_is_a_view_of_a_larger_buffer() {
        let (heads, width, capacity, cached) = (6, 32, 40, 9);
        let k_buffer = random((1, 2, capacity, width), 4);
        let v_buffer = random((1, 2, capacity, width), 5);
        let k = k_buffer.narrow(2, 0, cached).unwrap();
        let v = v_buffer.narrow(2, 0, cached).unwrap();
        assert!(!v.is_contiguous());
        let q = random((1, heads, 1, width), 6);
        let span = Span {
            position: cached - 1,
            window: usize::MAX,
        };
        let ours = attend(&q, &k, &v, 0.3, span).unwrap().unwrap();
        close(&ours, &reference(&q, &k, &v, 0.3, span));
    }

    #[test]
    fn refuses_a_cache_that_does_not_end_at_the_step_and_shapes_that_do_not_fit() {
        let q = random((1, 4, 2, 8), 1);
        let k = random((1, 2, 3, 8), 2);
        for position in [0, 2] {
            let span = Span {
                position,
                window: usize::MAX,
            };
            assert!(attend(&q, &k, &k, 1.0, span).is_err(), "{position}");
        }
        let no_width = random((1, 4, 2, 0), 4);
        let empty = random((1, 2, 3, 0), 5);
        let at = Span {
            position: 1,
            window: usize::MAX,
        };
        assert!(attend(&no_width, &empty, &empty, 1.0, at).is_err());
        let uneven = random((1, 3, 3, 8), 3);
        let at = Span {
            position: 1,
            window: usize::MAX,
        };
        assert!(attend(&q, &uneven, &uneven, 1.0, at).is_err());
    }

    /// A prompt long enough to spread over the compute threads gives each
    /// row the bits that row gets decoded alone.
    #[test]
    fn a_spread_prompt_row_has_the_bits_it_gets_alone() {
        let (seq, cached) = (90, 100);
        assert!(seq * cached >= PARALLEL_WORK);
        let q = random((1, 6, seq, 16), 7);
        let k = random((1, 2, cached, 16), 8);
        let v = random((1, 2, cached, 16), 9);
        let span = Span {
            position: cached - seq,
            window: 40,
        };
        let all = attend(&q, &k, &v, 0.25, span).unwrap().unwrap();
        for row in [0, 45, seq - 1] {
            let position = cached - seq + row;
            let alone = attend(
                &q.narrow(2, row, 1).unwrap(),
                &k.narrow(2, 0, position + 1).unwrap(),
                &v.narrow(2, 0, position + 1).unwrap(),
                0.25,
                Span {
                    position,
                    window: 40,
                },
            )
            .unwrap()
            .unwrap();
            let bits = crate::tensor_bits;
            assert_eq!(bits(&all.narrow(0, row, 1).unwrap()), bits(&alone), "{row}");
        }
    }

    /// The fixed-width loops and the general loops give every row the
    /// same bits, for each fixed width, grouped heads, windows and steps.
    #[test]
    fn the_fixed_width_loops_give_the_general_loops_bits() {
        for (width, group, kv_heads, seq, cached, window) in [
            (64, 3, 3, 1, 300, usize::MAX),
            (64, 3, 3, 7, 40, usize::MAX),
            (128, 2, 1, 5, 33, 9),
            (256, 4, 1, 3, 50, 20),
        ] {
            let heads = group * kv_heads;
            let q = random((1, heads, seq, width), 11);
            let k = random((1, kv_heads, cached, width), 12);
            let v = random((1, kv_heads, cached, width), 13);
            let (q_storage, q_layout) = q.storage_and_layout();
            let (k_storage, k_layout) = k.storage_and_layout();
            let (v_storage, v_layout) = v.storage_and_layout();
            let (queries, keys, values) = (
                view(&q_storage, q_layout).unwrap(),
                view(&k_storage, k_layout).unwrap(),
                view(&v_storage, v_layout).unwrap(),
            );
            let inputs = Inputs {
                queries: &queries,
                keys: &keys,
                values: &values,
                group,
                kv_heads,
                width,
                scale: 0.125,
                span: Span {
                    position: cached - seq,
                    window,
                },
            };
            for index in 0..seq * kv_heads {
                let mut general = vec![0f32; group * width];
                let mut fixed = vec![0f32; group * width];
                piece_rows(
                    &inputs,
                    index,
                    &mut general,
                    &mut Scratch::new(group, cached),
                )
                .unwrap();
                rows_of_width(&inputs, index, &mut fixed, &mut Scratch::new(group, cached))
                    .unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&general), bits(&fixed), "width {width} piece {index}");
            }
        }
    }

    proptest! {
        /// A query row's result does not depend on the other rows of its
        /// step: a prompt's last row equals that row decoded alone.
        #[test]
        fn a_row_has_the_same_bits_in_any_step(
            seq in 1usize..6,
            extra in 0usize..6,
            window in 1usize..12,
            seed in 0u64..1000,
        ) {
            let cached = seq + extra;
            let q = random((1, 4, seq, 16), seed);
            let k = random((1, 2, cached, 16), seed + 1);
            let v = random((1, 2, cached, 16), seed + 2);
            let span = Span { position: extra, window };
            let all = attend(&q, &k, &v, 0.25, span).unwrap().unwrap();
            let last_q = q.narrow(2, seq - 1, 1).unwrap();
            let last_span = Span { position: cached - 1, window };
            let alone = attend(&last_q, &k, &v, 0.25, last_span).unwrap().unwrap();
            prop_assert_eq!(
                crate::tensor_bits(&all.narrow(0, seq - 1, 1).unwrap()),
                crate::tensor_bits(&alone)
            );
        }
    }
}
