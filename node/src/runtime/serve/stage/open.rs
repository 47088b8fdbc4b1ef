//! OPEN, as a stage reads it: the request's run, capacity, deadline,
//! return mode, and a resume's claim.

use std::time::Duration;

use crate::runtime::serve::shared::Deadline;
use crate::runtime::serve::stage::role::StageRole;
use anyhow::{Context, bail};
use mesh_protocol::block::ReturnMode;
use mesh_protocol::cbor::{Cbor, Fields};
use mesh_protocol::control::MAX_CONTROL_TEXT;

/// What a stage reads from OPEN.
pub(crate) struct StageOpen {
    pub(crate) run_id: String,
    pub(crate) capacity: usize,
    pub(crate) prefill_steps: u64,
    /// `prefill_steps` as sent: in a resume that keeps caches, the
    /// replay's steps (none when every remote stage kept its cache), which
    /// the stage before a kept one sends no further, so a kept stage's
    /// first step is numbered this.
    pub(crate) replay_steps: u64,
    pub(crate) deadline: Deadline,
    pub(crate) return_mode: ReturnMode,
    /// A resumed request names the interrupted one: a stage where that
    /// one still runs (its upstream lost, its stream not yet timed out)
    /// ends it now.
    pub(crate) resumes: Option<u64>,
    pub(crate) keep: Option<StageResume>,
    /// The coordinator's signature over the resume claim
    /// (`resume::claim_message`): checked before anything is ended or kept.
    pub(crate) resume_sig: Option<Vec<u8>>,
}

/// OPEN of a resumed request whose chain keeps caches: the stages from
/// `kept_from` on take over the caches the interrupted request built, cut
/// back to `positions`; the stages before them rebuild theirs from the
/// prefill steps (the replay), and the last of those sends the replay no
/// further.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StageResume {
    pub(crate) of: u64,
    pub(crate) kept_from: u32,
    pub(crate) positions: u64,
}

impl StageOpen {
    pub(crate) fn parse(payload: &[u8], stage: &StageRole) -> anyhow::Result<Self> {
        let open = Cbor::decode(payload).context("malformed OPEN")?;
        let mut f = Fields::of(&open)?.text_limit(MAX_CONTROL_TEXT);
        let replay_steps = f.opt_uint("prefill_steps")?.unwrap_or(1);
        let mut parsed = Self {
            run_id: f.text("run_id")?.to_string(),
            capacity: f.uint("capacity")? as usize,
            prefill_steps: replay_steps.max(1),
            replay_steps,
            // The time its coordinator left the request, and one step
            // timeout more: at the deadline the coordinator's STOP ends the
            // request after the step in flight, and the coordinator reads
            // what this stage still sends for that long, so every hop's
            // lanes stay whole. This stage's own clock ends the request only
            // when its coordinator has gone quiet.
            deadline: Deadline::after(
                f.opt_uint("deadline_ms")?
                    .map_or(stage.shared.request_timeout, Duration::from_millis)
                    .saturating_add(stage.shared.step_timeout),
            ),
            return_mode: match f.opt_text("return_mode")? {
                Some("direct") => ReturnMode::Direct,
                _ => ReturnMode::Relayed,
            },
            resumes: f.opt_uint("resume_of")?,
            keep: None,
            resume_sig: f.opt_bytes("resume_sig")?.map(<[u8]>::to_vec),
        };
        parsed.keep = match (
            parsed.resumes,
            f.opt_uint("kept_from")?,
            f.opt_uint("keep_positions")?,
        ) {
            (_, None, None) => None,
            (Some(_), Some(0), Some(_)) => bail!("OPEN: kept_from names a remote stage"),
            (Some(of), Some(kept_from), Some(positions)) => Some(StageResume {
                of,
                kept_from: u32::try_from(kept_from).context("OPEN: kept_from")?,
                positions,
            }),
            _ => bail!("OPEN: kept_from and keep_positions come together, with resume_of"),
        };
        // Only a direct return lets a stage leave the replay's replies out:
        // relayed, every step's reply comes back through every stage.
        if parsed.keep.is_some() && parsed.return_mode != ReturnMode::Direct {
            bail!("OPEN: a resume that keeps caches needs the direct return");
        }
        if parsed.resumes.is_some() != parsed.resume_sig.is_some() {
            bail!("OPEN: resume_of and resume_sig come together");
        }
        if let Some(keep) = parsed.keep
            && keep.positions >= parsed.capacity as u64
        {
            bail!("OPEN: keep_positions leaves no room in the request's capacity");
        }
        // Carried down the chain as they are; the assignment is what counts.
        f.opt_text("coordinator")?;
        f.opt_uint("stage_count")?;
        f.finish().context("OPEN")?;
        Ok(parsed)
    }
}
