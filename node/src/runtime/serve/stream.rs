//! `mesh-stage/1`: a request's stream from the stage before (OPEN, then
//! its steps), or a final stage's direct return to its coordinator
//! (DIRECT_OPEN). Only an opening's worth is read before the sender is
//! checked; then the stream is the stage's, or the waiting request's.

use std::sync::Arc;

use anyhow::{Context, bail};

use crate::runtime::net::msg::{self, kind};
use crate::runtime::router::{Handled, ProtocolHandler};
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::stage;
use crate::runtime::serve::stage::role::MAX_STAGE_OPEN;
use crate::runtime::serve::stage::role::StageRole;
use anyhow;

/// The stage protocol's handler.
pub(crate) struct StageStreams {
    pub(crate) stage: Arc<StageRole>,
    pub(crate) coordinator: Arc<CoordinatorRole>,
}

impl ProtocolHandler for StageStreams {
    fn accept(
        &self,
        peer: [u8; 32],
        _connection: &quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
    ) -> Handled {
        let (stage, coordinator) = (self.stage.clone(), self.coordinator.clone());
        Box::pin(async move {
            let mut recv = recv;
            let first = msg::read(&mut recv, MAX_STAGE_OPEN, msg::IDLE_TIMEOUT)
                .await?
                .context("empty stage stream")?;
            let (message_kind, request_id, _, _) = msg::parse_stage(&first)?;
            match message_kind {
                kind::DIRECT_OPEN => {
                    coordinator.accept_direct(peer, request_id, (send, recv, first))
                }
                kind::OPEN => stage::request::handle_stage(stage, peer, send, recv, first).await,
                _ => bail!("a stage stream must start with OPEN"),
            }
        })
    }
}
