//! The coordinator's transparency log (`split-stage.md` §3.3): every record
//! it seals is appended to an MMR log in its journal, and the requester's
//! bundle carries the main record's inclusion proof under a checkpoint the
//! coordinator signed. `generate --format mesh-llm` writes it as Mesh-LLM's
//! `record_push_bundle`, which `verify` checks by the published rules.

mod common;

use std::path::Path;
use std::process::Command;

use common::nodes::{Setup, synthetic, three_nodes};
use common::processes::bin;
use serde_json::Value;

fn generate(coordinator: &str, out: &Path, format: &str) {
    let run = Command::new(bin())
        .args([
            "generate",
            "--coordinator",
            coordinator,
            "--prompt",
            "hello log",
            "--max-tokens",
            "4",
            "--json",
            "--out",
        ])
        .arg(out)
        .args(["--format", format])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

fn verify(file: &Path) -> (Option<i32>, Value) {
    let out = Command::new(bin())
        .args(["verify", "--json"])
        .arg(file)
        .output()
        .unwrap();
    (
        out.status.code(),
        serde_json::from_slice(&out.stdout).unwrap(),
    )
}

fn check<'a>(report: &'a Value, property: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["property"] == property)
        .unwrap_or_else(|| panic!("no check {property:?}: {report:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_main_record_is_proven_in_the_coordinators_log_and_exports_as_a_record_push_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (a, _b, _c) = three_nodes(&model, dir.path()).await;
    let coordinator = a.peer_addr().to_string();

    let pushed = dir.path().join("pushed.json");
    generate(&coordinator, &pushed, "mesh-llm");
    let (code, report) = verify(&pushed);
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(report["form"], "record_push_bundle", "{report:#}");
    assert_eq!(
        check(&report, "MMR inclusion proof under the checkpoint root")["ok"],
        true
    );
    assert_eq!(
        check(&report, "signed by the main record's key")["ok"],
        true
    );
    let document: Value = serde_json::from_slice(&std::fs::read(&pushed).unwrap()).unwrap();
    // Two stage-exchange records, then the main record: leaves 0, 1, 2.
    assert_eq!(document["inclusion"]["leaf_index"], 2);
    assert_eq!(
        document["split_stage_records"].as_array().unwrap().len(),
        2,
        "both stages' records carried"
    );

    // The log goes on: the next request's main record is leaf 5, under a
    // checkpoint naming the one before; this project's bundle carries the
    // same proof, and verify checks it there too.
    let bundle = dir.path().join("bundle.json");
    generate(&coordinator, &bundle, "mesh");
    let (code, report) = verify(&bundle);
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(
        check(&report, "MMR inclusion proof under the checkpoint root")["ok"],
        true
    );
    let next: Value = serde_json::from_slice(&std::fs::read(&bundle).unwrap()).unwrap();
    assert_eq!(next["inclusion"]["leaf_index"], 5);
    assert_eq!(
        next["checkpoint"]["prev_size"],
        document["checkpoint"]["mmr_size"]
    );

    // Restarted on its journal, the coordinator's next checkpoint names
    // the last one it issued before, not a fresh start.
    a.shutdown().await;
    let a = Setup::coordinator(&model, dir.path(), vec![_b.peer_addr(), _c.peer_addr()])
        .start()
        .await;
    let after_restart = dir.path().join("after-restart.json");
    generate(&a.peer_addr().to_string(), &after_restart, "mesh");
    let restarted: Value = serde_json::from_slice(&std::fs::read(&after_restart).unwrap()).unwrap();
    assert_eq!(
        restarted["checkpoint"]["prev_size"], next["checkpoint"]["mmr_size"],
        "{:#}",
        restarted["checkpoint"]
    );
    assert_eq!(
        restarted["checkpoint"]["prev_root"],
        next["checkpoint"]["root"]
    );
    assert_eq!(verify(&after_restart).0, Some(0));

    // A checkpoint whose root was altered proves nothing.
    let mut altered = document.clone();
    altered["checkpoint"]["root"] = Value::from("00".repeat(32));
    std::fs::write(&pushed, serde_json::to_vec(&altered).unwrap()).unwrap();
    let (code, report) = verify(&pushed);
    assert_eq!(code, Some(1), "{report:#}");
    assert_eq!(
        check(&report, "MMR inclusion proof under the checkpoint root")["ok"],
        false
    );
}

/// Three `serve` processes with checkpoints on (the default): each stage
/// pushes its record as a `record_push_bundle` proven in its own log, the
/// coordinator acknowledges both only after checking the proofs, and the
/// `--format mesh-llm` file verifies by the published bundles' rules.
#[test]
fn three_serve_processes_push_stage_records_as_proven_bundles() {
    use common::processes::{serve, stage};
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let b = stage(dir.path(), "b", &model, &[], &[]);
    let c = stage(dir.path(), "c", &model, &[], &[]);
    let a = serve(dir.path(), "coord", &model, &[&b.peer, &c.peer], &[], &[]);

    let pushed = dir.path().join("pushed.json");
    generate(&a.peer, &pushed, "mesh-llm");
    let (code, report) = verify(&pushed);
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(report["form"], "record_push_bundle", "{report:#}");

    let stats = Command::new(bin())
        .args(["stats", &a.peer, "--json", "--key"])
        .arg(dir.path().join("coord.key"))
        .output()
        .unwrap();
    assert!(
        stats.status.success(),
        "{}",
        String::from_utf8_lossy(&stats.stderr)
    );
    let stats: Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["records_proven"], 2, "{stats:#}");
    drop((a, b, c));
}
