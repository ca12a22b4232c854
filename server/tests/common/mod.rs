//! Shared helpers: an in-process server on ephemeral loopback ports and small clients.
#![allow(dead_code)]

use inferencecache_engine::ManualClock;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_server::service::{AppState, ServerOptions};
use std::net::SocketAddr;
use std::sync::Arc;
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
    let mut stream = TcpStream::connect(addr).await.expect("connect http");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string())
}
