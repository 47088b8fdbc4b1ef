//! The journal outside the happy path: `journal inspect` on a directory
//! without a journal, on a journal a killed steward left behind, and on a
//! corrupted file; serves without a grant; the receipt chain across a
//! restart.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use mesh_node::runtime::energy::EstimatorMeter;
use mesh_node::runtime::journal::{Entry, Journal};
use mesh_node::runtime::steward::{Steward, StewardError};
use mesh_node::tools::exercise::{EXERCISE_CEILING_UJ, exercise_chain, requester_key};
use mesh_protocol::SigningKey;
use mesh_protocol::grant::Presentation;
use mesh_protocol::mesh1::{Energy, Fidelity, MeshReceipt, Provenance, ServeRequest};

fn mesh_node() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mesh-node"))
}

fn inspect(dir: &Path) -> Output {
    mesh_node()
        .args(["journal", "inspect"])
        .arg(dir)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn request(tag: u8) -> ServeRequest {
    ServeRequest {
        prompt_hash: [tag; 32],
        prompt_tokens: 1,
        max_tokens: 1,
        fidelity_floor: Fidelity::F0,
        joule_ceiling_uj: EXERCISE_CEILING_UJ,
        decision: None,
    }
}

fn steward(dir: &Path, key: &SigningKey) -> Steward {
    Steward::open(dir, key.clone(), Box::new(EstimatorMeter::default())).unwrap()
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn inspect_refuses_a_directory_without_a_journal_and_creates_nothing() {
    let scratch = tempfile::tempdir().unwrap();
    let empty = scratch.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let output = inspect(&empty);
    assert!(!output.status.success(), "{}", text(&output.stdout));
    assert_ne!(output.status.code(), Some(101), "{}", text(&output.stderr));
    assert!(
        text(&output.stderr).contains("no journal"),
        "{}",
        text(&output.stderr)
    );
    assert!(
        files_in(&empty).is_empty(),
        "created {:?}",
        files_in(&empty)
    );

    let missing = scratch.path().join("missing");
    let output = inspect(&missing);
    assert!(!output.status.success(), "{}", text(&output.stdout));
    assert!(
        text(&output.stderr).contains("no journal"),
        "{}",
        text(&output.stderr)
    );
    assert!(!missing.exists(), "inspect created {}", missing.display());
}

/// A steward killed mid-serve leaves its journal unclosed; inspecting it
/// must still work, and must not write to it.
#[test]
fn inspect_reads_a_killed_stewards_journal_without_writing_to_it() {
    let scratch = tempfile::tempdir().unwrap();
    let key_file = scratch.path().join("node.key");
    assert!(
        mesh_node()
            .args(["keygen", "--out"])
            .arg(&key_file)
            .output()
            .unwrap()
            .status
            .success()
    );
    let data = scratch.path().join("data");
    let mut child = mesh_node()
        .args(["steward", "exercise", "--serves", "2", "--workload-ms"])
        .arg("60000")
        .arg("--key")
        .arg(&key_file)
        .arg("--data")
        .arg(&data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while !lines
        .next()
        .expect("the child reports its authorisation")
        .unwrap()
        .starts_with("authorised request")
    {}
    // Held by a live steward: refused.
    let output = inspect(&data);
    assert!(!output.status.success());
    assert!(
        text(&output.stderr).contains("another steward holds the journal"),
        "{}",
        text(&output.stderr)
    );
    child.kill().unwrap(); // SIGKILL: the database is not closed
    child.wait().unwrap();

    let before: Vec<(PathBuf, Vec<u8>)> = files_in(&data)
        .into_iter()
        .filter(|p| p.is_file())
        .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
        .collect();
    let output = inspect(&data);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(
        text(&output.stdout).contains("unresolved serves (authorised, never debited"),
        "{}",
        text(&output.stdout)
    );
    for (path, bytes) in before {
        assert!(
            std::fs::read(&path).unwrap() == bytes,
            "inspect wrote to {}",
            path.display()
        );
    }
}

/// A journal with fixed contents, so its file is the same on every run.
fn fixed_journal(dir: &Path) {
    let key = SigningKey::from_bytes(&[7; 32]);
    let did = mesh_protocol::identity::did_key(&key.verifying_key().to_bytes());
    let chain = exercise_chain(&did).unwrap();
    let (mut journal, _) = Journal::open(dir, key).unwrap();
    for i in 0..3u8 {
        let request = request(i);
        let presentation = Presentation::sign(
            chain.clone(),
            &request.request_id(),
            &requester_key(),
            [i; 16],
        )
        .unwrap();
        let authorised = journal
            .append(Entry::Authorised {
                presentation: Box::new(presentation),
                request,
                model: Some([i; 32]),
                backend: "fixed".into(),
                decided_at_ms: 1_800_000_000_000 + u64::from(i),
            })
            .unwrap();
        journal
            .append(Entry::Debited {
                authorised_seq: authorised.seq,
                energy: Energy::from_parts(None, 1000 + u64::from(i), Provenance::Estimator)
                    .unwrap(),
                breach: None,
            })
            .unwrap();
    }
}

/// Bit positions spread over the journal file, plus every other bit of the
/// first 160 bytes (redb's header and commit slots, where most panics were).
fn positions(len: u64) -> Vec<u64> {
    let bits = len * 8;
    let mut positions: Vec<u64> = (0..600u64).map(|i| i * bits / 600).collect();
    positions.extend((0..160 * 8).step_by(2));
    positions.sort_unstable();
    positions.dedup();
    positions
}

#[test]
fn bit_flips_in_the_journal_never_panic() {
    let scratch = tempfile::tempdir().unwrap();
    let pristine = scratch.path().join("pristine");
    fixed_journal(&pristine);
    let original = std::fs::read(pristine.join("journal.redb")).unwrap();
    let work = scratch.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let mut panicked = Vec::new();
    let mut refused = 0;
    for bit in positions(original.len() as u64) {
        let mut bytes = original.clone();
        bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
        std::fs::write(work.join("journal.redb"), &bytes).unwrap();
        match std::panic::catch_unwind(|| Journal::read(&work)) {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => refused += 1,
            Err(_) => panicked.push(bit),
        }
    }
    assert!(refused > 0, "no flip was noticed");
    assert!(
        panicked.is_empty(),
        "Journal::read panicked at bits {panicked:?}"
    );

    // The command line reports a corrupt journal as an error, not a panic.
    for bit in PANICKED_BEFORE {
        let mut bytes = original.clone();
        bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
        std::fs::write(work.join("journal.redb"), &bytes).unwrap();
        let output = inspect(&work);
        let stderr = text(&output.stderr);
        assert!(!output.status.success(), "bit {bit}: {stderr}");
        assert_ne!(output.status.code(), Some(101), "bit {bit}: {stderr}");
        assert!(!stderr.contains("panicked"), "bit {bit}: {stderr}");
        assert!(stderr.contains("is corrupt"), "bit {bit}: {stderr}");
    }
}

/// J1 (issue 37): some flips make redb fall back to its older commit slot,
/// and the journal then reads as whole, its last record gone, under a head
/// signed for the shorter chain ("replay: ok"). The tail marker written
/// beside the database tells: every flip either reads every record or is
/// refused, the lost tail named. The steward refuses to start on it, and
/// `journal accept-loss` records the loss, after which it starts.
#[test]
fn a_journal_that_lost_its_tail_is_refused_never_read_as_whole() {
    let scratch = tempfile::tempdir().unwrap();
    let pristine = scratch.path().join("pristine");
    fixed_journal(&pristine);
    let original = std::fs::read(pristine.join("journal.redb")).unwrap();
    let marker = std::fs::read(pristine.join("journal.tail")).ok();
    let work = scratch.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let flipped = |bit: u64, dir: &Path| {
        let mut bytes = original.clone();
        bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
        std::fs::write(dir.join("journal.redb"), &bytes).unwrap();
        if let Some(marker) = &marker {
            std::fs::write(dir.join("journal.tail"), marker).unwrap();
        }
    };
    let mut dropped = Vec::new();
    let mut lost = Vec::new();
    for bit in positions(original.len() as u64) {
        flipped(bit, &work);
        match Journal::read(&work) {
            Ok(records) if records.len() != 6 => dropped.push((bit, records.len())),
            Err(mesh_node::runtime::journal::JournalError::TailLost { .. }) => lost.push(bit),
            _ => {}
        }
    }
    assert!(
        dropped.is_empty(),
        "read as whole with records missing (bit, records): {dropped:?}"
    );
    assert!(!lost.is_empty(), "no flip made redb fall back a commit");

    let bit = lost[0];
    flipped(bit, &work);
    let output = inspect(&work);
    let stderr = text(&output.stderr);
    assert!(
        !output.status.success(),
        "bit {bit}: {}",
        text(&output.stdout)
    );
    assert!(!text(&output.stdout).contains("replay: ok"));
    // What remains is shown.
    assert!(
        text(&output.stdout).contains("record(s)"),
        "{}",
        text(&output.stdout)
    );
    assert!(
        stderr.contains("record 5 was written"),
        "bit {bit}: {stderr}"
    );
    // The steward refuses to start on it; the operator's recorded choice
    // lets it start again.
    let data = scratch.path().join("node");
    std::fs::create_dir_all(data.join("steward")).unwrap();
    flipped(bit, &data.join("steward"));
    let key = SigningKey::from_bytes(&[7; 32]);
    let refused = Steward::open(
        &data.join("steward"),
        key.clone(),
        Box::new(EstimatorMeter::default()),
    );
    assert!(
        matches!(
            refused,
            Err(StewardError::Journal(
                mesh_node::runtime::journal::JournalError::TailLost { written: 5, .. }
            ))
        ),
        "{refused:?}"
    );
    let key_file = scratch.path().join("node.key");
    std::fs::write(&key_file, mesh_protocol::hex::encode(&[7u8; 32])).unwrap();
    let accepted = mesh_node()
        .args(["journal", "accept-loss", "--data"])
        .arg(&data)
        .arg("--key")
        .arg(&key_file)
        .output()
        .unwrap();
    assert!(accepted.status.success(), "{}", text(&accepted.stderr));
    drop(steward(&data.join("steward"), &key));
    // The marker from before the loss, back (its replacement lost in a
    // crash): superseded by the recorded loss, not a journal that differs.
    std::fs::write(
        data.join("steward/journal.tail"),
        marker.as_ref().expect("a tail marker"),
    )
    .unwrap();
    drop(steward(&data.join("steward"), &key));
    let shown = text(&inspect(&data.join("steward")).stdout);
    assert!(shown.contains("TAIL LOST"), "{shown}");
}

/// Bits whose flip made redb panic (exit 101 from `journal inspect`) before
/// the journal caught it, found by this test's sweep on the unfixed code.
const PANICKED_BEFORE: [u64; 6] = [100, 180, 576, 33226, 393325, 399005];

#[test]
fn an_ungranted_serve_that_cannot_be_journalled_is_refused_up_front() {
    let scratch = tempfile::tempdir().unwrap();
    let key = SigningKey::from_bytes(&[3; 32]);
    let mut steward = steward(scratch.path(), &key);
    steward.journal_mut().inject_append_failure();
    assert!(matches!(
        steward.authorise(None, &request(1), None, "b", 1_800_000_000_000),
        Err(StewardError::NotJournalled(_))
    ));
}

#[test]
fn an_ungranted_serve_that_dies_is_unresolved() {
    let scratch = tempfile::tempdir().unwrap();
    let key = SigningKey::from_bytes(&[4; 32]);
    let mut steward = steward(scratch.path(), &key);
    // One ungranted serve that finishes, one that never does.
    let mut done = steward
        .authorise(
            None,
            &request(1),
            None,
            "finished-backend",
            1_800_000_000_000,
        )
        .unwrap();
    steward.begin_engine(&mut done);
    steward.end_engine(done, None).unwrap();
    let mut dying = steward
        .authorise(None, &request(2), None, "dying-backend", 1_800_000_000_001)
        .unwrap();
    steward.begin_engine(&mut dying);
    drop(dying);
    drop(steward);

    let steward = self::steward(scratch.path(), &key);
    let unresolved = steward.unresolved();
    assert_eq!(unresolved.len(), 1, "{unresolved:?}");
    assert_eq!(unresolved[0].backend, "dying-backend");
    assert_eq!(unresolved[0].request_id, request(2).request_id());
    drop(steward);

    let output = inspect(scratch.path());
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("dying-backend"), "{stdout}");
    assert!(stdout.contains("unresolved"), "{stdout}");
}

#[test]
fn the_last_envelope_survives_a_restart() {
    let scratch = tempfile::tempdir().unwrap();
    let key = SigningKey::from_bytes(&[5; 32]);
    let mut steward = steward(scratch.path(), &key);
    assert_eq!(steward.last_envelope(), None);
    let mut sealed = Vec::new();
    for i in 0..2u8 {
        let mut ticket = steward
            .authorise(None, &request(i), None, "b", 1_800_000_000_000)
            .unwrap();
        steward.begin_engine(&mut ticket);
        let metered = steward.end_engine(ticket, None).unwrap();
        let receipt = MeshReceipt::blank(
            request(i).request_id(),
            "b",
            "r",
            "local",
            metered.energy,
            [i; 16],
        );
        sealed.push(steward.seal(receipt).unwrap());
        assert_eq!(
            steward.last_envelope(),
            Some(sealed[i as usize].envelope.clone())
        );
    }
    drop(steward);

    let steward = self::steward(scratch.path(), &key);
    let last = steward.last_envelope().expect("recovered on open");
    assert_eq!(last, sealed[1].envelope);
    let previous = mesh_protocol::mesh1::SealedReceipt::verify(&last).unwrap();
    assert_eq!(steward.prev_envelope(), Some(previous.envelope_id()));
    previous.check_follows(&sealed[0]).unwrap();
}
