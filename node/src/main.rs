use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// mesh-node: serve language models split by layers across machines, with
/// hand-offs a requester can check offline.
#[derive(Debug, Parser)]
#[command(name = "mesh-node", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Threads of the async runtime (QUIC, HTTP, the mesh); by default one
    /// per core. Forward passes have their own compute threads
    /// (CANDLE_NUM_THREADS). With 1, a node's decode steps arrive, run and
    /// leave on one thread: faster on a 16-core machine, as fast over a
    /// delayed link and slower in process on a 2-core one
    /// (docs/operations.md, "I/O threads").
    #[arg(long, global = true, value_parser = clap::value_parser!(u16).range(1..=256))]
    io_threads: Option<u16>,
}

/// `--io-threads`, set once before any runtime starts.
static IO_THREADS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();

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
        /// a mesh_bundle written by mesh-node, or a mesh/1 receipt envelope
        /// (raw CBOR or hex text).
        file: PathBuf,
        /// For a mesh/1 envelope: the previous envelope of the same steward,
        /// to check the chain link.
        #[arg(long)]
        prev: Option<PathBuf>,
        /// Check instead whether the receipt (a bundle or an envelope) is
        /// covered by this weights change record (`weights show --out`):
        /// exit 0 covered, 1 not.
        #[arg(long)]
        change_record: Option<PathBuf>,
    },
    /// A backend's weights change record (SPEC §6.5), in the node's steward
    /// journal: once it has one, the node serves and seals only the weights
    /// in effect. `plan` and `record` need the node stopped.
    Weights {
        #[command(subcommand)]
        action: WeightsAction,
    },
    /// Re-execute a serve against its receipt (SPEC §6.4): prints
    /// `verified`, `diverged at token K` or `not replayable` with its reason.
    /// Exit 0 verified, 1 diverged, 3 not replayable, 2 unreadable input.
    Replay {
        /// The requester's bundle (`generate --out`), or the receipt envelope.
        bundle: PathBuf,
        /// The model file the serve ran (its weights digest must match).
        #[arg(long)]
        model: PathBuf,
        /// The prompt as it was sent.
        #[arg(long)]
        prompt_file: PathBuf,
        /// The prompt was sent with the chat template (`generate --chat`).
        #[arg(long)]
        chat: bool,
        /// The receipt's opening, hex (`mesh-node steward open`).
        #[arg(long)]
        opening: Option<String>,
        /// The output the serve disclosed: token ids as a JSON array, or
        /// `generate --json` output.
        #[arg(long)]
        output_file: Option<PathBuf>,
        /// Where to re-execute: cpu (default), cuda or cuda:N. A serve
        /// computed on GPUs reads as diverged on the CPU (other rounding);
        /// on a GPU it may match (docs/engine.md, "Devices").
        #[arg(long, default_value = "cpu")]
        device: mesh_stage::DeviceChoice,
        #[arg(long)]
        json: bool,
    },
    /// Start N nodes in this process, each with its own QUIC endpoint on
    /// 127.0.0.1, serve one request split over them, and check its bundle.
    Demo(mesh_node::cli::node_cli::DemoArgs),
    /// Run a node: a stage for any coordinator, and with --peer a
    /// coordinator over its peers; with neither --peer nor --coordinator
    /// (or with --bootstrap) it joins a mesh and plans over its members.
    Serve(Box<mesh_node::cli::node_cli::ServeArgs>),
    /// Join a mesh as a stage node with one command: creates the node's key
    /// in its data directory if there is none, measures its decode speed,
    /// advertises itself and serves the mesh's coordinators.
    Join(Box<mesh_node::cli::node_cli::JoinArgs>),
    /// The mesh as an observer sees it.
    Mesh {
        #[command(subcommand)]
        action: MeshAction,
    },
    /// The plan a coordinator would use over the mesh (or over members
    /// described in a file): node, layers, weight and KV bytes per stage,
    /// projected time per token, and why a member was left out.
    Plan(mesh_node::cli::mesh_cli::PlanArgs),
    /// Ask a coordinator a typed decision (SPEC §3.6): which of the options
    /// answers the question about the state in --prompt, with a probability
    /// for each; one forward pass, no text generated. Prints the chosen
    /// option (--json: the whole answer and receipt figures).
    Decide {
        /// NODEID@HOST:PORT of a coordinating node.
        #[arg(long)]
        coordinator: String,
        /// The state the question is about.
        #[arg(long)]
        prompt: String,
        #[arg(long)]
        question: String,
        /// One option; repeat for each (as many as the model has
        /// single-token letters for, at most 255).
        #[arg(long = "option", required = true)]
        options: Vec<String>,
        /// Wrap the state, question and options in the model's chat template.
        #[arg(long)]
        chat: bool,
        /// The least fidelity the decision accepts, F0..F4 (default F0).
        #[arg(long, value_parser = mesh_node::cli::node_cli::parse_fidelity)]
        fidelity_floor: Option<mesh_protocol::mesh1::Fidelity>,
        /// The decision's joule ceiling: priced on its prompt and options
        /// scored, never on tokens it cannot emit (default: none).
        #[arg(long)]
        ceiling_uj: Option<u64>,
        /// The longest the decision may take.
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Where to write the bundle.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Generate text: in this process (--model), or through a coordinator
    /// (--coordinator), which streams it and returns a verifiable bundle.
    Generate {
        /// A GGUF file or a safetensors model directory (default: the
        /// built-in synthetic model).
        #[arg(long, conflicts_with = "coordinator")]
        model: Option<PathBuf>,
        /// NODEID@HOST:PORT of a coordinating node.
        #[arg(long)]
        coordinator: Option<String>,
        /// With --coordinator: where to write the bundle.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The bundle's form: `mesh` (this project's mesh_bundle) or
        /// `mesh-llm` (Mesh-LLM's record_push_bundle with the stage records).
        #[arg(long, default_value = "mesh", requires = "out")]
        format: String,
        /// With --coordinator: serve on these grant shards (`grant shard`).
        #[arg(long, requires = "grant_key")]
        shards: Option<PathBuf>,
        /// The shards' holder key, which signs the presentations.
        #[arg(long)]
        grant_key: Option<PathBuf>,
        /// The request's joule ceiling (SPEC §3.1): the router refuses it
        /// when every backend's estimate is over it, and with --shards every
        /// steward checks it (default: none; 50000000 with --shards).
        #[arg(long)]
        ceiling_uj: Option<u64>,
        /// The least fidelity the request accepts, F0..F4 (default F0): the
        /// router refuses it when no backend is rated at or above it.
        #[arg(long, value_parser = mesh_node::cli::node_cli::parse_fidelity)]
        fidelity_floor: Option<mesh_protocol::mesh1::Fidelity>,
        /// With --coordinator: the longest the request may take, start to
        /// last token; past it the request ends `timed_out` on every stage
        /// (default and most: the coordinator's --request-timeout-ms).
        #[arg(long)]
        timeout_ms: Option<u64>,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Wrap the prompt in the model's own chat template.
        #[arg(long)]
        chat: bool,
        /// Layer ranges, e.g. 0..10,10..20,20..30 (default: one slice).
        #[arg(long)]
        split: Option<String>,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Activation encoding between slices: f32 (exact), f16, bf16.
        #[arg(long, default_value = "f32")]
        wire: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// A running node's pools (request caches, records awaiting a seal,
    /// grant decisions held) and counters: a leak shows as a pool that does
    /// not empty.
    Stats {
        /// NODEID@HOST:PORT of the node.
        node: String,
        /// The key to ask with: the node's own, or a peer's or coordinator's
        /// of it (stats are not for strangers).
        #[arg(long)]
        key: PathBuf,
        /// Print one JSON object.
        #[arg(long, conflicts_with = "prometheus")]
        json: bool,
        /// Print Prometheus' text exposition format.
        #[arg(long)]
        prometheus: bool,
    },
    /// Issue and shard joule grants.
    Grant {
        #[command(subcommand)]
        action: GrantAction,
    },
    /// Create a node key (an Ed25519 seed) and print the node id (did:key).
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
    /// A node's transparency log: every record it sealed, an MMR of their
    /// ids (read from DATA/steward with the node stopped).
    Log {
        #[command(subcommand)]
        action: LogAction,
    },
    /// Read a steward's decision journal.
    Journal {
        #[command(subcommand)]
        action: JournalAction,
    },
    /// Run a steward outside the serving path.
    Steward {
        #[command(subcommand)]
        action: StewardAction,
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
enum GrantAction {
    /// Sign a root grant of BUDGET µJ from the owner (--key) to --subject.
    Issue {
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        subject: String,
        #[arg(long)]
        budget_uj: u64,
        #[arg(long, default_value_t = 86_400)]
        expires_in_s: u64,
        /// A per-serve cost cap (MaxCostUj caveat).
        #[arg(long)]
        max_cost_uj: Option<u64>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Shard a grant you hold over a coordinator's stewards, one child each.
    Shard {
        #[arg(long)]
        grant: PathBuf,
        /// The holder's key (the grant's subject).
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        coordinator: String,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum JournalAction {
    /// Print every record, replay it, and list unresolved serves. Exit 1 if
    /// the journal does not replay.
    Inspect {
        /// The steward's data directory.
        dir: PathBuf,
    },
    /// Go on without records the journal lost (its tail marker names a
    /// record it no longer holds, so the node refuses to start): records
    /// the loss in the journal, after which the node starts again. Restore
    /// the journal from a copy instead when one holds them. Needs the node
    /// stopped.
    AcceptLoss {
        /// The node's data directory (its journal is in DATA/steward).
        #[arg(long)]
        data: PathBuf,
        /// The node's key file.
        #[arg(long)]
        key: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum MeshAction {
    /// Members, their adverts, round trip and age.
    Status {
        #[command(flatten)]
        observe: mesh_node::cli::mesh_cli::ObserveArgs,
        /// Print one JSON array.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
struct WeightsTarget {
    /// The node's key file (its steward's).
    #[arg(long)]
    key: PathBuf,
    /// The node's data directory (the journal is in DATA/steward).
    #[arg(long)]
    data: PathBuf,
    /// The model file: its name is the recipe, its weights the change's `to`.
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = mesh_node::cli::weights::DEFAULT_BACKEND)]
    backend: String,
}

#[derive(Debug, Subcommand)]
enum WeightsAction {
    /// Record a plan: the changes foreseen, before them.
    Plan {
        #[command(flatten)]
        target: WeightsTarget,
        /// A precision a planned change may run at (repeat; none: any named).
        #[arg(long)]
        precision: Vec<String>,
        #[arg(long, default_value_t = 0)]
        fidelity_floor: u64,
        /// How a change under it is validated.
        #[arg(long)]
        validation: String,
        /// What it foresees.
        #[arg(long)]
        foresees: String,
        #[arg(long)]
        risk_assessment: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Record that the model's weights are in effect from the next receipt
    /// on (from the weights in effect before, if any).
    Record {
        #[command(flatten)]
        target: WeightsTarget,
        #[arg(long, default_value = mesh_node::cli::weights::ENGINE_PRECISION)]
        precision: String,
        #[arg(long, default_value_t = 0)]
        fidelity: u64,
        /// The plan entry it falls under (its id, from `weights show`).
        #[arg(long)]
        plan: Option<String>,
        #[arg(long)]
        validation_result: Option<String>,
        #[arg(long)]
        reason: String,
        #[arg(long)]
        json: bool,
    },
    /// Print the records in a node's journal (read-only; with the node
    /// stopped, as `journal inspect`).
    Show {
        #[arg(long)]
        data: PathBuf,
        #[arg(long)]
        backend: Option<String>,
        /// Write the record (one backend) for `verify --change-record`.
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum LogAction {
    /// Its size, root and record ids.
    Show {
        #[arg(long)]
        data: PathBuf,
    },
    /// The inclusion proof of one record (its capsule id) at the log's size.
    Prove {
        #[arg(long)]
        data: PathBuf,
        capsule_id: String,
    },
    /// A checkpoint of the log now, signed with the node's key.
    Checkpoint {
        #[arg(long)]
        data: PathBuf,
        #[arg(long)]
        key: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum StewardAction {
    /// Disclose the opening of one receipt's output commitment (SPEC §6.4),
    /// as its steward: refused for a receipt another key sealed. The
    /// opening binds the receipt's request id, so it opens no other.
    Open {
        /// The receipt: a bundle, or the envelope (raw or hex).
        receipt: PathBuf,
        /// The steward's key file (the node's).
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Honour grants again after a halt (a witness showed a receipt this
    /// steward signed that its journal does not hold): journalled with your
    /// reason, then in force. Deal with the cause first: restore the
    /// journal from a copy, or stop the second node that runs with this
    /// key. Needs the node stopped (docs/operations.md, "A halted steward").
    ClearHalt {
        /// The node's data directory (its journal is in DATA/steward).
        #[arg(long)]
        data: PathBuf,
        /// The node's key file.
        #[arg(long)]
        key: PathBuf,
        /// Why grants may be honoured again: kept in the journal.
        #[arg(long)]
        reason: String,
    },
    /// Serve N requests on a CPU workload under a fixed grant, journalling
    /// and sealing each (a harness for the journal and receipt chain).
    Exercise {
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        data: PathBuf,
        #[arg(long, default_value_t = 1)]
        serves: u32,
        /// CPU time each serve burns inside the metered span.
        #[arg(long, default_value_t = 20)]
        workload_ms: u64,
        /// Powercap root for RAPL.
        #[arg(long, default_value = mesh_node::runtime::energy::POWERCAP_ROOT)]
        powercap: PathBuf,
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
    /// Membership and planning at scale: signed adverts of simulated
    /// members taken into a member table, then planned over.
    Plan {
        #[arg(long, default_value_t = 1000)]
        members: usize,
        /// Layers of the simulated model (80: a 70B-class model).
        #[arg(long, default_value_t = 80)]
        layers: usize,
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// From `join` (a node starting with a bootstrap address) to its first
    /// served request through a coordinator on loopback.
    Join {
        /// A GGUF file or safetensors directory (default: SmolLM2 when
        /// cached, else the synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// A stage SIGKILLed mid-request with a long context: time from the kill
    /// to the next token, split into detection, re-plan and prefix replay.
    Resume {
        /// A GGUF file or safetensors directory (default: SmolLM2 when
        /// cached, else the synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Context at the kill, in tokens (prompt plus tokens generated).
        #[arg(long, default_value_t = 512)]
        context: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Lane-fold throughput for 4 KiB and 64 KiB frames, next to plain SHA-256.
    Fold {
        /// Seconds to measure each case.
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Decode tokens/s unsplit in-process against split over loopback QUIC
    /// (2 and 3 stages, relayed and direct return), per-hop overhead, and
    /// the share of time folding.
    Split {
        /// A GGUF file or safetensors directory (default: the synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// A prompt of about this many tokens (plain text, no chat
        /// template) instead of the short chat prompt: the time to first
        /// token shows prefill, pipelined across stages in direct mode.
        #[arg(long)]
        prompt_tokens: Option<usize>,
        /// Rounds, each the unsplit run and every split in turn, each
        /// round starting one place further along (five rounds give each
        /// every place once); rows give the medians, each ratio taken
        /// within its round.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Where every node computes: cpu (default), cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: mesh_stage::DeviceChoice,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// One greedy request through the coordinator's HTTP API (streamed)
    /// against the same request from a `generate --coordinator` requester,
    /// on a three-node split in this process: time to first token, decode
    /// tokens/s, and the API's cost per token.
    Api {
        /// A GGUF file (default: SmolLM2-135M from the model cache, else the
        /// built-in synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// Alternating rounds; medians are reported.
        #[arg(long, default_value_t = 7)]
        rounds: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Aggregate decode tokens/s of concurrent greedy requests over three
    /// `serve` processes on 127.0.0.1 (continuous batching), next to
    /// llama.cpp's llama-server with as many parallel slots when given.
    Concurrency {
        /// A GGUF file (default: SmolLM2-135M from the model cache, else the
        /// built-in synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Tokens each request generates.
        #[arg(long, default_value_t = 32)]
        tokens: usize,
        /// Requests at once, one measurement each.
        #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
        levels: Vec<usize>,
        /// llama.cpp's llama-server (`scripts/build-llama-cpp.sh llama-server`).
        #[arg(long)]
        llama_server: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// A split behind UDP delay proxies on 127.0.0.1 (one in front of every
    /// node): time per output token minus compute at each round-trip time,
    /// against the floor of one-way delays and Mesh-LLM's 2 x RTT + 4.9 ms
    /// per boundary.
    Wan {
        /// A GGUF file (default: SmolLM2-135M from the model cache, else the
        /// built-in synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Round-trip times of every link, one measurement each.
        #[arg(long, value_delimiter = ',', default_value = "0,10,40,80")]
        rtt_ms: Vec<f64>,
        /// Stage counts, one measurement each.
        #[arg(long, value_delimiter = ',', default_value = "2,3")]
        stages: Vec<usize>,
        /// Extra delay per datagram, uniform in 0..=JITTER (order kept).
        #[arg(long, default_value_t = 0.0)]
        jitter_ms: f64,
        /// Datagrams dropped, each way, in percent.
        #[arg(long, default_value_t = 0.0)]
        loss_percent: f64,
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// Rounds over every configuration; medians are reported.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Seeds the proxies' jitter and loss, so a run can be repeated.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Tokens the coordinator drafts after each sampled token
        /// (speculative decoding; 0: off), one measurement each: `0,4`
        /// sets plain decoding beside four drafts.
        #[arg(long, value_delimiter = ',', default_value = "0")]
        draft_tokens: Vec<usize>,
        /// Draft with this model (same tokenizer as --model) instead of
        /// prompt lookup.
        #[arg(long)]
        draft_model: Option<PathBuf>,
        /// The prompt (default: a short chat request for a story).
        #[arg(long)]
        prompt: Option<String>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// The engine's own block kernels against candle's on the same stored
    /// blocks: one decode row and a 64-row prompt, SmolLM2's shapes.
    Kernels {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Engine prefill/decode tokens/s, unsplit vs split in-process, and the
    /// memory a third of the layers holds.
    Engine {
        /// A GGUF file or safetensors directory (default: SmolLM2-135M from
        /// the model cache, else the built-in synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 64)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 64)]
        decode_tokens: usize,
        /// Where the engine computes: cpu (default), cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: mesh_stage::DeviceChoice,
        #[arg(long)]
        json: bool,
    },
    /// Receipts sealed per second (sign + journal fsync), grant decisions per
    /// second, and what the steward adds to one serve.
    Steward {
        /// Serves to time.
        #[arg(long, default_value_t = 300)]
        serves: u32,
        /// Where to put the scratch journal (default: a temporary directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Verify {
            json,
            file,
            prev,
            change_record: Some(change_record),
        } => {
            if prev.is_some() {
                anyhow::bail!("--prev checks a chain link, --change-record coverage: give one");
            }
            // Exit 1 means not covered: input that cannot be read is 2.
            let read = mesh_node::cli::verify::read_receipt(&file)
                .map_err(anyhow::Error::msg)
                .and_then(|receipt| {
                    Ok((
                        receipt,
                        mesh_node::cli::weights::read_record(&change_record)?,
                    ))
                });
            let (receipt, record) = match read {
                Ok(read) => read,
                Err(error) => {
                    eprintln!("mesh-node verify: {error:#}");
                    return Ok(ExitCode::from(2));
                }
            };
            let covered = mesh_node::cli::weights::coverage(&receipt, &record);
            if json {
                println!(
                    "{}",
                    match &covered {
                        Ok(value) => value.clone(),
                        Err(why) => serde_json::json!({ "covered": false, "why": why }),
                    }
                );
            } else {
                match &covered {
                    Ok(value) => println!(
                        "covered: receipt {} was served on weights entry #{} ({})",
                        receipt.receipt.sequence, value["by"]["seq"], value["by"]["reason"]
                    ),
                    Err(why) => println!("NOT covered: {why}"),
                }
            }
            Ok(if covered.is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Verify {
            json, file, prev, ..
        } => Ok(mesh_node::cli::verify::verify(&file, prev.as_deref(), json)),
        Command::Weights { action } => {
            let target = |t: WeightsTarget| mesh_node::cli::weights::Target {
                data: t.data,
                key: t.key,
                backend: t.backend,
                model: t.model,
            };
            let (value, json) = match action {
                WeightsAction::Plan {
                    target: t,
                    precision,
                    fidelity_floor,
                    validation,
                    foresees,
                    risk_assessment,
                    json,
                } => (
                    mesh_node::cli::weights::plan(
                        &target(t),
                        precision,
                        fidelity_floor,
                        validation,
                        foresees,
                        risk_assessment,
                    )?,
                    json,
                ),
                WeightsAction::Record {
                    target: t,
                    precision,
                    fidelity,
                    plan,
                    validation_result,
                    reason,
                    json,
                } => (
                    mesh_node::cli::weights::record(
                        &target(t),
                        mesh_node::cli::weights::Change {
                            precision: Some(precision),
                            fidelity,
                            plan,
                            validation_result,
                            reason,
                        },
                    )?,
                    json,
                ),
                WeightsAction::Show {
                    data,
                    backend,
                    out,
                    json,
                } => {
                    let records = mesh_node::cli::weights::show(&data, backend.as_deref())?;
                    if let Some(out) = out {
                        let [record] = records.as_slice() else {
                            anyhow::bail!(
                                "--out writes one backend's record: {} found (give --backend)",
                                records.len()
                            );
                        };
                        std::fs::write(
                            &out,
                            serde_json::to_vec_pretty(&mesh_node::cli::weights::record_document(
                                record,
                            ))?,
                        )?;
                    }
                    if json {
                        println!(
                            "{}",
                            serde_json::to_string_pretty(
                                &records
                                    .iter()
                                    .map(mesh_node::cli::weights::record_document)
                                    .collect::<Vec<_>>()
                            )?
                        );
                    } else {
                        print!("{}", mesh_node::cli::weights::render(&records));
                    }
                    return Ok(ExitCode::SUCCESS);
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                println!(
                    "recorded #{} ({}) for {}: id {}",
                    value["seq"],
                    value["kind"],
                    value["backend"],
                    value["id"].as_str().unwrap_or("")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Replay {
            bundle,
            model,
            prompt_file,
            chat,
            opening,
            output_file,
            device,
            json,
        } => {
            let replayed = mesh_node::cli::replay::replay(&mesh_node::cli::replay::ReplayArgs {
                bundle: &bundle,
                model: &model,
                prompt_file: &prompt_file,
                chat,
                opening: opening.as_deref(),
                output_file: output_file.as_deref(),
                device,
                json,
            });
            // Exit 1 means diverged: input that cannot be read is 2.
            Ok(replayed.unwrap_or_else(|error| {
                eprintln!("mesh-node replay: {error:#}");
                ExitCode::from(2)
            }))
        }
        Command::Journal {
            action: JournalAction::AcceptLoss { data, key },
        } => {
            let key = mesh_node::runtime::keys::load(&key)?;
            let (records, recorded) = mesh_node::runtime::journal::Journal::accept_loss(
                &data.join("steward"),
                key,
                mesh_node::runtime::clock::now_ms(),
            )?;
            match recorded {
                Some(record) => println!(
                    "recorded the loss as record {}: the journal holds {} records before it, and the node starts again",
                    record.seq,
                    records.len()
                ),
                None => println!("the journal lost nothing: nothing recorded"),
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Steward {
            action: StewardAction::ClearHalt { data, key, reason },
        } => {
            if reason.trim().is_empty() {
                anyhow::bail!("give --reason: why grants may be honoured again (it is journalled)");
            }
            let key = mesh_node::runtime::keys::load(&key)?;
            let mut steward = mesh_node::runtime::steward::Steward::open(
                &data.join("steward"),
                key,
                Box::new(mesh_node::runtime::energy::EstimatorMeter::default()),
            )?;
            let was = steward.clear_halt(&reason, mesh_node::runtime::clock::now_ms())?;
            println!("the steward honours grants again; it had halted because: {was}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Steward {
            action: StewardAction::Open { receipt, key, json },
        } => {
            let key = mesh_node::runtime::keys::load(&key)?;
            mesh_node::cli::replay::open(&receipt, &key, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target:
                BenchTarget::Split {
                    model,
                    tokens,
                    prompt_tokens,
                    rounds,
                    device,
                    json,
                },
        } => {
            let model = model.map_or_else(mesh_node::cli::engine_cli::synthetic_model_path, Ok)?;
            let report = runtime()?.block_on(mesh_node::tools::bench_split::bench_split(
                model,
                tokens,
                prompt_tokens,
                rounds,
                device,
            ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", mesh_node::tools::bench_split::render_split(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo(args) => {
            let ok = runtime()?.block_on(mesh_node::cli::node_cli::demo(args))?;
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Serve(args) => {
            let options = mesh_node::cli::node_cli::node_options(*args)?;
            runtime()?.block_on(mesh_node::cli::node_cli::serve(options))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Join(args) => {
            let options = mesh_node::cli::node_cli::join_options(*args)?;
            runtime()?.block_on(mesh_node::cli::node_cli::serve(options))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Mesh {
            action: MeshAction::Status { observe, json },
        } => {
            let members = runtime()?.block_on(mesh_node::cli::mesh_cli::observe(&observe))?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&mesh_node::runtime::planner::members_json(
                        &members
                    ))?
                );
            } else {
                print!("{}", mesh_node::runtime::planner::render_members(&members));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan(args) => {
            let (report, text) = runtime()?.block_on(mesh_node::cli::mesh_cli::plan(&args))?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{text}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Generate {
            coordinator: Some(coordinator),
            prompt,
            max_tokens,
            chat,
            temperature,
            top_k,
            top_p,
            seed,
            out,
            format,
            json,
            shards,
            grant_key,
            ceiling_uj,
            fidelity_floor,
            timeout_ms,
            ..
        } => {
            let format = mesh_node::cli::node_cli::BundleFormat::parse(&format)?;
            let grant = match (shards, grant_key) {
                (Some(shards), Some(holder)) => {
                    // The prompt-token figure is the requester's own estimate (seed 001 §2.3).
                    let estimate = u32::try_from(prompt.len().div_ceil(4)).unwrap_or(u32::MAX);
                    let mut serve = mesh_node::runtime::serve::GrantedServe::derive(
                        &prompt,
                        max_tokens,
                        estimate,
                        ceiling_uj.unwrap_or(50_000_000),
                    );
                    if let Some(floor) = fidelity_floor {
                        serve.fidelity_floor = floor;
                    }
                    let presentations =
                        mesh_node::cli::node_cli::presentations_for(&shards, &holder, &serve)?;
                    Some(mesh_node::runtime::serve::GrantedServe {
                        serve,
                        presentations,
                    })
                }
                _ => None,
            };
            let request = mesh_node::runtime::serve::GenerateRequest {
                prompt,
                max_tokens,
                chat,
                sampling: mesh_stage::sampling::SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed,
                },
                grant,
                timeout: timeout_ms.map(std::time::Duration::from_millis),
                stop: Vec::new(),
                bounds: mesh_node::runtime::serve::RequestBounds {
                    fidelity_floor,
                    joule_ceiling_uj: ceiling_uj,
                },
                decision: None,
            };
            let summary = runtime()?.block_on(mesh_node::cli::node_cli::generate_via(
                &coordinator,
                request,
                out.as_deref().map(|path| (path, format)),
                json,
            ))?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "text": summary.text, "terminal_state": summary.terminal_state, "error": summary.error, "details": summary.details,
                    }))?
                );
            }
            if let Some(error) = &summary.error {
                eprintln!(
                    "mesh-node: the request ended early ({}): {error}",
                    summary.terminal_state
                );
                return Ok(ExitCode::from(1));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Decide {
            coordinator,
            prompt,
            question,
            options,
            chat,
            fidelity_floor,
            ceiling_uj,
            timeout_ms,
            out,
            json,
        } => {
            let request = mesh_node::runtime::serve::GenerateRequest {
                chat,
                timeout: timeout_ms.map(std::time::Duration::from_millis),
                bounds: mesh_node::runtime::serve::RequestBounds {
                    fidelity_floor,
                    joule_ceiling_uj: ceiling_uj,
                },
                decision: Some(mesh_protocol::control::DecisionAsk { question, options }),
                ..mesh_node::runtime::serve::GenerateRequest::greedy(prompt, 1)
            };
            let summary = runtime()?.block_on(mesh_node::cli::node_cli::generate_via(
                &coordinator,
                request,
                out.as_deref()
                    .map(|path| (path, mesh_node::cli::node_cli::BundleFormat::Mesh)),
                true,
            ))?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "chosen": summary.text,
                        "terminal_state": summary.terminal_state,
                        "error": summary.error,
                        "decision": summary.details["decision"],
                        "receipt": summary.details["receipt"],
                    }))?
                );
            } else if summary.error.is_none() {
                println!("{}", summary.text);
                for option in summary.details["decision"]["options"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    println!(
                        "  {}. {}  {:.4}",
                        option["label"].as_str().unwrap_or_default(),
                        option["option"].as_str().unwrap_or_default(),
                        option["probability"].as_f64().unwrap_or_default()
                    );
                }
            }
            if let Some(error) = &summary.error {
                eprintln!(
                    "mesh-node: the decision ended early ({}): {error}",
                    summary.terminal_state
                );
                return Ok(ExitCode::from(1));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Stats {
            node,
            key,
            json,
            prometheus,
        } => {
            let node: mesh_node::runtime::serve::PeerAddr = node.parse()?;
            let key = mesh_node::runtime::keys::load(&key)?;
            let stats =
                runtime()?.block_on(mesh_node::runtime::serve::node_stats_remote(&key, &node))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&stats)?);
            } else if prometheus {
                print!("{}", mesh_node::cli::render::node_stats_prometheus(&stats));
            } else {
                print!("{}", mesh_node::cli::render::node_stats(&node, &stats));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Generate {
            model,
            prompt,
            max_tokens,
            chat,
            split,
            temperature,
            top_k,
            top_p,
            seed,
            wire,
            json,
            ..
        } => {
            let wire = mesh_stage::frame::WireDType::parse(&wire)
                .context("--wire must be f32, f16 or bf16")?;
            mesh_node::cli::engine_cli::generate(&mesh_node::cli::engine_cli::GenerateOptions {
                model,
                prompt,
                max_tokens,
                chat,
                split,
                sampling: mesh_stage::sampling::SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed,
                },
                wire,
                json,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Grant {
            action:
                GrantAction::Issue {
                    key,
                    subject,
                    budget_uj,
                    expires_in_s,
                    max_cost_uj,
                    out,
                },
        } => {
            let id = mesh_node::cli::node_cli::grant_issue(
                &key,
                &subject,
                budget_uj,
                Duration::from_secs(expires_in_s),
                max_cost_uj,
                &out,
            )?;
            println!(
                "grant {id} ({budget_uj} µJ to {subject}) written to {}",
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Grant {
            action:
                GrantAction::Shard {
                    grant,
                    key,
                    coordinator,
                    out,
                },
        } => {
            let shares = runtime()?.block_on(mesh_node::cli::node_cli::grant_shard(
                &grant,
                &key,
                &coordinator,
                &out,
            ))?;
            for (steward, budget) in &shares {
                println!("  {budget} µJ held by {steward}");
            }
            println!("{} shards written to {}", shares.len(), out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Keygen { out } => {
            let key = mesh_node::runtime::keys::generate(&out)?;
            println!(
                "{}",
                mesh_protocol::identity::did_key(&key.verifying_key().to_bytes())
            );
            eprintln!(
                "wrote {} (keep it private: it is this node's identity)",
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Log { action } => {
            let value = match action {
                LogAction::Show { data } => mesh_node::cli::log::show(&data)?,
                LogAction::Prove { data, capsule_id } => {
                    mesh_node::cli::log::prove(&data, &capsule_id)?
                }
                LogAction::Checkpoint { data, key } => {
                    let key = mesh_node::runtime::keys::load(&key)?;
                    mesh_node::cli::log::checkpoint(&data, &key)?
                }
            };
            println!("{}", serde_json::to_string_pretty(&value)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Journal {
            action: JournalAction::Inspect { dir },
        } => {
            let (records, lost) = mesh_node::runtime::journal::Journal::read_with_loss(&dir)?;
            let steward = mesh_node::cli::inspect::steward_of(&records);
            // A lost tail is shown as the replay's failure: what remains
            // is printed, never passed as a whole journal.
            let replayed = match (&steward, &lost) {
                (_, Some(lost)) => Err(format!("{lost}")),
                (Some(did), None) => {
                    mesh_node::runtime::steward::replay(did, &records).map_err(|e| e.to_string())
                }
                (None, None) => {
                    mesh_node::runtime::steward::replay("", &records).map_err(|e| e.to_string())
                }
            };
            if let Some(did) = &steward {
                println!("steward {did}");
            }
            print!(
                "{}",
                mesh_node::cli::inspect::render_journal(
                    &records,
                    replayed.as_ref().ok(),
                    replayed.as_ref().err().map(String::as_str)
                )
            );
            if let Some(lost) = &lost {
                eprintln!("mesh-node: {lost}");
            }
            Ok(if replayed.is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Steward {
            action:
                StewardAction::Exercise {
                    key,
                    data,
                    serves,
                    workload_ms,
                    powercap,
                },
        } => {
            let key = mesh_node::runtime::keys::load(&key)?;
            let (meter, why) = mesh_node::runtime::energy::select_meter(
                &powercap,
                mesh_node::runtime::energy::EstimatorMeter::default(),
            );
            eprintln!("{why}");
            let mut stdout = std::io::stdout();
            mesh_node::tools::exercise::run(
                &data,
                key,
                meter,
                serves,
                Duration::from_millis(workload_ms),
                &mut stdout,
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Vectors {
            action: VectorsAction::Write { dir },
        } => {
            let changed = mesh_node::tools::vectors::write_or_check(&dir, false)?;
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
            let differing = mesh_node::tools::vectors::write_or_check(&dir, true)?;
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
            target: BenchTarget::Fold { seconds, json },
        } => {
            let min_time = Duration::try_from_secs_f64(seconds)
                .context("--seconds must be a positive number")?;
            let measurements = mesh_node::tools::bench::bench_fold(&[4096, 65_536], min_time);
            if json {
                println!("{}", serde_json::to_string_pretty(&measurements)?);
            } else {
                print!("{}", mesh_node::tools::bench::render_fold(&measurements));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target:
                BenchTarget::Api {
                    model,
                    tokens,
                    rounds,
                    json,
                },
        } => {
            let model = bench_model(model)?;
            let report = runtime()?.block_on(mesh_node::tools::bench_api::bench_api(
                &model, tokens, rounds,
            ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", mesh_node::tools::bench_api::render_api(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target:
                BenchTarget::Concurrency {
                    model,
                    tokens,
                    levels,
                    llama_server,
                    json,
                },
        } => {
            let model = bench_model(model)?;
            let report =
                runtime()?.block_on(mesh_node::tools::bench_concurrency::bench_concurrency(
                    &model,
                    tokens,
                    &levels,
                    llama_server,
                ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!(
                    "{}",
                    mesh_node::tools::bench_concurrency::render_concurrency(&report)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target:
                BenchTarget::Engine {
                    model,
                    prompt_tokens,
                    decode_tokens,
                    device,
                    json,
                },
        } => {
            let model = bench_model(model)?;
            let report = mesh_node::tools::bench::bench_engine(
                &model,
                prompt_tokens,
                decode_tokens,
                device,
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", mesh_node::tools::bench::render_engine(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target:
                BenchTarget::Wan {
                    model,
                    rtt_ms,
                    stages,
                    jitter_ms,
                    loss_percent,
                    tokens,
                    rounds,
                    seed,
                    draft_tokens,
                    draft_model,
                    prompt,
                    json,
                },
        } => {
            let bench = mesh_node::tools::bench_wan::WanBench {
                draft_tokens,
                draft_model,
                prompt,
                model: bench_model(model)?,
                rtts_ms: rtt_ms,
                stages,
                jitter_ms,
                loss: loss_percent / 100.0,
                tokens,
                rounds,
                seed,
            };
            let report = runtime()?.block_on(mesh_node::tools::bench_wan::bench_wan(&bench))?;
            if json {
                println!("{report}");
            } else {
                print!("{}", mesh_node::tools::bench_wan::render_wan(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target:
                BenchTarget::Plan {
                    members,
                    layers,
                    rounds,
                    seed,
                    json,
                },
        } => {
            let report = mesh_node::tools::bench_mesh::bench_plan(
                &mesh_node::tools::bench_mesh::PlanBench {
                    members,
                    layers,
                    rounds,
                    seed,
                },
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", mesh_node::tools::bench_mesh::render_plan(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target:
                BenchTarget::Join {
                    model,
                    rounds,
                    json,
                },
        } => {
            let model = bench_model(model)?;
            let report =
                runtime()?.block_on(mesh_node::tools::bench_mesh::bench_join(&model, rounds))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", mesh_node::tools::bench_mesh::render_join(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target:
                BenchTarget::Resume {
                    model,
                    rounds,
                    context,
                    json,
                },
        } => {
            let model = bench_model(model)?;
            let report = runtime()?.block_on(mesh_node::tools::bench_mesh::bench_resume(
                &model, rounds, context,
            ))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", mesh_node::tools::bench_mesh::render_resume(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target: BenchTarget::Kernels { json },
        } => {
            let report = mesh_node::tools::bench::bench_kernels()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", mesh_node::tools::bench::render_kernels(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            target: BenchTarget::Steward { serves, dir, json },
        } => {
            let scratch;
            let dir = match dir {
                Some(dir) => dir,
                None => {
                    scratch = std::env::temp_dir()
                        .join(format!("mesh-node-bench-steward-{}", std::process::id()));
                    let _ = std::fs::remove_dir_all(&scratch);
                    scratch.clone()
                }
            };
            let report = mesh_node::tools::bench::bench_steward(&dir, serves)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", mesh_node::tools::bench::render_steward(&report));
            }
            let _ = std::fs::remove_dir_all(&dir);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = IO_THREADS.get().copied().flatten() {
        builder.worker_threads(threads);
    }
    builder
        .on_thread_start(mesh_node::runtime::bind_gpu_to_this_thread)
        .on_thread_unpark(mesh_node::runtime::bind_gpu_to_this_thread)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Logs go to stderr through `tracing`; `RUST_LOG` chooses what is shown.
/// By default a serving node says what it does (info), and every other
/// command only what went wrong (warn), so the demo's answer stays in view.
fn init_logging(command: &Command) {
    let default = match command {
        Command::Serve(_) | Command::Join(_) => "mesh_node=info",
        _ => "mesh_node=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// The model a benchmark runs: the one given, else SmolLM2-135M from the
/// model cache, else the built-in synthetic model.
fn bench_model(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(model) = model {
        return Ok(model);
    }
    let cached = mesh_node::cli::models::smollm2_path();
    if cached.is_file() {
        Ok(cached)
    } else {
        mesh_node::cli::engine_cli::synthetic_model_path()
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = IO_THREADS.set(cli.io_threads.map(usize::from));
    init_logging(&cli.command);
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("mesh-node: {error:#}");
            ExitCode::from(1)
        }
    }
}
