//! Nodes behind NATs join a mesh and serve (docs/mesh.md "Reachability"),
//! in a network of namespaces this test builds (`scripts/netns-lab.sh`:
//! a public segment, and two homes behind MASQUERADE, one that keeps a
//! port for every destination and one that maps each destination to a new
//! port, a symmetric NAT). It needs root; without it, it says SKIPPED
//! (`MESH_REQUIRE_NETNS=1` makes that a failure).
//!
//! Every address here is inside the namespaces the test made: nothing
//! leaves the machine.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::nodes::synthetic;
use common::processes::bin;
use serde_json::Value;

const COORDINATOR: &str = "10.77.0.10";
const RELAY: &str = "10.77.0.11";
/// Each home's link to the public segment: its round trip, half each way
/// (`HOME_DELAY_MS`).
const HOME_DELAY_MS: f64 = 20.0;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/netns-lab.sh")
}

/// The lab's namespaces (removed when dropped).
struct Lab {
    prefix: String,
}

impl Lab {
    /// Build it with home 2 behind `home2_nat` (`cone`, `address` or
    /// `symmetric`), or
    /// `None` (SKIPPED) where this machine cannot.
    fn up(name: &str, home2_nat: &str) -> Option<Lab> {
        let check = Command::new("bash")
            .arg(script())
            .arg("check")
            .output()
            .ok()?;
        if !check.status.success() {
            return common::skipped(
                format!(
                    "the namespace lab cannot be built here ({}): {name} is SKIPPED",
                    String::from_utf8_lossy(&check.stdout).trim()
                ),
                "MESH_REQUIRE_NETNS",
            );
        }
        // Short (interface names hold 15 bytes) and distinct per test.
        let prefix = format!("mn{}{}", &home2_nat[..1], std::process::id() % 10_000);
        let up = Command::new("bash")
            .arg(script())
            .args(["up", &prefix])
            .env("HOME2_NAT", home2_nat)
            .env("HOME_DELAY_MS", HOME_DELAY_MS.to_string())
            .output()
            .unwrap();
        assert!(
            up.status.success(),
            "netns-lab.sh up: {}",
            String::from_utf8_lossy(&up.stderr)
        );
        Some(Lab { prefix })
    }

    fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.prefix)
    }

    /// `mesh-node ARGS` in namespace `host`.
    fn command(&self, host: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.ns(host), bin()]);
        command
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["down", &self.prefix])
            .output();
    }
}

/// A node in the lab, killed when dropped; its stdout lines as they come,
/// its log in `log`.
struct Node {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    log: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    fn start(lab: &Lab, host: &str, dir: &Path, name: &str, args: &[&str]) -> Node {
        let log = dir.join(format!("{name}.log"));
        let mut child = lab
            .command(host)
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let out = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Node {
            child,
            lines,
            seen: Vec::new(),
            log,
        }
    }

    /// The first stdout line starting with `prefix`, within `within`.
    fn wait_for(&mut self, prefix: &str, within: Duration) -> String {
        if let Some(line) = self.seen.iter().find(|l| l.starts_with(prefix)) {
            return line.clone();
        }
        let end = Instant::now() + within;
        while let Ok(line) = self
            .lines
            .recv_timeout(end.saturating_duration_since(Instant::now()))
        {
            self.seen.push(line.clone());
            if line.starts_with(prefix) {
                return line;
            }
        }
        panic!(
            "no `{prefix}` line within {within:?}; printed: {:?}; log:\n{}",
            self.seen,
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// Log lines that contain `text`.
    fn logged(&self, text: &str) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(text))
            .map(str::to_string)
            .collect()
    }
}

/// The node id a `peer address: DID@ADDR` line names.
fn did(peer_line: &str) -> String {
    peer_line
        .trim_start_matches("peer address: ")
        .split('@')
        .next()
        .unwrap()
        .to_string()
}

/// A coordinator on the public host, a relay on the second, one node in
/// each home; each home's node has said how it is reached.
struct Mesh {
    coordinator: Node,
    relay: Node,
    homes: [Node; 2],
    coordinator_peer: String,
    home_dids: [String; 2],
    /// What each home's node said of how it is reached.
    reach: [String; 2],
}

fn mesh(lab: &Lab, dir: &Path, model: &Path) -> Mesh {
    let model = model.to_str().unwrap();
    let data = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let coordinator_key = common::processes::keygen(dir, "coord");
    let mut coordinator = Node::start(
        lab,
        "pub",
        dir,
        "coord",
        &[
            "serve",
            "--key",
            coordinator_key.to_str().unwrap(),
            "--model",
            model,
            "--data",
            &data("coord"),
            "--listen",
            &format!("{COORDINATOR}:7000"),
            "--no-mdns",
            "--stages",
            "3",
            "--decode-us-per-layer",
            "50000",
        ],
    );
    let coordinator_peer = coordinator.wait_for("peer address: ", Duration::from_secs(30));
    let bootstrap = format!("{COORDINATOR}:7000");
    // The relay offers no memory for layers: it only relays.
    let mut relay = Node::start(
        lab,
        "pub2",
        dir,
        "relay",
        &[
            "join",
            "--model",
            model,
            "--data",
            &data("relay"),
            "--bootstrap",
            &bootstrap,
            "--listen",
            &format!("{RELAY}:7000"),
            "--no-mdns",
            "--relay",
            "--memory-mib",
            "1",
            "--decode-us-per-layer",
            "1000",
        ],
    );
    relay.wait_for("reachability: public", Duration::from_secs(30));
    let home = |host: &str, name: &str| {
        Node::start(
            lab,
            host,
            dir,
            name,
            &[
                "join",
                "--model",
                model,
                "--data",
                &data(name),
                "--bootstrap",
                &bootstrap,
                "--listen",
                "0.0.0.0:7001",
                "--no-mdns",
                "--decode-us-per-layer",
                "1000",
            ],
        )
    };
    let mut homes = [home("h1", "home1"), home("h2", "home2")];
    let mut home_dids = [String::new(), String::new()];
    let mut reaches = [String::new(), String::new()];
    for ((home, did_out), reach_out) in homes
        .iter_mut()
        .zip(home_dids.iter_mut())
        .zip(reaches.iter_mut())
    {
        *did_out = did(&home.wait_for("peer address: ", Duration::from_secs(30)));
        let reach = home.wait_for("reachability: ", Duration::from_secs(30));
        *reach_out = reach.clone();
        eprintln!("{did_out}: {reach}");
        assert!(
            reach.contains("behind a") && reach.contains(RELAY),
            "a home node is behind a NAT, introduced and relayed by the relay: {reach}"
        );
    }
    Mesh {
        coordinator,
        relay,
        homes,
        coordinator_peer: coordinator_peer
            .trim_start_matches("peer address: ")
            .to_string(),
        home_dids,
        reach: reaches,
    }
}

/// Wait until the coordinator's plan has a stage in each home (each home
/// node knows the other by then, or learns of it through its rendezvous).
fn wait_for_plan(lab: &Lab, mesh: &Mesh, model: &Path) {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let out = lab
            .command("pub2")
            .args(["plan", "--model"])
            .arg(model)
            .args(["--bootstrap", &format!("{COORDINATOR}:7000")])
            .args(["--coordinator", &did(&mesh.coordinator_peer)])
            .args(["--stages", "3", "--json"])
            .output()
            .unwrap();
        let plan: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let text = plan.to_string();
        if mesh.home_dids.iter().all(|d| text.contains(d.as_str())) {
            return;
        }
        assert!(
            Instant::now() < end,
            "no plan over both homes within 60 s: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One request from the second public host; the bundle, checked offline,
/// the coordinator's details of it, and the time it took.
fn request(
    lab: &Lab,
    mesh: &Mesh,
    dir: &Path,
    name: &str,
    tokens: u32,
) -> (Value, Value, Duration) {
    let bundle = dir.join(format!("{name}.json"));
    let started = Instant::now();
    let out = lab
        .command("pub2")
        .args(["generate", "--coordinator", &mesh.coordinator_peer])
        .args(["--prompt", "hello from the public side"])
        .args(["--max-tokens", &tokens.to_string(), "--json", "--out"])
        .arg(&bundle)
        .output()
        .unwrap();
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "generate: {}\ncoordinator log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&mesh.coordinator.log).unwrap_or_default()
    );
    let bundle: Value = serde_json::from_slice(&std::fs::read(&bundle).unwrap()).unwrap();
    let (code, report) = common::nodes::verify(dir, &bundle);
    assert_eq!(code, 0, "the bundle verifies: {report:#}");
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    (bundle, printed["details"].clone(), took)
}

/// The stages' node ids in chain order.
fn chain(bundle: &Value) -> Vec<String> {
    bundle["main_record"]["model_attestation"]["compute_attestation"]
        ["x-mesh-coordinator-receipt-v1"]["topology"]
        .as_array()
        .unwrap()
        .iter()
        .map(|stage| stage["assignment"]["node_id"].as_str().unwrap().to_string())
        .collect()
}

/// Print how each home node reached its peers (punched or relayed); the
/// lines for `path`.
fn paths(mesh: &Mesh) -> Vec<String> {
    let mut all = Vec::new();
    let coordinator = did(&mesh.coordinator_peer);
    let nodes = [
        (&mesh.coordinator, &coordinator),
        (&mesh.homes[0], &mesh.home_dids[0]),
        (&mesh.homes[1], &mesh.home_dids[1]),
    ];
    for (home, did) in nodes {
        for line in home
            .logged("reached by hole punching")
            .into_iter()
            .chain(home.logged("reached through a relay"))
        {
            let path = if line.contains("hole punching") {
                "hole-punched"
            } else {
                "relayed"
            };
            let to = line
                .split("peer=")
                .nth(1)
                .and_then(|p| p.split('@').next())
                .unwrap_or("?");
            let entry = format!("{} -> {}: {path}", short(did), short(to));
            eprintln!("hop {entry}");
            all.push(entry);
        }
    }
    all
}

/// Once the plan has a stage in each home, one request of 16 tokens from
/// the public side: its chain holds both homes, and the hop between them
/// took `path` (`hole-punched` or `relayed`).
fn serve_across_homes(lab: &Lab, mesh: &Mesh, dir: &Path, model: &Path, name: &str, path: &str) {
    wait_for_plan(lab, mesh, model);
    let (bundle, details, took) = request(lab, mesh, dir, name, 16);
    let stages = chain(&bundle);
    assert!(mesh.home_dids.iter().all(|d| stages.contains(d)));
    // The floor: the one-way delays a decode step crosses. With the direct
    // return (the default) every stage of the chain is entered once and
    // left once, and each home's link costs half its round trip each way;
    // a relay on the public segment adds no delayed link.
    let in_homes = stages.iter().filter(|s| mesh.home_dids.contains(s)).count();
    let floor_ms = in_homes as f64 * HOME_DELAY_MS;
    let per_token_ms = 1e3 / details["decode_tokens_per_s"].as_f64().unwrap();
    // The stages' forward passes (this is a debug build), per decode step.
    let compute_ms = details["decode_engine_ms"].as_f64().unwrap()
        / details["decode_steps"].as_f64().unwrap().max(1.0);
    eprintln!(
        "chain: {stages:?}; 16 tokens in {took:?}; decode {per_token_ms:.2} ms a token, \
         {:.2} ms without the stages' compute, against a floor of {floor_ms} ms (the home \
         links' one-way delays; {HOME_DELAY_MS} ms round trip each)",
        per_token_ms - compute_ms,
    );
    assert!(
        per_token_ms >= floor_ms,
        "a token cannot beat the links' delays: the links are delayed"
    );
    let hops = paths(mesh);
    let between_homes: Vec<_> = hops
        .iter()
        .filter(|h| mesh.home_dids.iter().all(|d| h.contains(short(d))))
        .collect();
    assert!(
        !between_homes.is_empty() && between_homes.iter().all(|h| h.ends_with(path)),
        "the hop between the homes is {path}: {hops:?}"
    );
}

fn short(did: &str) -> &str {
    &did[did.len().saturating_sub(8)..]
}

/// Home 2 behind `home2_nat`, a NAT that keeps one port for every
/// destination: neither home is found symmetric, and a request from the
/// public side is served over a hop between the homes that was punched.
fn hole_punched_between_homes(test: &str, home2_nat: &str) {
    let Some(lab) = Lab::up(test, home2_nat) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let mesh = mesh(&lab, dir.path(), &model);
    assert!(
        mesh.reach.iter().all(|r| !r.contains("symmetric")),
        "both homes keep one port for every destination: {:?}",
        mesh.reach
    );
    serve_across_homes(&lab, &mesh, dir.path(), &model, home2_nat, "hole-punched");
}

#[test]
fn a_chain_over_two_cone_nats_is_served_by_hole_punching() {
    hole_punched_between_homes(
        "a_chain_over_two_cone_nats_is_served_by_hole_punching",
        "cone",
    );
}

/// A NAT that filters by address only lets in a new flow from any port of
/// an address its home sent to, so a dial-back from the rendezvous's own
/// address gets in though strangers' packets do not. The dial-back comes
/// from another member's address: home 2's node is counted behind a NAT,
/// not public, and the hop into it is hole-punched.
#[test]
fn a_node_behind_a_nat_that_filters_by_address_only_is_not_counted_public() {
    // `mesh` holds every home node to "behind a NAT", introduced by the
    // relay.
    hole_punched_between_homes(
        "a_node_behind_a_nat_that_filters_by_address_only_is_not_counted_public",
        "address",
    );
}

#[test]
fn a_chain_through_a_symmetric_nat_is_relayed_and_a_relay_lost_mid_request_is_said_within_5_s() {
    let Some(lab) = Lab::up(
        "a_chain_through_a_symmetric_nat_is_relayed_and_a_relay_lost_mid_request_is_said_within_5_s",
        "symmetric",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = synthetic(dir.path());
    let mut mesh = mesh(&lab, dir.path(), &model);
    assert!(
        !mesh.reach[0].contains("symmetric") && mesh.reach[1].contains("symmetric"),
        "home 2's NAT is found symmetric, home 1's not: {:?}",
        mesh.reach
    );
    serve_across_homes(&lab, &mesh, dir.path(), &model, "symmetric", "relayed");
    // The relay goes away mid-request: the request resumes over another
    // path, or fails with one clear line, within 5 s of the kill (the
    // relayed connections' 2 s idle timeout, then a resume that finds no
    // member to take home 2's place: none here).
    let bundle = dir.path().join("long.json");
    let mut long = lab
        .command("pub2")
        .args(["generate", "--coordinator", &mesh.coordinator_peer])
        .args(["--prompt", "tell a long story", "--max-tokens", "400"])
        .args(["--json", "--out"])
        .arg(&bundle)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        long.try_wait().unwrap().is_none(),
        "the request is still in flight when the relay is killed"
    );
    let _ = mesh.relay.child.kill();
    let killed = Instant::now();
    let _ = mesh.relay.child.wait();
    let out = long.wait_with_output().unwrap();
    let took = killed.elapsed();
    let said = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "the relay killed mid-request: exit {:?} {took:?} after the kill: {}",
        out.status.code(),
        said.trim()
    );
    if out.status.success() {
        let bundle: Value = serde_json::from_slice(&std::fs::read(&bundle).unwrap()).unwrap();
        assert!(
            bundle.to_string().contains("\"resumes\""),
            "a request that outlived its relay resumed on a new chain"
        );
    } else {
        let lines: Vec<_> = said
            .lines()
            .filter(|l| l.starts_with("mesh-node"))
            .collect();
        assert_eq!(lines.len(), 1, "one clear line: {said}");
        assert!(
            lines[0].contains("stage"),
            "the line says which stage failed: {said}"
        );
        assert!(
            took < Duration::from_secs(5),
            "said within 5 s of the kill, took {took:?}; coordinator log:\n{}\nhome 1 log:\n{}",
            std::fs::read_to_string(&mesh.coordinator.log).unwrap_or_default(),
            std::fs::read_to_string(&mesh.homes[0].log).unwrap_or_default()
        );
    }
    let _ = &mut mesh.coordinator;
}
