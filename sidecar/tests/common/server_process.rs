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

/// A running server; killed on drop. It can be stopped and started again on the same ports
/// and flags ([`Server::stop`], [`Server::restart`]), so a sidecar sees one address throughout.
pub struct Server {
    child: std::sync::Mutex<Option<Child>>,
    /// gRPC port.
    pub grpc: u16,
    /// Control-plane port (`/snapshot`).
    pub snapshot: u16,
    /// HTTP port (`/readyz`).
    pub http: u16,
    bin: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    tls: bool,
    starts: std::sync::atomic::AtomicUsize,
}

/// How [`Server::stop`] ends the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM: a graceful stop (a final checkpoint with `--state-dir`).
    Term,
    /// SIGKILL: a crash.
    Kill,
}

impl Server {
    fn spawn(&self) -> Child {
        let run = self
            .starts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = if run == 0 {
            self.log.clone()
        } else {
            self.log.with_extension(format!("{run}.log"))
        };
        Command::new(&self.bin)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn server")
    }

    fn take_child(&self) -> Option<Child> {
        self.child.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// The process id of the running server.
    pub fn pid(&self) -> Option<u32> {
        self.child
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(Child::id)
    }

    /// Stops the server and waits until it exited.
    pub async fn stop(&self, how: Stop) {
        let Some(mut child) = self.take_child() else {
            return;
        };
        match how {
            Stop::Term => super::sigterm(child.id().expect("server running")),
            Stop::Kill => {
                let _ = child.start_kill();
            }
        }
        tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .expect("server exits")
            .expect("wait for the server");
    }

    /// Starts the server again on the same ports and flags and waits until `/readyz` answers
    /// 200; returns that moment.
    pub async fn restart(&self) -> tokio::time::Instant {
        assert!(self.pid().is_none(), "stop the server first");
        let child = self.spawn();
        *self.child.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        self.wait_ready().await
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self) -> tokio::time::Instant {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if readyz(self.http).await {
                return tokio::time::Instant::now();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "server did not become ready: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn serving(&self) -> bool {
        let p = self.grpc;
        if self.tls {
            return tokio::net::TcpStream::connect(("127.0.0.1", p))
                .await
                .is_ok();
        }
        match InferenceCacheClient::connect(format!("http://127.0.0.1:{p}")).await {
            Ok(mut c) => c
                .get_cache_state(pb::GetCacheStateRequest::default())
                .await
                .is_ok(),
            Err(_) => false,
        }
    }
}

/// Whether `GET /readyz` on `port` answers 200.
async fn readyz(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(Ok(mut stream)) = tokio::time::timeout(
        Duration::from_secs(1),
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    else {
        return false;
    };
    let request = "GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    matches!(
        tokio::time::timeout(Duration::from_secs(1), stream.read_exact(&mut head)).await,
        Ok(Ok(_))
    ) && head.starts_with(b"HTTP/1.1 200")
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
    let mut args: Vec<String> = vec![
        "--grpc-bind-address".into(),
        format!("127.0.0.1:{p}"),
        "--http-bind-address".into(),
        format!("127.0.0.1:{q}"),
        "--snapshot-bind-address".into(),
        format!("127.0.0.1:{r}"),
        "--engine-block-size".into(),
        block_size.to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let server = Server {
        child: std::sync::Mutex::new(None),
        grpc: p,
        snapshot: r,
        http: q,
        bin: bin.to_path_buf(),
        args,
        log: log.to_path_buf(),
        tls,
        starts: std::sync::atomic::AtomicUsize::new(0),
    };
    let child = server.spawn();
    *server.child.lock().unwrap() = Some(child);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let exited = server
            .child
            .lock()
            .unwrap()
            .as_mut()
            .map(|c| c.try_wait())
            .and_then(Result::ok)
            .flatten();
        if let Some(status) = exited {
            eprintln!(
                "NOTICE: server exited early ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            return None;
        }
        if server.serving().await {
            return Some(server);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "server did not come up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
