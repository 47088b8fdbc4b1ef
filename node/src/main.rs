use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use mesh_protocol::json::parse_strict;
use mesh_protocol::verify::verify_document;

/// mesh-node: serve language models split by layers across machines, with
/// hand-offs a requester can check offline.
#[derive(Debug, Parser)]
#[command(name = "mesh-node", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check a bundle or hop-check case offline: ids, signatures, inclusion
    /// proofs and hop agreement. Exit 0: all checks pass and hand-offs agree;
    /// 1: understood, but something failed; 2: the input cannot be read.
    Verify {
        /// Print one JSON object instead of tables.
        #[arg(long)]
        json: bool,
        /// A hop case {own, receipt, carried}, a Mesh-LLM record_push_bundle,
        /// or a mesh_bundle written by mesh-node.
        file: PathBuf,
    },
    /// Write or check this project's conformance vectors.
    Vectors {
        #[command(subcommand)]
        action: VectorsAction,
    },
    /// Measure performance.
    Bench {
        #[command(subcommand)]
        target: BenchTarget,
    },
}

#[derive(Debug, Subcommand)]
enum VectorsAction {
    /// Regenerate the vectors into DIR.
    Write {
        #[arg(long, default_value = "vectors")]
        dir: PathBuf,
    },
    /// Exit 1 when regenerating would change any file in DIR.
    Check {
        #[arg(long, default_value = "vectors")]
        dir: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum BenchTarget {
    /// Lane-fold throughput for 4 KiB and 64 KiB frames, next to plain SHA-256.
    Fold {
        /// Seconds to measure each case.
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
    },
}

/// Exit status for input that cannot be read.
const EXIT_UNREADABLE: u8 = 2;

fn verify(file: &Path, as_json: bool) -> ExitCode {
    let shown = file.display().to_string();
    let bytes = match std::fs::read(file) {
        Ok(bytes) => bytes,
        Err(error) => {
            eprintln!("mesh-node verify: cannot read {shown}: {error}");
            return ExitCode::from(EXIT_UNREADABLE);
        }
    };
    let document = match parse_strict(&bytes) {
        Ok(document) => document,
        Err(error) => {
            eprintln!("mesh-node verify: {shown}: not valid JSON: {error}");
            return ExitCode::from(EXIT_UNREADABLE);
        }
    };
    let report = match verify_document(&document) {
        Ok(report) => report,
        Err(error) => {
            eprintln!("mesh-node verify: {shown}: at {error}");
            return ExitCode::from(EXIT_UNREADABLE);
        }
    };
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_value()).unwrap_or_default()
        );
    } else {
        print!("{}", mesh_node::render::render(&shown, &report));
    }
    if report.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Verify { json, file } => Ok(verify(&file, json)),
        Command::Vectors {
            action: VectorsAction::Write { dir },
        } => {
            let changed = mesh_node::vectors::write_or_check(&dir, false)?;
            println!(
                "wrote {} changed file(s) under {}",
                changed.len(),
                dir.display()
            );
            for file in changed {
                println!("  {file}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Vectors {
            action: VectorsAction::Check { dir },
        } => {
            let differing = mesh_node::vectors::write_or_check(&dir, true)?;
            if differing.is_empty() {
                println!("vectors under {} are up to date", dir.display());
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!(
                    "vectors under {} differ from the generator; run `mesh-node vectors write`:",
                    dir.display()
                );
                for file in differing {
                    eprintln!("  {file}");
                }
                Ok(ExitCode::from(1))
            }
        }
        Command::Bench {
            target: BenchTarget::Fold { seconds },
        } => {
            let min_time = Duration::try_from_secs_f64(seconds)
                .context("--seconds must be a positive number")?;
            println!(
                "lane fold (skippy-stage-frames/v1) vs plain SHA-256 of the same frame, one thread"
            );
            println!(
                "{:>10} {:>12} {:>14} {:>8} {:>12}",
                "frame", "fold MB/s", "sha256 MB/s", "ratio", "µs/frame"
            );
            for m in mesh_node::bench::bench_fold(&[4096, 65_536], min_time) {
                println!(
                    "{:>10} {:>12.0} {:>14.0} {:>8.3} {:>12.2}",
                    format!("{} KiB", m.frame_bytes / 1024),
                    m.fold_mb_per_s,
                    m.sha256_mb_per_s,
                    m.fold_mb_per_s / m.sha256_mb_per_s,
                    m.fold_us_per_frame
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("mesh-node: {error:#}");
            ExitCode::from(1)
        }
    }
}
