//! `ic-loadgen` end to end against an in-process server: ~2 s of load at reduced rates, then
//! checks zero consumer errors, a non-zero realized hit rate and a valid JSON report + SVG.

use std::time::Duration;

use clap::Parser;
use inferencecache_bench::loadgen::{self, Args};
use inferencecache_server::state::{AppState, ServerOptions};
use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadgen_against_in_process_server() {
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(inferencecache_server::serve(
        AppState::new(ServerOptions::default()),
        grpc,
        http,
        async move {
            let _ = stop_rx.await;
        },
    ));

    let out = std::env::temp_dir().join(format!("ic-loadgen-test-{}", std::process::id()));
    let json = out.join("report.json");
    let target = format!("http://{addr}");
    let args = Args::parse_from([
        "ic-loadgen",
        "--target",
        &target,
        "--duration",
        "2s",
        "--warmup",
        "500ms",
        "--lookup-rate",
        "400",
        "--ingest-blocks-per-sec",
        "40000",
        "--events-per-sec",
        "200",
        "--clear-interval",
        "1s",
        "--replicas",
        "4",
        "--conversations",
        "200",
        "--system-prompt-tokens",
        "512",
        "--max-turns",
        "4",
        "--quiet",
    ]);
    let report = loadgen::run(&args, false).await.expect("loadgen run");
    let svg = report.write(&json).expect("write report");

    println!("{}", report.summary());
    assert_eq!(
        report.consumer_error_count(),
        0,
        "consumer errors: {:?}",
        report.consumer_errors
    );
    assert!(
        report.producer_errors.is_empty(),
        "producer errors: {:?}",
        report.producer_errors
    );
    let l = &report.lookups;
    assert!(l.ok > 300, "too few lookups: {}", l.ok);
    assert!(l.hit.lookups_with_prefix > 0);
    assert!(
        l.hit.realized_hit_rate > 0.5,
        "realized hit rate {}",
        l.hit.realized_hit_rate
    );
    assert!(l.reason_codes.get("PREFIX_MATCH").copied().unwrap_or(0) > 0);
    assert!(report.ingest.blocks_total > 0);
    assert!(report.events.prefix_evicted_total > 0);
    assert!(report.events.all_cleared_total > 0);

    // The JSON is valid and carries the headline fields.
    let text = std::fs::read_to_string(&json).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON report");
    assert!(v["lookups"]["latency_us"]["p99"].as_f64().unwrap() > 0.0);
    assert!(v["lookups"]["hit"]["realized_hit_rate"].as_f64().unwrap() > 0.0);
    assert_eq!(v["lookups"]["errors"].as_u64(), Some(0));
    assert!(!v["timeline"].as_array().unwrap().is_empty());
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.contains("<svg") && plot.contains("p99"));

    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("server stops")
        .unwrap()
        .unwrap();
    let _ = std::fs::remove_dir_all(&out);
}
