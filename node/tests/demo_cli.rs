//! `mesh-node demo`, the README's first command: a real answer when SmolLM2
//! can be had, the synthetic model (said so) when it cannot, and a verdict
//! either way.

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn demo(cache: &Path, out: &Path, offline: bool) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_mesh-node"));
    command
        .env("MESH_MODEL_CACHE", cache)
        .args(["demo", "--quiet", "--max-tokens", "12", "--out"])
        .arg(out);
    if offline {
        command.env("MESH_OFFLINE", "1");
    }
    command.output().unwrap()
}

#[test]
fn offline_the_demo_says_it_falls_back_and_still_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let output = demo(&dir.path().join("cache"), &dir.path().join("out"), true);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("synthetic model") && stderr.contains("MESH_OFFLINE"),
        "{stderr}"
    );
    // Just the answer and the verdict.
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(lines[0].starts_with("answer: "), "{stdout}");
    assert!(lines[1].starts_with("verdict: OK"), "{stdout}");
    // A second run in the same directory is the same nodes, going on.
    let again = demo(&dir.path().join("cache"), &dir.path().join("out"), true);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}

#[test]
fn with_smollm2_the_demo_answers_paris() {
    let Some(model) = common::smollm2("the real-model demo test") else {
        return;
    };
    assert_eq!(
        model.file_name().unwrap(),
        mesh_node::cli::models::SMOLLM2_FILE,
        "the demo finds SmolLM2 by its file name in the model cache"
    );
    let dir = tempfile::tempdir().unwrap();
    // Offline: the model is found in the cache, never downloaded here.
    let output = demo(model.parent().unwrap(), &dir.path().join("out"), true);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("answer: The capital of France is Paris."),
        "{stdout}"
    );
    assert!(stdout.contains("verdict: OK"), "{stdout}");
}

/// `--device`: a name that is no device is refused by the flag's parser; a
/// GPU on a binary built without the `cuda` feature is refused before any
/// node starts, saying how to build one that has it. With the feature the
/// same command opens the GPU (checked on a GPU machine by
/// `scripts/device-check.sh`, not here).
#[test]
fn a_device_the_binary_cannot_use_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let run = |device: &str| {
        Command::new(env!("CARGO_BIN_EXE_mesh-node"))
            .env("MESH_MODEL_CACHE", dir.path().join("cache"))
            .env("MESH_OFFLINE", "1")
            .args(["demo", "--quiet", "--device", device, "--out"])
            .arg(dir.path().join("out"))
            .output()
            .unwrap()
    };
    let wrong = run("gpu");
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(!wrong.status.success());
    assert!(
        stderr.contains("`gpu` names no device") && stderr.contains("cuda:N"),
        "{stderr}"
    );
    if mesh_stage::DeviceChoice::Cuda(0).compiled_in() {
        return;
    }
    let gpu = run("cuda");
    let stderr = String::from_utf8_lossy(&gpu.stderr);
    assert!(!gpu.status.success());
    assert!(stderr.contains("--features cuda"), "{stderr}");
    // replay refuses it before reading anything: input it cannot act on.
    let replay = Command::new(env!("CARGO_BIN_EXE_mesh-node"))
        .args([
            "replay",
            "no-bundle",
            "--model",
            "no-model",
            "--prompt-file",
            "no-prompt",
        ])
        .args(["--device", "cuda"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&replay.stderr);
    assert_eq!(replay.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--features cuda"), "{stderr}");
    assert!(
        !dir.path().join("out").join("bundle.json").exists(),
        "no node ran"
    );
}
