//! The InferenceCache server: a thin translation layer from gRPC and HTTP to the engine.
//!
//! The index logic lives in `inferencecache-engine`; this crate owns configuration, the RPC
//! handlers (numbered as the spec's handler algorithm, `// H1`…`// H13`), HTTP surfaces,
//! metrics and process lifecycle.

pub mod config;
pub mod config_file;
pub mod http;
pub mod lookup;
pub mod metrics;
pub mod policy;
pub mod service;
pub mod streams;
pub mod tls;

use std::net::SocketAddr;
use std::process::ExitCode;
use tokio::net::TcpListener;
use tracing::{error, info};

/// Runs the server until SIGINT/SIGTERM; returns the process exit code.
pub async fn run(cli: config::Cli) -> ExitCode {
    let settings = match config::Settings::from_cli(&cli) {
        Ok(s) => s,
        Err(err) => {
            eprintln!("inferencecache-server: {err:#}");
            return ExitCode::from(2);
        }
    };
    if let Err(err) = config::init_logging(&settings) {
        eprintln!("inferencecache-server: {err:#}");
        return ExitCode::from(2);
    }
    info!(
        version = env!("CARGO_PKG_VERSION"),
        grpc_addr = %settings.grpc_addr,
        http_addr = %settings.http_addr,
        "startup"
    );
    let grpc = match TcpListener::bind(settings.grpc_addr).await {
        Ok(l) => l,
        Err(err) => return serve_error("grpc", settings.grpc_addr, err),
    };
    let http = match TcpListener::bind(settings.http_addr).await {
        Ok(l) => l,
        Err(err) => return serve_error("http", settings.http_addr, err),
    };
    let state = service::AppState::new(service::ServerOptions {
        block_size: settings.block_size,
        index: inferencecache_engine::IndexConfig {
            global_ttl_ms: i64::try_from(settings.ttl.as_millis()).unwrap_or(i64::MAX),
            sweep_interval_ms: i64::try_from(settings.sweep_interval.as_millis())
                .unwrap_or(i64::MAX),
            max_entries: settings.max_entries,
            ..Default::default()
        },
        ..Default::default()
    });
    let shutdown = shutdown_signal();
    match serve(state, grpc, http, shutdown).await {
        Ok(()) => {
            info!("graceful_shutdown_done");
            ExitCode::SUCCESS
        }
        Err(err) => {
            error!(err = %format!("{err:#}"), "serve_error");
            ExitCode::from(1)
        }
    }
}

fn serve_error(listener: &str, addr: SocketAddr, err: std::io::Error) -> ExitCode {
    error!(listener, addr = %addr, err = %err, "serve_error");
    ExitCode::from(1)
}

/// Serves gRPC and HTTP on already-bound listeners until `shutdown` resolves.
pub async fn serve(
    state: service::AppState,
    grpc: TcpListener,
    http: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let grpc_stop = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stopped| *stopped).await;
        }
    };
    let http_stop = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stopped| *stopped).await;
        }
    };
    state.start();
    let grpc_task = tokio::spawn(service::serve_grpc(state.clone(), grpc, grpc_stop));
    let http_task = tokio::spawn(http::serve_public(state.clone(), http, http_stop));
    let broadcaster = state.broadcaster().clone();
    tokio::spawn(async move {
        shutdown.await;
        info!("graceful_shutdown_started");
        // Observer streams end with OK first, or the graceful stop would wait on them forever.
        broadcaster.shutdown();
        let _ = stop_tx.send(true);
    });
    let (grpc_res, http_res) = tokio::join!(grpc_task, http_task);
    state.stop();
    grpc_res??;
    http_res??;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
