//! The server starts with embedded defaults: health SERVING, reflection, fail-open LookupRoute
//! and the public HTTP routes (server.md §4, §5, §12.1; SV01, SV12, SV19).

mod common;

use common::{TestServer, http_request};
use inferencecache_proto::v1alpha1 as pb;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

#[tokio::test]
async fn health_reports_serving_for_the_default_service() {
    let server = TestServer::start().await;
    let mut health = HealthClient::new(server.channel().await);
    let reply = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(reply.into_inner().status(), ServingStatus::Serving);
    let reply = health
        .check(HealthCheckRequest {
            service: inferencecache_proto::SERVICE_NAME.into(),
        })
        .await
        .unwrap();
    assert_eq!(reply.into_inner().status(), ServingStatus::Serving);
    let err = health
        .check(HealthCheckRequest {
            service: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    server.shutdown().await;
}

#[tokio::test]
async fn sv19_empty_index_lookup_is_no_hint() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let reply = client
        .lookup_route(pb::LookupRouteRequest {
            model_id: "m".into(),
            ..Default::default()
        })
        .await
        .expect("LookupRoute never fails")
        .into_inner();
    assert_eq!(reply.reason_code, "NO_HINT");
    assert!(reply.replica_scores.is_empty());
    assert!(reply.lookup_latency_us >= 0);
    server.shutdown().await;
}

#[tokio::test]
async fn stubs_answer_fail_open() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let render = client
        .render_template(pb::RenderTemplateRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(render.reason_code, "OK");
    assert!(render.rendered_prompt.is_empty() && render.stable_prefix_hash.is_empty());
    let pd = client
        .lookup_pd_route(pb::LookupPdRouteRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pd.reason_code, "NO_HINT");
    assert!(pd.prefill_replica_id.is_empty() && pd.decode_replica_id.is_empty());
    let state = client
        .get_cache_state(pb::GetCacheStateRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(state.summary.is_some(), "summary is always present");
    server.shutdown().await;
}

#[tokio::test]
async fn sv01_health_endpoints() {
    let server = TestServer::start().await;
    for path in ["/healthz", "/readyz"] {
        let (status, _, body) = http_request(server.http, "GET", path, "").await;
        assert_eq!((status, body.as_str()), (200, "ok\n"), "{path}");
    }
    let (status, _, _) = http_request(server.http, "GET", "/snapshot", "").await;
    assert_eq!(
        status, 404,
        "control-plane routes are not served on the public listener"
    );
    server.state.core().set_ready(false);
    let (status, _, body) = http_request(server.http, "GET", "/readyz", "").await;
    assert_eq!((status, body.as_str()), (503, "not ready\n"));
    server.shutdown().await;
}

#[tokio::test]
async fn sv12_reflection_lists_both_services() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let server = TestServer::start().await;
    let mut client = ServerReflectionClient::new(server.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let reply = responses
        .message()
        .await
        .unwrap()
        .expect("one reflection reply");
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("expected a service list, got {:?}", reply.message_response);
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.iter().any(|n| n == "grpc.health.v1.Health"),
        "{names:?}"
    );
    assert!(
        names
            .iter()
            .any(|n| n == "inferencecache.v1alpha1.InferenceCache"),
        "{names:?}"
    );
    server.shutdown().await;
}
