//! `mesh-node` processes for the multi-process tests: keys, `serve`
//! children killed on drop, their peer addresses.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_mesh-node")
}

/// A `mesh-node serve` child, killed when dropped.
pub struct Served {
    pub child: Child,
    pub peer: String,
    /// What the node printed before its peer address (its HTTP API's
    /// address among it).
    pub banner: Vec<String>,
}

impl Served {
    /// The address of the HTTP API a `serve --http` printed.
    pub fn api_addr(&self) -> std::net::SocketAddr {
        self.banner
            .iter()
            .find_map(|line| line.strip_prefix("OpenAI-compatible API: http://"))
            .and_then(|rest| rest.split('/').next())
            .expect("serve --http prints its API's address")
            .parse()
            .unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn keygen(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(format!("{name}.key"));
    if path.exists() {
        return path;
    }
    let out = Command::new(bin())
        .args(["keygen", "--out"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success());
    path
}

/// The node id of `name`'s key (made if needed), for `--coordinator`.
pub fn node_id(dir: &Path, name: &str) -> String {
    let seed = std::fs::read_to_string(keygen(dir, name)).unwrap();
    let key = mesh_protocol::SigningKey::from_bytes(
        &mesh_protocol::hex::decode_array(seed.trim()).unwrap(),
    );
    mesh_protocol::identity::did_key(&key.verifying_key().to_bytes())
}

/// A stage node serving the coordinator named "coord" in `dir`.
pub fn stage(dir: &Path, name: &str, model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Served {
    let coordinator = node_id(dir, "coord");
    let mut args = vec!["--coordinator", coordinator.as_str()];
    args.extend_from_slice(extra);
    serve(dir, name, model, &[], &args, env)
}

pub fn serve(
    dir: &Path,
    name: &str,
    model: &Path,
    peers: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> Served {
    let key = keygen(dir, name);
    let mut command = Command::new(bin());
    command.arg("serve");
    if !extra.contains(&"--listen") {
        command.args(["--listen", "127.0.0.1:0"]);
    }
    command
        .arg("--key")
        .arg(&key)
        .arg("--model")
        .arg(model)
        .arg("--data")
        .arg(dir.join(name))
        .args(extra)
        .stdout(Stdio::piped())
        // Its log, for the tests that read what a node logs.
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap());
    for peer in peers {
        command.args(["--peer", peer]);
    }
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let mut banner = Vec::new();
    let peer = loop {
        let line = lines
            .next()
            .expect("serve prints its peer address")
            .unwrap();
        if let Some(peer) = line.strip_prefix("peer address: ") {
            break peer.to_string();
        }
        banner.push(line);
    };
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Served {
        child,
        peer,
        banner,
    }
}
