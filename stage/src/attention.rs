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
    // A piece is one query head at one position. A long prompt's pieces,
    // and a decode step's heads deep in a long context, go to the compute
    // threads; each piece's bits are the same wherever it runs.
    let pieces: Vec<std::sync::Mutex<&mut [f32]>> = out
        .chunks_exact_mut(width)
        .map(std::sync::Mutex::new)
        .collect();
    let failure: std::sync::Mutex<Option<EngineError>> = std::sync::Mutex::new(None);
    let run = |range: std::ops::Range<usize>| {
        let mut scratch = Scratch::new(cached);
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
    if seq * heads * cached >= PARALLEL_WORK {
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

/// Query rows (positions times heads) times cached positions from which a
/// step's pieces are spread over the compute threads: a prompt chunk, or
/// a decode step about a thousand positions deep (SmolLM2's nine heads;
/// two thousand for Gemma 3's four).
const PARALLEL_WORK: usize = 8192;

/// Where one piece sits: its query row and the keys it sees.
struct Piece {
    /// The row's index in the step.
    step_row: usize,
    head: usize,
    kv_head: usize,
    /// The first key the row sees (its window's start).
    first: usize,
    /// The row's own position: the last key it sees.
    query_position: usize,
}

impl Inputs<'_> {
    /// Piece `index`: query position `index / heads`, query head `index %
    /// heads`, which reads KV head `head / group`.
    #[inline(always)]
    fn piece(&self, index: usize) -> Piece {
        let heads = self.group * self.kv_heads;
        let (step_row, head) = (index / heads, index % heads);
        let query_position = self.span.position + step_row;
        Piece {
            step_row,
            head,
            kv_head: head / self.group,
            first: (query_position + 1).saturating_sub(self.span.window),
            query_position,
        }
    }
}

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
    scores: Vec<f32>,
}

impl Scratch {
    fn new(cached: usize) -> Self {
        Self {
            scores: Vec::with_capacity(cached),
        }
    }
}

/// Piece `index` ([`Inputs::piece`]) into `results`. With AVX2
/// when the CPU has it: no fused multiply-add either way, so both give the
/// same bits.
fn compute_piece(
    inputs: &Inputs<'_>,
    index: usize,
    results: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(|| rows_of_width(Some(simd), inputs, index, results, scratch));
    }
    rows_of_width(None, inputs, index, results, scratch)
}

/// The piece's row by the loops for its head width: the common widths
/// with the query and the accumulator fixed-size arrays, any other width
/// by the general loops. Both compute every row with the same operations in the same order (each score, the
/// row's maximum, the exponentials and their total, each value added in
/// key order, then the division by the total), so they give the same bits
/// (`the_fixed_width_loops_give_the_general_loops_bits`).
#[inline(always)]
fn rows_of_width(
    simd: Simd,
    inputs: &Inputs<'_>,
    index: usize,
    results: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    match inputs.width {
        64 => piece_rows_fixed::<64>(simd, inputs, index, results, scratch),
        128 => piece_rows_fixed::<128>(simd, inputs, index, results, scratch),
        256 => piece_rows_fixed::<256>(simd, inputs, index, results, scratch),
        _ => piece_rows(inputs, index, results, scratch),
    }
}

const QUERY_OUTSIDE: &str = "has a query outside its tensor";
const KEY_OUTSIDE: &str = "has a key outside its cache";
const VALUE_OUTSIDE: &str = "has a value outside its cache";

/// [`piece_rows`] for heads `W` wide, a query head at a time: its query
/// row and its output row stay in registers while the keys and values
/// stream past, and four keys' scores are summed at once (four
/// independent chains of additions where one would wait on each add).
#[inline(always)]
fn piece_rows_fixed<const W: usize>(
    simd: Simd,
    inputs: &Inputs<'_>,
    index: usize,
    results: &mut [f32],
    scratch: &mut Scratch,
) -> Result<()> {
    let Inputs {
        queries,
        keys,
        values,
        scale,
        ..
    } = *inputs;
    let Piece {
        step_row,
        head,
        kv_head,
        first,
        query_position,
    } = inputs.piece(index);
    let query = *fixed_row::<W>(queries, head, step_row, QUERY_OUTSIDE)?;
    let scores = &mut scratch.scores;
    scores.clear();
    let mut key = first;
    while key + 4 <= query_position + 1 {
        let rows = [
            fixed_row::<W>(keys, kv_head, key, KEY_OUTSIDE)?,
            fixed_row::<W>(keys, kv_head, key + 1, KEY_OUTSIDE)?,
            fixed_row::<W>(keys, kv_head, key + 2, KEY_OUTSIDE)?,
            fixed_row::<W>(keys, kv_head, key + 3, KEY_OUTSIDE)?,
        ];
        scores.extend(dots4_fast(simd, &query, rows).map(|dot| dot * scale));
        key += 4;
    }
    for key in key..=query_position {
        let key_row = fixed_row::<W>(keys, kv_head, key, KEY_OUTSIDE)?;
        scores.push(dot(&query, key_row) * scale);
    }
    let total = exponentials(scores);
    let mut sum = [0f32; W];
    add_weighted_rows::<W>(simd, &mut sum, scores, |j| {
        fixed_row::<W>(values, kv_head, first + j, VALUE_OUTSIDE)
    })?;
    for (r, o) in results.iter_mut().zip(sum) {
        *r = o / total;
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
        width,
        scale,
        ..
    } = *inputs;
    let Piece {
        step_row,
        head,
        kv_head,
        first,
        query_position,
    } = inputs.piece(index);
    let scores = &mut scratch.scores;
    let query = queries
        .row(head, step_row, width)
        .ok_or(EngineError::WrongInput(QUERY_OUTSIDE))?;
    scores.clear();
    for key in first..=query_position {
        let key_row = keys
            .row(kv_head, key, width)
            .ok_or(EngineError::WrongInput(KEY_OUTSIDE))?;
        scores.push(dot(query, key_row) * scale);
    }
    let total = exponentials(scores);
    results.fill(0.0);
    for (weight, key) in scores.iter().zip(first..=query_position) {
        let value_row = values
            .row(kv_head, key, width)
            .ok_or(EngineError::WrongInput(VALUE_OUTSIDE))?;
        for (o, v) in results.iter_mut().zip(value_row) {
            *o += weight * v;
        }
    }
    for o in results.iter_mut() {
        *o /= total;
    }
    Ok(())
}

/// A row `W` wide of a view, as an array. (The error is built only when
/// the row is missing: built and dropped on every row it cost 3 % of a
/// long prompt's prefill.)
#[inline(always)]
fn fixed_row<'a, const W: usize>(
    view: &View<'a>,
    head: usize,
    position: usize,
    what: &'static str,
) -> Result<&'a [f32; W]> {
    match view
        .row(head, position, W)
        .and_then(|row| <&[f32; W]>::try_from(row).ok())
    {
        Some(row) => Ok(row),
        None => Err(EngineError::WrongInput(what)),
    }
}

/// `sum += weights[j] · row(j)` for each `j` in order, each element's
/// additions in key order (so [`piece_rows`]' bits). With AVX, eight
/// vectors of eight lanes at a time, so the sums stay in registers.
#[inline(always)]
fn add_weighted_rows<'a, const W: usize>(
    simd: Simd,
    sum: &mut [f32; W],
    weights: &[f32],
    row: impl Fn(usize) -> Result<&'a [f32; W]>,
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd
        && W.is_multiple_of(64)
    {
        let (parts, _) = sum.as_chunks_mut::<64>();
        for (p, part) in parts.iter_mut().enumerate() {
            let mut lanes: [pulp::f32x8; 8] = pulp::cast(*part);
            for (j, &weight) in weights.iter().enumerate() {
                let (values, _) = row(j)?.as_chunks::<64>();
                let values: [pulp::f32x8; 8] = pulp::cast(values[p]);
                let weight = simd.splat_f32x8(weight);
                for (lane, v) in lanes.iter_mut().zip(values) {
                    *lane = simd.add_f32x8(*lane, simd.mul_f32x8(weight, v));
                }
            }
            *part = pulp::cast(lanes);
        }
        return Ok(());
    }
    for (j, weight) in weights.iter().enumerate() {
        for (o, v) in sum.iter_mut().zip(row(j)?) {
            *o += weight * v;
        }
    }
    Ok(())
}

/// [`dots4`] in AVX registers where the CPU has them, one per key: each
/// lane's products added in [`dot`]'s order, so [`dot`]'s bits.
#[inline(always)]
fn dots4_fast<const W: usize>(simd: Simd, query: &[f32; W], keys: [&[f32; W]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd
        && W.is_multiple_of(8)
    {
        let (q8, _) = query.as_chunks::<8>();
        let k8 = keys.map(|key| key.as_chunks::<8>().0);
        let mut sums = [simd.splat_f32x8(0.0); 4];
        for (c, &q) in q8.iter().enumerate() {
            let q: pulp::f32x8 = pulp::cast(q);
            for (sum, key) in sums.iter_mut().zip(k8) {
                let k: pulp::f32x8 = pulp::cast(key[c]);
                *sum = simd.add_f32x8(*sum, simd.mul_f32x8(q, k));
            }
        }
        // `+ 0.0` as `dot` adds its empty tail: it turns a sum of -0.0
        // into +0.0, so the bits stay `dot`'s.
        return sums.map(|sum| lanes_total(pulp::cast(sum)) + 0f32);
    }
    dots4(query, keys)
}

/// The vector unit a piece runs on: AVX2's (x86-64-v3) where the CPU has
/// it, else none (the portable loops, the same bits).
#[cfg(target_arch = "x86_64")]
type Simd = Option<pulp::x86::V3>;
#[cfg(not(target_arch = "x86_64"))]
type Simd = Option<std::convert::Infallible>;

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
    lanes_total(lanes) + tail
}

/// [`dot`] of one query with four keys at once: each key's products and
/// sums in [`dot`]'s order, so each gives [`dot`]'s bits. The portable
/// loops, where the CPU has no AVX2 ([`dots4_fast`]); left to itself,
/// LLVM vectorised these across the four keys, not along each key.
#[inline(always)]
fn dots4<const W: usize>(query: &[f32; W], keys: [&[f32; W]; 4]) -> [f32; 4] {
    let (q8, q_tail) = query.as_chunks::<8>();
    let [k0, k1, k2, k3] = keys.map(|key| key.as_chunks::<8>().0);
    let mut lanes = [[0f32; 8]; 4];
    for ((((q, a), b), c), d) in q8.iter().zip(k0).zip(k1).zip(k2).zip(k3) {
        add_products(&mut lanes[0], q, a);
        add_products(&mut lanes[1], q, b);
        add_products(&mut lanes[2], q, c);
        add_products(&mut lanes[3], q, d);
    }
    let whole = W - q_tail.len();
    let mut dots = [0f32; 4];
    for ((key, lanes), dot) in keys.iter().zip(lanes).zip(dots.iter_mut()) {
        let mut tail = 0f32;
        for (x, y) in q_tail.iter().zip(&key[whole..]) {
            tail += x * y;
        }
        *dot = lanes_total(lanes) + tail;
    }
    dots
}

/// `lanes[i] += a[i] * b[i]`, lane by lane.
#[inline(always)]
fn add_products(lanes: &mut [f32; 8], a: &[f32; 8], b: &[f32; 8]) {
    for lane in 0..8 {
        lanes[lane] += a[lane] * b[lane];
    }
}

/// Eight lanes' sum, in one fixed order.
#[inline(always)]
fn lanes_total(lanes: [f32; 8]) -> f32 {
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
}

/// Each score replaced by `exp(score - maximum)` over the row's maximum;
/// their total. Eight lanes at a time, each in a fixed order, so the bits
/// depend on the scores alone.
#[inline(always)]
fn exponentials(scores: &mut [f32]) -> f32 {
    let mut maxima = [f32::NEG_INFINITY; 8];
    let mut chunks = scores.chunks_exact(8);
    for chunk in &mut chunks {
        for lane in 0..8 {
            maxima[lane] = maxima[lane].max(chunk[lane]);
        }
    }
    let mut maximum = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, s| m.max(*s));
    for m in maxima {
        maximum = maximum.max(m);
    }
    let mut totals = [0f32; 8];
    let mut chunks = scores.chunks_exact_mut(8);
    for chunk in &mut chunks {
        for lane in 0..8 {
            let e = exp(chunk[lane] - maximum);
            chunk[lane] = e;
            totals[lane] += e;
        }
    }
    let mut tail = 0f32;
    for score in chunks.into_remainder() {
        let e = exp(*score - maximum);
        *score = e;
        tail += e;
    }
    lanes_total(totals) + tail
}

/// `e^x` for `x <= 0` (scores less their maximum), to about one unit in
/// the last place: `2^n · p(r)` with `x = n ln 2 + r`, `|r| <= ln 2 / 2`,
/// and `p` Cephes' `expf` polynomial. Adds and multiplies only (no fused
/// multiply-add, no table, no branch), so the compiler runs eight at once
/// and every build gives the same bits. Below -87 (where `e^x` leaves
/// f32's normal range) it gives `e^-87`, which is nothing beside the
/// maximum's `1`.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts: `n * LN2_HIGH` is exact for the n that occur.
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds to an integer, kept in the low bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 0.0);
    let shifted = x * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HIGH) - n * LN2_LOW;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_66;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // The integer n sits in `shifted`'s low mantissa bits; 2^n is built
    // from it as an exponent field (n >= -126 here, so normal).
    let n_bits = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let two_to_n = f32::from_bits((n_bits.wrapping_add(127) << 23) as u32);
    e * two_to_n
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
        assert!(seq * 6 * cached >= PARALLEL_WORK);
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
            for index in 0..seq * heads {
                let mut general = vec![0f32; width];
                let mut fixed = vec![0f32; width];
                piece_rows(&inputs, index, &mut general, &mut Scratch::new(cached)).unwrap();
                rows_of_width(
                    simd(),
                    &inputs,
                    index,
                    &mut fixed,
                    &mut Scratch::new(cached),
                )
                .unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&general), bits(&fixed), "width {width} piece {index}");
            }
        }
    }

    fn simd() -> Simd {
        #[cfg(target_arch = "x86_64")]
        return pulp::x86::V3::try_new();
        #[cfg(not(target_arch = "x86_64"))]
        None
    }

    /// The AVX loops give the portable loops' bits.
    #[test]
    fn the_vector_loops_give_the_portable_loops_bits() {
        let row = |seed: u64| -> [f32; 128] {
            let values: Vec<f32> = random((1, 1, 1, 128), seed)
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            values.try_into().unwrap()
        };
        let query = row(1);
        let keys = [row(2), row(3), row(4), row(5)];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let four = dots4_fast(simd(), &query, [&keys[0], &keys[1], &keys[2], &keys[3]]);
        let portable = dots4(&query, [&keys[0], &keys[1], &keys[2], &keys[3]]);
        let one_by_one: Vec<f32> = keys.iter().map(|k| dot(&query, k)).collect();
        assert_eq!(bits(&four), bits(&portable));
        assert_eq!(bits(&four), bits(&one_by_one));
        let weights = [0.25f32, 0.5, 0.125, 0.0625];
        let mut fast = [0f32; 128];
        add_weighted_rows::<128>(simd(), &mut fast, &weights, |j| Ok(&keys[j])).unwrap();
        let mut slow = [0f32; 128];
        for (weight, key) in weights.iter().zip(&keys) {
            for (o, v) in slow.iter_mut().zip(key) {
                *o += weight * v;
            }
        }
        assert_eq!(bits(&fast), bits(&slow));
    }

    #[test]
    fn exp_is_within_two_units_in_the_last_place_of_std() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let ours = f64::from(exp(x));
            let exact = f64::from(x).exp();
            worst = worst.max(((ours - exact) / exact).abs());
        }
        // f32's unit in the last place is 2^-23 of the value (1.2e-7).
        assert!(worst < 2.4e-7, "relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1e-37);
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
