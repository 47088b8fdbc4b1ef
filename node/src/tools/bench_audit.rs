//! `mesh-node bench audit`: what audits cost a coordinator's throughput.
//! A three-node split in this process (direct return) serves the same
//! greedy requests one after another at each audit rate, in rounds that
//! rotate the order; throughput is tokens over the wall time from the
//! first request sent to the last bundle received (an audit runs before
//! its request's bundle is sealed, so its cost is inside that time), and
//! each rate's ratio to no audits is taken within its round.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use mesh_protocol::block::ReturnMode;
use serde_json::{Value, json};

use crate::runtime::serve::{GenerateRequest, generate_remote};
use crate::tools::bench::{completed, median};
use crate::tools::bench_split::{BenchSplit, bench_prompt};

/// One rate's run in one round.
struct Measured {
    tokens_per_s: f64,
    audited: usize,
}

async fn serve_at(
    model: &Path,
    rate: f64,
    request: &GenerateRequest,
    requests: usize,
) -> anyhow::Result<Measured> {
    let split = BenchSplit::audited(model, 3, ReturnMode::Direct, rate).await?;
    let coordinator = split.coordinator.peer_addr();
    // Warm up (assignment, slice loads) without an audit in the count.
    let warm = GenerateRequest {
        max_tokens: 2,
        ..request.clone()
    };
    completed(generate_remote(&coordinator, &warm, &mut |_| {}).await?)?;
    let started = Instant::now();
    let mut tokens = 0;
    let mut audited = 0;
    for _ in 0..requests {
        let summary = completed(generate_remote(&coordinator, request, &mut |_| {}).await?)?;
        tokens += summary.details["generated_tokens"].as_u64().unwrap_or(0);
        let bundle = summary.bundle.as_ref().context("a bundle")?;
        audited += usize::from(bundle.get("audit").is_some());
    }
    let elapsed = started.elapsed().as_secs_f64();
    split.shutdown().await;
    Ok(Measured {
        tokens_per_s: tokens as f64 / elapsed.max(1e-9),
        audited,
    })
}

pub async fn bench_audit(
    model: &Path,
    tokens: usize,
    requests: usize,
    rounds: usize,
    rates: &[f64],
) -> anyhow::Result<Value> {
    anyhow::ensure!(
        rounds >= 1 && requests >= 1,
        "--rounds and --requests: at least 1"
    );
    anyhow::ensure!(
        rates.first() == Some(&0.0) && rates.iter().all(|r| (0.0..=1.0).contains(r)),
        "--rates: 0 first (the baseline), each 0 to 1"
    );
    let prompt = bench_prompt(model, None)?;
    let chat = mesh_stage::ModelHandle::open(model)?
        .text()?
        .chat_template()
        .is_ok();
    let request = GenerateRequest {
        chat,
        ..GenerateRequest::greedy(&prompt, tokens)
    };
    let mut runs: Vec<Vec<(f64, usize)>> = vec![Vec::new(); rates.len()];
    for round in 0..rounds {
        let mut measured: Vec<Option<Measured>> = (0..rates.len()).map(|_| None).collect();
        for place in 0..rates.len() {
            let i = (place + round) % rates.len();
            measured[i] = Some(serve_at(model, rates[i], &request, requests).await?);
        }
        let baseline = measured[0].as_ref().map_or(0.0, |m| m.tokens_per_s);
        for (i, m) in measured.into_iter().enumerate() {
            let m = m.context("every rate runs in every round")?;
            runs[i].push((m.tokens_per_s / baseline.max(1e-9), m.audited));
        }
    }
    let rows: Vec<Value> = rates
        .iter()
        .zip(&runs)
        .map(|(rate, runs)| {
            json!({
                "audit_rate": rate,
                "ratio_to_no_audits": median(runs.iter().map(|(ratio, _)| *ratio)),
                "ratio_samples": runs.iter().map(|(ratio, _)| *ratio).collect::<Vec<_>>(),
                "requests_audited": runs.iter().map(|(_, audited)| *audited).sum::<usize>(),
                "requests": requests * rounds,
            })
        })
        .collect();
    // The cost of auditing every request, scaled to a rate: what a rate
    // costs on average, however few of its requests a short run samples.
    let every = rates
        .iter()
        .position(|r| *r == 1.0)
        .map(|i| 1.0 - median(runs[i].iter().map(|(ratio, _)| *ratio)));
    Ok(json!({
        "model": model.display().to_string(),
        "stages": 3,
        "tokens": tokens,
        "requests_per_run": requests,
        "rounds": rounds,
        "rows": rows,
        "cost_of_auditing_every_request": every,
        "expected_ratio_at_rate": every.map(|cost| rates.iter().map(|r| json!({
            "audit_rate": r, "ratio": 1.0 - r * cost,
        })).collect::<Vec<_>>()),
    }))
}

pub fn render_audit(report: &Value) -> String {
    let mut out = format!(
        "audits: 3-stage split, {} requests of {} tokens per run, {} rounds\n",
        report["requests_per_run"], report["tokens"], report["rounds"]
    );
    for row in report["rows"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "  rate {:<5} throughput {:.3} of no audits ({} of {} requests audited)\n",
            row["audit_rate"],
            row["ratio_to_no_audits"].as_f64().unwrap_or(0.0),
            row["requests_audited"],
            row["requests"],
        ));
    }
    if let Some(cost) = report["cost_of_auditing_every_request"].as_f64() {
        out.push_str(&format!(
            "  auditing every request costs {:.1} % of throughput; a rate r costs r times that\n",
            cost * 100.0
        ));
    }
    out
}
