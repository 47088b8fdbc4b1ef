//! What the multi-process tests of this crate share. Each test binary uses
//! a part of it, so the rest is dead code there.
#![allow(dead_code)]

pub mod nodes;

use std::path::PathBuf;

/// SmolLM2-135M's GGUF (`MESH_SMOLLM2_GGUF`, else the model cache), or
/// `None` with `test` reported SKIPPED; with `MESH_REQUIRE_MODEL=1` its
/// absence fails the test instead.
pub fn smollm2(test: &str) -> Option<PathBuf> {
    let path = std::env::var_os("MESH_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(mesh_node::cli::models::smollm2_path);
    if path.is_file() {
        return Some(path);
    }
    let message = format!(
        "SmolLM2-135M not found at {}: {test} is SKIPPED",
        path.display()
    );
    if std::env::var("MESH_REQUIRE_MODEL").is_ok_and(|v| v == "1") {
        panic!("{message} (MESH_REQUIRE_MODEL=1)");
    }
    eprintln!("{message}");
    None
}
