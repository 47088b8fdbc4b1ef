#![allow(clippy::single_range_in_vec_init)] // one range is the whole model, unsplit
//! The engine on the real SmolLM2-135M-Instruct (Q4_1 GGUF). The model is
//! fetched by `scripts/fetch-smollm2.sh` (CI runs it); when it is absent the
//! tests say so and are skipped, unless `MESH_REQUIRE_MODEL=1`.

mod common;

use std::path::PathBuf;

use common::{bits, run};
use mesh_stage::ModelHandle;
use mesh_stage::frame::WireDType;
use mesh_stage::pipeline::Pipeline;
use mesh_stage::sampling::{Sampler, SamplingParams};

fn model_path() -> Option<PathBuf> {
    common::cached_model(
        "MESH_SMOLLM2_GGUF",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M",
        "scripts/fetch-smollm2.sh",
        "MESH_REQUIRE_MODEL",
    )
}

#[test]
fn answers_the_capital_of_france_with_paris() {
    let Some(path) = model_path() else { return };
    let handle = ModelHandle::open(&path).unwrap();
    assert_eq!(handle.config().layers, 30);
    assert_eq!(handle.config().hidden, 576);
    let prompt = handle
        .text()
        .unwrap()
        .chat_prompt("Name the capital of France.")
        .unwrap();
    let ids = handle.text().unwrap().encode(&prompt).unwrap();
    let slices = vec![handle.load_slice(0..30).unwrap()];
    let pipeline = Pipeline::new(slices, WireDType::F32).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let out = pipeline
        .generate(
            &ids,
            32,
            &mut sampler,
            &|t| handle.text().unwrap().is_eos(t),
            &mut |_| {},
        )
        .unwrap();
    let answer_ids: Vec<u32> = out
        .tokens
        .iter()
        .copied()
        .filter(|t| !handle.text().unwrap().is_eos(*t))
        .collect();
    let text = handle.text().unwrap().decode(&answer_ids).unwrap();
    assert!(text.contains("Paris"), "answered: {text:?}");
    assert!(
        text.split_whitespace().count() >= 3,
        "a sentence, not a word: {text:?}"
    );
}

#[test]
fn splits_of_1_2_3_and_5_are_bit_identical() {
    let Some(path) = model_path() else { return };
    let handle = ModelHandle::open(&path).unwrap();
    let ids = handle
        .text()
        .unwrap()
        .encode("The history of the Roman Empire")
        .unwrap();
    let whole = run(&handle, &[0..30], &ids, 16);
    for split in [
        vec![0..13, 13..30],
        vec![0..10, 10..20, 20..30],
        vec![0..1, 1..9, 9..22, 22..29, 29..30],
    ] {
        let parts = run(&handle, &split, &ids, 16);
        assert_eq!(parts.tokens, whole.tokens, "split {split:?}");
        assert_eq!(
            bits(&parts.last_logits),
            bits(&whole.last_logits),
            "split {split:?}"
        );
    }
}

#[test]
fn the_route_a_gpu_takes_gives_the_engines_logits() {
    let Some(path) = model_path() else { return };
    let handle = ModelHandle::open(&path).unwrap();
    common::gpu_route_agrees(
        &handle,
        "The history of the Roman Empire",
        &[0..10, 10..20, 20..30],
        16,
        0.2,
    );
}

#[test]
fn a_third_of_the_layers_holds_about_a_third_of_the_weights() {
    let Some(path) = model_path() else { return };
    let handle = ModelHandle::open(&path).unwrap();
    let whole = handle.load_slice(0..30).unwrap().weight_bytes() as f64;
    let thirds: Vec<f64> = mesh_stage::even_split(30, 3)
        .into_iter()
        .map(|r| handle.load_slice(r).unwrap().weight_bytes() as f64)
        .collect();
    let total: f64 = thirds.iter().sum();
    eprintln!(
        "whole {whole:.0} B; thirds {thirds:?} ({:?} of the whole)",
        thirds.iter().map(|t| t / whole).collect::<Vec<_>>()
    );
    // The whole model holds its tied embedding once, as embedding and
    // head; split, the first third holds it as the embedding and the last
    // as the head.
    let tied = handle.layer_bytes().embedding as f64;
    assert!(
        (total - tied - whole).abs() / whole < 0.01,
        "the thirds add up to the whole and the tied matrix once more"
    );
    // The middle third holds only blocks; the ends also hold the (tied)
    // embedding, stored as Q8_0 while the blocks are Q4_1, so they carry
    // well over a third each of what the split holds, and the middle a
    // little under a fifth.
    assert!(
        (0.15..0.36).contains(&(thirds[1] / total)),
        "{}",
        thirds[1] / total
    );
    assert!(thirds.iter().all(|t| t / total < 0.45));
}

#[test]
fn a_decode_step_gives_the_same_bits_on_the_calling_thread_as_in_candles_pool() {
    use mesh_stage::{SliceInput, SliceOutput};
    let Some(path) = model_path() else { return };
    let handle = ModelHandle::open(&path).unwrap();
    let ids = handle
        .text()
        .unwrap()
        .encode("The old harbour town kept")
        .unwrap();
    // The whole model and a chain's middle third (hidden states in and out).
    for (range, holds_head) in [(0..30, true), (10..20, false)] {
        let slice = handle.load_chain_slice(range.clone(), holds_head).unwrap();
        assert!(slice.runs_on_calling_thread([1]), "{range:?}");
        assert!(!slice.runs_on_calling_thread([2]), "{range:?}");
        let hidden = |rows: usize, salt: f32| mesh_stage::frame::Activations {
            rows,
            cols: 576,
            values: (0..rows * 576)
                .map(|i| (i as f32 * 0.37 + salt).sin())
                .collect(),
        };
        let prompt = hidden(ids.len(), 0.0);
        fn input<'a>(
            first: bool,
            step: usize,
            ids: &'a [u32],
            own: &'a mesh_stage::frame::Activations,
        ) -> SliceInput<'a> {
            match (first, step) {
                (true, 0) => SliceInput::Tokens(ids),
                (true, _) => SliceInput::Tokens(&ids[..1]),
                (false, _) => SliceInput::Hidden(own),
            }
        }
        let first = range.start == 0;
        let mut here = slice.new_cache(64).unwrap();
        let mut pool = slice.new_cache(64).unwrap();
        for step in 0..6 {
            let own = if step == 0 {
                prompt.clone()
            } else {
                hidden(1, step as f32)
            };
            let a = slice
                .forward(input(first, step, &ids, &own), &mut here)
                .unwrap();
            // A pool thread calling `forward`: the route every step took
            // before one-row steps stayed on the calling thread.
            let b = candle_core::Device::Cpu
                .with_context(|| slice.forward(input(first, step, &ids, &own), &mut pool))
                .unwrap();
            let values = |out: SliceOutput| match out {
                SliceOutput::Hidden(a) => a.values,
                SliceOutput::Logits(l) => l,
            };
            assert_eq!(bits(&values(a)), bits(&values(b)), "{range:?} step {step}");
        }
        if holds_head {
            let rows = hidden(3, 9.0);
            let on_thread = slice.logits(&rows).unwrap();
            let in_pool = candle_core::Device::Cpu
                .with_context(|| slice.logits(&rows))
                .unwrap();
            for (a, b) in on_thread.iter().zip(&in_pool) {
                assert_eq!(bits(a), bits(b));
            }
        }
    }
}

#[test]
fn the_text_stream_gives_the_whole_lists_text() {
    let Some(path) = model_path() else { return };
    common::text_stream_agrees(&ModelHandle::open(&path).unwrap());
}
