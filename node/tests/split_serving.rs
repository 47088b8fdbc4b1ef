//! Split serving across real `mesh-node serve` processes on 127.0.0.1:
//! tokens equal the unsplit run in both return modes, the bundle verifies,
//! a stage killed mid-request ends the request cleanly, a record pushed
//! by an unknown key is refused with a signed reason, and sixteen requests
//! at once each get the tokens they get alone.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::nodes::synthetic;
use common::processes::{bin, keygen, node_id, serve, stage};
use serde_json::Value;

/// `--chat` for models with a chat template; a base model continues the
/// prompt as written.
fn chat_flag(chat: bool) -> &'static [&'static str] {
    if chat { &["--chat"] } else { &[] }
}

fn local_tokens(model: &Path, prompt: &str, max_tokens: usize, chat: bool) -> Value {
    let out = Command::new(bin())
        .arg("generate")
        .args(chat_flag(chat))
        .args([
            "--json",
            "--prompt",
            prompt,
            "--max-tokens",
            &max_tokens.to_string(),
            "--model",
        ])
        .arg(model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout).unwrap()["token_ids"].clone()
}

fn remote(
    coordinator: &str,
    prompt: &str,
    max_tokens: usize,
    chat: bool,
    bundle: &Path,
) -> (bool, Value) {
    let out = Command::new(bin())
        .arg("generate")
        .args(chat_flag(chat))
        .args([
            "--json",
            "--prompt",
            prompt,
            "--max-tokens",
            &max_tokens.to_string(),
            "--coordinator",
            coordinator,
            "--out",
        ])
        .arg(bundle)
        .output()
        .unwrap();
    let value = serde_json::from_slice::<Value>(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), value)
}

fn verify(bundle: &Path) -> (i32, Value) {
    let out = Command::new(bin())
        .args(["verify", "--json"])
        .arg(bundle)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        serde_json::from_slice(&out.stdout).unwrap(),
    )
}

/// Serves `prompt` over a 3-process split in both return modes, each
/// bundle verified; returns the precision the coordinator's signed receipt
/// names.
fn split_equals_unsplit(model: &Path, prompt: &str, max_tokens: usize, chat: bool) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (relayed_id, direct_id) = (
        node_id(dir.path(), "relayed"),
        node_id(dir.path(), "direct"),
    );
    let serves = ["--coordinator", &relayed_id, "--coordinator", &direct_id];
    let b = serve(dir.path(), "b", model, &[], &serves, &[]);
    let c = serve(dir.path(), "c", model, &[], &serves, &[]);
    let relayed = serve(
        dir.path(),
        "relayed",
        model,
        &[&b.peer, &c.peer],
        &["--return-mode", "relayed"],
        &[],
    );
    let direct = serve(
        dir.path(),
        "direct",
        model,
        &[&b.peer, &c.peer],
        &["--return-mode", "direct"],
        &[],
    );
    let expected = local_tokens(model, prompt, max_tokens, chat);
    for (mode, coordinator) in [("relayed", &relayed), ("direct", &direct)] {
        let bundle = dir.path().join(format!("{mode}.json"));
        let (ok, value) = remote(&coordinator.peer, prompt, max_tokens, chat, &bundle);
        assert!(ok, "{mode}: {value:#}");
        assert_eq!(
            value["details"]["token_ids"], expected,
            "{mode}: split tokens differ from the unsplit run"
        );
        let (code, report) = verify(&bundle);
        assert_eq!(code, 0, "{mode}: {report:#}");
        assert_eq!(report["handoffs_agree"], true);
        assert_eq!(report["return_mode"], mode);
        assert!(
            report["checks"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["ok"] == true)
        );
        assert!(
            report["checks"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["property"] == "signed by the node the receipt routed its stage to")
        );
    }
    let bundle: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("direct.json")).unwrap()).unwrap();
    let envelope = mesh_protocol::hex::decode(bundle["mesh1_envelope"].as_str().unwrap()).unwrap();
    let receipt = mesh_protocol::mesh1::SealedReceipt::verify(&envelope)
        .unwrap()
        .receipt;
    receipt.weights.unwrap().precision
}

#[test]
fn three_processes_serve_the_synthetic_model_in_both_return_modes() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    // The synthetic file is f32 throughout and declares no file type.
    assert_eq!(
        split_equals_unsplit(&model, "Hello split world", 12, true),
        "f32; products f32; device cpu; wire f32"
    );
}

#[test]
fn three_processes_serve_smollm2_in_both_return_modes() {
    let Some(model) = common::smollm2("the real-model split test") else {
        return;
    };
    let precision = split_equals_unsplit(&model, "What is the capital of France?", 16, true);
    // What ran: the file's Q4_1 blocks (and the types beside them), as
    // stored, against 8-bit activations.
    assert!(
        precision.starts_with("q4_1 (")
            && precision.contains("q4_1")
            && precision.ends_with("); products q8/f32; device cpu; wire f32"),
        "{precision}"
    );
}

/// Gemma 3: a base model (no chat template), a 262,144-token vocabulary,
/// split by bytes (its embedding and tied head are most of it), with local
/// and global attention layers on either side of a boundary.
#[test]
fn three_processes_serve_gemma3_in_both_return_modes() {
    let Some(model) = common::gemma3("the Gemma 3 split test") else {
        return;
    };
    let precision = split_equals_unsplit(&model, "The capital of France is", 12, false);
    // Another file, another precision: Q4_K_M's K-quant blocks.
    assert!(
        precision.starts_with("q4_k_m (")
            && precision.contains("q4_k")
            && precision.ends_with("); products q8/f32; device cpu; wire f32"),
        "{precision}"
    );
}

#[test]
fn a_stage_killed_mid_request_ends_it_cleanly() {
    stage_killed_mid_request("relayed");
}

#[test]
fn a_stage_killed_mid_request_ends_it_cleanly_in_direct_mode() {
    stage_killed_mid_request("direct");
}

fn stage_killed_mid_request(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let b = stage(dir.path(), "b", &model, &[], &[]);
    let mut c = stage(dir.path(), "c", &model, &[], &[]);
    let coordinator = serve(
        dir.path(),
        "coord",
        &model,
        &[&b.peer, &c.peer],
        &["--deadline-ms", "500", "--return-mode", mode],
        &[],
    );
    let bundle = dir.path().join("bundle.json");
    let mut requester = Command::new(bin())
        .args([
            "generate",
            "--prompt",
            "a long answer please",
            "--max-tokens",
            "1500",
            "--coordinator",
            &coordinator.peer,
            "--out",
        ])
        .arg(&bundle)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first streamed bytes, then kill the final stage.
    let mut first = [0u8; 1];
    requester
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    let _ = c.child.kill();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = requester.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "the requester hangs"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // A lost stage is noticed by the connection, not by the step timeout.
    let noticed = started.elapsed();
    eprintln!("{mode}: the requester learned of the loss after {noticed:?}");
    assert!(
        // connection idle timeout 2 s + seal deadline 0.5 s + stats 0.75 s
        noticed < Duration::from_secs(7),
        "the requester learned of the loss after {noticed:?}"
    );
    let mut stderr = String::new();
    requester
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("ended early"), "{stderr}");
    let (code, report) = verify(&bundle);
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(report["handoffs_agree"], false);
    assert_ne!(report["terminal_state"], "completed");
    let cell = &report["cells"][2]["state"];
    assert!(cell == "not_received" || cell == "ok", "stage 2: {cell}");
    // The dead stage reads as silent; the healthy hop before it agrees.
    let lanes = report["lanes"].as_array().unwrap();
    for lane in lanes.iter().filter(|l| l["hop_index"] == 0) {
        assert_eq!(lane["state"], "agree", "{report:#}");
    }
    assert!(lanes.iter().all(|l| l["state"] != "break"), "{report:#}");
}

#[cfg(feature = "fault-injection")]
#[test]
fn one_altered_forward_byte_breaks_that_hop() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    // Stage 1 alters byte 40 of the forward frame it writes at step 1,
    // after folding it: the hop 1 -> 2 forward lane must read `break`.
    let b = stage(
        dir.path(),
        "b",
        &model,
        &[],
        &[("MESH_FAULT_FLIP_FORWARD", "1:1:40")],
    );
    let c = stage(dir.path(), "c", &model, &[], &[]);
    let coordinator = serve(dir.path(), "coord", &model, &[&b.peer, &c.peer], &[], &[]);
    let bundle = dir.path().join("bundle.json");
    let (_, _) = remote(&coordinator.peer, "fault", 6, true, &bundle);
    let (code, report) = verify(&bundle);
    assert_eq!(code, 1, "{report:#}");
    let lanes = report["lanes"].as_array().unwrap();
    let hop1 = lanes
        .iter()
        .find(|l| l["hop_index"] == 1 && l["lane"] == "forward")
        .unwrap();
    assert_eq!(hop1["state"], "break", "{report:#}");
    let hop0 = lanes
        .iter()
        .find(|l| l["hop_index"] == 0 && l["lane"] == "forward")
        .unwrap();
    assert_eq!(hop0["state"], "agree");
}

/// Addresses people can type: a coordinator told its stages by HOST:PORT
/// alone, and a requester that names the coordinator the same way; each
/// node id is learned in the handshake, said, and pinned.
#[test]
fn nodes_named_by_host_and_port_alone_serve_and_verify() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let plain = |peer: &str| peer.rsplit_once('@').unwrap().1.to_string();
    let b = stage(dir.path(), "b", &model, &[], &[]);
    let c = stage(dir.path(), "c", &model, &[], &[]);
    let (pb, pc) = (plain(&b.peer), plain(&c.peer));
    let coordinator = serve(dir.path(), "coord", &model, &[&pb, &pc], &[], &[]);
    let bundle = dir.path().join("bundle.json");
    let out = Command::new(bin())
        .args([
            "generate",
            "--json",
            "--prompt",
            "plain addresses",
            "--max-tokens",
            "4",
            "--coordinator",
            &plain(&coordinator.peer),
            "--out",
        ])
        .arg(&bundle)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(&format!(
            "the node at {} is {}",
            plain(&coordinator.peer),
            coordinator.peer.rsplit_once('@').unwrap().0
        )),
        "{said}"
    );
    let (code, report) = verify(&bundle);
    assert_eq!(code, 0, "{report:#}");
}

/// One node with no peers serves the whole model: the tokens of the local
/// run, a plain `mesh/1` receipt (no split, backend `mesh-node/local`) in a
/// `mesh1_bundle` that `verify` accepts and `replay` re-executes; Mesh-LLM's
/// form, which holds split records, is refused in one line.
#[test]
fn one_node_alone_serves_with_a_plain_receipt_that_verifies_and_replays() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let alone = serve(dir.path(), "alone", &model, &[], &["--no-mdns"], &[]);
    let prompt = "one node runs every layer";
    let expected = local_tokens(&model, prompt, 6, false);
    let bundle = dir.path().join("alone.json");
    let (ok, value) = remote(&alone.peer, prompt, 6, false, &bundle);
    assert!(ok, "{value:#}");
    assert_eq!(value["details"]["token_ids"], expected);
    assert_eq!(value["details"]["stages"].as_array().unwrap().len(), 1);
    let (code, report) = verify(&bundle);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["form"], "mesh1_bundle", "{report:#}");
    let document: Value = serde_json::from_slice(&std::fs::read(&bundle).unwrap()).unwrap();
    assert!(document.get("main_record").is_none(), "{document:#}");
    let envelope =
        mesh_protocol::hex::decode(document["mesh1_envelope"].as_str().unwrap()).unwrap();
    let receipt = mesh_protocol::mesh1::SealedReceipt::verify(&envelope)
        .unwrap()
        .receipt;
    assert_eq!(receipt.backend, mesh_protocol::replay::LOCAL_BACKEND);
    assert!(receipt.split.is_none() && receipt.resumed.is_none());
    assert_eq!(receipt.deterministic, Some(true));

    // Its steward opens it, and the re-run opens the commitment.
    let key = dir.path().join("alone.key");
    let opened = Command::new(bin())
        .args(["steward", "open"])
        .arg(&bundle)
        .arg("--key")
        .arg(&key)
        .output()
        .unwrap();
    assert!(
        opened.status.success(),
        "{}",
        String::from_utf8_lossy(&opened.stderr)
    );
    let opening = String::from_utf8(opened.stdout).unwrap().trim().to_string();
    let prompt_file = dir.path().join("prompt.txt");
    std::fs::write(&prompt_file, prompt).unwrap();
    let replayed = Command::new(bin())
        .arg("replay")
        .arg(&bundle)
        .arg("--model")
        .arg(&model)
        .arg("--prompt-file")
        .arg(&prompt_file)
        .args(["--opening", &opening, "--json"])
        .output()
        .unwrap();
    let verdict: Value = serde_json::from_slice(&replayed.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&replayed.stderr)));
    assert_eq!(
        (replayed.status.code(), verdict["verdict"].as_str()),
        (Some(0), Some("verified")),
        "{verdict:#}"
    );

    let refused = Command::new(bin())
        .args([
            "generate",
            "--prompt",
            prompt,
            "--max-tokens",
            "2",
            "--coordinator",
            &alone.peer,
            "--format",
            "mesh-llm",
            "--out",
        ])
        .arg(dir.path().join("mesh-llm.json"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(said.contains("one node ran this request whole"), "{said}");
}

/// SIGTERM stops a node gracefully: the request in flight runs to its end
/// (its stream finishes with a finish reason, not an error), a new one is
/// answered 503 saying the node is shutting down, and the process exits 0
/// saying so.
#[test]
fn sigterm_lets_the_request_in_flight_finish_then_exits() {
    use std::io::{BufRead, BufReader, Write};
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let mut alone = serve(
        dir.path(),
        "alone",
        &model,
        &[],
        &["--no-mdns", "--http", "127.0.0.1:0"],
        &[],
    );
    let body =
        r#"{"model":"m","prompt":"a long answer","max_tokens":1500,"temperature":0,"stream":true}"#;
    let mut stream = std::net::TcpStream::connect(alone.api_addr()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    // The first token's event: the request is in flight.
    while !line.starts_with("data: ") {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "no event came");
    }
    let killed = Command::new("kill")
        .args(["-TERM", &alone.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // While the first runs on, a new request is refused at once, saying
    // why (the signal is handled within a moment: asked until it is).
    let asked = r#"{"model":"m","prompt":"another","max_tokens":4}"#;
    let since = Instant::now();
    let (status, said) = loop {
        let (status, said) = common::http::exchange(
            alone.api_addr(),
            "POST",
            "/v1/completions",
            asked.as_bytes(),
        )
        .unwrap();
        if status != 200 || since.elapsed() > Duration::from_secs(5) {
            break (status, said);
        }
    };
    assert_eq!(status, 503, "{said}");
    assert!(said.contains("shutting down"), "{said}");
    let mut rest = String::new();
    let _ = reader.read_to_string(&mut rest);
    let events: Vec<&str> = rest.lines().filter(|l| l.starts_with("data: ")).collect();
    assert!(
        events.len() > 10,
        "the answer went on after SIGTERM: {rest}"
    );
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{rest}");
    assert!(
        events
            .iter()
            .any(|e| e.contains("\"finish_reason\":\"length\"")
                || e.contains("\"finish_reason\":\"stop\"")),
        "{rest}"
    );
    assert!(!rest.contains("\"error\""), "{rest}");
    let since = Instant::now();
    let status = loop {
        if let Some(status) = alone.child.try_wait().unwrap() {
            break status;
        }
        assert!(since.elapsed() < Duration::from_secs(40), "still running");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status}");
    let log = std::fs::read_to_string(dir.path().join("alone.log")).unwrap();
    assert!(
        log.contains("taking no new requests") && log.contains("shut down"),
        "{log}"
    );
}

#[test]
fn grant_shards_are_enforced_by_every_steward() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let b = stage(dir.path(), "b", &model, &[], &[]);
    let c = stage(dir.path(), "c", &model, &[], &[]);
    let coordinator = serve(dir.path(), "coord", &model, &[&b.peer, &c.peer], &[], &[]);
    let owner = keygen(dir.path(), "owner");
    let holder = keygen(dir.path(), "holder");
    let holder_did = {
        let seed = std::fs::read_to_string(&holder).unwrap();
        let key = mesh_protocol::SigningKey::from_bytes(
            &mesh_protocol::hex::decode_array(seed.trim()).unwrap(),
        );
        mesh_protocol::identity::did_key(&key.verifying_key().to_bytes())
    };
    let grant = dir.path().join("root.grant");
    let shards = dir.path().join("shards.cbor");
    let issue = Command::new(bin())
        .args([
            "grant",
            "issue",
            "--subject",
            &holder_did,
            "--budget-uj",
            "108000000",
            "--key",
        ])
        .arg(&owner)
        .arg("--out")
        .arg(&grant)
        .output()
        .unwrap();
    assert!(
        issue.status.success(),
        "{}",
        String::from_utf8_lossy(&issue.stderr)
    );
    let shard = Command::new(bin())
        .args([
            "grant",
            "shard",
            "--coordinator",
            &coordinator.peer,
            "--grant",
        ])
        .arg(&grant)
        .arg("--key")
        .arg(&holder)
        .arg("--out")
        .arg(&shards)
        .output()
        .unwrap();
    assert!(
        shard.status.success(),
        "{}",
        String::from_utf8_lossy(&shard.stderr)
    );
    assert!(String::from_utf8_lossy(&shard.stdout).contains("3 shards"));

    let ask = |key: &Path| {
        Command::new(bin())
            .args([
                "generate",
                "--json",
                "--prompt",
                "granted",
                "--max-tokens",
                "4",
                "--ceiling-uj",
                "30000000",
                "--coordinator",
                &coordinator.peer,
                "--shards",
            ])
            .arg(&shards)
            .arg("--grant-key")
            .arg(key)
            .output()
            .unwrap()
    };
    // Presentations signed by anyone but the shards' holder are refused.
    let stranger = keygen(dir.path(), "stranger");
    let refused = ask(&stranger);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("caller-not-issuer")
            || String::from_utf8_lossy(&refused.stderr).contains("not the leaf"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );

    let first = ask(&holder);
    assert!(
        first.status.success(),
        "stranger: {}\nholder: {}",
        String::from_utf8_lossy(&refused.stderr),
        String::from_utf8_lossy(&first.stderr)
    );
    let value: Value = serde_json::from_slice(&first.stdout).unwrap();
    assert!(
        value["details"]["receipt"]["grant_id"].is_string(),
        "{value:#}"
    );
    // Each steward debits its own 36 J shard; a 30 J ceiling is refused
    // once a shard has less than that left. (A serve that reaches its
    // ceiling on a loaded machine ends `policy_denied`, still debited.)
    let mut refusal = None;
    for _ in 0..100 {
        let out = ask(&holder);
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() && said.contains("grant refused") {
            refusal = Some(said);
            break;
        }
        assert!(
            out.status.success() || said.contains("policy_denied"),
            "{said}"
        );
    }
    let refusal = refusal.expect("the shards run out");
    assert!(
        refusal.contains("grant refused") && refusal.contains("budget"),
        "{refusal}"
    );
}

#[test]
fn a_restarted_stage_is_assigned_again() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let b = stage(dir.path(), "b", &model, &[], &[]);
    let c = stage(dir.path(), "c", &model, &[], &[]);
    let coordinator = serve(dir.path(), "coord", &model, &[&b.peer, &c.peer], &[], &[]);
    let bundle = dir.path().join("bundle.json");
    let (ok, value) = remote(&coordinator.peer, "before the restart", 4, true, &bundle);
    assert!(ok, "{value:#}");
    // Stage 2 restarts on the same key and address, holding no slice.
    let address = c.peer.rsplit_once('@').unwrap().1.to_string();
    drop(c);
    let c = stage(dir.path(), "c", &model, &["--listen", &address], &[]);
    // The request that meets the restart may fail (stage 1 still holds its
    // connection to the dead process, or the new one holds no slice); the
    // coordinator then assigns again, and the next request is served.
    let (ok, _) = remote(&coordinator.peer, "meets the restart", 4, true, &bundle);
    if !ok {
        let (ok, value) = remote(&coordinator.peer, "after the restart", 4, true, &bundle);
        assert!(ok, "{value:#}");
    }
    drop(c);
}

#[test]
fn no_log_line_at_the_most_verbose_level_holds_the_prompt_or_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let trace = [("RUST_LOG", "trace")];
    let b = stage(dir.path(), "b", &model, &[], &trace);
    let c = stage(dir.path(), "c", &model, &[], &trace);
    let coordinator = serve(
        dir.path(),
        "coord",
        &model,
        &[&b.peer, &c.peer],
        &["--http", "127.0.0.1:0"],
        &trace,
    );
    let prompt = "Zanzibar quetzal marmalade";
    let out = Command::new(bin())
        .env("RUST_LOG", "trace")
        .args([
            "generate",
            "--json",
            "--prompt",
            prompt,
            "--max-tokens",
            "16",
            "--coordinator",
            &coordinator.peer,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value: Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = value["text"].as_str().unwrap().trim().to_string();
    assert!(
        text.chars().count() >= 8,
        "too little output to look for: {text:?}"
    );
    // And through the HTTP API, streamed and not.
    let api = coordinator.api_addr();
    let api_prompt = "Xylophone walrus gazpacho";
    let (status, reply) = common::http::call(
        api,
        "POST",
        "/v1/completions",
        Some(&serde_json::json!({
            "model": "synthetic-f32", "prompt": api_prompt, "max_tokens": 16, "temperature": 0,
        })),
    )
    .unwrap();
    assert_eq!(status, 200, "{reply}");
    let api_text = reply["choices"][0]["text"]
        .as_str()
        .unwrap()
        .trim()
        .to_string();
    assert!(
        api_text.chars().count() >= 8,
        "too little output to look for: {api_text:?}"
    );
    let (status, _) = common::http::exchange(
        api,
        "POST",
        "/v1/completions",
        serde_json::json!({
            "model": "synthetic-f32", "prompt": api_prompt, "max_tokens": 16, "stream": true,
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(status, 200);
    drop((b, c, coordinator));
    let mut logs = String::from_utf8_lossy(&out.stderr).into_owned();
    for name in ["b", "c", "coord"] {
        logs.push_str(&std::fs::read_to_string(dir.path().join(format!("{name}.log"))).unwrap());
    }
    // The most verbose level did log: quinn's packets, the nodes' own lines.
    assert!(
        logs.lines().count() > 1000,
        "{} lines",
        logs.lines().count()
    );
    for needle in [
        prompt,
        "Zanzibar",
        "quetzal",
        "marmalade",
        text.as_str(),
        "Xylophone",
        "walrus",
        "gazpacho",
        api_text.as_str(),
    ] {
        assert!(!logs.contains(needle), "a log line holds {needle:?}");
    }
}

/// Issues 9 and 39: sixteen greedy requests at once over three `serve`
/// processes with the default settings (eight places) all complete, each
/// with the tokens it gets alone, none refused (eight wait their turn),
/// and afterwards every node's pools are empty again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_requests_at_once_over_three_processes_give_their_solo_tokens() {
    use common::nodes::alone_then_at_once;
    use mesh_node::runtime::serve::node_stats_remote;
    const REQUESTS: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    // The default settings: eight places on every node, so eight of the
    // sixteen wait their turn in the coordinator's queue (none refused).
    let b = stage(dir.path(), "b", &model, &[], &[]);
    let c = stage(dir.path(), "c", &model, &[], &[]);
    let coordinator = serve(dir.path(), "coord", &model, &[&b.peer, &c.peer], &[], &[]);
    let address: mesh_node::runtime::serve::PeerAddr = coordinator.peer.parse().unwrap();
    let prompts: Vec<String> = (0..REQUESTS)
        .map(|i| format!("request {i} of sixteen goes"))
        .collect();
    let (alone, together) = alone_then_at_once(&address, &prompts, 12).await;
    let ids =
        |summaries: Vec<mesh_node::runtime::serve::GenerateSummary>| -> Vec<serde_json::Value> {
            summaries
                .into_iter()
                .map(|s| s.details["token_ids"].clone())
                .collect()
        };
    let (alone, together) = (ids(alone), ids(together));
    assert!(
        alone
            .iter()
            .all(|ids| ids.as_array().is_some_and(|a| a.len() == 12))
    );
    assert_eq!(
        together, alone,
        "each request's tokens are the ones it gets alone"
    );
    // The coordinator's key reads every node's stats; a stage frees its
    // cache as its part of a request ends, so allow it a moment.
    let key = mesh_node::runtime::keys::load(&keygen(dir.path(), "coord")).unwrap();
    let mut batched = false;
    for node in [&coordinator, &b, &c] {
        let peer: mesh_node::runtime::serve::PeerAddr = node.peer.parse().unwrap();
        let since = Instant::now();
        loop {
            let stats = node_stats_remote(&key, &peer).await.unwrap();
            if stats.pools_empty() {
                batched |= stats.slices.iter().any(|s| s.passes < s.steps);
                break;
            }
            assert!(
                since.elapsed() < Duration::from_secs(5),
                "pools not empty: {stats:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // The sixteen ran together: some forward pass held several steps.
    assert!(batched, "no step was batched with another");
    let peer: mesh_node::runtime::serve::PeerAddr = coordinator.peer.parse().unwrap();
    let stats = node_stats_remote(&key, &peer).await.unwrap();
    assert_eq!(
        (stats.requests_completed, stats.requests_refused_busy),
        (2 * REQUESTS as u64, 0),
        "every request served, none refused: {stats:#?}"
    );
}
