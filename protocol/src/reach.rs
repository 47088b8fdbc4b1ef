//! `mesh-reach/1`: the messages of reachability on the data plane
//! (docs/mesh.md "Reachability"). One request and one answer per stream,
//! each a body of at most `MAX_REACH_MESSAGE` bytes (framed by the
//! caller), and the frames a relay copies between its members.
//!
//! ```text
//! OBSERVE    01                                   -> OBSERVED | BUSY | NOT_MEMBER
//! INTRODUCE  02 ‖ node key (32)                   -> DONE | NOT_KEPT | BUSY | SYMMETRIC | NOT_MEMBER
//! PUNCH      03 ‖ asker key (32) ‖ address (text) -> DONE | BUSY | SYMMETRIC | NOT_MEMBER
//! RELAY      04                                   -> DONE | BUSY | NO_RELAY | NOT_MEMBER
//! DIAL_BACK  05 ‖ node key (32) ‖ address (text)  -> OBSERVED | BUSY | NOT_MEMBER
//!
//! OBSERVED   00 (not reachable) | 01 (reachable) ‖ address seen (text)
//! DONE 00, NOT_KEPT 01, BUSY 02, NO_RELAY 03, SYMMETRIC 04, NOT_MEMBER 05 (one byte each)
//!
//! relay frame: peer key (32) ‖ packet length (u16 little-endian) ‖ packet (<= 1500)
//! ```
//!
//! An address is `HOST:PORT` as Rust writes a socket address (IPv6 in
//! brackets, its shortest form): one text per address, so one encoding
//! per message.

use std::net::SocketAddr;

use thiserror::Error;

/// The longest request or answer body.
pub const MAX_REACH_MESSAGE: usize = 128;
/// The longest QUIC packet a relay frame carries.
pub const MAX_RELAYED_PACKET: usize = 1500;
/// A relay frame's bytes before its packet: the key and the length.
pub const RELAY_FRAME_HEAD: usize = 34;

const OBSERVE: u8 = 1;
const INTRODUCE: u8 = 2;
const PUNCH: u8 = 3;
const RELAY: u8 = 4;
const DIAL_BACK: u8 = 5;

const DONE: u8 = 0;
const NOT_KEPT: u8 = 1;
const BUSY: u8 = 2;
const NO_RELAY: u8 = 3;
const SYMMETRIC: u8 = 4;
const NOT_MEMBER: u8 = 5;

/// What a member asks of another over `mesh-reach/1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReachRequest {
    /// How does the asked member see the asker, and does a connection
    /// from another of its ports get through unasked (a dial-back)?
    Observe,
    /// Have `node` (behind a NAT, its connection kept by the asked
    /// member) open its NAT to the asker.
    Introduce { node: [u8; 32] },
    /// From a rendezvous to the node it keeps: send a packet to `asker`
    /// at `at`, the address the rendezvous sees it at.
    Punch { asker: [u8; 32], at: SocketAddr },
    /// Hold this stream as the asker's relay stream (relay frames follow a
    /// `Done`).
    Relay,
    /// From a rendezvous to another member: dial `node` at `at` from a
    /// fresh port, and say whether the connection got in. It comes from an
    /// address the node never sent to, which a NAT that filters by address
    /// only keeps out (it lets in the rendezvous's own, from any port).
    DialBack { node: [u8; 32], at: SocketAddr },
}

/// What a request is answered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReachAnswer {
    /// To OBSERVE: the address the asker was seen at, and whether the
    /// dial-back got in. To DIAL_BACK: the address dialled, and whether
    /// the connection got in.
    Observed { reachable: bool, seen: SocketAddr },
    /// Introduced, punched, or relaying from now on.
    Done,
    /// No connection to that node is kept here.
    NotKept,
    /// Out of slots for now.
    Busy,
    /// This member offers no relay.
    NoRelay,
    /// The node is behind a symmetric NAT: no punch helps, reach it
    /// through its relay.
    Symmetric,
    /// The asker is not a member of this node's mesh.
    NotMember,
}

/// Why bytes are not a `mesh-reach/1` message.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ReachError {
    #[error("a reach message of {0} bytes, at most {MAX_REACH_MESSAGE}")]
    TooLong(usize),
    #[error("an empty reach message")]
    Empty,
    #[error("no reach request has kind {0}")]
    UnknownRequest(u8),
    #[error("a key of 32 bytes, or no more bytes, expected")]
    Length,
    #[error("the address is not HOST:PORT in its one written form")]
    Address,
    #[error("{answer} does not answer {request}")]
    NotAnAnswer { answer: u8, request: &'static str },
    #[error("a relayed packet of {0} bytes, at most {MAX_RELAYED_PACKET}")]
    PacketTooLong(usize),
    #[error("the relay frame ends before its packet does, or goes on after it")]
    FrameLength,
}

impl ReachError {
    /// The refusal as the vectors name it.
    pub fn kind(&self) -> &'static str {
        match self {
            ReachError::TooLong(_) => "too_long",
            ReachError::Empty => "empty",
            ReachError::UnknownRequest(_) => "unknown_request",
            ReachError::Length => "length",
            ReachError::Address => "address",
            ReachError::NotAnAnswer { .. } => "not_an_answer",
            ReachError::PacketTooLong(_) => "packet_too_long",
            ReachError::FrameLength => "frame_length",
        }
    }
}

fn bounded(body: &[u8]) -> Result<(), ReachError> {
    match body.len() {
        0 => Err(ReachError::Empty),
        n if n > MAX_REACH_MESSAGE => Err(ReachError::TooLong(n)),
        _ => Ok(()),
    }
}

fn key(bytes: &[u8]) -> Result<[u8; 32], ReachError> {
    bytes.try_into().map_err(|_| ReachError::Length)
}

fn address(text: &[u8]) -> Result<SocketAddr, ReachError> {
    let text = std::str::from_utf8(text).map_err(|_| ReachError::Address)?;
    let addr: SocketAddr = text.parse().map_err(|_| ReachError::Address)?;
    if addr.to_string() != text {
        return Err(ReachError::Address);
    }
    Ok(addr)
}

fn key_and_address(bytes: &[u8]) -> Result<([u8; 32], SocketAddr), ReachError> {
    let (node, at) = bytes.split_at_checked(32).ok_or(ReachError::Length)?;
    Ok((key(node)?, address(at)?))
}

impl ReachRequest {
    pub fn name(&self) -> &'static str {
        match self {
            ReachRequest::Observe => "OBSERVE",
            ReachRequest::Introduce { .. } => "INTRODUCE",
            ReachRequest::Punch { .. } => "PUNCH",
            ReachRequest::Relay => "RELAY",
            ReachRequest::DialBack { .. } => "DIAL_BACK",
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            ReachRequest::Observe => vec![OBSERVE],
            ReachRequest::Introduce { node } => [&[INTRODUCE][..], node].concat(),
            ReachRequest::Punch { asker, at } => {
                [&[PUNCH][..], asker, at.to_string().as_bytes()].concat()
            }
            ReachRequest::Relay => vec![RELAY],
            ReachRequest::DialBack { node, at } => {
                [&[DIAL_BACK][..], node, at.to_string().as_bytes()].concat()
            }
        }
    }

    pub fn decode(body: &[u8]) -> Result<Self, ReachError> {
        bounded(body)?;
        match body {
            [OBSERVE] => Ok(ReachRequest::Observe),
            [RELAY] => Ok(ReachRequest::Relay),
            [OBSERVE | RELAY, ..] => Err(ReachError::Length),
            [INTRODUCE, node @ ..] => Ok(ReachRequest::Introduce { node: key(node)? }),
            [PUNCH, rest @ ..] => {
                let (asker, at) = key_and_address(rest)?;
                Ok(ReachRequest::Punch { asker, at })
            }
            [DIAL_BACK, rest @ ..] => {
                let (node, at) = key_and_address(rest)?;
                Ok(ReachRequest::DialBack { node, at })
            }
            [other, ..] => Err(ReachError::UnknownRequest(*other)),
            [] => Err(ReachError::Empty),
        }
    }

    /// Whether `answer` is one this request may get.
    fn answered_by(&self, answer: &ReachAnswer) -> bool {
        use ReachAnswer as A;
        matches!(
            (self, answer),
            (_, A::Busy | A::NotMember)
                | (
                    ReachRequest::Observe | ReachRequest::DialBack { .. },
                    A::Observed { .. }
                )
                | (
                    ReachRequest::Introduce { .. },
                    A::Done | A::NotKept | A::Symmetric
                )
                | (ReachRequest::Punch { .. }, A::Done | A::Symmetric)
                | (ReachRequest::Relay, A::Done | A::NoRelay)
        )
    }
}

impl ReachAnswer {
    pub fn name(&self) -> &'static str {
        match self {
            ReachAnswer::Observed { .. } => "OBSERVED",
            ReachAnswer::Done => "DONE",
            ReachAnswer::NotKept => "NOT_KEPT",
            ReachAnswer::Busy => "BUSY",
            ReachAnswer::NoRelay => "NO_RELAY",
            ReachAnswer::Symmetric => "SYMMETRIC",
            ReachAnswer::NotMember => "NOT_MEMBER",
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            ReachAnswer::Observed { reachable, seen } => {
                [&[u8::from(*reachable)][..], seen.to_string().as_bytes()].concat()
            }
            ReachAnswer::Done => vec![DONE],
            ReachAnswer::NotKept => vec![NOT_KEPT],
            ReachAnswer::Busy => vec![BUSY],
            ReachAnswer::NoRelay => vec![NO_RELAY],
            ReachAnswer::Symmetric => vec![SYMMETRIC],
            ReachAnswer::NotMember => vec![NOT_MEMBER],
        }
    }

    /// The answer to `request` in `body`: refused when it is not one that
    /// request may get.
    pub fn decode(request: &ReachRequest, body: &[u8]) -> Result<Self, ReachError> {
        bounded(body)?;
        let answer = match body {
            [DONE] => ReachAnswer::Done,
            [NOT_KEPT] => ReachAnswer::NotKept,
            [BUSY] => ReachAnswer::Busy,
            [NO_RELAY] => ReachAnswer::NoRelay,
            [SYMMETRIC] => ReachAnswer::Symmetric,
            [NOT_MEMBER] => ReachAnswer::NotMember,
            [reachable @ (0 | 1), seen @ ..] => ReachAnswer::Observed {
                reachable: *reachable == 1,
                seen: address(seen)?,
            },
            [NOT_KEPT..=NOT_MEMBER, _, ..] => return Err(ReachError::Length),
            [other, ..] => {
                return Err(ReachError::NotAnAnswer {
                    answer: *other,
                    request: request.name(),
                });
            }
            [] => return Err(ReachError::Empty),
        };
        if !request.answered_by(&answer) {
            return Err(ReachError::NotAnAnswer {
                answer: body[0],
                request: request.name(),
            });
        }
        Ok(answer)
    }
}

/// A relay frame carrying `packet` to or from `peer`.
pub fn relay_frame(peer: &[u8; 32], packet: &[u8]) -> Result<Vec<u8>, ReachError> {
    let len = u16::try_from(packet.len())
        .ok()
        .filter(|len| usize::from(*len) <= MAX_RELAYED_PACKET)
        .ok_or(ReachError::PacketTooLong(packet.len()))?;
    let mut frame = Vec::with_capacity(RELAY_FRAME_HEAD + packet.len());
    frame.extend_from_slice(peer);
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(packet);
    Ok(frame)
}

/// A relay frame's head: the peer it names and its packet's length
/// (refused past `MAX_RELAYED_PACKET`, before the packet is read).
pub fn relay_frame_head(head: &[u8; RELAY_FRAME_HEAD]) -> Result<([u8; 32], usize), ReachError> {
    let (peer, len) = head.split_at(32);
    let len = usize::from(u16::from_le_bytes([len[0], len[1]]));
    if len > MAX_RELAYED_PACKET {
        return Err(ReachError::PacketTooLong(len));
    }
    Ok((key(peer)?, len))
}

/// A whole relay frame: the peer and the packet, nothing after it.
pub fn parse_relay_frame(frame: &[u8]) -> Result<([u8; 32], &[u8]), ReachError> {
    let (head, packet) = frame
        .split_first_chunk::<RELAY_FRAME_HEAD>()
        .ok_or(ReachError::FrameLength)?;
    let (peer, len) = relay_frame_head(head)?;
    if packet.len() != len {
        return Err(ReachError::FrameLength);
    }
    Ok((peer, packet))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn requests() -> Vec<ReachRequest> {
        vec![
            ReachRequest::Observe,
            ReachRequest::Introduce { node: [7; 32] },
            ReachRequest::Punch {
                asker: [9; 32],
                at: "[2001:db8::1]:7420".parse().unwrap(),
            },
            ReachRequest::Relay,
            ReachRequest::DialBack {
                node: [5; 32],
                at: "203.0.113.9:7001".parse().unwrap(),
            },
        ]
    }

    #[test]
    fn every_request_and_the_answers_it_may_get_read_back() {
        let answers = [
            ReachAnswer::Observed {
                reachable: false,
                seen: "198.51.100.7:40123".parse().unwrap(),
            },
            ReachAnswer::Done,
            ReachAnswer::NotKept,
            ReachAnswer::Busy,
            ReachAnswer::NoRelay,
            ReachAnswer::Symmetric,
            ReachAnswer::NotMember,
        ];
        for request in requests() {
            assert_eq!(ReachRequest::decode(&request.encode()), Ok(request));
            for answer in answers {
                let read = ReachAnswer::decode(&request, &answer.encode());
                if request.answered_by(&answer) {
                    assert_eq!(read, Ok(answer));
                } else {
                    assert!(
                        matches!(read, Err(ReachError::NotAnAnswer { .. })),
                        "{answer:?} to {request:?}: {read:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn one_text_per_address_and_keys_of_32_bytes() {
        let mut body = vec![PUNCH];
        body.extend_from_slice(&[1; 32]);
        for (text, ok) in [
            ("10.0.0.1:7000", true),
            ("[::1]:7000", true),
            ("[0:0:0:0:0:0:0:1]:7000", false),
            ("10.0.0.1", false),
            ("10.0.0.1:7000 ", false),
        ] {
            let mut punch = body.clone();
            punch.extend_from_slice(text.as_bytes());
            assert_eq!(ReachRequest::decode(&punch).is_ok(), ok, "{text}");
        }
        assert_eq!(
            ReachRequest::decode(&[INTRODUCE, 1, 2]),
            Err(ReachError::Length)
        );
        assert_eq!(ReachRequest::decode(&[OBSERVE, 0]), Err(ReachError::Length));
        assert_eq!(
            ReachRequest::decode(&[9]),
            Err(ReachError::UnknownRequest(9))
        );
        assert_eq!(
            ReachRequest::decode(&[OBSERVE; 129]),
            Err(ReachError::TooLong(129))
        );
    }

    #[test]
    fn a_relay_frame_past_the_packet_limit_is_refused_from_its_head() {
        let frame = relay_frame(&[3; 32], &[0xAB; MAX_RELAYED_PACKET]).unwrap();
        assert_eq!(
            parse_relay_frame(&frame),
            Ok(([3; 32], &[0xAB; MAX_RELAYED_PACKET][..]))
        );
        assert_eq!(
            relay_frame(&[3; 32], &[0; MAX_RELAYED_PACKET + 1]),
            Err(ReachError::PacketTooLong(MAX_RELAYED_PACKET + 1))
        );
        let mut head = [0u8; RELAY_FRAME_HEAD];
        head[32..].copy_from_slice(&1501u16.to_le_bytes());
        assert_eq!(
            relay_frame_head(&head),
            Err(ReachError::PacketTooLong(1501))
        );
        assert_eq!(
            parse_relay_frame(&frame[..frame.len() - 1]),
            Err(ReachError::FrameLength)
        );
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ReachRequest::decode(&bytes);
            for request in requests() {
                let _ = ReachAnswer::decode(&request, &bytes);
            }
            let _ = parse_relay_frame(&bytes);
        }

        #[test]
        fn punches_and_frames_round_trip(asker in any::<[u8; 32]>(), ip in any::<[u8; 16]>(),
                                         port in any::<u16>(), v4 in any::<bool>(),
                                         packet in proptest::collection::vec(any::<u8>(), 0..=MAX_RELAYED_PACKET)) {
            let at = if v4 {
                SocketAddr::from(([ip[0], ip[1], ip[2], ip[3]], port))
            } else {
                SocketAddr::from((ip, port))
            };
            let punch = ReachRequest::Punch { asker, at };
            prop_assert_eq!(ReachRequest::decode(&punch.encode()), Ok(punch));
            let dial_back = ReachRequest::DialBack { node: asker, at };
            prop_assert_eq!(ReachRequest::decode(&dial_back.encode()), Ok(dial_back));
            let frame = relay_frame(&asker, &packet).unwrap();
            prop_assert_eq!(parse_relay_frame(&frame), Ok((asker, &packet[..])));
        }
    }
}
