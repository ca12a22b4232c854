//! The gRPC service: translates `inferencecache.v1alpha1.InferenceCache` calls into engine calls.
//!
//! Consumer RPCs never turn request content into an error (contract §5): every outcome is an OK
//! response with a reason code.

use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

/// Largest request message accepted (contract §5: larger → RESOURCE_EXHAUSTED).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

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

/// State shared by every listener.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Shared>,
}

struct Shared {
    ready: AtomicBool,
}

impl AppState {
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Shared {
                ready: AtomicBool::new(true),
            }),
        }
    }

    /// Whether the index is started (drives `/readyz`).
    pub fn ready(&self) -> bool {
        self.inner.ready.load(Ordering::Acquire)
    }

    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Release);
    }
}

impl Default for AppState {
    fn default() -> Self {
        Self::new()
    }
}

/// The `InferenceCache` service implementation.
#[derive(Clone)]
pub struct CacheService {
    #[allow(dead_code)]
    state: AppState,
}

impl CacheService {
    pub fn new(state: AppState) -> Self {
        Self { state }
    }
}

fn elapsed_us(start: Instant) -> i64 {
    i64::try_from(start.elapsed().as_micros()).unwrap_or(i64::MAX)
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

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
        _request: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        let start = Instant::now();
        // No index is attached yet: the fail-open answer is always valid (contract §4.1).
        Ok(Response::new(pb::LookupRouteResponse {
            reason_code: reason::NO_HINT.into(),
            lookup_latency_us: elapsed_us(start),
            ..Default::default()
        }))
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
        _request: Request<pb::GetCacheStateRequest>,
    ) -> Result<Response<pb::GetCacheStateResponse>, Status> {
        Ok(Response::new(pb::GetCacheStateResponse {
            replicas: Vec::new(),
            summary: Some(pb::CacheSummary::default()),
        }))
    }

    async fn report_cache_state(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        let mut stream = request.into_inner();
        while stream.message().await?.is_some() {}
        Ok(Response::new(pb::Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }

    async fn publish_event(
        &self,
        _request: Request<pb::CacheEvent>,
    ) -> Result<Response<pb::Ack>, Status> {
        Ok(Response::new(pb::Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }

    type StreamCacheEventsStream = BoxStream<pb::CacheEvent>;

    async fn stream_cache_events(
        &self,
        _request: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Ok(Response::new(Box::pin(tokio_stream::pending())))
    }

    type StreamMetricsStream = BoxStream<pb::Metric>;

    async fn stream_metrics(
        &self,
        _request: Request<pb::StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Ok(Response::new(Box::pin(tokio_stream::pending())))
    }
}

/// Serves gRPC (the service, `grpc.health.v1.Health`, reflection v1 and v1alpha) until `stop`.
pub async fn serve_grpc(
    state: AppState,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    // Service "" reports SERVING from construction (server.md §5); so does ours by name.
    health_reporter
        .set_serving::<InferenceCacheServer<CacheService>>()
        .await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(inferencecache_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(inferencecache_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let service = InferenceCacheServer::new(CacheService::new(state))
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            stop,
        )
        .await?;
    Ok(())
}
