//! Fault injection and the memory limits, over real loopback gRPC (in process) or against the
//! real binary: producer streams cut mid-way, SIGTERM under load, wall-clock jumps, oversized
//! messages, 10,000 connections, clients exceeding each limit, and bad inputs of every class
//! (`docs/robustness.md` maps each class to its test here or elsewhere).

mod common;

use common::{SERVER_BIN, ServerProcess, T0_US, TestServer, lookup, manual_state, report};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_server::limits::{Exceeded, Limits};
use inferencecache_server::policy::decode_push;
use inferencecache_server::state::{AppState, ServerOptions};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

type Client = InferenceCacheClient<Channel>;

const MIB: usize = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Helpers

/// A legacy prefix of tenant `t`.
fn legacy(replica: &str, hash: &[u8], tokens: i32) -> pb::CacheStateUpdate {
    common::legacy_update(replica, "t", hash, tokens)
}

fn chain_entry(tag: u8, blocks: usize, hash_len: usize) -> pb::PrefixEntry {
    pb::PrefixEntry {
        block_hashes: (0..blocks)
            .map(|i| {
                let mut h = vec![tag; hash_len];
                h[..4].copy_from_slice(&(i as u32).to_be_bytes());
                h
            })
            .collect(),
        block_token_counts: vec![16; blocks],
        ..Default::default()
    }
}

fn update_of(prefixes: Vec<pb::PrefixEntry>) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: "r".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes,
        ..Default::default()
    }
}

/// An exact lookup of tenant `t`.
fn exact(hash: &[u8], tokens: i32) -> pb::LookupRouteRequest {
    common::exact_lookup("t", hash, tokens)
}

fn chain_req(entry: &pb::PrefixEntry) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: "t".into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        block_hashes: entry.block_hashes.clone(),
        block_token_counts: entry.block_token_counts.clone(),
        ..Default::default()
    }
}

/// Tenant `t` without floors or affinity, so a reason code says only what the index found.
fn plain_policy(state: &AppState) {
    state.policies().replace_pushed(
        decode_push(
            br#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":0,"minimumMatchedTokens":0,"affinityRouting":false}]}"#,
        )
        .expect("valid policy"),
    );
}

async fn server_with_limits(limits: Limits) -> TestServer {
    let (state, _clock) = manual_state(ServerOptions {
        limits,
        ..Default::default()
    });
    plain_policy(&state);
    TestServer::start_with(state).await
}

/// [`server_with_limits`] and a client of it: how most tests here begin.
async fn limited(limits: Limits) -> (TestServer, Client) {
    let server = server_with_limits(limits).await;
    let client = server.client().await;
    (server, client)
}

/// The reason code of an exact lookup of tenant `t`: the probe the tests use to show what the
/// index holds (or that the server still answers) after a fault.
async fn reason(c: &mut Client, hash: &[u8], tokens: i32) -> String {
    lookup(c, exact(hash, tokens)).await.reason_code
}

async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

/// The real binary, in a fresh directory named after the test.
fn start_binary(name: &str, extra: &[&str]) -> ServerProcess {
    ServerProcess::start(&common::temp_dir(&format!("faults-{name}")), extra)
}

/// Descriptors the child holds open (Linux `/proc`).
fn open_fds(server: &ServerProcess) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", server.pid()))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

// ---------------------------------------------------------------------------------------------
// Producer streams cut mid-way (contract §5, server.md §8.2, SV55)

/// A loopback TCP proxy in front of the server that forwards client bytes until told to cut,
/// then drops both sockets: the server sees the connection vanish in the middle of a stream.
struct Proxy {
    addr: std::net::SocketAddr,
    forwarded: Arc<AtomicU64>,
    /// Total client bytes to forward; the proxy cuts both sockets once it is reached.
    budget: Arc<AtomicU64>,
}

impl Proxy {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let forwarded = Arc::new(AtomicU64::new(0));
        let budget = Arc::new(AtomicU64::new(u64::MAX));
        let (fwd, limit) = (forwarded.clone(), budget.clone());
        tokio::spawn(async move {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let server = TcpStream::connect(upstream).await.unwrap();
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let up = async {
                let mut buf = vec![0u8; 16 * 1024];
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let done = fwd.load(Ordering::SeqCst);
                    let allowed = limit.load(Ordering::SeqCst).saturating_sub(done);
                    let take = n.min(usize::try_from(allowed).unwrap_or(usize::MAX));
                    if sw.write_all(&buf[..take]).await.is_err() {
                        return;
                    }
                    fwd.fetch_add(take as u64, Ordering::SeqCst);
                    if take < n {
                        return;
                    }
                }
            };
            let down = async {
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
            };
            // Either direction ending (or the cut) drops every socket half at once.
            tokio::select! {
                _ = up => {},
                _ = down => {},
            }
        });
        Self {
            addr,
            forwarded,
            budget,
        }
    }
}

#[tokio::test]
async fn producer_connection_cut_mid_message_keeps_what_was_received() {
    let server = server_with_limits(Limits::default()).await;
    let proxy = Proxy::start(server.grpc).await;
    let ch = Channel::from_shared(format!("http://{}", proxy.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut producer = Client::new(ch);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let call =
        tokio::spawn(async move { producer.report_cache_state(ReceiverStream::new(rx)).await });
    tx.send(legacy("r", b"first", 128)).await.unwrap();
    tx.send(legacy("r", b"second", 128)).await.unwrap();
    let index = server.state.index().clone();
    assert!(
        eventually(Duration::from_secs(5), || index.storage_entries() == 2).await,
        "both complete messages applied as they arrived"
    );
    // A third message of ~600 KiB, cut after 32 KiB of it crossed the proxy (less than one
    // HTTP/2 flow-control window): the server holds an incomplete message when the connection
    // vanishes.
    let before = proxy.forwarded.load(Ordering::SeqCst);
    proxy.budget.store(before + 32 * 1024, Ordering::SeqCst);
    let mut big = update_of(
        (0..40_000u32)
            .map(|i| pb::PrefixEntry {
                prefix_hash: format!("big-{i:08}").into_bytes(),
                token_count: 16,
                ..Default::default()
            })
            .collect(),
    );
    big.replica_id = "r".into();
    tx.send(big).await.unwrap();
    // The client sees the broken transport as an error status, never an Ack.
    let status = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call ends")
        .unwrap();
    assert!(status.is_err(), "no Ack after a cut: {status:?}");
    // Give the server time to notice; nothing of the partial message may appear.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(index.storage_entries(), 2);
    let mut c = server.client().await;
    for key in [&b"first"[..], b"second"] {
        let r = lookup(&mut c, exact(key, 128)).await;
        assert_eq!(
            r.reason_code, "PREFIX_MATCH",
            "{key:?} stays applied and visible"
        );
        assert_eq!(r.replica_scores[0].matched_tokens, 128);
    }
    assert_eq!(reason(&mut c, b"big-00000000", 16).await, "NO_HINT");
    server.shutdown().await;
}

#[tokio::test]
async fn sv55_cancelled_producer_stream_keeps_the_first_update() {
    let server = server_with_limits(Limits::default()).await;
    let mut producer = server.client().await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(legacy("r", b"first", 128)).await.unwrap();
    let index = server.state.index().clone();
    // The client gives up without half-closing: dropping the call resets the stream (CANCEL).
    let call = producer.report_cache_state(ReceiverStream::new(rx));
    let gave_up = tokio::time::timeout(Duration::from_millis(300), call).await;
    assert!(gave_up.is_err(), "no Ack without a half-close");
    drop(tx);
    assert!(eventually(Duration::from_secs(5), || index.storage_entries() == 1).await);
    let mut c = server.client().await;
    let r = lookup(&mut c, exact(b"first", 128)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    server.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// SIGTERM under load (server.md §14)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_completes_in_flight_rpcs_and_exits_0() {
    // One event per second per producer: the second PublishEvent is parked in the rate limiter,
    // i.e. in flight, when the signal arrives.
    let server = start_binary("sigterm", &["--producer-max-blocks-per-sec", "1"]);
    let ch = server.channel().await;
    let event = |hash: &[u8]| pb::CacheEvent {
        r#type: pb::cache_event::Type::PrefixEvicted as i32,
        replica_id: "r".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        prefix_hash: hash.to_vec(),
        ..Default::default()
    };
    let mut publisher = Client::new(ch.clone());
    publisher.publish_event(event(b"e1")).await.unwrap();
    let mut parked = Client::new(ch.clone());
    let in_flight_event = tokio::spawn(async move { parked.publish_event(event(b"e2")).await });
    // An open producer stream with one update applied.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut producer = Client::new(server.channel().await);
    let stream_call =
        tokio::spawn(async move { producer.report_cache_state(ReceiverStream::new(rx)).await });
    tx.send(legacy("r", b"before", 128)).await.unwrap();
    // Lookup load on four connections of their own until the server goes away.
    let stop = Arc::new(AtomicBool::new(false));
    let signalled = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..4 {
        let mut c = Client::new(server.channel().await);
        let stop = stop.clone();
        let signalled = signalled.clone();
        load.push(tokio::spawn(async move {
            let (mut ok, mut errors) = (0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match c.lookup_route(exact(b"before", 128)).await {
                    Ok(r) => {
                        assert!(!r.into_inner().reason_code.is_empty());
                        ok += 1;
                    }
                    Err(s) => {
                        // Whether the failure came after the signal is read before anything
                        // else can change it.
                        errors.push((s.code(), signalled.load(Ordering::SeqCst)));
                        break;
                    }
                }
            }
            (ok, errors)
        }));
    }
    // The second event is waiting for its budget (and nothing else waits).
    let waiting = Instant::now();
    loop {
        let http = std::net::SocketAddr::from(([127, 0, 0, 1], server.http));
        let (_, _, metrics) = common::http_request(http, "GET", "/metrics", "").await;
        let throttled = metric(&metrics, "inferencecache_producer_throttled_total");
        if throttled == Some(1.0) {
            break;
        }
        assert!(waiting.elapsed() < Duration::from_secs(5), "{metrics}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    signalled.store(true, Ordering::SeqCst);
    server.sigterm();
    let started = Instant::now();
    while !server.logs().contains("graceful_shutdown_started") {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{}",
            server.logs()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The open stream keeps working through the graceful stop and gets its Ack.
    tx.send(legacy("r", b"after", 128)).await.unwrap();
    drop(tx);
    let ack = tokio::time::timeout(Duration::from_secs(8), stream_call)
        .await
        .expect("stream completes")
        .unwrap()
        .expect("in-flight stream ends with OK")
        .into_inner();
    assert!(ack.accepted);
    let ack = tokio::time::timeout(Duration::from_secs(8), in_flight_event)
        .await
        .expect("event completes")
        .unwrap()
        .expect("in-flight PublishEvent ends with OK")
        .into_inner();
    assert!(ack.accepted);
    let (code, logs) = server.wait().await;
    stop.store(true, Ordering::Relaxed);
    assert_eq!(code, Some(0), "{logs}");
    assert!(logs.contains("graceful_shutdown_done"), "{logs}");
    let mut total_ok = 0;
    for task in load {
        let (ok, errors) = task.await.unwrap();
        total_ok += ok;
        // No lookup fails before the signal. After it, calls that race the listener and
        // connections closing fail at the transport (tonic reports those as Unavailable,
        // Cancelled or, for an h2 reset, Internal); none of them reached a handler.
        for (code, after_signal) in errors {
            assert!(after_signal, "a lookup failed before SIGTERM: {code:?}");
        }
    }
    assert!(total_ok > 0, "the load ran before the signal");
}

// ---------------------------------------------------------------------------------------------
// Wall-clock jumps (index.md §0 Time, L6, D7, V1)

#[tokio::test]
async fn wall_clock_jumps_clamp_freshness_and_never_panic() {
    let (state, clock) = manual_state(ServerOptions::default());
    plain_policy(&state);
    let server = TestServer::start_with(state).await;
    let mut c = server.client().await;
    let index = server.state.index().clone();
    report(&mut c, vec![legacy("r", b"k", 128)]).await;
    let prob = |r: &pb::LookupRouteResponse| r.replica_scores[0].estimated_cache_hit_prob;
    let r = lookup(&mut c, exact(b"k", 128)).await;
    assert_eq!((r.reason_code.as_str(), prob(&r)), ("PREFIX_MATCH", 1.0));

    // One hour back: the entry now lies in the future; L6 clamps its age to 0 (freshness 1).
    clock.set_us(T0_US - 3_600_000_000);
    let r = lookup(&mut c, exact(b"k", 128)).await;
    assert_eq!((r.reason_code.as_str(), prob(&r)), ("PREFIX_MATCH", 1.0));
    // Re-ingest at the earlier time: last_seen never moves backwards (D7)…
    report(&mut c, vec![legacy("r", b"k", 128)]).await;
    let seen = || {
        index
            .entry("t", "m", "vllm", "", b"k", "r")
            .expect("entry")
            .last_seen_us
    };
    assert_eq!(seen(), T0_US);
    // …and a sweep with the clock behind removes nothing.
    index.sweep_now();
    assert_eq!(index.storage_entries(), 1);

    // Forward to half the 30 min TTL: freshness 1 − 15/30.
    clock.set_us(T0_US + 15 * 60 * 1_000_000);
    let r = lookup(&mut c, exact(b"k", 128)).await;
    assert_eq!((r.reason_code.as_str(), prob(&r)), ("PREFIX_MATCH", 0.5));
    // Forward past the TTL: stale entries never match, and the sweep removes them.
    clock.set_us(T0_US + 30 * 60 * 1_000_000);
    let r = lookup(&mut c, exact(b"k", 128)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    index.sweep_now();
    assert_eq!(index.storage_entries(), 0);

    // Extreme clocks and timestamps: every RPC still answers, nothing panics.
    for now in [0, -1, i64::MIN, i64::MAX, T0_US] {
        clock.set_us(now);
        for ts in [0, -1, i64::MIN, i64::MAX] {
            let mut u = legacy("r", b"x", 128);
            u.timestamp_us = ts;
            u.stats = Some(pb::ReplicaStats {
                hit_rate: 0.5,
                ..Default::default()
            });
            report(&mut c, vec![u]).await;
            let ev = pb::CacheEvent {
                r#type: pb::cache_event::Type::ReplicaUpdated as i32,
                replica_id: "r".into(),
                model_id: "m".into(),
                tenant_id: "t".into(),
                timestamp_us: ts,
                ..Default::default()
            };
            assert!(c.publish_event(ev).await.unwrap().into_inner().accepted);
            let r = lookup(&mut c, exact(b"x", 128)).await;
            assert!(
                ["PREFIX_MATCH", "TENANT_HOT", "NO_HINT"].contains(&r.reason_code.as_str()),
                "now {now}, ts {ts}: {}",
                r.reason_code
            );
            for s in &r.replica_scores {
                assert!((0.0..=1.0).contains(&s.estimated_cache_hit_prob));
            }
            c.get_cache_state(pb::GetCacheStateRequest {
                tenant_id: "t".into(),
                model_id: "m".into(),
                ..Default::default()
            })
            .await
            .unwrap();
            index.sweep_now();
            let _ = inferencecache_server::http::json::snapshot_json(&index.snapshot());
        }
    }
    server.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Oversized messages (server.md §5, contract §5)

#[tokio::test]
async fn oversized_messages_are_resource_exhausted_and_the_server_is_unaffected() {
    let (server, mut c) = limited(Limits::default()).await;
    report(&mut c, vec![legacy("r", b"k", 128)]).await;
    // A 5 MiB lookup: refused by the transport before any handler runs.
    let mut huge = exact(b"k", 128);
    huge.prompt_text = "x".repeat(5 * MIB);
    let err = c.lookup_route(huge).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    // On a producer stream, an oversized message ends the stream; earlier ones stay applied.
    let five_mib = vec![7u8; 5 * MIB];
    let big = legacy("r", &five_mib, 16);
    let err = c
        .report_cache_state(tokio_stream::iter(vec![legacy("r", b"k2", 128), big]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert_eq!(server.state.index().storage_entries(), 2);
    // Just under 4 MiB still passes the transport (and the hash-length limit leaves it out).
    let almost_four_mib = vec![9u8; 4 * MIB - 1024];
    let under = legacy("r", &almost_four_mib, 16);
    report(&mut c, vec![under]).await;
    assert_eq!(server.state.index().storage_entries(), 2);
    assert_eq!(server.state.metrics().limits.get(Exceeded::HashBytes), 1);
    let r = lookup(&mut c, exact(b"k", 128)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    server.shutdown().await;

    // A configured smaller limit applies the same way.
    let (server, mut c) = limited(Limits {
        max_message_bytes: 64 * 1024,
        ..Limits::default()
    })
    .await;
    let mut req = exact(b"k", 128);
    req.prompt_text = "x".repeat(100 * 1024);
    assert_eq!(
        c.lookup_route(req).await.unwrap_err().code(),
        tonic::Code::ResourceExhausted
    );
    assert_eq!(reason(&mut c, b"k", 128).await, "NO_HINT");
    server.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// 10,000 connections opening and closing

fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on this process with a valid, initialised struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    lim.rlim_cur
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_connections_open_and_close() {
    const WAVES: usize = 5;
    const PER_WAVE: usize = 2_000;
    let limit = raise_fd_limit();
    assert!(
        limit >= 2 * PER_WAVE as u64 + 512,
        "RLIMIT_NOFILE hard limit {limit} is too low for this test"
    );
    // The child inherits the raised limit.
    let server = start_binary("conns", &[]);
    let mut c = Client::new(server.channel().await);
    let baseline = open_fds(&server);
    let port = server.grpc;
    for wave in 0..WAVES {
        let mut open = Vec::with_capacity(PER_WAVE);
        for i in 0..PER_WAVE {
            let mut s = TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap_or_else(|e| panic!("wave {wave}, connection {i}: {e}"));
            // Half speak the HTTP/2 preface and an empty SETTINGS frame, half say nothing.
            if i % 2 == 0 {
                s.write_all(
                    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
                )
                .await
                .unwrap();
            }
            open.push(s);
            // Pace the client to the server's accept loop (its descriptors show what it has
            // accepted) so a CPU-starved server never overflows the listen backlog, which would
            // turn into one-second SYN retransmits.
            if open.len() % 100 == 0 {
                let want = baseline + open.len() - 20;
                let paced = Instant::now();
                while open_fds(&server) < want && paced.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        }
        // With the whole wave open, the server still answers.
        let r = lookup(&mut c, exact(b"k", 128)).await;
        assert_eq!(r.reason_code, "NO_HINT", "wave {wave}");
        drop(open);
        // Every closed connection's descriptor is released.
        let start = Instant::now();
        let mut fds = open_fds(&server);
        while fds > baseline + 16 && start.elapsed() < Duration::from_secs(15) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            fds = open_fds(&server);
        }
        assert!(
            fds <= baseline + 16,
            "wave {wave}: server fds {fds}, baseline {baseline}"
        );
    }
    // New clients are served normally.
    let mut fresh = Client::new(server.channel().await);
    report(&mut fresh, vec![legacy("r", b"k", 128)]).await;
    let r = lookup(&mut fresh, exact(b"k", 128)).await;
    assert_eq!(r.replica_scores.len(), 1);
    server.sigterm();
    let (code, logs) = server.wait().await;
    assert_eq!(code, Some(0), "{logs}");
}

// ---------------------------------------------------------------------------------------------
// Clients exceeding each limit: the server stays within bounds and keeps what it stored

#[tokio::test]
async fn chain_length_limit_cuts_ingest_and_fails_lookups_open() {
    let (server, mut c) = limited(Limits {
        max_chain_length: 8,
        ..Limits::default()
    })
    .await;
    let long = chain_entry(1, 1_000, 8);
    report(&mut c, vec![update_of(vec![long.clone()])]).await;
    // Only the first 8 blocks are stored (one storage entry each).
    assert_eq!(server.state.index().storage_entries(), 8);
    let limits = &server.state.metrics().limits;
    assert_eq!(limits.get(Exceeded::ChainLength), 1);
    // A lookup within the limit matches the stored prefix in full.
    let mut head = long.clone();
    head.block_hashes.truncate(8);
    head.block_token_counts.truncate(8);
    let r = lookup(&mut c, chain_req(&head)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert_eq!(r.replica_scores[0].matched_tokens, 8 * 16);
    // A longer lookup chain fails open without an index call (like MaxLookupTokens).
    let r = lookup(&mut c, chain_req(&long)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    assert!(r.replica_scores.is_empty());
    assert_eq!(limits.get(Exceeded::LookupChainLength), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn hash_and_id_limits_leave_oversized_keys_out() {
    let (server, mut c) = limited(Limits::default()).await;
    let index = server.state.index().clone();
    report(&mut c, vec![legacy("r", b"kept", 128)]).await;
    let memory_before = index.memory_bytes();
    // 1 MiB "hashes", as a legacy key and inside a chain; a tenant id of 2 KiB.
    let mut bad_chain = chain_entry(2, 4, 8);
    bad_chain.block_hashes[2] = vec![3; MIB];
    let mut long_tenant = legacy("r", b"fine", 16);
    long_tenant.tenant_id = "t".repeat(2048);
    report(
        &mut c,
        vec![
            update_of(vec![
                pb::PrefixEntry {
                    prefix_hash: vec![4; MIB],
                    token_count: 16,
                    ..Default::default()
                },
                bad_chain,
            ]),
            long_tenant,
        ],
    )
    .await;
    assert_eq!(index.storage_entries(), 1, "nothing oversized was stored");
    assert!(
        index.memory_bytes() < memory_before + 64 * 1024,
        "index memory {} grew from {memory_before}",
        index.memory_bytes()
    );
    let limits = &server.state.metrics().limits;
    assert_eq!(limits.get(Exceeded::HashBytes), 2);
    assert_eq!(limits.get(Exceeded::IdBytes), 1);
    // A lookup for an over-long key is simply a miss.
    let one_mib = vec![4u8; MIB];
    assert_eq!(reason(&mut c, &one_mib, 16).await, "NO_HINT");
    assert_eq!(reason(&mut c, b"kept", 128).await, "PREFIX_MATCH");
    let text = inferencecache_server::metrics::render_text(&server.state.metrics().gather(&index));
    assert!(text.contains("inferencecache_limit_exceeded_total{limit=\"hash_bytes\"} 2\n"));
    assert!(text.contains("inferencecache_limit_exceeded_total{limit=\"id_bytes\"} 1\n"));
    server.shutdown().await;
}

#[tokio::test]
async fn prefixes_per_update_limit_applies_the_first_refs_and_the_stats() {
    let (server, mut c) = limited(Limits {
        max_prefixes_per_update: 4,
        ..Limits::default()
    })
    .await;
    let mut u = update_of(
        (0..10)
            .map(|i| pb::PrefixEntry {
                prefix_hash: format!("k{i}").into_bytes(),
                token_count: 128,
                ..Default::default()
            })
            .collect(),
    );
    u.stats = Some(pb::ReplicaStats {
        hit_rate: 0.5,
        cache_memory_bytes: 42,
        ..Default::default()
    });
    report(&mut c, vec![u]).await;
    assert_eq!(server.state.index().storage_entries(), 4);
    assert_eq!(
        server
            .state
            .metrics()
            .limits
            .get(Exceeded::PrefixesPerUpdate),
        6
    );
    assert_eq!(reason(&mut c, b"k3", 128).await, "PREFIX_MATCH");
    assert_ne!(reason(&mut c, b"k4", 128).await, "PREFIX_MATCH");
    let state = c
        .get_cache_state(pb::GetCacheStateRequest {
            tenant_id: "t".into(),
            model_id: "m".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        state.replicas.len(),
        1,
        "the update's stats are still stored"
    );
    assert_eq!(state.replicas[0].cache_memory_bytes, 42);
    server.shutdown().await;
}

#[tokio::test]
async fn producer_rate_limit_applies_backpressure_without_losing_updates() {
    const RATE: u64 = 200;
    let (server, mut c) = limited(Limits {
        producer_max_blocks_per_sec: RATE,
        ..Limits::default()
    })
    .await;
    // 500 one-block updates on one stream: the first second's budget (200) passes at once, the
    // other 300 wait for the bucket to refill, so the stream takes at least ~1.5 s.
    let updates: Vec<_> = (0..500)
        .map(|i| legacy("r", format!("k{i}").as_bytes(), 128))
        .collect();
    let started = Instant::now();
    report(&mut c, updates).await;
    let elapsed = started.elapsed();
    assert_eq!(
        server.state.index().storage_entries(),
        500,
        "every update applied: the limit delays, never drops"
    );
    assert!(
        elapsed >= Duration::from_millis(1_000),
        "300 blocks over the burst at 200/s cannot pass in {elapsed:?}"
    );
    // Waits are counted. How many depends on how fast this client could send (on a loaded
    // machine the bucket refills while it is slow), so only require some when the stream ran
    // near the limit's pace.
    let throttled = server.state.metrics().limits.throttled();
    assert!(
        throttled > 0 || elapsed >= Duration::from_millis(2_500),
        "a stream held back to the limit's pace counts its waits: {throttled} in {elapsed:?}"
    );
    // Another producer connection has its own (full) bucket: it does not wait.
    let mut other = Client::new(server.channel().await);
    report(&mut other, vec![legacy("r2", b"other", 128)]).await;
    assert_eq!(server.state.metrics().limits.throttled(), throttled);
    server.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Bad inputs of every class are accepted (producers) or fail open (consumers)

#[tokio::test]
async fn bad_inputs_are_acked_or_fail_open() {
    let (server, mut c) = limited(Limits::default()).await;
    let index = server.state.index().clone();
    // NaN/±Inf stats become 0 (S2); negative counts are stored as given (K10); an unknown tier
    // is kept and reported UNSPECIFIED (K6); empty keys and malformed chains are dropped (D8, K7).
    let mut stats = legacy("r", b"neg", -5);
    stats.prefixes[0].tier = 99;
    stats.prefixes.push(pb::PrefixEntry::default());
    stats.prefixes.push(pb::PrefixEntry {
        block_hashes: vec![b"a".to_vec(), Vec::new()],
        block_token_counts: vec![16, 16],
        ..Default::default()
    });
    stats.prefixes.push(pb::PrefixEntry {
        block_hashes: vec![b"b".to_vec(), b"c".to_vec()],
        block_token_counts: vec![16],
        ..Default::default()
    });
    stats.stats = Some(pb::ReplicaStats {
        hit_rate: f32::NAN,
        pressure: f32::INFINITY,
        cache_memory_bytes: -1,
        t2_hit_tokens: -7,
        ..Default::default()
    });
    report(&mut c, vec![stats]).await;
    assert_eq!(index.storage_entries(), 1);
    let view = index.entry("t", "m", "vllm", "", b"neg", "r").unwrap();
    assert_eq!(view.token_count, -5);
    let cs = c
        .get_cache_state(pb::GetCacheStateRequest {
            tenant_id: "t".into(),
            model_id: "m".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let r = &cs.replicas[0];
    assert_eq!((r.hit_rate, r.pressure), (0.0, 0.0));
    assert_eq!((r.cache_memory_bytes, r.t2_hit_tokens), (-1, -7));
    // Unknown event types are acked and counted as TYPE_UNSPECIFIED (E6, §8.3).
    let ack = c
        .publish_event(pb::CacheEvent {
            r#type: 77,
            tenant_id: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ack.accepted);
    let text = inferencecache_server::metrics::render_text(&server.state.metrics().gather(&index));
    assert!(text.contains("inferencecache_events_total{type=\"TYPE_UNSPECIFIED\"} 1\n"));
    // Consumer RPCs answer OK whatever the content.
    let garbage = [
        pb::LookupRouteRequest::default(),
        pb::LookupRouteRequest {
            tenant_id: "t".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            prefix_hash: b"neg".to_vec(),
            prefix_token_count: -1,
            slo: Some(pb::Slo {
                ttft_ms: -5,
                tbt_ms: i32::MIN,
            }),
            block_hashes: vec![Vec::new(); 3],
            block_token_counts: vec![i32::MIN, i32::MAX, -1],
            token_ids: vec![u32::MAX; 40],
            prompt_text: "\0\u{fffd}".into(),
            adapter_id: "\u{1F600}".into(),
        },
        pb::LookupRouteRequest {
            tenant_id: "t".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            block_token_counts: vec![16],
            ..Default::default()
        },
    ];
    for req in garbage {
        let r = lookup(&mut c, req).await;
        assert!(!r.reason_code.is_empty());
    }
    // An unknown type in a stream filter matches nothing; the stream stays open.
    let mut events = c
        .stream_cache_events(pb::StreamEventsRequest {
            types: vec![42],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    report(&mut c, vec![legacy("r", b"new", 128)]).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(200), events.message())
            .await
            .is_err(),
        "nothing matches an unknown type"
    );
    drop(events);
    server.shutdown().await;
}

/// Raw bytes as a gRPC message: lets the test send protobuf the server cannot decode.
#[derive(Clone, Default)]
struct RawCodec;

struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> Self::Encoder {
        RawEncoder
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

#[tokio::test]
async fn undecodable_protobuf_is_internal_and_the_server_is_unaffected() {
    let server = server_with_limits(Limits::default()).await;
    let mut grpc = tonic::client::Grpc::new(server.channel().await);
    grpc.ready().await.unwrap();
    // Field 1 (model_id) as a length-delimited value claiming 100 bytes of a 2-byte buffer.
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/inferencecache.v1alpha1.InferenceCache/LookupRoute",
    );
    let err = grpc
        .unary::<Vec<u8>, Vec<u8>, _>(
            tonic::Request::new(vec![0x0a, 100, b'm', b'x']),
            path,
            RawCodec,
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal);
    let mut c = server.client().await;
    assert_eq!(reason(&mut c, b"k", 128).await, "NO_HINT");
    server.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// A stalled StreamCacheEvents subscriber (D5, §8.5)

#[tokio::test]
async fn stalled_subscriber_never_blocks_ingest_and_every_event_is_delivered_or_counted() {
    let (state, _clock) = manual_state(ServerOptions {
        stream_buffer_events: 4,
        ..Default::default()
    });
    let server = TestServer::start_with(state).await;
    let mut c = server.client().await;
    let mut stalled = c
        .stream_cache_events(pb::StreamEventsRequest::default())
        .await
        .unwrap()
        .into_inner();
    // 2,000 new keys while the subscriber reads nothing: publishing never waits, so the ingest
    // completes and every key is stored.
    let updates: Vec<_> = (0..2_000)
        .map(|i| legacy("r", format!("k{i}").as_bytes(), 128))
        .collect();
    tokio::time::timeout(Duration::from_secs(20), report(&mut c, updates))
        .await
        .expect("ingest never waits for a subscriber");
    assert_eq!(server.state.index().storage_entries(), 2_000);
    let dropped = server
        .state
        .metrics()
        .stream_events_dropped
        .load(Ordering::Relaxed);
    assert!(dropped > 0, "a 4-event buffer cannot hold 2,000 events");
    // Once it reads again, what was queued arrives, then new events flow.
    report(&mut c, vec![legacy("r", b"marker", 128)]).await;
    let mut delivered = 0u64;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), stalled.message())
            .await
            .expect("events flow again")
            .expect("stream ok")
            .expect("stream open");
        assert_eq!(ev.r#type, pb::cache_event::Type::PrefixAdded as i32);
        if ev.prefix_hash == b"marker" {
            break;
        }
        delivered += 1;
    }
    assert_eq!(
        delivered + dropped,
        2_000,
        "every change is either delivered or counted as dropped"
    );
    server.shutdown().await;
}

#[test]
fn invalid_limit_values_are_startup_errors() {
    for args in [
        &["--max-message-bytes", "0"][..],
        &["--max-chain-length", "-1"],
        &["--producer-max-blocks-per-sec", "many"],
    ] {
        let out = Command::new(SERVER_BIN).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}
