//! `mesh-node journal inspect` and the text of `mesh-node verify` for a
//! `mesh/1` envelope.

use std::fmt::Write;

use mesh_protocol::hex;
use mesh_protocol::mesh1::SealedReceipt;

use crate::runtime::journal::{Entry, Record};
use crate::runtime::steward::{Replay, Unresolved};

/// The steward a journal belongs to, read from its first authorisation.
pub fn steward_of(records: &[Record]) -> Option<String> {
    records.iter().find_map(|r| match &r.entry {
        Entry::Authorised { presentation, .. } => {
            presentation.leaf().map(|leaf| leaf.grant.subject.clone())
        }
        _ => None,
    })
}

pub fn render_journal(
    records: &[Record],
    replay: Option<&Replay>,
    replay_error: Option<&str>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{} record(s), chained by BLAKE3", records.len());
    for record in records {
        let line = match &record.entry {
            Entry::Authorised {
                presentation,
                request,
                backend,
                decided_at_ms,
                ..
            } => format!(
                "authorised  request {} ceiling {} µJ caller {} backend {} at {}",
                short(&request.request_id()),
                request.joule_ceiling_uj,
                presentation.caller,
                backend,
                mesh_protocol::capsule::format_timestamp(*decided_at_ms)
            ),
            Entry::Debited {
                authorised_seq,
                energy,
                breach,
            } => format!(
                "debited     #{authorised_seq} {} µJ ({}){}",
                energy.uj(),
                energy.provenance().as_str(),
                breach
                    .as_ref()
                    .map(|b| format!(" BREACH {b}"))
                    .unwrap_or_default()
            ),
            Entry::Started {
                request_id,
                backend,
                started_at_ms,
                ..
            } => format!(
                "started     request {} (no grant) backend {} at {}",
                short(request_id),
                backend,
                mesh_protocol::capsule::format_timestamp(*started_at_ms)
            ),
            Entry::Ended {
                started_seq,
                energy,
            } => format!(
                "ended       #{started_seq} {} µJ ({})",
                energy.uj(),
                energy.provenance().as_str()
            ),
            Entry::Sealed {
                sequence,
                envelope_id,
                ..
            } => format!(
                "sealed      receipt {sequence} envelope {}",
                short(envelope_id)
            ),
            Entry::Halted { reason, .. } => format!("HALTED      {reason}"),
            Entry::HaltCleared { reason, .. } => format!("HALT CLEARED {reason}"),
            Entry::TailLost { last, written, .. } => format!(
                "TAIL LOST   records after {} up to {written} lost; the operator went on without them",
                last.map_or("none".to_string(), |l| l.to_string())
            ),
            Entry::Refused {
                request_id,
                table,
                unjournalled,
                ..
            } => {
                let line = serde_json::from_str::<serde_json::Value>(table)
                    .ok()
                    .and_then(|t| t["justification"].as_str().map(str::to_string))
                    .unwrap_or_else(|| table.clone());
                let skipped = if *unjournalled > 0 {
                    format!(" ({unjournalled} more before it, counted only)")
                } else {
                    String::new()
                };
                format!("refused     request {}: {line}{skipped}", short(request_id))
            }
            Entry::Logged { capsule_id } => format!("logged      record {}", short(capsule_id)),
            Entry::Judged(judged) => {
                let crate::runtime::journal::Judged {
                    node,
                    judgement,
                    at_ms,
                    until_ms,
                } = judged;
                let out = if until_ms > at_ms {
                    format!(", left out of plans for {} s", (until_ms - at_ms) / 1000)
                } else {
                    String::new()
                };
                format!(
                    "judged      {}: {}{out}",
                    mesh_protocol::identity::did_key(node),
                    judgement.as_str()
                )
            }
            Entry::Checkpointed { size, root } => {
                format!("checkpoint  log size {size} root {}", short(root))
            }
            Entry::Changed { envelope } => {
                match mesh_protocol::change::SealedChange::verify(envelope) {
                    Ok(change) => format!(
                        "changed     {} #{} {}",
                        change.entry.backend,
                        change.entry.seq,
                        match &change.entry.kind {
                            mesh_protocol::change::ChangeKind::Plan(_) => "plan".to_string(),
                            mesh_protocol::change::ChangeKind::Weights(w) =>
                                format!("weights to {}", short(&w.to)),
                        }
                    ),
                    Err(error) => format!("changed     (does not verify: {error})"),
                }
            }
        };
        let _ = writeln!(out, "  #{:<5} {line}", record.seq);
    }
    match (replay, replay_error) {
        (Some(replay), _) => {
            let _ = writeln!(
                out,
                "replay: ok; next receipt sequence {}",
                replay.next_sequence
            );
            if let Some(why) = replay.gate.halted() {
                let _ = writeln!(
                    out,
                    "grants: REFUSED until an operator restores the journal: {why}"
                );
            }
            render_unresolved(&mut out, &replay.unresolved);
        }
        (None, Some(error)) => {
            let _ = writeln!(out, "replay: REFUSED: {error}");
        }
        (None, None) => {}
    }
    out
}

fn render_unresolved(out: &mut String, unresolved: &[Unresolved]) {
    if unresolved.is_empty() {
        let _ = writeln!(out, "unresolved serves: none");
        return;
    }
    let (granted, ungranted): (Vec<&Unresolved>, Vec<&Unresolved>) =
        unresolved.iter().partition(|u| u.granted);
    if !ungranted.is_empty() {
        let _ = writeln!(
            out,
            "unresolved serves without a grant (started, never ended; nothing to settle):"
        );
        for u in &ungranted {
            let _ = writeln!(
                out,
                "  #{} request {} backend {} started {}",
                u.authorised_seq,
                short(&u.request_id),
                u.backend,
                mesh_protocol::capsule::format_timestamp(u.decided_at_ms)
            );
        }
    }
    if granted.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "unresolved serves (authorised, never debited; held at their ceiling for an operator to settle):"
    );
    for u in granted {
        let _ = writeln!(
            out,
            "  #{} request {} caller {} backend {} ceiling {} µJ",
            u.authorised_seq,
            short(&u.request_id),
            u.caller,
            u.backend,
            u.ceiling_uj
        );
    }
}

fn short(id: &[u8; 32]) -> String {
    format!("{}…", &hex::encode(id)[..16])
}

pub fn render_receipt(
    file: &str,
    sealed: &SealedReceipt,
    link: Option<&Result<(), String>>,
) -> String {
    let r = &sealed.receipt;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{file}: mesh/1 receipt, {} bytes",
        sealed.envelope.len()
    );
    let _ = writeln!(
        out,
        "  ✓ COSE_Sign1 EdDSA signature by steward {}",
        r.steward
    );
    let _ = writeln!(
        out,
        "  ✓ canonical CBOR core, every receipt rule (energy coupling, derived figures, pairings)"
    );
    match link {
        Some(Ok(())) => {
            let _ = writeln!(
                out,
                "  ✓ chain: sequence {} follows the previous envelope",
                r.sequence
            );
        }
        Some(Err(why)) => {
            let _ = writeln!(out, "  ✕ chain: {why}");
        }
        None => {
            let _ = writeln!(out, "  · chain link not checked (give --prev FILE)");
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "  envelope id     {}",
        hex::encode(&sealed.envelope_id())
    );
    let _ = writeln!(out, "  request         {}", hex::encode(&r.request_id));
    let _ = writeln!(
        out,
        "  sequence        {}{}",
        r.sequence,
        r.prev
            .map(|p| format!(" (prev {})", short(&p)))
            .unwrap_or_default()
    );
    let _ = writeln!(out, "  backend/recipe  {} / {}", r.backend, r.recipe);
    if let Some(w) = &r.weights {
        let _ = writeln!(
            out,
            "  weights         {} ({})",
            hex::encode(&w.weights_digest),
            w.precision
        );
    }
    let _ = writeln!(
        out,
        "  energy          {} µJ ({}{})",
        r.energy.uj(),
        r.energy.provenance().as_str(),
        r.energy
            .measured_uj()
            .map(|_| format!(", estimate {} µJ", r.energy.estimated_uj()))
            .unwrap_or_default()
    );
    let _ = writeln!(
        out,
        "  tokens          in {} out {} accepted {}",
        r.tokens_in, r.tokens_out, r.tokens_accepted
    );
    if let Some(per) = r.uj_per_accepted_token() {
        let _ = writeln!(out, "  µJ per token    {per}");
    }
    if let Some(grant) = &r.grant_id {
        let _ = writeln!(
            out,
            "  grant           {}{}",
            hex::encode(grant),
            r.grant_breach
                .as_ref()
                .map(|b| format!(" BREACH {b}"))
                .unwrap_or_default()
        );
    }
    if r.split.is_some() {
        let _ = writeln!(out, "  split           coordinator receipt block carried");
    }
    out
}
