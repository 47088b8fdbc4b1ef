//! What the real-model tests of this crate share. Each test binary uses a
//! part of it, so the rest is dead code there.
#![allow(dead_code)]

use std::ops::Range;
use std::path::PathBuf;

use mesh_stage::ModelHandle;
use mesh_stage::frame::WireDType;
use mesh_stage::pipeline::{Generation, Pipeline};
use mesh_stage::sampling::{Sampler, SamplingParams};

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
    let slices = ranges
        .iter()
        .map(|r| handle.load_slice(r.clone()).unwrap())
        .collect();
    let pipeline = Pipeline::new(slices, WireDType::F32).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    pipeline
        .generate(prompt, max_new, &mut sampler, &|_| false, &mut |_| {})
        .unwrap()
}
