//! A journal write that fails for lack of room (the file-size limit stands
//! in for a full disk: redb sees the same failed write) must not leave the
//! journal broken: once there is room again, the next append succeeds and
//! the journal still reads as one chain.
//!
//! The file-size limit is per process, so the test re-runs itself as a
//! child with the limit's signal (SIGXFSZ) ignored, and only the child
//! lowers the limit.

use std::process::Command;

use mesh_node::runtime::journal::{Entry, Journal};
use mesh_protocol::SigningKey;
use rustix::process::{Resource, getrlimit, setrlimit};

const CHILD: &str = "MESH_NODE_DISK_FULL_CHILD";
const TEST: &str = "a_failed_journal_write_is_retried_once_there_is_room";

fn halted(i: usize, bytes: usize) -> Entry {
    Entry::Halted {
        reason: format!("{i}:{}", "x".repeat(bytes)),
        at_ms: i as u64,
        sequence: None,
    }
}

#[test]
fn a_failed_journal_write_is_retried_once_there_is_room() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    // `trap '' XFSZ` makes the child ignore SIGXFSZ across exec, so a write
    // past the limit fails with EFBIG instead of killing it.
    let output = Command::new("bash")
        .arg("-c")
        .arg("trap '' XFSZ && exec \"$0\" \"$@\"")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "child failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn child() {
    let scratch = tempfile::tempdir().unwrap();
    let key = SigningKey::from_bytes(&[9; 32]);
    let (mut journal, _) = Journal::open(scratch.path(), key).unwrap();
    for i in 0..3 {
        journal.append(halted(i, 10)).unwrap();
    }
    let file = scratch.path().join("journal.redb");
    let room = getrlimit(Resource::Fsize);
    let mut full = room;
    full.current = Some(std::fs::metadata(&file).unwrap().len());
    setrlimit(Resource::Fsize, full).unwrap();

    // Append until the file must grow and cannot.
    let mut appended = 3;
    let error = loop {
        match journal.append(halted(appended, 64 * 1024)) {
            Ok(_) => appended += 1,
            Err(error) => break error,
        }
        assert!(appended < 400, "the journal never needed to grow");
    };
    eprintln!("append {appended} failed as the disk would: {error}");

    // Room again: the journal recovers without a restart.
    setrlimit(Resource::Fsize, room).unwrap();
    let record = journal
        .append(halted(appended, 10))
        .expect("the journal reopens its database once there is room");
    assert_eq!(record.seq, appended as u64);
    journal.append(halted(appended + 1, 10)).unwrap();
    drop(journal);

    let records = Journal::read(scratch.path()).unwrap();
    assert_eq!(records.len(), appended + 2);
}
