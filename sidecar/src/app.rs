//! Wiring of the sidecar process (spec `sidecar.md` §1): subscriber → reporter, and the
//! independent stats reporter, with a bounded graceful drain on shutdown.

use crate::client::{GrpcSink, TokenSource, build_channel_named, expand_servers};
use crate::config::Settings;
use crate::metrics::{Deriver, Profile, ScraperConfig};
use crate::reporter::{Identity, Reporter, ReporterConfig};
use crate::scrape_client::MetricsClient;
use crate::stats::{Staleness, StatsReporter};
use crate::subscriber::{self, CHANNEL_CAPACITY, SubscriberConfig};
use crate::telemetry::Telemetry;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Bound on each drain step at shutdown.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds the gRPC sink (the caller exits 1 on error).
pub fn build_sink(s: &Settings) -> anyhow::Result<GrpcSink> {
    let mut channels = Vec::new();
    for (address, tls_name) in expand_servers(&s.servers) {
        let channel = build_channel_named(&address, tls_name.as_deref(), &s.tls)
            .map_err(|e| anyhow::anyhow!("--server {address}: {e}"))?;
        channels.push((address, channel));
    }
    let token = s.token_file.as_ref().map(TokenSource::new).transpose()?;
    Ok(GrpcSink::with_servers(channels, token))
}

/// Builds the engine metrics client (the caller exits 1 on error).
pub fn build_metrics_client(s: &Settings) -> anyhow::Result<MetricsClient> {
    let Some(path) = &s.engine_metrics_ca_file else {
        return Ok(MetricsClient::new());
    };
    let pem = std::fs::read(path)
        .map_err(|e| anyhow::anyhow!("reading --engine-metrics-ca-file {}: {e}", path.display()))?;
    MetricsClient::with_extra_ca(&pem)
        .map_err(|e| anyhow::anyhow!("--engine-metrics-ca-file {}: {e}", path.display()))
}

/// Binds the metrics listener, when configured (the caller exits 1 on error).
pub async fn bind_metrics(s: &Settings) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    let Some(addr) = &s.metrics_bind_address else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding --metrics-bind-address {addr}: {e}"))?;
    Ok(Some(listener))
}

/// Runs the sidecar until `cancel` fires, then drains.
pub async fn run(
    s: Settings,
    sink: GrpcSink,
    metrics_client: MetricsClient,
    metrics_listener: Option<tokio::net::TcpListener>,
    cancel: CancellationToken,
) {
    if s.profile == Profile::Vllm && s.hash_scheme != "vllm" {
        warn!(hash_scheme = %s.hash_scheme, "unknown_hash_scheme");
    }
    if s.tenant_id.is_empty() {
        // T50: lookups never reach tenant "".
        warn!(
            event = "empty_tenant",
            "--tenant-id is empty: entries land under tenant \"\", which no lookup reaches; \
             set it to the tenant gateways send (typically the pod namespace)"
        );
    }
    let telemetry = Arc::new(Telemetry::default());
    if let Some(listener) = metrics_listener {
        let address = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        info!(metrics_address = %address, "metrics_listening");
        tokio::spawn(crate::exporter::serve(
            listener,
            Arc::clone(&telemetry),
            cancel.child_token(),
        ));
    }
    let identity = Identity {
        replica_id: s.replica_id.clone(),
        model_id: s.model_id.clone(),
        tenant_id: s.tenant_id.clone(),
        hash_scheme: s.hash_scheme.clone(),
    };
    info!(
        engine_endpoint = %s.engine_endpoint,
        topic = %s.topic,
        replay_endpoint = %s.replay_endpoint.as_deref().unwrap_or(""),
        block_size = s.block_size,
        server = %s.server,
        replica_id = %s.replica_id,
        model_id = %s.model_id,
        tenant_id = %s.tenant_id,
        hash_scheme = %s.hash_scheme,
        l2_mode = s.l2_mode,
        lora_adapters = s.adapters.len(),
        tls = s.tls.enabled(),
        producer_token = s.token_file.is_some(),
        "startup"
    );

    let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
    let sub_cancel = cancel.child_token();
    let mut scfg = SubscriberConfig::new(s.engine_endpoint.clone(), s.topic.clone());
    scfg.replay_endpoint = s.replay_endpoint.clone();
    scfg.telemetry = Arc::clone(&telemetry);
    let sub = tokio::spawn(subscriber::run(scfg, tx, sub_cancel));
    let mut rcfg = ReporterConfig::new(identity.clone());
    rcfg.window = s.window;
    rcfg.l2_mode = s.l2_mode;
    rcfg.adapters = s.adapters.clone();
    rcfg.block_size = s.block_size;
    rcfg.attention_chunk_size = s.attention_chunk_size;
    rcfg.telemetry = telemetry;
    rcfg.outbox_max_entries = s.outbox_max_entries;
    rcfg.retry_max = s.retry_max_delay;
    rcfg.anti_entropy_interval = s.anti_entropy_interval;
    rcfg.probe_interval = s.probe_interval;
    let reporter = tokio::spawn(Reporter::new(rcfg, sink.clone()).run(rx));

    let stats = StatsReporter {
        identity,
        url: s.engine_metrics_url.clone(),
        client: metrics_client,
        interval: s.stats_interval,
        deriver: Deriver::new(ScraperConfig {
            profile: s.profile,
            tier: s.cache_tier,
            model_name: s.engine_model_name.clone(),
            capacity_bytes: s.capacity_bytes,
            ceiling: s.ceiling,
        }),
        endpoint: s.engine_api_address.clone(),
        sink,
        staleness: Staleness::new(),
    };
    let stats_task = tokio::spawn(stats.run(cancel.child_token()));

    cancel.cancelled().await;
    info!("graceful_shutdown_started");
    // The subscriber returns on cancellation and drops the sender, closing the reporter input.
    let _ = sub.await;
    match tokio::time::timeout(DRAIN_TIMEOUT, reporter).await {
        Ok(_) => {}
        Err(_) => warn!("reporter_drain_timed_out"),
    }
    match tokio::time::timeout(DRAIN_TIMEOUT, stats_task).await {
        Ok(_) => {}
        Err(_) => warn!("stats_stop_timed_out"),
    }
    info!("graceful_shutdown_done");
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
