//! The picker's listener: binds `--epp-bind-address`, starts the endpoints file's reloader when
//! one is configured, and serves ext_proc with its health services.

use super::{ENDPOINTS_FILE_PERIOD, Picker, Settings, ext_proc};
use crate::endpoints;
use crate::state::AppState;
use anyhow::Context;
use std::net::SocketAddr;
use std::sync::Arc;

/// Starts the picker's listener (ext_proc plus its health services) and, when configured, the
/// endpoints file's reloader. Returns the serving task.
pub async fn spawn(
    state: AppState,
    settings: Settings,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<anyhow::Result<()>>)> {
    if settings.tenant.is_empty() {
        // The index never routes the empty tenant: without a tenant header every pick would
        // go by load.
        tracing::warn!(
            effect = "requests without an x-inferencecache-tenant header are picked by load only",
            "epp_empty_tenant"
        );
    }
    if let Some(path) = &settings.endpoints_file {
        let entries = endpoints::load_file(path)?;
        state.endpoints().replace_file(entries);
        let counted = state.clone();
        endpoints::spawn_file_reloader(
            path.clone(),
            state.endpoints().clone(),
            ENDPOINTS_FILE_PERIOD,
            move |loaded| counted.epp_metrics().endpoints_reload(loaded),
        );
    }
    let listener = tokio::net::TcpListener::bind(settings.bind)
        .await
        .with_context(|| format!("binding --epp-bind-address {}", settings.bind))?;
    let addr = listener.local_addr()?;
    let picker = Arc::new(Picker::new(state, settings));
    let task = tokio::spawn(ext_proc::serve(picker, listener));
    Ok((addr, task))
}
