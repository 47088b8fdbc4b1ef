//! `mesh-node chat`: a terminal conversation with a coordinator, through
//! its OpenAI-compatible API (`serve --http`): each turn is sent with the
//! whole history, the answer streams in as it is generated, and a line
//! after it says what the turn cost (tokens, and the energy of every stage
//! that served it, as its receipts say).

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// Longest a turn's answer may take to begin or go on streaming.
const READ_TIMEOUT: Duration = Duration::from_secs(600);
/// Most bytes one answer may take on the wire (its head, every chunk and
/// the usage): a server that sends more is cut off.
const MAX_ANSWER_BYTES: u64 = 16 * 1024 * 1024;
/// Turns kept: past this many, the oldest exchange is dropped.
const MAX_TURNS: usize = 64;

/// What `chat` asks with.
#[derive(Debug, Clone)]
pub struct ChatOptions {
    /// HOST:PORT of the coordinator's HTTP API.
    pub api: String,
    pub system: Option<String>,
    pub max_tokens: usize,
    pub temperature: f64,
}

/// The conversation loop: reads lines from `input` until it ends or says
/// `/quit`; `/reset` forgets the history.
pub fn run(options: &ChatOptions, input: impl BufRead, out: &mut impl Write) -> anyhow::Result<()> {
    let mut history: Vec<Value> = Vec::new();
    writeln!(
        out,
        "chatting with {} (/reset forgets the conversation, /quit or end of input leaves)",
        options.api
    )?;
    prompt(out)?;
    for line in input.lines() {
        let line = line?;
        let said = line.trim();
        match said {
            "" => {}
            "/quit" | "/exit" => break,
            "/reset" => {
                history.clear();
                writeln!(out, "(the conversation is forgotten)")?;
            }
            _ => {
                history.push(json!({"role": "user", "content": said}));
                match turn(options, &history, out) {
                    Ok(answer) => {
                        history.push(json!({"role": "assistant", "content": answer}));
                        if history.len() > 2 * MAX_TURNS {
                            history.drain(..2);
                        }
                    }
                    Err(error) => {
                        // The question stays unanswered: it is not kept.
                        history.pop();
                        writeln!(out, "\n(not answered: {error:#})")?;
                    }
                }
            }
        }
        prompt(out)?;
    }
    writeln!(out)?;
    Ok(())
}

fn prompt(out: &mut impl Write) -> std::io::Result<()> {
    write!(out, "> ")?;
    out.flush()
}

/// One turn: the history sent, the answer streamed to `out` and returned.
fn turn(options: &ChatOptions, history: &[Value], out: &mut impl Write) -> anyhow::Result<String> {
    let mut messages = Vec::new();
    if let Some(system) = &options.system {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.extend(history.iter().cloned());
    let body = json!({
        // A coordinator answers with the one model it serves.
        "model": "served",
        "messages": messages,
        "stream": true,
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
    })
    .to_string();
    let addr = options
        .api
        .to_socket_addrs()
        .with_context(|| format!("`{}`: give the API's HOST:PORT", options.api))?
        .next()
        .with_context(|| format!("`{}` resolves to no address", options.api))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .with_context(|| format!("connecting to {addr}: is `serve --http` running there?"))?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    // HTTP/1.0: the answer streams until the server closes the connection.
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::new(std::io::Read::take(stream, MAX_ANSWER_BYTES));
    let mut status = String::new();
    reader.read_line(&mut status)?;
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("not an HTTP answer: {status:?}"))?;
    // The head, then the body.
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
            break;
        }
    }
    if code != 200 {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut reader, &mut rest);
        let message = serde_json::from_str::<Value>(&rest)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(rest);
        bail!("the API answered {code}: {message}");
    }
    let mut answer = String::new();
    let mut usage = Value::Null;
    for line in reader.lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).context("a chunk that is not JSON")?;
        if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
            answer.push_str(piece);
            write!(out, "{piece}")?;
            out.flush()?;
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    writeln!(out)?;
    if !usage.is_null() {
        let energy = &usage["energy"];
        writeln!(
            out,
            "  [{} tokens in, {} out; {} µJ ({}) over {} receipts]",
            usage["prompt_tokens"],
            usage["completion_tokens"],
            energy["microjoules"],
            energy["provenance"].as_str().unwrap_or("?"),
            energy["parts"].as_array().map_or(0, Vec::len)
        )?;
    }
    Ok(answer)
}
