//! `mesh-node mesh status` and `mesh-node plan`: the mesh as an observer sees
//! it (an ephemeral key that advertises nothing), and the plan a
//! coordinator would make over it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use libp2p::multiaddr::Protocol;
use mesh_protocol::advert::{Advert, AdvertModel};
use mesh_protocol::identity::parse_did_key;
use mesh_protocol::plan::Stages;
use serde::Deserialize;

use crate::runtime::mesh::{MemberView, Mesh, MeshOptions};
use crate::runtime::planner;

/// Where to look at the mesh from.
#[derive(Debug, Clone, clap::Args)]
pub struct ObserveArgs {
    /// A member's mesh address: HOST:PORT or `/ip4/HOST/tcp/PORT/p2p/PEERID`;
    /// repeat for more.
    #[arg(long = "bootstrap", value_parser = crate::runtime::mesh::parse_bootstrap)]
    pub bootstrap: Vec<libp2p::Multiaddr>,
    /// Do not look for members on the local network by mDNS.
    #[arg(long)]
    pub no_mdns: bool,
    /// How long to listen for adverts, ms (they come every second).
    #[arg(long, default_value_t = 3000)]
    pub wait_ms: u64,
}

/// What an observer saw: the members heard, and whether it reached any
/// node at all (and if not, why the last dial failed).
#[derive(Debug)]
pub struct Observed {
    pub members: Vec<MemberView>,
    pub reached: bool,
    pub dial_error: Option<String>,
}

impl Observed {
    /// The one line `mesh status` says when it reached nobody.
    pub fn unreached(&self, args: &ObserveArgs) -> Option<String> {
        if self.reached || !self.members.is_empty() {
            return None;
        }
        let tried = if args.bootstrap.is_empty() {
            "no --bootstrap given, and no member found by mDNS".to_string()
        } else {
            let addresses: Vec<String> = args.bootstrap.iter().map(ToString::to_string).collect();
            format!(
                "bootstrap {}{}",
                addresses.join(", "),
                self.dial_error
                    .as_deref()
                    .map_or(String::new(), |e| format!(": {e}"))
            )
        };
        Some(format!(
            "reached no node in {} ms ({tried}); is a node running there, and its mesh port open?",
            args.wait_ms
        ))
    }
}

/// Listen to the mesh for a while as an observer; what it saw.
pub async fn observe(args: &ObserveArgs) -> anyhow::Result<Observed> {
    let key = mesh_protocol::SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?);
    let mut options = MeshOptions::new(key);
    options.bootstrap = args.bootstrap.clone();
    options.mdns = !args.no_mdns;
    let mesh = Mesh::start(options).await?;
    tokio::time::sleep(Duration::from_millis(args.wait_ms)).await;
    // Members heard but not yet pinged get up to as long again for their
    // first round trip (a plan leaves out members without one).
    let end = tokio::time::Instant::now() + Duration::from_millis(args.wait_ms);
    while mesh.members().iter().any(|m| m.rtt.is_none()) && tokio::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Observed {
        members: mesh.members(),
        reached: mesh.connected_peers() > 0,
        dial_error: mesh.last_dial_error(),
    })
}

/// `mesh-node plan`'s inputs.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The model to plan (its shape and package id): a GGUF file or a
    /// safetensors directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The coordinator (stage 0), a node id; default: the first bootstrap
    /// address's node.
    #[arg(long)]
    pub coordinator: Option<String>,
    /// Pin the number of stages (default: the planner decides; 1 is the
    /// coordinator alone).
    #[arg(long)]
    pub stages: Option<usize>,
    /// Plan over the members described in this JSON file instead of a live
    /// mesh: {"coordinator": NODEID, "members": [{"node_id", "quic",
    /// "memory_bytes", "decode_us_per_layer", "rtt_us", "holds_model"}]}.
    #[arg(long, conflicts_with = "bootstrap")]
    pub members: Option<PathBuf>,
    #[command(flatten)]
    pub observe: ObserveArgs,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MembersFile {
    coordinator: String,
    members: Vec<MemberFacts>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MemberFacts {
    node_id: String,
    #[serde(default = "default_quic")]
    quic: String,
    memory_bytes: u64,
    decode_us_per_layer: u64,
    #[serde(default)]
    rtt_us: u64,
    #[serde(default = "yes")]
    holds_model: bool,
    /// Where it computes, as adverts say it: `cpu` (default), `cuda:N`,
    /// `metal:N` (a GPU member's KV cache holds f32, twice the bytes).
    #[serde(default = "default_device")]
    device: String,
}

fn default_device() -> String {
    "cpu".into()
}

fn default_quic() -> String {
    "127.0.0.1:7420".into()
}
fn yes() -> bool {
    true
}

/// Members as described in a `--members` file, as if their adverts came in.
fn described(
    file: &MembersFile,
    package_id: [u8; 32],
    layers: u32,
) -> anyhow::Result<Vec<MemberView>> {
    file.members
        .iter()
        .map(|m| {
            let node_id = parse_did_key(&m.node_id)
                .with_context(|| format!("`{}` is not a did:key node id", m.node_id))?;
            Ok(MemberView {
                advert: Advert {
                    node_id,
                    seq: 1,
                    issued_ms: 0,
                    ttl_ms: 1,
                    quic: m.quic.clone(),
                    device: m.device.clone(),
                    memory_bytes: m.memory_bytes,
                    load: 0,
                    via: None,
                    rtts: Vec::new(),
                    models: if m.holds_model {
                        vec![AdvertModel {
                            package_id,
                            layers,
                            decode_us_per_layer: m.decode_us_per_layer.max(1),
                            precision: None,
                            name: None,
                        }]
                    } else {
                        Vec::new()
                    },
                },
                rtt: Some(Duration::from_micros(m.rtt_us)),
                age_ms: 0,
                member_for_ms: 0,
            })
        })
        .collect()
}

/// Plan over the live mesh or a described one; the plan as JSON and as
/// text.
pub async fn plan(args: &PlanArgs) -> anyhow::Result<(serde_json::Value, String)> {
    let model = crate::runtime::open_model(&args.model)?;
    let package_id = model.package_id();
    let (members, coordinator) = match &args.members {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let file: MembersFile = serde_json::from_str(&text)
                .with_context(|| format!("{} is not a members file", path.display()))?;
            let members = described(&file, package_id, model.config().layers)?;
            (members, file.coordinator.clone())
        }
        None => {
            let coordinator = match &args.coordinator {
                Some(id) => id.clone(),
                None => {
                    let peer = args
                        .observe
                        .bootstrap
                        .first()
                        .and_then(|a| match a.iter().last() {
                            Some(Protocol::P2p(peer)) => Some(peer),
                            _ => None,
                        })
                        .context("give --coordinator NODEID, or a --bootstrap address of it")?;
                    let key = crate::runtime::mesh::peer_key(&peer)
                        .context("the bootstrap peer id is not an Ed25519 key")?;
                    mesh_protocol::identity::did_key(&key)
                }
            };
            (observe(&args.observe).await?.members, coordinator)
        }
    };
    let coordinator = parse_did_key(&coordinator)
        .with_context(|| format!("`{coordinator}` is not a did:key node id"))?;
    let shape = planner::model_shape(&model);
    let stages = args.stages.map_or(Stages::AtLeast(1), Stages::Pinned);
    let plan = planner::plan_over(&shape, &package_id, &coordinator, &members, stages)?;
    let mut json = planner::plan_json(&plan, &members);
    json["model"] = serde_json::json!({
        "package_id": mesh_protocol::hex::encode(&package_id),
        "layer_bytes": shape.layer_bytes,
        "head_bytes": shape.head_bytes,
        "kv_bytes_per_layer": shape.kv_bytes_per_layer,
        "planned_context": planner::planned_context(&model),
    });
    json["per_hop_overhead_us"] = mesh_protocol::plan::PER_HOP_OVERHEAD_US.into();
    Ok((json, planner::render_plan(&plan)))
}
