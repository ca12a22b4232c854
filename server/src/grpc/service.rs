//! The gRPC service: translates `inferencecache.v1alpha1.InferenceCache` calls into engine calls.
//!
//! Consumer RPCs never turn request content into an error (contract §5): every outcome is an OK
//! response with a reason code.

use crate::limits::{Limits, ProducerLimiter};
use crate::lookup;
use crate::metrics::Metrics;
use crate::policy::PolicyStore;
use crate::streams::{Broadcaster, ObserverStream};
use inferencecache_engine::{
    CacheEventInput, CacheStateUpdate, Clock, Index, IndexConfig, PROBE_TENANT, PrefixRef,
    ReplicaStatsInput, SystemClock,
};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use inferencecache_tokenize::PromptTokenizer;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status, Streaming};

/// Largest request message accepted by default (contract §5: larger → RESOURCE_EXHAUSTED);
/// `--max-message-bytes` changes it.
pub const MAX_MESSAGE_BYTES: usize = crate::limits::DEFAULT_MAX_MESSAGE_BYTES as usize;

/// Reason codes of `LookupRoute` (contract §4.1; an open vocabulary).
pub mod reason {
    pub const PREFIX_MATCH: &str = "PREFIX_MATCH";
    pub const TENANT_HOT: &str = "TENANT_HOT";
    pub const AFFINITY_HINT: &str = "AFFINITY_HINT";
    pub const NO_HINT: &str = "NO_HINT";
    pub const POLICY_REQUIRES_CHAIN: &str = "POLICY_REQUIRES_CHAIN";
    pub const TIMEOUT: &str = "TIMEOUT";
    pub const UNKNOWN_TENANT: &str = "UNKNOWN_TENANT";
    pub const UNKNOWN_MODEL: &str = "UNKNOWN_MODEL";
    pub const UNKNOWN_HASH_SCHEME: &str = "UNKNOWN_HASH_SCHEME";
    pub const OK: &str = "OK";
}

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
    index: Arc<Index>,
    policies: Arc<PolicyStore>,
    metrics: Arc<Metrics>,
    broadcaster: Arc<Broadcaster>,
    tls: Option<Arc<rustls::ServerConfig>>,
    tokenizer: Option<Arc<dyn PromptTokenizer>>,
    tokenizer_slots: Arc<tokio::sync::Semaphore>,
    /// What LookupRoute calls: `index` itself, unless built by [`AppState::with_route_index`].
    route_index: Arc<dyn lookup::RouteIndex>,
    auth: std::sync::OnceLock<Arc<crate::auth::Auth>>,
    block_size: usize,
    ready: AtomicBool,
    /// True while a warm restart loads its checkpoint (see `checkpoint.rs`).
    restoring: tokio::sync::watch::Sender<bool>,
    /// Readiness as health and `/readyz` report it: started, not restoring, not draining.
    readiness: tokio::sync::watch::Sender<bool>,
    /// The body of the last accepted `/policy` push (kept in checkpoints).
    pushed_policy: parking_lot::Mutex<Option<Arc<[u8]>>>,
    checkpoint_status: Arc<crate::checkpoint::Status>,
    /// Replicated mode (`--nats-url`): set once at startup.
    replication: std::sync::OnceLock<Arc<crate::replication::Replication>>,
    drain_notice: std::time::Duration,
    limits: Limits,
    producer_limiter: ProducerLimiter,
    connections: crate::connections::ConnectionGate,
    /// This process's identity, told to producers in every `Ack` (see [`new_instance_id`]).
    instance_id: String,
    /// The endpoint picker's replica → `ip:port` map and in-flight counts (docs/epp.md).
    endpoints: Arc<crate::epp::endpoints::Registry>,
    epp_metrics: Arc<crate::epp::EppMetrics>,
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
        route_index: impl FnOnce(Arc<Index>) -> Arc<dyn lookup::RouteIndex>,
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
                index,
                route_index,
                policies,
                metrics: metrics.clone(),
                broadcaster,
                tls: options.tls.clone(),
                tokenizer: options.tokenizer.clone(),
                auth: std::sync::OnceLock::new(),
                tokenizer_slots: Arc::new(tokio::sync::Semaphore::new(
                    lookup::MAX_CONCURRENT_TOKENIZE,
                )),
                block_size: options.block_size.max(1),
                ready: AtomicBool::new(false),
                restoring: tokio::sync::watch::Sender::new(false),
                readiness: tokio::sync::watch::Sender::new(false),
                pushed_policy: parking_lot::Mutex::new(None),
                checkpoint_status: Arc::default(),
                replication: std::sync::OnceLock::new(),
                drain_notice: options.drain_notice,
                limits: options.limits,
                producer_limiter: ProducerLimiter::new(options.limits.producer_max_blocks_per_sec),
                connections: crate::connections::ConnectionGate::new(
                    options.max_connections,
                    metrics.clone(),
                ),
                instance_id: new_instance_id(),
                endpoints: Arc::default(),
                epp_metrics: Arc::default(),
            }),
        }
    }

    /// Starts the index (ready flag and TTL sweep ticker).
    pub fn start(&self) {
        self.inner.index.start();
        self.inner.ready.store(true, Ordering::Release);
        self.inner.metrics.server_up.store(1, Ordering::Relaxed);
        self.publish_readiness();
    }

    /// Stops the index (`/readyz` turns 503).
    pub fn stop(&self) {
        self.inner.ready.store(false, Ordering::Release);
        self.inner.index.stop();
        self.inner.metrics.server_up.store(0, Ordering::Relaxed);
        self.publish_readiness();
    }

    fn publish_readiness(&self) {
        let ready = self.ready();
        self.inner.readiness.send_if_modified(|r| {
            let changed = *r != ready;
            *r = ready;
            changed
        });
    }

    /// Readiness changes (health follows it).
    pub fn readiness(&self) -> tokio::sync::watch::Receiver<bool> {
        self.inner.readiness.subscribe()
    }

    /// Enters the warm-restart *restoring* state (before the listeners serve).
    pub fn begin_restore(&self) {
        self.inner.restoring.send_replace(true);
        self.publish_readiness();
    }

    /// Leaves the *restoring* state: waiting producers go on, readiness may turn true.
    pub fn end_restore(&self) {
        self.inner.restoring.send_replace(false);
        self.publish_readiness();
    }

    /// Whether a warm restart is loading its checkpoint.
    pub fn restoring(&self) -> bool {
        *self.inner.restoring.borrow()
    }

    /// Waits until no restore is running (at once when none is).
    pub async fn wait_restored(&self) {
        if !self.restoring() {
            return;
        }
        let mut rx = self.inner.restoring.subscribe();
        let _ = rx.wait_for(|restoring| !*restoring).await;
    }

    /// Checkpoint state for `/checkpoint` and the metrics.
    pub fn checkpoint_status(&self) -> &Arc<crate::checkpoint::Status> {
        &self.inner.checkpoint_status
    }

    /// Turns on replicated mode (once, before the listeners serve).
    pub fn set_replication(&self, replication: Arc<crate::replication::Replication>) {
        let _ = self.inner.replication.set(replication);
    }

    /// Replicated mode, when configured.
    pub fn replication(&self) -> Option<&Arc<crate::replication::Replication>> {
        self.inner.replication.get()
    }

    /// Applies an accepted `/policy` push and keeps its body for checkpoints.
    pub fn push_policy(&self, body: &[u8], layer: crate::policy::Layer) {
        *self.inner.pushed_policy.lock() = Some(Arc::from(body));
        self.inner.policies.replace_pushed(layer);
    }

    /// The last accepted `/policy` push body.
    pub fn pushed_policy_body(&self) -> Option<Arc<[u8]>> {
        self.inner.pushed_policy.lock().clone()
    }

    /// Re-applies a push body stored in a checkpoint (an undecodable one is logged and
    /// skipped: the checkpoint's index is still restored).
    pub fn restore_pushed_policy(&self, body: &[u8]) {
        match crate::policy::decode_push(body) {
            Ok(layer) => self.push_policy(body, layer),
            Err(err) => tracing::error!(err = %err, "checkpoint_policy_refused"),
        }
    }

    pub fn index(&self) -> &Arc<Index> {
        &self.inner.index
    }

    pub fn policies(&self) -> &Arc<PolicyStore> {
        &self.inner.policies
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
    pub fn route_index(&self) -> &dyn lookup::RouteIndex {
        &*self.inner.route_index
    }

    /// The endpoint picker's endpoint registry (filled from producers' stats whether or not
    /// the picker runs).
    pub fn endpoints(&self) -> &Arc<crate::epp::endpoints::Registry> {
        &self.inner.endpoints
    }

    /// The endpoint picker's counters.
    pub fn epp_metrics(&self) -> &crate::epp::EppMetrics {
        &self.inner.epp_metrics
    }

    /// Records the engine address a producer's stats carry (every server applying the update
    /// learns it, so picker replicas agree).
    pub fn observe_endpoint(&self, update: &pb::CacheStateUpdate) {
        if let Some(stats) = &update.stats {
            self.inner
                .endpoints
                .observe(&update.replica_id, &stats.endpoint);
        }
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
            let now_us = self.inner.index.now_us();
            let mut owned = crate::replication::owned_update(admitted, now_us);
            if let (Some(out), Some(stats)) = (owned.stats.as_mut(), update.stats.as_ref()) {
                out.endpoint.clone_from(&stats.endpoint);
            }
            replication.submit_update(owned).await;
            return;
        }
        // A warm restart's entries are older than anything a producer sends now.
        self.wait_restored().await;
        self.inner
            .producer_limiter
            .acquire(peer, cost, counters)
            .await;
        self.observe_endpoint(update);
        self.inner.index.ingest(admitted);
    }

    /// Waits for one unit of the producer's rate budget (a `PublishEvent`).
    pub async fn charge_event(&self, peer: Option<SocketAddr>) {
        self.inner
            .producer_limiter
            .acquire(peer, 1, &self.inner.metrics.limits)
            .await;
    }

    /// Whether the index is started and not restoring (drives `/readyz` and gRPC health).
    pub fn ready(&self) -> bool {
        self.inner.ready.load(Ordering::Acquire) && !self.restoring()
    }

    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Release);
        self.publish_readiness();
    }

    /// Starts a graceful stop's notice: `/readyz` answers 503 and gRPC health NOT_SERVING
    /// while both listeners keep serving; the drain follows after [`Self::drain_notice`].
    pub fn begin_drain(&self) {
        // Health follows readiness (see `serve_grpc`), so this one store announces the stop.
        self.set_ready(false);
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

/// The `InferenceCache` service implementation.
#[derive(Clone)]
pub struct CacheService {
    state: AppState,
}

impl CacheService {
    pub fn new(state: AppState) -> Self {
        Self { state }
    }
}

#[tonic::async_trait]
impl InferenceCache for CacheService {
    async fn render_template(
        &self,
        _request: Request<pb::RenderTemplateRequest>,
    ) -> Result<Response<pb::RenderTemplateResponse>, Status> {
        Ok(Response::new(pb::RenderTemplateResponse {
            reason_code: reason::OK.into(),
            ..Default::default()
        }))
    }

    async fn lookup_route(
        &self,
        request: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        Ok(Response::new(
            lookup::handle(&self.state, &metadata, &message).await,
        ))
    }

    async fn lookup_pd_route(
        &self,
        _request: Request<pb::LookupPdRouteRequest>,
    ) -> Result<Response<pb::LookupPdRouteResponse>, Status> {
        Ok(Response::new(pb::LookupPdRouteResponse {
            reason_code: reason::NO_HINT.into(),
            ..Default::default()
        }))
    }

    async fn get_cache_state(
        &self,
        request: Request<pb::GetCacheStateRequest>,
    ) -> Result<Response<pb::GetCacheStateResponse>, Status> {
        let req = request.into_inner();
        // §8.1: the reserved tenant gets an empty answer; summary is always present.
        if req.tenant_id == PROBE_TENANT {
            return Ok(Response::new(pb::GetCacheStateResponse {
                replicas: Vec::new(),
                summary: Some(pb::CacheSummary::default()),
                server_instance_id: self.state.instance_id().to_string(),
                replica_digest: None,
            }));
        }
        let state = self
            .state
            .index()
            .cache_state(&req.tenant_id, &req.model_id);
        // A producer's anti-entropy question: the digest of its replica's entries. Asked while
        // a warm restart loads, it waits for the load, so it never compares a partial index.
        let replica_digest = if req.replica_id.is_empty() {
            None
        } else {
            self.state.wait_restored().await;
            let digest =
                self.state
                    .index()
                    .replica_digest(&req.tenant_id, &req.model_id, &req.replica_id);
            Some(pb::ReplicaDigest {
                entries: i64::try_from(digest.entries).unwrap_or(i64::MAX),
                digest: digest.hash.to_be_bytes().to_vec(),
            })
        };
        Ok(Response::new(pb::GetCacheStateResponse {
            replicas: state
                .replicas
                .into_iter()
                .map(|r| pb::ReplicaStats {
                    replica_id: r.replica_id.to_string(),
                    cache_memory_bytes: r.cache_memory_bytes,
                    hit_rate: r.hit_rate,
                    pressure: r.pressure,
                    client_version: String::new(),
                    t2_hit_tokens: r.t2_hit_tokens,
                    t2_query_tokens: r.t2_query_tokens,
                    endpoint: String::new(),
                })
                .collect(),
            summary: Some(pb::CacheSummary {
                total_prefixes: state.total_prefixes,
                hot_prefixes: state.hot_prefixes,
            }),
            server_instance_id: self.state.instance_id().to_string(),
            replica_digest,
        }))
    }

    async fn report_cache_state(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        // §9.2: producer credentials are checked before any message is read.
        if let Some(auth) = self.state.auth() {
            auth.check_producer(request.metadata())?;
        }
        let peer = request.remote_addr();
        let mut stream = request.into_inner();
        // §8.2: each message is applied as it arrives; a broken stream ends with its status and
        // everything received before stays applied. Limits cut what is over them (never an
        // error), and the rate limit delays the next read instead of dropping.
        while let Some(update) = stream.message().await? {
            self.state.ingest_limited(peer, &update).await;
        }
        Ok(Response::new(self.state.ack()))
    }

    async fn publish_event(
        &self,
        request: Request<pb::CacheEvent>,
    ) -> Result<Response<pb::Ack>, Status> {
        if let Some(auth) = self.state.auth() {
            auth.check_producer(request.metadata())?;
        }
        let peer = request.remote_addr();
        let event = request.into_inner();
        // §8.3: the reserved tenant is acknowledged and dropped.
        if event.tenant_id != PROBE_TENANT {
            self.state.charge_event(peer).await;
            if let Some(replication) = self.state.replication() {
                self.state.metrics().observe_event(event.r#type);
                let mut event = event;
                if event.timestamp_us == 0 {
                    event.timestamp_us = self.state.index().now_us();
                }
                replication.submit_event(event).await;
                return Ok(Response::new(self.state.ack()));
            }
            // A removal applied before a warm restart's load would be undone by it.
            self.state.wait_restored().await;
            self.state.metrics().observe_event(event.r#type);
            apply_event(self.state.index(), &event);
        }
        Ok(Response::new(self.state.ack()))
    }

    type StreamCacheEventsStream = ObserverStream<pb::CacheEvent>;

    async fn stream_cache_events(
        &self,
        request: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        // §8.5: live changes only (no history), bounded per-subscriber queue.
        let stream = self.state.broadcaster().subscribe(request.get_ref())?;
        Ok(Response::new(stream))
    }

    type StreamMetricsStream = ObserverStream<pb::Metric>;

    async fn stream_metrics(
        &self,
        request: Request<pb::StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        // §8.6: a sample now, then about one per second.
        let stream = self
            .state
            .broadcaster()
            .subscribe_metrics(request.get_ref(), self.state.index().clone())?;
        Ok(Response::new(stream))
    }
}

/// Applies one `CacheEvent` (E1–E7); the reserved tenant is skipped silently (§8.3).
pub fn apply_event(index: &Index, event: &pb::CacheEvent) {
    if event.tenant_id == PROBE_TENANT {
        return;
    }
    index.apply_event(CacheEventInput {
        event_type: event.r#type,
        replica_id: &event.replica_id,
        model_id: &event.model_id,
        tenant_id: &event.tenant_id,
        prefix_hash: &event.prefix_hash,
        timestamp_us: event.timestamp_us,
        adapter_id: &event.adapter_id,
    });
}

/// Applies one `CacheStateUpdate` (K3–K14); the reserved tenant is skipped silently.
pub fn ingest(index: &Index, update: &pb::CacheStateUpdate) {
    if update.tenant_id == PROBE_TENANT {
        return;
    }
    index.ingest(CacheStateUpdate {
        replica_id: &update.replica_id,
        model_id: &update.model_id,
        tenant_id: &update.tenant_id,
        hash_scheme: &update.hash_scheme,
        timestamp_us: update.timestamp_us,
        adapter_id: &update.adapter_id,
        prefixes: update.prefixes.iter().map(|p| PrefixRef {
            prefix_hash: &p.prefix_hash,
            token_count: p.token_count,
            block_hashes: p.block_hashes.as_slice(),
            block_token_counts: &p.block_token_counts,
            tier: p.tier,
            adapter_id: &p.adapter_id,
        }),
        stats: update.stats.as_ref().map(|s| ReplicaStatsInput {
            cache_memory_bytes: s.cache_memory_bytes,
            hit_rate: s.hit_rate,
            pressure: s.pressure,
            t2_hit_tokens: s.t2_hit_tokens,
            t2_query_tokens: s.t2_query_tokens,
        }),
    });
}

/// tonic refuses a message over the decoding limit with `OUT_OF_RANGE`; the contract (§5, like
/// grpc-go and the reference) says `RESOURCE_EXHAUSTED`. No handler produces `OUT_OF_RANGE`, so
/// every such status is a size refusal (also on a producer stream, whose error ends the call
/// before any response byte, i.e. in a trailers-only response).
fn size_refusal_is_resource_exhausted<B>(
    mut response: tonic::codegen::http::Response<B>,
) -> tonic::codegen::http::Response<B> {
    const OUT_OF_RANGE: &str = "11";
    const RESOURCE_EXHAUSTED: &str = "8";
    let headers = response.headers_mut();
    if headers
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == OUT_OF_RANGE.as_bytes())
    {
        headers.insert(
            "grpc-status",
            tonic::codegen::http::HeaderValue::from_static(RESOURCE_EXHAUSTED),
        );
    }
    response
}

async fn set_health(reporter: &tonic_health::server::HealthReporter, serving: bool) {
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    reporter.set_service_status("", status).await;
    reporter
        .set_service_status(
            <InferenceCacheServer<CacheService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
}

/// HTTP/2 flow control of the gRPC listener: the windows that make backpressure hold a
/// producer back without ever tripping h2's DATA-frame budget.
///
/// h2 (≥ 0.4.13) charges every buffered non-final DATA frame smaller than 256 bytes
/// `256 − payload` against a per-connection budget of half the connection window, and closes
/// the connection with GOAWAY `ENHANCE_YOUR_CALM` "too_many_data_frames" when it is spent. The
/// budget comes back only as the application reads the frames. A producer over its rate (or
/// faster than ingest) is held back precisely by the server *not* reading, so with hyper's
/// defaults (1 MiB stream and connection windows, budget 512 KiB) a stream of ~40-byte
/// messages, one DATA frame each, filled the budget after ~2,400 frames and lost its
/// connection and every message in flight.
///
/// So the windows are sized together: what a connection can have buffered is at most
/// `MAX_CONCURRENT_STREAMS × STREAM_WINDOW` bytes (6.25 MiB), and the connection window is
/// chosen so that its half covers the overhead of all of that in frames of
/// `MIN_FRAME_PAYLOAD` bytes. A client whose DATA frames carry at least 32 bytes (a message of
/// 27 bytes plus the 5-byte gRPC prefix) therefore never meets the budget, however long the
/// server holds it back; only a peer splitting data into tinier frames on many streams can,
/// which is the flood the budget exists for.
pub mod flow {
    /// Per-stream receive window (the HTTP/2 default, 64 KiB).
    pub const STREAM_WINDOW: u32 = 65_536;
    /// Concurrent streams per connection (the RFC 9113 recommended minimum).
    pub const MAX_CONCURRENT_STREAMS: u32 = 100;
    /// The smallest DATA frame payload that can never exhaust the budget.
    pub const MIN_FRAME_PAYLOAD: u32 = 32;
    /// h2's small-frame threshold (`DEFAULT_DATA_FRAME_OVERHEAD_THRESHOLD`).
    pub const SMALL_FRAME_BYTES: u32 = 256;
    /// Twice the worst overhead of a full connection of minimal frames.
    pub const CONNECTION_WINDOW: u32 =
        2 * MAX_CONCURRENT_STREAMS * STREAM_WINDOW * (SMALL_FRAME_BYTES - MIN_FRAME_PAYLOAD)
            / MIN_FRAME_PAYLOAD;
}

/// Serves gRPC (the service, `grpc.health.v1.Health`, reflection v1 and v1alpha) until `stop`.
pub async fn serve_grpc(
    state: AppState,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    // Service "" and ours by name report SERVING while the state is ready (server.md §5): from
    // construction, except while a warm restart loads its checkpoint.
    let mut readiness = state.readiness();
    let follow = health_reporter.clone();
    let initially = state.ready() || !state.restoring();
    set_health(&follow, initially).await;
    tokio::spawn(async move {
        while readiness.changed().await.is_ok() {
            let ready = *readiness.borrow_and_update();
            set_health(&follow, ready).await;
        }
    });
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(inferencecache_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(inferencecache_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let service = InferenceCacheServer::new(CacheService::new(state.clone()))
        .max_decoding_message_size(state.limits().message_bytes());
    let router = tonic::transport::Server::builder()
        .initial_stream_window_size(flow::STREAM_WINDOW)
        .initial_connection_window_size(flow::CONNECTION_WINDOW)
        .max_concurrent_streams(flow::MAX_CONCURRENT_STREAMS)
        .layer(tower::util::MapResponseLayer::new(
            size_refusal_is_resource_exhausted,
        ))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service);
    match state.tls().cloned() {
        Some(config) => {
            state.metrics().grpc_tls_enabled.store(1, Ordering::Relaxed);
            let incoming = crate::tls::incoming(listener, config, state.connections().clone());
            router.serve_with_incoming_shutdown(incoming, stop).await?;
        }
        None => {
            let incoming = crate::connections::incoming(listener, state.connections().clone());
            router.serve_with_incoming_shutdown(incoming, stop).await?;
        }
    }
    Ok(())
}
