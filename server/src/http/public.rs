//! Public HTTP listener (`:8080`): `/healthz`, `/readyz`, `/metrics` (spec `server.md` §12.1–§12.2).

use crate::state::AppState;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::any;
use tokio::net::TcpListener;

/// Router of the public listener. Exact paths; anything else is 404.
pub fn public_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", any(healthz))
        .route("/readyz", any(readyz))
        .route("/metrics", any(metrics))
        .with_state(state)
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<AppState>) -> (StatusCode, &'static str) {
    if state.core().ready() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(State(state): State<AppState>) -> impl axum::response::IntoResponse {
    let mut families = state.metrics().gather(state.index());
    families.extend(state.core().checkpoint_status().families());
    families.extend(state.epp_metrics().families());
    families.extend(crate::metrics::tokenizer::families(
        state
            .tokenizer()
            .and_then(|tokenizer| tokenizer.segment_cache_stats()),
    ));
    match state.replication() {
        Some(replication) => families.extend(replication.families()),
        None => families.extend(crate::replication::families(
            &crate::replication::Counters::default(),
            false,
        )),
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::render_text(&families),
    )
}

/// Serves the public router until `stop` resolves.
pub async fn serve_public(
    state: AppState,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // Same hyper stack as the control plane: a 5 s read-header timeout (§4).
    super::serve::serve_http(public_router(state), listener, stop).await
}
