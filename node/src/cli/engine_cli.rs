//! `mesh-node generate --model …`: run a model in one process, slice by
//! slice, each hand-off through the activation-frame encoding.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mesh_stage::ModelHandle;
use mesh_stage::frame::WireDType;
use mesh_stage::pipeline::Pipeline;
use mesh_stage::sampling::{Sampler, SamplingParams};
use serde_json::json;

/// The options of one local generation.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub model: Option<PathBuf>,
    pub prompt: String,
    pub max_tokens: usize,
    pub chat: bool,
    pub split: Option<String>,
    pub sampling: SamplingParams,
    pub wire: WireDType,
    pub json: bool,
}

pub fn open_model(model: Option<&Path>) -> anyhow::Result<ModelHandle> {
    let path = crate::cli::models::default_model(model.map(Path::to_path_buf))?;
    crate::cli::progress::showing(
        &format!("loading {} (its digests checked)", path.display()),
        || crate::runtime::open_model(&path),
    )
}

pub fn generate(options: &GenerateOptions) -> anyhow::Result<()> {
    let load_start = Instant::now();
    let handle = open_model(options.model.as_deref())?;
    // The prompt is tokenized before any slice loads: a model this engine
    // cannot tokenize is said at once.
    let text = if options.chat {
        handle.text()?.chat_prompt(&options.prompt)?
    } else {
        options.prompt.clone()
    };
    let prompt_ids = handle.text()?.encode(&text)?;
    let layers = handle.config().layers;
    let ranges = match &options.split {
        Some(spec) => mesh_stage::parse_split(spec, layers)?,
        None => std::iter::once(0..layers).collect(),
    };
    let mut slices = Vec::with_capacity(ranges.len());
    for (i, range) in ranges.iter().enumerate() {
        let what = format!(
            "  loading slice {}/{}: layers {}..{}",
            i + 1,
            ranges.len(),
            range.start,
            range.end
        );
        slices.push(crate::cli::progress::showing(&what, || {
            handle.load_slice(range.clone())
        })?);
    }
    let load_time = load_start.elapsed();
    let pipeline = Pipeline::new(slices, options.wire)?;
    let mut sampler = Sampler::new(options.sampling.clone());
    let codec = handle.text()?;
    let mut printed = String::new();
    let mut produced: Vec<u32> = Vec::new();
    let mut stdout = std::io::stdout();
    let generation = pipeline.generate(
        &prompt_ids,
        options.max_tokens,
        &mut sampler,
        &|t| codec.is_eos(t),
        &mut |token| {
            if options.json {
                return;
            }
            produced.push(token);
            if let Ok(text) = codec.decode(&produced)
                && let Some(new) = text.strip_prefix(printed.as_str())
            {
                let _ = write!(stdout, "{new}");
                let _ = stdout.flush();
                printed = text;
            }
        },
    )?;
    let answer_ids: Vec<u32> = generation
        .tokens
        .iter()
        .copied()
        .filter(|t| !codec.is_eos(*t))
        .collect();
    let text = codec.decode(&answer_ids)?;
    if options.json {
        let value = json!({
            "text": text,
            "token_ids": generation.tokens,
            "prompt_token_ids": prompt_ids,
            "model": {
                "path": handle.path().display().to_string(),
                "architecture": handle.config().architecture,
                "layers": layers,
                "package_id": format!("sha256:{}", mesh_protocol::hex::encode(&handle.package_id())),
                "weights_digest": mesh_protocol::hex::encode(&handle.weights_digest()),
            },
            "slices": pipeline.slices().iter().map(|s| json!({
                "range": [s.range.start, s.range.end],
                "weights_digest": mesh_protocol::hex::encode(&s.weights_digest()),
                "weight_bytes": s.weight_bytes(),
            })).collect::<Vec<_>>(),
            "wire": format!("{:?}", options.wire).to_lowercase(),
            "frame_bytes": generation.frame_bytes,
            "timings": {
                "load_s": load_time.as_secs_f64(),
                "prefill_tokens": generation.timings.prefill_tokens,
                "prefill_tokens_per_s": generation.timings.prefill_tokens_per_s(),
                "decode_tokens": generation.timings.decode_tokens,
                "decode_tokens_per_s": generation.timings.decode_tokens_per_s(),
            },
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!();
        eprintln!(
            "{} prompt tokens at {:.1} tok/s, {} decoded at {:.1} tok/s, over {} slice(s); load {:.2} s",
            generation.timings.prefill_tokens,
            generation.timings.prefill_tokens_per_s(),
            generation.timings.decode_tokens,
            generation.timings.decode_tokens_per_s(),
            pipeline.slices().len(),
            load_time.as_secs_f64()
        );
    }
    Ok(())
}
