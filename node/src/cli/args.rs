//! The command line: every command and its flags, as clap reads them.
//! What each command does is in [`super::commands`].

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// mesh-node: serve language models split by layers across machines, with
/// hand-offs a requester can check offline.
#[derive(Debug, Parser)]
// Help is wrapped to the terminal, and never wider than 100 columns (nor
// wider than 100 where there is no terminal).
#[command(name = "mesh-node", version, about, max_term_width = 100)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Threads of the async runtime (QUIC, HTTP, the mesh); by default one
    /// per core. Forward passes have their own compute threads
    /// (CANDLE_NUM_THREADS). With 1, a node's decode steps arrive, run and
    /// leave on one thread: faster on a 16-core machine, as fast over a
    /// delayed link and slower in process on a 2-core one
    /// (docs/operations.md, "I/O threads").
    #[arg(long, global = true, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub io_threads: Option<u16>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check a bundle or hop-check case offline: ids, signatures, inclusion
    /// proofs and hop agreement. Exit 0: all checks pass and hand-offs agree;
    /// 1: understood, but something failed; 2: the input cannot be read.
    Verify(VerifyArgs),
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
    Replay(ReplayArgs),
    /// Start N nodes in this process, each with its own QUIC endpoint on
    /// 127.0.0.1, serve one request split over them, and check its bundle.
    Demo(crate::cli::node_cli::DemoArgs),
    /// Run a node: a stage for any coordinator, and with --peer a
    /// coordinator over its peers; with neither --peer nor --coordinator
    /// (or with --bootstrap) it joins a mesh and plans over its members.
    Serve(Box<crate::cli::node_cli::ServeArgs>),
    /// Join a mesh as a stage node with one command: creates the node's key
    /// in its data directory if there is none, measures its decode speed,
    /// advertises itself and serves the mesh's coordinators.
    Join(Box<crate::cli::node_cli::JoinArgs>),
    /// The mesh as an observer sees it.
    Mesh {
        #[command(subcommand)]
        action: MeshAction,
    },
    /// The plan a coordinator would use over the mesh (or over members
    /// described in a file): node, layers, weight and KV bytes per stage,
    /// projected time per token, and why a member was left out.
    Plan(crate::cli::mesh_cli::PlanArgs),
    /// Ask a coordinator a typed decision (SPEC §3.6): which of the options
    /// answers the question about the state in --prompt, with a probability
    /// for each; one forward pass, no text generated. Prints the chosen
    /// option (--json: the whole answer and receipt figures).
    // Its usage wrapped to fit 100 columns (clap does not wrap usage).
    #[command(
        override_usage = "mesh-node decide [OPTIONS] --coordinator <COORDINATOR> --prompt <PROMPT>\n       --question <QUESTION> --option <OPTIONS>"
    )]
    Decide(DecideArgs),
    /// Generate text: in this process (--model), or through a coordinator
    /// (--coordinator), which streams it and returns a verifiable bundle.
    Generate(GenerateArgs),
    /// Chat in the terminal with a coordinator, through its HTTP API
    /// (`serve --http`): the whole conversation each turn, the answer
    /// streaming in, and what the turn cost after it.
    Chat(ChatArgs),
    /// A running node's pools (request caches, records awaiting a seal,
    /// grant decisions held) and counters: a leak shows as a pool that does
    /// not empty.
    Stats(StatsArgs),
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
    /// Models by name: list what is cached and known, pull one.
    Models {
        #[command(subcommand)]
        action: ModelsAction,
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

// The flags of `verify`; its help is the variant's.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// A hop case {own, receipt, carried}, a Mesh-LLM record_push_bundle,
    /// a mesh_bundle written by mesh-node, or a mesh/1 receipt envelope
    /// (raw CBOR or hex text).
    pub file: PathBuf,
    /// For a mesh/1 envelope: the previous envelope of the same steward,
    /// to check the chain link.
    #[arg(long)]
    pub prev: Option<PathBuf>,
    /// Check instead whether the receipt (a bundle or an envelope) is
    /// covered by this weights change record (`weights show --out`):
    /// exit 0 covered, 1 not.
    #[arg(long)]
    pub change_record: Option<PathBuf>,
}

// The flags of `replay`; its help is the variant's.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The requester's bundle (`generate --out`), or the receipt envelope.
    pub bundle: PathBuf,
    /// The model file the serve ran (its weights digest must match), or a
    /// known model's name.
    #[arg(long, value_parser = crate::cli::models::model_arg)]
    pub model: PathBuf,
    /// The prompt as it was sent.
    #[arg(long, required_unless_present = "tape")]
    pub prompt_file: Option<PathBuf>,
    /// Instead of the tokens, check each stage: run every stage's layers on
    /// the inputs this tape (`serve --audit-tapes`) says it was given, and
    /// name the first stage whose output is not its layers' (exit 1).
    #[arg(long, conflicts_with_all = ["prompt_file", "opening", "output_file", "chat"])]
    pub tape: Option<PathBuf>,
    /// The prompt was sent with the chat template (`generate --chat`).
    #[arg(long)]
    pub chat: bool,
    /// The receipt's opening, hex (`mesh-node steward open`).
    #[arg(long)]
    pub opening: Option<String>,
    /// The output the serve disclosed: token ids as a JSON array, or
    /// `generate --json` output.
    #[arg(long)]
    pub output_file: Option<PathBuf>,
    /// Where to re-execute: cpu (default), cuda or cuda:N. A serve
    /// computed on GPUs reads as diverged on the CPU (other rounding);
    /// on a GPU it may match (docs/engine.md, "Devices").
    #[arg(long, default_value = "cpu")]
    pub device: mesh_stage::DeviceChoice,
    #[arg(long)]
    pub json: bool,
}

// The flags of `decide`; its help is the variant's.
#[derive(Debug, clap::Args)]
pub struct DecideArgs {
    /// NODEID@HOST:PORT of a coordinating node.
    #[arg(long)]
    pub coordinator: String,
    /// The state the question is about.
    #[arg(long)]
    pub prompt: String,
    #[arg(long)]
    pub question: String,
    /// One option; repeat for each (as many as the model has
    /// single-token letters for, at most 255).
    #[arg(long = "option", required = true)]
    pub options: Vec<String>,
    /// Wrap the state, question and options in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// The least fidelity the decision accepts, F0..F4 (default F0).
    #[arg(long, value_parser = crate::cli::node_cli::parse_fidelity)]
    pub fidelity_floor: Option<mesh_protocol::mesh1::Fidelity>,
    /// The decision's joule ceiling: priced on its prompt and options
    /// scored, never on tokens it cannot emit (default: none).
    #[arg(long)]
    pub ceiling_uj: Option<u64>,
    /// The longest the decision may take.
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// Where to write the bundle.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

// The flags of `generate`; its help is the variant's.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A GGUF file, a safetensors model directory or a known model's name
    /// (`mesh-node models list`; default: SmolLM2-135M-Instruct when cached,
    /// else the built-in synthetic model).
    #[arg(long, conflicts_with = "coordinator", value_parser = crate::cli::models::model_arg)]
    pub model: Option<PathBuf>,
    /// NODEID@HOST:PORT of a coordinating node.
    #[arg(long)]
    pub coordinator: Option<String>,
    /// With --coordinator: where to write the bundle.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The bundle's form: `mesh` (this project's mesh_bundle) or
    /// `mesh-llm` (Mesh-LLM's record_push_bundle with the stage records).
    #[arg(long, default_value = "mesh", requires = "out")]
    pub format: String,
    /// With --coordinator: serve on these grant shards (`grant shard`).
    #[arg(long, requires = "grant_key")]
    pub shards: Option<PathBuf>,
    /// The shards' holder key, which signs the presentations.
    #[arg(long)]
    pub grant_key: Option<PathBuf>,
    /// The request's joule ceiling (SPEC §3.1): the router refuses it
    /// when every backend's estimate is over it, and with --shards every
    /// steward checks it (default: none; 50000000 with --shards).
    #[arg(long)]
    pub ceiling_uj: Option<u64>,
    /// The least fidelity the request accepts, F0..F4 (default F0): the
    /// router refuses it when no backend is rated at or above it.
    #[arg(long, value_parser = crate::cli::node_cli::parse_fidelity)]
    pub fidelity_floor: Option<mesh_protocol::mesh1::Fidelity>,
    /// With --coordinator: the longest the request may take, start to
    /// last token; past it the request ends `timed_out` on every stage
    /// (default and most: the coordinator's --request-timeout-ms).
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Wrap the prompt in the model's own chat template.
    #[arg(long)]
    pub chat: bool,
    /// Layer ranges, e.g. 0..10,10..20,20..30 (default: one slice).
    #[arg(long)]
    pub split: Option<String>,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Activation encoding between slices: f32 (exact), f16, bf16.
    #[arg(long, default_value = "f32")]
    pub wire: String,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

// The flags of `stats`; its help is the variant's.
#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// HOST:PORT of the coordinator's HTTP API.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub api: String,
    /// A system message before the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0: greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
}

#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    /// NODEID@HOST:PORT of the node.
    pub node: String,
    /// The key to ask with: the node's own, or a peer's or coordinator's
    /// of it (stats are not for strangers).
    #[arg(long)]
    pub key: PathBuf,
    /// Print one JSON object.
    #[arg(long, conflicts_with = "prometheus")]
    pub json: bool,
    /// Print Prometheus' text exposition format.
    #[arg(long)]
    pub prometheus: bool,
}

#[derive(Debug, Subcommand)]
pub enum GrantAction {
    /// Sign a root grant of BUDGET µJ from the owner (--key) to --subject.
    // Its usage wrapped to fit 100 columns (clap does not wrap usage).
    #[command(
        override_usage = "mesh-node grant issue [OPTIONS] --key <KEY> --subject <SUBJECT>\n       --budget-uj <BUDGET_UJ> --out <OUT>"
    )]
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
        /// Weights it may be spent on (ModelIn caveat; repeat): a weights
        /// digest, 64 hex digits, as a receipt's `weights_digest` names it.
        #[arg(long, value_name = "WEIGHTS")]
        model_in: Vec<String>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Shard a grant you hold over a coordinator's stewards, one child each.
    // Its usage wrapped to fit 100 columns (clap does not wrap usage).
    #[command(
        override_usage = "mesh-node grant shard [OPTIONS] --grant <GRANT> --key <KEY>\n       --coordinator <COORDINATOR> --out <OUT>"
    )]
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
pub enum JournalAction {
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
pub enum MeshAction {
    /// Members, their adverts, round trip and age.
    Status {
        #[command(flatten)]
        observe: crate::cli::mesh_cli::ObserveArgs,
        /// Print one JSON array.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
pub struct WeightsTarget {
    /// The node's key file (its steward's).
    #[arg(long)]
    pub key: PathBuf,
    /// The node's data directory (the journal is in DATA/steward).
    #[arg(long)]
    pub data: PathBuf,
    /// The model file: its name is the recipe, its weights the change's `to`.
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, default_value = crate::cli::weights::DEFAULT_BACKEND)]
    pub backend: String,
}

#[derive(Debug, Subcommand)]
pub enum WeightsAction {
    /// Record a plan: the changes foreseen, before them.
    // Its usage wrapped to fit 100 columns (clap does not wrap usage).
    #[command(
        override_usage = "mesh-node weights plan [OPTIONS] --key <KEY> --data <DATA> --model <MODEL>\n       --validation <VALIDATION> --foresees <FORESEES>"
    )]
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
    // Its usage wrapped to fit 100 columns (clap does not wrap usage).
    #[command(
        override_usage = "mesh-node weights record [OPTIONS] --key <KEY> --data <DATA> --model <MODEL>\n       --reason <REASON>"
    )]
    Record {
        #[command(flatten)]
        target: WeightsTarget,
        /// The precision its receipts name (default: the model's on the
        /// CPU with an f32 wire, as `serve` names it there).
        #[arg(long)]
        precision: Option<String>,
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
pub enum LogAction {
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
pub enum StewardAction {
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
        #[arg(long, default_value = crate::runtime::energy::POWERCAP_ROOT)]
        powercap: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum ModelsAction {
    /// The models this project knows (cached or not) and every other GGUF
    /// in the model cache: size, architecture, quantization, path.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Download a known model into the cache (checked against its pinned
    /// SHA-256), showing progress; prints its path.
    Pull {
        /// Its name, as `models list` shows it (e.g. smollm2, gemma3).
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum VectorsAction {
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
pub enum BenchTarget {
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
    /// What audits cost: the same greedy requests one after another over a
    /// three-node split in this process at each audit rate, in rotating
    /// rounds; throughput (tokens over the wall time to the last bundle)
    /// against no audits.
    Audit {
        /// A GGUF file (default: SmolLM2-135M from the model cache, else the
        /// built-in synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Tokens each request generates.
        #[arg(long, default_value_t = 32)]
        tokens: usize,
        /// Requests per run, one after another.
        #[arg(long, default_value_t = 10)]
        requests: usize,
        /// Audit rates, the first 0 (the baseline).
        #[arg(long, value_delimiter = ',', default_value = "0,0.02,1")]
        rates: Vec<f64>,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// The memory of three `serve` processes on 127.0.0.1 after one greedy
    /// request: each one's peak RSS, and what the middle stage holds beyond
    /// its weights and KV cache.
    StageMemory {
        /// A GGUF file (default: SmolLM2-135M from the model cache, else the
        /// built-in synthetic model).
        #[arg(long)]
        model: Option<PathBuf>,
        /// A prompt of about this many tokens (plain text) instead of the
        /// short chat prompt.
        #[arg(long)]
        prompt_tokens: Option<usize>,
        /// Tokens the request generates.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// The mesh-node binary whose `serve` processes are measured
        /// (default: this one), to measure two builds side by side.
        #[arg(long)]
        binary: Option<PathBuf>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every command's help, short and long, fits 100 columns.
    #[test]
    fn every_help_fits_100_columns() {
        fn check(
            command: &mut clap::Command,
            path: &str,
            wide: &mut Vec<String>,
            seen: &mut usize,
        ) {
            for help in [command.render_help(), command.render_long_help()] {
                *seen += 1;
                for line in help.to_string().lines() {
                    if line.chars().count() > 100 {
                        wide.push(format!("{path}: {line}"));
                    }
                }
            }
            for sub in command.get_subcommands_mut() {
                let path = format!("{path} {}", sub.get_name());
                check(sub, &path, wide, seen);
            }
        }
        let mut command = Cli::command();
        command.build();
        let (mut wide, mut seen) = (Vec::new(), 0);
        check(&mut command, "mesh-node", &mut wide, &mut seen);
        assert!(seen > 40, "every command's help was read ({seen})");
        assert!(
            wide.is_empty(),
            "help lines over 100 columns:\n{}",
            wide.join("\n")
        );
    }
}
