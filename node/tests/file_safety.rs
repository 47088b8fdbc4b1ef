//! Files the node reads and writes: `verify` bounds what it reads.

use std::process::Command;
use std::time::{Duration, Instant};


fn mesh_node() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mesh-node"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn verify_refuses_an_oversized_file_without_reading_it() {
    let scratch = tempfile::tempdir().unwrap();
    let big = scratch.path().join("big.json");
    // 2 GiB, sparse: no disk is used, but reading it whole would take 2 GiB
    // of memory, more than the child is allowed.
    std::fs::File::create(&big)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let started = Instant::now();
    let output = Command::new("bash")
        .arg("-c")
        .arg("ulimit -v 1048576 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_mesh-node"))
        .arg("verify")
        .arg(&big)
        .output()
        .unwrap();
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("too large"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(10));
}
