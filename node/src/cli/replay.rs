//! `mesh-node replay` (re-execute a serve against its receipt, SPEC §6.4)
//! and `mesh-node steward open` (a steward discloses one receipt's opening).

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, bail};
use mesh_protocol::mesh1::{SealedReceipt, opening, opening_key, prompt_payload};
use mesh_protocol::replay::{
    NotReplayable, Replayer, Verdict, check_replayable, judge, request_id_of,
};
use mesh_protocol::route::RouteRequest;
use serde_json::json;

use super::verify::read_receipt;

/// Exit status of a replay the verdict says is not replayable.
const EXIT_NOT_REPLAYABLE: u8 = 3;

/// What `replay` is given besides the bundle.
#[derive(Debug)]
pub struct ReplayArgs<'a> {
    pub bundle: &'a Path,
    pub model: &'a Path,
    pub prompt_file: &'a Path,
    /// The prompt was sent with the model's chat template applied.
    pub chat: bool,
    pub opening: Option<&'a str>,
    pub output_file: Option<&'a Path>,
    /// Where to re-execute.
    pub device: mesh_stage::DeviceChoice,
    pub json: bool,
}

/// The disclosed output: a JSON array of token ids, or an object with a
/// `token_ids` array (what `generate --json` prints, under `details`).
fn read_output(path: &Path) -> anyhow::Result<Vec<u32>> {
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let value = mesh_protocol::json::parse_strict(&text)
        .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", path.display()))?;
    let ids = value
        .as_array()
        .or_else(|| value["token_ids"].as_array())
        .or_else(|| value["details"]["token_ids"].as_array())
        .with_context(|| format!("{}: no token ids", path.display()))?;
    ids.iter()
        .map(|id| {
            id.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .context("a token id is not a u32")
        })
        .collect()
}

/// The request's figures from the bundle's route table, when `path` is a
/// bundle whose table belongs to the receipt (bound by its signed `route`
/// line); `None` for a bare envelope.
fn request_figures(path: &Path, sealed: &SealedReceipt) -> Option<RouteRequest> {
    let bytes = std::fs::read(path).ok()?;
    let document = mesh_protocol::json::parse_strict(&bytes).ok()?;
    let (_, route) = mesh_protocol::bundle::carried_receipt(&document).ok()?;
    let route = mesh_protocol::route::check_table(route?, &sealed.receipt).ok()?;
    Some(route.request)
}

/// `mesh-node replay`: exit 0 verified, 1 diverged, 3 not replayable.
pub fn replay(args: &ReplayArgs<'_>) -> anyhow::Result<ExitCode> {
    // A device this binary cannot use is refused before any file is read.
    let device = args.device.open()?;
    let sealed = read_receipt(args.bundle).map_err(anyhow::Error::msg)?;
    let receipt = &sealed.receipt;
    let opening = args
        .opening
        .map(|hex| {
            mesh_protocol::hex::decode_array::<32>(hex.trim())
                .context("--opening is 32 bytes of hex")
        })
        .transpose()?;
    let disclosed = args.output_file.map(read_output).transpose()?;
    let handle = mesh_stage::ModelHandle::open(args.model)?.on_device(device);
    let prompt = std::fs::read_to_string(args.prompt_file)
        .with_context(|| format!("reading {}", args.prompt_file.display()))?;
    let text = if args.chat {
        handle.text()?.chat_prompt(&prompt)?
    } else {
        prompt.clone()
    };
    let ids = handle.text()?.encode(&text)?;
    let payload = prompt_payload(&ids);
    let recipe = super::weights::recipe_of(args.model);
    let replayer = Replayer {
        weights: handle.weights_digest(),
        recipe: &recipe,
        prompt_tokens: ids.len() as u64,
        request_id: request_figures(args.bundle, &sealed)
            .map(|figures| request_id_of(prompt.as_bytes(), &figures)),
    };
    // The receipt's counts come from whoever signed it: bounded by the
    // model's context before anything is generated.
    let context = handle
        .config()
        .context
        .min(mesh_stage::model::MAX_ENGINE_CONTEXT);
    let fits = usize::try_from(receipt.tokens_out)
        .ok()
        .and_then(|out| out.checked_add(ids.len()))
        .is_some_and(|total| total <= context);
    // Nothing is run for a serve that cannot be replayed.
    let checked = check_replayable(receipt, &replayer, opening.as_ref())
        .and_then(|()| fits.then_some(()).ok_or(NotReplayable::DoesNotFit));
    let rerun = match &checked {
        Err(_) => Vec::new(),
        Ok(()) => {
            let layers = handle.config().layers;
            let pipeline = mesh_stage::pipeline::Pipeline::new(
                vec![handle.load_slice(0..layers)?],
                mesh_stage::frame::WireDType::F32,
            )?;
            let mut sampler =
                mesh_stage::sampling::Sampler::new(mesh_stage::sampling::SamplingParams::greedy());
            let codec = handle.text()?;
            pipeline
                .generate(
                    &ids,
                    receipt.tokens_out as usize,
                    &mut sampler,
                    &|t| codec.is_eos(t),
                    &mut |_| {},
                )?
                .tokens
        }
    };
    let verdict = match checked {
        Err(reason) => Verdict::NotReplayable(reason),
        Ok(()) => judge(
            receipt,
            &replayer,
            opening.as_ref(),
            &payload,
            &rerun,
            disclosed.as_deref(),
        ),
    };
    let (name, detail, code) = match &verdict {
        Verdict::Verified => (
            "verified".to_string(),
            format!("the re-run's {} tokens open the commitment", rerun.len()),
            ExitCode::SUCCESS,
        ),
        Verdict::Diverged { at } => (
            format!("diverged at token {at}"),
            format!(
                "the disclosed output opens the commitment on this payload; the re-run gives {:?} there, the serve {:?}",
                rerun.get(*at),
                disclosed.as_ref().and_then(|d| d.get(*at))
            ),
            ExitCode::from(1),
        ),
        Verdict::NotReplayable(reason) => (
            "not replayable".to_string(),
            reason.reason(),
            ExitCode::from(EXIT_NOT_REPLAYABLE),
        ),
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "verdict": match verdict {
                    Verdict::Verified => "verified",
                    Verdict::Diverged { .. } => "diverged",
                    Verdict::NotReplayable(_) => "not_replayable",
                },
                "diverged_at": match verdict { Verdict::Diverged { at } => Some(at), _ => None },
                "reason": match &verdict { Verdict::NotReplayable(r) => Some(r.reason()), _ => None },
                "reason_kind": match &verdict { Verdict::NotReplayable(r) => Some(r.kind()), _ => None },
                "request_id": mesh_protocol::hex::encode(&receipt.request_id),
                "steward": receipt.steward,
                "prompt_tokens": ids.len(),
                "rerun_tokens": rerun,
            }))?
        );
    } else {
        println!(
            "{}: receipt of request {} sealed by {}\n{name}: {detail}",
            args.bundle.display(),
            mesh_protocol::hex::encode(&receipt.request_id),
            receipt.steward
        );
    }
    Ok(code)
}

/// Why `open` refuses a receipt: not this steward's, so its opening is not
/// this key's to give.
pub fn not_ours(sealed: &SealedReceipt, key: &mesh_protocol::SigningKey) -> Option<String> {
    let ours = mesh_protocol::identity::did_key(&key.verifying_key().to_bytes());
    (sealed.receipt.steward != ours).then(|| {
        format!(
            "the receipt was sealed by {}, not by this key ({ours}): only its steward can open it",
            sealed.receipt.steward
        )
    })
}

/// `mesh-node steward open RECEIPT --key K`: the opening of that receipt's
/// output commitment, and of no other (it binds the receipt's request id).
pub fn open(receipt: &Path, key: &mesh_protocol::SigningKey, json: bool) -> anyhow::Result<()> {
    let sealed = read_receipt(receipt).map_err(anyhow::Error::msg)?;
    if let Some(refusal) = not_ours(&sealed, key) {
        bail!("{refusal}");
    }
    if sealed.receipt.output_commitment.is_none() {
        bail!("{}", NotReplayable::NoCommitment.reason());
    }
    let value = opening(&opening_key(&key.to_bytes()), &sealed.receipt.request_id);
    if json {
        println!(
            "{}",
            json!({
                "request_id": mesh_protocol::hex::encode(&sealed.receipt.request_id),
                "opening": mesh_protocol::hex::encode(&value),
            })
        );
    } else {
        println!("{}", mesh_protocol::hex::encode(&value));
    }
    Ok(())
}

/// `mesh-node replay BUNDLE --model M --tape TAPE`: run each stage's layers
/// again, stage after stage, on the inputs the tape says stage 1 was given
/// (and, after it, what the stage before computes), and name the first
/// stage whose output is not what its layers give: a middle stage against
/// the forward lane its own signed record sealed, the final stage against
/// the replies the tape holds. Exit 0 every stage agreed, 1 a stage
/// diverged, 3 not replayable.
pub fn replay_tape(
    bundle: &Path,
    model: &Path,
    tape: &Path,
    device: mesh_stage::DeviceChoice,
    json: bool,
) -> anyhow::Result<ExitCode> {
    use crate::runtime::serve::coordinator::audit::{AuditCase, AuditedStage, Verdict, audit};
    let device = device.open()?;
    let bytes = std::fs::read(bundle).with_context(|| format!("reading {}", bundle.display()))?;
    let document = mesh_protocol::json::parse_strict(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", bundle.display()))?;
    let carried = mesh_protocol::bundle::MeshBundle::from_value(&document)
        .map_err(|e| anyhow::anyhow!("{}: not a split's bundle: {e}", bundle.display()))?;
    // The records it holds each stage to must be the routed nodes' own:
    // the bundle's checks first (signatures, stewards as routed, each
    // stage's record signed by its node). A failed audit it carries is
    // what this run looks at again, not a reason to stop.
    let report = mesh_protocol::verify::verify_document(&document)
        .map_err(|e| anyhow::anyhow!("{}: at {e}", bundle.display()))?;
    if let Some(failed) = report
        .checks
        .iter()
        .find(|c| c.outcome.is_err() && !c.subject.starts_with("audit"))
    {
        bail!(
            "{}: the bundle does not verify ({} {}: {}): `mesh-node verify` says more",
            bundle.display(),
            failed.subject,
            failed.property,
            failed.outcome.as_ref().err().map_or("", String::as_str)
        );
    }
    let main = mesh_protocol::capsule::SealedRecord::verify(carried.main_record.clone())
        .context("the bundle's main record")?;
    let own = main.stage_block().context("the main record's own slice")?;
    let tape_bytes = std::fs::read(tape).with_context(|| format!("reading {}", tape.display()))?;
    let tape = mesh_protocol::tape::Tape::decode(&tape_bytes)
        .with_context(|| format!("{}: not a mesh-node-tape/1 file", tape.display()))?;
    let handle = mesh_stage::ModelHandle::open(model)?.on_device(device);
    if handle.package_id() != own.package_id {
        bail!(
            "{} is not the model the serve ran (its package id differs)",
            model.display()
        );
    }
    let mut stages = Vec::new();
    for k in 1..own.stage_count {
        let block = carried
            .split_stage_records
            .iter()
            .filter_map(|record| mesh_protocol::capsule::SealedRecord::verify(record.clone()).ok())
            .find_map(|record| {
                let block = record.stage_block().ok()?;
                (block.stage_index == k && block.split_key() == own.split_key())
                    .then_some((record.key_id(), block))
            });
        let Some((node, block)) = block else {
            bail!("stage {k}'s signed record is not in the bundle: nothing to hold it to");
        };
        stages.push(AuditedStage {
            index: k,
            node,
            layers: block.layer_start..block.layer_end,
            claimed_sent: crate::runtime::serve::coordinator::audit::sent_on(&block),
            claimed_received: block.upstream.map(|u| u.received),
        });
    }
    let case = AuditCase {
        scope: mesh_protocol::session::RequestScope {
            split: own.split_key(),
            stage_count: own.stage_count,
            return_mode: own.return_mode,
        },
        stages,
        tape,
    };
    let verdict = audit(&handle, &case);
    let (name, code) = match &verdict {
        Verdict::Passed => ("every stage agreed", ExitCode::SUCCESS),
        Verdict::Failed { .. } => ("a stage diverged", ExitCode::from(1)),
        Verdict::Unauditable(_) => ("not replayable", ExitCode::from(EXIT_NOT_REPLAYABLE)),
    };
    let line = verdict.describe(&case.scope.split);
    if json {
        let (stage, node, step) = match &verdict {
            Verdict::Failed {
                stage, node, step, ..
            } => (
                Some(*stage),
                Some(mesh_protocol::identity::did_key(node)),
                *step,
            ),
            _ => (None, None, None),
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "verdict": match verdict {
                    Verdict::Passed => "agreed",
                    Verdict::Failed { .. } => "diverged",
                    Verdict::Unauditable(_) => "not_replayable",
                },
                "diverged_stage": stage,
                "node_id": node,
                "step": step,
                "said": line,
            }))?
        );
    } else {
        println!("{}: {name}\n{line}", bundle.display());
    }
    Ok(code)
}
