//! Test helpers: an in-process recording gRPC sink and small builders.
#![allow(dead_code)]

pub mod engines;
pub mod server_process;

use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use inferencecache_sidecar::client::{GrpcSink, TlsFiles, TokenSource, build_channel};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

/// One recorded RPC.
#[derive(Debug, Clone)]
pub enum Call {
    Report(pb::CacheStateUpdate),
    Publish(pb::CacheEvent),
}

/// How the fake server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Ok,
    /// Every RPC fails with UNAVAILABLE.
    Fail,
    /// OK with `Ack.accepted = false`.
    Reject,
}

#[derive(Clone)]
pub struct Recorder {
    pub calls: Arc<Mutex<Vec<Call>>>,
    pub auth: Arc<Mutex<Vec<Option<String>>>>,
    pub mode: Arc<Mutex<Mode>>,
}

impl Recorder {
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
    pub fn set_mode(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }
    pub fn updates(&self) -> Vec<pb::CacheStateUpdate> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Report(u) => Some(u),
                _ => None,
            })
            .collect()
    }
    pub fn events(&self) -> Vec<pb::CacheEvent> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Publish(e) => Some(e),
                _ => None,
            })
            .collect()
    }
    fn answer(&self) -> Result<Response<pb::Ack>, Status> {
        match *self.mode.lock().unwrap() {
            Mode::Ok => Ok(Response::new(pb::Ack {
                accepted: true,
                reason_code: String::new(),
                ..Default::default()
            })),
            Mode::Reject => Ok(Response::new(pb::Ack {
                accepted: false,
                reason_code: "NOPE".into(),
                ..Default::default()
            })),
            Mode::Fail => Err(Status::unavailable("fake server failing")),
        }
    }
    fn note_auth<T>(&self, req: &Request<T>) {
        let v = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        self.auth.lock().unwrap().push(v);
    }
}

type Empty<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl InferenceCache for Recorder {
    async fn render_template(
        &self,
        _r: Request<pb::RenderTemplateRequest>,
    ) -> Result<Response<pb::RenderTemplateResponse>, Status> {
        Ok(Response::new(pb::RenderTemplateResponse {
            reason_code: "OK".into(),
            ..Default::default()
        }))
    }
    async fn lookup_route(
        &self,
        _r: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        Ok(Response::new(pb::LookupRouteResponse {
            reason_code: "NO_HINT".into(),
            ..Default::default()
        }))
    }
    async fn lookup_pd_route(
        &self,
        _r: Request<pb::LookupPdRouteRequest>,
    ) -> Result<Response<pb::LookupPdRouteResponse>, Status> {
        Ok(Response::new(pb::LookupPdRouteResponse {
            reason_code: "NO_HINT".into(),
            ..Default::default()
        }))
    }
    async fn get_cache_state(
        &self,
        _r: Request<pb::GetCacheStateRequest>,
    ) -> Result<Response<pb::GetCacheStateResponse>, Status> {
        Ok(Response::new(pb::GetCacheStateResponse {
            replicas: Vec::new(),
            summary: Some(pb::CacheSummary::default()),
            ..Default::default()
        }))
    }
    async fn report_cache_state(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        self.note_auth(&request);
        let mut stream = request.into_inner();
        while let Some(u) = stream.message().await? {
            self.calls.lock().unwrap().push(Call::Report(u));
        }
        self.answer()
    }
    async fn publish_event(
        &self,
        request: Request<pb::CacheEvent>,
    ) -> Result<Response<pb::Ack>, Status> {
        self.note_auth(&request);
        self.calls
            .lock()
            .unwrap()
            .push(Call::Publish(request.into_inner()));
        self.answer()
    }
    type StreamCacheEventsStream = Empty<pb::CacheEvent>;
    async fn stream_cache_events(
        &self,
        _r: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Ok(Response::new(Box::pin(tokio_stream::empty())))
    }
    type StreamMetricsStream = Empty<pb::Metric>;
    async fn stream_metrics(
        &self,
        _r: Request<pb::StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Ok(Response::new(Box::pin(tokio_stream::empty())))
    }
}

/// Starts a recording server on a free loopback port.
pub async fn start_fake_server(mode: Mode) -> (Recorder, SocketAddr) {
    start_fake_server_with(mode, None).await
}

/// Starts a recording server, optionally behind TLS.
pub async fn start_fake_server_with(
    mode: Mode,
    tls: Option<tonic::transport::ServerTlsConfig>,
) -> (Recorder, SocketAddr) {
    let rec = Recorder {
        calls: Arc::default(),
        auth: Arc::default(),
        mode: Arc::new(Mutex::new(mode)),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = InferenceCacheServer::new(rec.clone());
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls).unwrap();
    }
    tokio::spawn(async move {
        builder
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (rec, addr)
}

/// A gRPC sink pointed at `addr`.
pub fn sink_to(addr: SocketAddr, token: Option<TokenSource>) -> GrpcSink {
    let ch = build_channel(&addr.to_string(), &TlsFiles::default()).unwrap();
    GrpcSink::new(ch, token)
}

/// A fresh temp directory under the system temp dir.
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "sidecar-test-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Sends SIGTERM to `pid`, a child this test spawned and has not reaped yet.
pub fn sigterm(pid: u32) {
    let pid = i32::try_from(pid).expect("pid fits in pid_t");
    // SAFETY: kill(2) on a pid this test spawned and still owns (not yet reaped), so it cannot
    // name a recycled process.
    let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill(SIGTERM)");
}

/// A free loopback port (free when asked; the caller binds it soon after), never one this test
/// process was given before: the OS may offer a just-released port again, and two listeners
/// given the same port would fail to start.
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
