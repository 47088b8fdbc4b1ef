//! Seal: each segment's split, the `mesh/1` receipt through the steward,
//! and the bundle a requester checks.

use std::sync::Arc;
use std::time::Instant;

use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::serve::coordinator::admit::Admitted;
use crate::runtime::serve::coordinator::collect::Collected;
use crate::runtime::serve::coordinator::collect::await_records;
use crate::runtime::serve::coordinator::drive::Driven;
use crate::runtime::serve::coordinator::progress::Progress;
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::coordinator::runs::Run;
use anyhow::{Context, bail};
use mesh_protocol::block::{TerminalState, Tokens};
use mesh_protocol::capsule::{Producer, SealedRecord, format_timestamp};
use mesh_protocol::identity::did_key;
use mesh_protocol::json::canonical_bytes;
use mesh_protocol::mesh1::{
    DecisionOutcome, FidelityReport, MeshReceipt, WeightsBinding, opening, output_commitment,
    prompt_payload,
};
use mesh_protocol::session::SliceFacts;
use mesh_protocol::split::{SealEnvironment, SplitSealInput, seal_split};
use mesh_protocol::stage_receipt::CarriedStageReceipt;
use serde_json::json;

/// The sealed request: its bundle and the `mesh/1` envelope.
pub(crate) struct Sealed {
    pub(crate) bundle: serde_json::Value,
    pub(crate) envelope: mesh_protocol::mesh1::SealedReceipt,
}

impl Sealed {
    /// The bundle carries the request's signed audit, when it had one.
    pub(crate) fn carry(&mut self, audit: Option<mesh_protocol::audit::SignedAudit>) {
        if let (Some(audit), serde_json::Value::Object(bundle)) = (audit, &mut self.bundle) {
            bundle.insert("audit".into(), audit.to_value());
        }
    }
}

/// Seal one segment's split: the own block (its lanes and what it
/// prefilled and decoded), the stage-exchange records and the main record,
/// chained after the coordinator's last.
pub(crate) fn seal_segment(
    coordinator: &Arc<CoordinatorRole>,
    run: &Run,
    driven: &Driven,
    records: &[Vec<SealedRecord>],
) -> anyhow::Result<(mesh_protocol::split::SealedSplit, u64)> {
    let (terminal, prefilled) = (driven.terminal, driven.prefilled);
    let lanes = driven.lanes.whole()?;
    let n = run.assigns.len() as u32;
    let own_block = lanes.session.block(
        &SliceFacts {
            topology_hash: run.assigns[0].topology_hash.clone(),
            stage_index: 0,
            layer_start: run.own.slice.range.start,
            layer_end: run.own.slice.range.end,
            package_id: coordinator.shared.model.package_id(),
            manifest_sha256: run.assigns[0].manifest,
            source_model_sha256: coordinator.shared.model.package_id(),
        },
        Tokens {
            prefill_received: prefilled as u64,
            decode: driven.own_decode_rows,
        },
        terminal,
    );
    let nonces = (0..n)
        .map(|_| crate::runtime::keys::random_bytes())
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Read and advanced under one lock: two requests sealing at once each
    // chain after the other.
    let mut chain_head = lock(&coordinator.chain_head);
    let sealed = seal_split(
        &SplitSealInput {
            own: &own_block,
            topology: &run.topology,
            manifests: &run.assigns.iter().map(|a| a.manifest).collect::<Vec<_>>(),
            held: records,
            not_requested: &[],
            coordinator_term: coordinator.coordinator_term,
            stage_seal_deadline_ms: coordinator.settings.seal_deadline.as_millis() as u64,
            model_id: &coordinator.shared.model_id(),
        },
        &SealEnvironment {
            producer: Producer::mesh_node(),
            timestamp: format_timestamp(now_ms()),
            nonces,
            chain_head: *chain_head,
        },
        &coordinator.shared.key,
    )?;
    *chain_head = Some(sealed.chain_head());
    drop(chain_head);
    // Every record this node sealed goes into its transparency log before
    // it leaves: the stage-exchange records, then the main record.
    let ids: Vec<[u8; 32]> = sealed
        .stage_exchange_records
        .iter()
        .chain([&sealed.main_record])
        .map(SealedRecord::capsule_id)
        .collect();
    let leaves = lock(&coordinator.shared.steward).log_records(&ids)?;
    let main_leaf = leaves.last().copied().context("the main record's leaf")?;
    Ok((sealed, main_leaf))
}

/// A segment's bundle: its records, the node behind each stage, and the
/// stages' own receipts that came.
pub(crate) fn segment_bundle(
    sealed: &mesh_protocol::split::SealedSplit,
    run: &Run,
    receipts: &[CarriedStageReceipt],
) -> serde_json::Value {
    let mut bundle = sealed.bundle();
    if let serde_json::Value::Object(map) = &mut bundle {
        if !receipts.is_empty() {
            map.insert(
                "stage_receipts".into(),
                receipts.iter().map(CarriedStageReceipt::to_value).collect(),
            );
        }
        map.insert(
            "stewards".into(),
            json!(
                run.keys
                    .iter()
                    .enumerate()
                    .map(|(k, key)| json!({ "stage_index": k, "node_id": did_key(key) }))
                    .collect::<Vec<_>>()
            ),
        );
    }
    bundle
}

/// The resume block's entry for one segment.
pub(crate) fn segment_entry(
    sealed: &mesh_protocol::split::SealedSplit,
    run: &Run,
    driven: &Driven,
) -> mesh_protocol::resume::Segment {
    mesh_protocol::resume::Segment {
        run_id: run.assigns[0].run_id.clone(),
        main_record: sealed.main_record.capsule_id(),
        nodes: run.keys.iter().map(did_key).collect(),
        first_token: driven.first_token as u64,
        prefilled: driven.prefilled as u64,
        tokens: driven.tokens as u64,
        terminal_state: driven.terminal.as_str().to_string(),
        lost: driven.lost.iter().map(did_key).collect(),
        kept: driven.kept.iter().map(did_key).collect(),
    }
}

/// The segments that lost their chain, sealed after the request ends: by
/// then their survivors' records and last frames have come in.
pub(crate) async fn seal_interrupted(
    coordinator: &Arc<CoordinatorRole>,
    interrupted: Vec<Interrupted<'_>>,
) -> anyhow::Result<Vec<(serde_json::Value, mesh_protocol::resume::Segment)>> {
    let until = Instant::now() + coordinator.settings.seal_deadline;
    let mut sealed_segments = Vec::new();
    for mut segment in interrupted {
        let stages = await_records(
            coordinator,
            &mut segment.admitted,
            &mut segment.driven,
            until,
        )
        .await?;
        let (sealed, main_leaf) =
            seal_segment(coordinator, &segment.run, &segment.driven, &stages.records)?;
        let mut bundle = segment_bundle(&sealed, &segment.run, &stages.receipts);
        // Each segment's main record proven in the log on its own.
        with_log_proof(coordinator, &mut bundle, main_leaf);
        sealed_segments.push((
            bundle,
            segment_entry(&sealed, &segment.run, &segment.driven),
        ));
    }
    Ok(sealed_segments)
}

/// Seal: the final segment's split, then the `mesh/1` receipt through the
/// steward (with the resume block of a resumed request), and the bundle a
/// requester checks (with the earlier segments).
pub(crate) fn seal(
    coordinator: &Arc<CoordinatorRole>,
    run: &Arc<Run>,
    admitted: &Admitted<'_>,
    driven: &Driven,
    progress: &Progress,
    collected: Collected,
    earlier: Vec<(serde_json::Value, mesh_protocol::resume::Segment)>,
) -> anyhow::Result<Sealed> {
    let codec = coordinator.shared.model.text()?;
    let prompt_ids = &admitted.prompt_ids;
    let serve = &admitted.serve;
    let tokens = &progress.tokens;
    let Collected { metered, stages } = collected;
    let (split, resumed) = seal_final_segment(coordinator, run, driven, &stages.records, &earlier)?;
    let model_id = coordinator.shared.model_id();

    let visible: Vec<u32> = tokens
        .iter()
        .copied()
        .filter(|t| !codec.is_eos(*t))
        .collect();
    let opening_value = opening(
        &lock(&coordinator.shared.steward).opening_key(),
        &serve.request_id(),
    );
    // The level the router admitted it on, and what it delivered (§3.2.1):
    // all of it only when it ran to its own end or to every token asked.
    let chosen = admitted
        .route
        .chosen()
        .context("a request was admitted with no backend chosen")?;
    let advertised = chosen.fidelity;
    let asked = admitted.asked_tokens;
    let ran_to_its_end = driven.terminal == TerminalState::Completed
        && (progress.finish_reason == "stop" || tokens.len() >= asked);
    // What a chain costs is learnt from serves that ran to their end on
    // it alone: a failed or cut-short one (which a stranger can cause) says
    // little about the next.
    // A decision is a prefill alone, far cheaper per token than decoding:
    // it would teach generations a cost they do not have.
    if resumed.is_none()
        && driven.terminal == TerminalState::Completed
        && admitted.decision.is_none()
    {
        lock(&coordinator.routing.costs).record(
            &chosen.backend,
            metered.energy.uj(),
            (prompt_ids.len() + tokens.len()) as u64,
        );
    }
    let receipt = MeshReceipt {
        request_id: serve.request_id(),
        grant_id: metered.grant_id,
        backend: run.backend().into(),
        recipe: model_id.clone(),
        weights: Some(WeightsBinding {
            weights_digest: coordinator.shared.model.weights_digest(),
            precision: coordinator
                .shared
                .model
                .precision(coordinator.settings.wire)
                .to_string(),
        }),
        route: admitted.route.justification(),
        tokens_in: prompt_ids.len() as u64,
        tokens_out: tokens.len() as u64,
        tokens_accepted: visible.len() as u64,
        cache_hit_tokens: 0,
        spec_proposed: progress.spec_proposed,
        spec_accepted: progress.spec_accepted,
        fidelity_floor: serve.fidelity_floor,
        fidelity: Some(FidelityReport {
            advertised,
            delivered: mesh_protocol::route::delivered(advertised, ran_to_its_end),
        }),
        fidelity_rating: advertised,
        energy: metered.energy,
        // A decision's figures (§3.6): its unit of work is the question
        // answered, and it commits to no output tokens (it emits none).
        decision: serve.decision.map(|asked| DecisionOutcome {
            questions_answered: u32::from(progress.decided.is_some()),
            // Options count as scored only once they were.
            options_scored: if progress.decided.is_some() {
                asked.options_scored
            } else {
                0
            },
            schema_tokens: asked.schema_tokens,
        }),
        grant_breach: metered
            .debit
            .as_ref()
            .and_then(|d| d.breach)
            .map(str::to_string),
        output_commitment: serve.decision.is_none().then(|| {
            output_commitment(
                &opening_value,
                &serve.request_id(),
                &prompt_payload(prompt_ids),
                tokens,
            )
        }),
        sequence: 0,
        prev: None,
        nonce: crate::runtime::keys::random_bytes()?,
        steward: String::new(),
        split: split
            .as_ref()
            .map(|(sealed, _)| canonical_bytes(&sealed.receipt.to_value())),
        resumed,
        // The engine's declaration (SPEC §5), under the steward's signature.
        deterministic: Some(progress.deterministic && earlier.is_empty()),
        training: coordinator.training,
    };
    // The previous envelope is the steward's (kept in its journal, so the
    // chain link survives a restart), read under the same lock as the seal.
    let (previous_envelope, envelope) = {
        let mut steward = lock(&coordinator.shared.steward);
        let previous = steward.last_envelope();
        (previous, steward.seal(receipt)?)
    };

    let earlier = earlier.into_iter().map(|(bundle, _)| bundle).collect();
    let bundle = match &split {
        Some((sealed, main_leaf)) => request_bundle(
            coordinator,
            (sealed, run, &stages.receipts),
            admitted,
            (&envelope, previous_envelope),
            earlier,
            *main_leaf,
        ),
        None => mesh_protocol::bundle::Mesh1Bundle::to_value(
            &envelope.envelope,
            previous_envelope
                .filter(|_| envelope.receipt.sequence > 0)
                .as_deref(),
            Some(admitted.route.to_json()),
        ),
    };
    Ok(Sealed { bundle, envelope })
}

/// A segment's sealed split and its main record's leaf in the log.
type SplitSealed = (mesh_protocol::split::SealedSplit, u64);

/// The final segment's split (with its main record's leaf in the log),
/// and for a resumed request the resume block's bytes; no split for a node
/// that ran every layer alone (its receipt is a plain one).
fn seal_final_segment(
    coordinator: &Arc<CoordinatorRole>,
    run: &Run,
    driven: &Driven,
    records: &[Vec<SealedRecord>],
    earlier: &[(serde_json::Value, mesh_protocol::resume::Segment)],
) -> anyhow::Result<(Option<SplitSealed>, Option<Vec<u8>>)> {
    if run.alone() {
        if !earlier.is_empty() {
            bail!("a resumed request ended on no split");
        }
        return Ok((None, None));
    }
    let (sealed, main_leaf) = seal_segment(coordinator, run, driven, records)?;
    let resumed = (!earlier.is_empty()).then(|| {
        let mut segments: Vec<_> = earlier.iter().map(|(_, entry)| entry.clone()).collect();
        segments.push(segment_entry(&sealed, run, driven));
        canonical_bytes(&mesh_protocol::resume::ResumeBlock { segments }.to_value())
    });
    Ok((Some((sealed, main_leaf)), resumed))
}

/// The request's bundle: its last segment's, with the `mesh/1` envelope
/// (and the one before it in the steward's chain), the route table, the
/// earlier segments' bundles, and where checkpoints are kept, the
/// receipt's inclusion proof.
fn request_bundle(
    coordinator: &CoordinatorRole,
    (sealed, run, receipts): (
        &mesh_protocol::split::SealedSplit,
        &Run,
        &[CarriedStageReceipt],
    ),
    admitted: &Admitted<'_>,
    (envelope, previous_envelope): (&mesh_protocol::mesh1::SealedReceipt, Option<Vec<u8>>),
    earlier: Vec<serde_json::Value>,
    main_leaf: u64,
) -> serde_json::Value {
    let mut bundle = segment_bundle(sealed, run, receipts);
    if let serde_json::Value::Object(map) = &mut bundle {
        map.insert(
            "mesh1_envelope".into(),
            json!(mesh_protocol::hex::encode(&envelope.envelope)),
        );
        // Every backend weighed, bound to the receipt by its `route` line.
        map.insert("route".into(), admitted.route.to_json());
        if let Some(prev) = previous_envelope.filter(|_| envelope.receipt.sequence > 0) {
            map.insert(
                "mesh1_prev_envelope".into(),
                json!(mesh_protocol::hex::encode(&prev)),
            );
        }
        if !earlier.is_empty() {
            map.insert("earlier_segments".into(), serde_json::Value::Array(earlier));
        }
    }
    with_log_proof(coordinator, &mut bundle, main_leaf);
    bundle
}

/// Where checkpoints are kept: the inclusion proof of a segment's main
/// record (at `main_leaf` of this node's log) and the checkpoint it is
/// proven under, in its bundle.
fn with_log_proof(coordinator: &CoordinatorRole, bundle: &mut serde_json::Value, main_leaf: u64) {
    if let (Some((inclusion, checkpoint)), serde_json::Value::Object(map)) = (
        coordinator
            .shared
            .record_checkpoints
            .then(|| coordinator.shared.log_proof(main_leaf))
            .flatten(),
        bundle,
    ) {
        map.insert("inclusion".into(), inclusion);
        map.insert("checkpoint".into(), checkpoint);
    }
}

/// A segment that lost its chain, kept to be sealed with the rest.
pub(crate) struct Interrupted<'a> {
    pub(crate) run: Arc<Run>,
    pub(crate) admitted: Admitted<'a>,
    pub(crate) driven: Driven,
}
