//! One request on a stage, from its OPEN to its record.

use std::sync::Arc;

use crate::runtime::serve::stage::admit::admit_stage;
use crate::runtime::serve::stage::role::StageRole;
use crate::runtime::serve::stage::run::run_stage;
use crate::runtime::serve::stage::seal::seal_stage;
use anyhow;

/// One request on a stage, in phases: admit (OPEN read and checked, the
/// sender the assigned upstream, a grant decision, a cache), run (the
/// request's steps, then whatever the neighbours still send) and seal (the
/// steward's receipt, the stage record pushed to the coordinator).
pub(crate) async fn handle_stage(
    stage: Arc<StageRole>,
    peer: [u8; 32],
    up_send: quinn::SendStream,
    up_recv: quinn::RecvStream,
    first: Vec<u8>,
) -> anyhow::Result<()> {
    let Some(admitted) = admit_stage(&stage, peer, (up_send, up_recv), first).await? else {
        return Ok(());
    };
    let ran = run_stage(&stage, admitted).await;
    // A failed run was reported and logged where it failed; its record is
    // sealed and pushed all the same.
    seal_stage(&stage, ran).await
}
