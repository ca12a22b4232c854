//! The sidecar's own HTTP listener (`--metrics-bind-address`): `GET /healthz` and
//! `GET /metrics` (Prometheus text of [`Telemetry`]). Plain HTTP/1.1 on a loopback address by
//! default; nothing on it changes state.

use crate::telemetry::Telemetry;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Time allowed for a request's header to arrive.
pub const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

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

/// Answers one request.
pub fn answer(telemetry: &Telemetry, method: &Method, path: &str) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "method not allowed\n".into(),
        );
    }
    match path {
        "/healthz" => respond(StatusCode::OK, "text/plain; charset=utf-8", "ok\n".into()),
        "/metrics" => respond(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            telemetry.render(),
        ),
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
}
