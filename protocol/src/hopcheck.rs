//! The requester's offline hop check: from the coordinator's own slice, its
//! receipt block and the carried stage records, decide for every stage
//! whether its record is usable, and for every hop and lane whether both ends
//! committed to the same bytes.
//!
//! Agreement shows only that both ends of a hop folded the same frames. It
//! does not show that any stage computed correctly, nor that stages are run
//! by independent parties.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use thiserror::Error;

use crate::block::{DirectReturn, ReturnMode, Side, StageBlock, TerminalState};
use crate::fold::{Lane, LaneDigest};
use crate::receipt::{CoordinatorReceipt, StageBundle};

/// A stage's cell in the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CellState {
    /// Stage 0: it would only compare the coordinator with itself.
    CoordinatorSlice,
    Ok,
    /// Its record is of this stage, but its slice or return mode differs
    /// from what was assigned; its lanes are still compared.
    Disagrees,
    NotReceived,
    NotRequested,
    Conflict,
    Rejected,
}

impl CellState {
    pub fn as_str(self) -> &'static str {
        match self {
            CellState::CoordinatorSlice => "coordinator_slice",
            CellState::Ok => "ok",
            CellState::Disagrees => "disagrees",
            CellState::NotReceived => "not_received",
            CellState::NotRequested => "not_requested",
            CellState::Conflict => "conflict",
            CellState::Rejected => "rejected",
        }
    }

    /// The console glyph.
    pub fn glyph(self) -> &'static str {
        match self {
            CellState::CoordinatorSlice => "coordinator",
            CellState::Ok => "✓ ok",
            CellState::Disagrees => "✕ disagrees",
            CellState::NotReceived => "◌ not received",
            CellState::NotRequested => "—",
            CellState::Conflict => "⚠ conflict",
            CellState::Rejected => "✕ rejected",
        }
    }
}

/// The outcome of comparing one lane of one hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LaneState {
    Agree,
    NotApplicable,
    Gap,
    Malformed,
    Break,
}

impl LaneState {
    pub fn as_str(self) -> &'static str {
        match self {
            LaneState::Agree => "agree",
            LaneState::NotApplicable => "not_applicable",
            LaneState::Gap => "gap",
            LaneState::Malformed => "malformed",
            LaneState::Break => "break",
        }
    }

    pub fn glyph(self) -> &'static str {
        match self {
            LaneState::Agree => "✓ agree",
            LaneState::NotApplicable => "— not applicable",
            LaneState::Gap => "◌ gap",
            LaneState::Malformed => "⚠ malformed",
            LaneState::Break => "✕ break",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    pub stage_index: u32,
    pub state: CellState,
    /// The record whose block was used (or refused), when there is one.
    pub record: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneResult {
    pub hop_index: u32,
    pub lane: Lane,
    pub required: bool,
    pub state: LaneState,
    pub upstream: Option<LaneDigest>,
    pub downstream: Option<LaneDigest>,
}

/// The whole result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HopReport {
    pub cells: Vec<Cell>,
    pub lanes: Vec<LaneResult>,
    pub handoffs_agree: bool,
    pub terminal_state: TerminalState,
    pub return_mode: ReturnMode,
}

impl HopReport {
    /// Whether every remote stage's cell is `ok`.
    pub fn all_cells_ok(&self) -> bool {
        self.cells
            .iter()
            .all(|cell| matches!(cell.state, CellState::Ok | CellState::CoordinatorSlice))
    }

    /// The four members of the published `expect` objects, exactly.
    pub fn to_expect_value(&self) -> Value {
        json!({
            "cells": self.cells.iter().map(|c| json!({"stage_index": c.stage_index, "state": c.state.as_str()})).collect::<Vec<_>>(),
            "lanes": self.lanes.iter().map(|l| json!({
                "hop_index": l.hop_index, "lane": l.lane.as_str(), "required": l.required, "state": l.state.as_str()
            })).collect::<Vec<_>>(),
            "handoffs_agree": self.handoffs_agree,
            "terminal_state": self.terminal_state.as_str(),
        })
    }

    /// Each hop's worst lane (break > malformed > gap > not applicable > agree).
    pub fn worst_per_hop(&self) -> BTreeMap<u32, LaneState> {
        let mut worst = BTreeMap::new();
        for lane in &self.lanes {
            let entry = worst.entry(lane.hop_index).or_insert(lane.state);
            if lane.state > *entry {
                *entry = lane.state;
            }
        }
        worst
    }
}

/// A carried stage record as the check sees it: its claimed id, and its
/// block (`None` when the record's id did not recompute or its signature
/// failed, so that it counts as rejected).
#[derive(Debug, Clone, PartialEq)]
pub struct Carried<'a> {
    pub capsule_id: String,
    pub block: Option<&'a Value>,
}

/// The check cannot run: the main record's own inputs are inconsistent.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum HopCheckError {
    #[error("the own-slice block must be side coordinator at stage_index 0")]
    OwnNotCoordinatorSlice,
    #[error("the own-slice block's split key {own} differs from the receipt's {receipt}")]
    SplitKeyMismatch { own: String, receipt: String },
    #[error("the own-slice block says {own} stages but the receipt routes {receipt}")]
    StageCountMismatch { own: u32, receipt: usize },
}

fn compare(
    upstream: Option<LaneDigest>,
    downstream: Option<LaneDigest>,
    required: bool,
) -> LaneState {
    let (Some(a), Some(b)) = (upstream, downstream) else {
        return LaneState::Gap;
    };
    if a.frames == 0 && b.frames == 0 {
        return if required {
            LaneState::Gap
        } else {
            LaneState::NotApplicable
        };
    }
    if a.digest != b.digest {
        return LaneState::Break;
    }
    if a.frames != b.frames {
        return LaneState::Malformed;
    }
    LaneState::Agree
}

/// Run the check (steps A to E).
pub fn check_hops(
    own: &StageBlock,
    receipt: &CoordinatorReceipt,
    carried: &[Carried<'_>],
) -> Result<HopReport, HopCheckError> {
    // Step A.
    if own.side != Side::Coordinator || own.stage_index != 0 {
        return Err(HopCheckError::OwnNotCoordinatorSlice);
    }
    let split_key = receipt.split_key();
    if own.split_key() != split_key {
        return Err(HopCheckError::SplitKeyMismatch {
            own: own.split_key().to_string(),
            receipt: split_key.to_string(),
        });
    }
    let n = receipt.stage_count();
    if usize::try_from(own.stage_count).ok() != Some(n) {
        return Err(HopCheckError::StageCountMismatch {
            own: own.stage_count,
            receipt: n,
        });
    }

    // Step B.
    let mut rejected: BTreeSet<&str> = BTreeSet::new();
    let mut valid: BTreeMap<&str, (StageBlock, &Value)> = BTreeMap::new();
    // One id carried with two different valid blocks (possible where ids
    // are not recomputed, as in a hop case): neither copy can be believed,
    // so every stage either copy claims is conflicted, as is a cell citing
    // that id. Identical copies are one record.
    let mut ambiguous: BTreeSet<&str> = BTreeSet::new();
    let mut claims: Vec<(&str, StageBlock)> = Vec::new();
    for record in carried {
        let id = record.capsule_id.as_str();
        match record
            .block
            .map(|value| (StageBlock::from_value(value), value))
        {
            Some((Ok(block), value)) => match valid.get(id) {
                None => {
                    valid.insert(id, (block, value));
                }
                Some((_, first)) if *first == value => {}
                Some(_) => {
                    ambiguous.insert(id);
                    claims.push((id, block));
                }
            },
            _ => {
                rejected.insert(id);
            }
        }
    }
    claims.extend(valid.iter().map(|(id, (block, _))| (*id, block.clone())));
    let mut ids_per_stage: BTreeMap<u32, BTreeSet<&str>> = BTreeMap::new();
    let mut conflicted: BTreeSet<u32> = BTreeSet::new();
    for (id, block) in &claims {
        if block.side == Side::Stage && block.split_key() == split_key {
            ids_per_stage
                .entry(block.stage_index)
                .or_default()
                .insert(id);
            if ambiguous.contains(id) {
                conflicted.insert(block.stage_index);
            }
        }
    }
    conflicted.extend(
        ids_per_stage
            .iter()
            .filter(|(_, ids)| ids.len() > 1)
            .map(|(k, _)| *k),
    );

    // Step C.
    let mut cells = vec![Cell {
        stage_index: 0,
        state: CellState::CoordinatorSlice,
        record: None,
    }];
    let mut blocks: Vec<Option<&StageBlock>> = vec![Some(own)];
    for (k, (entry, bundle)) in receipt
        .topology
        .iter()
        .zip(&receipt.stages)
        .enumerate()
        .skip(1)
    {
        let index = u32::try_from(k).unwrap_or(u32::MAX);
        let (state, record, block) = if conflicted.contains(&index) {
            (CellState::Conflict, None, None)
        } else {
            match bundle {
                StageBundle::NotRequested => (CellState::NotRequested, None, None),
                StageBundle::Conflict(_) => (CellState::Conflict, None, None),
                StageBundle::Absent => (CellState::NotReceived, None, None),
                StageBundle::Present(reference) => {
                    let id = crate::hex::encode(&reference.digest);
                    if ambiguous.contains(id.as_str()) {
                        (CellState::Conflict, Some(id), None)
                    } else if rejected.contains(id.as_str()) {
                        (CellState::Rejected, Some(id), None)
                    } else {
                        match valid.get(id.as_str()).map(|(block, _)| block) {
                            None => (CellState::NotReceived, Some(id), None),
                            Some(block)
                                if block.side != Side::Stage
                                    || block.stage_index != index
                                    || block.split_key() != split_key
                                    || usize::try_from(block.stage_count).ok() != Some(n) =>
                            {
                                (CellState::Rejected, Some(id), None)
                            }
                            Some(block)
                                if (block.layer_start, block.layer_end, block.package_id)
                                    != (
                                        entry.assignment.layer_start,
                                        entry.assignment.layer_end,
                                        entry.assignment.package_id,
                                    )
                                    || block.return_mode != own.return_mode =>
                            {
                                (CellState::Disagrees, Some(id), Some(block))
                            }
                            Some(block) => (CellState::Ok, Some(id), Some(block)),
                        }
                    }
                }
            }
        };
        cells.push(Cell {
            stage_index: index,
            state,
            record,
        });
        blocks.push(block);
    }

    // Step D.
    let completed = own.terminal_state == TerminalState::Completed;
    let relayed = own.return_mode == ReturnMode::Relayed;
    let mut lanes = Vec::new();
    for h in 0..n.saturating_sub(1) {
        let hop_index = u32::try_from(h).unwrap_or(u32::MAX);
        let up = blocks[h];
        let down = blocks[h + 1];
        let sent = up.and_then(|b| b.downstream).map(|d| d.sent);
        let received = down.and_then(|b| b.upstream).map(|u| u.received);
        lanes.push(LaneResult {
            hop_index,
            lane: Lane::Forward,
            required: true,
            state: compare(sent, received, true),
            upstream: sent,
            downstream: received,
        });
        let replies_sent = down.and_then(|b| b.upstream).map(|u| u.replies_sent);
        let replies_received = up.and_then(|b| b.downstream).map(|d| d.replies_received);
        let required = relayed && completed;
        lanes.push(LaneResult {
            hop_index,
            lane: Lane::Reply,
            required,
            state: compare(replies_sent, replies_received, required),
            // The reply lane's sender is the downstream end.
            upstream: replies_received,
            downstream: replies_sent,
        });
    }
    if !relayed {
        let final_sent = blocks
            .last()
            .copied()
            .flatten()
            .and_then(|b| match b.direct_return {
                Some(DirectReturn::Sent(lane)) => Some(lane),
                _ => None,
            });
        let own_received = match own.direct_return {
            Some(DirectReturn::Received(lane)) => Some(lane),
            _ => None,
        };
        lanes.push(LaneResult {
            hop_index: u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX),
            lane: Lane::DirectReturn,
            required: completed,
            state: compare(final_sent, own_received, completed),
            upstream: own_received,
            downstream: final_sent,
        });
    }

    // Step E.
    let handoffs_agree = lanes
        .iter()
        .all(|l| matches!(l.state, LaneState::Agree | LaneState::NotApplicable))
        && lanes.iter().any(|l| l.state == LaneState::Agree);
    Ok(HopReport {
        cells,
        lanes,
        handoffs_agree,
        terminal_state: own.terminal_state,
        return_mode: own.return_mode,
    })
}
