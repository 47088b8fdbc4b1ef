//! Human-readable output of `mesh-node verify` and `mesh-node stats`.

use std::fmt::Write;

use mesh_protocol::fold::Lane;
use mesh_protocol::hopcheck::{HopReport, LaneResult};
use mesh_protocol::verify::VerifyReport;

/// What agreement means, printed under every hop table.
pub const AGREEMENT_CAVEAT: &str = "Agreement means both ends of a hop committed to the same frame bytes. \
It does not show that any stage computed correctly, nor that the stages are run by independent parties.";

fn lane_cell(lane: Option<&LaneResult>) -> String {
    match lane {
        None => String::new(),
        Some(l) => {
            let mut text = l.state.glyph().to_string();
            if !l.required {
                text.push_str(" (optional)");
            }
            text
        }
    }
}

fn hop_table(out: &mut String, hop: &HopReport) {
    let _ = writeln!(out, "Stages");
    let _ = writeln!(out, "  {:<6} {:<18} record", "stage", "cell");
    for cell in &hop.cells {
        let record = cell.record.as_deref().map_or("—".to_string(), |id| {
            format!("{}…", &id[..id.len().min(16)])
        });
        let _ = writeln!(
            out,
            "  {:<6} {:<18} {}",
            cell.stage_index,
            cell.state.glyph(),
            record
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "Hops");
    let _ = writeln!(
        out,
        "  {:<14} {:<26} {:<26} direct_return",
        "hop", "forward", "reply"
    );
    let mut hops: Vec<u32> = hop
        .lanes
        .iter()
        .filter(|l| l.lane != Lane::DirectReturn)
        .map(|l| l.hop_index)
        .collect();
    hops.dedup();
    for index in hops {
        let find = |lane: Lane| {
            hop.lanes
                .iter()
                .find(|l| l.hop_index == index && l.lane == lane)
        };
        let _ = writeln!(
            out,
            "  {:<14} {:<26} {:<26}",
            format!("{index} → {}", index + 1),
            lane_cell(find(Lane::Forward)),
            lane_cell(find(Lane::Reply)),
        );
    }
    if let Some(direct) = hop.lanes.iter().find(|l| l.lane == Lane::DirectReturn) {
        let _ = writeln!(
            out,
            "  {:<14} {:<26} {:<26} {}",
            format!("{} → 0", direct.hop_index),
            "",
            "",
            lane_cell(Some(direct))
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Hand-offs agree: {}    terminal state: {}    return mode: {}",
        if hop.handoffs_agree {
            "yes ✓"
        } else {
            "NO ✕"
        },
        hop.terminal_state.as_str(),
        hop.return_mode.as_str(),
    );
    let _ = writeln!(out, "{AGREEMENT_CAVEAT}");
}

/// One line on a segment of a resumed request: where it started, what it
/// replayed, and whom it lost.
fn segment_line(segment: &mesh_protocol::resume::Segment) -> String {
    let mut line = format!(
        "run {}, tokens {}..{}, {} positions prefilled, {}",
        segment.run_id,
        segment.first_token,
        segment.first_token + segment.tokens,
        segment.prefilled,
        segment.terminal_state
    );
    if !segment.kept.is_empty() {
        let _ = write!(line, ", caches kept by {}", segment.kept.join(", "));
    }
    if !segment.lost.is_empty() {
        let _ = write!(line, ", lost {}", segment.lost.join(", "));
    }
    line
}

/// The whole report as text.
pub fn render(file: &str, report: &VerifyReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{file}: {}", report.form.as_str());
    let failed = report.checks.iter().filter(|c| c.outcome.is_err()).count();
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Checks: {} passed, {failed} failed",
        report.checks.len() - failed
    );
    for check in &report.checks {
        match &check.outcome {
            Ok(()) => {
                let _ = writeln!(out, "  ✓ {:<36} {}", check.subject, check.property);
            }
            Err(why) => {
                let _ = writeln!(out, "  ✕ {:<36} {}: {why}", check.subject, check.property);
            }
        }
    }
    let _ = writeln!(out);
    if !report.stage_receipts.is_empty() {
        let _ = writeln!(out, "Stage receipts (each stage's own served span):");
        for r in &report.stage_receipts {
            let energy = &r.sealed.receipt.energy;
            let _ = writeln!(
                out,
                "  stage {} {}: {} µJ ({})",
                r.stage_index,
                r.node,
                energy.uj(),
                energy.provenance().as_str()
            );
        }
        let _ = writeln!(out);
    }
    // A resumed request: each earlier segment, then the final one below.
    let segments = report.resume.as_ref().map(|r| r.segments.as_slice());
    for (k, segment) in report.earlier_segments.iter().enumerate() {
        let entry = segments.and_then(|s| s.get(k));
        let _ = writeln!(
            out,
            "Segment {k} of {}: {}",
            segments.map_or(0, <[_]>::len),
            entry.map_or(String::new(), segment_line)
        );
        let failed = segment.report.checks.iter().filter(|c| c.outcome.is_err());
        for check in failed {
            if let Err(why) = &check.outcome {
                let _ = writeln!(out, "  ✕ {:<36} {}: {why}", check.subject, check.property);
            }
        }
        match &segment.report.hop {
            Some(hop) => hop_table(&mut out, hop),
            None => {
                let _ = writeln!(out, "  its hop check could not run");
            }
        }
        let _ = writeln!(
            out,
            "Segment {k}: {}",
            if segment.success() {
                "every record checks; what is missing is the declared loss"
            } else {
                "FAILED"
            }
        );
        let _ = writeln!(out);
    }
    if let Some(last) = segments.and_then(<[_]>::last) {
        let _ = writeln!(
            out,
            "Segment {} of {}: {}",
            segments.map_or(0, <[_]>::len) - 1,
            segments.map_or(0, <[_]>::len),
            segment_line(last)
        );
    }
    match (&report.hop, &report.hop_error) {
        (Some(hop), _) => hop_table(&mut out, hop),
        (None, Some(error)) => {
            let _ = writeln!(out, "Hop check could not run: {error}");
        }
        (None, None) => {
            let _ = writeln!(
                out,
                "No split-stage data: this record was served by one node, so there are no hops to check."
            );
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Result: {}",
        if report.success() { "OK" } else { "FAILED" }
    );
    out
}

/// `mesh-node stats`: the pools first (what a leak would fill), then the
/// counters.
pub fn node_stats(
    node: &crate::runtime::serve::PeerAddr,
    stats: &crate::runtime::serve::NodeStats,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{node}");
    let _ = writeln!(out, "slices");
    if stats.slices.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for slice in &stats.slices {
        let _ = writeln!(
            out,
            "  {:<6} layers {}..{}  caches {}/{}  {} steps in {} passes",
            slice.role,
            slice.layer_start,
            slice.layer_end,
            slice.caches_open,
            slice.max_requests,
            slice.steps,
            slice.passes
        );
    }
    let _ = writeln!(
        out,
        "pools{}",
        if stats.pools_empty() {
            " (all empty)"
        } else {
            ""
        }
    );
    for (name, value) in [
        ("request caches open", stats.caches_open),
        ("  of them kept for a resume", stats.caches_kept),
        ("records awaiting a seal", stats.records_pending),
        ("direct-return waiters", stats.direct_waiters),
        ("grant decisions held", stats.grant_decisions_waiting),
        ("requests waiting for a place", stats.requests_queued),
        ("peer connections kept", stats.peer_connections),
    ] {
        let _ = writeln!(out, "  {name:<26} {value}");
    }
    let _ = writeln!(out, "counters since start");
    for (name, value) in [
        ("requests completed", stats.requests_completed),
        ("requests failed", stats.requests_failed),
        ("requests cancelled", stats.requests_cancelled),
        ("requests refused (busy)", stats.requests_refused_busy),
        (
            "requests refused (no admissible backend)",
            stats.requests_refused_route,
        ),
        ("requests refused (other)", stats.requests_refused_other),
        ("tokens generated", stats.tokens_generated),
        ("audits passed", stats.audits_passed),
        ("audits failed", stats.audits_failed),
        ("audits unconcluded", stats.audits_unconcluded),
        ("audits let go (queued up)", stats.audits_let_go),
        ("requests served as a stage", stats.stage_requests),
        ("refused as a stage", stats.stage_refusals),
        (
            "stage records received proven in their log",
            stats.records_proven,
        ),
    ] {
        let _ = writeln!(out, "  {name:<26} {value}");
    }
    let steps: u64 = stats.step_round_trips.iter().sum();
    if steps > 0 {
        let _ = writeln!(out, "step round trips through the chain ({steps} steps)");
        let bounds = crate::runtime::serve::ROUND_TRIP_BUCKETS_US;
        for (i, count) in stats.step_round_trips.iter().enumerate() {
            if *count == 0 {
                continue;
            }
            let label = match bounds.get(i) {
                Some(us) if *us < 1_000 => format!("<= {us} µs"),
                Some(us) => format!("<= {} ms", us / 1_000),
                None => format!("> {} ms", bounds[bounds.len() - 1] / 1_000),
            };
            let _ = writeln!(out, "  {label:<26} {count}");
        }
    }
    out
}
