//! Replay (SPEC §6.4) on real SmolLM2 serves split over three nodes: the
//! steward discloses one receipt's opening, and `mesh-node replay` gives
//! each of its three verdicts, never a divergence it cannot attribute.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::nodes::{key, three_nodes};
use mesh_node::runtime::serve::{GenerateRequest, generate_remote};
use mesh_protocol::mesh1::{
    SealedReceipt, opening, opening_key, output_commitment, prompt_payload,
};
use serde_json::Value;

fn mesh_node(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mesh-node"))
        .args(args)
        .output()
        .unwrap()
}

fn replay(bundle: &Path, model: &Path, prompt: &Path, extra: &[&str]) -> (Option<i32>, Value) {
    let mut args = vec![
        "replay",
        bundle.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--prompt-file",
        prompt.to_str().unwrap(),
        "--json",
    ];
    args.extend(extra);
    let out = mesh_node(&args);
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_serve_replays_verified_a_false_one_diverged_and_a_sampled_one_not_at_all() {
    let Some(model) = common::smollm2("the replay test") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (a, _b, _c) = three_nodes(&model, dir.path()).await;
    let text = "The three primary colours are";
    let served = generate_remote(
        &a.peer_addr(),
        &GenerateRequest::greedy(text, 12),
        &mut |_| {},
    )
    .await
    .unwrap();
    assert_eq!(served.terminal_state, "completed", "{:?}", served.error);
    let bundle_path = dir.path().join("bundle.json");
    let bundle = served.bundle.clone().unwrap();
    std::fs::write(&bundle_path, serde_json::to_vec(&bundle).unwrap()).unwrap();
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, text).unwrap();
    let output = dir.path().join("output.json");
    std::fs::write(&output, served.details["token_ids"].to_string()).unwrap();

    // The steward (the coordinator's key) opens its receipt; another cannot.
    let steward_key = dir.path().join("steward.key");
    std::fs::write(&steward_key, mesh_protocol::hex::encode(&key(1).to_bytes())).unwrap();
    let other_key = dir.path().join("other.key");
    std::fs::write(&other_key, mesh_protocol::hex::encode(&key(9).to_bytes())).unwrap();
    let opened = mesh_node(&[
        "steward",
        "open",
        bundle_path.to_str().unwrap(),
        "--key",
        steward_key.to_str().unwrap(),
    ]);
    assert!(
        opened.status.success(),
        "{}",
        String::from_utf8_lossy(&opened.stderr)
    );
    let opening_hex = String::from_utf8(opened.stdout).unwrap().trim().to_string();
    let refused = mesh_node(&[
        "steward",
        "open",
        bundle_path.to_str().unwrap(),
        "--key",
        other_key.to_str().unwrap(),
    ]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("only its steward can open it"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );

    // Verified: the re-run, unsplit in this process, opens the commitment.
    let (code, report) = replay(&bundle_path, &model, &prompt, &["--opening", &opening_hex]);
    assert_eq!(
        (code, report["verdict"].as_str()),
        (Some(0), Some("verified")),
        "{report:#}"
    );
    assert_eq!(report["rerun_tokens"], served.details["token_ids"]);
    // Named, the CPU is the same re-run (a GPU this binary lacks is
    // refused: demo_cli.rs).
    let (code, report) = replay(
        &bundle_path,
        &model,
        &prompt,
        &["--opening", &opening_hex, "--device", "cpu"],
    );
    assert_eq!(code, Some(0), "{report:#}");

    // Not replayable: without the opening; on another prompt, even with
    // the served output disclosed (the difference may be the replayer's).
    let (code, report) = replay(&bundle_path, &model, &prompt, &[]);
    assert_eq!(code, Some(3), "{report:#}");
    assert!(report["reason"].as_str().unwrap().contains("no opening"));
    let other_prompt = dir.path().join("other.txt");
    std::fs::write(&other_prompt, "The three primary colors are").unwrap();
    let (code, report) = replay(
        &bundle_path,
        &model,
        &other_prompt,
        &[
            "--opening",
            &opening_hex,
            "--output-file",
            output.to_str().unwrap(),
        ],
    );
    assert_eq!(
        (code, report["verdict"].as_str()),
        (Some(3), Some("not_replayable")),
        "{report:#}"
    );
    // Told apart by the request id its prompt gives with the bundle's
    // request figures, not only by its token count.
    assert_eq!(report["reason_kind"], "other_request", "{report:#}");
    assert!(
        report["reason"]
            .as_str()
            .unwrap()
            .contains("the receipt's is"),
        "{report:#}"
    );

    // Diverged: a steward that sealed an output its engine did not give.
    // The receipt commits to the served tokens with the fifth changed, and
    // is signed by the steward's own key; disclosed, that output opens it.
    let envelope = mesh_protocol::hex::decode(bundle["mesh1_envelope"].as_str().unwrap()).unwrap();
    let sealed = SealedReceipt::verify(&envelope).unwrap();
    let mut claimed: Vec<u32> =
        serde_json::from_value(served.details["token_ids"].clone()).unwrap();
    claimed[4] = claimed[4].wrapping_add(1);
    let handle = mesh_stage::ModelHandle::open(&model).unwrap();
    let payload = prompt_payload(&handle.text().unwrap().encode(text).unwrap());
    let mut receipt = sealed.receipt.clone();
    receipt.output_commitment = Some(output_commitment(
        &opening(&opening_key(&key(1).to_bytes()), &receipt.request_id),
        &receipt.request_id,
        &payload,
        &claimed,
    ));
    let false_envelope = receipt.seal(&key(1)).unwrap().envelope;
    let false_bundle = dir.path().join("false.json");
    let mut forged = bundle.clone();
    forged["mesh1_envelope"] = Value::from(mesh_protocol::hex::encode(&false_envelope));
    std::fs::write(&false_bundle, serde_json::to_vec(&forged).unwrap()).unwrap();
    let claimed_file = dir.path().join("claimed.json");
    std::fs::write(&claimed_file, serde_json::to_string(&claimed).unwrap()).unwrap();
    let (code, report) = replay(
        &false_bundle,
        &model,
        &prompt,
        &[
            "--opening",
            &opening_hex,
            "--output-file",
            claimed_file.to_str().unwrap(),
        ],
    );
    assert_eq!(
        (code, report["verdict"].as_str()),
        (Some(1), Some("diverged")),
        "{report:#}"
    );
    assert_eq!(report["diverged_at"], 4);
    // Without the disclosed output the same receipt is not the serve's to
    // answer for: not replayable.
    let (code, _) = replay(&false_bundle, &model, &prompt, &["--opening", &opening_hex]);
    assert_eq!(code, Some(3));

    // A sampled serve is declared not deterministic: not replayable.
    let mut sampled = GenerateRequest::greedy(text, 12);
    sampled.sampling.temperature = 0.8;
    sampled.sampling.seed = 7;
    let served = generate_remote(&a.peer_addr(), &sampled, &mut |_| {})
        .await
        .unwrap();
    let sampled_bundle = dir.path().join("sampled.json");
    std::fs::write(
        &sampled_bundle,
        serde_json::to_vec(&served.bundle.unwrap()).unwrap(),
    )
    .unwrap();
    let (code, report) = replay(
        &sampled_bundle,
        &model,
        &prompt,
        &["--opening", &opening_hex],
    );
    assert_eq!(code, Some(3), "{report:#}");
    assert!(
        report["reason"]
            .as_str()
            .unwrap()
            .contains("not declared deterministic"),
        "{report:#}"
    );
}
