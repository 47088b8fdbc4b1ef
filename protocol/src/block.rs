//! The `x-mesh-stage-v1` block: what one stage (or the coordinator, about its
//! own slice or about a remote stage) observed of one request.
//!
//! Parsing is strict: unknown members are refused, `request_id` must be a
//! canonical decimal string, and the block must fit one of the three
//! placements (a stage's own record, the coordinator's own slice, a
//! coordinator's stage-exchange record).

use serde_json::{Map, Value, json};

use crate::fold::LaneDigest;
use crate::hex;
use crate::json::{Members, Problem, ShapeError, as_u64};

/// The member name of the block inside `compute_attestation`.
pub const STAGE_BLOCK_MEMBER: &str = "x-mesh-stage-v1";

/// Which party wrote the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    Stage,
    Coordinator,
}

impl Side {
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Stage => "stage",
            Side::Coordinator => "coordinator",
        }
    }
}

/// How replies travel back to stage 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReturnMode {
    /// Hop by hop back up the chain.
    Relayed,
    /// Straight from the final stage to stage 0.
    Direct,
}

impl ReturnMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ReturnMode::Relayed => "relayed",
            ReturnMode::Direct => "direct",
        }
    }
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "relayed" => Some(ReturnMode::Relayed),
            "direct" => Some(ReturnMode::Direct),
            _ => None,
        }
    }
}

/// How a request ended, as the stage that writes the block saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TerminalState {
    Completed,
    PolicyDenied,
    RequestInvalid,
    BackendError,
    TransportError,
    ClientCancelled,
    TimedOut,
    EvidenceUnavailable,
}

impl TerminalState {
    pub const ALL: [TerminalState; 8] = [
        TerminalState::Completed,
        TerminalState::PolicyDenied,
        TerminalState::RequestInvalid,
        TerminalState::BackendError,
        TerminalState::TransportError,
        TerminalState::ClientCancelled,
        TerminalState::TimedOut,
        TerminalState::EvidenceUnavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TerminalState::Completed => "completed",
            TerminalState::PolicyDenied => "policy_denied",
            TerminalState::RequestInvalid => "request_invalid",
            TerminalState::BackendError => "backend_error",
            TerminalState::TransportError => "transport_error",
            TerminalState::ClientCancelled => "client_cancelled",
            TerminalState::TimedOut => "timed_out",
            TerminalState::EvidenceUnavailable => "evidence_unavailable",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|state| state.as_str() == text)
    }
}

/// The folds a stage keeps on its upstream hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upstream {
    pub received: LaneDigest,
    pub replies_sent: LaneDigest,
}

/// The folds a stage keeps on its downstream hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Downstream {
    pub sent: LaneDigest,
    pub replies_received: LaneDigest,
}

/// The direct-return lane, seen from the final stage (`Sent`) or from stage 0
/// (`Received`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectReturn {
    Sent(LaneDigest),
    Received(LaneDigest),
}

/// Tokens the stage handled for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tokens {
    /// Prompt tokens received, including those restored from a prefix cache.
    pub prefill_received: u64,
    pub decode: u64,
}

/// In a stage-exchange record: the coordinator's own folds on the data path
/// it shares with that stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoordinatorObserved {
    /// Stage 0's downstream folds; present iff the record is about stage 1.
    pub downstream: Option<Downstream>,
    /// Stage 0's received direct-return fold; present iff direct and final.
    pub direct_return_received: Option<LaneDigest>,
}

/// Which of the three placements a valid block has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// A stage node's own record (`side: stage`, index >= 1).
    StageRecord,
    /// The coordinator's own slice (`side: coordinator`, index 0).
    CoordinatorSlice,
    /// The coordinator's record about remote stage k (`side: coordinator`, k >= 1).
    StageExchange,
}

/// A validated `x-mesh-stage-v1` block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageBlock {
    pub side: Side,
    pub coordinator_node_id: String,
    pub run_id: String,
    pub request_id: u64,
    pub topology_hash: String,
    pub stage_index: u32,
    pub stage_count: u32,
    pub layer_start: u32,
    /// Exclusive.
    pub layer_end: u32,
    /// Package-wide SHA-256, written `sha256:<hex>`.
    pub package_id: [u8; 32],
    pub manifest_sha256: [u8; 32],
    pub source_model_sha256: [u8; 32],
    pub return_mode: ReturnMode,
    pub upstream: Option<Upstream>,
    pub downstream: Option<Downstream>,
    pub direct_return: Option<DirectReturn>,
    pub tokens: Option<Tokens>,
    pub terminal_state: TerminalState,
    pub coordinator_term: Option<u64>,
    pub data_path_observed: Option<bool>,
    pub coordinator_observed: Option<CoordinatorObserved>,
}

/// The key two records must share to describe the same stage of one split.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SplitKey {
    pub coordinator_node_id: String,
    pub run_id: String,
    pub request_id: u64,
}

impl std::fmt::Display for SplitKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "split:{}/{}/{}",
            self.coordinator_node_id, self.run_id, self.request_id
        )
    }
}

/// Parse a canonical decimal u64: ASCII digits, non-empty, no leading zero
/// unless exactly `"0"`, at most `u64::MAX`.
pub fn parse_request_id(text: &str) -> Option<u64> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if !canonical {
        return None;
    }
    text.parse().ok()
}

/// Parse `sha256:` + 64 lowercase hex.
pub fn parse_prefixed_sha256(text: &str) -> Option<[u8; 32]> {
    hex::decode_array(text.strip_prefix("sha256:")?)
}

pub fn prefixed_sha256(digest: &[u8; 32]) -> String {
    format!("sha256:{}", hex::encode(digest))
}

fn lane_digest(value: &Value, path: &str) -> Result<LaneDigest, ShapeError> {
    let mut members = Members::of(value, path)?;
    let frames = members.u64("frames")?;
    let digest_path = members.path("digest");
    let digest = parse_prefixed_sha256(members.string("digest")?).ok_or_else(|| {
        ShapeError::invalid(digest_path, "must be sha256: followed by 64 lowercase hex")
    })?;
    members.finish()?;
    Ok(LaneDigest { frames, digest })
}

fn lane_value(lane: &LaneDigest) -> Value {
    json!({ "frames": lane.frames, "digest": lane.digest_string() })
}

fn upstream(value: &Value, path: &str) -> Result<Upstream, ShapeError> {
    let mut members = Members::of(value, path)?;
    let received = lane_digest(members.required("received")?, &members.path("received"))?;
    let replies_sent = lane_digest(
        members.required("replies_sent")?,
        &members.path("replies_sent"),
    )?;
    members.finish()?;
    Ok(Upstream {
        received,
        replies_sent,
    })
}

fn downstream(value: &Value, path: &str) -> Result<Downstream, ShapeError> {
    let mut members = Members::of(value, path)?;
    let sent = lane_digest(members.required("sent")?, &members.path("sent"))?;
    let replies_received = lane_digest(
        members.required("replies_received")?,
        &members.path("replies_received"),
    )?;
    members.finish()?;
    Ok(Downstream {
        sent,
        replies_received,
    })
}

fn direct_return(value: &Value, path: &str) -> Result<DirectReturn, ShapeError> {
    let map = value
        .as_object()
        .ok_or_else(|| ShapeError::new(path, Problem::WrongType("an object or null")))?;
    let mut members = Members::of(value, path)?;
    let parsed = match (map.contains_key("sent"), map.contains_key("received")) {
        (true, false) => DirectReturn::Sent(lane_digest(
            members.required("sent")?,
            &members.path("sent"),
        )?),
        (false, true) => DirectReturn::Received(lane_digest(
            members.required("received")?,
            &members.path("received"),
        )?),
        _ => {
            return Err(ShapeError::invalid(
                path,
                "must hold exactly one of `sent` or `received`",
            ));
        }
    };
    members.finish()?;
    Ok(parsed)
}

fn tokens(value: &Value, path: &str) -> Result<Tokens, ShapeError> {
    let mut members = Members::of(value, path)?;
    let prefill_received = members.u64("prefill_received")?;
    let decode = members.u64("decode")?;
    members.finish()?;
    Ok(Tokens {
        prefill_received,
        decode,
    })
}

fn coordinator_observed(value: &Value, path: &str) -> Result<CoordinatorObserved, ShapeError> {
    let mut members = Members::of(value, path)?;
    let downstream_path = members.path("downstream");
    let observed_downstream = members
        .optional("downstream")
        .map(|v| downstream(v, &downstream_path))
        .transpose()?;
    let direct_path = members.path("direct_return");
    let direct = members
        .optional("direct_return")
        .map(|v| direct_return(v, &direct_path))
        .transpose()?;
    members.finish()?;
    let direct_return_received = match direct {
        None => None,
        Some(DirectReturn::Received(lane)) => Some(lane),
        Some(DirectReturn::Sent(_)) => {
            return Err(ShapeError::invalid(
                direct_path,
                "the coordinator only receives on the direct lane",
            ));
        }
    };
    Ok(CoordinatorObserved {
        downstream: observed_downstream,
        direct_return_received,
    })
}

fn hex32(members: &mut Members<'_>, key: &'static str) -> Result<[u8; 32], ShapeError> {
    let path = members.path(key);
    hex::decode_array(members.string(key)?)
        .ok_or_else(|| ShapeError::invalid(path, "must be 64 lowercase hex digits"))
}

fn rule(path: &str, why: &str) -> ShapeError {
    ShapeError::invalid(if path.is_empty() { "/" } else { path }, why)
}

impl StageBlock {
    /// The block's split key.
    pub fn split_key(&self) -> SplitKey {
        SplitKey {
            coordinator_node_id: self.coordinator_node_id.clone(),
            run_id: self.run_id.clone(),
            request_id: self.request_id,
        }
    }

    pub fn is_final(&self) -> bool {
        self.stage_index.checked_add(1) == Some(self.stage_count)
    }

    /// Which placement the block has (valid blocks only have these three).
    pub fn placement(&self) -> Placement {
        match (self.side, self.stage_index) {
            (Side::Stage, _) => Placement::StageRecord,
            (Side::Coordinator, 0) => Placement::CoordinatorSlice,
            (Side::Coordinator, _) => Placement::StageExchange,
        }
    }

    /// Parse and validate a block found at `path` of a larger document.
    pub fn from_value_at(value: &Value, path: &str) -> Result<Self, ShapeError> {
        let mut m = Members::of(value, path)?;
        let version_path = m.path("v");
        if m.u64("v")? != 1 {
            return Err(ShapeError::invalid(version_path, "must be 1"));
        }
        let side_path = m.path("side");
        let side = match m.string("side")? {
            "stage" => Side::Stage,
            "coordinator" => Side::Coordinator,
            _ => {
                return Err(ShapeError::invalid(
                    side_path,
                    "must be stage or coordinator",
                ));
            }
        };
        let coordinator_node_id = m.non_empty_string("coordinator_node_id")?.to_string();
        let run_id = m.non_empty_string("run_id")?.to_string();
        let request_path = m.path("request_id");
        let request_id = match m.required("request_id")? {
            Value::String(text) => parse_request_id(text).ok_or_else(|| {
                ShapeError::invalid(
                    request_path.clone(),
                    "must be a canonical decimal u64 (digits, no leading zero, at most 18446744073709551615)",
                )
            })?,
            _ => {
                return Err(ShapeError::new(
                    request_path,
                    Problem::WrongType("a decimal string"),
                ));
            }
        };
        let topology_hash = m.non_empty_string("topology_hash")?.to_string();
        let stage_index = m.u32("stage_index")?;
        let stage_count = m.u32("stage_count")?;
        let layer_start = m.u32("layer_start")?;
        let layer_end = m.u32("layer_end")?;
        let package_path = m.path("package_id");
        let package_id = parse_prefixed_sha256(m.string("package_id")?).ok_or_else(|| {
            ShapeError::invalid(package_path, "must be sha256: followed by 64 lowercase hex")
        })?;
        let manifest_sha256 = hex32(&mut m, "manifest_sha256")?;
        let source_model_sha256 = hex32(&mut m, "source_model_sha256")?;
        let mode_path = m.path("return_mode");
        let return_mode = ReturnMode::parse(m.string("return_mode")?)
            .ok_or_else(|| ShapeError::invalid(mode_path, "must be direct or relayed"))?;
        let up_path = m.path("upstream");
        let up = m
            .optional("upstream")
            .map(|v| upstream(v, &up_path))
            .transpose()?;
        let down_path = m.path("downstream");
        let down = m
            .optional("downstream")
            .map(|v| downstream(v, &down_path))
            .transpose()?;
        let direct_path = m.path("direct_return");
        let direct = m
            .optional("direct_return")
            .map(|v| direct_return(v, &direct_path))
            .transpose()?;
        let tokens_path = m.path("tokens");
        let token_counts = m
            .optional("tokens")
            .map(|v| tokens(v, &tokens_path))
            .transpose()?;
        let terminal_path = m.path("terminal_state");
        let terminal_state = TerminalState::parse(m.string("terminal_state")?)
            .ok_or_else(|| ShapeError::invalid(terminal_path, "not a known terminal state"))?;
        let term_path = m.path("coordinator_term");
        let coordinator_term = m
            .optional("coordinator_term")
            .map(|v| as_u64(v, &term_path))
            .transpose()?;
        let observed_flag_path = m.path("data_path_observed");
        let data_path_observed = m
            .optional("data_path_observed")
            .map(|v| {
                v.as_bool().ok_or_else(|| {
                    ShapeError::new(observed_flag_path.clone(), Problem::WrongType("a boolean"))
                })
            })
            .transpose()?;
        let observed_path = m.path("coordinator_observed");
        let observed = m
            .optional("coordinator_observed")
            .map(|v| coordinator_observed(v, &observed_path))
            .transpose()?;
        m.finish()?;

        let block = StageBlock {
            side,
            coordinator_node_id,
            run_id,
            request_id,
            topology_hash,
            stage_index,
            stage_count,
            layer_start,
            layer_end,
            package_id,
            manifest_sha256,
            source_model_sha256,
            return_mode,
            upstream: up,
            downstream: down,
            direct_return: direct,
            tokens: token_counts,
            terminal_state,
            coordinator_term,
            data_path_observed,
            coordinator_observed: observed,
        };
        block.check_rules(path)?;
        Ok(block)
    }

    /// Parse and validate a block given on its own.
    pub fn from_value(value: &Value) -> Result<Self, ShapeError> {
        Self::from_value_at(value, "")
    }

    /// The rules of placement and range, beyond member shapes.
    fn check_rules(&self, path: &str) -> Result<(), ShapeError> {
        let at = |member: &str| format!("{path}/{member}");
        if self.stage_count < 2 {
            return Err(rule(&at("stage_count"), "a split has at least 2 stages"));
        }
        if self.stage_index >= self.stage_count {
            return Err(rule(&at("stage_index"), "must be below stage_count"));
        }
        if self.layer_end <= self.layer_start {
            return Err(rule(
                &at("layer_end"),
                "must be above layer_start (the range is half-open)",
            ));
        }
        let direct = self.return_mode == ReturnMode::Direct;
        let is_final = self.is_final();
        let has_exchange_fields = self.coordinator_term.is_some()
            || self.data_path_observed.is_some()
            || self.coordinator_observed.is_some();
        match self.placement() {
            Placement::StageRecord => {
                if self.stage_index == 0 {
                    return Err(rule(
                        &at("stage_index"),
                        "a stage-side block cannot be stage 0",
                    ));
                }
                if has_exchange_fields {
                    return Err(rule(
                        path,
                        "a stage record carries no stage-exchange fields",
                    ));
                }
                if self.upstream.is_none() {
                    return Err(rule(&at("upstream"), "a stage record requires upstream"));
                }
                match (is_final, self.downstream.is_some()) {
                    (false, false) => {
                        return Err(rule(
                            &at("downstream"),
                            "a non-final stage requires downstream",
                        ));
                    }
                    (true, true) => {
                        return Err(rule(&at("downstream"), "the final stage has no downstream"));
                    }
                    _ => {}
                }
                match (direct && is_final, self.direct_return) {
                    (true, Some(DirectReturn::Sent(_))) | (false, None) => {}
                    (true, _) => {
                        return Err(rule(
                            &at("direct_return"),
                            "the final stage of a direct split must carry {sent}",
                        ));
                    }
                    (false, Some(_)) => {
                        return Err(rule(
                            &at("direct_return"),
                            "only the final stage of a direct split has a direct lane",
                        ));
                    }
                }
                if self.tokens.is_none() {
                    return Err(rule(&at("tokens"), "a stage record requires tokens"));
                }
            }
            Placement::CoordinatorSlice => {
                if has_exchange_fields {
                    return Err(rule(
                        path,
                        "the coordinator's slice carries no stage-exchange fields",
                    ));
                }
                if self.upstream.is_some() {
                    return Err(rule(&at("upstream"), "stage 0 has no upstream"));
                }
                if self.downstream.is_none() {
                    return Err(rule(
                        &at("downstream"),
                        "the coordinator's slice requires downstream",
                    ));
                }
                match (direct, self.direct_return) {
                    (true, Some(DirectReturn::Received(_))) | (false, None) => {}
                    (true, _) => {
                        return Err(rule(
                            &at("direct_return"),
                            "a direct split's coordinator slice must carry {received}",
                        ));
                    }
                    (false, Some(_)) => {
                        return Err(rule(
                            &at("direct_return"),
                            "a relayed split has no direct lane",
                        ));
                    }
                }
                if self.tokens.is_none() {
                    return Err(rule(
                        &at("tokens"),
                        "the coordinator's slice requires tokens",
                    ));
                }
            }
            Placement::StageExchange => {
                if self.upstream.is_some() || self.downstream.is_some() || self.tokens.is_some() {
                    return Err(rule(
                        path,
                        "a stage-exchange record carries no upstream, downstream or tokens",
                    ));
                }
                if self.direct_return.is_some() {
                    return Err(rule(
                        &at("direct_return"),
                        "must be null in a stage-exchange record",
                    ));
                }
                if self.coordinator_term.is_none() {
                    return Err(rule(
                        &at("coordinator_term"),
                        "a stage-exchange record requires it",
                    ));
                }
                let expected = self.stage_index == 1 || (direct && is_final);
                match self.data_path_observed {
                    None => {
                        return Err(rule(
                            &at("data_path_observed"),
                            "a stage-exchange record requires it",
                        ));
                    }
                    Some(flag) if flag != expected => {
                        return Err(rule(
                            &at("data_path_observed"),
                            "must be true exactly for stage 1 and for the final stage of a direct split",
                        ));
                    }
                    Some(_) => {}
                }
                match (expected, &self.coordinator_observed) {
                    (false, None) => {}
                    (false, Some(_)) => {
                        return Err(rule(
                            &at("coordinator_observed"),
                            "present only when data_path_observed is true",
                        ));
                    }
                    (true, None) => {
                        return Err(rule(
                            &at("coordinator_observed"),
                            "required when data_path_observed is true",
                        ));
                    }
                    (true, Some(observed)) => {
                        if observed.downstream.is_some() != (self.stage_index == 1) {
                            return Err(rule(
                                &at("coordinator_observed/downstream"),
                                "present exactly when the record is about stage 1",
                            ));
                        }
                        if observed.direct_return_received.is_some() != (direct && is_final) {
                            return Err(rule(
                                &at("coordinator_observed/direct_return"),
                                "present exactly for the final stage of a direct split",
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The block as JSON, in the producer's member order (`direct_return` is
    /// always written, `null` when absent).
    pub fn to_value(&self) -> Value {
        let mut map = Map::new();
        map.insert("v".into(), json!(1));
        map.insert("side".into(), json!(self.side.as_str()));
        map.insert(
            "coordinator_node_id".into(),
            json!(self.coordinator_node_id),
        );
        map.insert("run_id".into(), json!(self.run_id));
        map.insert("request_id".into(), json!(self.request_id.to_string()));
        map.insert("topology_hash".into(), json!(self.topology_hash));
        map.insert("stage_index".into(), json!(self.stage_index));
        map.insert("stage_count".into(), json!(self.stage_count));
        map.insert("layer_start".into(), json!(self.layer_start));
        map.insert("layer_end".into(), json!(self.layer_end));
        map.insert(
            "package_id".into(),
            json!(prefixed_sha256(&self.package_id)),
        );
        map.insert(
            "manifest_sha256".into(),
            json!(hex::encode(&self.manifest_sha256)),
        );
        map.insert(
            "source_model_sha256".into(),
            json!(hex::encode(&self.source_model_sha256)),
        );
        map.insert("return_mode".into(), json!(self.return_mode.as_str()));
        if let Some(up) = &self.upstream {
            map.insert(
                "upstream".into(),
                json!({ "received": lane_value(&up.received), "replies_sent": lane_value(&up.replies_sent) }),
            );
        }
        if let Some(down) = &self.downstream {
            map.insert("downstream".into(), downstream_value(down));
        }
        map.insert(
            "direct_return".into(),
            match &self.direct_return {
                None => Value::Null,
                Some(DirectReturn::Sent(lane)) => json!({ "sent": lane_value(lane) }),
                Some(DirectReturn::Received(lane)) => json!({ "received": lane_value(lane) }),
            },
        );
        if let Some(tokens) = &self.tokens {
            map.insert(
                "tokens".into(),
                json!({ "prefill_received": tokens.prefill_received, "decode": tokens.decode }),
            );
        }
        map.insert("terminal_state".into(), json!(self.terminal_state.as_str()));
        if let Some(term) = self.coordinator_term {
            map.insert("coordinator_term".into(), json!(term));
        }
        if let Some(flag) = self.data_path_observed {
            map.insert("data_path_observed".into(), json!(flag));
        }
        if let Some(observed) = &self.coordinator_observed {
            let mut inner = Map::new();
            if let Some(down) = &observed.downstream {
                inner.insert("downstream".into(), downstream_value(down));
            }
            if let Some(lane) = &observed.direct_return_received {
                inner.insert(
                    "direct_return".into(),
                    json!({ "received": lane_value(lane) }),
                );
            }
            map.insert("coordinator_observed".into(), Value::Object(inner));
        }
        Value::Object(map)
    }
}

fn downstream_value(down: &Downstream) -> Value {
    json!({ "sent": lane_value(&down.sent), "replies_received": lane_value(&down.replies_received) })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn request_id_rules() {
        assert_eq!(parse_request_id("0"), Some(0));
        assert_eq!(parse_request_id("18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_request_id("18446744073709551616"), None);
        assert_eq!(parse_request_id("007"), None);
        assert_eq!(parse_request_id(""), None);
        assert_eq!(parse_request_id("+7"), None);
        assert_eq!(parse_request_id(" 7"), None);
    }

    fn lane() -> impl Strategy<Value = LaneDigest> {
        (any::<u64>(), any::<[u8; 32]>()).prop_map(|(frames, digest)| LaneDigest { frames, digest })
    }

    /// Any valid block, in any of the three placements.
    pub(crate) fn valid_block() -> impl Strategy<Value = StageBlock> {
        (
            2u32..6,
            any::<u32>(),
            any::<bool>(),
            (0u32..3),
            any::<u64>(),
            (lane(), lane(), lane(), lane(), lane()),
            (
                any::<u32>(),
                1u32..1000,
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
            ),
            (0usize..8, any::<[u8; 32]>()),
        )
            .prop_map(
                |(count, index_seed, direct, placement, request_id, lanes, nums, misc)| {
                    let (a, b, c, d, e) = lanes;
                    let (layer_start_seed, width, term, prefill, decode) = nums;
                    let (state, digest) = misc;
                    let return_mode = if direct {
                        ReturnMode::Direct
                    } else {
                        ReturnMode::Relayed
                    };
                    let side = if placement == 0 {
                        Side::Stage
                    } else {
                        Side::Coordinator
                    };
                    let stage_index = match placement {
                        1 => 0,
                        _ => 1 + index_seed % (count - 1),
                    };
                    let is_final = stage_index + 1 == count;
                    let layer_start = layer_start_seed % 100_000;
                    let mut block = StageBlock {
                        side,
                        coordinator_node_id: "coord".into(),
                        run_id: format!("mesh-split-{term}"),
                        request_id,
                        topology_hash: "t".into(),
                        stage_index,
                        stage_count: count,
                        layer_start,
                        layer_end: layer_start + width,
                        package_id: digest,
                        manifest_sha256: [1; 32],
                        source_model_sha256: [2; 32],
                        return_mode,
                        upstream: None,
                        downstream: None,
                        direct_return: None,
                        tokens: None,
                        terminal_state: TerminalState::ALL[state],
                        coordinator_term: None,
                        data_path_observed: None,
                        coordinator_observed: None,
                    };
                    let tokens = Some(Tokens {
                        prefill_received: prefill,
                        decode,
                    });
                    match block.placement() {
                        Placement::StageRecord => {
                            block.upstream = Some(Upstream {
                                received: a,
                                replies_sent: b,
                            });
                            if !is_final {
                                block.downstream = Some(Downstream {
                                    sent: c,
                                    replies_received: d,
                                });
                            }
                            if direct && is_final {
                                block.direct_return = Some(DirectReturn::Sent(e));
                            }
                            block.tokens = tokens;
                        }
                        Placement::CoordinatorSlice => {
                            block.downstream = Some(Downstream {
                                sent: c,
                                replies_received: d,
                            });
                            if direct {
                                block.direct_return = Some(DirectReturn::Received(e));
                            }
                            block.tokens = tokens;
                        }
                        Placement::StageExchange => {
                            block.coordinator_term = Some(term);
                            let observed = stage_index == 1 || (direct && is_final);
                            block.data_path_observed = Some(observed);
                            if observed {
                                block.coordinator_observed = Some(CoordinatorObserved {
                                    downstream: (stage_index == 1).then_some(Downstream {
                                        sent: c,
                                        replies_received: d,
                                    }),
                                    direct_return_received: (direct && is_final).then_some(e),
                                });
                            }
                        }
                    }
                    block
                },
            )
    }

    proptest! {
        #[test]
        fn round_trips(block in valid_block()) {
            let value = block.to_value();
            prop_assert_eq!(StageBlock::from_value(&value), Ok(block));
        }

        #[test]
        fn never_panics_on_mutated_members(block in valid_block(), key_index in 0usize..24, replacement in prop_oneof![
            Just(Value::Null), Just(json!(0)), Just(json!("0")), Just(json!(-1)), Just(json!(1.5)),
            Just(json!({})), Just(json!([])), Just(json!(u64::MAX)), Just(json!("sha256:")),
        ]) {
            let mut value = block.to_value();
            if let Value::Object(map) = &mut value {
                let keys: Vec<String> = map.keys().cloned().collect();
                let key = keys[key_index % keys.len()].clone();
                map.insert(key, replacement);
            }
            let _ = StageBlock::from_value(&value);
        }
    }
}
