//! The sidecar's own HTTP listener (`--metrics-bind-address`): `GET /healthz`, `GET /readyz`
//! and `GET /metrics` (Prometheus text of [`Telemetry`], plus
//! `inferencecache_sidecar_server_reachable`). Plain HTTP/1.1 on a loopback address by
//! default; nothing on it changes state.
//!
//! Whether the server is reachable is [`ServerHealth`]: the outcome of the latest RPC to the
//! server, recorded by the code that makes the calls ([`server_health`]`().record(ok)`).
//! `/healthz` is liveness: 200 while the process serves, whatever the server's state (a
//! sidecar restarted because the index is down would only resync on return); its body names
//! the server's state. `/readyz` answers 200 only while the latest RPC succeeded, 503 before
//! the first one and after a failure, so an operator or a probe that wants the sidecar's view of
//! the index can have it without taking the engine out of service.

use crate::telemetry::Telemetry;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Time allowed for a request's header to arrive.
pub const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether the server answered the sidecar's latest RPC.
#[derive(Debug, Default)]
pub struct ServerHealth(AtomicU8);

/// No RPC has completed yet.
const UNKNOWN: u8 = 0;
/// The latest RPC succeeded.
const REACHABLE: u8 = 1;
/// The latest RPC failed (transport error, deadline, refused by the server).
const UNREACHABLE: u8 = 2;

impl ServerHealth {
    /// Records the outcome of one RPC to the server.
    pub fn record(&self, ok: bool) {
        self.0
            .store(if ok { REACHABLE } else { UNREACHABLE }, Ordering::Relaxed);
    }

    /// True while the latest RPC succeeded.
    pub fn reachable(&self) -> bool {
        self.0.load(Ordering::Relaxed) == REACHABLE
    }

    /// `reachable`, `unreachable` or `unknown` (no RPC yet).
    pub fn state(&self) -> &'static str {
        match self.0.load(Ordering::Relaxed) {
            REACHABLE => "reachable",
            UNREACHABLE => "unreachable",
            _ => "unknown",
        }
    }
}

static SERVER_HEALTH: ServerHealth = ServerHealth(AtomicU8::new(UNKNOWN));

/// The process's [`ServerHealth`], which the listener reports.
pub fn server_health() -> &'static ServerHealth {
    &SERVER_HEALTH
}

fn respond(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, v);
    }
    response
}

/// Answers one request with the process's [`server_health`].
pub fn answer(telemetry: &Telemetry, method: &Method, path: &str) -> Response<Full<Bytes>> {
    answer_with(telemetry, server_health(), method, path)
}

/// Answers one request.
pub fn answer_with(
    telemetry: &Telemetry,
    health: &ServerHealth,
    method: &Method,
    path: &str,
) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "method not allowed\n".into(),
        );
    }
    match path {
        "/healthz" => respond(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            format!("ok\nserver {}\n", health.state()),
        ),
        "/readyz" if health.reachable() => {
            respond(StatusCode::OK, "text/plain; charset=utf-8", "ok\n".into())
        }
        "/readyz" => respond(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            format!("server {}\n", health.state()),
        ),
        "/metrics" => {
            let mut page = telemetry.render();
            page.push_str(
                "# HELP inferencecache_sidecar_server_reachable 1 while the latest RPC to the server succeeded\n\
                 # TYPE inferencecache_sidecar_server_reachable gauge\n",
            );
            page.push_str(&format!(
                "inferencecache_sidecar_server_reachable {}\n",
                u8::from(health.reachable())
            ));
            respond(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                page,
            )
        }
        _ => respond(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found\n".into(),
        ),
    }
}

/// Serves until `cancel` fires.
pub async fn serve(listener: TcpListener, telemetry: Arc<Telemetry>, cancel: CancellationToken) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(READ_HEADER_TIMEOUT);
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else {
            // Out of descriptors and the like: pause instead of spinning.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let telemetry = Arc::clone(&telemetry);
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let response = answer(&telemetry, req.method(), req.uri().path());
            async move { Ok::<_, Infallible>(response) }
        });
        let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let cancel = cancel.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = conn => {}
                _ = cancel.cancelled() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let t = Telemetry::default();
        assert_eq!(
            answer(&t, &Method::GET, "/healthz").status(),
            StatusCode::OK
        );
        assert_eq!(
            answer(&t, &Method::GET, "/metrics").status(),
            StatusCode::OK
        );
        assert_eq!(
            answer(&t, &Method::GET, "/x").status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            answer(&t, &Method::POST, "/metrics").status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
    }

    fn body(response: Response<Full<Bytes>>) -> String {
        use http_body_util::BodyExt as _;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime");
        let collected = runtime.block_on(response.into_body().collect());
        String::from_utf8(collected.map(|c| c.to_bytes().to_vec()).unwrap_or_default())
            .unwrap_or_default()
    }

    #[test]
    fn readiness_and_the_gauge_follow_the_latest_rpc() {
        let t = Telemetry::default();
        let health = ServerHealth::default();
        let get = |path: &str| answer_with(&t, &health, &Method::GET, path);
        assert_eq!(get("/readyz").status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(get("/healthz").status(), StatusCode::OK);
        assert_eq!(body(get("/healthz")), "ok\nserver unknown\n");
        health.record(true);
        assert_eq!(get("/readyz").status(), StatusCode::OK);
        assert!(body(get("/metrics")).contains("\ninferencecache_sidecar_server_reachable 1\n"));
        health.record(false);
        assert_eq!(get("/readyz").status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            get("/healthz").status(),
            StatusCode::OK,
            "liveness never follows the server"
        );
        assert_eq!(body(get("/healthz")), "ok\nserver unreachable\n");
        assert!(body(get("/metrics")).contains("\ninferencecache_sidecar_server_reachable 0\n"));
    }
}
