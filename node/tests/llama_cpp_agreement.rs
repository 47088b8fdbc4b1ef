//! Agreement with llama.cpp, the reference for GGUF files: for a few fixed
//! prompts, the prompt's token ids and the first 16 greedy tokens of
//! `mesh-node generate` (unsplit, split in two and in three) against those
//! of llama.cpp's `llama-server` on the same file.
//!
//! Split runs must give exactly the unsplit tokens. Against llama.cpp the
//! tokens must be equal; where they are not, the test names the first step
//! that differs and accepts it only when that step was a near tie in
//! llama.cpp's own distribution: its top token's log-probability minus
//! that of ours is below `NEAR_TIE` (docs/engine.md says why). After the
//! first difference the two continuations are different texts, so nothing
//! after it is compared.
//!
//! Needs a llama.cpp build (`scripts/build-llama-cpp.sh llama-server`,
//! or `MESH_LLAMA_SERVER=/path/to/llama-server`); without one the test says
//! SKIPPED, and with `MESH_REQUIRE_LLAMA_CPP=1` it fails instead.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Largest log-probability gap, in nats, between llama.cpp's greedy token
/// and ours at the first step where they differ.
const NEAR_TIE: f64 = 0.35;
const STEPS: usize = 16;
const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "The three primary colors are",
];

/// A prompt of about 2,000 tokens (SmolLM2's and Gemma 3's tokenizers
/// give 2,004 and 1,911), so the greedy tokens come from attention over a
/// long context: notes on towns along a road, then a question on them.
fn long_prompt() -> String {
    const TOWNS: [&str; 8] = [
        "Arden", "Bellmoor", "Calder", "Dunmere", "Elmstead", "Fairholt", "Glenrock", "Harrow",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    const CRAFTS: [&str; 5] = [
        "weaving",
        "pottery",
        "cheese",
        "clockmaking",
        "boatbuilding",
    ];
    let mut text = String::from("Notes on the towns along the old river road.\n\n");
    for i in 0..41 {
        let (town, next) = (TOWNS[i % 8], TOWNS[(i + 3) % 8]);
        text += &format!(
            "Visit {}: {town} lies {} miles north of the river mouth. Its market opens on {}, \
             and its people are known for their {}. The road from {town} to {next} crosses {} \
             bridges.\n",
            i + 1,
            7 + (i * 13) % 90,
            DAYS[i % 7],
            CRAFTS[i % 5],
            1 + (i * 7) % 6,
        );
    }
    text + "\nOf all these towns, the one whose market opens first in the week is"
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_mesh-node")
}

fn llama_server() -> Option<PathBuf> {
    let path = std::env::var_os("MESH_LLAMA_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let root = std::env::var_os("MESH_BENCH_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/mesh-node/llama.cpp")
                });
            root.join("build/bin/llama-server")
        });
    common::present(
        path,
        "llama.cpp's llama-server (scripts/build-llama-cpp.sh llama-server)",
        "MESH_REQUIRE_LLAMA_CPP",
        "the llama.cpp agreement test",
    )
}

/// A llama-server child on a loopback port, killed when dropped.
struct LlamaServer {
    child: Child,
    port: u16,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl LlamaServer {
    /// `None` when the binary dies before it serves (a build for another
    /// CPU: its backend faults on an instruction this machine lacks).
    fn start(binary: &Path, model: &Path, log: &Path) -> Option<Self> {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(binary)
            .arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-c", "4096", "-np", "1", "-t", "2"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap();
        let mut server = Self { child, port };
        let started = Instant::now();
        loop {
            if let Ok((200, _)) = server.call("GET", "/health", None) {
                return Some(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                eprintln!(
                    "llama-server exited before serving ({status}); rebuild it on this machine \
                     (rm -rf ~/.cache/mesh-node/llama.cpp && scripts/build-llama-cpp.sh llama-server; \
                     where it dies of SIGILL in its AMX kernels, MESH_LLAMA_AMX=0 \
                     scripts/build-llama-cpp.sh llama-server and MESH_LLAMA_SERVER=<the path it prints>). \
                     Its log: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
                return None;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "llama-server did not come up; its log: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> std::io::Result<(u16, Value)> {
        common::http::call(
            SocketAddr::from(([127, 0, 0, 1], self.port)),
            method,
            path,
            body,
        )
    }
}

/// Our prompt ids and greedy tokens for `prompt`, with `split` if given.
fn ours(model: &Path, prompt: &str, split: Option<&str>) -> (Vec<u64>, Vec<u64>) {
    let mut command = Command::new(bin());
    command
        .args(["generate", "--json", "--prompt", prompt])
        .args(["--max-tokens", &STEPS.to_string(), "--model"])
        .arg(model);
    if let Some(split) = split {
        command.args(["--split", split]);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids = |key: &str| -> Vec<u64> {
        value[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    (ids("prompt_token_ids"), ids("token_ids"))
}

/// What llama.cpp made of a prompt.
struct Theirs {
    prompt_ids: Vec<u64>,
    tokens: Vec<u64>,
    /// Per step, its top tokens with their log-probabilities, best first.
    tops: Vec<Vec<(u64, f64)>>,
}

fn theirs(server: &LlamaServer, prompt: &str) -> Theirs {
    let (status, tokenized) = server
        .call(
            "POST",
            "/tokenize",
            Some(&json!({"content": prompt, "add_special": true})),
        )
        .unwrap();
    assert_eq!(status, 200, "{tokenized}");
    let prompt_ids: Vec<u64> = tokenized["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let request = json!({
        "prompt": prompt_ids,
        "n_predict": STEPS,
        "temperature": 0.0,
        "n_probs": 8,
        "return_tokens": true,
        "cache_prompt": false,
    });
    let (status, reply) = server.call("POST", "/completion", Some(&request)).unwrap();
    assert_eq!(status, 200, "{reply}");
    let tokens: Vec<u64> = reply["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let tops = reply["completion_probabilities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|step| {
            step["top_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| (t["id"].as_u64().unwrap(), t["logprob"].as_f64().unwrap()))
                .collect()
        })
        .collect();
    Theirs {
        prompt_ids,
        tokens,
        tops,
    }
}

fn agree(name: &str, model: &Path, splits: [&str; 2]) {
    let Some(binary) = llama_server() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = LlamaServer::start(&binary, model, &dir.path().join("llama-server.log"))
    else {
        assert!(
            std::env::var_os("MESH_REQUIRE_LLAMA_CPP").is_none(),
            "MESH_REQUIRE_LLAMA_CPP is set but llama-server does not run here"
        );
        eprintln!("SKIPPED {name}: the llama-server build here does not run");
        return;
    };
    for prompt in PROMPTS.map(String::from).into_iter().chain([long_prompt()]) {
        let prompt = prompt.as_str();
        let shown = if prompt.len() > 80 {
            format!("{:?}… ({} bytes)", &prompt[..40], prompt.len())
        } else {
            format!("{prompt:?}")
        };
        let (prompt_ids, tokens) = ours(model, prompt, None);
        for split in splits {
            assert_eq!(
                ours(model, prompt, Some(split)).1,
                tokens,
                "{name}, {shown}: split {split} differs from unsplit"
            );
        }
        let Theirs {
            prompt_ids: their_prompt,
            tokens: their_tokens,
            tops,
        } = theirs(&server, prompt);
        assert_eq!(
            prompt_ids, their_prompt,
            "{name}, {shown}: the prompt's token ids differ from llama.cpp's"
        );
        let first_difference = tokens.iter().zip(&their_tokens).position(|(a, b)| a != b);
        match first_difference {
            None => {
                assert_eq!(
                    tokens.len(),
                    their_tokens.len(),
                    "{name}, {shown}: one side stopped early: ours {tokens:?}, llama.cpp's {their_tokens:?}"
                );
                eprintln!(
                    "{name}, {shown}: all {} greedy tokens equal llama.cpp's",
                    tokens.len()
                );
            }
            Some(step) => {
                let top = &tops[step];
                let best = top[0].1;
                let gap = top
                    .iter()
                    .find(|(id, _)| *id == tokens[step])
                    .map(|(_, logprob)| best - logprob);
                let message = format!(
                    "{name}, {shown}: the first different token is step {step}: ours {}, \
                     llama.cpp's {}; llama.cpp's log-probability gap {gap:?} (tolerance {NEAR_TIE})",
                    tokens[step], their_tokens[step]
                );
                assert!(gap.is_some_and(|g| g < NEAR_TIE), "{message}");
                eprintln!("{message}: a near tie, accepted");
            }
        }
    }
}

#[test]
fn smollm2_agrees_with_llama_cpp_unsplit_and_split() {
    let Some(model) = common::smollm2("the llama.cpp agreement test (SmolLM2)") else {
        return;
    };
    agree(
        "SmolLM2-135M",
        &model,
        ["0..15,15..30", "0..6,6..25,25..30"],
    );
}

/// The boundaries fall between a local and a global attention layer (5 is
/// global, 4 and 6 local) and where the byte planner puts them.
#[test]
fn gemma3_agrees_with_llama_cpp_unsplit_and_split() {
    let Some(model) = common::gemma3("the llama.cpp agreement test (Gemma 3)") else {
        return;
    };
    agree("Gemma 3 270M", &model, ["0..5,5..18", "0..1,1..6,6..18"]);
}
