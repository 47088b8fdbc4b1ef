//! `mesh-node bench fold`: the lane fold's throughput against plain SHA-256
//! over the same bytes, measured side by side in one run.

use std::time::{Duration, Instant};

use mesh_protocol::fold::{Lane, LaneContext, LaneFold};
use sha2::{Digest, Sha256};

/// One measured frame size.
#[derive(Debug, Clone)]
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
    let context = LaneContext {
        salt: b"",
        coordinator_node_id: "bench-coordinator",
        run_id: "bench-run",
        request_id: 1,
        hop_index: 0,
        lane: Lane::Forward,
    };
    frame_sizes
        .iter()
        .map(|&size| {
            let frame: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
            let mut fold = LaneFold::new(&context);
            let (fold_frames, fold_time) = measure(min_time, || fold.push_frame(&frame));
            std::hint::black_box(fold.digest());
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
pub fn bench_steward(dir: &std::path::Path, serves: u32) -> anyhow::Result<String> {
    use std::fmt::Write;

    use mesh_protocol::grant::{GrantGate, Presentation};
    use mesh_protocol::mesh1::{Fidelity, MeshReceipt, ServeRequest, prompt_hash};

    use crate::energy::EstimatorMeter;
    use crate::exercise::{exercise_chain, requester_key};
    use crate::steward::Steward;

    let key = mesh_protocol::SigningKey::from_bytes(&crate::keys::random_bytes()?);
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
            crate::keys::random_bytes()?,
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
            request_id: request.request_id(),
            grant_id: metered.grant_id,
            backend: "bench".into(),
            recipe: "bench".into(),
            weights: None,
            route: "local".into(),
            tokens_in: 4,
            tokens_out: 1,
            tokens_accepted: 1,
            cache_hit_tokens: 0,
            spec_proposed: 0,
            spec_accepted: 0,
            fidelity_floor: Fidelity::F0,
            fidelity: None,
            fidelity_rating: Fidelity::F0,
            energy: metered.energy,
            decision: None,
            grant_breach: None,
            output_commitment: Some([0; 32]),
            sequence: 0,
            prev: None,
            nonce: [0; 16],
            steward: String::new(),
            split: None,
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

    let mut out = String::new();
    writeln!(
        out,
        "steward overhead per serve, {} serves, journal with fsync on every append:",
        totals.len()
    )?;
    writeln!(out, "{:>26} {:>9} {:>9}", "", "p50 ms", "p90 ms")?;
    for (name, samples) in [
        ("authorise + journal", &authorise),
        ("debit + journal", &debit),
        ("seal + journal", &seal),
        ("total", &totals),
    ] {
        writeln!(
            out,
            "{name:>26} {:>9.3} {:>9.3}",
            percentile(samples, 0.5),
            percentile(samples, 0.9)
        )?;
    }
    let seal_secs: f64 = seal.iter().map(Duration::as_secs_f64).sum();
    writeln!(
        out,
        "receipts sealed per second (sign + journal fsync): {:.0}",
        seal.len() as f64 / seal_secs.max(1e-9)
    )?;
    writeln!(
        out,
        "grant decisions per second (decide + debit, in memory, {decided} decided): {:.0}",
        f64::from(decided) / decide_time.as_secs_f64().max(1e-9)
    )?;
    Ok(out)
}
