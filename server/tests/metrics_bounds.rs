//! Bounded metrics (`docs/robustness.md`): a lookup never creates a series for an id the index
//! does not hold; per-model series exist only for held models, at most `--max-metric-models`
//! of them (the rest under `model="_other"`), and go away with the model.

mod common;

use common::{T0_US, TestServer, legacy_update};
use inferencecache_engine::{IndexConfig, ManualClock};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_server::metrics::render_text;
use inferencecache_server::state::{AppState, ServerOptions};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn state(max_metric_models: usize) -> (AppState, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(T0_US));
    let options = ServerOptions {
        index: IndexConfig {
            global_ttl_ms: 30_000,
            ..Default::default()
        },
        max_metric_models,
        ..Default::default()
    };
    (AppState::with_clock(options, clock.clone()), clock)
}

fn ingest(state: &AppState, tenant: &str, model: &str, key: &[u8]) {
    let mut update = legacy_update("r1", tenant, key, 16);
    update.model_id = model.into();
    inferencecache_server::translate::ingest(state.index(), &update);
}

/// The real LookupRoute handler, called in-process (no network: 100,000 calls stay quick).
async fn lookup(state: &AppState, tenant: &str, model: &str) -> String {
    let req = pb::LookupRouteRequest {
        tenant_id: tenant.into(),
        model_id: model.into(),
        hash_scheme: "vllm".into(),
        prefix_hash: b"k".to_vec(),
        prefix_token_count: 16,
        ..Default::default()
    };
    inferencecache_server::lookup::handle(state, &tonic::metadata::MetadataMap::new(), &req)
        .await
        .reason_code
}

fn scrape(state: &AppState) -> (String, Duration) {
    let started = Instant::now();
    let text = render_text(&state.metrics().gather(state.index()));
    (text, started.elapsed())
}

fn models_in(text: &str) -> Vec<String> {
    let mut models: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = &l[l.find("model=\"")? + 7..];
            Some(rest[..rest.find('"')?].to_string())
        })
        .collect();
    models.sort();
    models.dedup();
    models
}

/// `METRICS_BOUNDS_LOOKUPS` random-id lookups and `METRICS_BOUNDS_TENANTS` churned tenants. The
/// issue's figures are 100,000 each (measured on a release build, `bench/RESULTS.md`); CI runs
/// 10,000 and 2,000 on a debug build, where every call is far slower.
fn scale(var: &str, ci: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ci)
}

/// The render bar: 50 ms on an optimized build; a debug build gets 20× (HDR merges and string
/// formatting are unoptimized there).
const RENDER_BAR: Duration = if cfg!(debug_assertions) {
    Duration::from_secs(1)
} else {
    Duration::from_millis(50)
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_ids_and_churned_tenants_leave_metrics_small() {
    let (state, clock) = state(1_000);
    let server = TestServer::start_with(state.clone()).await;
    ingest(&state, "t", "m", b"k");
    // 100,000 lookups with random tenant and model ids: answered with their diagnostics, and
    // not one series for them.
    let lookups = scale("METRICS_BOUNDS_LOOKUPS", 10_000);
    let mut unknown = 0usize;
    for i in 0..lookups as u64 {
        let id = format!("{:016x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let reason = lookup(&state, &id, &id).await;
        unknown += usize::from(reason == "UNKNOWN_TENANT");
    }
    assert_eq!(unknown, lookups, "unknown ids keep their O1 diagnostic");
    // A held model is answered from the index (below the match floor: an affinity hint).
    assert_eq!(lookup(&state, "t", "m").await, "AFFINITY_HINT");
    // New tenants ingested while /metrics is scraped over HTTP, then expired by TTL and swept.
    let tenants = scale("METRICS_BOUNDS_TENANTS", 2_000);
    let writer = {
        let state = state.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            for i in 0..tenants {
                ingest(&state, &format!("tenant-{i}"), "m", b"k");
            }
            started.elapsed()
        })
    };
    let mut scrapes = Vec::new();
    while !writer.is_finished() {
        let started = Instant::now();
        let (status, _, body) = common::http_request(server.http, "GET", "/metrics", "").await;
        scrapes.push(started.elapsed());
        assert_eq!(status, 200);
        assert!(body.len() < 1 << 20);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ingest_took = writer.await.unwrap();
    scrapes.sort();
    let p99 = scrapes[(scrapes.len() * 99).div_ceil(100).saturating_sub(1)];
    assert!(
        p99 < Duration::from_secs(1),
        "/metrics p99 {p99:?} during ingest"
    );
    clock.advance_ms(31_000);
    state.index().sweep_now();
    assert_eq!(state.index().storage_entries(), 0);
    let (text, took) = scrape(&state);
    assert!(text.len() < 1 << 20, "/metrics is {} bytes", text.len());
    // Every entry of `m` expired, so the sweep reclaimed its records and its series went with
    // it: only `_other` is left.
    assert_eq!(models_in(&text), ["_other"], "{text}");
    assert!(text.contains(&format!(
        "inferencecache_lookup_route_calls_total{{model=\"_other\",reason_code=\"UNKNOWN_TENANT\",hint_used=\"false\"}} {lookups}\n"
    )), "{text}");
    assert!(
        !text.contains("inferencecache_index_entries{model=\"m\"}"),
        "the reclaimed model has no entries series: {text}"
    );
    assert!(took < RENDER_BAR, "gathered and rendered in {took:?}");
    eprintln!(
        "metrics_bounds: {lookups} random-id lookups, {tenants} tenants ingested in {ingest_took:?}; {} scrapes during it, \
         p99 {p99:?}, max {:?}; after churn /metrics {} bytes, {} lines, rendered in {took:?}",
        scrapes.len(),
        scrapes.last().unwrap(),
        text.len(),
        text.lines().count()
    );
    server.shutdown().await;
}

#[tokio::test]
async fn per_model_series_are_capped_and_the_rest_is_other() {
    let (state, _) = state(3);
    for m in ["m1", "m2", "m3", "m4", "m5"] {
        ingest(&state, "t", m, b"k");
    }
    for m in ["m5", "m4", "m3", "m2", "m1", "nope"] {
        lookup(&state, "t", m).await;
    }
    let (text, _) = scrape(&state);
    // The first three held models looked up have series; m2, m1 and the unknown id count
    // under `_other`, and so do the entries of m1 and m2.
    assert_eq!(models_in(&text), ["_other", "m3", "m4", "m5"], "{text}");
    assert!(
        text.contains("inferencecache_lookup_route_latency_seconds_count{model=\"_other\"} 3\n")
    );
    assert!(
        text.contains("inferencecache_index_entries{model=\"_other\"} 2\n"),
        "{text}"
    );
    assert!(text.contains("inferencecache_index_entries{model=\"m5\"} 1\n"));
}
