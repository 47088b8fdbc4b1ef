//! Files the node reads and writes: `verify` bounds what it reads, data
//! directories, journals and keys are the owner's alone, and a key file
//! others can read draws a warning.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use mesh_node::runtime::energy::EstimatorMeter;
use mesh_node::runtime::steward::Steward;
use mesh_protocol::SigningKey;

fn mesh_node() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mesh-node"))
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
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

#[test]
fn data_directories_journals_and_keys_are_owner_only() {
    let scratch = tempfile::tempdir().unwrap();
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).unwrap();

    let key_file = scratch.path().join("node.key");
    let output = mesh_node()
        .args(["keygen", "--out"])
        .arg(&key_file)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(mode(&key_file), 0o600);

    // As `serve` lays it out: DATA/steward/journal.redb.
    let data = scratch.path().join("data");
    let steward_dir = data.join("steward");
    let steward = Steward::open(
        &steward_dir,
        SigningKey::from_bytes(&[1; 32]),
        Box::new(EstimatorMeter::default()),
    )
    .unwrap();
    drop(steward);
    assert_eq!(mode(&data), 0o700, "the data directory");
    assert_eq!(mode(&steward_dir), 0o700, "the steward directory");
    for file in ["journal.redb", "journal.lock"] {
        assert_eq!(mode(&steward_dir.join(file)), 0o600, "{file}");
    }

    // A journal left world-readable by an earlier version is tightened.
    std::fs::set_permissions(
        steward_dir.join("journal.redb"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    drop(
        Steward::open(
            &steward_dir,
            SigningKey::from_bytes(&[1; 32]),
            Box::new(EstimatorMeter::default()),
        )
        .unwrap(),
    );
    assert_eq!(mode(&steward_dir.join("journal.redb")), 0o600);
}

#[test]
fn a_key_file_others_can_read_draws_a_warning() {
    let scratch = tempfile::tempdir().unwrap();
    let key_file = scratch.path().join("owner.key");
    let keygen = mesh_node()
        .args(["keygen", "--out"])
        .arg(&key_file)
        .output()
        .unwrap();
    assert!(keygen.status.success());
    let subject = text(&keygen.stdout).trim().to_string();
    let issue = |out: &str| {
        mesh_node()
            .args(["grant", "issue", "--key"])
            .arg(&key_file)
            .args(["--subject", &subject])
            .args(["--budget-uj", "1000", "--out"])
            .arg(scratch.path().join(out))
            .output()
            .unwrap()
    };
    let quiet = issue("g1.json");
    assert!(quiet.status.success(), "{}", text(&quiet.stderr));
    assert!(
        !text(&quiet.stderr).contains("chmod"),
        "{}",
        text(&quiet.stderr)
    );

    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let warned = issue("g2.json");
    let stderr = text(&warned.stderr);
    assert!(warned.status.success(), "{stderr}");
    assert!(stderr.contains("warning"), "{stderr}");
    assert!(
        stderr.contains(&format!("chmod 600 {}", key_file.display())),
        "{stderr}"
    );
}
