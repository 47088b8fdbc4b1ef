//! `record-push/1`: a stage pushes its sealed record to the coordinator
//! that assigned it, which checks it before it acknowledges.

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;

use crate::runtime::clock::lock;
use crate::runtime::net::msg;
use crate::runtime::records::{PushRefusal, Received, signed_refusal};
use crate::runtime::router::{Handled, ProtocolHandler};
use crate::runtime::serve::coordinator::role::CoordinatorRole;
use crate::runtime::serve::stats;
use anyhow;

/// The record-push protocol's handler: the coordinator's collector.
pub(crate) struct Push {
    pub(crate) coordinator: Arc<CoordinatorRole>,
}

impl ProtocolHandler for Push {
    fn accept(
        &self,
        peer: [u8; 32],
        _connection: &quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
    ) -> Handled {
        Box::pin(handle_push(self.coordinator.clone(), peer, send, recv))
    }
}

async fn handle_push(
    coordinator: Arc<CoordinatorRole>,
    peer: [u8; 32],
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) -> anyhow::Result<()> {
    // Only a node assigned a stage of a split this coordinator holds open has
    // a record to push: anyone else is refused before its body is read.
    if !lock(&coordinator.collector).expects_from(&peer) {
        let reply = signed_refusal(
            &coordinator.shared.key,
            b"",
            PushRefusal::NotAStageOfThisSplit,
        );
        send.write_all(&serde_json::to_vec(&reply)?).await?;
        send.finish()?;
        let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
        return Ok(());
    }
    let body = match tokio::time::timeout(msg::IDLE_TIMEOUT, recv.read_to_end(msg::MAX_RECORD_PUSH))
        .await
    {
        Ok(Ok(body)) => body,
        Ok(Err(_)) => {
            let reply = signed_refusal(&coordinator.shared.key, b"", PushRefusal::TooLarge);
            send.write_all(&serde_json::to_vec(&reply)?).await?;
            send.finish()?;
            return Ok(());
        }
        Err(_) => bail!("timed out reading a record push"),
    };
    let outcome = lock(&coordinator.collector).offer(&peer, &body);
    let reply = match outcome {
        Ok(received) => {
            if received == Received::Proven {
                stats::Counters::bump(&coordinator.shared.counters.records_proven);
            }
            coordinator.collected.notify_waiters();
            serde_json::json!({ "status": "received" })
        }
        Err(refusal) => signed_refusal(&coordinator.shared.key, &body, refusal),
    };
    send.write_all(&serde_json::to_vec(&reply)?).await?;
    send.finish()?;
    let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    Ok(())
}
