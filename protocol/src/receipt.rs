//! The coordinator receipt block `x-mesh-coordinator-receipt-v1`: what the
//! coordinator routed (`topology`) and what proof it holds of each stage
//! (`stages`). The two lists are never merged.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value, json};

use crate::block::{SplitKey, parse_prefixed_sha256, parse_request_id, prefixed_sha256};
use crate::hex;
use crate::json::{Members, Problem, ShapeError, as_str};

/// The member name of the block inside `compute_attestation`.
pub const RECEIPT_BLOCK_MEMBER: &str = "x-mesh-coordinator-receipt-v1";
/// The `kind` member's only value.
pub const RECEIPT_KIND: &str = "mesh-coordinator-receipt";
/// How long the coordinator waits for stage records unless configured.
pub const DEFAULT_STAGE_SEAL_DEADLINE_MS: u64 = 2000;
/// Most stages a receipt may name; a record-push carries at most 64 records.
pub const MAX_STAGES: usize = 64;

/// Role of a topology entry: stage 0 is always the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HopRole {
    Coordinator,
    Stage,
}

impl HopRole {
    pub fn as_str(self) -> &'static str {
        match self {
            HopRole::Coordinator => "coordinator",
            HopRole::Stage => "stage",
        }
    }
}

/// The slice the coordinator assigned to one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub node_id: String,
    pub layer_start: u32,
    pub layer_end: u32,
    pub package_id: [u8; 32],
}

/// One routed stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyEntry {
    pub role: HopRole,
    pub observation_point: Option<String>,
    pub assignment: Assignment,
}

/// A citation of a record by digest (`{"type","digest_alg","digest"}`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordRef {
    pub ref_type: String,
    pub digest: [u8; 32],
}

impl RecordRef {
    pub fn capsule(digest: [u8; 32]) -> Self {
        Self {
            ref_type: "capsule".into(),
            digest,
        }
    }

    pub fn to_value(&self) -> Value {
        json!({ "type": self.ref_type, "digest_alg": "SHA-256", "digest": hex::encode(&self.digest) })
    }

    fn from_value(value: &Value, path: &str) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, path)?;
        let type_path = m.path("type");
        let ref_type = m.string("type")?;
        if ref_type.trim().is_empty() {
            return Err(ShapeError::invalid(type_path, "must not be blank"));
        }
        let alg_path = m.path("digest_alg");
        if m.string("digest_alg")? != "SHA-256" {
            return Err(ShapeError::invalid(alg_path, "must be SHA-256"));
        }
        let digest_path = m.path("digest");
        let digest = hex::decode_array(m.string("digest")?)
            .ok_or_else(|| ShapeError::invalid(digest_path, "must be 64 lowercase hex digits"))?;
        m.finish()?;
        Ok(Self {
            ref_type: ref_type.to_string(),
            digest,
        })
    }
}

/// What the coordinator holds for one stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageBundle {
    /// Stage 0, or a stage whose record was not asked for.
    NotRequested,
    /// No record arrived by the deadline.
    Absent,
    /// Exactly one record arrived.
    Present(RecordRef),
    /// Two or more distinct records arrived under one stage key (sorted by digest).
    Conflict(Vec<RecordRef>),
}

impl StageBundle {
    pub fn state(&self) -> &'static str {
        match self {
            StageBundle::NotRequested => "not_requested",
            StageBundle::Absent => "absent",
            StageBundle::Present(_) => "present",
            StageBundle::Conflict(_) => "conflict",
        }
    }

    /// Every record digest this entry cites.
    pub fn cited(&self) -> Vec<[u8; 32]> {
        match self {
            StageBundle::Present(reference) => vec![reference.digest],
            StageBundle::Conflict(refs) => refs.iter().map(|r| r.digest).collect(),
            _ => Vec::new(),
        }
    }
}

/// A validated `x-mesh-coordinator-receipt-v1` block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorReceipt {
    pub run_id: String,
    pub topology: Vec<TopologyEntry>,
    /// One per topology entry, same order.
    pub stages: Vec<StageBundle>,
    pub coordinator_node_id: String,
    pub request_id: u64,
    pub stage_seal_deadline_ms: u64,
}

fn hop_id(k: usize) -> String {
    format!("stage-{k}")
}

impl CoordinatorReceipt {
    pub fn split_key(&self) -> SplitKey {
        SplitKey {
            coordinator_node_id: self.coordinator_node_id.clone(),
            run_id: self.run_id.clone(),
            request_id: self.request_id,
        }
    }

    pub fn stage_count(&self) -> usize {
        self.topology.len()
    }

    pub fn from_value(value: &Value) -> Result<Self, ShapeError> {
        Self::from_value_at(value, "")
    }

    /// Parse and validate the block found at `path` of a larger document.
    pub fn from_value_at(value: &Value, path: &str) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, path)?;
        let v_path = m.path("v");
        if m.u64("v")? != 1 {
            return Err(ShapeError::invalid(v_path, "must be 1"));
        }
        let kind_path = m.path("kind");
        if m.string("kind")? != RECEIPT_KIND {
            return Err(ShapeError::invalid(
                kind_path,
                "must be mesh-coordinator-receipt",
            ));
        }
        let run_id = m.non_empty_string("run_id")?.to_string();
        let coordinator_node_id = m.non_empty_string("coordinator_node_id")?.to_string();
        let request_path = m.path("request_id");
        let request_id = match m.required("request_id")? {
            Value::String(text) => parse_request_id(text).ok_or_else(|| {
                ShapeError::invalid(request_path.clone(), "must be a canonical decimal u64")
            })?,
            _ => {
                return Err(ShapeError::new(
                    request_path,
                    Problem::WrongType("a decimal string"),
                ));
            }
        };
        let stage_seal_deadline_ms = m.u64("stage_seal_deadline_ms")?;
        let topology_path = m.path("topology");
        let topology_values = m.array("topology")?;
        let stages_path = m.path("stages");
        let stage_values = m.array("stages")?;
        m.finish()?;

        if topology_values.len() < 2 {
            return Err(ShapeError::invalid(
                topology_path,
                "a split has at least 2 stages",
            ));
        }
        if topology_values.len() > MAX_STAGES {
            return Err(ShapeError::invalid(
                topology_path,
                format!("more than {MAX_STAGES} stages"),
            ));
        }
        if stage_values.len() != topology_values.len() {
            return Err(ShapeError::invalid(
                stages_path,
                "must have one entry per topology entry",
            ));
        }

        let mut topology = Vec::with_capacity(topology_values.len());
        for (k, entry) in topology_values.iter().enumerate() {
            let at = format!("{topology_path}/{k}");
            let mut e = Members::of(entry, &at)?;
            let seq_path = e.path("seq");
            if e.u64("seq")? != k as u64 {
                return Err(ShapeError::invalid(
                    seq_path,
                    format!("must be {k} (entries in stage order)"),
                ));
            }
            let hop_path = e.path("hop_id");
            if e.string("hop_id")? != hop_id(k) {
                return Err(ShapeError::invalid(
                    hop_path,
                    format!("must be {}", hop_id(k)),
                ));
            }
            let role_path = e.path("role");
            let role = match e.string("role")? {
                "coordinator" => HopRole::Coordinator,
                "stage" => HopRole::Stage,
                _ => {
                    return Err(ShapeError::invalid(
                        role_path,
                        "must be coordinator or stage",
                    ));
                }
            };
            let expected_role = if k == 0 {
                HopRole::Coordinator
            } else {
                HopRole::Stage
            };
            if role != expected_role {
                return Err(ShapeError::invalid(
                    role_path,
                    format!("stage {k} must have role {}", expected_role.as_str()),
                ));
            }
            let point_path = e.path("observation_point");
            if !e.present("observation_point") {
                return Err(ShapeError::new(point_path, Problem::Missing));
            }
            let observation_point = e
                .optional("observation_point")
                .map(|v| as_str(v, &point_path).map(str::to_string))
                .transpose()?;
            let assignment_path = e.path("assignment");
            let assignment = assignment(e.required("assignment")?, &assignment_path)?;
            e.finish()?;
            if k == 0 && assignment.node_id != coordinator_node_id {
                return Err(ShapeError::invalid(
                    format!("{assignment_path}/node_id"),
                    "stage 0 must be the coordinator",
                ));
            }
            topology.push(TopologyEntry {
                role,
                observation_point,
                assignment,
            });
        }

        let mut stages = Vec::with_capacity(stage_values.len());
        let mut cited_at: BTreeMap<[u8; 32], usize> = BTreeMap::new();
        for (k, entry) in stage_values.iter().enumerate() {
            let at = format!("{stages_path}/{k}");
            let mut s = Members::of(entry, &at)?;
            let hop_path = s.path("hop_id");
            if s.string("hop_id")? != hop_id(k) {
                return Err(ShapeError::invalid(
                    hop_path,
                    format!("must be {}", hop_id(k)),
                ));
            }
            let bundle_path = s.path("bundle");
            let state = s.string("bundle")?;
            let ref_path = s.path("bundle_ref");
            let single = s
                .optional("bundle_ref")
                .map(|v| RecordRef::from_value(v, &ref_path))
                .transpose()?;
            let refs_path = s.path("bundle_refs");
            let many = match s.optional("bundle_refs") {
                None => None,
                Some(Value::Array(items)) => Some(
                    items
                        .iter()
                        .enumerate()
                        .map(|(i, v)| RecordRef::from_value(v, &format!("{refs_path}/{i}")))
                        .collect::<Result<Vec<_>, _>>()?,
                ),
                Some(_) => return Err(ShapeError::new(refs_path, Problem::WrongType("an array"))),
            };
            s.finish()?;
            let bundle = match (state, single, many) {
                ("not_requested", None, None) => StageBundle::NotRequested,
                ("absent", None, None) => StageBundle::Absent,
                ("not_requested" | "absent", _, _) => {
                    return Err(ShapeError::invalid(
                        at,
                        format!("`{state}` carries no reference"),
                    ));
                }
                ("present", Some(reference), None) => StageBundle::Present(reference),
                ("present", _, _) => {
                    return Err(ShapeError::invalid(
                        at,
                        "`present` carries exactly one bundle_ref",
                    ));
                }
                ("conflict", None, Some(refs)) => {
                    let distinct: BTreeSet<_> = refs.iter().map(|r| r.digest).collect();
                    if refs.len() < 2 || distinct.len() != refs.len() {
                        return Err(ShapeError::invalid(
                            refs_path,
                            "a conflict cites at least 2 distinct records",
                        ));
                    }
                    StageBundle::Conflict(refs)
                }
                ("conflict", _, _) => {
                    return Err(ShapeError::invalid(
                        at,
                        "`conflict` carries only bundle_refs",
                    ));
                }
                _ => {
                    return Err(ShapeError::invalid(
                        bundle_path,
                        "must be not_requested, absent, present or conflict",
                    ));
                }
            };
            if k == 0 && bundle != StageBundle::NotRequested {
                return Err(ShapeError::invalid(
                    bundle_path,
                    "stage 0 must be not_requested",
                ));
            }
            for digest in bundle.cited() {
                if let Some(other) = cited_at.insert(digest, k)
                    && other != k
                {
                    return Err(ShapeError::invalid(
                        at,
                        format!(
                            "record {} is cited under stage {other} too",
                            hex::encode(&digest)
                        ),
                    ));
                }
            }
            stages.push(bundle);
        }

        Ok(Self {
            run_id,
            topology,
            stages,
            coordinator_node_id,
            request_id,
            stage_seal_deadline_ms,
        })
    }

    pub fn to_value(&self) -> Value {
        let topology: Vec<Value> = self
            .topology
            .iter()
            .enumerate()
            .map(|(k, entry)| {
                json!({
                    "seq": k,
                    "hop_id": hop_id(k),
                    "role": entry.role.as_str(),
                    "observation_point": entry.observation_point,
                    "assignment": {
                        "node_id": entry.assignment.node_id,
                        "layer_start": entry.assignment.layer_start,
                        "layer_end": entry.assignment.layer_end,
                        "package_id": prefixed_sha256(&entry.assignment.package_id),
                    }
                })
            })
            .collect();
        let stages: Vec<Value> = self
            .stages
            .iter()
            .enumerate()
            .map(|(k, bundle)| {
                let mut map = Map::new();
                map.insert("hop_id".into(), json!(hop_id(k)));
                map.insert("bundle".into(), json!(bundle.state()));
                match bundle {
                    StageBundle::Present(reference) => {
                        map.insert("bundle_ref".into(), reference.to_value());
                    }
                    StageBundle::Conflict(refs) => {
                        map.insert(
                            "bundle_refs".into(),
                            Value::Array(refs.iter().map(RecordRef::to_value).collect()),
                        );
                    }
                    _ => {}
                }
                Value::Object(map)
            })
            .collect();
        json!({
            "v": 1,
            "kind": RECEIPT_KIND,
            "run_id": self.run_id,
            "topology": topology,
            "stages": stages,
            "coordinator_node_id": self.coordinator_node_id,
            "request_id": self.request_id.to_string(),
            "stage_seal_deadline_ms": self.stage_seal_deadline_ms,
        })
    }
}

fn assignment(value: &Value, path: &str) -> Result<Assignment, ShapeError> {
    let mut m = Members::of(value, path)?;
    let node_id = m.non_empty_string("node_id")?.to_string();
    let layer_start = m.u32("layer_start")?;
    let end_path = m.path("layer_end");
    let layer_end = m.u32("layer_end")?;
    let package_path = m.path("package_id");
    let package_id = parse_prefixed_sha256(m.string("package_id")?).ok_or_else(|| {
        ShapeError::invalid(package_path, "must be sha256: followed by 64 lowercase hex")
    })?;
    m.finish()?;
    if layer_end <= layer_start {
        return Err(ShapeError::invalid(end_path, "must be above layer_start"));
    }
    Ok(Assignment {
        node_id,
        layer_start,
        layer_end,
        package_id,
    })
}

/// Decide a remote stage's receipt entry from the distinct records held for
/// it (§4.3): none is `absent`, one is `present`, two or more is `conflict`
/// with the references ordered by digest. Whether the coordinator asked for
/// the stage's record at all is the caller's (`not_requested`).
pub fn plan_stage(held: &[[u8; 32]]) -> StageBundle {
    let distinct: BTreeSet<[u8; 32]> = held.iter().copied().collect();
    let mut refs: Vec<RecordRef> = distinct.into_iter().map(RecordRef::capsule).collect();
    match refs.len() {
        0 => StageBundle::Absent,
        1 => StageBundle::Present(refs.remove(0)),
        _ => StageBundle::Conflict(refs),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn planning_rules() {
        assert_eq!(plan_stage(&[]), StageBundle::Absent);
        assert_eq!(
            plan_stage(&[[3; 32], [3; 32]]),
            StageBundle::Present(RecordRef::capsule([3; 32]))
        );
        assert_eq!(
            plan_stage(&[[9; 32], [3; 32]]),
            StageBundle::Conflict(vec![
                RecordRef::capsule([3; 32]),
                RecordRef::capsule([9; 32])
            ])
        );
    }

    pub(crate) fn valid_receipt() -> impl Strategy<Value = CoordinatorReceipt> {
        (
            2usize..6,
            any::<u64>(),
            proptest::collection::vec((0u8..4, any::<[u8; 32]>(), any::<[u8; 32]>()), 6),
        )
            .prop_map(|(n, request_id, picks)| {
                let topology = (0..n)
                    .map(|k| TopologyEntry {
                        role: if k == 0 {
                            HopRole::Coordinator
                        } else {
                            HopRole::Stage
                        },
                        observation_point: None,
                        assignment: Assignment {
                            node_id: if k == 0 {
                                "coord".into()
                            } else {
                                format!("node-{k}")
                            },
                            layer_start: k as u32 * 4,
                            layer_end: k as u32 * 4 + 4,
                            package_id: [7; 32],
                        },
                    })
                    .collect();
                let stages = (0..n)
                    .map(|k| {
                        let (pick, mut a, mut b) = picks[k];
                        // Make each stage's digests unique to it.
                        a[0] = k as u8;
                        b[0] = k as u8;
                        b[1] = a[1].wrapping_add(1);
                        match (k, pick) {
                            (0, _) | (_, 0) => StageBundle::NotRequested,
                            (_, 1) => StageBundle::Absent,
                            (_, 2) => StageBundle::Present(RecordRef::capsule(a)),
                            _ => plan_stage(&[a, b]),
                        }
                    })
                    .collect();
                CoordinatorReceipt {
                    run_id: "run".into(),
                    topology,
                    stages,
                    coordinator_node_id: "coord".into(),
                    request_id,
                    stage_seal_deadline_ms: DEFAULT_STAGE_SEAL_DEADLINE_MS,
                }
            })
    }

    proptest! {
        #[test]
        fn round_trips(receipt in valid_receipt()) {
            prop_assert_eq!(CoordinatorReceipt::from_value(&receipt.to_value()), Ok(receipt));
        }
    }
}
