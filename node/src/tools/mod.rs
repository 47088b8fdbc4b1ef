//! Tools built on the runtime: the vector generators (`vectors`, over the
//! deterministic `simulate`d run), benchmarks (and the UDP delay proxy the
//! WAN bench puts between nodes), and the `exercise` command.

pub mod bare_hop;
pub mod bench;
pub mod bench_api;
pub mod bench_audit;
pub mod bench_concurrency;
pub mod bench_memory;
pub mod bench_mesh;
pub mod bench_split;
pub mod bench_wan;
pub mod delay_proxy;
pub mod exercise;
pub mod simulate;
pub mod vectors;
