//! The house's shape, checked like a benchmark's numbers (issue 38): the
//! serving runtime's functions and files stay small, no module imports its
//! way back to itself, `cli/` and `tools/` stay apart, lane bytes are
//! folded only in the protocol's hop session, each role's state stays
//! narrow, and the fence holds: the protocol does no I/O, reads no clock
//! and draws no randomness of its own, the engine does no networking.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Most lines a function in `node/src/runtime` may span.
const MAX_FUNCTION_LINES: usize = 150;
/// Most lines a file in `node/src/runtime` may hold.
const MAX_FILE_LINES: usize = 1000;
/// Most fields a role's state may hold.
const MAX_ROLE_FIELDS: usize = 15;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

fn node_src() -> PathBuf {
    workspace().join("node/src")
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The source with comments, string and character literals blanked (line
/// breaks kept), so braces and words are the code's own.
fn code_only(source: &str) -> String {
    let bytes = source.as_bytes();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    let blank = |out: &mut String, text: &[u8]| {
        for &b in text {
            out.push(if b == b'\n' { '\n' } else { ' ' });
        }
    };
    while i < bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(b"//") {
            let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"/*") {
            let end = source[i + 2..].find("*/").map_or(rest.len(), |e| e + 4);
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"r#") || rest.starts_with(b"r\"") {
            let hashes = rest[1..].iter().take_while(|&&b| b == b'#').count();
            if rest.get(1 + hashes) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            let close = format!("\"{}", "#".repeat(hashes));
            let body = 2 + hashes;
            let end = source[i + body..]
                .find(&close)
                .map_or(rest.len(), |e| body + e + close.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'"' {
            let mut end = 1;
            while end < rest.len() && rest[end] != b'"' {
                end += if rest[end] == b'\\' { 2 } else { 1 };
            }
            let end = (end + 1).min(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'\'' {
            // A character literal ('x', '\n', '\u{..}'); a lifetime is left.
            let literal = if rest.get(1) == Some(&b'\\') {
                rest[2..].iter().position(|&b| b == b'\'').map(|e| e + 3)
            } else {
                let width = source[i + 1..].chars().next().map_or(1, char::len_utf8);
                (rest.get(1 + width) == Some(&b'\'')).then_some(2 + width)
            };
            match literal {
                Some(end) => {
                    blank(&mut out, &rest[..end]);
                    i += end;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let width = source[i..].chars().next().map_or(1, char::len_utf8);
            out.push_str(&source[i..i + width]);
            i += width;
        }
    }
    out
}

/// Each function's name, first line and length in lines.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(name) = function_name(line) else {
            continue;
        };
        let mut depth = 0i64;
        let mut opened = false;
        for (end, line) in lines.iter().enumerate().skip(start) {
            for c in line.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth <= 0 {
                found.push((name.clone(), start + 1, end - start + 1));
                break;
            }
            if !opened && line.trim_end().ends_with(';') {
                break;
            }
        }
    }
    found
}

/// The name a line declares a function by, if it does.
fn function_name(line: &str) -> Option<String> {
    let mut words = line.split_whitespace().peekable();
    while let Some(word) = words.peek() {
        let qualifier = word.starts_with("pub")
            || matches!(*word, "async" | "const" | "unsafe" | "extern" | "default");
        if !qualifier {
            break;
        }
        words.next();
    }
    if words.next()? != "fn" {
        return None;
    }
    let name: String = words
        .next()?
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

fn relative(path: &Path) -> String {
    path.strip_prefix(workspace())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn the_runtime_has_no_function_over_150_lines_and_no_file_over_1000() {
    let runtime = node_src().join("runtime");
    let mut over = Vec::new();
    for file in rust_files(&runtime) {
        let source = std::fs::read_to_string(&file).expect("a source file");
        let lines = source.lines().count();
        if lines > MAX_FILE_LINES {
            over.push(format!("{}: {lines} lines", relative(&file)));
        }
        for (name, line, length) in functions(&code_only(&source)) {
            if length > MAX_FUNCTION_LINES {
                over.push(format!(
                    "{}:{line}: fn {name} spans {length} lines",
                    relative(&file)
                ));
            }
        }
    }
    assert!(
        over.is_empty(),
        "at most {MAX_FUNCTION_LINES} lines a function and {MAX_FILE_LINES} a file in node/src/runtime:\n{}",
        over.join("\n")
    );
}

/// A module: its path below the crate root (`runtime/serve/stage/run`).
type Module = Vec<String>;

/// Which module each file of a crate's `src` is.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    rust_files(src)
        .into_iter()
        .filter(|file| file.file_name().is_some_and(|n| n != "main.rs"))
        .map(|file| {
            let relative = file.strip_prefix(src).expect("below src");
            let mut module: Module = relative
                .with_extension("")
                .iter()
                .map(|part| part.to_string_lossy().into_owned())
                .collect();
            if module
                .last()
                .is_some_and(|last| last == "mod" || last == "lib")
            {
                module.pop();
            }
            (module, file)
        })
        .collect()
}

/// Every module each module imports: `use` items (one level of braces),
/// paths written inline (`crate::a::b`, `super::x`), and a `mod.rs`'s paths
/// through its own children. Test modules are left out.
fn import_graph(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let modules = modules(src);
    let resolve = |mut path: Module| -> Option<Module> {
        loop {
            if modules.contains_key(&path) {
                return Some(path);
            }
            path.pop()?;
        }
    };
    let mut graph = BTreeMap::new();
    for (module, file) in &modules {
        let source = std::fs::read_to_string(file).expect("a source file");
        let source = source
            .split("\n#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or_default();
        let code = code_only(source);
        let is_dir = file
            .file_name()
            .is_some_and(|n| n == "mod.rs" || n == "lib.rs");
        // `self` is the module itself, `super` its parent, whether the
        // module is a `mod.rs` or a file of its own.
        let base: Module = module.clone();
        let mut paths: Vec<String> = Vec::new();
        for statement in code.split(';') {
            let Some(at) = statement.find("use ") else {
                continue;
            };
            let body: String = statement[at + 4..].split_whitespace().collect();
            match body.split_once("::{") {
                Some((head, inner)) => {
                    for item in inner.trim_end_matches('}').split(',') {
                        let item = item.split(['{', ':']).next().unwrap_or_default();
                        paths.push(format!("{head}::{item}"));
                    }
                }
                None => paths.push(body),
            }
        }
        let words: Vec<&str> = code
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .filter(|w| w.contains("::"))
            .collect();
        for word in words {
            let first = word.split("::").next().unwrap_or_default();
            if matches!(first, "crate" | "super" | "self") {
                paths.push(word.to_string());
            } else if is_dir {
                let mut child = base.clone();
                child.push(first.to_string());
                if modules.contains_key(&child) {
                    paths.push(format!("self::{word}"));
                }
            }
        }
        let mut imports = BTreeSet::new();
        for path in paths {
            let mut parts = path.split("::").filter(|p| !p.is_empty()).peekable();
            let target: Module = match parts.peek().copied() {
                Some("crate") => parts.skip(1).map(str::to_string).collect(),
                Some("super" | "self") => {
                    let mut at = base.clone();
                    while let Some(&step) = parts.peek() {
                        match step {
                            "super" => {
                                at.pop();
                            }
                            "self" => {}
                            _ => break,
                        }
                        parts.next();
                    }
                    at.extend(parts.map(str::to_string));
                    at
                }
                _ => continue,
            };
            if let Some(target) = resolve(target).filter(|t| t != module) {
                imports.insert(target);
            }
        }
        graph.insert(module.clone(), imports);
    }
    graph
}

/// The import circles: strongly connected sets of more than one module.
fn circles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    // Kosaraju: finish order on the graph, then components on its reverse.
    fn finish(
        graph: &BTreeMap<Module, BTreeSet<Module>>,
        start: &Module,
        seen: &mut BTreeSet<Module>,
        order: &mut Vec<Module>,
    ) {
        let mut stack = vec![(start.clone(), false)];
        while let Some((module, done)) = stack.pop() {
            if done {
                order.push(module);
                continue;
            }
            if !seen.insert(module.clone()) {
                continue;
            }
            stack.push((module.clone(), true));
            for next in graph.get(&module).into_iter().flatten() {
                if !seen.contains(next) {
                    stack.push((next.clone(), false));
                }
            }
        }
    }
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    for module in graph.keys() {
        finish(graph, module, &mut seen, &mut order);
    }
    let mut reverse: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (from, targets) in graph {
        for to in targets {
            reverse.entry(to.clone()).or_default().insert(from.clone());
        }
    }
    let mut assigned = BTreeSet::new();
    let mut found = Vec::new();
    for module in order.iter().rev() {
        if assigned.contains(module) {
            continue;
        }
        let mut component = Vec::new();
        let mut stack = vec![module.clone()];
        while let Some(m) = stack.pop() {
            if !assigned.insert(m.clone()) {
                continue;
            }
            for next in reverse.get(&m).into_iter().flatten() {
                if !assigned.contains(next) {
                    stack.push(next.clone());
                }
            }
            component.push(m);
        }
        if component.len() > 1 {
            component.sort();
            found.push(component);
        }
    }
    found
}

#[test]
fn no_module_imports_its_way_back_to_itself() {
    let mut found = Vec::new();
    for krate in ["node/src", "protocol/src", "stage/src"] {
        let graph = import_graph(&workspace().join(krate));
        assert!(graph.len() > 3, "{krate}: the modules were read");
        for circle in circles(&graph) {
            let names: Vec<String> = circle.iter().map(|m| m.join("/")).collect();
            found.push(format!("{krate}: {}", names.join(" <-> ")));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The circle finder sees a circle when there is one (a check that
/// cannot fail proves nothing).
#[test]
fn the_circle_finder_finds_a_circle() {
    let module = |name: &str| vec![name.to_string()];
    let mut graph = BTreeMap::new();
    graph.insert(module("a"), BTreeSet::from([module("b")]));
    graph.insert(module("b"), BTreeSet::from([module("c")]));
    graph.insert(module("c"), BTreeSet::from([module("a")]));
    graph.insert(module("d"), BTreeSet::from([module("a")]));
    assert_eq!(
        circles(&graph),
        vec![vec![module("a"), module("b"), module("c")]]
    );
    graph.insert(module("c"), BTreeSet::new());
    assert!(circles(&graph).is_empty());
}

#[test]
fn cli_and_tools_do_not_import_each_other() {
    let graph = import_graph(&node_src());
    let crossing: Vec<String> = graph
        .iter()
        .flat_map(|(from, targets)| targets.iter().map(move |to| (from, to)))
        // The command line (`cli/args.rs`, `cli/commands.rs`) is the
        // binary's dispatch, as main.rs was: it runs the tools' commands too.
        .filter(|(from, _)| !matches!(from.join("/").as_str(), "cli/commands" | "cli/args"))
        .filter(|(from, to)| {
            let (a, b) = (from.first(), to.first());
            a != b
                && matches!(a.map(String::as_str), Some("cli" | "tools"))
                && matches!(b.map(String::as_str), Some("cli" | "tools"))
        })
        .map(|(from, to)| format!("{} -> {}", from.join("/"), to.join("/")))
        .collect();
    assert!(
        graph.keys().any(|m| m.first().is_some_and(|f| f == "cli"))
            && graph
                .keys()
                .any(|m| m.first().is_some_and(|f| f == "tools")),
        "cli and tools were read"
    );
    assert!(crossing.is_empty(), "{}", crossing.join("\n"));
}

/// Lane bytes are folded in one place: the protocol's hop session. Its
/// primitives (`LaneFold`, `fold_frames`) appear in the node only where the
/// vector generator pins the primitive itself.
#[test]
fn lane_bytes_are_folded_only_in_the_hop_session() {
    let primitives = [
        "LaneFold",
        "LaneContext",
        "fold_frames(",
        "frame_chunk(",
        "push_frame(",
    ];
    let allowed = node_src().join("tools/vectors/split_stage.rs");
    let mut found = Vec::new();
    for file in rust_files(&node_src()) {
        if file == allowed {
            continue;
        }
        let code = code_only(&std::fs::read_to_string(&file).expect("a source file"));
        for (n, line) in code.lines().enumerate() {
            if primitives.iter().any(|p| line.contains(p)) {
                found.push(format!("{}:{}: {}", relative(&file), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "lane folds outside the hop session:\n{}",
        found.join("\n")
    );
    let session =
        std::fs::read_to_string(workspace().join("protocol/src/session.rs")).expect("session.rs");
    assert!(
        session.contains("LaneFold"),
        "the hop session folds the lanes"
    );
}

/// Fields of `struct name` in `file`.
fn field_count(file: &Path, name: &str) -> usize {
    let code = code_only(&std::fs::read_to_string(file).expect("a source file"));
    let start = code
        .find(&format!("struct {name} {{"))
        .unwrap_or_else(|| panic!("struct {name} in {}", relative(file)));
    let body = &code[start..];
    let mut depth = 0;
    let mut fields = 0;
    let mut line_start = true;
    for (i, c) in body.char_indices() {
        match c {
            '{' | '(' | '<' | '[' => depth += 1,
            '}' | ')' | '>' | ']' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            '\n' => line_start = true,
            ':' if depth == 1 && line_start => {
                let before = body[..i].rsplit('\n').next().unwrap_or_default();
                let not_path = !body[i..].starts_with("::") && !before.ends_with(':');
                if not_path && !before.trim().is_empty() && !before.contains('#') {
                    fields += 1;
                    line_start = false;
                }
            }
            _ => {}
        }
    }
    fields
}

#[test]
fn each_role_holds_at_most_15_fields() {
    let serve = node_src().join("runtime/serve");
    let roles = [
        (serve.join("shared.rs"), "Shared"),
        (serve.join("stage/role.rs"), "StageRole"),
        (serve.join("coordinator/role.rs"), "CoordinatorRole"),
    ];
    for (file, name) in roles {
        let fields = field_count(&file, name);
        assert!(fields >= 3, "{name}'s fields were counted ({fields})");
        assert!(
            fields <= MAX_ROLE_FIELDS,
            "{name} holds {fields} fields, over {MAX_ROLE_FIELDS}"
        );
    }
}

/// Every package `package` depends on for its own code (normal
/// dependencies, followed through, with the features it asks for), by
/// name, as `cargo tree` resolves them for this machine's platform.
fn normal_dependencies(package: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = std::process::Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "--locked",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["--format", "{p}", "-p", package])
        .current_dir(workspace())
        .output()
        .expect("cargo tree runs");
    assert!(
        output.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != package)
        .map(str::to_string)
        .collect()
}

/// Crates that do I/O, read a clock or draw randomness: the protocol is
/// handed time, keys and randomness by its caller.
const NOT_IN_PROTOCOL: &[&str] = &[
    "tokio",
    "mio",
    "socket2",
    "quinn",
    "quinn-proto",
    "rustls",
    "libp2p",
    "redb",
    "candle-core",
    "rand",
    "rand_core",
    "getrandom",
    "chrono",
    "time",
    "hyper",
    "axum",
    "reqwest",
];

/// Crates that network: the engine computes, the node moves the bytes.
const NOT_IN_STAGE: &[&str] = &[
    "tokio",
    "mio",
    "socket2",
    "quinn",
    "quinn-proto",
    "rustls",
    "libp2p",
    "hyper",
    "axum",
    "reqwest",
    "ureq",
    "h2",
];

fn fenced(package: &str, banned: &[&str]) -> Vec<String> {
    normal_dependencies(package)
        .into_iter()
        .filter(|name| {
            banned.contains(&name.as_str())
                || name.starts_with("libp2p")
                || name.starts_with("tokio-")
        })
        .collect()
}

#[test]
fn the_fence_holds_protocol_is_sans_io_and_stage_does_no_networking() {
    let protocol = normal_dependencies("mesh-protocol");
    assert!(
        protocol.contains("blake3") && protocol.contains("ed25519-dalek"),
        "mesh-protocol's dependencies were read: {protocol:?}"
    );
    assert_eq!(
        fenced("mesh-protocol", NOT_IN_PROTOCOL),
        Vec::<String>::new()
    );
    assert_eq!(fenced("mesh-stage", NOT_IN_STAGE), Vec::<String>::new());
    // The fence would see a crossing: the node, which owns the I/O,
    // depends on what the protocol may not.
    assert!(!fenced("mesh-node", NOT_IN_PROTOCOL).is_empty());
}
