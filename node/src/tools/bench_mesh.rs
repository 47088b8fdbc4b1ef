//! `mesh-node bench plan`: what membership and planning cost at scale (a
//! thousand signed adverts taken into a member table, then planned over),
//! and the time from `join` to the joining node's first served request on
//! loopback.

use std::time::{Duration, Instant};

use anyhow::Context;

use mesh_protocol::SigningKey;
use mesh_protocol::advert::{Advert, AdvertModel, Members};
use mesh_protocol::plan::{ModelShape, Stages};
use mesh_stage::sampling::SplitMix64;
use serde_json::{Value, json};

use crate::runtime::mesh::MemberView;
use crate::runtime::serve::{GenerateRequest, MeshSettings, Node, generate_remote};
use crate::tools::bench::{completed, median};

/// What `bench plan` simulates.
#[derive(Debug, Clone)]
pub struct PlanBench {
    pub members: usize,
    /// Layers of the simulated model (80: a 70B-class model).
    pub layers: usize,
    pub rounds: usize,
    pub seed: u64,
}

/// Sign `members` adverts, take them into a table (timed), and plan over
/// them (timed, median of `rounds`), free and with 8 stages pinned.
pub fn bench_plan(bench: &PlanBench) -> anyhow::Result<Value> {
    anyhow::ensure!(
        bench.members >= 1 && bench.layers >= 2,
        "at least one member and two layers"
    );
    let mut random = SplitMix64::new(bench.seed);
    let package_id = *blake3::hash(b"bench plan: the simulated package").as_bytes();
    // A 70B-class model at 4-5 bits: about 0.5 GB of weights per layer;
    // KV for 8,192 positions with 8 KV heads of 128, f16: 32 MiB per layer.
    let shape = ModelShape {
        layer_bytes: vec![500_000_000; bench.layers],
        head_bytes: 2_000_000_000,
        kv_bytes_per_layer: 2 * 8 * 128 * 2 * 8192,
    };
    let now = 1_790_739_480_000u64;
    let keys: Vec<SigningKey> = (0..bench.members)
        .map(|_| {
            let mut seed = [0u8; 32];
            for chunk in seed.chunks_mut(8) {
                chunk.copy_from_slice(&random.next_u64().to_le_bytes());
            }
            SigningKey::from_bytes(&seed)
        })
        .collect();
    let signed: Vec<(Vec<u8>, [u8; 32], u64)> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let holds = i == 0 || random.below(10) < 9;
            let advert = Advert {
                node_id: key.verifying_key().to_bytes(),
                seq: 1,
                issued_ms: now,
                ttl_ms: 5_000,
                quic: format!("10.{}.{}.{}:7420", i / 65536 % 256, i / 256 % 256, i % 256),
                device: "cpu".into(),
                // 4 to 64 GB offered; the coordinator enough for its head
                // and a few layers.
                memory_bytes: if i == 0 {
                    8_000_000_000
                } else {
                    (4 + random.below(60)) * 1_000_000_000
                },
                load: 0,
                via: None,
                rtts: Vec::new(),
                models: if holds {
                    vec![AdvertModel {
                        package_id,
                        layers: bench.layers as u32,
                        decode_us_per_layer: 200 + random.below(4_800),
                        precision: None,
                        name: None,
                    }]
                } else {
                    Vec::new()
                },
            };
            (advert.sign(key), advert.node_id, 200 + random.below(79_800))
        })
        .collect();
    let started = Instant::now();
    let mut table = Members::default();
    for (bytes, node, _) in &signed {
        table.offer(bytes, node, now)?;
    }
    let intake = started.elapsed();
    let members: Vec<MemberView> = table
        .iter()
        .map(|m| MemberView {
            advert: m.advert.clone(),
            rtt: signed
                .iter()
                .find(|(_, node, _)| *node == m.advert.node_id)
                .map(|(_, _, rtt)| Duration::from_micros(*rtt)),
            age_ms: 0,
            member_for_ms: 0,
        })
        .collect();
    let coordinator = keys[0].verifying_key().to_bytes();
    let mut report = json!({
        "members": bench.members,
        "layers": bench.layers,
        "rounds": bench.rounds,
        "seed": bench.seed,
        "intake_ms": intake.as_secs_f64() * 1e3,
        "intake_us_per_advert": intake.as_secs_f64() * 1e6 / bench.members as f64,
    });
    for (name, stages) in [
        ("free", Stages::AtLeast(2)),
        ("pinned_8", Stages::Pinned(8)),
    ] {
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..bench.rounds.max(1) {
            let started = Instant::now();
            let plan = crate::runtime::planner::plan_over(
                &shape,
                &package_id,
                &coordinator,
                &members,
                stages,
            )?;
            times.push(started.elapsed().as_secs_f64() * 1e3);
            last = Some(plan);
        }
        let plan = last.ok_or_else(|| anyhow::anyhow!("no round ran"))?;
        report[name] = json!({
            "plan_ms_median": median(times.iter().copied()),
            "stages": plan.stages.len(),
            "layers_per_stage": plan.stages.iter().map(|s| s.layers.end - s.layers.start).collect::<Vec<_>>(),
            "projected_ms_per_token": plan.projected_us_per_token as f64 / 1e3,
            "left_out": plan.left_out.len(),
        });
    }
    Ok(report)
}

pub fn render_plan(report: &Value) -> String {
    let mut out = format!(
        "{} simulated members, a model of {} layers (seed {})\n",
        report["members"], report["layers"], report["seed"]
    );
    out.push_str(&format!(
        "taking their signed adverts into a member table: {:.1} ms ({:.1} us an advert)\n",
        report["intake_ms"].as_f64().unwrap_or(0.0),
        report["intake_us_per_advert"].as_f64().unwrap_or(0.0)
    ));
    for (name, label) in [
        ("free", "the planner's choice"),
        ("pinned_8", "8 stages pinned"),
    ] {
        let r = &report[name];
        out.push_str(&format!(
            "planning, {label}: {:.2} ms (median of {}); {} stages {}, projected {:.1} ms per token, {} left out\n",
            r["plan_ms_median"].as_f64().unwrap_or(0.0),
            report["rounds"],
            r["stages"],
            r["layers_per_stage"],
            r["projected_ms_per_token"].as_f64().unwrap_or(0.0),
            r["left_out"]
        ));
    }
    out
}

/// From `Node::start` of a joining node (its speed measured, as on a first
/// join, or read from its data directory, as on a rejoin) to the end of
/// the first request a coordinator serves over it.
pub async fn bench_join(model: &std::path::Path, rounds: usize) -> anyhow::Result<Value> {
    let scratch = tempfile_dir()?;
    let coordinator_key = SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?);
    let loopback: libp2p::Multiaddr = "/ip4/127.0.0.1/tcp/0".parse()?;
    let settings = |bootstrap: Vec<libp2p::Multiaddr>| MeshSettings {
        listen: vec![loopback.clone()],
        bootstrap,
        mdns: false,
        memory_bytes: Some(8 << 30),
        decode_us_per_layer: None,
        relay: None,
    };
    let mut options =
        crate::tools::bench_split::bench_options(model, &scratch, 0, Vec::new(), &coordinator_key)?;
    options.mesh = Some(settings(Vec::new()));
    options.stages = Some(2);
    let coordinator = Node::start(options).await?;
    let bootstrap = coordinator.mesh_addresses(Duration::from_secs(5)).await;
    anyhow::ensure!(
        !bootstrap.is_empty(),
        "the coordinator's mesh does not listen"
    );
    let mut first_join = Vec::new();
    let mut rejoin = Vec::new();
    for round in 0..rounds.max(1) {
        let key = SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?);
        let data = scratch.join(format!("joiner-{round}"));
        for times in [&mut first_join, &mut rejoin] {
            let mut options = crate::tools::bench_split::bench_options(
                model,
                &scratch,
                round + 1,
                Vec::new(),
                &coordinator_key,
            )?;
            options.key = key.clone();
            options.data = data.clone();
            options.mesh = Some(settings(bootstrap.clone()));
            let started = Instant::now();
            let joiner = Node::start(options).await?;
            loop {
                let request = GenerateRequest::greedy("hello mesh", 4);
                match generate_remote(&coordinator.peer_addr(), &request, &mut |_| {})
                    .await
                    .and_then(completed)
                {
                    Ok(_) => break,
                    Err(error) if started.elapsed() < Duration::from_secs(60) => {
                        tracing::debug!("not served yet: {error:#}");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(error) => return Err(error.context("the joined node was never used")),
                }
            }
            times.push(started.elapsed().as_secs_f64() * 1e3);
            let gone = joiner.public_key();
            joiner.shutdown().await;
            // The next round starts once the coordinator saw it leave.
            let waited = Instant::now();
            while coordinator
                .mesh()
                .is_some_and(|m| m.members().iter().any(|v| v.advert.node_id == gone))
                && waited.elapsed() < Duration::from_secs(15)
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    coordinator.shutdown().await;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(json!({
        "model": model.display().to_string(),
        "rounds": rounds.max(1),
        "first_join_ms": first_join,
        "first_join_ms_median": median(first_join.iter().copied()),
        "rejoin_ms": rejoin,
        "rejoin_ms_median": median(rejoin.iter().copied()),
    }))
}

/// A `mesh-node join` child process, so that it can be SIGKILLed.
struct Joiner {
    child: std::process::Child,
    did: String,
}

impl Drop for Joiner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_joiner(
    model: &std::path::Path,
    data: &std::path::Path,
    bootstrap: &str,
) -> anyhow::Result<Joiner> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["join", "--model"])
        .arg(model)
        .arg("--data")
        .arg(data)
        .args(["--bootstrap", bootstrap, "--listen", "127.0.0.1:0"])
        .args(["--mesh-listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns"])
        .args(["--decode-us-per-layer", "1000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("the joiner's output")?;
    let mut lines = std::io::BufReader::new(stdout).lines();
    let mut did = None;
    for line in lines.by_ref() {
        let line = line?;
        if let Some(rest) = line.strip_prefix("node ") {
            did = rest.split_whitespace().next().map(str::to_string);
        }
        if line.starts_with("peer address: ") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Ok(Joiner {
        child,
        did: did.context("the joiner printed no node id")?,
    })
}

/// Three joiners as processes and a coordinator pinned to three stages; a
/// request whose context reaches `context` tokens; the middle stage
/// SIGKILLed after its 4th token. Detection is from the kill to the moment
/// the coordinator noticed (both wall clocks of this machine), re-plan and
/// replay as the coordinator measured them.
pub async fn bench_resume(
    model: &std::path::Path,
    rounds: usize,
    context: usize,
) -> anyhow::Result<Value> {
    const KILL_AT: usize = 4;
    let scratch = tempfile_dir()?;
    let coordinator_key = SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?);
    let mut options =
        crate::tools::bench_split::bench_options(model, &scratch, 0, Vec::new(), &coordinator_key)?;
    options.mesh = Some(MeshSettings {
        listen: vec!["/ip4/127.0.0.1/tcp/0".parse()?],
        bootstrap: Vec::new(),
        mdns: false,
        memory_bytes: Some(8 << 30),
        decode_us_per_layer: Some(1000),
        relay: None,
    });
    options.stages = Some(3);
    options.step_timeout = Duration::from_secs(60);
    // `serve`'s default: a direct-return wait also watches the mesh, so a
    // killed stage is noticed when its mesh connection closes.
    options.return_mode = mesh_protocol::block::ReturnMode::Direct;
    let coordinator = Node::start(options).await?;
    let bootstrap = coordinator
        .mesh_addresses(Duration::from_secs(5))
        .await
        .first()
        .map(ToString::to_string)
        .context("the coordinator's mesh does not listen")?;
    let mut joiners = (0..3)
        .map(|k| spawn_joiner(model, &scratch.join(format!("joiner-{k}")), &bootstrap))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // A prompt that, with the tokens before the kill, fills the context.
    let handle = crate::runtime::open_model(model)?;
    let codec = handle.text()?;
    let mut prompt = String::new();
    while codec.encode(&prompt)?.len() + KILL_AT < context {
        prompt.push_str("The quick brown fox jumps over the lazy dog. ");
    }
    let mut rows = Vec::new();
    for _ in 0..rounds.max(1) {
        // Every member back, and a three-stage chain served.
        let waited = Instant::now();
        let chain = loop {
            let members = coordinator.mesh().map_or(0, |m| m.members().len());
            let warm = generate_remote(
                &coordinator.peer_addr(),
                &GenerateRequest::greedy("hello mesh", 2),
                &mut |_| {},
            )
            .await
            .and_then(completed);
            if let Ok(summary) = warm
                && members >= 3
                && let Some(stewards) = summary
                    .bundle
                    .as_ref()
                    .and_then(|b| b["stewards"].as_array())
                && stewards.len() == 3
            {
                break stewards
                    .iter()
                    .filter_map(|s| s["node_id"].as_str().map(str::to_string))
                    .collect::<Vec<_>>();
            }
            anyhow::ensure!(
                waited.elapsed() < Duration::from_secs(120),
                "the mesh never served a three-stage chain"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let victim = joiners
            .iter()
            .position(|j| j.did == chain[1])
            .context("the middle stage is not one of the joiners")?;
        let mut seen = 0;
        let mut arrivals: Vec<Instant> = Vec::new();
        let mut killed: Option<(Instant, u64)> = None;
        let request = GenerateRequest::greedy(prompt.clone(), KILL_AT + 4);
        let child = &mut joiners[victim].child;
        let summary = generate_remote(&coordinator.peer_addr(), &request, &mut |_| {
            seen += 1;
            arrivals.push(Instant::now());
            if seen == KILL_AT {
                let _ = child.kill();
                killed = Some((Instant::now(), crate::runtime::clock::now_ms()));
            }
        })
        .await?;
        let (killed_at, killed_unix_ms) = killed.context("the request ended before the kill")?;
        anyhow::ensure!(
            summary.terminal_state == "completed",
            "the request did not complete: {:?}",
            summary.error
        );
        let resume = summary.details["resumes"]
            .get(0)
            .cloned()
            .context("the request was not resumed")?;
        let next_token_ms = arrivals
            .iter()
            .find(|t| **t > killed_at)
            .map(|t| (*t - killed_at).as_secs_f64() * 1e3)
            .context("no token after the kill")?;
        let noticed = resume["noticed_unix_ms"].as_u64().unwrap_or(killed_unix_ms);
        rows.push(json!({
            "context_tokens": summary.details["prompt_tokens"].as_u64().unwrap_or(0) + KILL_AT as u64,
            "kill_to_next_token_ms": next_token_ms,
            "detection_ms": noticed.saturating_sub(killed_unix_ms),
            "replan_ms": resume["replan_ms"],
            "replay_ms": resume["replay_ms"],
            "replayed_positions": resume["replayed_positions"],
            "caches_kept_by": resume["kept"],
            "prompt_prefill_ms": summary.details["prefill_ms"],
        }));
        // The killed node comes back (same key, same data) for the next round.
        let data = scratch.join(format!("joiner-{victim}"));
        joiners[victim] = spawn_joiner(model, &data, &bootstrap)?;
    }
    drop(joiners);
    coordinator.shutdown().await;
    let _ = std::fs::remove_dir_all(&scratch);
    let column = |key: &str| median(rows.iter().filter_map(|r| r[key].as_f64()));
    Ok(json!({
        "model": model.display().to_string(),
        "rounds": rows.len(),
        "runs": rows,
        "kill_to_next_token_ms_median": column("kill_to_next_token_ms"),
        "detection_ms_median": column("detection_ms"),
        "replan_ms_median": column("replan_ms"),
        "replay_ms_median": column("replay_ms"),
        "prompt_prefill_ms_median": column("prompt_prefill_ms"),
    }))
}

pub fn render_resume(report: &Value) -> String {
    let ms = |key: &str| report[key].as_f64().unwrap_or(f64::NAN);
    format!(
        "a stage SIGKILLed mid-request, {} rounds, context {} tokens ({}):\n  kill to next token: median {:.0} ms\n    detection {:.0} ms, re-plan {:.0} ms, prefix replay {:.0} ms of {} positions, caches kept by {} node(s) (the prompt's own prefill: {:.0} ms)\n",
        report["rounds"],
        report["runs"][0]["context_tokens"],
        report["model"].as_str().unwrap_or(""),
        ms("kill_to_next_token_ms_median"),
        ms("detection_ms_median"),
        ms("replan_ms_median"),
        ms("replay_ms_median"),
        report["runs"][0]["replayed_positions"],
        report["runs"][0]["caches_kept_by"]
            .as_array()
            .map_or(0, Vec::len),
        ms("prompt_prefill_ms_median"),
    )
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("mesh-node-bench-join-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

pub fn render_join(report: &Value) -> String {
    format!(
        "join to first served request over loopback ({} rounds, {}):\n  first join (measures its speed): median {:.0} ms {}\n  rejoin (speed read from its data directory): median {:.0} ms {}\n",
        report["rounds"],
        report["model"].as_str().unwrap_or(""),
        report["first_join_ms_median"].as_f64().unwrap_or(0.0),
        report["first_join_ms"],
        report["rejoin_ms_median"].as_f64().unwrap_or(0.0),
        report["rejoin_ms"],
    )
}
