//! Control-plane HTTP listener (`:8081`, spec `server.md` §4, §6.4, §9.1, §12.3, §12.4):
//! `GET /snapshot`, `POST|PUT /policy`, `GET /checkpoint`, `GET /digest`, `POST /probe`.
//!
//! Exact-path routing; anything else is 404. Each route authenticates first (§9.1), then checks
//! the method, then reads the body.

use super::json::snapshot_json;
use super::probe::{MAX_PROBE_BYTES, ProbeLocks, T2Prober, decode_probe};
use super::serve::serve_http;
use crate::auth::Auth;
use crate::metrics::AuthRoute;
use crate::policy::{MAX_PUSH_BYTES, decode_push};
use crate::state::AppState;
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use std::sync::Arc;
use tokio::net::TcpListener;

/// Shared state of the control-plane router.
#[derive(Clone)]
pub struct ControlState {
    app: AppState,
    auth: Arc<Auth>,
    probes: Arc<ProbeLocks>,
    t2: Option<Arc<dyn T2Prober>>,
}

impl ControlState {
    pub fn new(app: AppState, auth: Arc<Auth>) -> Self {
        Self {
            app,
            auth,
            probes: Arc::default(),
            t2: None,
        }
    }

    /// Installs a T2 prober for the probe's `t2` stage.
    pub fn with_t2_prober(mut self, prober: Arc<dyn T2Prober>) -> Self {
        self.t2 = Some(prober);
        self
    }
}

/// Router of the control-plane listener.
pub fn control_router(state: ControlState) -> Router {
    Router::new()
        .route("/snapshot", any(snapshot))
        .route("/policy", any(policy))
        .route("/probe", any(probe))
        .route("/checkpoint", any(checkpoint))
        .route("/digest", any(digest))
        .fallback(not_found)
        .with_state(state)
}

/// Serves the control-plane router until `stop` resolves.
pub async fn serve_control(
    state: ControlState,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_http(control_router(state), listener, stop).await
}

/// A control-plane server running in its own task, stopped with [`ControlServer::stop`].
pub struct ControlServer {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    failed: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl ControlServer {
    /// Starts serving `listener`.
    pub fn spawn(state: ControlState, listener: TcpListener) -> Self {
        let (stop, mut stop_rx) = tokio::sync::watch::channel(false);
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let result = serve_control(state, listener, async move {
                let _ = stop_rx.wait_for(|stopped| *stopped).await;
            })
            .await;
            if result.is_err() {
                let _ = failed_tx.send(());
            }
            result
        });
        Self {
            stop,
            task,
            failed: Some(failed_rx),
        }
    }

    /// Resolves when the listener fails; pending forever otherwise (even after a clean stop).
    pub fn failure(&mut self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let rx = self.failed.take();
        async move {
            let failed = match rx {
                Some(rx) => rx.await.is_ok(),
                None => false,
            };
            if !failed {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops accepting, drains in-flight requests and returns the listener's result.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.task.await?
    }
}

fn text(status: StatusCode, body: &'static str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

fn text_owned(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

fn method_not_allowed(allow: &'static str) -> Response {
    let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

fn json(body: String) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

async fn not_found() -> Response {
    text(StatusCode::NOT_FOUND, "404 page not found\n")
}

async fn snapshot(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Snapshot, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    json(snapshot_json(&s.app.index().snapshot()))
}

/// `GET /checkpoint`: the last checkpoint written and the startup restore (controller audience).
async fn checkpoint(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Snapshot, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    json(s.app.core().checkpoint_status().to_json())
}

/// `GET /digest`: the stream sequence applied, the entry count and the order-independent
/// digest of the index at that sequence (replicated mode computes it on the apply thread).
async fn digest(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Snapshot, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    let (replicated, at) = match s.app.replication() {
        Some(r) => match r.digest().await {
            Some(at) => (true, at),
            None => {
                return text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "replication has not started yet\n",
                );
            }
        },
        None => (
            false,
            crate::replication::apply::DigestAt {
                stream_seq: 0,
                digest: s.app.index().digest(),
            },
        ),
    };
    let (leader, buffered, stream_last_seq) = s.app.replication().map_or((false, 0, 0), |r| {
        let c = r.counters();
        (
            c.leader.load(std::sync::atomic::Ordering::Relaxed),
            r.buffered(),
            c.stream_last_seq.load(std::sync::atomic::Ordering::Relaxed),
        )
    });
    json(
        serde_json::json!({
            "replicated": replicated,
            "stream_seq": at.stream_seq,
            "entries": at.digest.entries,
            "digest": format!("{:032x}", at.digest.hash),
            "leader": leader,
            "buffered_records": buffered,
            "stream_last_seq": stream_last_seq,
        })
        .to_string()
            + "\n",
    )
}

async fn policy(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Policy, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::POST && req.method() != Method::PUT {
        return method_not_allowed("POST, PUT");
    }
    let body = match read_body(req.into_body(), MAX_PUSH_BYTES).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => {
            return text(
                StatusCode::BAD_REQUEST,
                "decode policy snapshot: body exceeds 1 MiB\n",
            );
        }
        Err(BodyError::Read(e)) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("decode policy snapshot: {e}\n"),
            );
        }
    };
    match decode_push(&body) {
        Ok(_) if s.app.replication().is_some() => {
            // Replicated mode: every server applies the push at its stream position.
            if let Some(replication) = s.app.replication() {
                replication.submit_policy(&body).await;
            }
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(layer) => {
            // A push during a warm restart wins over the checkpoint's layer.
            s.app.core().wait_restored().await;
            s.app.core().push_policy(&body, layer);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => text_owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

enum BodyError {
    TooLarge,
    Read(String),
}

/// Reads at most `limit` bytes; a longer body is `TooLarge`.
async fn read_body(body: Body, limit: usize) -> Result<axum::body::Bytes, BodyError> {
    match axum::body::to_bytes(body, limit).await {
        Ok(b) => Ok(b),
        Err(e) => {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = source {
                if err.is::<http_body_util::LengthLimitError>() {
                    return Err(BodyError::TooLarge);
                }
                source = err.source();
            }
            Err(BodyError::Read(e.to_string()))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// /snapshot (§12.3)

async fn probe(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Probe, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::POST {
        return method_not_allowed("POST");
    }
    let body = match read_body(req.into_body(), MAX_PROBE_BYTES).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => {
            return text(
                StatusCode::BAD_REQUEST,
                "invalid probe request: body exceeds 4 KiB\n",
            );
        }
        Err(BodyError::Read(e)) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("invalid probe request: {e}\n"),
            );
        }
    };
    let request = match decode_probe(&body) {
        Ok(r) => r,
        Err(e) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("invalid probe request: {e}\n"),
            );
        }
    };
    let report = s.probes.run(s.app.index(), &request, s.t2.as_deref()).await;
    json(report.to_json())
}
