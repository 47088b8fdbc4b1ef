//! `mesh-node`: parse the command line and run the command.

use std::process::ExitCode;

use clap::Parser;
use mesh_node::cli::args::Cli;

fn main() -> ExitCode {
    // Before any thread starts: threads made later then share the arena.
    mesh_stage::kernels::share_one_heap_arena();
    match mesh_node::cli::commands::run(Cli::parse()) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("mesh-node: {error:#}");
            ExitCode::from(1)
        }
    }
}
