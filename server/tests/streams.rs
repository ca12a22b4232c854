//! Observer streams over real gRPC (server.md §8.5–§8.6, D5; SV11 stream ending, T85 via the wire).

mod common;

use common::{TestServer, manual_state};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_server::state::ServerOptions;
use std::time::Duration;
use tokio::time::timeout;

fn update(tenant: &str, replica: &str, hash: &[u8], stats: bool) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: "m".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            prefix_hash: hash.to_vec(),
            token_count: 16,
            ..Default::default()
        }],
        stats: stats.then(|| pb::ReplicaStats {
            hit_rate: 0.5,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn next(stream: &mut tonic::Streaming<pb::CacheEvent>) -> pb::CacheEvent {
    timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("event in time")
        .expect("stream ok")
        .expect("open")
}

#[tokio::test]
async fn change_events_are_streamed_in_order_and_filtered() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let mut all = c
        .stream_cache_events(pb::StreamEventsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let mut only_evictions = c
        .stream_cache_events(pb::StreamEventsRequest {
            types: vec![pb::cache_event::Type::PrefixEvicted as i32],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut nothing = c
        .stream_cache_events(pb::StreamEventsRequest {
            types: vec![0, 9],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // Subscriptions are registered when the call returns; changes after it are delivered.
    let updates = vec![
        update("inferencecache.io/probe", "r", b"probe", false),
        update("t", "r1", b"p", true),
        update("t", "r1", b"p", false),
    ];
    c.report_cache_state(tokio_stream::iter(updates))
        .await
        .unwrap();
    let e = next(&mut all).await;
    assert_eq!(
        (e.r#type, e.replica_id.as_str(), e.prefix_hash.as_slice()),
        (1, "r1", &b"p"[..])
    );
    assert_ne!(e.timestamp_us, 0, "timestamps are resolved");
    let e = next(&mut all).await;
    assert_eq!(e.r#type, 3, "stats → REPLICA_UPDATED");
    c.publish_event(pb::CacheEvent {
        r#type: 2,
        replica_id: "r1".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        prefix_hash: b"p".to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    let e = next(&mut all).await;
    assert_eq!(
        (e.r#type, e.prefix_hash.as_slice()),
        (2, &b"p"[..]),
        "the re-ingest produced nothing"
    );
    let e = next(&mut only_evictions).await;
    assert_eq!(e.r#type, 2);
    c.publish_event(pb::CacheEvent {
        r#type: 4,
        replica_id: "r1".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let e = next(&mut all).await;
    assert_eq!((e.r#type, e.prefix_hash.len()), (4, 0));
    assert!(
        timeout(Duration::from_millis(200), nothing.message())
            .await
            .is_err(),
        "filter of unknown types matches nothing"
    );
    drop((all, only_evictions, nothing));
    server.shutdown().await;
}

#[tokio::test]
async fn slow_subscriber_drops_are_counted_and_limit_is_enforced() {
    let (state, _clock) = manual_state(ServerOptions {
        stream_buffer_events: 2,
        stream_max_subscribers: 2,
        ..Default::default()
    });
    let server = TestServer::start_with(state).await;
    let mut c = server.client().await;
    let stalled = c
        .stream_cache_events(pb::StreamEventsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let metrics = c
        .stream_metrics(pb::StreamMetricsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let err = c
        .stream_cache_events(pb::StreamEventsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    let updates: Vec<_> = (0..50)
        .map(|i| update("t", "r", format!("k{i}").as_bytes(), false))
        .collect();
    c.report_cache_state(tokio_stream::iter(updates))
        .await
        .unwrap();
    let dropped = server
        .state
        .metrics()
        .stream_events_dropped
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        dropped >= 40,
        "a stalled subscriber loses events, counted: {dropped}"
    );
    assert_eq!(
        server.state.index().storage_entries(),
        50,
        "ingest is unaffected"
    );
    drop(stalled);
    drop(metrics);
    // Slots are released when streams end.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let again = c
        .stream_cache_events(pb::StreamEventsRequest::default())
        .await;
    assert!(again.is_ok());
    drop(again);
    server.shutdown().await;
}

#[tokio::test]
async fn metrics_stream_sends_a_first_sample_at_once() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let mut stream = c
        .stream_metrics(pb::StreamMetricsRequest {
            names: vec![
                "inferencecache_server_up".into(),
                "inferencecache_events_total".into(),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    let first = timeout(Duration::from_millis(800), stream.message())
        .await
        .expect("immediate")
        .unwrap()
        .unwrap();
    assert_eq!(first.name, "inferencecache_server_up");
    assert_eq!((first.r#type.as_str(), first.value), ("gauge", 1.0));
    assert!(first.timestamp_us > 0);
    server.shutdown().await;
}

/// Reads one whole sample of a metrics stream: every message up to the first one carrying a
/// later timestamp (the start of the next sample, about a second later).
async fn one_sample(stream: &mut tonic::Streaming<pb::Metric>) -> Vec<pb::Metric> {
    let mut sample: Vec<pb::Metric> = Vec::new();
    loop {
        let metric = timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("sample in time")
            .expect("stream ok")
            .expect("open");
        if sample
            .first()
            .is_some_and(|first| first.timestamp_us != metric.timestamp_us)
        {
            return sample;
        }
        sample.push(metric);
    }
}

/// §8.6: without names, every `inferencecache_*` family and no process metrics; `process_*`
/// families only when named.
#[tokio::test]
async fn metrics_stream_without_names_sends_process_families_only_when_named() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    // One lookup, so that the LookupRoute latency histogram has a series with buckets.
    c.lookup_route(pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: "t".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut all = c
        .stream_metrics(pb::StreamMetricsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let sample = one_sample(&mut all).await;
    let foreign: Vec<&str> = sample
        .iter()
        .map(|m| m.name.as_str())
        .filter(|name| !name.starts_with("inferencecache_"))
        .collect();
    assert!(foreign.is_empty(), "unnamed families streamed: {foreign:?}");
    assert!(
        sample
            .iter()
            .any(|m| m.name == "inferencecache_server_up" && m.r#type == "gauge" && m.value == 1.0)
    );
    assert!(
        sample
            .iter()
            .any(|m| m.name.ends_with("_bucket") && m.labels.contains_key("le"))
    );
    drop(all);

    let mut named = c
        .stream_metrics(pb::StreamMetricsRequest {
            names: vec![
                "process_resident_memory_bytes".into(),
                "inferencecache_server_up".into(),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    let mut names: Vec<String> = one_sample(&mut named)
        .await
        .into_iter()
        .map(|m| m.name)
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["inferencecache_server_up", "process_resident_memory_bytes"]
    );
    server.shutdown().await;
}

#[tokio::test]
async fn shutdown_ends_open_streams_with_ok() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let mut events = c
        .stream_cache_events(pb::StreamEventsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let waiter =
        tokio::spawn(async move { timeout(Duration::from_secs(5), events.message()).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    timeout(Duration::from_secs(5), server.shutdown())
        .await
        .expect("graceful shutdown does not hang on streams");
    let ended = waiter.await.unwrap().expect("stream ended in time");
    assert!(matches!(ended, Ok(None)), "stream ends with OK: {ended:?}");
}
