//! Serving gRPC: the service, `grpc.health.v1.Health` following the readiness, reflection
//! (v1 and v1alpha), the flow-control windows of [`super::flow`] and the size-refusal status
//! mapping, over plaintext or TLS connections admitted by the connection gate.

use super::flow;
use super::service::CacheService;
use crate::state::AppState;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCacheServer;
use std::sync::atomic::Ordering;
use tokio::net::TcpListener;

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

/// Serves gRPC (the service, `grpc.health.v1.Health`, reflection v1 and v1alpha) until `stop`.
pub async fn serve_grpc(
    state: AppState,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    // Service "" and ours by name report SERVING while the state is ready (server.md §5): from
    // construction, except while a warm restart loads its checkpoint.
    let mut readiness = state.core().readiness();
    let follow = health_reporter.clone();
    let initially = state.core().ready() || !state.core().restoring();
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
