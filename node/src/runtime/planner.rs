//! What the planner (`protocol::plan`) is given on a node: the model's shape,
//! the members' adverts as candidates, and the node's own measured speed;
//! and the plan as `mesh-node plan` shows it.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use mesh_protocol::advert::Advert;
use mesh_protocol::identity::did_key;
use mesh_protocol::plan::{Candidate, LeftOut, ModelShape, Plan, Stages};
use mesh_stage::ModelHandle;
use mesh_stage::model::{MAX_ENGINE_CONTEXT, SliceInput};
use serde_json::json;

use crate::runtime::mesh::MemberView;

/// The longest a context the planner reserves KV for.
pub fn planned_context(model: &ModelHandle) -> usize {
    model.config().context.clamp(1, MAX_ENGINE_CONTEXT)
}

/// The model as the planner sees it: stored bytes per layer, what only
/// stage 0 holds, and the KV one layer needs for the planned context (K and
/// V, f16, every KV head).
pub fn model_shape(model: &ModelHandle) -> ModelShape {
    let bytes = model.layer_bytes().with_head_on_first();
    ModelShape {
        layer_bytes: bytes.layers,
        head_bytes: bytes.embedding,
        kv_bytes_per_layer: kv_bytes_per_position(model) * planned_context(model) as u64,
    }
}

/// A member's KV bytes per byte the plan's shape counts: a CPU member's
/// caches hold f16 (the engine's own attention), a GPU member's f32
/// (candle's route), twice as many bytes.
fn kv_scale(device: &str) -> u64 {
    if device == "cpu" { 1 } else { 2 }
}

/// The KV cache bytes one layer holds per position: K and V, f16 (as the
/// engine's own attention keeps them; a GPU member's caches hold f32, which
/// the plan counts per member, `kv_scale`), every KV head.
pub fn kv_bytes_per_position(model: &ModelHandle) -> u64 {
    let config = model.config();
    2 * config.kv_heads as u64 * config.head_dim as u64 * 2
}

/// A member as the planner weighs it: with the reason it is left out, if
/// it is.
pub type Weighed = (Candidate, Option<LeftOut>);

/// The candidates of a plan for `package_id` over `members`, stage 0 being
/// `coordinator`: each member with the reason it was left out, if it was.
pub fn candidates(
    package_id: &[u8; 32],
    coordinator: &[u8; 32],
    members: &[MemberView],
) -> anyhow::Result<(Candidate, Vec<Weighed>)> {
    let candidate = |m: &MemberView| Candidate {
        node_id: m.advert.node_id,
        memory_bytes: m.advert.memory_bytes,
        decode_us_per_layer: m
            .advert
            .model(package_id)
            .map_or(u64::MAX / 1024, |e| e.decode_us_per_layer),
        rtt_us: m.rtt.map_or(0, |r| r.as_micros() as u64),
        kv_scale: kv_scale(&m.advert.device),
        rtts: m
            .advert
            .rtts
            .iter()
            .map(|r| (r.node_id, r.rtt_us))
            .collect(),
        relayed_by: m
            .advert
            .via
            .as_ref()
            .filter(|via| via.relayed)
            .map(|via| via.node_id),
    };
    let own = members
        .iter()
        .find(|m| m.advert.node_id == *coordinator)
        .with_context(|| {
            format!(
                "the coordinator {} has no current advert in the mesh",
                did_key(coordinator)
            )
        })?;
    if own.advert.model(package_id).is_none() {
        anyhow::bail!("the coordinator's advert does not name the model");
    }
    let others = members
        .iter()
        .filter(|m| m.advert.node_id != *coordinator)
        .map(|m| {
            let reason = if m.advert.model(package_id).is_none() {
                Some(LeftOut::NoModel)
            } else if m.rtt.is_none() {
                Some(LeftOut::NotConnected)
            } else {
                None
            };
            (candidate(m), reason)
        })
        .collect();
    Ok((candidate(own), others))
}

/// Plan over `others`, members behind symmetric NATs (reached only through
/// a relay, every hop to them paying the detour) left out while a chain
/// without them fits.
pub fn plan_relayed_last(
    shape: &ModelShape,
    own: &Candidate,
    others: &[Weighed],
    stages: Stages,
) -> Result<Plan, mesh_protocol::plan::PlanError> {
    let direct: Vec<Weighed> = others
        .iter()
        .map(|(candidate, reason)| {
            let reason = reason
                .clone()
                .or_else(|| candidate.relayed_by.is_some().then_some(LeftOut::Relayed));
            (candidate.clone(), reason)
        })
        .collect();
    if direct == others {
        return mesh_protocol::plan::plan(shape, own, others, stages);
    }
    mesh_protocol::plan::plan(shape, own, &direct, stages)
        .or_else(|_| mesh_protocol::plan::plan(shape, own, others, stages))
}

/// Plan `model` over the mesh as `coordinator` sees it.
pub fn plan_over(
    shape: &ModelShape,
    package_id: &[u8; 32],
    coordinator: &[u8; 32],
    members: &[MemberView],
    stages: Stages,
) -> anyhow::Result<Plan> {
    let (own, others) = candidates(package_id, coordinator, members)?;
    plan_relayed_last(shape, &own, &others, stages).map_err(anyhow::Error::new)
}

/// A plan as `mesh-node plan --json` prints it.
pub fn plan_json(plan: &Plan, members: &[MemberView]) -> serde_json::Value {
    let address = |id: &[u8; 32]| {
        members
            .iter()
            .find(|m| m.advert.node_id == *id)
            .map(|m| m.advert.quic.clone())
    };
    json!({
        "stages": plan.stages.iter().enumerate().map(|(k, s)| json!({
            "stage_index": k,
            "node_id": did_key(&s.node_id),
            "quic": address(&s.node_id),
            "layer_start": s.layers.start,
            "layer_end": s.layers.end,
            "weight_bytes": s.weight_bytes,
            "kv_bytes": s.kv_bytes,
            "compute_us": s.compute_us,
            "hop_us": s.hop_us,
        })).collect::<Vec<_>>(),
        "return_us": plan.return_us,
        "projected_us_per_token": plan.projected_us_per_token,
        "projected_tokens_per_s": plan.projected_tokens_per_s(),
        "left_out": plan.left_out.iter().map(|(id, why)| json!({
            "node_id": did_key(id),
            "reason": why.describe(),
        })).collect::<Vec<_>>(),
    })
}

/// The plan as a table.
pub fn render_plan(plan: &Plan) -> String {
    let mut out = String::new();
    out.push_str("stage  layers     weights MB   KV MB   compute ms   hop ms  node\n");
    for (k, s) in plan.stages.iter().enumerate() {
        out.push_str(&format!(
            "{k:<6} {:>3}..{:<5} {:>10.1} {:>7.1} {:>12.2} {:>8.2}  {}\n",
            s.layers.start,
            s.layers.end,
            s.weight_bytes as f64 / 1e6,
            s.kv_bytes as f64 / 1e6,
            s.compute_us as f64 / 1e3,
            s.hop_us as f64 / 1e3,
            did_key(&s.node_id)
        ));
    }
    out.push_str(&format!(
        "return to the coordinator {:.2} ms; projected {:.2} ms per token, {:.1} tokens/s\n",
        plan.return_us as f64 / 1e3,
        plan.projected_us_per_token as f64 / 1e3,
        plan.projected_tokens_per_s()
    ));
    for (id, why) in &plan.left_out {
        out.push_str(&format!("left out {}: {}\n", did_key(id), why.describe()));
    }
    out
}

/// Decode steps the self-benchmark times (after one warm-up step).
const SPEED_STEPS: usize = 16;
/// Layers the self-benchmark runs (fewer when the model has fewer).
const SPEED_LAYERS: u32 = 4;

/// Measure how long one layer takes to decode one token on this node: a
/// slice of the first few layers decodes a few positions.
pub fn measure_decode_us_per_layer(model: &ModelHandle) -> anyhow::Result<u64> {
    let layers = model.config().layers.min(SPEED_LAYERS);
    let slice = model.load_slice(0..layers)?;
    let mut cache = slice.new_cache(SPEED_STEPS + 1)?;
    slice.forward(SliceInput::Tokens(&[1]), &mut cache)?;
    let started = Instant::now();
    for step in 0..SPEED_STEPS {
        slice.forward(SliceInput::Tokens(&[(step % 64) as u32 + 2]), &mut cache)?;
    }
    let per_layer = started.elapsed().as_micros() as u64 / (SPEED_STEPS as u64 * u64::from(layers));
    Ok(per_layer.max(1))
}

/// The node's decode speed for `model`: measured once per model, device and
/// thread count, then read from `data/speed-PACKAGE.json`.
pub fn decode_speed(model: &ModelHandle, data: &Path) -> anyhow::Result<u64> {
    let threads = mesh_stage::compute_threads();
    let device = format!("{:?}", model.device().location());
    let path = data.join(format!(
        "speed-{}.json",
        &mesh_protocol::hex::encode(&model.package_id())[..16]
    ));
    if let Ok(text) = std::fs::read_to_string(&path)
        && let Ok(cached) = serde_json::from_str::<serde_json::Value>(&text)
        && cached["threads"].as_u64() == Some(threads as u64)
        && cached["device"].as_str() == Some(device.as_str())
        && let Some(us) = cached["decode_us_per_layer"].as_u64().filter(|us| *us > 0)
    {
        return Ok(us);
    }
    eprintln!("measuring this node's decode speed on the model (once per model)...");
    let us = measure_decode_us_per_layer(model)?;
    eprintln!("  {us} us per layer per token on {device}, {threads} thread(s)");
    std::fs::create_dir_all(data).with_context(|| format!("creating {}", data.display()))?;
    std::fs::write(
        &path,
        serde_json::to_vec(&json!({
            "decode_us_per_layer": us,
            "threads": threads,
            "device": device,
        }))?,
    )
    .with_context(|| format!("writing {}", path.display()))?;
    Ok(us)
}

/// Memory this machine has free now (Linux `MemAvailable`), bytes.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `mesh status` as a table.
pub fn render_members(members: &[MemberView]) -> String {
    let mut out = String::from(
        "node                                                      quic                  device  memory MB  load  rtt ms  age ms  models\n",
    );
    for m in members {
        let a: &Advert = &m.advert;
        out.push_str(&format!(
            "{:<57} {:<21} {:<7} {:>9.1} {:>5} {:>7} {:>7}  {}\n",
            did_key(&a.node_id),
            a.quic,
            a.device,
            a.memory_bytes as f64 / 1e6,
            a.load,
            m.rtt.map_or_else(
                || "-".to_string(),
                |r| format!("{:.2}", r.as_secs_f64() * 1e3)
            ),
            m.age_ms,
            a.models
                .iter()
                .map(|e| format!(
                    "{} ({} layers, {} us/layer{})",
                    e.name.clone().unwrap_or_else(|| format!(
                        "{}..",
                        &mesh_protocol::hex::encode(&e.package_id)[..12]
                    )),
                    e.layers,
                    e.decode_us_per_layer,
                    e.precision
                        .as_deref()
                        .map_or(String::new(), |p| format!(", {p}"))
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    out
}

/// `mesh status --json`.
pub fn members_json(members: &[MemberView]) -> serde_json::Value {
    json!(
        members
            .iter()
            .map(|m| json!({
                "node_id": did_key(&m.advert.node_id),
                "peer_id": mesh_protocol::identity::peer_id(&m.advert.node_id),
                "quic": m.advert.quic,
                "device": m.advert.device,
                "memory_bytes": m.advert.memory_bytes,
                "load": m.advert.load,
                "seq": m.advert.seq,
                "rtt_ms": m.rtt.map(|r| r.as_secs_f64() * 1e3),
                "age_ms": m.age_ms,
                "models": m.advert.models.iter().map(|e| json!({
                    "package_id": mesh_protocol::hex::encode(&e.package_id),
                    "layers": e.layers,
                    "decode_us_per_layer": e.decode_us_per_layer,
                    "precision": e.precision,
                    "name": e.name,
                })).collect::<Vec<_>>(),
            }))
            .collect::<Vec<_>>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::advert::{AdvertModel, AdvertVia};

    fn member(id: u8, relayed: Option<bool>) -> MemberView {
        MemberView {
            advert: Advert {
                node_id: [id; 32],
                seq: 1,
                issued_ms: 0,
                ttl_ms: 5_000,
                quic: format!("10.0.0.{id}:7000"),
                device: "cpu".into(),
                memory_bytes: 1 << 30,
                load: 0,
                models: vec![AdvertModel {
                    package_id: [9; 32],
                    layers: 4,
                    decode_us_per_layer: 100,
                    precision: None,
                    name: None,
                }],
                rtts: Vec::new(),
                via: relayed.map(|relayed| AdvertVia {
                    node_id: [0; 32],
                    quic: "10.0.0.250:7000".into(),
                    relayed,
                }),
            },
            rtt: Some(std::time::Duration::from_micros(500)),
            age_ms: 0,
            member_for_ms: 0,
        }
    }

    /// A member behind a symmetric NAT is planned only when a chain without
    /// it does not fit; one behind a NAT that can be punched is planned as
    /// any other.
    #[test]
    fn a_relayed_member_is_planned_only_when_needed() {
        let shape = ModelShape {
            layer_bytes: vec![100; 4],
            head_bytes: 1_000,
            kv_bytes_per_layer: 10,
        };
        let members = vec![
            member(1, None),
            member(2, Some(true)),
            member(3, Some(false)),
        ];
        let (own, others) = candidates(&[9; 32], &[1; 32], &members).unwrap();
        let two = plan_relayed_last(&shape, &own, &others, Stages::Pinned(2)).unwrap();
        let nodes: Vec<_> = two.stages.iter().map(|s| s.node_id[0]).collect();
        assert_eq!(nodes, vec![1, 3]);
        assert!(two.left_out.contains(&([2; 32], LeftOut::Relayed)));
        let three = plan_relayed_last(&shape, &own, &others, Stages::Pinned(3)).unwrap();
        let mut nodes: Vec<_> = three.stages.iter().map(|s| s.node_id[0]).collect();
        nodes.sort();
        assert_eq!(nodes, vec![1, 2, 3]);
    }
}
