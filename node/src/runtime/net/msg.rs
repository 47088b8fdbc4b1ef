//! Length-prefixed messages on QUIC streams, bounded and timed. On
//! `mesh-stage/1` every message is a *frame* for the lane fold: the exact
//! bytes written (length prefix included) are folded by the writer, and the
//! exact bytes read by the reader, before anything parses them.

use std::time::Duration;

use std::sync::LazyLock;

use anyhow::{Context, bail};
use mesh_protocol::cbor::Cbor;
use tokio::sync::Semaphore;

/// Largest control message (a bundle rides in one).
pub const MAX_CONTROL_MESSAGE: usize = 16 * 1024 * 1024;
/// Largest control message a node accepts from a peer (a request, an
/// assignment, an authorisation: prompts and presentations, never bundles).
pub const MAX_CONTROL_REQUEST: usize = 1024 * 1024;
/// Bytes of message bodies being read at once, over every stream of the
/// process: a body is allocated as its bytes arrive and counted here until
/// it is whole, so declared lengths cost nothing and slow senders together
/// hold at most this much.
pub const MAX_INBOUND_BYTES: usize = 512 * 1024 * 1024;
/// Largest stage message: an activation frame plus the header.
pub const MAX_STAGE_MESSAGE: usize = mesh_stage::frame::MAX_FRAME_PAYLOAD + 64;
/// Largest record-push body, as Mesh-LLM's MAX_SIDE_STREAM_BYTES.
pub const MAX_RECORD_PUSH: usize = 1024 * 1024;
/// How long a peer may stay silent mid-request.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Frame a message: `u32 LE length ‖ body`.
pub fn frame(body: &[u8]) -> anyhow::Result<Vec<u8>> {
    let length = u32::try_from(body.len()).context("message over 4 GiB")?;
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&length.to_le_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

/// Write one framed message (not folded: a frame that enters a lane is
/// framed and folded by the hop session's owner, then written).
pub async fn write(send: &mut quinn::SendStream, body: &[u8]) -> anyhow::Result<usize> {
    let bytes = frame(body)?;
    tokio::time::timeout(IDLE_TIMEOUT, send.write_all(&bytes))
        .await
        .context("timed out writing to the peer")??;
    Ok(bytes.len())
}

/// Read one framed message; `None` when the peer finished the stream
/// cleanly between messages. Returns the whole frame (prefix included).
/// `timeout` bounds the wait for the message to start, and then the whole
/// body. Bodies count against the process-wide `MAX_INBOUND_BYTES` while
/// they arrive.
pub async fn read(
    recv: &mut quinn::RecvStream,
    max: usize,
    timeout: Duration,
) -> anyhow::Result<Option<Vec<u8>>> {
    read_framed(recv, max, timeout, true).await
}

/// As `read`, for a stream whose sender's authority was checked (a stage's
/// assigned upstream or downstream, the final stage's direct return): its
/// messages are bounded by the protocol (one per step per request), so they
/// do not compete with unchecked senders for `MAX_INBOUND_BYTES`.
pub async fn read_checked(
    recv: &mut quinn::RecvStream,
    max: usize,
    timeout: Duration,
) -> anyhow::Result<Option<Vec<u8>>> {
    read_framed(recv, max, timeout, false).await
}

async fn read_framed(
    recv: &mut quinn::RecvStream,
    max: usize,
    timeout: Duration,
    counted_inbound: bool,
) -> anyhow::Result<Option<Vec<u8>>> {
    let mut prefix = [0u8; 4];
    let mut filled = 0;
    while filled < 4 {
        let n = tokio::time::timeout(timeout, recv.read(&mut prefix[filled..]))
            .await
            .context("timed out waiting for the peer")??;
        match n {
            Some(n) => filled += n,
            None if filled == 0 => return Ok(None),
            None => bail!("the peer closed the stream inside a message header"),
        }
    }
    let length = u32::from_le_bytes(prefix) as usize;
    if length > max {
        bail!("message of {length} bytes is over the {max}-byte limit");
    }
    let mut bytes = Vec::with_capacity(4 + length.min(READ_CHUNK));
    bytes.extend_from_slice(&prefix);
    let mut counted = Vec::new();
    // The whole body within one timeout: a sender trickling bytes holds its
    // share of the bound for at most that long.
    let body_deadline = tokio::time::Instant::now() + timeout;
    while bytes.len() < 4 + length {
        let want = (4 + length - bytes.len()).min(READ_CHUNK);
        let chunk = tokio::time::timeout_at(body_deadline, recv.read_chunk(want, true))
            .await
            .context("timed out reading a message body")??
            .context("the peer closed the stream inside a message")?;
        if counted_inbound {
            let permits = u32::try_from(chunk.bytes.len()).context("chunk size")?;
            counted.push(
                INBOUND
                    .clone()
                    .try_acquire_many_owned(permits)
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "this node is reading {MAX_INBOUND_BYTES} bytes of messages already; try again"
                        )
                    })?,
            );
        }
        bytes.extend_from_slice(&chunk.bytes);
    }
    drop(counted);
    Ok(Some(bytes))
}

/// Most bytes taken from a stream at once while reading a body.
const READ_CHUNK: usize = 64 * 1024;

/// Bytes of partly read bodies, process-wide (one permit a byte).
static INBOUND: LazyLock<std::sync::Arc<Semaphore>> =
    LazyLock::new(|| std::sync::Arc::new(Semaphore::new(MAX_INBOUND_BYTES)));

/// Write a det-CBOR control message.
pub async fn write_cbor(send: &mut quinn::SendStream, value: &Cbor) -> anyhow::Result<()> {
    write(send, &value.encode()).await.map(|_| ())
}

/// One control exchange on its own stream: write the request, finish, and
/// read the one answer (a control request's size) within `timeout`.
pub async fn exchange(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    request: &Cbor,
    timeout: Duration,
) -> anyhow::Result<Option<Cbor>> {
    write_cbor(send, request).await?;
    send.finish()?;
    read_cbor(recv, MAX_CONTROL_REQUEST, timeout).await
}

/// Read a det-CBOR control message of at most `max` bytes.
pub async fn read_cbor(
    recv: &mut quinn::RecvStream,
    max: usize,
    timeout: Duration,
) -> anyhow::Result<Option<Cbor>> {
    match read(recv, max, timeout).await? {
        None => Ok(None),
        Some(bytes) => Ok(Some(
            Cbor::decode(&bytes[4..]).context("malformed control message")?,
        )),
    }
}

use mesh_protocol::stage_frame::StageHeader;
/// Kinds of `mesh-stage/1` messages.
pub use mesh_protocol::stage_frame::{STAGE_HEADER, kind};

pub fn stage_body(kind: u8, request_id: u64, step: u32, payload: &[u8]) -> Vec<u8> {
    StageHeader {
        kind,
        request_id,
        step,
    }
    .encode(payload)
}

/// Parse a stage frame (prefix included): kind, request id, step, payload.
/// A short body or an unknown kind is refused.
pub fn parse_stage(frame: &[u8]) -> anyhow::Result<(u8, u64, u32, &[u8])> {
    let body = frame.get(4..).context("short frame")?;
    let (header, payload) = StageHeader::parse(body)?;
    Ok((header.kind, header.request_id, header.step, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// What a node writes on a stage stream, it reads back: the frame
        /// prefix, the header and the payload.
        #[test]
        fn a_stage_frame_round_trips(
            kind in proptest::sample::select(kind::ALL.to_vec()),
            request_id in any::<u64>(),
            step in any::<u32>(),
            payload in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let framed = frame(&stage_body(kind, request_id, step, &payload)).unwrap();
            let length = u32::from_le_bytes(framed[..4].try_into().unwrap()) as usize;
            prop_assert_eq!(length + 4, framed.len());
            let (k, id, s, p) = parse_stage(&framed).unwrap();
            prop_assert_eq!((k, id, s, p), (kind, request_id, step, payload.as_slice()));
        }

        /// Any bytes from a peer are a typed refusal or a frame, never a
        /// panic.
        #[test]
        fn parsing_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse_stage(&bytes);
        }
    }
}
