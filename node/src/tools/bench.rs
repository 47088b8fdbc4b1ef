//! `mesh-node bench fold`: the lane fold's throughput against plain SHA-256
//! over the same bytes, measured side by side in one run.

use std::fmt::Write;
use std::time::{Duration, Instant};

use mesh_protocol::block::{ReturnMode, SplitKey};
use mesh_protocol::session::{HopSession, RequestScope, Wire};
use sha2::{Digest, Sha256};

/// The tokens a served request decoded, from its coordinator's details:
/// all but the first, which ends the prefill (at least one, so per-token
/// figures divide by it safely).
pub(crate) fn decode_tokens(details: &serde_json::Value) -> f64 {
    (details["generated_tokens"].as_f64().unwrap_or(0.0) - 1.0).max(1.0)
}

/// A benchmark's served request, or an error when it did not complete: a
/// failed request is never folded into a figure.
pub(crate) fn completed(
    summary: crate::runtime::serve::GenerateSummary,
) -> anyhow::Result<crate::runtime::serve::GenerateSummary> {
    if summary.terminal_state != mesh_protocol::block::TerminalState::Completed.as_str()
        || summary.error.is_some()
    {
        anyhow::bail!(
            "the request ended {}: {}",
            summary.terminal_state,
            summary.error.as_deref().unwrap_or("no reason given")
        );
    }
    Ok(summary)
}

/// The median (the mean of the middle two for an even count; 0 for none).
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.into_iter().collect();
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// One measured frame size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FoldMeasurement {
    pub frame_bytes: usize,
    pub fold_mb_per_s: f64,
    pub sha256_mb_per_s: f64,
    pub fold_us_per_frame: f64,
}

fn measure(min_time: Duration, mut work: impl FnMut()) -> (u64, Duration) {
    // Warm up, then run whole batches until the minimum time has passed.
    work();
    let start = Instant::now();
    let mut iterations = 0u64;
    while start.elapsed() < min_time {
        for _ in 0..16 {
            work();
        }
        iterations += 16;
    }
    (iterations, start.elapsed())
}

/// Measure the fold for each frame size, at least `min_time` each.
pub fn bench_fold(frame_sizes: &[usize], min_time: Duration) -> Vec<FoldMeasurement> {
    // The serving path's own fold: a hop session's forward lane.
    let scope = RequestScope {
        split: SplitKey {
            coordinator_node_id: "bench-coordinator".into(),
            run_id: "bench-run".into(),
            request_id: 1,
        },
        stage_count: 2,
        return_mode: ReturnMode::Relayed,
    };
    frame_sizes
        .iter()
        .map(|&size| {
            let frame: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
            let mut session = HopSession::new(scope.clone(), 0);
            let (fold_frames, fold_time) = measure(min_time, || {
                session.fold(Wire::ToDownstream, &frame);
            });
            std::hint::black_box(session.digests());
            let mut sink = [0u8; 32];
            let (hash_frames, hash_time) = measure(min_time, || {
                let digest: [u8; 32] = Sha256::digest(&frame).into();
                sink[0] ^= digest[0];
            });
            std::hint::black_box(sink);
            let rate = |frames: u64, time: Duration| {
                (frames as f64 * size as f64) / time.as_secs_f64() / 1e6
            };
            FoldMeasurement {
                frame_bytes: size,
                fold_mb_per_s: rate(fold_frames, fold_time),
                sha256_mb_per_s: rate(hash_frames, hash_time),
                fold_us_per_frame: fold_time.as_secs_f64() * 1e6 / fold_frames as f64,
            }
        })
        .collect()
}

/// `mesh-node bench steward`: what the steward costs a serve.
pub fn bench_steward(dir: &std::path::Path, serves: u32) -> anyhow::Result<serde_json::Value> {
    use mesh_protocol::grant::{GrantGate, Presentation};
    use mesh_protocol::mesh1::{Fidelity, MeshReceipt, ServeRequest, prompt_hash};

    use crate::runtime::energy::EstimatorMeter;
    use crate::runtime::steward::Steward;
    use crate::tools::exercise::{exercise_chain, requester_key};

    let key = mesh_protocol::SigningKey::from_bytes(&crate::runtime::keys::random_bytes()?);
    let mut steward = Steward::open(dir, key, Box::new(EstimatorMeter::default()))?;
    let chain = exercise_chain(steward.did())?;
    let request_for = |i: u32| ServeRequest {
        prompt_hash: prompt_hash(&i.to_le_bytes()),
        prompt_tokens: 4,
        max_tokens: 4,
        fidelity_floor: Fidelity::F0,
        joule_ceiling_uj: 1,
        decision: None,
    };
    let mut authorise = Vec::new();
    let mut debit = Vec::new();
    let mut seal = Vec::new();
    for i in 0..serves {
        let request = request_for(i);
        let presentation = Presentation::sign(
            chain.clone(),
            &request.request_id(),
            &requester_key(),
            crate::runtime::keys::random_bytes()?,
        )?;
        let t0 = Instant::now();
        let mut ticket = steward.authorise(
            Some(&presentation),
            &request,
            None,
            "bench",
            1_800_000_000_000,
        )?;
        let t1 = Instant::now();
        steward.begin_engine(&mut ticket);
        let metered = steward.end_engine(ticket, None)?;
        let t2 = Instant::now();
        let receipt = MeshReceipt {
            grant_id: metered.grant_id,
            tokens_in: 4,
            tokens_out: 1,
            tokens_accepted: 1,
            output_commitment: Some([0; 32]),
            ..MeshReceipt::blank(
                request.request_id(),
                "bench",
                "bench",
                "local",
                metered.energy,
                [0; 16],
            )
        };
        steward.seal(receipt)?;
        let t3 = Instant::now();
        authorise.push(t1 - t0);
        debit.push(t2 - t1);
        seal.push(t3 - t2);
    }
    let totals: Vec<Duration> = (0..authorise.len())
        .map(|i| authorise[i] + debit[i] + seal[i])
        .collect();
    let percentile = |samples: &[Duration], p: f64| -> f64 {
        let mut sorted = samples.to_vec();
        sorted.sort();
        sorted
            .get(((sorted.len() as f64 - 1.0) * p).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };

    // Grant decisions in memory: decide + debit, no journal.
    let mut gate = GrantGate::new(steward.did());
    let decisions = 2_000u32;
    let presentations: Vec<(ServeRequest, Presentation)> = (0..decisions)
        .map(|i| {
            let request = request_for(1_000_000 + i);
            let mut nonce = [0u8; 16];
            nonce[..4].copy_from_slice(&i.to_le_bytes());
            let presentation = Presentation::sign(
                chain.clone(),
                &request.request_id(),
                &requester_key(),
                nonce,
            )?;
            Ok((request, presentation))
        })
        .collect::<anyhow::Result<_>>()?;
    let start = Instant::now();
    let mut decided = 0u32;
    for (request, presentation) in &presentations {
        if let Ok(authorisation) = gate.decide(presentation, request, None, 1_800_000_000_000) {
            gate.debit(&authorisation, 1);
            decided += 1;
        }
    }
    let decide_time = start.elapsed();

    let phases: Vec<serde_json::Value> = [
        ("authorise + journal", &authorise),
        ("debit + journal", &debit),
        ("seal + journal", &seal),
        ("total", &totals),
    ]
    .into_iter()
    .map(|(name, samples)| {
        serde_json::json!({
            "phase": name,
            "p50_ms": percentile(samples, 0.5),
            "p90_ms": percentile(samples, 0.9),
        })
    })
    .collect();
    let seal_secs: f64 = seal.iter().map(Duration::as_secs_f64).sum();
    Ok(serde_json::json!({
        "serves": totals.len(),
        "phases": phases,
        "receipts_sealed_per_s": seal.len() as f64 / seal_secs.max(1e-9),
        "grant_decisions": decided,
        "grant_decisions_per_s": f64::from(decided) / decide_time.as_secs_f64().max(1e-9),
    }))
}

/// `bench steward` for people.
pub fn render_steward(report: &serde_json::Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "steward overhead per serve, {} serves, journal with fsync on every append:",
        report["serves"]
    );
    let _ = writeln!(out, "{:>26} {:>9} {:>9}", "", "p50 ms", "p90 ms");
    for phase in report["phases"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:>26} {:>9.3} {:>9.3}",
            phase["phase"].as_str().unwrap_or(""),
            phase["p50_ms"].as_f64().unwrap_or(0.0),
            phase["p90_ms"].as_f64().unwrap_or(0.0)
        );
    }
    let _ = writeln!(
        out,
        "receipts sealed per second (sign + journal fsync): {:.0}",
        report["receipts_sealed_per_s"].as_f64().unwrap_or(0.0)
    );
    let _ = writeln!(
        out,
        "grant decisions per second (decide + debit, in memory, {} decided): {:.0}",
        report["grant_decisions"],
        report["grant_decisions_per_s"].as_f64().unwrap_or(0.0)
    );
    out
}

/// `bench fold` for people.
pub fn render_fold(measurements: &[FoldMeasurement]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "lane fold (skippy-stage-frames/v1) vs plain SHA-256 of the same frame, one thread"
    );
    let _ = writeln!(
        out,
        "{:>10} {:>12} {:>14} {:>8} {:>12}",
        "frame", "fold MB/s", "sha256 MB/s", "ratio", "µs/frame"
    );
    for m in measurements {
        let _ = writeln!(
            out,
            "{:>10} {:>12.0} {:>14.0} {:>8.3} {:>12.2}",
            format!("{} KiB", m.frame_bytes / 1024),
            m.fold_mb_per_s,
            m.sha256_mb_per_s,
            m.fold_mb_per_s / m.sha256_mb_per_s,
            m.fold_us_per_frame
        );
    }
    out
}

/// One configuration of `mesh-node bench engine`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EngineRun {
    pub execution: String,
    pub slices: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
}

/// Resident set size of this process, in bytes (Linux).
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// `mesh-node bench kernels`: each block format on the engine's kernel and
/// on candle's, on the same stored blocks: the 32-weight formats at
/// SmolLM2's shapes, the K-quants at Gemma 3's (their rows are whole
/// 256-weight superblocks); one decode row, batches of two to four decode
/// rows, and a 64-row prompt (one step).
pub fn bench_kernels() -> anyhow::Result<serde_json::Value> {
    use mesh_stage::kernels::{BlockFormat, time_against_candle};
    let smollm2 = [(1536, 576), (576, 1536), (49_152, 576)];
    let gemma3 = [(640, 2048), (640, 1024)];
    let mut rows = Vec::new();
    for format in [
        BlockFormat::Q4_0,
        BlockFormat::Q4_1,
        BlockFormat::Q5_0,
        BlockFormat::Q8_0,
        BlockFormat::Q4K,
        BlockFormat::Q5K,
        BlockFormat::Q6K,
    ] {
        let shapes: &[(usize, usize)] = match format {
            BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K => &gemma3,
            _ => &smollm2,
        };
        for &shape in shapes {
            for m in [1usize, 2, 3, 4, 64] {
                // About 0.2 s of each kernel per figure.
                let work = shape.0 * shape.1 * m;
                let rounds = (2_000_000_000 / work).clamp(3, 2000);
                let (ours, candle) = time_against_candle(format, shape, &[m], rounds)?;
                rows.push(serde_json::json!({
                    "format": format!("{format:?}"),
                    "rows": shape.0,
                    "cols": shape.1,
                    "input_rows": m,
                    "ours_us": ours * 1e6,
                    "candle_us": candle * 1e6,
                    "speedup": candle / ours.max(1e-12),
                }));
            }
        }
    }
    Ok(serde_json::json!({
        "threads": mesh_stage::compute_threads(),
        "runs": rows,
    }))
}

pub fn render_kernels(report: &serde_json::Value) -> String {
    let mut out = format!(
        "threads {}\nformat  matrix        input rows   ours us   candle us   candle/ours\n",
        report["threads"]
    );
    for r in report["runs"].as_array().into_iter().flatten() {
        out += &format!(
            "{:<7} {:>6}x{:<6} {:>10} {:>9.1} {:>11.1} {:>13.2}\n",
            r["format"].as_str().unwrap_or(""),
            r["rows"],
            r["cols"],
            r["input_rows"],
            r["ours_us"].as_f64().unwrap_or(0.0),
            r["candle_us"].as_f64().unwrap_or(0.0),
            r["speedup"].as_f64().unwrap_or(0.0),
        );
    }
    out
}

/// `mesh-node bench engine`: prefill and decode tokens/s, unsplit and split
/// in-process, for the model's own quantization and for dense f32; and the
/// memory a third of the layers holds.
pub fn bench_engine(
    model: &std::path::Path,
    prompt_tokens: usize,
    decode_tokens: usize,
    device: mesh_stage::DeviceChoice,
) -> anyhow::Result<serde_json::Value> {
    use mesh_stage::frame::WireDType;
    use mesh_stage::pipeline::Pipeline;
    use mesh_stage::sampling::{Sampler, SamplingParams};
    use mesh_stage::{ExecPolicy, ModelHandle};

    let handle = ModelHandle::open(model)?.on_device(device.open()?);
    let layers = handle.config().layers;
    // A prompt of exactly `prompt_tokens` ids, as llama-bench's -p uses.
    // (The sentence is about 22 tokens: repeated enough for any length.)
    let text = "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of Constantinople. ".repeat(64.max(prompt_tokens / 16 + 1));
    let mut prompt = handle.text()?.encode(&text)?;
    prompt.truncate(prompt_tokens);
    let memory_before = resident_bytes();
    let middle = handle.load_slice(layers / 3..2 * layers / 3)?;
    let grown = || {
        resident_bytes()
            .zip(memory_before)
            .map(|(a, b)| a.saturating_sub(b))
    };
    let memory_third = grown();
    // What the third holds once it has run: a prompt chunk and a few
    // decode steps, as a stage's first request would (candle, for one,
    // repacks its matrices on first use).
    let hidden = handle.config().hidden;
    let mut cache = middle.new_cache(64)?;
    for rows in [8, 1, 1, 1, 1] {
        let input = mesh_stage::frame::Activations {
            rows,
            cols: hidden,
            values: vec![0.01; rows * hidden],
        };
        middle.forward(mesh_stage::SliceInput::Hidden(&input), &mut cache)?;
    }
    let memory_third_ran = grown();
    let third_bytes = middle.weight_bytes();
    drop(cache);
    drop(middle);

    let mut runs = Vec::new();
    let mut whole_bytes = 0;
    for (execution, policy) in [
        ("stored quantization", ExecPolicy::default()),
        (
            "dense f32",
            ExecPolicy {
                dense_f32: true,
                ..ExecPolicy::default()
            },
        ),
    ] {
        for parts in [1u32, 3] {
            let slices = mesh_stage::even_split(layers, parts)
                .into_iter()
                .map(|r| handle.load_slice_with(r, policy))
                .collect::<mesh_stage::Result<Vec<_>>>()?;
            if parts == 1 && policy == ExecPolicy::default() {
                whole_bytes = slices[0].weight_bytes();
            }
            let pipeline = Pipeline::new(slices, WireDType::F32)?;
            // Warm up once, then measure.
            let mut sampler = Sampler::new(SamplingParams::greedy());
            pipeline.generate(
                &prompt[..prompt.len().min(8)],
                4,
                &mut sampler,
                &|_| false,
                &mut |_| {},
            )?;
            let mut sampler = Sampler::new(SamplingParams::greedy());
            let generation = pipeline.generate(
                &prompt,
                decode_tokens + 1,
                &mut sampler,
                &|_| false,
                &mut |_| {},
            )?;
            runs.push(EngineRun {
                execution: execution.to_string(),
                slices: parts as usize,
                prefill_tokens_per_s: generation.timings.prefill_tokens_per_s(),
                decode_tokens_per_s: generation.timings.decode_tokens_per_s(),
            });
        }
    }
    let ratio = |execution: &str, field: fn(&EngineRun) -> f64| -> f64 {
        let find = |n: usize| {
            runs.iter()
                .find(|r| r.execution == execution && r.slices == n)
                .map(field)
                .unwrap_or(0.0)
        };
        find(3) / find(1).max(1e-9)
    };
    let quantized = "stored quantization";
    Ok(serde_json::json!({
        "model": model.display().to_string(),
        "device": device.to_string(),
        // What a node on this device advertises to a mesh's planner (null
        // on the CPU, whose node reads the host's memory).
        "gpu_free_bytes": mesh_stage::gpu_free_memory(handle.device())?,
        "threads": mesh_stage::compute_threads(),
        "prompt_tokens": prompt.len(),
        "decode_tokens": decode_tokens,
        "runs": runs,
        "split_over_unsplit": {
            "quantized_decode": ratio(quantized, |r| r.decode_tokens_per_s),
            "quantized_prefill": ratio(quantized, |r| r.prefill_tokens_per_s),
            "f32_decode": ratio("dense f32", |r| r.decode_tokens_per_s),
            "f32_prefill": ratio("dense f32", |r| r.prefill_tokens_per_s),
        },
        "memory": {
            "whole_weight_bytes": whole_bytes,
            "middle_third_weight_bytes": third_bytes,
            "middle_third_share": third_bytes as f64 / whole_bytes.max(1) as f64,
            "middle_third_rss_delta_bytes": memory_third,
            "middle_third_rss_delta_after_running_bytes": memory_third_ran,
        },
    }))
}

/// The text form of `bench engine`'s report.
pub fn render_engine(report: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    let free = report["gpu_free_bytes"]
        .as_u64()
        .map(|bytes| format!(" ({} MiB free)", bytes >> 20))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "model {}  device {}{free}  threads {}  prompt {} tokens, decode {} tokens",
        report["model"].as_str().unwrap_or(""),
        report["device"].as_str().unwrap_or("cpu"),
        report["threads"],
        report["prompt_tokens"],
        report["decode_tokens"]
    );
    let _ = writeln!(
        out,
        "{:<42} {:>7} {:>14} {:>14}",
        "execution", "slices", "prefill tok/s", "decode tok/s"
    );
    for run in report["runs"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:<42} {:>7} {:>14.1} {:>14.1}",
            run["execution"].as_str().unwrap_or(""),
            run["slices"],
            f(&run["prefill_tokens_per_s"]),
            f(&run["decode_tokens_per_s"])
        );
    }
    let r = &report["split_over_unsplit"];
    let _ = writeln!(
        out,
        "split/unsplit (3 slices in-process): quantized decode {:.3}, prefill {:.3}; f32 decode {:.3}, prefill {:.3}",
        f(&r["quantized_decode"]),
        f(&r["quantized_prefill"]),
        f(&r["f32_decode"]),
        f(&r["f32_prefill"])
    );
    let m = &report["memory"];
    let _ = writeln!(
        out,
        "memory: the whole model holds {} B of weights; the middle third {} B ({:.1} %); RSS grew {} B loading that third, {} B once it had run 5 steps",
        m["whole_weight_bytes"],
        m["middle_third_weight_bytes"],
        100.0 * f(&m["middle_third_share"]),
        m["middle_third_rss_delta_bytes"],
        m["middle_third_rss_delta_after_running_bytes"]
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::serve::GenerateSummary;

    fn summary(terminal_state: &str, error: Option<&str>) -> GenerateSummary {
        GenerateSummary {
            text: String::new(),
            terminal_state: terminal_state.to_string(),
            error: error.map(str::to_string),
            details: serde_json::json!({ "decode_tokens_per_s": 0.0 }),
            bundle: None,
        }
    }

    #[test]
    fn only_a_completed_request_is_measured() {
        use mesh_protocol::block::TerminalState;
        assert!(completed(summary(TerminalState::Completed.as_str(), None)).is_ok());
        let failed = completed(summary(
            TerminalState::BackendError.as_str(),
            Some("a forward pass failed"),
        ))
        .unwrap_err()
        .to_string();
        assert!(failed.contains("backend_error") && failed.contains("a forward pass failed"));
        assert!(
            completed(summary(
                TerminalState::Completed.as_str(),
                Some("stage 1 went away")
            ))
            .is_err()
        );
        for state in TerminalState::ALL {
            if state != TerminalState::Completed {
                assert!(
                    completed(summary(state.as_str(), None)).is_err(),
                    "{state:?}"
                );
            }
        }
    }
}
