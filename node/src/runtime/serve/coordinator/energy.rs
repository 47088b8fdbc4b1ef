//! Energy: every served span of a request, as the receipts its bundle
//! carries say. The coordinator's receipt covers its own span only (seed
//! 001 §3.3 forbids presenting a part as the whole), so the requester is
//! given each part, labelled with its stage, node, provenance and receipt,
//! and their sum, and told how many routed stages sent no receipt.

use mesh_protocol::hex;
use mesh_protocol::mesh1::{Provenance, SealedReceipt};
use mesh_protocol::stage_receipt::CarriedStageReceipt;
use serde_json::{Value, json};

/// What the energy figures cover, in the words the API shows.
const COVERS: &str = "the served spans (engine time) of the coordinator and of every stage whose receipt came, each under its own steward's signature; routing, grant decisions and the network are not metered (seed 001 §3.3)";

/// The parts of `bundle`'s request (its earlier segments' stages first)
/// and the coordinator's `envelope`: `{served_span_uj, provenance, covers,
/// parts, stages_without_receipt}`.
pub(crate) fn energy_parts(bundle: &Value, envelope: &SealedReceipt) -> Value {
    let mut parts = Vec::new();
    let mut missing = 0usize;
    let segments = bundle["earlier_segments"]
        .as_array()
        .into_iter()
        .flatten()
        .chain([bundle]);
    for (segment, carried) in segments.enumerate() {
        let routed = carried["stewards"]
            .as_array()
            .map_or(0, |s| s.len().saturating_sub(1));
        let receipts = carried["stage_receipts"].as_array().into_iter().flatten();
        let mut came = 0usize;
        for entry in receipts {
            // Checked when it was pushed; read again here for its figures.
            let Ok(stage) = CarriedStageReceipt::from_value_at(entry, "") else {
                continue;
            };
            let Ok(sealed) = SealedReceipt::verify(&stage.envelope) else {
                continue;
            };
            came += 1;
            parts.push(part(segment, stage.stage_index, &sealed));
        }
        missing += routed.saturating_sub(came);
    }
    // One receipt of the coordinator's covers the whole request: it is
    // named with the final segment.
    let final_segment = bundle["earlier_segments"].as_array().map_or(0, Vec::len);
    parts.insert(0, part(final_segment, 0, envelope));
    let total: u64 = parts
        .iter()
        .map(|p| p["microjoules"].as_u64().unwrap_or(0))
        .fold(0, u64::saturating_add);
    let weakest = parts
        .iter()
        .filter_map(|p| p["provenance"].as_str().and_then(Provenance::parse))
        .max_by_key(|p| grade_weakness(*p))
        .unwrap_or(Provenance::Estimator);
    json!({
        "served_span_uj": total,
        "provenance": weakest.as_str(),
        "covers": COVERS,
        "parts": parts,
        "stages_without_receipt": missing,
    })
}

fn part(segment: usize, stage: u32, sealed: &SealedReceipt) -> Value {
    let receipt = &sealed.receipt;
    json!({
        "segment": segment,
        "stage": stage,
        "node": receipt.steward,
        "backend": receipt.backend,
        "microjoules": receipt.energy.uj(),
        "provenance": receipt.energy.provenance().as_str(),
        "envelope_id": hex::encode(&sealed.envelope_id()),
    })
}

/// A sum is only as good as its weakest part: an estimate anywhere makes
/// the whole an estimate.
fn grade_weakness(provenance: Provenance) -> u8 {
    match provenance {
        Provenance::HwShunt => 0,
        Provenance::ModelBased => 1,
        Provenance::Estimator => 2,
    }
}
