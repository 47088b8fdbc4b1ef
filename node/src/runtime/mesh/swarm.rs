//! The mesh's libp2p swarm: its behaviours, how it is built, and the task
//! that runs it (adverts out, swarm events in).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent, behaviour::toggle::Toggle};
use libp2p::{
    Multiaddr, PeerId, StreamProtocol, connection_limits, dcutr, identify, kad, mdns, noise, ping,
    relay, tcp, yamux,
};
use mesh_protocol::advert::{Advert, AdvertRefusal, MAX_ADVERT_BYTES, Offered};
use mesh_protocol::identity::did_key;

use super::settings::{
    ADVERT_TOPIC, HANDSHAKE_TIMEOUT, IDENTIFY_PROTOCOL, KAD_PROTOCOL, LOOKUP_EVERY,
    MAX_ADDRESSES_PER_PEER, MAX_CONNECTIONS_PER_PEER, MAX_DIALED_PEERS, MAX_INBOUND_CONNECTIONS,
    MAX_LOOKUPS, MAX_PENDING_INBOUND, MAX_PENDING_PER_ADDRESS, MAX_RELAYS_USED, MeshOptions,
    PING_INTERVAL, PING_TIMEOUT,
};
use super::state::{Changes, State, dial_cause, peer_key};
use crate::runtime::clock::lock;
use crate::runtime::clock::now_ms;
use crate::runtime::limit::Source;

/// Refuses an inbound connection while its IP address has
/// `MAX_PENDING_PER_ADDRESS` others handshaking (libp2p's own limits count
/// pending connections in all, not per address).
#[derive(Default)]
pub(super) struct PendingPerAddress {
    pending: HashMap<libp2p::swarm::ConnectionId, Source>,
    per_address: HashMap<Source, usize>,
}

#[derive(Debug)]
struct TooManyPending(Source);

impl std::fmt::Display for TooManyPending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} has {MAX_PENDING_PER_ADDRESS} connections handshaking already",
            self.0
        )
    }
}

impl std::error::Error for TooManyPending {}

impl PendingPerAddress {
    fn release(&mut self, id: libp2p::swarm::ConnectionId) {
        let Some(source) = self.pending.remove(&id) else {
            return;
        };
        if let Some(count) = self.per_address.get_mut(&source) {
            *count -= 1;
            if *count == 0 {
                self.per_address.remove(&source);
            }
        }
    }
}

impl NetworkBehaviour for PendingPerAddress {
    type ConnectionHandler = libp2p::swarm::dummy::ConnectionHandler;
    type ToSwarm = std::convert::Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        id: libp2p::swarm::ConnectionId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<(), libp2p::swarm::ConnectionDenied> {
        let ip = remote.iter().find_map(|p| match p {
            Protocol::Ip4(ip) => Some(std::net::IpAddr::V4(ip)),
            Protocol::Ip6(ip) => Some(std::net::IpAddr::V6(ip)),
            _ => None,
        });
        let Some(source) = ip.map(Source::of) else {
            return Ok(());
        };
        let count = self.per_address.entry(source).or_default();
        if *count >= MAX_PENDING_PER_ADDRESS {
            return Err(libp2p::swarm::ConnectionDenied::new(TooManyPending(source)));
        }
        *count += 1;
        self.pending.insert(id, source);
        Ok(())
    }

    fn handle_established_inbound_connection(
        &mut self,
        id: libp2p::swarm::ConnectionId,
        _peer: PeerId,
        _local: &Multiaddr,
        _remote: &Multiaddr,
    ) -> Result<libp2p::swarm::THandler<Self>, libp2p::swarm::ConnectionDenied> {
        self.release(id);
        Ok(libp2p::swarm::dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _id: libp2p::swarm::ConnectionId,
        _peer: PeerId,
        _addr: &Multiaddr,
        _role: libp2p::core::Endpoint,
        _port_use: libp2p::core::transport::PortUse,
    ) -> Result<libp2p::swarm::THandler<Self>, libp2p::swarm::ConnectionDenied> {
        Ok(libp2p::swarm::dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: libp2p::swarm::FromSwarm) {
        if let libp2p::swarm::FromSwarm::ListenFailure(failure) = event {
            self.release(failure.connection_id);
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _peer: PeerId,
        _id: libp2p::swarm::ConnectionId,
        event: libp2p::swarm::THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<libp2p::swarm::ToSwarm<Self::ToSwarm, libp2p::swarm::THandlerInEvent<Self>>>
    {
        std::task::Poll::Pending
    }
}

#[derive(NetworkBehaviour)]
pub(super) struct Behaviour {
    pending: PendingPerAddress,
    limits: connection_limits::Behaviour,
    identify: identify::Behaviour,
    ping: ping::Behaviour,
    kad: kad::Behaviour<kad::store::MemoryStore>,
    mdns: Toggle<mdns::tokio::Behaviour>,
    gossipsub: gossipsub::Behaviour,
    /// A relay for members behind NATs (`--relay`).
    relay: Toggle<relay::Behaviour>,
    /// Listening and dialling through relays.
    relay_client: relay::client::Behaviour,
    /// Direct connections in place of relayed ones (hole punching).
    dcutr: dcutr::Behaviour,
}

/// The swarm: TCP + Noise + Yamux, the behaviours, listening, and the
/// bootstrap members dialled; with the bootstrap addresses that name no
/// peer yet.
pub(super) fn build(
    options: &MeshOptions,
    keypair: libp2p::identity::Keypair,
) -> anyhow::Result<(libp2p::Swarm<Behaviour>, Vec<Multiaddr>)> {
    let mdns_on = options.mdns;
    let relay_limits = options.relay;
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(keypair)
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            noise::Config::new,
            yamux::Config::default,
        )
        .context("setting up the mesh's TCP transport")?
        .with_relay_client(noise::Config::new, yamux::Config::default)
        .context("setting up the mesh's relay client")?
        .with_behaviour(|key, relay_client| {
            let peer_id = key.public().to_peer_id();
            // A new listen address (one through a relay) is told to peers
            // at once, not at the next periodic identify.
            let identify = identify::Behaviour::new(
                identify::Config::new(IDENTIFY_PROTOCOL.into(), key.public())
                    .with_push_listen_addr_updates(true),
            );
            let relay = relay_limits.map(|limits| {
                relay::Behaviour::new(
                    peer_id,
                    relay::Config {
                        max_reservations: limits.reservations,
                        max_circuits: limits.circuits,
                        max_circuits_per_peer: limits.circuits_per_peer,
                        max_circuit_duration: limits.circuit_duration,
                        max_circuit_bytes: limits.circuit_bytes,
                        ..relay::Config::default()
                    },
                )
            });
            let ping = ping::Behaviour::new(
                ping::Config::new()
                    .with_interval(PING_INTERVAL)
                    .with_timeout(PING_TIMEOUT),
            );
            let mut kad_config = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
            // Routing only: records others would store here are dropped
            // (the mesh keeps none).
            kad_config.set_record_filtering(kad::StoreInserts::FilterBoth);
            let mut kad = kad::Behaviour::with_config(
                peer_id,
                kad::store::MemoryStore::new(peer_id),
                kad_config,
            );
            // Answer queries even where no external address is confirmed
            // (a LAN, loopback): every member is a routing peer.
            kad.set_mode(Some(kad::Mode::Server));
            let mdns = if mdns_on {
                match mdns::tokio::Behaviour::new(mdns::Config::default(), peer_id) {
                    Ok(m) => Some(m),
                    Err(error) => {
                        tracing::warn!("mDNS is off: {error}");
                        None
                    }
                }
            } else {
                None
            };
            let config = gossipsub::ConfigBuilder::default()
                .heartbeat_interval(Duration::from_millis(500))
                .validation_mode(gossipsub::ValidationMode::Strict)
                .validate_messages()
                .max_transmit_size(MAX_ADVERT_BYTES + 512)
                .build()
                .map_err(|e| anyhow::anyhow!("gossipsub configuration: {e}"))?;
            let gossipsub = gossipsub::Behaviour::new(
                gossipsub::MessageAuthenticity::Signed(key.clone()),
                config,
            )
            .map_err(|e| anyhow::anyhow!("gossipsub: {e}"))?;
            let limits = connection_limits::Behaviour::new(
                connection_limits::ConnectionLimits::default()
                    .with_max_established_incoming(Some(MAX_INBOUND_CONNECTIONS))
                    .with_max_pending_incoming(Some(MAX_PENDING_INBOUND))
                    .with_max_established_per_peer(Some(MAX_CONNECTIONS_PER_PEER)),
            );
            Ok(Behaviour {
                pending: PendingPerAddress::default(),
                limits,
                identify,
                ping,
                kad,
                mdns: mdns.into(),
                gossipsub,
                relay: relay.into(),
                relay_client,
                dcutr: dcutr::Behaviour::new(peer_id),
            })
        })
        .map_err(|e| anyhow::anyhow!("building the mesh behaviour: {e}"))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        // From TCP to an authenticated, multiplexed connection.
        .with_connection_timeout(HANDSHAKE_TIMEOUT)
        .build();
    let topic = IdentTopic::new(ADVERT_TOPIC);
    swarm
        .behaviour_mut()
        .gossipsub
        .subscribe(&topic)
        .map_err(|e| anyhow::anyhow!("subscribing to adverts: {e}"))?;
    for address in &options.listen {
        swarm
            .listen_on(address.clone())
            .with_context(|| format!("listening on {address}"))?;
    }
    let mut unpinned = Vec::new();
    for address in &options.bootstrap {
        // A plain HOST:PORT names no peer: its id is learned in the
        // handshake (and pinned then, `handle_event`).
        if let Some(Protocol::P2p(peer)) = address.iter().last() {
            swarm
                .behaviour_mut()
                .kad
                .add_address(&peer, address.clone());
        } else {
            unpinned.push(address.clone());
        }
        swarm
            .dial(address.clone())
            .with_context(|| format!("dialling {address}"))?;
    }
    Ok((swarm, unpinned))
}

pub(super) async fn run(
    mut swarm: libp2p::Swarm<Behaviour>,
    topic: IdentTopic,
    mut published: tokio::sync::mpsc::Receiver<Vec<u8>>,
    options: MeshOptions,
    own_key: [u8; 32],
    state: Arc<Mutex<State>>,
    changed: Arc<Changes>,
) {
    let mut tick = tokio::time::interval(options.advert_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut last_bootstrap: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Some(facts) = &options.facts {
                    let now = now_ms();
                    // Above every earlier seq, also across restarts (the
                    // clock moves on while a node is down).
                    seq = (seq + 1).max(now);
                    let mut advert = facts();
                    advert.node_id = own_key;
                    advert.seq = seq;
                    advert.issued_ms = now;
                    advert.ttl_ms = options.advert_ttl.as_millis() as u64;
                    advert.rtts = lock(&state).advertised_rtts(&own_key);
                    let bytes = advert.sign(&options.key);
                    if advert.via.is_some() {
                        listen_through_relays(&mut swarm, &state);
                    }
                    // The own advert goes in the own table too: a
                    // coordinator plans over itself and its members alike.
                    let joined = lock(&state).members.offer(&bytes, &own_key, now);
                    if matches!(joined, Ok(Offered::Joined)) {
                        changed.bump();
                    }
                    if let Err(error) = swarm.behaviour_mut().gossipsub.publish(topic.clone(), bytes) {
                        tracing::debug!("advert not published: {error}");
                    }
                }
                let expired = lock(&state).members.expire(now_ms());
                for key in &expired {
                    tracing::info!(member = %did_key(key), "member left: its advert expired");
                }
                if !expired.is_empty() {
                    changed.bump();
                }
                if last_bootstrap.is_none_or(|t| t.elapsed() >= Duration::from_secs(30))
                    && swarm.behaviour_mut().kad.bootstrap().is_ok()
                {
                    last_bootstrap = Some(Instant::now());
                }
            }
            Some(bytes) = published.recv() => {
                if let Err(error) = swarm.behaviour_mut().gossipsub.publish(topic.clone(), bytes) {
                    tracing::debug!("advert not published: {error}");
                }
            }
            event = swarm.select_next_some() => {
                if handle_event(&mut swarm, event, &state, &changed) {
                    // A peer just subscribed to adverts: it hears this
                    // node's now, not at the next tick.
                    tick.reset_immediately();
                }
            }
        }
    }
}

/// A bootstrap address as a user may give it: a multiaddr
/// (`/ip4/HOST/tcp/PORT/p2p/PEERID`, the peer id optional) or a plain
/// `HOST:PORT` (an IP address or a DNS name), whose node id is learned in
/// the handshake.
fn handle_event(
    swarm: &mut libp2p::Swarm<Behaviour>,
    event: SwarmEvent<BehaviourEvent>,
    state: &Arc<Mutex<State>>,
    changed: &Changes,
) -> bool {
    let local = *swarm.local_peer_id();
    match event {
        SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Subscribed {
            ..
        })) => return true,
        SwarmEvent::NewListenAddr { address, .. } => {
            // A relay takes reservations only at addresses it knows others
            // reach: an operator who offers one says its own are.
            if swarm.behaviour().relay.is_enabled()
                && !address.iter().any(|p| p == Protocol::P2pCircuit)
            {
                swarm.add_external_address(address.clone());
            }
            let full = address.with(Protocol::P2p(local));
            lock(state).addresses.push(full);
            changed.bump();
        }
        SwarmEvent::OutgoingConnectionError { error, .. } => {
            lock(state).last_dial_error = Some(dial_cause(&error.to_string()));
        }
        SwarmEvent::ConnectionEstablished {
            peer_id, endpoint, ..
        } => connected(swarm, state, peer_id, &endpoint),
        SwarmEvent::ConnectionClosed {
            peer_id,
            num_established: 0,
            ..
        } => disconnected(state, changed, peer_id),
        SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
            peer_id,
            info,
            ..
        })) => {
            for address in info.listen_addrs.into_iter().take(MAX_ADDRESSES_PER_PEER) {
                swarm.behaviour_mut().kad.add_address(&peer_id, address);
            }
            tracing::debug!(peer = %peer_id, protocols = ?info.protocols, "identified");
            if info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
                let mut s = lock(state);
                if let Some(address) = s.dialed.get(&peer_id).cloned() {
                    s.relays.insert(peer_id, address);
                }
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Kad(kad::Event::RoutingUpdated {
            peer,
            addresses,
            ..
        })) => {
            let dial = {
                let s = lock(state);
                peer != local
                    && !s.connected.contains(&peer)
                    && s.connected.len() < MAX_DIALED_PEERS
            };
            if dial {
                let _ = swarm.dial(
                    libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
                        .addresses(addresses.into_vec())
                        .build(),
                );
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Mdns(mdns::Event::Discovered(found))) => {
            for (peer, address) in found {
                swarm
                    .behaviour_mut()
                    .kad
                    .add_address(&peer, address.clone());
                let dial = {
                    let s = lock(state);
                    !s.connected.contains(&peer) && s.connected.len() < MAX_DIALED_PEERS
                };
                if dial {
                    let _ = swarm.dial(address);
                }
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Ping(ping::Event { peer, result, .. })) => {
            let Some(key) = peer_key(&peer) else {
                return false;
            };
            match result {
                Ok(rtt) => {
                    let mut s = lock(state);
                    let first = s.record_rtt(key, rtt);
                    // A member's first round trip makes it plannable.
                    if first && s.members.get(&key).is_some() {
                        drop(s);
                        changed.bump();
                    }
                }
                Err(error) => {
                    let mut s = lock(state);
                    s.round_trips.remove(&key);
                    if s.members.remove(&key).is_some() {
                        tracing::info!(member = %did_key(&key), "member left: ping failed ({error})");
                        drop(s);
                        changed.bump();
                    }
                }
            }
        }
        SwarmEvent::ListenerClosed { listener_id, .. } => {
            lock(state).listening_via.remove(&listener_id);
        }
        SwarmEvent::Behaviour(BehaviourEvent::RelayClient(
            relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal: false,
                ..
            },
        )) => {
            tracing::info!(relay = %relay_peer_id, "listening through a relay for members behind NATs");
        }
        SwarmEvent::Behaviour(BehaviourEvent::Relay(event)) => relay_event(event),
        SwarmEvent::Behaviour(BehaviourEvent::Dcutr(dcutr::Event {
            remote_peer_id,
            result,
        })) => match result {
            Ok(_) => {
                tracing::info!(peer = %remote_peer_id, "a direct mesh connection by hole punching")
            }
            Err(error) => {
                tracing::debug!(peer = %remote_peer_id, "no direct mesh connection: {error}")
            }
        },
        SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
            propagation_source,
            message_id,
            message,
        })) => gossip_message(
            swarm,
            state,
            changed,
            propagation_source,
            message_id,
            message,
        ),
        _ => {}
    }
    false
}

/// An advert gossiped by a member, validated before gossipsub forwards it.
fn gossip_message(
    swarm: &mut libp2p::Swarm<Behaviour>,
    state: &Arc<Mutex<State>>,
    changed: &Changes,
    propagation_source: libp2p::PeerId,
    message_id: gossipsub::MessageId,
    message: gossipsub::Message,
) {
    // Strict validation: `source` is the peer that signed the
    // message, whoever forwarded it. Only a peer this node holds a
    // connection to may be a member: one connection cannot bring in
    // any number of made-up identities, and every member has a
    // measured round trip.
    let sender = message
        .source
        .filter(|source| lock(state).connected.contains(source))
        .as_ref()
        .and_then(peer_key);
    let acceptance = match sender {
        // Not connected (or not an Ed25519 peer): not taken, not
        // forwarded; but looked for, so its next adverts are taken.
        None => {
            // Looked for only when its advert is one (signed by its source,
            // current): a made-up message costs no Kademlia query.
            if let Some(source) = message.source
                && let Some(key) = peer_key(&source)
                && Advert::verify(&message.data, &key, now_ms()).is_ok()
            {
                look_up(swarm, state, source);
            }
            MessageAcceptance::Ignore
        }
        Some(sender) => {
            let outcome = lock(state).members.offer(&message.data, &sender, now_ms());
            match outcome {
                Ok(offered) => {
                    if offered == Offered::Joined {
                        tracing::info!(member = %did_key(&sender), "member joined");
                        changed.bump();
                    }
                    MessageAcceptance::Accept
                }
                Err(refusal) => refuse(state, &sender, &refusal),
            }
        }
    };
    let _ = swarm
        .behaviour_mut()
        .gossipsub
        .report_message_validation_result(&message_id, &propagation_source, acceptance);
}

/// Count a refused advert, log it once per sender and kind, and tell
/// gossipsub not to forward it (`Reject` for a forged or malformed one,
/// `Ignore` for a replay or a burst).
fn refuse(state: &Mutex<State>, sender: &[u8; 32], refusal: &AdvertRefusal) -> MessageAcceptance {
    let kind = refusal.kind();
    let mut s = lock(state);
    *s.refused.entry(kind).or_default() += 1;
    if s.logged.len() < 4096 && s.logged.insert((*sender, kind)) {
        tracing::warn!(sender = %did_key(sender), kind, "advert refused: {refusal}");
    }
    match refusal {
        // A replay, a burst or a full table: not the sender's forgery.
        AdvertRefusal::Replayed { .. } | AdvertRefusal::RateLimited(_) | AdvertRefusal::Full => {
            MessageAcceptance::Ignore
        }
        AdvertRefusal::Invalid(_) => MessageAcceptance::Reject,
    }
}

/// Behind a NAT: listen through up to `MAX_RELAYS_USED` connected relays,
/// so members that cannot dial this node reach it through one.
fn listen_through_relays(swarm: &mut libp2p::Swarm<Behaviour>, state: &Mutex<State>) {
    let mut s = lock(state);
    let mut candidates: Vec<(PeerId, Multiaddr)> = s
        .relays
        .iter()
        .filter(|(relay, _)| !s.listening_via.values().any(|used| used == *relay))
        .map(|(relay, address)| (*relay, address.clone()))
        .collect();
    candidates.sort();
    for (relay, address) in candidates {
        if s.listening_via.len() >= MAX_RELAYS_USED {
            break;
        }
        let circuit = through_relay(address, relay);
        match swarm.listen_on(circuit.clone()) {
            Ok(listener) => {
                s.listening_via.insert(listener, relay);
            }
            Err(error) => tracing::debug!("not listening through {circuit}: {error}"),
        }
    }
}

/// A circuit through the relay dialled at `address`:
/// `…/p2p/RELAY/p2p-circuit` (a trailing `/p2p/` of `address` replaced).
fn through_relay(mut address: Multiaddr, relay: PeerId) -> Multiaddr {
    if let Some(Protocol::P2p(_)) = address.iter().last() {
        address.pop();
    }
    address
        .with(Protocol::P2p(relay))
        .with(Protocol::P2pCircuit)
}

/// A member this node holds no connection to (behind a NAT, say) sent an
/// advert: find its addresses (Kademlia) and dial it through every relay
/// this node knows, at most once every `LOOKUP_EVERY`.
fn look_up(swarm: &mut libp2p::Swarm<Behaviour>, state: &Mutex<State>, member: PeerId) {
    let relays: Vec<(PeerId, Multiaddr)> = {
        let mut s = lock(state);
        if s.connected.contains(&member)
            || s.connected.len() >= MAX_DIALED_PEERS
            || s.looked_up
                .get(&member)
                .is_some_and(|at| at.elapsed() < LOOKUP_EVERY)
        {
            return;
        }
        // At most `MAX_LOOKUPS` in any `LOOKUP_EVERY`, over all members.
        s.looked_up.retain(|_, at| at.elapsed() < LOOKUP_EVERY);
        if s.looked_up.len() >= MAX_LOOKUPS {
            return;
        }
        s.looked_up.insert(member, Instant::now());
        s.relays.iter().map(|(r, a)| (*r, a.clone())).collect()
    };
    swarm.behaviour_mut().kad.get_closest_peers(member);
    for (relay, address) in relays {
        let through = through_relay(address, relay).with(Protocol::P2p(member));
        let _ = swarm.dial(through);
    }
}

/// What a relay this node offers did, as the logs tell it.
fn relay_event(event: relay::Event) {
    match event {
        relay::Event::ReservationReqAccepted {
            src_peer_id,
            renewed: false,
        } => tracing::info!(member = %src_peer_id, "relaying for a member behind a NAT"),
        relay::Event::CircuitReqDenied {
            src_peer_id,
            dst_peer_id,
            status,
        } => {
            tracing::info!(from = %src_peer_id, to = %dst_peer_id, "relay refused a circuit: {status:?}")
        }
        relay::Event::ReservationReqDenied { src_peer_id, .. } => {
            tracing::info!(member = %src_peer_id, "relay refused a reservation (at its limit)")
        }
        _ => {}
    }
}

/// A connection established: a bootstrap pinned to the node its handshake
/// proved, the peer connected, and where it was dialled (a relay's address).
fn connected(
    swarm: &mut libp2p::Swarm<Behaviour>,
    state: &Mutex<State>,
    peer_id: PeerId,
    endpoint: &libp2p::core::ConnectedPoint,
) {
    let mut s = lock(state);
    if let libp2p::core::ConnectedPoint::Dialer { address, .. } = &endpoint
        && let Some(at) = s.unpinned.iter().position(|a| a == address)
    {
        // The node at a plain HOST:PORT bootstrap, as its handshake
        // proved it: pinned from now on.
        let address = s.unpinned.swap_remove(at);
        swarm
            .behaviour_mut()
            .kad
            .add_address(&peer_id, address.clone());
        tracing::info!(
            node = %peer_key(&peer_id).map_or_else(|| peer_id.to_string(), |k| did_key(&k)),
            "bootstrap {address} is {}",
            address.clone().with(Protocol::P2p(peer_id))
        );
    }
    s.connected.insert(peer_id);
    if let libp2p::core::ConnectedPoint::Dialer { address, .. } = &endpoint
        && !address.iter().any(|p| p == Protocol::P2pCircuit)
        && s.dialed.len() < MAX_DIALED_PEERS * 2
    {
        s.dialed.insert(peer_id, address.clone());
    }
    if let Some(key) = peer_key(&peer_id) {
        s.closed.remove(&key);
    }
}

/// A peer's last connection closed: it is no longer connected, and no
/// longer a member (a killed process: at once).
fn disconnected(state: &Mutex<State>, changed: &Changes, peer_id: PeerId) {
    let mut s = lock(state);
    s.connected.remove(&peer_id);
    s.dialed.remove(&peer_id);
    s.relays.remove(&peer_id);
    if let Some(key) = peer_key(&peer_id) {
        s.round_trips.remove(&key);
        if s.closed.len() < mesh_protocol::advert::MAX_MEMBERS {
            s.closed.insert(key, Instant::now());
        }
        if s.members.remove(&key).is_some() {
            tracing::info!(member = %did_key(&key), "member left: its connection closed");
            drop(s);
            changed.bump();
        }
    }
}
