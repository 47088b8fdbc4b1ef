//! The package manifest: what a model package holds, as one canonical JSON
//! object, and its SHA-256 (`manifest_sha256` of the split-stage blocks).
//!
//! The value is package-wide: every stage of a model names the same one
//! (split-stage spec §2.1: package_id, manifest_sha256 and
//! source_model_sha256 are "package-wide, not per slice"), and the
//! coordinator assigns it to each stage in the `assign` message, which a
//! stage refuses when its own package's manifest differs.
//!
//! ```text
//! { "files": [ { "blake3": HEX64, "bytes": N, "name": NAME }, ... ],   // name order
//!   "kind": "mesh-node-package-manifest",
//!   "package_id": "sha256:" HEX64,
//!   "v": 1 }
//! manifest_sha256 = SHA-256( RFC 8785 bytes of that object )
//! ```

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::hex;

/// The manifest's `kind`.
pub const MANIFEST_KIND: &str = "mesh-node-package-manifest";

/// One file of a package.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackageFile<'a> {
    /// Its name inside the package (a relative path, `/`-separated).
    pub name: &'a str,
    pub bytes: u64,
    pub blake3: [u8; 32],
}

/// The manifest object, files in name order whatever order they come in.
pub fn package_manifest(package_id: &[u8; 32], files: &[PackageFile<'_>]) -> Value {
    let mut sorted: Vec<&PackageFile<'_>> = files.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(b.name));
    json!({
        "v": 1,
        "kind": MANIFEST_KIND,
        "package_id": format!("sha256:{}", hex::encode(package_id)),
        "files": sorted
            .iter()
            .map(|f| json!({ "name": f.name, "bytes": f.bytes, "blake3": hex::encode(&f.blake3) }))
            .collect::<Vec<_>>(),
    })
}

/// SHA-256 of the manifest's RFC 8785 form.
pub fn manifest_sha256(package_id: &[u8; 32], files: &[PackageFile<'_>]) -> [u8; 32] {
    Sha256::digest(crate::json::canonical_bytes(&package_manifest(
        package_id, files,
    )))
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> [PackageFile<'static>; 2] {
        [
            PackageFile {
                name: "model.gguf",
                bytes: 1234,
                blake3: [7; 32],
            },
            PackageFile {
                name: "a/tokenizer.json",
                bytes: 5,
                blake3: [9; 32],
            },
        ]
    }

    #[test]
    fn the_manifest_digest_is_pinned_and_ignores_file_order() {
        let files = files();
        let digest = manifest_sha256(&[1; 32], &files);
        assert_eq!(
            hex::encode(&digest),
            "3343bdf57bea223da7659a8bd50c8417f2ab63436841cb5432cb0fcc5e13002d",
            "{}",
            String::from_utf8_lossy(&crate::json::canonical_bytes(&package_manifest(
                &[1; 32], &files
            )))
        );
        let reversed = [files[1], files[0]];
        assert_eq!(manifest_sha256(&[1; 32], &reversed), digest);
    }

    #[test]
    fn every_field_of_every_file_is_bound() {
        let base = manifest_sha256(&[1; 32], &files());
        assert_ne!(manifest_sha256(&[2; 32], &files()), base);
        for change in 0..3 {
            let mut changed = files();
            match change {
                0 => changed[0].name = "other.gguf",
                1 => changed[0].bytes += 1,
                _ => changed[0].blake3[31] ^= 1,
            }
            assert_ne!(manifest_sha256(&[1; 32], &changed), base, "change {change}");
        }
        assert_ne!(manifest_sha256(&[1; 32], &files()[..1]), base);
    }
}
