#![allow(clippy::single_range_in_vec_init)] // one range is the whole model, unsplit
//! The engine on the synthetic model: split runs are bit-identical to the
//! unsplit run, the safetensors copy agrees with the GGUF copies, every
//! supported quantization loads and runs, and bad inputs fail cleanly.

mod common;

use std::ops::Range;

use candle_core::quantized::GgmlDType;
use common::bits;
use mesh_stage::frame::Activations;
use mesh_stage::frame::WireDType;
use mesh_stage::pipeline::{Generation, Pipeline};
use mesh_stage::sampling::{Sampler, SamplingParams};
use mesh_stage::synthetic::{SyntheticModel, SyntheticSpec, write_synthetic};
use mesh_stage::{EngineError, ExecPolicy, ModelHandle, SliceInput, SliceOutput};

fn model(types: &[GgmlDType]) -> (tempfile::TempDir, SyntheticModel) {
    let dir = tempfile::tempdir().unwrap();
    let model = write_synthetic(dir.path(), &SyntheticSpec::default(), types).unwrap();
    (dir, model)
}

fn run(handle: &ModelHandle, ranges: &[Range<u32>], prompt: &str, wire: WireDType) -> Generation {
    run_with(handle, ranges, prompt, wire, ExecPolicy::default())
}

fn run_with(
    handle: &ModelHandle,
    ranges: &[Range<u32>],
    prompt: &str,
    wire: WireDType,
    policy: ExecPolicy,
) -> Generation {
    let slices = ranges
        .iter()
        .map(|r| handle.load_slice_with(r.clone(), policy).unwrap())
        .collect();
    let pipeline = Pipeline::new(slices, wire).unwrap();
    let ids = handle.text().unwrap().encode(prompt).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    pipeline
        .generate(&ids, 12, &mut sampler, &|_| false, &mut |_| {})
        .unwrap()
}

/// Every stored type the engine runs.
const EVERY_TYPE: [GgmlDType; 9] = [
    GgmlDType::Q8_0,
    GgmlDType::Q4_1,
    GgmlDType::Q4_0,
    GgmlDType::Q5_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
    GgmlDType::F16,
    GgmlDType::F32,
];

#[test]
fn splits_are_bit_identical_to_the_unsplit_run() {
    let (_dir, model) = model(&[GgmlDType::F32, GgmlDType::Q8_0]);
    for path in [
        model.gguf(GgmlDType::F32).unwrap(),
        model.gguf(GgmlDType::Q8_0).unwrap(),
        model.safetensors_dir.as_path(),
    ] {
        let handle = ModelHandle::open(path).unwrap();
        let whole = run(&handle, &[0..6], "The quick brown fox", WireDType::F32);
        assert_eq!(whole.tokens.len(), 12);
        for split in [
            vec![0..3, 3..6],
            vec![0..1, 1..4, 4..6],
            vec![0..1, 1..2, 2..3, 3..5, 5..6],
            vec![0..5, 5..6],
        ] {
            let parts = run(&handle, &split, "The quick brown fox", WireDType::F32);
            assert_eq!(
                parts.tokens,
                whole.tokens,
                "{} split {split:?}",
                path.display()
            );
            assert_eq!(
                bits(&parts.last_logits),
                bits(&whole.last_logits),
                "{} split {split:?}",
                path.display()
            );
        }
    }
}

/// A chain's way: the final stage returns its hidden state and the
/// coordinator's first slice, holding the head apart, turns the last row
/// into logits with the bits the model's own last slice gives, in every
/// format the head may be stored in.
#[test]
fn a_head_held_apart_gives_the_last_slices_logits() {
    let types = [
        GgmlDType::F32,
        GgmlDType::Q8_0,
        GgmlDType::Q4_1,
        GgmlDType::Q4K,
    ];
    let (_dir, model) = model(&types);
    for dtype in types {
        let handle = ModelHandle::open(model.gguf(dtype).unwrap()).unwrap();
        let ids = handle
            .text()
            .unwrap()
            .encode("The quick brown fox")
            .unwrap();
        let whole = handle.load_slice(0..6).unwrap();
        let mut cache = whole.new_cache(32).unwrap();
        let expected = match whole.forward(SliceInput::Tokens(&ids), &mut cache).unwrap() {
            SliceOutput::Logits(logits) => logits,
            other => panic!("the whole model returned {other:?}"),
        };
        let first = handle.load_chain_slice(0..2, true).unwrap();
        let last = handle.load_chain_slice(2..6, false).unwrap();
        assert!(first.holds_head() && !first.is_last());
        assert!(!last.holds_head() && !last.is_last());
        let mut first_cache = first.new_cache(32).unwrap();
        let mut last_cache = last.new_cache(32).unwrap();
        let SliceOutput::Hidden(middle) = first
            .forward(SliceInput::Tokens(&ids), &mut first_cache)
            .unwrap()
        else {
            panic!("the first slice returned logits")
        };
        let SliceOutput::Hidden(end) = last
            .forward(SliceInput::Hidden(&middle), &mut last_cache)
            .unwrap()
        else {
            panic!("a chain's final slice returned logits")
        };
        assert_eq!(end.rows, ids.len());
        let final_row = Activations {
            rows: 1,
            cols: end.cols,
            values: end.values[(end.rows - 1) * end.cols..].to_vec(),
        };
        let logits = first.logits(&final_row).unwrap();
        assert_eq!(logits.len(), 1);
        assert_eq!(bits(&logits[0]), bits(&expected), "{dtype:?}");
        // Without a head, or with the wrong width, it says so.
        assert!(last.logits(&final_row).is_err());
        let narrow = Activations {
            rows: 1,
            cols: end.cols - 1,
            values: vec![0.0; end.cols - 1],
        };
        assert!(first.logits(&narrow).is_err());
    }
}

#[test]
fn safetensors_and_gguf_copies_give_the_same_tokens() {
    let (_dir, model) = model(&[GgmlDType::F32, GgmlDType::F16]);
    let st = run(
        &ModelHandle::open(&model.safetensors_dir).unwrap(),
        &[0..6],
        "Hello, world",
        WireDType::F32,
    );
    let f32 = run(
        &ModelHandle::open(model.gguf(GgmlDType::F32).unwrap()).unwrap(),
        &[0..6],
        "Hello, world",
        WireDType::F32,
    );
    let f16 = run(
        &ModelHandle::open(model.gguf(GgmlDType::F16).unwrap()).unwrap(),
        &[0..6],
        "Hello, world",
        WireDType::F32,
    );
    assert_eq!(
        st.tokens, f32.tokens,
        "safetensors vs GGUF F32 (Q/K permuted for llama.cpp's rotary layout)"
    );
    assert_eq!(st.tokens, f16.tokens, "safetensors vs GGUF F16");
}

#[test]
fn every_supported_quantization_loads_and_runs() {
    let types = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q8_0,
        GgmlDType::F16,
    ];
    let (_dir, model) = model(&types);
    for dtype in types {
        let handle = ModelHandle::open(model.gguf(dtype).unwrap()).unwrap();
        let out = run(&handle, &[0..2, 2..6], "abc", WireDType::F32);
        assert_eq!(out.tokens.len(), 12, "{dtype:?}");
        assert!(out.last_logits.iter().all(|v| v.is_finite()), "{dtype:?}");
    }
}

/// Every matrix on the engine's own kernels is grouped into the slice's
/// weight pages (none spills to the heap: the reservation covers them
/// all); every matrix on the route a GPU takes is not.
#[test]
fn own_kernel_matrices_live_in_the_slices_weight_pages() {
    let types = [
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q4_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q5K,
    ];
    let (_dir, model) = model(&types);
    for dtype in types {
        let handle = ModelHandle::open(model.gguf(dtype).unwrap()).unwrap();
        let own = handle.load_slice(2..4).unwrap();
        let gpu_route = handle.load_slice_with(2..4, common::CANDLE_ONLY).unwrap();
        assert_eq!(gpu_route.paged_weight_bytes(), 0, "{dtype:?}");
        // Two blocks' two f32 norms are all the middle slice holds besides
        // its matrices, whose row counts are whole groups of sixteen.
        let norms = 2 * 2 * handle.config().hidden * 4;
        assert_eq!(
            own.paged_weight_bytes(),
            own.weight_bytes() - norms,
            "{dtype:?}"
        );
    }
}

/// The route a GPU takes (every operation on candle's kernels), checked on
/// the CPU for every stored type: its split runs give its unsplit run's
/// bits, and its logits for a prompt are the engine's own route's up to
/// rounding (root mean square of the difference within 20 % of the
/// centred logits', as the real-model tests check).
#[test]
fn the_route_a_gpu_takes_runs_every_type_and_splits_bit_identically() {
    let (_dir, model) = model(&EVERY_TYPE);
    let candle_only = common::CANDLE_ONLY;
    let mut routes_differ = false;
    for dtype in EVERY_TYPE {
        let handle = ModelHandle::open(model.gguf(dtype).unwrap()).unwrap();
        let whole = run_with(&handle, &[0..6], "abc", WireDType::F32, candle_only);
        let parts = run_with(
            &handle,
            &[0..1, 1..4, 4..6],
            "abc",
            WireDType::F32,
            candle_only,
        );
        assert_eq!(parts.tokens, whole.tokens, "{dtype:?}");
        assert_eq!(
            bits(&parts.last_logits),
            bits(&whole.last_logits),
            "{dtype:?}"
        );
        let ids = handle.text().unwrap().encode("abc").unwrap();
        let logits = |policy| {
            let slice = handle.load_slice_with(0..6, policy).unwrap();
            let mut cache = slice.new_cache(ids.len()).unwrap();
            common::whole_logits(&slice, &mut cache, &ids)
        };
        let (own, gpu) = (logits(ExecPolicy::default()), logits(candle_only));
        let apart = common::spread_apart(&own, &gpu);
        assert!(apart <= 0.2, "{dtype:?}: {apart:.3} of the spread apart");
        routes_differ |= bits(&own) != bits(&gpu);
    }
    // Else the check above compared the engine's route with itself.
    assert!(routes_differ, "the candle-only route was not taken");
}

#[test]
fn f16_frames_halve_the_bytes() {
    let (_dir, model) = model(&[GgmlDType::F32]);
    let handle = ModelHandle::open(model.gguf(GgmlDType::F32).unwrap()).unwrap();
    let f32 = run(&handle, &[0..3, 3..6], "frames", WireDType::F32);
    let f16 = run(&handle, &[0..3, 3..6], "frames", WireDType::F16);
    assert_eq!(f32.frame_bytes - 16 * 12, 2 * (f16.frame_bytes - 16 * 12));
}

#[test]
fn slices_load_only_their_share_and_report_digests() {
    let (_dir, model) = model(&[GgmlDType::F32]);
    let handle = ModelHandle::open(model.gguf(GgmlDType::F32).unwrap()).unwrap();
    let whole = handle.load_slice(0..6).unwrap();
    let middle = handle.load_slice(2..4).unwrap();
    let blocks_only = middle.weight_bytes() as f64;
    // The middle third holds 2 of 6 blocks and neither end.
    let per_block = blocks_only / 2.0;
    assert!(
        whole.weight_bytes() as f64 > 6.0 * per_block,
        "the whole model also holds embedding and head"
    );
    assert!(blocks_only < whole.weight_bytes() as f64 / 2.5);
    assert_ne!(middle.weights_digest(), whole.weights_digest());
    assert_eq!(
        middle.weights_digest(),
        handle.load_slice(2..4).unwrap().weights_digest(),
        "digests are stable"
    );
    assert_ne!(handle.package_id(), [0; 32]);
}

#[test]
fn bad_inputs_fail_cleanly() {
    let (dir, model) = model(&[GgmlDType::F32]);
    let gguf = model.gguf(GgmlDType::F32).unwrap();
    assert!(matches!(
        ModelHandle::open(&dir.path().join("missing.gguf")),
        Err(EngineError::Io { .. })
    ));
    let bytes = std::fs::read(gguf).unwrap();
    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    // A truncated file opens (metadata is intact) but its tensors cannot be read.
    match ModelHandle::open(&truncated) {
        Err(_) => {}
        Ok(handle) => assert!(handle.load_slice(0..6).is_err()),
    }
    let header_only = dir.path().join("header.gguf");
    std::fs::write(&header_only, &bytes[..100]).unwrap();
    assert!(ModelHandle::open(&header_only).is_err());
    let handle = ModelHandle::open(gguf).unwrap();
    assert!(matches!(
        handle.load_slice(4..7),
        Err(EngineError::BadRange { .. })
    ));
    assert!(matches!(
        handle.load_slice(3..3),
        Err(EngineError::BadRange { .. })
    ));
    // A prompt longer than the context.
    let pipeline = Pipeline::new(vec![handle.load_slice(0..6).unwrap()], WireDType::F32).unwrap();
    let long = vec![65u32; 2040];
    let mut sampler = Sampler::new(SamplingParams::greedy());
    assert!(matches!(
        pipeline.generate(&long, 16, &mut sampler, &|_| false, &mut |_| {}),
        Err(EngineError::ContextExceeded { .. })
    ));
    // A frame of the wrong width, and tokens to a middle slice.
    let middle = handle.load_slice(2..4).unwrap();
    let mut cache = middle.new_cache(8).unwrap();
    let wrong = mesh_stage::frame::Activations {
        rows: 1,
        cols: 10,
        values: vec![0.0; 10],
    };
    assert!(
        middle
            .forward(mesh_stage::SliceInput::Hidden(&wrong), &mut cache)
            .is_err()
    );
    assert!(
        middle
            .forward(mesh_stage::SliceInput::Tokens(&[1]), &mut cache)
            .is_err()
    );
    // An unknown architecture.
    let st = &model.safetensors_dir;
    let config = std::fs::read_to_string(st.join("config.json"))
        .unwrap()
        .replace("\"llama\"", "\"mamba\"");
    std::fs::write(st.join("config.json"), config).unwrap();
    assert!(matches!(
        ModelHandle::open(st),
        Err(EngineError::UnsupportedArchitecture(_))
    ));
}

#[test]
fn cache_pool_is_bounded_and_a_dropped_lease_gives_its_place_back() {
    use mesh_stage::cache::CachePool;
    let (_dir, model) = model(&[GgmlDType::F32]);
    let handle = ModelHandle::open(model.gguf(GgmlDType::F32).unwrap()).unwrap();
    let slice = handle.load_slice(0..6).unwrap();
    let pool = CachePool::new(2, 64);
    let mut first = pool.open(&slice, 1, 32).unwrap();
    let second = pool.open(&slice, 2, 32).unwrap();
    assert!(matches!(
        pool.open(&slice, 3, 32),
        Err(EngineError::Busy(2))
    ));
    assert!(matches!(
        pool.open(&slice, 4, 65),
        Err(EngineError::ContextExceeded { .. })
    ));
    assert_eq!(pool.open_requests(), 2);
    drop(second);
    // One request, one cache: an id already open is refused.
    assert!(matches!(
        pool.open(&slice, 1, 32),
        Err(EngineError::AlreadyOpen(1))
    ));
    slice
        .forward(mesh_stage::SliceInput::Tokens(&[1, 2, 3]), first.cache())
        .unwrap();
    assert_eq!(first.cache().position(), 3);
    // A cache never grows past its capacity.
    assert!(
        slice
            .forward(mesh_stage::SliceInput::Tokens(&[1; 30]), first.cache())
            .is_err()
    );
    // A lease dropped on a panicking thread still gives its place back.
    std::thread::scope(|scope| {
        let joined = scope
            .spawn(|| {
                let _lease = pool.open(&slice, 5, 32).unwrap();
                panic!("the request's task failed");
            })
            .join();
        assert!(joined.is_err());
    });
    assert_eq!(pool.open_requests(), 1);
    drop(first);
    assert_eq!(pool.open_requests(), 0);
}

#[test]
fn requests_on_one_slice_run_at_the_same_time_and_match_their_solo_runs() {
    let (_dir, model) = model(&[GgmlDType::F32]);
    let handle = ModelHandle::open(model.gguf(GgmlDType::F32).unwrap()).unwrap();
    let slice = handle.load_slice(0..6).unwrap();
    let pool = mesh_stage::cache::CachePool::new(4, 64);
    let prompts: [&[u32]; 4] = [&[1, 2, 3], &[4, 5], &[6, 7, 8, 9], &[10]];
    let logits = |lease: &mut mesh_stage::cache::CacheLease, prompt: &[u32]| match slice
        .forward(mesh_stage::SliceInput::Tokens(prompt), lease.cache())
        .unwrap()
    {
        mesh_stage::SliceOutput::Logits(l) => bits(&l),
        _ => panic!("a whole model returns logits"),
    };
    let solo: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| logits(&mut pool.open(&slice, i as u64, 32).unwrap(), p))
        .collect();
    // All four leases open at once, each forward on its own thread.
    let together: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut lease = pool.open(&slice, 100 + i as u64, 32).unwrap();
                let logits = &logits;
                scope.spawn(move || logits(&mut lease, p))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(solo, together);
    assert_eq!(pool.open_requests(), 0);
}

#[test]
fn qwen2_with_qkv_biases_agrees_across_formats_and_splits() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec {
        qwen2: true,
        ..SyntheticSpec::default()
    };
    let model = write_synthetic(dir.path(), &spec, &[GgmlDType::F32, GgmlDType::Q8_0]).unwrap();
    let gguf = ModelHandle::open(model.gguf(GgmlDType::F32).unwrap()).unwrap();
    assert_eq!(gguf.config().architecture, "qwen2");
    assert!(gguf.config().qkv_bias);
    let st = ModelHandle::open(&model.safetensors_dir).unwrap();
    let a = run(&gguf, &[0..6], "qwen", WireDType::F32);
    let b = run(&st, &[0..6], "qwen", WireDType::F32);
    assert_eq!(a.tokens, b.tokens);
    let split = run(&gguf, &[0..2, 2..6], "qwen", WireDType::F32);
    assert_eq!(bits(&split.last_logits), bits(&a.last_logits));
    let q8 = ModelHandle::open(model.gguf(GgmlDType::Q8_0).unwrap()).unwrap();
    assert_eq!(
        run(&q8, &[0..3, 3..6], "qwen", WireDType::F32).tokens.len(),
        12
    );
}

#[test]
fn a_damaged_safetensors_file_is_refused_at_open() {
    let (_dir, model) = model(&[GgmlDType::F32]);
    let weights = model.safetensors_dir.join("model.safetensors");
    let good = std::fs::read(&weights).unwrap();
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let refusal = |bytes: &[u8]| {
        std::fs::write(&weights, bytes).unwrap();
        match ModelHandle::open(&model.safetensors_dir) {
            Err(EngineError::BadModel { path, why }) => {
                assert!(path.ends_with("model.safetensors"), "{path}");
                why
            }
            other => panic!("expected BadModel, got {:?}", other.map(|_| ())),
        }
    };
    // Truncated, and with bytes after the last tensor.
    assert!(refusal(&good[..good.len() - 4]).contains("truncated"));
    let mut longer = good.clone();
    longer.extend_from_slice(&[0; 4]);
    assert!(refusal(&longer).contains("truncated or altered"));
    // A tensor whose byte range does not match its shape and dtype: one
    // digit of a shape changed ("[" followed by a digit).
    let header = std::str::from_utf8(&good[8..8 + header_len]).unwrap();
    let at = 8 + header.find("\"shape\":[").unwrap() + "\"shape\":[".len();
    let mut reshaped = good.clone();
    reshaped[at] = if reshaped[at] == b'9' {
        b'8'
    } else {
        reshaped[at] + 1
    };
    assert!(refusal(&reshaped).contains("header"));
    // A header that is not JSON.
    let mut garbled = good.clone();
    garbled[8] = b'!';
    assert!(refusal(&garbled).contains("header"));
    std::fs::write(&weights, &good).unwrap();
    assert!(ModelHandle::open(&model.safetensors_dir).is_ok());
}

#[test]
fn a_batch_of_requests_gives_each_the_bits_it_gets_alone() {
    let types = EVERY_TYPE;
    let (_dir, model) = model(&types);
    // The prompts together are more rows than MAX_BATCH_ROWS: that batch
    // runs its products per request, the decode steps share them.
    let long: Vec<u32> = (40..65).collect();
    let prompts: [&[u32]; 5] = [&[1, 2, 3], &[4, 5], &[6, 7, 8, 9, 10], &[11], &long];
    assert!(prompts.iter().map(|p| p.len()).sum::<usize>() > mesh_stage::model::MAX_BATCH_ROWS);
    let mut differ = Vec::new();
    for dtype in types {
        let handle = ModelHandle::open(model.gguf(dtype).unwrap()).unwrap();
        let whole = handle.load_slice(0..6).unwrap();
        let logits = |output: mesh_stage::SliceOutput| match output {
            mesh_stage::SliceOutput::Logits(l) => bits(&l),
            _ => panic!("a whole model returns logits"),
        };
        // Alone: a prompt, then two decode steps, per request.
        let mut alone = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let mut cache = whole.new_cache(32).unwrap();
            let mut steps = vec![logits(
                whole
                    .forward(mesh_stage::SliceInput::Tokens(prompt), &mut cache)
                    .unwrap(),
            )];
            for token in [20 + i as u32, 30 + i as u32] {
                steps.push(logits(
                    whole
                        .forward(mesh_stage::SliceInput::Tokens(&[token]), &mut cache)
                        .unwrap(),
                ));
            }
            alone.push(steps);
        }
        // Together: the prompts (of different lengths) in one batch, then
        // each decode step of all four in one batch.
        let mut caches: Vec<_> = prompts
            .iter()
            .map(|_| whole.new_cache(32).unwrap())
            .collect();
        let mut together: Vec<Vec<Vec<u32>>> = vec![Vec::new(); prompts.len()];
        let inputs: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
        let mut step_inputs = vec![inputs];
        step_inputs.push((0..prompts.len()).map(|i| vec![20 + i as u32]).collect());
        step_inputs.push((0..prompts.len()).map(|i| vec![30 + i as u32]).collect());
        for inputs in &step_inputs {
            let mut jobs: Vec<_> = inputs
                .iter()
                .zip(caches.iter_mut())
                .map(|(ids, cache)| (mesh_stage::SliceInput::Tokens(ids), cache))
                .collect();
            let outputs = whole.forward_batch(&mut jobs).unwrap();
            for (i, output) in outputs.into_iter().enumerate() {
                together[i].push(logits(output));
            }
        }
        if together != alone {
            differ.push(format!("{dtype:?} whole"));
        }

        // A middle slice batches hidden states the same way.
        let first = handle.load_slice(0..2).unwrap();
        let middle = handle.load_slice(2..4).unwrap();
        let hidden = |output: mesh_stage::SliceOutput| match output {
            mesh_stage::SliceOutput::Hidden(a) => a,
            _ => panic!("a first slice returns hidden states"),
        };
        let states: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut cache = first.new_cache(32).unwrap();
                hidden(
                    first
                        .forward(mesh_stage::SliceInput::Tokens(p), &mut cache)
                        .unwrap(),
                )
            })
            .collect();
        let solo: Vec<_> = states
            .iter()
            .map(|a| {
                let mut cache = middle.new_cache(32).unwrap();
                bits(
                    &hidden(
                        middle
                            .forward(mesh_stage::SliceInput::Hidden(a), &mut cache)
                            .unwrap(),
                    )
                    .values,
                )
            })
            .collect();
        let mut caches: Vec<_> = states
            .iter()
            .map(|_| middle.new_cache(32).unwrap())
            .collect();
        let mut jobs: Vec<_> = states
            .iter()
            .zip(caches.iter_mut())
            .map(|(a, cache)| (mesh_stage::SliceInput::Hidden(a), cache))
            .collect();
        let batched: Vec<_> = middle
            .forward_batch(&mut jobs)
            .unwrap()
            .into_iter()
            .map(|o| bits(&hidden(o).values))
            .collect();
        if batched != solo {
            differ.push(format!("{dtype:?} middle"));
        }
    }
    assert!(
        differ.is_empty(),
        "batched bits differ from solo bits: {differ:?}"
    );
}

/// The package manifest binds the bytes, not the name a GGUF has on disk:
/// the same file under another name is the same package with the same
/// manifest; another file is another.
#[test]
fn the_manifest_of_a_gguf_is_its_bytes_not_its_name() {
    let (dir, model) = model(&[GgmlDType::F32, GgmlDType::Q8_0]);
    let original = model.gguf(GgmlDType::F32).unwrap();
    let renamed = dir.path().join("renamed.gguf");
    std::fs::copy(original, &renamed).unwrap();
    let a = ModelHandle::open(original).unwrap();
    let b = ModelHandle::open(&renamed).unwrap();
    assert_eq!(a.package_id(), b.package_id());
    assert_eq!(a.manifest_sha256(), b.manifest_sha256());
    let other = ModelHandle::open(model.gguf(GgmlDType::Q8_0).unwrap()).unwrap();
    assert_ne!(other.manifest_sha256(), a.manifest_sha256());
}

#[test]
fn a_kept_cache_cut_back_and_handed_to_a_new_request_goes_on_as_if_never_past_the_cut() {
    use mesh_stage::cache::CachePool;
    let (_dir, model) = model(&[GgmlDType::F32]);
    let handle = ModelHandle::open(model.gguf(GgmlDType::F32).unwrap()).unwrap();
    let slice = handle.load_slice(0..6).unwrap();
    let pool = CachePool::new(2, 64);
    let logits = |lease: &mut mesh_stage::cache::CacheLease, ids: &[u32]| match slice
        .forward(SliceInput::Tokens(ids), lease.cache())
        .unwrap()
    {
        SliceOutput::Logits(l) => bits(&l),
        _ => panic!("a whole model returns logits"),
    };
    // Never past position 5: the prompt, then token 9 at position 5.
    let mut straight = pool.open(&slice, 1, 32).unwrap();
    logits(&mut straight, &[1, 2, 3, 4, 5]);
    let expected = logits(&mut straight, &[9]);
    drop(straight);
    // Past it (positions 5 and 6 written), cut back to 5, then on.
    let mut kept = pool.open(&slice, 2, 32).unwrap();
    logits(&mut kept, &[1, 2, 3, 4, 5]);
    logits(&mut kept, &[7, 8]);
    assert_eq!(kept.positions(), 7);
    assert!(kept.cache().truncate(8).is_err());
    assert_eq!(kept.positions(), 7);
    kept.cache().truncate(5).unwrap();
    // The new request's id takes the old one's place in the pool.
    let other = pool.open(&slice, 3, 32).unwrap();
    assert!(matches!(kept.rekey(3), Err(EngineError::AlreadyOpen(3))));
    drop(other);
    kept.rekey(3).unwrap();
    assert_eq!(kept.request(), 3);
    assert_eq!(pool.open_requests(), 1);
    assert!(matches!(
        pool.open(&slice, 3, 32),
        Err(EngineError::AlreadyOpen(3))
    ));
    assert_eq!(logits(&mut kept, &[9]), expected);
    kept.cache().truncate(0).unwrap();
    assert_eq!(kept.positions(), 0);
    drop(kept);
    assert_eq!(pool.open_requests(), 0);
}

/// A draft verified in one step (several positions of one request, each
/// row alone through the matrices) gives every position the bits the
/// one-row decode steps give it, for every supported type, also in the
/// same passes as another request's decode step (which keeps its own
/// bits); and once its
/// rejected positions are cut from the cache, the request goes on as if
/// they were never run.
#[test]
fn a_verified_draft_gives_each_position_its_decode_bits_and_a_cut_goes_on_cleanly() {
    let types = EVERY_TYPE;
    let (_dir, model) = model(&types);
    let prompt: &[u32] = &[1, 2, 3, 4, 5];
    let draft: &[u32] = &[20, 21, 22, 23, 24, 25, 26];
    let mut differ = Vec::new();
    // The engine's own route, and the one a GPU takes (checked here on the
    // CPU): each gives a verified row its own decode bits.
    for (stored, policy) in types
        .into_iter()
        .flat_map(|stored| common::ROUTES.map(|policy| (stored, policy)))
    {
        let route = if policy.candle_only {
            " candle-only"
        } else {
            ""
        };
        let dtype = format!("{stored:?}{route}");
        let handle = ModelHandle::open(model.gguf(stored).unwrap()).unwrap();
        let first = handle.load_chain_slice_with(0..3, true, policy).unwrap();
        let last = handle.load_chain_slice_with(3..6, false, policy).unwrap();
        let hidden = |output: SliceOutput| match output {
            SliceOutput::Hidden(a) => a,
            _ => panic!("a split slice returns hidden states"),
        };
        // Decoded one position at a time.
        let mut one_first = first.new_cache(32).unwrap();
        let mut one_last = last.new_cache(32).unwrap();
        let state = hidden(
            first
                .forward(SliceInput::Tokens(prompt), &mut one_first)
                .unwrap(),
        );
        last.forward(SliceInput::Hidden(&state), &mut one_last)
            .unwrap();
        let mut decoded = Vec::new();
        for token in draft {
            let state = hidden(
                first
                    .forward(SliceInput::Tokens(&[*token]), &mut one_first)
                    .unwrap(),
            );
            decoded.push(bits(
                &hidden(
                    last.forward(SliceInput::Hidden(&state), &mut one_last)
                        .unwrap(),
                )
                .values,
            ));
        }
        // Another request's decode step: alone, then in the same passes as
        // the draft.
        let other_prompt: &[u32] = &[9, 9, 9];
        let mut other = Vec::new();
        for _ in 0..2 {
            let mut f = first.new_cache(32).unwrap();
            let mut l = last.new_cache(32).unwrap();
            let state = hidden(
                first
                    .forward(SliceInput::Tokens(other_prompt), &mut f)
                    .unwrap(),
            );
            last.forward(SliceInput::Hidden(&state), &mut l).unwrap();
            other.push((f, l));
        }
        let (mut alone_first, mut alone_last) = other.remove(0);
        let (mut other_first, mut other_last) = other.remove(0);
        let state = hidden(
            first
                .forward(SliceInput::Tokens(&[11]), &mut alone_first)
                .unwrap(),
        );
        let other_alone = bits(
            &hidden(
                last.forward(SliceInput::Hidden(&state), &mut alone_last)
                    .unwrap(),
            )
            .values,
        );
        // Verified in one step on each slice, each row alone, batched with
        // the other request's decode step.
        let mut all_first = first.new_cache(32).unwrap();
        let mut all_last = last.new_cache(32).unwrap();
        let state = hidden(
            first
                .forward(SliceInput::Tokens(prompt), &mut all_first)
                .unwrap(),
        );
        last.forward(SliceInput::Hidden(&state), &mut all_last)
            .unwrap();
        let mut states = first
            .forward_batch_rows(
                &mut [
                    (SliceInput::Tokens(draft), &mut all_first),
                    (SliceInput::Tokens(&[11]), &mut other_first),
                ],
                &[true, false],
            )
            .unwrap()
            .into_iter()
            .map(hidden);
        let (draft_state, other_state) = (states.next().unwrap(), states.next().unwrap());
        let mut outputs = last
            .forward_batch_rows(
                &mut [
                    (SliceInput::Hidden(&draft_state), &mut all_last),
                    (SliceInput::Hidden(&other_state), &mut other_last),
                ],
                &[true, false],
            )
            .unwrap()
            .into_iter()
            .map(hidden);
        let (verified, other_batched) = (outputs.next().unwrap(), outputs.next().unwrap());
        if bits(&other_batched.values) != other_alone {
            differ.push(format!("{dtype} the request batched with the draft"));
        }
        let rows: Vec<Vec<u32>> = verified.values.chunks(verified.cols).map(bits).collect();
        if rows != decoded {
            differ.push(format!("{dtype} verified"));
        }
        // Two of the seven accepted: the cut, then the next token decoded
        // on both caches.
        let keep = prompt.len() + 3;
        for cache in [&mut all_first, &mut all_last] {
            assert!(cache.truncate(cache.position() + 1).is_err());
            cache.truncate(keep).unwrap();
            assert_eq!(cache.position(), keep);
        }
        let mut straight_first = first.new_cache(32).unwrap();
        let mut straight_last = last.new_cache(32).unwrap();
        // Never past the cut: the prompt, then the accepted positions
        // decoded one at a time.
        for ids in std::iter::once(prompt).chain(draft[..3].chunks(1)) {
            let state = hidden(
                first
                    .forward(SliceInput::Tokens(ids), &mut straight_first)
                    .unwrap(),
            );
            last.forward(SliceInput::Hidden(&state), &mut straight_last)
                .unwrap();
        }
        let next = |f: &mut mesh_stage::SliceCache, l: &mut mesh_stage::SliceCache| {
            let state = hidden(first.forward(SliceInput::Tokens(&[40]), f).unwrap());
            bits(&hidden(last.forward(SliceInput::Hidden(&state), l).unwrap()).values)
        };
        if next(&mut all_first, &mut all_last) != next(&mut straight_first, &mut straight_last) {
            differ.push(format!("{dtype} after the cut"));
        }
    }
    assert!(differ.is_empty(), "verified bits differ: {differ:?}");
}
