//! Identity churn through a running server (issue 28): new tenants per second over gRPC,
//! `/metrics` latency while they arrive, and `/metrics` size and render time after random-id
//! lookups and churned (expired) tenants.
//!
//! ```text
//! identity-grpc --target http://127.0.0.1:9090 --http 127.0.0.1:8080 [--tenants N]
//!     [--streams S] [--lookups N] [--wait-expiry SECS]
//! ```
//!
//! 1. **Ingest**: `--tenants` `CacheStateUpdate`s, each naming a tenant the server has not
//!    seen (one 8-byte key), over `--streams` concurrent `ReportCacheState` streams (one
//!    connection each); the rate counts from the first message to the last stream's `Ack`
//!    (every Ack must say `accepted`). Meanwhile one client scrapes `/metrics` back to back
//!    (HTTP/1.1, a new connection per scrape) and the latency of each scrape is recorded.
//! 2. **Lookups**: `--lookups` `LookupRoute` calls with random tenant and model ids (32 in
//!    flight); each must answer `UNKNOWN_TENANT`.
//! 3. **After the churn**: waits `--wait-expiry` seconds (start the server with a TTL and sweep
//!    interval shorter than that, so the tenants' entries expire and their records are
//!    reclaimed), then scrapes `/metrics` 20 times: size, lines and time of each.
//!
//! Loopback only; every phase is bounded by its count.

use clap::Parser;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, LookupRouteRequest, PrefixEntry};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Channel, Endpoint};

#[derive(Parser, Clone)]
#[command(about = "New identities per second through gRPC, and /metrics under that churn")]
struct Args {
    /// gRPC address of the server (http://host:port).
    #[arg(long)]
    target: String,
    /// HTTP listener of the server (host:port), for /metrics.
    #[arg(long)]
    http: String,
    /// New tenants to ingest (one update each).
    #[arg(long, default_value_t = 100_000)]
    tenants: usize,
    /// Concurrent ReportCacheState streams (one connection each).
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// LookupRoute calls with random ids after the ingest.
    #[arg(long, default_value_t = 100_000)]
    lookups: usize,
    /// Seconds to wait after the lookups for the tenants to expire and be reclaimed.
    #[arg(long, default_value_t = 0)]
    wait_expiry: u64,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn connect(target: &str) -> Result<Channel, Error> {
    Ok(Endpoint::from_shared(target.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect()
        .await?)
}

/// One GET /metrics over a fresh HTTP/1.1 connection: (status line, body bytes, elapsed).
async fn scrape(http: &str) -> Result<(String, Vec<u8>, Duration), Error> {
    let t = Instant::now();
    let mut s = tokio::net::TcpStream::connect(http).await?;
    s.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let elapsed = t.elapsed();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head.lines().next().unwrap_or("").to_string();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Err("chunked /metrics body: not decoded by this client".into());
    }
    Ok((status, raw[split + 4..].to_vec(), elapsed))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Phase 1: one stream's share of the new tenants (`first..end`).
async fn ingest_stream(target: String, first: usize, end: usize) -> Result<(), Error> {
    let mut client = InferenceCacheClient::new(connect(&target).await?);
    let updates = (first..end).map(|j| CacheStateUpdate {
        replica_id: "r0".into(),
        model_id: "m".into(),
        tenant_id: format!("tenant-{j:08x}-churn"),
        hash_scheme: "vllm".into(),
        timestamp_us: 0,
        prefixes: vec![PrefixEntry {
            prefix_hash: (j as u64).to_be_bytes().to_vec(),
            token_count: 16,
            ..Default::default()
        }],
        stats: None,
        adapter_id: String::new(),
    });
    let ack = client
        .report_cache_state(tokio_stream::iter(updates))
        .await?
        .into_inner();
    if !ack.accepted {
        return Err(format!("Ack not accepted: {}", ack.reason_code).into());
    }
    Ok(())
}

async fn run(args: Args) -> Result<bool, Error> {
    let mut ok = true;
    // Phase 1: ingest, with /metrics scraped throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let scraper = {
        let (stop, http) = (stop.clone(), args.http.clone());
        tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut failures = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match scrape(&http).await {
                    Ok((status, _, t)) if status.contains(" 200") => lat.push(t),
                    _ => failures += 1,
                }
            }
            (lat, failures)
        })
    };
    let t0 = Instant::now();
    let per = args.tenants.div_ceil(args.streams.max(1));
    let mut streams = Vec::new();
    for s in 0..args.streams.max(1) {
        let (first, end) = (
            (s * per).min(args.tenants),
            ((s + 1) * per).min(args.tenants),
        );
        streams.push(tokio::spawn(ingest_stream(args.target.clone(), first, end)));
    }
    for s in streams {
        s.await??;
    }
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let (mut lat, failures) = scraper.await?;
    lat.sort_unstable();
    println!(
        "ingest: {} new tenants over {} streams in {:.2} s: {:.0} /s (all acks accepted)",
        args.tenants,
        args.streams,
        took.as_secs_f64(),
        args.tenants as f64 / took.as_secs_f64()
    );
    println!(
        "metrics during ingest: {} scrapes, {} failed, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        lat.len(),
        failures,
        percentile(&lat, 0.50).as_secs_f64() * 1e3,
        percentile(&lat, 0.99).as_secs_f64() * 1e3,
        lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );
    if failures > 0 || percentile(&lat, 0.99) >= Duration::from_secs(1) {
        ok = false;
    }

    // Phase 2: random-id lookups.
    let channel = connect(&args.target).await?;
    let t1 = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..32u64 {
        let (mut client, next, n) = (
            InferenceCacheClient::new(channel.clone()),
            next.clone(),
            args.lookups,
        );
        workers.push(tokio::spawn(async move {
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (w << 32);
            let mut wrong = 0u64;
            while next.fetch_add(1, Ordering::Relaxed) < n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let r = client
                    .lookup_route(LookupRouteRequest {
                        model_id: format!("model-{:016x}", x.rotate_left(17)),
                        tenant_id: format!("tenant-{x:016x}"),
                        hash_scheme: "vllm".into(),
                        prefix_hash: x.to_be_bytes().to_vec(),
                        prefix_token_count: 16,
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                if r.reason_code != "UNKNOWN_TENANT" {
                    wrong += 1;
                }
            }
            Ok::<u64, Error>(wrong)
        }));
    }
    let mut wrong = 0;
    for w in workers {
        wrong += w.await??;
    }
    println!(
        "lookups: {} with random ids in {:.2} s, {} answered other than UNKNOWN_TENANT",
        args.lookups,
        t1.elapsed().as_secs_f64(),
        wrong
    );
    if wrong > 0 {
        ok = false;
    }

    // Phase 3: after the churn.
    if args.wait_expiry > 0 {
        tokio::time::sleep(Duration::from_secs(args.wait_expiry)).await;
    }
    let mut times = Vec::new();
    let mut size = 0;
    let mut lines = 0;
    for _ in 0..20 {
        let (status, body, t) = scrape(&args.http).await?;
        if !status.contains(" 200") {
            return Err(format!("/metrics answered {status}").into());
        }
        size = body.len();
        lines = body.iter().filter(|&&b| b == b'\n').count();
        times.push(t);
    }
    times.sort_unstable();
    println!(
        "metrics after the churn: {size} bytes, {lines} lines; 20 scrapes: median {:.2} ms, max {:.2} ms",
        percentile(&times, 0.5).as_secs_f64() * 1e3,
        times.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );
    if size >= 1_000_000 || percentile(&times, 0.5) >= Duration::from_millis(50) {
        ok = false;
    }
    Ok(ok)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("identity-grpc: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            println!("FAIL: a bar was missed (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("identity-grpc: {e}");
            ExitCode::FAILURE
        }
    }
}
