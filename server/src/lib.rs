//! The InferenceCache server: a thin translation layer from gRPC and HTTP to the engine.
//!
//! The index logic lives in `inferencecache-engine`; this crate owns configuration, the RPC
//! handlers (numbered as the spec's handler algorithm, `// H1`…`// H13`), HTTP surfaces,
//! metrics and process lifecycle.

pub mod allocator;
pub mod auth;
pub mod checkpoint;
pub mod config;
pub mod config_file;
pub mod connections;
pub mod core;
pub mod endpoints;
pub mod epp;
pub mod grpc;
pub mod http;
pub mod limits;
pub mod load_aware;
pub mod lookup;
pub mod metrics;
pub mod policy;
pub mod replication;
pub mod route_index;
pub mod state;
pub mod streams;
pub mod tls;
pub mod translate;

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
    // §3 steps 3 and 5: load the token files, log the auth summary.
    let token_stores = match auth::TokenStores::load(&settings.auth) {
        Ok(s) => s,
        Err(err) => {
            eprintln!("inferencecache-server: {err:#}");
            return ExitCode::from(2);
        }
    };
    // §3 step 4: tokenizer models (loaded once; request-time lookups never touch the disk).
    let tokenizer = load_tokenizers(&settings);
    auth::log_auth_summary(
        &token_stores,
        settings.snapshot_addr,
        settings.snapshot_loopback_forced,
    );
    // §3 step 6: an unloadable certificate, key or client CA is exit 1.
    let tls = match &settings.tls {
        Some(files) => match tls::server_config(files) {
            Ok(config) => Some(config),
            Err(err) => {
                error!(err = %format!("{err:#}"), "grpc_tls_load");
                return ExitCode::from(1);
            }
        },
        None => None,
    };
    let file = settings.config_file.as_ref().map(|(_, f)| f);
    info!(
        version = env!("CARGO_PKG_VERSION"),
        commit = option_env!("INFERENCECACHE_COMMIT").unwrap_or("unknown"),
        grpc_addr = %settings.grpc_addr,
        grpc_tls = tls.is_some(),
        grpc_mtls = settings.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
        http_addr = %settings.http_addr,
        snapshot_addr = %settings.snapshot_addr,
        max_entries = settings.max_entries,
        ttl_seconds = settings.ttl.as_secs_f64(),
        // "" when warm restart is off.
        state_dir = %settings.state.as_ref().map(|s| s.dir.display().to_string()).unwrap_or_default(),
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
    let snapshot = match TcpListener::bind(settings.snapshot_addr).await {
        Ok(l) => l,
        Err(err) => return serve_error("snapshot", settings.snapshot_addr, err),
    };
    let state = state::AppState::new(state::ServerOptions {
        block_size: settings.block_size,
        index: inferencecache_engine::IndexConfig {
            global_ttl_ms: i64::try_from(settings.ttl.as_millis()).unwrap_or(i64::MAX),
            sweep_interval_ms: i64::try_from(settings.sweep_interval.as_millis())
                .unwrap_or(i64::MAX),
            max_entries: settings.max_entries,
            hot_access_threshold: file
                .and_then(|f| f.index.hot_access_threshold)
                .map_or(inferencecache_engine::DEFAULT_HOT_ACCESS_THRESHOLD, |t| {
                    u32::try_from(t).unwrap_or(u32::MAX)
                }),
            ..Default::default()
        },
        stream_buffer_events: file
            .and_then(|f| f.streams.buffer_events)
            .map_or(streams::DEFAULT_BUFFER_EVENTS, |v| {
                usize::try_from(v).unwrap_or(usize::MAX)
            }),
        stream_max_subscribers: file
            .and_then(|f| f.streams.max_subscribers)
            .map_or(streams::DEFAULT_MAX_SUBSCRIBERS, |v| {
                usize::try_from(v).unwrap_or(usize::MAX)
            }),
        tls,
        tokenizer,
        limits: settings.limits,
        max_connections: settings.max_connections,
        max_metric_models: settings.max_metric_models,
        drain_notice: settings.drain_notice,
    });
    // The file's policy layer applies now and is reloaded when the file changes (D1).
    if let Some((path, file)) = &settings.config_file {
        match file.policy_layer() {
            Ok(layer) => state.policies().replace_file(layer),
            Err(err) => {
                error!(err = %format!("{err:#}"), "config_reload_failed");
                return ExitCode::from(2);
            }
        }
        config_file::spawn_reloader(
            path.clone(),
            file.clone(),
            state.policies().clone(),
            std::time::Duration::from_secs(2),
        );
    }
    // The control-plane listener (:8081) runs next to gRPC and public HTTP; its failure stops
    // the others.
    let auth = std::sync::Arc::new(auth::Auth::new(token_stores, state.metrics().clone()));
    // D3: producer RPCs check the producer token when one is configured.
    state.set_auth(auth.clone());
    if let Some(ranking) = settings.load_aware {
        state.set_load_aware(ranking);
    }
    // Warm restart: the state is *restoring* before any listener serves; the restore runs
    // while they do (lookups fail open, producers wait), then periodic checkpoints start.
    let checkpointer = settings
        .state
        .clone()
        .map(|s| checkpoint::Checkpointer::new(s, state.core().clone()));
    if let Some(c) = &checkpointer {
        state.core().begin_restore();
        let c = c.clone();
        tokio::spawn(async move {
            c.restore().await;
            c.spawn_periodic();
        });
    }
    // Replicated mode: the state is *restoring* until the stream's backlog is applied; the
    // listeners serve meanwhile (lookups fail open, producers are acked into the outbox).
    if let Some(settings) = settings.replication.clone() {
        let replication = replication::Replication::new(settings);
        state.set_replication(replication.clone());
        let core = state.core().clone();
        core.begin_restore();
        tokio::spawn(async move {
            // NATS may come up after the server: keep trying (not ready meanwhile).
            while let Err(err) = replication.start(core.clone()).await {
                replication::start_failed(&err);
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        });
    }
    // The endpoint picker (docs/epp.md), when --epp-bind-address is given.
    let picker = match epp::Settings::from_cli(&cli) {
        Ok(Some(picker_settings)) => match epp::listen::spawn(state.clone(), picker_settings).await
        {
            Ok((addr, task)) => {
                info!(epp_addr = %addr, "epp_listening");
                Some(task)
            }
            Err(err) => {
                error!(err = %format!("{err:#}"), "serve_error");
                return ExitCode::from(1);
            }
        },
        Ok(None) => None,
        Err(err) => {
            eprintln!("inferencecache-server: {err:#}");
            return ExitCode::from(2);
        }
    };
    let mut control = http::control::ControlServer::spawn(
        http::control::ControlState::new(state.clone(), auth),
        snapshot,
    );
    let control_failed = control.failure();
    let signal = shutdown_signal();
    let shutdown = async move {
        tokio::select! {
            _ = signal => {},
            _ = control_failed => {},
        }
    };
    let served = serve(state, grpc, http, shutdown).await;
    // The last checkpoint holds everything producers sent before the drain ended.
    if let Some(c) = &checkpointer {
        c.write_now().await;
    }
    let control_result = control.stop().await;
    if let Some(picker) = picker {
        picker.abort();
    }
    match served.and(control_result) {
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

#[cfg(feature = "tokenizer")]
fn load_tokenizers(
    settings: &config::Settings,
) -> Option<std::sync::Arc<dyn inferencecache_tokenize::PromptTokenizer>> {
    let dir = settings.tokenizer_models_dir.as_ref()?;
    Some(std::sync::Arc::new(
        inferencecache_tokenize::Tokenizers::load(dir)
            .with_segment_cache(settings.tokenizer_segment_cache_bytes),
    ))
}

#[cfg(not(feature = "tokenizer"))]
fn load_tokenizers(
    settings: &config::Settings,
) -> Option<std::sync::Arc<dyn inferencecache_tokenize::PromptTokenizer>> {
    if let Some(dir) = &settings.tokenizer_models_dir {
        tracing::warn!(
            reason = "built without the tokenizer feature",
            tokenizer_models_dir = %dir.display(),
            effect = "prompt_text lookups answer NO_HINT",
            "tokenizer_models_dir_ignored"
        );
    }
    None
}

fn serve_error(listener: &str, addr: SocketAddr, err: std::io::Error) -> ExitCode {
    error!(listener, addr = %addr, err = %err, "serve_error");
    ExitCode::from(1)
}

/// How long a graceful stop waits for open connections before closing them.
pub const GRACEFUL_STOP_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A listener task aborted at the end of the grace period stopped as intended.
fn forgive_abort(
    res: Result<anyhow::Result<()>, tokio::task::JoinError>,
) -> Result<anyhow::Result<()>, tokio::task::JoinError> {
    match res {
        Err(e) if e.is_cancelled() => Ok(Ok(())),
        other => other,
    }
}

/// Serves gRPC and HTTP on already-bound listeners until `shutdown` resolves.
pub async fn serve(
    state: state::AppState,
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
    // The public listener outlives the gRPC drain, so `/readyz` keeps answering 503 while
    // in-flight RPCs finish.
    let (grpc_done_tx, grpc_done_rx) = tokio::sync::watch::channel(false);
    let http_stop = {
        let mut rx = grpc_done_rx;
        async move {
            let _ = rx.wait_for(|done| *done).await;
        }
    };
    state.start();
    let grpc_task = {
        let state = state.clone();
        tokio::spawn(async move {
            let served = grpc::serve_grpc(state, grpc, grpc_stop).await;
            let _ = grpc_done_tx.send(true);
            served
        })
    };
    let http_task = tokio::spawn(http::serve_public(state.clone(), http, http_stop));
    let broadcaster = state.broadcaster().clone();
    let draining = state.clone();
    tokio::spawn(async move {
        shutdown.await;
        info!("graceful_shutdown_started");
        // First the notice: health NOT_SERVING and /readyz 503 while everything still serves,
        // so a load balancer tells "draining" from "dead" and moves traffic away.
        draining.begin_drain();
        tokio::time::sleep(draining.drain_notice()).await;
        // Observer streams end with OK first, or the graceful stop would wait on them forever.
        broadcaster.shutdown();
        let _ = stop_tx.send(true);
    });
    // In-flight RPCs get a grace period; a peer that never lets its connection go (stalled,
    // or not reading the GOAWAY) cannot hold the process hostage beyond it.
    let (grpc_abort, http_abort) = (grpc_task.abort_handle(), http_task.abort_handle());
    let mut stopped = stop_rx.clone();
    tokio::spawn(async move {
        let _ = stopped.wait_for(|s| *s).await;
        tokio::time::sleep(GRACEFUL_STOP_LIMIT).await;
        grpc_abort.abort();
        http_abort.abort();
    });
    let (grpc_res, http_res) = tokio::join!(grpc_task, http_task);
    let (grpc_res, http_res) = (forgive_abort(grpc_res), forgive_abort(http_res));
    state.stop();
    grpc_res??;
    http_res??;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not when
/// the future is first polled: the listeners accept connections before the shutdown future is
/// polled, and a SIGTERM arriving in between must not take the default action (kill).
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let int = signal(SignalKind::interrupt()).ok();
        let term = signal(SignalKind::terminate()).ok();
        async move {
            let wait = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = wait(int) => {},
                _ = wait(term) => {},
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
