//! `mesh-node bench concurrency`: aggregate decode tokens/s of 1, 4, 8 and
//! 16 concurrent greedy requests over three `mesh-node serve` processes on
//! 127.0.0.1, next to llama.cpp's `llama-server` with as many parallel slots
//! on the same model when one is given, measured in the same run.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::runtime::serve::{GenerateRequest, PeerAddr, generate_remote, node_stats_remote};
use crate::tools::bench::completed;

/// A child process killed when dropped.
pub(crate) struct Process(Child);

impl Process {
    pub(crate) fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Topics, so concurrent requests are different requests.
const TOPICS: [&str; 16] = [
    "a dragon",
    "the sea",
    "a lighthouse",
    "a robot",
    "the moon",
    "a garden",
    "a train",
    "a violin",
    "a mountain",
    "a library",
    "a storm",
    "a fox",
    "a city",
    "a bakery",
    "a river",
    "a comet",
];

fn prompt(i: usize) -> String {
    format!(
        "Once upon a time there was {}. Tell the whole story:",
        TOPICS[i % TOPICS.len()]
    )
}

/// Compute threads for each of the three processes sharing this machine's
/// cores: candle's worker pools spin while they wait, so three pools of all
/// the cores each fight over them (measured: one request decodes at about
/// half the speed). llama-server, one process, gets every core.
pub(crate) fn threads_per_process() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 3).max(1))
}

/// Start `mesh-node serve` with a config file; its peer address.
pub(crate) fn serve(
    exe: &Path,
    dir: &Path,
    name: &str,
    config: &str,
) -> anyhow::Result<(Process, String)> {
    let key = dir.join(format!("{name}.key"));
    if !key.exists() {
        crate::runtime::keys::generate(&key)?;
    }
    let config_path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &config_path,
        format!(
            "key = {key:?}\nlisten = \"127.0.0.1:0\"\ndata = {:?}\n{config}",
            dir.join(name)
        ),
    )?;
    let mut child = Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(&config_path)
        .env("RUST_LOG", "warn")
        .env("CANDLE_NUM_THREADS", threads_per_process().to_string())
        .env("RAYON_NUM_THREADS", threads_per_process().to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting mesh-node serve")?;
    let stdout = child.stdout.take().context("serve's stdout")?;
    let process = Process(child);
    let mut lines = BufReader::new(stdout).lines();
    let peer = loop {
        let line = lines
            .next()
            .context("serve ended before printing its address")??;
        if let Some(peer) = line.strip_prefix("peer address: ") {
            break peer.to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Ok((process, peer))
}

pub(crate) fn did(dir: &Path, name: &str) -> anyhow::Result<String> {
    let key = crate::runtime::keys::load(&dir.join(format!("{name}.key")))?;
    Ok(mesh_protocol::identity::did_key(
        &key.verifying_key().to_bytes(),
    ))
}

/// One level: `n` requests at once through the coordinator.
async fn mesh_level(coordinator: &PeerAddr, n: usize, tokens: usize) -> anyhow::Result<(u64, f64)> {
    let started = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let coordinator = coordinator.clone();
            let request = GenerateRequest::greedy(prompt(i), tokens);
            tokio::spawn(async move { generate_remote(&coordinator, &request, &mut |_| {}).await })
        })
        .collect();
    let mut generated = 0;
    for task in tasks {
        let summary = completed(task.await??)?;
        generated += summary.details["generated_tokens"].as_u64().unwrap_or(0);
    }
    Ok((generated, started.elapsed().as_secs_f64()))
}

/// A minimal HTTP/1.1 POST of a JSON body; the JSON answer.
fn post(port: u16, path: &str, body: &Value) -> anyhow::Result<Value> {
    let body = serde_json::to_vec(body)?;
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(600)))?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(&body)?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    let text = String::from_utf8_lossy(&answer);
    let (head, json) = text.split_once("\r\n\r\n").context("no HTTP body")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "llama-server answered {}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(serde_json::from_str(json.trim())?)
}

fn llama_ready(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    if write!(
        stream,
        "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200")
}

/// One level on llama-server with `n` parallel slots.
fn llama_level(server: &Path, model: &Path, n: usize, tokens: usize) -> anyhow::Result<(u64, f64)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let _server = Process(
        Command::new(server)
            .args(["-m"])
            .arg(model)
            .args([
                "-np",
                &n.to_string(),
                "-c",
                &(n * 512).to_string(),
                "--port",
                &port.to_string(),
            ])
            .args([
                "--host",
                "127.0.0.1",
                "-t",
                &std::thread::available_parallelism()
                    .map_or(2, |n| n.get())
                    .to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting llama-server")?,
    );
    let waiting = Instant::now();
    while !llama_ready(port) {
        if waiting.elapsed() > Duration::from_secs(120) {
            bail!("llama-server did not become ready");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let started = Instant::now();
    let threads: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                post(
                    port,
                    "/completion",
                    &json!({
                        "prompt": prompt(i), "n_predict": tokens, "temperature": 0.0,
                        "cache_prompt": false,
                    }),
                )
            })
        })
        .collect();
    let mut generated = 0;
    for thread in threads {
        let answer = thread
            .join()
            .map_err(|_| anyhow::anyhow!("a request thread panicked"))??;
        generated += answer["tokens_predicted"].as_u64().unwrap_or(0);
    }
    Ok((generated, started.elapsed().as_secs_f64()))
}

pub async fn bench_concurrency(
    model: &Path,
    tokens: usize,
    levels: &[usize],
    llama_server: Option<PathBuf>,
) -> anyhow::Result<Value> {
    let exe = std::env::current_exe()?;
    let scratch = crate::tools::bench_split::tempfile_dir()?;
    let report = measure(&exe, &scratch, model, tokens, levels, llama_server).await;
    let _ = std::fs::remove_dir_all(&scratch);
    report
}

async fn measure(
    exe: &Path,
    dir: &Path,
    model: &Path,
    tokens: usize,
    levels: &[usize],
    llama_server: Option<PathBuf>,
) -> anyhow::Result<Value> {
    let most = levels.iter().copied().max().unwrap_or(1);
    let coordinator_did = {
        crate::runtime::keys::generate(&dir.join("coord.key"))?;
        did(dir, "coord")?
    };
    let stage_config =
        format!("model = {model:?}\ncoordinators = [{coordinator_did:?}]\nmax_requests = {most}\n");
    let (_b, b) = serve(exe, dir, "b", &stage_config)?;
    let (_c, c) = serve(exe, dir, "c", &stage_config)?;
    let (_a, a) = serve(
        exe,
        dir,
        "coord",
        &format!("model = {model:?}\npeers = [{b:?}, {c:?}]\nmax_requests = {most}\n"),
    )?;
    let coordinator: PeerAddr = a.parse()?;
    let nodes: Vec<PeerAddr> = [&a, &b, &c]
        .iter()
        .map(|p| p.parse())
        .collect::<anyhow::Result<_>>()?;
    // The coordinator's key may read every node's stats.
    let coordinator_key = crate::runtime::keys::load(&dir.join("coord.key"))?;
    // Warm up: the split loads.
    mesh_level(&coordinator, 1, 2).await?;
    let mut rows = Vec::new();
    let mut single = None;
    for &n in levels {
        let before = batch_counts(&coordinator_key, &nodes).await?;
        let (generated, seconds) = mesh_level(&coordinator, n, tokens).await?;
        let after = batch_counts(&coordinator_key, &nodes).await?;
        let rate = generated as f64 / seconds;
        let single_rate = *single.get_or_insert(rate);
        let (steps, passes) = (after.0 - before.0, after.1 - before.1);
        let llama = match &llama_server {
            Some(server) => {
                let server = server.clone();
                let model = model.to_path_buf();
                let (generated, seconds) =
                    tokio::task::spawn_blocking(move || llama_level(&server, &model, n, tokens))
                        .await??;
                Some(generated as f64 / seconds)
            }
            None => None,
        };
        let engine = {
            let model = model.to_path_buf();
            tokio::task::spawn_blocking(move || engine_batched(&model, n, tokens)).await??
        };
        rows.push(json!({
            "concurrent": n,
            "engine_unsplit_batched_tokens_per_s": engine,
            "generated_tokens": generated,
            "seconds": seconds,
            "aggregate_tokens_per_s": rate,
            "ratio_to_one_request": rate / single_rate,
            "mean_batch": if passes == 0 { 0.0 } else { steps as f64 / passes as f64 },
            "llama_server_aggregate_tokens_per_s": llama,
            "ratio_to_llama_server": llama.map(|l| rate / l),
        }));
    }
    Ok(json!({
        "model": model.display().to_string(),
        "tokens_per_request": tokens,
        "processes": 3,
        "threads_per_process": threads_per_process(),
        "llama_server_threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "levels": rows,
    }))
}

/// The engine alone, unsplit, in this process: `batch` requests decoding
/// in lockstep, one `forward_batch` per step; aggregate tokens/s.
fn engine_batched(model: &Path, batch: usize, tokens: usize) -> anyhow::Result<f64> {
    let handle = mesh_stage::ModelHandle::open(model)?;
    let slice = handle.load_slice(0..handle.config().layers)?;
    let mut caches = (0..batch)
        .map(|_| slice.new_cache(64 + tokens))
        .collect::<mesh_stage::Result<Vec<_>>>()?;
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|i| handle.text()?.encode(&prompt(i)))
        .collect::<mesh_stage::Result<_>>()?;
    // Prompts one by one (not measured), then the decode steps together.
    let mut next: Vec<u32> = Vec::new();
    for (prompt, cache) in prompts.iter().zip(caches.iter_mut()) {
        let out = slice.forward(
            mesh_stage::SliceInput::Tokens(&prompt[..prompt.len().min(48)]),
            cache,
        )?;
        next.push(greedy(&out));
    }
    let started = Instant::now();
    for _ in 0..tokens {
        let inputs: Vec<[u32; 1]> = next.iter().map(|t| [*t]).collect();
        let mut steps: Vec<_> = inputs
            .iter()
            .zip(caches.iter_mut())
            .map(|(t, cache)| (mesh_stage::SliceInput::Tokens(t), cache))
            .collect();
        next = slice
            .forward_batch(&mut steps)?
            .iter()
            .map(greedy)
            .collect();
    }
    Ok((batch * tokens) as f64 / started.elapsed().as_secs_f64())
}

fn greedy(output: &mesh_stage::SliceOutput) -> u32 {
    match output {
        mesh_stage::SliceOutput::Logits(logits) => logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i as u32),
        mesh_stage::SliceOutput::Hidden(_) => 0,
    }
}

/// Steps and forward passes over every slice of these nodes.
async fn batch_counts(
    key: &mesh_protocol::SigningKey,
    nodes: &[PeerAddr],
) -> anyhow::Result<(u64, u64)> {
    let mut totals = (0, 0);
    for node in nodes {
        for slice in node_stats_remote(key, node).await?.slices {
            totals.0 += slice.steps;
            totals.1 += slice.passes;
        }
    }
    Ok(totals)
}

pub fn render_concurrency(report: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model {}, {} tokens per request, greedy, three serve processes of {} compute thread(s); llama-server: one process of {}",
        report["model"].as_str().unwrap_or(""),
        report["tokens_per_request"],
        report["threads_per_process"],
        report["llama_server_threads"]
    );
    let _ = writeln!(
        out,
        "{:>10} {:>14} {:>10} {:>10} {:>14} {:>10} {:>16}",
        "concurrent",
        "mesh tok/s",
        "vs one",
        "mean batch",
        "llama tok/s",
        "vs llama",
        "engine batched"
    );
    for row in report["levels"].as_array().into_iter().flatten() {
        let llama = row["llama_server_aggregate_tokens_per_s"].as_f64();
        let _ = writeln!(
            out,
            "{:>10} {:>14.1} {:>10.2} {:>10.2} {:>14} {:>10} {:>16.1}",
            row["concurrent"],
            row["aggregate_tokens_per_s"].as_f64().unwrap_or(0.0),
            row["ratio_to_one_request"].as_f64().unwrap_or(0.0),
            row["mean_batch"].as_f64().unwrap_or(0.0),
            llama.map_or("-".to_string(), |l| format!("{l:.1}")),
            row["ratio_to_llama_server"]
                .as_f64()
                .map_or("-".to_string(), |r| format!("{r:.2}")),
            row["engine_unsplit_batched_tokens_per_s"]
                .as_f64()
                .unwrap_or(0.0),
        );
    }
    out
}
