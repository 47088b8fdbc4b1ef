//! What a hop costs with nothing but the transport: three QUIC endpoints in
//! this process (the node's own endpoint and TLS setup), in a ring, the
//! second and third forwarding every message they read. A message sent
//! around the ring crosses three hops; a third of its time is one hop.
//! `bench split` measures it in each round beside the split, so a hop's
//! overhead can be set against the transport's own cost on the same
//! machine at the same moment.

use std::time::{Duration, Instant};

use anyhow::Context;
use mesh_protocol::SigningKey;

use crate::runtime::net::{tls, tunnel};

const ALPN: &[u8] = b"mesh-bench-ring/1";
/// Messages sent around the ring; the first tenth warm it up.
const MESSAGES: usize = 1_000;
/// The most the whole measurement may take.
const WITHIN: Duration = Duration::from_secs(20);

/// The median time of one hop for a message of `bytes`.
pub async fn bare_quic_hop(bytes: usize) -> anyhow::Result<Duration> {
    tokio::time::timeout(WITHIN, ring(bytes))
        .await
        .context("the bare QUIC ring took over 20 s")?
}

async fn ring(bytes: usize) -> anyhow::Result<Duration> {
    tls::install_provider();
    let mut nodes = Vec::new();
    for seed in 1..=3u8 {
        let key = SigningKey::from_bytes(&[seed; 32]);
        let identity = tls::TlsIdentity::new(&key)?;
        let server = tls::server_config(&identity, &[ALPN])?;
        let (endpoint, tunnel, packets) = tunnel::endpoint(server, "127.0.0.1:0".parse()?)?;
        nodes.push((
            endpoint,
            identity,
            key.verifying_key().to_bytes(),
            tunnel,
            packets,
        ));
    }
    // Stream i runs from node i to node i + 1.
    let (mut sends, mut recvs, mut connections) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..3 {
        let to = &nodes[(i + 1) % 3];
        let config = tls::client_config(&nodes[i].1, to.2, ALPN)?;
        let listener = to.0.clone();
        let accepted = tokio::spawn(async move {
            let incoming = listener.accept().await.context("no connection came")?;
            anyhow::Ok(incoming.await?)
        });
        let client = nodes[i]
            .0
            .connect_with(config, to.0.local_addr()?, "mesh-node")?
            .await?;
        let server = accepted.await??;
        let (mut send, _) = client.open_bi().await?;
        // A stream is announced by its first bytes.
        send.write_all(&[0]).await?;
        let (_, mut recv) = server.accept_bi().await?;
        recv.read_exact(&mut [0u8; 1]).await?;
        sends.push(send);
        recvs.push(recv);
        connections.push((client, server));
    }
    let (mut sends, mut recvs) = (sends.into_iter(), recvs.into_iter());
    let (Some(mut out), Some(into_1), Some(from_1), Some(into_2), Some(from_2), Some(mut back)) = (
        sends.next(),
        recvs.next(),
        sends.next(),
        recvs.next(),
        sends.next(),
        recvs.next(),
    ) else {
        anyhow::bail!("a ring of three streams");
    };
    for (mut recv, mut send) in [(into_1, from_1), (into_2, from_2)] {
        tokio::spawn(async move {
            let mut message = vec![0u8; bytes];
            while recv.read_exact(&mut message).await.is_ok() {
                if send.write_all(&message).await.is_err() {
                    break;
                }
            }
        });
    }
    let message = vec![0x5a; bytes];
    let mut returned = vec![0u8; bytes];
    let mut around = Vec::with_capacity(MESSAGES);
    for n in 0..MESSAGES {
        let sent = Instant::now();
        out.write_all(&message).await?;
        back.read_exact(&mut returned).await?;
        if n >= MESSAGES / 10 {
            around.push(sent.elapsed());
        }
    }
    for (client, server) in connections {
        client.close(0u32.into(), b"done");
        server.close(0u32.into(), b"done");
    }
    for node in &nodes {
        node.0.close(0u32.into(), b"done");
    }
    around.sort_unstable();
    Ok(around[around.len() / 2] / 3)
}
