//! The planner: contiguous layer ranges over the members that hold a model,
//! chosen by a cost model of what they measured (docs/mesh.md works an
//! example). Pure and deterministic: the same model and candidates give
//! the same plan.
//!
//! Cost of one decode step, microseconds:
//!
//! ```text
//! projected = sum over stages k of  layers_k * decode_us_per_layer_k
//!           + sum over stages k >= 1 of  hop_us_k
//!           + return_us of the final stage (when there are 2 or more)
//! ```
//!
//! `hop_us_k` is the one-way trip into stage k from stage k - 1, plus a
//! fixed per-hop cost: half the round trip between the two as either
//! measured it (members name theirs in their adverts; the coordinator's
//! own are its pings), else half the coordinator's round trip to stage k.
//! A hop into a member behind a symmetric NAT goes through its relay: the
//! two legs' delays and one more per-hop cost. The final stage's answer
//! comes straight back to the coordinator (direct return), half its round
//! trip. A stage may hold layers `[a, b)` when their weights plus the
//! KV cache of `b - a` layers fit the memory it offers (stage 0, the
//! coordinator, also holds the embedding and the output head).
//!
//! Hops depend on the order of the stages, so the members are put in one
//! order first, as a route: from the coordinator, each time to the nearest
//! member not yet placed (the fastest of those within `ROUTE_SLACK_US` of
//! the nearest, so that jitter does not reorder a LAN). The search then
//! picks which of them to use, in that order, and their layers, exactly.
//!
//! Among the splits of the fewest-cost projection, the one whose slowest
//! stage is fastest wins (that is what bounds throughput under load), then
//! the first in a fixed order. A stage is added only when it lowers the
//! projection or the model does not fit otherwise, unless the number of
//! stages is pinned.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::advert::MAX_ADVERT_RTTS;

/// The most stages a plan has.
pub const MAX_PLAN_STAGES: usize = 16;
/// The most layers a model may have to be planned.
pub const MAX_PLAN_LAYERS: usize = 1024;
/// What each hop costs besides the wire's delay: framing, folding,
/// wake-ups (about 0.5 ms measured on loopback, docs/BENCHMARKS.md).
pub const PER_HOP_OVERHEAD_US: u64 = 500;

/// The model as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    /// Stored bytes of each layer's weights.
    pub layer_bytes: Vec<u64>,
    /// Bytes only stage 0 holds: the embedding and the output head.
    pub head_bytes: u64,
    /// KV cache bytes one layer needs for the configured context, at f16
    /// (a member holding f32 counts twice this: `Candidate::kv_scale`).
    pub kv_bytes_per_layer: u64,
}

/// A node the plan may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub node_id: [u8; 32],
    /// Memory offered for weights and KV, bytes.
    pub memory_bytes: u64,
    /// Measured decode time of one layer for one token.
    pub decode_us_per_layer: u64,
    /// The coordinator's measured round trip to it (0 for itself).
    pub rtt_us: u64,
    /// Its KV cache bytes per byte `ModelShape::kv_bytes_per_layer`
    /// counts: 1 where its caches hold f16 (the engine's own attention, on
    /// a CPU), 2 where they hold f32 (candle's, on a GPU).
    pub kv_scale: u64,
    /// Round trips it measured to other members, microseconds (its
    /// advert's `rtts`).
    pub rtts: Vec<([u8; 32], u64)>,
    /// It is behind a symmetric NAT, reached only through this member's
    /// relay.
    pub relayed_by: Option<[u8; 32]>,
}

impl Candidate {
    /// The KV cache bytes `layers` layers take on this node.
    fn kv_bytes(&self, model: &ModelShape, layers: u64) -> u64 {
        layers
            .saturating_mul(model.kv_bytes_per_layer)
            .saturating_mul(self.kv_scale.max(1))
    }
}

/// Hops within this of the nearest are equally near when the route is
/// ordered (members within 10 ms round trip of each other are one region):
/// round trips on a loaded LAN jitter by milliseconds, and a plan should
/// not change with the jitter; the faster member goes first.
pub const ROUTE_SLACK_US: u64 = 5_000;

/// The round trips between the plan's nodes, and who is reached through a
/// relay: what a hop between two costs.
///
/// A member's claims are its own: it could claim to be near others to draw
/// work (and prompts' activations) to itself. So a claim is never taken
/// below what the coordinator measured itself: a link between `a` and `b`
/// is at least `|rtt(C, a) - rtt(C, b)|` (two sides of a triangle), at
/// least the other end's claim where it made one, and at least the other
/// end's farthest listed member where that end lists its full
/// `MAX_ADVERT_RTTS` nearest and `a` is not among them; a hop from the
/// coordinator is never below its own ping.
#[derive(Debug, Default)]
struct Links {
    coordinator: [u8; 32],
    /// The coordinator's own round trip to each member it measured.
    from_coordinator: BTreeMap<[u8; 32], u64>,
    /// What each member claims: its round trips by member.
    claims: BTreeMap<[u8; 32], BTreeMap<[u8; 32], u64>>,
    relays: BTreeMap<[u8; 32], [u8; 32]>,
}

impl Links {
    fn of(coordinator: &Candidate, members: &[(Candidate, Option<LeftOut>)]) -> Self {
        let mut links = Links {
            coordinator: coordinator.node_id,
            ..Links::default()
        };
        for (node, reason) in std::iter::once((coordinator, &None))
            .chain(members.iter().map(|(c, reason)| (c, reason)))
        {
            // A member without a measured round trip has none to stand on.
            if node.node_id != coordinator.node_id && *reason != Some(LeftOut::NotConnected) {
                links.from_coordinator.insert(node.node_id, node.rtt_us);
            }
            let listed = node
                .rtts
                .iter()
                .filter(|(peer, _)| *peer != node.node_id)
                .copied()
                .collect();
            links.claims.insert(node.node_id, listed);
            if let Some(relay) = node.relayed_by {
                links.relays.insert(node.node_id, relay);
            }
        }
        links
    }

    /// What `claimer` says of `other`, or what its full list implies (at
    /// least its farthest listed member); `None` when it says nothing.
    fn claim(&self, claimer: &[u8; 32], other: &[u8; 32]) -> Option<u64> {
        let listed = self.claims.get(claimer)?;
        match listed.get(other) {
            Some(rtt_us) => Some(*rtt_us),
            None if listed.len() >= MAX_ADVERT_RTTS => listed.values().max().copied(),
            None => None,
        }
    }

    fn rtt_us(&self, a: &[u8; 32], b: &[u8; 32]) -> Option<u64> {
        if *a == self.coordinator {
            return self.from_coordinator.get(b).copied();
        }
        if *b == self.coordinator {
            return self.from_coordinator.get(a).copied();
        }
        let said = match (self.claim(a, b), self.claim(b, a)) {
            (None, None) => return None,
            (one, other) => one.max(other).unwrap_or(0),
        };
        let triangle = match (self.from_coordinator.get(a), self.from_coordinator.get(b)) {
            (Some(x), Some(y)) => x.abs_diff(*y),
            _ => 0,
        };
        Some(said.max(triangle))
    }

    /// A step's trip from `from` into `to`, microseconds: half the round
    /// trip (through `to`'s relay when it has one; the coordinator's ping
    /// to `to` where a leg is unknown), plus the per-hop cost of each node
    /// that handles it on the way.
    fn hop_us(&self, from: &[u8; 32], to: &Candidate) -> u64 {
        let direct = |a: &[u8; 32], b: &[u8; 32]| self.rtt_us(a, b);
        let relayed = self
            .relays
            .get(&to.node_id)
            .filter(|relay| *relay != from)
            .map(|relay| {
                direct(from, relay)
                    .zip(direct(relay, &to.node_id))
                    .map(|(a, b)| a.saturating_add(b))
                    .unwrap_or(to.rtt_us)
            });
        let (mut rtt_us, handled) = match relayed {
            Some(rtt_us) => (rtt_us, 2),
            None => (direct(from, &to.node_id).unwrap_or(to.rtt_us), 1),
        };
        if *from == self.coordinator {
            rtt_us = rtt_us.max(to.rtt_us);
        }
        (rtt_us / 2).saturating_add(PER_HOP_OVERHEAD_US * handled)
    }

    /// The final stage's answer back to the coordinator.
    fn return_us(&self, last: &Candidate) -> u64 {
        last.rtt_us / 2
    }

    /// The members as a route: from the coordinator, each time to the
    /// first in `members` (fastest first) of those nearest the last one
    /// placed, to within `ROUTE_SLACK_US`.
    fn route<'a>(&self, mut members: Vec<&'a Candidate>) -> Vec<&'a Candidate> {
        let mut route = Vec::with_capacity(members.len());
        let mut at = self.coordinator;
        while !members.is_empty() {
            let hops: Vec<u64> = members.iter().map(|m| self.hop_us(&at, m)).collect();
            let reach = hops
                .iter()
                .min()
                .copied()
                .unwrap_or(0)
                .saturating_add(ROUTE_SLACK_US);
            let nearest = hops.iter().position(|hop| *hop <= reach).unwrap_or(0);
            let next = members.remove(nearest);
            at = next.node_id;
            route.push(next);
        }
        route
    }
}

/// Why a member is not in the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeftOut {
    /// Its advert does not name the model's package.
    NoModel,
    /// It cannot hold even the smallest layer with its KV cache.
    NotEnoughMemory { offered: u64, smallest_layer: u64 },
    /// A plan with it was no faster than one without.
    TooSlowToHelp,
    /// Its advert expired.
    Stale,
    /// The coordinator holds no connection to it, so nothing of what it
    /// claims was seen (its round trip is unmeasured).
    NotConnected,
    /// It refused its last assignment (the coordinator goes around it for
    /// a while).
    Refused,
    /// Its output failed an audit: the coordinator ran its layers on the
    /// same input and got other bytes (it goes around it for a while).
    FailedAudit,
    /// It accepted a step and did not answer within the step timeout (it
    /// goes around it for a while).
    Stalled,
    /// It is behind a symmetric NAT, reached only through a relay: planned
    /// only when no chain without such members fits.
    Relayed,
}

impl LeftOut {
    pub fn describe(&self) -> String {
        match self {
            LeftOut::NoModel => "does not hold the model".into(),
            LeftOut::NotEnoughMemory {
                offered,
                smallest_layer,
            } => format!(
                "not enough memory: offers {offered} B, one layer with its KV needs {smallest_layer} B"
            ),
            LeftOut::TooSlowToHelp => "not needed: a plan with it is no faster".into(),
            LeftOut::Stale => "its advert expired".into(),
            LeftOut::NotConnected => "not connected: no measured round trip".into(),
            LeftOut::Refused => "refused its last assignment".into(),
            LeftOut::FailedAudit => "failed an audit: its output was not its layers'".into(),
            LeftOut::Stalled => "stalled on a step past the step timeout".into(),
            LeftOut::Relayed => "behind a symmetric NAT (relayed): a chain without it fits".into(),
        }
    }
}

/// One stage of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedStage {
    pub node_id: [u8; 32],
    pub layers: Range<u32>,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    pub compute_us: u64,
    /// The one-way trip into this stage (0 for stage 0).
    pub hop_us: u64,
}

/// A plan: the chain, its projected cost, and who was left out and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub stages: Vec<PlannedStage>,
    /// The final stage's answer back to the coordinator (0 when alone).
    pub return_us: u64,
    pub projected_us_per_token: u64,
    pub left_out: Vec<([u8; 32], LeftOut)>,
}

impl Plan {
    /// Tokens per second the projection gives (one request).
    pub fn projected_tokens_per_s(&self) -> f64 {
        if self.projected_us_per_token == 0 {
            0.0
        } else {
            1e6 / self.projected_us_per_token as f64
        }
    }
}

/// Why there is no plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("the model has no layers, or more than {MAX_PLAN_LAYERS}")]
    Layers,
    #[error("{asked} stages asked for, but only {available} nodes can hold a layer")]
    TooFewNodes { asked: usize, available: usize },
    #[error("{0} stages: between 1 and the model's layers, at most {MAX_PLAN_STAGES}")]
    Stages(usize),
    #[error("the model does not fit the memory of the nodes that hold it")]
    DoesNotFit,
}

/// How many stages a plan may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stages {
    /// Exactly this many (tests, demos, `--stages N`).
    Pinned(usize),
    /// As many as lower the projection, at least this many (split serving
    /// asks for 2).
    AtLeast(usize),
}

/// Plan `model` over `coordinator` (always stage 0) and `members`
/// (members with `Some` reason were left out before planning).
///
/// The usable members are taken fastest first (then nearer, then by node
/// id), at most `MAX_PLAN_CANDIDATES` of them, put in route order
/// (`Links::route`), and the chain follows that order; which of them to use
/// and how many layers each holds is searched exactly for it (dynamic
/// programming over last members, stages and layers).
pub fn plan(
    model: &ModelShape,
    coordinator: &Candidate,
    members: &[(Candidate, Option<LeftOut>)],
    stages: Stages,
) -> Result<Plan, PlanError> {
    let layers = model.layer_bytes.len();
    if layers == 0 || layers > MAX_PLAN_LAYERS {
        return Err(PlanError::Layers);
    }
    let smallest_weights = model.layer_bytes.iter().copied().min().unwrap_or(0);
    let mut left_out: Vec<([u8; 32], LeftOut)> = Vec::new();
    let mut usable: Vec<&Candidate> = Vec::new();
    for (candidate, reason) in members {
        if candidate.node_id == coordinator.node_id {
            continue;
        }
        let smallest_layer = smallest_weights.saturating_add(candidate.kv_bytes(model, 1));
        match reason {
            Some(reason) => left_out.push((candidate.node_id, reason.clone())),
            None if candidate.memory_bytes < smallest_layer => left_out.push((
                candidate.node_id,
                LeftOut::NotEnoughMemory {
                    offered: candidate.memory_bytes,
                    smallest_layer,
                },
            )),
            None => usable.push(candidate),
        }
    }
    usable.sort_by_key(|c| (c.decode_us_per_layer, c.rtt_us, c.node_id));
    let beyond = usable.split_off(usable.len().min(MAX_PLAN_CANDIDATES));
    let links = Links::of(coordinator, members);
    let usable = links.route(usable);
    let (low, high) = match stages {
        Stages::Pinned(n) => (n, n),
        Stages::AtLeast(n) => (n, MAX_PLAN_STAGES),
    };
    if low == 0 || low > layers || low > MAX_PLAN_STAGES {
        return Err(PlanError::Stages(low));
    }
    if low > usable.len() + 1 {
        return Err(PlanError::TooFewNodes {
            asked: low,
            available: usable.len() + 1,
        });
    }
    let (cost, chain) =
        search(model, coordinator, &usable, &links, low, high).ok_or(PlanError::DoesNotFit)?;
    for unused in usable.iter().chain(&beyond) {
        if !chain.iter().any(|(k, _)| *k == Some(unused.node_id)) {
            left_out.push((unused.node_id, LeftOut::TooSlowToHelp));
        }
    }
    left_out.sort_by_key(|(id, _)| *id);
    let node = |id: Option<[u8; 32]>| -> &Candidate {
        id.and_then(|id| usable.iter().copied().find(|c| c.node_id == id))
            .unwrap_or(coordinator)
    };
    let chain: Vec<(&Candidate, Range<u32>)> = chain
        .iter()
        .map(|(id, range)| (node(*id), range.clone()))
        .collect();
    let (stages, return_us) = planned_stages(model, &chain, &links);
    Ok(Plan {
        return_us,
        projected_us_per_token: cost.total,
        stages,
        left_out,
    })
}

/// A chain's stages as the plan states them (the coordinator first), and
/// the final stage's way back to it.
fn planned_stages(
    model: &ModelShape,
    chain: &[(&Candidate, Range<u32>)],
    links: &Links,
) -> (Vec<PlannedStage>, u64) {
    let stages = chain
        .iter()
        .enumerate()
        .map(|(k, (node, range))| {
            let n = u64::from(range.end - range.start);
            PlannedStage {
                node_id: node.node_id,
                layers: range.clone(),
                weight_bytes: weights(model, range, k == 0),
                kv_bytes: node.kv_bytes(model, n),
                compute_us: n.saturating_mul(node.decode_us_per_layer),
                hop_us: match k.checked_sub(1).and_then(|before| chain.get(before)) {
                    Some((before, _)) => links.hop_us(&before.node_id, node),
                    None => 0,
                },
            }
        })
        .collect();
    let return_us = match chain.last() {
        Some((node, _)) if chain.len() > 1 => links.return_us(node),
        _ => 0,
    };
    (stages, return_us)
}

/// After a loss: the `interrupted` chain (the coordinator first, each
/// stage's node and layers) with every stage whose node is no longer usable
/// handed to the fastest usable member not already in it that can hold
/// those layers, when that chain's projection is within `gain` of `best`'s
/// (kept when `kept * gain.0 <= best * gain.1`). The survivors keep their
/// loaded layers and, mid-request, the caches they built; `None` when some
/// stage finds no member, the chain is not whole, or it costs too much.
pub fn keep_in_place(
    model: &ModelShape,
    coordinator: &Candidate,
    members: &[(Candidate, Option<LeftOut>)],
    interrupted: &[([u8; 32], Range<u32>)],
    best: &Plan,
    gain: (u64, u64),
) -> Option<Plan> {
    let layers = model.layer_bytes.len() as u32;
    let whole = interrupted
        .first()
        .is_some_and(|(id, r)| *id == coordinator.node_id && r.start == 0)
        && interrupted.windows(2).all(|w| w[0].1.end == w[1].1.start)
        && interrupted.iter().all(|(_, r)| r.start < r.end)
        && interrupted.last().is_some_and(|(_, r)| r.end == layers);
    if !whole || interrupted.len() > MAX_PLAN_STAGES {
        return None;
    }
    let fits = |node: &Candidate, range: &Range<u32>, first: bool| {
        let n = u64::from(range.end - range.start);
        weights(model, range, first).saturating_add(node.kv_bytes(model, n)) <= node.memory_bytes
    };
    let mut usable: Vec<&Candidate> = members
        .iter()
        .filter(|(c, reason)| reason.is_none() && c.node_id != coordinator.node_id)
        .map(|(c, _)| c)
        .collect();
    usable.sort_by_key(|c| (c.decode_us_per_layer, c.rtt_us, c.node_id));
    if !fits(coordinator, &interrupted[0].1, true) {
        return None;
    }
    let mut chain: Vec<(&Candidate, Range<u32>)> = vec![(coordinator, interrupted[0].1.clone())];
    for (k, (id, range)) in interrupted.iter().enumerate().skip(1) {
        let survivor = usable
            .iter()
            .copied()
            .find(|c| c.node_id == *id)
            .filter(|c| fits(c, range, false));
        let node = match survivor {
            Some(node) => node,
            None => usable.iter().copied().find(|c| {
                // Not a node of the chain: neither one placed before this
                // stage nor a survivor of a later one.
                !chain.iter().any(|(placed, _)| placed.node_id == c.node_id)
                    && !interrupted[k + 1..]
                        .iter()
                        .any(|(later, _)| *later == c.node_id)
                    && fits(c, range, false)
            })?,
        };
        chain.push((node, range.clone()));
    }
    let (stages, return_us) = planned_stages(model, &chain, &Links::of(coordinator, members));
    let projected = stages.iter().fold(return_us, |sum, s| {
        sum.saturating_add(s.compute_us).saturating_add(s.hop_us)
    });
    if projected.saturating_mul(gain.0) > best.projected_us_per_token.saturating_mul(gain.1) {
        return None;
    }
    let mut left_out: Vec<([u8; 32], LeftOut)> = members
        .iter()
        .filter(|(c, _)| c.node_id != coordinator.node_id)
        .filter(|(c, _)| !chain.iter().any(|(node, _)| node.node_id == c.node_id))
        .map(|(c, reason)| (c.node_id, reason.clone().unwrap_or(LeftOut::TooSlowToHelp)))
        .collect();
    left_out.sort_by_key(|(id, _)| *id);
    Some(Plan {
        stages,
        return_us,
        projected_us_per_token: projected,
        left_out,
    })
}

/// The most members the search weighs (the fastest ones).
pub const MAX_PLAN_CANDIDATES: usize = 64;

/// Fewest total, then smallest slowest stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Cost {
    total: u64,
    slowest: u64,
}

fn weights(model: &ModelShape, range: &Range<u32>, first: bool) -> u64 {
    let layers = model.layer_bytes[range.start as usize..range.end as usize]
        .iter()
        .fold(0u64, |sum, b| sum.saturating_add(*b));
    layers.saturating_add(if first { model.head_bytes } else { 0 })
}

/// A chain as the search gives it: each stage's member (`None` for the
/// coordinator) and layers.
type Chain = Vec<(Option<[u8; 32]>, Range<u32>)>;

/// The best chain of `low..=high` stages: the coordinator first, then
/// members in the order of `members` (any of them skipped), each stage at
/// least one layer and within its memory.
// The tables are indexed by members, stage counts and layer boundaries,
// as the recurrence is written; iterators would hide it.
#[allow(clippy::needless_range_loop)]
fn search(
    model: &ModelShape,
    coordinator: &Candidate,
    members: &[&Candidate],
    links: &Links,
    low: usize,
    high: usize,
) -> Option<(Cost, Chain)> {
    let layers = model.layer_bytes.len();
    let mut prefix = vec![0u64; layers + 1];
    for (i, bytes) in model.layer_bytes.iter().enumerate() {
        prefix[i + 1] = prefix[i].saturating_add(*bytes);
    }
    let fits = |node: &Candidate, first: bool, a: usize, b: usize| {
        let n = (b - a) as u64;
        let need = (prefix[b] - prefix[a])
            .saturating_add(node.kv_bytes(model, n))
            .saturating_add(if first { model.head_bytes } else { 0 });
        need <= node.memory_bytes
    };
    let compute = |node: &Candidate, a: usize, b: usize| {
        ((b - a) as u64).saturating_mul(node.decode_us_per_layer)
    };
    let most_members = high.saturating_sub(1).min(members.len()).min(layers - 1);
    // hops[j][i]: into member i from member j; the last row from the
    // coordinator (looked up once, not at every layer boundary).
    let hops: Vec<Vec<u64>> = members
        .iter()
        .map(|from| &from.node_id)
        .chain(std::iter::once(&coordinator.node_id))
        .map(|from| members.iter().map(|to| links.hop_us(from, to)).collect())
        .collect();
    // alone[b]: the coordinator alone holding layers [0, b).
    let alone: Vec<Option<Cost>> = (0..=layers)
        .map(|b| {
            (b > 0 && fits(coordinator, true, 0, b)).then(|| {
                let c = compute(coordinator, 0, b);
                Cost {
                    total: c,
                    slowest: c,
                }
            })
        })
        .collect();
    // ends[i][k][b]: the best chain whose k-th member stage is member i,
    // ending at layer b; where that stage starts, and the member before it
    // (None: the coordinator). A hop's cost depends on both of its ends, so
    // a chain is kept for each last member.
    type End = Option<(Cost, usize, Option<usize>)>;
    let mut ends: Vec<Vec<Vec<End>>> = Vec::with_capacity(members.len());
    for (i, node) in members.iter().enumerate() {
        let mut here: Vec<Vec<End>> = vec![vec![None; layers + 1]; most_members + 1];
        for k in 1..=most_members {
            // into[a]: the best chain of k - 1 member stages covering
            // [0, a), with the hop into member i paid, and its last member.
            let mut into: Vec<Option<(Cost, Option<usize>)>> = vec![None; layers + 1];
            for a in k..layers {
                let mut best: Option<(Cost, Option<usize>)> = None;
                let mut consider = |before: Cost, last: Option<usize>| {
                    let hop = hops[last.unwrap_or(members.len())][i];
                    let cost = Cost {
                        total: before.total.saturating_add(hop),
                        slowest: before.slowest,
                    };
                    if best.is_none_or(|(c, _)| cost < c) {
                        best = Some((cost, last));
                    }
                };
                if k == 1 {
                    if let Some(before) = alone[a] {
                        consider(before, None);
                    }
                } else {
                    for j in 0..i {
                        if let Some((before, _, _)) = ends[j][k - 1][a] {
                            consider(before, Some(j));
                        }
                    }
                }
                into[a] = best;
            }
            for b in (k + 1)..=layers {
                let mut best: End = None;
                // Downwards: a stage that does not fit from `a` fits from no
                // earlier start either (more layers, more memory). Ties go
                // to the earlier start, as they did upwards.
                for a in (k..b).rev() {
                    if !fits(node, false, a, b) {
                        break;
                    }
                    let Some((before, last)) = into[a] else {
                        continue;
                    };
                    // A stage that ends the chain also costs the answer's
                    // way back; counted here, so the chains compete with it.
                    let c = compute(node, a, b);
                    let back = if b == layers {
                        links.return_us(node)
                    } else {
                        0
                    };
                    let cost = Cost {
                        total: before.total.saturating_add(c).saturating_add(back),
                        slowest: before.slowest.max(c),
                    };
                    if best.is_none_or(|(known, _, _)| cost <= known) {
                        best = Some((cost, a, last));
                    }
                }
                here[k][b] = best;
            }
        }
        ends.push(here);
    }
    // The finished chains: all layers covered, a stage count in range; the
    // first found among equals.
    let mut best: Option<(Cost, Option<(usize, usize)>)> = None;
    if low == 1 {
        best = alone[layers].map(|cost| (cost, None));
    }
    for k in (low.max(2) - 1)..=most_members.min(high - 1) {
        for (i, here) in ends.iter().enumerate() {
            if let Some((cost, _, _)) = here[k][layers]
                && best.is_none_or(|(c, _)| cost < c)
            {
                best = Some((cost, Some((i, k))));
            }
        }
    }
    let (cost, mut last) = best?;
    // Walk back: each member stage, where it starts, and the one before.
    let mut chain: Chain = Vec::new();
    let mut end = layers;
    while let Some((i, k)) = last {
        let (_, start, before) = ends[i][k][end]?;
        chain.push((Some(members[i].node_id), start as u32..end as u32));
        end = start;
        last = before.map(|j| (j, k - 1));
    }
    chain.push((None, 0..end as u32));
    chain.reverse();
    Some((cost, chain))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u8, memory: u64, us: u64, rtt: u64) -> Candidate {
        Candidate {
            node_id: [id; 32],
            memory_bytes: memory,
            decode_us_per_layer: us,
            rtt_us: rtt,
            kv_scale: 1,
            rtts: Vec::new(),
            relayed_by: None,
        }
    }

    fn shape(layers: usize) -> ModelShape {
        ModelShape {
            layer_bytes: vec![100; layers],
            head_bytes: 1_000,
            kv_bytes_per_layer: 10,
        }
    }

    #[test]
    fn hops_between_members_are_weighed_by_the_round_trips_they_measured() {
        // Two homes far from the coordinator (40 ms) and from each other,
        // each holding half the model with a member next door (1 ms).
        let coordinator = node(0, 1_200, 100, 0);
        let near = |mut a: Candidate, b: u8| {
            a.rtts.push(([b; 32], 1_000));
            a
        };
        let far = |mut a: Candidate, b: u8| {
            a.rtts.push(([b; 32], 80_000));
            a
        };
        let a1 = far(near(node(1, 500, 100, 40_000), 2), 3);
        let a2 = far(near(node(2, 500, 100, 40_000), 1), 4);
        let b1 = far(near(node(3, 500, 100, 40_000), 4), 1);
        let b2 = far(near(node(4, 500, 100, 40_000), 3), 2);
        let members: Vec<_> = [a1, b1, a2, b2].into_iter().map(|c| (c, None)).collect();
        let planned = plan(&shape(8), &coordinator, &members, Stages::Pinned(3)).unwrap();
        let ids: Vec<u8> = planned.stages.iter().map(|s| s.node_id[0]).collect();
        // Out to one home, next door, and back: 20 + 0.5 + 20 ms of delay,
        // where a chain across the homes would cross 40 ms between them.
        assert!(
            ids == [0, 1, 2] || ids == [0, 2, 1] || ids == [0, 3, 4] || ids == [0, 4, 3],
            "one home's two members: {ids:?}"
        );
        assert_eq!(planned.stages[2].hop_us, 500 + PER_HOP_OVERHEAD_US);
        assert_eq!(planned.return_us, 20_000);
        // Without the members' round trips every pair is as far as the
        // coordinator's: the same cost whichever two.
        let blind: Vec<_> = members
            .iter()
            .map(|(c, _)| {
                let mut c = c.clone();
                c.rtts.clear();
                (c, None)
            })
            .collect();
        let unseen = plan(&shape(8), &coordinator, &blind, Stages::Pinned(3)).unwrap();
        assert_eq!(
            unseen.projected_us_per_token - planned.projected_us_per_token,
            20_000 - 500
        );
    }

    #[test]
    fn a_member_cannot_claim_to_be_nearer_than_the_coordinator_measured() {
        let coordinator = node(0, 1_200, 100, 0);
        // Near the coordinator (2 ms), and a far member (80 ms) claiming
        // 1 us to it; the far one also names the near one as its relay.
        let near = node(1, 1 << 20, 100, 2_000);
        let mut far = node(2, 1 << 20, 100, 80_000);
        far.rtts.push(([1; 32], 1));
        let members = [(near.clone(), None), (far.clone(), None)];
        let links = Links::of(&coordinator, &members);
        // Two sides of a triangle: at least 78 ms between them.
        assert_eq!(links.rtt_us(&[1; 32], &[2; 32]), Some(78_000));
        far.relayed_by = Some([1; 32]);
        let members = [(near, None), (far.clone(), None)];
        let links = Links::of(&coordinator, &members);
        // Through its relay it is no nearer the coordinator than its ping.
        assert!(links.hop_us(&[0; 32], &far) >= 40_000);
        // A member that lists its full nearest and not the other is at
        // least as far from it as its farthest listed.
        let mut full = node(3, 1 << 20, 100, 0);
        full.rtts = (0..MAX_ADVERT_RTTS as u8)
            .map(|i| ([100 + i; 32], 1_000 + u64::from(i)))
            .collect();
        let mut claimer = node(4, 1 << 20, 100, 0);
        claimer.rtts.push(([3; 32], 1));
        let links = Links::of(&coordinator, &[(full, None), (claimer, None)]);
        assert_eq!(
            links.rtt_us(&[3; 32], &[4; 32]),
            Some(1_000 + MAX_ADVERT_RTTS as u64 - 1)
        );
    }

    #[test]
    fn a_hop_into_a_relayed_member_pays_the_detour_through_its_relay() {
        let coordinator = node(0, 1_200, 100, 0);
        let mut relay = node(1, 0, 100, 2_000);
        relay.rtts.push(([2; 32], 30_000));
        let mut behind = node(2, 1 << 20, 100, 10_000);
        behind.relayed_by = Some([1; 32]);
        let members = [(relay, None), (behind, None)];
        let planned = plan(&shape(8), &coordinator, &members, Stages::Pinned(2)).unwrap();
        assert_eq!(planned.stages[1].node_id, [2; 32]);
        // Coordinator to relay (2 ms) and relay to member (30 ms), half
        // each way, and two nodes handling it.
        assert_eq!(planned.stages[1].hop_us, 16_000 + 2 * PER_HOP_OVERHEAD_US);
    }

    #[test]
    fn after_a_loss_the_survivors_keep_their_places_when_it_costs_little() {
        let coordinator = node(0, 1 << 20, 100, 0);
        let (a, b, spare) = (
            node(1, 1 << 20, 100, 1_000),
            node(2, 1 << 20, 100, 1_000),
            node(3, 1 << 20, 100, 900),
        );
        let interrupted = [([0; 32], 0..3), ([1; 32], 3..6), ([2; 32], 6..8)];
        // Node 1 is gone: the spare, nearer than node 2, leads the search's
        // order, so the best chain puts node 2 after it on other layers.
        let members = [(b.clone(), None), (spare.clone(), None)];
        let best = plan(&shape(8), &coordinator, &members, Stages::Pinned(3)).unwrap();
        let kept = keep_in_place(
            &shape(8),
            &coordinator,
            &members,
            &interrupted,
            &best,
            (4, 5),
        )
        .unwrap();
        let chain: Vec<_> = kept
            .stages
            .iter()
            .map(|s| (s.node_id[0], s.layers.clone()))
            .collect();
        assert_eq!(chain, vec![(0, 0..3), (3, 3..6), (2, 6..8)]);
        assert_eq!(
            kept.projected_us_per_token,
            800 + (450 + 500) + (500 + 500) + 500
        );
        assert!(kept.left_out.is_empty());
        // A member that left is no replacement, and a chain much slower
        // than the best is not kept.
        let gone = [
            (b.clone(), None),
            (spare.clone(), Some(LeftOut::NotConnected)),
        ];
        assert!(
            keep_in_place(&shape(8), &coordinator, &gone, &interrupted, &best, (4, 5)).is_none()
        );
        let slow = node(3, 1 << 20, 10_000, 900);
        let members = [(b.clone(), None), (slow, None)];
        assert!(
            keep_in_place(
                &shape(8),
                &coordinator,
                &members,
                &interrupted,
                &best,
                (4, 5)
            )
            .is_none()
        );
        // A chain that does not cover the model is not one to keep.
        let broken = [([0; 32], 0..3), ([1; 32], 4..8)];
        let members = [(a, None), (b, None), (spare, None)];
        assert!(keep_in_place(&shape(8), &coordinator, &members, &broken, &best, (4, 5)).is_none());
    }

    #[test]
    fn a_node_that_holds_the_whole_model_serves_alone() {
        let plan = plan(
            &shape(8),
            &node(0, 1 << 20, 100, 0),
            &[(node(1, 1 << 20, 100, 1_000), None)],
            Stages::AtLeast(1),
        )
        .unwrap();
        assert_eq!(plan.stages.len(), 1);
        assert_eq!(plan.stages[0].layers, 0..8);
        assert_eq!(plan.projected_us_per_token, 800);
        assert_eq!(plan.left_out, vec![([1; 32], LeftOut::TooSlowToHelp)]);
    }

    #[test]
    fn a_model_that_does_not_fit_one_node_is_split_by_memory_and_speed() {
        // The coordinator holds its head (1000) and at most 4 layers (110
        // each); node 1 is fast but holds 3 layers at most; node 2 holds
        // anything. Every hop: half of 2000 us plus 500.
        let coordinator = node(0, 1_000 + 4 * 110, 200, 0);
        let fast = node(1, 3 * 110, 100, 2_000);
        let ranges =
            |plan: &Plan| -> Vec<_> { plan.stages.iter().map(|s| s.layers.clone()).collect() };

        // Node 2 at 1000 us a layer: the fast node is worth its hop.
        let slow = node(2, 100 * 110, 1_000, 2_000);
        let members = [(slow.clone(), None), (fast.clone(), None)];
        let three = plan(&shape(8), &coordinator, &members, Stages::AtLeast(1)).unwrap();
        assert_eq!(ranges(&three), vec![0..4, 4..7, 7..8]);
        // 4*200 + 3*100 + 1*1000 compute, two hops of 1500, and the return
        // of half node 2's round trip.
        assert_eq!(
            three.projected_us_per_token,
            800 + 300 + 1_000 + 2 * 1_500 + 1_000
        );

        // Node 2 at 400 us: skipping the fast node saves more than its
        // layers would (800 + 1600 + 1500 + 1000 against 800 + 300 + 400 +
        // 3000 + 1000).
        let slower = node(2, 100 * 110, 400, 2_000);
        let members = [(slower, None), (fast, None)];
        let two = plan(&shape(8), &coordinator, &members, Stages::AtLeast(1)).unwrap();
        assert_eq!(ranges(&two), vec![0..4, 4..8]);
        assert_eq!(two.stages[1].node_id, [2; 32]);
        assert_eq!(two.projected_us_per_token, 800 + 1_600 + 1_500 + 1_000);
        assert_eq!(two.left_out, vec![([1; 32], LeftOut::TooSlowToHelp)]);
    }

    #[test]
    fn the_way_back_counts_when_chains_compete() {
        // B is faster but far; A slower and near. With B's answer back
        // counted, A's chain is cheaper (750 against 897).
        let model = ModelShape {
            layer_bytes: vec![10, 10],
            head_bytes: 0,
            kv_bytes_per_layer: 0,
        };
        let coordinator = node(0, 10, 100, 0);
        let b = node(1, 100, 1, 296);
        let a = node(2, 100, 150, 0);
        let plan = plan(
            &model,
            &coordinator,
            &[(b, None), (a, None)],
            Stages::AtLeast(2),
        )
        .unwrap();
        assert_eq!(plan.projected_us_per_token, 100 + 150 + 500);
        assert_eq!(plan.stages[1].node_id, [2; 32]);
    }

    #[test]
    fn pinned_stages_balance_and_a_small_node_gets_fewer_layers() {
        let plan = plan(
            &shape(12),
            &node(0, 1 << 20, 100, 0),
            &[
                (node(1, 1 << 20, 100, 0), None),
                (node(2, 2 * 110, 100, 0), None),
                (node(3, 1 << 20, 100, 0), None),
            ],
            Stages::Pinned(4),
        )
        .unwrap();
        let counts: Vec<u32> = plan
            .stages
            .iter()
            .map(|s| s.layers.end - s.layers.start)
            .collect();
        assert_eq!(counts.iter().sum::<u32>(), 12);
        let small = plan.stages.iter().find(|s| s.node_id == [2; 32]).unwrap();
        assert!(small.layers.end - small.layers.start <= 2);
        // The rest is balanced: the slowest stage holds 4 layers.
        assert_eq!(counts.iter().max(), Some(&4));
    }

    #[test]
    fn members_left_out_say_why() {
        let err = plan(
            &shape(4),
            &node(0, 500, 100, 0),
            &[
                (node(1, 1 << 20, 100, 0), Some(LeftOut::NoModel)),
                (node(2, 5, 100, 0), None),
            ],
            Stages::AtLeast(1),
        );
        assert_eq!(err, Err(PlanError::DoesNotFit));
        let plan = plan(
            &shape(4),
            &node(0, 1 << 20, 100, 0),
            &[
                (node(1, 1 << 20, 100, 0), Some(LeftOut::Stale)),
                (node(2, 5, 100, 0), None),
            ],
            Stages::AtLeast(1),
        )
        .unwrap();
        assert_eq!(
            plan.left_out,
            vec![
                ([1; 32], LeftOut::Stale),
                (
                    [2; 32],
                    LeftOut::NotEnoughMemory {
                        offered: 5,
                        smallest_layer: 110
                    }
                )
            ]
        );
    }

    /// A member whose caches hold f32 (a GPU's, on candle's route) needs
    /// twice the KV bytes the shape counts: offered room for one layer with
    /// f16 caches, it holds none, and where it is planned its stage shows
    /// the f32 bytes.
    #[test]
    fn a_member_with_f32_caches_is_planned_with_twice_the_kv_bytes() {
        let gpu = |id: u8, memory: u64| Candidate {
            kv_scale: 2,
            ..node(id, memory, 10, 0)
        };
        let refused = plan(
            &shape(4),
            &node(0, 1 << 20, 100, 0),
            &[(gpu(1, 115), None)],
            Stages::AtLeast(1),
        )
        .unwrap();
        assert_eq!(
            refused.left_out,
            vec![(
                [1; 32],
                LeftOut::NotEnoughMemory {
                    offered: 115,
                    smallest_layer: 120
                }
            )]
        );
        let planned = plan(
            &shape(4),
            &node(0, 1_110, 100, 0),
            &[(gpu(1, 1 << 20), None)],
            Stages::Pinned(2),
        )
        .unwrap();
        let stage = &planned.stages[1];
        let layers = u64::from(stage.layers.end - stage.layers.start);
        assert_eq!(stage.kv_bytes, layers * 20);
    }

    #[test]
    fn the_same_input_gives_the_same_plan_and_bad_counts_are_refused() {
        let members: Vec<_> = (1..20u8)
            .map(|i| (node(i, 400, 100 + u64::from(i % 3), 100), None))
            .collect();
        let a = plan(
            &shape(30),
            &node(0, 1_500, 100, 0),
            &members,
            Stages::AtLeast(1),
        )
        .unwrap();
        let b = plan(
            &shape(30),
            &node(0, 1_500, 100, 0),
            &members,
            Stages::AtLeast(1),
        )
        .unwrap();
        assert_eq!(a, b);
        assert_eq!(
            plan(&shape(3), &node(0, 1 << 20, 1, 0), &[], Stages::Pinned(4)),
            Err(PlanError::Stages(4))
        );
        assert_eq!(
            plan(&shape(8), &node(0, 1 << 20, 1, 0), &[], Stages::Pinned(2)),
            Err(PlanError::TooFewNodes {
                asked: 2,
                available: 1
            })
        );
    }

    /// Every chain by enumeration: subsets of the members in planning order
    /// and every split of the layers over them.
    fn brute_force(
        model: &ModelShape,
        coordinator: &Candidate,
        members: &[Candidate],
        low: usize,
        high: usize,
    ) -> Option<Cost> {
        // As `plan` takes them: those that hold at least one layer.
        let smallest = model.layer_bytes.iter().copied().min().unwrap_or(0);
        let mut sorted: Vec<&Candidate> = members
            .iter()
            .filter(|c| c.memory_bytes >= smallest + c.kv_bytes(model, 1))
            .collect();
        sorted.sort_by_key(|c| (c.decode_us_per_layer, c.rtt_us, c.node_id));
        let offered: Vec<_> = members.iter().map(|m| (m.clone(), None)).collect();
        let links = Links::of(coordinator, &offered);
        let sorted = links.route(sorted);
        let layers = model.layer_bytes.len();
        let mut best: Option<Cost> = None;
        for mask in 0u32..(1 << sorted.len()) {
            let mut chain = vec![coordinator];
            chain.extend(
                sorted
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, c)| *c),
            );
            if chain.len() < low || chain.len() > high || chain.len() > layers {
                continue;
            }
            // Every composition of `layers` into chain.len() positive parts.
            let cuts = chain.len() - 1;
            let mut stack = vec![(0usize, Vec::<usize>::new())];
            while let Some((at, bounds)) = stack.pop() {
                if bounds.len() == cuts {
                    let mut edges = vec![0];
                    edges.extend(&bounds);
                    edges.push(layers);
                    let mut cost = Cost {
                        total: 0,
                        slowest: 0,
                    };
                    let mut ok = true;
                    for (k, node) in chain.iter().enumerate() {
                        let (a, b) = (edges[k], edges[k + 1]);
                        let need: u64 = model.layer_bytes[a..b].iter().sum::<u64>()
                            + (b - a) as u64 * model.kv_bytes_per_layer * node.kv_scale
                            + if k == 0 { model.head_bytes } else { 0 };
                        ok &= need <= node.memory_bytes;
                        let c = (b - a) as u64 * node.decode_us_per_layer;
                        let hop = match k {
                            0 => 0,
                            _ => links.hop_us(&chain[k - 1].node_id, node),
                        };
                        cost.total += c + hop;
                        cost.slowest = cost.slowest.max(c);
                    }
                    if chain.len() > 1 {
                        cost.total += links.return_us(chain[chain.len() - 1]);
                    }
                    if ok && best.is_none_or(|b| cost < b) {
                        best = Some(cost);
                    }
                    continue;
                }
                for next in (at + 1)..layers {
                    if layers - next >= cuts - bounds.len() {
                        let mut more = bounds.clone();
                        more.push(next);
                        stack.push((next, more));
                    }
                }
            }
        }
        best
    }

    proptest::proptest! {
        #[test]
        fn the_search_finds_the_cheapest_chain(
            layer_bytes in proptest::collection::vec(1u64..50, 1..7),
            kv in 0u64..20,
            head in 0u64..50,
            coordinator_memory in 0u64..300,
            members in proptest::collection::vec((0u64..300, 1u64..200, 0u64..3_000), 0..4),
            between in proptest::collection::vec(proptest::option::of(0u64..3_000), 16),
            relays in proptest::collection::vec(0u8..8, 4),
            low in 1usize..4,
            pinned in proptest::bool::ANY,
        ) {
            let model = ModelShape { layer_bytes, head_bytes: head, kv_bytes_per_layer: kv };
            let coordinator = node(0, coordinator_memory, 100, 0);
            let count = members.len();
            let members: Vec<Candidate> = members
                .iter()
                .enumerate()
                .map(|(i, (memory, us, rtt))| {
                    let mut member = node(i as u8 + 1, *memory, *us, *rtt);
                    // Some round trips to the other members, and now and
                    // then a relay (another member) it is reached through.
                    member.rtts = (0..count)
                        .filter(|j| *j != i)
                        .filter_map(|j| between[i * 4 + j].map(|rtt| ([j as u8 + 1; 32], rtt)))
                        .collect();
                    let relay = relays[i] as usize;
                    member.relayed_by = (relay < count && relay != i).then_some([relay as u8 + 1; 32]);
                    member
                })
                .collect();
            let high = if pinned { low } else { MAX_PLAN_STAGES };
            let stages = if pinned { Stages::Pinned(low) } else { Stages::AtLeast(low) };
            let offered: Vec<_> = members.iter().map(|m| (m.clone(), None)).collect();
            let planned = plan(&model, &coordinator, &offered, stages);
            let expected = brute_force(&model, &coordinator, &members, low, high);
            match (planned, expected) {
                (Ok(p), Some(cost)) => {
                    proptest::prop_assert_eq!(p.projected_us_per_token, cost.total);
                    let slowest = p.stages.iter().map(|s| s.compute_us).max().unwrap_or(0);
                    proptest::prop_assert_eq!(slowest, cost.slowest);
                    // The chain covers every layer once, in order.
                    let mut end = 0;
                    for s in &p.stages {
                        proptest::prop_assert_eq!(s.layers.start, end);
                        proptest::prop_assert!(s.layers.end > s.layers.start);
                        end = s.layers.end;
                    }
                    proptest::prop_assert_eq!(end as usize, model.layer_bytes.len());
                }
                (Err(_), None) => {}
                (p, e) => proptest::prop_assert!(false, "planned {:?}, enumeration {:?}", p, e),
            }
        }
    }
}
