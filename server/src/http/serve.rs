//! Plaintext HTTP/1.1 serving for both HTTP listeners (the public `:8080` and the control-plane
//! `:8081`): the read-header timeout and the bounded graceful stop of the spec (§4, §14).

use axum::Router;
use std::time::Duration;
use tokio::net::TcpListener;

/// Time allowed for a request's header to arrive (§4).
pub const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long in-flight requests may run after `stop` (§14).
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// Plaintext HTTP/1.1 for `router` on `listener` with the 5 s read-header timeout (§4). When
/// `stop` resolves, stops accepting and waits up to [`SHUTDOWN_DEADLINE`] for open connections.
pub async fn serve_http(
    router: Router,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(READ_HEADER_TIMEOUT);
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Per-connection failures are retried at once; others (e.g. out of file
                // descriptors) after a pause, as net/http does.
                if !matches!(
                    err.kind(),
                    std::io::ErrorKind::ConnectionRefused
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                ) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(SHUTDOWN_DEADLINE, graceful.shutdown()).await;
    Ok(())
}
