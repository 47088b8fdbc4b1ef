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
        .chat_prompt("Name the capital of France.")
        .unwrap();
    let ids = handle.text().encode(&prompt).unwrap();
    let slices = vec![handle.load_slice(0..30).unwrap()];
    let pipeline = Pipeline::new(slices, WireDType::F32).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let out = pipeline
        .generate(
            &ids,
            32,
            &mut sampler,
            &|t| handle.text().is_eos(t),
            &mut |_| {},
        )
        .unwrap();
    let answer_ids: Vec<u32> = out
        .tokens
        .iter()
        .copied()
        .filter(|t| !handle.text().is_eos(*t))
        .collect();
    let text = handle.text().decode(&answer_ids).unwrap();
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
