//! What the real-model tests of this crate share. Each test binary uses a
//! part of it, so the rest is dead code there.
#![allow(dead_code)]

use std::ops::Range;
use std::path::PathBuf;

use mesh_stage::frame::WireDType;
use mesh_stage::pipeline::{Generation, Pipeline};
use mesh_stage::sampling::{Sampler, SamplingParams};
use mesh_stage::{ExecPolicy, LayerSlice, ModelHandle, SliceCache, SliceInput, SliceOutput};

/// The route a GPU takes: every operation on candle's kernels.
pub const CANDLE_ONLY: ExecPolicy = ExecPolicy {
    dense_f32: false,
    candle_only: true,
};

/// Both routes: the engine's own, and the one a GPU takes.
pub const ROUTES: [ExecPolicy; 2] = [
    ExecPolicy {
        dense_f32: false,
        candle_only: false,
    },
    CANDLE_ONLY,
];

/// Each value's bits, for asserting bit identity.
pub fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits()).collect()
}

/// How far `other`'s logits are from `own`'s: the root mean square of the
/// difference over that of `own`'s centred logits (their spread).
pub fn spread_apart(own: &[f32], other: &[f32]) -> f32 {
    let mean = own.iter().sum::<f32>() / own.len() as f32;
    let spread = own.iter().map(|x| (x - mean).powi(2)).sum::<f32>().sqrt();
    let apart = own
        .iter()
        .zip(other)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f32>()
        .sqrt();
    apart / spread
}

/// The logits a whole model's slice gives for `ids`.
pub fn whole_logits(slice: &LayerSlice, cache: &mut SliceCache, ids: &[u32]) -> Vec<f32> {
    match slice.forward(SliceInput::Tokens(ids), cache).unwrap() {
        SliceOutput::Logits(logits) => logits,
        SliceOutput::Hidden(_) => panic!("a whole model returns logits"),
    }
}

/// The route a GPU takes (`CANDLE_ONLY`), checked on the CPU against the
/// engine's own route: fed the same tokens (the prompt, then the own
/// route's greedy choices), every step's logits differ by at most
/// `tolerance` of their spread (root mean square of the difference over
/// that of the centred logits); and the GPU route's `split` gives its
/// unsplit run's bits, as the own route's splits do.
///
/// Greedy tokens are not compared free-running: both routes quantize
/// activations to 8 bits, so a difference in summation order can move a
/// value by one quantum, and a near tie (SmolLM2's second token here is
/// 0.002 ahead) then goes either way. The engine's own route sits as far
/// from dense f32 (4-8 % on these prompts) as the GPU route from it.
pub fn gpu_route_agrees(
    handle: &ModelHandle,
    prompt: &str,
    split: &[Range<u32>],
    max_new: usize,
    tolerance: f32,
) {
    let prompt = &handle.text().unwrap().encode(prompt).unwrap();
    let layers = handle.config().layers;
    let own = run(handle, &[0..layers], prompt, max_new);
    let whole = |policy| handle.load_slice_with(0..layers, policy).unwrap();
    let (own_slice, gpu_slice) = (whole(ExecPolicy::default()), whole(CANDLE_ONLY));
    let context = prompt.len() + own.tokens.len();
    let (mut own_cache, mut gpu_cache) = (
        own_slice.new_cache(context).unwrap(),
        gpu_slice.new_cache(context).unwrap(),
    );
    let mut input = prompt.to_vec();
    let (mut farthest, mut bits_differ) = (0f32, false);
    for (step, next) in own.tokens.iter().enumerate() {
        let a = whole_logits(&own_slice, &mut own_cache, &input);
        let b = whole_logits(&gpu_slice, &mut gpu_cache, &input);
        let apart = spread_apart(&a, &b);
        assert!(
            apart <= tolerance,
            "step {step}: the GPU route's logits are {apart:.3} of their spread apart"
        );
        farthest = farthest.max(apart);
        bits_differ |= bits(&a) != bits(&b);
        input = vec![*next];
    }
    eprintln!("the GPU route's logits: at most {farthest:.3} of their spread apart");
    // Else the check above compared the engine's route with itself.
    assert!(bits_differ, "the candle-only route was not taken");
    let gpu = run_with(handle, &[0..layers], prompt, max_new, CANDLE_ONLY);
    let parts = run_with(handle, split, prompt, max_new, CANDLE_ONLY);
    assert_eq!(parts.tokens, gpu.tokens, "split {split:?}");
    assert_eq!(
        bits(&parts.last_logits),
        bits(&gpu.last_logits),
        "split {split:?}"
    );
}

/// A real model's GGUF: `$env` when set, else `file` in the model cache
/// (`MESH_MODEL_CACHE`, else `~/.cache/mesh-node/models`); `None` with the
/// test reported SKIPPED when absent (`fetch` says how to get it), or a
/// failure when `$require` is 1.
pub fn cached_model(
    env: &str,
    file: &str,
    what: &str,
    fetch: &str,
    require: &str,
) -> Option<PathBuf> {
    let path = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("MESH_MODEL_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                    .join(".cache/mesh-node/models")
            })
            .join(file)
    });
    if path.is_file() {
        return Some(path);
    }
    let message = format!(
        "{what} not found at {} (run {fetch}): test SKIPPED",
        path.display()
    );
    if std::env::var(require).is_ok_and(|v| v == "1") {
        panic!("{message} ({require}=1)");
    }
    eprintln!("{message}");
    None
}

/// Greedy generation through the slices `ranges` of `handle`, in process.
pub fn run(
    handle: &ModelHandle,
    ranges: &[Range<u32>],
    prompt: &[u32],
    max_new: usize,
) -> Generation {
    run_with(handle, ranges, prompt, max_new, ExecPolicy::default())
}

/// `run`, with the slices executed as `policy` says.
pub fn run_with(
    handle: &ModelHandle,
    ranges: &[Range<u32>],
    prompt: &[u32],
    max_new: usize,
    policy: ExecPolicy,
) -> Generation {
    let slices = ranges
        .iter()
        .map(|r| handle.load_slice_with(r.clone(), policy).unwrap())
        .collect();
    let pipeline = Pipeline::new(slices, WireDType::F32).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    pipeline
        .generate(prompt, max_new, &mut sampler, &|_| false, &mut |_| {})
        .unwrap()
}

/// `TextStream` gives, id by id, the text the codec decodes from the whole
/// list: over text with multi-byte characters split across ids, and over
/// every id of a vocabulary's first thousand after the text (odd bytes
/// and pieces among them).
pub fn text_stream_agrees(handle: &mesh_stage::ModelHandle) {
    let codec = handle.text().unwrap();
    let mut ids = codec
        .encode(" The dragon 🐉 flew over Tōkyō (東京) — naïve café, 1,234.5!\n\n\tDone. ")
        .unwrap();
    ids.extend(0..1000u32);
    ids.retain(|id| !codec.is_eos(*id));
    let mut stream = mesh_stage::text::TextStream::default();
    for end in 1..=ids.len() {
        let streamed = stream.push(codec, ids[end - 1]).unwrap().to_string();
        assert_eq!(
            streamed,
            codec.decode(&ids[..end]).unwrap(),
            "after {end} ids"
        );
    }
}
