//! Deadlines around an index that may block (H2, H7, SV27, SV28, SV30, SV45), using a double
//! installed through `AppState::with_route_index`.

mod common;

use common::{T0_US, TestServer, lookup};
use inferencecache_engine::{Index, ManualClock, RouteResult};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_server::policy::decode_push;
use inferencecache_server::route_index::{RouteIndex, RouteQuery};
use inferencecache_server::state::{AppState, ServerOptions};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Answers from the real index after a delay (or never), from its own thread, so a caller with
/// a deadline abandons it the way H7 asks of a blocking index.
struct SlowIndex {
    delay: Option<Duration>,
    real: Arc<Index>,
    calls: AtomicUsize,
}

impl RouteIndex for SlowIndex {
    fn route(&self, query: RouteQuery<'_, '_>, deadline: Option<Instant>) -> Option<RouteResult> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        // The answer is taken now and delivered late; an abandoned answer is dropped unread, so
        // its captured hits are never credited.
        let result = query.route_on(&self.real);
        let delay = self.delay;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            match delay {
                Some(d) => std::thread::sleep(d),
                None => loop {
                    std::thread::sleep(Duration::from_secs(3600));
                },
            }
            let _ = tx.send(result);
        });
        match deadline {
            Some(d) => rx
                .recv_timeout(d.saturating_duration_since(Instant::now()))
                .ok(),
            None => rx.recv().ok(),
        }
    }
}

/// A server whose LookupRoute goes through a [`SlowIndex`] with `delay`; returns the double too.
async fn start(delay: Option<Duration>) -> (TestServer, Arc<SlowIndex>) {
    let mut double = None;
    let clock = Arc::new(ManualClock::new(T0_US));
    let state = AppState::with_route_index(ServerOptions::default(), clock, |real| {
        let slow = Arc::new(SlowIndex {
            delay,
            real,
            calls: AtomicUsize::new(0),
        });
        double = Some(slow.clone());
        slow
    });
    let double = double.expect("route index built");
    (TestServer::start_with(state).await, double)
}

/// A legacy prefix on replica `r1` of tenant `t`.
fn legacy(hash: &[u8], tokens: i32) -> pb::CacheStateUpdate {
    common::legacy_update("r1", "t", hash, tokens)
}

/// An exact lookup of tenant `t`.
fn exact(hash: &[u8], tokens: i32) -> pb::LookupRouteRequest {
    common::exact_lookup("t", hash, tokens)
}

#[tokio::test]
async fn sv27_budget_exceeded_is_timeout_and_never_credited() {
    let (server, _double) = start(Some(Duration::from_millis(50))).await;
    server.state.policies().replace_pushed(
        decode_push(
            br#"{"version":7,"policies":[{"namespace":"t","lookupTimeoutMs":5,"eviction":"lfu"}]}"#,
        )
        .unwrap(),
    );
    let mut c = server.client().await;
    c.report_cache_state(tokio_stream::iter(vec![legacy(b"p", 128)]))
        .await
        .unwrap();
    let r = lookup(&mut c, exact(b"p", 128)).await;
    assert_eq!(r.reason_code, "TIMEOUT");
    assert!(r.replica_scores.is_empty());
    assert_eq!(r.adapter_id, "");
    // Give the abandoned call time to finish: its hits must still not be credited.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let entry = server
        .state
        .index()
        .entry("t", "m", "vllm", "", b"p", "r1")
        .expect("entry exists");
    assert_eq!(entry.access_count, 0);
    server.shutdown().await;
}

#[tokio::test]
async fn sv28_blocking_index_times_out_at_the_budget() {
    let (server, _double) = start(None).await;
    server.state.policies().replace_pushed(
        decode_push(br#"{"version":7,"policies":[{"namespace":"t","lookupTimeoutMs":20}]}"#)
            .unwrap(),
    );
    let mut c = server.client().await;
    let started = Instant::now();
    let r = lookup(&mut c, exact(b"p", 0)).await;
    assert_eq!(r.reason_code, "TIMEOUT");
    assert!(started.elapsed() < Duration::from_secs(1));
    server.shutdown().await;
}

#[tokio::test]
async fn sv30_gate_skips_the_index_call() {
    let (server, double) = start(Some(Duration::from_millis(1))).await;
    server.state.policies().replace_pushed(
        decode_push(br#"{"version":7,"policies":[{"namespace":"t","minimumPrefixTokens":200,"affinityRouting":false}]}"#)
            .unwrap(),
    );
    let mut c = server.client().await;
    let r = lookup(&mut c, exact(b"p", 10)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    assert_eq!(double.calls.load(Ordering::SeqCst), 0, "index not called");
    // SV39 too: requireChain refuses before the index.
    server.state.policies().replace_pushed(
        decode_push(
            br#"{"version":7,"policies":[{"namespace":"t","strategy":{"requireChain":true}}]}"#,
        )
        .unwrap(),
    );
    let r = lookup(&mut c, exact(b"p", 10)).await;
    assert_eq!(r.reason_code, "POLICY_REQUIRES_CHAIN");
    assert_eq!(double.calls.load(Ordering::SeqCst), 0, "index not called");
    server.shutdown().await;
}

#[tokio::test]
async fn sv45_latency_is_measured_by_the_server() {
    let (server, _double) = start(Some(Duration::from_millis(50))).await;
    let mut c = server.client().await;
    c.report_cache_state(tokio_stream::iter(vec![legacy(b"p", 128)]))
        .await
        .unwrap();
    let r = lookup(&mut c, exact(b"p", 128)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert!(r.lookup_latency_us >= 50_000, "{}", r.lookup_latency_us);
    let probe = lookup(
        &mut c,
        pb::LookupRouteRequest {
            tenant_id: "inferencecache.io/probe".into(),
            ..exact(b"p", 0)
        },
    )
    .await;
    assert_eq!(probe.reason_code, "NO_HINT");
    assert!(probe.lookup_latency_us >= 0);
    let (_, _, metrics) = common::http_request(server.http, "GET", "/metrics", "").await;
    // The 50 ms call lands in the 0.05 bucket's neighbourhood: at most 0.1 s, more than 0.025 s.
    assert!(
        metrics.contains(
            r#"inferencecache_lookup_route_latency_seconds_bucket{model="m",le="0.025"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"inferencecache_lookup_route_latency_seconds_bucket{model="m",le="0.1"} 2"#
        )
    );
    assert!(metrics.contains("inferencecache_index_lookup_latency_seconds_count 1"));
    server.shutdown().await;
}
