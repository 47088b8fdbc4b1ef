//! `mesh-node bench stage-memory`: the memory of a three-process split on
//! 127.0.0.1 after one greedy request, read from each process's
//! `/proc/PID/status`. A middle stage should hold its weights, its KV
//! cache and little else: its peak RSS beyond those two is the figure.

use std::path::Path;

use anyhow::Context;
use serde_json::{Value, json};

use crate::runtime::serve::{GenerateRequest, PeerAddr, generate_remote, node_stats_remote};
use crate::tools::bench::completed;
use crate::tools::bench_concurrency::{did, serve};

/// What a middle stage may hold beyond its weights and KV cache (issue 43:
/// llama.cpp's rpc-server carries some 10 MiB).
const MIDDLE_STAGE_OVERHEAD_TARGET: u64 = 20 << 20;

/// One process's memory, from `/proc/PID/status` (kB there, bytes here).
#[derive(Debug, Clone, Copy, Default)]
struct Memory {
    peak_rss: u64,
    rss: u64,
    rss_anon: u64,
    rss_file: u64,
}

fn memory_of(pid: u32) -> anyhow::Result<Memory> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {path} (the memory bench needs Linux's /proc)"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .with_context(|| format!("no {name} in {path}"))?;
        let kib: u64 = line
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("{name} in {path}"))?;
        Ok(kib * 1024)
    };
    Ok(Memory {
        peak_rss: field("VmHWM:")?,
        rss: field("VmRSS:")?,
        rss_anon: field("RssAnon:")?,
        rss_file: field("RssFile:")?,
    })
}

/// `binary`: whose `serve` processes are measured (default: this one), so
/// two builds can be measured side by side.
pub async fn bench_stage_memory(
    model: &Path,
    prompt_tokens: Option<usize>,
    tokens: usize,
    binary: Option<&Path>,
) -> anyhow::Result<Value> {
    let exe = match binary {
        Some(path) => path.to_path_buf(),
        None => std::env::current_exe()?,
    };
    let scratch = crate::tools::bench_split::tempfile_dir()?;
    let report = measure(&exe, &scratch, model, prompt_tokens, tokens).await;
    let _ = std::fs::remove_dir_all(&scratch);
    report
}

async fn measure(
    exe: &Path,
    dir: &Path,
    model: &Path,
    prompt_tokens: Option<usize>,
    tokens: usize,
) -> anyhow::Result<Value> {
    crate::runtime::keys::generate(&dir.join("coord.key"))?;
    let coordinator_did = did(dir, "coord")?;
    let stage_config = format!("model = {model:?}\ncoordinators = [{coordinator_did:?}]\n");
    let (b_process, b) = serve(exe, dir, "b", &stage_config)?;
    let (c_process, c) = serve(exe, dir, "c", &stage_config)?;
    let (a_process, a) = serve(
        exe,
        dir,
        "coord",
        &format!("model = {model:?}\npeers = [{b:?}, {c:?}]\n"),
    )?;
    let coordinator: PeerAddr = a.parse()?;
    let prompt = crate::tools::bench_split::bench_prompt(model, prompt_tokens)?;
    let mut request = GenerateRequest::greedy(prompt, tokens);
    request.chat = prompt_tokens.is_none();
    let summary = completed(generate_remote(&coordinator, &request, &mut |_| {}).await?)?;
    let prompt_ids = summary.details["prompt_tokens"].as_u64().unwrap_or(0);
    let generated = summary.details["generated_tokens"].as_u64().unwrap_or(0);
    // The stages' caches were opened for the prompt and every token the
    // request may generate (the coordinator's `capacity`).
    let capacity = prompt_ids + tokens as u64;
    let key = crate::runtime::keys::load(&dir.join("coord.key"))?;
    let handle = mesh_stage::ModelHandle::open(model)?;
    let kv_per_layer = crate::runtime::planner::kv_bytes_per_position(&handle) * capacity;
    let mut processes = Vec::new();
    let mut middle = None;
    for (name, process, peer) in [
        ("coordinator", &a_process, &a),
        ("stage 1", &b_process, &b),
        ("stage 2", &c_process, &c),
    ] {
        let memory = memory_of(process.id())?;
        let stats = node_stats_remote(&key, &peer.parse()?).await?;
        let layers: Vec<(u32, u32)> = stats
            .slices
            .iter()
            .map(|s| (s.layer_start, s.layer_end))
            .collect();
        processes.push(json!({
            "process": name,
            "layers": layers,
            "peak_rss_bytes": memory.peak_rss,
            "rss_bytes": memory.rss,
            "rss_anon_bytes": memory.rss_anon,
            "rss_file_bytes": memory.rss_file,
        }));
        if name == "stage 1" {
            middle = Some((layers, memory));
        }
    }
    let (layers, memory) = middle.context("no middle stage")?;
    let &[(start, end)] = layers.as_slice() else {
        anyhow::bail!("the middle stage holds {layers:?}, not one slice");
    };
    if start == 0 || end >= handle.config().layers {
        anyhow::bail!("stage 1 holds layers {start}..{end}: not a middle stage");
    }
    let weights = handle.load_slice(start..end)?.weight_bytes() as u64;
    let kv = kv_per_layer * u64::from(end - start);
    let beyond = memory.peak_rss.saturating_sub(weights + kv);
    Ok(json!({
        "binary": exe.display().to_string(),
        "model": model.display().to_string(),
        "prompt_tokens": prompt_ids,
        "generated_tokens": generated,
        "cache_positions": capacity,
        "threads_per_process": crate::tools::bench_concurrency::threads_per_process(),
        "processes": processes,
        "middle_stage": {
            "layers": [start, end],
            "weights_bytes": weights,
            "kv_cache_bytes": kv,
            "peak_rss_bytes": memory.peak_rss,
            "rss_file_bytes": memory.rss_file,
            "beyond_weights_and_kv_bytes": beyond,
            "target_beyond_bytes": MIDDLE_STAGE_OVERHEAD_TARGET,
            "within_target": beyond <= MIDDLE_STAGE_OVERHEAD_TARGET,
        },
    }))
}

pub fn render_stage_memory(report: &Value) -> String {
    use std::fmt::Write as _;
    let mib = |v: &Value| v.as_u64().unwrap_or(0) as f64 / (1 << 20) as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "three serve processes, one greedy request: {} prompt tokens, {} generated",
        report["prompt_tokens"], report["generated_tokens"]
    );
    for p in report["processes"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:<12} layers {:<10} peak RSS {:7.1} MiB  (anonymous {:6.1}, file {:5.1})",
            p["process"].as_str().unwrap_or("?"),
            p["layers"].to_string(),
            mib(&p["peak_rss_bytes"]),
            mib(&p["rss_anon_bytes"]),
            mib(&p["rss_file_bytes"]),
        );
    }
    let m = &report["middle_stage"];
    let _ = writeln!(
        out,
        "middle stage: weights {:.1} MiB + KV {:.1} MiB; beyond them {:.1} MiB (target {:.0} MiB: {})",
        mib(&m["weights_bytes"]),
        mib(&m["kv_cache_bytes"]),
        mib(&m["beyond_weights_and_kv_bytes"]),
        mib(&m["target_beyond_bytes"]),
        if m["within_target"].as_bool() == Some(true) {
            "met"
        } else {
            "not met"
        },
    );
    out
}
