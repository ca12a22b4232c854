//! Process-level behavior of the binaries: exit codes (spec `sidecar.md` §2), SC08 (a server
//! that fails every RPC never stops the process) and the SIGTERM drain.

mod common;

use common::{free_port, temp_dir};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SIDECAR: &str = env!("CARGO_BIN_EXE_inferencecache-sidecar");
const FAKE_ENGINE: &str = env!("CARGO_BIN_EXE_inferencecache-fake-engine");

/// Exit code of the sidecar run with `args`.
fn exit_code(args: &[&str]) -> i32 {
    exit_code_of(SIDECAR, args)
}

/// Exit code of `bin` run with `args`, output discarded.
fn exit_code_of(bin: &str, args: &[&str]) -> i32 {
    Command::new(bin)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .code()
        .unwrap()
}

#[test]
fn invalid_configuration_exits_2() {
    assert_eq!(exit_code(&["--model-id", "m"]), 2, "missing --replica-id");
    assert_eq!(
        exit_code(&["--replica-id", "r", "--model-id", "m", "--hash-scheme", ""]),
        2
    );
    assert_eq!(
        exit_code(&["--replica-id", "r", "--model-id", "m", "--cache-tier", "x"]),
        2
    );
    assert_eq!(
        exit_code(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--lora-adapter-names",
            "1=a,1=b"
        ]),
        2
    );
    assert_eq!(
        exit_code(&["--replica-id", "r", "--model-id", "m", "--window", "soon"]),
        2
    );
    assert_eq!(
        exit_code(&["--replica-id", "r", "--model-id", "m", "--block-size", "0"]),
        2
    );
    assert_eq!(
        exit_code(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--log-format",
            "xml"
        ]),
        2
    );
    assert_eq!(
        exit_code(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--no-such-flag",
            "1"
        ]),
        2
    );
}

#[test]
fn unbuildable_client_exits_1() {
    assert_eq!(
        exit_code(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--server",
            "bad host:1"
        ]),
        1
    );
    assert_eq!(
        exit_code(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--server-token-file",
            "/nonexistent/token"
        ]),
        1
    );
    assert_eq!(
        exit_code(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--server-tls-ca-file",
            "/nonexistent/ca.pem"
        ]),
        1
    );
}

#[test]
fn unusable_metrics_address_exits_1() {
    assert_eq!(
        exit_code(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--metrics-bind-address",
            "256.0.0.1:1"
        ]),
        1
    );
}

#[test]
fn fake_engine_rejects_invalid_sizes() {
    let code = |args: &[&str]| exit_code_of(FAKE_ENGINE, args);
    assert_eq!(code(&["--block-size", "0"]), 2);
    assert_eq!(code(&["--num-blocks", "2", "--events", "3"]), 2);
    assert_eq!(code(&["--block-size", "65536", "--num-blocks", "512"]), 2);
}

#[test]
fn sc08_unreachable_server_never_stops_the_process_and_sigterm_drains() {
    let dir = temp_dir("cli-sc08");
    let zmq_port = free_port();
    let dead_grpc = free_port();
    let mut engine = Command::new(FAKE_ENGINE)
        .args([
            "--bind",
            &format!("tcp://127.0.0.1:{zmq_port}"),
            "--num-blocks",
            "2",
            "--block-size",
            "16",
            "--interval",
            "100ms",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let log = dir.join("sidecar.log");
    let mut sidecar = Command::new(SIDECAR)
        .args([
            "--engine-endpoint",
            &format!("tcp://127.0.0.1:{zmq_port}"),
            "--server",
            &format!("127.0.0.1:{dead_grpc}"),
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--window",
            "20ms",
            "--stats-interval",
            "200ms",
            "--metrics-bind-address",
            "127.0.0.1:0",
            "--engine-metrics-url",
            &format!("http://127.0.0.1:{dead_grpc}/metrics"),
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("\"send_failed\"") && text.contains("load_signal_stale") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "expected failures not logged: {text}"
        );
        assert!(
            sidecar.try_wait().unwrap().is_none(),
            "sidecar exited: {text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        sidecar.try_wait().unwrap().is_none(),
        "sidecar keeps running"
    );
    common::sigterm(sidecar.id());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = sidecar.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("\"graceful_shutdown_done\""), "{text}");
    // No --tenant-id: entries would be unreachable, and the sidecar says so.
    assert_eq!(text.matches("\"empty_tenant\"").count(), 1, "{text}");
    // Exactly one stale ERROR however many failures followed.
    assert_eq!(text.matches("load_signal_stale").count(), 1, "{text}");
    // One WARN for the outage however many retries followed, then the bounded final attempt.
    assert_eq!(text.matches("\"send_failed\"").count(), 1, "{text}");
    assert!(text.contains("\"undelivered\":"), "{text}");
    let _ = engine.kill();
    let _ = engine.wait();
    let _ = std::fs::remove_dir_all(dir);
}
