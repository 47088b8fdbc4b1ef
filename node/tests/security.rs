//! Regression tests for the defects found by probing running nodes as a
//! stranger on the network would (issue 8). Every node here runs in this
//! process on 127.0.0.1 with an ephemeral port; each test failed on the code
//! before its fix.

mod common;

use std::path::Path;
use std::time::Duration;

use common::nodes::{
    Script, Setup, ask, connect, granted, grants, key, no_lane_breaks, observed_stalling_stage,
    public, refusal, request, scripted_stage, stalling_stage, synthetic, three_nodes, verify,
};
use mesh_node::runtime::net::tls::{self, TlsIdentity};
use mesh_node::runtime::net::{ALPN_CONTROL, ALPN_STAGE, msg};
use mesh_node::runtime::serve::{GenerateSummary, GrantedServe, Node, PeerAddr};
use mesh_protocol::SigningKey;
use mesh_protocol::block::ReturnMode;
use mesh_protocol::cbor::Cbor;
use mesh_protocol::identity::did_key;

/// DER of an Ed25519 SubjectPublicKeyInfo up to the key.
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

/// One control message and its answer.
async fn control(connection: &quinn::Connection, message: &Cbor) -> Cbor {
    let (mut send, mut recv) = connection.open_bi().await.unwrap();
    msg::write_cbor(&mut send, message).await.unwrap();
    send.finish().unwrap();
    msg::read_cbor(&mut recv, msg::MAX_CONTROL_MESSAGE, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("an answer")
}

/// A self-signed certificate for `holder` whose issuer and subject names
/// carry an Ed25519 SPKI with `named` in it: what an impostor presents.
fn certificate_naming(holder: &SigningKey, named: [u8; 32]) -> Vec<u8> {
    let placeholder = "P".repeat(ED25519_SPKI_PREFIX.len() + 32);
    let mut pkcs8 = vec![
        0x30, 0x53, 0x02, 0x01, 0x01, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    pkcs8.extend_from_slice(&holder.to_bytes());
    pkcs8.extend_from_slice(&[0xa1, 0x23, 0x03, 0x21, 0x00]);
    pkcs8.extend_from_slice(&public(holder));
    let pair =
        rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8.into(), &rcgen::PKCS_ED25519).unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["mesh-node".into()]).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, placeholder.clone());
    let mut der = params.self_signed(&pair).unwrap().der().to_vec();
    let mut spki = ED25519_SPKI_PREFIX.to_vec();
    spki.extend_from_slice(&named);
    let mut replaced = 0;
    while let Some(at) = der
        .windows(placeholder.len())
        .position(|w| w == placeholder.as_bytes())
    {
        der[at..at + spki.len()].copy_from_slice(&spki);
        replaced += 1;
    }
    assert_eq!(replaced, 2, "issuer and subject both name the key");
    der
}

fn assign_message(model: &Path, coordinator: [u8; 32], run_id: &str) -> Cbor {
    let handle = mesh_stage::ModelHandle::open(model).unwrap();
    assign_naming(model, coordinator, run_id, handle.manifest_sha256())
}

fn assign_naming(model: &Path, coordinator: [u8; 32], run_id: &str, manifest: [u8; 32]) -> Cbor {
    let handle = mesh_stage::ModelHandle::open(model).unwrap();
    Cbor::text_map([
        ("kind", Cbor::text("assign")),
        ("run_id", Cbor::text(run_id)),
        ("package_id", Cbor::bytes(handle.package_id().to_vec())),
        ("manifest_sha256", Cbor::bytes(manifest.to_vec())),
        ("layer_start", Cbor::Uint(3)),
        ("layer_end", Cbor::Uint(6)),
        ("stage_index", Cbor::Uint(1)),
        ("stage_count", Cbor::Uint(2)),
        ("coordinator", Cbor::text(did_key(&coordinator))),
        ("coordinator_addr", Cbor::text("127.0.0.1:9")),
        ("topology_hash", Cbor::text("00")),
        ("upstream", Cbor::text(did_key(&coordinator))),
    ])
}

fn kind(reply: &Cbor) -> &str {
    reply.get("kind").and_then(Cbor::as_text).unwrap_or("")
}

// ---------------------------------------------------------------- S1

#[test]
fn the_key_is_read_from_the_subject_public_key_info_only() {
    let (forger, victim) = (key(7), key(8));
    let forged = certificate_naming(&forger, public(&victim));
    assert_eq!(tls::certificate_key(&forged), Some(public(&forger)));
    // Something that is not a certificate carries no key, even with the
    // SPKI bytes in it.
    let mut loose = ED25519_SPKI_PREFIX.to_vec();
    loose.extend_from_slice(&public(&victim));
    assert_eq!(tls::certificate_key(&loose), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_certificate_is_refused_as_the_pinned_server() {
    tls::install_provider();
    let (forger, victim) = (key(7), key(8));
    let impostor =
        TlsIdentity::with_certificate(&forger, certificate_naming(&forger, public(&victim)))
            .unwrap();
    let server = quinn::Endpoint::server(
        tls::server_config(&impostor, &[ALPN_CONTROL]).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let accepting = server.clone();
    tokio::spawn(async move {
        while let Some(incoming) = accepting.accept().await {
            tokio::spawn(async move {
                if let Ok(connection) = incoming.await {
                    let _ = connection.accept_bi().await;
                }
            });
        }
    });
    let requester = TlsIdentity::new(&key(9)).unwrap();
    let pinned = PeerAddr {
        key: public(&victim),
        addr,
    };
    let outcome = connect(&requester, &pinned, ALPN_CONTROL).await;
    assert!(
        outcome.is_err(),
        "a requester pinned to the victim's key reached an impostor"
    );
    // The impostor is reachable as itself: the refusal is about the key.
    let itself = PeerAddr {
        key: public(&forger),
        addr,
    };
    assert!(connect(&requester, &itself, ALPN_CONTROL).await.is_ok());
    server.close(0u32.into(), b"done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_certificate_does_not_make_its_holder_the_coordinator() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (coordinator, forger) = (key(1), key(7));
    let mut stage = Setup::new(&model, dir.path().join("stage"), key(2));
    stage.coordinators = vec![public(&coordinator)];
    let stage = stage.start().await;

    // An impostor whose certificate names the coordinator's key.
    let impostor =
        TlsIdentity::with_certificate(&forger, certificate_naming(&forger, public(&coordinator)))
            .unwrap();
    let (_endpoint, connection) = connect(&impostor, &stage.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    let reply = control(
        &connection,
        &assign_message(&model, public(&coordinator), "forged-run"),
    )
    .await;
    assert_eq!(kind(&reply), "refused", "an impostor assign was accepted");
    assert_eq!(stage.slices_held(), 0);

    // The real coordinator, with another key written into its certificate's
    // names, is still itself.
    let genuine = TlsIdentity::with_certificate(
        &coordinator,
        certificate_naming(&coordinator, public(&forger)),
    )
    .unwrap();
    let (_endpoint, connection) = connect(&genuine, &stage.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    let reply = control(
        &connection,
        &assign_message(&model, public(&coordinator), "genuine-run"),
    )
    .await;
    assert_eq!(kind(&reply), "ready", "{reply:?}");
    assert_eq!(stage.slices_held(), 1);
}

/// A connection for a protocol the node does not speak gets nothing: the
/// handshake fails, or the node closes it before any stream is answered;
/// the node still speaks its own protocols to the same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_protocol_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let stage = Setup::stage(&model, dir.path(), "b", 2).start().await;
    let identity = TlsIdentity::new(&key(9)).unwrap();
    match connect(&identity, &stage.peer_addr(), b"mesh-unknown/1").await {
        Err(_) => {}
        Ok((_endpoint, connection)) => {
            let answered = async {
                let (mut send, mut recv) = connection.open_bi().await?;
                send.write_all(b"hello").await?;
                send.finish()?;
                anyhow::Ok(recv.read_to_end(64).await?)
            };
            let outcome = tokio::time::timeout(Duration::from_secs(5), answered).await;
            assert!(
                matches!(outcome, Ok(Err(_))),
                "an unknown protocol was answered: {outcome:?}"
            );
        }
    }
    let (_endpoint, connection) = connect(&identity, &stage.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    drop(connection);
}

/// The manifest is package-wide: a stage whose own package's manifest is
/// not the one assigned refuses, and loads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assign_naming_another_manifest_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let coordinator = key(1);
    let mut stage = Setup::new(&model, dir.path().join("stage"), key(2));
    stage.coordinators = vec![public(&coordinator)];
    let stage = stage.start().await;
    let identity = TlsIdentity::new(&coordinator).unwrap();
    let (_endpoint, connection) = connect(&identity, &stage.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    let mut other = mesh_stage::ModelHandle::open(&model)
        .unwrap()
        .manifest_sha256();
    other[0] ^= 1;
    let reply = control(
        &connection,
        &assign_naming(&model, public(&coordinator), "other-manifest", other),
    )
    .await;
    assert_eq!(kind(&reply), "refused", "{reply:?}");
    let reason = reply.get("reason").and_then(Cbor::as_text).unwrap_or("");
    assert!(reason.contains("manifest"), "{reason}");
    assert_eq!(stage.slices_held(), 0);
    let reply = control(
        &connection,
        &assign_message(&model, public(&coordinator), "this-manifest"),
    )
    .await;
    assert_eq!(kind(&reply), "ready", "{reply:?}");
}

// ---------------------------------------------------------------- S2

/// Open a request on a stage as `who`; the stage's first reply frame.
async fn open_request_as(
    who: &SigningKey,
    stage: &PeerAddr,
    run_id: &str,
) -> (
    quinn::Endpoint,
    quinn::SendStream,
    anyhow::Result<Option<Vec<u8>>>,
) {
    let identity = TlsIdentity::new(who).unwrap();
    let (endpoint, connection) = connect(&identity, stage, ALPN_STAGE).await.unwrap();
    let (mut send, mut recv) = connection.open_bi().await.unwrap();
    let open = Cbor::text_map([
        ("run_id", Cbor::text(run_id)),
        ("capacity", Cbor::Uint(64)),
        ("return_mode", Cbor::text("relayed")),
    ]);
    msg::write(
        &mut send,
        &msg::stage_body(msg::kind::OPEN, 77, 0, &open.encode()),
    )
    .await
    .unwrap();
    let reply = msg::read(&mut recv, msg::MAX_STAGE_MESSAGE, Duration::from_secs(3)).await;
    (endpoint, send, reply)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_assigned_upstream_may_open_a_request_on_a_stage() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (a, b, _c) = three_nodes(&model, dir.path()).await;
    let first = ask(&a.peer_addr(), &request("set up the run", 2, None))
        .await
        .unwrap();
    assert!(first.error.is_none(), "{:?}", first.error);
    let run_id = first.details["run_id"].as_str().unwrap().to_string();

    // A stranger who knows the run id (it is in every bundle) is refused.
    let mut held = Vec::new();
    for _ in 0..8 {
        let (endpoint, send, reply) = open_request_as(&key(9), &b.peer_addr(), &run_id).await;
        let frame = reply
            .expect("the stage answers a stranger at once")
            .expect("with a refusal");
        let (message_kind, _, _, payload) = msg::parse_stage(&frame).unwrap();
        assert_eq!(message_kind, msg::kind::FAILED);
        assert!(
            String::from_utf8_lossy(payload).contains("not the upstream"),
            "{}",
            String::from_utf8_lossy(payload)
        );
        held.push((endpoint, send));
    }
    // The coordinator itself is not stage 2's upstream either.
    let (_endpoint, _send, reply) = open_request_as(&key(1), &_c.peer_addr(), &run_id).await;
    let (message_kind, _, _, _) = msg::parse_stage(&reply.unwrap().unwrap()).unwrap();
    assert_eq!(message_kind, msg::kind::FAILED);
    // Eight held stranger streams block nothing.
    let after = ask(&a.peer_addr(), &request("still served", 4, None))
        .await
        .unwrap();
    assert!(after.error.is_none(), "{:?}", after.error);
}

// ---------------------------------------------------------------- S5

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assignments_come_only_from_served_coordinators_and_slices_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (first, second, stranger) = (key(1), key(4), key(9));
    let mut stage = Setup::new(&model, dir.path().join("stage"), key(2));
    stage.coordinators = vec![public(&first), public(&second)];
    stage.max_slices = 1;
    let stage = stage.start().await;

    let as_node = |k: &SigningKey| TlsIdentity::new(k).unwrap();
    let (_e, connection) = connect(&as_node(&stranger), &stage.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    let reply = control(&connection, &assign_message(&model, public(&stranger), "s")).await;
    assert_eq!(kind(&reply), "refused");
    assert_eq!(stage.slices_held(), 0);

    // A served coordinator that re-plans (or restarts) many times holds one
    // slice: each new run replaces its previous one.
    let (_e, connection) = connect(&as_node(&first), &stage.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    for n in 0..20 {
        let reply = control(
            &connection,
            &assign_message(&model, public(&first), &format!("run-{n}")),
        )
        .await;
        assert_eq!(kind(&reply), "ready", "{reply:?}");
        assert_eq!(stage.slices_held(), 1);
    }
    // Another served coordinator finds the bound full.
    let (_e, connection) = connect(&as_node(&second), &stage.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    let reply = control(&connection, &assign_message(&model, public(&second), "x")).await;
    assert_eq!(kind(&reply), "refused");
    assert!(
        reply
            .get("reason")
            .and_then(Cbor::as_text)
            .unwrap()
            .contains("maximum of 1 slices")
    );
    assert_eq!(stage.slices_held(), 1);
}

// ---------------------------------------------------------------- S3

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_leave_no_collector_slot_behind() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (a, _b, _c) = three_nodes(&model, dir.path()).await;
    let prompt = "undecodable presentation";
    let bad = GrantedServe {
        serve: GrantedServe::derive(prompt, 4, 4, 1_000_000),
        presentations: vec![vec![0xff, 0x00, 0x13]],
    };
    // More than the coordinator's 256 collector slots.
    for _ in 0..270 {
        let refused = ask(&a.peer_addr(), &request(prompt, 4, Some(bad.clone()))).await;
        let error = refused.expect_err("an undecodable presentation is refused");
        assert!(
            format!("{error:#}").contains("does not decode"),
            "{error:#}"
        );
    }
    assert_eq!(a.requests_pending_seal(), 0);
    let served = ask(&a.peer_addr(), &request("served after", 4, None))
        .await
        .unwrap();
    assert!(served.error.is_none(), "{:?}", served.error);
}

// ---------------------------------------------------------------- S4

/// A stopped node's journal, once its last in-flight task (a record push
/// to a peer that is gone, say) has let go of it.
fn journal(data: &Path) -> Vec<mesh_node::runtime::journal::Record> {
    let started = std::time::Instant::now();
    loop {
        match mesh_node::runtime::journal::Journal::read(&data.join("steward")) {
            Ok(records) => return records,
            Err(error) if started.elapsed() < Duration::from_secs(20) => {
                let _ = error;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(error) => panic!("{error}"),
        }
    }
}

/// Energy each debit in a steward's journal charged, in order.
fn debits_uj(data: &Path) -> Vec<u64> {
    journal(data)
        .iter()
        .filter_map(|record| match &record.entry {
            mesh_node::runtime::journal::Entry::Debited { energy, .. } => Some(energy.uj()),
            _ => None,
        })
        .collect()
}

fn unresolved(data: &Path, key: &SigningKey) -> usize {
    mesh_node::runtime::steward::replay(&did_key(&public(key)), &journal(data))
        .unwrap()
        .unresolved
        .len()
}

/// Granted requests refused as busy, at the coordinator (`coordinator_max`
/// 1) or at stage 1 (`stage_max` 1), while one request holds the only cache.
async fn busy_refusals_release_their_grants(coordinator_max: usize, stage_max: usize) {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (ka, kb) = (key(1), key(2));
    let (stall, c) = stalling_stage(&key(3)).await;
    let mut b = Setup::stage(&model, dir.path(), "b", 2);
    b.max_requests = stage_max;
    let b = b.start().await;
    let mut a = Setup::coordinator(&model, dir.path(), vec![b.peer_addr(), c]);
    a.max_requests = coordinator_max;
    // Refused at once, not queued: the refusals are what is checked.
    a.max_queued = 0;
    let a = a.start().await;

    let (shards, holder) = grants(dir.path(), &a, 900_000_000).await;

    // One request takes the only cache and stalls at the stand-in stage.
    let coordinator = a.peer_addr();
    let staller =
        tokio::spawn(async move { ask(&coordinator, &request("hold the cache", 4, None)).await });
    tokio::time::sleep(Duration::from_millis(500)).await;

    for n in 0..12 {
        let prompt = format!("granted {n}");
        let mut granted = granted(&shards, &holder, &prompt, 4, 20_000_000);
        granted.presentations[2].clear(); // the stand-in stage decides nothing
        let said = refusal(ask(&a.peer_addr(), &request(&prompt, 4, Some(granted))).await);
        assert!(
            said.contains("too many concurrent requests"),
            "request {n}: {said}"
        );
        assert!(!said.contains("too many authorised"), "request {n}: {said}");
    }
    // Releases at the stages are sent as the refusals end.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        b.grant_decisions_waiting(),
        0,
        "a stage holds stale decisions"
    );
    assert_eq!(a.requests_pending_seal(), 1, "only the stalled request");

    stall.close(0u32.into(), b"gone");
    let _ = staller.await;
    a.shutdown().await;
    b.shutdown().await;
    assert_eq!(unresolved(&dir.path().join("a"), &ka), 0);
    assert_eq!(unresolved(&dir.path().join("b"), &kb), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_coordinator_refuses_before_deciding_any_grant() {
    busy_refusals_release_their_grants(1, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_stage_releases_the_grant_it_decided() {
    busy_refusals_release_their_grants(4, 1).await;
}

// ---------------------------------------------------------------- S6

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_lengths_allocate_nothing_before_the_bytes_arrive() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (a, b, _c) = three_nodes(&model, dir.path()).await;
    let stranger = TlsIdentity::new(&key(9)).unwrap();
    // Address space, not residency: the old reader's zeroed buffers were
    // mapped whole (an address-space limit aborted the node) though untouched.
    let mapped_kib = || {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmSize:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            })
            .unwrap_or(0)
    };
    let before = mapped_kib();
    let mut held = Vec::new();
    // Stage streams: a first message may only be as large as an OPEN.
    let (_e1, stage) = connect(&stranger, &b.peer_addr(), ALPN_STAGE)
        .await
        .unwrap();
    for _ in 0..8 {
        let (mut send, mut recv) = stage.open_bi().await.unwrap();
        let length = msg::MAX_STAGE_MESSAGE as u32;
        // The node may drop the stream before these bytes are all sent.
        let _ = send.write_all(&length.to_le_bytes()).await;
        let _ = send.write_all(&[0u8; 1024]).await;
        let answer = tokio::time::timeout(Duration::from_secs(5), recv.read_to_end(64)).await;
        assert!(answer.is_ok(), "an oversized opening is dropped at once");
        held.push((send, recv));
    }
    // Control streams: a 1 MiB request limit, allocated as bytes arrive.
    let (_e2, control_connection) = connect(&stranger, &a.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    for _ in 0..32 {
        let (mut send, recv) = control_connection.open_bi().await.unwrap();
        let length = msg::MAX_CONTROL_REQUEST as u32;
        send.write_all(&length.to_le_bytes()).await.unwrap();
        send.write_all(&[0xa0; 16]).await.unwrap();
        held.push((send, recv));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown_mib = mapped_kib().saturating_sub(before) / 1024;
    // 8 x 256 MiB + 32 x 1 MiB were declared; the old reader mapped each.
    assert!(
        grown_mib < 1024,
        "{grown_mib} MiB mapped for declared lengths"
    );
    let served = ask(&a.peer_addr(), &request("served meanwhile", 4, None))
        .await
        .unwrap();
    assert!(served.error.is_none(), "{:?}", served.error);
}

// ---------------------------------------------------------------- S7

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_steward_stops_its_part_at_the_energy_ceiling() {
    stops_at_the_energy_ceiling(ReturnMode::Relayed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_steward_stops_its_part_at_the_energy_ceiling_in_direct_mode() {
    stops_at_the_energy_ceiling(ReturnMode::Direct).await;
}

/// `mesh-node verify --json` of a bundle: (exit code, report).
async fn stops_at_the_energy_ceiling(mode: ReturnMode) {
    stops_at_the_energy_ceiling_first_at(mode, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_final_stage_stopping_first_leaves_every_hop_agreeing() {
    for mode in [ReturnMode::Relayed, ReturnMode::Direct] {
        stops_at_the_energy_ceiling_first_at(mode, Some("c")).await;
    }
}

/// A serve on a 3 J ceiling; `first`, when given, is the node whose meter
/// bills a thousand times faster, so its steward stops before the others.
async fn stops_at_the_energy_ceiling_first_at(mode: ReturnMode, first: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let b = Setup::stage(&model, dir.path(), "b", 2).start().await;
    let mut c = Setup::stage(&model, dir.path(), "c", 3);
    if first == Some("c") {
        c.milliwatts *= 1000;
    }
    let c = c.start().await;
    let mut a = Setup::coordinator(&model, dir.path(), vec![b.peer_addr(), c.peer_addr()]);
    a.return_mode = mode;
    // The router would refuse a 1500-token answer on a 3 J ceiling up
    // front; a coordinator that underestimates admits it, and every
    // steward's own enforcement while the serve runs is what stops it.
    a.estimate_milliwatts = Some(1);
    let a = a.start().await;
    let (shards, holder) = grants(dir.path(), &a, 90_000_000).await;
    let ceiling_uj = 3_000_000;
    let prompt = "a long answer on a small ceiling";
    let summary = ask(
        &a.peer_addr(),
        &request(
            prompt,
            1500,
            Some(granted(&shards, &holder, prompt, 1500, ceiling_uj)),
        ),
    )
    .await
    .unwrap();
    assert_eq!(summary.terminal_state, "policy_denied", "{summary:?}");
    assert!(
        summary
            .error
            .as_deref()
            .is_some_and(|e| e.contains("energy ceiling")),
        "{summary:?}"
    );
    let generated = summary.details["generated_tokens"].as_u64().unwrap();
    assert!(generated < 1500, "{generated} tokens on a 3 J ceiling");
    if first == Some("c") {
        assert!(
            summary
                .error
                .as_deref()
                .unwrap_or_default()
                .contains("at stage 2"),
            "{summary:?}"
        );
    }
    let (_, report) = verify(dir.path(), summary.bundle.as_ref().unwrap());
    assert_eq!(report["terminal_state"], "policy_denied", "{report:#}");
    no_lane_breaks(&report);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for node in [a, b, c] {
        node.shutdown().await;
    }
    for name in ["a", "b", "c"] {
        let debits = debits_uj(&dir.path().join(name));
        assert_eq!(debits.len(), 1, "{name}: {debits:?}");
        if first == Some(name) {
            // One step at a thousand times the power is far over the ceiling
            // already: that steward stopped after its first step.
            continue;
        }
        // The ceiling, plus the step that crossed it (generously: a step on a
        // loaded machine can take long); the whole answer would be 100s of J.
        assert!(
            debits[0] <= 10 * ceiling_uj,
            "{name} debited {} µJ on a {ceiling_uj} µJ ceiling",
            debits[0]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_peer_that_is_gone_is_not_billed() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (stall, c) = stalling_stage(&key(3)).await;
    let b = Setup::stage(&model, dir.path(), "b", 2).start().await;
    let a = Setup::coordinator(&model, dir.path(), vec![b.peer_addr(), c])
        .start()
        .await;
    let (shards, holder) = grants(dir.path(), &a, 900_000_000).await;
    let prompt = "stalls at stage 2";
    let mut granted = granted(&shards, &holder, prompt, 8, 200_000_000);
    granted.presentations[2].clear();
    let coordinator = a.peer_addr();
    let asked =
        tokio::spawn(async move { ask(&coordinator, &request(prompt, 8, Some(granted))).await });
    // Five seconds of waiting on a stage that never answers, then it goes.
    tokio::time::sleep(Duration::from_secs(5)).await;
    stall.close(0u32.into(), b"gone");
    let summary = asked.await.unwrap().unwrap();
    assert_ne!(summary.terminal_state, "completed");
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.shutdown().await;
    b.shutdown().await;
    // At the estimator's 35 W the wait alone would be 175 J; one prefill
    // step, even on a loaded machine, is far less.
    for name in ["a", "b"] {
        let debits = debits_uj(&dir.path().join(name));
        assert_eq!(debits.len(), 1, "{name}: {debits:?}");
        assert!(
            debits[0] < 50_000_000,
            "{name} billed {} µJ for waiting",
            debits[0]
        );
    }
}

// ---------------------------------------------------------------- Low

/// The default chunk and a configured one: each chunk is one step at
/// every stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_prefilled_in_chunks_each_its_own_step() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let prompt: String = (0..300).map(|i| format!("w{i} ")).collect();
    let b = Setup::stage(&model, dir.path(), "b", 2).start().await;
    let c = Setup::stage(&model, dir.path(), "c", 3).start().await;
    let mut texts = Vec::new();
    for (run, chunk) in [mesh_node::runtime::serve::DEFAULT_PREFILL_CHUNK_TOKENS, 100]
        .into_iter()
        .enumerate()
    {
        let mut a = Setup::coordinator(&model, dir.path(), vec![b.peer_addr(), c.peer_addr()]);
        a.data = dir.path().join(format!("a{run}"));
        a.prefill_chunk_tokens = chunk;
        let a = a.start().await;
        let summary = ask(&a.peer_addr(), &request(&prompt, 3, None))
            .await
            .unwrap();
        assert!(summary.error.is_none(), "{:?}", summary.error);
        let prompt_tokens = summary.details["prompt_tokens"].as_u64().unwrap() as usize;
        assert!(prompt_tokens > 2 * chunk);
        let generated = summary.details["generated_tokens"].as_u64().unwrap() as usize;
        let chunks = prompt_tokens.div_ceil(chunk);
        for stage in [1, 2] {
            assert_eq!(
                summary.details["stages"][stage]["steps"].as_u64().unwrap() as usize,
                chunks + generated - 1,
                "chunk {chunk}, stage {stage}: {:#}",
                summary.details
            );
        }
        // Decode compute leaves the prompt's chunks out, at every stage,
        // and the chain's is the sum of its stages'.
        let stages = summary.details["stages"].as_array().unwrap();
        let mut sum = 0.0;
        for stage in stages {
            let (all, decode) = (
                stage["compute_ms"].as_f64().unwrap(),
                stage["decode_engine_ms"].as_f64().unwrap(),
            );
            assert!(0.0 < decode && decode < all, "{stage:#}");
            sum += decode;
        }
        let chain = summary.details["decode_engine_ms"].as_f64().unwrap();
        assert!((chain - sum).abs() < 1e-3, "{chain} against {sum}");
        texts.push(summary.text);
        a.shutdown().await;
    }
    assert_eq!(texts[0], texts[1], "the chunking changed the answer");
}

/// With direct return the prompt's chunks go down without waiting for
/// each other's replies (stage k on chunk i+1 while stage k+1 is on chunk
/// i): the tokens are the relayed run's, every stage still answers every
/// chunk, and every hand-off of the bundle agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_prompt_gives_the_sequential_tokens_and_whole_lanes() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let prompt: String = (0..300).map(|i| format!("w{i} ")).collect();
    let mut tokens = Vec::new();
    for mode in [ReturnMode::Relayed, ReturnMode::Direct] {
        let b = Setup::stage(&model, dir.path(), "b", 2).start().await;
        let c = Setup::stage(&model, dir.path(), "c", 3).start().await;
        let mut a = Setup::coordinator(&model, dir.path(), vec![b.peer_addr(), c.peer_addr()]);
        a.return_mode = mode;
        let a = a.start().await;
        let summary = ask(&a.peer_addr(), &request(&prompt, 6, None))
            .await
            .unwrap();
        assert!(summary.error.is_none(), "{mode:?}: {:?}", summary.error);
        let prompt_tokens = summary.details["prompt_tokens"].as_u64().unwrap() as usize;
        let chunks =
            prompt_tokens.div_ceil(mesh_node::runtime::serve::DEFAULT_PREFILL_CHUNK_TOKENS);
        assert!(chunks >= 3, "{prompt_tokens} prompt tokens");
        let generated = summary.details["generated_tokens"].as_u64().unwrap() as usize;
        for stage in [1, 2] {
            assert_eq!(
                summary.details["stages"][stage]["steps"].as_u64().unwrap() as usize,
                chunks + generated - 1,
                "{mode:?} stage {stage}"
            );
        }
        let (_, report) = verify(dir.path(), summary.bundle.as_ref().unwrap());
        assert_eq!(report["handoffs_agree"], true, "{mode:?}: {report:#}");
        no_lane_breaks(&report);
        tokens.push(summary.details["token_ids"].clone());
        for node in [a, b, c] {
            node.shutdown().await;
        }
    }
    assert_eq!(tokens[0], tokens[1], "relayed and pipelined direct differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_slice_is_freed_and_assigned_again_when_needed() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let idle = Duration::from_millis(400);
    let mut stages = Vec::new();
    for (name, k) in [("b", 2), ("c", 3)] {
        let mut stage = Setup::stage(&model, dir.path(), name, k);
        stage.slice_idle = idle;
        stages.push(stage.start().await);
    }
    let peers = stages.iter().map(Node::peer_addr).collect();
    let a = Setup::coordinator(&model, dir.path(), peers).start().await;
    for round in 0..2 {
        let summary = ask(&a.peer_addr(), &request("idle and back", 3, None))
            .await
            .unwrap();
        assert!(
            summary.error.is_none(),
            "round {round}: {:?}",
            summary.error
        );
        assert!(stages.iter().all(|s| s.slices_held() == 1));
        tokio::time::sleep(idle * 3).await;
        assert!(
            stages.iter().all(|s| s.slices_held() == 0),
            "round {round}: an idle slice is still held"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receipt_chain_link_survives_a_coordinator_restart() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (a, b, c) = three_nodes(&model, dir.path()).await;
    let peers = vec![b.peer_addr(), c.peer_addr()];
    let first = ask(&a.peer_addr(), &request("before", 2, None))
        .await
        .unwrap();
    let envelope = |summary: &GenerateSummary, member: &str| {
        summary.bundle.as_ref().unwrap()[member]
            .as_str()
            .map(|hex| mesh_protocol::hex::decode(hex).unwrap())
    };
    let before = envelope(&first, "mesh1_envelope").unwrap();
    a.shutdown().await;
    // Start again on the same journal once the old node has let go of it.
    let started = std::time::Instant::now();
    let a = loop {
        match Setup::coordinator(&model, dir.path(), peers.clone())
            .try_start()
            .await
        {
            Ok(node) => break node,
            Err(error) if started.elapsed() < Duration::from_secs(20) => {
                let _ = error;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("{error:#}"),
        }
    };
    let second = ask(&a.peer_addr(), &request("after", 2, None))
        .await
        .unwrap();
    let previous = envelope(&second, "mesh1_prev_envelope")
        .expect("the first bundle after a restart carries the previous envelope");
    assert_eq!(previous, before);
    let sealed =
        mesh_protocol::mesh1::SealedReceipt::verify(&envelope(&second, "mesh1_envelope").unwrap())
            .unwrap();
    let linked = mesh_protocol::mesh1::SealedReceipt::verify(&previous).unwrap();
    assert_eq!(sealed.receipt.prev, Some(linked.envelope_id()));
}

/// A final stage that answers with something other than one finite f32
/// row of the model's width, for the step asked, gets no token sampled
/// from it: the request fails naming what was wrong, and the coordinator
/// holds nothing afterwards. The same stage answering one well-formed row
/// is served, so the refusals are the reply's, not the harness's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_stage_reply_that_is_not_one_finite_row_is_refused() {
    use mesh_stage::frame::{WireDType, encode_frame};
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let hidden = mesh_stage::ModelHandle::open(&model)
        .unwrap()
        .config()
        .hidden;
    let row = move |value: f32, rows: usize, dtype| {
        encode_frame(&vec![value; rows * hidden], rows, hidden, dtype).unwrap()
    };
    let cases: Vec<(&str, Script, Option<&str>)> = vec![
        (
            "one f32 row",
            std::sync::Arc::new(move |id, step| {
                Some(msg::stage_body(
                    msg::kind::HIDDEN,
                    id,
                    step,
                    &row(0.5, 1, WireDType::F32),
                ))
            }),
            None,
        ),
        (
            "two rows",
            std::sync::Arc::new(move |id, step| {
                Some(msg::stage_body(
                    msg::kind::HIDDEN,
                    id,
                    step,
                    &row(0.5, 2, WireDType::F32),
                ))
            }),
            Some("not 1 of F32"),
        ),
        (
            "f16",
            std::sync::Arc::new(move |id, step| {
                Some(msg::stage_body(
                    msg::kind::HIDDEN,
                    id,
                    step,
                    &row(0.5, 1, WireDType::F16),
                ))
            }),
            Some("not 1 of F32"),
        ),
        (
            "not finite",
            std::sync::Arc::new(move |id, step| {
                Some(msg::stage_body(
                    msg::kind::HIDDEN,
                    id,
                    step,
                    &row(f32::NAN, 1, WireDType::F32),
                ))
            }),
            Some("not finite"),
        ),
        (
            "another step",
            std::sync::Arc::new(move |id, step| {
                Some(msg::stage_body(
                    msg::kind::HIDDEN,
                    id,
                    step + 1,
                    &row(0.5, 1, WireDType::F32),
                ))
            }),
            Some("a reply for step"),
        ),
        (
            "a megabyte",
            std::sync::Arc::new(move |id, step| {
                Some(msg::stage_body(
                    msg::kind::HIDDEN,
                    id,
                    step,
                    &vec![0u8; 1 << 20],
                ))
            }),
            Some("stage 1"),
        ),
    ];
    for (name, script, refusal) in cases {
        let (_stage, peer, _) = scripted_stage(&key(3), script).await;
        let a = Setup::coordinator(&model, dir.path(), vec![peer])
            .start()
            .await;
        let summary = ask(&a.peer_addr(), &request("whose hidden state?", 2, None))
            .await
            .unwrap();
        match refusal {
            None => {
                assert!(summary.error.is_none(), "{name}: {:?}", summary.error);
                assert_eq!(summary.details["generated_tokens"], 2, "{name}");
            }
            Some(why) => {
                let error = summary.error.clone().unwrap_or_default();
                assert!(error.contains(why), "{name}: {error}");
                assert_eq!(summary.details["generated_tokens"], 0, "{name}");
            }
        }
        assert!(a.stats().await.pools_empty(), "{name}");
        a.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_final_stage_may_open_the_direct_return() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (stall, c, opened) = observed_stalling_stage(&key(3)).await;
    let b = Setup::stage(&model, dir.path(), "b", 2).start().await;
    let mut a = Setup::coordinator(&model, dir.path(), vec![b.peer_addr(), c]);
    a.return_mode = ReturnMode::Direct;
    let a = a.start().await;
    let coordinator = a.peer_addr();
    let asked =
        tokio::spawn(async move { ask(&coordinator, &request("whose logits?", 4, None)).await });
    // The request id reaches the final stage in its OPEN (and every bundle).
    let started = std::time::Instant::now();
    let request_id = loop {
        if let Some(id) = opened.lock().unwrap().first().copied() {
            break id;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no OPEN");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A stranger opens the direct return and sends a final hidden state of
    // its choosing.
    let hidden = mesh_stage::ModelHandle::open(&model)
        .unwrap()
        .config()
        .hidden;
    let chosen = vec![1e3f32; hidden];
    let payload =
        mesh_stage::frame::encode_frame(&chosen, 1, hidden, mesh_stage::frame::WireDType::F32)
            .unwrap();
    let stranger = TlsIdentity::new(&key(9)).unwrap();
    let (_endpoint, connection) = connect(&stranger, &a.peer_addr(), ALPN_STAGE)
        .await
        .unwrap();
    let (mut send, _recv) = connection.open_bi().await.unwrap();
    for (kind, body) in [
        (msg::kind::DIRECT_OPEN, Vec::new()),
        (msg::kind::HIDDEN, payload),
    ] {
        let _ = msg::write(&mut send, &msg::stage_body(kind, request_id, 0, &body)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stall.close(0u32.into(), b"gone");
    let summary = asked.await.unwrap().unwrap();
    assert_eq!(
        summary.details["generated_tokens"], 0,
        "the stranger's hidden state was sampled: {:#}",
        summary.details
    );
    assert!(summary.error.is_some());
}

// ---------------------------------------------------------------- bounds

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_holds_at_most_64_streams_on_a_connection() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let node = Setup::new(&model, dir.path().join("n"), key(2))
        .start()
        .await;
    let stranger = TlsIdentity::new(&key(9)).unwrap();
    let (_endpoint, connection) = connect(&stranger, &node.peer_addr(), ALPN_CONTROL)
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..tls::MAX_STREAMS_PER_CONNECTION {
        let (mut send, recv) = connection.open_bi().await.unwrap();
        // A stream counts once the node sees it.
        send.write_all(&[0]).await.unwrap();
        held.push((send, recv));
    }
    let one_more = tokio::time::timeout(Duration::from_secs(1), connection.open_bi()).await;
    assert!(one_more.is_err(), "a 65th stream was opened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_bound_are_refused_but_known_peers_get_in() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let mut node = Setup::new(&model, dir.path().join("n"), key(2));
    node.coordinators = vec![public(&key(1))];
    let node = node.start().await;
    tls::install_provider();
    let client = |who: &SigningKey| {
        let identity = TlsIdentity::new(who).unwrap();
        let mut endpoint =
            quinn::Endpoint::client((std::net::Ipv4Addr::LOCALHOST, 0).into()).unwrap();
        endpoint.set_default_client_config(
            tls::client_config(&identity, node.public_key(), ALPN_CONTROL).unwrap(),
        );
        endpoint
    };
    let stranger = client(&key(9));
    let mut held = Vec::new();
    for _ in 0..mesh_node::runtime::serve::MAX_CONNECTIONS {
        held.push(
            stranger
                .connect(node.addr(), "mesh-node")
                .unwrap()
                .await
                .unwrap(),
        );
    }
    // One more stranger is closed as soon as the node knows who it is.
    let extra = stranger
        .connect(node.addr(), "mesh-node")
        .unwrap()
        .await
        .unwrap();
    // A generous bound: 512 handshakes on a loaded two-core machine can
    // hold the node's answer back for seconds (2.5 s alone, past 20 s once
    // beside this file's other tests in a debug build). What is checked is
    // the reason it gives, which an idle close would not.
    let closed = tokio::time::timeout(Duration::from_secs(90), extra.closed())
        .await
        .expect("closed, not left open");
    assert!(
        format!("{closed}").contains("too many connections"),
        "{closed}"
    );
    // The coordinator this node serves still gets in, and is answered.
    let coordinator = client(&key(1));
    let connection = coordinator
        .connect(node.addr(), "mesh-node")
        .unwrap()
        .await
        .unwrap();
    let reply = control(
        &connection,
        &Cbor::text_map([("kind", Cbor::text("stats")), ("request_id", Cbor::Uint(1))]),
    )
    .await;
    assert_eq!(kind(&reply), "stats");
    // A stranger's slot comes back when one of theirs closes.
    held.pop().unwrap().close(0u32.into(), b"done");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = stranger
        .connect(node.addr(), "mesh-node")
        .unwrap()
        .await
        .unwrap();
    let still_open = tokio::time::timeout(Duration::from_millis(500), again.closed()).await;
    assert!(still_open.is_err(), "a freed slot was not given back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stage_times_out_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (_stall, c) = stalling_stage(&key(3)).await;
    let mut b = Setup::stage(&model, dir.path(), "b", 2);
    b.step_timeout = Duration::from_secs(30);
    let b = b.start().await;
    let mut a = Setup::coordinator(&model, dir.path(), vec![b.peer_addr(), c]);
    a.step_timeout = Duration::from_millis(1500);
    let a = a.start().await;
    let summary = ask(&a.peer_addr(), &request("no answer comes", 4, None))
        .await
        .unwrap();
    assert_eq!(summary.terminal_state, "timed_out", "{summary:?}");
    let error = summary.error.unwrap_or_default();
    assert!(
        error.contains("step timeout of 1500 ms") && error.contains("--step-timeout-ms"),
        "{error}"
    );
}

// ------------------------------------------------------- drafts and REWIND

/// What a stage answers to one message of a scripted upstream.
#[derive(Debug, PartialEq)]
enum Answer {
    /// A HIDDEN reply of this many rows.
    Rows(usize),
    /// No reply (a REWIND taken).
    Nothing,
    /// FAILED, with its reason.
    Failed(String),
}

/// Speak as stage 1's upstream (the coordinator, key 1) on request
/// `request_id`: OPEN, then each message in turn (ACTIVATIONS of so many
/// rows, or REWIND to so many positions), reading what comes back after
/// each (relayed return: every reply comes up through stage 1).
/// What `drive_stage` says to a stage: ACTIVATIONS of so many rows, or a
/// REWIND to so many positions, carrying the next step's number or
/// (`..At`) the one given.
#[derive(Clone, Copy)]
enum Said {
    Rows(usize),
    Rewind(u64),
    RowsAt(usize, u32),
    RewindAt(u64, u32),
}

async fn drive_stage(
    stage: &PeerAddr,
    run_id: &str,
    hidden: usize,
    request_id: u64,
    messages: &[Said],
) -> Vec<Answer> {
    use mesh_protocol::stage_frame::Rewind;
    use mesh_stage::frame::{WireDType, encode_frame};
    let identity = TlsIdentity::new(&key(1)).unwrap();
    let (_endpoint, connection) = connect(&identity, stage, ALPN_STAGE).await.unwrap();
    let (mut send, mut recv) = connection.open_bi().await.unwrap();
    let open = Cbor::text_map([
        ("run_id", Cbor::text(run_id)),
        ("capacity", Cbor::Uint(64)),
        ("return_mode", Cbor::text("relayed")),
        ("prefill_steps", Cbor::Uint(1)),
    ]);
    msg::write(
        &mut send,
        &msg::stage_body(msg::kind::OPEN, request_id, 0, &open.encode()),
    )
    .await
    .unwrap();
    let mut answers = Vec::new();
    let mut step = 0;
    for message in messages {
        // The step a message carries: the next one, unless told otherwise.
        let (taken, at) = match *message {
            Said::Rows(_) | Said::Rewind(_) => (true, step),
            Said::RowsAt(_, at) | Said::RewindAt(_, at) => (false, at),
        };
        let body = match *message {
            Said::Rows(rows) | Said::RowsAt(rows, _) => {
                let values: Vec<f32> = (0..rows * hidden).map(|i| (i % 17) as f32 * 0.01).collect();
                let frame = encode_frame(&values, rows, hidden, WireDType::F32).unwrap();
                step += u32::from(taken);
                msg::stage_body(msg::kind::ACTIVATIONS, request_id, at, &frame)
            }
            Said::Rewind(positions) | Said::RewindAt(positions, _) => msg::stage_body(
                msg::kind::REWIND,
                request_id,
                at,
                &Rewind { positions }.encode(),
            ),
        };
        let is_rows = matches!(message, Said::Rows(_) | Said::RowsAt(..));
        msg::write(&mut send, &body).await.unwrap();
        // A REWIND taken gets no answer: a short wait says so.
        let wait = if is_rows { 10 } else { 1 };
        let reply = msg::read(&mut recv, msg::MAX_STAGE_MESSAGE, Duration::from_secs(wait)).await;
        let answer = match reply {
            Ok(Some(frame)) => {
                let (kind, _, _, payload) = msg::parse_stage(&frame).unwrap();
                if kind == msg::kind::FAILED {
                    Answer::Failed(String::from_utf8_lossy(payload).into_owned())
                } else {
                    assert_eq!(kind, msg::kind::HIDDEN);
                    let (rows, _) = mesh_stage::frame::decode_frame(payload, hidden).unwrap();
                    Answer::Rows(rows.rows)
                }
            }
            _ => Answer::Nothing,
        };
        let failed = matches!(answer, Answer::Failed(_));
        answers.push(answer);
        if failed {
            break;
        }
    }
    answers
}

/// A decode step's every position is answered; a REWIND is taken only
/// right after a decode step with a draft and only to drop part of that
/// draft; a decode step of more than 16 positions, and an ACTIVATIONS or
/// REWIND carrying another step than the next, are refused. Each refusal
/// is a FAILED, and the chain serves normally afterwards with every pool
/// empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_takes_a_rewind_only_of_the_last_draft_and_bounds_a_decode_step() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (a, b, c) = three_nodes(&model, dir.path()).await;
    let first = ask(&a.peer_addr(), &request("set up the run", 2, None))
        .await
        .unwrap();
    assert!(first.error.is_none(), "{:?}", first.error);
    let run_id = first.details["run_id"].as_str().unwrap().to_string();
    let hidden = mesh_stage::ModelHandle::open(&model)
        .unwrap()
        .config()
        .hidden;
    let failed = |answer: &Answer, why: &str| match answer {
        Answer::Failed(reason) => assert!(reason.contains(why), "{reason}"),
        other => panic!("{other:?}, not a refusal saying {why:?}"),
    };

    // A prompt of 3, a decode step with a draft of 2 (6 positions), one
    // drafted position dropped, a decode step of one, then a REWIND with
    // no draft to drop.
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        901,
        &[
            Said::Rows(3),
            Said::Rows(3),
            Said::Rewind(5),
            Said::Rows(1),
            Said::Rewind(5),
        ],
    )
    .await;
    assert_eq!(
        answers[..4],
        [
            Answer::Rows(1),
            Answer::Rows(3),
            Answer::Nothing,
            Answer::Rows(1)
        ]
    );
    failed(&answers[4], "drops more than the last step's draft");

    // More than the draft (2 of 3 positions are a draft: 3 dropped).
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        902,
        &[Said::Rows(3), Said::Rows(3), Said::Rewind(3)],
    )
    .await;
    failed(&answers[2], "drops more than the last step's draft");
    // Nothing dropped, or more kept than held.
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        903,
        &[Said::Rows(3), Said::Rows(3), Said::Rewind(6)],
    )
    .await;
    failed(&answers[2], "a rewind to 6 positions of 6");
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        904,
        &[Said::Rows(3), Said::Rows(3), Said::Rewind(9)],
    )
    .await;
    failed(&answers[2], "a rewind to 9 positions of 6");
    // During prefill.
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        905,
        &[Said::Rows(3), Said::Rewind(2)],
    )
    .await;
    failed(&answers[1], "drops more than the last step's draft");
    // A decode step of 17 positions.
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        906,
        &[Said::Rows(3), Said::Rows(17)],
    )
    .await;
    failed(&answers[1], "at most 16");
    // Out of turn: a step skipped or repeated, a REWIND carrying another
    // step than the next.
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        907,
        &[Said::Rows(3), Said::RowsAt(1, 2)],
    )
    .await;
    failed(&answers[1], "step 2 where step 1 was next");
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        908,
        &[Said::Rows(3), Said::Rows(1), Said::RowsAt(1, 1)],
    )
    .await;
    failed(&answers[2], "step 1 where step 2 was next");
    let answers = drive_stage(
        &b.peer_addr(),
        &run_id,
        hidden,
        909,
        &[Said::Rows(3), Said::Rows(3), Said::RewindAt(5, 1)],
    )
    .await;
    failed(&answers[2], "a rewind carrying step 1, not the next step 2");

    let after = ask(&a.peer_addr(), &request("still served", 4, None))
        .await
        .unwrap();
    assert!(after.error.is_none(), "{:?}", after.error);
    common::nodes::pools_empty_within(
        &[a, b, c],
        std::time::Instant::now(),
        Duration::from_secs(5),
        "refused rewinds",
    )
    .await;
}

// ------------------------------------------------- issue 37's stranger probes

/// X1 (issue 37): a model file changed after the node opened it is not
/// served under the digest it opened with. A slice loaded later reads each
/// tensor's bytes against what was digested at open, so the request that
/// would load it is refused, naming the change and what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_file_changed_after_start_is_not_served_under_the_old_digest() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (a, _b, _c) = three_nodes(&model, dir.path()).await;
    // One bit of a layer's weights, flipped in place: the lowest mantissa
    // bit of one f32 (a value nearly the same, as a quiet edit would be).
    let offset = {
        let mut file = std::fs::File::open(&model).unwrap();
        let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
        let info = &content.tensor_infos["blk.1.attn_q.weight"];
        content.tensor_data_offset + info.offset
    };
    let mut bytes = std::fs::read(&model).unwrap();
    bytes[offset as usize] ^= 0x01;
    std::fs::write(&model, &bytes).unwrap();
    let reason = refusal(ask(&a.peer_addr(), &request("hello", 4, None)).await);
    assert!(
        reason.contains("changed since this node opened it") && reason.contains("restart"),
        "{reason}"
    );
}

/// A coordinator over two stages with its HTTP API on, `access` its hosts
/// and origins; the API's address.
async fn api_nodes(
    dir: &Path,
    access: mesh_node::runtime::http::Access,
) -> ([Node; 3], std::net::SocketAddr) {
    let model = synthetic(dir);
    let b = Setup::stage(&model, dir, "b", 2).start().await;
    let c = Setup::stage(&model, dir, "c", 3).start().await;
    let mut a = Setup::coordinator(&model, dir, vec![b.peer_addr(), c.peer_addr()]);
    a.http = true;
    a.http_access = access;
    let a = a.start().await;
    let addr = a.http_addr().unwrap();
    ([a, b, c], addr)
}

/// Loopback address 127.0.0.`last`: a client of its own.
fn client(last: u8) -> std::net::IpAddr {
    std::net::IpAddr::from([127, 0, 0, last])
}

/// Host header (issue 37): a web page that rebinds its own name to a
/// node's loopback address reaches the API with that name as its Host, so
/// a name that is not the node's is refused (403) before any handler, the
/// witness among them; IP literals, localhost and a configured name are
/// answered. CORS is off unless an origin is configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_answers_only_hosts_a_rebinding_page_cannot_name() {
    use common::http::exchange_from;
    let dir = tempfile::tempdir().unwrap();
    let access = mesh_node::runtime::http::Access {
        allow_hosts: vec!["node.lan".into()],
        allow_origins: vec!["http://app.example".into()],
    };
    let (_nodes, addr) = api_nodes(dir.path(), access).await;
    let port = addr.port();
    let ask = move |method: &'static str, path: &'static str, host: String| async move {
        tokio::task::spawn_blocking(move || {
            exchange_from(
                client(1),
                addr,
                (method, path, &host),
                b"{}",
                Duration::from_secs(10),
            )
            .unwrap()
        })
        .await
        .unwrap()
    };
    for host in [
        format!("rebound.example:{port}"),
        format!("127.0.0.1.nip.io:{port}"),
    ] {
        let (status, body) = ask("GET", "/v1/models", host.clone()).await;
        assert_eq!(status, 403, "{host}: {body}");
        assert!(body.contains("--http-allow-host"), "{body}");
        let (status, _) = ask("POST", "/v1/mesh/witness", host.clone()).await;
        assert_eq!(status, 403, "{host}: the witness is reachable");
    }
    for host in [
        addr.to_string(),
        format!("localhost:{port}"),
        format!("node.lan:{port}"),
    ] {
        let (status, body) = ask("GET", "/v1/models", host.clone()).await;
        assert_eq!(status, 200, "{host}: {body}");
    }
    // A preflight from an origin nobody configured is refused; from the
    // configured one it is answered for that origin only.
    let preflight = |origin: &'static str| {
        move || {
            let mut stream = common::http::connect_from(client(1), addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            use std::io::{Read, Write};
            write!(
                stream,
                "OPTIONS /v1/completions HTTP/1.1\r\nHost: {addr}\r\nOrigin: {origin}\r\n\
                 Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut response = String::new();
            let _ = stream.read_to_string(&mut response);
            response
        }
    };
    let refused = tokio::task::spawn_blocking(preflight("http://evil.example"))
        .await
        .unwrap();
    assert!(refused.starts_with("HTTP/1.1 403"), "{refused}");
    let answered = tokio::task::spawn_blocking(preflight("http://app.example"))
        .await
        .unwrap();
    assert!(answered.starts_with("HTTP/1.1 204"), "{answered}");
    assert!(
        answered
            .to_ascii_lowercase()
            .contains("access-control-allow-origin: http://app.example"),
        "{answered}"
    );
}

/// H1 (issue 37): 300 TCP connections that send nothing, each opened again
/// as soon as it is closed, do not lock the API: every one of ten requests
/// from another client is answered within 2 s (before the fix, none in 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_never_lock_the_api() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let (_nodes, addr) = api_nodes(dir.path(), Default::default()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let holder = {
        let (stop, opened) = (stop.clone(), opened.clone());
        std::thread::spawn(move || {
            let mut held: Vec<std::net::TcpStream> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                // Reopen what the server closed, up to 300 held.
                held.retain(|stream| {
                    let mut byte = [0u8; 1];
                    let _ = stream.set_nonblocking(true);
                    match stream.peek(&mut byte) {
                        Ok(0) => false,
                        Ok(_) => true,
                        Err(error) => error.kind() == std::io::ErrorKind::WouldBlock,
                    }
                });
                while held.len() < 300 {
                    match common::http::connect_from(client(9), addr) {
                        Ok(stream) => {
                            held.push(stream);
                            opened.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    while opened.load(Ordering::Relaxed) < 300 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for attempt in 0..10 {
        let started = std::time::Instant::now();
        let (status, body) = tokio::task::spawn_blocking(move || {
            common::http::exchange_from(
                client(2),
                addr,
                ("GET", "/v1/models", &addr.to_string()),
                b"",
                Duration::from_secs(2),
            )
        })
        .await
        .unwrap()
        .unwrap_or((0, String::new()));
        let took = started.elapsed();
        assert_eq!(status, 200, "attempt {attempt}: {body}");
        assert!(
            took <= Duration::from_secs(2),
            "attempt {attempt}: {took:?}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    holder.join().unwrap();
}

/// Per-source fairness (issue 37): fifty clients of one stranger flood the
/// API with completions and eight more of another open streams they never
/// read; a well-behaved client elsewhere still gets at least 80 % of its
/// requests served (before the fix: 1 of 58), because each source holds at
/// most its quota of the coordinator's caches and a freed cache goes to the
/// next source in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_and_silent_streams_from_strangers_leave_room_for_others() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let (nodes, addr) = api_nodes(dir.path(), Default::default()).await;
    let model = nodes[0].model_id();
    let stop = Arc::new(AtomicBool::new(false));
    let body = |prompt: &str, tokens: u64, stream: bool| {
        serde_json::json!({
            "model": model, "prompt": prompt, "max_tokens": tokens, "stream": stream,
        })
        .to_string()
    };
    let flooders: Vec<_> = (0..50)
        .map(|i| {
            let (stop, request) = (stop.clone(), body(&format!("flood {i}"), 16, false));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _ = common::http::exchange_from(
                        client(9),
                        addr,
                        ("POST", "/v1/completions", &addr.to_string()),
                        request.as_bytes(),
                        Duration::from_secs(60),
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();
    // Streams whose readers never read: connections held open.
    let silent: Vec<std::net::TcpStream> = (0..8)
        .map(|i| {
            use std::io::Write;
            let request = body(&format!("silent {i}"), 1500, true);
            let mut stream = common::http::connect_from(client(10), addr).unwrap();
            write!(
                stream,
                "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{request}",
                request.len()
            )
            .unwrap();
            stream
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut served = 0;
    let asked = 20;
    for i in 0..asked {
        let request = body(&format!("well behaved {i}"), 8, false);
        let (status, reply) = tokio::task::spawn_blocking(move || {
            common::http::exchange_from(
                client(2),
                addr,
                ("POST", "/v1/completions", &addr.to_string()),
                request.as_bytes(),
                Duration::from_secs(60),
            )
            .unwrap_or((0, String::new()))
        })
        .await
        .unwrap();
        if status == 200 {
            served += 1;
        } else {
            eprintln!("request {i}: {status} {reply}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    drop(silent);
    for flooder in flooders {
        flooder.join().unwrap();
    }
    assert!(
        served * 10 >= asked * 8,
        "the well-behaved client got {served} of {asked} requests served"
    );
}

/// Low (issue 37): a stranger's refused assignments, however many, write one
/// warning a minute to the stage's log (the rest are counted in the next).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strangers_refused_assignments_are_logged_once_a_minute() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let stage = common::processes::stage(dir.path(), "b", &model, &[], &[]);
    let peer: PeerAddr = stage.peer.parse().unwrap();
    let stranger = TlsIdentity::new(&key(9)).unwrap();
    let (_e, connection) = connect(&stranger, &peer, ALPN_CONTROL).await.unwrap();
    for n in 0..40 {
        let reply = control(
            &connection,
            &assign_message(&model, public(&key(9)), &format!("s{n}")),
        )
        .await;
        assert_eq!(kind(&reply), "refused");
    }
    let log = std::fs::read_to_string(dir.path().join("b.log")).unwrap();
    let lines = log.matches("refused an assignment from").count();
    assert_eq!(lines, 1, "{log}");
}

/// Low (issue 37): a presentation that is hex but not a presentation is
/// the caller's mistake: 400, not the 503 (and Retry-After) of a mesh that
/// could not serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_presentation_that_is_not_one_is_a_bad_request() {
    let dir = tempfile::tempdir().unwrap();
    let (nodes, addr) = api_nodes(dir.path(), Default::default()).await;
    let body = serde_json::json!({
        "model": nodes[0].model_id(), "prompt": "hi", "max_tokens": 2,
        "metadata": {"joule_ceiling_uj": "5000000"},
        "jcp_presentation": ["00ff", "", ""],
    });
    let (status, reply) = tokio::task::spawn_blocking(move || {
        common::http::call(addr, "POST", "/v1/completions", Some(&body)).unwrap()
    })
    .await
    .unwrap();
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("not a grant presentation"),
        "{reply}"
    );
}

/// Low (issue 37): a request head over 64 KiB is refused (431), as
/// docs/api.md says; before, heads of up to about 128 KiB were taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_over_64_kib_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_nodes, addr) = api_nodes(dir.path(), Default::default()).await;
    let head = |bytes: usize| {
        move || {
            use std::io::{Read, Write};
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let padding = "a".repeat(bytes);
            let _ = write!(
                stream,
                "GET /v1/models HTTP/1.1\r\nHost: {addr}\r\nX-Padding: {padding}\r\n\
                 Connection: close\r\n\r\n"
            );
            let mut response = String::new();
            let _ = stream.read_to_string(&mut response);
            response.split_whitespace().nth(1).unwrap_or("").to_string()
        }
    };
    assert_eq!(
        tokio::task::spawn_blocking(head(60_000)).await.unwrap(),
        "200"
    );
    for bytes in [70_000, 100_000, 200_000] {
        assert_eq!(
            tokio::task::spawn_blocking(head(bytes)).await.unwrap(),
            "431",
            "a head of {bytes} bytes"
        );
    }
}
