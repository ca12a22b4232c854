//! Cross-language contract test: a Python grpcio client generated from our own proto talks to
//! the real `inferencecache-server` binary (health, the ReportCacheState client stream,
//! PublishEvent, LookupRoute, GetCacheState, StreamCacheEvents).
//!
//! Needs `python3` with the packages in `server/tests/python/requirements.txt`. Without them the
//! test is skipped locally and fails under CI (where `.ci/run` installs them).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

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

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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
    let (grpc, http, snapshot) = (free_port(), free_port(), free_port());
    let server = Child(
        Command::new(env!("CARGO_BIN_EXE_inferencecache-server"))
            .args([
                "--grpc-bind-address",
                &format!("127.0.0.1:{grpc}"),
                "--http-bind-address",
                &format!("127.0.0.1:{http}"),
                "--snapshot-bind-address",
                &format!("127.0.0.1:{snapshot}"),
                "--log-level",
                "warn",
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("start inferencecache-server"),
    );
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", grpc)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "server did not listen on {grpc}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = Command::new("python3")
        .arg(root.join("tests/python/contract_client.py"))
        .args(["--target", &format!("127.0.0.1:{grpc}"), "--proto-root"])
        .arg(root.join("../proto"))
        .output()
        .expect("run python3");
    drop(server);
    assert!(
        output.status.success(),
        "python contract client failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
