//! What the multi-process tests of this crate share. Each test binary uses
//! a part of it, so the rest is dead code there.
#![allow(dead_code)]

pub mod http;
pub mod nodes;
pub mod processes;

use std::path::PathBuf;

/// SmolLM2-135M's GGUF (`MESH_SMOLLM2_GGUF`, else the model cache), or
/// `None` with `test` reported SKIPPED; with `MESH_REQUIRE_MODEL=1` its
/// absence fails the test instead.
pub fn smollm2(test: &str) -> Option<PathBuf> {
    let path = std::env::var_os("MESH_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(mesh_node::cli::models::smollm2_path);
    present(path, "SmolLM2-135M", "MESH_REQUIRE_MODEL", test)
}

/// Gemma 3 270M's GGUF (`MESH_GEMMA3_GGUF`, else the model cache, where
/// `scripts/fetch-gemma3.sh` puts it), or `None` with `test` reported
/// SKIPPED; with `MESH_REQUIRE_GEMMA3=1` its absence fails the test.
pub fn gemma3(test: &str) -> Option<PathBuf> {
    let path = std::env::var_os("MESH_GEMMA3_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| mesh_node::cli::models::cache_dir().join("gemma-3-270m-q4_k_m.gguf"));
    present(path, "Gemma 3 270M", "MESH_REQUIRE_GEMMA3", test)
}

/// `path` when it is a file; otherwise SKIPPED, or a failure when
/// `require` is set to 1.
pub fn present(path: PathBuf, what: &str, require: &str, test: &str) -> Option<PathBuf> {
    if path.is_file() {
        return Some(path);
    }
    skipped(
        format!("{what} not found at {}: {test} is SKIPPED", path.display()),
        require,
    )
}

/// Report `message` (what is missing, and that the test is SKIPPED) and
/// give `None`; when `require` is set to 1, fail the test instead.
pub fn skipped<T>(message: String, require: &str) -> Option<T> {
    if std::env::var(require).is_ok_and(|v| v == "1") {
        panic!("{message} ({require}=1)");
    }
    eprintln!("{message}");
    None
}
