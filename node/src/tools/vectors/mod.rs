//! The vectors this project publishes under `vectors/`: `split_stage` (lane
//! folds, stage blocks, records, hop cases, bundles), `mesh1` (receipts,
//! grants, requests, routes), `mesh` (node adverts), `audit` (the signed
//! audit statement a bundle carries) and `stage` (the
//! `mesh-stage/1` message bodies and REWIND payloads). Every file is a pure
//! function of fixed seeds, so regenerating leaves the committed files
//! unchanged (CI checks it).

use anyhow::Context;

pub mod audit;
mod file;
pub mod mesh;
pub mod mesh1;
pub mod plain_bundle;
pub mod reach;
pub mod split_stage;
pub mod stage;
pub mod tape;

pub use file::VectorFile;

/// Generate every vector file.
pub fn generate() -> anyhow::Result<Vec<VectorFile>> {
    let mut files = split_stage::generate()?;
    files.extend(mesh1::generate()?);
    files.extend(mesh::generate()?);
    files.extend(audit::generate()?);
    files.extend(tape::generate()?);
    files.extend(stage::generate()?);
    files.extend(reach::generate()?);
    Ok(files)
}

/// Write the vectors under `dir`, or with `check`, compare instead and list
/// every file that differs.
pub fn write_or_check(dir: &std::path::Path, check: bool) -> anyhow::Result<Vec<String>> {
    let files = generate()?;
    let mut differing = Vec::new();
    for (relative, contents) in &files {
        let path = dir.join(relative);
        let current = std::fs::read_to_string(&path).ok();
        if current.as_deref() != Some(contents.as_str()) {
            differing.push(relative.clone());
            if !check {
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)
                        .with_context(|| format!("creating {}", parent.display()))?;
                }
                std::fs::write(&path, contents)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
    }
    Ok(differing)
}
