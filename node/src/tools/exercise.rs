//! `mesh-node steward exercise`: drive a steward through whole serves on a
//! CPU workload, with a grant presented for each, so its journal, replay and
//! receipt chain can be exercised (and killed) in a real process. The grant
//! chain is fixed (owner -> requester -> this steward), so a later run
//! presents the same chain and the steward's replayed spend applies to it.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use mesh_protocol::SigningKey;
use mesh_protocol::grant::{Grant, Presentation, SignedGrant};
use mesh_protocol::identity::did_key;
use mesh_protocol::mesh1::{Fidelity, MeshReceipt, ServeRequest, prompt_hash};

use crate::runtime::clock::now_ms;
use crate::runtime::energy::{EnergyMeter, burn_cpu};
use crate::runtime::steward::Steward;

/// The leaf grant's budget at the steward.
pub const EXERCISE_BUDGET_UJ: u64 = 50_000_000;
/// Each serve's joule ceiling.
pub const EXERCISE_CEILING_UJ: u64 = 5_000_000;
/// The backend name journalled for these serves.
pub const EXERCISE_BACKEND: &str = "exercise/cpu-workload";

fn labelled_key(label: &str) -> SigningKey {
    SigningKey::from_bytes(blake3::hash(label.as_bytes()).as_bytes())
}

/// The requester that presents the exercise's grant.
pub fn requester_key() -> SigningKey {
    labelled_key("mesh-node exercise requester")
}

/// The fixed chain: owner -> requester (root), requester -> steward (leaf).
pub fn exercise_chain(steward_did: &str) -> anyhow::Result<Vec<SignedGrant>> {
    let owner = labelled_key("mesh-node exercise owner");
    let requester = requester_key();
    let root = Grant {
        issuer: did_key(&owner.verifying_key().to_bytes()),
        subject: did_key(&requester.verifying_key().to_bytes()),
        budget_uj: EXERCISE_BUDGET_UJ * 4,
        caveats: vec![],
        parent: None,
        expiry_ms: 4_102_444_800_000,
        nonce: [0; 16],
    }
    .sign(&owner)?;
    let leaf = root.delegate(
        &requester,
        steward_did,
        EXERCISE_BUDGET_UJ,
        vec![],
        4_102_444_800_000,
        [1; 16],
    )?;
    Ok(vec![root, leaf])
}

/// Run `serves` serves, each burning `workload` of CPU inside the metered
/// span; print one line per step and write each envelope to `DIR/receipts/`.
pub fn run(
    data: &Path,
    key: SigningKey,
    meter: Box<dyn EnergyMeter>,
    serves: u32,
    workload: Duration,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let mut steward = Steward::open(data, key, meter)?;
    writeln!(
        out,
        "steward {} meter {} next-sequence {}",
        steward.did(),
        steward.meter_name(),
        steward.next_sequence()
    )?;
    for unresolved in steward.unresolved() {
        writeln!(
            out,
            "unresolved authorised-seq {} caller {} backend {} ceiling-uj {}",
            unresolved.authorised_seq, unresolved.caller, unresolved.backend, unresolved.ceiling_uj
        )?;
    }
    out.flush()?;
    let chain = exercise_chain(steward.did())?;
    let receipts = data.join("receipts");
    std::fs::create_dir_all(&receipts)
        .with_context(|| format!("creating {}", receipts.display()))?;
    for _ in 0..serves {
        let prompt = crate::runtime::keys::random_bytes::<16>()?;
        let request = ServeRequest {
            prompt_hash: prompt_hash(&prompt),
            prompt_tokens: 4,
            max_tokens: 4,
            fidelity_floor: Fidelity::F0,
            joule_ceiling_uj: EXERCISE_CEILING_UJ,
            decision: None,
        };
        let presentation = Presentation::sign(
            chain.clone(),
            &request.request_id(),
            &requester_key(),
            crate::runtime::keys::random_bytes()?,
        )?;
        let mut ticket = steward.authorise(
            Some(&presentation),
            &request,
            None,
            EXERCISE_BACKEND,
            now_ms(),
        )?;
        writeln!(
            out,
            "authorised request {}",
            mesh_protocol::hex::encode(&request.request_id())
        )?;
        out.flush()?;
        steward.begin_engine(&mut ticket);
        burn_cpu(workload);
        let metered = steward.end_engine(ticket, None)?;
        let receipt = MeshReceipt {
            grant_id: metered.grant_id,
            tokens_in: 4,
            grant_breach: metered.debit.and_then(|d| d.breach).map(str::to_string),
            ..MeshReceipt::blank(
                request.request_id(),
                EXERCISE_BACKEND,
                "cpu-workload",
                "local",
                metered.energy,
                crate::runtime::keys::random_bytes()?,
            )
        };
        let sealed = steward.seal(receipt)?;
        let path = receipts.join(format!("{}.cbor", sealed.receipt.sequence));
        std::fs::write(&path, &sealed.envelope)
            .with_context(|| format!("writing {}", path.display()))?;
        writeln!(
            out,
            "sealed sequence {} envelope {} energy-uj {}",
            sealed.receipt.sequence,
            mesh_protocol::hex::encode(&sealed.envelope_id()),
            metered.energy.uj()
        )?;
        out.flush()?;
    }
    Ok(())
}
