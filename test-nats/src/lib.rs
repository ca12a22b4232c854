//! A real `nats-server -js` on loopback for the tests of replicated mode, stopped by its PID.
//! Test code only: it panics when the server cannot be started, which a test reports as a
//! failure.
//!
//! [`binary`] finds `nats-server`; without one, a test skips with a notice locally and fails
//! under CI (`CI` set), where `.ci/run` installs it.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `nats-server` binary on `PATH` (or in `/usr/sbin`, `/usr/bin`). `None` skips the
/// caller's test locally, printing why; under CI its absence is a failure.
pub fn binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|directory| directory.join("nats-server"))
        .find(|candidate| candidate.is_file());
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "nats-server is not installed (.ci/run installs it)"
        );
        eprintln!("NOTICE: skipped: nats-server is not installed (apt-get install nats-server)");
    }
    found
}

/// A `nats-server -js` on `127.0.0.1`, its JetStream store under a directory of the test's;
/// killed on drop.
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    store: PathBuf,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts the server on a free port with its store in `directory/nats`, and waits until it
    /// listens.
    pub fn start(binary: &Path, directory: &Path) -> Self {
        let mut server = Self {
            binary: binary.to_path_buf(),
            port: free_port(),
            store: directory.join("nats"),
            child: None,
        };
        server.resume();
        server
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its client URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port and store, and waits until it listens.
    pub fn resume(&mut self) {
        let child = Command::new(&self.binary)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "nats-server did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL by its PID) and reaps it; `resume` starts it again.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A port free on loopback when asked (the listener is closed before the server binds it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("a free loopback port")
}
