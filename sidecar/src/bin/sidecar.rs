//! `inferencecache-sidecar`: runs next to one engine replica (spec `sidecar.md`).

use clap::Parser;
use inferencecache_sidecar::app;
use inferencecache_sidecar::config::{Cli, Settings, normalize_args};
use tokio_util::sync::CancellationToken;

fn main() {
    let cli = match Cli::try_parse_from(normalize_args(std::env::args_os())) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let settings = match Settings::from_cli(cli) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("inferencecache-sidecar: {e}");
            std::process::exit(2);
        }
    };
    // A logger installed already (embedding) is not an error for the sidecar.
    let _ = inferencecache_sidecar::logging::init(settings.log_level, settings.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("inferencecache-sidecar: runtime: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(async move {
        // Building the lazy channel needs a runtime context.
        let sink = match app::build_sink(&settings) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(err = %e, "grpc_client_failed");
                std::process::exit(1);
            }
        };
        let metrics_client = match app::build_metrics_client(&settings) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(err = %e, "engine_metrics_client_failed");
                std::process::exit(1);
            }
        };
        let metrics_listener = match app::bind_metrics(&settings).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(err = %e, "metrics_listener_failed");
                std::process::exit(1);
            }
        };
        let cancel = CancellationToken::new();
        let signal_cancel = cancel.clone();
        tokio::spawn(async move {
            app::shutdown_signal().await;
            signal_cancel.cancel();
        });
        app::run(settings, sink, metrics_client, metrics_listener, cancel).await;
    });
}
