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

use std::sync::Mutex;

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

/// A rank-4 `(1, heads, positions, head_dim)` tensor's values and the
/// strides of its head and position axes (its last axis is contiguous).
struct View<'a, T> {
    values: &'a [T],
    start: usize,
    head_stride: usize,
    position_stride: usize,
    positions: usize,
}

impl<'a, T: Stored> View<'a, T> {
    #[inline(always)]
    fn row(&self, head: usize, position: usize, width: usize) -> Option<&'a [T]> {
        let at = self.start + head * self.head_stride + position * self.position_stride;
        self.values.get(at..at + width)
    }

    /// Rows `positions` of `head` as f32, `width` apart: read in place
    /// where they are contiguous f32, else widened into `into` (one
    /// conversion for the lot where they are contiguous).
    #[inline(always)]
    fn tile<'s>(
        &self,
        head: usize,
        positions: std::ops::Range<usize>,
        width: usize,
        into: &'s mut [f32],
        what: &'static str,
    ) -> Result<&'s [f32]>
    where
        'a: 's,
    {
        let count = positions.len();
        if self.position_stride == width {
            let at = self.start + head * self.head_stride + positions.start * width;
            let rows = self
                .values
                .get(at..at + count * width)
                .ok_or_else(|| outside(what))?;
            if let Some(rows) = T::as_f32(rows) {
                return Ok(rows);
            }
            let into = into.get_mut(..count * width).ok_or_else(|| outside(what))?;
            T::widen(rows, into);
            return Ok(into);
        }
        let into = into.get_mut(..count * width).ok_or_else(|| outside(what))?;
        for (position, into) in positions.zip(into.chunks_exact_mut(width)) {
            let row = self
                .row(head, position, width)
                .ok_or_else(|| outside(what))?;
            T::widen(row, into);
        }
        Ok(into)
    }
}

/// The error for a row outside its view, built only when one is (built
/// and dropped on every row it cost 3 % of a long prompt's prefill).
fn outside(what: &'static str) -> EngineError {
    EngineError::WrongInput(what)
}

/// What a KV cache holds: f16, as the engine's own route keeps it (and as
/// llama.cpp does: half the bytes to read at every step deep in a long
/// context), or f32 (candle's route, and the queries). Widening is exact,
/// so where the conversion runs does not change a bit.
trait Stored: candle_core::WithDType {
    /// `into` (as long as `rows`) = `rows` as f32.
    fn widen(rows: &[Self], into: &mut [f32]);
    /// `rows` themselves, when they are f32 already.
    fn as_f32(rows: &[Self]) -> Option<&[f32]>;
}

impl Stored for f32 {
    #[inline(always)]
    fn widen(rows: &[f32], into: &mut [f32]) {
        into.copy_from_slice(rows);
    }
    #[inline(always)]
    fn as_f32(rows: &[f32]) -> Option<&[f32]> {
        Some(rows)
    }
}

impl Stored for half::f16 {
    #[inline(always)]
    fn widen(rows: &[half::f16], into: &mut [f32]) {
        crate::kernels::widen_f16(rows, into);
    }
    #[inline(always)]
    fn as_f32(_: &[half::f16]) -> Option<&[f32]> {
        None
    }
}

fn view<'a, T: Stored>(storage: &'a Storage, layout: &candle_core::Layout) -> Option<View<'a, T>> {
    let Storage::Cpu(cpu) = storage else {
        return None;
    };
    let values = cpu.as_slice::<T>().ok()?;
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
/// tensors are not on the CPU, the queries not f32, or the cache neither
/// f16 nor f32: the caller takes candle's route.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    span: Span,
) -> Result<Option<Tensor>> {
    if !matches!(q.device(), Device::Cpu) || q.dtype() != DType::F32 || k.dtype() != v.dtype() {
        return Ok(None);
    }
    match k.dtype() {
        DType::F32 => attend_over::<f32>(q, k, v, scale, span),
        // A prompt chunk's rows each read every key: the cache is widened
        // once for all of them (exact, so the same bits) rather than a
        // tile at a time for each row.
        DType::F16 if q.dim(2)? >= WIDEN_WHOLE_ROWS => {
            let (k, v) = (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
            attend_over::<f32>(q, &k, &v, scale, span)
        }
        DType::F16 => attend_over::<half::f16>(q, k, v, scale, span),
        _ => Ok(None),
    }
}

/// Rows of a step from which an f16 cache is widened whole before the
/// step attends, instead of a tile at a time per row.
const WIDEN_WHOLE_ROWS: usize = 8;

/// [`attend`] over a cache of `T`.
fn attend_over<T: Stored>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    span: Span,
) -> Result<Option<Tensor>> {
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
    // A row sees at least its own key (a model with a window of none is
    // refused when it is opened; this keeps every row's keys non-empty).
    if span.window == 0 {
        return Err(EngineError::WrongInput("has a window of no keys"));
    }
    let group = heads / kv_heads;
    let q = q.contiguous()?;
    let (q_storage, q_layout) = q.storage_and_layout();
    let (k_storage, k_layout) = k.storage_and_layout();
    let (v_storage, v_layout) = v.storage_and_layout();
    let (Some(queries), Some(keys), Some(values)) = (
        view::<f32>(&q_storage, q_layout),
        view::<T>(&k_storage, k_layout),
        view::<T>(&v_storage, v_layout),
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
    let pool = crate::kernels::pool::pool();
    let spread = seq * heads * cached >= PARALLEL_WORK;
    let blocks = inputs.blocks(seq);
    if spread && blocks.len() > 1 && seq * kv_heads < 4 * pool.threads() {
        by_blocks(&inputs, blocks, &mut out)?;
    } else {
        by_groups(&inputs, spread, &mut out)?;
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

/// Keys per block of a row's softmax, at absolute positions (block `b`
/// holds keys `b * KEY_BLOCK..(b + 1) * KEY_BLOCK`): a row's scores are
/// exponentiated and its values summed a block at a time, and the blocks
/// folded together in key order ([`merge`]). No row needs more than a
/// block of scores, and a row deep in a long context can be spread over
/// the threads by its blocks. Where the blocks fall depends on positions
/// only, so a row's bits do not depend on the step, the batch or the
/// threads.
const KEY_BLOCK: usize = 256;

/// Elements of keys (and values) widened to f32 at a time and used by
/// every query row of a piece before the next are read (16 KiB, in the L1
/// cache beside the piece's queries): sixteen rows of Gemma 3's 256, 64
/// of SmolLM2's 64, so a narrow head's tile costs as much to walk as a
/// wide one's.
const TILE_ELEMENTS: usize = 4096;

/// Step rows a prompt piece holds: each tile of keys and values is read
/// (and widened) once for every query head of the KV group at each of
/// these rows, not once per row.
const PIECE_ROWS: usize = 8;

/// A prompt chunk, or a step shallower than a block: a piece is up to
/// [`PIECE_ROWS`] step rows of one KV group, each row's blocks folded in
/// key order ([`group_rows`]).
fn by_groups<T: Stored>(inputs: &Inputs<'_, T>, spread: bool, out: &mut [f32]) -> Result<()> {
    let Inputs {
        group,
        kv_heads,
        width,
        ..
    } = *inputs;
    // One output per step row and KV group, locked by the piece that
    // computes it (each by one piece only).
    let row_results: Vec<Mutex<&mut [f32]>> = out
        .chunks_exact_mut(group * width)
        .map(Mutex::new)
        .collect();
    let seq = row_results.len() / kv_heads;
    let pieces = seq.div_ceil(PIECE_ROWS) * kv_heads;
    let failure: Mutex<Option<EngineError>> = Mutex::new(None);
    let run = |range: std::ops::Range<usize>| {
        let mut scratch = Scratch::default();
        for index in range {
            let (chunk, kv_head) = (index / kv_heads, index % kv_heads);
            let rows = chunk * PIECE_ROWS..((chunk + 1) * PIECE_ROWS).min(seq);
            if let Err(error) = with_simd(|simd| {
                by_width(width, |width| {
                    group_rows(simd, inputs, width, (rows.clone(), kv_head), &mut scratch)
                })
            }) {
                keep(&failure, error);
                continue;
            }
            let records = scratch.running.chunks_exact(group * (width + 2));
            for (row, records) in rows.zip(records) {
                if let Some(results) = row_results.get(row * kv_heads + kv_head) {
                    let mut results = results
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                    finish(records, &mut results, width);
                }
            }
        }
    };
    if spread {
        crate::kernels::pool::pool().for_each_piece(pieces, run);
    } else {
        run(0..pieces);
    }
    drop(row_results);
    failure.into_inner().ok().flatten().map_or(Ok(()), Err)
}

/// A few rows deep in a long context (a decode step, a draft's rows):
/// every block of every row's KV groups is a piece for the threads, then
/// each row's blocks are folded in key order, as [`group_rows`] folds
/// them.
/// `blocks`: the blocks (absolute, [`KEY_BLOCK`]) any of the step's rows
/// sees, from its first row's first key to its last row's position.
fn by_blocks<T: Stored>(
    inputs: &Inputs<'_, T>,
    blocks: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let Inputs {
        group,
        kv_heads,
        width,
        ..
    } = *inputs;
    let record = width + 2;
    let seq = out.len() / (group * kv_heads * width).max(1);
    let (first_block, blocks) = (blocks.start, blocks.len().max(1));
    let mut partials = vec![0f32; seq * kv_heads * blocks * group * record];
    let pieces: Vec<Mutex<&mut [f32]>> = partials
        .chunks_exact_mut(group * record)
        .map(Mutex::new)
        .collect();
    let failure: Mutex<Option<EngineError>> = Mutex::new(None);
    let run = |range: std::ops::Range<usize>| {
        let mut work = Work::default();
        for index in range {
            let (group_index, block) = (index / blocks, index % blocks);
            let (step_row, kv_head) = (group_index / kv_heads, group_index % kv_heads);
            let keys = block_keys(inputs.keys_of(step_row), first_block + block);
            let Some(piece) = pieces.get(index).filter(|_| !keys.is_empty()) else {
                continue;
            };
            let mut records = piece
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Err(error) = with_simd(|simd| {
                by_width(width, |width| {
                    let at = (step_row..step_row + 1, kv_head, first_block + block);
                    block_partial(simd, inputs, width, at, &mut work, &mut records)
                })
            }) {
                keep(&failure, error);
            }
        }
    };
    crate::kernels::pool::pool().for_each_piece(pieces.len(), run);
    drop(pieces);
    if let Some(error) = failure.into_inner().ok().flatten() {
        return Err(error);
    }
    let mut running = vec![0f32; group * record];
    for ((group_index, results), partials) in out
        .chunks_exact_mut(group * width)
        .enumerate()
        .zip(partials.chunks_exact(blocks * group * record))
    {
        let keys = inputs.keys_of(group_index / kv_heads);
        let in_row =
            (0..blocks).filter(|&block| !block_keys(keys.clone(), first_block + block).is_empty());
        for (n, block) in in_row.enumerate() {
            let records = partials
                .get(block * group * record..(block + 1) * group * record)
                .ok_or(EngineError::WrongInput(KEY_OUTSIDE))?;
            if n == 0 {
                running.copy_from_slice(records);
            } else {
                for (into, from) in running
                    .chunks_exact_mut(record)
                    .zip(records.chunks_exact(record))
                {
                    merge(into, from);
                }
            }
        }
        finish(&running, results, width);
    }
    Ok(())
}

fn keep(failure: &Mutex<Option<EngineError>>, error: EngineError) {
    if let Ok(mut failure) = failure.lock() {
        *failure = Some(error);
    }
}

/// `f` on AVX2's vector unit (x86-64-v3) where the CPU has it, else on
/// the portable loops: no fused multiply-add either way, so both give the
/// same bits.
#[inline(always)]
fn with_simd<R>(f: impl FnOnce(Simd) -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(|| f(Some(simd)));
    }
    f(None)
}

/// `f` with the common head widths as constants, so the loops inside are
/// compiled for them (each row's query and sums held in registers); any
/// other width as it comes. The same operations in the same order either
/// way, so the same bits.
#[inline(always)]
fn by_width<R>(width: usize, f: impl FnOnce(usize) -> R) -> R {
    match width {
        64 => f(64),
        128 => f(128),
        256 => f(256),
        other => f(other),
    }
}

/// The keys a row sees: from its window's start to its own position.
type Keys = std::ops::Range<usize>;

/// The keys of `keys` inside block `block` (empty when none are).
fn block_keys(keys: Keys, block: usize) -> Keys {
    let start = keys.start.max(block * KEY_BLOCK);
    let end = keys.end.min((block + 1) * KEY_BLOCK);
    start..end.max(start)
}

struct Inputs<'a, T> {
    queries: &'a View<'a, f32>,
    keys: &'a View<'a, T>,
    values: &'a View<'a, T>,
    group: usize,
    kv_heads: usize,
    width: usize,
    scale: f32,
    span: Span,
}

impl<T> Inputs<'_, T> {
    /// The blocks ([`KEY_BLOCK`]) a step of `seq` rows sees, from its
    /// first row's first key to its last row's own key.
    fn blocks(&self, seq: usize) -> std::ops::Range<usize> {
        self.keys_of(0).start / KEY_BLOCK..(self.span.position + seq).div_ceil(KEY_BLOCK)
    }

    /// The keys step row `step_row` sees.
    fn keys_of(&self, step_row: usize) -> Keys {
        let query_position = self.span.position + step_row;
        (query_position + 1).saturating_sub(self.span.window)..query_position + 1
    }
}

/// One piece's scores and block records, reused from piece to piece.
#[derive(Default)]
struct Scratch {
    work: Work,
    running: Vec<f32>,
    block: Vec<f32>,
}

/// A block's scores (one run per head of the group) and the tile of keys
/// or values it is reading, widened to f32.
#[derive(Default)]
struct Work {
    scores: Vec<f32>,
    tile: Vec<f32>,
}

/// Step rows `rows` of KV group `kv_head`: every query head of the group
/// at each row, its blocks computed and folded in key order, into
/// `scratch.running` (per row, `group` records of `width + 2`: the
/// running maximum, total and sums that [`finish`] divides).
#[inline(always)]
fn group_rows<T: Stored>(
    simd: Simd,
    inputs: &Inputs<'_, T>,
    width: usize,
    (rows, kv_head): (std::ops::Range<usize>, usize),
    scratch: &mut Scratch,
) -> Result<()> {
    let row_size = inputs.group * (width + 2);
    let size = rows.len() * row_size;
    let Scratch {
        work,
        running,
        block,
    } = scratch;
    running.clear();
    running.resize(size, 0.0);
    block.resize(size, 0.0);
    if rows.is_empty() {
        return Ok(());
    }
    let first = inputs.keys_of(rows.start).start / KEY_BLOCK;
    let last = inputs.keys_of(rows.end - 1).end.div_ceil(KEY_BLOCK);
    for b in first..last {
        block_partial(simd, inputs, width, (rows.clone(), kv_head, b), work, block)?;
        let records = running
            .chunks_exact_mut(row_size)
            .zip(block.chunks_exact(row_size));
        for (row, (running, block)) in rows.clone().zip(records) {
            let keys = inputs.keys_of(row);
            if block_keys(keys.clone(), b).is_empty() {
                continue;
            }
            if keys.start / KEY_BLOCK == b {
                running.copy_from_slice(block);
                continue;
            }
            for (into, from) in running
                .chunks_exact_mut(width + 2)
                .zip(block.chunks_exact(width + 2))
            {
                merge(into, from);
            }
        }
    }
    Ok(())
}

/// Block `block` of keys for every query head of a KV group at each step
/// row of `rows`, into `records` (per row, one per head, `width + 2`
/// long): the scores' maximum, the total of `exp(score - maximum)`, and
/// the values weighted by those exponentials, each element's additions in
/// key order. A row that sees no key of the block leaves its records as
/// they were. Each key and value row is read once for the whole piece,
/// and each row's arithmetic is the same whatever the other rows are.
#[inline(always)]
fn block_partial<T: Stored>(
    simd: Simd,
    inputs: &Inputs<'_, T>,
    width: usize,
    (rows, kv_head, block): (std::ops::Range<usize>, usize, usize),
    work: &mut Work,
    records: &mut [f32],
) -> Result<()> {
    let Inputs {
        queries,
        keys: key_rows,
        values,
        group,
        scale,
        ..
    } = *inputs;
    let row_keys = |row: usize| block_keys(inputs.keys_of(row), block);
    // The keys any of the rows sees in this block.
    let seen = rows
        .clone()
        .map(row_keys)
        .filter(|keys| !keys.is_empty())
        .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end));
    let Some(seen) = seen else {
        return Ok(());
    };
    let count = seen.len();
    let Work { scores, tile } = work;
    scores.clear();
    scores.resize(rows.len() * group * count, 0.0);
    let tile_rows = (TILE_ELEMENTS / width).max(1);
    tile.resize(tile_rows * width, 0.0);
    for tile_start in seen.clone().step_by(tile_rows) {
        let tile_keys = tile_start..(tile_start + tile_rows).min(seen.end);
        let tile = key_rows.tile(kv_head, tile_keys.clone(), width, tile, KEY_OUTSIDE)?;
        for (row, row_scores) in rows.clone().zip(scores.chunks_exact_mut(group * count)) {
            let keys = row_keys(row);
            let here = keys.start.max(tile_keys.start)..keys.end.min(tile_keys.end);
            if here.start >= here.end {
                continue;
            }
            let query = |h: usize| row_of(queries, kv_head * group + h, row, width, QUERY_OUTSIDE);
            let in_tile = here.start - tile_keys.start..here.end - tile_keys.start;
            let first_score = here.start - seen.start;
            let mut heads = row_scores.chunks_exact_mut(count).enumerate();
            while let Some((h, scores_a)) = heads.next() {
                match heads.next() {
                    Some((_, scores_b)) => {
                        let pair = [query(h)?, query(h + 1)?];
                        let into = [&mut scores_a[first_score..], &mut scores_b[first_score..]];
                        score_pair(simd, pair, tile, width, in_tile.clone(), scale, into)?;
                    }
                    None => {
                        let into = &mut scores_a[first_score..];
                        score_one(simd, query(h)?, tile, width, in_tile.clone(), scale, into)?;
                    }
                }
            }
        }
    }
    for ((row, row_records), row_scores) in rows
        .clone()
        .zip(records.chunks_exact_mut(group * (width + 2)))
        .zip(scores.chunks_exact_mut(group * count))
    {
        let keys = row_keys(row);
        if keys.is_empty() {
            continue;
        }
        let mine = keys.start - seen.start..keys.end - seen.start;
        for (record, head_scores) in row_records
            .chunks_exact_mut(width + 2)
            .zip(row_scores.chunks_exact_mut(count))
        {
            let (maximum, total) = exponentials(simd, &mut head_scores[mine.clone()]);
            record[0] = maximum;
            record[1] = total;
            record[2..].fill(0.0);
        }
    }
    for tile_start in seen.clone().step_by(tile_rows) {
        let tile_keys = tile_start..(tile_start + tile_rows).min(seen.end);
        let tile = values.tile(kv_head, tile_keys.clone(), width, tile, VALUE_OUTSIDE)?;
        for ((row, row_records), row_scores) in rows
            .clone()
            .zip(records.chunks_exact_mut(group * (width + 2)))
            .zip(scores.chunks_exact(group * count))
        {
            let keys = row_keys(row);
            let here = keys.start.max(tile_keys.start)..keys.end.min(tile_keys.end);
            if here.start >= here.end {
                continue;
            }
            let weights = here.start - seen.start..here.end - seen.start;
            let in_tile =
                (here.start - tile_keys.start) * width..(here.end - tile_keys.start) * width;
            let value_rows = tile
                .get(in_tile)
                .ok_or(EngineError::WrongInput(VALUE_OUTSIDE))?;
            let mut heads = row_records
                .chunks_exact_mut(width + 2)
                .zip(row_scores.chunks_exact(count));
            while let Some((record_a, scores_a)) = heads.next() {
                let weights_a = &scores_a[weights.clone()];
                match heads.next() {
                    Some((record_b, scores_b)) => add_weighted_pair(
                        simd,
                        [&mut record_a[2..], &mut record_b[2..]],
                        [weights_a, &scores_b[weights.clone()]],
                        value_rows,
                    )?,
                    None => add_weighted_rows(simd, &mut record_a[2..], weights_a, |j| {
                        tile_row(value_rows, j, width)
                    })?,
                }
            }
        }
    }
    Ok(())
}

/// Two query heads' scores against the tile's rows `in_tile`, into the
/// start of each head's `scores`: four keys at a time for both heads at
/// once (each key row loaded once for the two), then one at a time; each
/// score [`dot`]'s bits times `scale`.
#[inline(always)]
fn score_pair(
    simd: Simd,
    queries: [&[f32]; 2],
    tile: &[f32],
    width: usize,
    in_tile: std::ops::Range<usize>,
    scale: f32,
    scores: [&mut [f32]; 2],
) -> Result<()> {
    let [scores_a, scores_b] = scores;
    let mut at = in_tile.start;
    let mut n = 0;
    while at + 4 <= in_tile.end {
        let rows = four_rows(tile, at, width)?;
        let [a, b] = dots_pair4_fast(simd, queries, rows);
        let (Some(into_a), Some(into_b)) = (scores_a.get_mut(n..n + 4), scores_b.get_mut(n..n + 4))
        else {
            return Err(EngineError::WrongInput(KEY_OUTSIDE));
        };
        for ((into_a, into_b), (a, b)) in into_a.iter_mut().zip(into_b).zip(a.into_iter().zip(b)) {
            *into_a = a * scale;
            *into_b = b * scale;
        }
        at += 4;
        n += 4;
    }
    let rest = at..in_tile.end;
    score_one(
        simd,
        queries[0],
        tile,
        width,
        rest.clone(),
        scale,
        scores_a.get_mut(n..).unwrap_or_default(),
    )?;
    score_one(
        simd,
        queries[1],
        tile,
        width,
        rest,
        scale,
        scores_b.get_mut(n..).unwrap_or_default(),
    )
}

/// One query head's scores against the tile's rows `in_tile`, into the
/// start of `scores`, four keys at a time, then one at a time.
#[inline(always)]
fn score_one(
    simd: Simd,
    query: &[f32],
    tile: &[f32],
    width: usize,
    in_tile: std::ops::Range<usize>,
    scale: f32,
    scores: &mut [f32],
) -> Result<()> {
    if scores.len() < in_tile.len() {
        return Err(EngineError::WrongInput(KEY_OUTSIDE));
    }
    let mut at = in_tile.start;
    let mut n = 0;
    while at + 4 <= in_tile.end {
        let rows = four_rows(tile, at, width)?;
        for (into, dot) in scores[n..n + 4]
            .iter_mut()
            .zip(dots4_fast(simd, query, rows))
        {
            *into = dot * scale;
        }
        at += 4;
        n += 4;
    }
    for at in at..in_tile.end {
        scores[n] = dot(query, tile_row(tile, at, width)?) * scale;
        n += 1;
    }
    Ok(())
}

/// Rows `at` to `at + 3` of a tile.
#[inline(always)]
fn four_rows(tile: &[f32], at: usize, width: usize) -> Result<[&[f32]; 4]> {
    Ok([
        tile_row(tile, at, width)?,
        tile_row(tile, at + 1, width)?,
        tile_row(tile, at + 2, width)?,
        tile_row(tile, at + 3, width)?,
    ])
}

/// Row `at` of a tile.
#[inline(always)]
fn tile_row(tile: &[f32], at: usize, width: usize) -> Result<&[f32]> {
    match tile.get(at * width..(at + 1) * width) {
        Some(row) => Ok(row),
        None => Err(EngineError::WrongInput(KEY_OUTSIDE)),
    }
}

/// Fold a later block's record into a row's running one: both totals and
/// both sums scaled to the larger maximum (`exp(0)` is exactly 1, so the
/// side holding the maximum is kept as it is).
#[inline(always)]
fn merge(running: &mut [f32], block: &[f32]) {
    let (
        [running_maximum, running_total, sums @ ..],
        [block_maximum, block_total, block_sums @ ..],
    ) = (running, block)
    else {
        return;
    };
    let maximum = running_maximum.max(*block_maximum);
    let (a, b) = (
        exp(*running_maximum - maximum),
        exp(*block_maximum - maximum),
    );
    *running_maximum = maximum;
    *running_total = *running_total * a + *block_total * b;
    for (sum, block_sum) in sums.iter_mut().zip(block_sums) {
        *sum = *sum * a + *block_sum * b;
    }
}

/// Each head's sums divided by its total, into its output row.
#[inline(always)]
fn finish(running: &[f32], results: &mut [f32], width: usize) {
    for (record, row) in running
        .chunks_exact(width + 2)
        .zip(results.chunks_exact_mut(width))
    {
        let total = record[1];
        for (r, sum) in row.iter_mut().zip(&record[2..]) {
            *r = sum / total;
        }
    }
}

const QUERY_OUTSIDE: &str = "has a query outside its tensor";
const KEY_OUTSIDE: &str = "has a key outside its cache";
const VALUE_OUTSIDE: &str = "has a value outside its cache";

/// A row `width` wide of a view. (The error is built only when the row is
/// missing: built and dropped on every row it cost 3 % of a long prompt's
/// prefill.)
#[inline(always)]
fn row_of<'a>(
    view: &View<'a, f32>,
    head: usize,
    position: usize,
    width: usize,
    what: &'static str,
) -> Result<&'a [f32]> {
    match view.row(head, position, width) {
        Some(row) => Ok(row),
        None => Err(EngineError::WrongInput(what)),
    }
}

/// `sum += weights[j] · row(j)` for each `j` in order, each element's
/// additions in key order. With AVX, eight vectors of eight lanes at a
/// time, so the sums stay in registers.
#[inline(always)]
fn add_weighted_rows<'a>(
    simd: Simd,
    sum: &mut [f32],
    weights: &[f32],
    row: impl Fn(usize) -> Result<&'a [f32]>,
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd
        && sum.len().is_multiple_of(64)
    {
        let (parts, _) = sum.as_chunks_mut::<64>();
        for (p, part) in parts.iter_mut().enumerate() {
            let mut lanes: [pulp::f32x8; 8] = pulp::cast(*part);
            for (j, &weight) in weights.iter().enumerate() {
                let (values, _) = row(j)?.as_chunks::<64>();
                let Some(values) = values.get(p) else {
                    return Err(EngineError::WrongInput(VALUE_OUTSIDE));
                };
                let values: [pulp::f32x8; 8] = pulp::cast(*values);
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

/// [`add_weighted_rows`] for two heads' sums over the same rows (`rows`:
/// one after another, each as long as a sum): each row's chunk loaded
/// once for both, 32 elements of each sum held in registers; each
/// element's additions in key order, so the same bits.
#[inline(always)]
fn add_weighted_pair(
    simd: Simd,
    sums: [&mut [f32]; 2],
    weights: [&[f32]; 2],
    rows: &[f32],
) -> Result<()> {
    let [sum_a, sum_b] = sums;
    let width = sum_a.len();
    if sum_b.len() != width
        || weights[0].len() != weights[1].len()
        || rows.len() != weights[0].len() * width
    {
        return Err(EngineError::WrongInput(VALUE_OUTSIDE));
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd
        && width.is_multiple_of(32)
    {
        let (parts_a, _) = sum_a.as_chunks_mut::<32>();
        let (parts_b, _) = sum_b.as_chunks_mut::<32>();
        for (p, (part_a, part_b)) in parts_a.iter_mut().zip(parts_b.iter_mut()).enumerate() {
            let mut lanes_a: [pulp::f32x8; 4] = pulp::cast(*part_a);
            let mut lanes_b: [pulp::f32x8; 4] = pulp::cast(*part_b);
            for ((row, &weight_a), &weight_b) in
                rows.chunks_exact(width).zip(weights[0]).zip(weights[1])
            {
                let (values, _) = row.as_chunks::<32>();
                let Some(values) = values.get(p) else {
                    return Err(EngineError::WrongInput(VALUE_OUTSIDE));
                };
                let values: [pulp::f32x8; 4] = pulp::cast(*values);
                let (weight_a, weight_b) = (simd.splat_f32x8(weight_a), simd.splat_f32x8(weight_b));
                for ((lane_a, lane_b), v) in lanes_a.iter_mut().zip(lanes_b.iter_mut()).zip(values)
                {
                    *lane_a = simd.add_f32x8(*lane_a, simd.mul_f32x8(weight_a, v));
                    *lane_b = simd.add_f32x8(*lane_b, simd.mul_f32x8(weight_b, v));
                }
            }
            *part_a = pulp::cast(lanes_a);
            *part_b = pulp::cast(lanes_b);
        }
        return Ok(());
    }
    let row = |j: usize| tile_row(rows, j, width);
    add_weighted_rows(simd, sum_a, weights[0], row)?;
    add_weighted_rows(simd, sum_b, weights[1], row)
}

/// [`dots4`] in AVX registers where the CPU has them, one per key: each
/// lane's products added in [`dot`]'s order, so [`dot`]'s bits.
#[inline(always)]
fn dots4_fast(simd: Simd, query: &[f32], keys: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd
        && query.len().is_multiple_of(8)
        && keys.iter().all(|key| key.len() == query.len())
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
        return totals4(simd, sums).map(|total| total + 0f32);
    }
    dots4(query, keys)
}

/// [`dots4_fast`] for two queries against the same four keys: each key
/// chunk loaded once for both (eight independent chains of additions),
/// each dot in [`dot`]'s order, so [`dot`]'s bits.
#[inline(always)]
fn dots_pair4_fast(simd: Simd, queries: [&[f32]; 2], keys: [&[f32]; 4]) -> [[f32; 4]; 2] {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd
        && queries[0].len().is_multiple_of(8)
        && queries[1].len() == queries[0].len()
        && keys.iter().all(|key| key.len() == queries[0].len())
    {
        let [a8, b8] = queries.map(|query| query.as_chunks::<8>().0);
        let k8 = keys.map(|key| key.as_chunks::<8>().0);
        let mut sums_a = [simd.splat_f32x8(0.0); 4];
        let mut sums_b = [simd.splat_f32x8(0.0); 4];
        for (c, (&a, &b)) in a8.iter().zip(b8).enumerate() {
            let (a, b): (pulp::f32x8, pulp::f32x8) = (pulp::cast(a), pulp::cast(b));
            for ((sum_a, sum_b), key) in sums_a.iter_mut().zip(sums_b.iter_mut()).zip(k8) {
                let k: pulp::f32x8 = pulp::cast(key[c]);
                *sum_a = simd.add_f32x8(*sum_a, simd.mul_f32x8(a, k));
                *sum_b = simd.add_f32x8(*sum_b, simd.mul_f32x8(b, k));
            }
        }
        // `+ 0.0` as in `dots4_fast`.
        return [
            totals4(simd, sums_a).map(|total| total + 0f32),
            totals4(simd, sums_b).map(|total| total + 0f32),
        ];
    }
    [
        dots4_fast(simd, queries[0], keys),
        dots4_fast(simd, queries[1], keys),
    ]
}

/// Four keys' [`lanes_total`]s at once, each added in its order: each
/// key's halves (`l0 + l4`, …, two keys to a register), then neighbouring
/// pairs, then the two pair sums. A key at a time, the sums cost as much
/// as the products before them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn totals4(simd: pulp::x86::V3, sums: [pulp::f32x8; 4]) -> [f32; 4] {
    use std::arch::x86_64::__m256;
    let avx = simd.avx;
    let [s0, s1, s2, s3]: [__m256; 4] = sums.map(pulp::cast);
    let halves = |a: __m256, b: __m256| {
        avx._mm256_add_ps(
            avx._mm256_permute2f128_ps::<0x20>(a, b),
            avx._mm256_permute2f128_ps::<0x31>(a, b),
        )
    };
    let pairs = avx._mm256_hadd_ps(halves(s0, s1), halves(s2, s3));
    let totals: [f32; 8] = pulp::cast(avx._mm256_hadd_ps(pairs, pairs));
    // Keys 0 and 2 in the low 128 bits, 1 and 3 in the high.
    [totals[0], totals[4], totals[1], totals[5]]
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
fn dots4(query: &[f32], keys: [&[f32]; 4]) -> [f32; 4] {
    let (q8, q_tail) = query.as_chunks::<8>();
    let [k0, k1, k2, k3] = keys.map(|key| key.as_chunks::<8>().0);
    let mut lanes = [[0f32; 8]; 4];
    for ((((q, a), b), c), d) in q8.iter().zip(k0).zip(k1).zip(k2).zip(k3) {
        add_products(&mut lanes[0], q, a);
        add_products(&mut lanes[1], q, b);
        add_products(&mut lanes[2], q, c);
        add_products(&mut lanes[3], q, d);
    }
    let whole = query.len() - q_tail.len();
    let mut dots = [0f32; 4];
    for ((key, lanes), dot) in keys.iter().zip(lanes).zip(dots.iter_mut()) {
        let mut tail = 0f32;
        for (x, y) in q_tail.iter().zip(key.get(whole..).unwrap_or_default()) {
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

/// Each score replaced by `exp(score - maximum)` over the scores'
/// maximum; that maximum and their total. Eight lanes at a time, each in
/// a fixed order, so the bits depend on the scores alone: in AVX
/// registers where the CPU has them ([`exp8`], the same operations as
/// [`exp`]), else in the portable loops.
#[inline(always)]
fn exponentials(simd: Simd, scores: &mut [f32]) -> (f32, f32) {
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
    let (chunks, rest) = scores.as_chunks_mut::<8>();
    let mut totals = [0f32; 8];
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd {
        let avx = simd.avx;
        let (top, mut sums) = (avx._mm256_set1_ps(maximum), avx._mm256_setzero_ps());
        for chunk in chunks.iter_mut() {
            let e = exp8(simd, avx._mm256_sub_ps(pulp::cast(*chunk), top));
            *chunk = pulp::cast(e);
            sums = avx._mm256_add_ps(sums, e);
        }
        totals = pulp::cast(sums);
    }
    if simd.is_none() {
        for chunk in chunks.iter_mut() {
            for lane in 0..8 {
                let e = exp(chunk[lane] - maximum);
                chunk[lane] = e;
                totals[lane] += e;
            }
        }
    }
    let mut tail = 0f32;
    for score in rest {
        let e = exp(*score - maximum);
        *score = e;
        tail += e;
    }
    (maximum, lanes_total(totals) + tail)
}

/// [`exp`] of eight lanes in AVX registers: the same operations in the
/// same order, so [`exp`]'s bits (the clamp's maximum and minimum take
/// `x` second, so a NaN stays NaN as `f32::clamp` keeps it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn exp8(simd: pulp::x86::V3, x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    let (avx, avx2) = (simd.avx, simd.avx2);
    let splat = |value: f32| avx._mm256_set1_ps(value);
    let add = |a, b| avx._mm256_add_ps(a, b);
    let mul = |a, b| avx._mm256_mul_ps(a, b);
    let x = avx._mm256_min_ps(splat(0.0), avx._mm256_max_ps(splat(-87.0), x));
    let shifted = add(mul(x, splat(EXP_LOG2_E)), splat(EXP_ROUND));
    let n = avx._mm256_sub_ps(shifted, splat(EXP_ROUND));
    let r = avx._mm256_sub_ps(
        avx._mm256_sub_ps(x, mul(n, splat(EXP_LN2_HIGH))),
        mul(n, splat(EXP_LN2_LOW)),
    );
    let mut p = splat(EXP_POLYNOMIAL[0]);
    for c in &EXP_POLYNOMIAL[1..] {
        p = add(mul(p, r), splat(*c));
    }
    let e = add(add(mul(mul(p, r), r), r), splat(1.0));
    let n_bits = avx2._mm256_sub_epi32(
        avx._mm256_castps_si256(shifted),
        avx._mm256_set1_epi32(EXP_ROUND.to_bits() as i32),
    );
    let exponent =
        avx2._mm256_slli_epi32::<23>(avx2._mm256_add_epi32(n_bits, avx._mm256_set1_epi32(127)));
    mul(e, avx._mm256_castsi256_ps(exponent))
}

const EXP_LOG2_E: f32 = std::f32::consts::LOG2_E;
// ln 2 in two parts: `n * EXP_LN2_HIGH` is exact for the n that occur.
const EXP_LN2_HIGH: f32 = 0.693_359_4;
const EXP_LN2_LOW: f32 = -2.121_944_4e-4;
// 1.5 · 2^23: adding it rounds to an integer, kept in the low bits.
const EXP_ROUND: f32 = 12_582_912.0;
/// Cephes' `expf` polynomial, highest power first.
const EXP_POLYNOMIAL: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_66,
    0.5,
];

/// `e^x` for `x <= 0` (scores less their maximum), to about one unit in
/// the last place: `2^n · p(r)` with `x = n ln 2 + r`, `|r| <= ln 2 / 2`,
/// and `p` Cephes' `expf` polynomial. Adds and multiplies only (no fused
/// multiply-add, no table, no branch), so the compiler runs eight at once
/// and every build gives the same bits. Below -87 (where `e^x` leaves
/// f32's normal range) it gives `e^-87`, which is nothing beside the
/// maximum's `1`.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 0.0);
    let shifted = x * EXP_LOG2_E + EXP_ROUND;
    let n = shifted - EXP_ROUND;
    let r = (x - n * EXP_LN2_HIGH) - n * EXP_LN2_LOW;
    let mut p = EXP_POLYNOMIAL[0];
    for c in &EXP_POLYNOMIAL[1..] {
        p = p * r + c;
    }
    let e = p * r * r + r + 1.0;
    // The integer n sits in `shifted`'s low mantissa bits; 2^n is built
    // from it as an exponent field (n >= -126 here, so normal).
    let n_bits = (shifted.to_bits() as i32).wrapping_sub(EXP_ROUND.to_bits() as i32);
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
            // Several blocks of keys, folded in one piece and spread.
            (9, 3, 1, 700, 64, usize::MAX),
            (9, 3, 40, 700, 64, usize::MAX),
            (4, 1, 2, 1100, 256, 512),
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
        let no_window = Span {
            position: 1,
            window: 0,
        };
        assert!(attend(&q, &k, &k, 1.0, no_window).is_err());
    }

    /// A prompt long enough to spread over the compute threads gives each
    /// row the bits that row gets decoded alone.
    #[test]
    fn a_spread_prompt_row_has_the_bits_it_gets_alone() {
        // Rows several blocks deep: the prompt's rows fold their blocks in
        // one piece each, a row alone spreads its blocks over the threads.
        let (seq, cached) = (90, 600);
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

    /// The portable loops, the vector loops, a row's blocks in one piece
    /// and its blocks spread over the threads give every row the same
    /// bits, for each common width and another, grouped heads, windows,
    /// steps, and rows one block or several deep.
    #[test]
    fn every_route_gives_a_row_the_same_bits() {
        for (width, group, kv_heads, seq, cached, window) in [
            (64, 3, 3, 1, 700, usize::MAX),
            (64, 3, 3, 7, 40, usize::MAX),
            (128, 2, 1, 5, 600, 300),
            (256, 4, 1, 3, 530, 20),
            (13, 2, 2, 2, 300, usize::MAX),
            (64, 3, 3, 20, 300, 50),
            (256, 4, 1, 19, 600, usize::MAX),
        ] {
            let heads = group * kv_heads;
            let q = random((1, heads, seq, width), 11);
            let k = random((1, kv_heads, cached, width), 12);
            let v = random((1, kv_heads, cached, width), 13);
            let case = (
                group,
                kv_heads,
                width,
                Span {
                    position: cached - seq,
                    window,
                },
            );
            routes_agree::<f32>(&q, &k, &v, case);
            let (k, v) = (
                k.to_dtype(DType::F16).unwrap(),
                v.to_dtype(DType::F16).unwrap(),
            );
            routes_agree::<half::f16>(&q, &k, &v, case);
        }
    }

    fn routes_agree<T: Stored>(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (group, kv_heads, width, span): (usize, usize, usize, Span),
    ) {
        let (q_storage, q_layout) = q.storage_and_layout();
        let (k_storage, k_layout) = k.storage_and_layout();
        let (v_storage, v_layout) = v.storage_and_layout();
        let (queries, keys, values) = (
            view::<f32>(&q_storage, q_layout).unwrap(),
            view::<T>(&k_storage, k_layout).unwrap(),
            view::<T>(&v_storage, v_layout).unwrap(),
        );
        let inputs = Inputs {
            queries: &queries,
            keys: &keys,
            values: &values,
            group,
            kv_heads,
            width,
            scale: 0.125,
            span,
        };
        let size = q.elem_count();
        let cached = keys.positions;
        let mut spread = vec![0f32; size];
        by_blocks(&inputs, inputs.blocks(cached - span.position), &mut spread).unwrap();
        let mut grouped = vec![0f32; size];
        by_groups(&inputs, true, &mut grouped).unwrap();
        let mut portable = vec![0f32; size];
        for (index, results) in portable.chunks_exact_mut(group * width).enumerate() {
            let mut scratch = Scratch::default();
            let (row, kv_head) = (index / kv_heads, index % kv_heads);
            group_rows(None, &inputs, width, (row..row + 1, kv_head), &mut scratch).unwrap();
            finish(&scratch.running, results, width);
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&portable), bits(&grouped), "width {width}");
        assert_eq!(bits(&portable), bits(&spread), "width {width}");
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
        let four_keys = [&keys[0][..], &keys[1], &keys[2], &keys[3]];
        let four = dots4_fast(simd(), &query, four_keys);
        let portable = dots4(&query, four_keys);
        let one_by_one: Vec<f32> = keys.iter().map(|k| dot(&query, k)).collect();
        assert_eq!(bits(&four), bits(&portable));
        assert_eq!(bits(&four), bits(&one_by_one));
        let weights = [0.25f32, 0.5, 0.125, 0.0625];
        let mut fast = [0f32; 128];
        add_weighted_rows(simd(), &mut fast, &weights, |j| Ok(&keys[j][..])).unwrap();
        let mut slow = [0f32; 128];
        for (weight, key) in weights.iter().zip(&keys) {
            for (o, v) in slow.iter_mut().zip(key) {
                *o += weight * v;
            }
        }
        assert_eq!(bits(&fast), bits(&slow));
        let pair = dots_pair4_fast(simd(), [&query, &keys[0]], four_keys);
        let second: Vec<f32> = keys.iter().map(|k| dot(&keys[0], k)).collect();
        assert_eq!(bits(&pair[0]), bits(&one_by_one));
        assert_eq!(bits(&pair[1]), bits(&second));
        let rows: Vec<f32> = keys.iter().flatten().copied().collect();
        let other = [0.5f32, 0.25, 0.75, 0.125];
        let (mut fast_a, mut fast_b) = ([1f32; 128], [2f32; 128]);
        add_weighted_pair(
            simd(),
            [&mut fast_a, &mut fast_b],
            [&weights, &other],
            &rows,
        )
        .unwrap();
        let (mut slow_a, mut slow_b) = ([1f32; 128], [2f32; 128]);
        for (sum, weights) in [(&mut slow_a, &weights), (&mut slow_b, &other)] {
            for (weight, key) in weights.iter().zip(&keys) {
                for (o, v) in sum.iter_mut().zip(key) {
                    *o += weight * v;
                }
            }
        }
        assert_eq!(bits(&fast_a), bits(&slow_a));
        assert_eq!(bits(&fast_b), bits(&slow_b));
    }

    /// The eight-lane `exp` gives `exp`'s bits, lane by lane, over the
    /// scores' whole range and its edges.
    #[test]
    fn the_vector_exp_gives_the_portable_bits() {
        let Some(simd) = simd() else {
            eprintln!("skipped: this CPU has no AVX2, so there is no vector exp to compare");
            return;
        };
        let mut xs: Vec<f32> = (0..=900_000).map(|i| -(i as f32) * 1e-4).collect();
        xs.extend([
            0.0,
            -0.0,
            -86.999,
            -87.0,
            -87.001,
            -1e30,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            1.0,
            f32::NAN,
        ]);
        while !xs.len().is_multiple_of(8) {
            xs.push(-1.5);
        }
        for chunk in xs.chunks_exact(8) {
            let lanes: [f32; 8] = chunk.try_into().unwrap();
            let vector: [f32; 8] = pulp::cast(simd.vectorize(|| exp8(simd, pulp::cast(lanes))));
            let portable = lanes.map(exp);
            assert_eq!(
                vector.map(f32::to_bits),
                portable.map(f32::to_bits),
                "{lanes:?}"
            );
        }
        let mut scores: Vec<f32> = (0..203).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let mut portable = scores.clone();
        let fast = exponentials(Some(simd), &mut scores);
        let slow = exponentials(None, &mut portable);
        assert_eq!(
            (fast.0.to_bits(), fast.1.to_bits()),
            (slow.0.to_bits(), slow.1.to_bits())
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&scores), bits(&portable));
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
