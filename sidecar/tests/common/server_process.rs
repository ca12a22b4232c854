//! The real server binary for end-to-end tests: found in `$CARGO_TARGET_DIR/<profile>/` or
//! `<workspace>/target/<profile>/`. When it is missing the tests print a notice and pass,
//! unless `CI` is set: then it is built first with `cargo build -p inferencecache-server`.

use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::process::{Child, Command};

use super::free_port;

fn profile_dir() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        v.push(
            PathBuf::from(t)
                .join(profile_dir())
                .join("inferencecache-server"),
        );
    }
    v.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target")
            .join(profile_dir())
            .join("inferencecache-server"),
    );
    v
}

/// The server binary, building it under CI when missing; `None` → skip.
pub fn server_binary() -> Option<PathBuf> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = candidates().into_iter().find(|p| p.is_file()) {
            return Some(p);
        }
        if std::env::var_os("CI").is_none() {
            eprintln!(
                "NOTICE: inferencecache-server binary not found in {:?}; skipping end-to-end test \
                 (build it with `cargo build -p inferencecache-server`, or set CI=1 to build it here)",
                candidates()
            );
            return None;
        }
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "-p", "inferencecache-server"])
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
        if profile_dir() == "release" {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "cargo build -p inferencecache-server failed");
        let found = candidates().into_iter().find(|p| p.is_file());
        assert!(found.is_some(), "server binary still missing after build");
        found
    })
    .clone()
}

/// A running server; killed on drop.
pub struct Server {
    _child: Child,
    /// gRPC port.
    pub grpc: u16,
    /// Control-plane port (`/snapshot`).
    pub snapshot: u16,
}

/// Starts the server; `None` when it exits before serving (e.g. an unsupported flag).
pub async fn start_server(
    bin: &Path,
    block_size: usize,
    extra: &[&str],
    log: &Path,
) -> Option<Server> {
    let tls = extra.contains(&"--tls-cert-file");
    let (p, q, r) = (free_port(), free_port(), free_port());
    let mut child = Command::new(bin)
        .args([
            "--grpc-bind-address",
            &format!("127.0.0.1:{p}"),
            "--http-bind-address",
            &format!("127.0.0.1:{q}"),
            "--snapshot-bind-address",
            &format!("127.0.0.1:{r}"),
            "--engine-block-size",
            &block_size.to_string(),
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn server");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            eprintln!(
                "NOTICE: server exited early ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            return None;
        }
        let ready = if tls {
            tokio::net::TcpStream::connect(("127.0.0.1", p))
                .await
                .is_ok()
        } else {
            match InferenceCacheClient::connect(format!("http://127.0.0.1:{p}")).await {
                Ok(mut c) => c
                    .get_cache_state(pb::GetCacheStateRequest::default())
                    .await
                    .is_ok(),
                Err(_) => false,
            }
        };
        if ready {
            return Some(Server {
                _child: child,
                grpc: p,
                snapshot: r,
            });
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "server did not come up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
