//! A small synthetic Llama model generated from a seed: clearly not a real
//! model (its weights are seeded noise), but a real one as far as the engine
//! is concerned — GGUF and safetensors copies, a byte-level BPE tokenizer and
//! a ChatML template — so every path can be tested without downloads.

use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};

use crate::error::{EngineError, Result};
use crate::source::{TRAINING_AUTHORITY_KEY, TRAINING_DIGEST_KEY};

/// Shape of the synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    pub seed: u64,
    pub layers: u32,
    /// A multiple of 256 so every GGUF quantization (K-quants included) applies.
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub context: usize,
    /// Write a Qwen2 (q/k/v biases, rotary by halves in GGUF too) instead of
    /// a Llama.
    pub qwen2: bool,
    /// Declare a training corpus (SPEC §3.7) in the GGUF metadata: its
    /// digest (64 hex) and authority (`signed`, `logged` or `opaque`).
    pub training: Option<(String, String)>,
    /// The chat template (Jinja) the GGUF carries (default: ChatML).
    pub chat_template: String,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        Self {
            seed: 2026,
            layers: 6,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            ffn: 512,
            context: 2048,
            qwen2: false,
            training: None,
            chat_template: CHAT_TEMPLATE.into(),
        }
    }
}

/// Bumped whenever the generated files change (weights, tokenizer), so cached
/// copies are rewritten.
pub const SYNTHETIC_VERSION: u32 = 3;

pub const SYNTHETIC_NAME: &str = "synthetic-llama (seeded weights, not a trained model)";
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const CHAT_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GPT-2's byte-to-character table, so byte-level BPE sees printable text.
fn byte_tokens() -> Vec<String> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                let c = next;
                next += 1;
                c
            };
            char::from_u32(code).map(String::from).unwrap_or_default()
        })
        .collect()
}

struct Noise(u64);

impl Noise {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // Uniform in [-1, 1).
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn tensor(&mut self, rows: usize, cols: usize, scale: f32, offset: f32) -> Result<Tensor> {
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| offset + scale * self.next())
            .collect();
        let shape: Vec<usize> = if rows == 1 {
            vec![cols]
        } else {
            vec![rows, cols]
        };
        Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
    }
}

/// llama.cpp's reordering of Q/K rows for its interleaved rotary layout.
fn permute_for_gguf(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, cols) = w.dims2()?;
    let head_dim = out / heads;
    Ok(w.reshape((heads, 2, head_dim / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((out, cols))?)
}

/// The tensors of the model, in Hugging Face naming and layout.
fn hf_tensors(spec: &SyntheticSpec, vocab: usize) -> Result<Vec<(String, Tensor)>> {
    let mut noise = Noise(spec.seed);
    let head_dim = spec.hidden / spec.heads;
    let kv = spec.kv_heads * head_dim;
    let scale = 1.0 / (spec.hidden as f32).sqrt();
    let mut tensors = vec![(
        "model.embed_tokens.weight".to_string(),
        noise.tensor(vocab, spec.hidden, 1.0, 0.0)?,
    )];
    for i in 0..spec.layers {
        let p = |n: &str| format!("model.layers.{i}.{n}");
        tensors.push((
            p("input_layernorm.weight"),
            noise.tensor(1, spec.hidden, 0.1, 1.0)?,
        ));
        tensors.push((
            p("self_attn.q_proj.weight"),
            noise.tensor(spec.hidden, spec.hidden, scale * 2.0, 0.0)?,
        ));
        tensors.push((
            p("self_attn.k_proj.weight"),
            noise.tensor(kv, spec.hidden, scale * 2.0, 0.0)?,
        ));
        tensors.push((
            p("self_attn.v_proj.weight"),
            noise.tensor(kv, spec.hidden, scale, 0.0)?,
        ));
        if spec.qwen2 {
            for (name, width) in [("q", spec.hidden), ("k", kv), ("v", kv)] {
                tensors.push((
                    p(&format!("self_attn.{name}_proj.bias")),
                    noise.tensor(1, width, 0.1, 0.0)?,
                ));
            }
        }
        tensors.push((
            p("self_attn.o_proj.weight"),
            noise.tensor(spec.hidden, spec.hidden, scale, 0.0)?,
        ));
        tensors.push((
            p("post_attention_layernorm.weight"),
            noise.tensor(1, spec.hidden, 0.1, 1.0)?,
        ));
        tensors.push((
            p("mlp.gate_proj.weight"),
            noise.tensor(spec.ffn, spec.hidden, scale, 0.0)?,
        ));
        tensors.push((
            p("mlp.up_proj.weight"),
            noise.tensor(spec.ffn, spec.hidden, scale, 0.0)?,
        ));
        tensors.push((
            p("mlp.down_proj.weight"),
            noise.tensor(spec.hidden, spec.ffn, 1.0 / (spec.ffn as f32).sqrt(), 0.0)?,
        ));
    }
    tensors.push((
        "model.norm.weight".into(),
        noise.tensor(1, spec.hidden, 0.1, 1.0)?,
    ));
    // Damp the output rows of everything but printable ASCII, so that what
    // the model says, noise as it is, prints as text.
    let head = noise.tensor(vocab, spec.hidden, scale * 4.0, 0.0)?;
    let damp: Vec<f32> = (0..vocab)
        .map(|t| if (32..127).contains(&t) { 1.0 } else { 0.05 })
        .collect();
    let head = head.broadcast_mul(&Tensor::from_vec(damp, (vocab, 1), &Device::Cpu)?)?;
    tensors.push(("lm_head.weight".into(), head));
    Ok(tensors)
}

fn gguf_name(hf: &str) -> String {
    let map = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = map.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.trim_start_matches("model.layers.");
    let (index, part) = rest.split_once('.').unwrap_or(("0", rest));
    let part = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => other,
    };
    format!("blk.{index}.{part}")
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Which files a synthetic model directory holds.
#[derive(Debug, Clone)]
pub struct SyntheticModel {
    pub dir: PathBuf,
    /// The safetensors copy (a directory: config, weights, tokenizer).
    pub safetensors_dir: PathBuf,
    /// GGUF copies by weight type (F32 always first).
    pub gguf: Vec<(GgmlDType, PathBuf)>,
}

impl SyntheticModel {
    pub fn gguf(&self, dtype: GgmlDType) -> Option<&Path> {
        self.gguf
            .iter()
            .find(|(d, _)| *d == dtype)
            .map(|(_, p)| p.as_path())
    }
}

/// Write the synthetic model under `dir`: `safetensors/` and one GGUF file
/// per requested weight type (norms stay F32, as llama.cpp keeps them).
pub fn write_synthetic(
    dir: &Path,
    spec: &SyntheticSpec,
    gguf_types: &[GgmlDType],
) -> Result<SyntheticModel> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut tokens = byte_tokens();
    tokens.extend(SPECIALS.iter().map(|s| s.to_string()));
    let vocab = tokens.len();
    let hf = hf_tensors(spec, vocab)?;

    let metadata: Vec<(String, gguf_file::Value)> = {
        use gguf_file::Value as V;
        let u32v = |v: usize| V::U32(v as u32);
        let arch = if spec.qwen2 { "qwen2" } else { "llama" };
        let key = |k: &str| format!("{arch}.{k}");
        vec![
            ("general.architecture".into(), V::String(arch.into())),
            ("general.name".into(), V::String(SYNTHETIC_NAME.into())),
            (key("block_count"), V::U32(spec.layers)),
            (key("context_length"), u32v(spec.context)),
            (key("embedding_length"), u32v(spec.hidden)),
            (key("feed_forward_length"), u32v(spec.ffn)),
            (key("attention.head_count"), u32v(spec.heads)),
            (key("attention.head_count_kv"), u32v(spec.kv_heads)),
            (key("rope.freq_base"), V::F32(10_000.0)),
            (key("attention.layer_norm_rms_epsilon"), V::F32(1e-5)),
            ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), V::String("default".into())),
            (
                "tokenizer.ggml.tokens".into(),
                V::Array(tokens.iter().map(|t| V::String(t.clone())).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                V::Array(
                    (0..vocab)
                        .map(|i| V::I32(if i < 256 { 1 } else { 3 }))
                        .collect(),
                ),
            ),
            ("tokenizer.ggml.merges".into(), V::Array(Vec::new())),
            ("tokenizer.ggml.bos_token_id".into(), u32v(256)),
            ("tokenizer.ggml.eos_token_id".into(), u32v(256)),
            ("tokenizer.ggml.add_bos_token".into(), V::Bool(false)),
            (
                "tokenizer.chat_template".into(),
                V::String(spec.chat_template.clone()),
            ),
        ]
        .into_iter()
        .chain(spec.training.iter().flat_map(|(digest, authority)| {
            [
                (TRAINING_DIGEST_KEY.into(), V::String(digest.clone())),
                (TRAINING_AUTHORITY_KEY.into(), V::String(authority.clone())),
            ]
        }))
        .collect()
    };
    let mut gguf = Vec::new();
    for dtype in gguf_types {
        let mut quantized = Vec::with_capacity(hf.len());
        for (name, tensor) in &hf {
            let mut t = tensor.clone();
            if spec.qwen2 {
                // Qwen2 GGUF files keep Hugging Face's layout (rotary by halves).
            } else if name.ends_with("q_proj.weight") {
                t = permute_for_gguf(&t, spec.heads)?;
            } else if name.ends_with("k_proj.weight") {
                t = permute_for_gguf(&t, spec.kv_heads)?;
            }
            let target = if t.rank() == 1 {
                GgmlDType::F32
            } else {
                *dtype
            };
            quantized.push((gguf_name(name), QTensor::quantize(&t, target)?));
        }
        let path = dir.join(format!(
            "synthetic-{}.gguf",
            format!("{dtype:?}").to_lowercase()
        ));
        let mut file = std::fs::File::create(&path).map_err(io(&path))?;
        let meta: Vec<(&str, &gguf_file::Value)> =
            metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let refs: Vec<(&str, &QTensor)> = quantized.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut file, &meta, &refs)?;
        file.flush().map_err(io(&path))?;
        gguf.push((*dtype, path));
    }

    let st = dir.join("safetensors");
    std::fs::create_dir_all(&st).map_err(io(&st))?;
    let config = serde_json::json!({
        "architectures": [if spec.qwen2 { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }], "model_type": if spec.qwen2 { "qwen2" } else { "llama" },
        "hidden_size": spec.hidden, "intermediate_size": spec.ffn, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "num_hidden_layers": spec.layers, "vocab_size": vocab,
        "max_position_embeddings": spec.context, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "torch_dtype": "float32",
    });
    let config_path = st.join("config.json");
    std::fs::write(
        &config_path,
        serde_json::to_vec_pretty(&config).unwrap_or_default(),
    )
    .map_err(io(&config_path))?;
    let map: std::collections::HashMap<String, Tensor> = hf.into_iter().collect();
    candle_core::safetensors::save(&map, st.join("model.safetensors"))?;
    // The tokenizer is the one the GGUF metadata builds, saved as JSON, so
    // both copies tokenize identically by construction.
    let first = gguf
        .first()
        .map(|(_, p)| p.clone())
        .ok_or(EngineError::WrongInput("needs at least one GGUF type"))?;
    let mut file = std::fs::File::open(&first).map_err(io(&first))?;
    let content = gguf_file::Content::read(&mut file)?;
    let tokenizer = crate::text::byte_level_bpe(&content)?;
    tokenizer
        .save(st.join("tokenizer.json"), false)
        .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
    let tokenizer_config = serde_json::json!({
        "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "add_bos_token": false, "chat_template": spec.chat_template,
    });
    let tc = st.join("tokenizer_config.json");
    std::fs::write(
        &tc,
        serde_json::to_vec_pretty(&tokenizer_config).unwrap_or_default(),
    )
    .map_err(io(&tc))?;
    Ok(SyntheticModel {
        dir: dir.to_path_buf(),
        safetensors_dir: st,
        gguf,
    })
}
