//! `mesh-node verify`: a bundle, a hop-check case or a `mesh/1` envelope,
//! checked offline.

use std::path::Path;
use std::process::ExitCode;

use mesh_protocol::json::parse_strict;
use mesh_protocol::verify::verify_document;

/// Exit status for input that cannot be read.
const EXIT_UNREADABLE: u8 = 2;

/// The largest file `verify` reads: the largest JSON document it accepts
/// (an envelope, raw or as hex, is far smaller).
const MAX_VERIFY_BYTES: usize = mesh_protocol::json::MAX_JSON_BYTES;

/// Read a file for `verify`, at most `MAX_VERIFY_BYTES` + 1 bytes of it, so
/// a huge file is refused without being read.
fn read_bounded(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let shown = path.display();
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_VERIFY_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {shown}: {e}"))?;
    if bytes.len() > MAX_VERIFY_BYTES {
        return Err(format!(
            "{shown} is too large (over {MAX_VERIFY_BYTES} bytes); nothing mesh-node writes is that big"
        ));
    }
    Ok(bytes)
}

/// A mesh/1 envelope given as raw CBOR (tag 18 first) or as hex text.
fn as_envelope(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.first() == Some(&0xd2) {
        return Some(bytes.to_vec());
    }
    let text = std::str::from_utf8(bytes).ok()?.trim();
    mesh_protocol::hex::decode(text).filter(|raw| raw.first() == Some(&0xd2))
}

/// The `mesh/1` receipt of a file: an envelope (raw or hex), or a bundle
/// that carries one; its signature checked.
pub fn read_receipt(path: &Path) -> Result<mesh_protocol::mesh1::SealedReceipt, String> {
    let shown = path.display();
    let bytes = read_bounded(path)?;
    let envelope = match as_envelope(&bytes) {
        Some(envelope) => envelope,
        None => {
            let document =
                parse_strict(&bytes).map_err(|e| format!("{shown}: not valid JSON: {e}"))?;
            let (envelope, _) = mesh_protocol::bundle::carried_receipt(&document)
                .map_err(|e| format!("{shown}: not a mesh bundle: at {e}"))?;
            envelope.ok_or_else(|| format!("{shown}: the bundle carries no mesh/1 receipt"))?
        }
    };
    mesh_protocol::mesh1::SealedReceipt::verify(&envelope)
        .map_err(|e| format!("{shown}: the mesh/1 receipt does not verify: {e}"))
}

fn verify_envelope(shown: &str, envelope: &[u8], prev: Option<&Path>, as_json: bool) -> ExitCode {
    let sealed = match mesh_protocol::mesh1::SealedReceipt::verify(envelope) {
        Ok(sealed) => sealed,
        Err(error) => {
            if as_json {
                println!(
                    "{}",
                    serde_json::json!({ "form": "mesh1_envelope", "ok": false, "error": error.to_string() })
                );
            } else {
                println!("{shown}: mesh/1 receipt envelope\n  ✕ {error}\n\nResult: FAILED");
            }
            return ExitCode::from(1);
        }
    };
    let link = match prev {
        None => None,
        Some(path) => {
            let previous = read_bounded(path)
                .and_then(|b| {
                    as_envelope(&b).ok_or(format!("{} is not a mesh/1 envelope", path.display()))
                })
                .and_then(|b| {
                    mesh_protocol::mesh1::SealedReceipt::verify(&b)
                        .map_err(|e| format!("{}: {e}", path.display()))
                });
            Some(previous.and_then(|p| sealed.check_follows(&p).map_err(|e| e.to_string())))
        }
    };
    let ok = link.as_ref().is_none_or(|l| l.is_ok());
    if as_json {
        let r = &sealed.receipt;
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "form": "mesh1_envelope", "ok": ok,
                "envelope_id": mesh_protocol::hex::encode(&sealed.envelope_id()),
                "steward": r.steward, "sequence": r.sequence,
                "prev": r.prev.map(|p| mesh_protocol::hex::encode(&p)),
                "request_id": mesh_protocol::hex::encode(&r.request_id),
                "energy_uj": r.energy.uj(), "energy_provenance": r.energy.provenance().as_str(),
                "chain_link": link.as_ref().map(|l| l.clone().err().unwrap_or_else(|| "ok".into())),
            }))
            .unwrap_or_default()
        );
    } else {
        print!(
            "{}",
            crate::cli::inspect::render_receipt(shown, &sealed, link.as_ref())
        );
        println!("\nResult: {}", if ok { "OK" } else { "FAILED" });
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// `mesh-node verify`: exit 0 when every check passes and hand-offs agree,
/// 1 when something failed, 2 when the input cannot be read.
pub fn verify(file: &Path, prev: Option<&Path>, as_json: bool) -> ExitCode {
    let shown = file.display().to_string();
    let bytes = match read_bounded(file) {
        Ok(bytes) => bytes,
        Err(error) => {
            eprintln!("mesh-node verify: {error}");
            return ExitCode::from(EXIT_UNREADABLE);
        }
    };
    if let Some(envelope) = as_envelope(&bytes) {
        return verify_envelope(&shown, &envelope, prev, as_json);
    }
    let document = match parse_strict(&bytes) {
        Ok(document) => document,
        Err(error) => {
            eprintln!("mesh-node verify: {shown}: not valid JSON: {error}");
            return ExitCode::from(EXIT_UNREADABLE);
        }
    };
    let report = match verify_document(&document) {
        Ok(report) => report,
        Err(error) => {
            eprintln!("mesh-node verify: {shown}: at {error}");
            return ExitCode::from(EXIT_UNREADABLE);
        }
    };
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_value()).unwrap_or_default()
        );
    } else {
        print!("{}", crate::cli::render::render(&shown, &report));
    }
    if report.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
