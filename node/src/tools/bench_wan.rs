//! `mesh-node bench wan`: a split served through UDP delay proxies on
//! 127.0.0.1, one in front of every node, so each link between two nodes
//! has the round-trip time asked for. For each configuration it reports
//! the time per output token, and what the delay costs a token: the
//! coordinator's mean decode round trip (from sending a step's activation
//! to reading the final hidden state) minus the same configuration's at
//! zero delay through the same proxies, measured in the same round. That
//! is set next to two anchors: the floor (the one-way delays a decode step
//! crosses: relayed return crosses every link twice, direct return each
//! link down once plus the final stage's link home) and Mesh-LLM's
//! published cost of 2 x RTT + 4.9 ms per stage boundary.
//!
//! With `--draft-tokens K` the coordinator drafts K tokens (with
//! `--draft-model`, else by prompt lookup) after each token it samples and the chain verifies them in the same step
//! (speculative decoding): a decode round trip then gives one token and its
//! accepted drafts, and a token's share of the round trip can fall below
//! one round trip of the chain (`below_round_trip`). Each row reports how
//! many drafts were proposed and accepted.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use mesh_protocol::block::ReturnMode;
use serde_json::{Value, json};

use crate::runtime::serve::{GenerateRequest, generate_remote, one_way_hops_per_step};
use crate::tools::bench::{completed, decode_tokens, median};
use crate::tools::bench_split::{BenchSplit, bench_prompt, unsplit_generation};
use crate::tools::delay_proxy::LinkShape;

/// Mesh-LLM's published added time per stage boundary, beyond two round
/// trips (GLM-4.7-Flash split over a 20 ms WAN link: +44.9 ms per token,
/// Mesh-LLM/mesh-llm `docs/skippy/WAN_SPLIT_PERF.md`).
pub const MESH_LLM_BOUNDARY_MS: f64 = 4.9;

/// What `bench wan` measures.
#[derive(Debug, Clone)]
pub struct WanBench {
    pub model: PathBuf,
    pub rtts_ms: Vec<f64>,
    pub stages: Vec<usize>,
    pub jitter_ms: f64,
    pub loss: f64,
    pub tokens: usize,
    pub rounds: usize,
    pub seed: u64,
    /// Tokens drafted after each sampled token (0: plain decoding).
    pub draft_tokens: Vec<usize>,
    /// Drafted by this model, else by prompt lookup.
    pub draft_model: Option<PathBuf>,
    /// The prompt, else `bench_prompt`'s.
    pub prompt: Option<String>,
}

pub async fn bench_wan(bench: &WanBench) -> anyhow::Result<Value> {
    anyhow::ensure!(
        bench.stages.iter().all(|s| (2..=8).contains(s)),
        "--stages takes 2 to 8 stages"
    );
    anyhow::ensure!(
        bench.rtts_ms.iter().all(|r| (0.0..=2_000.0).contains(r)),
        "--rtt-ms takes round-trip times of 0 to 2000 ms"
    );
    anyhow::ensure!(
        (0.0..=0.5).contains(&bench.loss),
        "--loss-percent takes 0 to 50"
    );
    anyhow::ensure!(bench.tokens >= 2, "--tokens must be at least 2");
    anyhow::ensure!(bench.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(
        !bench.draft_tokens.is_empty()
            && bench
                .draft_tokens
                .iter()
                .all(|d| *d <= crate::runtime::serve::MAX_DRAFT_TOKENS),
        "--draft-tokens takes 0 to {} tokens",
        crate::runtime::serve::MAX_DRAFT_TOKENS
    );
    let prompt = match &bench.prompt {
        Some(prompt) => prompt.clone(),
        None => bench_prompt(&bench.model, None)?,
    };
    let request = GenerateRequest {
        chat: true,
        ..GenerateRequest::greedy(&prompt, bench.tokens)
    };
    // Zero delay through the same proxies is every row's baseline: what a
    // delay costs is the decode round trip over it.
    let mut rtts = bench.rtts_ms.clone();
    if !rtts.contains(&0.0) {
        rtts.insert(0, 0.0);
    }
    let mut configurations = Vec::new();
    for &rtt in &rtts {
        for &stages in &bench.stages {
            for return_mode in [ReturnMode::Relayed, ReturnMode::Direct] {
                for &drafts in &bench.draft_tokens {
                    configurations.push((rtt, stages, return_mode, drafts));
                }
            }
        }
    }
    // Rounds interleave every configuration, and the compute a token takes
    // unsplit is measured once per round: this machine's speed drifts.
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); configurations.len()];
    for round in 0..bench.rounds {
        let unsplit = unsplit_generation(
            &bench.model,
            &prompt,
            true,
            bench.tokens,
            &mesh_stage::Device::Cpu,
        )
        .await?;
        let compute_ms = 1e3 / unsplit.decode_tokens_per_s.max(1e-9);
        for (i, &(rtt, stages, return_mode, drafts)) in configurations.iter().enumerate() {
            // The baseline is the proxies alone: no delay, jitter or loss.
            let shape = if rtt == 0.0 {
                LinkShape {
                    one_way: Duration::ZERO,
                    jitter: Duration::ZERO,
                    loss: 0.0,
                }
            } else {
                LinkShape {
                    one_way: Duration::from_secs_f64(rtt / 2e3),
                    jitter: Duration::from_secs_f64(bench.jitter_ms / 1e3),
                    loss: bench.loss,
                }
            };
            let seed = bench.seed.wrapping_add(round as u64);
            let split = BenchSplit::behind_proxies(
                &bench.model,
                stages,
                return_mode,
                (shape, seed),
                (drafts, bench.draft_model.as_deref()),
            )
            .await
            .context("starting the split behind its proxies")?;
            let requester = split.requester_addr()?;
            // Warm up (handshakes, assignment, slice loads), then measure.
            let warm = generate_remote(
                &requester,
                &GenerateRequest {
                    max_tokens: 2,
                    ..request.clone()
                },
                &mut |_| {},
            )
            .await;
            let measured = match warm.and_then(completed) {
                Ok(_) => generate_remote(&requester, &request, &mut |_| {})
                    .await
                    .and_then(completed),
                Err(e) => Err(e),
            };
            let proxies = split
                .shutdown()
                .await
                .into_iter()
                .map(|c| {
                    json!({
                        "relayed": c.relayed,
                        "dropped": c.dropped,
                        "over_mtu": c.over_mtu,
                        "mean_late_us": c.mean_late_us,
                        "max_late_us": c.max_late_us,
                        "mean_read_wait_us": c.mean_read_wait_us,
                        "priority_raised": c.priority_raised,
                    })
                })
                .collect();
            let summary = measured.with_context(|| {
                format!(
                    "{stages} stages, {} return, {rtt} ms RTT, {drafts} draft tokens",
                    return_mode.as_str()
                )
            })?;
            let d = &summary.details;
            let hops = one_way_hops_per_step(stages, return_mode);
            let decode_tokens = decode_tokens(d);
            samples[i].push(Sample {
                ms_per_token: 1e3 / d["decode_tokens_per_s"].as_f64().unwrap_or(0.0).max(1e-9),
                compute_ms_per_token: compute_ms,
                chain_engine_ms_per_token: d["decode_engine_ms"].as_f64().unwrap_or(0.0)
                    / decode_tokens,
                chain_ms_per_token: d["per_hop_overhead_us"].as_f64().unwrap_or(0.0) * hops as f64
                    / 1e3,
                decode_round_trip_ms: d["decode_round_trip_ms"].as_f64().unwrap_or(0.0),
                // A step's round trip shared by the tokens it gave.
                decode_wait_ms_per_token: d["decode_round_trip_ms"].as_f64().unwrap_or(0.0)
                    * d["decode_steps"].as_f64().unwrap_or(0.0)
                    / decode_tokens,
                generated: d["generated_tokens"].as_u64().unwrap_or(0),
                decode_steps: d["decode_steps"].as_u64().unwrap_or(0),
                spec_proposed: d["spec_proposed"].as_u64().unwrap_or(0),
                spec_accepted: d["spec_accepted"].as_u64().unwrap_or(0),
                proxies,
            });
        }
    }
    let mut rows = Vec::new();
    for (&(rtt, stages, return_mode, drafts), samples_of) in configurations.iter().zip(&samples) {
        let hops = one_way_hops_per_step(stages, return_mode);
        // Jitter's mean is a lower bound of what it adds: datagrams keep
        // their order, so a late one holds back those behind it.
        let jitter_ms = if rtt == 0.0 { 0.0 } else { bench.jitter_ms };
        let floor_ms = hops as f64 * (rtt / 2.0 + jitter_ms / 2.0);
        let baseline = configurations
            .iter()
            .position(|&(r, s, m, d)| r == 0.0 && s == stages && m == return_mode && d == drafts)
            .context("every configuration has its zero-delay baseline")?;
        // Round by round, so both figures of a difference come from the
        // same minute of this machine.
        let delay_cost_ms = median(
            samples_of
                .iter()
                .zip(&samples[baseline])
                .map(|(s, zero)| s.decode_wait_ms_per_token - zero.decode_wait_ms_per_token),
        );
        let samples = samples_of;
        let ms_per_token = median(samples.iter().map(|s| s.ms_per_token));
        let compute_ms = median(samples.iter().map(|s| s.compute_ms_per_token));
        let overhead_ms = median(
            samples
                .iter()
                .map(|s| s.ms_per_token - s.compute_ms_per_token),
        );
        let chain_ms = median(samples.iter().map(|s| s.chain_ms_per_token));
        // The figure: a token's time minus the compute its own
        // chain reports for it (every stage's forward passes on decode
        // steps, the coordinator's slice and head included), so what is
        // left is links, the hand-offs between threads (to and from each
        // slice's worker too) and the coordinator's bookkeeping. A draft
        // model's time is in what is left.
        let chain_engine_ms = median(samples.iter().map(|s| s.chain_engine_ms_per_token));
        let minus_compute_ms = median(
            samples
                .iter()
                .map(|s| s.ms_per_token - s.chain_engine_ms_per_token),
        );
        let proposed: u64 = samples.iter().map(|s| s.spec_proposed).sum();
        let accepted: u64 = samples.iter().map(|s| s.spec_accepted).sum();
        let steps: u64 = samples.iter().map(|s| s.decode_steps).sum();
        let generated: u64 = samples.iter().map(|s| s.generated).sum();
        rows.push(json!({
            "rtt_ms": rtt,
            "stages": stages,
            "return_mode": return_mode.as_str(),
            "draft_tokens": drafts,
            "drafts_from": match (drafts, &bench.draft_model) {
                (0, _) => None,
                (_, Some(model)) => Some(model.display().to_string()),
                (_, None) => Some("prompt lookup".to_string()),
            },
            "spec_proposed": proposed,
            "spec_accepted": accepted,
            "acceptance": if proposed == 0 { 0.0 } else { accepted as f64 / proposed as f64 },
            // Tokens each decode step gave (1 without drafts).
            "tokens_per_step": generated.saturating_sub(samples.len() as u64) as f64 / steps.max(1) as f64,
            // Below one round trip of the chain per token: only drafts
            // accepted get there.
            "below_round_trip": rtt > 0.0 && ms_per_token < floor_ms,
            "rounds": samples.len(),
            "generated_tokens": samples.iter().map(|s| s.generated).collect::<Vec<_>>(),
            "ms_per_token": ms_per_token,
            "ms_per_token_samples": samples.iter().map(|s| s.ms_per_token).collect::<Vec<_>>(),
            "compute_ms_per_token": compute_ms,
            "overhead_ms_per_token": overhead_ms,
            "chain_engine_ms_per_token": chain_engine_ms,
            "minus_compute_ms_per_token": minus_compute_ms,
            "minus_compute_over_floor_ms": minus_compute_ms - floor_ms,
            "chain_overhead_ms_per_token": chain_ms,
            "one_way_delays_per_token": hops,
            "floor_ms_per_token": floor_ms,
            "over_floor_ms": overhead_ms - floor_ms,
            "chain_over_floor_ms": chain_ms - floor_ms,
            "decode_round_trip_ms": median(samples.iter().map(|s| s.decode_round_trip_ms)),
            "delay_cost_ms_per_token": delay_cost_ms,
            "delay_cost_over_floor_ms": delay_cost_ms - floor_ms,
            "mesh_llm_ms_per_token": (stages - 1) as f64 * (2.0 * rtt + MESH_LLM_BOUNDARY_MS),
            "proxies": samples.last().map(|s| s.proxies.clone()),
        }));
    }
    Ok(json!({
        "model": bench.model.display().to_string(),
        "decode_tokens": bench.tokens,
        "prompt": prompt,
        "rounds": bench.rounds,
        "jitter_ms": bench.jitter_ms,
        "loss": bench.loss,
        "seed": bench.seed,
        "rows": rows,
    }))
}

/// One measurement of one configuration.
#[derive(Debug, Clone)]
struct Sample {
    ms_per_token: f64,
    /// The whole model's decode compute per token, unsplit in this
    /// process, measured once per round.
    compute_ms_per_token: f64,
    /// The engine time per decode token its own chain reported.
    chain_engine_ms_per_token: f64,
    /// The coordinator's step round trips minus the compute the stages
    /// report, per token: what the links and hand-offs cost.
    chain_ms_per_token: f64,
    /// The coordinator's mean decode step, from sending its activation to
    /// reading the final hidden state: the chain's compute and its links.
    decode_round_trip_ms: f64,
    /// The decode round trips per token: a step's round trip divided by
    /// the tokens it gave (one, without drafts).
    decode_wait_ms_per_token: f64,
    generated: u64,
    decode_steps: u64,
    spec_proposed: u64,
    spec_accepted: u64,
    proxies: Vec<Value>,
}

/// `bench wan` for people.
pub fn render_wan(report: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model {}  {} decode tokens, greedy, medians of {} rounds; jitter {} ms, loss {:.1} %, seed {}",
        report["model"].as_str().unwrap_or(""),
        report["decode_tokens"],
        report["rounds"],
        report["jitter_ms"],
        100.0 * report["loss"].as_f64().unwrap_or(0.0),
        report["seed"],
    );
    let _ = writeln!(
        out,
        "{:>7} {:>6} {:>8} {:>6} {:>8} {:>9} {:>8} {:>8} {:>7} {:>8} {:>10} {:>9} {:>9}",
        "RTT ms",
        "stages",
        "return",
        "drafts",
        "tok/step",
        "ms/token",
        "compute",
        "minus c.",
        "floor",
        "- floor",
        "delay cost",
        "- floor",
        "Mesh-LLM"
    );
    for row in report["rows"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:>7.1} {:>6} {:>8} {:>6} {:>8.2} {:>9.2} {:>8.2} {:>8.2} {:>7.2} {:>+8.2} {:>10.2} {:>+9.2} {:>9.1}",
            row["rtt_ms"].as_f64().unwrap_or(0.0),
            row["stages"],
            row["return_mode"].as_str().unwrap_or(""),
            row["draft_tokens"],
            row["tokens_per_step"].as_f64().unwrap_or(0.0),
            row["ms_per_token"].as_f64().unwrap_or(0.0),
            row["chain_engine_ms_per_token"].as_f64().unwrap_or(0.0),
            row["minus_compute_ms_per_token"].as_f64().unwrap_or(0.0),
            row["floor_ms_per_token"].as_f64().unwrap_or(0.0),
            row["minus_compute_over_floor_ms"].as_f64().unwrap_or(0.0),
            row["delay_cost_ms_per_token"].as_f64().unwrap_or(0.0),
            row["delay_cost_over_floor_ms"].as_f64().unwrap_or(0.0),
            row["mesh_llm_ms_per_token"].as_f64().unwrap_or(0.0),
        );
    }
    out
}
