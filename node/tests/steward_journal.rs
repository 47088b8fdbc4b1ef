//! The steward's journal under a real crash: a `mesh-node steward exercise`
//! child process is killed with SIGKILL mid-serve, and the restarted steward
//! must give no budget back, surface the in-flight serve as unresolved, and
//! continue the receipt chain.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use mesh_node::runtime::energy::EstimatorMeter;
use mesh_node::runtime::journal::{Entry, Journal, JournalError};
use mesh_node::runtime::steward::{Steward, StewardError};
use mesh_node::tools::exercise::{
    EXERCISE_BACKEND, EXERCISE_BUDGET_UJ, EXERCISE_CEILING_UJ, exercise_chain, requester_key,
};
use mesh_protocol::identity::did_key;
use mesh_protocol::mesh1::SealedReceipt;

fn mesh_node() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mesh-node"))
}

struct Node {
    _scratch: tempfile::TempDir,
    key_file: PathBuf,
    data: PathBuf,
}

fn node() -> Node {
    let scratch = tempfile::tempdir().unwrap();
    let key_file = scratch.path().join("node.key");
    let status = mesh_node()
        .arg("keygen")
        .arg("--out")
        .arg(&key_file)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let data = scratch.path().join("data");
    Node {
        key_file,
        data,
        _scratch: scratch,
    }
}

fn exercise(node: &Node, serves: u32, workload_ms: u64) -> Command {
    let mut command = mesh_node();
    command
        .args([
            "steward",
            "exercise",
            "--serves",
            &serves.to_string(),
            "--workload-ms",
            &workload_ms.to_string(),
        ])
        .arg("--key")
        .arg(&node.key_file)
        .arg("--data")
        .arg(&node.data);
    command
}

fn run_to_completion(node: &Node, serves: u32) -> String {
    let output = exercise(node, serves, 15).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

fn receipt(node: &Node, sequence: u64) -> SealedReceipt {
    let bytes = std::fs::read(node.data.join(format!("receipts/{sequence}.cbor"))).unwrap();
    SealedReceipt::verify(&bytes).unwrap()
}

fn open(node: &Node) -> Result<Steward, StewardError> {
    Steward::open(
        &node.data,
        mesh_node::runtime::keys::load(&node.key_file).unwrap(),
        Box::new(EstimatorMeter::default()),
    )
}

/// A one-token request (its prompt hash `[tag; 32]`) with a joule ceiling,
/// presented by the exercise requester under `chain` with nonce `[nonce; 16]`.
fn presented(
    chain: &[mesh_protocol::grant::SignedGrant],
    tag: u8,
    ceiling_uj: u64,
    nonce: u8,
) -> (
    mesh_protocol::mesh1::ServeRequest,
    mesh_protocol::grant::Presentation,
) {
    let request = mesh_protocol::mesh1::ServeRequest {
        prompt_hash: [tag; 32],
        prompt_tokens: 1,
        max_tokens: 1,
        fidelity_floor: mesh_protocol::mesh1::Fidelity::F0,
        joule_ceiling_uj: ceiling_uj,
        decision: None,
    };
    let presentation = mesh_protocol::grant::Presentation::sign(
        chain.to_vec(),
        &request.request_id(),
        &requester_key(),
        [nonce; 16],
    )
    .unwrap();
    (request, presentation)
}

fn debited_total(data: &Path) -> u64 {
    Journal::read(data)
        .unwrap()
        .iter()
        .filter_map(|r| match &r.entry {
            Entry::Debited { energy, .. } => Some(energy.uj()),
            _ => None,
        })
        .sum()
}

#[test]
fn sigkill_mid_serve_gives_no_budget_back_and_the_chain_continues() {
    let node = node();
    run_to_completion(&node, 2);
    let before_crash = debited_total(&node.data);

    // A serve whose engine runs for a minute; kill it once it is authorised.
    let mut child = exercise(&node, 1, 60_000)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines
            .next()
            .expect("the child reports its authorisation")
            .unwrap();
        if line.starts_with("authorised request") {
            break;
        }
    }
    // While it runs, nobody else may open its journal.
    match open(&node) {
        Err(StewardError::Journal(JournalError::Locked(_))) => {}
        other => panic!("a second steward opened a held journal: {other:?}"),
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let steward = open(&node).expect("the OS released the dead steward's lock");
    let unresolved = steward.unresolved();
    assert_eq!(unresolved.len(), 1, "the in-flight serve is unresolved");
    assert_eq!(
        unresolved[0].caller,
        did_key(&requester_key().verifying_key().to_bytes())
    );
    assert_eq!(unresolved[0].backend, EXERCISE_BACKEND);
    assert_eq!(unresolved[0].ceiling_uj, EXERCISE_CEILING_UJ);

    // No budget came back: the two finished serves plus the in-flight one at
    // its ceiling are all spent.
    let chain = exercise_chain(steward.did()).unwrap();
    let remaining = steward.gate().chain_remaining(&chain);
    assert_eq!(
        remaining,
        EXERCISE_BUDGET_UJ - before_crash - EXERCISE_CEILING_UJ
    );

    // The receipt chain continues from the last sealed receipt.
    assert_eq!(steward.next_sequence(), 2);
    assert_eq!(
        steward.prev_envelope(),
        Some(receipt(&node, 1).envelope_id())
    );
    drop(steward);

    let output = run_to_completion(&node, 1);
    assert!(output.contains("unresolved authorised-seq"), "{output}");
    let third = receipt(&node, 2);
    third.check_follows(&receipt(&node, 1)).unwrap();

    let inspect = mesh_node()
        .args(["journal", "inspect"])
        .arg(&node.data)
        .output()
        .unwrap();
    let text = String::from_utf8(inspect.stdout).unwrap();
    assert!(inspect.status.success(), "{text}");
    assert!(
        text.contains("unresolved serves (authorised, never debited"),
        "{text}"
    );
    assert!(text.contains(EXERCISE_BACKEND), "{text}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

#[test]
fn a_receipt_the_journal_lacks_halts_grants_across_restarts() {
    let node = node();
    run_to_completion(&node, 1);
    // Snapshot the journal, serve once more, then put the snapshot back: the
    // records of the second serve are cut from the end.
    let snapshot = node.data.parent().unwrap().join("snapshot");
    copy_dir(&node.data, &snapshot);
    run_to_completion(&node, 1);
    let cut_receipt = std::fs::read(node.data.join("receipts/1.cbor")).unwrap();
    for entry in std::fs::read_dir(&snapshot).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), node.data.join(entry.file_name())).unwrap();
    }

    let mut steward = open(&node).unwrap();
    assert!(
        steward
            .witness(
                &std::fs::read(node.data.join("receipts/0.cbor")).unwrap(),
                1
            )
            .unwrap()
    );
    assert!(steward.halted().is_none());
    assert!(!steward.witness(&cut_receipt, 2).unwrap());
    assert!(steward.halted().is_some());
    drop(steward);

    // Still refused after a restart.
    let output = exercise(&node, 1, 1).output().unwrap();
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("stopped honouring grants"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn tampering_with_any_journal_record_is_detected() {
    let node = node();
    run_to_completion(&node, 2);
    let records = Journal::read(&node.data).unwrap();
    let pristine = node.data.parent().unwrap().join("pristine");
    copy_dir(&node.data, &pristine);
    let restore = || {
        for entry in std::fs::read_dir(&pristine).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), node.data.join(entry.file_name())).unwrap();
        }
    };
    for record in &records {
        let raw = Journal::raw(&node.data, record.seq).unwrap().unwrap();
        for index in 0..raw.len() {
            let mut tampered = raw.clone();
            tampered[index] ^= 0x01;
            Journal::overwrite_raw(&node.data, record.seq, Some(&tampered)).unwrap();
            assert!(
                open(&node).is_err(),
                "record {} byte {index} flipped and the journal still opened",
                record.seq
            );
            restore();
        }
    }
    // A record removed from the middle, and two records swapped.
    Journal::overwrite_raw(&node.data, 2, None).unwrap();
    assert!(matches!(
        open(&node),
        Err(StewardError::Journal(JournalError::Broken { seq: 2, .. }))
    ));
    restore();
    let (a, b) = (
        Journal::raw(&node.data, 1).unwrap().unwrap(),
        Journal::raw(&node.data, 4).unwrap().unwrap(),
    );
    Journal::overwrite_raw(&node.data, 1, Some(&b)).unwrap();
    Journal::overwrite_raw(&node.data, 4, Some(&a)).unwrap();
    assert!(open(&node).is_err());
    restore();
    assert!(open(&node).is_ok());
}

#[test]
fn what_cannot_be_journalled_does_not_happen() {
    use mesh_protocol::mesh1::MeshReceipt;

    let node = node();
    let mut steward = open(&node).unwrap();
    let chain = exercise_chain(steward.did()).unwrap();
    let (request, presentation) = presented(&chain, 1, EXERCISE_CEILING_UJ, 9);
    let full = steward.gate().chain_remaining(&chain);

    // An authorisation that cannot be recorded refuses the serve and
    // reserves nothing; the presentation stays unspent.
    steward.journal_mut().inject_append_failure();
    assert!(matches!(
        steward.authorise(Some(&presentation), &request, None, "b", 1_800_000_000_000),
        Err(StewardError::NotJournalled(_))
    ));
    assert_eq!(steward.gate().chain_remaining(&chain), full);
    let mut ticket = steward
        .authorise(Some(&presentation), &request, None, "b", 1_800_000_000_000)
        .unwrap();
    steward.begin_engine(&mut ticket);
    let metered = steward.end_engine(ticket, None).unwrap();

    // A receipt that cannot be recorded is not handed out and the chain
    // does not advance past it.
    let receipt = MeshReceipt {
        grant_id: metered.grant_id,
        tokens_in: 1,
        ..MeshReceipt::blank(
            request.request_id(),
            "b",
            "r",
            "local",
            metered.energy,
            [0; 16],
        )
    };
    steward.journal_mut().inject_append_failure();
    assert!(matches!(
        steward.seal(receipt.clone()),
        Err(StewardError::SealNotJournalled(_))
    ));
    assert_eq!(steward.next_sequence(), 0);
    let sealed = steward.seal(receipt).unwrap();
    assert_eq!(sealed.receipt.sequence, 0);
    assert_eq!(sealed.receipt.prev, None);
}

#[test]
fn an_engine_reporting_other_weights_is_not_sealed_but_is_debited() {
    let node = node();
    let mut steward = open(&node).unwrap();
    let chain = exercise_chain(steward.did()).unwrap();
    let (request, presentation) = presented(&chain, 2, 10, 1);
    let mut ticket = steward
        .authorise(
            Some(&presentation),
            &request,
            Some([7; 32]),
            "b",
            1_800_000_000_000,
        )
        .unwrap();
    steward.begin_engine(&mut ticket);
    assert!(matches!(
        steward.end_engine(ticket, Some([8; 32])),
        Err(StewardError::WeightsChanged)
    ));
    assert!(
        steward.gate().chain_remaining(&chain) < EXERCISE_BUDGET_UJ,
        "the work ran and was debited"
    );
}

/// The weights change record's gate (SPEC §6.5), at the steward: once a
/// backend has a record, a serve on other weights (or none) is refused
/// before any grant is decided or anything is journalled, a receipt naming
/// other weights is not sealed, an entry that cannot be journalled is not
/// in effect, and a restarted steward holds the record it persisted.
#[test]
fn a_backend_with_a_change_record_serves_and_seals_only_the_weights_in_effect() {
    use mesh_protocol::change::{ChangeEntry, ChangeKind, WeightsChange};
    use mesh_protocol::mesh1::{Fidelity, MeshReceipt, WeightsBinding};

    let node = node();
    let mut steward = open(&node).unwrap();
    let chain = exercise_chain(steward.did()).unwrap();
    let weights_change = |to: [u8; 32], from: Option<[u8; 32]>| ChangeEntry {
        backend: "b".into(),
        recipe: "r".into(),
        seq: 0,
        prev: None,
        made_at: 1_790_000_000,
        kind: ChangeKind::Weights(WeightsChange {
            from,
            to,
            precision: Some("fp32".into()),
            fidelity: Fidelity::F1,
            plan: None,
            validation_result: None,
            effective_from: 99,
            reason: "test".into(),
        }),
    };
    // An entry that cannot be journalled is not in effect.
    steward.journal_mut().inject_append_failure();
    assert!(
        steward
            .record_change(weights_change([1; 32], None))
            .is_err()
    );
    assert!(steward.change_record("b").is_none());
    let recorded = steward
        .record_change(weights_change([1; 32], None))
        .unwrap();
    // Its `effective_from` is the next receipt, whatever was asked.
    match &recorded.entry.kind {
        ChangeKind::Weights(w) => assert_eq!(w.effective_from, 0),
        ChangeKind::Plan(_) => unreachable!(),
    }

    let (request, presentation) = presented(&chain, 3, EXERCISE_CEILING_UJ, 4);
    let full = steward.gate().chain_remaining(&chain);
    let journalled = steward.journal_mut().next_seq();
    for weights in [Some([2; 32]), None] {
        assert!(matches!(
            steward.authorise(
                Some(&presentation),
                &request,
                weights,
                "b",
                1_800_000_000_000
            ),
            Err(StewardError::NotInEffect { .. })
        ));
        assert!(matches!(
            steward.authorise(None, &request, weights, "b", 1_800_000_000_000),
            Err(StewardError::NotInEffect { .. })
        ));
    }
    // Nothing decided, nothing spent, nothing journalled.
    assert_eq!(steward.gate().chain_remaining(&chain), full);
    assert_eq!(steward.journal_mut().next_seq(), journalled);
    // Another backend has no record: not gated.
    assert!(
        steward
            .authorise(None, &request, None, "another", 1_800_000_000_000)
            .is_ok()
    );
    let receipt = |weights: [u8; 32]| MeshReceipt {
        weights: Some(WeightsBinding {
            weights_digest: weights,
            precision: "fp32".into(),
        }),
        ..MeshReceipt::blank(
            request.request_id(),
            "b",
            "r",
            "local",
            mesh_protocol::mesh1::Energy::estimator(1),
            [0; 16],
        )
    };
    assert!(matches!(
        steward.seal(receipt([2; 32])),
        Err(StewardError::NotInEffect { .. })
    ));
    assert_eq!(steward.next_sequence(), 0);
    steward.seal(receipt([1; 32])).unwrap();
    assert!(
        steward
            .authorise(
                Some(&presentation),
                &request,
                Some([1; 32]),
                "b",
                1_800_000_000_000
            )
            .is_ok()
    );
    drop(steward);

    // Restarted, the steward holds the record: still gated, and a change
    // recorded now is in effect from receipt 1.
    let mut steward = open(&node).unwrap();
    assert!(matches!(
        steward.authorise(None, &request, Some([2; 32]), "b", 1_800_000_000_000),
        Err(StewardError::NotInEffect { .. })
    ));
    let changed = steward
        .record_change(weights_change([2; 32], Some([1; 32])))
        .unwrap();
    match &changed.entry.kind {
        ChangeKind::Weights(w) => assert_eq!(w.effective_from, 1),
        ChangeKind::Plan(_) => unreachable!(),
    }
    assert!(
        steward
            .authorise(None, &request, Some([2; 32]), "b", 1_800_000_000_000)
            .is_ok()
    );
}

/// Issue 41: what a coordinator found of other nodes is journalled before
/// it acts, survives a restart as it was written, and `journal inspect`
/// shows it.
#[test]
fn judgements_of_other_nodes_survive_a_restart() {
    use mesh_node::runtime::journal::{Judged, Judgement};
    let node = node();
    let judged = [
        Judged {
            node: [2; 32],
            judgement: Judgement::AuditFailed,
            at_ms: 1_000,
            until_ms: 3_601_000,
        },
        Judged {
            node: [3; 32],
            judgement: Judgement::Stalled,
            at_ms: 2_000,
            until_ms: 602_000,
        },
        Judged {
            node: [4; 32],
            judgement: Judgement::AuditPassed,
            at_ms: 3_000,
            until_ms: 3_000,
        },
    ];
    {
        let mut steward = open(&node).unwrap();
        for one in judged {
            steward.record_judgement(one).unwrap();
        }
    }
    let steward = open(&node).unwrap();
    assert_eq!(steward.judged().iter().copied().collect::<Vec<_>>(), judged);
    drop(steward);
    let shown = mesh_node()
        .args(["journal", "inspect"])
        .arg(&node.data)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("audit_failed, left out of plans for 3600 s") && text.contains("stalled"),
        "{text}"
    );
}
