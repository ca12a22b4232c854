//! Cross-language contract test: a Python grpcio client generated from our own proto talks to
//! the real `inferencecache-server` binary (health, the ReportCacheState client stream,
//! PublishEvent, LookupRoute, GetCacheState, StreamCacheEvents).
//!
//! Needs `python3` with the packages in `server/tests/python/requirements.txt`. Without them the
//! test is skipped locally and fails under CI (where `.ci/run` installs them).

mod common;

use common::ServerProcess;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn python_ready() -> bool {
    Command::new("python3")
        .args(["-c", "import grpc, grpc_tools, grpc_health"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

#[test]
fn python_grpcio_client_agrees_with_the_server() {
    if !python_ready() {
        assert!(
            !in_ci(),
            "CI must provide python3 with grpcio, grpcio-tools and grpcio-health-checking"
        );
        eprintln!(
            "skipping: python3 with grpcio/grpcio-tools/grpcio-health-checking is not installed"
        );
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let server = ServerProcess::start(
        &common::temp_dir("python-contract"),
        &["--log-level", "warn"],
    );
    let grpc = server.grpc;
    let output = Command::new("python3")
        .arg(root.join("tests/python/contract_client.py"))
        .args(["--target", &format!("127.0.0.1:{grpc}"), "--proto-root"])
        .arg(root.join("../proto"))
        .output()
        .expect("run python3");
    let server_logs = server.logs();
    drop(server);
    assert!(
        output.status.success(),
        "python contract client failed:\nstdout: {}\nstderr: {}\nserver: {server_logs}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
