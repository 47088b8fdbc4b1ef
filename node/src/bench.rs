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
