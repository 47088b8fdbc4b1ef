//! A living mesh on 127.0.0.1: nodes join through a bootstrap address, the
//! coordinator plans over their adverts (memory and speed), serves split,
//! re-plans when a stage node dies and when it comes back, without
//! restarting anything; forged and replayed adverts are refused.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::nodes::{key, public, synthetic};
use common::processes::bin;
use mesh_node::runtime::mesh::{Mesh, MeshOptions};
use mesh_protocol::advert::{Advert, AdvertModel};
use mesh_protocol::identity::did_key;
use serde_json::Value;

/// A `mesh-node serve|join` child, killed when dropped.
struct Running {
    child: Child,
    peer: String,
    mesh: String,
    did: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, name: &str, args: &[String]) -> Running {
    start_at(dir, name, args, "127.0.0.1:0")
}

/// `start`, its data plane (QUIC) on `listen`.
fn start_at(dir: &Path, name: &str, args: &[String], listen: &str) -> Running {
    start_with_env(dir, name, args, listen, &[])
}

/// `start_at`, with `env` set for the process.
fn start_with_env(
    dir: &Path,
    name: &str,
    args: &[String],
    listen: &str,
    env: &[(&str, &str)],
) -> Running {
    let mut child = Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .args([
            "--listen",
            listen,
            "--mesh-listen",
            "/ip4/127.0.0.1/tcp/0",
            "--no-mdns",
        ])
        .stdout(Stdio::piped())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join(format!("{name}.log")))
                .unwrap(),
        )
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut mesh = None;
    let mut did = None;
    let peer = loop {
        let line = lines
            .next()
            .expect("the node prints its addresses")
            .unwrap();
        if let Some(address) = line.strip_prefix("mesh address: ") {
            mesh.get_or_insert_with(|| address.to_string());
        }
        if let Some(rest) = line.strip_prefix("node ") {
            did = rest.split_whitespace().next().map(str::to_string);
        }
        if let Some(peer) = line.strip_prefix("peer address: ") {
            break peer.to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Running {
        child,
        peer,
        mesh: mesh.expect("a mesh node prints its mesh address"),
        did: did.expect("the node prints its node id"),
    }
}

/// A coordinator `serve` in a mesh (key and data `coord` under `dir`);
/// its key file with it.
fn mesh_coordinator(dir: &Path, model: &Path, extra: &[&str]) -> (Running, PathBuf) {
    let key = common::processes::keygen(dir, "coord");
    let mut args: Vec<String> = vec![
        "serve".into(),
        "--key".into(),
        key.to_str().unwrap().into(),
        "--model".into(),
        model.to_str().unwrap().into(),
        "--data".into(),
        dir.join("coord").to_str().unwrap().into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    (start(dir, "coord", &args), key)
}

/// `join` through `bootstrap`, its data under `dir/name`.
fn mesh_join(dir: &Path, model: &Path, bootstrap: &str, name: &str, extra: &[&str]) -> Running {
    start(dir, name, &join_args(dir, model, bootstrap, name, extra))
}

fn join_args(dir: &Path, model: &Path, bootstrap: &str, name: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "join".into(),
        "--model".into(),
        model.to_str().unwrap().into(),
        "--data".into(),
        dir.join(name).to_str().unwrap().into(),
        "--bootstrap".into(),
        bootstrap.into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// `mesh-node verify --json` on `bundle`, saved under `dir` as `name`: its
/// exit status and report.
fn verify_saved(dir: &Path, name: &str, bundle: &impl serde::Serialize) -> (Option<i32>, Value) {
    let saved = dir.join(name);
    std::fs::write(&saved, serde_json::to_vec(bundle).unwrap()).unwrap();
    let verified = Command::new(bin())
        .args(["verify", "--json"])
        .arg(&saved)
        .output()
        .unwrap();
    let report = serde_json::from_slice(&verified.stdout).unwrap();
    (verified.status.code(), report)
}

/// A mesh coordinator (`coordinator_args`) with one faulty joiner, `name`,
/// with `fault` set in its environment, and `honest` more joiners (`h1`,
/// …): beside honest ones, the faulty one advertises itself fastest (300
/// us a layer against 1000), so the first plan takes it. Every member seen;
/// the coordinator's key file with them.
#[cfg(feature = "fault-injection")]
fn mesh_with_a_faulty_member(
    dir: &Path,
    model: &Path,
    coordinator_args: &[&str],
    (name, fault): (&str, (&str, &str)),
    honest: usize,
) -> (Running, PathBuf, Running, Vec<Running>) {
    let (coordinator, key) = mesh_coordinator(dir, model, coordinator_args);
    // With spares, the faulty member advertises itself far the fastest: a
    // layer of it costs 19.7 ms less than a spare's, more than any round
    // trip on a loaded loopback (a gap of 0.7 ms once lost to one), so the
    // first plan takes it whatever the pings measured.
    let speed: &[&str] = if honest > 0 {
        &["--decode-us-per-layer", "300"]
    } else {
        &[]
    };
    let args = join_args(dir, model, &coordinator.mesh, name, speed);
    let faulty = start_with_env(dir, name, &args, "127.0.0.1:0", &[fault]);
    let honest: Vec<Running> = (1..=honest)
        .map(|i| {
            let name = format!("h{i}");
            let slower = &["--decode-us-per-layer", "20000"];
            mesh_join(dir, model, &coordinator.mesh, &name, slower)
        })
        .collect();
    let members = honest.len() + 2;
    members_until(&coordinator.mesh, Duration::from_secs(30), |m| {
        m.len() == members
    });
    (coordinator, key, faulty, honest)
}

fn run_json(args: &[&str]) -> Value {
    let out = Command::new(bin()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "mesh-node {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The node ids `mesh status` lists.
fn members(bootstrap: &str) -> Vec<String> {
    run_json(&[
        "mesh",
        "status",
        "--bootstrap",
        bootstrap,
        "--no-mdns",
        "--wait-ms",
        "1500",
        "--json",
    ])
    .as_array()
    .unwrap()
    .iter()
    .map(|m| m["node_id"].as_str().unwrap().to_string())
    .collect()
}

/// `mesh status` that reached nobody says so in one line and exits 1
/// (a script can tell "no members" from "could not look").
#[test]
fn mesh_status_that_reaches_nobody_says_so_and_fails() {
    // A port nothing listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = format!(
        "/ip4/127.0.0.1/tcp/{port}/p2p/{}",
        mesh_protocol::identity::peer_id(&public(&key(77)))
    );
    let out = Command::new(bin())
        .args([
            "mesh",
            "status",
            "--bootstrap",
            &nobody,
            "--no-mdns",
            "--wait-ms",
            "1000",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(
        said.contains("reached no node in 1000 ms") && said.contains("connection refused"),
        "{said}"
    );
}

/// A node whose bootstrap nobody answers says so in one line, within 5 s
/// of listening, and goes on.
#[test]
fn a_join_whose_bootstrap_nobody_answers_says_so_within_five_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = format!(
        "/ip4/127.0.0.1/tcp/{port}/p2p/{}",
        mesh_protocol::identity::peer_id(&public(&key(78)))
    );
    let mut child = Command::new(bin())
        .args(join_args(
            dir.path(),
            &model,
            &nobody,
            "a",
            &[
                "--listen",
                "127.0.0.1:0",
                "--no-mdns",
                "--decode-us-per-layer",
                "100",
            ],
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    while !out
        .next()
        .expect("join prints its addresses")
        .unwrap()
        .starts_with("peer address: ")
    {}
    let listening = Instant::now();
    let (said, when) = {
        let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
        loop {
            let line = err.next().expect("join says why").unwrap();
            if line.starts_with("reached no bootstrap") {
                break (line, listening.elapsed());
            }
        }
    };
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(when <= Duration::from_secs(5), "said after {when:?}");
    assert!(
        said.contains(&nobody)
            && said.contains("connection refused")
            && said.contains("still trying"),
        "{said}"
    );
    assert!(still_running, "it goes on trying");
}

fn members_until(
    bootstrap: &str,
    bound: Duration,
    done: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    let start = Instant::now();
    loop {
        let seen = members(bootstrap);
        if done(&seen) {
            return seen;
        }
        assert!(
            start.elapsed() < bound,
            "the mesh did not settle within {bound:?}: {seen:?}"
        );
    }
}

/// `mesh-node plan` over the live mesh: each stage's (node id, layers).
fn plan(model: &Path, bootstrap: &str) -> Vec<(String, u64, u64)> {
    let report = run_json(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--bootstrap",
        bootstrap,
        "--no-mdns",
        "--stages",
        "4",
        "--wait-ms",
        "1500",
        "--json",
    ]);
    report["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["node_id"].as_str().unwrap().to_string(),
                s["layer_start"].as_u64().unwrap(),
                s["layer_end"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// `plan` as an observer sees it, once its view has every member (it hears
/// members over a few seconds): the plan, or the last one seen.
fn plan_until(
    model: &Path,
    bootstrap: &str,
    expected: &[(String, u64, u64)],
) -> Vec<(String, u64, u64)> {
    let start = Instant::now();
    loop {
        let seen = plan(model, bootstrap);
        if held(&seen) == held(expected) || start.elapsed() > Duration::from_secs(20) {
            return seen;
        }
    }
}

/// A chain as the cost model tells it: the coordinator's stage, then each
/// member with how many layers it holds. The members' order is the route
/// the planner takes by their round trips (docs/mesh.md "Planning"), and
/// round trips on a loaded loopback jitter by milliseconds: any order of
/// the same stages costs the same compute.
fn held(chain: &[(String, u64, u64)]) -> Vec<(String, u64)> {
    let mut members: Vec<(String, u64)> = chain
        .iter()
        .skip(1)
        .map(|(did, start, end)| (did.clone(), end - start))
        .collect();
    members.sort();
    chain
        .first()
        .map(|(did, start, end)| (did.clone(), end - start))
        .into_iter()
        .chain(members)
        .collect()
}

/// One greedy request through the coordinator; its bundle must verify.
/// The chain it ran on, from the coordinator's signed receipt block.
fn served(dir: &Path, coordinator: &str, name: &str) -> Vec<(String, u64, u64)> {
    let bundle = dir.join(format!("{name}.json"));
    let out = Command::new(bin())
        .args([
            "generate",
            "--coordinator",
            coordinator,
            "--prompt",
            "hello mesh",
        ])
        .args(["--max-tokens", "6", "--json", "--out"])
        .arg(&bundle)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "generate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verified = Command::new(bin())
        .args(["verify", "--json"])
        .arg(&bundle)
        .output()
        .unwrap();
    assert_eq!(
        verified.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&verified.stdout)
    );
    let bundle: Value = serde_json::from_slice(&std::fs::read(&bundle).unwrap()).unwrap();
    bundle["main_record"]["model_attestation"]["compute_attestation"]
        ["x-mesh-coordinator-receipt-v1"]["topology"]
        .as_array()
        .unwrap()
        .iter()
        .map(|stage| {
            let a = &stage["assignment"];
            (
                a["node_id"].as_str().unwrap().to_string(),
                a["layer_start"].as_u64().unwrap(),
                a["layer_end"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// MiB that hold `layers` layers (with their KV) and `extra`, but not one
/// more layer.
fn memory_mib(layer: u64, extra: u64, layers: u64) -> String {
    let mib = 1024 * 1024;
    let need = extra + layers * layer;
    let offered = need.div_ceil(mib);
    assert!(
        offered * mib < need + layer,
        "MiB steps too coarse for this model"
    );
    offered.to_string()
}

#[test]
fn nodes_join_through_a_bootstrap_and_the_plan_follows_them() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let handle = mesh_stage::ModelHandle::open(&model).unwrap();
    let shape = mesh_node::runtime::planner::model_shape(&handle);
    assert_eq!(shape.layer_bytes.len(), 6);
    assert!(shape.layer_bytes.iter().all(|b| *b == shape.layer_bytes[0]));
    let layer = shape.layer_bytes[0] + shape.kv_bytes_per_layer;

    // Advertised speeds far apart (10 ms a layer and more), so loopback
    // round trips (under 10 ms) cannot change who holds how many layers;
    // they may change the members' order (`held`).
    let coordinator_memory = memory_mib(layer, shape.head_bytes, 1);
    let (coordinator, coordinator_key) = mesh_coordinator(
        dir.path(),
        &model,
        &[
            "--stages",
            "4",
            "--decode-us-per-layer",
            "50000",
            "--memory-mib",
            &coordinator_memory,
        ],
    );
    let join = |name: &str, us: u64, layers: u64| {
        mesh_join(
            dir.path(),
            &model,
            &coordinator.mesh,
            name,
            &[
                "--decode-us-per-layer",
                &us.to_string(),
                "--memory-mib",
                &memory_mib(layer, 0, layers),
            ],
        )
    };
    // The small node is the fastest, but holds one layer: less than an
    // even share (6 layers over 4 stages).
    let small = join("small", 10_000, 1);
    let mut a = join("a", 20_000, 3);
    let b = join("b", 30_000, 3);
    // Far slower than b: the chain that would keep b in place after a
    // loss (d on a's three layers) is not within the re-plan margin of
    // the best one, whatever the loopback round trips under load.
    let d = join("d", 200_000, 3);
    let everyone = [&coordinator, &small, &a, &b, &d];
    let seen = members_until(&coordinator.mesh, Duration::from_secs(30), |m| m.len() == 5);
    for node in everyone {
        assert!(
            seen.contains(&node.did),
            "{} missing from {seen:?}",
            node.did
        );
    }

    // The cheapest chain: the coordinator's one layer, the small node's
    // one, then the faster of the rest as far as memory allows.
    let first = vec![
        (coordinator.did.clone(), 0, 1),
        (small.did.clone(), 1, 2),
        (a.did.clone(), 2, 5),
        (b.did.clone(), 5, 6),
    ];
    // What `plan` shows before anything runs, and what then ran.
    assert_eq!(
        held(&plan_until(&model, &coordinator.mesh, &first)),
        held(&first)
    );
    assert_eq!(
        held(&served(dir.path(), &coordinator.peer, "first")),
        held(&first)
    );

    // A stage node dies: it leaves the mesh within the bound, and the next
    // request runs on a new plan; no process is restarted.
    let killed = Instant::now();
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    members_until(&coordinator.mesh, Duration::from_secs(10), |m| {
        !m.contains(&a.did)
    });
    eprintln!("the killed node left the mesh after {:?}", killed.elapsed());
    assert!(killed.elapsed() < Duration::from_secs(10));
    let second = vec![
        (coordinator.did.clone(), 0, 1),
        (small.did.clone(), 1, 2),
        (b.did.clone(), 2, 5),
        (d.did.clone(), 5, 6),
    ];
    assert_eq!(
        held(&served(dir.path(), &coordinator.peer, "second")),
        held(&second)
    );

    // The same node again, with its key and data directory: it rejoins
    // and the next plan has it back.
    let a_again = join("a", 20_000, 3);
    assert_eq!(
        a_again.did, a.did,
        "the data directory keeps the node's key"
    );
    members_until(&coordinator.mesh, Duration::from_secs(30), |m| {
        m.contains(&a.did)
    });
    // The coordinator plans with it again once it has measured its round
    // trip (a member without one is not planned over).
    let start = Instant::now();
    loop {
        let ran = served(dir.path(), &coordinator.peer, "third");
        if held(&ran) == held(&first) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the rejoined node is not in the plan: {ran:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // The node this plan left out was told to free its slice.
    let start = Instant::now();
    loop {
        let stats = run_json(&[
            "stats",
            &d.peer,
            "--key",
            coordinator_key.to_str().unwrap(),
            "--json",
        ]);
        if stats["slices"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the left-out node still holds its slice: {stats:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let log = std::fs::read_to_string(dir.path().join("coord.log")).unwrap();
    let runs = log.matches("a new run: assigned every stage").count();
    assert_eq!(runs, 3, "one run per plan:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_replayed_adverts_are_refused_and_logged_once() {
    let loopback: libp2p::Multiaddr = "/ip4/127.0.0.1/tcp/0".parse().unwrap();
    let mut honest = MeshOptions::new(key(1));
    honest.listen = vec![loopback.clone()];
    honest.mdns = false;
    let honest = Mesh::start(honest).await.unwrap();
    let address = honest.wait_for_addresses(Duration::from_secs(5)).await;
    let rogue_key = key(2);
    let mut rogue = MeshOptions::new(rogue_key.clone());
    rogue.listen = vec![loopback];
    rogue.mdns = false;
    rogue.bootstrap = address;
    let rogue = Mesh::start(rogue).await.unwrap();

    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let advert = |seq: u64| Advert {
        node_id: public(&rogue_key),
        seq,
        issued_ms: now,
        ttl_ms: 30_000,
        quic: "127.0.0.1:9".into(),
        device: "cpu".into(),
        memory_bytes: 1 << 30,
        load: 0,
        via: None,
        rtts: Vec::new(),
        models: vec![AdvertModel {
            package_id: [9; 32],
            layers: 6,
            decode_us_per_layer: 100,
            precision: None,
            name: None,
        }],
    };
    // Gossipsub needs a heartbeat or two to know the honest node is
    // subscribed: publish the genuine advert until it is taken.
    let genuine = advert(10).sign(&rogue_key);
    let start = Instant::now();
    while !honest.is_member(&public(&rogue_key)) {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "no advert got through"
        );
        rogue.publish_raw(genuine.clone()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let refused_before = honest.refusals();
    // The same advert again, an older one, and three signed by another key
    // than the one they name.
    rogue.publish_raw(genuine.clone()).await.unwrap();
    rogue.publish_raw(advert(3).sign(&rogue_key)).await.unwrap();
    for seq in 20..23 {
        rogue.publish_raw(advert(seq).sign(&key(3))).await.unwrap();
    }
    let start = Instant::now();
    loop {
        let refused = honest.refusals();
        let count = |kind: &str| {
            refused.get(kind).copied().unwrap_or(0) - refused_before.get(kind).copied().unwrap_or(0)
        };
        if count("bad_signature") == 3 && count("replayed") >= 2 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "refusals seen: {refused:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Logged once per sender and kind, however many came.
    assert_eq!(honest.refusals_logged(), 2);
    // The member the forged adverts named still holds its genuine advert.
    let member = honest
        .members()
        .into_iter()
        .find(|m| m.advert.node_id == public(&rogue_key))
        .unwrap();
    assert_eq!(member.advert.seq, 10, "{}", did_key(&member.advert.node_id));
}

#[test]
fn plan_json_follows_the_cost_model_for_a_hand_computed_case() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let handle = mesh_stage::ModelHandle::open(&model).unwrap();
    let shape = mesh_node::runtime::planner::model_shape(&handle);
    let (weights, kv, head) = (
        shape.layer_bytes[0],
        shape.kv_bytes_per_layer,
        shape.head_bytes,
    );
    let layer = weights + kv;
    let [c, m1, m2] = [key(11), key(12), key(13)].map(|k| did_key(&public(&k)));
    // The coordinator holds its head and 2 layers at 300 us a layer; m1 is
    // fast (100 us) but holds 3 layers, 200 us away; m2 holds them all but
    // is slow (500 us), 400 us away.
    let members = serde_json::json!({
        "coordinator": c,
        "members": [
            { "node_id": c, "memory_bytes": head + 2 * layer, "decode_us_per_layer": 300, "rtt_us": 0 },
            { "node_id": m2, "memory_bytes": 6 * layer, "decode_us_per_layer": 500, "rtt_us": 400 },
            { "node_id": m1, "memory_bytes": 3 * layer, "decode_us_per_layer": 100, "rtt_us": 200 },
        ],
    });
    let file = dir.path().join("members.json");
    std::fs::write(&file, members.to_string()).unwrap();
    let plan = run_json(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--members",
        file.to_str().unwrap(),
        "--json",
    ]);
    // By hand, with a hop costing half its round trip plus 500 us:
    //   coordinator 0..2: 2 x 300 = 600 us
    //   m1 2..5: 3 x 100 = 300 us, hop 100 + 500 = 600 us
    //   m2 5..6: 1 x 500 = 500 us, hop 200 + 500 = 700 us
    //   m2's answer back to the coordinator: 200 us
    //   projected 600 + 300 + 500 + 600 + 700 + 200 = 2900 us.
    // Next best: 0..1, 1..4, 4..6 costs 300 + 300 + 1000 + 1300 + 200 =
    // 3100; two stages (0..2 and m2 2..6) 600 + 2000 + 700 + 200 = 3500.
    assert_eq!(plan["per_hop_overhead_us"], 500);
    let expected = [
        (&c, 0, 2, 600, 0, weights * 2 + head, kv * 2),
        (&m1, 2, 5, 300, 600, weights * 3, kv * 3),
        (&m2, 5, 6, 500, 700, weights, kv),
    ];
    let stages = plan["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 3, "{plan:#}");
    for (stage, (node, start, end, compute, hop, weight_bytes, kv_bytes)) in
        stages.iter().zip(expected)
    {
        assert_eq!(stage["node_id"], *node);
        assert_eq!(stage["layer_start"], start);
        assert_eq!(stage["layer_end"], end);
        assert_eq!(stage["compute_us"], compute);
        assert_eq!(stage["hop_us"], hop);
        assert_eq!(stage["weight_bytes"], weight_bytes);
        assert_eq!(stage["kv_bytes"], kv_bytes);
    }
    assert_eq!(plan["return_us"], 200);
    assert_eq!(plan["projected_us_per_token"], 2900);
    assert_eq!(plan["left_out"], serde_json::json!([]));
}

#[test]
fn a_node_is_one_port_number_quic_on_udp_and_the_mesh_on_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let mut child = Command::new(bin())
        .args(["join", "--model"])
        .arg(&model)
        .arg("--data")
        .arg(dir.path().join("a"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--no-mdns",
            "--decode-us-per-layer",
            "100",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut mesh, mut quic) = (None, None);
    while quic.is_none() {
        let line = lines.next().expect("join prints its addresses").unwrap();
        if let Some(address) = line.strip_prefix("mesh address: ") {
            mesh = Some(address.to_string());
        }
        if let Some(peer) = line.strip_prefix("peer address: ") {
            quic = peer.rsplit_once(':').map(|(_, port)| port.to_string());
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let (mesh, port) = (mesh.expect("a mesh address"), quic.unwrap());
    assert!(
        mesh.starts_with(&format!("/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooW")),
        "{mesh} is not on the QUIC port {port}"
    );
}

#[test]
fn requests_through_a_churning_mesh_complete_or_fail_clearly_and_leak_nothing() {
    let seed = std::env::var("MESH_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("chaos seed {seed} (replay with MESH_CHAOS_SEED={seed})");
    let mut chaos = mesh_stage::sampling::SplitMix64::new(seed);
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (coordinator, coordinator_key) = mesh_coordinator(
        dir.path(),
        &model,
        &["--stages", "2", "--step-timeout-ms", "5000"],
    );
    let join = |name: &str| {
        mesh_join(
            dir.path(),
            &model,
            &coordinator.mesh,
            name,
            &["--decode-us-per-layer", "1000"],
        )
    };
    let names = ["j0", "j1", "j2"];
    let mut nodes: Vec<Option<Running>> = names.iter().map(|n| Some(join(n))).collect();
    members_until(&coordinator.mesh, Duration::from_secs(30), |m| m.len() == 4);

    let ask = |name: &str| -> (bool, Value, String, Duration) {
        let started = Instant::now();
        let out = Command::new(bin())
            .args([
                "generate",
                "--coordinator",
                &coordinator.peer,
                "--prompt",
                "hello mesh",
            ])
            .args([
                "--max-tokens",
                "24",
                "--timeout-ms",
                "20000",
                "--json",
                "--out",
            ])
            .arg(dir.path().join(format!("{name}.json")))
            .output()
            .unwrap();
        let summary = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (
            out.status.success(),
            summary,
            String::from_utf8_lossy(&out.stderr).into_owned(),
            started.elapsed(),
        )
    };
    let (ok, reference, stderr, _) = ask("reference");
    assert!(ok, "{stderr}");
    assert_eq!(reference["terminal_state"], "completed");
    let reference = reference["text"].as_str().unwrap().to_string();

    let (mut completed, mut failed) = (0, 0);
    for i in 0..30 {
        // Between requests: kill a live stage node (keeping one) or bring
        // a dead one back.
        let alive: Vec<usize> = (0..nodes.len()).filter(|k| nodes[*k].is_some()).collect();
        let dead: Vec<usize> = (0..nodes.len()).filter(|k| nodes[*k].is_none()).collect();
        match chaos.below(4) {
            0 if alive.len() > 1 => {
                let k = alive[chaos.below(alive.len() as u64) as usize];
                nodes[k] = None;
            }
            1 if !dead.is_empty() => {
                let k = dead[chaos.below(dead.len() as u64) as usize];
                nodes[k] = Some(join(names[k]));
            }
            _ => {}
        }
        // During the request, sometimes: kill a node after a random delay.
        let victim = (chaos.below(3) == 0)
            .then(|| {
                let alive: Vec<usize> = (0..nodes.len()).filter(|k| nodes[*k].is_some()).collect();
                (alive.len() > 1).then(|| alive[chaos.below(alive.len() as u64) as usize])
            })
            .flatten();
        let delay = Duration::from_millis(chaos.below(400));
        let killer = victim.map(|k| {
            let pid = nodes[k].as_ref().unwrap().child.id();
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            })
        });
        let (ok, summary, stderr, took) = ask(&format!("request-{i}"));
        if let Some(killer) = killer {
            killer.join().unwrap();
        }
        if let Some(k) = victim {
            nodes[k] = None;
        }
        // No request hangs: the request's own deadline bounds it.
        assert!(
            took < Duration::from_secs(30),
            "request {i} took {took:?} (seed {seed})"
        );
        if ok && summary["terminal_state"] == "completed" {
            assert_eq!(
                summary["text"],
                reference.as_str(),
                "request {i} (seed {seed})"
            );
            completed += 1;
        } else {
            let said = format!("{}{}", summary["error"].as_str().unwrap_or(""), stderr);
            assert!(
                !said.trim().is_empty(),
                "request {i} failed without saying why (seed {seed})"
            );
            eprintln!("request {i} failed after {took:?}: {}", said.trim());
            if std::env::var_os("MESH_CHAOS_DEBUG").is_some() {
                let log = std::fs::read_to_string(dir.path().join("coord.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(12).collect();
                eprintln!(
                    "coordinator log, last lines:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            // What it did serve is still evidence the verifier reads: the
            // loss shows, nothing breaks the reading.
            let bundle = dir.path().join(format!("request-{i}.json"));
            if bundle.exists() {
                let verified = Command::new(bin())
                    .args(["verify", "--json"])
                    .arg(&bundle)
                    .output()
                    .unwrap();
                let report: Value = serde_json::from_slice(&verified.stdout).unwrap();
                assert_eq!(verified.status.code(), Some(1), "request {i}: {report:#}");
                assert_ne!(report["terminal_state"], "completed", "request {i}");
            }
            failed += 1;
        }
    }
    eprintln!("{completed} completed, {failed} failed clearly (seed {seed})");
    assert!(completed > 0, "no request completed (seed {seed})");

    // Afterwards nothing is held: every pool at the coordinator is empty.
    let start = Instant::now();
    loop {
        let stats = run_json(&[
            "stats",
            &coordinator.peer,
            "--key",
            coordinator_key.to_str().unwrap(),
            "--json",
        ]);
        let empty = [
            "caches_open",
            "records_pending",
            "direct_waiters",
            "grant_decisions_waiting",
        ]
        .iter()
        .all(|pool| stats[*pool] == 0);
        if empty {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "pools not empty after the chaos (seed {seed}): {stats:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_member_that_refuses_its_assignment_is_planned_around_within_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (coordinator, _) = mesh_coordinator(dir.path(), &model, &["--stages", "2"]);
    // The fastest member serves only another coordinator: it is planned in
    // first, refuses, and the same request goes on over the other member.
    let other = common::processes::node_id(dir.path(), "someone-else");
    let refusing = mesh_join(
        dir.path(),
        &model,
        &coordinator.mesh,
        "refusing",
        &["--decode-us-per-layer", "1000", "--coordinator", &other],
    );
    let willing = mesh_join(
        dir.path(),
        &model,
        &coordinator.mesh,
        "willing",
        &["--decode-us-per-layer", "50000"],
    );
    members_until(&coordinator.mesh, Duration::from_secs(30), |m| m.len() == 3);
    let ran = served(dir.path(), &coordinator.peer, "around");
    assert_eq!(ran.len(), 2);
    assert_eq!(ran[1].0, willing.did, "ran on {ran:?}");
    let log = std::fs::read_to_string(dir.path().join("coord.log")).unwrap();
    assert!(log.contains("planning again"), "{log}");
    assert!(log.contains(&refusing.did), "{log}");
}

/// Low (issue 37): a request that arrives while the members its plan needs
/// are still joining (as while a restarted coordinator's members reconnect)
/// waits for the mesh within its deadline, planning again as members come,
/// instead of being refused after a few quick tries.
#[test]
fn a_request_waits_for_the_members_its_plan_needs() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (coordinator, _) = mesh_coordinator(dir.path(), &model, &["--stages", "3"]);
    let _first = mesh_join(
        dir.path(),
        &model,
        &coordinator.mesh,
        "j0",
        &["--decode-us-per-layer", "1000"],
    );
    members_until(&coordinator.mesh, Duration::from_secs(30), |m| m.len() == 2);
    // Three stages need a third member, which joins 7 s after the request.
    let asking = {
        let (dir, peer) = (dir.path().to_path_buf(), coordinator.peer.clone());
        std::thread::spawn(move || served(&dir, &peer, "waited"))
    };
    std::thread::sleep(Duration::from_secs(7));
    let _second = mesh_join(
        dir.path(),
        &model,
        &coordinator.mesh,
        "j1",
        &["--decode-us-per-layer", "1000"],
    );
    let chain = asking.join().expect("the request was served");
    assert_eq!(chain.len(), 3, "{chain:?}");
}

/// M1 (issue 37): raw TCP connections to the mesh port that never
/// handshake cannot keep members out. 32 held from one address take at
/// most `MAX_PENDING_PER_ADDRESS` of the handshake slots (the rest are
/// closed at once), each for at most `HANDSHAKE_TIMEOUT`, so a new member
/// still joins and `mesh status` still reaches the mesh.
/// Addresses people can type: a node joins through a plain HOST:PORT
/// (the node id learned in the handshake), and `mesh status` looks
/// through one.
#[test]
fn a_node_joins_through_a_plain_host_and_port() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (coordinator, _) = mesh_coordinator(dir.path(), &model, &[]);
    let port = coordinator
        .mesh
        .split('/')
        .skip_while(|part| *part != "tcp")
        .nth(1)
        .expect("a TCP mesh address")
        .to_string();
    let plain = format!("127.0.0.1:{port}");
    let joined = mesh_join(dir.path(), &model, &plain, "b", &[]);
    let seen = members_until(&plain, Duration::from_secs(30), |seen| seen.len() == 2);
    assert!(
        seen.contains(&joined.did) && seen.contains(&coordinator.did),
        "{seen:?}"
    );
    // Each member names its model as people call it, and what it runs it at.
    let status = run_json(&[
        "mesh",
        "status",
        "--bootstrap",
        &plain,
        "--no-mdns",
        "--wait-ms",
        "1500",
        "--json",
    ]);
    let stem = model.file_stem().unwrap().to_str().unwrap();
    for member in status.as_array().unwrap() {
        assert_eq!(member["models"][0]["name"], stem, "{status:#}");
        assert!(
            member["models"][0]["precision"]
                .as_str()
                .unwrap()
                .ends_with("device cpu; wire f32"),
            "{status:#}"
        );
    }
    let log = std::fs::read_to_string(dir.path().join("b.log")).unwrap();
    assert!(
        log.contains(&format!(
            "bootstrap /ip4/127.0.0.1/tcp/{port} is {}",
            coordinator.mesh
        )),
        "the node id learned is printed: {log}"
    );
}

#[test]
fn raw_connections_that_never_handshake_do_not_keep_members_out() {
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let (coordinator, _) = mesh_coordinator(dir.path(), &model, &[]);
    let port: u16 = coordinator
        .mesh
        .split('/')
        .skip_while(|part| *part != "tcp")
        .nth(1)
        .and_then(|port| port.parse().ok())
        .expect("a TCP mesh address");
    let target = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let stranger = std::net::IpAddr::from([127, 0, 0, 9]);
    // 32 raw connections, each opened again as soon as it is closed.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let holder = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut held: Vec<std::net::TcpStream> = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                held.retain(|stream| {
                    let _ = stream.set_nonblocking(true);
                    match stream.peek(&mut [0u8; 1]) {
                        Ok(0) => false,
                        Ok(_) => true,
                        Err(error) => error.kind() == std::io::ErrorKind::WouldBlock,
                    }
                });
                while held.len() < 32 {
                    match common::http::connect_from(stranger, target) {
                        Ok(stream) => held.push(stream),
                        Err(_) => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    let joiner = mesh_join(
        dir.path(),
        &model,
        &coordinator.mesh,
        "joiner",
        &["--decode-us-per-layer", "1000"],
    );
    let seen = members_until(&coordinator.mesh, Duration::from_secs(30), |m| {
        m.contains(&joiner.did)
    });
    assert!(seen.contains(&coordinator.did), "{seen:?}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    holder.join().unwrap();
}

/// A coordinator pinned to three stages over a mesh of three joiners (one
/// spare once a chain is planned), every member seen.
fn three_stages_and_a_spare(dir: &Path, extra: &[&str]) -> (Running, Vec<Running>, PathBuf) {
    let model = synthetic(dir);
    let args: Vec<&str> = ["--stages", "3"].iter().chain(extra).copied().collect();
    let (coordinator, _) = mesh_coordinator(dir, &model, &args);
    let nodes: Vec<Running> = ["j0", "j1", "j2"]
        .iter()
        .map(|name| {
            mesh_join(
                dir,
                &model,
                &coordinator.mesh,
                name,
                &["--decode-us-per-layer", "1000"],
            )
        })
        .collect();
    members_until(&coordinator.mesh, Duration::from_secs(30), |m| m.len() == 4);
    (coordinator, nodes, model)
}

/// `request` through `address`, SIGKILLing process `victim` when the
/// `at`-th token arrives; what the request gave, and when the kill was.
async fn generate_killing(
    address: &mesh_node::runtime::serve::PeerAddr,
    request: &mesh_node::runtime::serve::GenerateRequest,
    victim: u32,
    at: usize,
) -> (mesh_node::runtime::serve::GenerateSummary, Instant) {
    let mut seen = 0;
    let mut killed_at = None;
    let summary = mesh_node::runtime::serve::generate_remote(address, request, &mut |_| {
        seen += 1;
        if seen == at {
            Command::new("kill")
                .args(["-9", &victim.to_string()])
                .status()
                .unwrap();
            killed_at = Some(Instant::now());
        }
    })
    .await
    .unwrap();
    (
        summary,
        killed_at.expect("the request reached the token of the kill"),
    )
}

/// The chain a request ran on, stage 0 first, from its bundle's stewards.
fn chain_of(summary: &mesh_node::runtime::serve::GenerateSummary) -> Vec<String> {
    summary.bundle.as_ref().unwrap()["stewards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["node_id"].as_str().unwrap().to_string())
        .collect()
}

/// Issue 11's own test: a stage SIGKILLed after the 10th token of a
/// 64-token greedy request costs a pause, not the answer. The request goes
/// on over a new chain (the spare member takes the lost range), its tokens
/// equal an uninterrupted run's, and its bundle verifies with both segments
/// shown, the loss declared in the receipt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_killed_mid_request_costs_a_pause_not_the_answer() {
    a_stage_killed_mid_request("hello mesh", &[], 1).await;
}

/// R1 (issue 37): the final stage SIGKILLed mid-request. The first resume
/// keeps only the coordinator's cache (every remote stage rebuilds, the
/// new final stage silently through the replay) and is not refused, so the
/// request goes on at once with its reference tokens, and its bundle
/// verifies with exit 0: two segments, no empty failed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_final_stage_mid_request_resumes_and_verifies() {
    a_stage_killed_mid_request("hello mesh", &[], 2).await;
}

/// The same with the coordinator drafting (prompt lookup, on a prompt the
/// synthetic model's answer repeats): the kill comes between steps that
/// carry drafts, some rejected, and the kept caches are cut back to the
/// request's own positions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drafting_request_resumes_with_its_greedy_tokens() {
    let resumed =
        a_stage_killed_mid_request("say 3333Q999999 3333Q999999", &["--draft-tokens", "4"], 1)
            .await;
    let proposed = resumed.details["spec_proposed"].as_u64().unwrap();
    let accepted = resumed.details["spec_accepted"].as_u64().unwrap();
    assert!(
        proposed > accepted && accepted > 0,
        "{proposed} drafted, {accepted} accepted"
    );
}

/// `prompt` through a three-stage chain over a mesh with a spare, stage
/// `victim` of the chain SIGKILLed at the 10th token.
async fn a_stage_killed_mid_request(
    prompt: &str,
    coordinator_args: &[&str],
    victim_stage: usize,
) -> mesh_node::runtime::serve::GenerateSummary {
    use mesh_node::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};
    let dir = tempfile::tempdir().unwrap();
    let (coordinator, nodes, _) = three_stages_and_a_spare(dir.path(), coordinator_args);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let request = GenerateRequest::greedy(prompt, 64);

    let reference = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(
        reference.terminal_state, "completed",
        "{:?}",
        reference.error
    );
    let reference_tokens = reference.details["token_ids"].clone();
    assert!(
        reference_tokens.as_array().unwrap().len() >= 20,
        "the reference must run well past the 10th token: {reference_tokens}"
    );
    let chain = chain_of(&reference);
    assert_eq!(chain.len(), 3);
    let victim = nodes.iter().find(|n| n.did == chain[victim_stage]).unwrap();
    let victim_pid = victim.child.id();

    let (resumed, killed_at) = generate_killing(&address, &request, victim_pid, 10).await;
    eprintln!(
        "resumed request ended {:?} after the kill: {}",
        killed_at.elapsed(),
        resumed.details["resumes"]
    );
    assert_eq!(
        resumed.terminal_state,
        "completed",
        "{:?}\n{}",
        resumed.error,
        std::fs::read_to_string(dir.path().join("coord.log")).unwrap_or_default()
    );
    assert_eq!(resumed.details["token_ids"], reference_tokens);
    assert_eq!(resumed.text, reference.text);

    let bundle = resumed.bundle.clone().unwrap();
    let earlier = bundle["earlier_segments"].as_array().unwrap();
    assert_eq!(earlier.len(), 1, "one loss, two segments");
    // Each segment's main record is proven in the coordinator's log on its
    // own (the verifier checks the proof with the rest of the segment).
    assert!(
        earlier[0]["inclusion"].is_object() && earlier[0]["checkpoint"].is_object(),
        "{:#}",
        earlier[0]
    );
    // Mesh-LLM's form cannot hold the segments: refused in one line, never
    // written as an ordinary completed split.
    let refused = mesh_node::cli::node_cli::as_record_push_bundle(&bundle).unwrap_err();
    assert!(
        refused.to_string().contains("resumed on a new chain")
            && !refused.to_string().contains('\n'),
        "{refused:#}"
    );
    let (code, report) = verify_saved(dir.path(), "resumed.json", &bundle);
    assert_eq!(code, Some(0), "{report:#}");
    let segments = report["resumed"]["segments"].as_array().unwrap();
    assert_eq!(segments.len(), 2);
    assert_eq!(segments[0]["lost"], serde_json::json!([victim.did]));
    assert_eq!(segments[0]["nodes"][victim_stage], victim.did.as_str());
    let resumed_at = segments[1]["first_token"].as_u64().unwrap();
    assert!(resumed_at >= 10, "resumed at token {resumed_at}");
    // The coordinator (and, when the middle stage was lost, the final
    // stage) kept the layers and caches they had: only the stages from the
    // lost one on rebuilt theirs, from the prompt and every token but the
    // last (which ran as a decode step through the chain).
    let kept: Vec<&String> = std::iter::once(&chain[0])
        .chain(chain[victim_stage + 1..].iter())
        .collect();
    assert_eq!(segments[1]["kept"], serde_json::json!(kept), "{report:#}");
    assert_eq!(
        segments[1]["prefilled"].as_u64().unwrap(),
        segments[0]["prefilled"].as_u64().unwrap() + resumed_at - 1,
        "the spare replayed the prompt and every token but the last"
    );
    assert!(
        !segments[1]["nodes"]
            .as_array()
            .unwrap()
            .contains(&Value::from(victim.did.as_str()))
    );
    assert_eq!(report["earlier_segments"][0]["ok"], true, "{report:#}");
    assert!(
        report["earlier_segments"][0]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .any(
                |c| c["property"] == "MMR inclusion proof under the checkpoint root"
                    && c["ok"] == true
            ),
        "{report:#}"
    );
    assert_eq!(report["terminal_state"], "completed");
    // Shown one after the other, the loss visible.
    let shown = Command::new(bin())
        .arg("verify")
        .arg(dir.path().join("resumed.json"))
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("Segment 0 of 2"), "{shown}");
    assert!(shown.contains("Segment 1 of 2"), "{shown}");
    assert!(shown.contains(&format!("lost {}", victim.did)), "{shown}");
    assert!(shown.contains("not received"), "{shown}");
    let kept: Vec<&str> = kept.iter().map(|k| k.as_str()).collect();
    assert!(
        shown.contains(&format!("caches kept by {}", kept.join(", "))),
        "{shown}"
    );
    resumed
}

/// A resume with no chain left to plan ends the request with an error
/// naming the loss, never a hang: here the middle stage and the spare are
/// both killed, so no three-stage chain is left. The resume waits 1 s for
/// members (`RESUME_SETTLE_WAIT`), so it says so before the request's 4 s
/// deadline (`transport_error`); on a machine too slow for that, the
/// deadline ends it first (`timed_out`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_with_no_chain_left_ends_with_the_loss_named_not_in_a_hang() {
    use mesh_node::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};
    let dir = tempfile::tempdir().unwrap();
    let (coordinator, nodes, _) = three_stages_and_a_spare(dir.path(), &[]);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let warm = generate_remote(
        &address,
        &GenerateRequest::greedy("hello mesh", 4),
        &mut |_| {},
    )
    .await
    .unwrap();
    let chain = chain_of(&warm);
    let victims: Vec<u32> = nodes
        .iter()
        .filter(|n| n.did == chain[1] || !chain.contains(&n.did))
        .map(|n| n.child.id())
        .collect();
    assert_eq!(victims.len(), 2);

    let timeout = Duration::from_secs(4);
    let request = GenerateRequest {
        timeout: Some(timeout),
        ..GenerateRequest::greedy("hello mesh", 64)
    };
    let started = Instant::now();
    let mut seen = 0;
    let summary = generate_remote(&address, &request, &mut |_| {
        seen += 1;
        if seen == 10 {
            for pid in &victims {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    })
    .await
    .unwrap();
    let took = started.elapsed();
    assert!(
        ["transport_error", "timed_out"].contains(&summary.terminal_state.as_str()),
        "{}: {:?}",
        summary.terminal_state,
        summary.error
    );
    let error = summary.error.unwrap_or_default();
    assert!(error.contains("could not resume"), "{error}");
    assert!(error.contains(&chain[1]), "the lost node is named: {error}");
    assert!(took < timeout + Duration::from_secs(8), "took {took:?}");
}

/// A stage that comes back at its old address under another key is a new
/// member, never the old one: the old node id at that address is refused
/// by the TLS pin, the next request's chain does not name the old id, and
/// the records of whoever served verify under their own keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_back_at_its_address_with_another_key_is_not_trusted_as_the_old_one() {
    use mesh_node::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};
    let dir = tempfile::tempdir().unwrap();
    let (coordinator, mut nodes, model) = three_stages_and_a_spare(dir.path(), &[]);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let request = GenerateRequest::greedy("hello mesh", 4);
    let warm = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    let chain = chain_of(&warm);
    let old = nodes.remove(nodes.iter().position(|n| n.did == chain[1]).unwrap());
    let (old_did, old_peer) = (old.did.clone(), old.peer.clone());
    let old_addr = old_peer.parse::<PeerAddr>().unwrap().addr.to_string();
    drop(old);
    let impostor = start_at(
        dir.path(),
        "impostor",
        &join_args(
            dir.path(),
            &model,
            &coordinator.mesh,
            "impostor",
            &["--decode-us-per-layer", "1000"],
        ),
        &old_addr,
    );
    assert_ne!(impostor.did, old_did);
    assert!(impostor.peer.ends_with(&old_addr), "{}", impostor.peer);

    // Asked for by the old id, the node at that address cannot prove it.
    let key = common::processes::keygen(dir.path(), "asker");
    let asked = Command::new(bin())
        .args(["stats", &old_peer, "--key", key.to_str().unwrap()])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&asked.stderr);
    assert!(
        !asked.status.success(),
        "the old id answered at its address"
    );
    assert!(said.contains(&format!("peer is not {old_did}")), "{said}");

    members_until(&coordinator.mesh, Duration::from_secs(30), |m| {
        m.contains(&impostor.did) && !m.contains(&old_did)
    });
    let after = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(after.terminal_state, "completed", "{:?}", after.error);
    let chain = chain_of(&after);
    assert!(!chain.contains(&old_did), "{chain:?}");
    let saved = dir.path().join("after.json");
    std::fs::write(&saved, serde_json::to_vec(&after.bundle.unwrap()).unwrap()).unwrap();
    let verified = Command::new(bin())
        .args(["verify", "--json"])
        .arg(&saved)
        .output()
        .unwrap();
    assert_eq!(
        verified.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&verified.stdout)
    );
}

/// With the relayed return a killed stage is noticed through the mesh too
/// (not at QUIC's idle timeout), and the request resumes with the tokens of
/// an uninterrupted run; every stage rebuilds its cache, since each step's
/// reply comes back through every stage and none can leave the replay out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_chain_resumes_too_and_rebuilds_every_cache() {
    use mesh_node::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};
    let dir = tempfile::tempdir().unwrap();
    let (coordinator, nodes, _) =
        three_stages_and_a_spare(dir.path(), &["--return-mode", "relayed"]);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let request = GenerateRequest::greedy("hello mesh", 24);
    let reference = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(
        reference.terminal_state, "completed",
        "{:?}",
        reference.error
    );
    assert!(reference.details["token_ids"].as_array().unwrap().len() >= 12);
    let chain = chain_of(&reference);
    let victim = nodes.iter().find(|n| n.did == chain[1]).unwrap();
    let victim_pid = victim.child.id();
    let (resumed, _) = generate_killing(&address, &request, victim_pid, 6).await;
    assert_eq!(resumed.terminal_state, "completed", "{:?}", resumed.error);
    assert_eq!(resumed.details["token_ids"], reference.details["token_ids"]);
    let resumes = resumed.details["resumes"].as_array().unwrap();
    assert_eq!(resumes.len(), 1, "{resumes:?}");
    assert_eq!(resumes[0]["lost"], serde_json::json!([victim.did]));
    assert_eq!(resumes[0]["kept"], serde_json::json!([]));
}

/// Issue 41: a stage that computes wrongly (its every output nudged, as
/// altered weights would; each hop still agrees) is caught by the first
/// audit (`--audit-rate 1`), named, and planned out: the next request runs
/// on the spare, and its audit passes. The dishonest node advertises
/// itself as the fastest, so the first plan takes it.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_that_computes_wrongly_is_caught_by_an_audit_and_planned_out() {
    use mesh_node::runtime::serve::{
        GenerateRequest, PeerAddr, generate_remote, node_stats_remote,
    };
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let tapes = dir.path().join("tapes");
    let args = [
        "--stages",
        "3",
        "--audit-rate",
        "1",
        "--audit-tapes",
        tapes.to_str().unwrap(),
    ];
    let fault = ("liar", ("MESH_FAULT_WRONG_OUTPUT", "1"));
    let (coordinator, key, dishonest, honest) =
        mesh_with_a_faulty_member(dir.path(), &model, &args, fault, 2);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let key = mesh_node::runtime::keys::load(&key).unwrap();
    let audits = || async {
        let stats = node_stats_remote(&key, &address).await.unwrap();
        (
            stats.audits_passed,
            stats.audits_failed,
            stats.audits_unconcluded,
        )
    };
    let request = GenerateRequest::greedy("who audits the auditors", 8);

    let first = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(first.terminal_state, "completed", "{:?}", first.error);
    let chain = chain_of(&first);
    let liar_at = chain.iter().position(|d| *d == dishonest.did);
    let liar_at = liar_at.unwrap_or_else(|| {
        let log = std::fs::read_to_string(dir.path().join("coord.log")).unwrap_or_default();
        panic!("the fastest is planned in: {chain:?}\n{log}")
    });
    // The bundle carries the coordinator's signed verdict: `verify` fails
    // it and names the stage.
    let bundle = first.bundle.clone().unwrap();
    let audit = &bundle["audit"]["statement"];
    let verdicts: Vec<&str> = audit["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["verdict"].as_str().unwrap())
        .collect();
    let mut expected = vec!["passed"; liar_at - 1];
    expected.push("failed");
    expected.resize(2, "not_reached");
    assert_eq!(verdicts, expected, "{audit:#}");
    let (code, report) = verify_saved(dir.path(), "audited.json", &bundle);
    assert_eq!(code, Some(1), "{report:#}");
    let said = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["ok"] == false)
        .map(|c| c["error"].as_str().unwrap().to_string())
        .unwrap();
    assert!(
        said.contains("computed wrongly") && said.contains(&dishonest.did),
        "{said}"
    );
    // Every hop agreed: only the audit tells.
    assert!(
        report["lanes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|lane| lane["state"] != "break"),
        "{report:#}"
    );
    // With the tape the coordinator kept, anyone holding the model finds
    // the same stage offline.
    let replay_tape = |summary: &mesh_node::runtime::serve::GenerateSummary, name: &str| {
        let saved = dir.path().join(name);
        std::fs::write(&saved, serde_json::to_vec(&summary.bundle).unwrap()).unwrap();
        let id = summary.details["request_id"].as_str().unwrap();
        let out = Command::new(bin())
            .args(["replay", "--json", "--model"])
            .arg(&model)
            .arg("--tape")
            .arg(tapes.join(format!("{id}.tape")))
            .arg(&saved)
            .output()
            .unwrap();
        let said: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
        (out.status.code(), said)
    };
    let (code, said) = replay_tape(&first, "first.json");
    assert_eq!(code, Some(1), "{said:#}");
    assert_eq!(said["diverged_stage"], liar_at, "{said:#}");
    assert_eq!(said["node_id"], dishonest.did.as_str(), "{said:#}");
    let since = Instant::now();
    while audits().await != (0, 1, 0) {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "no failed audit: {:?}",
            audits().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = std::fs::read_to_string(dir.path().join("coord.log")).unwrap();
    let named = log
        .lines()
        .find(|l| l.contains("computed wrongly") && l.contains(&dishonest.did));
    eprintln!("{named:?}");
    assert!(named.is_some(), "the log names the stage: {log}");

    let second = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(second.terminal_state, "completed", "{:?}", second.error);
    let chain = chain_of(&second);
    assert!(!chain.contains(&dishonest.did), "planned out: {chain:?}");
    assert!(honest.iter().all(|h| chain.contains(&h.did)), "{chain:?}");
    let (code, said) = replay_tape(&second, "second.json");
    assert_eq!(code, Some(0), "{said:#}");
    assert_eq!(said["verdict"], "agreed");
    let since = Instant::now();
    while audits().await != (1, 1, 0) {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "{:?}",
            audits().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 41: how many requests it takes to catch a stage that is always
/// wrong, at an audit rate `p`. Each request is audited with probability
/// `p`, so the requests up to a detection are geometric: `1 / p` on
/// average (4 at p = 0.25), and within `n` with probability
/// `1 - (1 - p)^n`. With no pause after a failure (`--audit-pause-s 0`)
/// the liar stays in every plan, so one mesh gives 20 detections in a row;
/// their mean must be near `1 / p` (the bound is five standard deviations
/// of a mean of 20).
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_liar_is_caught_within_the_requests_the_audit_rate_predicts() {
    use mesh_node::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};
    const RATE: f64 = 0.25;
    const DETECTIONS: usize = 20;
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let args = [
        "--stages",
        "2",
        "--audit-rate",
        "0.25",
        "--audit-pause-s",
        "0",
    ];
    let fault = ("liar", ("MESH_FAULT_WRONG_OUTPUT", "1"));
    let (coordinator, _, _liar, _) = mesh_with_a_faulty_member(dir.path(), &model, &args, fault, 0);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let request = GenerateRequest::greedy("count the requests", 4);
    let mut counts = Vec::new();
    let mut since_last = 0;
    let mut sent = 0;
    while counts.len() < DETECTIONS {
        sent += 1;
        assert!(sent < 2_000, "{counts:?}");
        let summary = generate_remote(&address, &request, &mut |_| {})
            .await
            .unwrap();
        assert_eq!(summary.terminal_state, "completed", "{:?}", summary.error);
        since_last += 1;
        let bundle = summary.bundle.unwrap();
        if let Some(audit) = bundle.get("audit") {
            let verdict = &audit["statement"]["stages"][0]["verdict"];
            assert_eq!(verdict, "failed", "{audit:#}");
            counts.push(since_last);
            since_last = 0;
        }
    }
    let mean = counts.iter().sum::<usize>() as f64 / DETECTIONS as f64;
    let expected = 1.0 / RATE;
    let sd_of_mean = (1.0 - RATE).sqrt() / RATE / (DETECTIONS as f64).sqrt();
    eprintln!(
        "requests to each detection at rate {RATE}: {counts:?}; mean {mean:.2}, expected {expected:.2} (sd of the mean {sd_of_mean:.2})"
    );
    assert!(
        (mean - expected).abs() < 5.0 * sd_of_mean,
        "mean {mean} against {expected}: {counts:?}"
    );
}

/// Issue 41: a stage that accepts a step and then stalls is planned out
/// after its first stall. The chain times out on the step (2 s), the
/// coordinator names the stage still inside the request once those before
/// it ended theirs, counts it lost and resumes without it: the request
/// completes with its greedy tokens, its bundle verifies (the staller is
/// the segment's declared loss), and the next request is planned around
/// it. The staller advertises itself as the fastest, so the first plan
/// takes it.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_that_stalls_is_planned_out_after_its_first_stall() {
    use mesh_node::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let args = [
        "--stages",
        "3",
        "--step-timeout-ms",
        "2000",
        "--audit-rate",
        "0",
    ];
    let fault = ("staller", ("MESH_FAULT_STALL", "1"));
    let (coordinator, _, staller, _honest) =
        mesh_with_a_faulty_member(dir.path(), &model, &args, fault, 2);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let request = GenerateRequest::greedy("who waits for the slow one", 8);

    let first = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    let log = || std::fs::read_to_string(dir.path().join("coord.log")).unwrap_or_default();
    assert_eq!(
        first.terminal_state,
        "completed",
        "{:?}\n{}",
        first.error,
        log()
    );
    let resumes = first.details["resumes"].as_array().unwrap();
    assert_eq!(resumes.len(), 1, "{resumes:?}\n{}", log());
    assert_eq!(resumes[0]["lost"], serde_json::json!([staller.did]));
    assert!(!chain_of(&first).contains(&staller.did));
    assert!(
        log()
            .lines()
            .any(|l| l.contains("stalled") && l.contains(&staller.did)),
        "{}",
        log()
    );
    let (code, report) = verify_saved(dir.path(), "stalled.json", &first.bundle);
    assert_eq!(code, Some(0), "{report:#}");

    let second = generate_remote(&address, &request, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(second.terminal_state, "completed", "{:?}", second.error);
    assert!(
        second.details["resumes"]
            .as_array()
            .is_none_or(Vec::is_empty)
    );
    assert!(!chain_of(&second).contains(&staller.did));
    assert_eq!(second.details["token_ids"], first.details["token_ids"]);
}

/// Issue 41: a stage wrong only now and then (each output nudged with
/// probability 0.2) passes the audits of requests whose steps it computed
/// honestly and fails the first audit of one where it did not: the audit
/// judges bytes, not a node's habits.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_wrong_now_and_then_is_caught_by_the_first_audit_that_holds_a_wrong_step() {
    use mesh_node::runtime::serve::{GenerateRequest, PeerAddr, generate_remote};
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let args = ["--stages", "2", "--audit-rate", "1", "--audit-pause-s", "0"];
    let fault = ("liar", ("MESH_FAULT_WRONG_OUTPUT", "0.2"));
    let (coordinator, _, _liar, _) = mesh_with_a_faulty_member(dir.path(), &model, &args, fault, 0);
    let address: PeerAddr = coordinator.peer.parse().unwrap();
    let request = GenerateRequest::greedy("now and then", 3);
    let mut verdicts = Vec::new();
    while !verdicts.contains(&"failed".to_string()) {
        assert!(verdicts.len() < 60, "never caught: {verdicts:?}");
        let summary = generate_remote(&address, &request, &mut |_| {})
            .await
            .unwrap();
        assert_eq!(summary.terminal_state, "completed", "{:?}", summary.error);
        let bundle = summary.bundle.unwrap();
        let verdict = bundle["audit"]["statement"]["stages"][0]["verdict"].clone();
        verdicts.push(verdict.as_str().unwrap().to_string());
    }
    eprintln!("verdicts until caught: {verdicts:?}");
}
