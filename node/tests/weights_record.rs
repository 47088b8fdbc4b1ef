//! The weights change record (SPEC §6.5) on live `serve` processes: once a
//! backend has a record, its coordinator serves only the weights in effect
//! (refused before any grant is decided otherwise); a change recorded with
//! `mesh-node weights record` puts the model's weights in effect after a
//! restart; `verify --change-record` says which receipts it covers. The
//! same stopped coordinator's transparency log is read with `mesh-node log`.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::nodes::synthetic;
use common::processes::{bin, keygen, serve, stage};
use mesh_node::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};

fn mesh_node(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn weights(action: &str, dir: &Path, model: &Path, extra: &[&str]) -> Output {
    let key = keygen(dir, "coord");
    let data = dir.join("coord");
    let mut args = vec![
        "weights",
        action,
        "--key",
        key.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
    ];
    args.extend(extra);
    mesh_node(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_serves_only_the_weights_its_change_record_has_in_effect() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    // Another model's weights are recorded in effect, under a plan.
    let other_dir = tempfile::tempdir().unwrap();
    let other = common::nodes::synthetic_with(
        other_dir.path(),
        &mesh_stage::synthetic::SyntheticSpec {
            seed: 99,
            ..Default::default()
        },
    );
    let planned = weights(
        "plan",
        dir.path(),
        &model,
        &[
            "--precision",
            // What the synthetic f32 model runs at on the CPU (the
            // precision `weights record` defaults to, and receipts name).
            "f32; products f32; device cpu; wire f32",
            "--fidelity-floor",
            "1",
            "--validation",
            "greedy agreement on the reference prompts",
            "--foresees",
            "the synthetic model's rebuilds",
            "--json",
        ],
    );
    let plan: serde_json::Value = serde_json::from_str(&ok(&planned)).unwrap();
    ok(&weights(
        "record",
        dir.path(),
        &other,
        &["--reason", "first weights"],
    ));

    let b = stage(dir.path(), "b", &model, &[], &[]);
    let c = stage(dir.path(), "c", &model, &[], &[]);
    let coordinator = serve(dir.path(), "coord", &model, &[&b.peer, &c.peer], &[], &[]);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let request = GenerateRequest::greedy("hello record", 4);
    let refused = generate_remote(&address, &request, &mut |_| {}).await;
    let said = format!("{refused:?}");
    assert!(
        said.contains("weights change record") && said.contains("not the weights in effect"),
        "{said}"
    );
    drop(coordinator);

    // A change under the plan puts the served model's weights in effect.
    let recorded = weights(
        "record",
        dir.path(),
        &model,
        &[
            "--fidelity",
            "2",
            "--plan",
            plan["id"].as_str().unwrap(),
            "--validation-result",
            "4 of 4 agree",
            "--reason",
            "rebuilt",
            "--json",
        ],
    );
    let change: serde_json::Value = serde_json::from_str(&ok(&recorded)).unwrap();
    assert_eq!(change["seq"], 2);
    // A change outside its plan is refused, and records nothing.
    let outside = weights(
        "record",
        dir.path(),
        &other,
        &[
            "--plan",
            plan["id"].as_str().unwrap(),
            "--reason",
            "no validation",
        ],
    );
    assert!(!outside.status.success());
    assert!(
        String::from_utf8_lossy(&outside.stderr).contains("outside its plan"),
        "{}",
        String::from_utf8_lossy(&outside.stderr)
    );

    let coordinator = serve(dir.path(), "coord", &model, &[&b.peer, &c.peer], &[], &[]);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let served = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(served.terminal_state, "completed", "{:?}", served.error);
    let bundle = dir.path().join("bundle.json");
    std::fs::write(
        &bundle,
        serde_json::to_vec(&served.bundle.unwrap()).unwrap(),
    )
    .unwrap();

    // The record covers that receipt (read with the node stopped: its
    // steward holds the journal while it runs).
    drop(coordinator);
    let record = dir.path().join("record.json");
    let data = dir.path().join("coord");
    let shown = ok(&mesh_node(&[
        "weights",
        "show",
        "--data",
        data.to_str().unwrap(),
        "--out",
        record.to_str().unwrap(),
    ]));
    assert!(shown.contains("3 entries"), "{shown}");
    let covered = mesh_node(&[
        "verify",
        bundle.to_str().unwrap(),
        "--change-record",
        record.to_str().unwrap(),
    ]);
    assert!(ok(&covered).contains("covered"));
    // Cut back to before the change, the record has other weights in
    // effect at that receipt: not covered.
    let mut document: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    document["record"].as_array_mut().unwrap().truncate(2);
    std::fs::write(&record, serde_json::to_vec(&document).unwrap()).unwrap();
    let stale = mesh_node(&[
        "verify",
        bundle.to_str().unwrap(),
        "--change-record",
        record.to_str().unwrap(),
    ]);
    assert_eq!(stale.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&stale.stdout).contains("NOT covered"));

    // The coordinator's transparency log holds the records it sealed for
    // the one request it served (two stage-exchange records, the main
    // record), proves the main record under its root, and checkpoints it.
    let json = |out: Output| -> serde_json::Value { serde_json::from_str(&ok(&out)).unwrap() };
    let shown = json(mesh_node(&[
        "log",
        "show",
        "--data",
        data.to_str().unwrap(),
    ]));
    assert_eq!(shown["records"], 3, "{shown:#}");
    let served: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&bundle).unwrap()).unwrap();
    let main_id = served["main_record"]["capsule_id"].as_str().unwrap();
    let proved = json(mesh_node(&[
        "log",
        "prove",
        "--data",
        data.to_str().unwrap(),
        main_id,
    ]));
    assert_eq!(proved["leaf_index"], 2);
    let proof = mesh_protocol::bundle::InclusionProof::from_value_at(&proved["proof"], "").unwrap();
    let root = proof
        .root_for(&mesh_protocol::bundle::mmr_leaf(
            &mesh_protocol::hex::decode_array(main_id).unwrap(),
        ))
        .unwrap();
    assert_eq!(
        mesh_protocol::hex::encode(&root),
        proved["root"].as_str().unwrap()
    );
    let key = keygen(dir.path(), "coord");
    let checkpoint = json(mesh_node(&[
        "log",
        "checkpoint",
        "--data",
        data.to_str().unwrap(),
        "--key",
        key.to_str().unwrap(),
    ]));
    let checkpoint = mesh_protocol::bundle::Checkpoint::from_value_at(&checkpoint, "").unwrap();
    checkpoint.verify_signature().unwrap();
    assert_eq!(checkpoint.mmr_size, shown["mmr_size"].as_u64().unwrap());
    assert_eq!(checkpoint.root, root);
}
