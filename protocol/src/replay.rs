//! Replay (SPEC §6.4): re-executing a serve against its receipt's output
//! commitment, and the verdict. Sans-IO: the caller runs the engine and
//! passes what it produced.
//!
//! A serve is replayable only where its engine declared itself
//! deterministic (§5): the receipt's `deterministic` member, under the
//! steward's signature. This project's coordinator sets it to 1 for a
//! serve whose tokens are a function of the request and the prompt payload
//! alone (greedy decoding, the f32 wire, the prompt in one prefill step,
//! never resumed), and to 0 otherwise.
//!
//! The verdict never blames the serve for what may be the replayer's own
//! input: it is *diverged* only when a disclosed output opens the
//! commitment on the payload the replay ran.

use crate::mesh1::{ContentId, MeshReceipt, output_commitment};

/// The backend of this project's split serves.
pub const SPLIT_BACKEND: &str = "mesh-node/split";
/// The backend of this project's serves one node ran whole (every layer,
/// no split): the same engine, so replayed alike.
pub const LOCAL_BACKEND: &str = "mesh-node/local";
/// The backends whose serves this replay knows how to re-execute.
pub const REPLAYED_BACKENDS: [&str; 2] = [SPLIT_BACKEND, LOCAL_BACKEND];

/// Why a serve cannot be replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotReplayable {
    /// The receipt commits to no output.
    NoCommitment,
    /// The engine did not declare the serve deterministic.
    NotDeterministic,
    /// Another backend served it.
    OtherBackend(String),
    /// The replay's weights are not the ones the receipt sealed.
    OtherWeights,
    /// The replay's model is not the recipe the receipt names.
    OtherRecipe(String),
    /// The prompt payload is not the request's: another number of tokens
    /// than the receipt's `tokens_in`.
    OtherRequest { receipt: u64, replay: u64 },
    /// The prompt, with the request's figures (the bundle's route table),
    /// gives another request id than the receipt's.
    NotThisRequest {
        receipt: ContentId,
        replay: ContentId,
    },
    /// The receipt's token counts do not fit the replay's model.
    DoesNotFit,
    /// No opening was given: only the steward can disclose it.
    NoOpening,
    /// The re-run does not open the commitment, and no disclosed output
    /// opens it on the replay's payload and opening: the mismatch may be
    /// the replayer's own input (another prompt, another opening).
    Unattributable,
}

impl NotReplayable {
    /// A stable name, for vectors and `--json`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NoCommitment => "no_commitment",
            Self::NotDeterministic => "not_deterministic",
            Self::OtherBackend(_) => "other_backend",
            Self::OtherWeights => "other_weights",
            Self::OtherRecipe(_) => "other_recipe",
            Self::OtherRequest { .. } | Self::NotThisRequest { .. } => "other_request",
            Self::DoesNotFit => "does_not_fit",
            Self::NoOpening => "no_opening",
            Self::Unattributable => "unattributable",
        }
    }

    pub fn reason(&self) -> String {
        match self {
            Self::NoCommitment => "the receipt commits to no output".into(),
            Self::NotDeterministic => {
                "the serve was not declared deterministic (it sampled, used a rounding wire, ran its prompt in several steps, or was resumed)".into()
            }
            Self::OtherBackend(backend) => {
                format!("backend {backend:?} is not one this replay re-executes ({})", REPLAYED_BACKENDS.join(", "))
            }
            Self::OtherWeights => "the model given is not the weights the receipt sealed".into(),
            Self::OtherRecipe(recipe) => {
                format!("the model given is not the recipe the receipt names ({recipe:?})")
            }
            Self::OtherRequest { receipt, replay } => format!(
                "the prompt is not the receipt's request: {replay} tokens, the receipt read {receipt}"
            ),
            Self::NotThisRequest { receipt, replay } => format!(
                "the prompt is not the receipt's request: with the request's figures it is request {}, the receipt's is {}",
                crate::hex::encode(replay),
                crate::hex::encode(receipt)
            ),
            Self::DoesNotFit => "the receipt's token counts do not fit the model's context".into(),
            Self::NoOpening => {
                "no opening: its steward discloses it (`mesh-node steward open`)".into()
            }
            Self::Unattributable => "the re-run does not open the commitment, and no disclosed output opens it on this payload and opening: the difference may be the replay's own input".into(),
        }
    }
}

/// What a replay concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The re-run's tokens open the commitment.
    Verified,
    /// A disclosed output opens the commitment on the replay's payload, and
    /// the re-run parts from it at this token.
    Diverged {
        at: usize,
    },
    NotReplayable(NotReplayable),
}

/// What the replay would run: its model's weights and recipe, and the
/// prompt payload's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayer<'a> {
    pub weights: [u8; 32],
    pub recipe: &'a str,
    pub prompt_tokens: u64,
    /// The request id the replay's prompt gives with the request's figures
    /// ([`request_id_of`]); `None` when they did not come with the receipt
    /// (a bare envelope), and then only the token count tells another
    /// request apart.
    pub request_id: Option<ContentId>,
}

/// The request id of `prompt` asked with the figures a receipt's route
/// table holds (it is bound to the receipt's signed `route` line:
/// `route::check_table`): what the coordinator hashed, when the prompt is
/// the one it was sent. A ceiling the table leaves out was none (or one no
/// estimate could reach, which then reads as another request).
pub fn request_id_of(prompt: &[u8], figures: &crate::route::RouteRequest) -> ContentId {
    crate::mesh1::ServeRequest {
        prompt_hash: crate::mesh1::prompt_hash(prompt),
        prompt_tokens: figures.prompt_tokens,
        max_tokens: figures.max_tokens,
        fidelity_floor: figures.fidelity_floor,
        joule_ceiling_uj: figures.joule_ceiling_uj,
        decision: None,
    }
    .request_id()
}

/// Whether the serve can be re-executed at all, before any engine runs.
pub fn check_replayable(
    receipt: &MeshReceipt,
    replayer: &Replayer<'_>,
    opening: Option<&[u8; 32]>,
) -> Result<(), NotReplayable> {
    if receipt.output_commitment.is_none() {
        return Err(NotReplayable::NoCommitment);
    }
    if !REPLAYED_BACKENDS.contains(&receipt.backend.as_str()) {
        return Err(NotReplayable::OtherBackend(receipt.backend.clone()));
    }
    if receipt.deterministic != Some(true) {
        return Err(NotReplayable::NotDeterministic);
    }
    if receipt
        .weights
        .as_ref()
        .is_none_or(|w| w.weights_digest != replayer.weights)
    {
        return Err(NotReplayable::OtherWeights);
    }
    if receipt.recipe != replayer.recipe {
        return Err(NotReplayable::OtherRecipe(receipt.recipe.clone()));
    }
    if let Some(replay) = replayer.request_id
        && replay != receipt.request_id
    {
        return Err(NotReplayable::NotThisRequest {
            receipt: receipt.request_id,
            replay,
        });
    }
    if receipt.tokens_in != replayer.prompt_tokens {
        return Err(NotReplayable::OtherRequest {
            receipt: receipt.tokens_in,
            replay: replayer.prompt_tokens,
        });
    }
    if opening.is_none() {
        return Err(NotReplayable::NoOpening);
    }
    Ok(())
}

/// The verdict on a re-run: `payload` is the digest of the prompt payload
/// it ran (`mesh1::prompt_payload`), `rerun` its tokens, `disclosed` the
/// output the steward or requester disclosed, if any.
pub fn judge(
    receipt: &MeshReceipt,
    replayer: &Replayer<'_>,
    opening: Option<&[u8; 32]>,
    payload: &ContentId,
    rerun: &[u32],
    disclosed: Option<&[u32]>,
) -> Verdict {
    if let Err(reason) = check_replayable(receipt, replayer, opening) {
        return Verdict::NotReplayable(reason);
    }
    let (Some(committed), Some(opening)) = (receipt.output_commitment, opening) else {
        return Verdict::NotReplayable(NotReplayable::NoCommitment);
    };
    let opens = |tokens: &[u32]| {
        output_commitment(opening, &receipt.request_id, payload, tokens) == committed
    };
    if opens(rerun) {
        return Verdict::Verified;
    }
    match disclosed {
        Some(output) if opens(output) => Verdict::Diverged {
            at: rerun
                .iter()
                .zip(output)
                .position(|(a, b)| a != b)
                .unwrap_or(rerun.len().min(output.len())),
        },
        _ => Verdict::NotReplayable(NotReplayable::Unattributable),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh1::{WeightsBinding, opening as opening_of, opening_key, prompt_payload};

    const WEIGHTS: [u8; 32] = [9; 32];
    const PROMPT: [u32; 3] = [1, 2, 3];
    const SERVED: [u32; 4] = [5, 6, 7, 8];

    fn receipt() -> (MeshReceipt, [u8; 32]) {
        let mut receipt = MeshReceipt::blank(
            [4; 32],
            SPLIT_BACKEND,
            "model.gguf",
            "static split",
            crate::mesh1::Energy::estimator(1),
            [0; 16],
        );
        receipt.deterministic = Some(true);
        receipt.tokens_in = PROMPT.len() as u64;
        receipt.weights = Some(WeightsBinding {
            weights_digest: WEIGHTS,
            precision: "q8_0/f32".into(),
        });
        let opening = opening_of(&opening_key(&[1; 32]), &receipt.request_id);
        receipt.output_commitment = Some(output_commitment(
            &opening,
            &receipt.request_id,
            &prompt_payload(&PROMPT),
            &SERVED,
        ));
        (receipt, opening)
    }

    /// The repository's replay vectors (`vectors/mesh1/replay.json`,
    /// written by `mesh-node vectors write`) give their verdicts.
    #[test]
    fn the_replay_vectors_give_their_verdicts() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../vectors/mesh1/replay.json");
        let document: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let hex32 =
            |v: &serde_json::Value| crate::hex::decode_array::<32>(v.as_str().unwrap()).unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        };
        let cases = document["cases"].as_array().unwrap();
        assert!(cases.len() >= 9);
        for case in cases {
            let envelope = crate::hex::decode(case["envelope_hex"].as_str().unwrap()).unwrap();
            let sealed = crate::mesh1::SealedReceipt::verify(&envelope).unwrap();
            let opening = (!case["opening_hex"].is_null()).then(|| hex32(&case["opening_hex"]));
            let disclosed =
                (!case["disclosed_token_ids"].is_null()).then(|| ids(&case["disclosed_token_ids"]));
            let prompt = ids(&case["prompt_token_ids"]);
            let verdict = judge(
                &sealed.receipt,
                &Replayer {
                    weights: hex32(&case["weights_digest_hex"]),
                    recipe: case["recipe"].as_str().unwrap(),
                    prompt_tokens: prompt.len() as u64,
                    request_id: None,
                },
                opening.as_ref(),
                &prompt_payload(&prompt),
                &ids(&case["rerun_token_ids"]),
                disclosed.as_deref(),
            );
            let (name, at, kind) = match &verdict {
                Verdict::Verified => ("verified", None, None),
                Verdict::Diverged { at } => ("diverged", Some(*at as u64), None),
                Verdict::NotReplayable(r) => ("not_replayable", None, Some(r.kind())),
            };
            assert_eq!(name, case["verdict"], "{}", case["name"]);
            assert_eq!(at, case["diverged_at"].as_u64(), "{}", case["name"]);
            assert_eq!(kind, case["reason"].as_str(), "{}", case["name"]);
        }
    }

    #[test]
    fn each_verdict_and_only_where_it_can_be_attributed() {
        let (receipt, opening) = receipt();
        let replayer = |prompt: &[u32]| Replayer {
            weights: WEIGHTS,
            recipe: "model.gguf",
            prompt_tokens: prompt.len() as u64,
            request_id: None,
        };
        let judged =
            |r: &MeshReceipt, o: Option<&[u8; 32]>, p: &[u32], run: &[u32], d: Option<&[u32]>| {
                judge(r, &replayer(p), o, &prompt_payload(p), run, d)
            };
        let payload = &PROMPT[..];
        assert_eq!(
            judged(&receipt, Some(&opening), payload, &SERVED, None),
            Verdict::Verified
        );
        // The serve's output, disclosed, opens the commitment on this
        // payload: the re-run parts from it at token 2.
        assert_eq!(
            judged(
                &receipt,
                Some(&opening),
                payload,
                &[5, 6, 0, 0],
                Some(&SERVED)
            ),
            Verdict::Diverged { at: 2 }
        );
        // Without a disclosed output, or with one that does not open it,
        // the difference is not the serve's to answer for.
        for disclosed in [None, Some(&[5, 6, 0, 0][..])] {
            assert_eq!(
                judged(&receipt, Some(&opening), payload, &[5, 6, 0, 0], disclosed),
                Verdict::NotReplayable(NotReplayable::Unattributable)
            );
        }
        // Another prompt of the same length: even the served output opens
        // nothing. Of another length: not the receipt's request.
        assert_eq!(
            judged(&receipt, Some(&opening), &[1, 2], &SERVED, Some(&SERVED)),
            Verdict::NotReplayable(NotReplayable::OtherRequest {
                receipt: 3,
                replay: 2
            })
        );
        let other = [1, 2, 4];
        assert_eq!(
            judged(
                &receipt,
                Some(&opening),
                &other,
                &[5, 6, 0, 0],
                Some(&SERVED)
            ),
            Verdict::NotReplayable(NotReplayable::Unattributable)
        );
        // Another opening (another receipt's): nothing opens.
        let wrong = opening_of(&opening_key(&[1; 32]), &[5; 32]);
        assert_eq!(
            judged(&receipt, Some(&wrong), payload, &SERVED, Some(&SERVED)),
            Verdict::NotReplayable(NotReplayable::Unattributable)
        );
        assert_eq!(
            judged(&receipt, None, payload, &SERVED, None),
            Verdict::NotReplayable(NotReplayable::NoOpening)
        );
        let other_weights = Replayer {
            weights: [8; 32],
            ..replayer(payload)
        };
        assert_eq!(
            judge(
                &receipt,
                &other_weights,
                Some(&opening),
                &prompt_payload(payload),
                &SERVED,
                None
            ),
            Verdict::NotReplayable(NotReplayable::OtherWeights)
        );
        // Bound to the request id: another prompt of the same length is
        // told apart by the id it gives, not only by its token count.
        let bound = Replayer {
            request_id: Some([3; 32]),
            ..replayer(payload)
        };
        assert!(matches!(
            judge(
                &receipt,
                &bound,
                Some(&opening),
                &prompt_payload(payload),
                &SERVED,
                None
            ),
            Verdict::NotReplayable(NotReplayable::NotThisRequest { .. })
        ));
        let same = Replayer {
            request_id: Some(receipt.request_id),
            ..replayer(payload)
        };
        assert_eq!(
            judge(
                &receipt,
                &same,
                Some(&opening),
                &prompt_payload(payload),
                &SERVED,
                None
            ),
            Verdict::Verified
        );
        let other_recipe = Replayer {
            recipe: "other.gguf",
            ..replayer(payload)
        };
        assert!(matches!(
            judge(
                &receipt,
                &other_recipe,
                Some(&opening),
                &prompt_payload(payload),
                &SERVED,
                None
            ),
            Verdict::NotReplayable(NotReplayable::OtherRecipe(_))
        ));
        for declared in [Some(false), None] {
            let mut sampled = receipt.clone();
            sampled.deterministic = declared;
            assert_eq!(
                judged(&sampled, Some(&opening), payload, &SERVED, Some(&SERVED)),
                Verdict::NotReplayable(NotReplayable::NotDeterministic)
            );
        }
        let mut other_backend = receipt.clone();
        other_backend.backend = "mesh-node/stage".into();
        assert!(matches!(
            judged(&other_backend, Some(&opening), payload, &SERVED, None),
            Verdict::NotReplayable(NotReplayable::OtherBackend(_))
        ));
        let mut nothing = receipt.clone();
        nothing.output_commitment = None;
        assert_eq!(
            judged(&nothing, Some(&opening), payload, &SERVED, None),
            Verdict::NotReplayable(NotReplayable::NoCommitment)
        );
        // A disclosed output that is a prefix of the re-run parts where it ends.
        let (mut short, _) = self::receipt();
        short.output_commitment = Some(output_commitment(
            &opening,
            &short.request_id,
            &prompt_payload(payload),
            &SERVED[..2],
        ));
        assert_eq!(
            judged(&short, Some(&opening), payload, &SERVED, Some(&SERVED[..2])),
            Verdict::Diverged { at: 2 }
        );
    }
}
