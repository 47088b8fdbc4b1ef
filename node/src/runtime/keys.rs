//! Node key files: the 32-byte Ed25519 seed as 64 lowercase hex digits and a
//! newline, readable only by its owner. One seed is the node's identity
//! everywhere: steward, stage records and (later) transport.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, bail};
use mesh_protocol::SigningKey;

/// Fresh randomness from the operating system.
pub fn random_bytes<const N: usize>() -> anyhow::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("the OS gave no randomness: {e}"))?;
    Ok(bytes)
}

/// True with probability `p` (0 never, 1 always; never when the OS gives
/// no randomness).
pub fn chance(p: f64) -> bool {
    if p <= 0.0 {
        return false;
    }
    let Ok(bytes) = random_bytes::<8>() else {
        return false;
    };
    // 53 random bits, uniform in [0, 1).
    let draw = (u64::from_le_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64;
    draw < p
}

/// Write a new key to `path`, refusing to overwrite one.
pub fn generate(path: &Path) -> anyhow::Result<SigningKey> {
    let seed = random_bytes::<32>()?;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(path)
        .with_context(|| format!("cannot create {} (it must not exist yet)", path.display()))?;
    writeln!(file, "{}", mesh_protocol::hex::encode(&seed))?;
    file.sync_all()?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Why a key file's permissions are unsafe, if they are: anyone in its
/// group or beyond can read it (the seed is the node's whole identity).
pub fn permission_warning(path: &Path) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
        (mode & 0o077 != 0).then(|| {
            format!(
                "warning: key file {} is readable by others than its owner (mode {mode:04o}); \
                 anyone who can read it can act as this node. Fix with: chmod 600 {}",
                path.display(),
                path.display()
            )
        })
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

/// Load a key file; warns on stderr when its permissions let others read it.
pub fn load(path: &Path) -> anyhow::Result<SigningKey> {
    if let Some(warning) = permission_warning(path) {
        eprintln!("mesh-node: {warning}");
    }
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "cannot read key file {} (create one with `mesh-node keygen --out {}`)",
            path.display(),
            path.display()
        )
    })?;
    let Some(seed) = mesh_protocol::hex::decode_array::<32>(text.trim()) else {
        bail!(
            "{} is not a mesh-node key file (64 lowercase hex digits expected)",
            path.display()
        );
    };
    Ok(SigningKey::from_bytes(&seed))
}
