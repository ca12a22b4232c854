//! The serving state every listener shares: the [`Core`] (index, policies, restore gate,
//! checkpoint status) plus what serving needs on top of it (metrics, observer streams, TLS,
//! the tokenizer, credentials, limits, connection gate, replication, the instance identity).
//!
//! One [`AppState`] per process (per test server); cloning it clones an `Arc`.

use crate::core::Core;
use crate::limits::{Limits, ProducerLimiter};
use crate::metrics::Metrics;
use crate::policy::PolicyStore;
use crate::route_index::RouteIndex;
use crate::streams::Broadcaster;
use inferencecache_engine::{Clock, Index, IndexConfig, PROBE_TENANT, SystemClock};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_tokenize::PromptTokenizer;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Concurrent tokenizations; over the limit a lookup fails open instead of waiting.
pub const MAX_CONCURRENT_TOKENIZE: usize = 64;

/// Server-wide knobs the handlers read.
#[derive(Clone)]
pub struct ServerOptions {
    /// Tokens per block for `token_ids` / `prompt_text` fingerprints.
    pub block_size: usize,
    /// Index configuration (TTL, sweep, cap, ranker).
    pub index: IndexConfig,
    /// Per-subscriber queue of `StreamCacheEvents`.
    pub stream_buffer_events: usize,
    /// Concurrent observer streams (both RPCs together).
    pub stream_max_subscribers: usize,
    /// gRPC TLS (and mTLS) configuration; `None` serves plaintext.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Tokenizer for `prompt_text` lookups; `None` fails those lookups open (`NO_HINT`).
    pub tokenizer: Option<Arc<dyn PromptTokenizer>>,
    /// Memory and rate limits (`docs/robustness.md`).
    pub limits: Limits,
    /// Concurrent gRPC connections (`0` = no cap); more are closed at accept and counted.
    pub max_connections: u64,
    /// Models with their own lookup and entry series; the rest are counted as `_other`.
    pub max_metric_models: usize,
    /// How long a graceful stop answers "not serving" (gRPC health, `/readyz`) before the
    /// drain begins, so load balancers see the stop coming.
    pub drain_notice: std::time::Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            index: IndexConfig::default(),
            stream_buffer_events: crate::streams::DEFAULT_BUFFER_EVENTS,
            stream_max_subscribers: crate::streams::DEFAULT_MAX_SUBSCRIBERS,
            tls: None,
            tokenizer: None,
            limits: Limits::default(),
            max_connections: crate::connections::DEFAULT_MAX_CONNECTIONS,
            max_metric_models: crate::metrics::DEFAULT_MAX_METRIC_MODELS,
            // Embedders and tests stop at once; the binary's `--drain-notice` defaults to 2 s.
            drain_notice: std::time::Duration::ZERO,
        }
    }
}

/// State shared by every listener: the index, the policy store and the metrics.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Shared>,
}

struct Shared {
    /// The index, policies, restore gate and checkpoint status (what checkpoint and
    /// replication take).
    core: Core,
    metrics: Arc<Metrics>,
    broadcaster: Arc<Broadcaster>,
    tls: Option<Arc<rustls::ServerConfig>>,
    tokenizer: Option<Arc<dyn PromptTokenizer>>,
    tokenizer_slots: Arc<tokio::sync::Semaphore>,
    /// What LookupRoute calls: `index` itself, unless built by [`AppState::with_route_index`].
    route_index: Arc<dyn RouteIndex>,
    auth: std::sync::OnceLock<Arc<crate::auth::Auth>>,
    block_size: usize,
    /// Replicated mode (`--nats-url`): set once at startup.
    replication: std::sync::OnceLock<Arc<crate::replication::Replication>>,
    /// The opt-in load-aware ranking (`--load-aware-overlap-weight`): set once at startup.
    load_aware: std::sync::OnceLock<crate::load_aware::LoadAwareRanking>,
    drain_notice: std::time::Duration,
    limits: Limits,
    producer_limiter: ProducerLimiter,
    connections: crate::connections::ConnectionGate,
    /// This process's identity, told to producers in every `Ack` (see [`new_instance_id`]).
    instance_id: String,
    epp_metrics: Arc<crate::metrics::epp::EppMetrics>,
}

/// A fresh server instance identity: random per process (and per [`AppState`]), so every start,
/// a warm restart from a checkpoint included, is a new instance to producers. A producer that
/// sees it change reconciles its replica: the new instance may hold less (a cold start) or
/// more (a checkpoint older than the last removals) than the producer reported.
pub fn new_instance_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    // `RandomState` draws its keys from the OS's randomness; the time and process id make a
    // collision between two processes seeded alike impossible in practice.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    hasher.write_u128(nanos);
    hasher.write_u32(std::process::id());
    let high = hasher.finish();
    hasher.write_u64(high);
    format!("{high:016x}{:016x}", hasher.finish())
}

impl AppState {
    /// Builds the index with the system clock. The sweep ticker starts with [`AppState::start`].
    pub fn new(options: ServerOptions) -> Self {
        Self::with_clock(options, Arc::new(SystemClock))
    }

    /// Builds the state over an injected clock (tests).
    pub fn with_clock(options: ServerOptions, clock: Arc<dyn Clock>) -> Self {
        Self::with_route_index(options, clock, |index| index)
    }

    /// Builds the state with LookupRoute calling `route_index(index)` instead of the index
    /// itself (everything else still uses the index). The wrapper gets the real index, so an
    /// index double (H7) can answer from it.
    pub fn with_route_index(
        options: ServerOptions,
        clock: Arc<dyn Clock>,
        route_index: impl FnOnce(Arc<Index>) -> Arc<dyn RouteIndex>,
    ) -> Self {
        let config = options.index.normalized();
        let policies = Arc::new(PolicyStore::new(
            config.global_ttl_ms.saturating_mul(1_000_000),
        ));
        let index = Arc::new(Index::new(config, policies.clone(), clock));
        let metrics = Arc::new(Metrics::with_model_cap(options.max_metric_models));
        let broadcaster = Arc::new(Broadcaster::new(
            metrics.clone(),
            options.stream_buffer_events,
            options.stream_max_subscribers,
        ));
        index.set_change_sink(broadcaster.clone());
        let route_index = route_index(index.clone());
        Self {
            inner: Arc::new(Shared {
                core: Core::new(index, policies),
                route_index,
                metrics: metrics.clone(),
                broadcaster,
                tls: options.tls.clone(),
                tokenizer: options.tokenizer.clone(),
                auth: std::sync::OnceLock::new(),
                tokenizer_slots: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_TOKENIZE)),
                block_size: options.block_size.max(1),
                replication: std::sync::OnceLock::new(),
                load_aware: std::sync::OnceLock::new(),
                drain_notice: options.drain_notice,
                limits: options.limits,
                producer_limiter: ProducerLimiter::new(options.limits.producer_max_blocks_per_sec),
                connections: crate::connections::ConnectionGate::new(
                    options.max_connections,
                    metrics.clone(),
                ),
                instance_id: new_instance_id(),
                epp_metrics: Arc::default(),
            }),
        }
    }

    /// Starts the index (ready flag and TTL sweep ticker).
    pub fn start(&self) {
        self.index().start();
        self.inner.metrics.server_up.store(1, Ordering::Relaxed);
        self.core().set_ready(true);
    }

    /// Stops the index (`/readyz` turns 503).
    pub fn stop(&self) {
        self.core().set_ready(false);
        self.index().stop();
        self.inner.metrics.server_up.store(0, Ordering::Relaxed);
    }

    /// The core handle: index, policies, restore gate, checkpoint status, endpoints.
    pub fn core(&self) -> &Core {
        &self.inner.core
    }

    /// The index (the core's).
    pub fn index(&self) -> &Arc<Index> {
        self.inner.core.index()
    }

    /// The policy store (the core's).
    pub fn policies(&self) -> &Arc<PolicyStore> {
        self.inner.core.policies()
    }

    /// Turns on replicated mode (once, before the listeners serve).
    pub fn set_replication(&self, replication: Arc<crate::replication::Replication>) {
        let _ = self.inner.replication.set(replication);
    }

    /// Turns on the opt-in load-aware ranking (once, before the listeners serve).
    pub fn set_load_aware(&self, ranking: crate::load_aware::LoadAwareRanking) {
        let _ = self.inner.load_aware.set(ranking);
    }

    /// The load-aware ranking, when enabled (`None`: the reference ranking).
    pub fn load_aware(&self) -> Option<&crate::load_aware::LoadAwareRanking> {
        self.inner.load_aware.get()
    }

    /// Replicated mode, when configured.
    pub fn replication(&self) -> Option<&Arc<crate::replication::Replication>> {
        self.inner.replication.get()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    pub fn broadcaster(&self) -> &Arc<Broadcaster> {
        &self.inner.broadcaster
    }

    /// TLS configuration of the gRPC listener, if any.
    pub fn tls(&self) -> Option<&Arc<rustls::ServerConfig>> {
        self.inner.tls.as_ref()
    }

    /// The `prompt_text` tokenizer, if one was configured.
    pub fn tokenizer(&self) -> Option<&Arc<dyn PromptTokenizer>> {
        self.inner.tokenizer.as_ref()
    }

    /// Slots bounding concurrent tokenizations (taken without waiting).
    pub fn tokenizer_slots(&self) -> &Arc<tokio::sync::Semaphore> {
        &self.inner.tokenizer_slots
    }

    /// Installs the credentials checker (producer auth, D3). Set once at startup.
    pub fn set_auth(&self, auth: Arc<crate::auth::Auth>) {
        let _ = self.inner.auth.set(auth);
    }

    /// The credentials checker, if installed.
    pub fn auth(&self) -> Option<&Arc<crate::auth::Auth>> {
        self.inner.auth.get()
    }

    /// The index LookupRoute calls (borrowed: no reference count per call).
    pub fn route_index(&self) -> &dyn RouteIndex {
        &*self.inner.route_index
    }

    /// The endpoint picker's endpoint registry (the core's).
    pub fn endpoints(&self) -> &Arc<crate::endpoints::Registry> {
        self.inner.core.endpoints()
    }

    /// The endpoint picker's counters.
    pub fn epp_metrics(&self) -> &crate::metrics::epp::EppMetrics {
        &self.inner.epp_metrics
    }

    pub fn block_size(&self) -> usize {
        self.inner.block_size
    }

    /// The memory and rate limits in force.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Applies one `CacheStateUpdate` within the limits, after waiting for the producer's rate
    /// budget (`peer` = the producer's connection). The reserved tenant is skipped silently.
    pub async fn ingest_limited(&self, peer: Option<SocketAddr>, update: &pb::CacheStateUpdate) {
        if update.tenant_id == PROBE_TENANT {
            return;
        }
        let counters = &self.inner.metrics.limits;
        let Some((admitted, cost)) = crate::limits::admit(update, &self.inner.limits, counters)
        else {
            return;
        };
        // Replicated mode: the stream applies it, here and everywhere (never waits on NATS).
        if let Some(replication) = self.replication() {
            self.inner
                .producer_limiter
                .acquire(peer, cost, counters)
                .await;
            let now_us = self.index().now_us();
            let mut owned = crate::replication::owned_update(admitted, now_us);
            if let (Some(out), Some(stats)) = (owned.stats.as_mut(), update.stats.as_ref()) {
                out.endpoint.clone_from(&stats.endpoint);
            }
            replication.submit_update(owned).await;
            return;
        }
        // A warm restart's entries are older than anything a producer sends now.
        self.core().wait_restored().await;
        self.inner
            .producer_limiter
            .acquire(peer, cost, counters)
            .await;
        self.core().observe_endpoint(update);
        self.index().ingest(admitted);
    }

    /// Waits for one unit of the producer's rate budget (a `PublishEvent`).
    pub async fn charge_event(&self, peer: Option<SocketAddr>) {
        self.inner
            .producer_limiter
            .acquire(peer, 1, &self.inner.metrics.limits)
            .await;
    }

    /// Starts a graceful stop's notice: `/readyz` answers 503 and gRPC health NOT_SERVING
    /// while both listeners keep serving; the drain follows after [`Self::drain_notice`].
    pub fn begin_drain(&self) {
        // Health follows readiness (see `serve_grpc`), so this one store announces the stop.
        self.core().set_ready(false);
    }

    /// How long the notice of a graceful stop lasts.
    pub fn drain_notice(&self) -> std::time::Duration {
        self.inner.drain_notice
    }

    /// This server instance's identity (changes at every start).
    pub fn instance_id(&self) -> &str {
        &self.inner.instance_id
    }

    /// An accepting `Ack` stamped with this instance's identity.
    pub fn ack(&self) -> pb::Ack {
        pb::Ack {
            accepted: true,
            reason_code: String::new(),
            server_instance_id: self.inner.instance_id.clone(),
        }
    }

    /// The admission gate of gRPC connections.
    pub fn connections(&self) -> &crate::connections::ConnectionGate {
        &self.inner.connections
    }
}
