//! The generator of the `mesh/1` conformance vectors (`vectors/mesh1/`): a
//! deterministic reference serve (fixed steward key, signed core, envelope,
//! the next envelope in its chain), receipt cases, and grant chains,
//! shards and presentations with the decision each must get. Every negative
//! case is derived mechanically from a positive one and says what it must
//! verify as; the generator refuses to write a case the code disagrees with.

use anyhow::{Context, ensure};
use mesh_protocol::SigningKey;
use mesh_protocol::cbor::Cbor;
use mesh_protocol::grant::{Caveat, Grant, GrantGate, Presentation, SignedGrant};
use mesh_protocol::hex;
use mesh_protocol::identity::did_key;
use mesh_protocol::mesh1::{
    Energy, Fidelity, FidelityReport, MeshReceipt, SealedReceipt, ServeRequest, WeightsBinding,
    opening, opening_key, output_commitment, prompt_hash, prompt_payload, sign_core_unchecked,
    weights_digest,
};
use serde_json::{Value, json};

use crate::tools::simulate::{Scenario, deterministic_32, simulate};
use crate::tools::vectors::file::VectorFile;

fn key(label: &str) -> SigningKey {
    SigningKey::from_bytes(&deterministic_32(label))
}

fn did(key: &SigningKey) -> String {
    did_key(&key.verifying_key().to_bytes())
}

const STEWARD_LABEL: &str = "mesh-node vectors: mesh/1 steward key";
/// 2026-09-30T03:38:00.000Z
const NOW_MS: u64 = 1_790_739_480_000;
const EXPIRY_MS: u64 = NOW_MS + 86_400_000;

fn request() -> ServeRequest {
    ServeRequest {
        prompt_hash: prompt_hash(b"What is the capital of France?"),
        prompt_tokens: 9,
        max_tokens: 16,
        fidelity_floor: Fidelity::F1,
        joule_ceiling_uj: 5_000_000,
        decision: None,
    }
}

const PROMPT_TOKENS: [u32; 9] = [1, 9690, 314, 260, 3575, 282, 4649, 47, 2];
const OUTPUT_TOKENS: [u32; 7] = [504, 3575, 282, 4649, 314, 7042, 30];

fn pretty(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    text
}

fn weights_files() -> Vec<(String, [u8; 32])> {
    vec![
        (
            "config.json".to_string(),
            *blake3::hash(b"synthetic config").as_bytes(),
        ),
        (
            "model.safetensors".to_string(),
            *blake3::hash(b"synthetic weights").as_bytes(),
        ),
    ]
}

fn reference_receipts(
    steward: &SigningKey,
    grant_id: [u8; 32],
) -> anyhow::Result<(SealedReceipt, SealedReceipt)> {
    let request = request();
    let open = opening(&opening_key(&steward.to_bytes()), &request.request_id());
    let commitment = output_commitment(
        &open,
        &request.request_id(),
        &prompt_payload(&PROMPT_TOKENS),
        &OUTPUT_TOKENS,
    );
    let split = simulate(&Scenario::default()).sealed.receipt.to_value();
    let first = MeshReceipt {
        request_id: request.request_id(),
        grant_id: Some(grant_id),
        backend: "mesh-node/split".into(),
        recipe: "synthetic-llama".into(),
        weights: Some(WeightsBinding {
            weights_digest: weights_digest(&weights_files()),
            precision: "fp32".into(),
        }),
        route: "static split over 3 nodes".into(),
        tokens_in: PROMPT_TOKENS.len() as u64,
        tokens_out: OUTPUT_TOKENS.len() as u64,
        tokens_accepted: OUTPUT_TOKENS.len() as u64,
        cache_hit_tokens: 0,
        spec_proposed: 0,
        spec_accepted: 0,
        fidelity_floor: Fidelity::F1,
        fidelity: None,
        fidelity_rating: Fidelity::F2,
        energy: Energy::estimator(1_234_567),
        decision: None,
        grant_breach: None,
        output_commitment: Some(commitment),
        sequence: 0,
        prev: None,
        nonce: deterministic_32("mesh-node vectors: receipt nonce 0")[..16].try_into()?,
        steward: did(steward),
        split: Some(mesh_protocol::json::canonical_bytes(&split)),
        resumed: None,
        deterministic: None,
        training: None,
    }
    .seal(steward)?;
    let second = MeshReceipt {
        sequence: 1,
        prev: Some(first.envelope_id()),
        energy: Energy::hw_shunt(2_000_000, 1_900_000),
        fidelity: Some(FidelityReport {
            advertised: Fidelity::F2,
            delivered: Fidelity::F2,
        }),
        split: None,
        resumed: None,
        grant_breach: Some("caveat-unsatisfied".into()),
        nonce: deterministic_32("mesh-node vectors: receipt nonce 1")[..16].try_into()?,
        ..first.receipt.clone()
    }
    .seal(steward)?;
    Ok((first, second))
}

/// A signed core with one member replaced (or removed, with `None`).
fn core_with(core: &Cbor, member: &str, value: Option<Cbor>) -> Cbor {
    let Cbor::Map(entries) = core else {
        return core.clone();
    };
    let mut entries: Vec<(Cbor, Cbor)> = entries
        .iter()
        .filter(|(k, _)| k.as_text() != Some(member))
        .cloned()
        .collect();
    if let Some(value) = value {
        entries.push((Cbor::text(member), value));
    }
    Cbor::map(entries)
}

/// A resume block of two segments: the middle stage lost after 10 tokens,
/// a spare node in its place.
fn resume_block() -> Value {
    let node = |label: &str| did(&key(label));
    let coordinator = node("mesh-node vectors: steward");
    let (a, b, spare) = (
        node("mesh-node vectors: stage a"),
        node("mesh-node vectors: stage b"),
        node("mesh-node vectors: spare"),
    );
    mesh_protocol::resume::ResumeBlock {
        segments: vec![
            mesh_protocol::resume::Segment {
                run_id: "mesh-split-1".into(),
                main_record: [0x11; 32],
                nodes: vec![coordinator.clone(), a.clone(), b.clone()],
                first_token: 0,
                prefilled: 5,
                tokens: 10,
                terminal_state: "transport_error".into(),
                lost: vec![a],
                kept: vec![],
            },
            mesh_protocol::resume::Segment {
                run_id: "mesh-split-2".into(),
                main_record: [0x22; 32],
                nodes: vec![coordinator.clone(), spare, b.clone()],
                first_token: 10,
                // The spare rebuilt its cache from 14 positions (the prompt
                // and 9 tokens); the coordinator and stage b kept theirs.
                prefilled: 14,
                tokens: 54,
                terminal_state: "completed".into(),
                lost: vec![],
                kept: vec![coordinator, b],
            },
        ],
    }
    .to_value()
}

fn receipt_cases(steward: &SigningKey, first: &SealedReceipt) -> anyhow::Result<Value> {
    let mut cases = vec![
        json!({ "name": "reference", "valid": true, "derived_from": null, "envelope_hex": hex::encode(&first.envelope) }),
    ];
    let envelope = &first.envelope;
    let mut push = |name: String, valid: bool, bytes: Vec<u8>| {
        cases.push(json!({ "name": name, "valid": valid, "derived_from": "reference", "envelope_hex": hex::encode(&bytes) }));
    };
    let step = (envelope.len() / 24).max(1);
    for offset in (0..envelope.len())
        .step_by(step)
        .chain([envelope.len() - 1])
    {
        let mut flipped = envelope.clone();
        flipped[offset] ^= 0x01;
        push(format!("bit_flipped_at_{offset}"), false, flipped);
    }
    push(
        "truncated".into(),
        false,
        envelope[..envelope.len() - 1].to_vec(),
    );
    let mut trailing = envelope.clone();
    trailing.push(0);
    push("trailing_byte".into(), false, trailing);
    // The same receipt, its signature still good, with its first head (the
    // COSE_Sign1 tag, 18) written in two bytes where one is the shortest:
    // not the envelope its steward sealed (one receipt, one envelope id).
    if envelope.first() == Some(&0xd2) {
        let mut longer = vec![0xd8, 0x12];
        longer.extend_from_slice(&envelope[1..]);
        push("tag_written_longer".into(), false, longer);
    }
    // The kid swapped for another steward's key: the signature no longer holds.
    let other = key("mesh-node vectors: another steward");
    let kid = steward.verifying_key().to_bytes();
    let position = envelope
        .windows(32)
        .position(|w| w == kid)
        .context("kid in envelope")?;
    let mut swapped = envelope.clone();
    swapped[position..position + 32].copy_from_slice(&other.verifying_key().to_bytes());
    push("kid_of_another_key".into(), false, swapped);
    // The same core signed by another key: `steward` no longer names the signer.
    push(
        "signed_by_another_key".into(),
        false,
        sign_core_unchecked(first.core.clone(), &other),
    );

    // Validly signed cores that break a receipt rule.
    let core = Cbor::decode(&first.core)?;
    let signed = |core: Cbor| sign_core_unchecked(core.encode(), steward);
    push(
        "estimator_with_measured_uj".into(),
        false,
        signed(core_with(&core, "measured_uj", Some(Cbor::Uint(5)))),
    );
    push(
        "hwshunt_without_measured_uj".into(),
        false,
        signed(core_with(
            &core,
            "energy_provenance",
            Some(Cbor::text("HwShunt")),
        )),
    );
    push(
        "wedge_metric_wrong".into(),
        false,
        signed(core_with(
            &core,
            "uj_per_accepted_token",
            Some(Cbor::Uint(1)),
        )),
    );
    push(
        "wedge_metric_missing".into(),
        false,
        signed(core_with(&core, "uj_per_accepted_token", None)),
    );
    push(
        "unknown_member".into(),
        false,
        signed(core_with(&core, "session_id", Some(Cbor::Uint(1)))),
    );
    push(
        "boolean_met_as_2".into(),
        false,
        signed(core_with(&core, "fidelity_met", Some(Cbor::Uint(2)))),
    );
    let training_digest = Cbor::text(hex::encode(&deterministic_32(
        "mesh-node vectors: a training corpus",
    )));
    push(
        "training_signed".into(),
        true,
        signed(core_with(
            &core_with(&core, "training_digest", Some(training_digest.clone())),
            "training_authority",
            Some(Cbor::text("signed")),
        )),
    );
    push(
        "training_digest_without_authority".into(),
        false,
        signed(core_with(
            &core,
            "training_digest",
            Some(training_digest.clone()),
        )),
    );
    push(
        "training_authority_unknown".into(),
        false,
        signed(core_with(
            &core_with(&core, "training_digest", Some(training_digest)),
            "training_authority",
            Some(Cbor::text("trusted")),
        )),
    );
    push(
        "deterministic_not_0_or_1".into(),
        false,
        signed(core_with(&core, "deterministic", Some(Cbor::Uint(2)))),
    );
    push(
        "delivered_above_advertised".into(),
        false,
        signed(core_with(
            &core_with(&core, "fidelity_advertised", Some(Cbor::Uint(1))),
            "fidelity_delivered",
            Some(Cbor::Uint(3)),
        )),
    );
    push(
        "weights_digest_without_precision".into(),
        false,
        signed(core_with(&core, "precision", None)),
    );
    push(
        "prev_at_genesis".into(),
        false,
        signed(core_with(
            &core,
            "prev",
            Some(Cbor::text(hex::encode(&[1; 32]))),
        )),
    );
    push(
        "split_not_canonical_json".into(),
        false,
        signed(core_with(
            &core,
            "split",
            Some(Cbor::bytes(b"{ \"v\": 1 }".to_vec())),
        )),
    );
    // A resumed serve's block, and blocks that break its rules.
    let block = |edit: &dyn Fn(&mut Value)| {
        let mut value = resume_block();
        edit(&mut value);
        Cbor::bytes(mesh_protocol::json::canonical_bytes(&value))
    };
    push(
        "resumed_two_segments".into(),
        true,
        signed(core_with(&core, "resumed", Some(block(&|_| {})))),
    );
    push(
        "resumed_not_canonical_json".into(),
        false,
        signed(core_with(
            &core,
            "resumed",
            Some(Cbor::bytes(
                mesh_protocol::json::canonical_bytes(&resume_block())
                    .into_iter()
                    .chain(*b" ")
                    .collect::<Vec<u8>>(),
            )),
        )),
    );
    push(
        "resumed_one_segment".into(),
        false,
        signed(core_with(
            &core,
            "resumed",
            Some(block(&|v| {
                if let Some(segments) = v["segments"].as_array_mut() {
                    segments.truncate(1);
                }
            })),
        )),
    );
    push(
        "resumed_segments_not_contiguous".into(),
        false,
        signed(core_with(
            &core,
            "resumed",
            Some(block(&|v| v["segments"][1]["first_token"] = json!(11))),
        )),
    );
    push(
        "resumed_lost_node_not_in_chain".into(),
        false,
        signed(core_with(
            &core,
            "resumed",
            Some(block(&|v| {
                v["segments"][0]["lost"] = json!([did(&key("mesh-node vectors: a stranger"))])
            })),
        )),
    );
    push(
        "resumed_kept_node_new_to_the_segment".into(),
        false,
        signed(core_with(
            &core,
            "resumed",
            Some(block(&|v| {
                v["segments"][1]["kept"] = json!([did(&key("mesh-node vectors: spare"))])
            })),
        )),
    );
    push(
        "resumed_without_split".into(),
        false,
        signed(core_with(
            &core_with(&core, "split", None),
            "resumed",
            Some(block(&|_| {})),
        )),
    );
    // Members reordered: not canonical CBOR, though it decodes loosely.
    let Cbor::Map(entries) = &core else {
        anyhow::bail!("the core is a map")
    };
    let mut reversed = Vec::new();
    crate::tools::vectors::mesh1::encode_map_unsorted(&mut reversed, entries.iter().rev());
    push(
        "members_not_in_canonical_order".into(),
        false,
        sign_core_unchecked(reversed, steward),
    );
    // A re-seal of the very same core by the steward is valid and identical.
    push(
        "resigned_same_core".into(),
        true,
        sign_core_unchecked(first.core.clone(), steward),
    );

    for case in &cases {
        let bytes =
            hex::decode(case["envelope_hex"].as_str().unwrap_or_default()).unwrap_or_default();
        let verified = SealedReceipt::verify(&bytes);
        ensure!(
            verified.is_ok() == case["valid"].as_bool().unwrap_or_default(),
            "receipt case {} does not verify as constructed: {verified:?}",
            case["name"]
        );
    }
    Ok(Value::Array(cases))
}

/// Encode a map's entries in the order given (for a non-canonical vector).
fn encode_map_unsorted<'a>(
    out: &mut Vec<u8>,
    entries: impl Iterator<Item = &'a (Cbor, Cbor)> + Clone,
) {
    let count = entries.clone().count();
    // Header for a map of `count` entries (count < 256 here).
    if count < 24 {
        out.push(0xa0 | count as u8);
    } else {
        out.push(0xb8);
        out.push(count as u8);
    }
    for (k, v) in entries {
        out.extend(k.encode());
        out.extend(v.encode());
    }
}

struct GrantSetup {
    owner: SigningKey,
    requester: SigningKey,
    stewards: Vec<SigningKey>,
    root: SignedGrant,
    shards: Vec<SignedGrant>,
}

fn grant_setup(steward: &SigningKey) -> anyhow::Result<GrantSetup> {
    let owner = key("mesh-node vectors: grant owner");
    let requester = key("mesh-node vectors: grant requester");
    let stewards = vec![
        steward.clone(),
        key("mesh-node vectors: steward b"),
        key("mesh-node vectors: steward c"),
    ];
    let root = Grant {
        issuer: did(&owner),
        subject: did(&requester),
        budget_uj: 30_000_000,
        caveats: vec![
            Caveat::Actions(vec!["infer".into()]),
            Caveat::MaxCostUj(8_000_000),
        ],
        parent: None,
        expiry_ms: EXPIRY_MS,
        nonce: [0; 16],
    }
    .sign(&owner)?;
    let shares: Vec<(String, u64)> = stewards.iter().map(|s| (did(s), 10_000_000)).collect();
    let shards = root.shard(&requester, &shares, EXPIRY_MS, [7; 16])?;
    Ok(GrantSetup {
        owner,
        requester,
        stewards,
        root,
        shards,
    })
}

fn grant_cases(setup: &GrantSetup) -> anyhow::Result<Value> {
    let request = request();
    let chain = vec![setup.root.clone(), setup.shards[0].clone()];
    let present = |chain: Vec<SignedGrant>, key: &SigningKey, nonce: u8| {
        Presentation::sign(chain, &request.request_id(), key, [nonce; 16]).map(|p| p.encode())
    };
    let good = present(chain.clone(), &setup.requester, 1)?;
    let steward_a = did(&setup.stewards[0]);
    let mut cases: Vec<Value> = Vec::new();
    let mut case = |name: &str,
                    derived: Option<&str>,
                    steward: &str,
                    now: u64,
                    prior: Vec<&[u8]>,
                    presentation: &[u8],
                    expect: &str| {
        cases.push(json!({
            "name": name, "derived_from": derived, "steward": steward, "now_ms": now,
            "prior_presentations_hex": prior.iter().map(|p| hex::encode(p)).collect::<Vec<_>>(),
            "presentation_hex": hex::encode(presentation), "expect": expect,
        }));
    };
    case(
        "authorised",
        None,
        &steward_a,
        NOW_MS,
        vec![],
        &good,
        "authorised",
    );
    case(
        "replayed",
        Some("authorised"),
        &steward_a,
        NOW_MS,
        vec![&good],
        &good,
        "presentation-replayed",
    );
    case(
        "at_another_steward",
        Some("authorised"),
        &did(&setup.stewards[1]),
        NOW_MS,
        vec![],
        &good,
        "wrong-holder",
    );
    case(
        "expired",
        Some("authorised"),
        &steward_a,
        EXPIRY_MS,
        vec![],
        &good,
        "expired",
    );
    case(
        "caller_not_issuer",
        Some("authorised"),
        &steward_a,
        NOW_MS,
        vec![],
        &present(chain.clone(), &setup.owner, 1)?,
        "caller-not-issuer",
    );
    case(
        "chain_reordered",
        Some("authorised"),
        &steward_a,
        NOW_MS,
        vec![],
        &present(
            vec![setup.shards[0].clone(), setup.root.clone()],
            &setup.owner,
            1,
        )?,
        "attenuation-violated",
    );
    case(
        "sibling_shard_spliced",
        Some("authorised"),
        &steward_a,
        NOW_MS,
        vec![],
        &present(
            vec![setup.root.clone(), setup.shards[1].clone()],
            &setup.requester,
            1,
        )?,
        "wrong-holder",
    );
    let mut signature_flipped = Presentation::decode(&good)?;
    signature_flipped.signature[0] ^= 0x01;
    case(
        "presentation_signature_bit_flipped",
        Some("authorised"),
        &steward_a,
        NOW_MS,
        vec![],
        &signature_flipped.encode(),
        "presentation-signature",
    );
    let mut grant_signature_flipped = Presentation::decode(&good)?;
    grant_signature_flipped.chain[1].signature[10] ^= 0x01;
    case(
        "grant_signature_bit_flipped",
        Some("authorised"),
        &steward_a,
        NOW_MS,
        vec![],
        &grant_signature_flipped.encode(),
        "bad-signature",
    );
    case(
        "truncated",
        Some("authorised"),
        &steward_a,
        NOW_MS,
        vec![],
        &good[..good.len() - 1],
        "malformed",
    );
    let mut trailing = good.clone();
    trailing.push(0);
    case(
        "trailing_byte",
        Some("authorised"),
        &steward_a,
        NOW_MS,
        vec![],
        &trailing,
        "malformed",
    );

    for case in &cases {
        let mut gate = GrantGate::new(case["steward"].as_str().unwrap_or_default());
        for prior in case["prior_presentations_hex"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let p = Presentation::decode(
                &hex::decode(prior.as_str().unwrap_or_default()).unwrap_or_default(),
            )?;
            gate.decide(&p, &request, None, NOW_MS)?;
        }
        let bytes =
            hex::decode(case["presentation_hex"].as_str().unwrap_or_default()).unwrap_or_default();
        let outcome = match Presentation::decode(&bytes) {
            Err(_) => "malformed".to_string(),
            Ok(p) => match gate.decide(
                &p,
                &request,
                None,
                case["now_ms"].as_u64().unwrap_or_default(),
            ) {
                Ok(_) => "authorised".to_string(),
                Err(refusal) => refusal.label().to_string(),
            },
        };
        ensure!(
            outcome == case["expect"],
            "grant case {}: decided {outcome}, constructed to be {}",
            case["name"],
            case["expect"]
        );
    }
    Ok(json!({
        "request_cbor_hex": hex::encode(&request.to_cbor().encode()),
        "root_hex": hex::encode(&setup.root.encode()),
        "root_id": hex::encode(&setup.root.id()),
        "shards": setup.shards.iter().map(|s| json!({ "id": hex::encode(&s.id()), "subject": s.grant.subject, "budget_uj": s.grant.budget_uj, "grant_hex": hex::encode(&s.encode()) })).collect::<Vec<_>>(),
        "cases": cases,
    }))
}

/// Generate every file under `vectors/mesh1/`.
pub fn generate() -> anyhow::Result<Vec<VectorFile>> {
    let steward = key(STEWARD_LABEL);
    let setup = grant_setup(&steward)?;
    let (first, second) = reference_receipts(&steward, setup.shards[0].id())?;
    second.check_follows(&first)?;
    let request = request();
    let open = opening(&opening_key(&steward.to_bytes()), &request.request_id());
    let meta = json!({
        "generator": "mesh-node vectors write (node/src/tools/vectors/mesh1.rs)",
        "description": "A deterministic reference mesh/1 serve. reference/signed_core.hex must encode identically across implementations; reference/envelope.hex must be reproducible from it with the steward seed below (Ed25519 signatures are deterministic). reference/next_envelope.hex follows it in the same receipt chain. See docs/mesh1.md.",
        "steward": { "seed_hex": hex::encode(&deterministic_32(STEWARD_LABEL)), "key_id": hex::encode(&steward.verifying_key().to_bytes()), "did": did(&steward) },
        "grant_keys": {
            "owner_seed_hex": hex::encode(&deterministic_32("mesh-node vectors: grant owner")),
            "requester_seed_hex": hex::encode(&deterministic_32("mesh-node vectors: grant requester")),
            "steward_b_seed_hex": hex::encode(&deterministic_32("mesh-node vectors: steward b")),
            "steward_c_seed_hex": hex::encode(&deterministic_32("mesh-node vectors: steward c")),
        },
        "request": {
            "prompt": "What is the capital of France?",
            "cbor_hex": hex::encode(&request.to_cbor().encode()),
            "request_id": hex::encode(&request.request_id()),
        },
        "output_commitment": {
            "prompt_token_ids": PROMPT_TOKENS, "output_token_ids": OUTPUT_TOKENS,
            "opening_hex": hex::encode(&open),
            "prompt_payload_hex": hex::encode(&prompt_payload(&PROMPT_TOKENS)),
            "commitment_hex": hex::encode(&output_commitment(&open, &request.request_id(), &prompt_payload(&PROMPT_TOKENS), &OUTPUT_TOKENS)),
        },
        "weights": {
            "files": weights_files().iter().map(|(p, d)| json!({ "path": p, "blake3": hex::encode(d) })).collect::<Vec<_>>(),
            "weights_digest": hex::encode(&weights_digest(&weights_files())),
        },
        "envelope_id": hex::encode(&first.envelope_id()),
        "next_envelope_id": hex::encode(&second.envelope_id()),
    });
    Ok(vec![
        ("mesh1/meta.json".into(), pretty(&meta)),
        (
            "mesh1/reference/signed_core.hex".into(),
            format!("{}\n", hex::encode(&first.core)),
        ),
        (
            "mesh1/reference/envelope.hex".into(),
            format!("{}\n", hex::encode(&first.envelope)),
        ),
        (
            "mesh1/reference/next_envelope.hex".into(),
            format!("{}\n", hex::encode(&second.envelope)),
        ),
        (
            "mesh1/receipts.json".into(),
            pretty(&receipt_cases(&steward, &first)?),
        ),
        ("mesh1/grants.json".into(), pretty(&grant_cases(&setup)?)),
        (
            "mesh1/replay.json".into(),
            pretty(&replay_cases(&steward, &first)?),
        ),
        (
            "mesh1/changes.json".into(),
            pretty(&change_cases(&steward, &first)?),
        ),
        ("mesh1/routes.json".into(), pretty(&route_cases()?)),
        (
            "mesh1/plain-bundles.json".into(),
            pretty(&crate::tools::vectors::plain_bundle::cases(
                &steward, &first, &second,
            )?),
        ),
    ])
}

/// Cheapest-sufficient routing (SPEC §4): route tables with the choice
/// each must give (written here by hand, and checked against the router),
/// and tables derived from the first by one change each, which a reader
/// must refuse.
fn route_cases() -> anyhow::Result<Value> {
    use mesh_protocol::route::{
        Backend, CostBasis, MAX_TABLE_INTEGER, NO_CEILING, Route, RouteRequest, route_within,
    };
    let backend = |name: &str, fidelity: Fidelity, uj_per_token: u64, per_option: u64| Backend {
        name: name.into(),
        recipe: format!("{name}.gguf"),
        fidelity,
        uj_per_token,
        uj_per_option_scored: per_option,
        cost_basis: CostBasis::Metered,
        weights: None,
    };
    let generation = |floor: Fidelity, ceiling: u64| RouteRequest {
        prompt_tokens: 20,
        max_tokens: 80,
        fidelity_floor: floor,
        joule_ceiling_uj: ceiling,
        options_scored: None,
    };
    // Registered cheapest first: the cheapest is below the floor, the next
    // over the ceiling, and of the two admissible ones the cheaper wins.
    let four = vec![
        backend("tiny-cache", Fidelity::F0, 5, 0),
        backend("frontier", Fidelity::F4, 900, 0),
        backend("mid-q4", Fidelity::F2, 40, 0),
        backend("mid-q8", Fidelity::F3, 70, 0),
    ];
    let mut estimated = four.clone();
    estimated[3].cost_basis = CostBasis::Estimator;
    estimated[2].uj_per_token = 80;
    let decision = RouteRequest {
        prompt_tokens: 130,
        max_tokens: 4096,
        fidelity_floor: Fidelity::F1,
        joule_ceiling_uj: 20_000,
        options_scored: Some(20),
    };
    let deciders = vec![
        backend("per-token-cheap", Fidelity::F1, 10, 900),
        backend("schema-cheap", Fidelity::F2, 60, 50),
        backend("too-coarse", Fidelity::F0, 1, 1),
        backend("no-option-cost", Fidelity::F3, 120, 0),
    ];
    // (name, request, the weights its grant permits, backends, chosen,
    // [(est_total_uj, admissible)] by hand)
    type Expected<'a> = (
        &'a str,
        RouteRequest,
        Option<[u8; 32]>,
        Vec<Backend>,
        Option<&'a str>,
        Vec<(u64, bool)>,
    );
    let expected: Vec<Expected<'_>> = vec![
        (
            "cheapest_below_floor_next_over_ceiling",
            generation(Fidelity::F2, 50_000),
            None,
            four.clone(),
            Some("mid-q4"),
            vec![(500, false), (90_000, false), (4_000, true), (7_000, true)],
        ),
        (
            "estimator_costs_are_weighed_and_named",
            generation(Fidelity::F2, 50_000),
            None,
            estimated,
            Some("mid-q8"),
            vec![(500, false), (90_000, false), (8_000, true), (7_000, true)],
        ),
        (
            "ties_go_to_the_first_registered",
            generation(Fidelity::F0, NO_CEILING),
            None,
            vec![
                backend("second-name-first", Fidelity::F1, 30, 0),
                backend("a-first-name-second", Fidelity::F1, 30, 0),
            ],
            Some("second-name-first"),
            vec![(3_000, true), (3_000, true)],
        ),
        (
            "none_admissible_is_a_refusal",
            generation(Fidelity::F4, 60_000),
            None,
            four.clone(),
            None,
            vec![
                (500, false),
                (90_000, false),
                (4_000, false),
                (7_000, false),
            ],
        ),
        (
            // 130 prompt tokens and 20 options; max_tokens is never priced.
            "decision_priced_per_option_scored",
            decision,
            None,
            deciders.clone(),
            Some("schema-cheap"),
            vec![(19_300, true), (8_800, true), (150, false), (15_600, true)],
        ),
        (
            "the_same_figures_as_a_generation_price_max_tokens",
            RouteRequest {
                options_scored: None,
                ..decision
            },
            None,
            deciders,
            None,
            vec![
                (42_260, false),
                (253_560, false),
                (4_226, false),
                (507_120, false),
            ],
        ),
        (
            // No ceiling is no member of the table (RFC 8785 writes
            // numbers as doubles; u64::MAX has no exact double).
            "no_ceiling_is_no_member",
            generation(Fidelity::F2, NO_CEILING),
            None,
            four.clone(),
            Some("mid-q4"),
            vec![(500, false), (90_000, true), (4_000, true), (7_000, true)],
        ),
        (
            // A ceiling past 2^53 - 1 can never be exceeded (estimates
            // saturate there): the same route as none, hashed alike.
            "ceiling_above_2_53_is_no_ceiling",
            generation(Fidelity::F2, (1 << 60) + 1),
            None,
            four.clone(),
            Some("mid-q4"),
            vec![(500, false), (90_000, true), (4_000, true), (7_000, true)],
        ),
        (
            // A grant's ModelIn (every caveat of its chains at once): the
            // cheapest backend serves other weights, one names none; both
            // are left out with the rule named, and the table binds it.
            "grant_model_in_leaves_out_other_weights",
            generation(Fidelity::F2, 50_000),
            Some([0x11; 32]),
            {
                let mut weighed = four.clone();
                weighed[0].fidelity = Fidelity::F2;
                weighed[0].weights = Some([0x22; 32]);
                weighed[2].weights = Some([0x11; 32]);
                weighed[3].weights = Some([0x11; 32]);
                weighed
            },
            Some("mid-q4"),
            vec![(500, false), (90_000, false), (4_000, true), (7_000, true)],
        ),
    ];
    let mut routes = Vec::new();
    let mut first_table = None;
    let mut digests = std::collections::BTreeMap::new();
    for (name, request, model_in, backends, chosen, figures) in expected {
        let routed = route_within(
            &request,
            model_in.as_ref().map(std::slice::from_ref),
            &backends,
        )?;
        let got: Vec<(u64, bool)> = routed
            .candidates
            .iter()
            .map(|c| (c.est_total_uj, c.admissible()))
            .collect();
        ensure!(
            got == figures,
            "{name}: candidates {got:?}, expected {figures:?}"
        );
        ensure!(
            routed.chosen().map(|c| c.backend.as_str()) == chosen,
            "{name}: chose {:?}, expected {chosen:?}",
            routed.chosen().map(|c| &c.backend)
        );
        ensure!(
            routed.refusal().is_some() == chosen.is_none(),
            "{name}: a refusal exactly when nothing is chosen"
        );
        let table = routed.to_json();
        ensure!(
            Route::from_json(&table)? == routed,
            "{name}: the table reads back"
        );
        ensure!(
            table["request"].get("joule_ceiling_uj").is_none()
                == (request.joule_ceiling_uj >= MAX_TABLE_INTEGER),
            "{name}: the table names a ceiling exactly when one can bind"
        );
        digests.insert(name, routed.inputs_digest());
        first_table.get_or_insert_with(|| table.clone());
        routes.push(json!({ "name": name, "chosen": chosen, "table": table }));
    }
    // The ModelIn case's table is bound to its restriction: without it the
    // table recomputes to another route.
    let restricted = routes
        .iter()
        .find(|r| r["name"] == "grant_model_in_leaves_out_other_weights")
        .context("the ModelIn case")?;
    ensure!(
        restricted["table"]["candidates"][0]["reason"] == "weights not in the grant's ModelIn",
        "the ModelIn case names the rule"
    );
    let mut unrestricted = restricted["table"].clone();
    if let Some(request) = unrestricted["request"].as_object_mut() {
        request.remove("model_in");
    }
    ensure!(
        Route::from_json(&unrestricted).is_err(),
        "the ModelIn restriction is bound to the table"
    );
    ensure!(
        digests.get("no_ceiling_is_no_member") == digests.get("ceiling_above_2_53_is_no_ceiling"),
        "a ceiling no estimate can pass hashes as none"
    );
    let table = first_table.context("no route case")?;
    let derive = |name: &str, refused_as: &str, change: &dyn Fn(&mut Value)| {
        let mut changed = table.clone();
        change(&mut changed);
        json!({ "name": name, "refused_as": refused_as, "table": changed })
    };
    let refusals = vec![
        derive("estimate_altered", "candidates", &|t| {
            t["candidates"][2]["est_total_uj"] = json!(3_999)
        }),
        derive("another_chosen", "chosen", &|t| {
            t["chosen"] = json!("mid-q8")
        }),
        derive("admissibility_flipped", "candidates", &|t| {
            t["candidates"][0]["admissible"] = json!(true)
        }),
        derive("candidates_reordered", "candidates", &|t| {
            if let Some(list) = t["candidates"].as_array_mut() {
                list.swap(2, 3);
            }
        }),
        derive("backend_dropped", "candidates", &|t| {
            if let Some(list) = t["backends"].as_array_mut() {
                list.remove(1);
            }
        }),
        derive("input_cost_altered", "justification", &|t| {
            t["backends"][0]["uj_per_token"] = json!(6);
            t["candidates"][0]["est_total_uj"] = json!(600);
            t["candidates"][0]["reason"] = json!("below floor (F0 < F2)");
        }),
        derive("floor_altered", "candidates", &|t| {
            t["request"]["fidelity_floor"] = json!(0)
        }),
        derive("unknown_member", "shape", &|t| {
            t["note"] = json!("cheapest")
        }),
        derive("truncated_candidates", "candidates", &|t| {
            if let Some(list) = t["candidates"].as_array_mut() {
                list.pop();
            }
        }),
        derive("ceiling_past_exact_json", "shape", &|t| {
            t["request"]["joule_ceiling_uj"] = json!(u64::MAX)
        }),
        derive("cost_past_exact_json", "route", &|t| {
            t["backends"][1]["uj_per_token"] = json!(MAX_TABLE_INTEGER + 1)
        }),
    ];
    for refusal in &refusals {
        let error = Route::from_json(&refusal["table"]);
        let kind = match &error {
            Ok(_) => "accepted",
            Err(mesh_protocol::route::TableError::Derived(member)) => member,
            Err(mesh_protocol::route::TableError::Shape(_)) => "shape",
            Err(mesh_protocol::route::TableError::Route(_)) => "route",
            Err(_) => "other",
        };
        ensure!(
            refusal["refused_as"] == kind,
            "{}: read as {kind}, expected {}",
            refusal["name"],
            refusal["refused_as"]
        );
    }
    Ok(json!({
        "description": "mesh/1 cheapest-sufficient routing (SPEC §4): each table's candidates, choice and justification recompute from its request and backends; each refusal is the first table changed once, refused as the named member",
        "routes": routes,
        "refusals": refusals,
    }))
}

/// The weights change record (SPEC §6.5): a valid record (a plan, the first
/// weights, a change under the plan), one case per refusal rule (the record
/// and one more entry, which must be refused with the named kind), and the
/// coverage of receipts at positions on either side of the change.
fn change_cases(steward: &SigningKey, first: &SealedReceipt) -> anyhow::Result<Value> {
    use mesh_protocol::change::{
        ChangeEntry, ChangeKind, ChangeRecord, Coverage, Plan, SealedChange, WeightsChange,
    };
    let backend = first.receipt.backend.clone();
    let recipe = first.receipt.recipe.clone();
    let precision = first
        .receipt
        .weights
        .as_ref()
        .map(|w| w.precision.clone())
        .context("the reference receipt names its weights")?;
    let old_weights = *blake3::hash(b"mesh-node vectors: weights before").as_bytes();
    let new_weights = weights_digest(&weights_files());
    let steward_key = steward.verifying_key().to_bytes();
    let mut record = ChangeRecord::new(&backend, steward_key);
    let entry = |seq: u64, prev, made_at, kind| ChangeEntry {
        backend: backend.clone(),
        recipe: recipe.clone(),
        seq,
        prev,
        made_at,
        kind,
    };
    let plan = entry(
        0,
        None,
        1_790_000_000,
        ChangeKind::Plan(Plan {
            precisions: vec![precision.clone()],
            fidelity_floor: Fidelity::F1,
            validation: "greedy agreement on the 64 reference prompts".into(),
            foresees: "a requantized build of the same model".into(),
            risk_assessment: Some("low: same architecture and tokenizer".into()),
        }),
    )
    .seal(steward)?;
    let plan_id = plan.id();
    record.append(plan)?;
    let (seq, prev) = record.next_position();
    record.append(
        entry(
            seq,
            prev,
            1_790_000_100,
            ChangeKind::Weights(WeightsChange {
                from: None,
                to: old_weights,
                precision: Some(precision.clone()),
                fidelity: Fidelity::F2,
                plan: None,
                validation_result: None,
                // Receipts 0 and 1 were sealed before the record existed.
                effective_from: 2,
                reason: "first weights".into(),
            }),
        )
        .seal(steward)?,
    )?;
    let (seq, prev) = record.next_position();
    let change = WeightsChange {
        from: Some(old_weights),
        to: new_weights,
        precision: Some(precision.clone()),
        fidelity: Fidelity::F2,
        plan: Some(plan_id),
        validation_result: Some("64 of 64 agree".into()),
        effective_from: 5,
        reason: "requantized".into(),
    };
    let base = record.clone();
    record.append(
        entry(
            seq,
            prev,
            1_790_000_200,
            ChangeKind::Weights(change.clone()),
        )
        .seal(steward)?,
    )?;
    let envelopes = |r: &ChangeRecord| -> Vec<String> {
        r.entries()
            .iter()
            .map(|e| hex::encode(&e.envelope))
            .collect()
    };
    // One edit at a time to the change under the plan, appended to `base`.
    type Edit<'a> = Box<dyn Fn(&mut ChangeEntry) + 'a>;
    let weights_edit = |edit: fn(&mut WeightsChange)| -> Edit<'_> {
        Box::new(move |e: &mut ChangeEntry| {
            if let ChangeKind::Weights(w) = &mut e.kind {
                edit(w);
            }
        })
    };
    let another = SigningKey::from_bytes(&deterministic_32("mesh-node vectors: another steward"));
    // (name, edit, sealing key, the refusal it must get)
    let refusals: Vec<(&str, Edit<'_>, &SigningKey, &str)> = vec![
        (
            "another_backend",
            Box::new(|e| e.backend = "mesh-node/stage".into()),
            steward,
            "other_backend",
        ),
        (
            "seq_not_next",
            Box::new(|e| e.seq += 1),
            steward,
            "seq_not_next",
        ),
        (
            "prev_not_the_envelope_before",
            Box::new(|e| e.prev = Some([0; 32])),
            steward,
            "prev_mismatch",
        ),
        (
            "made_at_earlier_than_before",
            Box::new(|e| e.made_at = 1_790_000_000),
            steward,
            "made_at_earlier",
        ),
        (
            "from_not_the_last_to",
            weights_edit(|w| w.from = Some([9; 32])),
            steward,
            "from_mismatch",
        ),
        (
            "from_absent_after_a_first_change",
            weights_edit(|w| w.from = None),
            steward,
            "from_mismatch",
        ),
        (
            "to_equals_from",
            weights_edit(|w| w.to = *blake3::hash(b"mesh-node vectors: weights before").as_bytes()),
            steward,
            "to_equals_from",
        ),
        (
            "effective_from_earlier_than_the_last",
            weights_edit(|w| w.effective_from = 1),
            steward,
            "effective_from_earlier",
        ),
        (
            "plan_names_no_plan_entry",
            weights_edit(|w| w.plan = Some([7; 32])),
            steward,
            "unknown_plan",
        ),
        (
            "outside_plan_another_recipe",
            Box::new(|e| e.recipe = "another-model".into()),
            steward,
            "outside_plan_recipe",
        ),
        (
            "outside_plan_precision_not_listed",
            weights_edit(|w| w.precision = Some("bf16".into())),
            steward,
            "outside_plan_precision",
        ),
        (
            "outside_plan_no_precision",
            weights_edit(|w| w.precision = None),
            steward,
            "outside_plan_no_precision",
        ),
        (
            "outside_plan_fidelity_below_floor",
            weights_edit(|w| w.fidelity = Fidelity::F0),
            steward,
            "outside_plan_fidelity",
        ),
        (
            "outside_plan_no_validation_result",
            weights_edit(|w| w.validation_result = None),
            steward,
            "outside_plan_no_validation_result",
        ),
        (
            "sealed_by_another_key",
            Box::new(|_| {}),
            &another,
            "other_steward",
        ),
    ];
    let mut cases = Vec::new();
    for (name, edit, key, expected) in refusals {
        let mut bad = entry(
            seq,
            prev,
            1_790_000_200,
            ChangeKind::Weights(change.clone()),
        );
        edit(&mut bad);
        let sealed = bad.seal(key)?;
        let refused = base
            .clone()
            .append(sealed.clone())
            .err()
            .with_context(|| format!("{name} was not refused"))?;
        ensure!(
            refused.kind() == expected,
            "{name}: refused as {}, expected {expected}",
            refused.kind()
        );
        cases.push(json!({ "name": name, "entry_hex": hex::encode(&sealed.envelope), "refused": expected }));
    }
    // A change no plan foresaw is recorded too, without a `plan`.
    let unplanned = entry(
        seq,
        prev,
        1_790_000_200,
        ChangeKind::Weights(WeightsChange {
            plan: None,
            precision: None,
            validation_result: None,
            ..change.clone()
        }),
    )
    .seal(steward)?;
    ensure!(
        base.clone().append(unplanned.clone()).is_ok(),
        "an unplanned change is recorded"
    );
    cases.push(json!({ "name": "unplanned_change_recorded", "entry_hex": hex::encode(&unplanned.envelope), "refused": null }));
    // Coverage of the reference receipt at positions around the change.
    // (receipt sequence, its weights, its precision, the entry that must
    // cover it): before any weights were in effect, on either side of the
    // change, and with the precision the change names changed.
    let coverage = [
        (1u64, old_weights, precision.as_str(), None),
        (4, old_weights, precision.as_str(), Some(1u64)),
        (4, new_weights, precision.as_str(), None),
        (5, new_weights, precision.as_str(), Some(2)),
        (5, old_weights, precision.as_str(), None),
        (5, new_weights, "bf16", None),
    ]
    .into_iter()
    .map(|(sequence, weights, named, expected)| {
        let mut receipt = first.receipt.clone();
        receipt.sequence = sequence;
        receipt.weights = Some(WeightsBinding {
            weights_digest: weights,
            precision: named.to_string(),
        });
        let covered = match record.covers(&receipt) {
            Coverage::Covered(entry) => Some(entry.entry.seq),
            Coverage::NotCovered(_) => None,
        };
        ensure!(
            covered == expected,
            "receipt {sequence}: covered by {covered:?}, expected {expected:?}"
        );
        Ok(json!({
            "receipt_sequence": sequence,
            "receipt_weights_digest": hex::encode(&weights),
            "receipt_precision": named,
            "covered_by_entry": expected,
        }))
    })
    .collect::<anyhow::Result<Vec<Value>>>()?;
    // The first weights entry of a record carries no `from`.
    let plan_only = ChangeRecord::from_envelopes(
        &backend,
        steward_key,
        record.entries()[..1].iter().map(|e| e.envelope.as_slice()),
    )
    .map_err(|(k, e)| anyhow::anyhow!("entry {k}: {e}"))?;
    let first_with_from = entry(
        1,
        Some(plan_id),
        1_790_000_100,
        ChangeKind::Weights(WeightsChange {
            from: Some(old_weights),
            to: new_weights,
            precision: Some(precision.clone()),
            fidelity: Fidelity::F2,
            plan: None,
            validation_result: None,
            effective_from: 2,
            reason: "first weights".into(),
        }),
    )
    .seal(steward)?;
    ensure!(
        plan_only
            .clone()
            .append(first_with_from.clone())
            .err()
            .map(|e| e.kind())
            == Some("from_mismatch"),
        "a first weights entry with `from` is refused"
    );
    let _ = SealedChange::verify(&record.entries()[0].envelope)?;
    Ok(json!({
        "generator": "mesh-node vectors write (node/src/tools/vectors/mesh1.rs)",
        "description": "The weights change record (SPEC §6.5, docs/mesh1.md): `record` is a valid record (a plan, the backend's first weights effective from receipt 2, a change under the plan effective from receipt 5) sealed by the mesh1 steward; each case appends one entry to the record's first two entries and gives the refusal kind it must get (null: recorded); `first_weights_entry_with_from` appends to the record's first entry (the plan) alone; `coverage` gives, for the reference receipt at a sequence with a weights digest and precision, the seq of the entry that covers it (null: not covered).",
        "backend": backend,
        "steward_did": did(steward),
        "record": envelopes(&record),
        "cases": cases,
        "first_weights_entry_with_from": {
            "record_prefix": 1,
            "entry_hex": hex::encode(&first_with_from.envelope),
            "refused": "from_mismatch",
        },
        "coverage": coverage,
    }))
}

/// Replay (SPEC §6.4): a serve declared deterministic, re-runs and
/// disclosed outputs, and the verdict each must give (written here by hand
/// and checked against `judge`, so a regression in either fails the write);
/// then the same with one thing changed at a time, each refusal named.
fn replay_cases(steward: &SigningKey, first: &SealedReceipt) -> anyhow::Result<Value> {
    use mesh_protocol::replay::{Replayer, Verdict, judge};
    let declared = MeshReceipt {
        deterministic: Some(true),
        ..first.receipt.clone()
    };
    let request_id = declared.request_id;
    let open = opening(&opening_key(&steward.to_bytes()), &request_id);
    let weights = weights_digest(&weights_files());
    let recipe = declared.recipe.clone();
    let mut parted = OUTPUT_TOKENS.to_vec();
    parted[2] ^= 1;
    let mut other_prompt = PROMPT_TOKENS.to_vec();
    other_prompt[0] ^= 1;
    let shorter_prompt = &PROMPT_TOKENS[..PROMPT_TOKENS.len() - 1];
    let sealed =
        |receipt: MeshReceipt| -> anyhow::Result<SealedReceipt> { Ok(receipt.seal(steward)?) };
    let deterministic = sealed(declared.clone())?;
    let other_backend = sealed(MeshReceipt {
        backend: "mesh-node/stage".into(),
        ..declared.clone()
    })?;
    let no_commitment = sealed(MeshReceipt {
        output_commitment: None,
        ..declared.clone()
    })?;
    let declared_not = sealed(MeshReceipt {
        deterministic: Some(false),
        ..declared.clone()
    })?;
    struct Case<'a> {
        name: &'a str,
        receipt: &'a SealedReceipt,
        weights: [u8; 32],
        recipe: &'a str,
        opening: Option<[u8; 32]>,
        prompt: &'a [u32],
        rerun: &'a [u32],
        disclosed: Option<&'a [u32]>,
        /// The verdict, the token it parts at, the refusal's kind.
        expected: (&'a str, Option<usize>, Option<&'a str>),
    }
    let case = |name, receipt, prompt, rerun, disclosed, expected| Case {
        name,
        receipt,
        weights,
        recipe: &recipe,
        opening: Some(open),
        prompt,
        rerun,
        disclosed,
        expected,
    };
    let not = |kind| ("not_replayable", None, Some(kind));
    let cases = vec![
        case(
            "verified",
            &deterministic,
            &PROMPT_TOKENS,
            &OUTPUT_TOKENS,
            None,
            ("verified", None, None),
        ),
        case(
            "verified_with_the_output_disclosed",
            &deterministic,
            &PROMPT_TOKENS,
            &OUTPUT_TOKENS,
            Some(&OUTPUT_TOKENS),
            ("verified", None, None),
        ),
        case(
            "diverged_at_token_2",
            &deterministic,
            &PROMPT_TOKENS,
            &parted,
            Some(&OUTPUT_TOKENS),
            ("diverged", Some(2), None),
        ),
        case(
            "rerun_differs_and_nothing_disclosed",
            &deterministic,
            &PROMPT_TOKENS,
            &parted,
            None,
            not("unattributable"),
        ),
        case(
            "rerun_differs_and_the_disclosed_output_opens_nothing",
            &deterministic,
            &PROMPT_TOKENS,
            &parted,
            Some(&parted),
            not("unattributable"),
        ),
        case(
            "another_prompt_payload",
            &deterministic,
            &other_prompt,
            &parted,
            Some(&OUTPUT_TOKENS),
            not("unattributable"),
        ),
        case(
            "another_request_by_its_length",
            &deterministic,
            shorter_prompt,
            &parted,
            Some(&OUTPUT_TOKENS),
            not("other_request"),
        ),
        Case {
            opening: Some(opening(&opening_key(&steward.to_bytes()), &[0; 32])),
            ..case(
                "another_receipts_opening",
                &deterministic,
                &PROMPT_TOKENS,
                &OUTPUT_TOKENS,
                Some(&OUTPUT_TOKENS),
                not("unattributable"),
            )
        },
        Case {
            opening: None,
            ..case(
                "no_opening",
                &deterministic,
                &PROMPT_TOKENS,
                &OUTPUT_TOKENS,
                None,
                not("no_opening"),
            )
        },
        Case {
            weights: [0; 32],
            ..case(
                "other_weights",
                &deterministic,
                &PROMPT_TOKENS,
                &OUTPUT_TOKENS,
                None,
                not("other_weights"),
            )
        },
        Case {
            recipe: "another-model",
            ..case(
                "other_recipe",
                &deterministic,
                &PROMPT_TOKENS,
                &OUTPUT_TOKENS,
                None,
                not("other_recipe"),
            )
        },
        case(
            "not_declared_deterministic",
            first,
            &PROMPT_TOKENS,
            &OUTPUT_TOKENS,
            None,
            not("not_deterministic"),
        ),
        case(
            "declared_not_deterministic",
            &declared_not,
            &PROMPT_TOKENS,
            &OUTPUT_TOKENS,
            None,
            not("not_deterministic"),
        ),
        case(
            "other_backend",
            &other_backend,
            &PROMPT_TOKENS,
            &OUTPUT_TOKENS,
            None,
            not("other_backend"),
        ),
        case(
            "no_commitment",
            &no_commitment,
            &PROMPT_TOKENS,
            &OUTPUT_TOKENS,
            None,
            not("no_commitment"),
        ),
    ];
    let mut out = Vec::new();
    for c in cases {
        let verdict = judge(
            &c.receipt.receipt,
            &Replayer {
                weights: c.weights,
                recipe: c.recipe,
                prompt_tokens: c.prompt.len() as u64,
                request_id: None,
            },
            c.opening.as_ref(),
            &prompt_payload(c.prompt),
            c.rerun,
            c.disclosed,
        );
        let got = match &verdict {
            Verdict::Verified => ("verified", None, None),
            Verdict::Diverged { at } => ("diverged", Some(*at), None),
            Verdict::NotReplayable(r) => ("not_replayable", None, Some(r.kind())),
        };
        ensure!(
            got == c.expected,
            "{}: judged {got:?}, expected {:?}",
            c.name,
            c.expected
        );
        out.push(json!({
            "name": c.name,
            "envelope_hex": hex::encode(&c.receipt.envelope),
            "weights_digest_hex": hex::encode(&c.weights),
            "recipe": c.recipe,
            "opening_hex": c.opening.map(|o| hex::encode(&o)),
            "prompt_token_ids": c.prompt,
            "rerun_token_ids": c.rerun,
            "disclosed_token_ids": c.disclosed,
            "verdict": c.expected.0,
            "diverged_at": c.expected.1,
            "reason": c.expected.2,
        }));
    }
    Ok(json!({
        "generator": "mesh-node vectors write (node/src/tools/vectors/mesh1.rs)",
        "description": "Replay verdicts (SPEC §6.4, docs/mesh1.md): each case is a mesh/1 envelope, the weights digest, recipe and opening the replay holds, the prompt token ids it ran, its re-run's tokens and the disclosed output (if any), and the verdict: verified, diverged (with the first token where the re-run parts from the disclosed output) or not_replayable (with the reason's kind). Diverged only where the disclosed output opens the commitment on the replay's payload.",
        "cases": out,
    }))
}
