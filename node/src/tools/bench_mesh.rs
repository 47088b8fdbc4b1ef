//! `mesh-node bench plan`: what membership and planning cost at scale (a
//! thousand signed adverts taken into a member table, then planned over),
//! and the time from `join` to the joining node's first served request on
//! loopback.

use std::time::{Duration, Instant};

use mesh_protocol::SigningKey;
use mesh_protocol::advert::{Advert, AdvertModel, Members};
use mesh_protocol::plan::{ModelShape, Stages};
use mesh_stage::sampling::SplitMix64;
use serde_json::{Value, json};

use crate::runtime::mesh::MemberView;
use crate::runtime::serve::{GenerateRequest, MeshSettings, Node, generate_remote};
use crate::tools::bench::median;

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
    // KV for 8,192 positions with 8 KV heads of 128, f32: 64 MiB per layer.
    let shape = ModelShape {
        layer_bytes: vec![500_000_000; bench.layers],
        head_bytes: 2_000_000_000,
        kv_bytes_per_layer: 2 * 8 * 128 * 4 * 8192,
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
                models: if holds {
                    vec![AdvertModel {
                        package_id,
                        layers: bench.layers as u32,
                        decode_us_per_layer: 200 + random.below(4_800),
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
    };
    let mut options =
        crate::cli::node_cli::bench_options(model, &scratch, 0, Vec::new(), &coordinator_key)?;
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
            let mut options = crate::cli::node_cli::bench_options(
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
                match generate_remote(&coordinator.peer_addr(), &request, &mut |_| {}).await {
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
