//! Signed node adverts (`mesh-advert/1`) and the member table a node keeps
//! of them: what a node tells the mesh about itself (its QUIC data address,
//! the model packages it holds, memory it offers, its measured decode speed,
//! its load), signed by its node key, and the rules by which one is taken
//! or refused (docs/mesh.md has the byte layout).
//!
//! Sans-IO: the caller passes the time, the key of the libp2p peer an advert
//! came from, and the bytes.

use std::collections::BTreeMap;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use thiserror::Error;

use crate::cbor::{Cbor, CborError, FieldError, Fields};

/// The largest signed advert, envelope included.
pub const MAX_ADVERT_BYTES: usize = 4096;
/// The most model packages one advert names.
pub const MAX_ADVERT_MODELS: usize = 8;
/// The longest an advert may ask to be believed for.
pub const MAX_ADVERT_TTL_MS: u64 = 60_000;
/// How far in the future an advert's issue time may be (clock skew).
pub const MAX_ADVERT_SKEW_MS: u64 = 30_000;
/// Longest text member (the data address, the device kind).
pub const MAX_ADVERT_TEXT: usize = 64;
/// Longest precision a model entry names (`mesh1.md`, the receipt's
/// `precision`).
pub const MAX_ADVERT_PRECISION: usize = 128;
/// Adverts from one node closer together than this are refused (the node
/// republishes far less often; this bounds what one peer can make a
/// member table do).
pub const MIN_ADVERT_INTERVAL_MS: u64 = 250;
/// The most members a table holds; adverts of further nodes are refused.
pub const MAX_MEMBERS: usize = 4096;
/// The slowest decode speed an advert may claim (100 s per layer and
/// token): bounds every product the planner forms from it.
pub const MAX_DECODE_US_PER_LAYER: u64 = 100_000_000;
/// Domain separation of the advert signature.
pub const ADVERT_SIGNATURE_CONTEXT: &[u8] = b"mesh-advert/1\0";
/// The most round trips to other members an advert names.
pub const MAX_ADVERT_RTTS: usize = 24;
/// The longest round trip an advert may name, microseconds (10 s).
pub const MAX_ADVERT_RTT_US: u64 = 10_000_000;
/// Advert format version.
pub const ADVERT_VERSION: u64 = 1;

/// A model package a node holds, and how fast it decodes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvertModel {
    pub package_id: [u8; 32],
    /// The package's total transformer layers.
    pub layers: u32,
    /// Measured decode time of one layer for one token, microseconds
    /// (the node's self-benchmark of its slice engine; never 0).
    pub decode_us_per_layer: u64,
    /// What the node runs it at, as its receipts name it with an f32
    /// wire: the file's type, its stored types, the products and the
    /// device (`mesh1.md`); absent when the node does not say.
    pub precision: Option<String>,
    /// Its name as people call it (the file's name without extension, as
    /// the node's API lists it); absent when the node does not say.
    pub name: Option<String>,
}

/// What a node tells the mesh about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advert {
    /// The node's Ed25519 public key (its node id and its libp2p identity).
    pub node_id: [u8; 32],
    /// Strictly increasing per node: a lower or equal one is a replay.
    pub seq: u64,
    /// When it was signed, Unix milliseconds.
    pub issued_ms: u64,
    /// How long after `issued_ms` it may be believed.
    pub ttl_ms: u64,
    /// HOST:PORT of the node's QUIC data plane.
    pub quic: String,
    /// `cpu`, `cuda`, `metal`.
    pub device: String,
    /// Memory the node offers for weights and KV caches, bytes.
    pub memory_bytes: u64,
    /// Requests in flight on the node when it signed.
    pub load: u32,
    pub models: Vec<AdvertModel>,
    /// Present when the node is behind a NAT that lets in only what answers
    /// its own packets: the public member it keeps a connection with, which
    /// others ask to have the node open its NAT to them (docs/mesh.md,
    /// "Reachability"). `quic` is then the address that member sees.
    pub via: Option<AdvertVia>,
    /// Round trips the node measured to other members (its mesh pings), in
    /// node id order, each member once, never itself; empty when it names
    /// none (the field is then absent). The planner weighs a hop between
    /// two members by them (`plan::Links`).
    pub rtts: Vec<AdvertRtt>,
}

/// A round trip a node measured to another member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdvertRtt {
    pub node_id: [u8; 32],
    /// Microseconds, 1 to `MAX_ADVERT_RTT_US`.
    pub rtt_us: u64,
}

/// The member a node behind a NAT is reached through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvertVia {
    /// Its Ed25519 public key; never the advertising node's own.
    pub node_id: [u8; 32],
    /// HOST:PORT of its QUIC data plane.
    pub quic: String,
    /// The node is behind a symmetric NAT: members reach it only through
    /// this member's relay.
    pub relayed: bool,
}

/// Why an advert is refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AdvertError {
    #[error("advert of {0} bytes is over the {MAX_ADVERT_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("CBOR: {0}")]
    Cbor(#[from] CborError),
    #[error("advert: {0}")]
    Field(#[from] FieldError),
    #[error("advert version {0} is not {ADVERT_VERSION}")]
    Version(u64),
    #[error("the signature does not verify under the advert's node id")]
    BadSignature,
    #[error("the advert names another key than the peer it came from")]
    KeyMismatch,
    #[error("the advert expired {0} ms ago")]
    Expired(u64),
    #[error("the advert was issued {0} ms in the future")]
    FromTheFuture(u64),
    #[error("ttl {0} ms is 0 or over {MAX_ADVERT_TTL_MS} ms")]
    Ttl(u64),
    #[error("`{0}` is not a HOST:PORT address")]
    Address(String),
    #[error("{0} models named, at most {MAX_ADVERT_MODELS}")]
    TooManyModels(usize),
    #[error("a package is named twice")]
    DuplicateModel,
    #[error("a model entry has no layers, or a speed of 0 or over {MAX_DECODE_US_PER_LAYER} us")]
    EmptyModel,
    #[error("`via` names the node itself, or an address `{0}` that does not parse")]
    Via(String),
    #[error(
        "`rtts`: empty, over {MAX_ADVERT_RTTS} entries, not in node id order, naming the node \
         itself, or a round trip of 0 or over {MAX_ADVERT_RTT_US} us"
    )]
    Rtts,
}

impl Advert {
    fn content(&self) -> Cbor {
        let mut members = vec![
            ("v", Cbor::Uint(ADVERT_VERSION)),
            ("node_id", Cbor::bytes(self.node_id)),
            ("seq", Cbor::Uint(self.seq)),
            ("issued_ms", Cbor::Uint(self.issued_ms)),
            ("ttl_ms", Cbor::Uint(self.ttl_ms)),
            ("quic", Cbor::text(&self.quic)),
            ("device", Cbor::text(&self.device)),
            ("memory_bytes", Cbor::Uint(self.memory_bytes)),
            ("load", Cbor::Uint(self.load.into())),
            (
                "models",
                Cbor::Array(
                    self.models
                        .iter()
                        .map(|m| {
                            let mut members = vec![
                                ("package_id", Cbor::bytes(m.package_id)),
                                ("layers", Cbor::Uint(m.layers.into())),
                                ("decode_us_per_layer", Cbor::Uint(m.decode_us_per_layer)),
                            ];
                            if let Some(precision) = &m.precision {
                                members.push(("precision", Cbor::text(precision)));
                            }
                            if let Some(name) = &m.name {
                                members.push(("name", Cbor::text(name)));
                            }
                            Cbor::text_map(members)
                        })
                        .collect(),
                ),
            ),
        ];
        if let Some(via) = &self.via {
            let mut fields = vec![
                ("node_id", Cbor::bytes(via.node_id)),
                ("quic", Cbor::text(&via.quic)),
            ];
            if via.relayed {
                fields.push(("relayed", Cbor::Uint(1)));
            }
            members.push(("via", Cbor::text_map(fields)));
        }
        if !self.rtts.is_empty() {
            let rtts = self
                .rtts
                .iter()
                .map(|r| Cbor::Array(vec![Cbor::bytes(r.node_id), Cbor::Uint(r.rtt_us)]))
                .collect();
            members.push(("rtts", Cbor::Array(rtts)));
        }
        Cbor::text_map(members)
    }

    /// The signed envelope: a map of the content's det-CBOR bytes and the
    /// Ed25519 signature over `ADVERT_SIGNATURE_CONTEXT || content`.
    /// `key` must be the node's own (its public key is `node_id`).
    pub fn sign(&self, key: &SigningKey) -> Vec<u8> {
        let content = self.content().encode();
        let signature = key.sign(&signed_message(&content));
        Cbor::text_map([
            ("advert", Cbor::bytes(content)),
            ("sig", Cbor::bytes(signature.to_bytes())),
        ])
        .encode()
    }

    /// Decode and check a signed advert: its form and limits, its
    /// signature, that it names `from_peer` (the key the transport
    /// authenticated), and that it is current at `now_ms`.
    pub fn verify(bytes: &[u8], from_peer: &[u8; 32], now_ms: u64) -> Result<Self, AdvertError> {
        let advert = Self::verify_signature(bytes)?;
        if advert.node_id != *from_peer {
            return Err(AdvertError::KeyMismatch);
        }
        if advert.issued_ms > now_ms.saturating_add(MAX_ADVERT_SKEW_MS) {
            return Err(AdvertError::FromTheFuture(advert.issued_ms - now_ms));
        }
        let expires = advert.expires_ms();
        if now_ms >= expires {
            return Err(AdvertError::Expired(now_ms - expires));
        }
        Ok(advert)
    }

    /// Form, limits and signature only (no time, no transport peer).
    pub fn verify_signature(bytes: &[u8]) -> Result<Self, AdvertError> {
        if bytes.len() > MAX_ADVERT_BYTES {
            return Err(AdvertError::TooLarge(bytes.len()));
        }
        let envelope = Cbor::decode(bytes)?;
        let mut f = Fields::of(&envelope)?;
        let content = f.bytes("advert")?;
        let signature: [u8; 64] = f.fixed("sig")?;
        f.finish()?;
        let advert = Self::read(&Cbor::decode(content)?)?;
        let key =
            VerifyingKey::from_bytes(&advert.node_id).map_err(|_| AdvertError::BadSignature)?;
        key.verify_strict(&signed_message(content), &Signature::from_bytes(&signature))
            .map_err(|_| AdvertError::BadSignature)?;
        Ok(advert)
    }

    fn read(value: &Cbor) -> Result<Self, AdvertError> {
        let mut f = Fields::of(value)?.text_limit(MAX_ADVERT_TEXT);
        let version = f.uint("v")?;
        if version != ADVERT_VERSION {
            return Err(AdvertError::Version(version));
        }
        let node_id = f.fixed("node_id")?;
        let seq = f.uint("seq")?;
        let issued_ms = f.uint("issued_ms")?;
        let ttl_ms = f.uint("ttl_ms")?;
        if ttl_ms == 0 || ttl_ms > MAX_ADVERT_TTL_MS {
            return Err(AdvertError::Ttl(ttl_ms));
        }
        let quic = f.text("quic")?.to_string();
        if quic.parse::<std::net::SocketAddr>().is_err() {
            return Err(AdvertError::Address(quic));
        }
        let device = f.text("device")?.to_string();
        let memory_bytes = f.uint("memory_bytes")?;
        let load = f.u32("load")?;
        let entries = f.array("models")?;
        let via = f.optional("via").map(Self::read_via).transpose()?;
        let rtts = f
            .optional("rtts")
            .map(|rtts| Self::read_rtts(rtts, &node_id))
            .transpose()?
            .unwrap_or_default();
        f.finish()?;
        if let Some(via) = &via
            && via.node_id == node_id
        {
            return Err(AdvertError::Via(via.quic.clone()));
        }
        if entries.len() > MAX_ADVERT_MODELS {
            return Err(AdvertError::TooManyModels(entries.len()));
        }
        let mut models: Vec<AdvertModel> = Vec::with_capacity(entries.len());
        for entry in entries {
            let mut m = Fields::of(entry)?.text_limit(MAX_ADVERT_PRECISION);
            let model = AdvertModel {
                package_id: m.fixed("package_id")?,
                layers: m.u32("layers")?,
                decode_us_per_layer: m.uint("decode_us_per_layer")?,
                precision: m.opt_text("precision")?.map(str::to_string),
                name: m.opt_text("name")?.map(str::to_string),
            };
            m.finish()?;
            if model
                .name
                .as_ref()
                .is_some_and(|n| n.len() > MAX_ADVERT_TEXT)
            {
                return Err(AdvertError::Field(crate::cbor::FieldError::Invalid("name")));
            }
            if model.layers == 0
                || model.decode_us_per_layer == 0
                || model.decode_us_per_layer > MAX_DECODE_US_PER_LAYER
            {
                return Err(AdvertError::EmptyModel);
            }
            if models.iter().any(|o| o.package_id == model.package_id) {
                return Err(AdvertError::DuplicateModel);
            }
            models.push(model);
        }
        Ok(Self {
            node_id,
            seq,
            issued_ms,
            ttl_ms,
            quic,
            device,
            memory_bytes,
            load,
            models,
            via,
            rtts,
        })
    }

    /// One encoding per list: present only when not empty, ascending node
    /// ids (so each member once), bounded in length and in each value.
    fn read_rtts(value: &Cbor, own: &[u8; 32]) -> Result<Vec<AdvertRtt>, AdvertError> {
        let entries = value.as_array().ok_or(AdvertError::Rtts)?;
        if entries.is_empty() || entries.len() > MAX_ADVERT_RTTS {
            return Err(AdvertError::Rtts);
        }
        let mut rtts: Vec<AdvertRtt> = Vec::with_capacity(entries.len());
        for entry in entries {
            let [node_id, rtt_us] = entry.as_array().ok_or(AdvertError::Rtts)? else {
                return Err(AdvertError::Rtts);
            };
            let node_id: [u8; 32] = node_id
                .as_bytes()
                .and_then(|b| b.try_into().ok())
                .ok_or(AdvertError::Rtts)?;
            let rtt_us = rtt_us.as_uint().ok_or(AdvertError::Rtts)?;
            let after_last = rtts.last().is_none_or(|last| last.node_id < node_id);
            if node_id == *own || !after_last || !(1..=MAX_ADVERT_RTT_US).contains(&rtt_us) {
                return Err(AdvertError::Rtts);
            }
            rtts.push(AdvertRtt { node_id, rtt_us });
        }
        Ok(rtts)
    }

    fn read_via(value: &Cbor) -> Result<AdvertVia, AdvertError> {
        let mut f = Fields::of(value)?.text_limit(MAX_ADVERT_TEXT);
        let node_id = f.fixed("node_id")?;
        let quic = f.text("quic")?.to_string();
        let relayed = match f.opt_uint("relayed")? {
            None => false,
            Some(1) => true,
            // Absent means not relayed: only 1 may be written.
            Some(_) => return Err(AdvertError::Via(quic)),
        };
        let via = AdvertVia {
            node_id,
            quic,
            relayed,
        };
        f.finish()?;
        if via.quic.parse::<std::net::SocketAddr>().is_err() {
            return Err(AdvertError::Via(via.quic));
        }
        Ok(via)
    }

    pub fn expires_ms(&self) -> u64 {
        self.issued_ms.saturating_add(self.ttl_ms)
    }

    /// The entry for `package_id`, when the node holds it.
    pub fn model(&self, package_id: &[u8; 32]) -> Option<&AdvertModel> {
        self.models.iter().find(|m| m.package_id == *package_id)
    }
}

fn signed_message(content: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(ADVERT_SIGNATURE_CONTEXT.len() + content.len());
    message.extend_from_slice(ADVERT_SIGNATURE_CONTEXT);
    message.extend_from_slice(content);
    message
}

/// Why a member table did not take an advert.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AdvertRefusal {
    #[error(transparent)]
    Invalid(#[from] AdvertError),
    #[error("replayed: seq {seq} is not above the {held} already held")]
    Replayed { seq: u64, held: u64 },
    #[error("rate-limited: a newer advert of this node came {0} ms ago")]
    RateLimited(u64),
    #[error("the member table is full ({MAX_MEMBERS} members)")]
    Full,
}

impl AdvertRefusal {
    /// A short name for counting and logging refusals by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            AdvertRefusal::Invalid(AdvertError::BadSignature) => "bad_signature",
            AdvertRefusal::Invalid(AdvertError::KeyMismatch) => "key_mismatch",
            AdvertRefusal::Invalid(AdvertError::Expired(_)) => "stale",
            AdvertRefusal::Invalid(AdvertError::FromTheFuture(_)) => "from_the_future",
            AdvertRefusal::Invalid(AdvertError::TooLarge(_)) => "oversized",
            AdvertRefusal::Invalid(_) => "malformed",
            AdvertRefusal::Replayed { .. } => "replayed",
            AdvertRefusal::RateLimited(_) => "rate_limited",
            AdvertRefusal::Full => "full",
        }
    }
}

/// A member as the table holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub advert: Advert,
    /// When this node took the advert (its own clock).
    pub received_ms: u64,
    /// When this node took the member's first advert of its current stay
    /// (a member that left and came back has a later one).
    pub joined_ms: u64,
}

/// What taking an advert changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offered {
    /// A node not in the table before.
    Joined,
    /// A newer advert of a member.
    Updated,
}

/// The adverts a node believes, one per node, bounded, expiring.
#[derive(Debug, Default, Clone)]
pub struct Members {
    members: BTreeMap<[u8; 32], Member>,
    /// Highest seq seen per node, kept after a member expires or leaves so
    /// its old adverts cannot be replayed (bounded with the table).
    last_seq: BTreeMap<[u8; 32], u64>,
}

impl Members {
    /// Take a signed advert that came from `from_peer` at `now_ms`, or say
    /// why not. A refused advert changes nothing.
    pub fn offer(
        &mut self,
        bytes: &[u8],
        from_peer: &[u8; 32],
        now_ms: u64,
    ) -> Result<Offered, AdvertRefusal> {
        let advert = Advert::verify(bytes, from_peer, now_ms)?;
        if let Some(&held) = self.last_seq.get(&advert.node_id)
            && advert.seq <= held
        {
            return Err(AdvertRefusal::Replayed {
                seq: advert.seq,
                held,
            });
        }
        if let Some(member) = self.members.get(&advert.node_id) {
            let since = now_ms.saturating_sub(member.received_ms);
            if since < MIN_ADVERT_INTERVAL_MS {
                return Err(AdvertRefusal::RateLimited(since));
            }
        } else if self.members.len() >= MAX_MEMBERS {
            return Err(AdvertRefusal::Full);
        }
        if !self.last_seq.contains_key(&advert.node_id) && self.last_seq.len() >= 2 * MAX_MEMBERS {
            // Forget the replay floor of nodes no longer members, oldest key
            // order first; their adverts have long expired anyway.
            let gone: Vec<[u8; 32]> = self
                .last_seq
                .keys()
                .filter(|k| !self.members.contains_key(*k))
                .take(MAX_MEMBERS)
                .copied()
                .collect();
            for key in gone {
                self.last_seq.remove(&key);
            }
        }
        self.last_seq.insert(advert.node_id, advert.seq);
        let joined_ms = self
            .members
            .get(&advert.node_id)
            .map_or(now_ms, |m| m.joined_ms);
        let joined = self
            .members
            .insert(
                advert.node_id,
                Member {
                    advert,
                    received_ms: now_ms,
                    joined_ms,
                },
            )
            .is_none();
        Ok(if joined {
            Offered::Joined
        } else {
            Offered::Updated
        })
    }

    /// Drop members whose advert expired by `now_ms`; their keys.
    pub fn expire(&mut self, now_ms: u64) -> Vec<[u8; 32]> {
        let gone: Vec<[u8; 32]> = self
            .members
            .iter()
            .filter(|(_, m)| now_ms >= m.advert.expires_ms())
            .map(|(k, _)| *k)
            .collect();
        for key in &gone {
            self.members.remove(key);
        }
        gone
    }

    /// Drop a member now (its connection went away); its replay floor stays.
    pub fn remove(&mut self, node_id: &[u8; 32]) -> Option<Member> {
        self.members.remove(node_id)
    }

    pub fn get(&self, node_id: &[u8; 32]) -> Option<&Member> {
        self.members.get(node_id)
    }

    /// Members in node-id order.
    pub fn iter(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    pub(crate) fn advert(key: &SigningKey, seq: u64, issued_ms: u64) -> Advert {
        Advert {
            node_id: key.verifying_key().to_bytes(),
            seq,
            issued_ms,
            ttl_ms: 6_000,
            quic: "127.0.0.1:7420".into(),
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            load: 0,
            models: vec![AdvertModel {
                package_id: [7; 32],
                layers: 30,
                decode_us_per_layer: 250,
                precision: None,
                name: None,
            }],
            via: None,
            rtts: Vec::new(),
        }
    }

    #[test]
    fn round_trips_to_members_are_named_once_each_in_order() {
        let k = key(1);
        let me = k.verifying_key().to_bytes();
        let rtt = |id: u8, rtt_us: u64| AdvertRtt {
            node_id: [id; 32],
            rtt_us,
        };
        let mut a = advert(&k, 1, 1_000);
        a.rtts = vec![rtt(2, 1_500), rtt(5, 40_000)];
        assert_eq!(Advert::verify(&a.sign(&k), &me, 1_000), Ok(a.clone()));
        let most = (0..MAX_ADVERT_RTTS as u8)
            .map(|i| rtt(i + 2, MAX_ADVERT_RTT_US))
            .collect::<Vec<_>>();
        a.rtts = most.clone();
        assert!(a.sign(&k).len() <= MAX_ADVERT_BYTES);
        assert_eq!(Advert::verify(&a.sign(&k), &me, 1_000), Ok(a.clone()));
        for refused in [
            vec![rtt(5, 1), rtt(2, 1)],
            vec![rtt(2, 1), rtt(2, 1)],
            vec![rtt(2, 0)],
            vec![rtt(2, MAX_ADVERT_RTT_US + 1)],
            vec![AdvertRtt {
                node_id: me,
                rtt_us: 1,
            }],
            [most.clone(), vec![rtt(200, 1)]].concat(),
        ] {
            a.rtts = refused;
            assert_eq!(
                Advert::verify(&a.sign(&k), &me, 1_000),
                Err(AdvertError::Rtts)
            );
        }
    }

    #[test]
    fn a_node_behind_a_nat_names_the_member_it_is_reached_through() {
        let k = key(1);
        let me = k.verifying_key().to_bytes();
        let mut a = advert(&k, 1, 1_000);
        a.via = Some(AdvertVia {
            node_id: key(2).verifying_key().to_bytes(),
            quic: "10.77.0.10:7000".into(),
            relayed: false,
        });
        assert_eq!(Advert::verify(&a.sign(&k), &me, 1_500), Ok(a.clone()));
        let mut itself = a.clone();
        itself.via = Some(AdvertVia {
            node_id: me,
            quic: "10.77.0.10:7000".into(),
            relayed: false,
        });
        assert!(matches!(
            Advert::verify(&itself.sign(&k), &me, 1_500),
            Err(AdvertError::Via(_))
        ));
        let mut relayed = a.clone();
        if let Some(via) = relayed.via.as_mut() {
            via.relayed = true;
        }
        assert_eq!(
            Advert::verify(&relayed.sign(&k), &me, 1_500),
            Ok(relayed.clone())
        );
        let mut nowhere = a.clone();
        nowhere.via = Some(AdvertVia {
            node_id: key(2).verifying_key().to_bytes(),
            quic: "relay.example:7000".into(),
            relayed: false,
        });
        assert!(matches!(
            Advert::verify(&nowhere.sign(&k), &me, 1_500),
            Err(AdvertError::Via(_))
        ));
    }

    #[test]
    fn a_signed_advert_verifies_and_round_trips() {
        let k = key(1);
        let a = advert(&k, 1, 1_000);
        let bytes = a.sign(&k);
        assert!(bytes.len() <= MAX_ADVERT_BYTES);
        assert_eq!(
            Advert::verify(&bytes, &k.verifying_key().to_bytes(), 1_500),
            Ok(a)
        );
    }

    #[test]
    fn every_defect_is_refused_with_its_reason() {
        let k = key(1);
        let me = k.verifying_key().to_bytes();
        let a = advert(&k, 1, 10_000);
        let bytes = a.sign(&k);
        // Signed by another key than the one it names.
        assert_eq!(
            Advert::verify(&a.sign(&key(2)), &me, 10_000),
            Err(AdvertError::BadSignature)
        );
        // Any flipped bit of the envelope.
        for i in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[i] ^= 0x01;
            assert!(Advert::verify(&flipped, &me, 10_000).is_err(), "byte {i}");
        }
        assert_eq!(
            Advert::verify(&bytes, &key(2).verifying_key().to_bytes(), 10_000),
            Err(AdvertError::KeyMismatch)
        );
        assert_eq!(
            Advert::verify(&bytes, &me, 16_001),
            Err(AdvertError::Expired(1))
        );
        let future = advert(&k, 1, 10_000 + MAX_ADVERT_SKEW_MS + 5).sign(&k);
        assert_eq!(
            Advert::verify(&future, &me, 10_000),
            Err(AdvertError::FromTheFuture(MAX_ADVERT_SKEW_MS + 5))
        );
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(Advert::verify(&trailing, &me, 10_000).is_err());
        assert!(Advert::verify(&bytes[..bytes.len() - 1], &me, 10_000).is_err());
        let mut long = a.clone();
        long.ttl_ms = MAX_ADVERT_TTL_MS + 1;
        assert_eq!(
            Advert::verify(&long.sign(&k), &me, 10_000),
            Err(AdvertError::Ttl(MAX_ADVERT_TTL_MS + 1))
        );
        let mut many = a.clone();
        many.models = (0..=MAX_ADVERT_MODELS as u8)
            .map(|i| AdvertModel {
                package_id: [i; 32],
                layers: 1,
                decode_us_per_layer: 1,
                precision: None,
                name: None,
            })
            .collect();
        assert_eq!(
            Advert::verify(&many.sign(&k), &me, 10_000),
            Err(AdvertError::TooManyModels(MAX_ADVERT_MODELS + 1))
        );
        let mut twice = a.clone();
        twice.models.push(twice.models[0].clone());
        assert_eq!(
            Advert::verify(&twice.sign(&k), &me, 10_000),
            Err(AdvertError::DuplicateModel)
        );
        let mut address = a.clone();
        address.quic = "nowhere".into();
        assert!(matches!(
            Advert::verify(&address.sign(&k), &me, 10_000),
            Err(AdvertError::Address(_))
        ));
        let mut huge = a.clone();
        huge.device = "x".repeat(MAX_ADVERT_BYTES);
        assert!(matches!(
            Advert::verify(&huge.sign(&k), &me, 10_000),
            Err(AdvertError::TooLarge(_))
        ));
    }

    #[test]
    fn the_table_refuses_replays_floods_and_drops_what_expired() {
        let k = key(1);
        let me = k.verifying_key().to_bytes();
        let mut table = Members::default();
        let first = advert(&k, 5, 1_000).sign(&k);
        assert_eq!(table.offer(&first, &me, 1_000), Ok(Offered::Joined));
        // The same advert again, and an older one.
        assert_eq!(
            table.offer(&first, &me, 2_000),
            Err(AdvertRefusal::Replayed { seq: 5, held: 5 })
        );
        let older = advert(&k, 4, 1_900).sign(&k);
        assert_eq!(
            table.offer(&older, &me, 2_000),
            Err(AdvertRefusal::Replayed { seq: 4, held: 5 })
        );
        let soon = advert(&k, 6, 1_100).sign(&k);
        assert_eq!(
            table.offer(&soon, &me, 1_100),
            Err(AdvertRefusal::RateLimited(100))
        );
        let next = advert(&k, 7, 2_000).sign(&k);
        assert_eq!(table.offer(&next, &me, 2_000), Ok(Offered::Updated));
        assert_eq!(table.get(&me).map(|m| m.advert.seq), Some(7));
        // Expiry drops it, and the old advert cannot bring it back.
        assert_eq!(table.expire(8_000), vec![me]);
        assert!(table.is_empty());
        assert!(matches!(
            table.offer(&first, &me, 4_000),
            Err(AdvertRefusal::Replayed { .. })
        ));
        // A refused advert changed nothing.
        assert!(table.is_empty());
    }

    proptest! {
        #[test]
        fn verify_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Advert::verify(&bytes, &[0; 32], 0);
        }

        #[test]
        fn adverts_round_trip(seq in any::<u64>(), issued in 0u64..1 << 50, memory in any::<u64>(),
                              load in any::<u32>(), ttl in 1..=MAX_ADVERT_TTL_MS,
                              layers in 1u32..200, speed in 1u64..=MAX_DECODE_US_PER_LAYER) {
            let k = key(3);
            let mut a = advert(&k, seq, issued);
            a.memory_bytes = memory;
            a.load = load;
            a.ttl_ms = ttl;
            a.models[0].layers = layers;
            a.models[0].decode_us_per_layer = speed;
            if seq % 2 == 1 {
                a.via = Some(AdvertVia { node_id: [9; 32], quic: format!("10.0.0.1:{}", load % 65_536), relayed: load % 4 == 1 });
            }
            a.rtts = (0..(layers as usize % (MAX_ADVERT_RTTS + 1)))
                .map(|i| AdvertRtt { node_id: [i as u8 + 10; 32], rtt_us: 1 + speed % MAX_ADVERT_RTT_US })
                .collect();
            let bytes = a.sign(&k);
            prop_assert_eq!(Advert::verify(&bytes, &k.verifying_key().to_bytes(), issued), Ok(a));
        }
    }
}
