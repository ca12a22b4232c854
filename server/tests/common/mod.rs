//! Shared helpers: an in-process server on ephemeral loopback ports, the real binary as a child
//! process, small clients and request builders.
#![allow(dead_code)]

use inferencecache_engine::{ManualClock, fingerprint};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_server::state::{AppState, ServerOptions};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// Microseconds of the fake clock's origin used by tests (2026-01-01T00:00:00Z).
pub const T0_US: i64 = 1_767_225_600_000_000;

/// State over a manual clock at [`T0_US`].
pub fn manual_state(options: ServerOptions) -> (AppState, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(T0_US));
    (AppState::with_clock(options, clock.clone()), clock)
}

pub struct TestServer {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub state: AppState,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
    pub async fn start() -> Self {
        // A frozen clock keeps freshness exactly 1, so scores are exact.
        Self::start_with(manual_state(ServerOptions::default()).0).await
    }

    pub async fn start_with(state: AppState) -> Self {
        let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind grpc");
        let http = TcpListener::bind("127.0.0.1:0").await.expect("bind http");
        let (grpc_addr, http_addr) = (grpc.local_addr().unwrap(), http.local_addr().unwrap());
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(inferencecache_server::serve(
            state.clone(),
            grpc,
            http,
            async move {
                let _ = rx.await;
            },
        ));
        Self {
            grpc: grpc_addr,
            http: http_addr,
            state,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub async fn channel(&self) -> Channel {
        let endpoint = format!("http://{}", self.grpc);
        for _ in 0..100 {
            if let Ok(ch) = Channel::from_shared(endpoint.clone())
                .unwrap()
                .connect()
                .await
            {
                return ch;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("gRPC server at {endpoint} never accepted a connection");
    }

    pub async fn client(&self) -> InferenceCacheClient<Channel> {
        InferenceCacheClient::new(self.channel().await)
    }

    /// Stops the server and waits for a clean exit.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await
                .expect("server task panicked")
                .expect("server returned an error");
        }
    }
}

/// Minimal HTTP/1.1 request: returns (status, headers, body).
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String, String) {
    match try_http_request(addr, method, path, body).await {
        Ok(answer) => answer,
        Err(e) => panic!("{method} {path} on {addr}: {e}"),
    }
}

/// [`http_request`] that returns a connection error instead of panicking: for polls of a
/// server that may be starting or stopping (it can accept a connection and drop it).
pub async fn try_http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, String, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, head.to_string(), body.to_string()))
}

/// A free loopback port (free when asked; the caller binds it soon after), never one this test
/// process was given before: the OS may offer a just-released port again, and two listeners of
/// one server given the same port would fail to start.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A fresh, empty directory for one test, unique to this test binary's process.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ic-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A one-prefix legacy update (model `m`, scheme `vllm`).
pub fn legacy_update(
    replica: &str,
    tenant: &str,
    hash: &[u8],
    tokens: i32,
) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: "m".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            prefix_hash: hash.to_vec(),
            token_count: tokens,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// An exact-key lookup (model `m`, scheme `vllm`).
pub fn exact_lookup(tenant: &str, hash: &[u8], tokens: i32) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: tenant.into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        prefix_hash: hash.to_vec(),
        prefix_token_count: tokens,
        ..Default::default()
    }
}

/// A `prompt_text` lookup of tenant `t` (scheme `vllm`): the server tokenizes `text` with the
/// tokenizer of `model`.
pub fn prompt_lookup(model: &str, text: &str) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: "t".into(),
        model_id: model.into(),
        hash_scheme: "vllm".into(),
        prompt_text: text.into(),
        ..Default::default()
    }
}

/// Reports, for `replica` of (tenant `t`, `model`, `vllm`), the block chain a gateway computes
/// from `tokens` with `block` tokens per block: what a later prompt with those tokens must find.
pub async fn report_token_chain(
    client: &mut InferenceCacheClient<Channel>,
    replica: &str,
    model: &str,
    tokens: &[u32],
    block: usize,
) {
    let (wire, counts) = fingerprint::chain(tokens, block);
    let update = pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: model.into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: wire.iter().map(|h| h.to_vec()).collect(),
            block_token_counts: counts,
            ..Default::default()
        }],
        ..Default::default()
    };
    report(client, vec![update]).await;
}

/// One ReportCacheState stream of `updates`; the server must accept it. Returns the Ack.
pub async fn report(
    client: &mut InferenceCacheClient<Channel>,
    updates: Vec<pb::CacheStateUpdate>,
) -> pb::Ack {
    let ack = client
        .report_cache_state(tokio_stream::iter(updates))
        .await
        .expect("report")
        .into_inner();
    assert!(ack.accepted);
    ack
}

/// One LookupRoute call; the RPC itself never fails (consumer RPCs answer every request).
pub async fn lookup(
    client: &mut InferenceCacheClient<Channel>,
    req: pb::LookupRouteRequest,
) -> pb::LookupRouteResponse {
    client
        .lookup_route(req)
        .await
        .expect("LookupRoute never returns an error status")
        .into_inner()
}

/// Sends SIGTERM to a child this test spawned and has not reaped yet.
pub fn sigterm(child: &Child) {
    let pid = i32::try_from(child.id()).expect("pid fits in pid_t");
    // SAFETY: kill(2) on a pid this test spawned and still owns (not yet reaped), so it cannot
    // name a recycled process.
    let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill(SIGTERM)");
}

/// The server binary of this crate.
pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_inferencecache-server");

/// The real binary on free loopback ports, stderr captured to `<dir>/stderr.log`; killed on
/// drop unless [`ServerProcess::wait`] reaped it.
pub struct ServerProcess {
    child: Child,
    pub grpc: u16,
    pub http: u16,
    /// The control-plane listener (`/snapshot`, `/policy`, `/digest`).
    pub control: u16,
    log: PathBuf,
}

impl ServerProcess {
    /// Starts the binary with `extra` flags and waits until gRPC accepts connections.
    pub fn start(dir: &Path, extra: &[&str]) -> Self {
        let (grpc, http, control) = (free_port(), free_port(), free_port());
        let log = dir.join("stderr.log");
        let child = Command::new(SERVER_BIN)
            .args([
                "--grpc-bind-address".to_string(),
                format!("127.0.0.1:{grpc}"),
                "--http-bind-address".into(),
                format!("127.0.0.1:{http}"),
                "--snapshot-bind-address".into(),
                format!("127.0.0.1:{control}"),
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start server");
        let server = Self {
            child,
            grpc,
            http,
            control,
            log,
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", grpc)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "server did not listen: {}",
                server.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    /// Everything the binary wrote to stderr so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://127.0.0.1:{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn client(&self) -> InferenceCacheClient<Channel> {
        InferenceCacheClient::new(self.channel().await)
    }

    /// Waits until `/readyz` answers 200: the server has started serving, not only bound its
    /// listeners (what [`ServerProcess::start`] waits for). For tests whose first RPC must be
    /// served; a server that is meant to stay unready (replication without NATS, a restore)
    /// is never waited on this way.
    pub async fn wait_ready(&self) {
        self.wait_ready_within(Duration::from_secs(20)).await;
    }

    /// [`ServerProcess::wait_ready`] with a time limit of `limit`.
    pub async fn wait_ready_within(&self, limit: Duration) {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.http));
        let start = Instant::now();
        // A server still starting may refuse or drop a connection: not ready yet.
        while !try_http_request(addr, "GET", "/readyz", "")
            .await
            .is_ok_and(|(status, _, _)| status == 200)
        {
            assert!(start.elapsed() < limit, "server not ready: {}", self.logs());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn sigterm(&self) {
        sigterm(&self.child);
    }

    /// Waits for the exit (on a blocking thread, so the test's own gRPC clients keep being
    /// driven); returns the exit code and the logs.
    pub async fn wait(mut self) -> (Option<i32>, String) {
        let mut child = std::mem::replace(&mut self.child, Command::new("true").spawn().unwrap());
        let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
        (status.code(), self.logs())
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
