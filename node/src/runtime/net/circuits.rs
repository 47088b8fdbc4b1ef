//! A relay's bookkeeping (docs/mesh.md "Reachability", "Limits of a
//! relay"): the circuits it carries between pairs of members, each within
//! its bytes and time, and what it says when it drops a packet.

use std::collections::HashMap;
use std::time::Duration;

/// How long a relayed circuit may sit idle before its place is freed.
pub const CIRCUIT_IDLE: Duration = Duration::from_secs(60);
/// Bytes one relayed circuit carries by default: a few long prompts'
/// activations and their replies.
pub const DEFAULT_CIRCUIT_BYTES: u64 = 1 << 30;

/// What a relay carries of the data plane for members that cannot reach
/// each other: members holding a relay stream, circuits (pairs of them)
/// at once, and the bytes and time of each circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayBounds {
    pub members: usize,
    pub circuits: usize,
    pub circuit_bytes: u64,
    pub circuit_duration: Duration,
}

impl Default for RelayBounds {
    fn default() -> Self {
        Self {
            members: 128,
            circuits: 64,
            circuit_bytes: DEFAULT_CIRCUIT_BYTES,
            circuit_duration: Duration::from_secs(60 * 60),
        }
    }
}

/// Why a relay dropped a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitRefusal {
    /// Every circuit is taken.
    Full,
    /// The circuit carried its bytes.
    Bytes,
    /// The circuit lived its time.
    Expired,
}

#[derive(Debug)]
struct Circuit {
    started: std::time::Instant,
    last: std::time::Instant,
    bytes: u64,
}

/// The relay's circuits: one per pair of members, bounded.
#[derive(Debug)]
pub struct Circuits {
    bounds: RelayBounds,
    open: HashMap<([u8; 32], [u8; 32]), Circuit>,
}

impl Circuits {
    pub fn new(bounds: RelayBounds) -> Self {
        Self {
            bounds,
            open: HashMap::new(),
        }
    }

    /// Count `bytes` from `from` to `to` at `now`, or say why not.
    pub fn admit(
        &mut self,
        from: [u8; 32],
        to: [u8; 32],
        bytes: usize,
        now: std::time::Instant,
    ) -> Result<(), CircuitRefusal> {
        let pair = if from < to { (from, to) } else { (to, from) };
        // A circuit ends after `CIRCUIT_IDLE` without a packet; a pair that
        // keeps sending past its budget stays refused.
        if self
            .open
            .get(&pair)
            .is_some_and(|c| now.saturating_duration_since(c.last) >= CIRCUIT_IDLE)
        {
            self.open.remove(&pair);
        }
        if !self.open.contains_key(&pair) {
            self.open
                .retain(|_, c| now.saturating_duration_since(c.last) < CIRCUIT_IDLE);
            if self.open.len() >= self.bounds.circuits {
                return Err(CircuitRefusal::Full);
            }
            self.open.insert(
                pair,
                Circuit {
                    started: now,
                    last: now,
                    bytes: 0,
                },
            );
        }
        let circuit = self.open.get_mut(&pair).ok_or(CircuitRefusal::Full)?;
        // A refused packet is a packet too: a pair that keeps sending keeps
        // its spent circuit.
        circuit.last = now;
        if now.saturating_duration_since(circuit.started) > self.bounds.circuit_duration {
            return Err(CircuitRefusal::Expired);
        }
        let bytes = circuit.bytes.saturating_add(bytes as u64);
        if bytes > self.bounds.circuit_bytes {
            return Err(CircuitRefusal::Bytes);
        }
        circuit.bytes = bytes;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(circuits: usize, circuit_bytes: u64) -> RelayBounds {
        RelayBounds {
            members: 8,
            circuits,
            circuit_bytes,
            circuit_duration: Duration::from_secs(30),
        }
    }

    #[test]
    fn a_relay_refuses_circuits_past_its_limits() {
        let now = std::time::Instant::now();
        let mut circuits = Circuits::new(bounds(2, 1000));
        assert_eq!(circuits.admit([1; 32], [2; 32], 100, now), Ok(()));
        // Both directions are one circuit.
        assert_eq!(circuits.admit([2; 32], [1; 32], 100, now), Ok(()));
        assert_eq!(circuits.admit([1; 32], [3; 32], 100, now), Ok(()));
        assert_eq!(
            circuits.admit([4; 32], [5; 32], 1, now),
            Err(CircuitRefusal::Full)
        );
        // Bytes: 200 carried, 800 more fit, then no more.
        assert_eq!(circuits.admit([1; 32], [2; 32], 800, now), Ok(()));
        assert_eq!(
            circuits.admit([1; 32], [2; 32], 1, now),
            Err(CircuitRefusal::Bytes)
        );
        // Time: a circuit past its duration (30 s here) carries nothing, and
        // one that keeps sending stays refused.
        for seconds in [31, 50, 70, 90] {
            assert_eq!(
                circuits.admit([1; 32], [3; 32], 1, now + Duration::from_secs(seconds)),
                Err(CircuitRefusal::Expired)
            );
        }
        // A circuit silent for `CIRCUIT_IDLE` has ended: its place goes to
        // another pair, and the pair may start a new one.
        let idle = now + Duration::from_secs(91) + CIRCUIT_IDLE;
        assert_eq!(circuits.admit([4; 32], [5; 32], 1, idle), Ok(()));
        assert_eq!(circuits.admit([1; 32], [2; 32], 1, idle), Ok(()));
    }
}
