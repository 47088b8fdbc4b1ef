//! Node identities: an Ed25519 public key, written as a `did:key`.

use ed25519_dalek::VerifyingKey;

/// Multicodec prefix of an Ed25519 public key (0xed, varint-encoded).
const ED25519_MULTICODEC: [u8; 2] = [0xed, 0x01];
const BASE58_ALPHABET: &[u8; 58] = b"123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz";

fn base58_encode(bytes: &[u8]) -> String {
    let zeros = bytes.iter().take_while(|b| **b == 0).count();
    // Base-58 digits, least significant first.
    let mut digits: Vec<u8> = Vec::with_capacity(bytes.len() * 138 / 100 + 1);
    for byte in &bytes[zeros..] {
        let mut carry = u32::from(*byte);
        for digit in digits.iter_mut() {
            carry += u32::from(*digit) << 8;
            *digit = (carry % 58) as u8;
            carry /= 58;
        }
        while carry > 0 {
            digits.push((carry % 58) as u8);
            carry /= 58;
        }
    }
    let mut out = String::with_capacity(zeros + digits.len());
    out.extend(std::iter::repeat_n('1', zeros));
    out.extend(
        digits
            .iter()
            .rev()
            .map(|d| BASE58_ALPHABET[usize::from(*d)] as char),
    );
    out
}

fn base58_decode(text: &str) -> Option<Vec<u8>> {
    let zeros = text.bytes().take_while(|b| *b == b'1').count();
    let mut bytes: Vec<u8> = Vec::new();
    for c in text.bytes().skip(zeros) {
        let mut carry = u32::try_from(BASE58_ALPHABET.iter().position(|a| *a == c)?).ok()?;
        for byte in bytes.iter_mut() {
            carry += u32::from(*byte) * 58;
            *byte = (carry & 0xff) as u8;
            carry >>= 8;
        }
        while carry > 0 {
            bytes.push((carry & 0xff) as u8);
            carry >>= 8;
        }
    }
    let mut out = vec![0u8; zeros];
    out.extend(bytes.iter().rev());
    Some(out)
}

/// `did:key:z…` of an Ed25519 public key.
pub fn did_key(public_key: &[u8; 32]) -> String {
    let mut raw = Vec::with_capacity(34);
    raw.extend_from_slice(&ED25519_MULTICODEC);
    raw.extend_from_slice(public_key);
    format!("did:key:z{}", base58_encode(&raw))
}

/// The Ed25519 public key of a `did:key`, if it is one (and a valid point).
pub fn parse_did_key(did: &str) -> Option<[u8; 32]> {
    // 34 bytes encode to at most 47 base-58 digits; refuse anything longer
    // before doing quadratic work on it.
    let encoded = did
        .strip_prefix("did:key:z")
        .filter(|rest| rest.len() <= 64)?;
    let raw = base58_decode(encoded)?;
    let key: [u8; 32] = raw.strip_prefix(&ED25519_MULTICODEC)?.try_into().ok()?;
    VerifyingKey::from_bytes(&key).ok()?;
    Some(key)
}

/// The libp2p identity prefix of an Ed25519 key: an identity multihash
/// (0x00, length 36) of the protobuf `PublicKey { Type: Ed25519 (1), Data:
/// 32 bytes }` (0x08 0x01 0x12 0x20). The node's PeerId and its did:key name
/// the same 32 bytes under these two prefixes.
const PEER_ID_PREFIX: [u8; 6] = [0x00, 0x24, 0x08, 0x01, 0x12, 0x20];

/// The libp2p PeerId (`12D3KooW…`) of an Ed25519 public key.
pub fn peer_id(public_key: &[u8; 32]) -> String {
    let mut raw = Vec::with_capacity(38);
    raw.extend_from_slice(&PEER_ID_PREFIX);
    raw.extend_from_slice(public_key);
    base58_encode(&raw)
}

/// The Ed25519 public key a PeerId names, when it names one inline.
pub fn parse_peer_id(text: &str) -> Option<[u8; 32]> {
    if text.len() > 64 {
        return None;
    }
    let raw = base58_decode(text)?;
    let key: [u8; 32] = raw.strip_prefix(&PEER_ID_PREFIX)?.try_into().ok()?;
    VerifyingKey::from_bytes(&key).ok()?;
    Some(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn matches_the_did_key_spec_example() {
        // From the did:key method specification's Ed25519 test vectors.
        let did = "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp";
        let key = parse_did_key(did).unwrap();
        assert_eq!(did_key(&key), did);
    }

    proptest! {
        #[test]
        fn round_trips(seed in any::<[u8; 32]>()) {
            let key = ed25519_dalek::SigningKey::from_bytes(&seed).verifying_key().to_bytes();
            prop_assert_eq!(parse_did_key(&did_key(&key)), Some(key));
            prop_assert_eq!(parse_peer_id(&peer_id(&key)), Some(key));
            prop_assert!(peer_id(&key).starts_with("12D3KooW"));
        }

        #[test]
        fn never_panics(text in ".{0,80}") {
            let _ = parse_did_key(&text);
            let _ = parse_did_key(&format!("did:key:z{text}"));
            let _ = parse_peer_id(&text);
        }
    }
}
